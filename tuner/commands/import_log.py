"""``ctx-tuner import-log LOGFILE --model M --device D [options]``: store a vLLM start-up log an
operator already has as a measured run (``method='import'``), and its calibration residual.

Exit codes: 0 stored (or already stored); 1 database or worker failure; 2 unreadable log, no
memory lines, or an invalid/missing setting (the message names the file and the field).
"""

from __future__ import annotations

from tuner.commands import timeout_seconds

import argparse
import json
import sys

from tuner.errors import DeviceError, DropError, EraError, LogParseError, ModelConfigError, TunerError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
NAME = "import-log"
GiB = 1 << 30


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, not {text!r}")


def _length(text: str) -> int:
    """An integer or vLLM's human-readable form (``32k`` = 32000, ``32K`` = 32768)."""
    from tuner.memory.serve_args import human_readable_int

    try:
        return human_readable_int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("import-log", help="store a vLLM start-up log as a measured run (and calibrate from it)",
                       description="Parse a vLLM start-up log (any release: V0 '# GPU blocks', V1 'Available KV "
                                   "cache memory', 'GPU KV cache size', 'Maximum concurrency', 'Model loading "
                                   "took', the max-seq-len errors) and store it as a measured run. Settings the "
                                   "log does not print come from these options, else the release's defaults.")
    p.add_argument("log", help="the vLLM log file")
    p.add_argument("--model", required=True, help="HF id or local path of the model (its config.json is read offline)")
    p.add_argument("--models-dir", default=None, help="directory of <org>--<name>/config.json per HF id")
    from tuner.commands.check import _one_device

    p.add_argument("--device", required=True, type=_one_device,
                   help="GPU: catalog name/alias as NVML or vLLM print it, 'auto' (GPU 0 of this host), or NAME:GIB "
                        "(optionally :nvswitch / :nvlink / :pcie / :xgmi); a total the log prints picks among a "
                        "name's cards and sizes a card the catalog lacks")
    p.add_argument("--engine-version", default=None, help="vLLM version (default: what the log prints)")
    p.add_argument("--engine", choices=("V0", "V1"), default=None, help="engine (default: what the log shows)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--max-model-len", type=_length, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=None)
    p.add_argument("--pipeline-parallel-size", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-cache-dtype", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=_length, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--enable-chunked-prefill", type=_bool, default=None, metavar="true|false")
    p.add_argument("--enforce-eager", type=_bool, default=None, metavar="true|false")
    p.add_argument("--entry-point", choices=("serve", "offline"), default=None)
    p.add_argument("--no-predict", action="store_true",
                   help="do not run simulate on the same settings (no calibration residual is stored)")
    p.add_argument("--force", action="store_true", help="store again even if this log was imported before")
    p.add_argument("--db", default=None, help="SQLAlchemy URL or SQLite path (default var/ctx-tuner.sqlite)")
    p.add_argument("--json", action="store_true", help="print the stored run as JSON")
    p.add_argument("--timeout", type=timeout_seconds, default=600.0, help="prediction worker time limit, seconds")
    return p


def _options(args) -> dict:
    from tuner.accuracy.importlog import OPTION_KEYS

    return {k: getattr(args, k) for k in OPTION_KEYS if getattr(args, k, None) is not None}


def _gib(v) -> str:
    return "-" if v is None else f"{v / GiB:.2f} GiB"


def run(args) -> int:
    from tuner.accuracy.importlog import import_log
    from tuner.logs.logparse import parse_file
    from tuner.store.database import open_store

    try:
        parsed = parse_file(args.log)
    except LogParseError as exc:
        print(f"ctx-tuner: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        store = open_store(args.db)
    except TunerError as exc:
        print(f"ctx-tuner: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        out = import_log(args.log, model=args.model, device=args.device, store=store,
                         engine_version=args.engine_version, engine=args.engine, options=_options(args),
                         models_dir=args.models_dir, predict=not args.no_predict, timeout_s=args.timeout,
                         force=args.force, parsed=parsed)
    except (LogParseError, DropError, DeviceError, EraError, ModelConfigError) as exc:
        print(f"ctx-tuner: invalid import: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TunerError as exc:
        print(f"ctx-tuner: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        store.close()
    run_row = {k: v for k, v in out.run.items() if k != "key"}
    if args.json:
        print(json.dumps({"drop_id": out.drop_id, "already_imported": out.already, "run": run_row,
                          "predicted": out.predicted, "calibration": out.calibration, "warnings": out.warnings,
                          "release": out.release},
                         indent=2, default=str))
        return EXIT_OK
    from tuner.store.records import StoredRun

    r = run_row
    run = StoredRun.from_row(run_row)
    head = "already imported as" if out.already else "stored as"
    print(f"{args.log}: {head} drop id {out.drop_id} ({run.era}, {run.device_name}, "
          f"TP {run.tensor_parallel_size} PP {run.pipeline_parallel_size}, gmu {run.gpu_memory_utilization}, "
          f"max_model_len {run.max_model_len})")
    if out.release is not None:
        lo, hi = out.release["release_range"]
        print(f"  vLLM release assumed: {out.release['release']} (the log prints none; consistent: "
              f"{lo if lo == hi else lo + ' – ' + hi}, {len(out.release['release_candidates'])} release(s))")
    print(f"  weights {_gib(r['weights_bytes'])}, activation peak {_gib(r['activation_peak_bytes'])}, "
          f"non-torch {_gib(r['non_torch_bytes'])}, CUDA graphs {_gib(r['cuda_graph_bytes'])}")
    print(f"  available KV {_gib(r['available_kv_cache_bytes'])}, blocks {r['num_gpu_blocks'] or '-'}, "
          f"KV tokens {r['kv_cache_tokens'] or '-'}, concurrency {r['max_concurrency'] or '-'}")
    if r["error_message"]:
        print(f"  engine refused: {r['error_message']}")
    if out.predicted is not None:
        p = out.predicted
        print(f"  simulate for the same settings: available KV {_gib(p['available_kv_cache_bytes'])}, "
              f"blocks {p['num_gpu_blocks']}")
    if out.calibration is not None:
        c = out.calibration
        if c["usable"]:
            print("  residual (measured - predicted): activation "
                  f"{_gib(c['activation_peak_delta_bytes'])}, non-torch {_gib(c['non_torch_delta_bytes'])}, "
                  f"graphs {_gib(c['cuda_graph_delta_bytes'])}")
        else:
            print(f"  not used for calibration: {c['note']}")
    for w in out.warnings:
        print(f"  warning: {w}")
    return EXIT_OK

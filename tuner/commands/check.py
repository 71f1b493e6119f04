"""``ctx-tuner check [--config vllm.yaml] [--device D] [--engine-version V] [--json] -- vllm serve MODEL …``
or ``ctx-tuner check [--deploy-files] DEPLOY.yaml …``: will this vLLM start? Exit codes: 0 starts,
3 does not start, 4 uncertain (the verdict flips inside the
prediction's interval: it starts at one end and not at the other; docs/uncertainty.md), 2 invalid input (a flag vLLM would reject or ctx-tuner cannot model, an invalid
setting, unknown model, an unreadable deploy file), 1 the job failed. Several workloads (deploy
files): the worst, 3 before 2 before 1 before 0 (:mod:`tuner.deploy.verdicts`)."""

from __future__ import annotations

import argparse
from typing import Any
import json
import sys

from tuner.commands import timeout_seconds

NAME = "check"


def _device(text: str):
    """``--device``: one card, or a comma-separated list of cards, one per pipeline stage (the drop's
    device list: ``'RTX 5070 Ti,RTX 5090 D'`` with ``-pp 2``); each as :func:`_one_device`."""
    if "," in text:
        items = [t.strip() for t in text.split(",")]
        if any(not t for t in items):
            raise argparse.ArgumentTypeError(f"an empty entry in the device list {text!r}")
        if any(t.lower() == "auto" for t in items):
            raise argparse.ArgumentTypeError("'auto' reads GPU 0 only: in a device list name each stage's card")
        return [_one_device(t) for t in items]
    return _one_device(text)


def _one_device(text: str):
    """One card: a catalog name/alias, ``auto``, ``NAME:GIB`` (a total in GiB), and either may end
    in ``:INTERCONNECT`` (``nvswitch``, ``nvlink``, ``pcie``, ``xgmi``; ``pcie`` may be followed by
    ``:p2p`` or ``:no-p2p``): ``'My card:24:pcie'``, ``'A100-80GB:pcie'`` (a catalog card on another board)."""
    from tuner.memory.devices import INTERCONNECTS

    parts = text.split(":")
    p2p = None
    if len(parts) > 1 and parts[-1].strip().lower() in ("p2p", "no-p2p", "nop2p"):
        p2p = parts.pop().strip().lower() == "p2p"
    ic = None
    if len(parts) > 1 and parts[-1].strip().lower() in INTERCONNECTS:
        ic = parts.pop().strip().lower()
    elif p2p is not None:
        raise argparse.ArgumentTypeError(f"':p2p' / ':no-p2p' follows an interconnect (NAME:GIB:pcie:p2p): {text!r}")
    out: dict = {}
    if len(parts) > 1:
        name, gib = ":".join(parts[:-1]), parts[-1]
        try:
            out = {"name": name, "total_memory_gib": float(gib)}
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not NAME:GIB[:INTERCONNECT]: {text!r} (INTERCONNECT one of {', '.join(INTERCONNECTS)})") from None
    elif ic is None:
        return text
    else:
        out = {"name": parts[0]}
    if ic is not None:
        out["interconnect"] = ic
    if p2p is not None:
        out["p2p"] = p2p
    return out


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("check", help="will this `vllm serve` line or config start? (exit 0 starts, 3 does not, 4 uncertain)",
                       description="Check a `vllm serve` command line (after --) and/or a `vllm serve --config` "
                                   "YAML before deploying it.")
    p.add_argument("serve", nargs=argparse.REMAINDER,
                   help="the vLLM command line after --: vllm serve MODEL [options] (or serve MODEL …), optionally after "
                        "an environment prefix (CUDA_VISIBLE_DEVICES=0 VLLM_X=1 vllm serve …)")
    p.add_argument("--config", dest="config_file", default=None, metavar="VLLM_YAML",
                   help="the YAML file `vllm serve --config` reads (the command line wins over it, as in vLLM); "
                        "a deploy file (Kubernetes, Helm values, compose, KServe, llm-d) is checked as one")
    p.add_argument("--deploy-files", action="store_true",
                   help="the positional arguments are deploy files (Kubernetes manifests, helm template output, "
                        "production-stack or llm-d Helm values, KServe resources, docker compose files, vLLM "
                        "--config YAML): every vLLM container in them is checked; exit = the worst "
                        "(docs/deploy-files.md). Without --, existing *.yaml/*.yml files are read so anyway")
    p.add_argument("--skip-non-vllm", action="store_true",
                   help="with deploy files (hooks on every changed YAML): skip files that are not a deploy format "
                        "or run no vLLM container instead of exit 2 (they are listed)")
    p.add_argument("--models-dir", default=None, metavar="DIR",
                   help="directory of <org>--<name>/config.json per HF id (as validate and import-log read)")
    p.add_argument("--device", type=_device, default=None,
                   help="GPU: catalog name (H100-80GB), auto (GPU 0 via NVML; default), or NAME:GIB; either may end "
                        "in :nvswitch, :nvlink, :pcie or :xgmi (how the TP group's cards connect; a card the catalog "
                        "lacks is taken as PCIe without P2P); a comma-separated list names one card per pipeline "
                        "stage (-pp)")
    p.add_argument("--engine-version", default=None,
                   help="vLLM release whose rules apply (default: the installed vllm's version, else the newest "
                        "modelled release 0.34.0; a newer release is answered with 0.34's rules and a warning; a pre-release "
                        "such as 0.26.0rc1 with its release's rules and a note)")
    p.add_argument("--strict-release", action="store_true",
                   help="refuse an --engine-version newer than the newest modelled release (exit 2)")
    p.add_argument("--other-processes-memory-gib", type=float, default=None, metavar="GIB",
                   help="GPU memory other processes hold when vLLM starts (co-tenants; the drop field "
                        "other_processes_memory_gib; on a unified-memory device such as GB10 the host RAM in use): "
                        "the total minus the free memory vLLM prints at start; default: none, or with --device auto "
                        "what NVML (on GB10 the host's MemAvailable) reports in use")
    p.add_argument("--compile-cache", choices=("cold", "warm"), default=None,
                   help="the torch.compile cache vLLM starts with (the drop field compile_cache): cold (first boot: "
                        "Inductor compiles in the profile run; its extra peak is not modelled and widens the "
                        "interval) or warm; default: not stated, answered as modelled")
    p.add_argument("--flashinfer-installed", choices=("true", "false"), default=None,
                   help="whether FlashInfer is installed beside vLLM (the drop field flashinfer_installed; before "
                        "0.11.1 it picks the profile run's sampler): true where it is installed, as in the "
                        "vllm/vllm-openai image; default: not stated, answered as pip installs vLLM (false) "
                        "with the other value's effect as a band")
    p.add_argument("--triton-kernels-installed", choices=("true", "false"), default=None,
                   help="whether triton_kernels is installed beside vLLM 0.10.2 - 0.11.x (the drop field "
                        "triton_kernels_installed; MXFP4 experts on Hopper run Triton with it, Marlin without); "
                        "default: not stated, answered as pip installs vLLM (false) with the other value's "
                        "effect as a band")
    p.add_argument("--allow-unmodelled", action="store_true",
                   help="check even when the line has flags ctx-tuner does not model (they are listed)")
    p.add_argument("--no-variants", action="store_true",
                   help="do not search the nearest settings that start (fp8 KV cache, more GPUs)")
    p.add_argument("--parser", choices=("auto", "vllm", "built-in"), default="auto",
                   help="who parses the line: auto (default: the installed vLLM's own parser when vLLM is importable "
                        "in the worker Python, else ctx-tuner's built-in one), vllm (vLLM's or exit 2), built-in")
    p.add_argument("--worker-python", metavar="PATH", default=None,
                   help="Python with vLLM (the engine adapter's interpreter) for the parser and the worker job; "
                        "default: the settings' engine_pythons/worker_python (--settings), $CTX_TUNER_WORKER_PYTHON, "
                        "else this interpreter")
    p.add_argument("--settings", default=None, metavar="FILE",
                   help="daemon settings whose engine_pythons (by --engine-version) / worker_python choose the "
                        "worker Python")
    p.add_argument("--risk", choices=("safe", "expected"), default="safe",
                   help="safe (default): exit 4 'uncertain' when the line starts at one end of the interval and not "
                        "at the other; expected: answer 0/3 by the expected value (the interval is still named)")
    p.add_argument("--cross-check", action="store_true",
                   help="with vLLM installed: run the engine cross-check of the model now where none is stored for "
                        "this vLLM build (it is then stored in the default store, var/ctx-tuner.sqlite, and used "
                        "without importing vLLM); without it a stored one is used and a missing one is said "
                        "(docs/reliability.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=timeout_seconds, default=600.0, help="worker time limit in seconds")
    return p


def run(args) -> int:
    from tuner.reports.check import EXIT_FAILED, EXIT_INVALID, CheckInputError, render, run_check
    from tuner.errors import DeviceError, DropError, EraError, ModelConfigError, TunerError
    from tuner.memory.serve_args import ServeArgsError

    argv = list(args.serve or [])
    dashed = bool(argv) and argv[0] == "--"
    if dashed:
        argv = argv[1:]
    else:
        argv = _options_after_files(args, argv)
    deploy = _deploy_files(args, argv, dashed)
    if isinstance(deploy, int):
        return deploy
    if deploy:
        return _run_deploy(args, deploy)
    if not argv and not args.config_file:
        print("ctx-tuner check: give the vllm command line after -- (ctx-tuner check -- vllm serve MODEL …) "
              "or --config vllm.yaml", file=sys.stderr)
        return EXIT_INVALID
    python_kw = _worker_python(args)
    if isinstance(python_kw, int):
        return python_kw
    python, kw = python_kw
    from tuner.engine.serve_parser import VllmParserUnavailable, make_parser

    try:
        res = run_check(argv, config_file=args.config_file, device=args.device, engine_version=args.engine_version,
                        timeout_s=args.timeout, variants=not args.no_variants, allow_unmodelled=args.allow_unmodelled,
                        other_processes_memory_gib=args.other_processes_memory_gib,
                        compile_cache=args.compile_cache, installed=_installed(args),
                        parser=make_parser(args.parser, python), models_dir=args.models_dir,
                        strict_release=args.strict_release, risk=getattr(args, "risk", "safe"),
                        cross_check=bool(getattr(args, "cross_check", False)), **kw)
    except VllmParserUnavailable as exc:
        _fail(args, "invalid input", exc)
        return EXIT_INVALID
    except (ServeArgsError, CheckInputError) as exc:
        _fail(args, "invalid input", exc)
        _device_form_hint(exc)
        return EXIT_INVALID
    except (DropError, DeviceError, EraError, ModelConfigError) as exc:
        _fail(args, "invalid input", exc)
        if isinstance(exc, DeviceError) and args.device in (None, "auto"):  # the default, auto, found no GPU here
            print("ctx-tuner check: without --device the GPU is read from this host (auto); name it where there "
                  "is none: --device H100-80GB (a catalog name) or --device NAME:GIB", file=sys.stderr)
        _device_form_hint(exc)
        return EXIT_INVALID
    except TunerError as exc:
        _fail(args, type(exc).__name__, exc)
        return EXIT_FAILED
    if args.json:
        print(json.dumps({**res.doc, "exit_code": res.exit_code}, indent=2))
    else:
        print(render(res))
    return res.exit_code


def _installed(args) -> dict:
    """The packages beside vLLM the options state (the drop fields ``flashinfer_installed``,
    ``triton_kernels_installed``); absent ones stay assumed."""
    out = {}
    for name in ("flashinfer_installed", "triton_kernels_installed"):
        value = getattr(args, name, None)
        if value is not None:
            out[name] = value == "true"
    return out


def _worker_python(args) -> tuple[Any, dict] | int:
    """The worker Python (``--worker-python`` / ``--settings``) and the ``run_check`` keyword that
    runs jobs in it, or exit 2 for an invalid choice (printed)."""
    from tuner.reports.check import EXIT_INVALID
    from tuner.errors import TunerError

    try:
        python = _python(args)
    except TunerError as exc:
        _fail(args, "invalid input", exc)
        return EXIT_INVALID
    kw: dict = {}
    if python is not None:
        import functools

        from tuner.seam.worker import run_in_worker

        kw["worker"] = functools.partial(run_in_worker, python=python)
    return python, kw


def _options_after_files(args, argv: list[str]) -> list[str]:
    """``check FILE … [--device D] …``: options after deploy files are check's own (the synopsis of
    docs/deploy-files.md), not a serve line's. argparse's remainder took them with the files; they are
    parsed into ``args`` here and the files returned. A serve line (``vllm serve …``) is left as is."""
    import os

    files = []
    for a in argv:
        if a.startswith("-"):
            break
        files.append(a)
    rest = argv[len(files):]
    deploy_like = files and (args.deploy_files or all(
        f.lower().endswith((".yaml", ".yml")) and os.path.isfile(f) for f in files))
    if not rest or not deploy_like:
        return argv
    parser = argparse.ArgumentParser(prog="ctx-tuner")
    add_parser(parser.add_subparsers(dest="command")).parse_args(rest, namespace=args)
    more = [a for a in (args.serve or []) if a != "--"]
    return files + _options_after_files(args, more) if more else files


def _deploy_files(args, argv: list[str], dashed: bool) -> list[str] | int:
    """The deploy files to check: the positional arguments with ``--deploy-files`` (or, without
    ``--``, when they are existing ``.yaml``/``.yml`` files), or a ``--config`` file that is a
    deploy file; [] for a serve line; an exit code for a conflict."""
    import os

    from tuner.reports.check import EXIT_INVALID
    from tuner.deploy import is_deploy_file

    if args.deploy_files:
        if args.config_file:
            print("ctx-tuner check: --deploy-files reads the files given; --config is for a serve line",
                  file=sys.stderr)
            return EXIT_INVALID
        if not argv:
            print("ctx-tuner check: --deploy-files needs at least one file", file=sys.stderr)
            return EXIT_INVALID
        return argv
    if argv and not dashed and all(a.lower().endswith((".yaml", ".yml")) and os.path.isfile(a) for a in argv):
        return argv
    missing = _missing_deploy_files(argv) if not dashed else []
    if missing:  # check /tmp/dep/missing.yaml: a mistyped deploy file, not a model
        print(f"ctx-tuner check: invalid input: no such deploy file: {', '.join(missing)}", file=sys.stderr)
        if args.json:
            print(json.dumps({"verdict": "invalid input", "error": f"no such deploy file: {', '.join(missing)}",
                              "error_type": "DeployFileError", "exit_code": EXIT_INVALID}))
        return EXIT_INVALID
    if args.config_file and os.path.isfile(args.config_file) and is_deploy_file(args.config_file):
        if argv:
            print(f"ctx-tuner check: invalid input: {args.config_file}: a deploy file, not a `vllm serve --config` "
                  "YAML: it names its own vLLM command; check it without a serve line (ctx-tuner check "
                  f"{args.config_file})", file=sys.stderr)
            if args.json:
                print(json.dumps({"verdict": "invalid input", "error": f"{args.config_file}: a deploy file given "
                                  "with a serve line", "error_type": "CheckInputError", "exit_code": EXIT_INVALID}))
            return EXIT_INVALID
        return [args.config_file]
    return []


def _missing_deploy_files(argv: list[str]) -> list[str]:
    """The ``*.yaml``/``*.yml``/``*.json`` paths that do not exist, where every leading positional
    argument is such a path (``check FILE … [--device D]`` without ``--``); [] otherwise (a serve line)."""
    import os

    files = []
    for a in argv:
        if a.startswith("-"):
            break
        files.append(a)
    if not files or not all(a.lower().endswith((".yaml", ".yml", ".json")) for a in files):
        return []
    return [a for a in files if not os.path.exists(a)]


def _run_deploy(args, files: list[str]) -> int:
    """Check every vLLM workload of the deploy files; print each; exit = the worst."""
    from tuner.reports.check import EXIT_INVALID
    from tuner.deploy.verdicts import check_files, render
    from tuner.errors import TunerError
    from tuner.engine.serve_parser import make_parser

    python_kw = _worker_python(args)
    if isinstance(python_kw, int):
        return python_kw
    python, kw = python_kw
    skipped: list = []
    verdicts, code = check_files(files, device=args.device, engine_version=args.engine_version,
                                 skip_non_vllm=args.skip_non_vllm, skipped=skipped,
                                 timeout_s=args.timeout, variants=not args.no_variants,
                                 allow_unmodelled=args.allow_unmodelled, parser=make_parser(args.parser, python),
                                 models_dir=args.models_dir,
                                 other_processes_memory_gib=args.other_processes_memory_gib,
                                 compile_cache=args.compile_cache, installed=_installed(args), **kw)
    if args.json:
        print(json.dumps({"files": list(files), "workloads": [v.to_dict() for v in verdicts],
                          "skipped": [{"file": f, "why": why} for f, why in skipped], "exit_code": code},
                         indent=2, default=str))
    else:
        for f, why in skipped:
            print(f"skipped {f}: {why}")
        if verdicts:
            print(render(verdicts))
        elif skipped:
            print(f"no vLLM workload in {len(skipped)} file(s); exit {code}")
    return code


def _python(args) -> str | None:
    """The worker Python: ``--worker-python``, else the settings' ``engine_pythons`` entry for
    ``--engine-version`` / ``worker_python`` (``--settings``), else None (the environment's or this one).

    Raises:
        TunerError: not an executable; SettingsError: unreadable settings.
    """
    import os
    import shutil

    from tuner.errors import TunerError

    wp, where = args.worker_python, "--worker-python"
    if wp is None and args.settings:
        from tuner.daemon.settings import load_settings

        wp, where = load_settings(args.settings).python_for(args.engine_version), args.settings
    if wp is None:
        return None
    path = os.path.expanduser(wp)
    if not ((os.sep in path and os.path.isfile(path) and os.access(path, os.X_OK))
            or (os.sep not in path and shutil.which(path))):
        raise TunerError(f"{wp}: not an executable Python", where=where)
    return path


def _fail(args, kind: str, exc: Exception) -> None:
    print(f"ctx-tuner check: {kind}: {exc}", file=sys.stderr)
    if args.json:
        print(json.dumps({"verdict": "invalid input" if kind == "invalid input" else "failed", "error": str(exc),
                          "error_type": type(exc).__name__}))


def _device_form_hint(exc: Exception) -> None:
    """A device error's advice is a drop's mapping form; on check's command line it is NAME:GIB."""
    text = getattr(exc, "message", None) or str(exc)
    if "total_memory_gib: ...}" in text and "did you mean" not in text:  # a near miss is named already
        print("ctx-tuner check: on the command line a card with its total is --device NAME:GIB "
              "(e.g. --device 'H100 40GB:39.5'), not a {name, total_memory_gib} mapping", file=sys.stderr)

"""``ctx-tuner check [--config vllm.yaml] [--device D] [--engine-version V] [--json] -- vllm serve MODEL …``:
will this vLLM start? Exit codes: 0 starts, 3 does not start, 2 invalid input (a flag vLLM would
reject or ctx-tuner cannot model, an invalid setting, unknown model), 1 the job failed."""

from __future__ import annotations

import argparse
import json
import sys

from tuner.commands import timeout_seconds

NAME = "check"


def _device(text: str):
    """``--device``: a catalog name/alias, ``auto``, or ``NAME:GIB`` (a total in GiB)."""
    if ":" in text:
        name, _, gib = text.rpartition(":")
        try:
            return {"name": name, "total_memory_gib": float(gib)}
        except ValueError:
            raise argparse.ArgumentTypeError(f"not NAME:GIB: {text!r}") from None
    return text


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("check", help="will this `vllm serve` line or config start? (exit 0 starts, 3 does not)",
                       description="Check a `vllm serve` command line (after --) and/or a `vllm serve --config` "
                                   "YAML before deploying it.")
    p.add_argument("serve", nargs=argparse.REMAINDER,
                   help="the vLLM command line after --: vllm serve MODEL [options] (or serve MODEL …)")
    p.add_argument("--config", dest="config_file", default=None, metavar="VLLM_YAML",
                   help="the YAML file `vllm serve --config` reads (the command line wins over it, as in vLLM)")
    p.add_argument("--device", type=_device, default=None,
                   help="GPU: catalog name (H100-80GB), auto (GPU 0 via NVML; default), or NAME:GIB")
    p.add_argument("--engine-version", default=None,
                   help="vLLM release whose rules apply (default: the installed vllm's version, else 0.19.0)")
    p.add_argument("--other-processes-memory-gib", type=float, default=None, metavar="GIB",
                   help="GPU memory other processes hold when vLLM starts (co-tenants; the drop field "
                        "other_processes_memory_gib); default: none, or with --device auto what NVML reports in use")
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
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=timeout_seconds, default=600.0, help="worker time limit in seconds")
    return p


def run(args) -> int:
    from tuner.check import EXIT_FAILED, EXIT_INVALID, CheckInputError, render, run_check
    from tuner.errors import DeviceError, DropError, EraError, ModelConfigError, TunerError
    from tuner.serve_args import ServeArgsError

    argv = list(args.serve or [])
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv and not args.config_file:
        print("ctx-tuner check: give the vllm command line after -- (ctx-tuner check -- vllm serve MODEL …) "
              "or --config vllm.yaml", file=sys.stderr)
        return EXIT_INVALID
    try:
        python = _python(args)
    except TunerError as exc:
        _fail(args, "invalid input", exc)
        return EXIT_INVALID
    from tuner.vllm_serve_parser import VllmParserUnavailable, make_parser

    kw = {}
    if python is not None:
        import functools

        from tuner.worker import run_in_worker

        kw["worker"] = functools.partial(run_in_worker, python=python)
    try:
        res = run_check(argv, config_file=args.config_file, device=args.device, engine_version=args.engine_version,
                        timeout_s=args.timeout, variants=not args.no_variants, allow_unmodelled=args.allow_unmodelled,
                        other_processes_memory_gib=args.other_processes_memory_gib,
                        parser=make_parser(args.parser, python), **kw)
    except VllmParserUnavailable as exc:
        _fail(args, "invalid input", exc)
        return EXIT_INVALID
    except (ServeArgsError, CheckInputError) as exc:
        _fail(args, "invalid input", exc)
        _device_form_hint(exc)
        return EXIT_INVALID
    except (DropError, DeviceError, EraError, ModelConfigError) as exc:
        _fail(args, "invalid input", exc)
        if isinstance(exc, DeviceError) and args.device is None:  # the default, auto, found no GPU here
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
        from tuner.settings import load_settings

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
    if "total_memory_gib: ...}" in (getattr(exc, "message", None) or str(exc)):
        print("ctx-tuner check: on the command line a card with its total is --device NAME:GIB "
              "(e.g. --device 'H100 40GB:39.5'), not a {name, total_memory_gib} mapping", file=sys.stderr)

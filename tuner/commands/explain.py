"""``ctx-tuner explain DROP.yaml [--gpu-memory-utilization U] [--max-model-len M]`` or
``ctx-tuner explain --run ID``: the KV-cache budget step by step, and what would make a point start.
Exit codes as ``check``'s: 0 every point explained starts, 3 one does not start (vLLM would refuse it),
1 job or database failed, 2 invalid drop, model config, option or run id."""

from __future__ import annotations

from tuner.commands import job_error_exit, timeout_seconds

import argparse
import json
import sys

from tuner.errors import TunerError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DOES_NOT_START, EXIT_UNCERTAIN = 0, 1, 2, 3, 4
NAME = "explain"


def _gmu(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], not {text}")
    return value


def _mml(text: str) -> int:
    """A length: an integer or vLLM's human-readable form (``32k``, ``128K``)."""
    from tuner.memory.serve_args import human_readable_int

    try:
        value = human_readable_int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an integer or a length such as 32k: {text!r} ({exc})") from None
    if not 1 <= value <= 16_777_216:
        raise argparse.ArgumentTypeError(f"must be in 1..16777216, not {text}")
    return value



def add_progress_options(p: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--quiet``: progress lines on stderr (default: when stderr is a terminal)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", action="store_true", default=None,
                   help="progress lines on stderr (default when stderr is a terminal)")
    g.add_argument("--quiet", action="store_true", help="no progress lines")


def progress_printer(args):
    """A stderr progress sink, or None: ``--progress`` on, ``--quiet`` off, else when stderr is a tty."""
    if getattr(args, "quiet", False):
        return None
    if sys.stderr is None:  # started with stderr closed (``2>&-``): nowhere to print
        return None
    if not getattr(args, "progress", None) and not sys.stderr.isatty():
        return None
    return lambda line: print(f"ctx-tuner: {line}", file=sys.stderr, flush=True)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("explain", help="explain the KV-cache budget of one point step by step, and what would make it "
                                       "fit (exit 0 starts, 3 does not, 4 uncertain: starts at the expected value, not at the safe end)")
    p.add_argument("drop", nargs="?", help="path to a drop YAML file (or use --run)")
    p.add_argument("--run", type=int, metavar="ID", help="explain a stored profile run (profile_runs.id) without re-running")
    p.add_argument("--gpu-memory-utilization", "-u", type=_gmu, metavar="U",
                   help="the u to explain (default: each of the drop's)")
    p.add_argument("--max-model-len", "-m", type=_mml, metavar="M",
                   help="the max_model_len to explain (default: the largest that starts at u)")
    p.add_argument("--no-variants", action="store_true",
                   help="skip the extra worker jobs (fp8 KV cache, 2x TP, the u needed) for a point that does not start")
    p.add_argument("--db", default=None,
                   help="SQLAlchemy URL or SQLite path: the run for --run, and the measured runs a drop's simulation "
                        "is calibrated from (default var/ctx-tuner.sqlite)")
    p.add_argument("--no-calibration", action="store_true",
                   help="explain the plain simulation even where measured runs could calibrate it")
    p.add_argument("--json", action="store_true", help="print the explanation as JSON (bytes as integers)")
    from tuner.commands import add_cache_option

    add_cache_option(p)
    p.add_argument("--timeout", type=timeout_seconds, default=600.0, help="worker time limit per job in seconds (default 600)")
    add_progress_options(p)
    return p


def run(args) -> int:
    from tuner.reports.explain import ExplainInputError, explain_drop, explain_stored, render, store_label

    if (args.drop is None) == (args.run is None):
        print("ctx-tuner explain: give a drop file or --run ID (one of them)", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.run is not None:
            from tuner.reports.results import open_for_read

            store = open_for_read(args.db)
            try:
                doc = explain_stored(store, args.run, gpu_memory_utilization=args.gpu_memory_utilization,
                                     max_model_len=args.max_model_len)
            finally:
                store.close()
            doc["store"] = {"path": store_label(args.db), "named": args.db, "read": f"profile run {args.run}",
                            "pass_memo_entries_written": 0}  # --run reads the stored run, writes nothing
        else:
            doc = explain_drop(args.drop, gpu_memory_utilization=args.gpu_memory_utilization,
                               max_model_len=args.max_model_len, timeout_s=args.timeout,
                               progress=progress_printer(args), variants=not args.no_variants,
                               db_url=args.db, calibrate=not args.no_calibration, cache=not args.no_cache)
    except ExplainInputError as exc:
        print(f"ctx-tuner: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TunerError as exc:
        return job_error_exit(exc)
    print(json.dumps(doc, indent=2) if args.json else render(doc))
    # vLLM's verdict, as check's exit code: "starts, but fewer than min_concurrency" still starts
    starts = all(e.get("starts", e.get("fits")) for e in doc["explanations"])
    if not starts:
        return EXIT_DOES_NOT_START
    # as check at risk safe: a point that starts at the expected value but not at the interval's
    # safe end is uncertain (exit 4, docs/uncertainty.md)
    unsure = any((e.get("interval") or {}).get("starts_low") is False for e in doc["explanations"])
    return EXIT_UNCERTAIN if unsure else EXIT_OK

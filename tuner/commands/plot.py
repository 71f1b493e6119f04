"""``ctx-tuner plot DROP.yaml -o frontier.png`` or ``ctx-tuner plot --model TEXT -o frontier.png``:
the largest max_model_len that starts against gpu_memory_utilization (needs the ``plot`` extra,
matplotlib). Exit codes: 0 done, 1 job, database or matplotlib missing, 2 invalid drop, model config or
usage (an ``-o`` extension matplotlib cannot write)."""

from __future__ import annotations

from tuner.commands import job_error_exit, timeout_seconds

import argparse
import json
import os
import sys

from tuner.commands.explain import _gmu, add_progress_options, progress_printer
from tuner.errors import TunerError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
NAME = "plot"


def _conc(text: str) -> float:
    value = float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {text}")
    return value


def output_problem(output: str) -> str | None:
    """Why matplotlib cannot write ``-o OUTPUT`` (its extension names no format it supports), or None."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    ext = os.path.splitext(output)[1][1:].lower()
    if ext in formats:
        return None
    what = f"unsupported extension '.{ext}'" if ext else "no file extension"
    return f"-o {output}: {what}; matplotlib writes {', '.join(formats)} (e.g. -o frontier.png)"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plot", help="plot the largest max_model_len that starts against gpu_memory_utilization")
    p.add_argument("drop", nargs="?", help="drop YAML file to sweep (simulated now), or use --model")
    p.add_argument("--model", help="plot stored results of models whose name contains this text")
    p.add_argument("--device", help="with --model: only devices whose name contains this text")
    p.add_argument("--host", default=None,
                   help="with --model, in a fleet store: only this host_id's drops (series are labelled NAME@HOST)")
    p.add_argument("-o", "--output", required=True, help="image file to write, format by extension (png, svg, pdf, …; the plotted series go to "
                        "NAME.json for a png, NAME.EXT.json for other formats)")
    p.add_argument("--gmu", type=_gmu, nargs="+", metavar="U",
                   help="gpu_memory_utilization values to sweep (default: the drop's if >= 3, else 0.70..0.98 step 0.02)")
    p.add_argument("--concurrency", type=_conc, nargs="+", metavar="C",
                   help="extra concurrency lines (default 2 4; 1 and the drop's min_concurrency are always drawn)")
    p.add_argument("--db", default=None, help="store for measured points / --model (default var/ctx-tuner.sqlite)")
    from tuner.commands import add_settings_option

    add_settings_option(p)
    p.add_argument("--json", action="store_true", help="print the plotted series as JSON")
    from tuner.commands import add_cache_option

    add_cache_option(p)
    p.add_argument("--timeout", type=timeout_seconds, default=600.0, help="worker time limit per job in seconds (default 600)")
    add_progress_options(p)
    return p


def run(args) -> int:
    from tuner.reports.plot import _import_pyplot, frontier_from_drop, frontier_from_store, render_png, sidecar_path
    from tuner.reports.results import open_for_read

    if args.host is not None and args.model is None:
        print("ctx-tuner plot: --host filters stored results: give it with --model TEXT", file=sys.stderr)
        return EXIT_USAGE
    if (args.drop is None) == (args.model is None):
        print("ctx-tuner plot: give a drop file or --model TEXT (one of them)", file=sys.stderr)
        return EXIT_USAGE
    from tuner.commands import store_from_args
    from tuner.errors import SettingsError

    try:
        args.db = store_from_args(args)
    except SettingsError as exc:
        print(f"ctx-tuner plot: invalid settings: {exc}", file=sys.stderr)
        return EXIT_USAGE
    store = None
    store_note = None  # what the drop's jobs read from and wrote to the store (None: --model reads only)
    try:
        _import_pyplot()  # fail before any job runs
        problem = output_problem(args.output)
        if problem is not None:
            print(f"ctx-tuner plot: {problem}", file=sys.stderr)
            return EXIT_USAGE
        if args.model is not None:
            store = open_for_read(args.db)
            from tuner.jobs.memoanswer import memo_worker

            data = frontier_from_store(store, model=args.model, device=args.device, concurrency=args.concurrency,
                                       host=args.host, timeout_s=args.timeout,
                                       worker=memo_worker(args.db, None, enabled=not args.no_cache, write=False))
        else:
            from tuner.store.database import store_exists

            db = args.db or "var/ctx-tuner.sqlite"
            # measured points, if there is a store: a SQLite file that does not exist yet (path or
            # sqlite:/// URL) simply has none
            if store_exists(db):
                store = open_for_read(db)
            from tuner.reports.explain import memo_with_store_note

            # the jobs' passes go to the store's pass memo where the store exists: said below (store line)
            worker, store_note = memo_with_store_note(args.db, not args.no_cache)
            data = frontier_from_drop(args.drop, gpu_memory_utilization=args.gmu, concurrency=args.concurrency,
                                      store=store, timeout_s=args.timeout, progress=progress_printer(args),
                                      worker=worker)
        series = render_png(data, args.output)
    except TunerError as exc:
        return job_error_exit(exc)
    finally:
        if store is not None:
            store.close()
    if args.json:
        print(json.dumps({"output": args.output, "series": series, "data": data, "store": store_note}, indent=2))
    else:
        print(f"wrote {args.output} ({len(series)} series; data in {sidecar_path(args.output)})")
        from tuner.reports.explain import store_line

        line = store_line(store_note)
        if line:
            print(f"  {line}")
        for label, pts in series.items():
            print(f"  {label}: {len(pts)} points")
        for note in data.get("notes") or []:
            print(f"  note: {note}")
        if data.get("non_monotone_at"):
            print(f"  note: not monotone at gpu_memory_utilization {', '.join(f'{u:g}' for u in data['non_monotone_at'])}")
    return EXIT_OK

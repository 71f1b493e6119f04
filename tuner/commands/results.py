"""``ctx-tuner results [--model TEXT] [--device TEXT] [--json | --csv [--table T]]``: the latest
proposals, fit surfaces and runs in the store. Exit codes: 0 done, 1 database failed (or no store),
2 usage error."""

from __future__ import annotations

import argparse
import json
import sys

from tuner.errors import TunerError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
NAME = "results"


def _limit(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {text}")
    return value


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("results", help="latest proposals, fit surfaces and runs from the store")
    p.add_argument("--model", help="only models whose name contains this text (case-insensitive)")
    p.add_argument("--device", help="only devices whose name contains this text (case-insensitive)")
    p.add_argument("--db", default=None, help="SQLAlchemy URL or SQLite path (default var/ctx-tuner.sqlite)")
    from tuner.commands import add_settings_option

    add_settings_option(p)
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print JSON (bytes as integers)")
    fmt.add_argument("--csv", action="store_true", help="print one table as CSV (see --table)")
    p.add_argument("--table", choices=("proposals", "runs", "candidates"), default=None,
                   help="the table --csv prints (default proposals); only with --csv")
    p.add_argument("--limit", type=_limit, default=200, help="at most this many runs, newest (default 200)")
    return p


def run(args) -> int:
    from tuner.reports.results import open_for_read, query, render, to_csv

    if args.table is not None and not args.csv:
        print("ctx-tuner results: --table goes with --csv (the table and --json outputs show every table)",
              file=sys.stderr)
        return EXIT_USAGE
    from tuner.commands import store_from_args
    from tuner.errors import SettingsError

    try:
        args.db = store_from_args(args)
    except SettingsError as exc:
        print(f"ctx-tuner results: invalid settings: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        store = open_for_read(args.db)
        try:
            doc = query(store, model=args.model, device=args.device, limit=args.limit)
        finally:
            store.close()
    except TunerError as exc:
        print(f"ctx-tuner: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(doc, indent=2))
    elif args.csv:
        sys.stdout.write(to_csv(doc, args.table or "proposals"))
    else:
        print(render(doc))
    return EXIT_OK

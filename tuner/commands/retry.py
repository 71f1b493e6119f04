"""``ctx-tuner retry NAME... | --failed [--settings FILE | --db URL]``: run failed drops again.

Puts the current failed job of each named drop (its ``name``, or its file name without the
suffix) — or, with ``--failed``, of every drop — back to ``pending`` with a fresh attempt count
(the ``history`` of earlier attempts is kept). A running daemon picks them up within seconds (it
polls the queue; no SIGHUP needed). A drop failure (invalid input) fails again unless what it
points at changed — e.g. the model's config.json has been put in place. Exit codes: 0 at least one
job queued again; 1 nothing matched, or the store cannot be opened; 2 usage error. With a fleet
store (several daemons on one database) the named drops of every daemon are queued again.
"""

from __future__ import annotations

import argparse
import sys

from tuner.errors import SettingsError, TunerError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
NAME = "retry"


def add_parser(sub) -> argparse.ArgumentParser:
    from tuner.daemon.settings import DEFAULT_SETTINGS_PATH

    p = sub.add_parser("retry", help="queue failed daemon drops again (by name, or all with --failed)")
    p.add_argument("names", nargs="*", metavar="NAME", help="drop name (or drop file name without .yaml)")
    p.add_argument("--failed", action="store_true", help="every drop whose current job failed")
    p.add_argument("--settings", default=None,
                   help=f"daemon settings whose store to use (default {DEFAULT_SETTINGS_PATH} if it exists)")
    p.add_argument("--db", default=None, help="results store (SQLite file path or SQLAlchemy URL); overrides --settings")
    return p


def run(args) -> int:
    import os

    from tuner.store.jobqueue import JobQueue
    from tuner.daemon.settings import DEFAULT_SETTINGS_PATH, load_settings
    from tuner.store.database import open_store, store_exists

    if bool(args.names) == bool(args.failed):
        print("ctx-tuner retry: give drop names or --failed (one of them)", file=sys.stderr)
        return EXIT_USAGE
    db = args.db
    if db is None:
        path = args.settings
        if path is None and os.path.exists(DEFAULT_SETTINGS_PATH):
            path = DEFAULT_SETTINGS_PATH
        try:
            db = load_settings(path).db_url
        except SettingsError as exc:
            print(f"ctx-tuner retry: invalid settings: {exc}", file=sys.stderr)
            return EXIT_USAGE
    try:
        if not store_exists(db):
            print(f"ctx-tuner retry: {db}: no store yet, so no failed drops", file=sys.stderr)
            return EXIT_FAILED
        store = open_store(db)
        try:
            # every daemon's jobs on this store (fleet: each stays with its owner, whose daemon
            # runs it); owner id 0 is no hosts row, so this tool registers no host of its own
            jobs = JobQueue(store, 0).retry(args.names, all_failed=args.failed, all_owners=True)
        finally:
            store.close()
    except TunerError as exc:
        print(f"ctx-tuner retry: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if not jobs:
        what = "no failed drop" if args.failed else f"no failed drop named {', '.join(args.names)}"
        print(f"ctx-tuner retry: {what}", file=sys.stderr)
        return EXIT_FAILED
    from tuner.daemon.failures import short

    for j in jobs:
        # the reason on one line, cut at a word with "…" (a cut at 200 characters lost "(ratio 4.2)")
        print(f"queued again: {j.name or '-'} ({j.path}; job {j.id}, was {j.failure_kind or 'drop'} failure "
              f"{j.error_type}: {short(j.error or '', 300)})")
    return EXIT_OK

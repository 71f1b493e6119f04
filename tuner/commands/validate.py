"""``ctx-tuner validate CASES.jsonl [--models-dir DIR] [--json] [--filter REGEX] [--timeout S] [--calibrate]``:
predict every real start-up in a case file with its observed settings and report the errors.

Exit codes: 0 whatever the accuracy (cases that cannot run are reported, not fatal); 1 the worker
itself failed; 2 usage error (unreadable case file, missing models directory).
"""

from __future__ import annotations

from tuner.commands import timeout_seconds

import argparse
import json
import re
import sys
from pathlib import Path

from tuner.errors import DropError, TunerError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
NAME = "validate"


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"not a regular expression: {text!r} ({exc})") from None
    return text


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("validate", help="predict real vLLM start-ups (a case file) and report the errors")
    p.add_argument("cases", help="JSON Lines case file (format: shared/cases/README.md)")
    p.add_argument("--models-dir", default=None,
                   help="directory of <org>--<name>/config.json per model id (default: ../models next to the case file)")
    p.add_argument("--json", action="store_true",
                   help='print one JSON object {"cases": [...], "summary": {...}} instead of a table')
    p.add_argument("--filter", type=_regex, default=None, help="only cases whose id or model matches this regular expression")
    p.add_argument("--timeout", type=timeout_seconds, default=900.0, help="worker time limit in seconds (default 900)")
    p.add_argument("--calibrate", action="store_true",
                   help="also predict each case calibrated leave-one-out from the other cases' logs of its group "
                        "(before/after columns, a second summary; --json adds calibrated_* and summary_calibrated)")
    return p


def default_models_dir(cases_path: str) -> Path:
    """``<case file's directory>/../models`` (the layout of ``shared/``)."""
    return Path(cases_path).resolve().parent.parent / "models"


def run(args) -> int:
    from tuner.accuracy.validate import load_cases, render, select
    from tuner.question.protocol import ValidateRequest
    from tuner.seam.worker import run_in_worker

    try:
        cases = select(load_cases(args.cases), args.filter)
    except DropError as exc:
        print(f"ctx-tuner: {exc}", file=sys.stderr)
        return EXIT_USAGE
    models_dir = Path(args.models_dir) if args.models_dir else default_models_dir(args.cases)
    if not models_dir.is_dir():
        print(f"ctx-tuner: {models_dir}: models directory not found (use --models-dir)", file=sys.stderr)
        return EXIT_USAGE
    try:
        request = ValidateRequest(cases=tuple(cases), models_dir=str(models_dir),
                                  calibrate=bool(getattr(args, "calibrate", False)))
        report = run_in_worker(request,
                               job=f"validate {args.cases}", timeout_s=args.timeout)
    except TunerError as exc:
        print(f"ctx-tuner: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(report, indent=2) if args.json else render(report))
    return EXIT_OK

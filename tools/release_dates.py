#!/usr/bin/env python3
"""Generate ``tuner/data/release_dates.json``: the day each vLLM release's wheel was built.

Maintainer's tool (not imported by ctx-tuner). For every release directory under ``--src``
(``/work/vllm-src/<release>/vllm``: the wheel's Python sources as ``pip download vllm==<release>
--no-deps`` + ``unzip`` leave them, file times kept from the wheel's zip entries), the newest
modification day of its ``.py`` files (UTC), i.e. the day the wheel was built. A start-up posted
on day D did not run a release built after D (``tuner.releases.dates``).

Usage::

    python tools/release_dates.py --src /work/vllm-src --out tuner/data/release_dates.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path


def built_on(src: Path) -> str | None:
    """The newest modification day (``YYYY-MM-DD``, UTC) of ``src``'s ``.py`` files."""
    newest = max((p.stat().st_mtime for p in src.rglob("*.py")), default=None)
    if newest is None:
        return None
    return dt.datetime.fromtimestamp(newest, tz=dt.timezone.utc).date().isoformat()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default="/work/vllm-src", help="directory of <release>/vllm folders")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tuner" / "data"
                                         / "release_dates.json"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tuner.releases import facts as rf

    out = {}
    for release in rf.releases():
        src = Path(args.src) / release / "vllm"
        day = built_on(src) if src.is_dir() else None
        if day is not None:
            out[release] = day
    Path(args.out).write_text(json.dumps({"source": "newest .py modification day in each release's wheel "
                                          "(tools/release_dates.py)", "built_on": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

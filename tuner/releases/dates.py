"""Which releases a start-up posted on a given day can have run: those whose wheel was built by
then (no I/O but reading the packaged file once).

``tuner/data/release_dates.json`` holds the day each release's wheel was built (the newest file
time of its ``vllm/**/*.py``), written by ``tools/release_dates.py`` from the wheels (0.4.0 …
0.34.0; e.g. 0.9.2 2025-07-07, 0.10.0 2025-07-24, 0.10.1.1 2025-08-20, 0.10.2 2025-09-13). A dev
build between two releases is assumed to be the older one (the newest built by the day).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from tuner.releases import facts as rf

__all__ = ["built_on", "releases_built_by", "is_day"]

DATA = Path(__file__).resolve().parent.parent / "data" / "release_dates.json"
_DAY = re.compile(r"^20\d\d-[01]\d-[0-3]\d$")


@lru_cache(maxsize=1)
def _built() -> dict:
    return json.loads(DATA.read_text())["built_on"]


def is_day(text: object) -> bool:
    """``"2025-07-22"`` (ISO day) → True."""
    return bool(_DAY.match(str(text)))


def built_on(release: str) -> str | None:
    """The day ``release``'s wheel was built (``YYYY-MM-DD``), None when not read."""
    return _built().get(release)


def releases_built_by(day: str) -> frozenset[str]:
    """Releases whose wheel was built on or before ``day`` (``YYYY-MM-DD``; ISO days compare as
    strings)."""
    return frozenset(r for r, d in _built().items() if d <= day)

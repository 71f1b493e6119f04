"""What both paths to the results store share, without SQLAlchemy: the default file, the time
format, the migration scripts' head revision, the rules a row must meet before it is inserted
and the rows of pass-memo entries.

Two paths use these: :mod:`tuner.store.database` (SQLAlchemy and Alembic, every backend) and
:mod:`tuner.store.litestore` (the standard library's ``sqlite3``, for a SQLite file already at the
head, so a cold CLI answer from the pass memo pays no SQLAlchemy import). Keeping the rules here
means the two paths cannot disagree on what they store. No torch, no SQLAlchemy.
"""

from __future__ import annotations

import json
import numbers
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Collection, Iterable

from tuner.errors import StoreError

DEFAULT_PATH = "var/ctx-tuner.sqlite"

#: The non-column key each table's rows may carry for :meth:`tuner.store.database.Store.save_result`
#: (a run's ``key``, a candidate's ``run_key``): used to link rows, never stored.
EXTRA_KEYS = {"profile_runs": "key", "candidates": "run_key"}
#: Columns the store sets itself; a row that gives one is refused.
SET_BY_STORE = frozenset({"id", "drop_id", "profile_run_id", "created_at"})

#: The ``pass_memo`` columns an entry gives (``created_at`` and ``value`` are set by :func:`memo_rows`).
MEMO_COLUMNS = ("memo_key", "kind", "model_config_sha256", "tool_version", "method", "device_name", "era")


def utc_text(value: datetime | str | None = None) -> str:
    """Return ``value`` (default: now) as UTC ISO-8601 text ``YYYY-MM-DDTHH:MM:SS.ffffffZ``.

    Accepts an aware ``datetime`` or an ISO-8601 string with an offset (``Z`` included).
    Raises ``StoreError`` for a naive time (its zone is unknown) or an unparsable string.
    """
    if value is None:
        value = datetime.now(timezone.utc)
    elif isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError as e:
            raise StoreError(f"not an ISO-8601 time: {value!r}") from e
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise StoreError(f"time must be timezone-aware (UTC), got {value!r}")
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def row_values(table: str, row: dict, columns: Collection[str], *, where: str) -> dict[str, Any]:
    """The values to insert for one row of ``table`` whose columns are ``columns``: the row's
    link key (:data:`EXTRA_KEYS`) left out, byte columns (``*_bytes``) as ints, time columns
    (``*_at``) as UTC text (:func:`utc_text`).

    Raises:
        StoreError: an unknown or store-owned column (naming table and key), a non-integer byte
            value, a naive or unparsable time.
    """
    values: dict[str, Any] = {}
    extra = EXTRA_KEYS.get(table)
    for k, v in row.items():
        if k == extra:
            continue
        if k not in columns or k in SET_BY_STORE:
            raise StoreError(f"{table}: unknown or store-owned column {k!r}", where=where)
        values[k] = _coerce(table, k, v, where)
    return values


def _coerce(table: str, col: str, v: Any, where: str) -> Any:
    if v is None:
        return None
    if col.endswith("_bytes"):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise StoreError(f"{table}.{col} must be an int of bytes, got {v!r}", where=where)
        return int(v)
    if col.endswith("_at"):
        return utc_text(v)
    return v


def memo_rows(entries: Iterable[dict], now: str) -> list[dict]:
    """The ``pass_memo`` rows of memo entries (dicts with :data:`MEMO_COLUMNS` and ``value``): one
    row per ``memo_key`` (the last entry wins), ``value`` as JSON text, ``created_at`` ``now``."""
    unique = list({e["memo_key"]: e for e in entries}.values())
    return [{**{k: e.get(k) for k in MEMO_COLUMNS}, "created_at": now,
             "value": e["value"] if isinstance(e["value"], str) else json.dumps(e["value"], sort_keys=True)}
            for e in unique]


def memo_values(rows: Iterable[tuple[str, str]]) -> dict[str, dict]:
    """``{memo_key: value}`` from ``(memo_key, value JSON text)`` rows; a damaged row is left
    out (a miss, never an answer)."""
    out = {}
    for key, value in rows:
        try:
            out[key] = json.loads(value)
        except (TypeError, ValueError):
            continue
    return out


def script_head() -> str | None:
    """The head revision of the migration scripts, read from their ``revision`` /
    ``down_revision`` lines without importing Alembic; None when that is not one clear head (then
    Alembic decides)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("tuner.migrations")
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
    except (ImportError, ValueError):
        return None
    revs, downs = set(), set()
    pat = re.compile(r'^(revision|down_revision)\s*(?::[^=]*)?=\s*(.+?)\s*$', re.M)
    for root in roots:
        for f in sorted((Path(root) / "versions").glob("*.py")):
            found = dict((k, v) for k, v in pat.findall(f.read_text(encoding="utf-8")))
            rev = found.get("revision", "").strip("'\"")
            if not rev:
                continue
            revs.add(rev)
            down = found.get("down_revision", "None")
            if down != "None":
                if not re.fullmatch(r'["\'][\w]+["\']', down):
                    return None  # a merge point or anything unusual: ask Alembic
                downs.add(down.strip("'\""))
    heads = revs - downs
    return heads.pop() if len(heads) == 1 else None


__all__ = ["DEFAULT_PATH", "EXTRA_KEYS", "MEMO_COLUMNS", "SET_BY_STORE", "memo_rows", "memo_values", "row_values",
           "script_head", "utc_text"]

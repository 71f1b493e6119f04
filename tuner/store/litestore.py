"""The results store through the standard library's ``sqlite3``: the few
:class:`tuner.store.database.Store` methods that ``profile`` and ``explain`` call for one simulate job
(the pass memo, the first runs of its passes, the result's insert), on a SQLite file that is
already at the migration scripts' head — without importing SQLAlchemy, which is about 0.3 s of a
cold CLI answer from the pass memo (issue 13: ≤ 0.4 s for a repeated question).

:func:`open_lite` returns a :class:`LiteStore` only where it can vouch for the store, and None
otherwise — the caller then opens the real :class:`tuner.store.database.Store` as before:

- the URL is a plain path or a plain ``sqlite:///PATH`` (no driver name, query or ``%`` escape),
  and that file exists (a new store is made by :func:`tuner.store.database.open_store`, with Alembic);
- its ``alembic_version`` is the scripts' one head (:func:`tuner.store.storerules.script_head`): the
  tables are the ones the migrations made, so the columns are read from the file itself
  (``PRAGMA table_info``), never declared a second time;
- with ``calibrate``, its ``calibrations`` table is empty, so no correction applies
  (:func:`tuner.jobs.calibrate.calibration_for` would find none): a store with measured runs is read
  through SQLAlchemy, as before.

Connections are set up as :func:`tuner.store.database.make_engine` sets up SQLite's (``busy_timeout``,
``journal_mode=WAL`` for writers, ``synchronous=FULL``, ``foreign_keys=ON``; a write starts with
``BEGIN IMMEDIATE``); rows go through the same rules (:func:`tuner.store.storerules.row_values`,
:func:`tuner.store.storerules.memo_rows`). Tests check that both paths store and read the same rows.
No torch, no SQLAlchemy.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, Callable

from tuner.errors import StoreError
from tuner.store.storerules import DEFAULT_PATH, memo_rows, memo_values, row_values, script_head, utc_text

_PLAIN = "sqlite:///"


def sqlite_file(url: str | None, default_path: str = DEFAULT_PATH) -> str | None:
    """The SQLite file a store URL names as :func:`tuner.store.database.open_store` reads it — ``None``
    (the default path), a plain path, or ``sqlite:///PATH`` — and None for anything else (a
    server URL, a driver name, a query, an escape, an in-memory database), which only SQLAlchemy
    should interpret."""
    if not url:
        return str(default_path)
    if "://" not in url:
        return url
    if not url.startswith(_PLAIN) or "?" in url or "%" in url:
        return None
    path = url[len(_PLAIN):]
    return path if path and path != ":memory:" else None


def store_missing(url: str | None, default_path: str = DEFAULT_PATH) -> bool:
    """True when ``url`` names a SQLite file (:func:`sqlite_file`) that does not exist yet, or an
    empty file (which :func:`tuner.store.database.open_store` makes into a new store) — the memo cannot
    answer and opening it would create the store; False otherwise (unsure included)."""
    path = sqlite_file(url, default_path)
    if path is None:
        return False
    try:
        return Path(path).stat().st_size == 0
    except FileNotFoundError:
        return True
    except OSError:  # unreadable: the store reports it
        return False


def open_lite(url: str | None, *, readonly: bool = False, calibrate: bool = True,
              default_path: str = DEFAULT_PATH, busy_timeout_s: float = 30.0) -> "LiteStore | None":
    """A :class:`LiteStore` on the SQLite store at ``url``, or None when this path cannot vouch
    for it (see the module docstring; the caller then uses :func:`tuner.store.database.open_store`).
    ``readonly`` opens the file with ``mode=ro``. Never creates or migrates anything, and never
    raises for a store it cannot read (the real store then reports it) — except one still locked
    by another writer after ``busy_timeout_s``, the ``StoreError`` the real store would raise after
    waiting as long again.

    Raises:
        StoreError: the store stayed locked (``database is locked``) past ``busy_timeout_s``.
    """
    path = sqlite_file(url, default_path)
    if path is None or not Path(path).is_file():
        return None
    head = script_head()
    if head is None:
        return None
    uri = Path(path).resolve().as_uri() + ("?mode=ro" if readonly else "?mode=rw")
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    except sqlite3.Error:
        return None
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        if [r[0] for r in conn.execute("SELECT version_num FROM alembic_version")] != [head]:
            conn.close()
            return None
        if calibrate and conn.execute("SELECT 1 FROM calibrations LIMIT 1").fetchone() is not None:
            conn.close()
            return None
        if not readonly:
            conn.execute("PRAGMA journal_mode = WAL").fetchall()
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
    except sqlite3.OperationalError as e:
        conn.close()
        if "locked" in str(e) or "busy" in str(e):
            raise StoreError(f"cannot open store: {e}", where=_PLAIN + path) from e
        return None
    except sqlite3.Error:
        conn.close()
        return None
    return LiteStore(conn, where=_PLAIN + path, readonly=readonly)


class LiteStore:
    """The :class:`tuner.store.database.Store` methods a simulate ``profile`` / ``explain`` job calls, on a
    store :func:`open_lite` vouched for. Errors are ``StoreError`` with ``where`` the store's URL,
    as the real store's; :meth:`save_result` writes all or nothing."""

    def __init__(self, conn: sqlite3.Connection, *, where: str, readonly: bool = False) -> None:
        self._conn = conn
        self.where = where
        self.readonly = readonly
        self._columns: dict[str, frozenset[str]] = {}

    def close(self) -> None:
        self._conn.close()

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        try:
            return self._conn.execute(sql, params).fetchall()
        except sqlite3.Error as e:
            raise StoreError(f"query failed: {e}", where=self.where) from e

    # -- reads (the same answers as tuner.store.database.Store's methods of these names) ------------------

    def memo_entries(self, model_config_sha256: str, tool_version: str) -> dict[str, dict]:
        """As :meth:`tuner.store.database.Store.memo_entries`."""
        return memo_values(self._query("SELECT memo_key, value FROM pass_memo WHERE model_config_sha256 = ? "
                                       "AND tool_version = ?", (model_config_sha256, tool_version)))

    def first_runs(self, pass_sha256s: list[str]) -> dict[str, tuple[int, int]]:
        """As :meth:`tuner.store.database.Store.first_runs`."""
        keys = sorted({k for k in pass_sha256s if k})
        if not keys:
            return {}
        marks = ", ".join("?" * len(keys))
        rows = self._query(
            "SELECT pass_sha256, id, drop_id FROM profile_runs WHERE id IN (SELECT min(id) FROM profile_runs "
            f"WHERE pass_sha256 IN ({marks}) AND status = 'ok' AND method = 'simulate' GROUP BY pass_sha256)",
            tuple(keys))
        return {k: (i, d) for k, i, d in rows}

    def calibration_rows(self, **_match: Any) -> list[dict]:
        """No rows: :func:`open_lite` (with ``calibrate``) opens only a store whose
        ``calibrations`` table is empty."""
        return []

    # -- writes ----------------------------------------------------------------------------------

    def save_result(self, drop: dict, runs: list[dict], candidates: list[dict], proposals: list[dict], *,
                    also: Callable[[sqlite3.Connection, int], None] | None = None) -> int:
        """As :meth:`tuner.store.database.Store.save_result` (``also`` gets this store's sqlite3 connection);
        one ``BEGIN IMMEDIATE`` transaction, rolled back on any failure."""
        now = utc_text()
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise StoreError(f"save_result failed, nothing written: {e}", where=self.where) from e
        try:
            drop_id = self._insert("drops", drop, created_at=now)
            run_ids: dict[Any, int] = {}
            for run in runs:
                key = run.get("key")
                if key is not None and key in run_ids:
                    raise StoreError(f"profile_runs: duplicate run key {key!r}", where=self.where)
                run_id = self._insert("profile_runs", run, drop_id=drop_id)
                if key is not None:
                    run_ids[key] = run_id
            for cand in candidates:
                rk = cand.get("run_key")
                if rk is not None and rk not in run_ids:
                    raise StoreError(f"candidates: run_key {rk!r} names no run", where=self.where)
                self._insert("candidates", cand, drop_id=drop_id,
                             profile_run_id=run_ids.get(rk) if rk is not None else None)
            for prop in proposals:
                self._insert("proposals", prop, drop_id=drop_id, created_at=now)
            if also is not None:
                also(conn, drop_id)
            conn.execute("COMMIT")
            return drop_id
        except BaseException as exc:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"save_result failed, nothing written: {exc}", where=self.where) from exc
            raise

    def put_memo(self, entries: list[dict], conn: sqlite3.Connection | None = None) -> int:
        """As :meth:`tuner.store.database.Store.put_memo`: a key already stored is left as it is.
        ``conn``: inside the caller's transaction (:meth:`save_result`'s ``also``)."""
        if not entries:
            return 0
        rows = memo_rows(entries, utc_text())
        cols = list(rows[0])
        sql = (f"INSERT INTO pass_memo ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
               "ON CONFLICT (memo_key) DO NOTHING")
        params = [tuple(r[c] for c in cols) for r in rows]
        try:
            if conn is not None:
                conn.executemany(sql, params)
                return len(rows)
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(sql, params)
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as e:
            raise StoreError(f"storing the pass memo failed: {e}", where=self.where) from e
        return len(rows)

    def _table_columns(self, table: str) -> frozenset[str]:
        cols = self._columns.get(table)
        if cols is None:
            cols = self._columns[table] = frozenset(r[1] for r in self._conn.execute(f"PRAGMA table_info({table})"))
        return cols

    def _insert(self, table: str, row: dict, **fixed: Any) -> int:
        values = row_values(table, row, self._table_columns(table), where=self.where)
        values.update(fixed)
        names = list(values)
        cur = self._conn.execute(f"INSERT INTO {table} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                                 tuple(values[n] for n in names))
        return int(cur.lastrowid)


__all__ = ["LiteStore", "open_lite", "sqlite_file", "store_missing"]

"""A read-only snapshot of the SQLite store for readers who cannot write the state directory.

A WAL database needs its ``-wal``/``-shm`` files writable by every reader; a reader without write
access to the directory cannot open it. The snapshot is a plain rollback-journal copy made with
SQLite's online backup API (consistent, never blocks the daemon's writes for long), written to a
temporary file, fsynced, made world-readable and renamed over the old one: a reader sees either
the old or the new snapshot, never half of one. Open it with ``sqlite3 'file:PATH?mode=ro'``.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from pathlib import Path

from tuner.errors import StoreError


def write_snapshot(db_path: str | os.PathLike, dest: str | os.PathLike, *, mode: int = 0o644) -> Path:
    """Copy the SQLite database at ``db_path`` to ``dest`` atomically; returns ``dest``.

    Raises:
        StoreError: the source cannot be read or the destination cannot be written (``where`` =
            the path at fault); no partial file is left behind.
    """
    src_path, dest = Path(db_path), Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        os.close(fd)
    except OSError as exc:
        raise StoreError(f"cannot write snapshot: {exc.strerror or exc}", where=str(dest)) from exc
    try:
        try:
            src = sqlite3.connect(f"{src_path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read database for snapshot: {exc}", where=str(src_path)) from exc
        try:
            out = sqlite3.connect(tmp)
            try:
                src.backup(out)
                out.execute("PRAGMA journal_mode = DELETE").fetchall()  # readers need no -wal/-shm
                out.commit()
            finally:
                out.close()
        except sqlite3.Error as exc:
            raise StoreError(f"snapshot failed: {exc}", where=str(src_path)) from exc
        finally:
            src.close()
        os.chmod(tmp, mode)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
        try:
            dfd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:  # pragma: no cover - some filesystems refuse directory fsync
            pass
    except OSError as exc:
        raise StoreError(f"cannot write snapshot: {exc.strerror or exc}", where=str(dest)) from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest

"""Shared pieces of the daemon tests: settings in a temp dir, the fake worker, polling helpers."""

from __future__ import annotations

import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from tests.conftest import REPO
from tuner.daemon.settings import Settings

FAKE_WORKER = REPO / "tests" / "_fake_worker.py"


def without_elapsed(obj):
    """A job result without its timings (``elapsed_s``), for comparing two runs of one job."""
    if isinstance(obj, dict):
        return {k: without_elapsed(v) for k, v in obj.items() if k != "elapsed_s"}
    if isinstance(obj, list):
        return [without_elapsed(v) for v in obj]
    return obj


def hanging_python(tmp_path: Path, *, read_request: bool = True) -> tuple[str, Path]:
    """A 'python' that (with ``read_request``) reads its request, starts a grandchild in its
    group, writes its pid (= its process group) to a marker file, then sleeps for an hour; without
    ``read_request`` it never reads stdin (a worker still importing)."""
    marker = tmp_path / "worker.pid"
    script = tmp_path / "hangpy"
    script.write_text(
        f"#!{sys.executable}\n"
        "import os, subprocess, sys, time\n"
        + ("sys.stdin.read()\n" if read_request else "")
        + f"subprocess.Popen([{sys.executable!r}, '-c', 'import time; time.sleep(3600)'])\n"
        f"open({str(marker) + '.tmp'!r}, 'w').write(str(os.getpid()))\n"
        f"os.replace({str(marker) + '.tmp'!r}, {str(marker)!r})\n"
        "time.sleep(3600)\n")
    script.chmod(0o755)
    return str(script), marker


def fake_python(tmp_path: Path) -> Path:
    """A 'python' for ``worker_python`` that runs tests/_fake_worker.py (no torch, ~20 ms)."""
    p = tmp_path / "fake-python"
    p.write_text(f"#!/bin/sh\nexec {sys.executable} -S {FAKE_WORKER} \"$@\"\n")
    p.chmod(0o755)
    return p


def settings_for(tmp_path: Path, **over) -> Settings:
    (tmp_path / "conf.d").mkdir(exist_ok=True)
    base = dict(watch_dir=str(tmp_path / "conf.d"), state_dir=str(tmp_path / "state"), debounce_s=0.05,
                rescan_interval_s=30.0, job_timeout_s=20.0, worker_python=str(fake_python(tmp_path)),
                log_level="INFO", retry_backoff_s=0.0)
    base.update(over)
    return Settings(**base)


def write_settings(tmp_path: Path, **over) -> Path:
    s = settings_for(tmp_path, **over)
    data = {k: getattr(s, k) for k in ("watch_dir", "state_dir", "debounce_s", "rescan_interval_s", "job_timeout_s",
                                       "worker_python", "log_level", "retry_backoff_s")}
    data.update(over)
    p = tmp_path / "tuner.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def drop_text(name: str, model: str | os.PathLike, gmu=(0.5,), **extra) -> str:
    body = {"name": name, "model": str(model), "device": "H100-80GB",
            "candidates": {"gpu_memory_utilization": list(gmu), "max_model_len": [1024]}}
    body.update(extra)
    return yaml.safe_dump(body)


def own_drop_text(name: str, model: str | os.PathLike, gmu=(0.5,), **extra) -> str:
    """:func:`drop_text` with a ``max_num_seqs`` of its own derived from ``name``: drops that differ
    only by name share one result key (:func:`tuner.store.fleet.result_key`) and all but the first are
    answered from the store without a worker, while the fake worker's behaviour (slow, crash,
    hog, …) hangs on the name — tests of worker runs give each drop its own pass this way."""
    import zlib

    extra.setdefault("max_num_seqs", 1 + zlib.crc32(name.encode("utf-8")) % 65536)
    return drop_text(name, model, gmu, **extra)


def poll(predicate: Callable[[], object], timeout_s: float = 10.0, step: Callable[[], None] | None = None,
         what: str = "condition") -> object:
    """Call ``step`` (or sleep 20 ms) until ``predicate()`` is truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        if step is not None:
            step()
        else:
            time.sleep(0.02)


def db_rows(db: Path, sql: str, *args) -> list[tuple]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def try_rows(db: Path, sql: str, *args) -> list[tuple]:
    """:func:`db_rows`, or [] while the database or its tables do not exist yet."""
    try:
        return db_rows(db, sql, *args)
    except sqlite3.Error:
        return []


def group_alive(pgid: int) -> bool:
    """True while a non-zombie process is in process group ``pgid`` (zombies wait for a reaper)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def fast_tmp(tmp_path: Path) -> Path:
    """A scratch directory on tmpfs when there is one (fsync is free there), else ``tmp_path``.
    For tests about counting, not durability."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        import tempfile

        return Path(tempfile.mkdtemp(prefix="ctx-tuner-test-", dir=shm))
    return tmp_path

"""The daemon in-process, with real inotify, real SQLite files (and, through the ``db_url``
fixture, a real PostgreSQL database when CTX_TUNER_TEST_DATABASE_URL is set) and real worker
subprocesses (the fast fake worker, tests/_fake_worker.py, behind ``worker_python``; the code path
is the real one). No fixed sleeps: every wait polls a condition with a deadline."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from tests._daemon_helpers import db_rows, drop_text, fast_tmp, group_alive, poll, settings_for
from tuner.daemon.service import Daemon
from tuner.daemon.notify import Notifier

H100 = 85_030_076_416  # H100-80GB total bytes, as the catalog has it


def _expected_tokens(gmu: float) -> int:
    """What the fake worker computes (tests/_fake_worker.py)."""
    avail = int(H100 * gmu) - (1 << 30) - (1 << 28) - (1 << 28)
    return avail // 32768 * 16


class Harness:
    def __init__(self, tmp_path: Path, model: Path, db_url: str | None = None, **over) -> None:
        self.tmp = tmp_path
        self.model = model
        self.pg = db_url is not None and db_url.startswith("postgresql")
        if self.pg:
            over = {**over, "database_url": db_url}
        self.settings = settings_for(tmp_path, **over)
        self.conf = Path(self.settings.watch_dir)
        self.db = Path(self.settings.state_dir) / "ctx-tuner.sqlite"
        self.url = db_url
        self.daemons: list[Daemon] = []

    def start(self, **kw) -> Daemon:
        d = Daemon(self.settings, notifier=Notifier({}), **kw)
        self.daemons.append(d)
        d.start()
        return d

    def until(self, d: Daemon, predicate, timeout_s: float = 10.0, what: str = "condition"):
        return poll(predicate, timeout_s, step=lambda: d.step(max_wait_s=0.05), what=what)

    def rows(self, sql: str, *args) -> list[tuple]:
        if not self.pg:
            return db_rows(self.db, sql, *args)
        import sqlalchemy as sa

        eng = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        try:
            with eng.connect() as c:
                return [tuple(r) for r in c.exec_driver_sql(sql.replace("?", "%s"), tuple(args))]
        except sa.exc.ProgrammingError:  # not migrated yet
            return []
        finally:
            eng.dispose()

    def sqlite_only(self) -> None:
        if self.pg:
            pytest.skip("about SQLite's own locking")

    def job(self, name: str) -> tuple:
        rows = self.rows("SELECT status, error_type, error, attempts, worker_pid FROM jobs WHERE path = ? "
                         "ORDER BY id DESC LIMIT 1", str(self.conf / name))
        return rows[0] if rows else (None,) * 5

    def close(self) -> None:
        for d in self.daemons:
            d.shutdown()


@pytest.fixture
def h(tmp_path, tiny_config, monkeypatch, db_url):
    monkeypatch.setenv("FAKE_WORKER_LOG", str(tmp_path / "worker.log"))
    harness = Harness(tmp_path, tiny_config, db_url)
    yield harness
    harness.close()


def worker_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "worker.log"
    return log.read_text().splitlines() if log.exists() else []


def test_drop_becomes_a_proposal_edit_reprofiles_identical_rewrite_does_not(h, tmp_path):
    d = h.start()
    t0 = time.monotonic()
    (h.conf / "a.yaml").write_text(drop_text("a", h.model, gmu=(0.5,)))
    h.until(d, lambda: h.rows("SELECT 1 FROM proposals"), what="a proposal row")
    assert time.monotonic() - t0 < 10
    (mml, tokens, gmu), = h.rows("SELECT max_model_len, kv_cache_tokens, gpu_memory_utilization FROM proposals")
    assert (tokens, gmu) == (_expected_tokens(0.5), 0.5) and mml == 131072
    doc = (Path(h.settings.state_dir) / "proposals" / "a.yaml").read_text()
    assert "--max-model-len 131072 --gpu-memory-utilization 0.5" in doc and "weights_bytes: 1073741824" in doc
    assert len(worker_calls(tmp_path)) == 1

    # identical rewrite: events arrive, a reconcile runs, nothing is profiled
    before = d.reconciles
    (h.conf / "a.yaml").write_text(drop_text("a", h.model, gmu=(0.5,)))
    h.until(d, lambda: d.reconciles > before and not d.debouncer.pending, what="a reconcile")
    for _ in range(5):
        d.step(max_wait_s=0.02)
    assert len(worker_calls(tmp_path)) == 1
    assert h.rows("SELECT count(*) FROM jobs") == [(1,)]

    # an edit re-profiles; the old drop row is retired, its results kept
    (h.conf / "a.yaml").write_text(drop_text("a", h.model, gmu=(0.25,)))
    h.until(d, lambda: h.rows("SELECT 1 FROM drops WHERE id = 2"), what="the edited drop")
    assert len(worker_calls(tmp_path)) == 2
    drops = h.rows("SELECT id, retired_at IS NOT NULL FROM drops ORDER BY id")
    assert drops == [(1, 1), (2, 0)]
    assert h.rows("SELECT drop_id, gpu_memory_utilization FROM proposals ORDER BY id") == [(1, 0.5), (2, 0.25)]
    assert "gpu_memory_utilization: 0.25" in (Path(h.settings.state_dir) / "proposals" / "a.yaml").read_text()


def test_atomic_saves_editor_files_subdirs_and_deletion(h, tmp_path):
    d = h.start()
    junk = [".a.yaml.swp", "a.yaml~", "#a.yaml#", ".#a.yaml", "a.yaml.tmp", "notes.txt", "4913", ".hidden.yaml"]
    for name in junk:
        (h.conf / name).write_text(drop_text("junk", h.model))
    (h.conf / ".git").mkdir()
    (h.conf / ".git" / "x.yaml").write_text(drop_text("junk", h.model))
    (h.conf / "team").mkdir()
    (h.conf / "team" / "b.yaml").write_text(drop_text("b", h.model))
    # atomic save: write a temporary name, then rename over the drop
    tmp = h.conf / ".a.yaml.tmp123"
    tmp.write_text(drop_text("a", h.model))
    os.replace(tmp, h.conf / "a.yaml")
    h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'done'") == [(2,)], what="two drops done")
    paths = sorted(p for (p,) in h.rows("SELECT path FROM jobs"))
    assert paths == [str(h.conf / "a.yaml"), str(h.conf / "team" / "b.yaml")]
    # a second atomic save with new content re-profiles
    tmp.write_text(drop_text("a", h.model, gmu=(0.75,)))
    os.replace(tmp, h.conf / "a.yaml")
    h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'done'") == [(3,)], what="re-profile")
    # deletion retires the drop: rows kept, proposal file removed
    proposal = Path(h.settings.state_dir) / "proposals" / "a.yaml"
    assert proposal.exists()
    (h.conf / "a.yaml").unlink()
    h.until(d, lambda: not proposal.exists(), what="proposal file removed")
    assert h.rows("SELECT count(*) FROM drops WHERE path = ? AND retired_at IS NULL", str(h.conf / "a.yaml")) == [(0,)]
    assert h.rows("SELECT count(*) FROM proposals p JOIN drops d ON d.id = p.drop_id WHERE d.name = 'a'") == [(2,)]
    assert h.rows("SELECT count(*) FROM jobs WHERE path = ? AND retired_at IS NULL", str(h.conf / "a.yaml")) == [(0,)]
    assert (Path(h.settings.state_dir) / "proposals" / "b.yaml").exists()
    # recreated with the old content: it is a drop again
    (h.conf / "a.yaml").write_text(drop_text("a", h.model, gmu=(0.75,)))
    h.until(d, lambda: proposal.exists(), what="drop recreated")
    # b has a's settings (only the name differs) and the recreated a the 0.75 version's: both are
    # answered from the stored results (tuner.store.fleet.result_key), so only two workers ran
    assert len(worker_calls(tmp_path)) == 2
    shared = h.rows("SELECT d.name, s.content FROM drops d JOIN drops s ON s.id = d.answered_from_drop_id ORDER BY d.id")
    assert [(n, "0.75" in c) for n, c in shared] == [("b", False), ("a", True)]


def _shell_fake(tmp_path: Path, model: Path) -> Path:
    """A /bin/sh worker (a few ms per call): logs the drop name, replies with a canned result made
    once by the Python fake. rows_for_store takes the drop's identity from the daemon, not the reply."""
    import json
    import subprocess
    import sys

    from tests._daemon_helpers import FAKE_WORKER

    request = {"drop": {"name": "canned", "content_sha256": "0" * 64, "max_num_batched_tokens": None,
                        "candidates": {"gpu_memory_utilization": [0.5], "max_model_len": [1024]}},
               "device": {"name": "H100-80GB", "total_memory_bytes": H100}}
    env = {k: v for k, v in os.environ.items() if k != "FAKE_WORKER_LOG"}
    reply = subprocess.run([sys.executable, "-S", str(FAKE_WORKER)], input=json.dumps(request), env=env,
                           capture_output=True, text=True, check=True).stdout
    (tmp_path / "canned.json").write_text(reply)
    sh = tmp_path / "fast-python"
    sh.write_text("#!/bin/sh\nreq=$(cat)\n"
                  f"printf '%s\\n' \"$req\" | grep -o '\"name\": \"[^\"]*\"' | head -n 1 >> {tmp_path / 'worker.log'}\n"
                  f"cat {tmp_path / 'canned.json'}\n")
    sh.chmod(0o755)
    return sh


def test_200_drops_written_at_once_are_each_profiled_exactly_once(tmp_path, tiny_config):
    base = fast_tmp(tmp_path)  # tmpfs: this test counts jobs; fsync latency would only slow it down
    h = Harness(base, tiny_config)
    # the /bin/sh stand-in speaks the one-request protocol only: a fresh worker per job (worker_max_jobs 1)
    h.settings = h.settings.__class__(**{**h.settings.__dict__, "worker_python": str(_shell_fake(base, tiny_config)),
                                         "worker_max_jobs": 1})
    d = h.start()
    for i in range(200):  # distinct settings: none is answered from another's stored result
        (h.conf / f"d{i:03d}.yaml").write_text(drop_text(f"d{i:03d}", h.model, max_num_seqs=i + 1))
    h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'done'") == [(200,)], timeout_s=60,
            what="200 jobs done")
    names = worker_calls(base)
    assert len(names) == 200 and len(set(names)) == 200 and names[0].startswith('"name": "d')
    assert h.rows("SELECT status, count(*) FROM jobs GROUP BY status") == [("done", 200)]
    assert h.rows("SELECT count(*), count(DISTINCT name) FROM drops") == [(200, 200)]
    assert h.rows("SELECT count(*) FROM proposals") == [(200,)]
    assert len(list((Path(h.settings.state_dir) / "proposals").glob("*.yaml"))) == 200
    h.close()
    if base != tmp_path:
        shutil.rmtree(base)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(8))


def _malformed(h: Harness, outside: Path) -> list[tuple[str, bytes | str, str, str | None]]:
    """(file name, content or special action, text the error must contain, field or None)."""
    good = drop_text("ok", h.model)
    return [
        ("bad-yaml.yaml", "name: [x\n", "not valid YAML", None),
        ("bomb.yaml", BOMB, "YAML bomb", None),
        ("recursive.yaml", "&a [*a]\n", "YAML bomb", None),
        ("list.yaml", "- a\n- b\n", "top level must be a mapping", None),
        ("empty.yaml", "", "drop is empty", None),
        ("wrong-type.yaml", good + "tensor_parallel_size: two\n", "must be an integer", "tensor_parallel_size"),
        ("unknown-key.yaml", good + "colour: red\n", "unknown key 'colour'", "colour"),
        ("no-name.yaml", good.replace("name: ok\n", ""), "required key 'name'", "name"),
        ("unknown-model.yaml", drop_text("um", "./no-such-model"), "no config.json found", "model"),
        ("absurd-gmu.yaml", drop_text("ag", h.model, gmu=(7,)), "must be in (0, 1]",
         "candidates.gpu_memory_utilization[0]"),
        ("absurd-len.yaml", good.replace("- 1024", "- 1000000000000"), "between 1 and 16777216",
         "candidates.max_model_len[0]"),
        ("trust.yaml", good + "trust_remote_code: true\n", "never by a drop", "trust_remote_code"),
        ("latin1.yaml", b"name: caf\xe9\n", "not UTF-8", None),
        ("huge.yaml", good + "#" * (300 * 1024) + "\n", "larger than 256 KiB", None),
        ("dup.yaml", good + "name: again\n", "duplicate key 'name'", "name"),
        ("device.yaml", drop_text("dv", h.model, device="Z80-8KB"), "unknown device", "device"),
        ("pytag.yaml", "!!python/object/apply:os.system ['touch /tmp/pwned']\n", "not valid YAML", None),
        ("nul.yaml", good + "\x00\n", "NUL byte", None),
        # a release newer than the modelled ones is answered (issue 29); one before the oldest is refused
        ("engine.yaml", drop_text("ev", h.model, engine_version="0.3.0"), "engine_version", "engine_version"),
        ("method.yaml", drop_text("me", h.model, method="cuda"), "needs a GPU host", "method"),
        ("name-path.yaml", drop_text("../../etc/passwd", h.model), "must be 1–128 characters", "name"),
        ("model-path.yaml", drop_text("mp", "/etc/passwd"), "no config.json found", "model"),
        ("symlink-out.yaml", ("symlink", outside), "outside the watched directory", None),
        ("fifo.yaml", ("fifo", None), "not a regular file", None),
        ("dangling.yaml", ("symlink", h.conf / "nowhere"), "a dangling symlink", None),
        ("loop.yaml", ("symlink", h.conf / "loop.yaml"), "a symlink loop", None),
    ]


def test_malformed_drops_each_give_an_error_row_and_a_log_line(h, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tuner.daemon.service")
    outside = tmp_path / "secret.yaml"
    outside.write_text("password: hunter2\n")
    cases = _malformed(h, outside)
    assert len(cases) >= 15
    d = h.start()
    for name, content, _, _ in cases:
        path = h.conf / name
        if isinstance(content, tuple):
            if content[0] == "symlink":
                path.symlink_to(content[1])
            else:
                os.mkfifo(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    h.until(d, lambda: h.rows("SELECT count(DISTINCT path) FROM jobs WHERE status = 'failed'") == [(len(cases),)],
            what="every malformed drop failed")
    log_text = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
    for name, _, needle, field in cases:
        status, error_type, error, attempts, _pid = h.job(name)
        path = str(h.conf / name)
        assert status == "failed" and error_type == "DropError", name
        assert needle in error, (name, error)
        where = f"{path}:{field}" if field else path
        assert error.startswith(where + ":"), (name, error)
        assert where in log_text, name
    assert "hunter2" not in log_text  # a symlink out of the directory is never read
    assert not Path("/tmp/pwned").exists()
    assert len(worker_calls(tmp_path)) == 0  # none reached a worker
    # the daemon is up: a good drop is still profiled
    (h.conf / "good.yaml").write_text(drop_text("good", h.model))
    h.until(d, lambda: h.job("good.yaml")[0] == "done", what="the good drop")


def test_crashing_hanging_and_failing_workers_are_recorded_and_the_daemon_stays_up(tmp_path, tiny_config, monkeypatch):
    monkeypatch.setenv("FAKE_WORKER_LOG", str(tmp_path / "worker.log"))
    h = Harness(tmp_path, tiny_config, job_timeout_s=1.5, max_attempts=2, retry_backoff_s=0.0)
    try:
        d = h.start()
        for name in ("crash-a", "hang-b", "typed-c"):
            (h.conf / f"{name}.yaml").write_text(drop_text(name, h.model))
        h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'failed'") == [(3,)], timeout_s=25,
                what="three failed jobs")
        # run failures (a crash, a timeout) are retried up to max_attempts; each attempt is in history
        status, kind, error, attempts, pid = h.job("crash-a.yaml")
        assert (status, kind, attempts) == ("failed", "WorkerError", 2)
        assert "killed by signal 9" in error and "CUDA out of memory" in error
        status, kind, error, attempts, pid = h.job("hang-b.yaml")
        assert (status, kind, attempts) == ("failed", "WorkerTimeout", 2) and "exceeded 1.5 s" in error
        poll(lambda: not group_alive(pid), 5, what="the whole group (worker and its child) killed")
        status, kind, error, attempts, pid = h.job("typed-c.yaml")
        # the worker's typed error keeps its class (error_type) and its text; a drop failure is final at once
        assert (status, kind, attempts) == ("failed", "PluginError", 1) and "plugin generic: no architecture" in error
        kinds = dict(h.rows("SELECT path, failure_kind FROM jobs"))
        assert [kinds[str(h.conf / f"{n}.yaml")] for n in ("crash-a", "hang-b", "typed-c")] == ["run", "run", "drop"]
        import json
        (hist,), = h.rows("SELECT history FROM jobs WHERE path = ?", str(h.conf / "crash-a.yaml"))
        assert [(e["attempt"], e["kind"], e["error_type"]) for e in json.loads(hist)] == [
            (1, "run", "WorkerError"), (2, "run", "WorkerError")]
        (h.conf / "fine.yaml").write_text(drop_text("fine", h.model))
        h.until(d, lambda: h.job("fine.yaml")[0] == "done", what="a good drop after the failures")
    finally:
        h.close()


def test_a_reader_holding_the_database_never_fails_a_daemon_write(h, tmp_path):
    h.sqlite_only()
    d = h.start()
    reader = sqlite3.connect(h.db, timeout=0, isolation_level=None)
    snap_reader = sqlite3.connect(f"file:{h.settings.snapshot_file}?mode=ro", uri=True, isolation_level=None)
    try:
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM jobs").fetchone() == (0,)  # holds a read snapshot
        snap_reader.execute("BEGIN")
        assert snap_reader.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
        for i in range(5):
            (h.conf / f"r{i}.yaml").write_text(drop_text(f"r{i}", h.model))
        h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'done'") == [(5,)], what="5 done")
        assert h.rows("SELECT count(*) FROM jobs WHERE status != 'done'") == [(0,)]
        assert reader.execute("SELECT count(*) FROM jobs").fetchone() == (0,)  # still its old snapshot
        reader.execute("COMMIT")
        assert reader.execute("SELECT count(*) FROM drops").fetchone() == (5,)
        # the snapshot: a plain (non-WAL) file, refreshed atomically, old readers undisturbed
        d._snapshot()
        assert snap_reader.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
        snap_reader.execute("COMMIT")
    finally:
        reader.close()
        snap_reader.close()
    fresh = sqlite3.connect(f"file:{h.settings.snapshot_file}?mode=ro", uri=True)
    try:
        assert fresh.execute("PRAGMA journal_mode").fetchone() == ("delete",)
        assert fresh.execute("SELECT count(*) FROM proposals").fetchone() == (5,)
    finally:
        fresh.close()
    assert oct(h.settings.snapshot_file.stat().st_mode & 0o777) == "0o644"


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_periodic_rescan_catches_a_dead_observer_and_a_recreated_directory(h, tmp_path):
    clock = FakeClock()
    d = h.start(clock=clock)

    def step():  # the injected clock ticks 0.1 s per iteration: debounce passes, rescans do not
        clock.t += 0.1
        d.step(max_wait_s=0.02)

    # the observer dies silently: events stop, the periodic rescan still finds the drop
    d.watcher._observer.stop()
    d.watcher._observer.join()
    (h.conf / "a.yaml").write_text(drop_text("a", h.model))
    for _ in range(10):
        step()
    assert h.rows("SELECT count(*) FROM jobs") == [(0,)]
    clock.t += h.settings.rescan_interval_s
    poll(lambda: h.job("a.yaml")[0] == "done", 10, step=step, what="rescan found the drop")
    assert d.watcher.healthy()  # restarted by the rescan
    # the directory is deleted and recreated: its old inotify watch is gone
    shutil.rmtree(h.conf)
    clock.t += h.settings.rescan_interval_s
    for _ in range(5):
        step()
    assert h.job("a.yaml")[0] == "done"  # a missing watch_dir retires nothing
    h.conf.mkdir()
    (h.conf / "b.yaml").write_text(drop_text("b", h.model))
    clock.t += h.settings.rescan_interval_s
    poll(lambda: h.job("b.yaml")[0] == "done", 10, step=step, what="drop in recreated dir")
    assert h.rows("SELECT retired_at IS NOT NULL FROM jobs WHERE path = ?", str(h.conf / "a.yaml")) == [(1,)]
    assert d.watcher.healthy()
    # and events flow again from the new directory (no clock advance needed)
    (h.conf / "c.yaml").write_text(drop_text("c", h.model))
    poll(lambda: h.job("c.yaml")[0] == "done", 10, step=step, what="event from recreated dir")


def test_sigterm_during_a_job_returns_it_to_the_queue_and_it_completes_after_restart(h, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SLOW_S", "30")
    d = h.start()
    (h.conf / "slow-a.yaml").write_text(drop_text("slow-a", h.model))
    h.until(d, lambda: h.job("slow-a.yaml")[4], what="the worker started")
    pid = h.job("slow-a.yaml")[4]
    os.killpg(pid, 0)  # alive
    d.request_stop()  # what SIGTERM does
    d.step(max_wait_s=0)
    d.shutdown()
    assert h.job("slow-a.yaml")[:4] == ("pending", None, None, 0)  # the interrupted attempt is not counted
    poll(lambda: not group_alive(pid), 5, what="worker group killed")
    monkeypatch.setenv("FAKE_SLOW_S", "0")
    d2 = h.start()
    h.until(d2, lambda: h.job("slow-a.yaml")[0] == "done", what="job done after restart")
    assert h.rows("SELECT count(*), max(attempts) FROM jobs") == [(1, 1)]
    assert h.rows("SELECT count(*) FROM drops") == [(1,)]


def test_sighup_reload_applies_new_settings_and_bad_settings_keep_the_old(h, tmp_path):
    from tests._daemon_helpers import write_settings
    from tuner.daemon.settings import load_settings

    path = write_settings(tmp_path, job_timeout_s=20.0)
    h.settings = load_settings(path)
    d = h.start()
    path.write_text(path.read_text().replace("job_timeout_s: 20.0", "job_timeout_s: 7.0"))
    d.request_reload()
    d.step(max_wait_s=0)
    assert d.settings.job_timeout_s == 7.0
    path.write_text(path.read_text() + "colour: red\n")
    d.request_reload()
    d.step(max_wait_s=0)
    assert d.settings.job_timeout_s == 7.0  # the invalid file was refused, the daemon runs on
    assert d.reconciles >= 2


def test_signal_handlers_only_set_flags(h):
    d = h.start()
    d._install_signals()
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        poll(lambda: d.reload_requested, 2, what="flag")
        d.step(max_wait_s=0)
        assert not d.reload_requested
    finally:
        d._restore_signals()


def test_a_locked_database_delays_the_save_then_the_job_is_stored_once(h, tmp_path, monkeypatch, caplog):
    """A foreign writer holding the lock past busy_timeout: the finished result waits in memory
    and is retried; the daemon neither dies nor loses or duplicates the job."""
    h.sqlite_only()
    from tuner.store.database import open_store

    monkeypatch.setenv("FAKE_SLOW_S", "0.5")
    d = h.start(store_factory=lambda url: open_store(url, busy_timeout_s=0.1))
    (h.conf / "slow-a.yaml").write_text(drop_text("slow-a", h.model))
    h.until(d, lambda: h.job("slow-a.yaml")[4], what="the worker started")
    locker = sqlite3.connect(h.db, timeout=0, isolation_level=None)
    try:
        locker.execute("BEGIN IMMEDIATE")
        h.until(d, lambda: d._unsaved is not None and any("locked" in r.getMessage() for r in caplog.records),
                what="a failed save attempt")
        assert h.rows("SELECT status FROM jobs") == [("running",)]
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    h.until(d, lambda: h.job("slow-a.yaml")[0] == "done", what="saved after the lock went away")
    assert h.rows("SELECT count(*) FROM drops") == [(1,)] and d._unsaved is None


def test_shutdown_leaves_no_threads_or_worker_processes(h, monkeypatch):
    import threading

    monkeypatch.setenv("FAKE_SLOW_S", "30")
    before = set(threading.enumerate())
    d = h.start()
    (h.conf / "slow-a.yaml").write_text(drop_text("slow-a", h.model))
    h.until(d, lambda: h.job("slow-a.yaml")[4], what="the worker started")
    pid = h.job("slow-a.yaml")[4]
    d.shutdown()
    poll(lambda: set(threading.enumerate()) <= before, 5, what="threads joined")
    assert not group_alive(pid)


# --- settings and drops a tester tripped over -----------------------------------------------------


def _no_gpu_nvml():
    import types

    import pynvml

    def no_library():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    return types.SimpleNamespace(NVMLError=pynvml.NVMLError, nvmlInit=no_library, nvmlShutdown=lambda: None)


@pytest.mark.parametrize("over, field", [
    ({"state_dir": "/proc/ctx-tuner-nope/state"}, "state_dir"),
    ({"worker_python": "/nonexistent/python3"}, "worker_python"),
    ({"worker_python": "NOTEXEC"}, "worker_python"),
    ({"worker_python": "no-such-python-command-xyz"}, "worker_python"),
])
def test_daemon_start_with_unusable_settings_is_one_line_exit_2(tmp_path, capsys, over, field):
    from tests._daemon_helpers import write_settings
    from tuner.cli import main

    if over.get("worker_python") == "NOTEXEC":
        plain = tmp_path / "python-not-executable"
        plain.write_text("#!/bin/sh\n")
        plain.chmod(0o644)
        over = {"worker_python": str(plain)}
    path = write_settings(tmp_path, **over)
    rc = main(["daemon", "--settings", str(path)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{path}:{field}:" in err


def test_two_drops_with_one_name_are_warned_about(h, caplog):
    caplog.set_level(logging.INFO, logger="tuner.daemon.service")
    d = h.start()
    (h.conf / "a.yaml").write_text(drop_text("same", h.model))
    (h.conf / "b.yaml").write_text(drop_text("same", h.model))
    h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'done'") == [(2,)], what="both jobs done")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "'same'" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert str(h.conf / "a.yaml") in warnings[0] and str(h.conf / "b.yaml") in warnings[0]
    before = d.reconciles
    d.reconcile()  # a rescan of the same files does not repeat the warning
    assert d.reconciles == before + 1
    assert len([r for r in caplog.records if r.levelno == logging.WARNING and "'same'" in r.getMessage()]) == 1


def test_default_method_error_names_the_setting_not_the_drop(tmp_path, tiny_config, monkeypatch):
    harness = Harness(tmp_path, tiny_config, default_method="cuda", source=str(tmp_path / "tuner.yaml"))
    try:
        d = harness.start(nvml=_no_gpu_nvml())
        (harness.conf / "plain.yaml").write_text(drop_text("plain", harness.model))  # no `method` key
        (harness.conf / "own.yaml").write_text(drop_text("own", harness.model, method="cuda"))
        harness.until(d, lambda: harness.job("plain.yaml")[0] == "failed" and harness.job("own.yaml")[0] == "failed",
                      what="both jobs failed")
        status, kind, error, _, _ = harness.job("plain.yaml")
        assert kind == "SettingsError" and error.startswith(f"{tmp_path / 'tuner.yaml'}:default_method:")
        assert "the drop sets no `method`" in error and "needs a GPU host" in error
        status, kind, error, _, _ = harness.job("own.yaml")
        assert kind == "DropError" and error.startswith(f"{harness.conf / 'own.yaml'}:method:")
    finally:
        harness.close()

"""The daemon as a fleet member, in-process, on each backend (``db_url``: a SQLite file and a
PostgreSQL database; the latter skipped without CTX_TUNER_TEST_DATABASE_URL): ownership and the
hosts row, look-ups through read-only stores, shared results across hosts, no foreign retirement,
and a database outage that the daemon rides out."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests._daemon_helpers import drop_text, poll, settings_for
from tuner.daemon.service import DB_RETRY_S, Daemon
from tuner.errors import StoreError
from tuner.daemon.notify import Notifier


class Fleet:
    def __init__(self, tmp_path: Path, db_url: str, model: Path) -> None:
        self.tmp, self.url, self.model = tmp_path, db_url, model
        self.daemons: list[Daemon] = []
        self.eng = sa.create_engine(db_url, poolclass=sa.pool.NullPool)

    def start(self, tag: str, **over) -> Daemon:
        base = self.tmp / tag
        base.mkdir(exist_ok=True)
        s = settings_for(base, database_url=self.url, host_id=f"host-{tag}", **over)
        d = Daemon(s, notifier=Notifier({}))
        self.daemons.append(d)
        d.start()
        return d

    def rows(self, sql: str, **params) -> list[tuple]:
        with self.eng.connect() as c:
            return [tuple(r) for r in c.execute(sa.text(sql), params)]

    def until(self, d: Daemon, predicate, timeout_s: float = 20.0, what: str = "condition"):
        return poll(predicate, timeout_s, step=lambda: d.step(max_wait_s=0.05), what=what)

    def close(self) -> None:
        for d in self.daemons:
            d.shutdown()
        self.eng.dispose()


@pytest.fixture
def fleet(tmp_path, db_url, tiny_config, monkeypatch):
    monkeypatch.setenv("FAKE_WORKER_LOG", str(tmp_path / "worker.log"))
    f = Fleet(tmp_path, db_url, tiny_config)
    yield f
    f.close()


def _worker_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "worker.log"
    return log.read_text().splitlines() if log.exists() else []


def test_drop_is_owned_by_its_daemon_whose_host_row_shows_in_sql(fleet, caplog):
    caplog.set_level(logging.WARNING, logger="tuner.daemon.service")
    d = fleet.start("a")
    conf = Path(d.settings.watch_dir)
    (conf / "x.yaml").write_text(drop_text("x", fleet.model))
    fleet.until(d, lambda: fleet.rows("SELECT 1 FROM jobs WHERE status = 'done'"), what="job done")
    [(host_id, watch_dir, pid, version, gpus, seen, lease)] = fleet.rows(
        "SELECT host_id, watch_dir, pid, tool_version, gpus, last_seen_at, lease_expires_at FROM hosts")
    assert (host_id, watch_dir, version, gpus) == ("host-a", str(conf), "0.1.0", "[]") and pid > 0
    assert lease > seen  # lease_expires_at = last_seen_at + lease_s (UTC text orders as time)
    assert fleet.rows("SELECT owner_id FROM jobs") == [(d.owner.id,)]
    assert fleet.rows("SELECT owner_id, result_sha256 IS NOT NULL FROM drops") == [(d.owner.id, True)]
    # regression: on PostgreSQL the read-only look-ups (calibration, shared results) were skipped
    assert not [r for r in caplog.records if "skipped" in r.getMessage()]
    # regression: on PostgreSQL an armed snapshot deadline in the past made the loop spin
    assert d._timeout() > 1.0


def test_a_drop_computed_on_one_host_is_answered_on_another_without_a_worker(fleet, tmp_path):
    a, b = fleet.start("a"), fleet.start("b")
    (Path(a.settings.watch_dir) / "x.yaml").write_text(drop_text("x", fleet.model, gmu=(0.5, 0.9)))
    fleet.until(a, lambda: fleet.rows("SELECT 1 FROM jobs WHERE status = 'done'"), what="a done")
    assert len(_worker_calls(tmp_path)) == 1
    # the same settings under another name and file on host b
    (Path(b.settings.watch_dir) / "y.yaml").write_text(drop_text("y", fleet.model, gmu=(0.5, 0.9)))
    fleet.until(b, lambda: len(fleet.rows("SELECT 1 FROM jobs WHERE status = 'done'")) == 2, what="b done")
    assert len(_worker_calls(tmp_path)) == 1  # no second worker
    [(src, key_a, key_b)] = fleet.rows(
        "SELECT y.answered_from_drop_id, x.result_sha256, y.result_sha256 FROM drops y JOIN drops x ON x.name = 'x' "
        "WHERE y.name = 'y'")
    assert key_a == key_b and src == fleet.rows("SELECT id FROM drops WHERE name = 'x'")[0][0]
    px = fleet.rows("SELECT gpu_memory_utilization, max_model_len, num_gpu_blocks FROM latest_proposals "
                    "WHERE drop_name = 'x' ORDER BY 1")
    py = fleet.rows("SELECT gpu_memory_utilization, max_model_len, num_gpu_blocks FROM latest_proposals "
                    "WHERE drop_name = 'y' ORDER BY 1")
    assert px == py and len(px) == 2
    assert (Path(b.settings.state_dir) / "proposals" / "y.yaml").is_file()
    assert fleet.rows("SELECT host_id, drop_name, from_shared_result FROM fleet_latest_proposals "
                      "WHERE gpu_memory_utilization = 0.5 ORDER BY host_id") == [("host-a", "x", 0), ("host-b", "y", 1)]
    [(device, hosts, drops, lo, hi)] = fleet.rows(
        "SELECT device_name, hosts, drops, min_max_model_len, max_max_model_len FROM fleet_by_device "
        "WHERE gpu_memory_utilization = 0.9")
    assert (device, hosts, drops, lo) == ("H100-80GB", 2, 2, hi)
    # other settings: a worker runs
    (Path(b.settings.watch_dir) / "z.yaml").write_text(drop_text("z", fleet.model, gmu=(0.6,)))
    fleet.until(b, lambda: len(fleet.rows("SELECT 1 FROM jobs WHERE status = 'done'")) == 3, what="z done")
    assert len(_worker_calls(tmp_path)) == 2


def test_same_file_name_on_two_hosts_each_keeps_its_own_drop_and_deletion_retires_only_its_own(fleet):
    a, b = fleet.start("a"), fleet.start("b")
    for d, gmu in ((a, 0.5), (b, 0.6)):
        (Path(d.settings.watch_dir) / "x.yaml").write_text(drop_text("x", fleet.model, gmu=(gmu,)))
    poll(lambda: len(fleet.rows("SELECT 1 FROM jobs WHERE status = 'done'")) == 2, 20,
         step=lambda: (a.step(max_wait_s=0.05), b.step(max_wait_s=0.05)), what="both done")
    b.reconcile()
    a.reconcile()
    assert fleet.rows("SELECT count(*) FROM drops WHERE retired_at IS NULL") == [(2,)]
    # `results` shows one latest drop per name and host (it used to keep only the newest per name)
    from tuner.reports.results import open_for_read, query, render

    ro = open_for_read(fleet.url)
    try:
        doc = query(ro)
    finally:
        ro.close()
    assert [(p["drop_name"], p["host_id"], p["gpu_memory_utilization"]) for p in doc["proposals"]] == [
        ("x", "host-a", 0.5), ("x", "host-b", 0.6)]
    assert "x@host-a" in render(doc) and "x@host-b" in render(doc)
    (Path(b.settings.watch_dir) / "x.yaml").unlink()
    fleet.until(b, lambda: fleet.rows("SELECT count(*) FROM drops WHERE retired_at IS NULL") == [(1,)],
                what="b's drop retired")
    a.reconcile()
    assert fleet.rows("SELECT d.owner_id, p.gpu_memory_utilization FROM drops d JOIN proposals p ON p.drop_id = d.id "
                      "WHERE d.retired_at IS NULL") == [(a.owner.id, 0.5)]
    assert "gpu_memory_utilization: 0.5" in (Path(a.settings.state_dir) / "proposals" / "x.yaml").read_text()
    assert not (Path(b.settings.state_dir) / "proposals" / "x.yaml").exists()


def test_database_down_daemon_keeps_watching_then_catches_up(fleet, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="tuner.daemon.service")
    d = fleet.start("a")
    conf = Path(d.settings.watch_dir)
    good = (d.store.engine, d.store._reader, d.queue.engine)
    dead_url = ("sqlite:///" + str(tmp_path / "no-such-dir" / "x.sqlite")
                if good[0].dialect.name == "sqlite" else "postgresql+psycopg://tuner@127.0.0.1:9/none")
    dead = sa.create_engine(dead_url)
    d.store.engine = d.queue.engine = dead
    d.store._reader = dead
    try:
        (conf / "x.yaml").write_text(drop_text("x", fleet.model))
        for _ in range(10):
            d.step(max_wait_s=0.05)  # never raises: errors are logged, the loop goes on
        assert any("database unavailable (" in r.getMessage() and "still watching" in r.getMessage()
                   for r in caplog.records)
        assert d._next_rescan - d.clock() <= DB_RETRY_S  # a failed scan is retried soon
        assert d._errors == 0  # an outage is not an unhealthy loop: WATCHDOG=1 goes on
        assert fleet.rows("SELECT count(*) FROM jobs") == [(0,)]
    finally:
        d.store.engine, d.store._reader, d.queue.engine = good
        dead.dispose()
    d._next_rescan = d.clock()  # the retry is due (no sleep in the test)
    fleet.until(d, lambda: fleet.rows("SELECT status FROM jobs") == [("done",)], what="caught up")
    assert any("database reachable again" in r.getMessage() for r in caplog.records)
    assert (Path(d.settings.state_dir) / "proposals" / "x.yaml").is_file()


def test_finished_results_wait_for_the_database_and_are_saved_once(fleet):
    d = fleet.start("a")
    conf = Path(d.settings.watch_dir)
    (conf / "x.yaml").write_text(drop_text("x", fleet.model))
    fleet.until(d, lambda: d._running is not None, what="job running")
    good = (d.store.engine, d.queue.engine)
    dead_url = ("sqlite:///" + str(fleet.tmp / "no-such-dir" / "x.sqlite")
                if good[0].dialect.name == "sqlite" else "postgresql+psycopg://tuner@127.0.0.1:9/none")
    dead = sa.create_engine(dead_url)
    d.store.engine = d.queue.engine = dead
    try:
        poll(lambda: d._unsaved is not None, 20, step=lambda: d.step(max_wait_s=0.05), what="result held unsaved")
    finally:
        d.store.engine, d.queue.engine = good
        dead.dispose()
    d._retry_at = d.clock()
    fleet.until(d, lambda: fleet.rows("SELECT status FROM jobs") == [("done",)], what="saved after the outage")
    assert fleet.rows("SELECT count(*) FROM drops") == [(1,)]


def _lost_connection() -> StoreError:
    """A StoreError as the store raises it when the server closes the connection."""
    err = StoreError("job queue write failed: server closed the connection unexpectedly", where="test")
    err.__cause__ = sa.exc.OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))
    return err


def test_claim_committed_as_the_database_restarted_left_the_job_running_forever(fleet, tmp_path, caplog):
    """Regression (the PostgreSQL fleet test with the warm worker lost a drop: its job stayed
    ``running`` with no worker until the end): the claim committed but the daemon got a
    connection error back, so it never started the job and, its lease renewed, nobody requeued it.
    The daemon's heartbeat now returns its own ``running`` jobs that it does not hold to the queue."""
    caplog.set_level(logging.WARNING, logger="tuner.daemon.service")
    d = fleet.start("a")
    real = d.queue.claim_next
    lost = []

    def claim_then_lose_the_reply(now=None):
        job = real(now=now)
        if job is not None and not lost:
            lost.append(job.id)
            raise _lost_connection()  # committed; the reply never arrived
        return job

    d.queue.claim_next = claim_then_lose_the_reply
    (Path(d.settings.watch_dir) / "x.yaml").write_text(drop_text("x", fleet.model))
    fleet.until(d, lambda: lost, what="the claim")
    for _ in range(5):
        d.step(max_wait_s=0.01)
    assert d._running is None and fleet.rows("SELECT status FROM jobs") == [("running",)]  # stranded
    d._next_beat = d.clock()  # the heartbeat is due (no sleep)
    fleet.until(d, lambda: fleet.rows("SELECT status FROM jobs") == [("done",)], what="the stranded job done")
    assert fleet.rows("SELECT attempts, interruptions FROM jobs") == [(1, 1)]  # the lost claim not counted
    assert len(_worker_calls(tmp_path)) == 1
    assert (Path(d.settings.state_dir) / "proposals" / "x.yaml").is_file()
    assert any("claimed but never started" in r.getMessage() for r in caplog.records)


def test_job_failure_while_the_database_was_down_was_dropped_and_the_job_left_running(fleet):
    """Regression: the failure of a job that ended while the database was unreachable was not
    written and then forgotten (the finished-event consumed), leaving the job ``running``. It is
    kept and written once the database answers, as finished results are."""
    d = fleet.start("a")
    (Path(d.settings.watch_dir) / "t.yaml").write_text(drop_text("typed-t", fleet.model))
    fleet.until(d, lambda: d._running is not None, what="job running")
    good = (d.store.engine, d.queue.engine)
    dead_url = ("sqlite:///" + str(fleet.tmp / "no-such-dir" / "x.sqlite")
                if good[0].dialect.name == "sqlite" else "postgresql+psycopg://tuner@127.0.0.1:9/none")
    dead = sa.create_engine(dead_url)
    d.store.engine = d.queue.engine = dead
    try:
        poll(lambda: d._running is None, 20, step=lambda: d.step(max_wait_s=0.05), what="the job finished")
        d.step(max_wait_s=0.01)
    finally:
        d.store.engine, d.queue.engine = good
        dead.dispose()
    d._retry_at = d.clock()
    fleet.until(d, lambda: fleet.rows("SELECT status, error_type FROM jobs") == [("failed", "PluginError")],
                timeout_s=10, what="the failure written after the outage")
    assert fleet.rows("SELECT attempts, interruptions FROM jobs") == [(1, None)]


def test_daemon_opened_two_read_only_stores_for_every_job(fleet, monkeypatch):
    """Regression (issue 13's drop → proposal time): each job opened a read-only store for its
    look-ups and another for the pass memo (an engine, a connection and a schema check each).
    The job thread keeps one read-only store from its first job to shutdown."""
    import tuner.daemon.service as daemon_mod

    opened = []
    real = daemon_mod.open_store

    def counting(url, **kw):
        store = real(url, **kw)
        if kw.get("readonly"):
            opened.append(store)
        return store

    monkeypatch.setattr(daemon_mod, "open_store", counting)
    d = fleet.start("a")
    conf = Path(d.settings.watch_dir)
    for i in range(3):
        (conf / f"r{i}.yaml").write_text(drop_text(f"r{i}", fleet.model, gmu=(0.5 + 0.1 * i,)))
        fleet.until(d, lambda: len(fleet.rows("SELECT 1 FROM jobs WHERE status = 'done'")) == i + 1, what=f"r{i} done")
    assert len(opened) == 1 and d._ro_store is opened[0]
    d.shutdown()
    assert d._ro_store is None

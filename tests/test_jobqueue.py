"""The jobs table: supersede, claim, complete atomically with the results, fail, requeue, recover,
retire — against a real SQLite file and a real PostgreSQL database (``db_url``; skipped without
CTX_TUNER_TEST_DATABASE_URL). Ownership and leases (fleet): each queue sees only its owner's jobs
and drops; concurrent claimers never claim one job twice."""

from __future__ import annotations

import pytest

from tuner.errors import DropError, WorkerError
from tuner.store.fleet import OwnerBusy, register_owner, renew_lease
from tuner.store.jobqueue import JobNotRunning, JobQueue
from tuner.store.database import open_store, utc_text


@pytest.fixture
def q(db_url):
    store = open_store(db_url)
    yield JobQueue(store)
    store.close()


def _drop(path: str, name: str = "a") -> dict:
    return {"name": name, "path": path, "content_sha256": "a" * 64, "content": "x", "model": "m",
            "device_name": "H100-80GB", "engine_version": "0.19.0", "method": "simulate"}


def _save(q, job, name="a"):
    return q.store.save_result(_drop(job.path, name), [], [], [], also=lambda c, i: q.complete_in(c, job.id, i))


def test_supersede_claim_complete_and_retire(q):
    j1 = q.enqueue("/d/a.yaml", "1" * 64, "v1")
    j2 = q.enqueue("/d/a.yaml", "2" * 64, "v2")  # newer content before j1 ran
    assert q.get(j1.id).status == "cancelled" and "superseded" in q.get(j1.id).error
    assert q.current()["/d/a.yaml"].id == j2.id
    claimed = q.claim_next()
    assert (claimed.id, claimed.status, claimed.attempts) == (j2.id, "running", 1)
    assert q.claim_next() is None
    drop_id = _save(q, claimed)
    done = q.get(j2.id)
    assert (done.status, done.drop_id) == ("done", drop_id)
    # a newer version completing retires the older drop row of the same path
    j3 = q.enqueue("/d/a.yaml", "3" * 64, "v3")
    drop2 = _save(q, q.claim_next())
    assert q.active_drop_ids(["a"]) == {"a": drop2}
    assert q.retire_path("/d/a.yaml") == ["a"]
    assert q.active_drop_ids(["a"]) == {} and q.current() == {}
    assert q.get(j3.id).retired_at is not None
    assert q.counts() == {"pending": 0, "running": 0, "done": 2, "failed": 0, "cancelled": 1}


def test_results_of_a_job_that_is_no_longer_running_are_rolled_back(q):
    job = q.enqueue("/d/a.yaml", "1" * 64, "v1")
    claimed = q.claim_next()
    q.fail(claimed.id, WorkerError("boom", where="a"))
    with pytest.raises(JobNotRunning):
        _save(q, claimed)
    with q.store.engine.connect() as c:
        assert c.exec_driver_sql("SELECT count(*) FROM drops").scalar() == 0
    failed = q.get(job.id)
    assert (failed.status, failed.error_type, failed.error) == ("failed", "WorkerError", "a: boom")


def test_invalid_drop_is_a_failed_row_at_once(q):
    err = DropError("must be an integer", path="/d/b.yaml", field="tensor_parallel_size")
    job = q.record_invalid("/d/b.yaml", "4" * 64, "tensor_parallel_size: two", err)
    assert (job.status, job.attempts, job.error_type) == ("failed", 0, "DropError")
    assert job.error == "/d/b.yaml:tensor_parallel_size: must be an integer"
    assert q.claim_next() is None


def test_requeue_does_not_count_and_daemon_crashes_never_leave_a_drop_failed(q):
    """Issue 15 item 2: three daemon crashes during one job used to fail it for good."""
    from datetime import datetime, timedelta, timezone

    job = q.enqueue("/d/a.yaml", "1" * 64, "v1", name="a")
    q.claim_next()
    q.requeue(job.id)  # graceful stop
    assert (q.get(job.id).status, q.get(job.id).attempts) == ("pending", 0)
    t0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
    for n in range(1, 6):  # five crashes while running, more than max_attempts
        claimed = q.claim_next(now=t0 + timedelta(days=n))
        assert claimed is not None and claimed.attempts == 1
        requeued, failed = q.recover(3, backoff_base_s=10, backoff_max_s=60, now=t0 + timedelta(days=n))
        assert [j.id for j in requeued] == [job.id] and failed == []
        j = q.get(job.id)
        assert (j.status, j.attempts, j.interruptions) == ("pending", 0, n)
        assert j.retry_at == utc_text(t0 + timedelta(days=n, seconds=min(60, 10 * 2 ** (n - 1))))
    assert [e["kind"] for e in q.get(job.id).failures] == ["interrupted"] * 5
    # backoff: not claimable before retry_at
    assert q.claim_next(now=t0 + timedelta(days=5, seconds=59)) is None
    assert q.claim_next(now=t0 + timedelta(days=5, seconds=60)).id == job.id


def test_failed_run_is_retried_with_backoff_but_a_failed_drop_is_final(q):
    """Issue 15 item 2: a worker killed by the OOM killer stayed failed until the bytes changed."""
    from datetime import datetime, timedelta, timezone

    t0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
    run = q.enqueue("/d/run.yaml", "1" * 64, "v1", name="run")
    bad = q.enqueue("/d/bad.yaml", "2" * 64, "v2", name="bad")
    kw = dict(max_attempts=3, backoff_base_s=30, backoff_max_s=3600)
    c = q.claim_next(now=t0)
    assert c.id == run.id
    j = q.fail(c.id, WorkerError("worker crashed (killed by signal 9): oom", where="run"), now=t0, **kw)
    assert (j.status, j.failure_kind, j.attempts, j.retry_at) == ("pending", "run", 1,
                                                                 utc_text(t0 + timedelta(seconds=30)))
    c = q.claim_next(now=t0)
    assert c.id == bad.id  # the retry waits for its backoff; the next drop runs meanwhile
    j = q.fail(c.id, DropError("must be an integer", path="/d/bad.yaml", field="block_size"), now=t0, **kw)
    assert (j.status, j.failure_kind, j.attempts) == ("failed", "drop", 1)
    assert q.claim_next(now=t0 + timedelta(seconds=29)) is None
    c = q.claim_next(now=t0 + timedelta(seconds=30))
    j = q.fail(c.id, WorkerError("again", where="run"), now=t0, **kw)
    assert (j.status, j.attempts, j.retry_at) == ("pending", 2, utc_text(t0 + timedelta(seconds=60)))
    c = q.claim_next(now=t0 + timedelta(seconds=60))
    j = q.fail(c.id, WorkerError("third", where="run"), now=t0, **kw)
    assert (j.status, j.failure_kind, j.attempts) == ("failed", "run", 3)
    assert [(e["attempt"], e["kind"], e["reason"]) for e in j.failures] == [
        (1, "run", "run: worker crashed (killed by signal 9): oom"), (2, "run", "run: again"),
        (3, "run", "run: third")]
    # ctx-tuner retry NAME / --failed
    assert [x.id for x in q.retry(["run"])] == [run.id]
    j = q.get(run.id)
    assert (j.status, j.attempts, j.retry_at, len(j.failures)) == ("pending", 0, None, 3)
    assert [x.id for x in q.retry(all_failed=True)] == [bad.id]
    assert q.counts()["failed"] == 0


def test_one_pending_job_per_path_is_enforced_by_the_database(q):
    import sqlalchemy as sa

    from tuner.store.database import jobs_table, utc_text

    q.enqueue("/d/a.yaml", "1" * 64, "v1")
    with pytest.raises(sa.exc.IntegrityError):
        with q.engine.begin() as c:
            c.execute(jobs_table.insert().values(path="/d/a.yaml", content_sha256="2" * 64, status="pending",
                                                 attempts=0, created_at=utc_text(), owner_id=q.owner_id))
    other = register_owner(q.store, "other-host", "/d", lease_s=60).id
    JobQueue(q.store, other).enqueue("/d/a.yaml", "2" * 64, "v2")  # the same path on another host is its own


# -- fleet: ownership, leases, concurrent claimers ----------------------------------------------------


def _owner(store, host, watch_dir="/d", lease_s=60.0, **kw):
    return register_owner(store, host, watch_dir, lease_s=lease_s, **kw).id


def test_second_daemon_neither_requeues_nor_retires_a_live_hosts_jobs_and_drops(q):
    """Regression: a second daemon with another watch_dir requeued the first one's live jobs as
    "crashed" at start and retired its drops on reconcile."""
    a = JobQueue(q.store, _owner(q.store, "host-a", "/a"))
    b = JobQueue(q.store, _owner(q.store, "host-b", "/b"))
    done = a.enqueue("/a/x.yaml", "1" * 64, "v1")
    _save(a, a.claim_next(), name="x")
    live = a.enqueue("/a/y.yaml", "2" * 64, "v2")
    assert a.claim_next().id == live.id
    assert b.claim_next() is None  # never another owner's job
    assert b.current() == {} and b.counts()["running"] == 0
    assert b.recover(max_attempts=3) == ([], [])  # host-a's lease is live: its running job is left alone
    assert b.retire_path("/a/x.yaml") == []  # reconciliation of /b never retires host-a's drops
    assert a.active_drop_ids(["x"]) and a.get(live.id).status == "running"
    assert a.get(done.id).retired_at is None and b.active_drop_ids(["x"]) == {}


def test_expired_owners_running_jobs_return_to_the_queue_for_their_successor(q):
    dead = _owner(q.store, "host-dead", "/a", lease_s=5, wall_clock=lambda: 1_000_000.0)
    a = JobQueue(q.store, dead)
    job = a.enqueue("/a/x.yaml", "1" * 64, "v1")
    a.claim_next()
    b = JobQueue(q.store, _owner(q.store, "host-b", "/b"))
    requeued, failed = b.recover(max_attempts=3)  # now ≫ 1_000_005: the lease expired long ago
    assert [j.id for j in requeued] == [job.id] and failed == []
    assert (a.get(job.id).status, a.get(job.id).owner_id) == ("pending", dead)  # still the owner's
    assert b.claim_next() is None and a.claim_next().id == job.id  # only its successor runs it


def test_periodic_recovery_never_requeues_the_daemons_own_running_job(q):
    """Regression: the heartbeat's recovery included the daemon's own owner, so a job running
    longer than a third of the lease was requeued under its feet (then "interrupted 3 times")."""
    job = q.enqueue("/d/a.yaml", "1" * 64, "v1")
    q.claim_next()
    assert q.recover(max_attempts=3, include_own=False) == ([], [])
    assert q.get(job.id).status == "running"


def test_claim_read_back_after_its_commit_failed_and_stranded_the_job_running(q, monkeypatch):
    """Regression (fleet kill -9 + database restart with the warm worker, job left ``running``
    forever): the claim committed, then a second query read the row back; the database restarting
    between the two raised StoreError, so the daemon never started a job the database had
    running. The row is read back in the claim's own transaction now."""
    from tuner.errors import StoreError

    job = q.enqueue("/d/a.yaml", "1" * 64, "v1")

    def gone(_job_id):
        raise StoreError("query failed: server closed the connection unexpectedly", where="test")

    monkeypatch.setattr(q, "get", gone)
    claimed = q.claim_next()
    assert (claimed.id, claimed.status, claimed.attempts, claimed.path) == (job.id, "running", 1, "/d/a.yaml")


def test_claim_whose_commit_reply_was_lost_is_requeued_by_the_owners_sweep_not_the_held_one(q):
    """Regression: a claim whose COMMIT reply the connection lost (the database restarted) left the
    job ``running`` under a live owner: no job thread ran it, its lease kept being renewed, nobody
    ever requeued it. ``recover(keep=held)`` (the daemon's heartbeat) returns such a job to the
    queue at once, uncounted and without backoff, and leaves the jobs the daemon holds alone."""
    held = q.enqueue("/d/held.yaml", "1" * 64, "v1")
    q.claim_next()
    stranded = q.enqueue("/d/lost.yaml", "2" * 64, "v2")
    q.claim_next()  # its claimer "never heard back"
    requeued, failed = q.recover(backoff_base_s=30.0, include_own=False, keep={held.id})
    assert [j.id for j in requeued] == [stranded.id] and failed == []
    row = q.get(stranded.id)
    assert (row.status, row.attempts, row.interruptions) == ("pending", 0, 1)
    assert row.retry_at <= utc_text() and "never started" in row.failures[-1]["reason"]
    assert q.get(held.id).status == "running"
    assert q.claim_next().id == stranded.id  # due now: no backoff for a drop that did nothing wrong


def test_renewed_lease_keeps_running_jobs_owned_and_running(q):
    me = _owner(q.store, "host-a", "/a", lease_s=5, wall_clock=lambda: 1_000_000.0)
    a = JobQueue(q.store, me)
    job = a.enqueue("/a/x.yaml", "1" * 64, "v1")
    a.claim_next()
    renew_lease(q.store, me, lease_s=5, wall_clock=lambda: 1_000_100.0)
    b = JobQueue(q.store, _owner(q.store, "host-b", "/b"))
    assert b.recover(max_attempts=3, now="1970-01-12T13:48:21.000000Z") == ([], [])  # 1_000_101: live
    assert a.get(job.id).status == "running"


def test_a_live_owner_identity_is_refused_and_a_dead_one_taken_over(q):
    store = q.store
    first = _owner(store, "host-a", "/a", pid=111, pid_alive=lambda pid: True)
    with pytest.raises(OwnerBusy, match="host-a.*pid 111"):
        _owner(store, "host-a", "/a", pid=222, pid_alive=lambda pid: True)
    assert _owner(store, "host-a", "/a", pid=222, pid_alive=lambda pid: False) == first  # kill -9'd: successor
    assert _owner(store, "host-a", "/b", pid=333, pid_alive=lambda pid: True) != first  # another watch dir


def test_adopt_takes_only_ownerless_rows_inside_the_watch_dir(q):
    import sqlalchemy as sa

    from tuner.store.database import drops_table, jobs_table, utc_text

    with q.engine.begin() as c:
        for path in ("/w/a.yaml", "/w/sub/b.yaml", "/wx/c.yaml"):
            c.execute(jobs_table.insert().values(path=path, content_sha256="1" * 64, status="done", attempts=1,
                                                 created_at=utc_text(), owner_id=None))
            c.execute(drops_table.insert().values(**{**_drop(path), "created_at": utc_text()}))
    mine = JobQueue(q.store, _owner(q.store, "host-w", "/w"))
    assert mine.adopt("/w") == 2
    assert sorted(j.path for j in mine.jobs()) == ["/w/a.yaml", "/w/sub/b.yaml"]
    with q.engine.connect() as c:
        rows = c.execute(sa.select(drops_table.c.path, drops_table.c.owner_id).order_by(drops_table.c.path)).all()
    assert rows == [("/w/a.yaml", mine.owner_id), ("/w/sub/b.yaml", mine.owner_id), ("/wx/c.yaml", None)]


def _claimer(url: str, owner_id: int, out, start) -> None:
    from tuner.store.database import open_store as _open

    store = _open(url)
    queue = JobQueue(store, owner_id)
    got = []
    start.wait(60)
    while (job := queue.claim_next()) is not None:
        got.append(job.id)
    store.close()
    out.put(got)


def test_concurrent_claimers_never_claim_a_job_twice(db_url):
    """Regression: two claimers on one PostgreSQL double-claimed jobs (209 of 300 in one trial):
    ``claim_next`` ignored the update's row count. Four processes drain 120 jobs of one owner."""
    import multiprocessing as mp

    store = open_store(db_url)
    owner = _owner(store, "host-a", "/a")
    queue = JobQueue(store, owner)
    ids = [queue.enqueue(f"/a/{i:03d}.yaml", f"{i:064x}", "v").id for i in range(120)]
    store.close()
    ctx = mp.get_context("spawn")
    out, start = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_claimer, args=(db_url, owner, out, start)) for _ in range(4)]
    for p in procs:
        p.start()
    start.set()
    claimed = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    flat = [i for got in claimed for i in got]
    assert len(flat) - len(set(flat)) == 0  # no double claims
    assert sorted(flat) == ids  # every job claimed exactly once


def test_nul_bytes_of_an_invalid_drop_are_stored_on_every_backend(q):
    """Regression: on PostgreSQL a drop file with a NUL byte failed its write ("text fields cannot
    contain NUL"), which aborted every scan, so no later drop was ever queued."""
    err = DropError("drop contains a NUL byte", path="/d/n.yaml")
    job = q.record_invalid("/d/n.yaml", "5" * 64, "name: a\x00\n", err)
    assert (job.status, job.content) == ("failed", "name: a\\x00\n")

"""The jobs table: supersede, claim, complete atomically with the results, fail, requeue, recover,
retire — against a real SQLite file."""

from __future__ import annotations

import pytest

from tuner.errors import DropError, WorkerError
from tuner.jobqueue import JobNotRunning, JobQueue
from tuner.store import open_store, utc_text


@pytest.fixture
def q(tmp_path):
    store = open_store(str(tmp_path / "q.sqlite"))
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

    from tuner.store import jobs_table, utc_text

    q.enqueue("/d/a.yaml", "1" * 64, "v1")
    with pytest.raises(sa.exc.IntegrityError):
        with q.engine.begin() as c:
            c.execute(jobs_table.insert().values(path="/d/a.yaml", content_sha256="2" * 64, status="pending",
                                                 attempts=0, created_at=utc_text()))

"""The jobs table: supersede, claim, complete atomically with the results, fail, requeue, recover,
retire — against a real SQLite file."""

from __future__ import annotations

import pytest

from tuner.errors import DropError, WorkerError
from tuner.jobqueue import JobNotRunning, JobQueue
from tuner.store import open_store


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


def test_requeue_does_not_count_and_recover_gives_up_after_max_attempts(q):
    job = q.enqueue("/d/a.yaml", "1" * 64, "v1")
    q.claim_next()
    q.requeue(job.id)  # graceful stop
    assert (q.get(job.id).status, q.get(job.id).attempts) == ("pending", 0)
    for attempt in (1, 2):  # two crashes while running
        q.claim_next()
        requeued, failed = q.recover(max_attempts=3)
        assert [j.id for j in requeued] == [job.id] and failed == []
        assert (q.get(job.id).status, q.get(job.id).attempts) == ("pending", attempt)
    q.claim_next()
    requeued, failed = q.recover(max_attempts=3)
    assert requeued == [] and [j.id for j in failed] == [job.id]
    assert q.get(job.id).status == "failed" and "interrupted 3 times" in q.get(job.id).error


def test_one_pending_job_per_path_is_enforced_by_the_database(q):
    import sqlalchemy as sa

    from tuner.store import jobs_table, utc_text

    q.enqueue("/d/a.yaml", "1" * 64, "v1")
    with pytest.raises(sa.exc.IntegrityError):
        with q.engine.begin() as c:
            c.execute(jobs_table.insert().values(path="/d/a.yaml", content_sha256="2" * 64, status="pending",
                                                 attempts=0, created_at=utc_text()))

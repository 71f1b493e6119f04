"""Fleet on a real PostgreSQL server with real daemon processes (skipped without
CTX_TUNER_TEST_DATABASE_URL; the database restart also needs CTX_TUNER_PG_DIR from .ci/pg-server.sh):
3 daemons with 3 watch directories on one database, one killed with SIGKILL and restarted mid-run,
the server restarted once → every drop stored exactly once (profiled once, or answered from the
shared result of another host), 0 double claims, 0 jobs lost, no drop retired by another host.
The daemons run with their default settings, so with the warm worker (``worker_max_jobs`` 50: one
fake worker process per daemon); with it the test lost a drop in 1 of 5 runs before a claim
whose commit the database restart cut off was requeued (tests/test_daemon_fleet.py,
test_claim_committed_as_the_database_restarted_left_the_job_running_forever).
The 300-drop soak is tests/benchmarks/bench_fleet.py."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests._fleet import run_fleet
from tests.conftest import REPO


def _restart_db() -> None:
    subprocess.run([str(REPO / ".ci" / "pg-server.sh"), "restart", os.environ["CTX_TUNER_PG_DIR"]], check=True,
                   capture_output=True, timeout=120)


def test_three_daemons_one_database_kill_and_db_restart_lose_and_double_nothing(pg_url, tmp_path):
    if not os.environ.get("CTX_TUNER_PG_DIR"):
        pytest.skip("CTX_TUNER_PG_DIR not set: the database restart needs the server started by .ci/pg-server.sh")
    report = run_fleet(pg_url, tmp_path, hosts=3, drops_per_host=16, restart_db=_restart_db, timeout_s=240)
    print(report)
    assert report["events"][0].startswith("kill -9 host-1") and report["events"][1].startswith("database restarted")
    assert report["lost"] == 0, report
    assert report["double_claims"] == 0, report
    assert report["retired_by_other"] == 0, report
    assert report["drops_stored_not_once"] == 0, report
    assert report["alembic_version_rows"] == 1
    assert report["exit_codes"] == [0, 0, 0], report
    # the 8 even-numbered settings are common to the 3 hosts: computed once or twice when two hosts
    # raced, and answered from the store for the rest
    assert report["shared"] >= 1 and report["worker_runs"] - report["reruns_after_kill"] <= 48 - report["shared"]

"""Fleet soak and race counts on a real PostgreSQL server (run by hand; not part of the suite).

    eval "$(.ci/pg-server.sh start /tmp/pg)"
    .venv/bin/python tests/benchmarks/bench_fleet.py claims migrations cross-host soak

* ``claims`` — 4 processes drain 300 pending jobs of one queue; counts jobs claimed more than once.
* ``migrations`` — 5 processes open (migrate) one empty database at once, 3 trials; counts failures.
* ``cross-host`` — daemon A (watch dir a/) finishes 5 drops and has one job running; daemon B (watch
  dir b/) starts on the same database: counts A's jobs B requeued and A's drops B retired.
* ``soak`` — tests/_fleet.py with 3 daemons × 100 drops (300), one daemon kill -9'd and restarted,
  the database restarted once (needs CTX_TUNER_PG_DIR from .ci/pg-server.sh).

``claims``, ``migrations`` and ``cross-host`` use only APIs that existed before the fleet work, so
the same script measures an older checkout (``PYTHONPATH=/path/to/old/checkout``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))

import sqlalchemy as sa  # noqa: E402

BASE = os.environ.get("CTX_TUNER_TEST_DATABASE_URL")


def _new_db() -> tuple[str, sa.Engine, str]:
    admin = sa.create_engine(BASE, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    name = "bench_" + uuid.uuid4().hex[:10]
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    return sa.engine.make_url(BASE).set(database=name).render_as_string(hide_password=False), admin, name


def _drop_db(admin: sa.Engine, name: str) -> None:
    with admin.connect() as c:
        c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _claimer(url, out, start):
    from tuner.store.jobqueue import JobQueue
    from tuner.store.database import open_store

    store = open_store(url)
    q = JobQueue(store)
    start.wait(60)
    got = []
    while True:
        try:
            job = q.claim_next()
        except Exception:  # noqa: BLE001 - a failed claim counts as nothing claimed
            continue
        if job is None:
            break
        got.append(job.id)
    store.close()
    out.put(got)


def claims(n_jobs: int = 300, n_proc: int = 4) -> dict:
    from tuner.store.jobqueue import JobQueue
    from tuner.store.database import open_store

    url, admin, name = _new_db()
    store = open_store(url)
    q = JobQueue(store)
    for i in range(n_jobs):
        q.enqueue(f"/d/{i:04d}.yaml", f"{i:064x}", "v")
    store.close()
    ctx = mp.get_context("spawn")
    out, start = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_claimer, args=(url, out, start)) for _ in range(n_proc)]
    for p in procs:
        p.start()
    time.sleep(3)  # all imported and connected
    start.set()
    got = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    flat = [i for g in got for i in g]
    _drop_db(admin, name)
    return {"jobs": n_jobs, "claimers": n_proc, "claims": len(flat), "double_claimed_jobs": len(flat) - len(set(flat)),
            "never_claimed": n_jobs - len(set(flat))}


def _migrator(url, out):
    from tuner.store.database import open_store

    try:
        open_store(url).close()
        out.put("ok")
    except Exception as exc:  # noqa: BLE001
        out.put(f"{type(exc).__name__}: {str(exc)[:120]}")


def migrations(trials: int = 3, n_proc: int = 5) -> dict:
    ctx = mp.get_context("spawn")
    failures, errors = 0, []
    for _ in range(trials):
        url, admin, name = _new_db()
        out = ctx.Queue()
        procs = [ctx.Process(target=_migrator, args=(url, out)) for _ in range(n_proc)]
        for p in procs:
            p.start()
        res = [out.get(timeout=300) for _ in procs]
        for p in procs:
            p.join()
        bad = [r for r in res if r != "ok"]
        failures += len(bad)
        errors += bad[:1]
        _drop_db(admin, name)
    return {"processes": n_proc, "trials": trials, "failures": failures, "first_errors": errors}


def cross_host() -> dict:
    from tests._daemon_helpers import drop_text, fake_python, poll
    from tuner.daemon.service import Daemon
    from tuner.daemon.notify import Notifier
    from tuner.daemon.settings import Settings

    url, admin, name = _new_db()
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    model = REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"
    os.environ["FAKE_SLOW_S"] = "30"

    def settings(tag: str) -> Settings:
        (tmp / tag / "conf.d").mkdir(parents=True)
        return Settings(watch_dir=str(tmp / tag / "conf.d"), state_dir=str(tmp / tag / "state"), database_url=url,
                        debounce_s=0.05, rescan_interval_s=30.0, job_timeout_s=60.0,
                        worker_python=str(fake_python(tmp / tag)))

    sa_, sb = settings("a"), settings("b")
    a = Daemon(sa_, notifier=Notifier({}))
    a.start()
    for i in range(5):
        (Path(sa_.watch_dir) / f"d{i}.yaml").write_text(drop_text(f"a{i}", model, max_num_seqs=i + 1))
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)

    def q(sql):
        with eng.connect() as c:
            return c.exec_driver_sql(sql).scalar()

    poll(lambda: q("SELECT count(*) FROM jobs WHERE status = 'done'") == 5, 60, step=lambda: a.step(max_wait_s=0.05))
    (Path(sa_.watch_dir) / "slow.yaml").write_text(drop_text("slow-a", model))
    poll(lambda: q("SELECT count(*) FROM jobs WHERE status = 'running'") == 1, 30,
         step=lambda: a.step(max_wait_s=0.05))
    b = Daemon(sb, notifier=Notifier({}))
    b.start()
    b.reconcile()
    requeued = q("SELECT count(*) FROM jobs WHERE status <> 'running' AND name_tail = 'slow.yaml'".replace(
        "name_tail", "substr(path, length(path) - 8)"))
    retired = q("SELECT count(*) FROM drops WHERE retired_at IS NOT NULL")
    b.shutdown()
    a.shutdown()
    eng.dispose()
    _drop_db(admin, name)
    return {"a_jobs_requeued_by_b": requeued, "a_drops_retired_by_b": retired, "a_drops": 5}


def soak() -> dict:
    from tests._fleet import run_fleet

    url, admin, name = _new_db()
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-soak-"))

    def restart():
        subprocess.run([str(REPO / ".ci" / "pg-server.sh"), "restart", os.environ["CTX_TUNER_PG_DIR"]], check=True,
                       capture_output=True, timeout=120)

    report = run_fleet(url, tmp, hosts=3, drops_per_host=100, restart_db=restart, timeout_s=900,
                       log=lambda m: print("  ", m, flush=True))
    _drop_db(admin, name)
    return report


def main(argv: list[str]) -> int:
    if not BASE:
        print("CTX_TUNER_TEST_DATABASE_URL is not set (eval \"$(.ci/pg-server.sh start DIR)\")", file=sys.stderr)
        return 2
    import tuner

    print(f"tuner from {Path(tuner.__file__).parent}", flush=True)
    for what in argv or ["claims", "migrations", "cross-host", "soak"]:
        t0 = time.monotonic()
        out = {"claims": claims, "migrations": migrations, "cross-host": cross_host, "soak": soak}[what]()
        print(f"{what} ({time.monotonic() - t0:.1f} s): {json.dumps(out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

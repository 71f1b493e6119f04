"""A fleet of real daemon processes on one PostgreSQL database, with a daemon killed and the
database restarted mid-run; used by tests/test_fleet.py (small) and tests/benchmarks/bench_fleet.py
(the 300-drop soak). Workers are the fast fake (tests/_fake_worker.py): no torch.

Every count comes from the database and the fake worker's per-host log:

* ``double_claims`` — worker runs beyond one per drop (minus the attempts a kill -9 interrupted,
  which the daemon's successor legitimately re-ran), plus jobs done twice for one file;
* ``lost`` — drop files without a done job of their own host at the end (pending/running left);
* ``retired_by_other`` — drop rows retired, or owned by another host than the file's (no file is
  deleted or edited here, so any retired drop is one a foreign reconciliation retired);
* ``shared`` — drops answered from the store (another drop with the same result key) without a worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import sqlalchemy as sa
import yaml

from tests._daemon_helpers import drop_text, fake_python
from tests.conftest import REPO


def _settings(base: Path, i: int, url: str, lease_s: float, extra: dict | None = None) -> Path:
    host = base / f"h{i}"
    (host / "conf.d").mkdir(parents=True, exist_ok=True)
    p = host / "tuner.yaml"
    p.write_text(yaml.safe_dump({
        "watch_dir": str(host / "conf.d"), "state_dir": str(host / "state"), "database_url": url,
        "host_id": f"host-{i}", "debounce_s": 0.05, "rescan_interval_s": 2.0, "job_timeout_s": 60.0,
        "worker_python": str(fake_python(host)), "log_level": "INFO", "lease_s": lease_s, **(extra or {})}))
    return p


def _start(base: Path, i: int, env: dict) -> subprocess.Popen:
    host = base / f"h{i}"
    log = open(host / "daemon.log", "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "tuner.cli", "daemon", "--settings", str(host / "tuner.yaml")],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**env, "FAKE_WORKER_LOG": str(host / "worker.log")})
    finally:
        log.close()


def _done(eng: sa.Engine) -> int:
    try:
        with eng.connect() as c:
            return c.exec_driver_sql(
                "SELECT count(*) FROM (SELECT DISTINCT owner_id, path FROM jobs WHERE status = 'done') t").scalar()
    except sa.exc.SQLAlchemyError:
        return -1  # not migrated yet, or the server is restarting


def _wait_running(eng: sa.Engine, host: str, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with eng.connect() as c:
            if c.exec_driver_sql("SELECT count(*) FROM jobs j JOIN hosts h ON h.id = j.owner_id "
                                 f"WHERE h.host_id = '{host}' AND j.status = 'running'").scalar():
                return True
        time.sleep(0.02)
    return False


def _wait_registered(eng: sa.Engine, host: str, pid: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with eng.connect() as c:
            if c.exec_driver_sql(f"SELECT pid FROM hosts WHERE host_id = '{host}'").scalar() == pid:
                return
        time.sleep(0.05)
    raise AssertionError(f"{host} (pid {pid}) did not register within {timeout_s} s")


def run_fleet(url: str, base: Path, *, hosts: int = 3, drops_per_host: int = 20, restart_db: Callable[[], None] | None,
              kill_host: int = 1, lease_s: float = 6.0, timeout_s: float = 240.0,
              log: Callable[[str], None] = lambda m: None, settings: dict | None = None) -> dict:
    """Run the fleet; returns the counts (see the module docstring) and timings. ``settings``:
    more daemon settings for every host (e.g. ``{"worker_max_jobs": 1}``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "CTX_TUNER_DATABASE_URL",
                                                             "CREDENTIALS_DIRECTORY")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(REPO), FAKE_SLOW_S="0.4")
    model = REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"
    for i in range(hosts):
        _settings(base, i, url, lease_s, settings)
    total = hosts * drops_per_host
    # drops: even j share one result key across hosts (same settings, other names); odd j are unique
    for i in range(hosts):
        for j in range(drops_per_host):
            seqs = j + 1 if j % 2 == 0 else 1000 + i * drops_per_host + j
            slow = "slow-" if j % 4 == 3 else ""  # the fake worker sleeps $FAKE_SLOW_S for these
            (base / f"h{i}" / "conf.d" / f"d{j:03d}.yaml").write_text(
                drop_text(f"{slow}h{i}-d{j:03d}", model, max_num_seqs=seqs))
    t0 = time.monotonic()
    procs = [_start(base, i, env) for i in range(hosts)]  # all at once: they migrate the empty database together
    eng = sa.create_engine(url, pool_pre_ping=True)
    events: list[str] = []
    killed = restarted = False
    try:
        while True:
            n = _done(eng)
            if not killed and n >= total // 3:
                _wait_running(eng, f"host-{kill_host}")  # kill it in the middle of a job when it has one
                procs[kill_host].send_signal(signal.SIGKILL)
                procs[kill_host].wait()
                procs[kill_host] = _start(base, kill_host, env)
                _wait_registered(eng, f"host-{kill_host}", procs[kill_host].pid)  # its successor is up
                killed = True
                events.append(f"kill -9 host-{kill_host} at {n}/{total} done")
                log(events[-1])
            elif killed and not restarted and restart_db is not None and n >= 2 * total // 3:
                restart_db()
                restarted = True
                events.append(f"database restarted at {n}/{total} done")
                log(events[-1])
            if n >= total:
                break
            for i, p in enumerate(procs):
                if p.poll() is not None:
                    raise AssertionError(f"daemon host-{i} exited {p.returncode}:\n"
                                         + (base / f"h{i}" / "daemon.log").read_text()[-3000:])
            if time.monotonic() - t0 > timeout_s:
                break
            time.sleep(0.2)
        elapsed = time.monotonic() - t0
    finally:
        codes = []
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                codes.append(p.wait(timeout=60))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
    report = _count(eng, base, hosts, drops_per_host)
    eng.dispose()
    report.update(elapsed_s=round(elapsed, 1), drops=total, exit_codes=codes, events=events)
    return report


def _count(eng: sa.Engine, base: Path, hosts: int, drops_per_host: int) -> dict:
    with eng.connect() as c:
        owner = {h: i for i, h in c.exec_driver_sql("SELECT id, host_id FROM hosts")}
        jobs = c.exec_driver_sql("SELECT owner_id, path, status, attempts, interruptions FROM jobs").all()
        drops = c.exec_driver_sql("SELECT name, path, owner_id, retired_at, answered_from_drop_id FROM drops").all()
        migrations = c.exec_driver_sql("SELECT count(*) FROM alembic_version").scalar()
    done = Counter((o, p) for o, p, s, _a, _i in jobs if s == "done")
    # an attempt a kill -9 interrupted is not counted in attempts but in interruptions (tuner.store.jobqueue)
    attempts = {(o, p): a + (i or 0) for o, p, s, a, i in jobs if s == "done"}
    files = {(owner[f"host-{i}"], str(base / f"h{i}" / "conf.d" / f"d{j:03d}.yaml"))
             for i in range(hosts) for j in range(drops_per_host)}
    lost = sum(1 for f in files if done[f] == 0)
    done_twice = sum(n - 1 for n in done.values() if n > 1)
    runs: Counter = Counter()
    for i in range(hosts):
        wlog = base / f"h{i}" / "worker.log"
        for line in (wlog.read_text().splitlines() if wlog.exists() else []):
            runs[line.split()[1]] += 1  # "pid name sha256" per worker start
    shared = {name for name, _p, _o, _r, src in drops if src is not None}
    extra_runs = 0
    for name, path, o, _r, src in drops:
        expected = 0 if src is not None else 1
        allowed = max(0, attempts.get((o, path), 1) - 1)  # attempts interrupted by the kill -9
        extra_runs += max(0, runs[name] - expected - allowed)
    host_of_path = {p: o for o, p in files}
    retired_by_other = sum(1 for _n, p, o, r, _s in drops if r is not None or host_of_path.get(p) != o)
    stored = Counter((o, p) for _n, p, o, _r, _s in drops)
    return {
        "double_claims": extra_runs + done_twice,
        "lost": lost,
        "retired_by_other": retired_by_other,
        "drops_stored_not_once": sum(1 for f in files if stored[f] != 1),
        "shared": len(shared),
        "worker_runs": sum(runs.values()),
        "reruns_after_kill": sum(max(0, a - 1) for a in attempts.values()),
        "alembic_version_rows": migrations,
    }

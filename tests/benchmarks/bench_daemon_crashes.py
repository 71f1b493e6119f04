"""Benchmark (on demand): the daemon under kill -9 — issue 15's must-show figures.

    .venv/bin/python tests/benchmarks/bench_daemon_crashes.py [--random N] [--window N] [--workers N]

Real ``ctx-tuner daemon`` processes, real SQLite files and signals, the fast fake worker
(``tests/_fake_worker.py`` behind ``worker_python``; every drop's pass takes 0.3 s):

1. ``--random`` (default 50): 20 drops; the daemon is started and SIGKILLed at a random moment
   N times (one in five during start-up, the others 0–3 s after READY, while it claims, runs,
   commits and writes files), then run to the end.
2. ``--window`` (default 30): N drops; each run of the daemon SIGKILLs itself right after a job's
   results are committed and before its proposal file is written (``tests/_daemon_with_hooks.py``),
   N times, then run to the end.
3. ``--workers`` (default 10): N slow drops; each one's worker is SIGKILLed once (what the OOM
   killer does), plus one drop whose first pass exceeds the worker memory limit.
4. ``--real`` (default 0; CI runs 2): part 1 with the *real* worker (``python -m
   tuner.commands.worker_main``, torch imported, the warm worker kept between jobs) on 12 drops of a tiny
   Llama, the daemon SIGKILLed N times while it works (issue 34: a share of the runs with real
   workers), then run to the end.

Each part then counts: lost proposal files (an active drop without ``proposals/NAME.yaml`` holding
its newest drop row), drops left failed, duplicate or half-written rows (two unretired drop rows
per name, proposals without their drop, runs per drop), and ``PRAGMA integrity_check``.
Settings: the defaults except ``retry_backoff_s: 0.2`` (so the run takes minutes, not hours).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests._daemon_helpers import own_drop_text as drop_text, fake_python, poll, try_rows  # noqa: E402

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def setup(root: Path, **over) -> tuple[Path, Path]:
    (root / "conf.d").mkdir(parents=True)
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(TINY))
    import yaml

    s = {"watch_dir": str(root / "conf.d"), "state_dir": str(root / "state"), "debounce_s": 0.05,
         "worker_python": str(fake_python(root)), "retry_backoff_s": 0.2, **over}
    (root / "tuner.yaml").write_text(yaml.safe_dump(s))
    return root / "tuner.yaml", root / "state" / "ctx-tuner.sqlite"


def spawn(settings: Path, log: Path, *, hooked: bool = False, env: dict | None = None) -> subprocess.Popen:
    e = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
    e.update(env or {})
    cmd = [sys.executable, str(REPO / "tests" / "_daemon_with_hooks.py")] if hooked else [sys.executable, "-m",
                                                                                          "tuner.cli"]
    return subprocess.Popen(cmd + ["daemon", "--settings", str(settings)], cwd=REPO, env=e,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def run_to_end(settings: Path, db: Path, n: int, log: Path, env: dict | None = None, timeout_s: float = 300) -> float:
    t0 = time.monotonic()
    readies = log.read_text().count("ready: watching") if log.exists() else 0
    proc = spawn(settings, log, env=env)
    try:
        poll(lambda: log.read_text().count("ready: watching") > readies, 60, what="the daemon ready")
        poll(lambda: try_rows(db, "SELECT count(*) FROM jobs j WHERE j.id IN (SELECT max(id) FROM jobs GROUP BY path)"
                              " AND j.status IN ('done', 'failed')") == [(n,)], timeout_s, what="every drop finished")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    return time.monotonic() - t0


def audit(root: Path, db: Path) -> dict:
    import yaml

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        active = dict(con.execute("SELECT name, max(id) FROM drops WHERE retired_at IS NULL GROUP BY name"))
        lost = 0
        for name, drop_id in active.items():
            p = root / "state" / "proposals" / f"{name}.yaml"
            if not p.exists() or yaml.safe_load(p.read_text()).get("drop_id") != drop_id:
                lost += 1
        current = con.execute("SELECT status, failure_kind, attempts, interruptions FROM jobs WHERE id IN "
                              "(SELECT max(id) FROM jobs GROUP BY path)").fetchall()
        out = {
            "drops": len(active),
            "lost_proposal_files": lost,
            "failed": sum(1 for r in current if r[0] == "failed"),
            "done": sum(1 for r in current if r[0] == "done"),
            "duplicate_drop_rows": con.execute("SELECT count(*) - count(DISTINCT name) FROM drops WHERE retired_at IS NULL").fetchone()[0],
            "drop_rows_total": con.execute("SELECT count(*) FROM drops").fetchone()[0],
            "proposals_without_drop": con.execute("SELECT count(*) FROM proposals WHERE drop_id NOT IN (SELECT id FROM drops)").fetchone()[0],
            "drops_without_proposals": con.execute("SELECT count(*) FROM drops WHERE id NOT IN (SELECT drop_id FROM proposals)").fetchone()[0],
            "max_runs_per_drop": con.execute("SELECT coalesce(max(n), 0) FROM (SELECT count(*) n FROM profile_runs GROUP BY drop_id)").fetchone()[0],
            "jobs_done_without_drop": con.execute("SELECT count(*) FROM jobs WHERE status = 'done' AND drop_id IS NULL").fetchone()[0],
            "max_attempts_used": max((r[2] for r in current), default=0),
            "interruptions": sum((r[3] or 0) for r in current),
            "integrity": con.execute("PRAGMA integrity_check").fetchone()[0],
        }
    finally:
        con.close()
    return out


def part_random(n_kills: int, rng: random.Random) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-random-"))
    settings, db = setup(root)
    n = 20
    for i in range(n):
        (root / "conf.d" / f"slow-{i:02d}.yaml").write_text(drop_text(f"slow-{i:02d}", root / "model"))
    log = root / "daemon.log"
    env = {"FAKE_SLOW_S": "0.3"}
    for _ in range(n_kills):
        readies = log.read_text().count("ready: watching") if log.exists() else 0
        proc = spawn(settings, log, env=env)
        if rng.random() < 0.2:  # now and then during start-up (migrations, recovery, first scan)
            time.sleep(rng.uniform(0.0, 1.5))
        else:  # mostly while it works: claims, passes, commits, file writes
            poll(lambda: log.read_text().count("ready: watching") > readies or proc.poll() is not None, 60,
                 what="the daemon ready")
            time.sleep(rng.uniform(0.0, 3.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    wall = run_to_end(settings, db, n, log, env=env)
    return {"kills": n_kills, "final_run_s": round(wall, 1), **audit(root, db), "dir": str(root)}


def part_real(n_kills: int, rng: random.Random) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-real-"))
    settings, db = setup(root, worker_python=sys.executable, job_timeout_s=300)
    n = 12
    for i in range(n):
        (root / "conf.d" / f"real-{i:02d}.yaml").write_text(drop_text(f"real-{i:02d}", root / "model",
                                                                      max_num_seqs=16 + i))  # one pass each
    log = root / "daemon.log"
    for _ in range(n_kills):
        readies = log.read_text().count("ready: watching") if log.exists() else 0
        proc = spawn(settings, log)
        poll(lambda: log.read_text().count("ready: watching") > readies or proc.poll() is not None, 60,
             what="the daemon ready")
        time.sleep(rng.uniform(0.3, 4.0))  # a real worker imports torch first: kills land in imports and passes
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    wall = run_to_end(settings, db, n, log, timeout_s=600)
    return {"kills": n_kills, "final_run_s": round(wall, 1), **audit(root, db), "dir": str(root)}


def part_window(n: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-window-"))
    settings, db = setup(root)
    for i in range(n):
        (root / "conf.d" / f"w-{i:02d}.yaml").write_text(drop_text(f"w-{i:02d}", root / "model"))
    log = root / "daemon.log"
    kills = 0
    for _ in range(n):
        proc = spawn(settings, log, hooked=True, env={"HOOK_KILL_AFTER_COMMIT": "1"})
        if proc.wait(timeout=60) == -signal.SIGKILL:
            kills += 1
    missing_before = sum(not (root / "state" / "proposals" / f"w-{i:02d}.yaml").exists() for i in range(n))
    run_to_end(settings, db, n, log)
    return {"kills_in_commit_window": kills, "files_missing_before_restart": missing_before,
            "rederived_log_lines": log.read_text().count("re-derived from the store"), **audit(root, db),
            "dir": str(root)}


def part_workers(n: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    settings, db = setup(root, worker_memory_max_bytes=256 << 20)
    (root / "once").mkdir()
    env = {"FAKE_SLOW_S": "60", "FAKE_SLOW_ONCE_DIR": str(root / "once"), "FAKE_HOG_ONCE": str(root / "hogged"),
           "FAKE_HOG_BYTES": str(1 << 30)}
    for i in range(n):
        (root / "conf.d" / f"slow-{i:02d}.yaml").write_text(drop_text(f"slow-{i:02d}", root / "model"))
    (root / "conf.d" / "hog.yaml").write_text(drop_text("hog", root / "model"))
    log = root / "daemon.log"
    proc = spawn(settings, log, env=env)
    killed = 0
    try:
        for i in range(n):
            name = f"slow-{i:02d}"
            pid = poll(lambda: try_rows(db, "SELECT worker_pid FROM jobs WHERE path LIKE ? AND status = 'running' AND "
                                            "worker_pid IS NOT NULL", f"%/{name}.yaml"), 60, what=f"{name} running")[0][0]
            poll(lambda: (root / "once" / name).exists(), 30, what=f"{name} sleeping")
            os.kill(pid, signal.SIGKILL)
            killed += 1
        poll(lambda: try_rows(db, "SELECT count(*) FROM jobs WHERE status IN ('done', 'failed')") == [(n + 1,)], 120,
             what="every drop finished")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute("SELECT path, status, attempts, history FROM jobs ORDER BY path").fetchall()
    con.close()
    jobs = [{"drop": Path(p).stem, "status": s, "attempts": a,
             "reasons": [e["reason"][:80] for e in json.loads(h or "[]")]} for p, s, a, h in rows]
    return {"worker_kills": killed, **audit(root, db), "jobs": jobs, "dir": str(root)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--random", type=int, default=50)
    ap.add_argument("--window", type=int, default=30)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--real", type=int, default=0)
    ap.add_argument("--seed", type=int, default=15)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    results = {}
    for name, fn in (("random_kill_9", lambda: part_random(args.random, rng)),
                     ("commit_window_kill_9", lambda: part_window(args.window)),
                     ("worker_kill_9", lambda: part_workers(args.workers)),
                     ("real_worker_kill_9", lambda: part_real(args.real, rng) if args.real else None)):
        t0 = time.monotonic()
        out = fn()
        if out is None:
            continue
        results[name] = out
        results[name]["wall_s"] = round(time.monotonic() - t0, 1)
        print(name, json.dumps(results[name], indent=1), flush=True)
    bad = any(r["lost_proposal_files"] or r["failed"] or r["duplicate_drop_rows"] or r["integrity"] != "ok"
              for r in results.values())
    print("RESULT:", "FAIL" if bad else "ok: 0 lost proposal files, 0 drops failed, 0 duplicate rows")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

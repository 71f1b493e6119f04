"""Benchmark (on demand): another process holds the database's write lock — issue 15, item 8.

    .venv/bin/python tests/benchmarks/bench_daemon_lock.py [--hold-s 75] [--watchdog-s 10]

Starts a real ``ctx-tuner daemon`` (fake worker) with a fake systemd notify socket and
``WATCHDOG_USEC`` = ``--watchdog-s``, waits for READY, then takes ``BEGIN IMMEDIATE`` on its
SQLite file from this process and holds it ``--hold-s`` seconds while drops arrive (so the daemon
must write). It records every ``WATCHDOG=1`` and reports the longest gap (target: under
WatchdogSec/2), sends SIGTERM while the lock is still held and reports how long the daemon took
to exit (target: under 2 s). A second daemon is then started without the lock to check that the
drops are all profiled once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold-s", type=float, default=75.0)
    ap.add_argument("--watchdog-s", type=float, default=10.0)
    args = ap.parse_args()
    import yaml

    root = Path(tempfile.mkdtemp(prefix="bench-lock-"))
    (root / "conf.d").mkdir()
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(TINY))
    settings = root / "tuner.yaml"
    settings.write_text(yaml.safe_dump({"watch_dir": str(root / "conf.d"), "state_dir": str(root / "state"),
                                        "debounce_s": 0.05, "worker_python": str(fake_python(root))}))
    db = root / "state" / "ctx-tuner.sqlite"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(root / "notify.sock"))
    sock.setblocking(False)
    msgs: list[tuple[float, list[str]]] = []

    def pump() -> None:
        try:
            while True:
                msgs.append((time.monotonic(), sock.recv(4096).decode().split("\n")))
        except BlockingIOError:
            pass

    env = {**os.environ, "NOTIFY_SOCKET": str(root / "notify.sock"), "WATCHDOG_USEC": str(int(args.watchdog_s * 1e6))}
    log = open(root / "daemon.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "tuner.cli", "daemon", "--settings", str(settings)], cwd=REPO,
                            env=env, stdout=log, stderr=log)
    poll(lambda: (pump(), any("READY=1" in m for _, m in msgs))[1], 60, what="READY=1")
    locker = sqlite3.connect(db, isolation_level=None, timeout=60)
    locker.execute("BEGIN IMMEDIATE")
    t0 = time.monotonic()
    for i in range(5):
        (root / "conf.d" / f"d{i}.yaml").write_text(drop_text(f"d{i}", root / "model"))
    while time.monotonic() - t0 < args.hold_s:
        pump()
        time.sleep(0.01)
    pings = [t for t, m in msgs if "WATCHDOG=1" in m and t >= t0]
    gaps = [b - a for a, b in zip([t0] + pings, pings + [time.monotonic()])]
    t1 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)
    stop_s = time.monotonic() - t1
    locker.close()
    proc = subprocess.Popen([sys.executable, "-m", "tuner.cli", "daemon", "--settings", str(settings)], cwd=REPO,
                            env={k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}, stdout=log, stderr=log)
    poll(lambda: try_rows(db, "SELECT count(*) FROM jobs WHERE status = 'done'") == [(5,)], 120, what="all done")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    drops = try_rows(db, "SELECT count(*) FROM drops")[0][0]
    out = {"hold_s": args.hold_s, "watchdog_s": args.watchdog_s, "pings": len(pings),
           "longest_ping_gap_s": round(max(gaps), 3), "limit_s": args.watchdog_s / 2,
           "sigterm_to_exit_s": round(stop_s, 3), "exit_code": rc, "drops_after_restart": drops, "dir": str(root)}
    print(json.dumps(out, indent=1))
    ok = max(gaps) < args.watchdog_s / 2 and stop_s < 2.0 and rc == 0 and drops == 5
    print("RESULT:", "ok" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""``ctx-tuner daemon`` as a service: a real process with a fake NOTIFY_SOCKET, SIGHUP/SIGTERM,
kill -9 in the middle of a job, bad settings, and the real worker without torch in the daemon."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests._daemon_helpers import db_rows, drop_text, group_alive, poll, try_rows, write_settings
from tests.conftest import REPO


def _spawn(settings: Path, env_extra: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env.update(env_extra or {})
    out = open(log, "ab") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "tuner.cli", "daemon", "--settings", str(settings)],
                            cwd=REPO, env=env, stdout=out, stderr=out)


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30)


class FakeSystemd:
    """A Unix datagram socket standing in for systemd's notify socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[list[str]] = []
        self.times: list[float] = []  # time.monotonic() when each message was read

    def pump(self) -> None:
        """Read what has arrived, without waiting (pings may come every few ms)."""
        try:
            while True:
                data = self.sock.recv(4096)
                self.messages.append(data.decode().split("\n"))
                self.times.append(time.monotonic())
        except (socket.timeout, BlockingIOError):
            pass

    def seen(self, line: str) -> list[int]:
        self.pump()
        return [i for i, m in enumerate(self.messages) if line in m]

    def close(self) -> None:
        self.sock.close()


def test_sd_notify_ready_status_watchdog_reloading_stopping(tmp_path, tiny_config):
    settings = write_settings(tmp_path)
    db = tmp_path / "state" / "ctx-tuner.sqlite"
    (tmp_path / "conf.d" / "pre.yaml").write_text(drop_text("pre", tiny_config))
    systemd = FakeSystemd(tmp_path / "notify.sock")
    proc = _spawn(settings, {"NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "200000"}, tmp_path / "daemon.log")
    try:
        poll(lambda: systemd.seen("READY=1"), 30, what="READY=1")
        # READY comes after migrations and the first scan: the drop already there has its job
        assert db_rows(db, "SELECT version_num FROM alembic_version")[0][0] >= "0002"
        assert db_rows(db, "SELECT count(*) FROM jobs WHERE path LIKE '%pre.yaml'") == [(1,)]
        ready = systemd.seen("READY=1")[0]
        assert any(line.startswith("STATUS=") for line in systemd.messages[ready])
        assert all("READY=1" not in m for m in systemd.messages[:ready])
        poll(lambda: len(systemd.seen("WATCHDOG=1")) >= 3, 10, what="watchdog pings")
        poll(lambda: any(line.startswith("STATUS=") and "1 done" in line
                         for m in (systemd.pump() or systemd.messages) for line in m), 10, what="STATUS progress")
        # SIGHUP: RELOADING=1 with MONOTONIC_USEC (CLOCK_MONOTONIC µs), then READY=1 again
        settings.write_text(settings.read_text().replace("job_timeout_s: 20.0", "job_timeout_s: 9.0"))
        before = time.monotonic_ns() // 1000
        proc.send_signal(signal.SIGHUP)
        poll(lambda: systemd.seen("RELOADING=1"), 10, what="RELOADING=1")
        msg = systemd.messages[systemd.seen("RELOADING=1")[0]]
        usec = int(next(line for line in msg if line.startswith("MONOTONIC_USEC="))[len("MONOTONIC_USEC="):])
        assert before <= usec <= time.monotonic_ns() // 1000
        poll(lambda: systemd.seen("READY=1")[-1] > systemd.seen("RELOADING=1")[0], 10, what="READY after reload")
        assert proc.poll() is None
        assert _stop(proc) == 0
        assert systemd.seen("STOPPING=1")
    finally:
        if proc.poll() is None:
            proc.kill()
        systemd.close()
    log = (tmp_path / "daemon.log").read_text()
    assert "settings reloaded" in log and "stopped" in log


def test_kill_9_in_the_middle_of_a_job_then_restart_completes_it_once(tmp_path, tiny_config):
    settings = write_settings(tmp_path)
    db = tmp_path / "state" / "ctx-tuner.sqlite"
    wlog = tmp_path / "worker.log"
    (tmp_path / "conf.d" / "slow-a.yaml").write_text(drop_text("slow-a", tiny_config, gmu=(0.5, 0.9)))
    proc = _spawn(settings, {"FAKE_SLOW_S": "60", "FAKE_WORKER_LOG": str(wlog)}, tmp_path / "daemon.log")
    try:
        poll(lambda: try_rows(db, "SELECT worker_pid FROM jobs WHERE status = 'running' AND worker_pid IS NOT NULL"),
             30, what="the job running")
        (orphan,), = db_rows(db, "SELECT worker_pid FROM jobs")
        poll(lambda: wlog.exists() and wlog.read_text(), 30, what="the worker reading its request")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert db_rows(db, "SELECT status, attempts FROM jobs") == [("running", 1)]
        # issue 15 item 7: the worker dies with its parent (PR_SET_PDEATHSIG + its getppid watchdog)
        poll(lambda: not group_alive(orphan), 10, what="the orphaned worker dying with the daemon")
    finally:
        if proc.poll() is None:
            proc.kill()
    proc = _spawn(settings, {"FAKE_SLOW_S": "0", "FAKE_WORKER_LOG": str(wlog)}, tmp_path / "daemon.log")
    try:
        poll(lambda: db_rows(db, "SELECT status FROM jobs") == [("done",)], 30, what="the job done after restart")
        # the attempt the daemon crash cost is not counted against the drop; history says why
        assert db_rows(db, "SELECT count(*), max(attempts), max(interruptions) FROM jobs") == [(1, 1, 1)]
        (hist,), = db_rows(db, "SELECT history FROM jobs")
        assert [e["kind"] for e in __import__("json").loads(hist)] == ["interrupted"]
        assert db_rows(db, "SELECT count(*) FROM drops") == [(1,)]
        assert db_rows(db, "SELECT count(*) FROM profile_runs") == [(1,)]
        assert db_rows(db, "SELECT gpu_memory_utilization FROM proposals ORDER BY 1") == [(0.5,), (0.9,)]
        assert len(wlog.read_text().splitlines()) == 2  # started twice, stored once
        assert _stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "daemon.log").read_text()
    assert "interrupted by a daemon crash" in log and "not counted" in log


def test_invalid_settings_exit_2_naming_file_and_key(tmp_path):
    bad = tmp_path / "tuner.yaml"
    bad.write_text("watch_dir: /x\njob_timeout_s: soon\n")
    proc = subprocess.run([sys.executable, "-m", "tuner.cli", "daemon", "--settings", str(bad)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"{bad}:job_timeout_s" in proc.stderr and "must be a number" in proc.stderr


def test_daemon_with_the_real_worker_never_imports_torch(tmp_path, tiny_config):
    """One drop through the real worker (torch in the subprocess only); the daemon process stays
    free of torch and transformers."""
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "tiny.yaml").write_text(drop_text("tiny", tiny_config, gmu=(0.9,),
                                                             max_num_batched_tokens=2048, max_num_seqs=64))
    code = f"""
import sys, sqlite3
from pathlib import Path
from tuner.daemon.service import Daemon
from tuner.daemon.notify import Notifier
from tuner.daemon.settings import Settings
from tests._daemon_helpers import poll
s = Settings(watch_dir={str(tmp_path / 'conf.d')!r}, state_dir={str(tmp_path / 'state')!r}, debounce_s=0.05)
d = Daemon(s, notifier=Notifier({{}}))
d.start()
db = Path(s.state_dir) / "ctx-tuner.sqlite"
def done():
    con = sqlite3.connect(db)
    try:
        return con.execute("select status, error from jobs").fetchall()
    finally:
        con.close()
poll(lambda: done()[0][0] in ("done", "failed"), 120, step=lambda: d.step(max_wait_s=0.1))
d.shutdown()
print("JOB", done())
bad = [m for m in ("torch", "transformers") if m in sys.modules]
print("LOADED", bad)
sys.exit(1 if bad else 0)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "JOB [('done', None)]" in proc.stdout
    db = tmp_path / "state" / "ctx-tuner.sqlite"
    # the tiny model is limited by its max_position_embeddings (4096), not memory
    assert db_rows(db, "SELECT max_model_len, kv_cache_tokens > 0 FROM proposals") == [(4096, 1)]
    assert db_rows(db, "SELECT method, era FROM profile_runs LIMIT 1")[0][0] == "simulate"
    assert "max_model_len: 4096" in (tmp_path / "state" / "proposals" / "tiny.yaml").read_text()

"""Issue 34: the reliability findings of the adversarial run (real workers, storms, bad inputs,
store faults). One regression test per finding, named after the failure; real processes, files
and signals, the fast fake worker behind ``worker_python`` unless a test says otherwise."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._daemon_helpers import FAKE_WORKER, group_alive, own_drop_text as drop_text, poll
from tests.conftest import REPO
from tests.test_daemon import Harness
from tuner.errors import ModelConfigError, WorkerError, WorkerTimeout
from tuner.seam.warmworker import WarmWorker
from tuner.seam.worker import crash_error, run_in_worker, worker_env


@pytest.fixture
def h(tmp_path, tiny_config, monkeypatch):
    monkeypatch.setenv("FAKE_WORKER_LOG", str(tmp_path / "worker.log"))
    harness = Harness(tmp_path, tiny_config)
    yield harness
    harness.close()


def _fake_request(name: str) -> dict:
    return {"drop": {"name": name, "content_sha256": "0", "candidates": {"gpu_memory_utilization": [0.5]}},
            "device": {"total_memory_bytes": 80 << 30}}


# -- 1: the SQLite file deleted or replaced under a running daemon --------------------------------

@pytest.mark.parametrize("how", ["replaced", "deleted"])
def test_store_file_replaced_under_running_daemon_went_unnoticed(h, caplog, how):
    """The store file swapped for an older backup (or deleted) while the daemon ran: results were
    committed into the unlinked file and lost at restart. The daemon compares the open file's
    device and inode with the path's at every step and stops with one ERROR and exit status 1."""
    d = h.start()
    (h.conf / "a.yaml").write_text(drop_text("a", h.model))
    h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'done'") == [(1,)], what="a done")
    backup = h.tmp / "backup.sqlite"
    shutil.copyfile(h.db, backup)  # an "older backup" (a copy: another inode)
    if how == "replaced":
        os.replace(backup, h.db)
    else:
        os.unlink(h.db)
    (h.conf / "b.yaml").write_text(drop_text("b", h.model))
    caplog.set_level(logging.INFO, logger="tuner.daemon.service")
    for _ in range(5):
        d.step(max_wait_s=0.05)
    assert d.stop_requested and d.exit_status == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"store file {h.db} was {'replaced by another file' if how == 'replaced' else 'deleted'}")
    assert "stopping so that no result is committed" in errors[0]
    assert not any("drop " in r.getMessage() and "b.yaml" in r.getMessage() and "queued" in r.getMessage()
                   for r in caplog.records)  # nothing more was written into the old file


def test_daemon_exit_status_when_its_store_file_was_replaced(tmp_path, tiny_config):
    """End to end: ``ctx-tuner daemon`` whose store file is replaced exits 1 on its own (systemd's
    Restart= then opens the file now at the path), with the one ERROR line and no traceback."""
    from tests._daemon_helpers import write_settings

    settings = write_settings(tmp_path)
    db, log = tmp_path / "state" / "ctx-tuner.sqlite", tmp_path / "daemon.log"
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tuner.cli", "daemon", "--settings", str(settings)], cwd=REPO,
                                env=env, stdout=out, stderr=out)
    try:
        poll(lambda: "ready: watching" in log.read_text(), 60, what="the daemon ready")
        copy = tmp_path / "copy.sqlite"
        shutil.copyfile(db, copy)
        os.replace(copy, db)
        (tmp_path / "conf.d" / "a.yaml").write_text(drop_text("a", tiny_config))  # wakes the loop
        assert proc.wait(timeout=40) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert text.count(f"store file {db} was replaced by another file") == 1
    assert "Traceback" not in text


# -- 2: exceeding worker_memory_max_bytes reported as a crash ---------------------------------------

def _script(tmp_path: Path, name: str, body: str) -> str:
    p = tmp_path / name
    p.write_text(f"#!{sys.executable}\n" + body)
    p.chmod(0o755)
    return str(p)


def test_worker_over_memory_limit_reported_as_worker_crashed_exit_status_1(tmp_path):
    """A pass over ``worker_memory_max_bytes`` that dies outside Python's ``MemoryError`` reply
    (an uncaught allocation failure, exit 1; a C++ ``std::bad_alloc`` that aborts) was "worker
    crashed (exit status 1)". It names the limit and its bytes now; a crash without a limit, or
    without any sign of a failed allocation, is still a crash."""
    # a real RLIMIT_DATA breach: the worker's own guard sets the limit, then an allocation fails
    # outside the reply path (an uncaught MemoryError: a traceback and exit status 1)
    real = _script(tmp_path, "hog", "import sys\nsys.path.insert(0, %r)\nfrom tuner.seam.worker_guard import install\n"
                   "install()\nsys.stdin.read()\nx = bytearray(1 << 30)\n" % str(REPO))
    with pytest.raises(WorkerError) as exc:
        run_in_worker({"kind": "job"}, job="j", python=real, timeout_s=60, memory_max_bytes=256 << 20)
    assert type(exc.value) is WorkerError
    assert exc.value.message.startswith("the profile pass exceeded the worker memory limit (268,435,456 bytes, "
                                        "setting worker_memory_max_bytes): it reported 'MemoryError'")
    assert "(worker exit status 1; last output: MemoryError)" in exc.value.message
    aborting = _script(tmp_path, "abort", "import os, sys\nsys.stdin.read()\n"
                       "sys.stderr.write(\"terminate called after throwing an instance of 'std::bad_alloc'\\n"
                       "  what():  std::bad_alloc\\n\")\nsys.stderr.flush()\nos.abort()\n")
    with pytest.raises(WorkerError) as exc:
        run_in_worker({"kind": "job"}, job="j", python=aborting, timeout_s=60, memory_max_bytes=1 << 30)
    assert exc.value.message.startswith("the profile pass exceeded the worker memory limit (1,073,741,824 bytes, "
                                        "setting worker_memory_max_bytes): it reported 'std::bad_alloc'")
    assert "worker killed by signal 6" in exc.value.message
    # no limit: the same death is a crash, as before
    with pytest.raises(WorkerError) as exc:
        run_in_worker({"kind": "job"}, job="j", python=aborting, timeout_s=60)
    assert exc.value.message.startswith("worker crashed (killed by signal 6): terminate called")
    # a limit, but a death that says nothing of memory (exit 3, no signal): a crash
    assert crash_error(3, "boom", job="j", memory_max_bytes=1 << 30).message == "worker crashed (exit status 3): boom"
    # SIGSEGV under a limit: how an unchecked failed malloc ends
    assert crash_error(-11, "", job="j", memory_max_bytes=1 << 30).message.startswith(
        "the profile pass exceeded the worker memory limit (1,073,741,824 bytes, setting worker_memory_max_bytes): "
        "it was killed by signal 11, as a process whose allocation failed is")


def test_warm_worker_over_memory_limit_reported_as_worker_crashed(tmp_path):
    """The daemon's warm worker: the same death under the limit names the limit."""
    aborting = _script(tmp_path, "abort", "import os, sys\nsys.stdin.readline()\n"
                       "sys.stderr.write('std::bad_alloc\\n')\nsys.stderr.flush()\nos.abort()\n")
    warm = WarmWorker()
    try:
        with pytest.raises(WorkerError) as exc:
            warm.run({"kind": "job"}, job="j", python=aborting, timeout_s=60, memory_max_bytes=1 << 30)
    finally:
        warm.close()
    assert exc.value.message.startswith("the profile pass exceeded the worker memory limit (1,073,741,824 bytes")


def test_torch_allocator_failure_under_memory_limit_crashed_the_worker(monkeypatch):
    """PyTorch's allocator under RLIMIT_DATA raises ``RuntimeError: DefaultCPUAllocator: can't
    allocate memory`` — not a MemoryError, so it escaped the worker's reply as a crash. With the
    limit set it is the typed reply naming the limit; another RuntimeError still propagates."""
    from tuner.commands import worker_main

    def boom(_request):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr("tuner.jobs.job.run_job", boom)
    monkeypatch.setattr(worker_main, "_calibrate", lambda r: r)
    monkeypatch.setenv("CTX_TUNER_WORKER_MEMORY_MAX_BYTES", str(512 << 20))
    request = {"protocol": 1, "kind": "job", "drop": {"name": "x", "model": "m", "candidates": {}},
               "config_path": "/nonexistent/config.json", "device": {}}
    reply = worker_main.handle(request)
    assert (reply["error_type"], reply["message"]) == (
        "WorkerError", "the profile pass ran out of memory (worker memory limit 536,870,912 bytes, "
                       "setting worker_memory_max_bytes)")
    monkeypatch.delenv("CTX_TUNER_WORKER_MEMORY_MAX_BYTES")
    with pytest.raises(RuntimeError):
        worker_main.handle(request)


# -- 3: the worker imports code from the daemon's working directory -------------------------------

def test_worker_imported_planted_module_from_daemons_working_directory(tmp_path, monkeypatch):
    """A ``json.py`` (or ``yaml/``) planted where the daemon was started ran in the worker:
    ``python -m tuner.commands.worker_main`` put the working directory first on ``sys.path``. Workers
    start with ``PYTHONSAFEPATH=1`` now (the daemon's also in ``/``): the planted code never runs."""
    planted = tmp_path / "drops"
    planted.mkdir()
    marker = tmp_path / "planted-ran"
    for mod in ("json.py", "yaml.py"):
        (planted / mod).write_text(f"open({str(marker)!r}, 'a').write({mod!r})\nraise SystemExit(7)\n")
    monkeypatch.chdir(planted)
    # a request no job runs (another kind): the worker imports its own modules and answers typed
    with pytest.raises(Exception) as exc:
        run_in_worker({"kind": "nothing"}, job="j", timeout_s=120)
    assert not marker.exists()
    assert not isinstance(exc.value, WorkerError), exc.value  # a typed reply, not a crash
    env = worker_env({"PYTHONPATH": ":lib:/opt/x:", "PATH": "/bin"}, cwd="/srv/d")
    assert (env["PYTHONSAFEPATH"], env["PYTHONPATH"]) == ("1", "/srv/d/lib:/opt/x")  # no empty (= cwd) entry
    assert "PYTHONPATH" not in worker_env({"PYTHONPATH": "::"})


def test_daemon_worker_started_in_daemons_working_directory(h, monkeypatch):
    """The daemon starts its workers (one-shot and warm) in ``/``, with a relative ``worker_python``
    made absolute first."""
    seen = []

    def popen(args, **kw):
        seen.append((list(args), kw.get("cwd"), kw["env"].get("PYTHONSAFEPATH")))
        return subprocess.Popen(args, **kw)

    d = h.start(popen=popen)
    (h.conf / "a.yaml").write_text(drop_text("a", h.model))
    h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'done'") == [(1,)], what="a done")
    assert [(cwd, safe) for _args, cwd, safe in seen] == [("/", "1")]
    monkeypatch.chdir(h.tmp)
    from tuner.daemon.service import _Running

    from types import SimpleNamespace

    d._running = _Running(SimpleNamespace(id=0), None, None, 0.0)  # type: ignore[arg-type]
    d._popen_fn = lambda args, **kw: seen.append(list(args)) or subprocess.Popen(["true"])
    try:
        d._popen(["./venv/bin/python", "-m", "tuner.commands.worker_main"], env={}).wait()
    finally:
        d._running = None
    assert seen[-1] == [str(h.tmp / "venv" / "bin" / "python"), "-m", "tuner.commands.worker_main"]


# -- 4: a worker_python wrapper that leaves a helper process ----------------------------------------

def _wrapper_with_helper(tmp_path: Path) -> tuple[str, Path]:
    """A ``worker_python`` wrapper that starts a helper (inheriting stdout/stderr, in the worker's
    group) and then execs the fake worker; the helper writes its pid to a file."""
    pidfile = tmp_path / "helper.pid"
    helper = tmp_path / "helper.py"
    helper.write_text(f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(3600)\n")
    p = tmp_path / "wrapped-python"
    p.write_text(f"#!/bin/sh\n{sys.executable} -S {helper} &\nexec {sys.executable} -S {FAKE_WORKER} \"$@\"\n")
    p.chmod(0o755)
    return str(p), pidfile


def _alive(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return st[st.rfind(")") + 2] != "Z"


def test_worker_python_wrapper_helper_made_killed_worker_a_timeout(tmp_path):
    """With a wrapper whose helper keeps the pipes open, a killed worker was noticed only at the
    job timeout (reported as a timeout). The worker's own exit is watched now: a crash within
    seconds, and the helper (the worker's group) is gone too; a good reply is read as before."""
    wrapper, pidfile = _wrapper_with_helper(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as exc:
        run_in_worker(_fake_request("crash-1"), job="j", python=wrapper, timeout_s=60)
    assert time.monotonic() - t0 < 20
    assert not isinstance(exc.value, WorkerTimeout)
    assert exc.value.message.startswith("worker crashed (killed by signal 9): CUDA out of memory")
    helper = int(poll(lambda: pidfile.exists() and pidfile.read_text(), 10, what="helper pid"))
    poll(lambda: not _alive(helper), 10, what="the helper gone with the worker's group")
    pidfile.unlink()
    t0 = time.monotonic()
    result = run_in_worker(_fake_request("ok-1"), job="j", python=wrapper, timeout_s=60)
    assert result["proposals"][0]["gpu_memory_utilization"] == 0.5 and time.monotonic() - t0 < 20


def test_warm_worker_wrapper_helper_made_killed_worker_a_timeout(tmp_path):
    wrapper, pidfile = _wrapper_with_helper(tmp_path)
    warm = WarmWorker()
    try:
        assert warm.run(_fake_request("ok-1"), job="j", python=wrapper, timeout_s=60)["proposals"]
        t0 = time.monotonic()
        with pytest.raises(WorkerError) as exc:
            warm.run(_fake_request("crash-2"), job="j", python=wrapper, timeout_s=60)
        assert time.monotonic() - t0 < 20 and not isinstance(exc.value, WorkerTimeout)
        assert exc.value.message.startswith("worker crashed (killed by signal 9)")
    finally:
        warm.close()
    helper = int(poll(lambda: pidfile.exists() and pidfile.read_text(), 10, what="helper pid"))
    poll(lambda: not _alive(helper), 10, what="the helper gone with the worker's group")


# -- 5, 8: a config.json nested 100,000 levels; a FIFO or a link to /dev/zero ----------------------

def test_deeply_nested_config_json_was_a_retried_recursion_error(tmp_path):
    """A 100,000-level nested ``config.json`` was "unexpected RecursionError" (a run failure,
    retried) naming no file. It is a :class:`ModelConfigError` naming the file (a drop failure)."""
    from tuner.store.jobqueue import failure_kind
    from tuner.model.modelspec import MAX_CONFIG_DEPTH, config_file_sha256, load_model_spec, read_top

    d = tmp_path / "deep"
    d.mkdir()
    cfg = d / "config.json"
    cfg.write_text('{"architectures": ["LlamaForCausalLM"], "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    for fn in (read_top, config_file_sha256, load_model_spec):
        with pytest.raises(ModelConfigError) as exc:
            fn(cfg)
        assert exc.value.where == str(cfg)
        assert exc.value.message == (f"config nests objects/lists 100001 levels deep; model configs are read up to "
                                     f"{MAX_CONFIG_DEPTH} levels (MAX_CONFIG_DEPTH)")
        assert failure_kind(exc.value) == "drop"
    cfg.write_text(json.dumps({"a": "[" * 80 + "{", "b": {"c": [1]}}))
    assert read_top(cfg) == {"a": "[" * 80 + "{", "b": {"c": [1]}}  # brackets inside strings do not count


def test_config_json_fifo_or_dev_zero_link_reported_as_no_config_found(tmp_path):
    """A ``config.json`` that is a FIFO, or a link to ``/dev/zero``, was "no config.json found";
    it is "not a regular file" naming it now — found at once, never opened (no hang, no read)."""
    from tuner.model.modelspec import resolve_model_path

    fifo_dir, zero_dir = tmp_path / "fifo", tmp_path / "zero"
    fifo_dir.mkdir()
    zero_dir.mkdir()
    os.mkfifo(fifo_dir / "config.json")
    os.symlink("/dev/zero", zero_dir / "config.json")
    os.symlink("/dev/zero", tmp_path / "direct.json")
    os.symlink(tmp_path / "nothing", tmp_path / "dangling.json")
    cases = [(fifo_dir, fifo_dir / "config.json", "not a regular file (a FIFO)"),
             (zero_dir, zero_dir / "config.json", "not a regular file (a character device, through a symbolic link)"),
             (tmp_path / "direct.json", tmp_path / "direct.json",
              "not a regular file (a character device, through a symbolic link)"),
             (tmp_path / "dangling.json", tmp_path / "dangling.json", "a dangling symbolic link")]
    for model, where, what in cases:
        t0 = time.monotonic()
        with pytest.raises(ModelConfigError) as exc:
            resolve_model_path(str(model))
        assert time.monotonic() - t0 < 5
        assert (exc.value.where, exc.value.message) == (str(where), f"{what}; a model config must be a regular file")


def test_import_log_config_fifo_hung(tmp_path):
    """``import-log``'s own config reader read the file whole: a FIFO hung it. It reads through
    the bounded regular-file reader now."""
    from tuner.accuracy.importlog import read_config

    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(ModelConfigError, match="not a regular file"):
        read_config(tmp_path / "config.json")
    (tmp_path / "deep.json").write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(ModelConfigError, match="levels deep"):
        read_config(tmp_path / "deep.json")


# -- 6: temporaries in proposals/NAME.vllm/ survive restarts ---------------------------------------

def test_temporary_files_in_proposal_vllm_dir_survived_restarts(h):
    state = Path(h.settings.state_dir)
    vdir = state / "proposals" / "a.vllm"
    vdir.mkdir(parents=True)
    junk = [vdir / ".gpu-memory-utilization-0.9.yaml.k2j3.tmp", vdir / ".kv-cache-memory-bytes-0.9.yaml.x8y.tmp"]
    for p in junk:
        p.write_bytes(b"x" * 4096)
    keep = vdir / "gpu-memory-utilization-0.9.yaml"
    keep.write_text("model: m\n")
    h.start()
    assert [p.exists() for p in junk] == [False, False] and keep.exists()


# -- 9: state dir full / read-only, SIGTERM with a failing store ------------------------------------

def test_full_state_dir_logged_an_error_every_few_seconds(h, monkeypatch, caplog):
    """While the state dir is full every reconcile and snapshot logged an ERROR (and the failing
    steps starved the watchdog). The condition is logged once when it begins and once when it
    ends; meanwhile the loop stays healthy and the results are in the store."""
    import errno

    from tuner.daemon import service as daemon_mod
    from tuner.errors import StoreError

    real_write, real_snap = daemon_mod.write_proposal_file, daemon_mod.write_snapshot
    full = OSError(errno.ENOSPC, "No space left on device")

    def no_space(*_a, **_kw):
        raise full

    def no_space_snapshot(*_a, **_kw):
        raise StoreError("cannot write snapshot: No space left on device", where="snap") from full

    d = h.start()
    caplog.set_level(logging.DEBUG, logger="tuner.daemon.service")
    monkeypatch.setattr(daemon_mod, "write_proposal_file", no_space)
    monkeypatch.setattr(daemon_mod, "write_snapshot", no_space_snapshot)
    for n in ("a", "b", "c"):
        (h.conf / f"{n}.yaml").write_text(drop_text(n, h.model))
    h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'done'") == [(3,)], what="all done")
    for _ in range(20):  # rescans and snapshot retries while the disk is full
        d._next_rescan = 0
        d._last_snapshot = -1e9
        d.step(max_wait_s=0.01)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [f"state_dir {h.settings.state_dir} is full (no space left on the device) (proposal file of a: "
                      "No space left on device); proposal files and the snapshot are not written until it is fixed "
                      "(results are kept in the store and the files written then)"]
    assert d.healthy() and d._errors == 0
    monkeypatch.setattr(daemon_mod, "write_proposal_file", real_write)
    monkeypatch.setattr(daemon_mod, "write_snapshot", real_snap)
    d._next_rescan = 0
    d._last_snapshot = -1e9
    h.until(d, lambda: all((Path(h.settings.state_dir) / "proposals" / f"{n}.yaml").exists() for n in "abc"),
            what="the proposal files written once there is space")
    for _ in range(3):
        d.step(max_wait_s=0.01)
    ends = [r.getMessage() for r in caplog.records if "writable again" in r.getMessage()]
    assert ends == [f"state_dir {h.settings.state_dir} is writable again (it was full (no space left on the device)); "
                    "proposal files and the snapshot are written"]
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1


def test_read_only_state_dir_reported_as_not_writable_by_this_user(tmp_path, monkeypatch):
    """A state dir on a read-only mount was "not writable by this user"; it says read-only."""
    import errno

    from tests._daemon_helpers import settings_for
    from tuner.daemon import service as daemon_mod
    from tuner.errors import SettingsError

    s = settings_for(tmp_path)
    Path(s.state_dir).mkdir()
    real_statvfs = os.statvfs

    class RO:
        def __init__(self, st):
            self.f_flag = st.f_flag | os.ST_RDONLY

    monkeypatch.setattr(daemon_mod.os, "access", lambda *_a, **_kw: False)
    monkeypatch.setattr(daemon_mod.os, "statvfs", lambda p: RO(real_statvfs(p)))
    with pytest.raises(SettingsError) as exc:
        daemon_mod.make_state_dir(s)
    assert exc.value.message.startswith(f"state_dir {s.state_dir} is on a read-only filesystem (mounted read-only")
    monkeypatch.setattr(daemon_mod.os, "statvfs", real_statvfs)
    with pytest.raises(SettingsError, match="is not writable by this user"):
        daemon_mod.make_state_dir(s)
    assert daemon_mod.state_dir_condition(OSError(errno.EROFS, "Read-only file system")) == "on a read-only filesystem"
    assert daemon_mod.state_dir_condition(OSError(errno.EIO, "I/O error")) is None


def _fail_store_writes(d) -> None:
    """Every new connection of the daemon's store refuses writes (SQLite ``query_only``): what a
    store whose filesystem went read-only does."""
    import sqlalchemy as sa

    sa.event.listen(d.store.engine, "connect", lambda conn, _rec: conn.execute("PRAGMA query_only = ON"))
    d.store.engine.dispose()


def test_sigterm_with_failing_store_logged_traceback_and_later_daemon_crash(h, monkeypatch, caplog):
    """SIGTERM while a job ran and the store refused writes logged a 40-line traceback, and the next
    start called the job "interrupted by a daemon crash". The stop logs one ERROR line now, and
    the next start says the job was stopped with the daemon (requeued uncounted, no backoff)."""
    monkeypatch.setenv("FAKE_SLOW_S", "60")
    d = h.start()
    (h.conf / "slow-1.yaml").write_text(drop_text("slow-1", h.model))
    h.until(d, lambda: h.job("slow-1.yaml")[0] == "running" and h.job("slow-1.yaml")[4], 20, what="slow-1 running")
    (job_id,), = h.rows("SELECT id FROM jobs WHERE path = ?", str(h.conf / "slow-1.yaml"))
    _fail_store_writes(d)
    caplog.set_level(logging.INFO, logger="tuner.daemon.service")
    d.request_stop()
    d.shutdown()
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("stopping without finishing the store's bookkeeping: StoreError: ")
    assert errors[0].endswith(f"; job(s) {job_id} go back to the queue at the next start (not counted)")
    assert h.job("slow-1.yaml")[0] == "running"
    caplog.clear()
    monkeypatch.setenv("FAKE_SLOW_S", "0")
    d2 = h.start()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "queued again" in r.getMessage()]
    assert warned == [f"job {job_id} ({h.conf / 'slow-1.yaml'}) was stopped with the daemon (SIGTERM) before it could "
                      "be returned to the queue; queued again (not counted: 0 of 3 attempts used; interrupted 1 time(s))"]
    (hist,), = h.rows("SELECT history FROM jobs WHERE id = ?", job_id)
    assert json.loads(hist)[-1]["reason"].startswith("the daemon was stopped (SIGTERM) during the job")
    assert not (Path(h.settings.state_dir) / "stopped-jobs.json").exists()
    h.until(d2, lambda: h.job("slow-1.yaml")[0] == "done", 20, what="slow-1 done after the restart")


# -- 7: `model:` may name any readable JSON file, and its values were echoed ------------------------

def test_model_naming_any_readable_json_file_was_read_and_echoed(tmp_path, tiny_config, monkeypatch):
    """A drop whose ``model`` named a file outside the operator's model directories was read, and
    its values echoed into the log and the jobs table. With ``model_roots`` set the drop fails as
    invalid before the file is read (a symlink inside a root pointing outside counts as outside);
    a model inside a root runs as before."""
    monkeypatch.setenv("FAKE_WORKER_LOG", str(tmp_path / "worker.log"))
    secret_dir = tmp_path / "etc-secret"
    secret_dir.mkdir()
    (secret_dir / "config.json").write_text(json.dumps({"hidden_size": "hunter2-token", "api_key": "s3cr3t"}))
    roots = tmp_path / "models"
    roots.mkdir()
    shutil.copytree(tiny_config, roots / "tiny")
    os.symlink(secret_dir, roots / "sneaky")
    h = Harness(tmp_path, tiny_config, model_roots=(str(roots),))
    try:
        d = h.start()
        (h.conf / "out.yaml").write_text(drop_text("out", secret_dir))
        (h.conf / "link.yaml").write_text(drop_text("link", roots / "sneaky"))
        (h.conf / "ok.yaml").write_text(drop_text("ok", roots / "tiny"))
        h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status IN ('done', 'failed')") == [(3,)], 20,
                what="three jobs finished")
        assert h.job("ok.yaml")[0] == "done"
        for name, shown in (("out.yaml", f"{secret_dir / 'config.json'}"),
                            ("link.yaml", f"{secret_dir / 'config.json'}")):  # the link followed
            status, etype, error, attempts, _pid = h.job(name)
            assert (status, etype, attempts) == ("failed", "DropError", 1)
            assert error == (f"{h.conf / name}:model: {shown} is outside the allowed model roots ({roots}: setting "
                             "model_roots); put the model under one of them or ask the operator to add its directory")
            assert "hunter2" not in error and "s3cr3t" not in error
        assert [ln.split()[1] for ln in (tmp_path / "worker.log").read_text().splitlines()] == ["ok"]
    finally:
        h.close()
    from tuner.daemon.settings import load_settings

    (tmp_path / "s.yaml").write_text("model_roots: [models, /srv/models]\n")
    assert load_settings(tmp_path / "s.yaml").model_roots == (str(tmp_path / "models"), "/srv/models")
    shipped = load_settings(REPO / "configs" / "tuner.yaml")
    assert shipped.model_roots == ("/var/lib/ctx-tuner/models", "/srv/models")  # restrictive where shipped
    from tuner.daemon.settings import Settings

    assert Settings().model_roots is None  # permissive built-in default (the CLI never checks)


def test_foreign_json_values_echoed_in_model_config_errors(tmp_path):
    """A JSON file that is no model config had its values echoed by the config checks ("hidden_size
    must be a positive integer, not 'hunter2-…'"). It is refused without a value now, and a
    model config's bad values are shown only when short and name-like."""
    from tuner.model.modelspec import load_model_spec, shown

    d = tmp_path / "foreign"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": "hunter2-token-0123456789abcdef", "db": {"pw": "x"}}))
    with pytest.raises(ModelConfigError) as exc:
        load_model_spec(d / "config.json")
    assert exc.value.message == ("not a model config: the JSON object has neither `architectures` nor `model_type` "
                                 "(its values are not shown)")
    assert "hunter2" not in str(exc.value)
    assert [shown(v) for v in (4096, True, None, "int8", "hunter 2 secret", "x" * 41, [1, 2], {"a": 1})] == [
        "4096", "True", "None", "'int8'", "a string of 15 characters", "a string of 41 characters",
        "a list of 2 items", "a JSON object of 1 keys"]
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                               "hidden_size": "my secret value", "num_hidden_layers": 2,
                                               "num_attention_heads": 4, "vocab_size": 100,
                                               "intermediate_size": 128, "max_position_embeddings": 64}))
    with pytest.raises(ModelConfigError) as exc:
        load_model_spec(d / "config.json")
    assert "my secret value" not in str(exc.value) and "a string of 15 characters" in str(exc.value)


def test_prefix_caching_on_hybrid_model_before_0_19_crashed_with_typeerror():
    """``enable_prefix_caching`` on a hybrid model under a release before the modelled mamba cache
    modes raised ``TypeError: 'VllmVersion' object is not iterable`` while writing its warning (a
    run failure, retried, of one of the visible cases); it is the warning now."""
    from types import SimpleNamespace

    from tuner.memory.eras import era_for
    from tuner.jobs.job import mamba_cache_mode

    warnings: list[str] = []
    plugin = SimpleNamespace(mamba_prefix_caching_mode="align")
    assert mamba_cache_mode({"enable_prefix_caching": True}, era_for("0.10.1"), plugin, warnings) is None
    assert warnings == ["enable_prefix_caching on a hybrid model: mamba_cache_mode 'align' in vLLM 0.10.1 is not "
                        "modelled (state blocks counted as without it)"]

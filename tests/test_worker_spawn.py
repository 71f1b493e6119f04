"""A worker started ahead of its request (issue 13, 70B first answer): ``tuner.commands.worker_main
--preload`` imports first, then answers the request as the one-shot worker does;
:func:`tuner.seam.worker.spawn_worker` starts it with ``run_in_worker``'s environment, its handle is
cancelled without leaving a process, and ``profile`` starts one only when a worker will certainly
run (a fake spawner here: no real process for those)."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._daemon_helpers import group_alive, hanging_python, poll, without_elapsed
from tuner.seam import worker as worker_mod
from tuner.errors import ProtocolError, StoreError, WorkerError
from tuner.seam.worker import _RUNNING, run_in_worker, spawn_worker, spawner_for
from tuner.seam.worker_guard import ENV_DEADLINE, ENV_MEMORY, ENV_PARENT


def _tiny_drop(tmp_path: Path, tiny_config: Path, name: str = "tiny", gmu=(0.9,)) -> Path:
    d = tmp_path / f"{name}.yaml"
    d.write_text(f"name: {name}\nmodel: {tiny_config}\ndevice: H100-80GB\nengine_version: \"0.19.0\"\n"
                 f"max_num_batched_tokens: 2048\nmax_num_seqs: 64\n"
                 f"candidates:\n  gpu_memory_utilization: {list(gmu)}\n  max_model_len: [1024, 4096]\n")
    return d


def _tiny_request(tmp_path: Path, tiny_config: Path) -> dict:
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import load_drop

    return prepare_request(load_drop(_tiny_drop(tmp_path, tiny_config)), download=False)[0]


# --- the --preload worker answers like the one-shot worker ---------------------------------------


@pytest.mark.slow
def test_preload_worker_answers_a_simulate_job_as_a_fresh_worker_does(tmp_path, tiny_config):
    request = _tiny_request(tmp_path, tiny_config)
    with spawn_worker(timeout_s=300) as handle:
        assert handle.proc.args[-2:] == ["tuner.commands.worker_main", "--preload"]
        assert _RUNNING.get(handle.pid) is not None  # kill_running_workers sees it from the spawn
        ahead = run_in_worker(request, job="tiny", spawned=handle)
    assert handle.proc.returncode == 0 and handle.pid not in _RUNNING
    fresh = run_in_worker(request, job="tiny")
    assert without_elapsed(ahead) == without_elapsed(fresh)
    assert ahead["method"] == "simulate"
    assert [(p["gpu_memory_utilization"], p["max_model_len"]) for p in ahead["proposals"]] == [(0.9, 4096)]


@pytest.mark.slow
def test_preload_worker_answers_a_validate_request_and_a_refused_protocol(shared_dir):
    from tuner.question.protocol import ValidateRequest

    with spawn_worker(timeout_s=300) as handle:
        report = run_in_worker(ValidateRequest(cases=(), models_dir=str(shared_dir / "models")), job="validate",
                               spawned=handle)
    assert report["cases"] == [] and report["summary"]["cases"] == 0 and report["summary"]["unsafe"] == 0
    with spawn_worker(timeout_s=300) as handle, pytest.raises(ProtocolError) as e:
        run_in_worker({"protocol": 999, "kind": "job"}, job="newer", spawned=handle)  # a newer ctx-tuner's request
    assert "999" in str(e.value) and handle.proc.returncode == 0


# --- the handle: cancel leaves no process ----------------------------------------------------------


def test_cancelled_spawn_leaves_no_process_no_group_and_no_registration(tmp_path):
    py, marker = hanging_python(tmp_path, read_request=False)
    handle = spawn_worker(timeout_s=60, python=py)
    try:
        assert handle.pid in _RUNNING
        poll(marker.exists, 20, what="the worker and its grandchild started")
        handle.cancel()
        assert handle.proc.poll() is not None  # reaped
        assert handle.pid not in _RUNNING and handle.cancelled
        poll(lambda: not group_alive(handle.pid), 10, what="the worker's process group gone")
        handle.cancel()  # twice: nothing
        with pytest.raises(WorkerError, match="cancelled"):
            run_in_worker({}, job="late", spawned=handle)
    finally:
        if group_alive(handle.pid):
            worker_mod._kill_group(handle.proc, worker_mod.os.killpg)


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit, StoreError])
def test_spawn_used_as_context_manager_leaves_no_process_when_the_caller_raises(tmp_path, exc_type):
    py, _marker = hanging_python(tmp_path, read_request=False)
    with pytest.raises(exc_type):
        with spawn_worker(timeout_s=60, python=py) as handle:
            raise exc_type("before the job")
    assert handle.proc.poll() is not None and handle.pid not in _RUNNING


class _FakeProc:
    """A worker process that answers at once (no real process)."""

    def __init__(self, args, reply=None, **kw):
        self.args, self.kw, self.pid, self.returncode = args, kw, 424242, None
        self.reply = reply or {"ok": True, "protocol": 1, "result": {"x": 1}}
        self.stdin = self.stdout = self.stderr = None
        self.timeouts: list = []

    def communicate(self, data=None, timeout=None):
        self.timeouts.append(timeout)
        self.returncode = 0
        return json.dumps(self.reply).encode(), b""

    def wait(self, timeout=None):
        self.returncode = -9
        return self.returncode

    def poll(self):
        return self.returncode


def test_spawn_uses_run_in_workers_environment_and_isolation_plus_preload(monkeypatch):
    started: list[_FakeProc] = []

    def popen(args, **kw):
        started.append(_FakeProc(args, **kw))
        return started[-1]

    monkeypatch.delenv("CTX_TUNER_WORKER_PYTHON", raising=False)
    run_in_worker({}, job="j", timeout_s=10, memory_max_bytes=123, popen=popen)
    spawn_worker(timeout_s=10, memory_max_bytes=123, popen=popen, killpg=lambda *_: None).cancel()
    fresh, ahead = started
    assert fresh.args == [sys.executable, "-m", "tuner.commands.worker_main"]
    assert ahead.args == [sys.executable, "-m", "tuner.commands.worker_main", "--preload"]
    assert fresh.kw == ahead.kw
    assert ahead.kw["start_new_session"] is True
    env = ahead.kw["env"]
    assert (env[ENV_DEADLINE], env[ENV_MEMORY], env[ENV_PARENT]) == ("15", "123", str(worker_mod.os.getpid()))
    assert (env["PYTHONUNBUFFERED"], env["HF_HUB_OFFLINE"]) == ("1", "1")
    assert _RUNNING == {}


def test_spawned_worker_charged_the_parents_store_wait_to_the_job_timeout():
    """A worker started ahead while the parent waited on a locked store timed out a 2 s pass under
    ``--timeout 3``: the limit counted from the spawn. It counts from the request now: the parent
    waits the whole ``timeout_s`` of the handle, and the request carries the worker's own
    deadline (timeout + grace), which it arms when it reads the request."""
    sent = []

    class Proc(_FakeProc):
        def communicate(self, data=None, timeout=None):
            sent.append(json.loads(data))
            return super().communicate(data, timeout)

    proc = Proc(["py"])
    handle = spawn_worker(timeout_s=10, popen=lambda args, **kw: proc, killpg=lambda *_: None)
    assert run_in_worker({"kind": "job"}, job="j", timeout_s=600, spawned=handle) == {"x": 1}
    assert proc.timeouts == [10.0]  # the handle's limit, not the 600 given to run_in_worker
    assert sent[0][worker_mod.DEADLINE_KEY] == 10 + worker_mod.DEADLINE_GRACE_S
    assert handle.used and 424242 not in _RUNNING
    fresh = Proc(["py"])
    run_in_worker({"kind": "job"}, job="j", timeout_s=7, popen=lambda args, **kw: fresh, killpg=lambda *_: None)
    assert worker_mod.DEADLINE_KEY not in sent[1]  # a worker started for its request: the env's deadline


def test_preload_worker_arms_its_deadline_only_when_the_request_comes(tmp_path, tiny_config):
    """A ``--preload`` worker whose environment's deadline (0.3 s) is shorter than its own imports
    (torch alone takes longer) still answers: that deadline was not armed at its start; the
    request's ``deadline_s`` is taken out before the job reads the request."""
    import os

    request = _tiny_request(tmp_path, tiny_config)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", ENV_DEADLINE: "0.3", ENV_PARENT: str(os.getpid())}
    proc = subprocess.Popen([sys.executable, "-m", "tuner.commands.worker_main", "--preload"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(json.dumps({**request, worker_mod.DEADLINE_KEY: 300}).encode(), timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    reply = json.loads(out)
    assert proc.returncode == 0 and reply["ok"] is True, err[-500:]
    assert [(p["gpu_memory_utilization"], p["max_model_len"]) for p in reply["result"]["proposals"]] == [(0.9, 4096)]


def test_worker_python_that_cannot_start_gave_a_traceback():
    """``CTX_TUNER_WORKER_PYTHON=/nonexistent`` (or a script with a bad ``#!``) raised the raw
    ``FileNotFoundError`` from Popen; it is a WorkerError naming the interpreter now."""
    with pytest.raises(WorkerError) as exc:
        run_in_worker({"kind": "job"}, job="j", python="/nonexistent/python3")
    assert exc.value.message.startswith("cannot start the worker Python /nonexistent/python3: ")
    assert "No such file or directory" in exc.value.message and _RUNNING == {}


def test_cancel_after_the_job_signals_nothing_so_a_reused_pid_is_never_killed():
    kills = []
    handle = spawn_worker(timeout_s=10, popen=lambda args, **kw: _FakeProc(args),
                          killpg=lambda pid, sig: kills.append(pid))
    run_in_worker({}, job="j", spawned=handle)
    handle.cancel()
    with handle:
        pass
    assert kills == [] and not handle.cancelled
    with pytest.raises(WorkerError, match="already used"):
        run_in_worker({}, job="again", spawned=handle)


def test_spawner_for_binds_the_workers_python_and_nothing_for_a_fake():
    show = print
    assert spawner_for(lambda request, **kw: {}) is None
    assert spawner_for(functools.partial(lambda request, **kw: {}, python="/x")) is None
    plain = spawner_for(run_in_worker)
    assert plain.func is spawn_worker and plain.keywords == {}
    bound = spawner_for(functools.partial(functools.partial(run_in_worker, python="/venv/bin/python"),
                                          on_progress=show))
    assert bound.func is spawn_worker and bound.keywords == {"python": "/venv/bin/python"}


def test_spawner_for_a_fake_put_in_run_in_workers_place_is_none(monkeypatch):
    fake = lambda request, **kw: {}  # noqa: E731 - what a test puts in tuner.seam.worker.run_in_worker
    monkeypatch.setattr(worker_mod, "run_in_worker", fake)
    assert spawner_for(fake) is None


# --- profile: spawn ahead only when a worker will certainly run -------------------------------------


class _FakeHandle:
    def __init__(self, timeout_s):
        self.timeout_s = timeout_s
        self.cancels = 0

    def cancel(self):
        self.cancels += 1


class _Recorder:
    """A fake spawner and a fake worker (run_job in this process, through JSON as the pipe does)."""

    def __init__(self):
        self.handles: list[_FakeHandle] = []
        self.spawned_seen: list = []

    def spawner(self, *, timeout_s):
        self.handles.append(_FakeHandle(timeout_s))
        return self.handles[-1]

    def worker(self, request, *, job, timeout_s=None, spawned=None, **kw):
        from tuner.jobs.job import run_job

        self.spawned_seen.append(spawned)
        return json.loads(json.dumps(run_job(copy.deepcopy(request))))


def test_profile_spawns_ahead_when_the_store_is_missing_and_the_worker_gets_that_handle(tmp_path, tiny_config):
    from tuner.jobs.app import profile

    rec = _Recorder()
    db = str(tmp_path / "store.sqlite")
    out = profile(str(_tiny_drop(tmp_path, tiny_config)), db_url=db, worker=rec.worker, spawner=rec.spawner,
                  timeout_s=42)
    assert [h.timeout_s for h in rec.handles] == [42]
    assert rec.spawned_seen == rec.handles  # the worker ran in the process spawned ahead
    assert rec.handles[0].cancels == 1  # profile's finally: a no-op for a used handle
    assert out.result["pass_source"]["reason"] == "no store" and out.drop_id == 1


def test_profile_does_not_spawn_when_the_store_exists_and_the_memo_may_answer(tmp_path, tiny_config):
    from tuner.jobs.app import profile

    db = str(tmp_path / "store.sqlite")
    profile(str(_tiny_drop(tmp_path, tiny_config)), db_url=db, worker=_Recorder().worker, spawner=_Recorder().spawner)
    rec = _Recorder()
    out = profile(str(_tiny_drop(tmp_path, tiny_config, name="tiny2", gmu=(0.5,))), db_url=db, worker=rec.worker,
                  spawner=rec.spawner)
    assert rec.handles == [] and rec.spawned_seen == []  # answered from the memo: no worker at all
    assert out.result["pass_source"]["source"] == "memo"


def test_profile_spawns_ahead_with_cache_off_even_when_the_store_exists(tmp_path, tiny_config):
    from tuner.jobs.app import profile

    db = str(tmp_path / "store.sqlite")
    profile(str(_tiny_drop(tmp_path, tiny_config)), db_url=db, worker=_Recorder().worker, spawner=_Recorder().spawner)
    rec = _Recorder()
    out = profile(str(_tiny_drop(tmp_path, tiny_config, name="tiny2")), db_url=db, worker=rec.worker,
                  spawner=rec.spawner, cache=False)
    assert len(rec.handles) == 1 and rec.spawned_seen == rec.handles
    assert out.result["pass_source"]["reason"] == "no-cache"


@pytest.mark.parametrize("exc_type", [StoreError, KeyboardInterrupt])
def test_profile_cancels_the_spawned_worker_when_it_fails_before_the_job(tmp_path, tiny_config, exc_type):
    from tuner.jobs.app import profile

    from tuner.store.database import open_store

    db = tmp_path / "store.sqlite"
    open_store(str(db)).close()  # a store exists: profile opens it before the job

    def store_factory(url):
        raise exc_type("cannot open the store")

    rec = _Recorder()
    with pytest.raises(exc_type):
        profile(str(_tiny_drop(tmp_path, tiny_config)), db_url=str(db), worker=rec.worker, spawner=rec.spawner,
                store_factory=store_factory, cache=False)
    assert len(rec.handles) == 1 and rec.handles[0].cancels == 1
    assert rec.spawned_seen == []  # the worker never ran


def test_profile_with_a_fake_worker_and_no_spawner_starts_no_process(tmp_path, tiny_config, monkeypatch):
    from tuner.jobs.app import profile

    def no_spawn(**kw):
        raise AssertionError("a real worker was spawned for a fake worker")

    monkeypatch.setattr(worker_mod, "spawn_worker", no_spawn)
    rec = _Recorder()
    out = profile(str(_tiny_drop(tmp_path, tiny_config)), db_url=str(tmp_path / "s.sqlite"), worker=rec.worker)
    assert rec.spawned_seen == [None] and out.drop_id == 1


def test_needs_worker_only_for_simulate_jobs_the_memo_cannot_answer(tmp_path, tiny_config):
    from tuner.jobs.app import _needs_worker

    request = _tiny_request(tmp_path, tiny_config)
    from tuner.question.protocol import as_job_request

    job = as_job_request(request)
    from tuner.store.database import open_store

    missing, existing = str(tmp_path / "none.sqlite"), tmp_path / "there.sqlite"
    open_store(str(existing)).close()
    assert _needs_worker(job, missing, True) is True  # no store: the memo cannot answer
    assert _needs_worker(job, str(existing), True) is False  # the memo may answer
    assert _needs_worker(job, str(existing), False) is True  # --no-cache
    assert _needs_worker(job, str(existing), True, python="/other/python") is True  # not memoizable
    assert _needs_worker(job.replace(method="cuda"), missing, False) is False  # no simulate imports to win


# --- the one-shot worker ends without the interpreter's teardown after a simulate reply ------------

_TEARDOWN_PROBE = (
    "import atexit, runpy, sys\n"
    "atexit.register(lambda: sys.stderr.write('ctx-teardown-ran'))\n"
    "sys.argv = ['tuner.commands.worker_main']\n"
    "runpy.run_module('tuner.commands.worker_main', run_name='__main__')\n")


@pytest.mark.slow
def test_worker_paid_interpreter_teardown_after_a_simulate_reply(tmp_path, tiny_config):
    """The parent waits for the worker's exit before reading the reply; finalizing torch cost a
    cold 70B worker ~0.2 s. A simulate job's worker exits right after its flushed reply (atexit
    handlers do not run; the reply is complete); a request that is no simulate job — here one the
    contract refuses — still ends through the normal teardown."""
    request = _tiny_request(tmp_path, tiny_config)
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", _TEARDOWN_PROBE], input=json.dumps(request), capture_output=True,
                          text=True, env=env, timeout=300)
    reply = json.loads(proc.stdout)
    assert proc.returncode == 0 and reply["ok"] is True
    assert [(p["gpu_memory_utilization"], p["max_model_len"]) for p in reply["result"]["proposals"]] == [(0.9, 4096)]
    assert "ctx-teardown-ran" not in proc.stderr
    refused = subprocess.run([sys.executable, "-c", _TEARDOWN_PROBE], input=json.dumps({"kind": "nonsense"}),
                             capture_output=True, text=True, env=env, timeout=300)
    assert json.loads(refused.stdout)["ok"] is False
    assert refused.returncode == 0 and "ctx-teardown-ran" in refused.stderr


def test_simulate_only_names_the_requests_that_leave_nothing_to_clean_up():
    from tuner.commands.worker_main import simulate_only, skip_teardown

    assert [simulate_only(d) for d in ({"kind": "job"}, {"kind": "job", "method": "simulate"}, {"kind": "validate"},
                                       {"method": None}, {"kind": "job", "method": "cuda"}, {"method": "vllm"},
                                       {"kind": "other"}, [1], None)] == [True, True, True, True, False, False,
                                                                           False, False, False]
    codes = []
    skip_teardown(exit_=codes.append)
    assert codes == [0]


def test_install_leaves_the_deadline_unarmed_for_a_worker_started_ahead():
    import threading

    from tuner.seam import worker_guard

    env = {worker_guard.ENV_DEADLINE: "5"}
    assert [t.name for t in worker_guard.install(env, arm=False, pdeathsig=lambda _s: True)] == []
    assert worker_guard.arm_deadline(None, {}) is None and worker_guard.arm_deadline(0.0) is None
    died = threading.Event()
    clock = iter([100.0, 107.0])  # armed at 100 for 5 s; the watchdog's first look is at 107
    thread = worker_guard.arm_deadline(None, env, die=died.set, monotonic=lambda: next(clock))
    thread.join(timeout=30)
    assert died.is_set() and thread.name == "ctx-tuner-deadline"

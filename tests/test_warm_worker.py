"""The daemon's warm worker (issue 13, :mod:`tuner.seam.warmworker`): one worker process for successive
jobs, with the isolation of a fresh one — own process group, a timeout kills and replaces it, a
crash fails its job, recycled after ``max_jobs`` jobs or on RSS growth. Driven with the fast fake
worker (tests/_fake_worker.py, its ``--serve`` mode), whose log names the pid of every job."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests._daemon_helpers import fake_python, group_alive, poll
from tuner.errors import PluginError, WorkerError, WorkerTimeout
from tuner.seam.warmworker import WarmWorker, read_rss_bytes


def _request(name: str, gmu: float = 0.5) -> dict:
    return {"drop": {"name": name, "content_sha256": "0" * 64,
                     "candidates": {"gpu_memory_utilization": [gmu], "max_model_len": [1024]}},
            "device": {"name": "H100-80GB", "total_memory_bytes": 85_030_076_416}, "method": "simulate"}


@pytest.fixture
def warm(tmp_path, monkeypatch):
    log = tmp_path / "worker.log"
    monkeypatch.setenv("FAKE_WORKER_LOG", str(log))
    w = WarmWorker()
    w.python = str(fake_python(tmp_path))
    w.log = log
    yield w
    w.close()


def _pids(log: Path) -> list[int]:
    return [int(line.split()[0]) for line in log.read_text().splitlines()] if log.exists() else []


def test_successive_jobs_share_one_worker_process(warm):
    results = [warm.run(_request(f"a{i}", round(0.1 * (i + 1), 2)), job=f"a{i}", timeout_s=20, python=warm.python)
               for i in range(4)]
    assert [r["proposals"][0]["gpu_memory_utilization"] for r in results] == [0.1, 0.2, 0.3, 0.4]
    assert len(set(_pids(warm.log))) == 1 and warm.spawned == 1
    assert group_alive(warm.pid)  # idle between jobs, in its own group
    pid = warm.pid
    warm.close()
    assert warm.pid is None and not group_alive(pid)


def test_worker_is_recycled_after_max_jobs(warm):
    for i in range(5):
        warm.run(_request(f"b{i}"), job="b", timeout_s=20, python=warm.python, max_jobs=2)
    pids = _pids(warm.log)
    assert [pids.count(p) for p in dict.fromkeys(pids)] == [2, 2, 1]
    assert warm.spawned == 3


def test_worker_is_recycled_when_its_rss_grows_above_the_limit(warm):
    seen = []
    warm.rss = lambda pid: seen.append(pid) or (3 << 30 if len(seen) == 2 else 100 << 20)
    for i in range(4):
        warm.run(_request(f"c{i}"), job="c", timeout_s=20, python=warm.python, max_rss_bytes=2 << 30)
    pids = _pids(warm.log)
    assert [pids.count(p) for p in dict.fromkeys(pids)] == [2, 2]  # replaced after the 2nd job's 3 GiB


def test_crash_fails_the_job_with_the_stderr_tail_and_the_next_job_gets_a_new_worker(warm):
    warm.run(_request("ok1"), job="ok1", timeout_s=20, python=warm.python)
    with pytest.raises(WorkerError, match=r"worker crashed \(killed by signal 9\): CUDA out of memory") as err:
        warm.run(_request("crash-1"), job="crash-1", timeout_s=20, python=warm.python)
    assert err.value.where == "crash-1"
    warm.run(_request("ok2"), job="ok2", timeout_s=20, python=warm.python)
    pids = _pids(warm.log)
    assert pids[0] == pids[1] != pids[2]


def test_timeout_kills_the_whole_group_and_replaces_the_worker(warm):
    warm.run(_request("ok1"), job="ok1", timeout_s=20, python=warm.python)
    pid = warm.pid
    with pytest.raises(WorkerTimeout, match="exceeded 1 s; worker process group killed"):
        warm.run(_request("hang-1"), job="hang-1", timeout_s=1, python=warm.python)
    # SIGKILL is delivered asynchronously: the grandchild (re-parented) may still be running for a moment.
    poll(lambda: not group_alive(pid), timeout_s=10, what="the killed worker group gone")  # worker + its child
    warm.run(_request("ok2"), job="ok2", timeout_s=20, python=warm.python)
    assert warm.pid != pid and warm.spawned == 2


def test_typed_error_is_a_reply_and_the_worker_stays(warm):
    warm.run(_request("ok1"), job="ok1", timeout_s=20, python=warm.python)
    with pytest.raises(PluginError, match="no architecture"):
        warm.run(_request("typed-1"), job="typed-1", timeout_s=20, python=warm.python)
    warm.run(_request("ok2"), job="ok2", timeout_s=20, python=warm.python)
    assert len(set(_pids(warm.log))) == 1


def test_another_memory_limit_or_interpreter_starts_a_new_worker(warm, tmp_path):
    warm.run(_request("m1"), job="m1", timeout_s=20, python=warm.python, memory_max_bytes=8 << 30)
    warm.run(_request("m2"), job="m2", timeout_s=20, python=warm.python, memory_max_bytes=4 << 30)
    other = tmp_path / "other"
    other.mkdir()
    warm.run(_request("m3"), job="m3", timeout_s=20, python=str(fake_python(other)), memory_max_bytes=4 << 30)
    assert len(set(_pids(warm.log))) == 3


def test_read_rss_bytes_reads_this_process():
    rss = read_rss_bytes(os.getpid())
    assert rss is not None and 10 << 20 < rss < 64 << 30
    assert read_rss_bytes(2 ** 31 - 1) is None


def test_daemon_runs_successive_drops_in_one_warm_worker_and_stops_it_on_shutdown(tmp_path, tiny_config,
                                                                                  monkeypatch):
    from tests._daemon_helpers import own_drop_text, poll, settings_for
    from tuner.daemon.service import Daemon
    from tuner.daemon.notify import Notifier

    log = tmp_path / "worker.log"
    monkeypatch.setenv("FAKE_WORKER_LOG", str(log))
    s = settings_for(tmp_path, worker_max_jobs=50)
    conf, props = Path(s.watch_dir), Path(s.state_dir) / "proposals"
    d = Daemon(s, notifier=Notifier({}))
    d.start()
    try:
        for name in ("w1", "w2", "w3"):
            (conf / f"{name}.yaml").write_text(own_drop_text(name, tiny_config))
            poll(lambda: (props / f"{name}.yaml").exists(), 30, step=lambda: d.step(max_wait_s=0.05),
                 what=f"{name}'s proposal")
        pids = _pids(log)
        assert len(pids) == 3 and len(set(pids)) == 1
        assert group_alive(pids[0])
        from tests._daemon_helpers import db_rows

        rows = db_rows(Path(s.state_dir) / "ctx-tuner.sqlite", "SELECT DISTINCT worker_pid FROM jobs")
        assert rows == [(pids[0],)]  # every job records the worker that ran it (orphan kill at restart)
    finally:
        d.shutdown()
    assert not group_alive(pids[0])


def _drop_request(config: Path, name: str, gmu: float, **extra) -> dict:
    from tests._daemon_helpers import drop_text
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import parse_drop

    text = drop_text(name, config, gmu=(gmu,), **extra)
    return prepare_request(parse_drop(text.encode(), path=str(config.parent / f"{name}.yaml")), download=False)[0]


def _numbers(result: dict) -> tuple:
    """What a result says about memory (timings left out)."""
    keys = ("gpu_memory_utilization", "max_model_len", "num_gpu_blocks", "kv_cache_tokens", "available_kv_cache_bytes",
            "activation_peak_bytes", "weights_bytes", "non_torch_bytes", "cuda_graph_bytes", "fits")
    return (tuple(tuple(c.get(k) for k in keys) for c in result["candidates"]),
            tuple(tuple(p.get(k) for k in keys) for p in result["proposals"]),
            tuple((r["weights_bytes"], r["activation_peak_bytes"], r["max_num_batched_tokens"]) for r in result["runs"]))


def test_warm_worker_answer_differs_from_a_fresh_workers_after_other_jobs(tmp_path, tiny_config):
    """Guard for the warm worker as the daemon's default: the real worker (``worker_main
    --serve``, torch) answers a job after jobs of other models and settings exactly as a fresh
    worker process does — nothing a job leaves in the process changes the next one's numbers."""
    from tuner.seam.worker import run_in_worker

    other = tmp_path / "other-llama"
    other.mkdir()
    cfg = json.loads((tiny_config / "config.json").read_text())
    cfg.update(hidden_size=128, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=352)
    (other / "config.json").write_text(json.dumps(cfg))
    first = _drop_request(tiny_config, "t1", 0.5)
    fresh = run_in_worker(first, job="fresh", timeout_s=300)
    w = WarmWorker()
    try:
        answers = [w.run(r, job=f"warm{i}", timeout_s=300) for i, r in enumerate(
            (_drop_request(other, "o1", 0.9, max_num_seqs=7), _drop_request(tiny_config, "t2", 0.7, max_num_batched_tokens=4096),
             first))]
        assert w.spawned == 1 and w.pid is not None
    finally:
        w.close()
    assert _numbers(answers[-1]) == _numbers(fresh)
    assert _numbers(answers[0]) != _numbers(fresh)  # the comparison can fail: other jobs, other numbers


def test_plugin_registry_rescanned_every_installed_distribution_for_every_job(tmp_path, monkeypatch):
    """Regression (issue 13's daemon timings): every job — each memo answer in the daemon, each job
    in the warm worker — called ``importlib.metadata.entry_points()`` again (tens of ms reading
    every distribution's metadata). The registry is reused while ``sys.path`` and its directories
    are unchanged, and a distribution installed since is still found."""
    import tuner.model.plugin as plugin_mod
    from tests.test_docs import _install_undocumented_plugin

    scans = []
    real = plugin_mod.entry_points
    monkeypatch.setattr(plugin_mod, "entry_points", lambda **kw: scans.append(kw) or real(**kw))
    monkeypatch.setattr(plugin_mod, "_REGISTRY_CACHE", {})
    first = [p.name for p in plugin_mod.load_registry().plugins]
    again = plugin_mod.load_registry()
    assert len(scans) == 1 and [p.name for p in again.plugins] == first and "generic" in first
    again.plugins.clear()  # a caller's copy: the cached registry is not changed through it
    assert [p.name for p in plugin_mod.load_registry().plugins] == first and len(scans) == 1
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))  # a new sys.path entry: scanned again
    assert "someone_elses_family" not in [p.name for p in plugin_mod.load_registry().plugins] and len(scans) == 2
    _install_undocumented_plugin(site)  # installed into it later: its mtime changed
    assert "someone_elses_family" in [p.name for p in plugin_mod.load_registry().plugins] and len(scans) == 3

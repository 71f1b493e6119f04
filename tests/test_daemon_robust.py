"""Issue 15: nothing lost, nothing stuck. One regression test per numbered failure, with real
processes, files, signals and SQLite (the fast fake worker behind ``worker_python`` unless a test
says it uses the real one). The x50 / x30 kill runs and the 75 s lock are benchmarks
(``tests/benchmarks/bench_daemon_crashes.py``, ``bench_daemon_lock.py``); here a few of each."""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests._daemon_helpers import db_rows, own_drop_text as drop_text, group_alive, poll, try_rows, write_settings
from tests.conftest import REPO
from tests.test_daemon import Harness
from tests.test_daemon_service import FakeSystemd
from tuner.seam import worker_guard

HOOKED = REPO / "tests" / "_daemon_with_hooks.py"


@pytest.fixture
def h(tmp_path, tiny_config, monkeypatch):
    monkeypatch.setenv("FAKE_WORKER_LOG", str(tmp_path / "worker.log"))
    harness = Harness(tmp_path, tiny_config)
    yield harness
    harness.close()


def _spawn(settings: Path, log: Path, env_extra: dict | None = None, hooked: bool = False) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env.update(env_extra or {})
    cmd = [sys.executable, str(HOOKED)] if hooked else [sys.executable, "-m", "tuner.cli"]
    out = open(log, "ab")
    return subprocess.Popen(cmd + ["daemon", "--settings", str(settings)], cwd=REPO, env=env, stdout=out, stderr=out)


def _proposal_drop_id(state: Path, name: str) -> int | None:
    p = state / "proposals" / f"{name}.yaml"
    return yaml.safe_load(p.read_text())["drop_id"] if p.exists() else None


# -- 1 -------------------------------------------------------------------------------------------

def test_proposal_file_lost_after_kill_between_commit_and_write(tmp_path, tiny_config):
    """kill -9 aimed at the commit window (results committed, proposal file not yet written),
    three times in a row: every restart re-derives the missing file from the store."""
    settings = write_settings(tmp_path)
    state, db, log = tmp_path / "state", tmp_path / "state" / "ctx-tuner.sqlite", tmp_path / "daemon.log"
    names = ["a", "b", "c"]
    for n in names:
        (tmp_path / "conf.d" / f"{n}.yaml").write_text(drop_text(n, tiny_config))
    kills = 0
    for _ in range(len(names)):  # each hooked run dies right after one commit
        proc = _spawn(settings, log, hooked=True, env_extra={"HOOK_KILL_AFTER_COMMIT": "1"})
        assert proc.wait(timeout=60) == -signal.SIGKILL
        kills += 1
    assert db_rows(db, "SELECT count(*) FROM jobs WHERE status = 'done'") == [(3,)]
    # the last commit's file was never written; the earlier ones were re-derived by the next start
    assert sum(_proposal_drop_id(state, n) is None for n in names) >= 1
    proc = _spawn(settings, log)
    try:
        poll(lambda: all(_proposal_drop_id(state, n) is not None for n in names), 30, what="every proposal file")
        ids = dict(db_rows(db, "SELECT name, id FROM drops WHERE retired_at IS NULL"))
        assert {n: _proposal_drop_id(state, n) for n in names} == ids
        assert db_rows(db, "SELECT count(*), count(DISTINCT name) FROM drops") == [(3, 3)]  # no duplicates
        assert db_rows(db, "SELECT count(*) FROM proposals") == [(3,)]
        assert db_rows(db, "SELECT max(attempts) FROM jobs") == [(1,)]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    text = log.read_text()
    assert kills == 3 and text.count("re-derived from the store (it was missing") >= 1


def test_proposal_file_missing_or_stale_is_rewritten_from_the_store_on_reconcile(h):
    d = h.start()
    for n in ("a", "b"):
        (h.conf / f"{n}.yaml").write_text(drop_text(n, h.model))
    h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'done'") == [(2,)], what="two done")
    props = Path(h.settings.proposals_dir)
    (props / "a.yaml").unlink()                                    # lost
    (props / "b.yaml").write_text("drop: b\ndrop_id: 999\nproposals: []\n")  # stale
    (props / "ghost.yaml").write_text("drop: ghost\n")             # no active drop of that name
    h.settings.snapshot_file.unlink()
    d.reconcile()
    ids = dict(h.rows("SELECT name, id FROM drops"))
    assert _proposal_drop_id(Path(h.settings.state_dir), "a") == ids["a"]
    assert _proposal_drop_id(Path(h.settings.state_dir), "b") == ids["b"]
    assert not (props / "ghost.yaml").exists()
    h.until(d, lambda: h.settings.snapshot_file.exists(), what="the snapshot rewritten")


# -- 2 -------------------------------------------------------------------------------------------

def test_worker_killed_by_signal_or_oom_is_retried_and_done_with_attempts_in_jobs(tmp_path, tiny_config,
                                                                                   monkeypatch):
    """kill -9 of the worker (what the OOM killer does) x3, and a pass over the worker memory
    limit: each is a run failure, retried, then done; attempts and reasons are in ``jobs``."""
    monkeypatch.setenv("FAKE_SLOW_S", "60")
    (tmp_path / "slow-once").mkdir()
    monkeypatch.setenv("FAKE_SLOW_ONCE_DIR", str(tmp_path / "slow-once"))  # retries are quick
    monkeypatch.setenv("FAKE_HOG_ONCE", str(tmp_path / "hogged"))
    monkeypatch.setenv("FAKE_HOG_BYTES", str(1 << 30))
    h = Harness(tmp_path, tiny_config, worker_memory_max_bytes=256 << 20)
    try:
        d = h.start()
        names = ["slow-1", "slow-2", "slow-3"]
        for n in names + ["hog-4"]:
            (h.conf / f"{n}.yaml").write_text(drop_text(n, h.model))
        for n in names:
            pid = h.until(d, lambda: (h.job(f"{n}.yaml")[0] == "running" and h.job(f"{n}.yaml")[4]), 20,
                          what=f"{n} running")
            poll(lambda: (tmp_path / "slow-once" / n).exists(), 20, what=f"{n}'s worker sleeping")
            os.kill(pid, signal.SIGKILL)
            h.until(d, lambda: h.job(f"{n}.yaml")[3] == 2, 20, what=f"{n} retried")
        h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'done'") == [(4,)], 60,
                what="every drop done")
        for n in names:
            (status, attempts, kind, hist), = h.rows(
                "SELECT status, attempts, failure_kind, history FROM jobs WHERE path = ?", str(h.conf / f"{n}.yaml"))
            entries = json.loads(hist)
            assert (status, attempts, kind) == ("done", 2, "run")
            assert [(e["attempt"], e["kind"], e["error_type"]) for e in entries] == [(1, "run", "WorkerError")]
            assert "killed by signal 9" in entries[0]["reason"]
        (attempts, hist), = h.rows("SELECT attempts, history FROM jobs WHERE path = ?", str(h.conf / "hog-4.yaml"))
        assert attempts == 2 and "MemoryError" in json.loads(hist)[0]["reason"]
    finally:
        h.close()


def test_drop_failed_by_a_worker_crash_is_rerun_by_ctx_tuner_retry_without_sighup(h, monkeypatch, capsys):
    from tuner import cli
    from tuner.daemon import service as daemon

    monkeypatch.setattr(daemon, "JOB_POLL_S", 0.05)
    h.settings = type(h.settings)(**{**h.settings.__dict__, "max_attempts": 1})
    d = h.start()
    (h.conf / "crash-a.yaml").write_text(drop_text("crash-a", h.model))
    (h.conf / "bad.yaml").write_text("name: bad\nmodel: [1, 2]\n")
    h.until(d, lambda: h.job("crash-a.yaml")[0] == "failed", what="crash-a failed")
    assert h.rows("SELECT failure_kind FROM jobs ORDER BY path") == [("drop",), ("run",)]
    before = len((h.tmp / "worker.log").read_text().splitlines())
    assert cli.main(["retry", "--db", str(h.db), "nosuch"]) == 1
    assert cli.main(["retry", "--db", str(h.db), "crash-a"]) == 0
    assert "queued again: crash-a" in capsys.readouterr().out
    assert h.job("crash-a.yaml")[0] == "pending"
    h.until(d, lambda: len((h.tmp / "worker.log").read_text().splitlines()) > before, what="the retry running")
    h.until(d, lambda: h.job("crash-a.yaml")[0] == "failed", what="crash-a failed again")
    (hist,), = h.rows("SELECT history FROM jobs WHERE path = ?", str(h.conf / "crash-a.yaml"))
    assert len(json.loads(hist)) == 2  # the earlier attempt's reason is kept
    assert cli.main(["retry", "--db", str(h.db), "--failed"]) == 0
    assert h.rows("SELECT count(*) FROM jobs WHERE status = 'pending'") == [(2,)]


# -- 3 -------------------------------------------------------------------------------------------

def _rss_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def test_daemon_read_a_1gib_model_config_into_its_own_memory(tmp_path, tiny_config):
    """A drop naming a 1 GiB (sparse) config.json, through the real worker: the daemon's peak RSS
    stays under 100 MB, that drop fails clearly (a drop failure), the other drop is done."""
    huge = tmp_path / "huge"
    huge.mkdir()
    with open(huge / "config.json", "wb") as fh:
        fh.write(b'{"architectures": ["LlamaForCausalLM"], "pad": "')
        fh.truncate(1 << 30)
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "huge.yaml").write_text(drop_text("huge", huge))
    (tmp_path / "conf.d" / "tiny.yaml").write_text(drop_text("tiny", tiny_config, max_num_batched_tokens=2048,
                                                             max_num_seqs=64))
    p = tmp_path / "tuner.yaml"
    p.write_text(yaml.safe_dump({"watch_dir": str(tmp_path / "conf.d"), "state_dir": str(tmp_path / "state"),
                                 "debounce_s": 0.05, "retry_backoff_s": 0.0}))
    db = tmp_path / "state" / "ctx-tuner.sqlite"
    proc = _spawn(p, tmp_path / "daemon.log")
    try:
        poll(lambda: try_rows(db, "SELECT count(*) FROM jobs WHERE status IN ('done', 'failed')") == [(2,)], 240,
             what="both drops finished")
        rss = _rss_hwm(proc.pid)
        rows = dict((Path(p).stem, (s, k, t, e)) for p, s, k, t, e in db_rows(
            db, "SELECT path, status, failure_kind, error_type, error FROM jobs"))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    print(f"daemon peak RSS (VmHWM) {rss:,} bytes with a 1 GiB config.json in a drop")
    assert 0 < rss < 100_000_000, rss
    status, kind, etype, error = rows["huge"]
    assert (status, kind, etype) == ("failed", "drop", "ModelConfigError")
    assert "1,073,741,824 bytes" in error and str(huge / "config.json") in error
    assert rows["tiny"][0] == "done"


# -- 4 -------------------------------------------------------------------------------------------

def test_fallback_and_default_warnings_vanish_in_daemon_mode(h, caplog):
    caplog.set_level(logging.INFO, logger="tuner.daemon.service")
    d = h.start()
    (h.conf / "warn-a.yaml").write_text(drop_text("warn-a", h.model))
    h.until(d, lambda: h.job("warn-a.yaml")[0] == "done", what="warn-a done")
    (stored,), = h.rows("SELECT warnings FROM drops")
    assert json.loads(stored) == ["no plugin serves FooForCausalLM; using generic",
                                  "config.json lacks head_dim; using 128 (default of plugin generic)"]
    doc = yaml.safe_load((Path(h.settings.proposals_dir) / "warn-a.yaml").read_text())
    assert doc["warnings"] == json.loads(stored)
    done = [r.getMessage() for r in caplog.records if "job 1 done" in r.getMessage()]
    assert len(done) == 1 and "2 warning(s): no plugin serves FooForCausalLM" in done[0]


# -- 5, 6 ----------------------------------------------------------------------------------------

def test_yml_and_upper_case_yaml_drops_were_ignored_without_a_word(h):
    d = h.start()
    (h.conf / "a.yml").write_text(drop_text("a", h.model))
    (h.conf / "B.YAML").write_text(drop_text("b", h.model))
    h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'done'") == [(2,)], what="both done")


def test_temporary_files_left_after_crashes_are_cleaned_at_start(h):
    state = Path(h.settings.state_dir)
    (state / "proposals").mkdir(parents=True)
    junk = [state / ".ctx-tuner-snapshot.sqlite.k2j3.tmp", state / ".ctx-tuner-snapshot.sqlite.k2j3.tmp-journal",
            state / "proposals" / ".a.yaml.x8y.tmp"]
    for p in junk:
        p.write_bytes(b"x" * 4096)
    keep = state / "proposals" / "notes.txt"
    keep.write_text("mine")
    h.start()
    assert [p.exists() for p in junk] == [False, False, False] and keep.exists()


# -- 7 -------------------------------------------------------------------------------------------

def test_orphaned_worker_runs_on_after_its_parent_is_killed(tmp_path, tiny_config):
    """A parent running a worker (the CLI's path, run_in_worker) is killed with SIGKILL: the worker
    group (worker and its child) dies with it. And a worker left alone keeps its own deadline."""
    from tests._daemon_helpers import fake_python

    fake = fake_python(tmp_path)
    code = f"""
import sys
from tuner.seam.worker import run_in_worker
req = {{"drop": {{"name": "hang-x", "content_sha256": "0", "candidates": {{}}}}, "device": {{}}}}
run_in_worker(req, job="hang-x", timeout_s=600, python={str(fake)!r})
"""
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    try:
        worker = poll(lambda: [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == parent.pid],
                      30, what="the worker started")[0]
        poll(lambda: _children_of(worker), 30, what="the worker's child started")
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        poll(lambda: not group_alive(worker), 10, what="the worker group dying with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
    # its own deadline: a worker with nobody to kill it (deadline 1 s, no parent check)
    env = {**os.environ, worker_guard.ENV_DEADLINE: "1"}
    env.pop(worker_guard.ENV_PARENT, None)
    t0 = time.monotonic()
    w = subprocess.Popen([str(fake), "-m", "tuner.commands.worker_main"], stdin=subprocess.PIPE, env=env,
                         start_new_session=True)
    w.communicate(json.dumps({"drop": {"name": "hang-y", "content_sha256": "0"}}).encode(), timeout=30)
    assert w.returncode == -signal.SIGKILL and time.monotonic() - t0 < 20
    poll(lambda: not group_alive(w.pid), 10, what="the deadline killing the whole group")


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rfind(")") + 2:].split()[1])


def _children_of(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == pid]


def test_worker_guard_kills_its_group_when_the_parent_changes():
    died = threading.Event()
    parents = iter([100, 100, 1])
    worker_guard.install({worker_guard.ENV_PARENT: "100"}, getppid=lambda: next(parents, 1), die=died.set,
                         poll_s=0.01, pdeathsig=lambda sig: True)
    assert died.wait(5)
    late = threading.Event()  # the parent was gone before the guard ran
    worker_guard.install({worker_guard.ENV_PARENT: "100"}, getppid=lambda: 1, die=late.set, poll_s=3600,
                         pdeathsig=lambda sig: True)
    assert late.is_set()


# -- 8 -------------------------------------------------------------------------------------------

def test_another_writers_lock_stalled_watchdog_pings_and_sigterm(tmp_path, tiny_config):
    """An external write lock held 4 s while the daemon must write: pings keep coming at least every
    WatchdogSec/2 and SIGTERM, sent while the lock is still held, ends the daemon within 2 s."""
    settings = write_settings(tmp_path)
    db = tmp_path / "state" / "ctx-tuner.sqlite"
    systemd = FakeSystemd(tmp_path / "notify.sock")
    watchdog_s = 2.0
    proc = _spawn(settings, tmp_path / "daemon.log",
                  {"NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": str(int(watchdog_s * 1e6))})
    locker = None
    try:
        poll(lambda: systemd.seen("READY=1"), 30, what="READY=1")
        locker = sqlite3.connect(db, isolation_level=None, timeout=30)
        locker.execute("BEGIN IMMEDIATE")
        (tmp_path / "conf.d" / "a.yaml").write_text(drop_text("a", tiny_config))  # the daemon must write
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4.0:
            systemd.pump()
            time.sleep(0.02)
        pings = [t for t, m in zip(systemd.times, systemd.messages) if "WATCHDOG=1" in m and t >= t0 - 0.5]
        gaps = [b - a for a, b in zip(pings, pings[1:])] + [time.monotonic() - pings[-1]]
        assert max(gaps) < watchdog_s / 2, gaps
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=10)
        assert rc == 0 and time.monotonic() - t1 < 2.0
    finally:
        if locker is not None:
            locker.close()
        if proc.poll() is None:
            proc.kill()
        systemd.close()


# -- 9, 10, 12, 13 -------------------------------------------------------------------------------

def test_profile_on_a_fifo_blocked_forever(tmp_path):
    fifo = tmp_path / "drop.yaml"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "tuner.cli", "profile", str(fifo)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not a regular file" in proc.stderr and str(fifo) in proc.stderr


@pytest.mark.parametrize("key,value", [("hidden_size", 2 ** 40), ("num_hidden_layers", 10 ** 6),
                                       ("vocab_size", 1e30), ("intermediate_size", 2 ** 50)])
def test_absurd_config_sizes_crashed_the_worker_or_ran_to_the_timeout(tmp_path, tiny_config, key, value):
    from tuner.errors import ModelConfigError
    from tuner.model.modelspec import load_model_spec

    cfg = json.loads((tiny_config / "config.json").read_text())
    cfg[key] = value
    (tiny_config / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError) as err:
        load_model_spec(tiny_config / "config.json")
    assert err.value.where == f"{tiny_config / 'config.json'}:{key}"


def test_absurd_config_size_exits_2_naming_the_key_without_a_stack_dump(tmp_path, tiny_config):
    cfg = json.loads((tiny_config / "config.json").read_text())
    cfg["hidden_size"] = 2 ** 40
    (tiny_config / "config.json").write_text(json.dumps(cfg))
    drop = tmp_path / "d.yaml"
    drop.write_text(drop_text("d", tiny_config))
    proc = subprocess.run([sys.executable, "-m", "tuner.cli", "profile", str(drop), "--db", str(tmp_path / "x.sqlite")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "config.json:hidden_size" in proc.stderr and "1,099,511,627,776" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_yaml_exponent_read_as_a_string_gave_a_confusing_error():
    from tuner.question.drop import parse_drop
    from tuner.errors import DropError

    with pytest.raises(DropError) as err:
        parse_drop(b"name: a\nmodel: x\ndevice: H100-80GB\nmax_num_batched_tokens: 1e30\n", "/d/a.yaml")
    assert "YAML 1.1 reads 1e30 as a string" in str(err.value) and "write 1.0e+30" in str(err.value)


def test_small_help_and_log_gaps():
    from tuner.cli import build_parser
    from tuner.commands.daemon import TEXT_FORMAT
    from tuner.errors import ModelConfigError
    from tuner.model.modelspec import resolve_model_path

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert "SQLite file path" in sub.choices["profile"].format_help()
    assert "``" not in sub.choices["selftest"].format_help()
    assert "%(asctime)s" in TEXT_FORMAT
    with pytest.raises(ModelConfigError) as err:
        resolve_model_path("no-such-org/no-such-model")
    assert "the HF cache is" in str(err.value)


def test_store_that_does_not_exist_yet_made_plot_fail():
    from tuner.store.database import store_exists

    assert store_exists("sqlite:////nonexistent/dir/new.sqlite") is False  # plot: no measured points


def test_plot_svg_then_png_overwrote_the_same_json(tmp_path):
    from tuner.reports.plot import sidecar_path

    assert sidecar_path(tmp_path / "x.png") == tmp_path / "x.json"
    assert sidecar_path(tmp_path / "x.svg") == tmp_path / "x.svg.json"
    assert sidecar_path(tmp_path / "x.PDF") == tmp_path / "x.PDF.json"


# -- 11 ------------------------------------------------------------------------------------------

def test_moved_drop_file_was_retired_and_profiled_again(h, caplog):
    caplog.set_level(logging.INFO, logger="tuner.daemon.service")
    d = h.start()
    (h.conf / "a.yaml").write_text(drop_text("a", h.model))
    h.until(d, lambda: h.job("a.yaml")[0] == "done", what="a done")
    (drop_id,), = h.rows("SELECT id FROM drops")
    (h.conf / "sub").mkdir()
    os.rename(h.conf / "a.yaml", h.conf / "sub" / "renamed.yaml")
    h.until(d, lambda: h.rows("SELECT path FROM drops WHERE retired_at IS NULL") == [(str(h.conf / "sub" / "renamed.yaml"),)],
            what="the drop row following the file")
    d.reconcile()
    assert h.rows("SELECT count(*) FROM drops") == [(1,)] and h.rows("SELECT count(*) FROM jobs") == [(1,)]
    assert len((h.tmp / "worker.log").read_text().splitlines()) == 1  # not profiled again
    doc = yaml.safe_load((Path(h.settings.proposals_dir) / "a.yaml").read_text())
    assert doc["drop_id"] == drop_id and doc["source"] == str(h.conf / "sub" / "renamed.yaml")
    msgs = [r.getMessage() for r in caplog.records]
    assert any("moved to" in m for m in msgs) and not any("deleted" in m for m in msgs)


def test_watch_dir_change_by_sighup_logged_every_old_drop_as_deleted(h, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="tuner.daemon.service")
    d = h.start()
    (h.conf / "a.yaml").write_text(drop_text("a", h.model))
    h.until(d, lambda: h.job("a.yaml")[0] == "done", what="a done")
    new_dir = tmp_path / "conf2.d"
    new_dir.mkdir()
    settings = write_settings(tmp_path, watch_dir=str(new_dir))
    d.settings = type(d.settings)(**{**d.settings.__dict__, "source": str(settings)})
    d.request_reload()
    h.until(d, lambda: h.rows("SELECT count(*) FROM drops WHERE retired_at IS NOT NULL") == [(1,)],
            what="the old drop retired")
    msgs = [r.getMessage() for r in caplog.records]
    assert any("no longer under watch_dir" in m for m in msgs) and not any("deleted" in m for m in msgs)

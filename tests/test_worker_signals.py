"""A worker never outlives an interrupted parent, and its typed errors keep their class.

Real subprocesses throughout: a hanging fake worker (own process group, with a grandchild) behind
``run_in_worker``'s ``python=``; the CLI runs in a subprocess and gets a real SIGTERM / SIGINT.
Every wait polls a condition with a deadline (no fixed sleeps)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests._daemon_helpers import group_alive, hanging_python, poll
from tuner.errors import DropError, ModelConfigError, SettingsError, TunerError
from tuner.seam.worker import error_from_reply, run_in_worker
from tuner.commands.worker_main import error_reply


def _replying_python(tmp_path: Path, reply: dict) -> str:
    script = tmp_path / "replypy"
    script.write_text(f"#!{sys.executable}\nimport sys, json\nsys.stdin.read()\nprint(json.dumps({reply!r}))\n")
    script.chmod(0o755)
    return str(script)


# --- run_in_worker: any BaseException while waiting kills the group ------------------------------


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit])
def test_interrupt_while_waiting_kills_the_worker_group_and_reraises(tmp_path, exc_type):
    py, marker = hanging_python(tmp_path)
    started: list[subprocess.Popen] = []

    def popen(*args, **kw):  # the real Popen; its wait is interrupted like Ctrl-C / SIGTERM would
        proc = subprocess.Popen(*args, **kw)
        started.append(proc)
        real_wait = proc.wait

        def wait(timeout=None):  # the wait for the worker's exit (tuner.seam.worker watches that, not its pipes)
            if not marker.exists() or timeout is None or timeout > 30:
                poll(marker.exists, 20, what="the worker and its child started")
                raise exc_type()
            return real_wait(timeout)
        proc.wait = wait
        return proc

    with pytest.raises(exc_type):
        run_in_worker({}, job="j", python=py, popen=popen, timeout_s=60)
    pgid = int(marker.read_text())
    assert pgid == started[0].pid
    poll(lambda: not group_alive(pgid), 10, what="the worker's process group gone")
    for f in (started[0].stdin, started[0].stdout, started[0].stderr):
        f.close()


def test_interrupt_while_relaying_progress_kills_the_worker_group(tmp_path):
    py, marker = hanging_python(tmp_path)
    started: list[subprocess.Popen] = []

    def popen(*args, **kw):
        proc = subprocess.Popen(*args, **kw)
        started.append(proc)
        real_wait = proc.wait

        def wait(timeout=None):
            if not marker.exists() or timeout is None or timeout > 30:  # the relaying wait, not ours
                poll(marker.exists, 20, what="the worker started")
                raise KeyboardInterrupt
            return real_wait(timeout)
        proc.wait = wait
        return proc

    with pytest.raises(KeyboardInterrupt):
        run_in_worker({}, job="j", python=py, popen=popen, timeout_s=60, on_progress=lambda line: None)
    pgid = int(marker.read_text())
    poll(lambda: not group_alive(pgid), 10, what="the worker's process group gone")


# --- the CLI: SIGTERM → 143, SIGINT → 130, one line, no traceback, no worker left ----------------

_LAUNCHER = """\
import sys
import tuner.seam.worker
tuner.seam.worker.run_in_worker.__kwdefaults__["python"] = sys.argv[1]  # every job gets the fake worker,
tuner.seam.worker.spawn_worker.__kwdefaults__["python"] = sys.argv[1]  # the one profile starts ahead too
from tuner.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("command", [["profile"], ["explain", "--no-calibration"]])  # explain: jobs in threads
@pytest.mark.parametrize("sig, code, text", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_cli_signal_leaves_no_worker_and_no_traceback(tmp_path, tiny_config, command, sig, code, text):
    py, marker = hanging_python(tmp_path)
    launcher = tmp_path / "launch.py"
    launcher.write_text(_LAUNCHER)
    drop = tmp_path / "d.yaml"
    drop.write_text(yaml.safe_dump({"name": "d", "model": str(tiny_config), "device": "H100-80GB",
                                    "candidates": {"gpu_memory_utilization": [0.9]}}))
    cli = subprocess.Popen([sys.executable, str(launcher), py, command[0], str(drop), *command[1:], "--db",
                            str(tmp_path / "r.sqlite"), "--quiet"], cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    pgid = None
    try:
        poll(lambda: marker.exists() or cli.poll() is not None, 60, what="the profile worker started")
        assert cli.poll() is None, cli.communicate()
        pgid = int(marker.read_text())
        assert group_alive(pgid)
        os.kill(cli.pid, sig)
        out, err = cli.communicate(timeout=30)
        assert cli.returncode == code, err
        assert "Traceback" not in err and text in err
        assert len(err.strip().splitlines()) == 1, err
        poll(lambda: not group_alive(pgid), 10, what="the worker's process group gone")
    finally:  # never leave a hanging worker behind, whatever failed above
        if cli.poll() is None:
            cli.kill()
            cli.communicate()
        if pgid is not None and group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)


# --- typed worker errors keep their class, where, path and field ---------------------------------


def test_drop_error_from_the_worker_keeps_class_path_and_field(tmp_path):
    reply = error_reply(DropError("TP 3 does not divide 32 attention heads", path="/drops/x.yaml",
                                  field="tensor_parallel_size"))
    py = _replying_python(tmp_path, reply)
    with pytest.raises(DropError) as e:
        run_in_worker({}, job="x", python=py)
    assert (e.value.path, e.value.field) == ("/drops/x.yaml", "tensor_parallel_size")
    assert str(e.value) == "/drops/x.yaml:tensor_parallel_size: TP 3 does not divide 32 attention heads"


@pytest.mark.parametrize("exc", [ModelConfigError("no vocab_size", where="/m/config.json"),
                                 SettingsError("bad", path="/etc/t.yaml", field="state_dir"),
                                 TunerError("plain")])
def test_error_reply_round_trip(exc):
    back = error_from_reply(json.loads(json.dumps(error_reply(exc))), job="job")
    assert type(back) is type(exc)
    assert back.message == exc.message
    assert back.where == (exc.where or "job")
    assert getattr(back, "field", None) == getattr(exc, "field", None)


def test_unknown_error_class_falls_back_to_its_nearest_known_base_or_tuner_error():
    class LocalDropProblem(DropError):
        pass

    back = error_from_reply(error_reply(LocalDropProblem("odd", path="p.yaml", field="f")), job="j")
    assert isinstance(back, DropError) and back.field == "f" and "LocalDropProblem: odd" in str(back)
    back = error_from_reply({"ok": False, "error_type": "NoSuchError", "error": "boom"}, job="j")
    assert type(back) is TunerError and str(back) == "j: NoSuchError: boom"


def test_cli_maps_a_worker_drop_error_to_exit_2(tmp_path, tiny_config):
    reply = error_reply(DropError("vLLM refuses TP 3 for this model", path=str(tmp_path / "d.yaml"),
                                  field="tensor_parallel_size"))
    py = _replying_python(tmp_path, reply)
    launcher = tmp_path / "launch.py"
    launcher.write_text(_LAUNCHER)
    drop = tmp_path / "d.yaml"
    drop.write_text(yaml.safe_dump({"name": "d", "model": str(tiny_config), "device": "H100-80GB",
                                    "candidates": {"gpu_memory_utilization": [0.9]}}))
    for cmd in (["profile", str(drop), "--db", str(tmp_path / "r.sqlite")],
                ["explain", str(drop), "--no-calibration", "--db", str(tmp_path / "r.sqlite")]):
        p = subprocess.run([sys.executable, str(launcher), py, *cmd, "--quiet"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, (cmd, p.stderr)
        assert f"invalid drop: {drop}:tensor_parallel_size: vLLM refuses TP 3" in p.stderr, p.stderr


def test_cli_maps_a_worker_model_config_error_to_exit_2(tmp_path, tiny_config):
    py = _replying_python(tmp_path, error_reply(ModelConfigError("no num_hidden_layers", where="/m/config.json")))
    launcher = tmp_path / "launch.py"
    launcher.write_text(_LAUNCHER)
    drop = tmp_path / "d.yaml"
    drop.write_text(yaml.safe_dump({"name": "d", "model": str(tiny_config), "device": "H100-80GB",
                                    "candidates": {"gpu_memory_utilization": [0.9]}}))
    p = subprocess.run([sys.executable, str(launcher), py, "profile", str(drop), "--db", str(tmp_path / "r.sqlite"),
                        "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "invalid model config: /m/config.json: no num_hidden_layers" in p.stderr, p.stderr

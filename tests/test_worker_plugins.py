"""Worker isolation and the plugin registry."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from tuner.errors import ModelConfigError, PluginError, WorkerError, WorkerTimeout
from tuner.model.plugin import ENTRY_POINT_GROUP, load_registry
from tuner.seam.worker import run_in_worker


def _fake_python(tmp_path, body: str) -> str:
    script = tmp_path / "fakepy"
    script.write_text(f"#!{sys.executable}\nimport sys, json, os, time\n{body}\n")
    script.chmod(0o755)
    return str(script)


def test_crash_becomes_worker_error_with_stderr(tmp_path):
    py = _fake_python(tmp_path, "sys.stderr.write('boom: CUDA out of memory'); os._exit(3)")
    with pytest.raises(WorkerError) as e:
        run_in_worker({}, job="j1", python=py)
    assert "exit status 3" in str(e.value) and "out of memory" in str(e.value) and e.value.where == "j1"


def test_timeout_kills_the_process_group(tmp_path):
    marker = tmp_path / "child.pid"
    py = _fake_python(tmp_path, f"import subprocess; p = subprocess.Popen(['sleep', '60']); open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    with pytest.raises(WorkerTimeout):
        run_in_worker({}, job="j2", python=py, timeout_s=2)
    pid = int(marker.read_text())
    # the grandchild was in the same process group and is gone too
    out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    assert out == "" or out.startswith("Z")


def test_typed_error_reply_is_reraised(tmp_path):
    py = _fake_python(tmp_path, "sys.stdin.read(); print(json.dumps({'ok': False, 'error_type': 'ModelConfigError', 'error': 'no vocab_size'}))")
    with pytest.raises(ModelConfigError) as e:  # the same class, not a plain TunerError
        run_in_worker({}, job="j3", python=py)
    assert "no vocab_size" in str(e.value) and e.value.where == "j3"


def test_garbage_reply_is_a_worker_error(tmp_path):
    py = _fake_python(tmp_path, "sys.stdin.read(); print('not json')")
    with pytest.raises(WorkerError):
        run_in_worker({}, job="j4", python=py)


def test_builtin_plugin_registers_through_the_entry_point_group():
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert "generic" in names
    reg = load_registry()
    assert reg.errors == []
    p, warn = reg.for_architectures(["LlamaForCausalLM"])
    assert p.name == "generic" and warn is None
    p, warn = reg.for_architectures(["SomethingNewForCausalLM"])
    assert p.name == "generic" and "generic" in warn


def test_broken_plugins_are_reported_and_skipped():
    good = SimpleNamespace(name="generic", architectures=("LlamaForCausalLM",), kv_cache_spec=lambda *a: {},
                           build_model=lambda *a: None, weights_bytes=lambda *a: 0)

    class EP:
        def __init__(self, name, obj=None, exc=None):
            self.name, self.obj, self.exc = name, obj, exc

        def load(self):
            if self.exc:
                raise self.exc
            return self.obj

    eps = [EP("broken", exc=ImportError("No module named 'flash_attn'")),
           EP("nameless", obj=SimpleNamespace(architectures=("X",))),
           EP("noarch", obj=SimpleNamespace(name="noarch", architectures=())),
           EP("generic", obj=good)]
    reg = load_registry(loader=lambda g: eps)
    assert [p.name for p in reg.plugins] == ["generic"]
    assert len(reg.errors) == 3
    assert all(isinstance(e, PluginError) for e in reg.errors)
    assert "tuner.plugins:broken" in str(reg.errors[0]) and "flash_attn" in str(reg.errors[0])
    with pytest.raises(PluginError):
        load_registry(loader=lambda g: eps[:1]).for_architectures(["LlamaForCausalLM"])

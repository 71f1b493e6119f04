"""The vLLM-backed serve parser's plumbing without vLLM: what ``tuner/engine/parse_main.py`` prints
becomes the built-in parser's ``ServeArgs`` shape; no vLLM → the built-in parser, said so. The real
vLLM parser is tested in tests/engine/test_serve_parser_engine.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tuner.engine import vllm_importable
from tuner.memory.serve_args import ServeArgsError, parse_serve
from tuner.engine.serve_parser import AutoServeParser, VllmParserUnavailable, VllmServeParser, make_parser
from tests._cli_helpers import run_cli as _cli

L8B = REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"
no_vllm_here = pytest.mark.skipif(vllm_importable(), reason="vllm is importable in this Python")


class FakeRun:
    """Stands in for subprocess.run: records the command, answers with a fixed stdout/exit code."""

    def __init__(self, doc, rc=0):
        self.doc, self.rc, self.calls = doc, rc, []

    def __call__(self, cmd, **kw):
        self.calls.append((cmd, kw))
        return subprocess.CompletedProcess(cmd, self.rc, stdout="log line\n" + json.dumps(self.doc) + "\n", stderr="")


#: what vllm_parse_main printed for `serve M -tp 2 --max_model_len=32K --port 8000 --enforce-eager
#: --max-cudagraph-capture-size 256 --cpu-offload-gb 2 --config c.yaml` (c.yaml: gpu-memory-utilization 0.8)
OK = {"model": "M", "max_model_len": 32768, "explicit": {
    "tensor_parallel_size": 2, "max_model_len": 32768, "port": 8000, "enforce_eager": True,
    "max_cudagraph_capture_size": 256, "cpu_offload_gb": 2.0, "gpu_memory_utilization": 0.8},
    "options": {"tensor_parallel_size": ["--tensor-parallel-size", "-tp"], "max_model_len": ["--max-model-len"],
                "port": ["--port"], "enforce_eager": ["--enforce-eager"],
                "max_cudagraph_capture_size": ["--max-cudagraph-capture-size"], "cpu_offload_gb": ["--cpu-offload-gb"],
                "gpu_memory_utilization": ["--gpu-memory-utilization"]},
    "model_given": True, "config_notes": ["c.yaml: `x: false` is dropped"], "vllm_version": "0.32.0",
    "import_s": 9.5, "parse_s": 0.05}
ARGV = ["M", "-tp", "2", "--max_model_len=32K", "--port", "8000", "--enforce-eager", "--max-cudagraph-capture-size",
        "256", "--cpu-offload-gb", "2", "--config", "c.yaml"]


def test_vllm_parser_result_becomes_typed_settings_and_named_flags():
    run = FakeRun(OK)
    sa = VllmServeParser("/venv/bin/python", run=run).parse(ARGV)
    cmd, kw = run.calls[0]
    assert cmd[0] == "/venv/bin/python" and cmd[1].endswith("tuner/engine/parse_main.py") and cmd[2:] == ["serve", *ARGV]
    assert kw["env"]["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert sa.model == "M" and sa.parser == "vllm 0.32.0" and sa.config_file == "c.yaml"
    assert sa.values == {"tensor_parallel_size": 2, "max_model_len": 32768, "enforce_eager": True,
                         "gpu_memory_utilization": 0.8}
    assert sa.spelled["tensor_parallel_size"] == "-tp 2" and sa.spelled["max_model_len"] == "--max_model_len=32K"
    assert sa.spelled["gpu_memory_utilization"] == "gpu-memory-utilization: 0.8 (from c.yaml)"
    assert [(e["flag"], e["value"]) for e in sa.ignored] == [("--port", 8000), ("--max-cudagraph-capture-size", 256)]
    assert "ctx-tuner does not model" in sa.ignored[1]["note"]
    assert [(e["flag"], e["as_written"]) for e in sa.unmodelled] == [("--cpu-offload-gb", "--cpu-offload-gb 2")]
    assert sa.unknown == [] and sa.notes == ["c.yaml: `x: false` is dropped"]
    assert sa.parser_info == {"name": "vllm", "vllm_version": "0.32.0", "python": "/venv/bin/python",
                              "import_s": 9.5, "parse_s": 0.05}


def test_vllm_refusal_is_a_serve_args_error_with_vllms_message():
    run = FakeRun({"error": ["argument --kv-cache-dtype: invalid choice: 'fp9'"], "vllm_version": "0.32.0"}, rc=2)
    with pytest.raises(ServeArgsError, match="invalid choice: 'fp9'") as exc:
        VllmServeParser("py", run=run).parse(["M", "--kv-cache-dtype", "fp9"])
    assert exc.value.where == "vLLM 0.32.0 parser"


def test_no_vllm_falls_back_to_the_builtin_parser_and_says_so():
    run = FakeRun({"unavailable": "no vllm package importable"}, rc=3)
    p = AutoServeParser("/usr/bin/python3", run=run)
    sa = p.parse(["M", "-tp", "2"])
    assert sa.parser == "built-in" and sa.values == {"tensor_parallel_size": 2}
    assert sa.parser_info["fallback_reason"] == "/usr/bin/python3: no vllm package importable"
    with pytest.raises(VllmParserUnavailable, match="no vllm package"):
        VllmServeParser("/usr/bin/python3", run=run).parse(["M"])
    with pytest.raises(VllmParserUnavailable, match="not an executable Python"):
        VllmServeParser("/no/such/python").parse(["M"])


@no_vllm_here
def test_real_interpreter_without_vllm_falls_back():
    sa = AutoServeParser(sys.executable).parse(["M", "--max-model-len", "8k"])
    assert sa.parser == "built-in" and sa.values == {"max_model_len": 8000}
    assert "no vllm package importable" in sa.parser_info["fallback_reason"]
    assert make_parser("built-in", None).name == "built-in"




@no_vllm_here
def test_cli_parser_vllm_without_vllm_is_exit_2(tmp_path):
    rc, out, err = _cli("check", "--parser", "vllm", "--device", "H100-80GB", "--engine-version", "0.19.0", "--",
                        "vllm", "serve", str(L8B))
    assert rc == 2 and "no vllm package importable" in err
    rc, out, err = _cli("check", "--worker-python", str(tmp_path / "nope"), "--", "vllm", "serve", str(L8B))
    assert rc == 2 and "not an executable Python" in err


def test_builtin_parser_does_not_read_config_equals_form(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max-model-len: 4096\n")
    sa = parse_serve(["vllm", "serve", "m", f"--config={cfg}", "-tp", "2"])
    assert sa.values == {"tensor_parallel_size": 2}  # vLLM stores --config=FILE and never opens it
    assert any("file is NOT read" in n for n in sa.notes)


def test_check_worker_python_from_settings_engine_pythons(tmp_path):
    from types import SimpleNamespace

    from tuner.commands.check import _python

    pys = {}
    for name in ("py019", "pyother"):
        p = tmp_path / name
        p.write_text("#!/bin/sh\n")
        p.chmod(0o755)
        pys[name] = str(p)
    st = tmp_path / "tuner.yaml"
    st.write_text(f"worker_python: {pys['pyother']}\nengine_pythons: {{'0.19.0': {pys['py019']}}}\n")
    args = lambda **kw: SimpleNamespace(**{"worker_python": None, "settings": str(st), "engine_version": None, **kw})
    assert _python(args(engine_version="0.19.0")) == pys["py019"]
    assert _python(args(engine_version="0.6.4")) == pys["pyother"]
    assert _python(args(worker_python=pys["pyother"], engine_version="0.19.0")) == pys["pyother"]
    assert _python(args(settings=None)) is None

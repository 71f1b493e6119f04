"""The vLLM-backed serve parser against the real installed vLLM (issue 17).

``check`` with vLLM's own ``vllm serve`` parser (run in the vLLM interpreter by
``tuner/engine/parse_main.py``, never imported here) gives the same settings, verdict and KV numbers
as ctx-tuner's built-in parser on real serve lines and config files; where they disagree vLLM's
answer wins. The vLLM interpreter is ``CTX_TUNER_VLLM_PYTHON``, else this Python when vLLM is
importable here (the CI engine tier: ``.venv-engine``); otherwise the module skips (fails under
``CTX_TUNER_REQUIRE_ENGINE=1``). One vLLM import serves all lines (``parse_many``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import sys

import pytest

from tests.conftest import REPO
from tuner.reports.check import run_check
from tuner.engine import vllm_importable
from tuner.memory.serve_args import BUILTIN, ServeArgsError, parse_serve, strip_program

REQUIRED = os.environ.get("CTX_TUNER_REQUIRE_ENGINE") == "1"


def _vllm_python() -> str | None:
    p = os.environ.get("CTX_TUNER_VLLM_PYTHON")
    if p:
        return p
    return sys.executable if vllm_importable() else None


VLLM_PY = _vllm_python()
if REQUIRED and VLLM_PY is None:
    raise RuntimeError("CTX_TUNER_REQUIRE_ENGINE=1 but no vLLM interpreter (vllm not importable here, "
                       "CTX_TUNER_VLLM_PYTHON unset)")
pytestmark = pytest.mark.skipif(VLLM_PY is None, reason="no vLLM interpreter (vllm not importable, "
                                                        "CTX_TUNER_VLLM_PYTHON unset)")

L8B = REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"
L70B = REPO / "configs" / "models" / "meta-llama--Llama-3.1-70B"

#: name → (serve line, config YAML text or None, device, engine_version, allow_unmodelled)
SAME = {
    "32k_tp2": (["vllm", "serve", str(L8B), "--max-model-len", "32k", "-tp", "2", "--gpu-memory-utilization", "0.9"],
                None, "H100-80GB", "0.19.0", False),
    "underscores_equals_fp8": (["vllm", "serve", str(L8B), "--max_model_len=16384", "--gpu_memory_utilization=0.85",
                                "--kv-cache-dtype=fp8", "--port", "8000", "--enable-prefix-caching"],
                               None, "H100-80GB", "0.19.0", False),
    "config_lists_booleans": (["vllm", "serve"], f"model: {L8B}\nmax-model-len: 128K\ntensor_parallel_size: 1\n"
                              "enforce-eager: true\nserved-model-name: [a, b]\nenable-chunked-prefill: false\n",
                              "H100-80GB", "0.19.0", False),
    "config_then_command_line": (["vllm", "serve", str(L70B), "-tp", "4", "--max-model-len", "65536"],
                                 "tensor-parallel-size: 2\nmax-model-len: 8192\ngpu-memory-utilization: 0.95\n",
                                 "H100-80GB", "0.19.0", False),
    "model_option_auto": (["vllm", "serve", "--model", str(L8B), "--max-model-len", "auto",
                           "--gpu-memory-utilization", "0.3"], None, "H100-80GB", "0.19.0", False),
    "v0_does_not_start": (["vllm", "serve", str(L8B), "--max-model-len", "29000", "--gpu-memory-utilization", "0.9"],
                          None, "RTX-3090", "0.6.4", False),
    "batched_tokens_no_bool_O3": (["vllm", "serve", str(L8B), "--max-num-seqs", "64", "--max-num-batched-tokens", "8k",
                                   "--no-enable-chunked-prefill", "--enforce-eager", "-O3", "--max-model-len", "8k"],
                                  None, "H100-80GB", "0.19.0", True),
    "kv_cache_memory_bytes": (["vllm", "serve", str(L8B), "--max-model-len", "32k", "--kv-cache-memory-bytes", "2G",
                               "--block-size", "32"], None, "H100-80GB", "0.19.0", False),
}

#: lines where the two parsers disagree: vLLM's answer wins
DIFFERENT = {
    "bad_choice": (["vllm", "serve", str(L8B), "--max-model-len", "8k", "--kv-cache-dtype", "fp9"], None),
    "tool_choice_without_parser": (["vllm", "serve", str(L8B), "--max-model-len", "8k", "--enable-auto-tool-choice"],
                                   None),
    "option_builtin_does_not_know": (["vllm", "serve", str(L8B), "--max-model-len", "8k",
                                      "--max-cudagraph-capture-size", "256"], None),
    "config_equals_form": (["vllm", "serve", str(L8B), "--max-model-len", "8k", "--config=CFG"],
                           "max-model-len: 4096\n"),
}


@functools.lru_cache(maxsize=None)
def _job(key: str) -> dict:
    from tuner.jobs.job import run_job

    return run_job(json.loads(key))


def inproc_worker(request: dict, *, job: str, timeout_s: float = 600.0, on_progress=None) -> dict:
    """The worker job in this process (torch is fine in tests), memoized by request."""
    return json.loads(json.dumps(_job(json.dumps(request, sort_keys=True))))


@pytest.fixture(autouse=True)
def _inproc(monkeypatch):
    monkeypatch.setattr("tuner.seam.worker.run_in_worker", inproc_worker)
    monkeypatch.setenv("CTX_TUNER_ENGINE", "off")  # the engine adapter is not what these tests compare


def _materialise(tmp, name, argv, text):
    """The line with its config file written; ``--config=CFG`` stands for the file in that form."""
    if text is None:
        return argv, None
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(text)
    if "--config=CFG" in argv:
        return [f"--config={cfg}" if a == "--config=CFG" else a for a in argv], None
    return argv, str(cfg)


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    """Every line above through vLLM's own parser, one subprocess: name → (argv, config, result)."""
    from tuner.engine.serve_parser import VllmServeParser

    tmp = tmp_path_factory.mktemp("serve-lines")
    items = {}
    for name, (argv, text, *_) in {**SAME, **DIFFERENT}.items():
        items[name] = _materialise(tmp, name, argv, text)
    parser = VllmServeParser(VLLM_PY, timeout_s=600)
    results = parser.parse_many([(strip_program(a), c) for a, c in items.values()])
    return {name: (a, c, r) for (name, (a, c)), r in zip(items.items(), results)}


class _Preparsed:
    """The vLLM parser's answer for one line, handed to ``run_check`` as its ServeParser."""

    def __init__(self, result):
        self.result = result
        self.name = "vllm"

    def parse(self, argv, config_file=None):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize("name", sorted(SAME))
def test_vllm_parser_and_builtin_parser_agree(parsed, name):
    argv, cfg, vres = parsed[name]
    _, _, device, version, allow = SAME[name]
    assert not isinstance(vres, Exception), vres
    assert vres.parser.startswith("vllm ") and vres.parser_info["name"] == "vllm"
    bres = parse_serve(argv, cfg)
    assert vres.model == bres.model
    assert vres.values == bres.values
    kw = dict(device=device, engine_version=version, variants=False, allow_unmodelled=allow)
    a = run_check(argv, config_file=cfg, parser=_Preparsed(vres), **kw)
    b = run_check(argv, config_file=cfg, parser=BUILTIN, **kw)
    assert a.doc["parser"].startswith("vllm ") and b.doc["parser"] == "built-in"
    assert a.starts == b.starts and a.exit_code == b.exit_code
    assert a.doc["max_model_len"] == b.doc["max_model_len"]
    assert a.doc["drop"] == b.doc["drop"]
    for k in ("available_kv_cache_bytes", "num_gpu_blocks", "kv_cache_tokens", "weights_bytes", "kv_block_bytes"):
        assert a.doc["numbers"][k] == b.doc["numbers"][k], k
    assert a.doc["engine_error"] == b.doc["engine_error"]


def test_vllm_parser_reads_real_values(parsed):
    """What vLLM made of the lines (so that agreement is not agreement on nothing)."""
    v = {name: parsed[name][2] for name in SAME}
    assert v["32k_tp2"].values == {"max_model_len": 32000, "tensor_parallel_size": 2, "gpu_memory_utilization": 0.9}
    assert v["32k_tp2"].spelled["tensor_parallel_size"] == "-tp 2"
    assert v["config_lists_booleans"].values["max_model_len"] == 131072
    assert "enable_chunked_prefill" not in v["config_lists_booleans"].values  # `key: false` dropped by vLLM
    assert any("enable-chunked-prefill: false` is dropped" in n for n in v["config_lists_booleans"].notes)
    assert [e["flag"] for e in v["config_lists_booleans"].ignored] == ["--served-model-name"]
    assert v["config_then_command_line"].values["tensor_parallel_size"] == 4  # command line wins
    assert v["config_then_command_line"].values["gpu_memory_utilization"] == 0.95  # from the file
    assert v["model_option_auto"].values["max_model_len"] == -1
    assert v["batched_tokens_no_bool_O3"].values["max_num_batched_tokens"] == 8000
    assert v["batched_tokens_no_bool_O3"].values["enable_chunked_prefill"] is False
    assert [e["flag"] for e in v["batched_tokens_no_bool_O3"].unmodelled] == ["--optimization-level"]
    assert v["kv_cache_memory_bytes"].values["kv_cache_memory_bytes"] == 2 << 30
    assert {e["flag"] for e in v["underscores_equals_fp8"].ignored} == {"--port"}
    assert v["underscores_equals_fp8"].values["enable_prefix_caching"] is True  # modelled (hybrid models' state)


def test_vllm_refuses_a_value_the_builtin_parser_accepts(parsed):
    argv, cfg, vres = parsed["bad_choice"]
    assert parse_serve(argv, cfg).values["kv_cache_dtype"] == "fp9"  # the built-in parser takes any string
    assert isinstance(vres, ServeArgsError)
    assert "argument --kv-cache-dtype: invalid choice: 'fp9'" in str(vres)
    with pytest.raises(ServeArgsError, match="invalid choice: 'fp9'"):
        run_check(argv, parser=_Preparsed(vres), device="H100-80GB", engine_version="0.19.0", variants=False)


def test_vllm_validation_refuses_a_line_the_builtin_parser_starts(parsed):
    argv, cfg, vres = parsed["tool_choice_without_parser"]
    b = run_check(argv, device="H100-80GB", engine_version="0.19.0", variants=False)
    assert b.starts and b.exit_code == 0  # built-in: --enable-auto-tool-choice has no effect on memory
    assert isinstance(vres, ServeArgsError)
    assert "--enable-auto-tool-choice requires --tool-call-parser" in str(vres)


def test_option_unknown_to_builtin_is_named_as_ignored_by_vllm_parser(parsed):
    argv, cfg, vres = parsed["option_builtin_does_not_know"]
    with pytest.raises(Exception, match="unrecognized arguments: --max-cudagraph-capture-size 256"):
        run_check(argv, device="H100-80GB", engine_version="0.19.0", variants=False)
    res = run_check(argv, parser=_Preparsed(vres), device="H100-80GB", engine_version="0.19.0", variants=False)
    assert res.starts
    [e] = res.doc["read"]["ignored"]
    assert e["flag"] == "--max-cudagraph-capture-size" and e["value"] == 256
    assert "ctx-tuner does not model" in e["note"]


def test_config_equals_form_is_not_read_by_either_parser(parsed):
    argv, cfg, vres = parsed["config_equals_form"]
    assert vres.values["max_model_len"] == 8000  # vLLM stores --config=FILE and never opens the file
    assert any("file is NOT read" in n for n in vres.notes)
    b = parse_serve(argv, cfg)
    assert b.values == vres.values and any("file is NOT read" in n for n in b.notes)


def test_cli_vllm_parser_message_wins_exit_2():
    """Through the CLI (a real subprocess of the vLLM interpreter): exit 2 with vLLM's message."""
    from tuner.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["check", "--parser", "vllm", "--worker-python", VLLM_PY, "--device", "H100-80GB",
                   "--engine-version", "0.19.0", "--no-variants", "--", "vllm", "serve", str(L8B), "-tp", "2",
                   "--max-model-len", "1.5K"])
    assert rc == 2
    assert "Decimals are not allowed with binary suffixes like K" in err.getvalue()
    assert "vLLM 0." in err.getvalue() and "parser" in err.getvalue()  # named as vLLM's parser

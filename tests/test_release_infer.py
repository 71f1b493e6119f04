"""Per-release facts read from the vLLM wheels, release inference for logs and cases without a
version, and what a release refuses to load (issue 29 "release said out loud", issue 28
mechanism 2)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tuner.releases import facts as rf
from tuner.memory.engine_checks import check_architecture, check_kv_cache_dtype, check_quantization
from tuner.errors import DropError
from tuner.logs.release_infer import Evidence, infer_for_case, infer_for_log, infer_release, log_evidence

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT.parent / "shared" / "cases" / "vllm-observed.jsonl"
MODELS = ROOT.parent / "shared" / "models"


# ---------------------------------------------------------------------------------------------
# the data file
# ---------------------------------------------------------------------------------------------


def test_release_facts_cover_every_wheel_from_0_4_to_0_34_in_under_a_megabyte():
    releases = rf.releases()
    assert releases[0] == "0.4.0" and releases[-1] == "0.34.0" and len(releases) == 80
    assert {"0.6.4.post1", "0.8.5.post1", "0.10.1.1", "0.20.2", "0.27.1"} <= set(releases)
    assert rf.DATA.stat().st_size < 1 << 20
    facts = rf.facts()
    assert facts["generated_by"] == "tools/release_facts.py"


def test_first_release_of_each_name_is_read_from_the_wheels():
    first = {a: rf.first_release(rf.with_architecture(a)) for a in
             ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM",
              "DeepseekV4ForCausalLM", "Qwen3_5ForConditionalGeneration", "MiniMaxM2ForCausalLM")}
    assert first == {"LlamaForCausalLM": "0.4.0", "Qwen3ForCausalLM": "0.8.4", "Gemma3ForCausalLM": "0.8.0",
                     "GptOssForCausalLM": "0.10.1", "DeepseekV4ForCausalLM": "0.20.0",
                     "Qwen3_5ForConditionalGeneration": "0.17.0", "MiniMaxM2ForCausalLM": "0.11.1"}
    assert rf.first_release(rf.with_quantization("mxfp4")) == "0.10.1"
    assert rf.first_release(rf.with_kv_cache_dtype("int8_per_token_head")) == "0.20.0"
    assert rf.quantization_methods("0.4.0") == ("awq", "gptq", "squeezellm")  # the --quantization choices
    # the logger's prefix: "file.py:line]" up to 0.7.3, "[file.py:line]" from 0.8.0 (vllm/logger.py)
    assert rf.first_release(rf.with_log_prefix("bracket")) == "0.8.0"
    assert rf.newest(rf.with_log_prefix("plain")) == "0.7.3"
    # the V1 worker's "Available KV cache memory" line, by release (vllm/v1/worker/gpu_worker.py)
    sites = rf.fragment_sites("Available KV cache memory")
    assert sites["gpu_worker.py:276"] == frozenset({"0.10.1", "0.10.1.1"})
    assert sites["gpu_worker.py:508"] == frozenset({"0.24.0"})


def _tool():
    spec = importlib.util.spec_from_file_location("release_facts_tool", ROOT / "tools" / "release_facts.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["release_facts_tool"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_generator_reads_a_release_tree(tmp_path):
    """tools/release_facts.py on a miniature release: registry keys, Literal names, the logger's
    call line (not the string's), a message built in a variable, argparse destinations."""
    tool = _tool()
    root = tmp_path / "9.9.9"
    files = {
        "vllm/logger.py": '_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"\n',
        "vllm/model_executor/models/registry.py": (
            '_TEXT_GENERATION_MODELS = {"FooForCausalLM": ("foo", "Foo")}\n'
            '_PREVIOUSLY_SUPPORTED_MODELS = {"OldForCausalLM": "9.0.0"}\n'
            'def f(architectures):\n'
            '    raise ValueError(f"Model architectures {architectures} are not supported for now. "\n'
            '                     f"Supported architectures: {1}")\n'),
        "vllm/model_executor/layers/quantization/__init__.py": (
            'from typing import Literal\nQuantizationMethods = Literal["awq", "mxfp4"]\n'
            'DEPRECATED_QUANTIZATION_METHODS = ["awq"]\n'),
        "vllm/config/cache.py": 'from typing import Literal\nCacheDType = Literal["auto", "fp8"]\n',
        "vllm/v1/worker/gpu_worker.py": (
            'import logging\nlogger = logging.getLogger(__name__)\n'
            'def g(x):\n'
            '    logger.info(\n'
            '        "Available KV cache memory: %s GiB",\n'
            '        x)\n'
            '    msg = (f"Memory profiling takes {x:.2f} seconds")\n'
            '    logger.debug(msg)\n'),
        "vllm/engine/arg_utils.py": (
            'class EngineArgs:\n    max_model_len: int = 0\n'
            'def add(parser):\n    parser.add_argument("--kv-cache-memory-bytes", type=int)\n'),
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    got = tool.read_release(root)
    assert got["architectures"] == ["FooForCausalLM"] and got["previously_supported"] == {"OldForCausalLM": "9.0.0"}
    assert got["architecture_error"].startswith("Model architectures \x00 are not supported for now.")
    assert got["quantization_methods"] == ["awq", "mxfp4"] and got["deprecated_quantization_methods"] == ["awq"]
    assert got["kv_cache_dtypes"] == ["auto", "fp8"] and got["engines"] == ["V1"] and got["log_prefix"] == "bracket"
    assert got["sites"]["Available KV cache memory"] == ["gpu_worker.py:4"]
    assert got["sites"]["Memory profiling takes"] == ["gpu_worker.py:8"]
    assert {"max_model_len", "kv_cache_memory_bytes"} <= set(got["flags"])
    facts = tool.assemble({"9.9.9": got})
    assert facts["architectures"] == {"FooForCausalLM": [[0, 0]]}


# ---------------------------------------------------------------------------------------------
# a release refuses what it cannot load (both sides of the first release that has it)
# ---------------------------------------------------------------------------------------------


def test_qwen3_refused_on_vllm_0_5():
    with pytest.raises(DropError) as exc:
        check_architecture(["Qwen3ForCausalLM"], version="0.5.0", path="d.yaml")
    msg = str(exc.value)
    assert "Model architectures ['Qwen3ForCausalLM'] are not supported for now. Supported architectures:" in msg
    assert "registered from vLLM 0.8.4" in msg and exc.value.field == "engine_version"
    with pytest.raises(DropError):
        check_architecture(["Qwen3ForCausalLM"], version="0.8.3", path=None)
    check_architecture(["Qwen3ForCausalLM"], version="0.8.4", path=None)


@pytest.mark.parametrize("arch, before, first", [
    ("Gemma3ForCausalLM", "0.7.3", "0.8.0"),
    ("Gemma3ForConditionalGeneration", "0.5.0", "0.8.0"),
    ("GptOssForCausalLM", "0.10.0", "0.10.1"),
    ("DeepseekV4ForCausalLM", "0.19.1", "0.20.0"),
])
def test_gemma3_gpt_oss_and_deepseek_v4_refused_before_their_first_release(arch, before, first):
    with pytest.raises(DropError, match="are not supported for now"):
        check_architecture([arch], version=before, path=None)
    check_architecture([arch], version=first, path=None)


def test_an_architecture_removed_from_the_registry_gets_vllms_removal_message():
    with pytest.raises(DropError, match="was supported in vLLM until v0.22.0, and is not supported anymore"):
        check_architecture(["JAISLMHeadModel"], version="0.24.0", path=None)
    check_architecture(["JAISLMHeadModel"], version="0.22.0", path=None)


def test_mxfp4_accepted_from_the_release_whose_list_has_it():
    ckpt = {"quant_method": "mxfp4"}
    with pytest.raises(DropError, match=r"Unknown quantization method: mxfp4\. .*first accepted in 0\.10\.1"):
        check_quantization(None, ckpt, version="0.10.0", path="d.yaml")
    assert check_quantization(None, ckpt, version="0.10.1", path=None) == []
    with pytest.raises(DropError, match="Unknown quantization method: mxfp4"):
        check_quantization("mxfp4", ckpt, version="0.10.0", path=None)
    check_quantization("mxfp4", ckpt, version="0.10.1", path=None)


def test_kv_dtype_accepted_from_the_release_whose_list_has_it():
    with pytest.raises(DropError, match="invalid choice: 'int8_per_token_head'.*first accepted in vLLM 0.20.0"):
        check_kv_cache_dtype("int8_per_token_head", version="0.19.1", path=None)
    check_kv_cache_dtype("int8_per_token_head", version="0.20.0", path=None)


# ---------------------------------------------------------------------------------------------
# inference on synthetic lines
# ---------------------------------------------------------------------------------------------


def test_log_without_version_naming_deepseek_v4_is_not_taken_as_0_10():
    line = ("(EngineCore pid=2739502) ERROR 06-03 14:24:40 [core.py:1165] ValueError: To serve at least one request "
            "with the model's max seq len (30000), (6.66 GiB KV cache is needed")
    got = infer_for_log([line], engine="V1", config={"architectures": ["DeepseekV4ForCausalLM"]},
                        kv_cache_dtype="fp8")
    assert got.release_range[0] == "0.20.0" and rf.release_key(got.release) >= (0, 20, 0)
    assert [e.kind for e in got.evidence][:2] == ["engine", "architecture"]


def test_log_without_version_naming_mxfp4_is_not_taken_as_0_10():
    lines = ["vllm serve openai/gpt-oss-120b --gpu-memory-utilization 0.95 --max-num-batched-tokens 1024",
             "(EngineCore_DP0 pid=6880) INFO 10-31 15:07:49 [gpu_worker.py:298] Available KV cache memory: 1.71 GiB"]
    got = infer_for_log(lines, config={"architectures": ["GptOssForCausalLM"],
                                       "quantization_config": {"quant_method": "mxfp4"}})
    assert (got.release, got.engine, got.release_range) == ("0.11.0", "V1", ("0.10.2", "0.11.0"))
    assert got.to_dict()["release_assumed"] is True


def test_v0_line_numbers_without_brackets_point_before_0_8():
    got = infer_for_log(["INFO 02-11 07:40:45 model_runner.py:1115] Loading model weights took 13.9476 GB"])
    assert got.engine == "V0" and got.release_range == ("0.7.0", "0.7.3")
    assert any(e.kind == "log prefix" for e in got.evidence)


def test_non_default_args_keys_are_flags_of_the_release():
    line = ("(APIServer pid=1) INFO 07-06 10:43:59 [api_utils.py:273] non-default args: {'model_tag': 'x', ..., "
            "'kv_cache_memory_bytes': 1000, 'speculative_config': {'method': 'mtp', 'num_speculative_tokens': 3}}")
    kinds = {(e.kind, e.value) for e in log_evidence([line])}
    assert ("flag", "kv_cache_memory_bytes") in kinds and ("flag", "speculative_config") in kinds
    assert ("flag", "method") not in kinds  # a nested key is not a flag
    got = infer_for_log([line])
    # [api_utils.py:273] "non-default args": vllm/entrypoints/serve/utils/api_utils.py of 0.23.0–0.27.1
    assert got.candidates == ["0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1"]


def test_evidence_that_contradicts_the_rest_is_set_aside():
    both = [Evidence("architecture", "A", frozenset({"0.19.0", "0.19.1"})),
            Evidence("log line", "B", frozenset({"0.6.4"}))]
    got = infer_release(both, engine="V1")
    assert got.candidates == ["0.19.0", "0.19.1"] and got.release == "0.19.1"
    assert [e.value for e in got.ignored] == ["B"] and "set aside" in got.describe()


def test_the_newest_modelled_release_when_nothing_narrows_it():
    from tuner.memory.eras import NEWEST

    got = infer_for_log(["Available KV cache memory: 5.01 GiB"], engine="V1")
    assert rf.release_key(got.release) == NEWEST and got.release_range[0] == "0.9.1"


# ---------------------------------------------------------------------------------------------
# real raw_lines of the shared cases
# ---------------------------------------------------------------------------------------------


def _cases() -> list[dict]:
    if not CASES.is_file():
        pytest.skip("shared cases absent")
    return [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]


def _config(case: dict) -> dict | None:
    p = MODELS / str(case["model"]).replace("/", "--") / "config.json"
    return json.loads(p.read_text()) if p.is_file() else None


def test_every_stated_release_is_among_those_inferred_with_the_version_hidden():
    """Each case that states its release, with the version removed: what its lines, names and
    model say still admits the stated release (the data and the rule agree with 100+ real logs)."""
    checked = 0
    for case in _cases():
        v = case.get("vllm_version")
        if not v or "dev" in str(v) or "rc" in str(v):
            continue
        got = infer_for_case({**case, "vllm_version": None}, _config(case))
        assert rf.release_of(rf.release_key(v)) in got.candidates or v in got.candidates, (case["id"], v, got.describe())
        checked += 1
    assert checked >= 95


def test_cases_without_version_get_a_release_that_can_load_them():
    by_id = {c["id"]: c for c in _cases() if not c.get("vllm_version")}
    got = {cid: infer_for_case(c, _config(c)) for cid, c in by_id.items()}
    expect = {
        "vllm-27508-h100-gpt-oss-120b-util095-mnbt1024": ("0.11.0", ("0.10.2", "0.11.0")),
        "vllm-23278-h100-gpt-oss-120b-negative-kv": ("0.10.1.1", ("0.10.1", "0.10.1.1")),
        "vllm-10517-rtx3090-llama31-8b-29k": ("0.6.4.post1", ("0.6.4", "0.6.4.post1")),
        "club3090-pr594-2x3090-qwen36-27b-fp8-fp8kv-262k": ("0.24.0", ("0.24.0", "0.24.0")),
        "club3090-294-2x3090-qwen36-27b-autoround-262k": ("0.22.1", ("0.22.0", "0.22.1")),
    }
    for cid, (release, rng) in expect.items():
        if cid in got:
            assert (got[cid].release, got[cid].release_range) == (release, rng), (cid, got[cid].describe())
    for cid in ("vllm-53961-8xmi300x-dsv4-pro-1m-dummy-fail", "vllm-44376-2xgh200-dsv4-flash-30k-fail"):
        if cid in got:
            assert got[cid].release_range[0] == "0.20.0", got[cid].describe()
    for cid, inferred in got.items():
        cfg = _config(by_id[cid])
        if cfg is not None and inferred.release is not None:
            check_architecture(cfg.get("architectures") or [], version=inferred.release, path=None)


def test_an_architecture_no_release_registers_is_left_to_the_plugin():
    """Remote code / the Transformers backend: not a registry refusal (the generic plugin answers)."""
    check_architecture(["SomeNewDecoderForCausalLM"], version="0.19.0", path=None)


def test_number_formats_of_verbatim_lines_narrow_the_release():
    """vllm/v1/worker/gpu_model_runner.py: "Model loading took %.4f GiB and %.6f seconds" up to
    0.11, "%.4f GiB memory and" in 0.12–0.13, format_gib's at most two decimals from 0.14."""
    four = infer_for_log(["INFO 09-04 01:03:03 [gpu_model_runner.py:2007] Model loading took 1.1201 GiB and 3.1 s"])
    assert rf.release_key(four.release_range[1]) <= (0, 11, 0)
    two = infer_for_log(["INFO 09-04 01:03:03 [gpu_model_runner.py:4820] Model loading took 14.99 GiB memory and 1"])
    assert rf.release_key(two.release_range[0]) >= (0, 14, 0)
    # a record's re-typed line (no logger prefix) is not held to the format: only its words count
    loose = infer_for_log(["Model loading took 1.1201 GiB"])
    assert not any(e.kind == "log format" for e in loose.evidence + loose.ignored)
    assert rf.shape_matches("Available KV cache memory: \x00f2\x00 GiB", "Available KV cache memory: -2.14 GiB")
    assert not rf.shape_matches("Available KV cache memory: \x00f2\x00 GiB", "Available KV cache memory: 21.5 GiB")

"""Settings vLLM refuses at start-up are DropErrors naming the drop and the key (tuner.memory.engine_checks,
called from tuner.jobs.job.run_job): parallel layouts, scheduler limits, the quantization override."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO
from tuner.memory import engine_checks
from tuner.errors import DropError, ModelConfigError
from tuner.jobs.job import run_job

LLAMA_8B = REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct" / "config.json"
H100 = 85_520_809_984
DROP = "/etc/ctx-tuner/conf.d/llama.yaml"


def _drop(**over) -> dict:
    d = {"path": DROP, "engine_version": "0.19.0", "dtype": "auto", "kv_cache_dtype": "auto",
         "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
         "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [4096]}, "constraints": {}}
    d.update(over)
    return d


def _job(config: Path = LLAMA_8B, **over) -> dict:
    return run_job({"drop": _drop(**over), "config_path": str(config),
                    "device": {"name": "H100-80GB", "total_memory_bytes": H100}, "search": False})


def _refused(field: str, **over) -> DropError:
    with pytest.raises(DropError) as info:
        _job(**over)
    assert info.value.path == DROP and info.value.field == field
    assert str(info.value).startswith(f"{DROP}:{field}: ")
    return info.value


# -- 1. parallel layouts -----------------------------------------------------------------------
def test_tp3_on_llama_8b_is_a_drop_error_not_a_kv_cache_error():
    err = _refused("tensor_parallel_size", tensor_parallel_size=3)
    assert "Total number of attention heads (32) must be divisible by tensor parallel size (3)." in err.message


def test_tp64_on_32_heads_is_refused_instead_of_proposed():
    err = _refused("tensor_parallel_size", tensor_parallel_size=64)
    assert "attention heads (32)" in err.message and "(64)" in err.message


def test_pp64_on_32_layers_is_a_drop_error_not_stopiteration():
    err = _refused("pipeline_parallel_size", pipeline_parallel_size=64)
    assert "pipeline_parallel_size (64) is larger than num_hidden_layers (32)" in err.message


def test_kv_heads_must_split_or_replicate_evenly(tmp_path):
    top = json.loads(LLAMA_8B.read_text())
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**top, "num_attention_heads": 48, "num_key_value_heads": 12, "head_dim": 128}))
    with pytest.raises(DropError) as info:
        _job(cfg, tensor_parallel_size=8)  # 48 % 8 == 0, but 12 KV heads do not split over 8 ranks
    assert info.value.field == "tensor_parallel_size" and "KV heads (12)" in info.value.message
    # fewer KV heads than ranks: replicated when tp is a multiple of them (vLLM starts)
    engine_checks.check_parallel_layout(num_attention_heads=32, num_hidden_layers=32, kv_heads={8},
                                        tensor_parallel_size=16, pipeline_parallel_size=1, path=DROP)
    with pytest.raises(DropError, match="multiple of the number of KV heads"):
        engine_checks.check_parallel_layout(num_attention_heads=32, num_hidden_layers=32, kv_heads={6},
                                            tensor_parallel_size=16, pipeline_parallel_size=1, path=DROP)


def test_mla_has_no_per_head_kv_rule(shared_dir):
    """DeepSeek-V2-Lite (16 heads, MLA): TP 8 is only the heads rule; the latent is not split."""
    from tuner.jobs.job import per_head_kv_totals
    from tuner.model.modelspec import load_model_spec, read_architectures, read_top
    from tuner.model.plugin import RankSettings, load_registry

    cfg = shared_dir / "models" / "deepseek-ai--DeepSeek-V2-Lite-Chat" / "config.json"
    plugin, _ = load_registry().for_architectures(read_architectures(cfg))
    spec, _ = load_model_spec(cfg, defaults=plugin.config_defaults(read_top(cfg)))
    assert per_head_kv_totals(plugin, spec, RankSettings(engine_version="0.19.0", dtype="bfloat16")) == set()
    r = _job(cfg, tensor_parallel_size=8)
    assert r["candidates"]
    with pytest.raises(DropError) as info:
        _job(cfg, tensor_parallel_size=3)
    assert info.value.field == "tensor_parallel_size" and "attention heads (16)" in info.value.message


def test_valid_tp_and_pp_still_run():
    r = _job(tensor_parallel_size=8, pipeline_parallel_size=2)
    assert r["candidates"][0]["num_gpu_blocks"] > 0


# -- 2. scheduler limits ----------------------------------------------------------------------
def test_max_num_batched_tokens_below_max_num_seqs_is_refused():
    err = _refused("max_num_batched_tokens", max_num_batched_tokens=256, max_num_seqs=512)
    assert err.message == "max_num_batched_tokens (256) must be greater than or equal to max_num_seqs (512)."


def test_default_max_num_seqs_is_clamped_in_v1_but_not_in_v0():
    engine_checks.check_batch(engine="V1", max_num_batched_tokens=256, max_num_seqs=256, chunked_prefill=True,
                              user_max_num_batched_tokens=256, user_max_num_seqs=None, path=DROP)
    with pytest.raises(DropError) as info:  # V0's default 256 sequences stay
        engine_checks.check_batch(engine="V0", max_num_batched_tokens=128, max_num_seqs=256, chunked_prefill=True,
                                  user_max_num_batched_tokens=128, user_max_num_seqs=None, path=DROP)
    assert info.value.field == "max_num_batched_tokens"
    with pytest.raises(DropError) as info:  # a drop-set S above the era's default N names max_num_seqs
        engine_checks.check_batch(engine="V1", max_num_batched_tokens=8192, max_num_seqs=10000, chunked_prefill=True,
                                  user_max_num_batched_tokens=None, user_max_num_seqs=10000, path=DROP)
    assert info.value.field == "max_num_seqs"


def test_max_num_seqs_above_default_batched_tokens_is_refused():
    err = _refused("max_num_seqs", max_num_seqs=10000)  # 0.19 on an H100: N defaults to 8192
    assert "max_num_batched_tokens (8192) must be greater than or equal to max_num_seqs (10000)" in err.message


def test_chunked_prefill_off_needs_max_num_batched_tokens_at_least_max_model_len():
    err = _refused("max_num_batched_tokens", enable_chunked_prefill=False, max_num_batched_tokens=2048,
                   max_num_seqs=256)
    assert err.message.startswith("max_num_batched_tokens (2048) is smaller than max_model_len (4096).")


def test_chunked_prefill_off_caps_the_proposal_at_max_num_batched_tokens():
    r = run_job({"drop": _drop(enable_chunked_prefill=False, max_num_batched_tokens=16384, max_num_seqs=256,
                               candidates={"gpu_memory_utilization": [0.9], "max_model_len": [8192]}),
                 "config_path": str(LLAMA_8B), "device": {"name": "H100-80GB", "total_memory_bytes": H100}})
    assert r["proposals"][0]["max_model_len"] <= 16384


# -- 3. quantization override -----------------------------------------------------------------
def test_unknown_quantization_method_is_refused():
    err = _refused("quantization", quantization="foobar")
    assert err.message.startswith("Unknown quantization method: foobar. Must be one of ['awq', 'fp8'")


def test_awq_on_a_bf16_checkpoint_is_refused():
    err = _refused("quantization", quantization="awq")
    assert "needs a checkpoint quantized with it" in err.message


def test_override_that_contradicts_the_checkpoint_is_refused():
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with pytest.raises(DropError) as info:
        engine_checks.check_quantization("awq", fp8, version=(0, 19, 0), path=DROP)
    assert info.value.field == "quantization"
    assert info.value.message == ("Quantization method specified in the model config (fp8) does not match the "
                                  "quantization method specified in the `quantization` argument (awq).")
    assert engine_checks.check_quantization("fp8", fp8, version=(0, 19, 0), path=DROP) == []
    gptq = {"quant_method": "gptq", "bits": 4}
    for ok in ("gptq", "gptq_marlin", "moe_wna16"):
        engine_checks.check_quantization(ok, gptq, version=(0, 19, 0), path=DROP)


def test_online_methods_stay_allowed_and_unmodelled_ones_say_so():
    assert engine_checks.check_quantization("fp8", None, version=(0, 19, 0), path=DROP) == []
    assert engine_checks.check_quantization("ptpc_fp8", None, version=(0, 11, 0), path=DROP) == []
    assert "deprecates" in engine_checks.check_quantization("experts_int8", None, version=(0, 19, 0), path=DROP)[0]
    with pytest.raises(DropError):  # removed from 0.19's list
        engine_checks.check_quantization("ptpc_fp8", None, version=(0, 19, 0), path=DROP)
    with pytest.raises(ModelConfigError, match="not modelled"):
        engine_checks.check_quantization("bitsandbytes", None, version=(0, 19, 0), path=DROP)
    from types import SimpleNamespace

    from tuner.memory.quant import scheme_for

    with pytest.raises(ModelConfigError, match="not modelled"):
        scheme_for(SimpleNamespace(quantization_config=None, top={}, raw={}),
                   SimpleNamespace(engine_version="0.19.0", quantization="mxfp8", compute_capability="9.0"))


def test_quantization_override_is_in_the_proposed_arguments():
    from tuner.jobs.job import _extra_args

    assert "--quantization fp8" in _extra_args(_drop(quantization="fp8"))
    assert "--allow-deprecated-quantization" in _extra_args(_drop(quantization="experts_int8"))


def test_vllm_019_list_matches_the_source():
    src = Path("/tmp/vllm/src019/vllm/model_executor/layers/quantization/__init__.py")
    if not src.is_file():
        pytest.skip("vLLM 0.19 source not present")
    import re

    body = re.search(r"QuantizationMethods = Literal\[(.*?)\]", src.read_text(), re.S).group(1)
    assert tuple(re.findall(r'"([^"]+)"', body)) == engine_checks.VLLM_019_QUANTIZATION_METHODS


def test_v0_unchunked_lengths_must_fit_the_drops_batch(tmp_path, shared_dir):
    """V0 keeps chunked prefill off up to 32768 tokens: a grid length there above the drop's
    max_num_batched_tokens is refused naming that field (with the real length), and the search
    skips the unchunked lengths the batch cannot hold."""
    from tuner.errors import DropError
    from tuner.jobs.job import run_job

    config = shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct" / "config.json"
    drop = {"name": "v0n", "path": str(tmp_path / "v0n.yaml"), "engine_version": "0.6.4", "dtype": "auto",
            "kv_cache_dtype": "auto", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
            "max_num_batched_tokens": 4096, "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [8192]},
            "constraints": {}}
    dev = {"name": "RTX-3090", "total_memory_bytes": 25318916096}
    with pytest.raises(DropError) as e:
        run_job({"drop": drop, "config_path": str(config), "device": dev})
    assert e.value.field == "max_num_batched_tokens" and "max_model_len (8192)" in str(e.value)
    drop["candidates"]["max_model_len"] = [2048, 40000]
    r = run_job({"drop": drop, "config_path": str(config), "device": dev})
    assert {c["max_num_batched_tokens"] for c in r["candidates"]} == {4096}
    prop = r["proposals"][0]["max_model_len"]
    assert prop > 32768 or prop <= 4096  # never an unchunked length above the batch


def test_draft_tensor_parallel_size_vllm_refuses_was_profiled_without_a_word():
    """A draft_model drafter at draft_tensor_parallel_size 1 or 2 under TP4 profiled normally;
    vLLM refuses both (0.19.0 and 0.32.0 read): any value but 1 or the target's TP
    (config/speculative.py), and for draft_model any value but the target's (v1/spec_decode/draft_model.py)."""
    spec = {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3}
    err = _refused("speculative_config.draft_tensor_parallel_size", tensor_parallel_size=4,
                   speculative_config={**spec, "draft_tensor_parallel_size": 2})
    assert err.message.startswith("speculative_draft_tensor_parallel_size=2 cannot be other value than 1 or target")
    err = _refused("speculative_config.draft_tensor_parallel_size", tensor_parallel_size=4,
                   speculative_config={**spec, "draft_tensor_parallel_size": 1})
    assert "must be the same. Got 1 and 4" in err.message
    # 1 under TP4 is allowed for other drafters, the target's TP for draft_model
    engine_checks.check_draft_tensor_parallel_size({"method": "eagle", "draft_tensor_parallel_size": 1},
                                                   tensor_parallel_size=4, engine="V1", path=DROP)
    engine_checks.check_draft_tensor_parallel_size({**spec, "draft_tensor_parallel_size": 4},
                                                   tensor_parallel_size=4, engine="V1", path=DROP)

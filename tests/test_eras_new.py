"""Rules for vLLM 0.20 – 0.33 (V1): Model Runner V2 selection and its profile, the
``total_consumed`` budget's persistent buffers, the cuBLAS baseline, batch defaults, DeepSeek-V4.

Every expected value is computed by hand from the vLLM source cited in each test."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tuner.memory.budget import cublas_workspace_bytes, profile_overhead_bytes, runner_persistent_bytes
from tuner.memory.eras import (
    GiB,
    SAMPLER_V1_TRITON,
    SAMPLER_V2_FP32_PASS,
    SAMPLER_V2_LOGITS,
    V1_CONSUMED,
    V1_PROFILING,
    config_is_moe,
    era_for,
    profile_batch,
    sampler_family,
    uses_model_runner_v2,
)
from tuner.model.simulate.sampler import run_dummy_sampler
from tuner.model.simulate.tracker import MemoryTracker

H100 = 85030076416


# -- Model Runner V2 selection (vllm/config/vllm.py use_v2_model_runner) -----------------------

def _v2(version, archs, **kw):
    kw.setdefault("is_moe", False)
    return uses_model_runner_v2(era_for(version), archs, **kw)


def test_v2_runner_is_opt_in_in_0_20():
    """0.20 vllm/v1/worker/gpu_worker.py: ``use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER`` (default 0)."""
    assert not _v2("0.20.0", ["Qwen3ForCausalLM"])
    assert not _v2("0.19.0", ["LlamaForCausalLM"])


def test_v2_runner_0_22_only_unquantized_dense_qwen3():
    """0.22 ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES = {"Qwen3ForCausalLM"}``, not MoE, not quantized."""
    assert _v2("0.22.0", ["Qwen3ForCausalLM"])
    assert not _v2("0.22.0", ["Qwen3ForCausalLM"], is_quantized=True)
    assert not _v2("0.22.0", ["LlamaForCausalLM"])


def test_v2_runner_0_24_list_only():
    """0.24: architecture in the six-entry list, nothing else (Qwen2 dense stays on V1)."""
    assert _v2("0.24.0", ["LlamaForCausalLM"])
    assert _v2("0.24.0", ["Qwen2MoeForCausalLM"], is_moe=True)
    assert not _v2("0.24.0", ["Qwen2ForCausalLM"])


def test_v2_runner_0_25_every_dense_model_but_not_hybrid_or_unlisted_moe():
    """0.25 ``_is_default_v2_model_runner_model``: hybrid / attention-free → V1; listed or not MoE → V2."""
    assert _v2("0.25.0", ["Qwen2ForCausalLM"])
    assert not _v2("0.25.0", ["MixtralForCausalLM"], is_moe=True)
    assert _v2("0.25.0", ["DeepseekV2ForCausalLM"], is_moe=True)
    assert not _v2("0.25.0", ["DeepseekV3ForCausalLM"], is_moe=True)
    assert not _v2("0.25.0", ["Qwen3NextForCausalLM"], is_moe=True, is_hybrid=True)
    assert not _v2("0.25.0", ["MambaForCausalLM"], is_attention_free=True)
    # pooling models stay on V1 before 0.30
    assert not _v2("0.25.0", ["Qwen2ForCausalLM"], generate=False)


def test_v2_runner_0_28_listed_hybrid_and_deepseek_v4():
    """0.28: hybrid allowed when listed; the list gains DeepseekV4ForCausalLM."""
    assert not _v2("0.27.0", ["DeepseekV4ForCausalLM"], is_moe=True)
    assert _v2("0.28.0", ["DeepseekV4ForCausalLM"], is_moe=True)
    assert not _v2("0.28.0", ["Qwen3NextForCausalLM"], is_moe=True, is_hybrid=True)


def test_v2_runner_default_for_everything_from_0_30():
    """0.30 / 0.33 ``use_v2_model_runner``: True unless an unsupported feature is configured."""
    assert _v2("0.30.0", ["MixtralForCausalLM"], is_moe=True, is_hybrid=True)
    assert _v2("0.33.0", ["Qwen3NextForCausalLM"], is_moe=True, is_hybrid=True)


def test_config_is_moe_reads_vllm_aliases():
    """vllm/transformers_utils/config.py ``CONFIG_FIELD_ALIASES["num_experts"]``."""
    assert config_is_moe({"num_local_experts": 8})
    assert config_is_moe({"n_routed_experts": 256})
    assert config_is_moe({"moe_num_experts": [64, 64]})
    assert not config_is_moe({"num_experts": 0})
    assert not config_is_moe({"hidden_size": 4096})


# -- sampler families ----------------------------------------------------------------------

def test_sampler_family_v2_and_v1_runner():
    """V2 ``_dummy_sampler_run``: default pass only (0.22–0.32), + fp32 warm-up pass (0.33);
    the V1 runner keeps the Triton path (0.25 ``TopKTopPSampler.forward_native``)."""
    assert sampler_family(era_for("0.25.0"), model_runner_v2=True) == SAMPLER_V2_LOGITS
    assert sampler_family(era_for("0.30.0"), model_runner_v2=True) == SAMPLER_V2_LOGITS
    assert sampler_family(era_for("0.33.0"), model_runner_v2=True) == SAMPLER_V2_FP32_PASS
    assert sampler_family(era_for("0.33.0")) == SAMPLER_V1_TRITON
    assert sampler_family(era_for("0.19.0"), model_runner_v2=True) == SAMPLER_V1_TRITON


class _Head(nn.Module):
    def __init__(self, vocab: int, hidden: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=torch.bfloat16), requires_grad=False)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.weight)


def _sampler_peak(family: str, r: int, v: int) -> int:
    head = _Head(v)
    with torch.no_grad():
        hidden = torch.zeros(r, 8, dtype=torch.bfloat16)
        with MemoryTracker() as t:
            run_dummy_sampler(family, head, hidden, num_reqs=r)
    return t.peak_bytes


def test_v2_sampler_peaks_hand_computed():
    """R = 4, V = 1024 bf16: logits 4·1024·2 = 8 KiB (+ the [R, H] row gather, 4·8·2 → 512 B,
    + the arange index 4·8 → 512 B freed before); 0.33 adds three fp32 [R, V] (16 KiB each):
    fp32 copy, top_k_mask_logits output, softmax probs."""
    gather = 512
    assert _sampler_peak(SAMPLER_V2_LOGITS, 4, 1024) == gather + 8192
    assert _sampler_peak(SAMPLER_V2_FP32_PASS, 4, 1024) == gather + 8192 + 3 * 16384


# -- persistent buffers charged by total_consumed (0.27+) -------------------------------------

def test_runner_persistent_bytes_v2():
    """Model Runner V2 0.33: InputBuffers (int32 + int64 + bool [N]) and PenaltiesState
    ``output_bin_counts [S, V]`` int32 + ``prompt_bin_mask [S, cdiv(V, 32)]`` int32.
    N 8192, S 1024, V 152064: 32768 + 65536 + 8192 + 622854144 + 19464192."""
    kw = dict(model_runner_v2=True, max_num_batched_tokens=8192, max_num_seqs=1024, max_model_len=32768,
              hidden_size=3584, vocab_size=152064)
    assert runner_persistent_bytes(era_for("0.33.0"), **kw) == 642_424_832
    assert runner_persistent_bytes(era_for("0.27.0"), **kw) == 642_424_832
    # 0.26 subtracts the torch peak increase measured from the profile's start: not charged.
    assert era_for("0.26.0").budget_formula == V1_PROFILING
    assert runner_persistent_bytes(era_for("0.26.0"), **kw) == 0


def test_runner_persistent_bytes_v1_runner():
    """V1 runner 0.33 ``GPUModelRunner.__init__``: [N] buffers 4+8+1+8+1 B, query_pos 8·max(S+1, N),
    inputs_embeds N·H·2, block table S·cdiv(M, 16)·4, slot mapping 8N.
    N 8192, S 1024, M 32768, H 4096: 32768+65536+8192+65536+8192+65536+67108864+8388608+65536."""
    got = runner_persistent_bytes(era_for("0.33.0"), model_runner_v2=False, max_num_batched_tokens=8192,
                                  max_num_seqs=1024, max_model_len=32768, hidden_size=4096, vocab_size=128256)
    assert era_for("0.33.0").budget_formula == V1_CONSUMED
    assert got == 75_808_768


def test_cublas_workspace_is_baseline_from_0_33():
    """0.33 gpu_worker.py ``init_device`` runs torch.mm / linear before the snapshot; 0.30 does not."""
    assert profile_overhead_bytes("9.0", era_for("0.33.0")) == 0
    assert profile_overhead_bytes("9.0", era_for("0.30.0")) == cublas_workspace_bytes("9.0") == 32 * 1024 * 1024
    assert profile_overhead_bytes("8.0") == 4096 * 2 * 1024 + 16 * 8 * 1024


# -- batch defaults (vllm/engine/arg_utils.py get_batch_defaults) ----------------------------

def test_gb10_is_small_tier_in_0_33_only():
    """0.33 excludes GB10 (cc 12.1, 128 GB unified memory) from the ≥70 GiB tier; 0.30 does not test it."""
    total = 128 * GiB
    b33 = profile_batch(era_for("0.33.0"), max_model_len=8192, device_name="NVIDIA GB10", total_memory_bytes=total)
    b30 = profile_batch(era_for("0.30.0"), max_model_len=8192, device_name="NVIDIA GB10", total_memory_bytes=total)
    assert (b33.max_num_batched_tokens, b33.max_num_seqs) == (2048, 256)
    assert (b30.max_num_batched_tokens, b30.max_num_seqs) == (8192, 1024)


def test_default_utilization_and_cudagraph_subtraction_from_0_20():
    """0.20 vllm/config/cache.py ``gpu_memory_utilization = 0.92``; envs
    ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` default 1; cudagraph_mode NONE (enforce_eager) skips it."""
    assert era_for("0.20.0").default_gpu_memory_utilization == 0.92
    assert era_for("0.33.0").subtracts_cudagraph_estimate
    assert not era_for("0.33.0", enforce_eager=True).subtracts_cudagraph_estimate
    assert not era_for("0.19.0").subtracts_cudagraph_estimate


# -- end to end: a job at 0.33 runs the V2 profile --------------------------------------------

def test_job_0_33_uses_v2_runner_and_charges_its_buffers(tiny_config):
    """Tiny Llama (V 1000) on an H100 with vLLM 0.33 serve defaults N 8192, S 1024:
    V2 buffers 32768 + 65536 + 8192 + 4·1024·1000 + 4·1024·32 = 4,333,568 B; 0.20: V1 runner, none charged."""
    from tuner.jobs.job import run_job

    def job(version):
        d = {"engine_version": version, "dtype": "auto", "kv_cache_dtype": "auto", "tensor_parallel_size": 1,
             "pipeline_parallel_size": 1, "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [4096]},
             "constraints": {}}
        return run_job({"drop": d, "config_path": str(tiny_config / "config.json"),
                        "device": {"name": "H100-80GB", "total_memory_bytes": H100}, "search": False})

    r33, r20 = job("0.33.0"), job("0.20.0")
    assert r33["model_runner_v2"] and not r20["model_runner_v2"]
    assert r33["runs"][0]["persistent_bytes"] == 4_333_568
    assert r20["runs"][0]["persistent_bytes"] == 0
    run = r33["runs"][0]
    assert run["activation_peak_bytes"] >= run["persistent_bytes"] + run["sampler_peak_bytes"]


# -- DeepSeek-V4 (vllm/model_executor/models/registry.py) -------------------------------------

def test_deepseek_v4_refusal_says_which_releases_have_it(shared_dir):
    from tuner.errors import ModelConfigError
    from tuner.model.modelspec import load_model_spec
    from tuner.model.plugin import RankSettings, load_registry

    path = shared_dir / "models" / "deepseek-ai--DeepSeek-V4-Flash" / "config.json"
    spec, _ = load_model_spec(path)
    plugin = load_registry().by_name("deepseek_v4")  # its own plugin since issue 28 (0.20 – 0.29 modelled)
    with pytest.raises(ModelConfigError, match="absent from the model registry before 0.20"):
        plugin.kv_cache_spec(spec, RankSettings(engine_version="0.19.0", dtype="bfloat16", kv_cache_dtype="fp8"))
    with pytest.raises(ModelConfigError, match="0.30 changed the DeepSeek-V4 sliding-window cache spec"):
        plugin.kv_cache_spec(spec, RankSettings(engine_version="0.33.0", dtype="bfloat16", kv_cache_dtype="fp8"))

"""Era rules and the KV budget, against the reference and real logs."""

from __future__ import annotations

import pytest

from tuner.memory.budget import kv_budget, non_torch_bytes, requested_memory_bytes
from tuner.memory.eras import GiB, era_for, profile_batch, resolve_dtype, sampler_family
from tuner.errors import EraError


def test_era_formula_families():
    assert era_for("0.6.3").budget_formula == "v0_free_delta"
    assert era_for("0.6.4.post1").budget_formula == "v0_whole_gpu"
    assert era_for("0.6.5").budget_formula == "v0_profiling"
    assert era_for("0.8.0").engine == "V1"
    assert era_for("0.8.0").budget_formula == "v1_whole_gpu"
    assert era_for("0.9.1").budget_formula == "v1_profiling"
    assert era_for("0.27.0").budget_formula == "v1_consumed"
    assert era_for("0.20.0").subtracts_cudagraph_estimate
    assert not era_for("0.19.0").subtracts_cudagraph_estimate
    assert not era_for("0.20.0", enforce_eager=True).subtracts_cudagraph_estimate
    assert era_for("0.20.0").default_gpu_memory_utilization == 0.92


@pytest.mark.parametrize("bad", ["banana", "0.3.0", ""])
def test_bad_versions_raise(bad):
    with pytest.raises(EraError):
        era_for(bad)


def test_newer_release_takes_the_newest_rules_unless_refused():
    """A release past the newest modelled one is answered with the newest's rules (issue 29); strict
    mode (``newer="refuse"``) raises."""
    from tuner.memory.eras import VllmVersion

    assert era_for("1.2.0").version == (0, 34, 0)
    with pytest.raises(EraError, match="strict release mode"):
        VllmVersion.parse("1.2.0", newer="refuse")


def test_v0_removed_in_011():
    with pytest.raises(EraError):
        era_for("0.11.0", "V0")


def test_v0_profile_batch_follows_chunked_prefill_switch():
    e = era_for("0.6.4")
    assert profile_batch(e, max_model_len=1000).max_num_batched_tokens == 2048
    assert profile_batch(e, max_model_len=29000).max_num_batched_tokens == 29000
    b = profile_batch(e, max_model_len=35000)
    assert (b.max_num_batched_tokens, b.num_reqs, b.chunked_prefill) == (512, 256, True)
    assert profile_batch(era_for("0.6.5"), max_model_len=35000).max_num_batched_tokens == 2048
    with pytest.raises(EraError):
        profile_batch(e, max_model_len=29000, max_num_batched_tokens=8192, enable_chunked_prefill=False)


def test_v1_defaults_by_gpu_tier():
    e = era_for("0.19.0")
    h100 = profile_batch(e, max_model_len=8192, device_name="H100-80GB", total_memory_bytes=int(79.19 * GiB))
    assert (h100.max_num_batched_tokens, h100.max_num_seqs) == (8192, 1024)
    a100 = profile_batch(e, max_model_len=8192, device_name="A100-80GB", total_memory_bytes=int(79.2 * GiB))
    assert (a100.max_num_batched_tokens, a100.max_num_seqs) == (2048, 256)
    off = profile_batch(e, max_model_len=8192, entry_point="offline", device_name="H100", total_memory_bytes=int(79 * GiB))
    assert off.max_num_batched_tokens == 16384
    small = profile_batch(e, max_model_len=100, max_num_batched_tokens=8192, max_num_seqs=1024)
    assert small.max_num_batched_tokens == 8192 and small.num_reqs == 1024
    # 0.12+: N = min(S·M, N)
    tiny = profile_batch(e, max_model_len=4, max_num_batched_tokens=8192, max_num_seqs=2)
    assert tiny.max_num_batched_tokens == 8 and tiny.num_reqs == 2


def test_sampler_families():
    assert sampler_family(era_for("0.6.4")) == "v0_sort"
    assert sampler_family(era_for("0.7.0", "V1")) == "v1_all_logits"
    assert sampler_family(era_for("0.10.1")) == "v1_sort"  # a pip install: no FlashInfer before 0.11.1
    assert sampler_family(era_for("0.10.1"), flashinfer=True) == "v1_flashinfer"
    assert sampler_family(era_for("0.13.0")) == "v1_sort"
    assert sampler_family(era_for("0.19.0")) == "v1_triton"


def test_requested_memory_rounds_up_from_014():
    t = 85_030_076_416
    assert requested_memory_bytes(era_for("0.19.0"), t, 0.95) == 80_778_572_596  # ceil(80778572595.2)
    assert requested_memory_bytes(era_for("0.13.0"), t, 0.95) == 80_778_572_595


def test_budget_reproduces_v0_064_log():
    # "total_gpu_memory=23.58GiB peak_torch_memory=17.98GiB non_torch_memory=0.35GiB kv_cache_size=2.89GiB"
    b = kv_budget(era_for("0.6.4"), total_memory_bytes=int(23.58 * GiB), gpu_memory_utilization=0.9,
                  weights_bytes=int(14.9888 * GiB), activation_peak_bytes=int((17.98 - 14.9888) * GiB),
                  non_torch_bytes=int(0.35 * GiB))
    assert abs(b.available_kv_cache_bytes / GiB - 2.89) < 0.01


def test_non_torch_model_by_layout():
    e = era_for("0.19.0")
    assert non_torch_bytes(e) == int(0.25 * GiB)
    assert abs(non_torch_bytes(e, tensor_parallel_size=2) / GiB - 2.07) < 0.01
    assert abs(non_torch_bytes(e, tensor_parallel_size=4) / GiB - 2.10) < 0.05
    assert non_torch_bytes(e, pipeline_parallel_size=2) == int(0.07 * GiB)


def test_resolve_dtype():
    assert resolve_dtype("auto", "bfloat16") == "bfloat16"
    assert resolve_dtype("auto", "float32") == "float16"
    assert resolve_dtype("float32", "bfloat16") == "float32"

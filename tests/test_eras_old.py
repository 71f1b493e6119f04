"""Rules of vLLM 0.4 – 0.10 (V0, and V1 0.7 – 0.10), hand-computed against the released source."""

from __future__ import annotations

import torch

from tuner.memory.budget import V1_0910_TP1_NON_TORCH_GIB, non_torch_bytes
from tuner.memory.eras import (
    GiB,
    era_for,
    profile_batch,
    sampler_family,
    v0_multimodal_min_batched_tokens,
    v0_uses_sliding_window,
)
from tuner.model.simulate.sampler import FLASHINFER_DEFAULT_BUFFERS, FLASHINFER_WORKSPACE_FP32_BUFFERS, run_dummy_sampler
from tuner.model.simulate.tracker import MemoryTracker


def test_v0_multimodal_batched_tokens_floor():
    """vllm/config.py ``_MULTIMODAL_MODEL_MAX_NUM_BATCHED_TOKENS``: absent in 0.5.4, 4096 in
    0.6.0, 5120 in 0.6.3 / 0.6.4.post1 / 0.7.0; applied only to the default N."""
    assert v0_multimodal_min_batched_tokens(era_for("0.5.4").version) == 0
    assert v0_multimodal_min_batched_tokens(era_for("0.6.0").version) == 4096
    assert v0_multimodal_min_batched_tokens(era_for("0.6.4").version) == 5120
    e = era_for("0.6.4")
    b = profile_batch(e, max_model_len=4096, is_multimodal=True)
    assert (b.max_num_batched_tokens, b.num_reqs, b.chunked_prefill) == (5120, 256, False)
    assert profile_batch(e, max_model_len=4096).max_num_batched_tokens == 4096
    assert profile_batch(era_for("0.5.4"), max_model_len=4096, is_multimodal=True).max_num_batched_tokens == 4096
    # a user value is kept as given
    assert profile_batch(e, max_model_len=4096, is_multimodal=True,
                         max_num_batched_tokens=4096).max_num_batched_tokens == 4096


def test_v0_chunked_prefill_default_for_multimodal_by_release():
    """vllm/engine/arg_utils.py: 0.5.4 and 0.6.0 enable chunked prefill above 32K for every model
    without a sliding window (multimodal included: N = 512); 0.6.3+ keep it off for multimodal
    (N = max(M, 2048))."""
    old = profile_batch(era_for("0.5.4"), max_model_len=65536, is_multimodal=True)
    assert (old.chunked_prefill, old.max_num_batched_tokens) == (True, 512)
    new = profile_batch(era_for("0.6.4"), max_model_len=65536, is_multimodal=True)
    assert (new.chunked_prefill, new.max_num_batched_tokens) == (False, 65536)
    v010 = profile_batch(era_for("0.10.0", "V0"), max_model_len=65536)
    assert (v010.chunked_prefill, v010.max_num_batched_tokens, v010.num_reqs) == (True, 2048, 256)


def test_v0_sliding_window_honours_use_sliding_window():
    """vllm/config.py 0.6.4 ``get_hf_config_sliding_window``: ``use_sliding_window: false``
    (Qwen2 / Qwen1.5 configs) means no window, so a >32K context gets chunked prefill."""
    assert not v0_uses_sliding_window(131072, False)
    assert not v0_uses_sliding_window(0, False)
    assert not v0_uses_sliding_window(None)
    assert v0_uses_sliding_window(4096)  # Mistral-7B-v0.1
    e = era_for("0.6.4")
    assert profile_batch(e, max_model_len=65536, has_sliding_window=True).max_num_batched_tokens == 65536
    assert profile_batch(e, max_model_len=65536,
                         has_sliding_window=v0_uses_sliding_window(131072, False)).max_num_batched_tokens == 512


def test_v1_0910_tp1_non_torch_constant():
    """V1 0.9.1–0.10.x at TP1: module loads only (calibrated 0.02 GiB); TP keeps the NCCL model."""
    assert non_torch_bytes(era_for("0.10.1.1")) == int(0.02 * GiB) == int(V1_0910_TP1_NON_TORCH_GIB * GiB)
    assert non_torch_bytes(era_for("0.9.2")) == int(0.02 * GiB)
    # TP2 on the default topology (H100 SXM, NVSwitch): TP1 term + NVLS + the NCCL communicator and
    # custom all-reduce buffers (0.10 snapshots before the distributed init, so they are charged)
    assert non_torch_bytes(era_for("0.10.1"), tensor_parallel_size=2) == (
        int(0.02 * GiB) + int((1.82 + 0.12) * GiB) + 2560 + 2 * 8 * 1024 * 1024)
    assert non_torch_bytes(era_for("0.10.1"), pipeline_parallel_size=2) == int(0.07 * GiB)
    assert non_torch_bytes(era_for("0.11.0")) == int(0.13 * GiB)


class _Head(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(vocab, hidden, dtype=torch.bfloat16), requires_grad=False)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.w)


def _sampler_peak(version: str, r: int, v: int, h: int = 64, flashinfer: bool | None = None) -> int:
    head = _Head(v, h)
    hidden = torch.empty(r, h, dtype=torch.bfloat16)
    e = era_for(version)
    with torch.no_grad(), MemoryTracker() as t:
        run_dummy_sampler(sampler_family(e, flashinfer=flashinfer), head, hidden, num_reqs=r, version=e.version.key)
    return t.peak_bytes


def test_flashinfer_sampler_buffers_by_release():
    """0.8.x ``forward_cuda``: softmax probs then ``top_k_top_p_sampling_from_probs`` → one fp32
    [R, V] buffer; 0.9.0–0.10.x ``top_k_top_p_sampling_from_logits`` → FlashInfer
    ``top_k_mask_logits`` (empty_like) + softmax → two (vllm/v1/sample/ops/topk_topp_sampler.py)."""
    assert FLASHINFER_WORKSPACE_FP32_BUFFERS[(0, 8)] == 1
    assert FLASHINFER_DEFAULT_BUFFERS == 2  # 0.9–0.16
    r, v, h = 8, 1024, 64  # every allocation a multiple of 512 B
    # [R, H] rand_like copy (bf16) + [R, V] bf16 logits + fp32 logits + k fp32 buffers (+ [R] argmax)
    base = r * h * 2 + r * v * 2 + r * v * 4
    argmax = 512
    assert _sampler_peak("0.8.5", r, v, h, flashinfer=True) == base + 1 * r * v * 4 + argmax
    assert _sampler_peak("0.10.1", r, v, h, flashinfer=True) == base + 2 * r * v * 4 + argmax


def test_flashinfer_sampler_opt_in_from_0_11_1():
    """vllm/v1/sample/ops/topk_topp_sampler.py: 0.9.0–0.11.0 take ``forward_cuda`` (FlashInfer)
    unless ``VLLM_USE_FLASHINFER_SAMPLER=0``; 0.11.0→0.11.1 turns it into an opt-in
    (``if envs.VLLM_USE_FLASHINFER_SAMPLER:``), so 0.11.1 and 0.11.2 profile the PyTorch sort path
    that 0.12 keeps (same ``apply_top_k_top_p``)."""
    assert sampler_family(era_for("0.11.0"), flashinfer=True) == "v1_flashinfer"
    assert sampler_family(era_for("0.11.1")) == sampler_family(era_for("0.11.2")) == "v1_sort"
    r, v, h = 8, 1024, 64
    assert _sampler_peak("0.11.1", r, v, h) == _sampler_peak("0.12.0", r, v, h)
    assert _sampler_peak("0.11.1", r, v, h) != _sampler_peak("0.11.0", r, v, h, flashinfer=True)


def test_v0_sampler_peak_is_32_bytes_per_logit():
    """V0 0.6.4 sampler (vllm/model_executor/layers/sampler.py): bf16 logits 2 + fp32 copy 4 +
    ``_apply_top_k_top_p`` sorted 4, int64 idx 8, top-k mask 1, softmax 4, cumsum 4, top-p mask 1,
    scattered copy 4 = 32 B per [R, V] element, plus the [R, H] last-token rows."""
    r, v, h = 8, 1024, 64
    assert _sampler_peak("0.6.4", r, v, h) == r * h * 2 + 32 * r * v

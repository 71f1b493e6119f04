"""Memory-equivalent dummy sampler runs, one per era family (torch).

Each function allocates, in order and with the same lifetimes, the ``[R, V]`` tensors that the
era's sampler creates on the profile run's sampled rows (see :func:`tuner.memory.eras.sampler_family`).
Values are never meaningful. Bytes per ``[R, V]`` element at the peak, besides the model-dtype
logits: V0 sort path ≈ 30 (0.6.4 ``_apply_top_k_top_p``: fp32 logits, sorted values, int64
indices, masks, softmax, cumsum, scattered copy); V1 sort path 36 at ≥ 128 rows (0.8–0.16 without
FlashInfer: the fp32 copy, the sort's outputs and its workspace, :func:`sort_workspace`); V1 Triton path 12
plus a per-SM ``[min(SMs, R), V]`` fp32 scratch buffer (0.17+); FlashInfer (0.8–0.16, where
:func:`tuner.memory.eras.sampler_path` picks it) two fp32 buffers (see ``FLASHINFER_WORKSPACE_FP32_BUFFERS``); Model
Runner V2 (0.22+) samples the model-dtype logits only, 0.33 adds an fp32 pass of 12 B.
"""

from __future__ import annotations

import torch

from tuner.memory.eras import (
    SAMPLER_V0_SORT,
    SAMPLER_V1_ALL_LOGITS,
    SAMPLER_V1_FLASHINFER,
    SAMPLER_V1_LOGITS_ONLY,
    SAMPLER_V1_SORT,
    SAMPLER_V1_TRITON,
    SAMPLER_V2_FP32_PASS,
    SAMPLER_V2_LOGITS,
)

#: FlashInfer sampler scratch, in fp32 ``[R, V]`` buffers beside the fp32 logits.
#: 0.8.x (vllm/v1/sample/ops/topk_topp_sampler.py ``forward_cuda``): ``probs = logits.softmax()``
#: then ``top_k_top_p_sampling_from_probs`` (FlashInfer < 0.2.3; 0.8.x falls back to the sort path
#: with ≥ 0.2.3) → 1. 0.9.0–0.16: ``top_k_top_p_sampling_from_logits`` = FlashInfer
#: ``top_k_mask_logits`` (``empty_like(logits)``) + ``torch.softmax`` of it, both alive → 2
#: (read in 0.9.0, 0.9.2, 0.10.1.1, 0.11.0 and flashinfer/sampling.py; the same ``flashinfer_sample``
#: in 0.11.1 and 0.16.0, where it runs only with ``VLLM_USE_FLASHINFER_SAMPLER=1``).
#: The 0.11.0 logs that once calibrated 8 here (activation ≈ 38 B per sampled logit) ran the
#: PyTorch sort path (:func:`tuner.memory.eras.sampler_path`: FlashInfer not installed), whose
#: workspace :func:`sort_workspace` gives exactly those 38 B.
FLASHINFER_WORKSPACE_FP32_BUFFERS = {(0, 8): 1}
FLASHINFER_DEFAULT_BUFFERS = 2

#: PyTorch's CUDA ``sort`` of ``[R, V]`` along the last dimension (aten/src/ATen/native/cuda/
#: SortStable.cu ``launch_stable_sort_kernel``, unchanged from torch 2.1 to the 2.9/2.10 of vLLM
#: 0.11–0.16): besides its outputs (values, int64 indices) it allocates, while the kernel runs,
#: * one segment (R = 1) or segments of ≥ 1e6: ``segmented_sort_large_segments`` — an int64 iota
#:   of V and cub ``DeviceRadixSort::SortPairs``' alternate key and value buffers (V each);
#: * fewer than 128 segments: ``segmented_sort_pairs_by_full_sort`` — two ``int2`` (8-byte)
#:   index-and-segment arrays, an owned keys output and cub's alternate key and ``int2`` buffers
#:   (R·V each);
#: * else: ``segmented_sort_pairs`` — int64 reverse indices and cub
#:   ``DeviceSegmentedRadixSort::SortPairs``' alternate key and int64 value buffers (R·V each).
#: With bf16 logits (2 B) and their fp32 copy (4 B) alive, the third case peaks at
#: 2 + 4 + 12 (outputs) + 8 + 4 + 8 = 38 B per sampled logit: the vLLM 0.11.0 H100 logs'
#: activation peaks (Llama-3.1-8B 4.76 GiB, Qwen3-0.6B 5.56, gpt-oss-20b 7.38 at R = 1024).
SORT_FULL_SORT_BELOW_SEGMENTS = 128


def sort_workspace(values: torch.Tensor) -> list:
    """Allocate (and return, for the caller to free) the transient buffers of PyTorch's CUDA
    sort of ``values`` (``[R, V]``) along the last dimension, after its outputs (see
    :data:`SORT_FULL_SORT_BELOW_SEGMENTS`)."""
    rows, cols = int(values.shape[0]), int(values.shape[-1])
    i64 = torch.int64
    if rows <= 1 or cols >= 1_000_000:
        return [values.new_empty(cols, dtype=i64), values.new_empty(cols), values.new_empty(cols, dtype=i64)]
    if rows < SORT_FULL_SORT_BELOW_SEGMENTS:
        return [values.new_empty(rows, cols, dtype=i64), values.new_empty(rows, cols, dtype=i64),
                values.new_empty(rows, cols), values.new_empty(rows, cols), values.new_empty(rows, cols, dtype=i64)]
    return [values.new_empty(rows, cols, dtype=i64), values.new_empty(rows, cols),
            values.new_empty(rows, cols, dtype=i64)]


def _sort_top_k_top_p(logits: torch.Tensor, v0: bool) -> torch.Tensor:
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if not v0:  # the sort's own transients (V0's figures stay as calibrated on its logs)
        work = sort_workspace(logits_sort)
        del work
    top_k_mask = torch.empty_like(logits_sort, dtype=torch.bool)
    probs_sort = torch.empty_like(logits_sort)  # softmax
    if v0:
        probs_sum = torch.empty_like(probs_sort)  # cumsum (new tensor in V0)
    else:
        probs_sum = probs_sort  # cumsum(out=probs_sort)
    top_p_mask = torch.empty_like(probs_sum, dtype=torch.bool)
    # V0: empty_like(...).scatter_; V1 ``logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)``
    # (0.10.1.1–0.16): a new tensor, not in place
    out = torch.empty_like(logits_sort)
    del logits_sort, logits_idx, top_k_mask, probs_sort, probs_sum, top_p_mask
    return out


def run_dummy_sampler(
    family: str,
    model: torch.nn.Module,
    hidden_states: torch.Tensor,
    *,
    num_reqs: int,
    num_sms: int = 132,
    version: tuple[int, int, int] = (0, 19, 0),
) -> None:
    """Run the era's dummy sampler over the last-token rows of ``hidden_states``.

    Args:
        family: one of the ``SAMPLER_*`` constants of :mod:`tuner.memory.eras`.
        model: a :class:`tuner.model.simulate.layers.CausalLM`-like module with ``compute_logits``.
        hidden_states: ``[N, H]`` output of the forward (kept alive by the caller, as in vLLM).
        num_reqs: R, rows to sample.
        num_sms: streaming multiprocessors of the GPU (Triton scratch buffer rows).
        version: the vLLM release (selects calibrated constants).
    """
    n = hidden_states.shape[0]
    if family == SAMPLER_V1_ALL_LOGITS:
        logits = model.compute_logits(hidden_states)
        del logits
        return
    idx = torch.arange(n - num_reqs, n, device=hidden_states.device)
    last = hidden_states[idx]  # [R, H]
    del idx
    if family in (SAMPLER_V1_FLASHINFER, SAMPLER_V1_SORT, SAMPLER_V1_TRITON):
        last = torch.empty_like(last)  # torch.rand_like(hidden_states)
    logits = model.compute_logits(last)  # [R, V] model dtype (a view of the padded logits)
    if family in (SAMPLER_V1_LOGITS_ONLY, SAMPLER_V2_LOGITS):
        # V2 default pass (vllm/v1/worker/gpu/sample/sampler.py, 0.22–0.33): no request needs
        # processing, top-k/top-p unset → gumbel_sample on the model-dtype logits ([R] outputs).
        del logits, last
        return
    if family == SAMPLER_V2_FP32_PASS:
        # 0.33 second pass, SamplingParams.for_sampler_warmup(): apply_sampling_params copies
        # the logits to fp32 (penalties, bias, temperature, min-p in place), then
        # flashinfer_sample → top_k_mask_logits (empty_like) + softmax probs; the fp32 copy
        # stays alive for compute_topk_scores (gather-based, no [R, V] output).
        processed = torch.empty_like(logits, dtype=torch.float32)
        masked = torch.empty_like(processed)
        probs = torch.empty_like(masked)
        del masked, probs, processed, logits, last
        return
    logits32 = logits.to(torch.float32)  # no-op for fp32 models
    if family == SAMPLER_V0_SORT:
        logits32 = _sort_top_k_top_p(logits32, v0=True)
        probs = torch.empty_like(logits32)  # softmax
        logprobs = torch.empty_like(logits32)  # log_softmax
        q = torch.empty_like(probs)  # exponential for multinomial
        del probs, logprobs, q
    elif family == SAMPLER_V1_SORT:
        greedy = logits32.argmax(dim=-1)
        logits32 = _sort_top_k_top_p(logits32, v0=False)
        probs = torch.empty_like(logits32)
        q = torch.empty_like(probs)
        del probs, q, greedy
    elif family == SAMPLER_V1_TRITON:
        greedy = logits32.argmax(dim=-1)
        rows = min(num_sms, num_reqs)
        rows = min(1 << (rows - 1).bit_length(), num_sms) if num_reqs >= 8 else 0
        scratch = logits32.new_empty(rows, logits32.shape[1]) if rows else None
        probs = torch.empty_like(logits32)
        q = torch.empty_like(probs)
        del probs, q, greedy, scratch
    elif family == SAMPLER_V1_FLASHINFER:
        greedy = logits32.argmax(dim=-1)
        k = FLASHINFER_WORKSPACE_FP32_BUFFERS.get(tuple(version[:2]), FLASHINFER_DEFAULT_BUFFERS)
        work = [torch.empty_like(logits32) for _ in range(k)]
        del work, greedy
    else:  # pragma: no cover - guarded by eras.sampler_family
        raise ValueError(f"unknown sampler family {family!r}")
    del logits32, logits, last

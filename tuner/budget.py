"""The engine's KV-cache budget: requested memory minus what the profile run found in use.

Pure functions (no torch, no I/O). The formula families follow vLLM's worker code by era
(reference §3.2 for V0 ``vllm/worker/worker.py``, §4.3 for V1 ``vllm/v1/worker/gpu_worker.py``
and ``vllm/utils/mem_utils.py``). Terms no formula gives exactly — non-torch memory and the
CUDA-graph estimate — are empirical models over the era and the parallel layout, calibrated on
the public start-up logs in ``shared/cases/vllm-observed.jsonl`` (documented per constant).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from tuner.eras import GiB, MiB, V0_FREE_DELTA, V0_PROFILING, V0_WHOLE_GPU, V1_CONSUMED, V1_WHOLE_GPU, Era


def requested_memory_bytes(era: Era, total_memory_bytes: int, gpu_memory_utilization: float) -> int:
    """``T·u`` in bytes: ``math.ceil`` from V1 0.14 (vllm/v1/worker/utils.py ``request_memory``),
    truncated to int before (the budget is later cast with ``int()``)."""
    raw = total_memory_bytes * gpu_memory_utilization
    return math.ceil(raw) if era.requested_rounds_up else int(raw)


#: Non-torch increase of a V1 0.9.1–0.10.x engine at TP1/PP1 (GiB). These releases snapshot
#: before ``init_worker_distributed_environment`` (vllm/v1/worker/gpu_worker.py), but a world of one
#: creates no NCCL communicator or custom all-reduce, so only module loads (cuBLAS/cuBLASLt,
#: Triton, FlashInfer kernels) remain. Calibrated, not derived: the two vLLM 0.10.1.1 A100-80GB
#: logs (Qwen2-7B, u = 0.25 and 0.5) both leave 0.546 GiB beyond the logged weights, of which the
#: simulated FlashInfer sampler peak (two fp32 [R, V] buffers, 0.9+) is 0.53 GiB: ≈0.02 GiB
#: non-torch (the V1 reserve of :func:`unexplained_bytes` still applies on top).
V1_0910_TP1_NON_TORCH_GIB = 0.02


def non_torch_bytes(era: Era, *, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> int:
    """Non-torch memory the era charges to the instance (bytes, per rank).

    What it contains depends on the era (reference §8):
    - V0 0.6.4 and V1 0.7–0.9.0 count everything used on the GPU outside torch's allocations,
      the CUDA context included: 0.35 GiB on one RTX 3090 (case vllm-10517, 0.6.4).
    - V0 0.6.5–0.6.6 charge NCCL and workspaces since init: 1.79 GiB TP1, 3.58 GiB TP2
      (PR #10511 sanity log, reference §7A).
    - V1 0.9.1–0.10.x at TP1: :data:`V1_0910_TP1_NON_TORCH_GIB` (module loads only).
    - V0 ≤0.6.3 charges the free-memory drop since init: not the CUDA context (created before the
      baseline) but the torch cache the profile leaves (no ``empty_cache``), cuBLAS and NCCL;
      the 0.6.4 constant is kept as its estimate (no public ≤0.6.3 breakdown).
    - V1 0.9.1+ charge the non-torch increase during the profile: 0.25 GiB at TP1 on H100 with
      0.19 (0.24–0.26 over 14 cases; 0.13 with 0.11.0); 2.07 GiB at TP2, 2.13 at TP4 (custom
      all-reduce and NCCL buffers); 0.07 GiB on pipeline stages without TP.
    Calibrated constants, not a per-model lookup.
    """
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    v = era.version
    f = era.budget_formula
    if f in (V0_WHOLE_GPU, V1_WHOLE_GPU, V0_FREE_DELTA):
        base = 0.35 * GiB
        return int(base + (1.8 * GiB if tp > 1 else 0))
    if f == V0_PROFILING:
        if v < (0, 7, 0):
            return int(1.79 * GiB * (2 if tp > 1 else 1))
        return int(0.25 * GiB + (1.8 * GiB if tp > 1 else 0))
    # V1 0.9.1+
    if tp > 1:
        # 2.07 GiB at TP2 (2.06–2.09 over 5 models), 2.13 at TP4 (2 models): +0.06 GiB per doubling.
        return int((2.07 + 0.06 * math.log2(tp / 2)) * GiB)
    if pp > 1:
        return int(0.07 * GiB)
    if v < (0, 11, 0):
        return int(V1_0910_TP1_NON_TORCH_GIB * GiB)
    if v < (0, 12, 0):
        # 0.13 GiB measured on 0.11.0 (4 H100 cases); applied to 0.9.1–0.10 too (the 0.10.1.1 A100
        # logs print no breakdown; with it their KV is predicted −0.8 % / −3.4 %, without −1.3 / −5.8).
        return int(0.13 * GiB)
    return int(0.25 * GiB)


MiB = 1 << 20

#: Unexplained start-up memory of a V1 engine, charged with the profile pass (bytes):
#: :data:`UNEXPLAINED_FLOOR_BYTES` plus :data:`UNEXPLAINED_WEIGHTS_FRACTION` of the rank's weights,
#: at most :data:`UNEXPLAINED_CAP_BYTES` — a safety reserve, reported apart from the activation.
#: Calibrated, not derived, on the 41 visible start-ups plus 6 checks built from the logs cited in
#: shared/models source files (vLLM 0.10–0.19, H100/A100, TP 1–4, PP 1–4, dense, quantized, MoE,
#: MLA, multimodal): after the cuBLAS workspace, engines kept 0–90 MiB more torch peak than
#: simulated (Granite's unfused residual path is the largest), and several checkpoints load more
#: than their parameters and rotary caches (Qwen2 family +0.39 %, DeepSeek-V2-Lite +0.53 %, gpt-oss
#: +0.37 %; Llama / Qwen3 / Mistral +0.00 %). These are the smallest round values that keep every
#: prediction but one (fp32 Llama, whose fp32 activations are under-modelled by 0.3 GiB) at or
#: below the engine's KV cache; median |error| 0.3 %. A start must not fail because the prediction
#: was optimistic. V0 accounting (whole-GPU peak) shows no residual on its one visible case.
UNEXPLAINED_FLOOR_BYTES = 192 * MiB
UNEXPLAINED_WEIGHTS_FRACTION = 0.0035
UNEXPLAINED_CAP_BYTES = 256 * MiB


def unexplained_bytes(era: Era, weights_bytes: int) -> int:
    """Start-up memory no modelled term explains, for one rank (bytes); 0 on V0 engines."""
    if era.engine != "V1":
        return 0
    return int(min(UNEXPLAINED_FLOOR_BYTES + UNEXPLAINED_WEIGHTS_FRACTION * max(0, weights_bytes),
                   UNEXPLAINED_CAP_BYTES))


def cublas_workspace_bytes(compute_capability: str | None) -> int:
    """cuBLAS workspace torch allocates through its caching allocator on the first GEMM of the
    profile run (bytes): ``4096 KiB × 8`` on compute capability ≥ 9.0 (Hopper, Blackwell), else
    ``4096 KiB × 2 + 16 KiB × 8`` (torch ``CublasHandlePool.cpp`` default
    ``CUBLAS_WORKSPACE_CONFIG``). Unknown capability → the larger (safe) value."""
    try:
        major = int(str(compute_capability).split(".")[0])
    except (TypeError, ValueError):
        major = 9
    return 4096 * 8 * 1024 if major >= 9 else 4096 * 2 * 1024 + 16 * 8 * 1024


def profile_overhead_bytes(compute_capability: str | None, era: Era | None = None) -> int:
    """Torch peak of a real profile run beyond the simulated model and sampler (bytes): the cuBLAS
    workspace (see also :func:`unexplained_bytes`, charged per rank with it).

    vLLM 0.33 (vllm/v1/worker/gpu_worker.py ``init_device``) runs ``torch.mm`` and a biased
    ``linear`` before the start-up snapshot, so the cuBLAS(Lt) handles and workspace are baseline
    and the profile charges none (0.30 still creates them on the profile's first GEMM)."""
    if era is not None and era.engine == "V1" and era.version >= (0, 33, 0):
        return 0
    return cublas_workspace_bytes(compute_capability)


def _alloc(nbytes: int) -> int:
    """One allocation as the caching allocator counts it (512-byte granules)."""
    return -(-max(0, int(nbytes)) // 512) * 512


def runner_persistent_bytes(
    era: Era, *, model_runner_v2: bool, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
    hidden_size: int, vocab_size: int, dtype_bytes: int = 2, block_size: int = 16,
) -> int:
    """Persistent GPU buffers the model runner allocates between the start-up snapshot and the
    profile run, charged only where the budget is ``total_consumed``-based (V1 0.27+,
    vllm/utils/mem_utils.py ``memory_profiling``: ``init_free − free_after_profile``); earlier
    formulas take the torch peak increase from the profile's start and never see them (bytes).

    V1 runner (vllm/v1/worker/gpu_model_runner.py ``__init__``, 0.33): ``input_ids`` int32,
    ``positions``/``req_indices``/``query_pos`` int64, ``is_padding``/``is_token_ids`` bool, all
    ``[N]``; ``inputs_embeds [N, H]`` in the model dtype; the placeholder ``InputBatch`` block
    table ``[S, cdiv(M, bs)]`` int32 and slot mapping ``[N]`` int64 (vllm/v1/worker/block_table.py).
    Model Runner V2 (vllm/v1/worker/gpu/*.py, 0.27–0.33): ``InputBuffers`` ``[N]`` ids/positions/
    padding, and the sampler's ``PenaltiesState`` — ``output_bin_counts [S, V]`` int32 and
    ``prompt_bin_mask [S, cdiv(V, 32)]`` int32 (block tables come after the profile, the token
    history lives in host memory). Buffers of ``[S]`` elements are left out (a few KiB).
    """
    if era.engine != "V1" or era.budget_formula != V1_CONSUMED:
        return 0
    n, s = int(max_num_batched_tokens), int(max_num_seqs)
    if model_runner_v2:
        return (_alloc(4 * n) + _alloc(8 * n) + _alloc(n)
                + _alloc(4 * s * vocab_size) + _alloc(4 * s * (-(-vocab_size // 32))))
    blocks = -(-int(max_model_len) // max(1, block_size))
    return (_alloc(4 * n) + _alloc(8 * n) + _alloc(n) + _alloc(8 * n) + _alloc(n)
            + _alloc(8 * max(s + 1, n)) + _alloc(n * hidden_size * dtype_bytes)
            + _alloc(4 * s * blocks) + _alloc(8 * n))


def cudagraph_capture_sizes(era: Era, max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """CUDA-graph capture sizes (tokens) by era (vllm/config/compilation.py).

    ≤0.11: ``[1, 2, 4] + range(8, max_graph + 1, 8)``, ``max_graph = min(2·max_num_seqs, 512)``;
    later: ``[1, 2, 4] + range(8, 256, 8) + range(256, max_graph + 1, 16)``; both capped at N.
    """
    max_graph = min(2 * max_num_seqs, 512)
    if era.version < (0, 12, 0):
        sizes = [1, 2, 4] + list(range(8, max_graph + 1, 8))
    else:
        sizes = [1, 2, 4] + list(range(8, min(256, max_graph + 1), 8)) + list(range(256, max_graph + 1, 16))
    return [s for s in sizes if s <= max_num_batched_tokens]


def cudagraph_estimate_bytes(
    era: Era, *, num_layers: int, max_num_seqs: int, max_num_batched_tokens: int, hidden_size: int = 4096,
    always: bool = False,
) -> int:
    """The CUDA-graph memory estimate the era subtracts (bytes; 0 where it subtracts none).

    vLLM 0.19+ (vllm/v1/worker/gpu_model_runner.py ``profile_cudagraph_memory``) captures the two
    largest sizes per mode, measures free memory around each, and extrapolates
    ``first + per_graph·(n − 1)``; 0.20+ subtracts it from the KV budget
    (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``). The measured value is a function of the
    stage's residual stream (layers × hidden), calibrated, not derived, on the 34 vLLM 0.19.0 H100
    logs that print "CUDA graph pool memory: … (estimated)" (default 1024 seqs / 8192 tokens):
    0.84 GiB at 131072 layer·hidden (Llama-3.1-8B, CodeLlama-7B, Qwen3-8B, Gemma-2-9B and
    Mistral-Small-24B all print 0.84), proportional below with a 0.5 GiB floor (Gemma-2-2B 0.52,
    8-16-layer pipeline stages 0.49-0.54), +1.5 GiB per 10⁶ above (Qwen2.5-72B: 1.63). Fit: median
    |error| 0.03 GiB on dense models; MoE/MLA models print 0.3-0.9 GiB more (not modelled).
    ``always`` returns the estimate even where the era does not subtract it (for reports).
    """
    if not (era.subtracts_cudagraph_estimate or always) or era.engine != "V1":
        return 0
    x = num_layers * hidden_size
    anchor, at_anchor = 131072, 0.84 * GiB
    if x <= anchor:
        est = max(0.5 * GiB, at_anchor * x / anchor)
    else:
        est = at_anchor + 1.507e-6 * GiB * (x - anchor)
    return int(est)


@dataclass(frozen=True)
class Budget:
    """One KV budget, all in bytes (per rank).

    ``available_kv_cache_bytes`` may be negative: the engine would refuse to start with
    "No available memory for the cache blocks".
    """

    requested_memory_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int
    available_kv_cache_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def kv_budget(
    era: Era,
    *,
    total_memory_bytes: int,
    gpu_memory_utilization: float,
    weights_bytes: int,
    activation_peak_bytes: int,
    non_torch_bytes: int,
    cuda_graph_bytes: int = 0,
) -> Budget:
    """Available KV-cache bytes for one rank.

    All families reduce to ``requested − (W + activation peak + non-torch) [− graphs]``
    once each term carries the era's meaning (see :func:`non_torch_bytes`):
    V0 ≤0.6.3 ``T·u − (init_free − free_after)``; V0 0.6.4 / V1 0.7–0.9.0
    ``T·u − (torch_alloc_peak + non_torch_whole_gpu)`` where the torch peak includes W;
    V0 0.6.5–0.10.2 and V1 0.9.1–0.26 ``requested − (W + peak_increase + non_torch_increase)``
    (V1 0.20+ minus the CUDA-graph estimate); V1 0.27+ ``requested − (total_consumed +
    transient_headroom) − graphs`` with ``total_consumed`` = W + non-torch since the snapshot.
    """
    requested = requested_memory_bytes(era, total_memory_bytes, gpu_memory_utilization)
    graphs = cuda_graph_bytes if era.subtracts_cudagraph_estimate else 0
    avail = requested - weights_bytes - activation_peak_bytes - non_torch_bytes - graphs
    return Budget(requested, weights_bytes, activation_peak_bytes, non_torch_bytes, graphs, int(avail))

"""Memory-equivalent mixture-of-experts layers (torch): vLLM's ``FusedMoE`` and the sparse MoE block.

What one rank holds (vllm/model_executor/layers/fused_moe/layer.py, 0.6–0.19):
- stacked expert weights ``w13_weight [E_rank, 2·I_rank, H]`` (gate and up fused) and
  ``w2_weight [E_rank, H, I_rank]`` in the model dtype, or whatever the checkpoint's quantization
  scheme registers for the whole bank through ``make_expert_weights(quant, module, E_rank, H,
  I_rank, dtype, prefix, has_bias=...)`` (:mod:`tuner.memory.quant`; it then registers the
  biases too, and ``quant.expert_sizes(H, I_rank, prefix)`` gives the padded sizes its kernels run
  with, e.g. MXFP4 pads I to 64 on Hopper); otherwise optional biases ``w13_bias [E_rank, 2·I_rank]``,
  ``w2_bias [E_rank, H]`` in ``bias_dtype``. Tensor parallelism shards the
  intermediate size of every expert (``I_rank = I / tp``); expert parallelism is off by default
  (``E_rank = E``).
- the router (gate) is a replicated 16-bit ``Linear [E, H]`` built by the plugin (:class:`SparseMoeBlock`).

What the profile run allocates in the MoE layer, per era (``M`` tokens, top-k ``k``, ``N = 2·I_rank``,
``K = H``, model dtype ``dt`` bytes):
- routing (``fused_topk``): ``topk_weights`` fp32 ``[M, k]``, ``topk_ids`` and
  ``token_expert_indices`` int32 ``[M, k]``; ``moe_align_block_size``: ``sorted_token_ids`` int32
  ``[M·k + E·(BLOCK_M − 1)]``, ``expert_ids`` int32 ``[cdiv(·, BLOCK_M)]`` (``BLOCK_M`` = 64 for
  prefill-sized M, vllm/model_executor/layers/fused_moe/fused_moe.py ``get_default_config``).
- Triton path up to 0.14 (``fused_experts_impl``, fused_moe.py): per call and per chunk of
  ``VLLM_FUSED_MOE_CHUNK_SIZE`` tokens (32768 in 0.6 – 0.11, 16384 from 0.12) a
  ``cache13 [Mc·k·max(N, K)]`` (intermediate_cache1 ``[Mc, k, N]`` and intermediate_cache3
  ``[Mc, k, K]`` share it) and ``intermediate_cache2 [Mc·k, N/2]``; all freed when the op returns.
- Triton path from 0.15 (modular kernel, modular_kernel.py ``_allocate_buffers`` +
  vllm/v1/worker/workspace.py): ``workspace13 = [Mc, k, max(N/2, K)]`` (also holding the fused
  output ``[M, K]`` when there is one chunk) and ``workspace2 = [Mc, k, max(N, K)]`` (plus the fused
  output ``[M, K]`` as a third part when chunked) come from the process-wide ``WorkspaceManager``:
  one uint8 buffer, each part rounded up to 256 bytes, grown to the largest request and **kept**
  across layers and after the forward (so it is still alive while the dummy sampler runs).
  Chunks of 16384 tokens in 0.15–0.17, none from 0.18. The layer output ``[M, H]`` is a new tensor
  (``disable_inplace()`` is true with torch ≥ 2.9) and the fused output is copied into it.
- MXFP4 experts on Hopper (``kernel="oai_triton"``, vllm/model_executor/layers/fused_moe/
  gpt_oss_triton_kernels_moe.py ``triton_kernel_moe_forward`` + triton_kernels ``matmul_ogs``):
  output ``[M, H]``, ``intermediate_cache [M·k, I_rank]`` for the first (gather + SwiGLU) matmul,
  and for the second (scatter) matmul with ``k > 1`` a scratch ``[M·k, H]`` in the model dtype
  that is reduced over the k experts into the output; all transient.
- TP > 1: the layer's output is all-reduced out of place (custom all-reduce: a new ``[M, H]``).

The persistent workspace is shared by every MoE layer of one profile pass: it lives in a
:class:`MoEWorkspace` kept per active :class:`~tuner.model.simulate.tracker.MemoryTracker` (the process-
wide manager lives as long as the engine; a simulated pass lives as long as its tracker), so a
fresh pass allocates (and counts) it again.
"""

from __future__ import annotations

import contextlib
import contextvars

import math
import weakref

import torch
from torch import nn

# The decoder builder lives in tuner.model.simulate.decoder; these names stay importable from here.
from tuner.model.simulate.decoder import build_decoder, torch_dtype  # noqa: F401
from tuner.model.simulate.quant_weights import make_expert_weights

#: ``BLOCK_SIZE_M`` of the default Triton MoE config for prefill-sized batches (fused_moe.py
#: ``get_default_config``: 64 when M > E; only sizes the small ``moe_align_block_size`` buffers).
DEFAULT_BLOCK_M = 64
#: Alignment of each view carved out of the workspace buffer (vllm/v1/worker/workspace.py).
WORKSPACE_ALIGN_BYTES = 256


def _vkey(engine_version) -> tuple[int, int, int]:
    if engine_version is None:
        return (0, 19, 0)
    if isinstance(engine_version, tuple):
        return tuple(engine_version[:3]) + (0,) * (3 - len(engine_version[:3]))  # type: ignore[return-value]
    if hasattr(engine_version, "key"):
        return engine_version.key
    parts = [int(p) for p in str(engine_version).split(".")[:3] if p.isdigit()]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def fused_moe_chunk_size(engine_version) -> int | None:
    """Tokens per chunk of the Triton MoE path (``VLLM_FUSED_MOE_CHUNK_SIZE`` default), or None
    when the release does not chunk.

    vllm/envs.py (every wheel read): none before 0.5.1 (0.4.0 – 0.5.0 ``fused_experts`` sizes its
    caches on all M tokens), 65536 (0.5.1 – 0.5.5), 32768 (0.6.0 – 0.11.2), 16384
    (``16 * 1024``, 0.12.0 – 0.17.1), removed in 0.18.0 (the modular kernel runs all M tokens at
    once). Only M above the chunk is affected: data-parallel MoE layers that see ``dp × N`` tokens
    (vllm-recipes PR 12, DP8, 65536 tokens: two chunks of 32768 in 0.10.1, not one of 65536).
    """
    v = _vkey(engine_version)
    if v >= (0, 18, 0) or v < (0, 5, 1):
        return None
    if v < (0, 6, 0):
        return 65536
    return 32768 if v < (0, 12, 0) else 16384


def uses_persistent_workspace(engine_version) -> bool:
    """True from the release whose unquantized Triton MoE runs through the modular kernel with
    buffers from the persistent ``WorkspaceManager`` (read: 0.15.0, 0.17.0, 0.18.0, 0.19.0; 0.13.0
    still calls the functional ``fused_experts`` with per-call caches; 0.14 not read, assumed
    like 0.13)."""
    return _vkey(engine_version) >= PERSISTENT_WORKSPACE_FROM


#: First release modelled with the persistent MoE workspace (see :func:`uses_persistent_workspace`).
PERSISTENT_WORKSPACE_FROM = (0, 15, 0)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def workspace_bytes(m: int, top_k: int, intermediate_per_rank: int, hidden: int, dtype_bytes: int,
                    chunk: int | None = None) -> int:
    """Bytes ``TritonExperts`` asks of the workspace manager for ``m`` tokens (0.15+,
    modular_kernel.py ``_allocate_buffers``; fused_moe.py ``TritonExperts.workspace_shapes``).

    One chunk (``chunk`` None or ≥ m): ``r(max(m·k·max(I, H), m·H)·dt) + r(m·k·max(2I, H)·dt)``;
    chunked (``mc = chunk``): ``r(mc·k·max(I, H)·dt) + r(mc·k·max(2I, H)·dt) + r(m·H·dt)``,
    with ``r`` rounding up to 256 bytes.
    """
    n, k = 2 * intermediate_per_rank, hidden
    r = lambda b: _round_up(b, WORKSPACE_ALIGN_BYTES)  # noqa: E731
    if chunk is None or m <= chunk:
        ws13 = max(m * top_k * max(intermediate_per_rank, k), m * k) * dtype_bytes
        return r(ws13) + r(m * top_k * max(n, k) * dtype_bytes)
    mc = chunk
    return (r(mc * top_k * max(intermediate_per_rank, k) * dtype_bytes) + r(mc * top_k * max(n, k) * dtype_bytes)
            + r(m * k * dtype_bytes))


def fused_experts_inplace(engine_version) -> bool:
    """The unquantized and FP8 MoE methods call ``fused_experts(..., inplace=True)``: the fused
    output overwrites the layer's input (``out_hidden_states = hidden_states``) instead of a new
    ``[M, H]`` (vllm/model_executor/layers/quantization/fp8.py ``Fp8MoEMethod.apply`` and
    fused_moe/layer.py / unquantized_fused_moe_method.py ``forward_cuda``: read in 0.6.4, 0.7.3,
    0.8.5, 0.9.2, 0.10.1, 0.11.0, 0.12.0, 0.13.0; 0.14.0 passes no ``inplace=True``)."""
    v = _vkey(engine_version)
    return (0, 6, 0) <= v < (0, 14, 0)


def fp8_input_quant_bytes(rows: int, cols: int, block_k: int | None) -> int:
    """Bytes of one ``moe_kernel_quantize_input`` of ``[rows, cols]`` to FP8 (fused_moe/utils.py
    0.10.1): the fp8 copy (1 B per element) and its fp32 scales — ``[rows, ceil(cols / block_k)]``
    per token group (``per_token_group_quant_fp8``, block-quantized checkpoints), else one per
    token (dynamic per-token) — each rounded to 512 B as the allocator counts them."""
    groups = -(-cols // block_k) if block_k else 1
    r = lambda b: _round_up(b, 512)  # noqa: E731
    return r(rows * cols) + r(rows * groups * 4)


def fp8_input_quant(x: torch.Tensor, rows: int, cols: int, block_k: int | None) -> tuple:
    """Allocate what :func:`fp8_input_quant_bytes` counts: fp8 ``[rows, cols]`` and fp32 scales."""
    groups = -(-cols // block_k) if block_k else 1
    return x.new_empty(rows, cols, dtype=torch.float8_e4m3fn), x.new_empty(rows, groups, dtype=torch.float32)


class MoEWorkspace:
    """The process-wide MoE workspace of one pass: a uint8 buffer grown to the largest request
    (freed-then-reallocated on growth, like ``WorkspaceManager._ensure_workspace_size``)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def ensure(self, nbytes: int, device) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None  # delete before allocating (avoids the resize_ spike, as vLLM does)
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.buffer


_WORKSPACES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_NO_TRACKER = MoEWorkspace()


def current_workspace() -> MoEWorkspace:
    """The workspace of the innermost active :class:`~tuner.model.simulate.tracker.MemoryTracker`
    (one per profile pass), or a process-wide one when no tracker is active."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from tuner.model.simulate.tracker import MemoryTracker

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, MemoryTracker):
            ws = _WORKSPACES.get(mode)
            if ws is None:
                ws = _WORKSPACES[mode] = MoEWorkspace()
            return ws
    return _NO_TRACKER


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _act_quant_block(quant, prefix: str):
    """The FP8 W8A8 experts' activation quantization: ``block_k`` (per token group) for
    block-quantized banks, 0 for per-token, None when the experts do not quantize activations
    (16-bit, weight-only Marlin, other formats)."""
    from tuner.memory.quant import Fp8Format

    fmt = quant._format_for(prefix, "experts") if hasattr(quant, "_format_for") else None
    if not isinstance(fmt, Fp8Format) or fmt.marlin or not fmt.quantize_activations:
        return None
    return int(fmt.block[1]) if fmt.strategy == "block" else 0


#: The rank's expert layout for data/expert parallelism (``(tp, dp, enable_ep)``), set by the
#: profile pass around ``build_model`` (:func:`expert_layout`); None = TP only, as plugins build.
_EXPERT_LAYOUT: "contextvars.ContextVar[tuple[int, int, bool] | None]" = contextvars.ContextVar("expert_layout",
                                                                                               default=None)


@contextlib.contextmanager
def expert_layout(tensor_parallel_size: int, data_parallel_size: int, enable_expert_parallel: bool):
    """Build FusedMoE layers for ``data_parallel_size`` × ``tensor_parallel_size`` ranks with or
    without expert parallelism (:func:`tuner.memory.budget.moe_rank_shape`); plugins keep passing
    ``I / tp`` and E."""
    token = _EXPERT_LAYOUT.set((int(tensor_parallel_size), int(data_parallel_size), bool(enable_expert_parallel)))
    try:
        yield
    finally:
        _EXPERT_LAYOUT.reset(token)


class FusedMoE(nn.Module):
    """vLLM ``FusedMoE`` on one rank: expert weights plus the profile-run allocations of the
    fused-experts kernel (see the module docstring for shapes and eras).

    Args:
        hidden: H.
        intermediate_per_rank: I / tp before any padding of the quantization method.
        num_experts_per_rank: experts held by this rank (E without expert parallelism).
        top_k: experts per token.
        dtype: model dtype (activations, 16-bit weights).
        quant: the checkpoint's quantization scheme or None (16-bit experts).
        prefix: vLLM module name (``model.layers.3.mlp.experts``) handed to the scheme.
        compiled: V1 torch.compile lifetimes (the op's own buffers die inside the op either way).
        has_bias: expert biases ``w13_bias``/``w2_bias``.
        engine_version: vLLM release (selects the chunked per-call caches or the persistent
            workspace); None = 0.19 behaviour.
        tensor_parallel_size: > 1 adds the out-of-place all-reduce of the output.
        reduce_results: the layer all-reduces its own output (False when the block does it).
        kernel: ``"triton"`` (fused_moe Triton path, also FP8/INT8 experts) or ``"oai_triton"``
            (MXFP4 experts through triton_kernels ``matmul_ogs``).
        bias_dtype: dtype of 16-bit experts' biases (default ``dtype``); a quantization scheme
            registers its own.
        global_num_experts: E (sizes the align buffers); defaults to ``num_experts_per_rank``.

    ``forward(x [N, H], router_logits [N, E]) -> [N, H]``.
    """

    def __init__(self, hidden: int, intermediate_per_rank: int, num_experts_per_rank: int, top_k: int, dtype,
                 *, quant=None, prefix: str = "", compiled: bool = True, has_bias: bool = False,
                 engine_version=None, tensor_parallel_size: int = 1, reduce_results: bool = True,
                 kernel: str = "triton", bias_dtype=None, global_num_experts: int | None = None) -> None:
        super().__init__()
        if kernel not in ("triton", "oai_triton"):
            raise ValueError(f"unknown MoE kernel {kernel!r}")
        layout = _EXPERT_LAYOUT.get()
        self.dp = int(layout[1]) if layout is not None else 1
        if layout is not None and (layout[1] > 1 or layout[2]):
            from tuner.memory.budget import moe_rank_shape

            tp_, dp_, ep_ = layout
            global_num_experts = global_num_experts or num_experts_per_rank
            num_experts_per_rank, intermediate_per_rank = moe_rank_shape(
                global_num_experts, intermediate_per_rank * tp_, tensor_parallel_size=tp_, data_parallel_size=dp_,
                enable_expert_parallel=ep_)
        self.hidden, self.top_k = hidden, top_k
        self.num_experts = num_experts_per_rank
        self.global_num_experts = global_num_experts or num_experts_per_rank
        self.dtype, self.compiled, self.kernel = dtype, compiled, kernel
        self.version = _vkey(engine_version)
        self.tp = tensor_parallel_size
        self.reduce_results = reduce_results
        self.quantized = bool(quant is not None and hasattr(quant, "expert_layout")
                              and make_expert_weights(quant, self, num_experts_per_rank, hidden, intermediate_per_rank,
                                                      dtype, prefix, has_bias=has_bias))
        if not self.quantized:
            e, i = num_experts_per_rank, intermediate_per_rank
            self.w13_weight = _param(e, 2 * i, hidden, dtype=dtype)
            self.w2_weight = _param(e, hidden, i, dtype=dtype)
            if has_bias:
                self.w13_bias = _param(e, 2 * i, dtype=bias_dtype or dtype)
                self.w2_bias = _param(e, hidden, dtype=bias_dtype or dtype)
        self.act_quant_block = _act_quant_block(quant, prefix) if self.quantized else None
        sizes = getattr(quant, "expert_sizes", None) if self.quantized else None
        # the kernels run with the method's padded sizes (MXFP4: I rounded up to 64 on Hopper)
        self.hidden_padded, self.intermediate = (sizes(hidden, intermediate_per_rank, prefix) if sizes
                                                 else (hidden, intermediate_per_rank))

    # -- pieces ------------------------------------------------------------------------------
    def _topk(self, x: torch.Tensor):
        m = x.shape[0]
        w = x.new_empty(m, self.top_k, dtype=torch.float32)
        ids = x.new_empty(m, self.top_k, dtype=torch.int32)
        idx = x.new_empty(m, self.top_k, dtype=torch.int32)
        return w, ids, idx

    def _align(self, x: torch.Tensor, m: int):
        padded = m * self.top_k + self.global_num_experts * (DEFAULT_BLOCK_M - 1)
        if m * self.top_k < self.global_num_experts:
            padded = min(m * self.top_k * DEFAULT_BLOCK_M, padded)
        sorted_ids = x.new_empty(padded, dtype=torch.int32)
        expert_ids = x.new_empty(math.ceil(padded / DEFAULT_BLOCK_M), dtype=torch.int32)
        post = x.new_empty(1, dtype=torch.int32)
        return sorted_ids, expert_ids, post

    def _triton_chunked(self, x: torch.Tensor) -> torch.Tensor:
        """Up to 0.14: ``fused_experts_impl`` with per-call caches, in chunks.

        Within each chunk (vllm/model_executor/layers/fused_moe/fused_moe.py 0.10.1
        ``fused_experts_impl``) FP8 W8A8 experts quantize the chunk's input and the activated
        intermediate (``moe_kernel_quantize_input``: fp8 ``[Mc, K]`` and ``[Mc·k, N/2]`` plus fp32
        scales, :func:`fp8_input_quant_bytes`); each stays bound to its loop variable until the
        next chunk's replaces it, so the next chunk's copy is allocated beside it. Where the method
        calls ``fused_experts(..., inplace=True)`` (:func:`fused_experts_inplace`) the output is
        the input tensor, not a new ``[M, H]``.
        """
        m = x.shape[0]
        chunk = fused_moe_chunk_size(self.version) or m
        mc = min(m, chunk)
        n, k = 2 * self.intermediate, self.hidden_padded
        cache13 = x.new_empty(mc * self.top_k * max(n, k))
        cache2 = x.new_empty(mc * self.top_k, n // 2)
        out = x if fused_experts_inplace(self.version) else torch.empty_like(x)
        q1 = q2 = None
        for start in range(0, m, chunk):
            rows = min(chunk, m - start)
            aligned = self._align(x, rows)
            if self.act_quant_block is not None:
                q1 = fp8_input_quant(x, rows, k, self.act_quant_block)  # replaces the previous chunk's
                q2 = fp8_input_quant(x, rows * self.top_k, n // 2, self.act_quant_block)
            del aligned
        del cache13, cache2, q1, q2
        return out

    def _triton_workspace(self, x: torch.Tensor) -> torch.Tensor:
        """From 0.15: modular kernel, buffers from the persistent workspace."""
        m = x.shape[0]
        nbytes = workspace_bytes(m, self.top_k, self.intermediate, self.hidden_padded, x.element_size(),
                                 fused_moe_chunk_size(self.version))
        current_workspace().ensure(nbytes, x.device)
        out = torch.empty_like(x)  # disable_inplace(): output = torch.empty_like(hidden_states)
        aligned = self._align(x, m)
        del aligned
        return out

    def _oai_triton(self, x: torch.Tensor) -> torch.Tensor:
        """MXFP4 experts through triton_kernels ``matmul_ogs`` (gather+SwiGLU, then scatter)."""
        m = x.shape[0]
        mk = m * self.top_k
        routing = [x.new_empty(mk, dtype=torch.int32) for _ in range(4)]  # gather/scatter src/dst
        out = torch.empty_like(x)
        inter = x.new_empty(mk, self.intermediate)
        scratch = x.new_empty(mk, self.hidden_padded) if self.top_k > 1 else None
        del scratch, inter, routing
        return out

    def _dispatch(self, x: torch.Tensor, router_logits: torch.Tensor):
        """Data parallelism: every DP rank's tokens reach every rank's MoE layer
        (vllm/model_executor/layers/fused_moe/layer.py ``forward_impl``: ``get_ep_group().dispatch``
        when ``dp_size > 1``; vllm/distributed/device_communicators/all2all.py: the ``naive``
        backend (``VLLM_ALL2ALL_BACKEND`` default ≤ 0.10.2) broadcasts into a new
        ``[Σ tokens, H]`` buffer and one for the router logits, ``allgather_reducescatter`` (the
        default from 0.11.0) all-gathers both). In the profile every rank runs the same N tokens,
        so the experts see ``dp × N``."""
        m = x.shape[0] * self.dp
        return x.new_empty(m, x.shape[1]), router_logits.new_empty(m, router_logits.shape[1])

    def _combine(self, out: torch.Tensor, local_tokens: int) -> torch.Tensor:
        """Back to this rank's tokens: ``naive`` all-reduces over the DP group (an out-of-place
        ``[dp × N, H]`` whose slice stays a view of it), ``allgather_reducescatter`` reduce-scatters
        into a new ``[N, H]``."""
        if self.version < (0, 11, 0):
            reduced = torch.empty_like(out)
            return reduced[:local_tokens]
        return out.new_empty(local_tokens, out.shape[1])

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        local_tokens = x.shape[0]
        gathered = None
        if self.dp > 1:
            x, router_logits = gathered = self._dispatch(x, router_logits)
        padded = None
        if self.hidden_padded != self.hidden:  # F.pad to the method's hidden size (a new [N, H_pad])
            padded = x = x.new_empty(x.shape[0], self.hidden_padded)
        topk = self._topk(x) if self.kernel == "triton" else None
        if self.kernel == "oai_triton":
            out = self._oai_triton(x)
        elif uses_persistent_workspace(self.version):
            out = self._triton_workspace(x)
        else:
            out = self._triton_chunked(x)
        del topk, padded, x
        if gathered is not None:
            del gathered, router_logits
            out = self._combine(out, local_tokens)
        if self.reduce_results and self.tp > 1:
            reduced = torch.empty_like(out)  # custom all-reduce: out of place
            del out
            out = reduced
        return out[:, : self.hidden]


class Fp32Router(nn.Module):
    """A replicated router ``Linear [E, H]`` held in fp32 that casts its input to fp32 first
    (MiniMax-M2: ``gate(hidden_states.to(torch.float32))``, params_dtype fp32): one ``[N, H]``
    fp32 temporary and fp32 logits ``[N, E]``. ``e_score_correction_bias [E]`` fp32 when
    ``correction_bias``."""

    def __init__(self, hidden: int, num_experts: int, *, correction_bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(num_experts, hidden, dtype=torch.float32)
        self.e_score_correction_bias = _param(num_experts, dtype=torch.float32) if correction_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        logits = torch.nn.functional.linear(x32, self.weight)
        del x32
        return logits


class SparseMoeBlock(nn.Module):
    """Router + experts (+ optional shared expert), vLLM's ``MixtralMoE`` / ``Qwen2MoeSparseMoeBlock``
    / ``Qwen3MoeSparseMoeBlock`` / gpt-oss ``MLPBlock`` in memory terms.

    ``gate``: replicated 16-bit ``Linear [E, H]`` producing router logits ``[N, E]``;
    ``shared_expert``: a TP-sharded gated MLP whose partial output is summed with the experts'
    before the single all-reduce (``reduce_results=False`` on both, the block reduces);
    ``shared_expert_gate``: replicated ``Linear [1, H]``, ``sigmoid(gate(x)) * shared(x)``.
    """

    def __init__(self, gate: nn.Module, experts: FusedMoE, *, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None, tensor_parallel_size: int = 1) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.tp = tensor_parallel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = None
        if self.shared_expert is not None:  # runs before the routed experts (run_shared_experts_before)
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                g = torch.empty_like(self.shared_expert_gate(x))  # sigmoid(gate(x)): [N, 1]
                shared = g * shared  # out of place: a new [N, H]
                del g
        router_logits = self.gate(x)
        out = self.experts(x, router_logits)
        del router_logits
        if shared is not None:
            summed = out.add(shared)
            del out, shared
            out = summed
        if not self.experts.reduce_results and self.tp > 1:
            reduced = torch.empty_like(out)
            del out
            out = reduced
        return out


def unique_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``module``, each storage once
    (:func:`tuner.model.plugin.module_weights_bytes`)."""
    from tuner.model.plugin import module_weights_bytes

    return module_weights_bytes(module)

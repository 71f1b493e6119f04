"""DeepSeek-V4 KV cache: compressed / sliding-window MLA specs and their "layer tuple" grouping.

Pure functions over frozen dataclasses (no torch). Written from vLLM 0.20.0 – 0.28.0:

* ``vllm/v1/kv_cache_interface.py`` (0.22.0 lines 337–560; 0.28.0 ``state_content_bytes``):
  ``MLAAttentionSpec`` / ``SlidingWindowMLASpec`` with ``compress_ratio``, ``alignment`` and
  ``model_version="deepseek_v4"``: page = ``storage_block_size · bytes per stored entry`` with
  ``storage_block_size = block_size // compress_ratio``; ``fp8_ds_mla`` stores 584 B per entry
  (448 B fp8 NoPE + 128 B bf16 RoPE + 8 B scales), else ``head_size · dtype``; the page is rounded
  up to ``alignment`` (``_apply_alignment_padding``: 576 for FlashMLA).
  Max memory: full layers ``cdiv(M, block_size) · page``; sliding layers
  ``(cdiv(min(w − 1 + X, M), block_size) + 1) · page`` (X: :class:`tuner.memory.kvcache._Ctx`
  ``in_flight``: ``max_num_batched_tokens`` before 0.26, ``max_in_flight_tokens`` from 0.26).
* ``vllm/v1/core/kv_cache_utils.py`` (0.20.0 – 0.28.0): ``group_and_unify_kv_cache_specs`` and
  ``_get_kv_cache_groups_uniform_groups`` (:func:`dsv4_kv_cache_groups`): one group of every
  compressed MLA layer (``MLAAttentionSpec``: main C4A / C128A caches and C4 indexer caches), and
  the ``SlidingWindowMLASpec`` layers bucketed by ``(block_size, sliding_window)`` (SWA caches,
  C4 compressor states, C128 compressor states), each bucket split round-robin into
  ``cdiv(n, T)`` groups where ``T = _approximate_gcd(tuples per bucket, lower bound: the full
  group's)``; 0.20 – 0.26 first pad every sliding page up to the nearest larger full-group page
  (``size_to_candidate``), 0.27+ keep them.
* The admission check ``_max_memory_usage_bytes_from_groups`` ("Special case (only DeepseekV4
  for now)", 0.20.0 – 0.28.0; :func:`dsv4_needed_bytes`): ``Σ_groups T' · pages_g · LTB`` with
  ``LTB = Σ distinct page sizes of the full group`` (one "layer tuple": C4A + C4I + C128A pages),
  ``T' = max over groups of the most common page size count`` and ``pages_g`` the group's
  ``max_memory_usage_pages``. Every sliding-window group is charged at the full layer-tuple bytes,
  not its own page: with ``max_num_batched_tokens`` 16384 the C4 compressor state group alone
  needs ``cdiv(16391, 4) + 1 = 4099`` tuple-pages for any ``M ≥ 16391``. That is the "MHA-sized"
  surprise of vLLM issue 44376 (6.66 GiB for 30000 tokens of DeepSeek-V4-Flash).
* Blocks (:func:`dsv4_bytes_per_block`): 0.20 – 0.23 ``_get_kv_cache_config_deepseek_v4``:
  ``LTB · T'``; 0.24 – 0.26 ``_get_kv_cache_config_packed`` over page-size buckets:
  ``Σ_ps ps · slots(ps)``; 0.27 – 0.28 ``_get_packed_kv_cache_layout``: the largest group's
  ``Σ pages``.

0.29 (:data:`DSV4_GROUPING_UNTIL`) replaces that grouping with ``_get_packed_kv_cache_groups``
(block-outermost layouts, vllm/v1/core/kv_cache_utils.py 0.29.0; :func:`dsv4_packed_groups`):
layers bucketed greedily by ``UniformTypeKVCacheSpecs.is_uniform_type``, a bucket "balanced" when
each of its page sizes has the same layer count, ``repeats = _approximate_gcd(max layers per page
size of the balanced buckets, lower bound: the largest balanced bucket that mixes page sizes)``,
balanced buckets split round-robin into ``cdiv(count, repeats)`` groups, the others kept whole.
Bytes per block and the admission bytes then follow the 0.29 layer plan of
:mod:`tuner.memory.kvcache` (the widest group's ``Σ pages`` × ``Σ`` group pages). The DeepSeek-V4
caches change again in 0.30 (the SWA cache's spec): 0.30+ are not modelled (the plugin refuses).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from tuner.memory.eras import VllmVersion, parse_version

#: First release after the DeepSeek-V4 "layer tuple" grouping (``group_and_unify_kv_cache_specs``
#: is gone from vllm/v1/core/kv_cache_utils.py in 0.29.0; ``_get_packed_kv_cache_groups`` instead).
DSV4_GROUPING_UNTIL = "0.29.0"
#: First release whose DeepSeek-V4 SWA cache spec differs from 0.20 – 0.29's (sparse_swa.py 0.30.0:
#: no ``state_content_bytes=584`` / ``block_size = 64``): not modelled.
DSV4_MODELLED_UNTIL = "0.30.0"
#: First release that keeps sliding pages unpadded in the DeepSeek-V4 groups (``size_to_candidate``
#: padding in ``_get_kv_cache_groups_uniform_groups`` up to 0.26.0, gone in 0.27.0).
DSV4_UNPADDED_SWA_SINCE = "0.27.0"
#: First release allocating DeepSeek-V4 blocks by page-size buckets (``_get_kv_cache_config_packed``
#: with ``_bucket_layers_by_page_size``, 0.24.0) and by the densest group (``_get_packed_kv_cache_layout``,
#: 0.27.0).
DSV4_BUCKETS_SINCE = "0.24.0"
DSV4_PACKED_SINCE = "0.27.0"

#: Bytes per stored entry of the ``fp8_ds_mla`` DeepSeek-V4 layout (kv_cache_interface.py:
#: "448B NoPE + 128B RoPE + 8B fp8 scale = 584B per token").
FP8_DS_MLA_V4_BYTES = 584


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(x: int, a: int | None) -> int:
    return x if not a else _cdiv(x, a) * a


@dataclass(frozen=True)
class DSv4MLASpec:
    """A compressed DeepSeek-V4 cache (main C4A / C128A latent or C4 indexer keys): vLLM
    ``MLAAttentionSpec`` with ``compress_ratio`` (``storage_block_size = block_size // ratio``),
    ``entry_bytes`` per stored entry (584 for ``fp8_ds_mla``, else ``head_size · dtype``) and the
    page rounded up to ``alignment``."""

    block_size: int
    entry_bytes: int
    compress_ratio: int = 1
    alignment: int | None = None
    page_size_padded: int | None = None

    num_kv_heads = 1
    sliding_window = None
    attention_chunk_size = None

    @property
    def storage_block_size(self) -> int:
        return self.block_size // self.compress_ratio

    @property
    def unpadded_page_size_bytes(self) -> int:
        return _round_up(self.storage_block_size * self.entry_bytes, self.alignment)

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.unpadded_page_size_bytes

    def _max_mem(self, ctx: Any) -> int:
        return _cdiv(ctx.max_model_len, self.block_size) * self.page_size_bytes

    def with_block_size(self, block_size: int):
        return replace(self, block_size=block_size)


@dataclass(frozen=True)
class DSv4SlidingWindowMLASpec:
    """A DeepSeek-V4 sliding cache (SWA latent, block 64; compressor states, fp32, block 4 / 8):
    vLLM ``SlidingWindowMLASpec``; page as :class:`DSv4MLASpec` (no compression)."""

    block_size: int
    entry_bytes: int
    sliding_window: int
    alignment: int | None = None
    page_size_padded: int | None = None

    num_kv_heads = 1
    compress_ratio = 1
    attention_chunk_size = None

    @property
    def unpadded_page_size_bytes(self) -> int:
        return _round_up(self.block_size * self.entry_bytes, self.alignment)

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.unpadded_page_size_bytes

    def _max_mem(self, ctx: Any) -> int:
        n = min(self.sliding_window - 1 + ctx.in_flight, ctx.max_model_len)
        return (_cdiv(n, self.block_size) + 1) * self.page_size_bytes

    def with_block_size(self, block_size: int):
        return replace(self, block_size=block_size)


DSV4_SPECS = (DSv4MLASpec, DSv4SlidingWindowMLASpec)


def is_dsv4_specs(specs: dict) -> bool:
    """vLLM's ``group_and_unify_kv_cache_specs`` applies: some layer is a sliding MLA spec."""
    return any(isinstance(s, DSv4SlidingWindowMLASpec) for s in specs.values())


def _approximate_gcd(values: list[int], lower_bound: int) -> int:
    """``_approximate_gcd`` (kv_cache_utils.py): the d in [lower_bound, max] with the least total
    upward padding, ties to the larger d."""
    best_d, best_pad = lower_bound, None
    for d in range(max(1, lower_bound), max(values) + 1):
        pad = sum((d - (x % d)) % d for x in values)
        if best_pad is None or pad < best_pad or (pad == best_pad and d > best_d):
            best_pad, best_d = pad, d
    return best_d


def _tuples(specs: dict) -> int:
    """``UniformTypeKVCacheSpecs.get_num_layer_tuples``: count of the most common page size."""
    return Counter(s.page_size_bytes for s in specs.values()).most_common(1)[0][1]


#: One group as this module plans it: ``(layer names, block size, {layer: spec})`` —
#: :mod:`tuner.memory.kvcache` makes it a ``KVCacheGroup`` of ``UniformTypeKVCacheSpecs`` (this module
#: stays below it: the imports run one way).
PlannedGroup = tuple


def _group(names: list, specs: dict) -> PlannedGroup:
    return (list(names), next(iter(specs.values())).block_size, dict(specs))


def dsv4_kv_cache_groups(version: str | VllmVersion, specs: dict) -> list[PlannedGroup]:
    """``group_and_unify_kv_cache_specs`` + ``_get_kv_cache_groups_uniform_groups`` (0.20 – 0.28;
    0.29: :func:`dsv4_packed_groups`): ``[full MLA group, sliding sub-groups …]`` as
    :data:`PlannedGroup` (``UniformTypeKVCacheSpecs`` groups in :mod:`tuner.memory.kvcache`)."""
    v = parse_version(version)
    if v >= DSV4_GROUPING_UNTIL:
        return dsv4_packed_groups(specs)
    full = {n: s for n, s in specs.items() if isinstance(s, DSv4MLASpec)}
    buckets: dict[tuple[int, int], dict] = {}
    for n, s in specs.items():
        if isinstance(s, DSv4SlidingWindowMLASpec):
            buckets.setdefault((s.block_size, s.sliding_window), {})[n] = s
    if not full:
        raise ValueError("DeepSeek-V4 KV specs without a compressed MLA layer (vLLM asserts len(mla_specs) > 0)")
    full_block = {s.block_size for s in full.values()}
    if len(full_block) != 1:
        raise ValueError("DeepSeek-V4 compressed MLA layers with different block sizes")
    tuples = [_tuples(full)] + [_tuples(b) for b in buckets.values()]
    t = _approximate_gcd(tuples, lower_bound=tuples[0])
    full_pages = sorted({s.page_size_bytes for s in full.values()})
    groups = [(list(full), full_block.pop(), dict(full))]
    for bucket in buckets.values():
        per_size: dict[int, list[str]] = {}
        padded: dict[str, Any] = {}
        for n, s in bucket.items():
            ps = s.page_size_bytes
            if v < DSV4_UNPADDED_SWA_SINCE:
                larger = [x for x in full_pages if x >= ps]
                if not larger:
                    raise ValueError(f"DeepSeek-V4 sliding page {ps} above every full page {full_pages}")
                cand = min(larger)
                if cand != ps:
                    s = replace(s, page_size_padded=cand)
                ps = cand
            padded[n] = s
            per_size.setdefault(ps, []).append(n)
        counts = {len(v_) for v_ in per_size.values()}
        if len(counts) != 1:  # vLLM asserts one layer count per page size inside a bucket
            raise ValueError(f"DeepSeek-V4 sliding bucket with unequal page-size counts {sorted(counts)}")
        n_groups = _cdiv(counts.pop(), t)
        layer_tuples = list(zip(*per_size.values()))
        for i in range(n_groups):
            names = [name for tup in layer_tuples[i::n_groups] for name in tup]
            sub = {name: padded[name] for name in names}
            groups.append(_group(names, sub))
    return groups


def dsv4_packed_groups(specs: dict) -> list[PlannedGroup]:
    """``_get_packed_kv_cache_groups`` (0.29.0, no Mamba layers): see the module docstring."""
    buckets: list[dict] = []
    for name, s in specs.items():
        for b in buckets:
            if _uniform_type({**b, name: s}):
                b[name] = s
                break
        else:
            buckets.append({name: s})
    info = []
    for b in buckets:
        per_size: dict[int, list[str]] = {}
        for name, s in b.items():
            per_size.setdefault(s.page_size_bytes, []).append(name)
        info.append((b, per_size, len({len(v) for v in per_size.values()}) == 1))
    floor = max((_tuples(b) for b, per, bal in info if bal and len(per) > 1), default=0)
    repeats = _approximate_gcd([_tuples(b) for b, _, bal in info if bal], floor) if floor else None
    groups = []
    for b, per, bal in info:
        n = _cdiv(_tuples(b), repeats) if bal and repeats else 1
        if n == 1:
            groups.append(_group(list(b), b))
            continue
        pattern = list(zip(*per.values()))
        for i in range(n):
            names = [name for rep in pattern[i::n] for name in rep]
            sub = {name: b[name] for name in names}
            groups.append(_group(names, sub))
    return groups


def _uniform_type(specs: dict) -> bool:
    """``UniformTypeKVCacheSpecs.is_uniform_type`` for DeepSeek-V4 specs: one block size, and all
    sliding with one window or all compressed (full-attention type)."""
    vals = list(specs.values())
    if len({s.block_size for s in vals}) > 1:
        return False
    if isinstance(vals[0], DSv4SlidingWindowMLASpec):
        return all(isinstance(s, DSv4SlidingWindowMLASpec) and s.sliding_window == vals[0].sliding_window for s in vals)
    return all(isinstance(s, DSv4MLASpec) for s in vals)


def _layer_tuple_bytes(groups: list) -> int:
    return sum({s.page_size_bytes for s in groups[0].spec.kv_cache_specs.values()})


def _num_layer_tuples(groups: list) -> int:
    return max(_tuples(g.spec.kv_cache_specs) for g in groups if g.layer_names)


def dsv4_needed_bytes(groups: list, ctx: Any) -> int:
    """``_max_memory_usage_bytes_from_groups`` DeepSeek-V4 branch (0.20 – 0.28): bytes vLLM's
    admission check asks for one request of ``ctx.max_model_len`` tokens."""
    live = [g for g in groups if g.layer_names]
    ltb, t = _layer_tuple_bytes(live), _num_layer_tuples(live)
    return sum(t * g.spec.max_pages(ctx) * ltb for g in live)


def dsv4_bytes_per_block(version: str | VllmVersion, groups: list) -> int:
    """Bytes one block costs on the worker (the divisor of ``num_blocks``), per release (module
    docstring)."""
    v = parse_version(version)
    live = [g for g in groups if g.layer_names]
    if v >= DSV4_PACKED_SINCE:
        return max(sum(g.spec.kv_cache_specs[n].page_size_bytes for n in g.layer_names) for g in live)
    if v >= DSV4_BUCKETS_SINCE:
        slots: dict[int, int] = {}
        for g in live:
            for ps, k in Counter(g.spec.kv_cache_specs[n].page_size_bytes for n in g.layer_names).items():
                slots[ps] = max(slots.get(ps, 0), k)
        return sum(ps * k for ps, k in slots.items())
    return _layer_tuple_bytes(live) * _num_layer_tuples(live)


def dsv4_tensors(version: str | VllmVersion, groups: list, num_blocks: int) -> list[tuple[int, list[str]]]:
    """One tensor ``(bytes, layer names)`` per (slot, page size), shared by the layers of every group
    at that slot (``_get_kv_cache_config_deepseek_v4`` / the packed planners); a
    ``KVCacheTensor`` each in :mod:`tuner.memory.kvcache`."""
    slots: dict[int, list[list[str]]] = {}
    for g in groups:
        seen: Counter = Counter()
        for n in g.layer_names:
            ps = g.spec.kv_cache_specs[n].page_size_bytes
            idx = seen[ps]
            seen[ps] += 1
            lst = slots.setdefault(ps, [])
            if idx == len(lst):
                lst.append([])
            lst[idx].append(n)
    return [(ps * num_blocks, names) for ps, lst in sorted(slots.items()) for names in lst]

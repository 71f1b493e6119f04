"""Which attention backend vLLM selects for a decoder's (non-MLA) layers, and the memory that choice
puts into the CUDA-graph estimate (issue 28, docs/accuracy-mechanisms.md §20).

Pure: no torch, no vLLM. Read in vLLM 0.19.0 – 0.34.0 (wheels from PyPI):

* ``vllm/platforms/cuda.py`` ``_get_backend_priorities`` (non-MLA): compute capability 10.x tries
  FLASHINFER first; every other capability (8.x, 9.0, 12.x) tries FLASH_ATTN, then FLASHINFER, then
  TRITON_ATTN; the first backend whose checks pass is used.
* ``vllm/v1/attention/backends/flash_attn.py`` ``supports_kv_cache_dtype``: an fp8 cache only with
  FlashAttention 3 on Hopper (``get_flash_attn_version() == 3 and is_device_capability_family(90)``;
  0.19 – 0.21 ``kv_cache_dtype.startswith("fp8")`` → ``flash_attn_supports_fp8()``, the same test;
  0.22+ lists ``fp8`` / ``fp8_e4m3`` for it and refuses ``fp8_e5m2`` on every card), else
  ``auto`` / ``float16`` / ``bfloat16``; ``supports_head_size``: a multiple of 8, at most 256
  (FlashAttention 4, Blackwell 10.x only, 512).
* ``vllm/v1/attention/backends/flashinfer.py``: ``supported_kv_cache_dtypes`` ``auto``, ``float16``,
  ``bfloat16``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2`` (``nvfp4`` where the release lists it),
  compute capability 7.5 (8.0 from 0.24) to 12.1.

So off Hopper an fp8 KV cache runs FlashInfer: on an RTX 3090 / 4090 / A100 as on an RTX 5090 or a
GB10 — the cc 12.x over-predictions of issue 28 are the fp8 cache's backend, not the capability.
"""
from __future__ import annotations

MiB = 1 << 20

#: ``VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE`` (vllm/envs.py): ``394 * 1024 * 1024`` in every release
#: read, 0.19.0 – 0.34.0. ``FlashInferMetadataBuilder._get_workspace_buffer``
#: (v1/attention/backends/flashinfer.py) allocates it with ``torch.zeros(..., uint8)`` the first time
#: a prefill / decode wrapper is planned; on 10.x the TRT-LLM decode path takes the module's
#: ``_get_trtllm_gen_workspace_buffer()`` of the same size instead.
FLASHINFER_WORKSPACE_BUFFER_BYTES = 394 * MiB
#: From 0.26 ``_get_workspace_buffer`` sizes the buffer ``max(default, max_num_batched_tokens ×
#: num_qo_heads × head_dim × FLASHINFER_PREFILL_WORKSPACE_BYTES_PER_ELEM)`` ("FlashInfer prefill temp
#: buffers … scale with the prefill chunk and query-head footprint"; 16 B per element, 0.26 – 0.34;
#: 0.25.1 and before the default alone). ``num_qo_heads``: the rank's query heads of the group's layers.
FLASHINFER_WORKSPACE_BY_HEADS_SINCE = (0, 26, 0)
FLASHINFER_PREFILL_WORKSPACE_BYTES_PER_ELEM = 16

#: KV cache dtypes FlashInfer's backend accepts (flashinfer.py ``supported_kv_cache_dtypes``; nvfp4
#: is checked by :mod:`tuner.memory.engine_checks`).
FLASHINFER_KV_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4")
#: KV cache dtypes FlashAttention accepts without fp8 (flash_attn.py ``supports_kv_cache_dtype``).
FLASH_ATTN_PLAIN_KV_DTYPES = ("auto", "float16", "bfloat16")
#: First release whose FlashAttention refuses ``fp8_e5m2`` even on Hopper (flash_attn.py lists
#: only ``fp8`` / ``fp8_e4m3`` for FA3; 0.19 – 0.21 accept every ``fp8*`` there).
FLASH_ATTN_E5M2_REFUSED_SINCE = (0, 22, 0)


def _vt(version) -> tuple:
    """``(major, minor, patch)`` of a release tuple or :class:`tuner.releases.VllmVersion`."""
    if hasattr(version, "major"):
        return (int(version.major), int(version.minor), int(version.patch))
    return tuple(int(x) for x in tuple(version)[:3])


def _major(compute_capability: str | None) -> int | None:
    try:
        return int(str(compute_capability).split(".")[0])
    except (TypeError, ValueError):
        return None


def flash_attn_accepts(version: tuple, *, compute_capability: str | None, kv_cache_dtype: str,
                       head_size: int) -> bool:
    """Whether vLLM's FLASH_ATTN backend takes a non-MLA layer (flash_attn.py
    ``supports_kv_cache_dtype`` / ``supports_head_size``; FA3 is Hopper's, 9.0)."""
    kv = str(kv_cache_dtype or "auto").lower()
    if head_size % 8 != 0 or head_size > 256:
        return False
    if kv in FLASH_ATTN_PLAIN_KV_DTYPES:
        return True
    if kv.startswith("fp8") and _major(compute_capability) == 9:
        return kv in ("fp8", "fp8_e4m3") or _vt(version) < FLASH_ATTN_E5M2_REFUSED_SINCE
    return False


def selects_flashinfer(version: tuple, *, compute_capability: str | None, kv_cache_dtype: str,
                       head_size: int) -> bool:
    """Whether vLLM runs a non-MLA attention layer on FLASHINFER (platforms/cuda.py
    ``_get_backend_priorities``): first on 10.x, else when FLASH_ATTN refuses the layer and
    FlashInfer takes its cache dtype and the card. Unknown capability → False (no charge)."""
    major = _major(compute_capability)
    kv = str(kv_cache_dtype or "auto").lower()
    if major is None or kv not in FLASHINFER_KV_DTYPES:
        return False
    if major == 10:
        return True
    if not (7 <= major <= 12):
        return False
    return not flash_attn_accepts(version, compute_capability=compute_capability, kv_cache_dtype=kv,
                                  head_size=head_size)


def _flashinfer_layers(version: tuple, compute_capability: str | None, kv_cache_dtype: str, kv_specs) -> set:
    """The distinct non-MLA attention specs that run FlashInfer (none where the layers have two head
    sizes: ``Gemma4Config.verify_and_update_config``, model_executor/models/config.py 0.19 – 0.34,
    forces TRITON_ATTN, or FA4 where available, on every layer)."""
    from tuner.memory.kvcache import (ChunkedLocalAttentionSpec, FullAttentionSpec, MLAAttentionSpec,
                                      SlidingWindowMLASpec, SlidingWindowSpec)

    attn = [s for s in dict(kv_specs or {}).values()
            if isinstance(s, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec))
            and not isinstance(s, (MLAAttentionSpec, SlidingWindowMLASpec))]
    if len({int(s.head_size) for s in attn}) > 1:
        return set()
    return {s for s in attn if selects_flashinfer(version, compute_capability=compute_capability,
                                                  kv_cache_dtype=kv_cache_dtype, head_size=int(s.head_size))}


def full_graphs_captured(version: tuple, *, compute_capability: str | None, kv_cache_dtype: str, kv_specs,
                         num_speculative_tokens: int = 0) -> bool:
    """Whether FULL decode graphs stay in the CUDA-graph mode. With spec decode (``1 + k`` tokens per
    decode) a FULL decode mode needs every backend's ``UNIFORM_BATCH`` support; FlashInfer without
    TRT-LLM attention (every card but 10.x) reports ``UNIFORM_SINGLE_TOKEN_DECODE``
    (flashinfer.py ``get_cudagraph_support``), and ``resolve_cudagraph_mode_and_sizes``
    (config/compilation.py, 0.20 – 0.34; gpu_model_runner.py in 0.19) sets ``cudagraph_mode=PIECEWISE``
    ("CUDAGraphMode.FULL_AND_PIECEWISE is not supported with spec-decode for attention backend …";
    attention is a splitting op under the default compile). Other backends are taken to keep FULL."""
    if not num_speculative_tokens or _major(compute_capability) == 10:
        return True
    return not _flashinfer_layers(version, compute_capability, kv_cache_dtype, kv_specs)


def flashinfer_graph_workspace_bytes(version: tuple, *, compute_capability: str | None, kv_cache_dtype: str,
                                     kv_specs, num_speculative_tokens: int = 0, model_runner_v2: bool = False,
                                     max_num_batched_tokens: int = 0, num_qo_heads: int = 0) -> int:
    """FlashInfer's workspace buffers inside vLLM's CUDA-graph memory estimate (bytes; 0 where the
    layers do not run FlashInfer or no FULL graph is captured). ``kv_specs``: the stage's
    ``{layer: spec}`` (:mod:`tuner.memory.kvcache`); only non-MLA attention specs count.

    ``GPUModelRunner.profile_cudagraph_memory`` (v1/worker/gpu_model_runner.py, 0.19 – 0.33)
    builds a minimal KV cache (``_init_minimal_kv_cache_for_profiling``: new metadata builders,
    their workspace not yet allocated), ``empty_cache()``s, then samples ``mem_get_info`` around the
    two largest captures of each mode. A FULL capture's warm-ups run ``_dummy_run(...,
    force_attention=True)`` (``_warmup_and_capture``), so each FlashInfer metadata builder plans
    and allocates its own 394 MiB workspace (:data:`FLASHINFER_WORKSPACE_BUFFER_BYTES`; builders share
    none) inside the FULL mode's *first* sample; PIECEWISE captures and the profile run build no
    attention metadata (``attn_metadata`` only ``if force_attention or cudagraph_runtime_mode ==
    FULL``). ``_build_attention_metadata`` builds once per ``(kv_cache_spec, builder type)`` and
    reuses it for groups with the same spec (``update_block_table``), so one buffer per distinct
    attention spec (a full and a sliding-window group: two). The estimate is ``max over
    modes(first) + Σ (n − 1) × per-graph``, and the calibrated estimate
    (:func:`tuner.memory.budget.cudagraph_estimate_bytes`, fit on 0.19 H100 logs running FlashAttention
    3) holds no such buffer: it is added whole (an upper bound where the PIECEWISE first capture
    exceeds the FULL one's other bytes).

    No FULL graph: spec decode (``1 + k`` tokens per decode) needs ``UNIFORM_BATCH`` support, and
    FlashInfer without TRT-LLM attention (every card but 10.x) reports
    ``UNIFORM_SINGLE_TOKEN_DECODE`` (``FlashInferMetadataBuilder.get_cudagraph_support``), so
    config/compilation.py sets ``cudagraph_mode=PIECEWISE`` ("not supported with spec-decode for
    attention backend"): nothing is charged then. Not read, not charged: attention sinks (FLASH_ATTN
    refuses them below FA3, FlashInfer off 10.x: TRITON_ATTN), MLA backends' own workspaces, a
    backend forced by ``--attention-backend`` / ``VLLM_ATTENTION_BACKEND``.

    Model Runner V2 (0.29+, whose estimate is ``gpu/cudagraph_utils.py profile_cudagraph_memory``:
    the free-memory drop around ``capture_model``) builds attention metadata for PIECEWISE captures
    too (``prepare_attn(..., for_capture=full_cudagraph)``: "We always generate attention metadata
    for both FULL and PIECEWISE CUDA graphs") and none in its profile run (``_dummy_run(...,
    skip_attn=True, is_profile=True)``), so there the buffer is in the estimate with or without
    FULL graphs.
    """
    if not model_runner_v2 and not full_graphs_captured(version, compute_capability=compute_capability, kv_cache_dtype=kv_cache_dtype,
                                kv_specs=kv_specs, num_speculative_tokens=num_speculative_tokens):
        return 0
    fi = _flashinfer_layers(version, compute_capability, kv_cache_dtype, kv_specs)
    if not fi:
        return 0
    return sum(workspace_buffer_bytes(version, max_num_batched_tokens=max_num_batched_tokens,
                                      num_qo_heads=num_qo_heads, head_size=int(spec.head_size))
               for spec in _builders(version, kv_specs, fi))


def workspace_buffer_bytes(version: tuple, *, max_num_batched_tokens: int = 0, num_qo_heads: int = 0,
                           head_size: int = 0) -> int:
    """One FlashInfer metadata builder's workspace (bytes): :data:`FLASHINFER_WORKSPACE_BUFFER_BYTES`,
    from 0.26 at least ``N × num_qo_heads × head_dim × 16`` (:data:`FLASHINFER_WORKSPACE_BY_HEADS_SINCE`)."""
    if _vt(version) < FLASHINFER_WORKSPACE_BY_HEADS_SINCE:
        return FLASHINFER_WORKSPACE_BUFFER_BYTES
    est = int(max_num_batched_tokens) * int(num_qo_heads) * int(head_size) * FLASHINFER_PREFILL_WORKSPACE_BYTES_PER_ELEM
    return max(FLASHINFER_WORKSPACE_BUFFER_BYTES, est)


def _builders(version: tuple, kv_specs, flashinfer_specs: set) -> list:
    """One entry per FlashInfer metadata builder: vLLM builds one attention group per KV-cache group and
    ``(backend, layer spec, query heads)`` (v1/worker/gpu_model_runner.py ``initialize_attn_backend``
    ``get_attn_backends_for_group``), each with its own builder and buffer; FlashInfer's builder has no
    ``supports_update_block_table``, so every group builds (and plans) its own in the FULL capture
    (``_build_attention_metadata``). The groups are :func:`tuner.memory.kvcache.get_kv_cache_groups`'
    (a hybrid model's same-spec layers split into several groups: one builder each)."""
    from tuner.errors import TunerError
    from tuner.memory.kvcache import UniformTypeKVCacheSpecs, get_kv_cache_groups

    try:
        groups = get_kv_cache_groups(".".join(str(x) for x in _vt(version)), dict(kv_specs))
    except TunerError:
        return sorted(flashinfer_specs, key=repr)
    out = []
    for g in groups:
        if isinstance(g.spec, UniformTypeKVCacheSpecs):
            layer_specs = {g.spec.kv_cache_specs[n] for n in g.layer_names if n in g.spec.kv_cache_specs}
        else:
            layer_specs = {dict(kv_specs).get(n, g.spec) for n in g.layer_names}
        out.extend(sorted((x for x in layer_specs if x in flashinfer_specs), key=repr))
    return out

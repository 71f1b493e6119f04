"""The vLLM platform a card runs (CUDA or ROCm) and a unified-memory card's memory reading: what
changes the memory model there, and what the model does not follow (the job's ``assumptions``).

Read from vLLM's source:

- **ROCm** (vllm/platforms/rocm.py, 0.33.0 / 0.34.0): NCCL is RCCL (``dist_backend = "nccl"``, the
  ROCm build of torch); NVLink SHARP (NVLS) does not exist, so no NVLS buffers (the catalog gives
  AMD cards ``interconnect: xgmi``, :func:`tuner.memory.budget.nccl_profile_bytes` charges NVLS on
  ``nvswitch`` only); custom all-reduce skips the P2P check on ROCm ("On AMD GPU, p2p is always
  enabled between XGMI connected GPUs", vllm/distributed/device_communicators/custom_all_reduce.py
  ``CustomAllreduce.__init__``) and takes ``is_fully_connected`` from amdsmi's xGMI links
  (:func:`tuner.memory.budget.custom_all_reduce_enabled`); the hybrid KV cache manager is supported
  (``RocmPlatform.support_hybrid_kv_cache`` returns True: sliding-window savings apply as on CUDA);
  the KV block size default is the platform-independent ``CacheConfig.DEFAULT_BLOCK_SIZE`` (vllm/config/cache.py:
  16 in 0.33.0, 64 in 0.34.0),
  the backends' kernel block sizes (ROCM_ATTN / TRITON_ATTN / ROCM_AITER_UNIFIED_ATTN
  ``MultipleOf(16)``, ROCM_AITER_FA 16/32, ROCM_AITER_MLA ``MultipleOf(1)``, TRITON_MLA
  ``MultipleOf(16)``) split a block, they do not change the bytes per token; CUDA graphs are HIP
  graphs sized by the same estimate (vllm/v1/worker/gpu_model_runner.py, platform-independent).
  The KV buffer is padded to 4096 bytes on ROCm only (vllm/v1/worker/utils.py
  ``_allocate_kv_cache_buffer``, 0.34): after the block count, no block changes. FlashInfer's
  top-k/top-p sampler is CUDA-only (vllm/v1/sample/ops/topk_topp_sampler.py): the profile's dummy
  sampler sorts on ROCm in 0.8–0.11.0 (:mod:`tuner.model.simulate.profile`); gpt-oss's MXFP4 experts take
  Triton with ROCm's padding (:func:`tuner.memory.quant.mxfp4_backend`); an MLA model's block size
  comes from ROCm's backends (:func:`rocm_mla_block_size`). When the profile
  measures a release of memory (negative consumption) ROCm sizes the KV cache from the torch
  reserve instead of refusing (vllm/v1/worker/gpu_worker.py ``maybe_rocm_profiling_fallback``,
  0.34). Not modelled, and named as assumptions: RCCL's own buffers, hipBLASLt's workspace (the
  cuBLAS workspace of the same capability is charged), AITER's workspaces and kernels selected by
  ``VLLM_ROCM_USE_AITER*``, QuickReduce buffers.
- **Unified memory** (GB10 / DGX Spark, Jetson Thor; ``torch.cuda.get_device_properties().is_integrated``,
  vllm/platforms/cuda.py ``is_integrated_gpu``): vLLM reads the free memory from
  ``psutil.virtual_memory().available`` instead of cudaMemGetInfo (vllm/utils/mem_utils.py
  ``MemorySnapshot.measure`` in 0.20–0.33, ``device_memory_info`` in 0.34.0; by compute capability in
  0.11.1–0.19.1, :func:`tuner.memory.budget.free_memory_from_host`); the total is cudaMemGetInfo's (0.34
  ``get_device_total_memory`` falls back to the CUDA device properties where NVML has no memory
  query, as on GB10). So host RAM counts against the same pool: RAM in use when vLLM starts is
  memory the start-up check finds missing (``other_processes_memory_gib`` in a drop,
  ``--other-processes-memory-gib`` in ``check``), and host RAM that grows after vLLM's first snapshot (the
  worker's own CPU memory, compile workers, loaders, other processes) is consumed memory to
  0.27+'s ``total_consumed`` and non-torch memory to 0.9.1–0.26 — not modelled (an assumption).
  GH200 / GB200 have their own HBM (``is_integrated`` false): cudaMemGetInfo as on any card.

No torch, no vLLM: a data module the daemon may import.
"""

from __future__ import annotations

from typing import Any

__all__ = ["platform_of", "is_integrated", "platform_assumptions", "assumption", "rocm_mla_block_size"]


def rocm_mla_block_size(version: str, *, sparse: bool = False, user_block_size: int | None = None) -> int:
    """Tokens per KV block of an MLA model on ROCm with vLLM's default backends (``VLLM_ROCM_USE_AITER``
    off, its default in vllm/envs.py), where CUDA's FlashMLA / CUTLASS rules do not apply:

    * < 0.19 (vllm/platforms/rocm.py ``check_and_update_config``: ``block_size = 16`` when unset;
      ``TRITON_MLA``); sparse MLA asserts ``block_size == 1`` (0.11–0.18, ``get_attn_backend_cls``);
    * 0.19+ (vllm/platforms/interface.py ``update_block_size_for_backend``): the backend's preferred
      size of ``CacheConfig.DEFAULT_BLOCK_SIZE`` (16; 64 from 0.34): ``TRITON_MLA`` takes
      ``MultipleOf(16)``, so the default; sparse ``ROCM_AITER_MLA_SPARSE`` takes ``[1]`` (0.19–0.20),
      ``[1, 64]`` (0.21–0.27) — the default is refused, the smallest, 1, is used — and
      ``[1, MultipleOf(16)]`` from 0.28 (the default). A user's ``--block-size`` is kept.
    """
    import re

    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    v = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else (0, 0, 0)
    if user_block_size:
        return int(user_block_size)
    default = 64 if v >= (0, 34, 0) else 16
    if sparse:
        return 1 if v < (0, 28, 0) else default
    return 16 if v < (0, 19, 0) else default


def platform_of(card: dict) -> str:
    """``"rocm"`` or ``"cuda"`` for a request's card: as the card states it, else the catalog's for
    its name (and total), else by the vendor words of its name (:func:`tuner.memory.devices.platform_of_name`)."""
    from tuner.memory.devices import lookup, platform_of_name

    if card.get("platform") in ("cuda", "rocm"):
        return str(card["platform"])
    known = lookup(str(card.get("name", "")), total_memory_bytes=card.get("total_memory_bytes"))
    return known.platform if known is not None else platform_of_name(str(card.get("name", "")))


def is_integrated(card: dict) -> bool | None:
    """CUDA's ``is_integrated`` for a request's card: as stated, else the catalog's, else None."""
    from tuner.memory.devices import lookup

    if card.get("integrated") is not None:
        return bool(card["integrated"])
    known = lookup(str(card.get("name", "")), total_memory_bytes=card.get("total_memory_bytes"))
    return known.integrated if known is not None else None


def assumption(name: str, value: str, where: str, note: str) -> dict:
    """One assumption as data: the fields of :class:`tuner.memory.uncertainty.Unmodelled` (``effect``
    ``widens``, ``kind`` ``not_modelled``), so the band widens for it."""
    return {"name": name, "value": value, "where": where, "effect": "widens", "note": note, "kind": "not_modelled"}


def platform_assumptions(card: dict, era: Any = None, *, where: str = "device") -> list[dict]:
    """What the job does not model for the card's platform (:func:`assumption` entries)."""
    out: list[dict] = []
    if platform_of(card) == "rocm":
        out.append(assumption(
            "platform", "rocm", where,
            f"{card.get('name')!s} runs vLLM's ROCm platform (vllm/platforms/rocm.py): modelled as no NVLS, custom "
            "all-reduce over xGMI without the P2P check, KV layout and block size as on CUDA; RCCL buffers, "
            "hipBLASLt and AITER workspaces (VLLM_ROCM_USE_AITER*) are not modelled: the KV cache may be smaller"))
    if is_integrated(card):
        from tuner.memory.budget import free_memory_from_host

        host = era is not None and free_memory_from_host(
            era, compute_capability=card.get("compute_capability") or _catalog_cc(card), integrated=True)
        out.append(assumption(
            "unified memory", "no host RAM growth during start-up" + (
                " beyond the runner's token-history buffers" if host else ""), where,
            f"{card.get('name')!s} shares one memory with the CPU"
            + (f"; vLLM {era.version} reads free memory from the host's available memory (vllm/utils/mem_utils.py), "
               "so host RAM the start-up takes after its first snapshot is consumed device memory: the model "
               "runner's [max_num_seqs, max_model_len] token history is charged (tuner.memory.budget.uma_host_buffer_bytes), "
               "the rest (libraries and kernels loaded lazily, CUDA-graph captures measured on the OS's free "
               "memory, other processes) is not" if host else
               "; cudaMemGetInfo's free memory there leaves out reclaimable page cache")
            + ": the KV cache may be smaller; RAM in use at start is other_processes_memory_gib "
              "(check: --other-processes-memory-gib)"))
    return out


def _catalog_cc(card: dict) -> str | None:
    from tuner.memory.devices import lookup

    known = lookup(str(card.get("name", "")), total_memory_bytes=card.get("total_memory_bytes"))
    return known.compute_capability if known is not None else None

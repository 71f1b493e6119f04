"""Block sizes of the CUDA caching allocator, as its *allocated* statistics count them.

Pure functions, no torch import of their own. Constants from torch ``c10/core/AllocatorConfig.h``
(the torch 2.13 headers read) and the rules of ``c10/cuda/CUDACachingAllocator.cpp``:

- every request is rounded up to ``kMinBlockSize`` (512 B);
- a request of at most ``kSmallSize`` (1 MiB) is carved from a 2 MiB small-pool segment, one of
  1–10 MiB from a 20 MiB ``kLargeBuffer`` segment, and one of ``kMinLargeAlloc`` (10 MiB) or more
  gets its own segment, its size rounded up to ``kRoundLarge`` (2 MiB);
- a large-pool block is split only when more than ``kSmallSize`` would remain
  (``should_split``: ``remaining > kSmallSize``); an unsplit block is allocated whole, and
  ``allocated_bytes`` (``torch.cuda.memory_allocated``, which vLLM's "Model loading took" reads)
  grows by the whole block.

Used for the weights of every engine (:func:`weights_rounding_bytes`, added by
:class:`tuner.model.simulate.profile.ModelCache` to the module's bytes): vLLM's "Model loading
took" and the weights its KV budget subtracts are the *allocated*-bytes increase over
``load_model`` on V0 and V1 alike (V1 gpu_model_runner.py ``load_model`` → utils
``DeviceMemoryProfiler`` → platforms/cuda.py ``get_current_memory_usage``: ``empty_cache``,
``reset_peak_memory_stats``, ``max_memory_allocated``; 0.10 – 0.34). Until docs/accuracy-mechanisms.md
§24 the V1 share of it sat in the calibrated reserve (:func:`tuner.memory.budget.unexplained_bytes`):
the Qwen2 family's +0.056 GiB on 14.2 GiB is this rounding, 2 MiB per layer.
"""

from __future__ import annotations

from typing import Any

K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = 1 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20


def round_request(nbytes: int) -> int:
    """``round_size``: ``nbytes`` rounded up to 512 B (0 stays 0)."""
    if nbytes <= 0:
        return 0
    return -(-int(nbytes) // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def fresh_segment_block_bytes(nbytes: int) -> int:
    """Allocated bytes of one tensor of ``nbytes`` placed in a new segment (no cached block fits,
    as while a model's weights are created one after another): a request of 10 MiB or more keeps
    its whole 2 MiB-rounded segment when at most 1 MiB would remain (17.5 MiB → 18 MiB, 135 MiB →
    136 MiB), else its 512 B-rounded size; smaller requests their 512 B-rounded size."""
    size = round_request(nbytes)
    if size < K_MIN_LARGE_ALLOC:
        return size
    segment = -(-size // K_ROUND_LARGE) * K_ROUND_LARGE
    return segment if segment - size <= K_SMALL_SIZE else size


def weights_rounding_bytes(module: Any) -> int:
    """What the allocator adds to a module's parameters and buffers created one after another
    (bytes): Σ ``fresh_segment_block_bytes(n) − n`` over its storages, each once."""
    seen, extra = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = id(t.untyped_storage())
        if key not in seen:
            seen.add(key)
            n = t.numel() * t.element_size()
            extra += fresh_segment_block_bytes(n) - n
    return extra

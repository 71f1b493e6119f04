"""JSON forms that keep what plain JSON loses — tuples and dicts with non-string keys — for values
stored as JSON and read back equal: the pass memo's specs and passes (:mod:`tuner.jobs.passmemo`) and
the stored engine cross-check's KV specs (:mod:`tuner.engine.stored`)."""

from __future__ import annotations

from typing import Any


def encode(obj: Any) -> Any:
    """``obj`` with tuples as ``{"__tuple__": [...]}`` and dicts whose keys are not all strings (or
    that hold a marker key) as ``{"__items__": [[key, value], ...]}`` (``id2label`` has int keys)."""
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            if "__items__" in obj or "__tuple__" in obj:
                return {"__items__": [[k, encode(v)] for k, v in obj.items()]}
            return {k: encode(v) for k, v in obj.items()}
        return {"__items__": [[k, encode(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v) for v in obj]}
    if isinstance(obj, list):
        return [encode(v) for v in obj]
    return obj


def decode(obj: Any) -> Any:
    """The inverse of :func:`encode` (after a JSON round trip)."""
    if isinstance(obj, dict):
        if set(obj) == {"__items__"}:
            return {k: decode(v) for k, v in obj["__items__"]}
        if set(obj) == {"__tuple__"}:
            return tuple(decode(v) for v in obj["__tuple__"])
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj

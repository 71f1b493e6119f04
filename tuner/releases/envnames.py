"""The ``VLLM_*`` environment variables vLLM releases read (``tuner/data/vllm_env_names.json``).

Read from each release's ``vllm/envs.py`` (``environment_variables``) by ``tools/vllm_env_names.py``
(0.4.2–0.34.0: the releases that have the module). Pure: no vLLM import.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data" / "vllm_env_names.json"


@lru_cache(maxsize=1)
def _table() -> dict:
    return json.loads(DATA.read_text(encoding="utf-8"))


def releases_reading(name: str) -> tuple[str, ...]:
    """The releases whose ``vllm/envs.py`` defines ``name`` (oldest first; () for none)."""
    t = _table()
    rel = t["releases"]
    return tuple(rel[i] for lo, hi in t["names"].get(name, ()) for i in range(lo, hi + 1))


def is_vllm_env(name: str) -> bool:
    """Whether some release's ``vllm/envs.py`` defines ``name``."""
    return name in _table()["names"]


def span() -> str:
    """The releases the table covers (``0.4.2–0.34.0``)."""
    rel = _table()["releases"]
    return f"{rel[0]}–{rel[-1]}"


def close_names(name: str, n: int = 1) -> list[str]:
    """The vLLM variable names closest to a misspelled one (difflib, cutoff 0.8)."""
    import difflib

    return difflib.get_close_matches(name, list(_table()["names"]), n=n, cutoff=0.8)

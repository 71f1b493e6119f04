"""What each vLLM release names, as read from its wheel (``tuner/data/release_facts.json``).

Pure data and lookups (no torch, no I/O but reading the packaged file once). The file is written
by ``tools/release_facts.py`` from the released wheels (``pip download vllm==X --no-deps``) — see
``docs/releases.md`` — and holds, for every release read (0.4.0 … 0.34.0, patch releases
included):

- the model registry's architecture names (``vllm/model_executor/models/registry.py``);
- the ``--quantization`` names (``QuantizationMethods`` of
  ``vllm/model_executor/layers/quantization/__init__.py``) and the deprecated ones;
- the ``--kv-cache-dtype`` names (``CacheDType``, or the argparse ``choices`` in older releases);
- the engines it has (V0 ``vllm/worker/worker.py``, V1 ``vllm/v1/worker/gpu_worker.py``);
- the logger prefix style (``[file.py:line]`` from 0.8, ``file.py:line]`` before; ``vllm/logger.py``);
- its argparse destinations (the keys of the "non-default args" line);
- for each memory / settings log-line fragment, the releases whose sources print it and the
  ``file.py:line`` of each logger call printing it.

Releases are the wheels' version strings (``"0.10.1.1"``, ``"0.8.5.post1"``); sets of releases are
``frozenset`` of those strings.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent.parent / "data" / "release_facts.json"


def release_key(release: str) -> tuple[int, int, int]:
    """``"0.10.1.1"`` → ``(0, 10, 1)`` (the triple ctx-tuner's eras use)."""
    nums = [int(n) for n in re.findall(r"\d+", str(release).split("post")[0])[:3]]
    return tuple(nums + [0] * (3 - len(nums)))  # type: ignore[return-value]


def _sort_key(release: str) -> tuple:
    return tuple(0.5 if p == "post" else int(p) for p in re.findall(r"\d+|post", release))


@lru_cache(maxsize=1)
def facts() -> dict:
    """The parsed data file (read once)."""
    return json.loads(DATA.read_text())


@lru_cache(maxsize=1)
def releases() -> tuple[str, ...]:
    """Every release read, oldest first."""
    return tuple(facts()["releases"])


def _expand(intervals) -> frozenset[str]:
    rel = releases()
    return frozenset(rel[i] for lo, hi in intervals for i in range(lo, hi + 1))


@lru_cache(maxsize=None)
def _table(section: str, name: str) -> frozenset[str]:
    return _expand(facts()[section].get(name, ()))


def with_architecture(arch: str) -> frozenset[str]:
    """Releases whose model registry has ``arch``."""
    return _table("architectures", arch)


def with_engine(engine: str) -> frozenset[str]:
    """Releases that have the ``"V0"`` / ``"V1"`` engine."""
    return _table("engines", engine.upper())


def with_log_prefix(style: str) -> frozenset[str]:
    """Releases whose logger prints ``[file.py:line]`` (``"bracket"``) or ``file.py:line]`` (``"plain"``)."""
    return _table("log_prefix", style)


def with_flag(dest: str) -> frozenset[str]:
    """Releases whose ``vllm serve`` / engine arguments have the destination ``dest``
    (from the first to the last release that has it). Empty for a name no release has."""
    span = facts()["flags"].get(dest)
    if span is None:
        return frozenset()
    return frozenset(releases()[span[0]:span[1] + 1])


def known_flag(dest: str) -> bool:
    return dest in facts()["flags"]


@lru_cache(maxsize=1)
def log_fragments() -> tuple[str, ...]:
    """The log-line fragments the data file knows (``tools/release_facts.py`` ``FRAGMENTS``)."""
    return tuple(facts()["log_lines"])


def with_fragment(fragment: str) -> frozenset[str]:
    """Releases whose sources hold the log-line fragment in a string literal."""
    entry = facts()["log_lines"].get(fragment)
    return _expand(entry["releases"]) if entry else frozenset()


def fragment_has_sites(fragment: str) -> bool:
    entry = facts()["log_lines"].get(fragment)
    return bool(entry and entry["sites"])


@lru_cache(maxsize=None)
def with_fragment_at(fragment: str, site: str) -> frozenset[str]:
    """Releases consistent with ``fragment`` printed at ``site`` (``"gpu_worker.py:276"``): those
    whose logger call printing it is there, and those that hold the fragment but print it
    through an object's ``repr`` or a helper (no call site read: not excluded)."""
    entry = facts()["log_lines"].get(fragment)
    if not entry:
        return frozenset()
    sited = frozenset().union(*(_expand(iv) for iv in entry["sites"].values()))
    return _expand(entry["sites"].get(site, ())) | (with_fragment(fragment) - sited)


@lru_cache(maxsize=None)
def with_fragment_apart(fragment: str, other: str) -> frozenset[str]:
    """Releases consistent with ``fragment`` printed on a line without ``other``: those holding
    ``fragment``, less those whose every logger call printing it prints ``other`` on the same
    output line (0.28+ "GPU KV cache size: N tokens, Maximum concurrency for …")."""
    entry = facts()["log_lines"].get(fragment) or {}
    return with_fragment(fragment) - _expand(entry.get("always_with", {}).get(other, ()))


_HOLE = re.compile("\x00(\\w+)\x00")


def _hole_pattern(kind: str) -> re.Pattern | None:
    if kind == "int":
        return re.compile(r"-?\d+")
    if kind == "intc":
        return re.compile(r"-?\d[\d,]*")
    if kind == "g2":
        return re.compile(r"-?\d+(?:\.\d{1,2})?(?![\d])")
    m = re.fullmatch(r"f(\d+)", kind)
    if m:
        n = int(m.group(1))
        return re.compile(r"-?\d+" + (rf"\.\d{{{n}}}(?!\d)" if n else ""))
    return None


def shape_matches(shape: str, text: str) -> bool:
    """Whether ``text`` (a log line from the fragment on) can be what ``shape`` prints — a typed
    template of ``tools/release_facts.py``: literals must agree, ``f<N>`` holes need N decimals,
    ``g2`` at most two, ``int``/``intc`` digits; a line cut short agrees with what it shows."""
    parts = _HOLE.split(shape)  # literal, kind, literal, kind, ...
    pos = 0
    for i, part in enumerate(parts):
        if i % 2 == 0:
            for ch in part:
                if pos == len(text):
                    return True
                if text[pos] != ch:
                    return False
                pos += 1
            continue
        if pos == len(text):
            return True
        rx = _hole_pattern(part)
        if rx is None:  # any text: up to the next literal, when the line shows it
            nxt = parts[i + 1] if i + 1 < len(parts) else ""
            if not nxt:
                return True
            found = text.find(nxt, pos)
            if found < 0:
                return True
            pos = found
            continue
        m = rx.match(text, pos)
        if m is None:
            return False
        pos = m.end()
    return True


@lru_cache(maxsize=4096)
def with_fragment_shaped(fragment: str, text: str) -> frozenset[str]:
    """Releases whose line printing ``fragment`` can read ``text`` (the line from the fragment on):
    a typed template of theirs matches (:func:`shape_matches`), or no template of theirs was read."""
    entry = facts()["log_lines"].get(fragment) or {}
    shapes = entry.get("shapes", {})
    matching: set = set()
    shaped: set = set()
    for sh, iv in shapes.items():
        rel = _expand(iv)
        shaped |= rel
        if shape_matches(sh, text):
            matching |= rel
    return frozenset(matching) | (with_fragment(fragment) - shaped)


def fragment_sites(fragment: str) -> dict[str, frozenset[str]]:
    entry = facts()["log_lines"].get(fragment) or {"sites": {}}
    return {s: _expand(iv) for s, iv in entry["sites"].items()}


def _changes(section: str) -> list:
    return facts()[section]


def _at(section: str, version: Any):
    """The value of a change-point table for ``version`` (a release string, ``VllmVersion`` or
    tuple): the row of the newest release read at or below it (patch releases of one triple:
    the last)."""
    key = version_key(version)
    rows = _changes(section)
    chosen = rows[0][1]
    for release, value in rows:
        if release_key(release) <= key:
            chosen = value
    return chosen


def version_key(version: Any) -> tuple[int, int, int]:
    """A release string, ``VllmVersion`` (``.key``) or tuple as ``(major, minor, patch)``."""
    key = getattr(version, "key", None)
    if key is not None:
        return tuple(key)  # type: ignore[return-value]
    if isinstance(version, str):
        return release_key(version)
    t = tuple(version)[:3]
    return tuple(t) + (0,) * (3 - len(t))  # type: ignore[return-value]


def release_of(version: Any) -> str | None:
    """The release read for ``version``: the last release with the same ``(major, minor, patch)``,
    else the newest below it; a release string that was read is itself. None below the oldest."""
    if isinstance(version, str) and version.strip() in releases():
        return version.strip()
    key = version_key(version)
    chosen = None
    for r in releases():
        if release_key(r) <= key:
            chosen = r
    return chosen


def quantization_methods(version: Any) -> tuple[str, ...]:
    """The ``--quantization`` names ``version`` accepts, in the release's order."""
    return tuple(_at("quantization_methods", version))


def deprecated_quantization_methods(version: Any) -> tuple[str, ...]:
    """``DEPRECATED_QUANTIZATION_METHODS`` of ``version`` (empty before 0.14)."""
    return tuple(_at("deprecated_quantization_methods", version))


def kv_cache_dtypes(version: Any) -> tuple[str, ...]:
    """The ``--kv-cache-dtype`` names ``version`` accepts."""
    return tuple(_at("kv_cache_dtypes", version))


def with_quantization(name: str) -> frozenset[str]:
    """Releases whose ``--quantization`` list has ``name``."""
    return _with_changes("quantization_methods", name)


def with_kv_cache_dtype(name: str) -> frozenset[str]:
    """Releases whose ``--kv-cache-dtype`` names include ``name``."""
    return _with_changes("kv_cache_dtypes", name)


@lru_cache(maxsize=None)
def _with_changes(section: str, name: str) -> frozenset[str]:
    rows = _changes(section)
    rel = releases()
    out = set()
    for i, (start, value) in enumerate(rows):
        end = rows[i + 1][0] if i + 1 < len(rows) else None
        lo = rel.index(start)
        hi = rel.index(end) if end is not None else len(rel)
        if name in value:
            out.update(rel[lo:hi])
    return frozenset(out)


def architectures(version: Any) -> frozenset[str]:
    """The registry's architecture names of ``version`` (its release read, :func:`release_of`)."""
    release = release_of(version)
    if release is None:
        return frozenset()
    i = releases().index(release)
    return frozenset(a for a, iv in facts()["architectures"].items() if any(lo <= i <= hi for lo, hi in iv))


def first_release(releases_set: frozenset[str]) -> str | None:
    """The oldest release of a set."""
    return min(releases_set, key=_sort_key) if releases_set else None


def newest(releases_set) -> str | None:
    return max(releases_set, key=_sort_key) if releases_set else None


def ordered(releases_set) -> list[str]:
    return sorted(releases_set, key=_sort_key)


def architecture_error(version: Any, architectures_: list[str]) -> str:
    """vLLM's error for architectures its registry of ``version`` lacks
    (``ModelRegistry._raise_for_unsupported``, ``registry.py``; the supported list shortened)."""
    for arch in architectures_:
        until = facts()["previously_supported"].get(arch)
        if until is not None and version_key(version) > release_key(until):
            return (f"Model architecture {arch} was supported in vLLM until v{until}, and is not supported anymore. "
                    "Please use an older version of vLLM if you want to use this model architecture.")
    template = _at("architecture_error", version) or \
        "Model architectures \x00 are not supported for now. Supported architectures: \x00"
    n = len(architectures(version))
    parts = template.split("\x00")
    values = [repr(list(architectures_)), f"[... {n} architectures]"]
    out = parts[0]
    for i, piece in enumerate(parts[1:]):
        out += (values[i] if i < len(values) else "") + piece
    return out

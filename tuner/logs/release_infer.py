"""Which vLLM release a log or case ran, when it does not say (no torch, no I/O).

Everything a log or a case record names is evidence about its release, checked against what each
release's wheel holds (:mod:`tuner.releases.facts`):

- the engine (V0 logs exist up to 0.10, V1 from 0.7);
- the model's architecture (the release's registry has it), its quantization method and KV-cache
  dtype (the release accepts the name);
- the memory and settings lines the log prints (the release's sources hold the text), the
  ``[file.py:line]`` of each (the release's logger call is at that line), the way its numbers are
  printed (``Model loading took 1.1201 GiB``: ``%.4f`` up to 0.13, ``format_gib``'s two decimals
  from 0.14), the prefix style
  (``[file.py:line]`` from 0.8, ``file.py:line]`` before), and lines printed apart that a release
  prints in one call (0.28+ joins "GPU KV cache size" and "Maximum concurrency");
- the flags the log or record names ("non-default args", a ``vllm serve`` command line, an
  ``LLM(...)`` call, the record's settings): the release's argparse has them.

The releases consistent with all of it are kept; evidence that would leave none (a trimmed or
re-typed line, a setting the record normalised) is set aside and reported. Of the releases left,
the newest that ctx-tuner models (:func:`tuner.memory.eras.era_for` accepts it) is assumed — said out
loud: :class:`ReleaseInference` carries the range, the evidence and ``release_assumed``, which
the output, the JSON and the uncertainty band use.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from tuner.releases import facts as rf

__all__ = ["Evidence", "ReleaseInference", "infer_release", "log_evidence", "record_evidence",
           "config_evidence"]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
#: ``[file.py:123]`` (0.8+) or `` file.py:123]`` (before): the logger's prefix.
_MARKER = re.compile(r"(\[)?((?:[\w.-]+/)*[\w.-]+\.py):(\d+)\]")
_COMMAND = re.compile(r"\bvllm serve\b|\bapi_server\b|vllm\.entrypoints")
_LONG_FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9_-]*)")
_LLM_CALL = re.compile(r"\bLLM\((.*)")
_KWARG = re.compile(r"(?<![\w.])([a-z_][a-z0-9_]*)\s*=(?!=)")

#: Quantization spellings of a checkpoint that vLLM maps to another name before its check
#: (an auto-round checkpoint becomes ``inc``: ``INCConfig.override_quantization_method``).
_CHECKPOINT_SPELLINGS = ("auto_round", "autoround", "auto-round")

#: Order in which evidence is applied; a later kind is set aside when it contradicts the earlier ones.
PRIORITY = ("engine", "architecture", "quantization", "kv_cache_dtype", "log line", "log prefix", "log marker",
            "log format", "flag", "setting")


@dataclass(frozen=True)
class Evidence:
    """One thing a log or record names and the releases consistent with it."""

    kind: str
    value: str
    releases: frozenset

    def span(self) -> str:
        """``"0.10.1.1 – 0.34.0"`` (first and last release; gaps not shown)."""
        if not self.releases:
            return "no release"
        first, last = rf.first_release(self.releases), rf.newest(self.releases)
        return first if first == last else f"{first} – {last}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value, "releases": self.span()}


@dataclass
class ReleaseInference:
    """The release assumed for a log or case that does not print one.

    Attributes:
        release: the release assumed (a wheel version, e.g. ``"0.10.1.1"``): the newest of
            ``candidates``; None when nothing modelled is consistent.
        engine: ``"V0"`` / ``"V1"``.
        candidates: every modelled release consistent with the evidence, oldest first.
        evidence: what narrowed the set; ignored: evidence set aside (it contradicted the rest).
    """

    release: str | None
    engine: str | None
    candidates: list = field(default_factory=list)
    evidence: list = field(default_factory=list)
    ignored: list = field(default_factory=list)

    @property
    def release_range(self) -> tuple[str, str] | None:
        if not self.candidates:
            return None
        return self.candidates[0], self.candidates[-1]

    def describe(self) -> str:
        """One sentence for warnings and text output."""
        if self.release is None:
            return "no modelled vLLM release is consistent with what the log names"
        lo, hi = self.release_range
        span = lo if lo == hi else f"{lo} – {hi}"
        used = "; ".join(f"{e.kind} {e.value!r} ({e.span()})" for e in self.evidence) or "nothing release-specific"
        text = (f"assumed vLLM {self.release} ({self.engine}), the newest of the {len(self.candidates)} modelled "
                f"release(s) consistent with it: {span}; from {used}")
        if self.ignored:
            text += "; set aside as contradicting the rest: " + "; ".join(
                f"{e.kind} {e.value!r} ({e.span()})" for e in self.ignored)
        return text

    def to_dict(self) -> dict:
        """The JSON form: ``release``, ``release_assumed`` (always true: nothing printed it),
        ``release_range`` ``[first, last]``, ``release_candidates``, ``evidence``, ``ignored``."""
        rng = self.release_range
        return {"release": self.release, "engine": self.engine, "release_assumed": True,
                "release_range": list(rng) if rng else None, "release_candidates": list(self.candidates),
                "evidence": [e.to_dict() for e in self.evidence], "ignored": [e.to_dict() for e in self.ignored]}


# ---------------------------------------------------------------------------------------------
# evidence
# ---------------------------------------------------------------------------------------------


def _top_level_keys(text: str) -> list[str]:
    """Keys of the outermost ``{...}`` in ``text`` (a printed dict, possibly cut or elided)."""
    start = text.find("{")
    if start < 0:
        return []
    try:
        value = ast.literal_eval(text[start:])
        if isinstance(value, dict):
            return [str(k) for k in value]
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        pass
    keys, depth, i = [], 0, start
    quote = None
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            if depth == 1:
                m = re.match(r"(['\"])(\w+)\1\s*:", text[i:])
                if m:
                    keys.append(m.group(2))
                    i += m.end()
                    continue
            quote = c
        elif c in "{[(":
            depth += 1
        elif c in "}])":
            depth -= 1
            if depth <= 0:
                break
        i += 1
    return keys


def _flag_evidence(dest: str, kind: str = "flag") -> Evidence | None:
    if not rf.known_flag(dest):
        return None
    return Evidence(kind, dest, rf.with_flag(dest))


def log_evidence(lines: Iterable[str]) -> list[Evidence]:
    """Evidence in a log's lines: fragments of memory / settings lines, their ``[file.py:line]``,
    the prefix style, and the flags of "non-default args", command lines and ``LLM(...)`` calls."""
    out: list[Evidence] = []
    seen: set = set()

    def add(ev: Evidence | None) -> None:
        if ev is not None and (ev.kind, ev.value) not in seen:
            seen.add((ev.kind, ev.value))
            out.append(ev)

    fragments = rf.log_fragments()
    per_line: list[list[str]] = []
    for raw in lines:
        line = _ANSI.sub("", str(raw))
        found = [f for f in fragments if f in line]
        marker = _MARKER.search(line)
        # a line with the logger's prefix is verbatim: its layout and number formats are evidence
        # too (a record's re-typed or summarised line is not: only its words count)
        verbatim = marker is not None and any(marker.start() < line.find(f) for f in found)
        if found and verbatim:
            per_line.append(found)
        for f in found:
            add(Evidence("log line", f, rf.with_fragment(f)))
            if verbatim:
                tail = line[line.find(f):].rstrip()
                add(Evidence("log format", tail[:120], rf.with_fragment_shaped(f, tail)))
            if marker is not None and rf.fragment_has_sites(f) and marker.start() < line.find(f):
                site = f"{marker.group(2).rsplit('/', 1)[-1]}:{marker.group(3)}"
                add(Evidence("log marker", f"[{site}] {f}", rf.with_fragment_at(f, site)))
        if marker is not None and (found or re.search(r"\b(?:INFO|DEBUG|WARNING|ERROR)\b", line)):
            style = "bracket" if marker.group(1) else "plain"
            before = line[:marker.start()]
            if style == "bracket" or before.endswith(" ") or not before:
                add(Evidence("log prefix", "[file.py:line]" if style == "bracket" else "file.py:line]",
                             rf.with_log_prefix(style)))
        if "non-default args" in line:
            for key in _top_level_keys(line.split("non-default args", 1)[1]):
                add(_flag_evidence(key))
        if _COMMAND.search(line):
            for name in _LONG_FLAG.findall(line):
                dest = name.replace("-", "_")
                if not rf.known_flag(dest) and dest.startswith("no_") and rf.known_flag(dest[3:]):
                    dest = dest[3:]
                add(_flag_evidence(dest))
        m = _LLM_CALL.search(line)
        if m:
            for key in _KWARG.findall(m.group(1)):
                add(_flag_evidence(key))
    everywhere = {f for found in per_line for f in found}
    for found in per_line:  # fragments one release prints in one call, printed here on separate verbatim lines
        for a in found:
            for b in sorted(everywhere - set(found)):
                add(Evidence("log format", f"{a!r} on a line without {b!r}", rf.with_fragment_apart(a, b)))
    return out


def record_evidence(record: dict) -> list[Evidence]:
    """Evidence in a case record: its engine, quantization, KV-cache dtype and the settings it
    names (non-null keys that are vLLM flags)."""
    out: list[Evidence] = []
    engine = str(record.get("engine") or "").upper()
    if engine in ("V0", "V1"):
        out.append(Evidence("engine", engine, rf.with_engine(engine)))
    out.extend(name_evidence(quantization=record.get("quantization"), kv_cache_dtype=record.get("kv_cache_dtype")))
    for key, value in (record.get("settings") or {}).items():
        if value is None or value is False or key == "non_default_args":
            continue
        ev = _flag_evidence(str(key), "setting")
        if ev is not None:
            out.append(ev)
    return out


def name_evidence(*, quantization: Any = None, kv_cache_dtype: Any = None) -> list[Evidence]:
    """A ``--quantization`` / ``--kv-cache-dtype`` name as evidence (``auto`` / none: nothing)."""
    out = []
    q = str(quantization or "").lower()
    if q and q not in _CHECKPOINT_SPELLINGS:
        out.append(Evidence("quantization", q, rf.with_quantization(q)))
    if kv_cache_dtype and str(kv_cache_dtype).lower() != "auto":
        kv = str(kv_cache_dtype).lower()
        out.append(Evidence("kv_cache_dtype", kv, rf.with_kv_cache_dtype(kv)))
    return out


def config_evidence(config: dict | None) -> list[Evidence]:
    """Evidence in a model's config.json: its ``architectures`` (a release loads it when its
    registry has any of them) and its checkpoint's ``quant_method`` when that is a vLLM name."""
    if not isinstance(config, dict):
        return []
    out = []
    archs = config.get("architectures")
    archs = [archs] if isinstance(archs, str) else [a for a in (archs or []) if isinstance(a, str)]
    if archs:
        having = frozenset().union(*(rf.with_architecture(a) for a in archs))
        out.append(Evidence("architecture", ",".join(archs), having))
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) and isinstance(config.get("text_config"), dict):
        qc = config["text_config"].get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") and str(qc["quant_method"]).lower() not in _CHECKPOINT_SPELLINGS:
        q = str(qc["quant_method"]).lower()
        having = rf.with_quantization(q)
        if having:
            out.append(Evidence("quantization", q, having))
    return out


# ---------------------------------------------------------------------------------------------
# inference
# ---------------------------------------------------------------------------------------------


def _modelled(release: str, engine: str) -> bool:
    from tuner.memory.eras import era_for
    from tuner.errors import EraError

    try:
        era_for(release, engine)
    except EraError:
        return False
    return True


def _default_engine(release: str) -> str:
    return "V1" if rf.release_key(release) >= (0, 8, 0) else "V0"


def infer_release(evidence: Iterable[Evidence], engine: str | None = None) -> ReleaseInference:
    """The newest modelled release consistent with ``evidence`` (applied in :data:`PRIORITY`
    order; a piece that would leave no release is set aside).

    Args:
        engine: the engine when known (``"V0"``/``"V1"``); else each release's default engine,
            or its other one when only that is consistent.
    """
    eng = (engine or "").upper()
    eng = eng if eng in ("V0", "V1") else None
    evidence = [e for e in evidence if e is not None]
    if eng is not None and not any(e.kind == "engine" for e in evidence):
        evidence.insert(0, Evidence("engine", eng, rf.with_engine(eng)))
    rank = {k: i for i, k in enumerate(PRIORITY)}
    evidence.sort(key=lambda e: rank.get(e.kind, len(PRIORITY)))

    def modelled_with(r: str) -> str | None:
        engines = [eng] if eng else [_default_engine(r), "V0" if _default_engine(r) == "V1" else "V1"]
        for e in engines:
            if r in rf.with_engine(e) and _modelled(r, e):
                return e
        return None

    current = {r for r in rf.releases() if modelled_with(r)}
    used, ignored = [], []
    for ev in evidence:
        narrowed = current & ev.releases
        if narrowed:
            if narrowed != current or ev.kind in ("engine", "architecture", "quantization", "kv_cache_dtype"):
                used.append(ev)
            current = narrowed
        else:
            ignored.append(ev)
    candidates = rf.ordered(current)
    chosen = candidates[-1] if candidates else None
    return ReleaseInference(release=chosen, engine=modelled_with(chosen) if chosen else eng,
                            candidates=candidates, evidence=used, ignored=ignored)


def infer_for_log(lines: Iterable[str], *, engine: str | None = None, config: dict | None = None,
                  quantization: Any = None, kv_cache_dtype: Any = None) -> ReleaseInference:
    """:func:`infer_release` over a log's lines, the model's config and the names the user gave."""
    lines = list(lines)
    ev = config_evidence(config) + name_evidence(quantization=quantization, kv_cache_dtype=kv_cache_dtype) \
        + log_evidence(lines)
    return infer_release(ev, engine or _engine_of(lines))


def _engine_of(lines: list) -> str | None:
    """The engine a log's lines show (:func:`tuner.logs.logparse.parse_lines`' V0 / V1 markers)."""
    from tuner.logs.logparse import parse_lines

    return parse_lines(lines).engine


def infer_for_case(case: dict, config: dict | None = None) -> ReleaseInference:
    """:func:`infer_release` over a case record (``shared/cases/README.md``): its engine, names,
    settings and ``raw_lines``, and the model's config when given."""
    lines = list(case.get("raw_lines") or [])
    ev = record_evidence(case) + config_evidence(config) + log_evidence(lines)
    engine = str(case.get("engine") or "").upper()
    return infer_release(ev, engine if engine in ("V0", "V1") else _engine_of(lines))

#!/usr/bin/env python3
"""Generate ``tuner/data/release_facts.json``: what each vLLM release names, read from its wheel.

Maintainer's tool (not imported by ctx-tuner). For every release directory under ``--src``
(``/work/vllm-src/<release>``, each holding the release's wheel as downloaded by ``pip download
vllm==<release> --no-deps`` and/or its extracted ``vllm/`` Python sources), it reads:

- **architectures**: the keys of the model registry's ``_*_MODELS`` dicts
  (``vllm/model_executor/models/registry.py``; ``vllm/model_executor/models/__init__.py`` before
  the registry module existed), without ``_PREVIOUSLY_SUPPORTED_MODELS`` / ``_OOT_SUPPORTED_MODELS``;
- **the error** the release raises for an architecture it does not have (the f-string of
  ``ModelRegistry._raise_for_unsupported`` / ``ModelRegistry.resolve_model_cls``);
- **quantization methods**: ``QuantizationMethods`` (a ``Literal``) or the ``QUANTIZATION_METHODS``
  dict/list of ``vllm/model_executor/layers/quantization/__init__.py``, and
  ``DEPRECATED_QUANTIZATION_METHODS``;
- **KV-cache dtypes**: the ``CacheDType`` ``Literal`` (``vllm/config/cache.py``, ``vllm/config.py``)
  or the ``--kv-cache-dtype`` ``choices`` of ``vllm/engine/arg_utils.py``;
- **engines**: V0 where ``vllm/worker/worker.py`` exists, V1 where ``vllm/v1/worker/gpu_worker.py``
  exists;
- **the log prefix**: ``[file.py:line]`` or ``file.py:line]`` (``_FORMAT`` of ``vllm/logger.py``);
- **flags**: the argparse destinations of ``vllm serve`` / the engine (``add_argument`` option
  strings and the fields of the ``*Args`` dataclasses under ``vllm/engine`` and
  ``vllm/entrypoints``, and ``vllm/scripts.py``'s ``vllm serve`` before 0.7), as printed in the
  "non-default args" line;
- **log lines**: for each fragment of :data:`FRAGMENTS` (the memory and settings lines
  ``tuner/logs/logparse.py`` reads), the releases whose sources hold it in a string literal, the
  ``file.py:line`` of every logger call printing it (the line of the call, what the logger
  prints), the fragments every such call prints on the same output line (``always_with``), and
  the typed shape of that line from the fragment on (``shapes``: ``\x00f4\x00`` four decimals,
  ``\x00g2\x00`` ``format_gib``'s at most two, ``\x00intc\x00`` comma-grouped, ``\x00any\x00``).

Usage::

    python tools/release_facts.py --src /work/vllm-src --out tuner/data/release_facts.json

Releases are compressed as index intervals into the sorted ``releases`` list. See
``docs/releases.md``.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import sys
import zipfile
from pathlib import Path

#: Literal fragments of the log lines used as evidence of a release (each must be a literal piece
#: of the source string, never spanning a formatted value).
FRAGMENTS = (
    "Loading model weights took",
    "Model loading took",
    "model weights take",
    "Memory profiling results:",
    "initial_memory_usage=",
    "Memory profiling takes",
    "the current vLLM instance can use",
    "the rest of the memory reserved for KV Cache is",
    "PyTorch activation peak memory takes",
    "non_torch_memory takes",
    "Available KV cache memory",
    "KV cache size:",
    "Maximum concurrency for",
    "# CPU blocks",
    "non-default args",
    "Graph capturing finished in",
    "CUDA graph pool memory",
    "Memory after warmup",
    "reduced max_model_len from",
    "Free memory on device",
    "torch peak memory increase",
    "Initial free memory",
    "Requested memory",
    "for peak activation",
    "for non-torch memory",
    "To serve at least one request with the model",
    "is larger than the maximum number of tokens that can be stored in KV cache",
    "estimated maximum model length is",
    "No available memory for the cache blocks",
    "Cannot auto-fit max_model_len",
    "Total non KV cache memory",
)

_LOG_METHODS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "info_once",
                "warning_once", "debug_once", "error_once"}
_HOLE = "\x00"


def _version_key(text: str) -> tuple:
    parts = re.findall(r"\d+|post", text)
    out = []
    for p in parts:
        out.append(0.5 if p == "post" else int(p))
    return tuple(out)


class Source:
    """The Python files of one release: its wheel when present (complete), else ``vllm/``."""

    def __init__(self, root: Path):
        self.root = root
        wheels = sorted(root.glob("vllm-*.whl"))
        self._zip = zipfile.ZipFile(wheels[0]) if wheels else None
        if self._zip is not None:
            self.files = sorted(n for n in self._zip.namelist() if n.startswith("vllm/") and n.endswith(".py"))
        else:
            self.files = sorted(str(p.relative_to(root)) for p in (root / "vllm").rglob("*.py"))

    def has(self, rel: str) -> bool:
        return rel in self._set

    @property
    def _set(self) -> set:
        if not hasattr(self, "_s"):
            self._s = set(self.files)
        return self._s

    def read(self, rel: str) -> str:
        if self._zip is not None:
            return self._zip.read(rel).decode("utf-8", "replace")
        return (self.root / rel).read_text("utf-8", "replace")

    def parse(self, rel: str) -> ast.Module | None:
        try:
            return ast.parse(self.read(rel))
        except (SyntaxError, ValueError, KeyError, OSError):
            return None


# ---------------------------------------------------------------------------------------------
# string templates of the AST
# ---------------------------------------------------------------------------------------------


def _text(node, env: dict | None = None, line: int = 0, depth: int = 0) -> str:
    """The literal text of a string expression, formatted values as ``_HOLE``."""
    if depth > 8 or node is None:
        return _HOLE
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else _HOLE
                       for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left, env, line, depth + 1) + _text(node.right, env, line, depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return _text(node.left, env, line, depth + 1)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return _text(node.func.value, env, line, depth + 1)
    if isinstance(node, ast.Name) and env:
        best = None
        for lineno, value in env.get(node.id, ()):
            if lineno <= line and (best is None or lineno > best[0]):
                best = (lineno, value)
        if best is not None:
            return _text(best[1], env, best[0], depth + 1)
    return _HOLE


def _value_type(node) -> str:
    """The shape of a formatted value: ``f<N>`` (N decimals), ``int``, ``intc`` (comma-grouped),
    ``g2`` (``format_gib``: at most 2 decimals), else ``any``."""
    if isinstance(node, ast.Call):
        fn = node.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
        if name == "format_gib":
            return "g2"
    if isinstance(node, ast.JoinedStr) and len(node.values) == 1 and isinstance(node.values[0], ast.FormattedValue):
        return _spec_type(node.values[0])
    return "any"


def _spec_type(fv: ast.FormattedValue) -> str:
    spec = _text(fv.format_spec) if fv.format_spec is not None else ""
    if _HOLE in spec:
        return "any"
    m = re.fullmatch(r",?\.(\d+)f", spec)
    if m:
        return f"f{m.group(1)}"
    if spec in (",", ",d"):
        return "intc"
    if spec == "d":
        return "int"
    if not spec:
        return _value_type(fv.value)
    return "any"


def _typed(node, env: dict | None = None, line: int = 0, depth: int = 0) -> str:
    """As :func:`_text`, holes written ``\x00TYPE\x00`` (:func:`_value_type`)."""
    if depth > 8 or node is None:
        return "\x00any\x00"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str)
                       else f"\x00{_spec_type(v)}\x00" if isinstance(v, ast.FormattedValue) else "\x00any\x00"
                       for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _typed(node.left, env, line, depth + 1) + _typed(node.right, env, line, depth + 1)
    if isinstance(node, ast.Name) and env:
        best = None
        for lineno, value in env.get(node.id, ()):
            if lineno <= line and (best is None or lineno > best[0]):
                best = (lineno, value)
        if best is not None:
            return _typed(best[1], env, best[0], depth + 1)
    return "\x00any\x00"


_PCT = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d+|\*)?(?:\.(\d+))?([sdifgeExXr%])")


def shape(call: ast.Call, env: dict, line: int) -> str:
    """The typed template of a logger call: its message with %-specs typed by their argument."""
    text = _typed(call.args[0], env, line)
    args = call.args[1:]
    k = 0
    out = []
    last = 0
    for m in _PCT.finditer(text):
        out.append(text[last:m.start()])
        last = m.end()
        conv = m.group(3)
        if conv == "%":
            out.append("%")
            continue
        arg = args[k] if k < len(args) else None
        k += 1
        if conv in "di":
            out.append("\x00int\x00")
        elif conv == "f":
            out.append(f"\x00f{m.group(2) if m.group(2) is not None else 6}\x00")
        elif conv == "s" and arg is not None:
            out.append(f"\x00{_value_type(arg)}\x00")
        else:
            out.append("\x00any\x00")
    out.append(text[last:])
    return "".join(out)


def _is_logger_call(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in _LOG_METHODS and node.args):
        return False
    owner = node.func.value
    if isinstance(owner, ast.Name):
        return "log" in owner.id.lower()
    if isinstance(owner, ast.Attribute):
        return "log" in owner.attr.lower()
    return False


def _scopes(tree: ast.Module):
    """Each function (and the module) with its name → assignments environment."""
    for node in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        env: dict = {}
        body_nodes = node.body if isinstance(node, ast.Module) else [node]
        for sub in body_nodes:
            for n in ast.walk(sub):
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                    env.setdefault(n.targets[0].id, []).append((n.lineno, n.value))
                elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None:
                    env.setdefault(n.target.id, []).append((n.lineno, n.value))
        yield node, env


def log_fragments(src: Source) -> tuple[dict, dict, dict, dict]:
    """``(present, sites, always_with)``: fragment → True when a string literal holds it;
    fragment → the set of ``file.py:line`` of logger calls printing it; fragment → the fragments
    every one of its logger calls prints on the same output line (the message split at ``\n``);
    fragment → the typed templates (:func:`shape`) of its output line, from the fragment on."""
    probes = {f: f[:14] for f in FRAGMENTS}
    present: dict[str, bool] = {}
    sites: dict[str, set] = {}
    together: dict[str, list] = {}
    shapes: dict[str, set] = {}
    for rel in src.files:
        text = src.read(rel)
        hit = [f for f, p in probes.items() if p in text]
        if not hit:
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        base = rel.rsplit("/", 1)[-1]
        for n in ast.walk(tree):
            if isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant) and isinstance(n.value, str)):
                t = _text(n)
                for f in hit:
                    if f in t:
                        present[f] = True
        for scope, env in _scopes(tree):
            walker = ast.walk(scope) if not isinstance(scope, ast.Module) else \
                (n for stmt in scope.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 for n in ast.walk(stmt))
            for n in walker:
                if not _is_logger_call(n):
                    continue
                t = _text(n.args[0], env, n.lineno)
                for f in hit:
                    if f in t:
                        present[f] = True
                        sites.setdefault(f, set()).add(f"{base}:{n.lineno}")
                for segment in t.split("\n"):
                    inside = {f for f in hit if f in segment}
                    for f in inside:
                        together.setdefault(f, []).append(inside - {f})
                for segment in shape(n, env, n.lineno).split("\n"):
                    for f in hit:
                        if f in segment:
                            shapes.setdefault(f, set()).add(segment[segment.index(f):])
    always_with = {f: sorted(set.intersection(*groups)) for f, groups in together.items()
                   if groups and set.intersection(*groups)}
    return present, sites, always_with, shapes


# ---------------------------------------------------------------------------------------------
# registry, quantization, KV dtypes, flags, engines, logger format
# ---------------------------------------------------------------------------------------------


def _dict_keys(node) -> list[str]:
    out = []
    if isinstance(node, ast.Dict):
        for k, v in zip(node.keys, node.values):
            if isinstance(k, ast.Constant) and isinstance(k.value, str):
                out.append(k.value)
    return out


def architectures(src: Source) -> tuple[list[str], str | None, dict]:
    """Registry keys, the unsupported-architecture error template, previously supported map."""
    rel = "vllm/model_executor/models/registry.py"
    if not src.has(rel):
        rel = "vllm/model_executor/models/__init__.py"
    tree = src.parse(rel)
    names: list[str] = []
    previous: dict = {}
    if tree is None:
        return names, None, previous
    for node in tree.body:
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            value = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets, value = [node.target.id], node.value
        for t in targets:
            if not t.endswith("_MODELS"):
                continue
            if "PREVIOUSLY" in t:
                for k, v in zip(value.keys, value.values):
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant):
                        previous[k.value] = v.value
                continue
            if "OOT" in t:
                continue
            names.extend(_dict_keys(value))
    error = None
    for path in [rel] + [f for f in src.files if f.startswith("vllm/model_executor/") and f != rel]:
        text = src.read(path)
        if "are not supported for now" not in text:
            continue
        other = tree if path == rel else ast.parse(text)
        for n in ast.walk(other):
            if isinstance(n, ast.JoinedStr) or (isinstance(n, ast.Constant) and isinstance(n.value, str)):
                t = _text(n)
                if "are not supported for now" in t:
                    error = t
                    break
        if error:
            break
    return sorted(set(names)), error, previous


def _literal_strings(node) -> list[str]:
    if isinstance(node, ast.Subscript):  # Literal["a", "b"]
        sl = node.slice
        elts = sl.elts if isinstance(sl, ast.Tuple) else [sl]
        return [e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    if isinstance(node, ast.Dict):
        return _dict_keys(node)
    if isinstance(node, ast.Call) and node.args:  # list(...) / dict(...)
        return _literal_strings(node.args[0])
    return []


def quantization(src: Source) -> tuple[list[str], list[str]]:
    tree = src.parse("vllm/model_executor/layers/quantization/__init__.py")
    methods: list[str] = []
    deprecated: list[str] = []
    if tree is None:
        return methods, deprecated
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names, value = [t.id for t in node.targets if isinstance(t, ast.Name)], node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names, value = [node.target.id], node.value
        else:
            continue
        if "QuantizationMethods" in names:
            methods = _literal_strings(value)
        elif "QUANTIZATION_METHODS" in names and not methods:
            methods = _literal_strings(value)
        elif "DEPRECATED_QUANTIZATION_METHODS" in names:
            deprecated = _literal_strings(value)
    if not methods:  # 0.4.0: the --quantization choices of vllm/engine/arg_utils.py
        methods = _choices(src, "--quantization")
    return methods, deprecated


def _choices(src: Source, option: str) -> list[str]:
    tree = src.parse("vllm/engine/arg_utils.py")
    for n in ast.walk(tree) if tree else []:
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
                and n.args and isinstance(n.args[0], ast.Constant) and n.args[0].value == option):
            for kw in n.keywords:
                if kw.arg == "choices":
                    return _literal_strings(kw.value)
    return []


def kv_cache_dtypes(src: Source) -> list[str]:
    for rel in ("vllm/config/cache.py", "vllm/config.py"):
        if not src.has(rel):
            continue
        tree = src.parse(rel)
        for node in (tree.body if tree else []):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "CacheDType"
                                                    for t in node.targets):
                return _literal_strings(node.value)
    return _choices(src, "--kv-cache-dtype")


def flags(src: Source) -> set[str]:
    out: set[str] = set()
    for rel in src.files:
        if not (rel.startswith("vllm/engine/") or rel.startswith("vllm/entrypoints/") or rel == "vllm/scripts.py"):
            continue
        text = src.read(rel)
        if "add_argument" not in text and "Args" not in text:
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef) and n.name.endswith("Args"):
                for stmt in n.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                            and not stmt.target.id.startswith("_"):
                        out.add(stmt.target.id)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument":
                dest = next((kw.value.value for kw in n.keywords if kw.arg == "dest"
                             and isinstance(kw.value, ast.Constant)), None)
                opts = [a.value for a in n.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                if dest:
                    out.add(dest)
                elif opts:
                    long = [o for o in opts if o.startswith("--")] or opts
                    out.add(long[0].lstrip("-").replace("-", "_"))
    return out


def engines(src: Source) -> list[str]:
    out = []
    if src.has("vllm/worker/worker.py"):
        out.append("V0")
    if src.has("vllm/v1/worker/gpu_worker.py"):
        out.append("V1")
    return out


def log_prefix(src: Source) -> str | None:
    if not src.has("vllm/logger.py"):
        return None
    text = src.read("vllm/logger.py")
    if re.search(r"\[%\((?:filename|fileinfo)\)s:%\(lineno\)d\]", text):
        return "bracket"
    if re.search(r"%\((?:filename|fileinfo)\)s:%\(lineno\)d\]", text):
        return "plain"
    return None


# ---------------------------------------------------------------------------------------------
# assembly
# ---------------------------------------------------------------------------------------------


def intervals(indexes) -> list[list[int]]:
    out: list[list[int]] = []
    for i in sorted(set(indexes)):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def read_release(root: Path) -> dict:
    src = Source(root)
    archs, error, previous = architectures(src)
    methods, deprecated = quantization(src)
    present, sites, always_with, shapes = log_fragments(src)
    return {"architectures": archs, "architecture_error": error, "previously_supported": previous,
            "quantization_methods": methods, "deprecated_quantization_methods": deprecated,
            "kv_cache_dtypes": kv_cache_dtypes(src), "engines": engines(src), "log_prefix": log_prefix(src),
            "flags": sorted(flags(src)), "present": sorted(present), "sites": {f: sorted(s) for f, s in sites.items()},
            "always_with": always_with, "shapes": {f: sorted(v) for f, v in shapes.items()}}


def assemble(per: dict[str, dict]) -> dict:
    releases = sorted(per, key=_version_key)
    idx = {r: i for i, r in enumerate(releases)}

    def collect(getter) -> dict:
        acc: dict = {}
        for r in releases:
            for name in getter(per[r]):
                acc.setdefault(name, []).append(idx[r])
        return {k: intervals(v) for k, v in sorted(acc.items())}

    def changes(key: str) -> list:
        out, last = [], None
        for r in releases:
            value = per[r][key]
            if value != last:
                out.append([r, value])
                last = value
        return out

    log_lines = {}
    for f in FRAGMENTS:
        rel = [idx[r] for r in releases if f in per[r]["present"]]
        site_acc: dict = {}
        for r in releases:
            for s in per[r]["sites"].get(f, ()):
                site_acc.setdefault(s, []).append(idx[r])
        with_acc: dict = {}
        for r in releases:
            for other in per[r].get("always_with", {}).get(f, ()):
                with_acc.setdefault(other, []).append(idx[r])
        shape_acc: dict = {}
        for r in releases:
            for sh in per[r].get("shapes", {}).get(f, ()):
                shape_acc.setdefault(sh, []).append(idx[r])
        log_lines[f] = {"releases": intervals(rel), "sites": {s: intervals(v) for s, v in sorted(site_acc.items())},
                        "always_with": {o: intervals(v) for o, v in sorted(with_acc.items())},
                        "shapes": {sh: intervals(v) for sh, v in sorted(shape_acc.items())}}
    flag_span = {}
    for name, iv in collect(lambda d: d["flags"]).items():
        flag_span[name] = [iv[0][0], iv[-1][1]]  # gaps filled: a flag lives from first to last release seen
    previous: dict = {}
    for r in releases:
        for arch, until in per[r]["previously_supported"].items():
            previous.setdefault(arch, until)
    return {
        "generated_by": "tools/release_facts.py",
        "source": "vLLM wheels (pip download vllm==X --no-deps): registry.py, quantization/__init__.py, "
                  "config CacheDType, engine/entrypoints argparse, logger.py, logger calls",
        "releases": releases,
        "engines": collect(lambda d: d["engines"]),
        "log_prefix": collect(lambda d: [d["log_prefix"]] if d["log_prefix"] else []),
        "architectures": collect(lambda d: d["architectures"]),
        "architecture_error": changes("architecture_error"),
        "previously_supported": dict(sorted(previous.items())),
        "quantization_methods": changes("quantization_methods"),
        "deprecated_quantization_methods": changes("deprecated_quantization_methods"),
        "kv_cache_dtypes": changes("kv_cache_dtypes"),
        "flags": dict(sorted(flag_span.items())),
        "log_lines": log_lines,
    }


def dump(facts: dict) -> str:
    """One top-level key per line group, compact inside (a small, diffable file)."""
    buf = io.StringIO()
    buf.write("{\n")
    items = list(facts.items())
    for i, (k, v) in enumerate(items):
        if isinstance(v, dict) and k in ("architectures", "flags", "log_lines", "engines", "log_prefix",
                                          "previously_supported"):
            buf.write(f"{json.dumps(k)}: {{\n")
            sub = list(v.items())
            for j, (sk, sv) in enumerate(sub):
                buf.write(f"  {json.dumps(sk)}: {json.dumps(sv, separators=(',', ':'))}{',' if j < len(sub) - 1 else ''}\n")
            buf.write("}")
        elif isinstance(v, list) and k != "releases":
            buf.write(f"{json.dumps(k)}: [\n")
            for j, row in enumerate(v):
                buf.write(f"  {json.dumps(row, separators=(',', ':'))}{',' if j < len(v) - 1 else ''}\n")
            buf.write("]")
        else:
            buf.write(f"{json.dumps(k)}: {json.dumps(v, separators=(', ', ': '))}")
        buf.write(",\n" if i < len(items) - 1 else "\n")
    buf.write("}\n")
    return buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default="/work/vllm-src", help="directory of <release>/ folders")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tuner" / "data" / "release_facts.json"))
    ap.add_argument("--releases", nargs="*", help="only these releases (default: every folder with a wheel or DONE)")
    ap.add_argument("--cache", help="JSON file caching each release's facts between runs")
    args = ap.parse_args(argv)
    src = Path(args.src)
    cache = {}
    if args.cache and Path(args.cache).is_file():
        cache = json.loads(Path(args.cache).read_text())
    per = {}
    for d in sorted(src.iterdir()):
        if not re.fullmatch(r"\d+\.\d+\.\d+(?:\.\d+|\.post\d+)?", d.name):
            continue
        if args.releases and d.name not in args.releases:
            continue
        if not (list(d.glob("vllm-*.whl")) or ((d / "DONE").exists() and (d / "vllm" / "logger.py").exists())):
            print(f"skip {d.name}: no wheel and no complete sources", file=sys.stderr)
            continue
        if d.name in cache:
            per[d.name] = cache[d.name]
            continue
        print(f"reading {d.name}", file=sys.stderr)
        per[d.name] = read_release(d)
        cache[d.name] = per[d.name]
        if args.cache:
            Path(args.cache).write_text(json.dumps(cache))
    facts = assemble(per)
    Path(args.out).write_text(dump(facts))
    print(f"wrote {args.out}: {len(facts['releases'])} releases, {len(facts['architectures'])} architectures",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

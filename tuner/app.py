"""Composition root: builds the collaborators of the ``profile`` job and wires them together.

drop file → validated :class:`~tuner.drop.Drop` → device → model config path → worker subprocess
(spec, plugin, passes, candidates, proposals) → one database transaction. Never imports torch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from tuner.drop import Drop, load_drop
from tuner.errors import DropError, ModelConfigError
from tuner.modelspec import resolve_model_path
from tuner.store import Store, open_store, utc_text
from tuner.worker import DEFAULT_TIMEOUT_S, run_in_worker


@dataclass
class ProfileOutcome:
    """What ``profile`` produced: the worker's result plus the database ids."""

    drop: Drop
    device: dict
    result: dict[str, Any]
    drop_id: int | None = None
    warnings: list[str] = field(default_factory=list)
    #: the drop text that was profiled; None = read it from ``drop.path`` when storing.
    content: str | None = None


def _pass_sha256(result: dict, run: dict, drop: Drop, device: dict) -> str:
    key = {
        "model_config_sha256": result["model"]["config_sha256"], "dtype": result["dtype"],
        "kv_cache_dtype": drop.kv_cache_dtype, "quantization": drop.quantization,
        "max_num_batched_tokens": run["max_num_batched_tokens"], "num_reqs": run["num_reqs"],
        "tensor_parallel_size": drop.tensor_parallel_size, "pipeline_parallel_size": drop.pipeline_parallel_size,
        "pp_rank": run["pp_rank"], "method": drop.method, "era": result["era"], "device": device["name"],
        "tool": result["versions"]["tool"],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def rows_for_store(outcome: ProfileOutcome, *, started_at: str) -> tuple[dict, list, list, list]:
    """Map a job result onto the ``drops``/``profile_runs``/``candidates``/``proposals`` rows."""
    d, r, dev = outcome.drop, outcome.result, outcome.device
    drop_row = {"name": d.name, "path": d.path, "content_sha256": d.content_sha256,
                "content": outcome.content if outcome.content is not None
                else (open(d.path, encoding="utf-8").read() if d.path else ""),
                "model": d.model, "device_name": dev["name"], "engine_version": d.engine_version, "method": d.method}
    runs = []
    for run in r["runs"]:
        runs.append({
            "key": run["key"], "pass_sha256": _pass_sha256(r, run, d, dev), "status": "ok", "error": None,
            "method": d.method, "engine_version": d.engine_version, "era": r["era"], "model": d.model,
            "model_config_sha256": r["model"]["config_sha256"], "architecture": ",".join(r["model"]["architectures"]),
            "plugin": r["plugin"], "device_name": dev["name"], "device_total_memory_bytes": dev["total_memory_bytes"],
            "dtype": r["dtype"], "kv_cache_dtype": d.kv_cache_dtype, "tensor_parallel_size": d.tensor_parallel_size,
            "pipeline_parallel_size": d.pipeline_parallel_size, "max_num_batched_tokens": run["max_num_batched_tokens"],
            "max_num_seqs": run["max_num_seqs"], "num_sampled_rows": run["num_reqs"],
            "weights_bytes": run["weights_bytes"], "activation_peak_bytes": run["activation_peak_bytes"],
            "forward_peak_bytes": run["forward_peak_bytes"], "sampler_peak_bytes": run["sampler_peak_bytes"],
            "tool_version": r["versions"]["tool"], "torch_version": r["versions"]["torch"],
            "transformers_version": r["versions"]["transformers"], "started_at": started_at,
            "elapsed_s": run["elapsed_s"],
        })
    cand_cols = ("gpu_memory_utilization", "max_model_len", "max_num_batched_tokens", "fits", "reason",
                 "requested_memory_bytes", "weights_bytes", "activation_peak_bytes", "non_torch_bytes",
                 "cuda_graph_bytes", "available_kv_cache_bytes", "num_gpu_blocks", "kv_cache_tokens", "max_concurrency")
    candidates = [{**{k: c[k] for k in cand_cols}, "run_key": c["run_key"]} for c in r["candidates"]]
    prop_cols = ("gpu_memory_utilization", "max_model_len", "num_gpu_blocks", "kv_cache_tokens", "max_concurrency",
                 "vllm_args", "reason")
    proposals = [{k: p[k] for k in prop_cols} for p in r["proposals"]]
    return drop_row, runs, candidates, proposals


def prepare_request(drop: Drop, *, nvml: Any = None, trust_remote_code: bool = False) -> tuple[dict, dict]:
    """The worker request for a validated drop, and the resolved device ``{name, total_memory_bytes}``.

    Checks the method is available, resolves the device (``auto`` through NVML) and finds the
    model's config.json offline. No torch, no database.

    Raises:
        DropError: unavailable ``method`` or unknown ``model`` (field named).
        DeviceError: the device cannot be resolved.
    """
    if drop.method not in ("simulate", "auto"):
        raise DropError(f"method {drop.method!r} needs a GPU host and is not available in this build; "
                        "use 'simulate'", path=drop.path, field="method")
    device = drop.resolve_device(nvml=nvml)
    try:
        config_path = resolve_model_path(drop.model, drop.base_dir)
    except ModelConfigError as exc:
        raise DropError(exc.message, path=drop.path, field="model") from exc
    dev = {"name": device.name, "total_memory_bytes": device.total_memory_bytes}
    request = {"drop": drop.to_dict(), "config_path": str(config_path), "device": dev}
    if trust_remote_code:
        request["trust_remote_code"] = True
    return request, dev


def profile(drop_path: str, *, db_url: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
            store_factory: Callable[..., Store] = open_store, worker: Callable[..., dict] = run_in_worker,
            nvml: Any = None) -> ProfileOutcome:
    """Run the main job for one drop file and store everything in one transaction.

    Raises:
        DropError: the drop is invalid (names file and field).
        ModelConfigError: the model's config.json cannot be found offline.
        DeviceError, WorkerError, StoreError, TunerError: as their names say; nothing is written.
    """
    drop = load_drop(drop_path)
    request, dev = prepare_request(drop, nvml=nvml)
    started = utc_text()
    result = worker(request, job=drop.name, timeout_s=timeout_s)
    outcome = ProfileOutcome(drop, dev, result, warnings=list(result.get("warnings", [])))
    store = store_factory(db_url)
    try:
        outcome.drop_id = store.save_result(*rows_for_store(outcome, started_at=started))
    finally:
        store.close()
    return outcome

"""Composition root: builds the collaborators of the ``profile`` job and wires them together.

drop file → validated :class:`~tuner.drop.Drop` → method (``auto`` resolved by what the host
has) → device → model config path → calibration from the store (simulate) → worker subprocess
(spec, plugin, passes — simulated, measured on the GPU, or vLLM start-ups — candidates, proposals)
→ one database transaction. Never imports torch.

Where the numbers live (``profile --json`` and the store):

- ``result["method"]``: the method actually run (``simulate``/``cuda``/``vllm``), also written to
  every ``profile_runs.method``; ``drops.method`` keeps what the drop asked for (``auto`` too).
- ``result["calibration"]``: the corrections applied (bytes per term and ``runs``) or None.
  Candidates and proposals (and the ``candidates``/``proposals`` rows) are the *calibrated*
  prediction; with a calibration each candidate and proposal also carries ``uncalibrated``: the
  same fields without the corrections (JSON only, not stored).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from tuner.drop import Drop, load_drop
from tuner.errors import DeviceError, DropError, ModelConfigError
from tuner.modelspec import resolve_model_path
from tuner.store import Store, open_store, store_exists, utc_text
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
    #: the fleet's shared result key (:func:`tuner.fleet.result_key`) when the daemon computed one.
    result_sha256: str | None = None

    @property
    def method(self) -> str:
        """The method that produced the result: the worker's ``method``, else the drop's
        (``auto`` without a worker answer counts as ``simulate``)."""
        return method_used(self.drop, self.result)


def serve_model(drop: Drop) -> str:
    """The model argument of ``vllm serve`` for a drop: the absolute model directory for a local
    path (the drop's ``model`` is relative to the drop file, not to where the command runs; a
    path to a ``config.json`` gives its directory), an HF id (``org/name`` with no such local
    path) unchanged."""
    try:
        p = drop.model_path()
    except (OSError, ValueError):
        p = None
    if p is None:
        return drop.model
    if p.name == "config.json" or p.is_file():
        p = p.parent
    return str(p)


def method_used(drop: Drop, result: dict) -> str:
    """``result["method"]`` when the worker reported it, else the drop's method (``auto`` → simulate)."""
    m = result.get("method") or drop.method
    return "simulate" if m == "auto" else m


def _pass_sha256(result: dict, run: dict, drop: Drop, device: dict) -> str:
    key = {
        "model_config_sha256": result["model"]["config_sha256"], "dtype": result["dtype"],
        "kv_cache_dtype": drop.kv_cache_dtype, "quantization": drop.quantization,
        "max_num_batched_tokens": run["max_num_batched_tokens"], "num_reqs": run["num_reqs"],
        "tensor_parallel_size": drop.tensor_parallel_size, "pipeline_parallel_size": drop.pipeline_parallel_size,
        "pp_rank": run["pp_rank"], "method": method_used(drop, result), "era": result["era"], "device": device["name"],
        "tool": result["versions"]["tool"],
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


#: ``profile_runs`` columns a measured engine start-up fills (``vllm`` method).
_MEASURED_COLUMNS = ("gpu_memory_utilization", "max_model_len", "weights_bytes", "activation_peak_bytes",
                     "non_torch_bytes", "cuda_graph_bytes", "available_kv_cache_bytes", "num_gpu_blocks",
                     "kv_cache_tokens", "max_concurrency", "error_message", "source")


def _provenance_json(result: dict) -> dict:
    """The ``term_sources`` and ``engine_check`` columns (JSON text, null when absent)."""
    out = {}
    for key in ("term_sources", "engine_check"):
        v = result.get(key)
        out[key] = json.dumps(v) if v is not None else None  # key order kept (explain prints it)
    return out


def rows_for_store(outcome: ProfileOutcome, *, started_at: str) -> tuple[dict, list, list, list]:
    """Map a job result onto the ``drops``/``profile_runs``/``candidates``/``proposals`` rows.

    Each pass row's ``method`` is the method that produced it (``simulate`` or ``cuda``); a
    ``vllm`` job adds one ``method='vllm'`` row per engine start-up (status ``failed`` with the
    engine's error where it refused; a start of a CPU build is kept under ``device_name='cpu'``
    with its ``source`` naming ``VLLM_CPU_KVCACHE_SPACE``, and never calibrates). Candidates and
    proposals are stored as predicted
    (calibrated where a calibration applied). The ``candidates.fits`` column is the candidate's
    ``fits``: vLLM starts *and* the drop's constraints (``min_concurrency``) are met; ``starts``
    (vLLM's own verdict) is not a column — a row with ``fits`` false whose ``reason`` begins
    "only …" started but missed ``min_concurrency``."""
    d, r, dev = outcome.drop, outcome.result, outcome.device
    drop_row = {"name": d.name, "path": d.path, "content_sha256": d.content_sha256,
                "content": outcome.content if outcome.content is not None
                else (open(d.path, encoding="utf-8").read() if d.path else ""),
                "model": serve_model(d), "device_name": dev["name"], "engine_version": d.engine_version, "method": d.method,
                "warnings": json.dumps([str(w) for w in outcome.warnings]) if outcome.warnings else None}
    runs = []
    for run in r["runs"]:
        runs.append({
            "key": run["key"], "pass_sha256": _pass_sha256(r, run, d, dev), "status": "ok", "error": None,
            "method": outcome.method, "engine_version": d.engine_version, "era": r["era"], "model": d.model,
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
        runs[-1]["method"] = run.get("method") or runs[-1]["method"]
        runs[-1].update(_provenance_json(r))
        if run.get("non_torch_bytes") is not None:  # measured on the GPU (cuda)
            runs[-1]["non_torch_bytes"] = int(run["non_torch_bytes"])
    for i, m in enumerate(r.get("measured") or []):  # vllm: one engine start-up per needed candidate
        base = {k: v for k, v in runs[0].items() if k not in _MEASURED_COLUMNS} if runs else {}
        key = {"pass": base.get("pass_sha256"), "u": m["gpu_memory_utilization"], "m": m["max_model_len"],
               "method": "vllm", "started_at": started_at, "i": i}
        runs.append({**base, "key": f"vllm:{i}", "method": "vllm", "status": "failed" if m.get("failed") else "ok",
                     "error": m["error_message"] if m.get("failed") else None, "pass_sha256": hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest(),
                     "max_num_batched_tokens": m["max_num_batched_tokens"], "max_num_seqs": m["max_num_seqs"],
                     "num_sampled_rows": m["num_reqs"], "forward_peak_bytes": None, "sampler_peak_bytes": None,
                     "elapsed_s": m["elapsed_s"], **{k: m.get(k) for k in _MEASURED_COLUMNS}})
        if m.get("block_size") is not None:
            runs[-1]["block_size"] = m["block_size"]
        if m.get("engine_device") == "cpu":  # a CPU build (vllm-cpu): the engine's device, not the drop's GPU
            runs[-1].update(device_name="cpu", device_total_memory_bytes=None)
    cand_cols = ("gpu_memory_utilization", "max_model_len", "max_num_batched_tokens", "fits", "reason",
                 "requested_memory_bytes", "weights_bytes", "activation_peak_bytes", "non_torch_bytes",
                 "cuda_graph_bytes", "available_kv_cache_bytes", "num_gpu_blocks", "kv_cache_tokens", "max_concurrency")
    candidates = [{**{k: c[k] for k in cand_cols}, "run_key": c["run_key"]} for c in r["candidates"]]
    prop_cols = ("gpu_memory_utilization", "max_model_len", "num_gpu_blocks", "kv_cache_tokens", "max_concurrency",
                 "vllm_args", "reason")
    proposals = [{k: p[k] for k in prop_cols} for p in r["proposals"]]
    return drop_row, runs, candidates, proposals


def resolve_method(drop: Drop, *, nvml: Any = None) -> str:
    """The method to run for a drop on this host: ``simulate`` as is; ``auto`` → ``vllm`` (GPU
    via NVML and vllm importable), else ``cuda`` (GPU), else ``simulate``; ``cuda``/``vllm`` only
    where the host has what they need. No torch, no vllm import.

    Raises:
        DropError: ``method`` is cuda or vllm and this host has no NVIDIA GPU (NVML's reason in
            the message), or vllm is not importable (field ``method``).
    """
    from tuner.measure import has_vllm, pick_method

    if drop.method == "simulate":
        return "simulate"
    if drop.method == "auto":
        return pick_method("auto", nvml)
    from tuner.devices import require_gpu

    try:
        require_gpu(drop.method, nvml)
    except DeviceError as exc:
        raise DropError(f"method {drop.method!r} needs a GPU host: {exc.message}; use 'simulate' or 'auto'",
                        path=drop.path, field="method") from exc
    if drop.method == "vllm" and not has_vllm():
        raise DropError("method 'vllm' needs the vllm package importable on this host; use 'cuda', 'simulate' "
                        "or 'auto'", path=drop.path, field="method")
    return drop.method


def prepare_request(drop: Drop, *, nvml: Any = None, trust_remote_code: bool = False,
                    download: bool | None = None) -> tuple[dict, dict]:
    """The worker request for a validated drop, and the resolved device ``{name, total_memory_bytes}``.

    Resolves the method (:func:`resolve_method`; the request's ``method`` key is what the worker
    runs, ``method_requested`` what the drop asked), the device (``auto`` through NVML) and finds
    the model's config.json offline. No torch, no database.

    Raises:
        DropError: unavailable ``method`` or unknown ``model`` (field named).
        DeviceError: the device cannot be resolved.
    """
    method = resolve_method(drop, nvml=nvml)
    device = drop.resolve_device(nvml=nvml)
    try:
        if download is None:  # the CLI: fetch a missing HF config unless HF_HUB_OFFLINE says no
            from tuner.hub import offline

            download = not offline()
        config_path = resolve_model_path(drop.model, drop.base_dir, download=download, revision=drop.revision)
    except ModelConfigError as exc:
        raise DropError(exc.message, path=drop.path, field="model") from exc
    dev = {"name": device.name, "total_memory_bytes": device.total_memory_bytes}
    # the topology a drop's device mapping states travels with the request (tuner.budget.Topology)
    extra = {k: getattr(device, k) for k in ("compute_capability", "interconnect", "p2p")
             if isinstance(drop.device, dict) and k in drop.device}
    if drop.device == "auto" and device.free_memory_bytes is not None:
        # co-tenants as vLLM's free-memory check sees them: the engine's total minus NVML's free memory
        # at job time (on an idle card NVML's free is about the CUDA total: ~0)
        extra["other_processes_bytes"] = max(0, int(device.total_memory_bytes) - int(device.free_memory_bytes))
    request = {"drop": drop.to_dict(), "config_path": str(config_path), "device": {**dev, **extra}, "method": method,
               "method_requested": drop.method}
    sc = drop.speculative_config or {}
    if sc.get("model") and sc.get("method") in ("draft_model", "eagle", "eagle3", "dflash"):
        # the drafter checkpoint's config.json, found like the target's (tuner.specdecode sizes it)
        try:
            request["draft_config_path"] = str(resolve_model_path(sc["model"], drop.base_dir, download=download))
        except ModelConfigError as exc:
            request["draft_config_error"] = exc.message
    if trust_remote_code:
        request["trust_remote_code"] = True
    return request, dev


def lookup_calibration(request: dict, store: Store) -> dict | None:
    """The stored corrections (:func:`tuner.calibrate.calibration_for`) for a simulate request's
    model config, device kind, era, TP/PP, dtype and quantization; None when none apply or the
    request does not simulate.

    Raises:
        StoreError: the query failed; ModelConfigError / EraError: as :func:`tuner.calibrate.lookup_kwargs`.
    """
    from tuner import calibrate

    if request.get("method", "simulate") != "simulate":
        return None
    kw = calibrate.lookup_kwargs(request)
    return calibrate.calibration_for(store, kw.pop("model"), kw.pop("device_name"), kw.pop("era"), **kw)


def profile(drop_path: str, *, db_url: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
            store_factory: Callable[..., Store] = open_store, worker: Callable[..., dict] = run_in_worker,
            nvml: Any = None, calibrate: bool = True, cache: bool = True) -> ProfileOutcome:
    """Run the main job for one drop file and store everything in one transaction.

    With ``calibrate`` (default) and an existing store, a simulate run applies the corrections
    learned from the store's measured runs of the same model, device kind, era and layout
    (:func:`lookup_calibration`); the result then carries ``calibration`` and, per candidate and
    proposal, ``uncalibrated``. A store that does not exist yet is not created before the job
    succeeds.

    With ``cache`` (default) a job whose model spec and passes are in the store's pass memo is
    answered from them in this process, with no worker and no torch (:mod:`tuner.passmemo`);
    ``cache=False`` (``--no-cache``) runs the worker. A worker's new memo entries are stored with
    the result, in the same transaction.

    Raises:
        DropError: the drop is invalid (names file and field), or its method cannot run here.
        ModelConfigError: the model's config.json cannot be found offline.
        DeviceError, WorkerError, StoreError, TunerError: as their names say; nothing is written.
    """
    drop = load_drop(drop_path)
    request, dev = prepare_request(drop, nvml=nvml)
    if calibrate and request["method"] == "simulate" and store_exists(db_url):
        store = store_factory(db_url)
        try:
            cal = lookup_calibration(request, store)
        finally:
            store.close()
        if cal is not None:
            request["calibration"] = cal
    started = utc_text()
    from tuner.passmemo import ENTRIES, memo_worker

    result = memo_worker(db_url, worker, enabled=cache, write=False)(request, job=drop.name, timeout_s=timeout_s)
    memo_entries = result.pop(ENTRIES, None) or []
    outcome = ProfileOutcome(drop, dev, result, warnings=list(result.get("warnings", [])))
    store = store_factory(db_url)
    try:
        rows = rows_for_store(outcome, started_at=started)
        residuals = _vllm_residuals(outcome, rows[1], store)

        def also(conn, drop_id: int) -> None:
            if residuals is not None:
                residuals(conn, drop_id)
            store.put_memo(memo_entries, conn)

        outcome.drop_id = store.save_result(*rows, also=also)
    finally:
        store.close()
    return outcome


def _vllm_residuals(outcome: ProfileOutcome, runs: list[dict], store: Store) -> Callable | None:
    """The ``save_result`` hook that stores, in the same transaction, the calibration residual of
    each ``vllm`` start-up against the (uncalibrated) simulate candidate of the same
    ``gpu_memory_utilization`` × ``max_model_len``; None when the job started no engine."""
    from tuner import calibrate

    measured = outcome.result.get("measured") or []
    if not measured:
        return None
    preds = {(c["gpu_memory_utilization"], c["max_model_len"]): c for c in outcome.result["candidates"]}

    def hook(conn, drop_id: int) -> None:
        ids = store.run_ids(conn, drop_id)
        for run_id, run, m in zip(ids[len(runs) - len(measured):], runs[len(runs) - len(measured):], measured):
            pred = preds.get((m["gpu_memory_utilization"], m["max_model_len"]))
            if pred is None or run["status"] != "ok" or m.get("engine_device") == "cpu":  # CPU: no GPU budget
                continue
            row = calibrate.residual_row({**run, "id": run_id}, pred, quantization=outcome.drop.quantization,
                                         total_known=m.get("total_memory_bytes") is not None)
            store.insert_calibration(conn, row)

    return hook

"""Calibration: correct simulate's non-torch, activation (sampler) and CUDA-graph terms from measured runs.

A measured run (``cuda``, ``vllm`` or an imported log) and a simulate prediction of the *same*
settings differ per budget term; :func:`residual` takes the difference (measured − predicted,
bytes) of

- the activation peak (vLLM's "torch peak memory increase", dominated by the dummy sampler),
- the non-torch memory ("non-torch forward increase memory"),
- the CUDA-graph estimate (only in eras whose budget subtracts it, vLLM ≥ 0.20),

and, where the log printed no breakdown, the total non-weight error
``(predicted KV − measured KV) − (measured W − predicted W)``, attributed to non-torch memory.
Weights are never corrected (a weights error is a plugin bug, not a calibration constant).

:func:`fit` turns the residuals of the runs of one group — same model config, device kind, era
and parallel layout (TP, PP: non-torch memory is mostly NCCL buffers, and a PP log reports one
stage) — into the byte corrections ``{"activation_peak_delta_bytes", "non_torch_delta_bytes",
"cuda_graph_delta_bytes"}`` that :func:`tuner.memory.search.evaluate` adds to the predicted terms. It is
deliberately conservative, so that a correction learned on some runs does not make another
run's prediction worse:

- the group is also keyed by dtype and quantization (an fp8-quantized or fp32 run of the same
  config is a different memory model);
- a run calibrates only where the prediction agrees with it on everything but these terms
  (:func:`consistency`: weights within 1 % / 128 MiB, KV bytes per token within 2 %): otherwise
  a larger, unrelated error (a weights or KV-layout miss) would be "compensated" in the wrong term;
- the total non-weight error stands in for non-torch only when the log printed the device total
  (otherwise it also holds the error of the assumed total × ``gpu_memory_utilization``);
- residuals within the print resolution (:data:`NOISE_BYTES`) count as zero;
- when the runs disagree in sign on a term, that term is not corrected (0);
- otherwise the residual of the smallest magnitude is used (every run moved at least that far),
  shrunk by ``n / (n + 1)`` for ``n`` runs (one run alone corrects half its residual);
- finally the corrections are scaled down until no calibration run's available-KV error would
  grow, or turn a safe prediction (less KV than the engine had) into an unsafe one
  (:func:`_guard`): a term can be right while errors elsewhere compensate it.

Pure functions except :func:`store_residual` / :func:`calibration_for` (database) and
:func:`tuner.accuracy.validate.leave_one_out` (runs the simulate job; worker side, imports torch).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from tuner.memory.eras import era_for

GIB = 1 << 30
MIB = 1 << 20

#: Residuals this small (bytes) are print noise: vLLM prints GiB with 2 decimals (±5 MiB per
#: figure, and a residual combines up to three figures).
NOISE_BYTES = 16 * MIB

#: The correction keys (bytes), in the order they are reported.
TERMS = ("activation_peak_delta_bytes", "non_torch_delta_bytes", "cuda_graph_delta_bytes")

__all__ = ["residual", "consistency", "fit", "aggregate", "calibration_for", "store_residual", "group_key",
           "lookup_kwargs", "TERMS", "NOISE_BYTES"]


def _era_subtracts_graphs(row: dict) -> bool:
    try:
        engine = str(row.get("era") or "").split(" ")[0] or None
        return era_for(str(row["engine_version"]), engine if engine in ("V0", "V1") else None).subtracts_cudagraph_estimate
    except Exception:  # noqa: BLE001 - an unknown era never subtracts
        return False


#: Largest weights difference (fraction of the measured weights, and absolute floor in bytes) at
#: which a run may still calibrate; and the largest KV-bytes-per-token difference (fraction).
WEIGHTS_TOLERANCE = 0.01
WEIGHTS_TOLERANCE_FLOOR = 128 * MIB
KV_LAYOUT_TOLERANCE = 0.02


def consistency(measured: dict, predicted: dict) -> str | None:
    """None when ``predicted`` agrees with ``measured`` apart from the calibrated terms, else why not:
    a pipeline-parallel run (one stage printed), weights unknown or off by more than ``max(1 %, 128 MiB)``, or KV bytes per token (available
    KV ÷ KV tokens) off by more than 2 % (a KV-layout difference: hybrid groups, sliding windows)."""
    if int(measured.get("pipeline_parallel_size") or 1) > 1:
        return "pipeline-parallel run: its log prints one stage's terms, the prediction the worst stage's"
    mw, pw = measured.get("weights_bytes"), predicted.get("weights_bytes")
    if mw is None or pw is None:
        return "weights not measured"
    if abs(int(mw) - int(pw)) > max(WEIGHTS_TOLERANCE * abs(int(mw)), WEIGHTS_TOLERANCE_FLOOR):
        return f"weights differ: measured {int(mw) / GIB:.2f} GiB, predicted {int(pw) / GIB:.2f} GiB"
    mt, mk = measured.get("kv_cache_tokens"), measured.get("available_kv_cache_bytes")
    pt, pk = predicted.get("kv_cache_tokens"), predicted.get("available_kv_cache_bytes")
    if mt and mk and pt and pk and mk > 0 and pk > 0:
        ratio = (mk / mt) / (pk / pt)
        if abs(ratio - 1.0) > KV_LAYOUT_TOLERANCE:
            return (f"KV bytes per token differ: measured {mk / mt:.0f}, predicted {pk / pt:.0f} "
                    "(KV layout not modelled alike)")
    return None


def residual(measured: dict, predicted: dict, *, total_known: bool = True) -> dict:
    """Per-term residual (measured − predicted, bytes) of one measured run against the simulate
    prediction of the same settings.

    Args:
        measured: a ``profile_runs`` row of a measured/imported run (``weights_bytes``,
            ``activation_peak_bytes``, ``non_torch_bytes``, ``cuda_graph_bytes``,
            ``available_kv_cache_bytes``, ``kv_cache_tokens``, ``engine_version``, ``era``; None =
            not printed).
        predicted: the prediction's candidate (:class:`tuner.memory.search.Candidate` as a dict).
        total_known: the run's device total is known (measured, or printed in the log); only then
            may the total non-weight error stand in for an unprinted non-torch term.

    Returns:
        ``{term: int | None for term in TERMS}``, ``total_delta_bytes`` (the KV error not
        explained by weights: ``(pred KV − meas KV) − (meas W − pred W)``; None when KV or weights
        is missing), ``usable`` (bool) and ``note`` (why not usable, or how a term was derived).
    """
    def diff(key: str) -> int | None:
        m, p = measured.get(key), predicted.get(key)
        return None if m is None or p is None else int(m) - int(p)

    out: dict[str, Any] = {"activation_peak_delta_bytes": diff("activation_peak_bytes"),
                           "non_torch_delta_bytes": diff("non_torch_bytes"), "cuda_graph_delta_bytes": None}
    # the graph term is a residual only where the budget subtracts it: the era does (0.20+) and so
    # does the prediction (Model Runner V2 before 0.29 estimates none: a log's "took X GiB" is
    # then captured after the cache is sized, tuner.memory.budget.cudagraph_estimate_bytes)
    if _era_subtracts_graphs(measured) and predicted.get("cuda_graph_bytes"):
        out["cuda_graph_delta_bytes"] = diff("cuda_graph_bytes")
    total = None
    mk, pk = measured.get("available_kv_cache_bytes"), predicted.get("available_kv_cache_bytes")
    mw, pw = measured.get("weights_bytes"), predicted.get("weights_bytes")
    if None not in (mk, pk, mw, pw):
        total = (int(pk) - int(mk)) - (int(mw) - int(pw))
    out["total_delta_bytes"] = total
    out["kv_error_bytes"] = None if mk is None or pk is None else int(pk) - int(mk)
    note = consistency(measured, predicted)
    if note is None and out["activation_peak_delta_bytes"] is None and out["non_torch_delta_bytes"] is None:
        if total is not None and total_known:
            out["non_torch_delta_bytes"] = total - (out["cuda_graph_delta_bytes"] or 0)
            note = "no breakdown printed: the non-weight KV error is taken as non-torch"
        else:
            note = "no breakdown printed and the device total is assumed: nothing to attribute"
    out["usable"] = consistency(measured, predicted) is None
    out["note"] = note
    return out


def aggregate(values: Iterable[int | None]) -> int:
    """One correction from the residuals of one term (bytes): 0 when there are none or they
    disagree in sign beyond :data:`NOISE_BYTES`; else the smallest-magnitude residual shrunk by
    ``n / (n + 1)``."""
    vals = [int(v) for v in values if v is not None]
    if not vals:
        return 0
    pos = [v for v in vals if v > NOISE_BYTES]
    neg = [v for v in vals if v < -NOISE_BYTES]
    if (pos and neg) or len(pos) + len(neg) < len(vals):
        return 0  # disagreement, or some run says this term is already right
    smallest = min(vals, key=abs)
    n = len(vals)
    return int(smallest * n / (n + 1))


def fit(measured: Sequence[dict], predicted: Sequence[dict], *, total_known: Sequence[bool] | None = None) -> dict:
    """Corrections from paired measured runs and predictions (same order, same settings each);
    runs whose prediction is not :func:`consistency`-clean are left out.

    Args:
        total_known: per run, whether its device total is known (default: all known).

    Returns:
        ``{"activation_peak_delta_bytes": int, "non_torch_delta_bytes": int,
        "cuda_graph_delta_bytes": int}`` (zeros when nothing can be learned).

    Raises:
        ValueError: the lists differ in length.
    """
    if len(measured) != len(predicted) or (total_known is not None and len(total_known) != len(measured)):
        raise ValueError(f"{len(measured)} measured runs but {len(predicted)} predictions")
    known = list(total_known) if total_known is not None else [True] * len(measured)
    res = [residual(m, p, total_known=k) for m, p, k in zip(measured, predicted, known)]
    return from_residuals([r for r in res if r["usable"]])


def from_residuals(residuals: Sequence[dict]) -> dict:
    """:func:`aggregate` applied per term to residual rows (``calibrations`` rows or
    :func:`residual` dicts; the caller filters unusable ones), then scaled down by
    :func:`_guard` so that no run's KV error grows or turns from safe to unsafe."""
    cal = {term: aggregate(r.get(term) for r in residuals) for term in TERMS}
    f = _guard(residuals, sum(cal.values()))
    return {term: int(v * f) for term, v in cal.items()}


def _guard(residuals: Sequence[dict], shift: int) -> float:
    """The largest factor f in [0, 1] such that, for every run with a known KV error
    ``e = predicted KV − measured KV``, the corrected error ``e − f·shift`` is no larger in
    magnitude, and stays ≤ 0 when ``e`` was ≤ 0 (a safe prediction stays safe). A run whose KV
    error is unknown allows nothing (f = 0) — without it the correction cannot be checked."""
    if shift == 0:
        return 1.0
    f = 1.0
    for r in residuals:
        e = r.get("kv_error_bytes")
        if e is None:
            return 0.0
        if e * shift <= 0 and not (e == 0 and shift > 0):
            # the correction moves the error away from zero, or a safe (e ≤ 0) prediction upwards
            return 0.0
        # same direction: |e − f·shift| ≤ |e| needs f ≤ 2e/shift; a safe e < 0 stays ≤ 0 with f ≤ e/shift
        limit = (e / shift) if e < 0 else (2 * e / shift)
        f = min(f, max(0.0, limit))
    return f


def group_key(run: dict, quantization: str | None = None) -> tuple:
    """What runs must share to calibrate each other: model config (SHA-256, else the model
    name), device kind, era, TP, PP, dtype and quantization."""
    return (run.get("model_config_sha256") or run.get("model"), run.get("device_name"), run.get("era"),
            int(run.get("tensor_parallel_size") or 1), int(run.get("pipeline_parallel_size") or 1),
            run.get("dtype"), quantization)


def store_residual(store, run: dict, predicted: dict, *, quantization: str | None = None,
                   total_known: bool = True) -> dict:
    """Store the residual of a stored measured run (``run`` has its ``id``) against ``predicted``
    in ``calibrations``; returns the row written (with its ``id``).

    Raises:
        StoreError: as :meth:`tuner.store.database.Store.save_calibration`.
    """
    row = residual_row(run, predicted, quantization=quantization, total_known=total_known)
    row["id"] = store.save_calibration(row)
    return row


def residual_row(run: dict, predicted: dict, *, quantization: str | None = None, total_known: bool = True) -> dict:
    """The ``calibrations`` row (no ``id``) of a measured run (``run`` has its ``id``) against
    ``predicted``: the predicted terms, :func:`residual` per term, ``usable`` and ``note``. Pure."""
    r = residual(run, predicted, total_known=total_known)
    row = {
        "profile_run_id": run["id"], "model": run["model"], "model_config_sha256": run.get("model_config_sha256"),
        "device_name": run["device_name"], "era": run["era"],
        "tensor_parallel_size": int(run.get("tensor_parallel_size") or 1),
        "pipeline_parallel_size": int(run.get("pipeline_parallel_size") or 1),
        "dtype": run["dtype"], "quantization": quantization,
        "predicted_activation_peak_bytes": predicted.get("activation_peak_bytes"),
        "predicted_non_torch_bytes": predicted.get("non_torch_bytes"),
        "predicted_cuda_graph_bytes": predicted.get("cuda_graph_bytes"),
        "predicted_available_kv_cache_bytes": predicted.get("available_kv_cache_bytes"),
        "predicted_num_gpu_blocks": predicted.get("num_gpu_blocks"),
        "usable": bool(r["usable"]), "note": r["note"],
        **{k: r[k] for k in (*TERMS, "total_delta_bytes", "kv_error_bytes")},
    }
    return row


def calibration_for(store, model: str | None, device_name: str, era: str, *, model_config_sha256: str | None = None,
                    tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, dtype: str | None = None,
                    quantization: str | None = None, exclude_profile_run_ids: tuple[int, ...] = ()) -> dict | None:
    """The corrections for one model (config SHA-256 preferred over the name), device kind
    (catalog name), era (``Era.name``), parallel layout, dtype and quantization, from the stored
    usable residuals; None when there are none or every correction is 0. The dict has the three
    :data:`TERMS` plus ``runs`` (how many residuals it came from).

    Raises:
        StoreError: the query failed.
    """
    rows = store.calibration_rows(device_name=device_name, era=era, model_config_sha256=model_config_sha256,
                                  model=None if model_config_sha256 else model,
                                  tensor_parallel_size=tensor_parallel_size,
                                  pipeline_parallel_size=pipeline_parallel_size, dtype=dtype,
                                  quantization=quantization, exclude_profile_run_ids=exclude_profile_run_ids)
    if not rows:
        return None
    cal = from_residuals(rows)
    if not any(cal.values()):
        return None
    return {**cal, "runs": len(rows)}


def lookup_kwargs(request) -> dict:
    """The :func:`calibration_for` keyword arguments for a worker request (a
    :class:`tuner.question.protocol.JobRequest` or its wire object: ``drop``, ``config_path``, ``device``), computed parent-side without torch the way the worker and
    :func:`tuner.accuracy.importlog.run_row` key a run: the config's canonical hash (:func:`tuner.model.modelspec.config_hash`), catalog device
    name, era name, TP, PP, the dtype vLLM runs and the quantization.

    Raises:
        ModelConfigError: the config cannot be read; EraError: unknown ``engine_version``.
    """
    from pathlib import Path

    from tuner.memory.devices import lookup
    from tuner.memory.eras import resolve_dtype
    from tuner.model.modelspec import config_hash, read_top
    from tuner.question.protocol import as_job_request

    request = as_job_request(request)
    d = request.drop
    path = Path(request.config_path)
    top = read_top(path)  # ModelConfigError naming the file: unreadable, not JSON, not an object
    tc = top.get("text_config") if isinstance(top.get("text_config"), dict) else top
    config_dtype = str((tc or {}).get("torch_dtype") or (tc or {}).get("dtype") or top.get("torch_dtype")
                       or "float16").replace("torch.", "")
    from tuner.jobs.job import drop_era

    era = drop_era(d, request.engine_kind)
    name = str(request.device["name"])
    known = lookup(name)
    return {"model": d.model or None, "device_name": known.name if known else name, "era": era.name,
            "model_config_sha256": config_hash(top),
            "tensor_parallel_size": int(d.tensor_parallel_size or 1),
            "pipeline_parallel_size": int(d.pipeline_parallel_size or 1),
            "dtype": resolve_dtype(str(d.dtype or "auto"), config_dtype), "quantization": d.quantization}

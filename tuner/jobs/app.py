"""Composition root: builds the collaborators of the ``profile`` job and wires them together.

drop file → validated :class:`~tuner.question.drop.Drop` → method (``auto`` resolved by what the host
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

import functools
from typing import TYPE_CHECKING, Any, Callable

from tuner.question.drop import Drop, load_drop
from tuner.errors import DeviceError, DropError, ModelConfigError
from tuner.model.modelspec import resolve_model_path
from tuner.question.protocol import JobRequest, as_job_request
from tuner.store.records import ProfileOutcome, method_used, rows_for_store, serve_model  # noqa: F401  (app's names)
from tuner.store.storerules import utc_text
from tuner.seam.worker import DEFAULT_TIMEOUT_S, run_in_worker, spawner_for

if TYPE_CHECKING:
    from tuner.store.database import Store


def config_error_text(exc: ModelConfigError, model: str) -> str:
    """A model-config error for a drop's ``model`` field, naming the file at fault where it is not the
    model as written (``/m/config.json: not a regular file (a FIFO)``)."""
    if exc.where and str(exc.where) != str(model):
        return f"{exc.where}: {exc.message}"
    return exc.message


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
    from tuner.memory.devices import require_gpu

    try:
        require_gpu(drop.method, nvml)
    except DeviceError as exc:
        raise DropError(f"method {drop.method!r} needs a GPU host: {exc.message}; use 'simulate' or 'auto'",
                        path=drop.path, field="method") from exc
    if drop.method == "vllm" and not has_vllm():
        raise DropError("method 'vllm' needs the vllm package importable on this host; use 'cuda', 'simulate' "
                        "or 'auto'", path=drop.path, field="method")
    return drop.method


def prepare_job(drop: Drop, *, nvml: Any = None, trust_remote_code: bool = False,
                download: bool | None = None) -> tuple[JobRequest, dict]:
    """The worker request for a validated drop, and the resolved device ``{name, total_memory_bytes}``.

    Resolves the method (:func:`resolve_method`; the request's ``method`` is what the worker
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
            from tuner.model.hub import offline

            download = not offline()
        config_path = resolve_model_path(drop.model, drop.base_dir, download=download, revision=drop.revision)
    except ModelConfigError as exc:
        raise DropError(config_error_text(exc, drop.model), path=drop.path, field="model") from exc
    dev = {"name": device.name, "total_memory_bytes": device.total_memory_bytes}
    # the topology a drop's device mapping states travels with the request (tuner.memory.budget.Topology)
    extra = {k: getattr(device, k) for k in ("compute_capability", "interconnect", "p2p")
             if isinstance(drop.device, dict) and k in drop.device}
    if isinstance(drop.device, str) and device.interconnect is not None:
        from tuner.memory.devices import lookup

        known = lookup(device.name)
        if known is not None and known.interconnect != device.interconnect:  # a board word in the name
            extra["interconnect"] = device.interconnect
    if isinstance(drop.device, list):  # one card per pipeline stage (tuner.jobs.job.stage_devices)
        stages = stage_device_dicts(drop)
        extra = {k: v for k, v in stages[0].items() if k not in dev}
        extra["stages"] = stages
        if len({(s["name"], s["total_memory_bytes"]) for s in stages}) > 1:
            dev = {"name": " | ".join(s["name"] for s in stages),
                   "total_memory_bytes": min(s["total_memory_bytes"] for s in stages)}
        dev["stages"] = stages
        if method == "cuda" and drop.method == "auto":
            method = "simulate"
        elif method == "cuda":
            raise DropError("method 'cuda' measures GPU 0 only: a device list (one card per pipeline stage) is "
                            "simulated; use 'simulate' or 'vllm'", path=drop.path, field="method")
    if drop.device == "auto" and device.free_memory_bytes is not None:
        # co-tenants as vLLM's free-memory check sees them: the engine's total minus NVML's free memory
        # at job time (on an idle card NVML's free is about the CUDA total: ~0)
        extra["other_processes_bytes"] = max(0, int(device.total_memory_bytes) - int(device.free_memory_bytes))
    sc = drop.speculative_config or {}
    draft_path = draft_error = None
    if sc.get("model") and sc.get("method") in ("draft_model", "eagle", "eagle3", "dflash"):
        # the drafter checkpoint's config.json, found like the target's (tuner.memory.specdecode sizes it)
        try:
            draft_path = str(resolve_model_path(sc["model"], drop.base_dir, download=download))
        except ModelConfigError as exc:
            draft_error = config_error_text(exc, sc["model"])
    first = {"name": device.name, "total_memory_bytes": device.total_memory_bytes}
    request = JobRequest(drop=drop, config_path=str(config_path), device={**first, **extra}, method=method,
                         method_requested=drop.method, trust_remote_code=bool(trust_remote_code),
                         draft_config_path=draft_path, draft_config_error=draft_error)
    return request, dev


def stage_device_dicts(drop: Drop) -> list[dict]:
    """The request's ``device["stages"]``: each pipeline stage's card of a device list as
    ``{name, total_memory_bytes}`` plus what its mapping states (``compute_capability``,
    ``interconnect``, ``p2p``).

    Raises:
        DeviceError: an entry that does not resolve (``FILE:device[I]``)."""
    out = []
    entries = drop.device if isinstance(drop.device, list) else [drop.device]
    for raw, d in zip(entries, drop.resolve_devices()):
        s = {"name": d.name, "total_memory_bytes": int(d.total_memory_bytes)}
        s.update({k: getattr(d, k) for k in ("compute_capability", "interconnect", "p2p")
                  if isinstance(raw, dict) and k in raw})
        if isinstance(raw, str) and d.interconnect is not None:
            from tuner.memory.devices import lookup

            known = lookup(d.name)
            if known is not None and known.interconnect != d.interconnect:  # a board word in the name
                s["interconnect"] = d.interconnect
        out.append(s)
    return out


def prepare_request(drop: Drop, *, nvml: Any = None, trust_remote_code: bool = False,
                    download: bool | None = None) -> tuple[dict, dict]:
    """:func:`prepare_job` with the request as its wire object (:meth:`JobRequest.to_wire`)."""
    request, dev = prepare_job(drop, nvml=nvml, trust_remote_code=trust_remote_code, download=download)
    return request.to_wire(), dev


def lookup_calibration(request: JobRequest | dict, store: "Store") -> dict | None:
    """The stored corrections (:func:`tuner.jobs.calibrate.calibration_for`) for a simulate request's
    model config, device kind, era, TP/PP, dtype and quantization; None when none apply or the
    request does not simulate.

    Raises:
        StoreError: the query failed; ModelConfigError / EraError: as :func:`tuner.jobs.calibrate.lookup_kwargs`.
    """
    from tuner.jobs import calibrate

    request = as_job_request(request)
    if request.method != "simulate":
        return None
    kw = calibrate.lookup_kwargs(request)
    return calibrate.calibration_for(store, kw.pop("model"), kw.pop("device_name"), kw.pop("era"), **kw)


def open_for_job(request: JobRequest, db_url: str | None, *, calibrate: bool = True,
                 store_factory: Callable[..., "Store"] | None = None) -> "Store | None":
    """The store a job reads (and ``profile`` writes) through, or None when it does not exist yet
    (a new store is made only once the job succeeded). With the default ``store_factory`` a
    simulate job opens an existing SQLite store at the head revision through the standard
    library (:func:`tuner.store.litestore.open_lite`: no SQLAlchemy import; a store with calibrations,
    another revision or a server URL goes through :func:`tuner.store.database.open_store` as before).

    Raises:
        StoreError: the store exists and cannot be opened or migrated.
    """
    from tuner.store.litestore import open_lite, store_missing

    if store_missing(db_url):  # a SQLite file not made yet: nothing to import for it now
        return None
    if store_factory is None:
        if request.method == "simulate":
            lite = open_lite(db_url, calibrate=calibrate)
            if lite is not None:
                return lite
        from tuner.store.database import open_store as store_factory
    from tuner.store.database import store_exists

    return store_factory(db_url) if store_exists(db_url) else None


#: What :func:`tuner.store.database.open_store` imports to create and migrate a new store (SQLAlchemy and
#: Alembic: about 0.4 s of a cold CLI on a 2-core host).
NEW_STORE_MODULES = ("tuner.store.database", "alembic.command")


def import_all(*modules: str) -> bool:
    """Import ``modules`` in order; False at the first that fails (left to the code that needs it,
    which reports it as before)."""
    from importlib import import_module

    for name in modules:
        try:
            import_module(name)
        except Exception:  # noqa: BLE001 - the real import reports it
            return False
    return True


def make_new_store(db_url: str | None) -> Any:
    """Start making ``profile``'s new store in a background thread while its worker runs: import
    SQLAlchemy and Alembic (:data:`NEW_STORE_MODULES`, :func:`import_all`), then create and
    migrate the store under a temporary name (:func:`tuner.store.database.stage_new_store`). Returns the
    started thread; once joined, its ``staged`` is the :class:`tuner.store.database.StagedStore` or None.
    The parent only waits on the worker's pipes meanwhile, so none of it costs wall time."""
    import threading

    from tuner.store.litestore import sqlite_file

    def run() -> None:
        if not import_all(*NEW_STORE_MODULES) or sqlite_file(db_url) is None:
            return
        try:
            from tuner.store.database import stage_new_store

            thread.staged = stage_new_store(db_url)
        except Exception:  # noqa: BLE001 - open_store makes the store after the job, and reports
            thread.staged = None

    thread = threading.Thread(target=run, name="ctx-tuner-new-store", daemon=True)
    thread.staged = None
    thread.start()
    return thread


def profile(drop_path: str, *, db_url: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
            store_factory: Callable[..., "Store"] | None = None, worker: Callable[..., dict] = run_in_worker,
            nvml: Any = None, calibrate: bool = True, cache: bool = True,
            spawner: Callable[..., Any] | None = None, risk: str | None = None,
            cross_check: bool = False) -> ProfileOutcome:
    """Run the main job for one drop file and store everything in one transaction.

    ``cross_check`` (``--cross-check``): with vLLM installed, a plugin-served model's engine
    cross-check runs where none is stored for this vLLM build (and is stored with the result);
    without it a stored one is used and a missing or stale one is said (:mod:`tuner.engine.stored`).

    ``risk`` (``--risk``): the drop's ``constraints.risk`` replaced (``safe`` | ``expected``).

    With ``calibrate`` (default) and an existing store, a simulate run applies the corrections
    learned from the store's measured runs of the same model, device kind, era and layout
    (:func:`lookup_calibration`); the result then carries ``calibration`` and, per candidate and
    proposal, ``uncalibrated``. A store that does not exist yet is not created before the job
    succeeds.

    With ``cache`` (default) a job whose model spec and passes are in the store's pass memo is
    answered from them in this process, with no worker and no torch (:mod:`tuner.jobs.passmemo`);
    ``cache=False`` (``--no-cache``) runs the worker. A worker's new memo entries are stored with
    the result, in the same transaction.

    When the job will certainly run a worker (:func:`_needs_worker`) it is started right after
    the drop is read, before the store is opened (:func:`tuner.seam.worker.spawn_worker`): its imports
    overlap the store, calibration and memo lookups; ``timeout_s`` counts from the request (time
    spent waiting on a locked store is not charged to the job). A
    worker started so and not used (an error on the way) is killed. ``spawner``: what starts it
    (default :func:`tuner.seam.worker.spawner_for` ``worker``: only for ``run_in_worker`` and its
    partials, so a fake ``worker`` starts no process); it is called with ``timeout_s`` and its
    handle reaches ``worker`` as ``spawned=``.

    Raises:
        DropError: the drop is invalid (names file and field), or its method cannot run here.
        ModelConfigError: the model's config.json cannot be found offline.
        DeviceError, WorkerError, StoreError, TunerError: as their names say; nothing is written.
    """
    from tuner.question.vllm_args import from_drop_file

    drop = from_drop_file(drop_path).drop  # a drop's fields: the one mapping's drop source
    if risk is not None:
        import dataclasses

        drop = dataclasses.replace(drop, constraints=dataclasses.replace(drop.constraints, risk=risk))
    request, dev = prepare_job(drop, nvml=nvml)
    request = request.replace(cross_check="run" if cross_check else "stored")
    ahead = _spawn_ahead(request, db_url, cache, worker, spawner, timeout_s)
    store = warming = None
    try:
        # one store for the calibration, the memo and the result (a new one is made only once the job
        # succeeded); a worker run meanwhile holds no transaction and no lock on it
        store = open_for_job(request, db_url, calibrate=calibrate, store_factory=store_factory)
        # a new store is made while the worker runs, and put in place only once the job succeeded
        warming = make_new_store(db_url) if store is None and store_factory is None else None
        if calibrate and request.method == "simulate" and store is not None:
            cal = lookup_calibration(request, store)
            if cal is not None:
                request = request.replace(calibration=cal)
        started = utc_text()
        from tuner.jobs.memoanswer import PASS_SOURCE, memo_worker
        from tuner.jobs.passmemo import ENTRIES

        run = worker if ahead is None else functools.partial(worker, spawned=ahead)
        result = memo_worker(db_url, run, enabled=cache, write=False, store=store)(
            request.to_wire(), job=drop.name, timeout_s=timeout_s)
        memo_entries = result.pop(ENTRIES, None) or []
        outcome = ProfileOutcome(drop, dev, result, warnings=list(result.get("warnings", [])))
        if store is None:
            if warming is not None:
                warming.join()
                if warming.staged is not None:
                    warming.staged.adopt()
            if store_factory is None:
                from tuner.store.database import open_store as store_factory
            store = store_factory(db_url)
        rows = rows_for_store(outcome, started_at=started)
        residuals = _vllm_residuals(outcome, rows[1], store)
        source = result.get(PASS_SOURCE)
        if isinstance(source, dict) and source.get("source") == "memo":  # where the stored passes came from
            first = store.first_runs([r["pass_sha256"] for r in rows[1]])
            if first:
                run_id, drop_id = min(first.values())
                source.update(first_run_id=run_id, first_drop_id=drop_id)

        def also(conn, drop_id: int) -> None:
            if residuals is not None:
                residuals(conn, drop_id)
            store.put_memo(memo_entries, conn)

        same = same_stored_drop(store, *rows) if outcome.method == "simulate" and residuals is None else None
        if same is not None:  # the same drop file with the same results: its row, not a copy
            outcome.drop_id, outcome.reused = same, True
            store.put_memo(memo_entries)
        else:
            outcome.drop_id = store.save_result(*rows, also=also)
    finally:
        if ahead is not None:
            ahead.cancel()  # unused (the memo answered, an error on the way); a used one is reaped
        if warming is not None:  # a job that failed leaves no store behind
            warming.join(timeout=30)
            if warming.staged is not None:
                warming.staged.discard()
        if store is not None:
            store.close()
    return outcome


def _store_rows(store: Any, sql: str, params: dict) -> list[tuple]:
    """A read on either store kind (:class:`tuner.store.database.Store` or the standard-library
    :class:`tuner.store.litestore.LiteStore`): ``:name`` parameters, rows as tuples."""
    if hasattr(store, "_query"):  # LiteStore: sqlite3 takes :name with a dict
        return [tuple(r) for r in store._query(sql, params)]
    import sqlalchemy as sa

    with store.reader.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(sql), params).all()]


def _same_values(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b)
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)))
    return a == b


def same_stored_drop(store: Any, drop: dict, runs: list[dict], candidates: list[dict],
                     proposals: list[dict]) -> int | None:
    """The id of the newest stored drop row this result would repeat — the same name, file, bytes,
    model, device, release and method (no owner: ``profile``'s own rows), the same passes and the
    same candidates and proposals, column by column — or None. ``profile`` run again on an
    unchanged drop then reuses that row instead of storing a copy each time."""
    rows = _store_rows(store, "SELECT id FROM drops WHERE name = :name AND content_sha256 = :sha AND "
                              "coalesce(path, '') = :path AND model = :model AND device_name = :device AND "
                              "engine_version = :ev AND method = :method AND retired_at IS NULL AND owner_id IS NULL "
                              "ORDER BY id DESC LIMIT 1",
                       {"name": drop["name"], "sha": drop["content_sha256"], "path": drop.get("path") or "",
                        "model": drop["model"], "device": drop["device_name"], "ev": drop["engine_version"],
                        "method": drop["method"]})
    if not rows:
        return None
    drop_id = int(rows[0][0])
    passes = sorted(r["pass_sha256"] for r in runs)
    stored = sorted(r[0] for r in _store_rows(store, "SELECT pass_sha256 FROM profile_runs WHERE drop_id = :d",
                                              {"d": drop_id}))
    if passes != stored:
        return None
    for table, new in (("candidates", candidates), ("proposals", proposals)):
        cols = sorted({k for row in new for k in row if k not in ("run_key", "key")})
        if not cols:
            if _store_rows(store, f"SELECT count(*) FROM {table} WHERE drop_id = :d", {"d": drop_id})[0][0]:
                return None
            continue
        old = _store_rows(store, f"SELECT {', '.join(cols)} FROM {table} WHERE drop_id = :d ORDER BY id",
                          {"d": drop_id})
        if len(old) != len(new):
            return None
        for o, n in zip(old, new):
            if not all(_same_values(o[i], n.get(c)) for i, c in enumerate(cols)):
                return None
    return drop_id


def _needs_worker(request: JobRequest, db_url: str | None, cache: bool, python: str | None = None) -> bool:
    """Whether ``profile`` will certainly run a worker for ``request`` and starting it early is
    cheap to waste: a simulate job (the ``--preload`` imports are its) that the pass memo cannot
    answer — ``cache`` off, a job the memo does not apply to
    (:func:`tuner.jobs.memoanswer.memo_applies`), or no store file yet
    (:func:`tuner.store.litestore.store_missing`; a URL it is unsure of: False). The one place that
    decides it, before the store is opened; no SQLAlchemy import here."""
    from tuner.store.litestore import store_missing
    from tuner.jobs.memoanswer import memo_applies

    if request.method != "simulate":
        return False
    return not cache or not memo_applies(request, python) or store_missing(db_url)


def _spawn_ahead(request: JobRequest, db_url: str | None, cache: bool, worker: Callable[..., dict],
                 spawner: Callable[..., Any] | None, timeout_s: float) -> Any:
    """The worker handle :func:`_needs_worker` asks for, started now; None when none is needed or
    nothing can start one (``spawner`` None and ``worker`` no ``run_in_worker``)."""
    spawner = spawner_for(worker) if spawner is None else spawner
    python = (getattr(worker, "keywords", None) or {}).get("python")  # a partial's (as memo_worker reads it)
    if spawner is None or not _needs_worker(request, db_url, cache, python):
        return None
    return spawner(timeout_s=timeout_s)


def _vllm_residuals(outcome: ProfileOutcome, runs: list[dict], store: "Store") -> Callable | None:
    """The ``save_result`` hook that stores, in the same transaction, the calibration residual of
    each ``vllm`` start-up against the (uncalibrated) simulate candidate of the same
    ``gpu_memory_utilization`` × ``max_model_len``; None when the job started no engine."""
    from tuner.jobs import calibrate

    measured = outcome.result.get("measured") or []
    if not measured:
        return None
    from tuner.question.protocol import point_of

    preds = {point_of(c): c for c in outcome.result["candidates"]}

    def hook(conn, drop_id: int) -> None:
        ids = store.run_ids(conn, drop_id)
        for run_id, run, m in zip(ids[len(runs) - len(measured):], runs[len(runs) - len(measured):], measured):
            pred = preds.get(point_of(m))
            if pred is None or run["status"] != "ok" or m.get("engine_device") == "cpu":  # CPU: no GPU budget
                continue
            row = calibrate.residual_row({**run, "id": run_id}, pred, quantization=outcome.drop.quantization,
                                         total_known=m.get("total_memory_bytes") is not None)
            store.insert_calibration(conn, row)

    return hook

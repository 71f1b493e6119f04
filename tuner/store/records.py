"""Job results ↔ store rows (DESIGN §5b): the only place that maps a job's
:class:`~tuner.question.protocol.JobResult` onto the ``drops`` / ``profile_runs`` / ``candidates`` /
``proposals`` rows, and rows back to typed records and to a ``JobResult``.

Writing: :func:`rows_for_store` (what :meth:`tuner.store.database.Store.save_result` inserts). Reading:
one frozen record class per table (:class:`StoredDrop`, :class:`StoredRun`,
:class:`StoredCandidate`, :class:`StoredProposal`), its fields the table's columns, declared once
by the schema (:mod:`tuner.store.database`), and the reads ``explain``, ``plot``, ``results``, the
proposal files and ``metrics`` need (:func:`run`, :func:`drop`, :func:`candidates_of_drop`, …,
:func:`stored_result`). No torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

if TYPE_CHECKING:
    import sqlalchemy as sa

    from tuner.store.database import Store

from tuner.question.drop import Drop
from tuner.question.protocol import point_of

if TYPE_CHECKING:
    from tuner.question.protocol import JobResult


# ------------------------------------------------------------------------------------------------
# A job result → rows
# ------------------------------------------------------------------------------------------------


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
    #: the fleet's shared result key (:func:`tuner.store.fleet.result_key`) when the daemon computed one.
    result_sha256: str | None = None
    #: ``drop_id`` is an earlier row holding the same drop and results (``profile`` run again on an
    #: unchanged drop stores no copy; :func:`tuner.jobs.app.same_stored_drop`).
    reused: bool = False

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
                "warnings": json.dumps([str(w) for w in outcome.warnings]) if outcome.warnings else None,
                "release_assumed": json.dumps(d.release_assumed) if getattr(d, "release_assumed", None) else None}
    runs = []
    stages = dev.get("stages") or []
    for run in r["runs"]:
        # a device list: each stage's pass is recorded on its own card
        run_dev = stages[int(run.get("pp_rank") or 0)] if len(stages) == d.pipeline_parallel_size else dev
        runs.append({
            "key": run["key"], "pass_sha256": _pass_sha256(r, run, d, run_dev), "status": "ok", "error": None,
            "method": outcome.method, "engine_version": d.engine_version, "era": r["era"], "model": d.model,
            "model_config_sha256": r["model"]["config_sha256"], "architecture": ",".join(r["model"]["architectures"]),
            "plugin": r["plugin"], "device_name": run_dev["name"],
            "device_total_memory_bytes": run_dev["total_memory_bytes"],
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
        if r.get("block_size") is not None:  # the KV block size the pass sized its blocks with (explain --run)
            runs[-1]["block_size"] = int(r["block_size"])
    for i, m in enumerate(r.get("measured") or []):  # vllm: one engine start-up per needed candidate
        base = {k: v for k, v in runs[0].items() if k not in _MEASURED_COLUMNS} if runs else {}
        u, mml = point_of(m)
        key = {"pass": base.get("pass_sha256"), "u": u, "m": mml,
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
    from tuner.question.protocol import INTERVAL_NUMBERS

    # revision 0010: the interval's ends (tuner/memory/uncertainty.py; absent on a candidate without one)
    cand_iv = INTERVAL_NUMBERS + ("num_gpu_blocks_low", "num_gpu_blocks_high")
    candidates = [{**{k: c[k] for k in cand_cols}, **{k: c.get(k) for k in cand_iv}, "run_key": c["run_key"]}
                  for c in r["candidates"]]
    prop_cols = ("gpu_memory_utilization", "max_model_len", "num_gpu_blocks", "kv_cache_tokens", "max_concurrency",
                 "vllm_args", "reason")
    from tuner.question.protocol import POINT_NUMBERS

    # the proposed point's own numbers (absent: nothing fits)
    prop_iv = INTERVAL_NUMBERS + ("risk", "max_model_len_safe", "max_model_len_expected")
    proposals = [{**{k: p[k] for k in prop_cols}, **{k: p.get(k) for k in POINT_NUMBERS},
                  **{k: p.get(k) for k in prop_iv}} for p in r["proposals"]]
    return drop_row, runs, candidates, proposals


# ------------------------------------------------------------------------------------------------
# Rows → typed records
# ------------------------------------------------------------------------------------------------


class _Record:
    """Base of the record classes: ``from_row`` keeps the table's columns as fields (a column the
    query did not select is None) and anything else the query labelled (``drop_name``) in
    ``extra``."""

    __slots__ = ()
    table: sa.Table

    @classmethod
    def from_row(cls, row: Mapping[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: row.get(k) for k in names}, extra={k: v for k, v in row.items() if k not in names})

    def as_dict(self) -> dict[str, Any]:
        """The row as the store gave it (columns and extra labels)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update(self.extra)
        return out

    def get(self, key: str, default: Any = None) -> Any:
        """A column or extra label by name (for code that handles several tables alike)."""
        v = getattr(self, key, None) if key != "extra" else None
        if v is None:
            v = self.extra.get(key)
        return default if v is None else v


def _table(name: str) -> "sa.Table":
    """The schema's table ``name`` (:mod:`tuner.store.database`, imported on the first read: writing a
    result, :func:`rows_for_store`, needs no SQLAlchemy)."""
    from tuner.store import database as store

    return getattr(store, f"{name}_table")


def _select(name: str):
    """``(sqlalchemy.select(table), table)`` for the table ``name``."""
    import sqlalchemy as sa

    t = _table(name)
    return sa.select(t), t


def _record_class(name: str, table: "sa.Table", doc: str) -> type:
    fields = [(c, Any, dataclasses.field(default=None)) for c in table.c.keys()]
    fields.append(("extra", dict, dataclasses.field(default_factory=dict, repr=False, compare=False)))
    cls = dataclasses.make_dataclass(name, fields, bases=(_Record,), frozen=True, namespace={"table": table})
    cls.__doc__ = doc
    cls.__module__ = __name__
    return cls


#: The record classes, by name: table and docstring (built on first use, :func:`_record`).
_RECORDS = {
    "StoredDrop": ("drops", "One ``drops`` row (a drop as it was profiled)."),
    "StoredRun": ("profile_runs", "One ``profile_runs`` row (a pass or a measured start-up)."),
    "StoredCandidate": ("candidates", "One ``candidates`` row (a grid point's verdict)."),
    "StoredProposal": ("proposals", "One ``proposals`` row (the largest length per u)."),
}
_built: dict[str, type] = {}


def _record(name: str) -> type:
    """The record class ``name`` (:data:`_RECORDS`), built once: four frozen dataclasses of ~50
    fields each cost a cold CLI ~10–30 ms to make, and writing a result (``profile``) needs none."""
    cls = _built.get(name)
    if cls is None:
        table, doc = _RECORDS[name]
        cls = _built[name] = _record_class(name, _table(table), doc)
    return cls


def __getattr__(name: str) -> type:
    """``StoredDrop``, ``StoredRun``, ``StoredCandidate``, ``StoredProposal`` (see :func:`_record`)."""
    if name in _RECORDS:
        return _record(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def select(store: "Store", stmt: "sa.Executable", record: type | None = None) -> list:
    """Run a read query; rows as dicts, or as ``record`` instances."""
    rows = store.select(stmt)
    return [record.from_row(r) for r in rows] if record is not None else rows


def drop(store: Store, drop_id: int) -> "StoredDrop | None":
    """The ``drops`` row ``drop_id``, or None."""
    stmt, t = _select("drops")
    rows = select(store, stmt.where(t.c.id == int(drop_id)), _record("StoredDrop"))
    return rows[0] if rows else None


def drop_warnings(store: Store, drop_id: int) -> str | None:
    """``drops.warnings`` (JSON text) of one drop, None when absent or no such drop."""
    import sqlalchemy as sa

    t = _table("drops")
    rows = store.select(sa.select(t.c.warnings).where(t.c.id == int(drop_id)))
    return rows[0]["warnings"] if rows else None


def run(store: Store, run_id: int) -> "StoredRun | None":
    """The ``profile_runs`` row ``run_id``, or None."""
    stmt, t = _select("profile_runs")
    rows = select(store, stmt.where(t.c.id == int(run_id)), _record("StoredRun"))
    return rows[0] if rows else None


def runs_of_drop(store: Store, drop_id: int, *, limit: int | None = None) -> list:
    """A drop's ``profile_runs`` rows, in insertion order (the first ``limit`` ones)."""
    stmt, t = _select("profile_runs")
    stmt = stmt.where(t.c.drop_id == int(drop_id)).order_by(t.c.id)
    return select(store, stmt.limit(limit) if limit else stmt, _record("StoredRun"))


def candidates_of_run(store: Store, run_id: int) -> list:
    """The ``candidates`` rows evaluated on one pass, in insertion order."""
    stmt, t = _select("candidates")
    return select(store, stmt.where(t.c.profile_run_id == int(run_id)).order_by(t.c.id), _record("StoredCandidate"))


def candidates_of_drop(store: Store, drop_id: int) -> list:
    """A drop's ``candidates`` rows, in insertion order."""
    stmt, t = _select("candidates")
    return select(store, stmt.where(t.c.drop_id == int(drop_id)).order_by(t.c.id), _record("StoredCandidate"))


def proposals_of_drop(store: Store, drop_id: int, *, by_utilization: bool = False) -> list:
    """A drop's ``proposals`` rows, in insertion order (or by ``gpu_memory_utilization``, then id)."""
    stmt, t = _select("proposals")
    order = (t.c.gpu_memory_utilization, t.c.id) if by_utilization else (t.c.id,)
    return select(store, stmt.where(t.c.drop_id == int(drop_id)).order_by(*order), _record("StoredProposal"))


def json_column(text: str | None) -> Any:
    """A stored JSON text column (``term_sources``, ``engine_check``, ``warnings``), None when
    absent or unreadable."""
    if not text:
        return None
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


def stored_result(store: Store, drop_id: int) -> "JobResult":
    """A stored drop's candidates and proposals back as a :class:`~tuner.question.protocol.JobResult` (the
    budget ledgers' sources from its first run's ``term_sources``; ``runs`` as stored).

    Raises:
        StoreError: a database error.
    """
    from tuner.question.protocol import JobResult

    runs = runs_of_drop(store, drop_id)
    sources = json_column(runs[0].term_sources) if runs else None
    keys = {r.id: r for r in runs}
    cands = []
    for c in candidates_of_drop(store, drop_id):
        row = {k: v for k, v in c.as_dict().items() if k not in ("id", "drop_id", "profile_run_id")}
        row["fits"] = bool(row.get("fits"))
        run_row = keys.get(c.profile_run_id)
        row["run_key"] = None if run_row is None else f"{run_row.max_num_batched_tokens}x{run_row.num_sampled_rows}@0"
        cands.append(row)
    props = [{k: v for k, v in p.as_dict().items() if k not in ("id", "drop_id", "created_at")}
             for p in proposals_of_drop(store, drop_id)]
    return JobResult.from_wire({"candidates": cands, "proposals": props, "term_sources": sources,
                                "runs": [r.as_dict() for r in runs],
                                "era": runs[0].era if runs else None, "plugin": runs[0].plugin if runs else None})


def find(records: Iterable, gpu_memory_utilization: float, max_model_len: int | None = None):
    """The first record at ``gpu_memory_utilization`` (compared to 1e-9; and ``max_model_len`` when
    given), or None."""
    for r in records:
        if abs(float(r.gpu_memory_utilization) - float(gpu_memory_utilization)) < 1e-9 \
                and (max_model_len is None or r.max_model_len == max_model_len):
            return r
    return None

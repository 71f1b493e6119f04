"""``results``: the latest proposals, fit surfaces and runs in the store, as text, JSON or CSV.

Reads the tables (not the views, so a store at any revision works) through SQLAlchemy Core, on a
read-only connection (SQLite ``mode=ro``, read-only PostgreSQL sessions). Bytes stay ints here;
GiB appear only in :func:`render`. In a fleet (revision 0007) the latest drop is per drop name *and*
owner, and each proposal names its ``host_id`` (null for drops stored by ``profile``).

Each proposal carries its interval (revision 0010, :mod:`tuner.memory.uncertainty`): the ``risk`` it was
taken at, both answers (``max_model_len_safe``, ``max_model_len_expected``) and the KV tokens and
bytes at the interval's low (safe) and high ends; null (``-`` in the text) for older rows.
"""

from __future__ import annotations

import csv
import io
import os
from typing import Any

import sqlalchemy as sa

from tuner.errors import StoreError
from tuner.question.protocol import gmu_text, point_of
from tuner.store.database import (DEFAULT_PATH, Store, candidates_table, drops_table, hosts_table, open_store,
                         profile_runs_table, proposals_table)

GiB = 1 << 30
MEASURED_METHODS = ("cuda", "vllm", "import")

#: A proposal's interval (revision 0010; null for older rows): the risk, both answers, the KV ends.
INTERVAL_COLUMNS = ("risk", "max_model_len_safe", "max_model_len_expected", "kv_cache_tokens_low",
                    "kv_cache_tokens_high", "available_kv_cache_bytes_low", "available_kv_cache_bytes_high")
#: CSV/JSON columns per table (``--table``).
PROPOSAL_COLUMNS = ("drop_id", "drop_name", "host_id", "model", "device_name", "engine_version",
                    "gpu_memory_utilization", "max_model_len", "num_gpu_blocks", "kv_cache_tokens", "max_concurrency",
                    "vllm_args", "reason", "created_at", *INTERVAL_COLUMNS)
RUN_COLUMNS = ("id", "drop_id", "method", "status", "model", "device_name", "engine_version", "era", "dtype",
               "kv_cache_dtype", "tensor_parallel_size", "pipeline_parallel_size", "max_num_batched_tokens",
               "max_num_seqs", "num_sampled_rows", "gpu_memory_utilization", "max_model_len",
               "device_total_memory_bytes", "weights_bytes", "activation_peak_bytes", "forward_peak_bytes",
               "sampler_peak_bytes", "non_torch_bytes", "cuda_graph_bytes", "available_kv_cache_bytes",
               "num_gpu_blocks", "kv_cache_tokens", "max_concurrency", "error_message", "source", "started_at")
CANDIDATE_COLUMNS = ("id", "drop_id", "drop_name", "profile_run_id", "gpu_memory_utilization", "max_model_len",
                     "max_num_batched_tokens", "fits", "requested_memory_bytes", "weights_bytes",
                     "activation_peak_bytes", "non_torch_bytes", "cuda_graph_bytes", "available_kv_cache_bytes",
                     "num_gpu_blocks", "kv_cache_tokens", "max_concurrency", "reason")
TABLES = {"proposals": PROPOSAL_COLUMNS, "runs": RUN_COLUMNS, "candidates": CANDIDATE_COLUMNS}


def open_for_read(db_url: str | None) -> Store:
    """Open the store for reading, read-only (a SQLite file must exist; nothing is migrated).

    Raises:
        StoreError: no store at the path, or it cannot be opened.
    """
    if not db_url or "://" not in db_url:
        path = db_url or DEFAULT_PATH
        if not os.path.isfile(path):
            raise StoreError("no results store here (run `ctx-tuner profile DROP.yaml` first, or pass --db)",
                             where=path)
        return open_store(path, readonly=True)
    return open_store(db_url, readonly=True)


def rows(store: Store, stmt: sa.Executable) -> list[dict]:
    """Run a read query on ``store`` (:func:`tuner.store.records.select`); ``StoreError`` on failure."""
    from tuner.store import records

    return records.select(store, stmt)


def _like(col, text: str | None):
    return sa.true() if not text else sa.func.lower(col).contains(text.lower(), autoescape=True)


def _has_owners(store: Store) -> bool:
    """True when the store has revision 0007's ``drops.owner_id`` (a read-only open never migrates)."""
    try:
        return "owner_id" in {c["name"] for c in sa.inspect(store.engine).get_columns("drops")}
    except sa.exc.SQLAlchemyError as e:
        raise StoreError(f"query failed: {e}", where=store.where) from e


def latest_drops(store: Store, *, model: str | None = None, device: str | None = None) -> list[dict]:
    """The newest unretired drop row per drop name (and owner, in a fleet store) whose model /
    device contain the given text (case-insensitive), ordered by name and host; ``host_id`` is the
    owner's (None without one)."""
    d, h = drops_table, hosts_table
    cols = [d.c.id, d.c.name, d.c.model, d.c.device_name, d.c.engine_version, d.c.method, d.c.content, d.c.created_at]
    if _has_owners(store):
        newest = (sa.select(sa.func.max(d.c.id)).where(d.c.retired_at.is_(None))
                  .group_by(d.c.name, sa.func.coalesce(d.c.owner_id, 0)))
        stmt = (sa.select(*cols, h.c.host_id).select_from(d.outerjoin(h, h.c.id == d.c.owner_id))
                .where(d.c.id.in_(newest), _like(d.c.model, model), _like(d.c.device_name, device))
                .order_by(d.c.name, h.c.host_id))
        return rows(store, stmt)
    newest = sa.select(sa.func.max(d.c.id)).where(d.c.retired_at.is_(None)).group_by(d.c.name)
    stmt = (sa.select(*cols).where(d.c.id.in_(newest), _like(d.c.model, model), _like(d.c.device_name, device))
            .order_by(d.c.name))
    return [{**r, "host_id": None} for r in rows(store, stmt)]


def non_monotone(points: list[dict]) -> bool:
    """True when some max_model_len fits above one that does not."""
    failed = False
    for p in sorted(points, key=lambda p: point_of(p).max_model_len):
        if not p["fits"]:
            failed = True
        elif failed:
            return True
    return False


def query(store: Store, *, model: str | None = None, device: str | None = None, limit: int = 200) -> dict:
    """Latest proposals, fit surfaces and runs (the latest drops' passes plus measured runs).

    Returns ``{"filters", "proposals", "surfaces", "candidates", "runs"}`` (lists of dicts, bytes as ints).
    """
    drops = latest_drops(store, model=model, device=device)
    ids = [d["id"] for d in drops]
    names = {d["id"]: d["name"] for d in drops}
    p, c, r = proposals_table, candidates_table, profile_runs_table
    order = {i: n for n, i in enumerate(ids)}  # drops' order: name, then host
    props = sorted(rows(store, sa.select(p).where(p.c.drop_id.in_(ids))),
                   key=lambda x: (order[x["drop_id"]], point_of(x).gpu_memory_utilization))
    by_id = {d["id"]: d for d in drops}
    proposals = [{"drop_name": names[x["drop_id"]], "host_id": by_id[x["drop_id"]]["host_id"],
                  "model": by_id[x["drop_id"]]["model"],
                  "device_name": by_id[x["drop_id"]]["device_name"],
                  "engine_version": by_id[x["drop_id"]]["engine_version"], **x} for x in props]
    cands = rows(store, sa.select(c).where(c.c.drop_id.in_(ids)).order_by(c.c.drop_id, c.c.gpu_memory_utilization,
                                                                           c.c.max_model_len))
    candidates = [{"drop_name": names[x["drop_id"]], **x} for x in cands]
    surfaces: dict[tuple, dict] = {}
    for x in candidates:
        u = point_of(x).gpu_memory_utilization
        s = surfaces.setdefault((x["drop_id"], u), {
            "drop_id": x["drop_id"], "drop_name": x["drop_name"], "gpu_memory_utilization": u, "points": []})
        s["points"].append({k: x[k] for k in ("max_model_len", "max_num_batched_tokens", "fits", "num_gpu_blocks",
                                              "kv_cache_tokens", "max_concurrency")})
    for s in surfaces.values():
        s["non_monotone"] = non_monotone(s["points"])
    measured = sa.and_(r.c.method.in_(MEASURED_METHODS), _like(r.c.model, model), _like(r.c.device_name, device))
    stmt = (sa.select(r).where(sa.or_(r.c.drop_id.in_(ids), measured)).order_by(r.c.id.desc()).limit(limit))
    runs = [{k: x.get(k) for k in RUN_COLUMNS} for x in rows(store, stmt)]
    runs.reverse()
    return {"filters": {"model": model, "device": device}, "proposals": proposals,
            "surfaces": list(surfaces.values()), "candidates": candidates, "runs": runs}


def to_csv(doc: dict, table: str) -> str:
    """One table of :func:`query`'s result as CSV (header row, then one row per item)."""
    cols = TABLES[table]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for x in doc[table]:
        w.writerow(["" if x.get(k) is None else (int(x[k]) if isinstance(x.get(k), bool) else x[k]) for k in cols])
    return buf.getvalue()


def _gib(n: Any) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _opt(n: Any) -> str:
    return "-" if n is None else str(n)


def _span(p: dict) -> str:
    """The KV tokens at the interval's low-high ends (``-`` where not stored)."""
    lo, hi = p.get("kv_cache_tokens_low"), p.get("kv_cache_tokens_high")
    return "-" if lo is None and hi is None else f"{_opt(lo)}-{_opt(hi)}"


def render(doc: dict) -> str:
    """Text report: proposals, fit surfaces (non-monotone ones marked), runs."""
    lines = ["latest proposals (largest max_model_len that starts):"]
    if not doc["proposals"]:
        lines.append("  (none)")
    # a device list's joined names ("H100-80GB | A100-40GB") widen the column instead of running into vLLM's
    dw = max([12] + [len(str(p["device_name"])) for p in doc["proposals"]])
    head = (f"  {'drop':<28} {'device':<{dw}} {'vLLM':<7} {'gmu':>5} {'max_model_len':>13} {'blocks':>8} "
            f"{'KV tokens':>10} {'conc.':>7}  {'risk':<8} {'safe':>7} {'expected':>8} {'KV tokens low-high':>18}")
    if doc["proposals"]:
        lines.append(head)
    for p in doc["proposals"]:
        u, mml = point_of(p)
        mml = "none" if mml is None else mml
        name = p["drop_name"] + (f"@{p['host_id']}" if p.get("host_id") else "")
        lines.append(f"  {name:<28} {p['device_name']:<{dw}} {p['engine_version']:<7} "
                     f"{gmu_text(u):>5} {mml:>13} {p['num_gpu_blocks'] or '-':>8} "
                     f"{p['kv_cache_tokens'] or '-':>10} {p['max_concurrency'] or 0:>7.2f}  "
                     f"{p.get('risk') or '-':<8} {_opt(p.get('max_model_len_safe')):>7} "
                     f"{_opt(p.get('max_model_len_expected')):>8} {_span(p):>18}")
    lines += ["", "fit surfaces (max_model_len:fits at each gpu_memory_utilization):"]
    if not doc["surfaces"]:
        lines.append("  (none)")
    for s in doc["surfaces"]:
        pts = " ".join(f"{point_of(q).max_model_len}:{'yes' if q['fits'] else 'NO'}" for q in s["points"])
        flag = "  <- NOT monotone: a longer length starts where a shorter one fails" if s["non_monotone"] else ""
        lines.append(f"  {s['drop_name']:<28} gmu {gmu_text(point_of(s).gpu_memory_utilization)}  {pts}{flag}")
    lines += ["", "runs (profile passes and measured start-ups, GiB):"]
    if not doc["runs"]:
        lines.append("  (none)")
    else:
        lines.append(f"  {'id':>5} {'method':<8} {'device':<12} {'vLLM':<7} {'N':>7} {'R':>5} {'gmu':>5} {'M':>7} "
                     f"{'weights':>8} {'act.peak':>8} {'non-torch':>9} {'KV':>7} {'blocks':>7}  status")
    for x in doc["runs"]:
        at = point_of(x)
        u = gmu_text(at.gpu_memory_utilization)
        status = x["status"] + (f": {x['error_message']}" if x.get("error_message") else "")
        lines.append(f"  {x['id']:>5} {x['method']:<8} {x['device_name']:<12} {x['engine_version']:<7} "
                     f"{x['max_num_batched_tokens']:>7} {x['num_sampled_rows'] or '-':>5} {u:>5} "
                     f"{at.max_model_len or '-':>7} {_gib(x['weights_bytes']):>8} {_gib(x['activation_peak_bytes']):>8} "
                     f"{_gib(x['non_torch_bytes']):>9} {_gib(x['available_kv_cache_bytes']):>7} "
                     f"{x['num_gpu_blocks'] or '-':>7}  {status}")
    return "\n".join(lines)

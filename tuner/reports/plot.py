"""``plot``: the largest ``max_model_len`` that starts against ``gpu_memory_utilization``.

Data first (:func:`frontier_from_drop` runs worker jobs; :func:`frontier_from_store` reads the
store), picture second (:func:`render_png`, matplotlib imported lazily — the ``plot`` extra). The
picture has one frontier line per concurrency (the largest M at which that many full-length
requests fit), every simulated grid point (starts / does not start: a non-monotone surface shows
as a failure below points that start), and measured start-ups from the store marked apart.
:func:`render_png` returns the series read back from the figure's artists and writes them next to
the image (``OUT.json``), so what was drawn can be checked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import sqlalchemy as sa
import yaml

from tuner.store import records
from tuner.errors import TunerError
from tuner.reports.explain import Progress, prepare, run_jobs
from tuner.question.protocol import JobResult, point_of
from tuner.reports.results import MEASURED_METHODS, latest_drops, non_monotone
from tuner.store.database import Store, profile_runs_table
from tuner.seam.worker import DEFAULT_TIMEOUT_S

#: gpu_memory_utilization values swept when the drop lists fewer than three.
DEFAULT_GMU = tuple(round(0.70 + 0.02 * i, 2) for i in range(15))  # 0.70 … 0.98


class PlotUnavailable(TunerError):
    """matplotlib (the ``plot`` extra) is not installed."""


def _same_u(a: float, b: float) -> bool:
    return abs(float(a) - float(b)) < 1e-9


def _non_monotone_us(surface: list[dict]) -> list[float]:
    us = sorted({point_of(p).gpu_memory_utilization for p in surface})
    return [u for u in us if non_monotone([p for p in surface if _same_u(point_of(p).gpu_memory_utilization, u)])]


def _measured(store: Store | None, **match: Any) -> list[dict]:
    """Measured / imported runs with a gpu_memory_utilization and max_model_len, filtered."""
    if store is None:
        return []
    r = profile_runs_table
    cond = [r.c.method.in_(MEASURED_METHODS), r.c.gpu_memory_utilization.isnot(None), r.c.max_model_len.isnot(None)]
    for key in ("device_name", "engine_version", "tensor_parallel_size", "pipeline_parallel_size", "kv_cache_dtype"):
        if match.get(key) is not None:
            cond.append(getattr(r.c, key) == match[key])
    if match.get("device_like"):
        cond.append(sa.func.lower(r.c.device_name).contains(match["device_like"].lower(), autoescape=True))
    if match.get("model_like"):
        cond.append(sa.func.lower(r.c.model).contains(match["model_like"].lower(), autoescape=True))
    if match.get("model") or match.get("config_sha256"):
        cond.append(sa.or_(r.c.model == match.get("model"), r.c.model_config_sha256 == match.get("config_sha256")))
    out = []
    for x in records.select(store, sa.select(r).where(*cond).order_by(r.c.id), records.StoredRun):
        out.append({"run_id": x.id, "method": x.method, "gpu_memory_utilization": x.gpu_memory_utilization,
                    "max_model_len": x.max_model_len, "num_gpu_blocks": x.num_gpu_blocks,
                    "kv_cache_tokens": x.kv_cache_tokens, "fits": x.status == "ok" and not x.error_message})
    return out


def frontier_from_drop(drop_path: str, *, gpu_memory_utilization: list[float] | None = None,
                       concurrency: list[float] | None = None, store: Store | None = None,
                       worker: Callable[..., dict] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                       progress: Progress | None = None) -> dict:
    """Sweep u for one drop: one worker job per concurrency level (in parallel).

    ``gpu_memory_utilization`` defaults to the drop's list when it has three or more values, else
    :data:`DEFAULT_GMU`; ``concurrency`` to 1, 2, 4 and the drop's ``min_concurrency``.
    """
    job = prepare(drop_path)
    d = job.drop
    us = sorted(set(gpu_memory_utilization or (d.candidates.gpu_memory_utilization
                                               if len(d.candidates.gpu_memory_utilization) >= 3 else DEFAULT_GMU)))
    cs = sorted({1.0, *(float(c) for c in (concurrency or (2, 4))), float(d.constraints.min_concurrency)})
    jobs = [(f"concurrency {c:g}", job.request(gpu_memory_utilization=us, min_concurrency=c)) for c in cs]
    if progress:
        progress(f"plot {d.name}: {len(jobs)} jobs x {len(us)} gpu_memory_utilization values")
    res = run_jobs(jobs, job_name=d.name, worker=worker, timeout_s=timeout_s, progress=progress)
    for label, r in res.items():
        if isinstance(r, TunerError):
            raise r
    base = res["concurrency 1"]
    frontiers = []
    for c in cs:
        r = JobResult.from_wire(res[f"concurrency {c:g}"])
        frontiers.append({"label": f"largest max_model_len, >= {c:g} full-length request{'s' if c != 1 else ''}",
                          "min_concurrency": c,
                          "points": [[p.gpu_memory_utilization, p.max_model_len] for p in r.proposals]})
    surface = [_surface_point(c) for c in JobResult.from_wire(base).candidates]
    measured = _measured(store, device_name=job.device["name"], engine_version=d.engine_version,
                         tensor_parallel_size=d.tensor_parallel_size, pipeline_parallel_size=d.pipeline_parallel_size,
                         kv_cache_dtype=d.kv_cache_dtype, model=d.model, config_sha256=base["model"]["config_sha256"])
    return {"title": f"{d.name}: {d.model} on {job.device['name']}, vLLM {base['era']}",
            "source": "simulate", "frontiers": frontiers, "surface": surface, "measured": measured,
            "non_monotone_at": _non_monotone_us(surface)}


def _starts(c: Any) -> bool:
    """Starts as far as memory goes: fits, or refused only for ``min_concurrency`` (the search's
    "only N full-length requests" reason), which is not a start-up failure."""
    return bool(c.get("fits")) or (c.get("reason") or "").startswith("only ")


def _surface_point(c: Any, **extra: Any) -> dict:
    return {**extra, "gpu_memory_utilization": c.gpu_memory_utilization, "max_model_len": c.max_model_len,
            "max_num_batched_tokens": c.get("max_num_batched_tokens"), "fits": c.get("fits"),
            "starts": _starts(c), "kv_cache_tokens": c.get("kv_cache_tokens")}


def _resimulated(dr: dict, us: list[float], cs: list[float], *, worker: Callable[..., dict] | None,
                 timeout_s: float) -> tuple[dict[float, list] | None, str | None]:
    """The exact frontier per concurrency of a stored drop: its content searched again (simulate,
    the pass memo answers repeated passes) with ``min_concurrency`` = each of ``cs`` at the stored
    utilizations ``us``. ``({c: [[u, M | None], …]}, None)``, or ``(None, why)`` when the drop
    cannot be prepared here (its model config is not found on this host, …)."""
    from tuner.question.drop import parse_drop

    import dataclasses

    try:
        drop = parse_drop(dr["content"], dr.get("path") or f"{dr['name']}.yaml")
        job = prepare(None, drop=dataclasses.replace(drop, method="simulate"))  # a measured drop too: no GPU here
        jobs = [(f"concurrency {c:g}", job.request(gpu_memory_utilization=us, min_concurrency=c)) for c in cs]
        res = run_jobs(jobs, job_name=dr["name"], worker=worker, timeout_s=timeout_s)
    except TunerError as exc:
        return None, str(exc)
    out = {}
    for c in cs:
        r = res[f"concurrency {c:g}"]
        if isinstance(r, TunerError):
            return None, str(r)
        by_u = {round(p.gpu_memory_utilization, 9): p.max_model_len for p in JobResult.from_wire(r).proposals}
        out[c] = [[u, by_u.get(round(u, 9))] for u in us]
    return out, None


def frontier_from_store(store: Store, *, model: str, device: str | None = None,
                        concurrency: list[float] | None = None, host: str | None = None,
                        worker: Callable[..., dict] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """The same picture from stored results: the latest drops whose model (and device) contain the
    given text — their proposals, grid points and one line per concurrency — and the measured runs
    of that model. In a fleet store each series is labelled ``NAME@HOST`` (as ``results`` labels
    proposals); ``host`` keeps only that ``host_id``'s drops.

    The concurrency lines are the drop searched again with each ``min_concurrency`` (simulate, at
    the stored utilizations): the stored grid is the search's sparse probes for the drop's own
    ``min_concurrency``, and its largest point with enough concurrency is not the largest length
    that has it (Qwen2.5-7B on an L4 at 0.85: 16 tokens for 4 requests where 13568 start). Where a
    drop cannot be searched here (its model config is not on this host) it has no concurrency
    lines, and ``notes`` says why."""
    drops = latest_drops(store, model=model, device=device)
    if host is not None:
        drops = [dr for dr in drops if dr.get("host_id") == host]
    if not drops:
        raise TunerError(f"no stored drop whose model contains {model!r}"
                         + (f" and device contains {device!r}" if device else "")
                         + (f" on host {host!r}" if host is not None else ""), where=store.where)
    cs = sorted({1.0, *(float(c) for c in (concurrency or (2, 4)))})
    frontiers, surface, notes = [], [], []
    paths = _drop_paths(store, [dr["id"] for dr in drops])
    for dr in drops:
        dr = {**dr, "name": dr["name"] + (f"@{dr['host_id']}" if dr.get("host_id") else ""),
              "path": paths.get(dr["id"])}
        try:
            min_c = float(((yaml.safe_load(dr["content"]) or {}).get("constraints") or {}).get("min_concurrency") or 1)
        except yaml.YAMLError:
            min_c = 1.0
        props = records.proposals_of_drop(store, dr["id"], by_utilization=True)
        frontiers.append({"label": f"{dr['name']}: proposals (>= {min_c:g} requests)", "min_concurrency": min_c,
                          "drop": dr["name"],
                          "points": [[p.gpu_memory_utilization, p.max_model_len] for p in props]})
        cands = records.candidates_of_drop(store, dr["id"])
        surface += [_surface_point(c, drop=dr["name"]) for c in cands]
        us = sorted({c.gpu_memory_utilization for c in cands} | {p.gpu_memory_utilization for p in props})
        lines, why = _resimulated(dr, us, cs, worker=worker, timeout_s=timeout_s)
        if lines is None:
            notes.append(f"{dr['name']}: no concurrency lines (the drop cannot be searched again here: {why})")
            continue
        for k in cs:
            frontiers.append({"label": f"{dr['name']}: largest max_model_len, >= {k:g} full-length request"
                                       f"{'s' if k != 1 else ''}", "min_concurrency": k, "drop": dr["name"],
                              "points": lines[k]})
    measured = _measured(store, model_like=model, device_like=device)
    title = (f"stored results for model ~ {model!r}" + (f", device ~ {device!r}" if device else "")
             + (f", host {host}" if host is not None else ""))
    return {"title": title, "source": "store", "frontiers": frontiers, "surface": surface, "measured": measured,
            "non_monotone_at": _non_monotone_us(surface), "notes": notes}


def _drop_paths(store: Store, ids: list[int]) -> dict[int, str | None]:
    from tuner.store.database import drops_table as d

    return {r["id"]: r["path"] for r in store.select(sa.select(d.c.id, d.c.path).where(d.c.id.in_(ids)))}


def _import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable("matplotlib is not installed; install the plot extra: pip install 'ctx-tuner[plot]'") \
            from exc
    return plt


def render_png(data: dict, out: str | Path) -> dict:
    """Draw ``data`` into ``out`` (PNG) and ``out`` with suffix ``.json``; return the drawn series
    (``{label: [[x, y], …]}`` read back from the figure's lines and scatter collections).

    Raises:
        PlotUnavailable: matplotlib is missing.
    """
    plt = _import_pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    try:
        for f in data["frontiers"]:
            pts = [(u, m) for u, m in f["points"] if m is not None]
            if pts:
                ax.plot([u for u, _ in pts], [m for _, m in pts], marker="o", markersize=3, linewidth=1.5,
                        label=f["label"])
        # a point refused only for min_concurrency starts: drawn apart, never as "does not start"
        starts = [p.get("starts", p["fits"]) for p in data["surface"]]
        sf = [tuple(point_of(p)) for p, st in zip(data["surface"], starts) if p["fits"]]
        sc = [tuple(point_of(p)) for p, st in zip(data["surface"], starts) if st and not p["fits"]]
        sn = [tuple(point_of(p)) for p, st in zip(data["surface"], starts) if not st]
        if sf:
            ax.scatter(*zip(*sf), marker="o", facecolors="none", edgecolors="tab:green", s=36,
                       label="simulated grid point: starts")
        if sc:
            ax.scatter(*zip(*sc), marker="o", facecolors="none", edgecolors="tab:orange", s=36,
                       label="simulated grid point: starts, below min_concurrency")
        if sn:
            ax.scatter(*zip(*sn), marker="x", color="tab:red", s=40, label="simulated grid point: does not start")
        mf = [tuple(point_of(p)) for p in data["measured"] if p["fits"]]
        mn = [tuple(point_of(p)) for p in data["measured"] if not p["fits"]]
        if mf:
            ax.scatter(*zip(*mf), marker="s", color="black", s=50, label="measured: started")
        if mn:
            ax.scatter(*zip(*mn), marker="X", color="darkred", s=70, label="measured: refused")
        if data.get("non_monotone_at"):
            us = ", ".join(f"{u:g}" for u in data["non_monotone_at"])
            ax.text(0.01, 0.02, f"not monotone at gmu {us}: a longer max_model_len starts above one that fails",
                    transform=ax.transAxes, fontsize=8, color="tab:red")
        ax.set_xlabel("gpu_memory_utilization")
        ax.set_ylabel("max_model_len (tokens)")
        ax.set_title(data["title"], fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        series: dict[str, list] = {}
        for line in ax.get_lines():
            series[line.get_label()] = [[float(x), float(y)] for x, y in line.get_xydata()]
        for coll in ax.collections:
            series[coll.get_label()] = [[float(x), float(y)] for x, y in coll.get_offsets()]
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    finally:
        plt.close(fig)
    sidecar = sidecar_path(out)
    sidecar.write_text(json.dumps({"title": data["title"], "series": series, "data": data}, indent=1))
    return series


def sidecar_path(out: str | Path) -> Path:
    """Where the plotted series of image ``out`` go: ``NAME.json`` for a PNG (``frontier.png`` →
    ``frontier.json``), ``NAME.EXT.json`` for any other format, so ``-o x.svg`` and ``-o x.png``
    never overwrite each other's data."""
    out = Path(out)
    return out.with_suffix(".json") if out.suffix.lower() == ".png" else out.with_name(out.name + ".json")

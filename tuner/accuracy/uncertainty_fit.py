"""The fit behind :mod:`tuner.memory.uncertainty`'s band sizes (``python -m tuner.accuracy.uncertainty_fit``).

Data: ``validate`` rows (:func:`tuner.accuracy.validate.predict_cases`) of the high-confidence records of a
case file (``shared/cases/vllm-observed.jsonl``), each with ``band_basis``: the expected KV bytes,
the observed ones (blocks × bytes per block, the printed GiB, or tokens × bytes per token), the
tolerance of the observation (one block, the ±0.005 GiB of a printed GiB, one block of tokens)
and, per fitted band (:data:`tuner.memory.uncertainty.PARAMETERS`), the bytes it scales.

Model: a row's interval is ``expected ± (Σ fraction_p × bytes_p + fixed)`` — the bands added
linearly as :func:`tuner.memory.uncertainty.kv_interval` adds them. Objective: the smallest mean
half-width (% of the expected KV, capped at 100 % a row) such that at least
:data:`COVERAGE_TARGET` of the rows hold their observation and at most :data:`UNSAFE_TARGET` of
them have the safe end above it by more than 1 % (a penalty of 10⁴ per unit share missed).
Search: coordinate descent over the grids :data:`GRIDS`, from the widest point, until no
coordinate moves, once per rotation of the :data:`tuner.memory.uncertainty.PARAMETERS` order; the best
objective wins (deterministic).

Cross-validation: leave-one-out by ``model_family`` — each family's rows judged with the bands
fitted on the other families (:func:`cross_validate`). The constants in :mod:`tuner.memory.uncertainty`
are the fit on every high-confidence row (:func:`fit_bands`); no per-model, GPU or case value.
Pure, except :func:`main` (runs the predictions in this process: imports torch).
"""

from __future__ import annotations

import statistics
from typing import Iterable, Mapping, Sequence

from tuner.memory.uncertainty import PARAMETERS

#: Share of the training rows whose observation the interval must hold.
COVERAGE_TARGET = 0.93
#: Share of the training rows allowed a safe end above the observation by more than 1 %.
UNSAFE_TARGET = 0.02

#: The values each fraction may take.
GRIDS: dict[str, tuple[float, ...]] = {
    # a simulated pass is never taken for exact: these grids start at 0.1 % and 1 % of the term
    "weights_simulated": (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02),
    "activation_simulated": (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5),
    # a rule calibrated on public logs and a fitted reserve are never taken for exact either
    "catalog_rule": (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0),
    "reserve_fit": (0.5, 1.0, 1.5, 2.0, 3.0),
    # a catalog total is a typical board's, not this one's: the grid starts at 0.1 % of the request
    "device_total": (0.001, 0.002, 0.003, 0.005, 0.01, 0.02),
    # an input with no rule is never taken for exact: these grids start at 3 % of the request
    "not_modelled": (0.03, 0.05, 0.075, 0.1, 0.15, 0.2),
    "release_not_stated": (0.03, 0.05, 0.075, 0.1, 0.15, 0.2),
}


def usable(rows: Iterable[Mapping]) -> list[dict]:
    """The rows the fit uses: predicted, high confidence, with an observed KV in bytes."""
    out = []
    for r in rows:
        b = r.get("band_basis") or {}
        if r.get("status") == "ok" and r.get("confidence", "high") != "low" and b.get("observed_kv_bytes") is not None \
                and b.get("expected_kv_bytes"):
            out.append(dict(r))
    return out


def judge(row: Mapping, fractions: Mapping[str, float]) -> tuple[bool, bool, float]:
    """``(covered, unsafe at the safe end, half-width in % of the expected KV)`` of one row.

    The low side is ``fixed_half_bytes`` + the fractions of ``bytes``; the high side
    ``fixed_high_bytes`` + the fractions of ``bytes_high`` where the row gives them (one-sided
    bands: an assumption's computed alternative, a cold compile cache), else the low side's."""
    b = row["band_basis"]
    kv, obs = float(b["expected_kv_bytes"]), float(b["observed_kv_bytes"])

    def side(fixed_key: str, bytes_key: str) -> float:
        return float(b.get(fixed_key) or 0) + sum(float(fractions.get(p, 0.0)) * float(v)
                                                  for p, v in (b.get(bytes_key) or {}).items())

    down = side("fixed_half_bytes", "bytes")
    up = side("fixed_high_bytes", "bytes_high") if "fixed_high_bytes" in b else down
    tol = float(b.get("tolerance_units") or 0) * float(b.get("bytes_per_unit") or 0)
    low, high = kv - down, kv + up
    covered = low - tol <= obs <= high + tol
    unsafe = low - obs > max(tol, 0.01 * abs(obs))
    return covered, unsafe, 100.0 * (down + up) / 2 / abs(kv)


def score(rows: Sequence[Mapping], fractions: Mapping[str, float]) -> dict:
    """Coverage, unsafe share, median and mean half-width (%) of ``rows`` under ``fractions``."""
    judged = [judge(r, fractions) for r in rows]
    n = max(1, len(judged))
    halves = [h for _c, _u, h in judged]
    return {"coverage": sum(1 for c, _u, _h in judged if c) / n, "unsafe": sum(1 for _c, u, _h in judged if u) / n,
            "median_half_width_pct": statistics.median(halves) if halves else 0.0,
            "mean_half_width_pct": sum(min(h, 100.0) for h in halves) / n}


def _objective(rows: Sequence[Mapping], fractions: Mapping[str, float]) -> float:
    s = score(rows, fractions)
    penalty = 0.0
    if s["coverage"] < COVERAGE_TARGET:
        penalty += 1e4 * (COVERAGE_TARGET - s["coverage"])
    if s["unsafe"] > UNSAFE_TARGET:
        penalty += 1e4 * (s["unsafe"] - UNSAFE_TARGET)
    return penalty + s["mean_half_width_pct"]


def _descend(data: Sequence[Mapping], order: Sequence[str]) -> tuple[float, dict[str, float]]:
    cur = {p: GRIDS[p][-1] for p in PARAMETERS}
    best = _objective(data, cur)
    for _sweep in range(8):
        moved = False
        for p in order:
            for v in GRIDS[p]:
                trial = {**cur, p: v}
                j = _objective(data, trial)
                if j < best - 1e-12:
                    best, cur, moved = j, trial, True
        if not moved:
            break
    return best, cur


def fit_bands(rows: Iterable[Mapping]) -> dict[str, float]:
    """The fractions (:data:`tuner.memory.uncertainty.PARAMETERS`) fitted on ``rows`` (see the module):
    coordinate descent from the widest point once per rotation of the parameter order, the best
    objective kept (the first rotation on a tie)."""
    data = usable(rows)
    found = []
    for k in range(len(PARAMETERS)):
        order = PARAMETERS[k:] + PARAMETERS[:k]
        found.append(_descend(data, order))
    return min(found, key=lambda x: x[0])[1]


def cross_validate(rows: Iterable[Mapping]) -> dict:
    """Leave-one-out by ``model_family``: every family's rows judged with the fractions fitted on
    the other families. Returns the pooled coverage, unsafe share and median half-width (%) and
    the rows not covered / unsafe."""
    data = usable(rows)
    families = sorted({str(r.get("model_family") or r.get("model")) for r in data})
    judged: list[tuple[str, bool, bool, float]] = []
    for fam in families:
        train = [r for r in data if str(r.get("model_family") or r.get("model")) != fam]
        f = fit_bands(train)
        for r in data:
            if str(r.get("model_family") or r.get("model")) == fam:
                judged.append((r["id"], *judge(r, f)))
    n = max(1, len(judged))
    halves = [h for *_x, h in judged]
    return {"rows": len(judged), "families": len(families),
            "coverage_pct": round(100.0 * sum(1 for _i, c, _u, _h in judged if c) / n, 2),
            "unsafe_pct": round(100.0 * sum(1 for _i, _c, u, _h in judged if u) / n, 2),
            "median_half_width_pct": round(statistics.median(halves), 3) if halves else None,
            "not_covered": [i for i, c, _u, _h in judged if not c],
            "unsafe": [i for i, _c, u, _h in judged if u]}


def report(rows: Iterable[Mapping]) -> dict:
    """The fit on every usable row, its own score, and the cross-validation."""
    rows = list(rows)
    f = fit_bands(rows)
    s = score(usable(rows), f)
    return {"fractions": f, "rows": len(usable(rows)),
            "in_sample": {k: round(v * (100 if k in ("coverage", "unsafe") else 1), 3) for k, v in s.items()},
            "leave_one_family_out": cross_validate(rows)}


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - developer entry point
    """``python -m tuner.accuracy.uncertainty_fit [CASES.jsonl [MODELS_DIR]]``: predict the cases, print the fit."""
    import json
    import sys

    from tuner.accuracy.validate import load_cases, predict_cases

    args = list(sys.argv[1:] if argv is None else argv)
    cases_path = args[0] if args else "../shared/cases/vllm-observed.jsonl"
    models_dir = args[1] if len(args) > 1 else "../shared/models"
    rows = predict_cases(load_cases(cases_path), models_dir)
    print(json.dumps(report(rows), indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

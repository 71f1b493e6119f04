"""Benchmark (on demand, not in the default test run): simulate-pass speed.

    .venv/bin/python tests/benchmarks/bench_simulate.py

Times one simulate pass (after imports) for Llama-3.1-8B and Llama-3.1-70B at N = 8192, R = 1024
(vLLM 0.19.0), and a whole sweep (the example drop's 3 × 16 grid plus the proposal search) for 8B.
Target: ≤ 2 s per pass after imports.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

t0 = time.perf_counter()
from tuner.question.drop import load_drop  # noqa: E402
from tuner.memory.eras import ProfileBatch, era_for  # noqa: E402
from tuner.jobs.job import run_job  # noqa: E402
from tuner.model.modelspec import load_model_spec, resolve_model_path  # noqa: E402
from tuner.model.plugin import RankSettings, load_registry  # noqa: E402
from tuner.model.simulate.profile import run_pass  # noqa: E402

import_s = time.perf_counter() - t0


def bench_pass(model_dir: Path, repeats: int = 3) -> float:
    spec, _ = load_model_spec(resolve_model_path(str(model_dir)))
    plugin, _ = load_registry().for_architectures(spec.architectures)
    era = era_for("0.19.0")
    st = RankSettings("0.19.0", spec.torch_dtype)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run_pass(plugin, spec, st, era, ProfileBatch(8192, 1024, 1024, True))
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    models = REPO / "configs" / "models"
    print(f"imports: {import_s:.2f} s")
    for name in ("meta-llama--Llama-3.1-8B-Instruct", "meta-llama--Llama-3.1-70B"):
        print(f"one simulate pass, {name}, N=8192: {bench_pass(models / name):.3f} s (best of 3)")
    d = load_drop(REPO / "configs" / "examples" / "llama-3.1-8b-h100.yaml")
    dev = d.resolve_device()
    t = time.perf_counter()
    r = run_job({"drop": d.to_dict(), "config_path": str(d.model_path() / "config.json"),
                 "device": {"name": dev.name, "total_memory_bytes": dev.total_memory_bytes}})
    print(f"whole sweep (8B, {len(r['candidates'])} candidates, {len(r['runs'])} passes): "
          f"{time.perf_counter() - t:.2f} s")
    d = load_drop(REPO / "configs" / "examples" / "llama-3.1-8b-rtx3090-v0.yaml")
    dev = d.resolve_device()
    t = time.perf_counter()
    r = run_job({"drop": d.to_dict(), "config_path": str(d.model_path() / "config.json"),
                 "device": {"name": dev.name, "total_memory_bytes": dev.total_memory_bytes}})
    print(f"whole sweep (8B V0 0.6.4, {len(r['candidates'])} candidates, {len(r['runs'])} passes, one per M probed): "
          f"{time.perf_counter() - t:.2f} s")


if __name__ == "__main__":
    main()

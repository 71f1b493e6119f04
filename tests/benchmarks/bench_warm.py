"""Benchmark (on demand, not in the default test run): the daemon's warm worker (issue 13).

    .venv/bin/python tests/benchmarks/bench_warm.py [--jobs N]

1. New model with a warm worker: the worker has run one job (the Llama-3.1-8B H100 example, so
   torch and transformers are imported), then gets the Llama-3.1-70B TP4 example — a model it has
   not built before. Seconds of that job, parent side (request written → reply read). Target ≤ 1 s.
2. Worker memory over many jobs: N jobs (default 100) of DeepSeek-V3 (671B, MLA + MoE, from
   ``../shared/models``) at TP 8 on H200, each at another ``gpu_memory_utilization``, in one warm
   worker (no recycling); the worker's resident memory after the first and the last job and its
   peak (``VmHWM``). Target: peak ≤ 1 GiB.

Exit status 0 when both meet their targets. Quote the figures with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("CTX_TUNER_SHARED", REPO.parent / "shared"))
NEW_MODEL_TARGET_S, RSS_TARGET = 1.0, 1 << 30


def _hwm(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _example(name: str) -> dict:
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import load_drop

    return prepare_request(load_drop(REPO / "configs" / "examples" / name), download=False)[0]


def _deepseek(gmu: float) -> dict:
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import parse_drop

    text = (f"name: deepseek-v3-{gmu}\nmodel: {SHARED / 'models' / 'deepseek-ai--DeepSeek-V3'}\ndevice: H200\n"
            f"engine_version: \"0.19.0\"\ntensor_parallel_size: 8\nmax_num_batched_tokens: 8192\nmax_num_seqs: 256\n"
            f"candidates:\n  gpu_memory_utilization: [{gmu}]\n  max_model_len: [32768, 65536, 131072]\n")
    return prepare_request(parse_drop(text.encode(), path=str(REPO / "bench-deepseek.yaml")), download=False)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=100)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(REPO))
    from tuner.seam.warmworker import WarmWorker, read_rss_bytes

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    warm = WarmWorker()
    kw = {"timeout_s": 600.0, "max_jobs": args.jobs + 10, "max_rss_bytes": 0}
    try:
        t0 = time.perf_counter()
        warm.run(_example("llama-3.1-8b-h100.yaml"), job="warm-up", **kw)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm.run(_example("llama-3.1-70b-h100-tp4.yaml"), job="70b", **kw)
        new_model = time.perf_counter() - t0
        print(f"1. first job in a cold worker (8B, imports included): {first:.2f} s; new model (70B TP4) in the "
              f"warm worker: {new_model:.2f} s (target <= {NEW_MODEL_TARGET_S} s)")
        rss, times = [], []
        for i in range(args.jobs):
            t0 = time.perf_counter()
            warm.run(_deepseek(round(0.80 + 0.15 * i / max(1, args.jobs - 1), 4)), job=f"deepseek {i}", **kw)
            times.append(time.perf_counter() - t0)
            rss.append(read_rss_bytes(warm.pid))
        peak = _hwm(warm.pid)
        gib = 1 << 30
        print(f"2. DeepSeek-V3 TP8 x {args.jobs} jobs in one warm worker (pid {warm.pid}): RSS after job 1 "
              f"{rss[0] / gib:.2f} GiB, after job {args.jobs} {rss[-1] / gib:.2f} GiB, peak (VmHWM) "
              f"{peak / gib:.2f} GiB (target <= 1 GiB); {sorted(times)[len(times) // 2]:.2f} s per job (median)")
    finally:
        warm.close()
    return 0 if new_model <= NEW_MODEL_TARGET_S and peak is not None and peak <= RSS_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark (on demand, not in the default test run): first answers from cold processes.

    .venv/bin/python tests/benchmarks/bench_cold.py [--runs N]

1. Cold CLI, new model: ``ctx-tuner profile configs/examples/llama-3.1-70b-h100-tp4.yaml`` in a new
   process (its worker subprocess included) against a new store, N runs; median wall seconds.
   Target (issue 13): ≤ 2.0 s. Then the same job's worker process alone (``python -m
   tuner.commands.worker_main`` on the job's request: no CLI, no store), with the heavy modules it
   imported (sympy, torch._dynamo / inductor, torch.distributed.tensor, transformers.activations:
   none, with the lean worker). Then the same CLI run against an existing store that holds another
   model (the 8B H100 example, profiled once): the store is opened and the memo looked up before
   the worker answers (``profile`` starts its worker ahead only where the memo cannot answer:
   no store, ``--no-cache``, not memoizable).
2. V0 after imports: a new process imports the worker side (torch, transformers, the job, the
   simulator), then runs the V0 example drop ``configs/examples/llama-3.1-8b-rtx3090-v0.yaml``
   (vLLM 0.6.4 without chunked prefill: one pass per ``max_model_len`` probed; the imports are
   :func:`tuner.commands.worker_main.preload`'s, as the one-shot worker runs them); seconds of that
   first job, median over N processes (and of the same job run again in that process, which
   leaves out what the first job still imports or builds on first use). Target (issue 13): ≤ 1.5 s.

Each cold CLI run is preceded by a ``python -c "import torch"`` (the floor of any answer that runs a
worker); the CLI's wall above that floor is printed beside it, as the figure this code controls
(this VM's speed drifts by a third within an hour, and torch's import with it).

``CTX_TUNER_BENCH_REPO=/path/to/other/checkout`` measures another checkout with this benchmark.
Each figure is also printed as CPU seconds (user + system of the process and its children), which
a loaded machine stretches less than wall time. Exit status 0 when both medians meet their targets.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The checkout measured: this one, or ``$CTX_TUNER_BENCH_REPO`` (another worktree, e.g. main for
#: before/after figures with this same benchmark).
REPO = Path(os.environ.get("CTX_TUNER_BENCH_REPO") or Path(__file__).resolve().parents[2])
COLD_DROP = REPO / "configs" / "examples" / "llama-3.1-70b-h100-tp4.yaml"
SEED_DROP = REPO / "configs" / "examples" / "llama-3.1-8b-h100.yaml"
V0_DROP = REPO / "configs" / "examples" / "llama-3.1-8b-rtx3090-v0.yaml"
COLD_TARGET_S, V0_TARGET_S = 2.0, 1.5

#: Modules the lean worker leaves unimported for these jobs (reported per figure).
HEAVY = ("sympy", "torch._dynamo", "torch._inductor", "torch.distributed.tensor", "transformers.activations")

#: The child of figure 2: imports first, then one timed job (JSON on stdout).
V0_CHILD = r"""
import json, sys, time
HEAVY = %r
t0 = time.perf_counter()
import torch  # noqa: F401
from tuner.jobs.app import prepare_request
from tuner.question.drop import load_drop
from tuner.jobs.job import run_job
from tuner.model.plugin import load_registry
import tuner.model.simulate.profile  # noqa: F401
try:
    from tuner.commands.worker_main import preload
except ImportError:  # a checkout before the worker's preload (for before/after figures)
    try:
        from tuner.model.transformers_lean import import_transformers
    except ImportError:  # a checkout before the lean import
        import transformers  # noqa: F401
    else:
        import_transformers()
    from transformers.models.auto.configuration_auto import AutoConfig  # noqa: F401
    load_registry()
    request = prepare_request(load_drop(sys.argv[1]))[0]
else:  # what the one-shot worker does before the job (imports, GC frozen)
    request = prepare_request(load_drop(sys.argv[1]))[0]
    preload(request)
t1, c1 = time.perf_counter(), time.process_time()
result = run_job(request)
t2, c2 = time.perf_counter(), time.process_time()
run_job(request)
print(json.dumps({"imports_s": t1 - t0, "job_s": t2 - t1, "job_cpu_s": c2 - c1, "repeat_s": time.perf_counter() - t2,
                  "repeat_cpu_s": time.process_time() - c2, "passes": len(result["runs"]),
                  "proposals": [p["max_model_len"] for p in result["proposals"]],
                  "heavy": sorted(m for m in HEAVY if m in sys.modules)}))
"""


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def torch_floor() -> float:
    """Wall seconds of ``python -c "import torch"`` now: the floor of every cold answer that runs
    a worker, and this VM's speed at the moment (it drifts by a third within an hour here)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, capture_output=True)
    return time.perf_counter() - t0


def cold_cli(runs: int, seeded: bool = False) -> tuple[list[float], list[float], list[float]]:
    """``profile`` of the 70B example in a new process, N runs: against a new store, or (``seeded``)
    against a copy of a store that holds the 8B example's run (made once, not timed). Each run is
    preceded by one :func:`torch_floor` (its figures are the third list)."""
    walls, cpus, floors = [], [], []
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory() as tmp:
        seed = Path(tmp) / "seed.sqlite"
        if seeded:
            subprocess.run([sys.executable, "-m", "tuner.cli", "profile", str(SEED_DROP), "--db", str(seed), "--quiet"],
                           cwd=REPO, env=env, capture_output=True, check=True)
        for i in range(runs):
            db = Path(tmp) / f"cold-{i}.sqlite"
            if seeded:
                shutil.copyfile(seed, db)
            floors.append(torch_floor())
            c0, t0 = _children_cpu(), time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "tuner.cli", "profile", str(COLD_DROP), "--db", str(db)],
                                  cwd=REPO, env=env, capture_output=True, text=True)
            walls.append(time.perf_counter() - t0)
            cpus.append(_children_cpu() - c0)
            if proc.returncode != 0:
                raise SystemExit(f"profile failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return walls, cpus, floors


#: The child of figure 1b: the 70B job's worker alone (``python -m tuner.commands.worker_main`` on its
#: request), reporting the heavy modules it imported.
WORKER_CHILD = r"""
import json, os, sys
HEAVY = %r
import tuner.commands.worker_main as wm

def report_then_exit(exit_=os._exit):
    # the worker ends without the interpreter's teardown (wm.skip_teardown): report first
    sys.stderr.write("ctx-bench-heavy: " + json.dumps(sorted(m for m in HEAVY if m in sys.modules)) + "\n")
    sys.stderr.flush()
    exit_(0)

if hasattr(wm, "skip_teardown"):
    wm.skip_teardown = report_then_exit
wm.main()
report_then_exit(sys.exit)  # a checkout whose worker returns (or a request it does not end early)
"""


def cold_worker(runs: int) -> tuple[list[float], list[float], list[str]]:
    """The 70B job's worker process alone (no CLI, no store): wall and CPU seconds, and the heavy
    modules it imported."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    sys.path.insert(0, str(REPO))
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import load_drop

    request = json.dumps(prepare_request(load_drop(str(COLD_DROP)))[0])
    walls, cpus, heavy = [], [], []
    for _ in range(runs):
        c0, t0 = _children_cpu(), time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", WORKER_CHILD % (HEAVY,)], input=request, cwd=REPO, env=env,
                              capture_output=True, text=True)
        walls.append(time.perf_counter() - t0)
        cpus.append(_children_cpu() - c0)
        if proc.returncode != 0 or '"ok": true' not in proc.stdout:
            raise SystemExit(f"worker failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        heavy = [line.split(": ", 1)[1] for line in proc.stderr.splitlines() if line.startswith("ctx-bench-heavy: ")]
    return walls, cpus, heavy


def v0_after_imports(runs: int) -> list[dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-c", V0_CHILD % (HEAVY,), str(V0_DROP)], cwd=REPO, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"V0 child failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def bytecode_note() -> str:
    """Whether the measured checkout's own modules (``tuner/``, ``plugins/``) load from cached
    bytecode: with ``PYTHONDONTWRITEBYTECODE`` set and no ``__pycache__`` (an editable checkout
    never byte-compiled), every process compiles them from source, about 0.1 CPU s of a cold
    worker that an installed wheel (byte-compiled by pip) or one ``python -m compileall -q tuner
    plugins`` does not pay; the figures then overstate a user's cold start by that much."""
    import importlib.util

    sources = [p for d in ("tuner", "plugins") for p in (REPO / d).rglob("*.py")]
    missing = [p for p in sources if not Path(importlib.util.cache_from_source(str(p))).is_file()]
    flag = "PYTHONDONTWRITEBYTECODE set" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "bytecode written"
    if not missing:
        return f"bytecode: every tuner/plugins module has a cached .pyc ({flag})"
    return (f"bytecode: {len(missing)} of {len(sources)} tuner/plugins modules without a cached .pyc ({flag})"
            + ("; each process compiles those it imports (`python -m compileall -q tuner plugins` once)"
               if os.environ.get("PYTHONDONTWRITEBYTECODE") else ""))


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="processes per figure (default 5)")
    args = ap.parse_args()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs")
    print(bytecode_note())
    walls, cpus, floors = cold_cli(args.runs)
    print(f"cold CLI, {COLD_DROP.name}: wall {_spread(walls)}; cpu {_spread(cpus)}; target <= {COLD_TARGET_S} s wall")
    print(f"  floor, `python -c 'import torch'` before each run: {_spread(floors)}; "
          f"the CLI above it: {_spread([w - f for w, f in zip(walls, floors)])}")
    s_walls, s_cpus, s_floors = cold_cli(args.runs, seeded=True)
    print(f"  into a store holding {SEED_DROP.name}: wall {_spread(s_walls)}; cpu {_spread(s_cpus)}; "
          f"above the floor: {_spread([w - f for w, f in zip(s_walls, s_floors)])}")
    w_walls, w_cpus, heavy = cold_worker(args.runs)
    print(f"  its worker alone: wall {_spread(w_walls)}; cpu {_spread(w_cpus)}; heavy modules imported: "
          f"{heavy[0] if heavy else '?'}")
    v0 = v0_after_imports(args.runs)
    job = [r["job_s"] for r in v0]
    print(f"V0 after imports, {V0_DROP.name} ({v0[0]['passes']} passes, proposals {v0[0]['proposals']}): "
          f"first job wall {_spread(job)}, cpu {_spread([r['job_cpu_s'] for r in v0])}; target <= {V0_TARGET_S} s wall")
    print(f"  the same job again in that process: wall {_spread([r['repeat_s'] for r in v0])}, "
          f"cpu {_spread([r['repeat_cpu_s'] for r in v0])}; the imports before: {_spread([r['imports_s'] for r in v0])}; "
          f"heavy modules imported: {v0[0].get('heavy')}")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    ok = statistics.median(walls) <= COLD_TARGET_S and statistics.median(job) <= V0_TARGET_S
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

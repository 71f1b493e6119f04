"""Benchmark (on demand, not in the default test run): answers from the pass memo (issue 13).

    .venv/bin/python tests/benchmarks/bench_memo.py [--runs N] [--cli-only]

1. Repeated question, cold CLI: the store holds the Llama-3.1-8B H100 example's passes (one
   ``profile`` run first); then N new processes run ``ctx-tuner profile`` for the same model and
   settings at other ``gpu_memory_utilization`` values and lengths. Median wall and CPU seconds
   (user + sys) of the whole process (answered from the memo: no worker, no torch). Target:
   ≤ 0.4 s wall. Beside it: the same question to ``ctx-tuner explain`` (read-only), the same with
   ``--no-cache`` (a worker per answer), the floor of a bare interpreter (``python -c pass``) and,
   for scale, ``import sqlalchemy`` with its SQLite dialect — the store library's import, which a
   memo answer on a SQLite store at head no longer pays (:mod:`tuner.store.litestore`; before it, about
   0.3 s of a 0.5 s answer).
2. Daemon, new drop file with memoized passes: an in-process daemon (real worker subprocesses)
   profiles one drop, then N drop files of the same model at other u values (each its own result
   key, so the fleet's shared-result copy does not apply) are written one at a time; seconds from
   the write to the proposal file, minus the debounce. Target: ≤ 0.2 s.

ctx-tuner's modules are byte-compiled first (``compileall``): an installed package has its
``.pyc`` files, and under ``PYTHONDONTWRITEBYTECODE=1`` an editable checkout would otherwise
compile every module in every process (about 0.2 CPU s more).

Exit status 0 when both medians meet their targets. Figures depend on the machine's load: quote
them with it (printed first, and again at the end).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "configs" / "examples" / "llama-3.1-8b-h100.yaml"
CLI_TARGET_S, DAEMON_TARGET_S = 0.4, 0.2


def _drop(tmp: Path, name: str, gmu: float, max_model_len: int = 32768) -> Path:
    text = EXAMPLE.read_text()
    model = (EXAMPLE.parent / "../models/meta-llama--Llama-3.1-8B-Instruct").resolve()
    text = text.replace("model: ../models/meta-llama--Llama-3.1-8B-Instruct", f"model: {model}")
    text = text.replace("name: llama-3.1-8b-h100", f"name: {name}")
    text = text.replace("gpu_memory_utilization: [0.8, 0.9, 0.95]", f"gpu_memory_utilization: [{gmu}]")
    text = text.replace("max_model_len: {min: 8192, max: 131072, step: 8192}", f"max_model_len: [{max_model_len}]")
    p = tmp / f"{name}.yaml"
    p.write_text(text)
    return p


def _timed(cmd: list[str], cwd: Path) -> tuple[float, float]:
    """Wall and CPU seconds (user + sys of the child) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=cwd, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _cli(args: list[str], cwd: Path) -> tuple[float, float]:
    return _timed([str(Path(sys.executable).parent / "ctx-tuner"), *args], cwd)


def _line(what: str, samples: list[tuple[float, float]], target: str = "") -> str:
    walls, cpus = [w for w, _ in samples], [c for _, c in samples]
    return (f"{what}: median {statistics.median(walls):.3f} s wall (min {min(walls):.3f}), "
            f"{statistics.median(cpus):.3f} s CPU (min {min(cpus):.3f}) over {len(samples)} runs{target}")


def bench_cli(runs: int) -> float:
    tmp = Path(tempfile.mkdtemp(prefix="bench-memo-"))
    db = str(tmp / "store.sqlite")
    _cli(["profile", str(_drop(tmp, "first", 0.9)), "--db", db], tmp)  # fills the memo
    memo, explain, fresh, bare, sqla = [], [], [], [], []
    for i in range(runs):
        drop = _drop(tmp, f"again{i}", round(0.5 + 0.04 * i, 2), 8192 * (i + 1))
        memo.append(_cli(["profile", str(drop), "--db", db], tmp))
        explain.append(_cli(["explain", str(drop), "--db", db], tmp))
        fresh.append(_cli(["profile", str(drop), "--db", db, "--no-cache"], tmp))
        bare.append(_timed([sys.executable, "-c", "pass"], tmp))
        sqla.append(_timed([sys.executable, "-c", "import sqlalchemy, sqlalchemy.dialects.sqlite"], tmp))
    med = statistics.median(w for w, _ in memo)
    print(_line("1. repeated question, cold CLI `profile` (memo)", memo, f" (target <= {CLI_TARGET_S} s wall)"))
    print(_line("   the same question, cold CLI `explain` (memo)", explain))
    print(_line("   `profile --no-cache` (worker)", fresh))
    print(_line("   floor: python -c pass", bare))
    print(_line("   for scale: import sqlalchemy + its SQLite dialect (not paid above)", sqla))
    return med


def bench_daemon(runs: int, poll: bool = False) -> float:
    from tests._daemon_helpers import settings_for
    from tuner.daemon.service import Daemon
    from tuner.daemon.notify import Notifier

    tmp = Path(tempfile.mkdtemp(prefix="bench-memo-daemon-"))
    s = settings_for(tmp, worker_python=None, debounce_s=0.05, job_timeout_s=600.0)
    conf, props = Path(s.watch_dir), Path(s.state_dir) / "proposals"
    d = Daemon(s, notifier=Notifier({}))
    d.start()
    times, cpu = [], []
    try:
        def until(path: Path, limit: float) -> float:
            # the daemon's own loop: each step waits for a wake-up (file event, finished job) or its
            # next deadline, as under Daemon.run; a poll every 5 ms instead (--poll, the figure's
            # method before) takes the GIL from the job thread
            t_end = time.monotonic() + limit
            while not path.exists():
                if time.monotonic() > t_end:
                    raise SystemExit(f"no {path} after {limit} s")
                d.step(max_wait_s=0.005 if poll else 0.5)
            return time.monotonic()

        _drop(conf, "first", 0.9)
        until(props / "first.yaml", 600)
        for i in range(runs):
            t0, c0 = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
            _drop(conf, f"memo{i}", round(0.5 + 0.04 * i, 2), 8192 * (i + 1))
            times.append(until(props / f"memo{i}.yaml", 120) - t0 - s.debounce_s)
            c1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu.append(c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime)
    finally:
        d.shutdown()
    med = statistics.median(times)
    print(f"2. daemon, new drop with memoized passes: drop write -> proposal file median {med:.3f} s after the "
          f"{s.debounce_s:g} s debounce (min {min(times):.3f}, max {max(times):.3f}, {runs} drops; target <= "
          f"{DAEMON_TARGET_S} s); {statistics.median(cpu):.3f} CPU s per drop (daemon process){' (5 ms poll)' if poll else ''}")
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cli-only", action="store_true", help="only the cold CLI figures (1.)")
    ap.add_argument("--daemon-only", action="store_true", help="only part 2")
    ap.add_argument("--poll", action="store_true", help="part 2 polls every 5 ms (the method of the earlier figures)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(REPO))
    import compileall

    for d in ("tuner", "plugins", "migrations"):  # what an installed package has (see the docstring)
        compileall.compile_dir(str(REPO / d), quiet=1)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    cli = 0.0 if args.daemon_only else bench_cli(args.runs)
    daemon = 0.0 if args.cli_only else bench_daemon(args.runs, args.poll)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0 if cli <= CLI_TARGET_S and daemon <= DAEMON_TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark (on demand, not in the default test run): ``ctx-tuner validate`` speed.

    .venv/bin/python tests/benchmarks/bench_validate.py [CASES.jsonl] [MODELS_DIR]

Runs the whole visible case set (default ``../shared/cases/vllm-observed.jsonl``) the way the CLI
does — one worker subprocess for every case — and prints the wall time and the summary line.
Target (issue 7): the whole visible set in under a minute on a CPU-only machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("CTX_TUNER_SHARED", REPO.parent / "shared"))


def main() -> int:
    cases = Path(sys.argv[1]) if len(sys.argv) > 1 else SHARED / "cases" / "vllm-observed.jsonl"
    models = Path(sys.argv[2]) if len(sys.argv) > 2 else SHARED / "models"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tuner.cli", "validate", str(cases), "--models-dir", str(models)],
                          capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    summary = [line for line in proc.stdout.splitlines() if line.startswith("cases ")]
    print(f"validate {cases.name}: {wall:.1f} s wall (exit {proc.returncode}); target < 60 s")
    print(summary[0] if summary else proc.stderr[-2000:])
    return 0 if proc.returncode == 0 and wall < 60 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark (on demand): the cost of parsing a ``vllm serve`` line with vLLM's own parser.

    .venv/bin/python tests/benchmarks/bench_vllm_parser.py --python /path/to/vllm-venv/bin/python [--runs N]

Per run, one new interpreter (as ``check`` starts one): wall and CPU seconds of the whole
subprocess, the ``import vllm`` + serve-parser import it reports (``import_s``), the parse itself
(``parse_s``); then 20 lines in one subprocess (``parse_many``); and the built-in parser's time per
line in this process. Medians over N runs. No target: the figures are reported (README "Check a
vllm serve line").
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tuner.memory.serve_args import parse_serve, strip_program  # noqa: E402
from tuner.engine.serve_parser import VllmServeParser  # noqa: E402

LINE = ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--max-model-len", "32k", "-tp", "2",
        "--gpu-memory-utilization", "0.9", "--port", "8000", "--enable-prefix-caching"]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=os.environ.get("CTX_TUNER_VLLM_PYTHON"), required=False)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if not args.python:
        print("give --python (an interpreter with vLLM) or CTX_TUNER_VLLM_PYTHON", file=sys.stderr)
        return 2
    p = VllmServeParser(args.python, timeout_s=600)
    walls, cpus, imports, parses, many = [], [], [], [], []
    for _ in range(args.runs):
        c0, t0 = _children_cpu(), time.perf_counter()
        sa = p.parse(strip_program(LINE))
        walls.append(time.perf_counter() - t0)
        cpus.append(_children_cpu() - c0)
        imports.append(sa.parser_info["import_s"])
        parses.append(sa.parser_info["parse_s"])
    t0 = time.perf_counter()
    p.parse_many([(strip_program(LINE), None)] * 20)
    many.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(1000):
        parse_serve(LINE)
    builtin = (time.perf_counter() - t0) / 1000
    med = statistics.median
    print(f"vLLM parser ({sa.parser}, {args.python}), median of {args.runs}:")
    print(f"  one line in a new interpreter: {med(walls):.2f} s wall, {med(cpus):.2f} s CPU; "
          f"import {med(imports):.2f} s, parse {med(parses) * 1000:.1f} ms")
    print(f"  20 lines in one interpreter: {many[0]:.2f} s wall")
    print(f"built-in parser: {builtin * 1e6:.0f} us per line")
    return 0


if __name__ == "__main__":
    sys.exit(main())

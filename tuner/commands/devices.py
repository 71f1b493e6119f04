"""``ctx-tuner devices [--json]``: the NVIDIA GPUs of this host through NVML (name, UUID, total,
free and used memory, memory held by other processes). Exit codes: 0 listed; 1 no GPU / NVML
not available (the message says which)."""

from __future__ import annotations

import json
import sys

from tuner.errors import DeviceError

EXIT_OK, EXIT_FAILED = 0, 1
NAME = "devices"
GiB = 1 << 30


def add_parser(sub):
    p = sub.add_parser("devices", help="list this host's NVIDIA GPUs (NVML)")
    p.add_argument("--json", action="store_true", help="print a JSON list (bytes as integers)")
    return p


def _gib(v) -> str:
    return "-" if v is None else f"{v / GiB:.2f}"


def render(gpus) -> str:
    head = f"{'#':>2} {'name':<28} {'catalog':<12} {'uuid':<40} {'total':>7} {'free':>7} {'used':>7} {'others':>7} {'procs':>5}"
    lines = [head, "-" * len(head)]
    for g in gpus:
        lines.append(f"{g.index:>2} {g.name[:28]:<28} {(g.catalog_name or '-'):<12} {g.uuid[:40]:<40} "
                     f"{_gib(g.total_memory_bytes):>7} {_gib(g.free_memory_bytes):>7} {_gib(g.used_memory_bytes):>7} "
                     f"{_gib(g.other_processes_bytes):>7} {('-' if g.processes is None else g.processes):>5}")
    lines.append("(GiB = 2^30 bytes; NVML totals are physical and exceed what CUDA/vLLM see by the driver reservation)")
    return "\n".join(lines)


def run(args, nvml=None) -> int:
    from tuner.memory.devices import list_gpus

    try:
        gpus = list_gpus(nvml)
    except DeviceError as exc:
        print(f"ctx-tuner: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps([g.to_dict() for g in gpus], indent=2))
    else:
        print(render(gpus))
    return EXIT_OK

"""Measured profile methods (``cuda``, ``vllm``): run on a GPU host, in a worker subprocess.

Nothing here is imported by the CLI's main process; torch and vllm are imported inside the
functions that need them. :func:`available_methods` tells what this host can run (no torch).
"""

from __future__ import annotations

import importlib.util
from typing import Any


def has_vllm() -> bool:
    """True when ``vllm`` is importable here (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def available_methods(nvml: Any = None) -> list[str]:
    """Methods this host can run, best first: ``vllm`` (GPU and vllm installed), ``cuda`` (GPU),
    ``simulate`` (always). Never raises: a missing GPU or NVML just drops the GPU methods."""
    from tuner.memory.devices import list_gpus
    from tuner.errors import DeviceError

    try:
        gpu = bool(list_gpus(nvml))
    except DeviceError:
        gpu = False
    methods = []
    if gpu and has_vllm():
        methods.append("vllm")
    if gpu:
        methods.append("cuda")
    return methods + ["simulate"]


def pick_method(requested: str, nvml: Any = None) -> str:
    """``auto`` → the best of :func:`available_methods`; any other method is returned as is."""
    return available_methods(nvml)[0] if requested == "auto" else requested

"""Import-only ``torchvision`` stand-in for the engine adapter (ctx-tuner, not torchvision).

The CPU build of vLLM cannot load torchvision's binary ops with its torch, yet transformers'
image processors of multimodal checkpoints import torchvision at module level; vLLM imports them
while inspecting the architecture (in a subprocess, hence ``PYTHONPATH``). The engine adapter
builds language models only (``language_model_only=True``): nothing here is ever called. Any
attribute is a placeholder class; calling one raises.
"""

from __future__ import annotations

import enum

__version__ = "0.0.0+ctx-tuner-stub"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Placeholder:
    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("torchvision is a ctx-tuner import stub here (engine adapter): not callable")


def placeholder(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    if name == "InterpolationMode":
        return InterpolationMode
    return type(name, (_Placeholder,), {})


_SUBMODULES = ("transforms", "io", "ops", "utils")


def __getattr__(name: str):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    return placeholder(name)

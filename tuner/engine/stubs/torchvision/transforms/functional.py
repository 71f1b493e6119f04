"""Part of ctx-tuner's import-only torchvision stand-in (see torchvision/__init__.py)."""

from torchvision import InterpolationMode, placeholder  # noqa: F401


def __getattr__(name: str):
    return placeholder(name)

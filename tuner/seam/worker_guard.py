"""Limits a worker subprocess sets on itself at start (stdlib only; runs before torch is imported).

The parent (:func:`tuner.seam.worker.run_in_worker`) passes them in the environment:

* ``CTX_TUNER_PARENT_PID`` — the worker dies with its parent, and its whole process group with
  it (the children a pass starts, such as an engine's helpers): ``prctl(PR_SET_PDEATHSIG)``
  (Linux, through ctypes) delivers a blocked real-time signal that a watchdog thread waits for
  (``sigtimedwait``), and the same thread polls ``getppid()`` (the death signal follows the
  parent *thread*, and misses a parent that died before the call); either way it SIGKILLs the
  group at once.
* ``CTX_TUNER_WORKER_DEADLINE_S`` — the worker's own wall-clock deadline: at expiry it kills its
  process group, even when nobody is left to do it (the parent's timeout is the first line).
* ``CTX_TUNER_WORKER_MEMORY_MAX_BYTES`` — ``RLIMIT_DATA`` (private writable memory: heap and
  anonymous maps, what a runaway allocation grows; device and shared mappings are not counted,
  so CUDA still works): an allocation beyond it fails in the worker (``MemoryError``) instead of
  waking the host's OOM killer. The worker also raises its ``oom_score_adj`` so that, if the
  kernel must kill something, it kills the worker rather than the daemon.

Every step is best effort: a refusal (seccomp, no ``/proc``) is ignored, never fatal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, Mapping

ENV_PARENT = "CTX_TUNER_PARENT_PID"
ENV_DEADLINE = "CTX_TUNER_WORKER_DEADLINE_S"
ENV_MEMORY = "CTX_TUNER_WORKER_MEMORY_MAX_BYTES"
#: How often the watchdog thread checks that the parent is alive (seconds).
PARENT_POLL_S = 0.5
PR_SET_PDEATHSIG = 1


def kill_own_group() -> None:
    """SIGKILL this process's group when it leads one (``start_new_session``), else itself."""
    try:
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``; False where it is unavailable or refused."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_memory_limit(max_bytes: int) -> bool:
    """Lower ``RLIMIT_DATA`` to ``max_bytes`` (never raise it). False where refused."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = max_bytes if hard == resource.RLIM_INFINITY else min(max_bytes, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
        return True
    except (ImportError, ValueError, OSError):
        return False


def prefer_oom_kill() -> None:
    """Ask the kernel's OOM killer to pick this process first (``oom_score_adj`` 1000)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("1000")
    except OSError:
        pass


def _death_signal() -> int | None:
    """The signal the parent's death delivers: a real-time one nothing else uses, blocked in
    every thread so only the watchdog's ``sigtimedwait`` takes it; None where unsupported."""
    if not hasattr(signal, "SIGRTMIN") or not hasattr(signal, "sigtimedwait"):
        return None
    return signal.SIGRTMIN + 3


def install(environ: Mapping[str, str] | None = None, *, getppid: Callable[[], int] = os.getppid,
            die: Callable[[], None] = kill_own_group, poll_s: float = PARENT_POLL_S,
            monotonic: Callable[[], float] = time.monotonic,
            pdeathsig: Callable[[int], bool] = set_pdeathsig, arm: bool = True) -> list[threading.Thread]:
    """Apply the limits named in ``environ`` (default ``os.environ``). Call it from the main thread
    before other threads exist. Returns the watchdog threads started (daemon threads; tests
    inject ``getppid``/``die``/``poll_s``/``pdeathsig``). ``arm=False`` leaves the deadline
    unarmed: a worker started before its request (``--preload``) arms it when the request comes
    (:func:`arm_deadline`), so the time its parent took before sending it is not charged."""
    env = os.environ if environ is None else environ
    threads = []
    mem = env.get(ENV_MEMORY)
    if mem and mem.isdigit() and int(mem) > 0:
        set_memory_limit(int(mem))
    prefer_oom_kill()
    parent = env.get(ENV_PARENT)
    if parent and parent.isdigit():
        ppid = int(parent)
        sig = _death_signal()
        if sig is not None:
            try:
                signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
            except (OSError, ValueError):
                sig = None
        pdeathsig(sig if sig is not None else signal.SIGKILL)
        if getppid() != ppid:  # the parent died before the prctl took effect
            die()

        def watch_parent() -> None:
            while True:
                if sig is not None:
                    got = signal.sigtimedwait([sig], poll_s)
                else:
                    got = None
                    time.sleep(poll_s)
                if got is not None or getppid() != ppid:
                    die()
                    return

        threads.append(threading.Thread(target=watch_parent, name="ctx-tuner-parent-watch", daemon=True))
    deadline = env.get(ENV_DEADLINE)
    try:
        limit_s = float(deadline) if deadline else 0.0
    except ValueError:
        limit_s = 0.0
    if limit_s > 0 and arm:
        threads.append(deadline_thread(limit_s, die=die, monotonic=monotonic))
    for t in threads:
        t.start()
    return threads


def deadline_thread(limit_s: float, *, die: Callable[[], None] = kill_own_group,
                    monotonic: Callable[[], float] = time.monotonic) -> threading.Thread:
    """A daemon thread (not started) that calls ``die`` once ``limit_s`` seconds have passed."""
    end = monotonic() + limit_s

    def watch_deadline() -> None:
        while True:
            left = end - monotonic()
            if left <= 0:
                die()
                return
            time.sleep(min(left, 1.0))

    return threading.Thread(target=watch_deadline, name="ctx-tuner-deadline", daemon=True)


def arm_deadline(limit_s: float | None, environ: Mapping[str, str] | None = None, *,
                 die: Callable[[], None] = kill_own_group,
                 monotonic: Callable[[], float] = time.monotonic) -> threading.Thread | None:
    """Arm this process's deadline now: ``limit_s`` seconds, else :data:`ENV_DEADLINE` of
    ``environ``; nothing for no positive limit. Returns the started thread."""
    if limit_s is None:
        try:
            limit_s = float((os.environ if environ is None else environ).get(ENV_DEADLINE) or 0)
        except ValueError:
            limit_s = 0.0
    if not limit_s or limit_s <= 0:
        return None
    thread = deadline_thread(float(limit_s), die=die, monotonic=monotonic)
    thread.start()
    return thread


def end_now(code: int = 0, *, exit_: Callable[[int], None] = os._exit) -> None:
    """End this process now with ``code``, without the interpreter's teardown (finalizing hundreds
    of modules: ~0.2 s for a worker holding torch, ~0.1 s for the CLI), once its work is done and
    its output written: stdout and stderr are flushed first (a stream that is closed or gone is
    skipped). The one-shot worker calls it after its reply (:func:`tuner.commands.worker_main.skip_teardown`),
    the ``ctx-tuner`` console script after :func:`tuner.cli.main` (:func:`tuner.cli.run`).
    ``exit_`` is injectable for tests."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    exit_(code)

"""Run a profile job in a worker subprocess (parent side; never imports torch).

The child is ``python -m tuner.commands.worker_main``: it reads one JSON request on stdin and writes one
JSON reply on stdout, both in the versioned contract of :mod:`tuner.question.protocol` (a reply of another
version is a :class:`~tuner.errors.ProtocolError`). It runs in its own process group (``start_new_session``) so a timeout kills
the whole group; a crash, a signal or unreadable output becomes a :class:`WorkerError` carrying
the job name and the tail of the child's stderr.

The child also guards itself (:mod:`tuner.seam.worker_guard`, from the environment set here): it dies
with this process (``PR_SET_PDEATHSIG`` plus a ``getppid`` watchdog that kills its group), keeps
its own deadline (``timeout_s`` + :data:`DEADLINE_GRACE_S`) and, with ``memory_max_bytes``, a
memory limit.

A caller that knows early that it will run a job can start its worker ahead
(:func:`spawn_worker`, ``tuner.commands.worker_main --preload``: the heavy imports run while the caller
still opens its store) and hand the :class:`WorkerHandle` to ``run_in_worker(..., spawned=)``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any, Callable

from tuner.errors import TunerError, WorkerError, WorkerTimeout

if TYPE_CHECKING:
    from tuner.question.protocol import JobRequest, ValidateRequest

#: Worker processes this process is waiting for, from any thread: ``pid`` (= its process group)
#: → the ``killpg`` to use. Read by :func:`kill_running_workers` from signal handlers, so a plain
#: dict (single operations are atomic) and no lock.
_RUNNING: dict[int, Callable[[int, int], None]] = {}

#: Default wall-clock limit of one job (seconds).
DEFAULT_TIMEOUT_S = 600.0

#: The worker's own deadline is the parent's timeout plus this (seconds): the parent kills first.
DEADLINE_GRACE_S = 5.0
#: The key of a request sent to a worker started ahead (:func:`spawn_worker`): its own deadline,
#: seconds from when it reads the request (:func:`tuner.seam.worker_guard.arm_deadline`).
DEADLINE_KEY = "deadline_s"

#: Prefix of the progress lines a job writes on stderr (request ``"progress": true``); the parent
#: passes them to ``on_progress`` and keeps them out of error tails.
PROGRESS_PREFIX = "ctx-tuner-progress: "


def run_in_worker(request: "JobRequest | ValidateRequest | dict[str, Any]", *, job: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                  python: str | None = None, popen: Callable[..., subprocess.Popen] = subprocess.Popen,
                  killpg: Callable[[int, int], None] = os.killpg,
                  on_progress: Callable[[str], None] | None = None,
                  memory_max_bytes: int | None = None, spawned: "WorkerHandle | None" = None) -> dict[str, Any]:
    """Run one job in a fresh worker process and return its result dict.

    Args:
        request: the job: a :class:`tuner.question.protocol.JobRequest` / ``ValidateRequest`` (sent as its
            wire object), or a wire object already (sent as is, stamped with the protocol version).
        job: a name for errors and logs (the drop name).
        timeout_s: wall-clock limit in seconds; on expiry the process group gets SIGKILL.
        python, popen, killpg: injectable for tests.
        on_progress: called with each progress line the job writes (the request gets
            ``"progress": true``); stderr is then read while the job runs.
        memory_max_bytes: the worker's memory limit (``RLIMIT_DATA``); None or 0: none.
        spawned: a worker already started for this job (:func:`spawn_worker`): the request goes
            to that process instead of a new one, and the limit is the handle's, counted from now
            — the request carries it (:data:`DEADLINE_KEY`) and the worker arms its own deadline
            when it reads it (``timeout_s``, ``python``, ``popen``, ``killpg`` and
            ``memory_max_bytes`` given here are then not used). A handle serves one job.

    Raises:
        WorkerTimeout: the limit expired (the group was killed).
        WorkerError: the child crashed, was killed, or wrote no valid reply; or ``spawned`` was
            already used or cancelled.
        ProtocolError: the child answered in another protocol version (another ctx-tuner).
        TunerError: the child reported a typed error (bad config, plugin failure, …), re-raised
            as the same class of :mod:`tuner.errors` with the same ``where`` / ``path`` / ``field``
            (:func:`error_from_reply`).
        KeyboardInterrupt, SystemExit, …: anything raised while waiting kills the worker's
            process group first, then propagates.
    """
    request = _wire(request)
    if spawned is None:
        spawned = spawn_worker(timeout_s=timeout_s, python=python, memory_max_bytes=memory_max_bytes, popen=popen,
                               killpg=killpg, preload=False)
    else:  # the job's limit counts from now; the worker arms its own deadline when the request comes
        request = {**request, DEADLINE_KEY: spawned.timeout_s + DEADLINE_GRACE_S}
    wait_s = spawned.timeout_s
    proc = spawned.claim(job)
    try:
        return _wait_for_reply(proc, request, job=job, timeout_s=spawned.timeout_s, wait_s=wait_s,
                               killpg=spawned.killpg, on_progress=on_progress)
    finally:
        _RUNNING.pop(proc.pid, None)


#: :func:`run_in_worker` itself, for :func:`spawner_for` (a test that replaces the module's name
#: with a fake gets no real process spawned ahead for it).
_RUN_IN_WORKER = run_in_worker


def worker_env(environ: "dict[str, str] | None" = None, *, cwd: str | None = None) -> dict[str, str]:
    """The environment every worker process starts with: ``environ`` (default ``os.environ``) with
    the offline hub flags (unless set), unbuffered output and the worker isolated from the
    caller's working directory:

    * ``PYTHONSAFEPATH=1`` (Python 3.11+, which the worker needs anyway; inherited by what it
      starts): ``python -m tuner.commands.worker_main`` puts no working directory on ``sys.path``, so a
      planted ``yaml/`` or ``json.py`` where the daemon was started is never imported;
    * ``PYTHONPATH`` only as configured, each entry made absolute against ``cwd`` (default: this
      process's working directory) and empty entries dropped (an empty entry *is* the working
      directory).
    """
    env = dict(os.environ if environ is None else environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONSAFEPATH"] = "1"
    if "PYTHONPATH" in env:
        base = cwd or os.getcwd()
        parts = [os.path.join(base, p) if not os.path.isabs(p) else p
                 for p in env["PYTHONPATH"].split(os.pathsep) if p.strip()]
        if parts:
            env["PYTHONPATH"] = os.pathsep.join(parts)
        else:
            env.pop("PYTHONPATH")
    return env


def _start_worker(args: list[str], *, timeout_s: float, python: str | None, memory_max_bytes: int | None,
                  popen: Callable[..., subprocess.Popen]) -> subprocess.Popen:
    """Start ``python -m tuner.commands.worker_main ARGS`` in its own process group, with the environment
    every one-shot worker gets (offline hub, unbuffered output, the :mod:`tuner.seam.worker_guard`
    limits: this process as its parent, the deadline ``timeout_s`` + :data:`DEADLINE_GRACE_S`
    from now, the memory limit)."""
    env = worker_env()
    from tuner.seam.worker_guard import ENV_DEADLINE, ENV_MEMORY, ENV_PARENT

    env[ENV_PARENT] = str(os.getpid())
    env[ENV_DEADLINE] = f"{timeout_s + DEADLINE_GRACE_S:g}"
    if memory_max_bytes:
        env[ENV_MEMORY] = str(int(memory_max_bytes))
    else:
        env.pop(ENV_MEMORY, None)
    exe = worker_python(python)
    try:
        proc = popen([exe, "-m", "tuner.commands.worker_main", *args], stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env)
    except OSError as exc:  # a missing interpreter, a bad #! line, no permission, no memory
        raise WorkerError(f"cannot start the worker Python {exe}: {exc.strerror or exc}", where="worker") from exc
    try:  # what a crash is read against (crash_error): the limit this process runs under
        proc.ctx_tuner_memory_max_bytes = int(memory_max_bytes) if memory_max_bytes else None
    except AttributeError:  # a test's stand-in without attributes
        pass
    return proc


class WorkerHandle:
    """A one-shot worker process started before its request (:func:`spawn_worker`), for one job.

    :func:`run_in_worker` (``spawned=``) sends it the request; :meth:`cancel` kills and reaps it
    when no job comes after all. As a context manager it is cancelled on the way out unless a job
    used it, so no path (an error before the job, ``KeyboardInterrupt``) leaves it running; it is
    also in :data:`_RUNNING` from its spawn, for :func:`kill_running_workers`.

    The limit (``timeout_s``) counts from the request, not from the spawn: the imports ran while
    the parent did its own work (a store locked by another writer may keep it waiting), so only
    the job is charged; the worker arms its own deadline (:mod:`tuner.seam.worker_guard`) when the
    request comes. Until then it waits on its stdin, and dies with its parent.
    """

    def __init__(self, proc: subprocess.Popen, *, timeout_s: float, killpg: Callable[[int, int], None]) -> None:
        self.proc = proc
        self.timeout_s = float(timeout_s)
        self.killpg = killpg
        self.used = False
        self.cancelled = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def claim(self, job: str) -> subprocess.Popen:
        """The process, for the one job that uses it (:func:`run_in_worker`); from then on that
        job owns it (kills it on any error) and :meth:`cancel` does nothing.

        Raises:
            WorkerError: the handle was already used or cancelled."""
        if self.used or self.cancelled:
            raise WorkerError(f"worker process {self.proc.pid} was already {'used' if self.used else 'cancelled'}",
                              where=job)
        self.used = True
        return self.proc

    def cancel(self) -> None:
        """Kill the worker's process group, reap the process, close its pipes and unregister it;
        nothing once a job used the handle (that job reaps it) or when already cancelled."""
        if self.used or self.cancelled:
            return
        self.cancelled = True
        try:
            _kill_group(self.proc, self.killpg)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # SIGKILLed already: a zombie the kernel will reap with us
                pass
        finally:
            _RUNNING.pop(self.proc.pid, None)
            for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    try:
                        pipe.close()
                    except OSError:
                        pass

    def __enter__(self) -> "WorkerHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


def spawn_worker(*, timeout_s: float = DEFAULT_TIMEOUT_S, python: str | None = None,
                 memory_max_bytes: int | None = None, popen: Callable[..., subprocess.Popen] = subprocess.Popen,
                 killpg: Callable[[int, int], None] = os.killpg, preload: bool = True) -> WorkerHandle:
    """Start a one-shot worker now, before its request exists, so that its start-up overlaps the
    caller's own work (``profile`` opening the store); :func:`run_in_worker` with ``spawned=``
    sends it the request later. Same process, environment and isolation as ``run_in_worker``'s
    own worker (:func:`_start_worker`); with ``preload`` it is ``tuner.commands.worker_main --preload``,
    which imports what a simulate job needs (torch, transformers, the simulator) while it waits.

    The limit ``timeout_s`` counts from the request (:class:`WorkerHandle`). The caller cancels the
    handle when it finds it needs no worker (use it as a context manager, or ``cancel()`` in a
    ``finally``). ``python``, ``memory_max_bytes``, ``popen``, ``killpg``: as
    ``run_in_worker``'s, injectable for tests."""
    proc = _start_worker(["--preload"] if preload else [], timeout_s=timeout_s, python=python,
                         memory_max_bytes=memory_max_bytes, popen=popen)
    _RUNNING[proc.pid] = killpg
    return WorkerHandle(proc, timeout_s=timeout_s, killpg=killpg)


def spawner_for(worker: Callable[..., Any]) -> Callable[..., WorkerHandle] | None:
    """:func:`spawn_worker` with the ``python`` / ``memory_max_bytes`` / ``popen`` / ``killpg``
    that ``worker`` would start its process with, when ``worker`` is :func:`run_in_worker` or a
    ``functools.partial`` of it (the CLI's ``--worker-python``, its progress printer); None for any
    other worker function (a test's fake, the daemon's warm worker): nothing is spawned ahead."""
    import functools

    func, kw = worker, {}
    while isinstance(func, functools.partial):
        kw = {**func.keywords, **kw}
        func = func.func
    if func is not _RUN_IN_WORKER:
        return None
    return functools.partial(spawn_worker, **{k: kw[k] for k in ("python", "memory_max_bytes", "popen", "killpg")
                                              if k in kw})


def _wire(request: Any) -> dict[str, Any]:
    """The JSON object sent to the worker (:mod:`tuner.question.protocol`)."""
    if hasattr(request, "to_wire"):
        return request.to_wire()
    from tuner.question.protocol import PROTOCOL_VERSION

    return {"protocol": PROTOCOL_VERSION, **request}


#: Environment variable naming the worker's Python (e.g. a venv with a vLLM build for the engine
#: adapter) for every command that runs workers; ``profile --worker-python`` and the daemon's
#: ``worker_python`` setting win over it.
WORKER_PYTHON_ENV = "CTX_TUNER_WORKER_PYTHON"


def worker_python(python: str | None = None) -> str:
    """The interpreter that runs workers: ``python`` when given, else ``$CTX_TUNER_WORKER_PYTHON``,
    else this process's own."""
    return python or os.environ.get(WORKER_PYTHON_ENV) or sys.executable


def kill_running_workers() -> int:
    """SIGKILL the process group of every worker this process is waiting for, in any thread
    (``explain`` and ``plot`` run several jobs in threads). Safe in a signal handler: the CLI calls
    it on SIGTERM / SIGINT so that no worker outlives it and the waiting threads return at once.
    Returns how many groups were signalled."""
    n = 0
    for pid, killpg in list(_RUNNING.items()):
        try:
            killpg(pid, signal.SIGKILL)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


def _wait_for_reply(proc: subprocess.Popen, request: dict[str, Any], *, job: str, timeout_s: float, wait_s: float,
                    killpg: Callable[[int, int], None],
                    on_progress: Callable[[str], None] | None) -> dict[str, Any]:
    """Send the request, wait ``wait_s`` seconds at most (what is left of ``timeout_s``, the limit
    named in the timeout error) and read the reply."""
    try:
        if on_progress is not None:
            request = {**request, "progress": True}
        if proc.stdout is None:  # a test's stand-in without pipes
            out, err = proc.communicate(json.dumps(request).encode(), timeout=wait_s)
        else:
            out, err = _communicate_relaying(proc, json.dumps(request).encode(), wait_s, on_progress, killpg)
    except subprocess.TimeoutExpired:
        _kill_group(proc, killpg)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # SIGKILLed: a zombie the kernel reaps with us
            pass
        raise WorkerTimeout(f"profile pass exceeded {timeout_s:g} s; worker process group killed", where=job)
    except BaseException:
        # KeyboardInterrupt (Ctrl-C), SystemExit (the CLI's SIGTERM handler), or anything else
        # while waiting: the worker runs in its own process group and would outlive us.
        _kill_group(proc, killpg)
        try:
            proc.wait(timeout=10)
        except BaseException:  # a second Ctrl-C or a stuck zombie: the group is already SIGKILLed
            pass
        raise
    tail = err.decode(errors="replace")[-2000:].strip()
    if proc.returncode != 0 and not out:
        raise crash_error(proc.returncode, tail, job=job, memory_max_bytes=memory_limit_of(proc))
    try:
        reply = json.loads(out.decode())
    except ValueError as exc:
        raise WorkerError(f"worker wrote no valid JSON reply: {tail or out[-200:]!r}", where=job) from exc
    if not isinstance(reply, dict):
        raise WorkerError(f"worker wrote no valid JSON reply: {tail or out[-200:]!r}", where=job)
    if not reply.get("ok"):
        raise error_from_reply(reply, job=job)
    from tuner.question.protocol import reply_result

    return reply_result(reply, job=job)


#: What a worker's stderr says when an allocation failed (Python, C++, glibc, PyTorch's allocator).
_ALLOC_FAILED = ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "Unable to allocate",
                 "DefaultCPUAllocator: can't allocate memory", "failed to allocate", "mmap failed",
                 "can't start new thread")


def memory_limit_of(proc: Any) -> int | None:
    """The memory limit a worker started with (the ``RLIMIT_DATA`` of :mod:`tuner.seam.worker_guard`,
    from the environment :func:`_start_worker` gave it), or None."""
    value = getattr(proc, "ctx_tuner_memory_max_bytes", None)
    return int(value) if value else None


def crash_error(returncode: int | None, tail: str, *, job: str, memory_max_bytes: int | None = None) -> WorkerError:
    """The error for a worker that ended without a reply (``returncode``: its exit status, a
    negative signal number, or None when unknown) and wrote ``tail`` on stderr.

    With a memory limit set, a death that is how a process over ``RLIMIT_DATA`` dies — an
    allocation failure named on stderr (``MemoryError``, ``std::bad_alloc``, "Cannot allocate
    memory", …), or SIGABRT / SIGSEGV / SIGBUS (a C++ ``terminate`` or an unchecked failed ``malloc``)
    — is reported as the limit, with its bytes and the setting, not as "worker crashed (exit
    status 1)". Still a :class:`WorkerError` (a run failure)."""
    how = ("closed its output" if returncode is None else f"killed by signal {-returncode}" if returncode < 0
           else f"exit status {returncode}")
    if memory_max_bytes:
        said = next((m for m in _ALLOC_FAILED if m.lower() in tail.lower()), None)
        by_signal = returncode is not None and -returncode in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)
        if said or by_signal:
            why = f"it reported {said!r}" if said else f"it was {how}, as a process whose allocation failed is"
            return WorkerError(f"the profile pass exceeded the worker memory limit ({memory_max_bytes:,} bytes, "
                               f"setting worker_memory_max_bytes): {why}; raise the setting or give the worker "
                               f"less to build (worker {how}; last output: {_last_line(tail) or 'none'})", where=job)
    return WorkerError(f"worker crashed ({how}): {tail or 'no output'}", where=job)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _kill_group(proc: subprocess.Popen, killpg: Callable[[int, int], None]) -> None:
    """SIGKILL the worker's process group (its pid is the group id: ``start_new_session``)."""
    try:
        killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def error_from_reply(reply: dict[str, Any], *, job: str) -> TunerError:
    """The typed error a worker reported, rebuilt in this process.

    The class is looked up by name in :mod:`tuner.errors` (``error_type``, then the names in
    ``error_bases``, the child's class hierarchy); ``where`` / ``path`` / ``field`` are kept. An
    unknown name becomes a plain :class:`TunerError` whose message starts with that name. Without
    a ``where`` from the child the error is about ``job``.
    """
    from tuner import errors

    name = str(reply.get("error_type") or "Error")
    message = reply.get("message")
    if message is None:  # an older worker: only the formatted ``error`` text
        message = str(reply.get("error", "unknown error"))
    cls: type[TunerError] | None = None
    for candidate in [name, *(reply.get("error_bases") or [])]:
        found = getattr(errors, str(candidate), None)
        if isinstance(found, type) and issubclass(found, TunerError):
            cls = found
            break
    if cls is None:
        return TunerError(f"{name}: {message}", where=reply.get("where") or job)
    if cls.__name__ != name:
        message = f"{name}: {message}"  # a subclass tuner.errors does not know: keep its name visible
    if issubclass(cls, (errors.DropError, errors.SettingsError)):
        path, field = reply.get("path"), reply.get("field")
        if path is None and field is None:
            exc = cls(message, path=reply.get("where") or job)
        else:
            exc = cls(message, path=path, field=field)
    else:
        exc = cls(message, where=reply.get("where") or job)
    exc.job = job
    return exc


#: After the worker process itself exited, how long its pipes may stay open (seconds) before its
#: process group is killed: a helper a ``worker_python`` wrapper left running holds them.
PIPE_GRACE_S = 2.0


def _communicate_relaying(proc: subprocess.Popen, data: bytes, timeout_s: float,
                          on_progress: Callable[[str], None] | None,
                          killpg: Callable[[int, int], None] = os.killpg) -> tuple[bytes, bytes]:
    """``communicate`` that watches the worker's own exit, not its pipes' end: a helper process
    that a ``worker_python`` wrapper started (and that inherited stdout/stderr) would otherwise
    keep them open, and a worker killed meanwhile would be noticed only at the timeout. Once the
    process exited, the pipes get :data:`PIPE_GRACE_S` to drain; then the worker's process group
    (the helper with it) is killed and what was read is returned. Progress lines on stderr go to
    ``on_progress`` (when given) as they arrive.

    Raises ``subprocess.TimeoutExpired`` like ``communicate`` (the caller kills the group)."""
    import threading

    out_chunks: list[bytes] = []
    err_lines: list[bytes] = []

    def read_out() -> None:
        fd = proc.stdout.fileno()
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            out_chunks.append(chunk)

    def read_err() -> None:
        try:
            for line in iter(proc.stderr.readline, b""):
                text = line.decode(errors="replace")
                if on_progress is not None and text.startswith(PROGRESS_PREFIX):
                    try:
                        on_progress(text[len(PROGRESS_PREFIX):].rstrip("\n"))
                    except Exception:  # a broken progress sink must not break the job
                        pass
                else:
                    err_lines.append(line)
        except (OSError, ValueError):
            pass

    readers = [threading.Thread(target=read_out, daemon=True), threading.Thread(target=read_err, daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.stdin.write(data)
    except BrokenPipeError:
        pass
    finally:
        proc.stdin.close()
    try:
        proc.wait(timeout=timeout_s)  # the worker's own exit
    except subprocess.TimeoutExpired:
        # the readers own the pipes: let the caller's communicate() after the kill only wait
        proc.stdin = proc.stdout = proc.stderr = None
        raise
    for t in readers:
        t.join(timeout=PIPE_GRACE_S)
    if any(t.is_alive() for t in readers):  # something else holds the pipes: the worker's group goes
        _kill_group(proc, killpg)
        for t in readers:
            t.join(timeout=PIPE_GRACE_S)
    return b"".join(out_chunks), b"".join(err_lines)

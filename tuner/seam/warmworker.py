"""A warm worker for the daemon: one long-lived ``python -m tuner.commands.worker_main --serve`` process
reused across jobs (parent side; never imports torch).

A fresh worker pays ``import torch`` and transformers (seconds) for every job; the warm worker pays
them once. It keeps the isolation of :func:`tuner.seam.worker.run_in_worker`: its own process group
(``start_new_session``), one JSON request per line on stdin and one JSON reply per line on stdout,
and

* a job that outlives ``timeout_s`` SIGKILLs the whole group (:class:`~tuner.errors.WorkerTimeout`,
  the same message as a fresh worker's); the next job starts a new worker;
* a worker that dies (crash, OOM kill, signal) fails its job with
  :class:`~tuner.errors.WorkerError` ``worker crashed (…)`` and the tail of what it wrote on stderr
  during that job — the daemon's failure kinds and retries apply unchanged;
* a typed error is a reply like any other and the worker stays; a ``WorkerError`` reply (the pass
  ran out of memory) recycles it;
* after ``max_jobs`` jobs (setting ``worker_max_jobs``), or when its resident memory after a job
  exceeds ``max_rss_bytes`` (setting ``worker_max_rss_bytes``), it is stopped and the next job
  starts a new one; a job for another interpreter or memory limit starts a new one too.

The worker guards itself as a fresh one does (:mod:`tuner.seam.worker_guard`: memory limit, dies with
the daemon), with two differences: its deadline is per job (``deadline_s`` in each request,
``timeout_s`` + :data:`tuner.seam.worker.DEADLINE_GRACE_S`), and it watches the daemon by ``getppid``
only — ``PR_SET_PDEATHSIG`` fires when the *thread* that started it ends, and the daemon starts
workers from a job's thread.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from typing import Any, Callable

from tuner.errors import WorkerError, WorkerTimeout
from tuner.seam.worker import (_RUNNING, DEADLINE_GRACE_S, DEFAULT_TIMEOUT_S, PIPE_GRACE_S, PROGRESS_PREFIX, _wire,
                          crash_error, error_from_reply, worker_env, worker_python)

#: Jobs one warm worker runs before it is replaced (setting ``worker_max_jobs``).
DEFAULT_MAX_JOBS = 50
#: Resident memory after a job above which the worker is replaced (setting ``worker_max_rss_bytes``).
DEFAULT_MAX_RSS_BYTES = 2 << 30
#: Seconds a recycled worker gets to exit after its stdin closes, before its group is killed.
EXIT_GRACE_S = 2.0
#: How often a job's wait checks that the worker process is still alive (seconds).
POLL_S = 0.25


def read_rss_bytes(pid: int) -> int | None:
    """Resident set size of process ``pid`` (``VmRSS`` of ``/proc/PID/status``), or None."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class _Proc:
    """One running serve-mode worker: the process, its stdout lines and its stderr."""

    def __init__(self, proc: subprocess.Popen, key: tuple) -> None:
        self.proc = proc
        self.key = key
        self.jobs = 0
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        self.on_progress: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._read_out, name="ctx-tuner-warm-out", daemon=True).start()
        self.err_reader = threading.Thread(target=self._read_err, name="ctx-tuner-warm-err", daemon=True)
        self.err_reader.start()

    def _read_out(self) -> None:
        try:
            for line in iter(self.proc.stdout.readline, b""):
                self.lines.put(line)
        except (OSError, ValueError):
            pass
        self.lines.put(None)  # EOF: the worker is gone

    def _read_err(self) -> None:
        try:
            for line in iter(self.proc.stderr.readline, b""):
                text = line.decode(errors="replace")
                if text.startswith(PROGRESS_PREFIX):
                    sink = self.on_progress
                    if sink is not None:
                        try:
                            sink(text[len(PROGRESS_PREFIX):].rstrip("\n"))
                        except Exception:  # a broken progress sink must not break the job
                            pass
                    continue
                with self._lock:
                    self.err.append(text)
                    if len(self.err) > 200:
                        del self.err[:100]
        except (OSError, ValueError):
            pass

    def take_err(self) -> str:
        with self._lock:
            text, self.err = "".join(self.err), []
        return text[-2000:].strip()


class WarmWorker:
    """The daemon's warm worker (see the module docstring). :meth:`run` has the signature of
    :func:`tuner.seam.worker.run_in_worker` plus ``max_jobs``, ``max_rss_bytes`` and ``attach``
    (called with the worker's ``Popen`` at every job, spawned or reused: the daemon records its
    pid and kills its group on shutdown). One job at a time; :meth:`close` stops the worker."""

    def __init__(self, *, killpg: Callable[[int, int], None] = os.killpg,
                 rss: Callable[[int], int | None] = read_rss_bytes) -> None:
        self.killpg = killpg
        self.rss = rss
        self._w: _Proc | None = None
        #: workers started so far (tests and the log read it)
        self.spawned = 0

    def run(self, request: Any, *, job: str, timeout_s: float = DEFAULT_TIMEOUT_S,
            python: str | None = None, popen: Callable[..., subprocess.Popen] = subprocess.Popen,
            on_progress: Callable[[str], None] | None = None, memory_max_bytes: int | None = None,
            max_jobs: int = DEFAULT_MAX_JOBS, max_rss_bytes: int | None = DEFAULT_MAX_RSS_BYTES,
            attach: Callable[[subprocess.Popen], None] | None = None) -> dict[str, Any]:
        """Run one job in the warm worker (starting one if needed) and return its result.

        Raises: as :func:`tuner.seam.worker.run_in_worker` (WorkerTimeout, WorkerError, the typed errors).
        """
        key = (worker_python(python), int(memory_max_bytes or 0))
        w = self._w
        if w is not None and (w.key != key or w.proc.poll() is not None):
            self.close()
            w = None
        if w is None:
            w = self._w = self._spawn(key, popen)
        elif attach is not None:
            attach(w.proc)
        w.err = []
        w.on_progress = on_progress
        # the request through the contract (tuner.question.protocol: versioned), plus this job's deadline
        req = {**_wire(request), "deadline_s": float(timeout_s) + DEADLINE_GRACE_S}
        if on_progress is not None:
            req["progress"] = True
        _RUNNING[w.proc.pid] = self.killpg
        try:
            reply = self._exchange(w, req, job=job, timeout_s=timeout_s)
        finally:
            _RUNNING.pop(w.proc.pid, None)
            w.on_progress = None
        w.jobs += 1
        recycle = w.jobs >= max(1, int(max_jobs)) or not reply.get("ok") and reply.get("error_type") == "WorkerError"
        if not recycle and max_rss_bytes:
            rss = self.rss(w.proc.pid)
            recycle = rss is not None and rss > int(max_rss_bytes)
        if recycle:
            self.close()
        if not reply.get("ok"):
            raise error_from_reply(reply, job=job)
        from tuner.question.protocol import reply_result

        return reply_result(reply, job=job)

    def _spawn(self, key: tuple, popen: Callable[..., subprocess.Popen]) -> _Proc:
        from tuner.seam.worker_guard import ENV_DEADLINE, ENV_MEMORY, ENV_PARENT

        env = worker_env()  # isolated from the daemon's working directory (tuner.seam.worker.worker_env)
        env[ENV_PARENT] = str(os.getpid())
        env.pop(ENV_DEADLINE, None)  # per job, in each request
        if key[1]:
            env[ENV_MEMORY] = str(key[1])
        else:
            env.pop(ENV_MEMORY, None)
        proc = popen([key[0], "-m", "tuner.commands.worker_main", "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, start_new_session=True, env=env)
        self.spawned += 1
        return _Proc(proc, key)

    def _exchange(self, w: _Proc, req: dict, *, job: str, timeout_s: float) -> dict:
        try:
            w.proc.stdin.write(json.dumps(req).encode() + b"\n")
            w.proc.stdin.flush()
            line = self._next_line(w, timeout_s)
        except queue.Empty:
            self._kill(w)
            raise WorkerTimeout(f"profile pass exceeded {timeout_s:g} s; worker process group killed", where=job)
        except (BrokenPipeError, OSError):
            line = None  # it died before reading: reported below as a crash
        except BaseException:  # Ctrl-C, SIGTERM's SystemExit: the worker would outlive us
            self._kill(w)
            raise
        if line is None:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            code = w.proc.returncode
            self._kill(w)  # its group too: a helper holding stderr open would keep the reader waiting
            w.err_reader.join(timeout=2)  # what it wrote on stderr before dying
            tail = w.take_err()
            raise crash_error(code, tail, job=job, memory_max_bytes=w.key[1] or None)
        try:
            return json.loads(line.decode())
        except ValueError as exc:
            tail = w.take_err()
            self._kill(w)
            raise WorkerError(f"worker wrote no valid JSON reply: {tail or line[-200:]!r}", where=job) from exc

    @staticmethod
    def _next_line(w: _Proc, timeout_s: float) -> bytes | None:
        """The worker's next stdout line; None once the worker process itself has exited (its own
        exit, not its pipe's end: a helper a ``worker_python`` wrapper left running keeps the pipe
        open) and no line came within :data:`tuner.seam.worker.PIPE_GRACE_S` after it.

        Raises:
            queue.Empty: ``timeout_s`` passed without a line.
        """
        import time

        end = time.monotonic() + timeout_s
        exited_at = None
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise queue.Empty
            try:
                return w.lines.get(timeout=min(left, POLL_S))
            except queue.Empty:
                pass
            if w.proc.poll() is not None:
                now = time.monotonic()
                exited_at = exited_at or now
                if now - exited_at >= PIPE_GRACE_S:
                    return None

    def _kill(self, w: _Proc) -> None:
        try:
            self.killpg(w.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self._w is w:
            self._w = None

    def close(self) -> None:
        """Stop the worker: close its stdin (it exits after the job in hand), then kill its group."""
        w, self._w = self._w, None
        if w is None:
            return
        try:
            w.proc.stdin.close()
        except OSError:
            pass
        try:
            w.proc.wait(timeout=EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            self.killpg(w.proc.pid, signal.SIGKILL)  # what it started, and itself if it lingers
        except (ProcessLookupError, PermissionError):
            pass
        try:
            w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """SIGKILL the worker's group now (the daemon's shutdown; any thread)."""
        w, self._w = self._w, None
        if w is not None:
            self._kill(w)

    @property
    def pid(self) -> int | None:
        """The warm worker's pid (its process group), or None when none runs."""
        return self._w.proc.pid if self._w is not None else None


__all__ = ["DEFAULT_MAX_JOBS", "DEFAULT_MAX_RSS_BYTES", "WarmWorker", "read_rss_bytes"]

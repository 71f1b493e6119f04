"""Run a profile job in a worker subprocess (parent side; never imports torch).

The child is ``python -m tuner.worker_main``: it reads one JSON request on stdin and writes one
JSON reply on stdout. It runs in its own process group (``start_new_session``) so a timeout kills
the whole group; a crash, a signal or unreadable output becomes a :class:`WorkerError` carrying
the job name and the tail of the child's stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any, Callable

from tuner.errors import TunerError, WorkerError, WorkerTimeout

#: Default wall-clock limit of one job (seconds).
DEFAULT_TIMEOUT_S = 600.0

#: Prefix of the progress lines a job writes on stderr (request ``"progress": true``); the parent
#: passes them to ``on_progress`` and keeps them out of error tails.
PROGRESS_PREFIX = "ctx-tuner-progress: "


def run_in_worker(request: dict[str, Any], *, job: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                  python: str | None = None, popen: Callable[..., subprocess.Popen] = subprocess.Popen,
                  killpg: Callable[[int, int], None] = os.killpg,
                  on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run one job in a fresh worker process and return its result dict.

    Args:
        request: the job (see :func:`tuner.job.run_job`).
        job: a name for errors and logs (the drop name).
        timeout_s: wall-clock limit in seconds; on expiry the process group gets SIGKILL.
        python, popen, killpg: injectable for tests.
        on_progress: called with each progress line the job writes (the request gets
            ``"progress": true``); stderr is then read while the job runs.

    Raises:
        WorkerTimeout: the limit expired (the group was killed).
        WorkerError: the child crashed, was killed, or wrote no valid reply.
        TunerError: the child reported a typed error (bad config, plugin failure, …), re-raised
            with the same class name in the message.
    """
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    proc = popen([python or sys.executable, "-m", "tuner.worker_main"], stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env)
    try:
        if on_progress is None:
            out, err = proc.communicate(json.dumps(request).encode(), timeout=timeout_s)
        else:
            out, err = _communicate_relaying(proc, json.dumps({**request, "progress": True}).encode(), timeout_s,
                                             on_progress)
    except subprocess.TimeoutExpired:
        try:
            killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        raise WorkerTimeout(f"profile pass exceeded {timeout_s:g} s; worker process group killed", where=job)
    tail = err.decode(errors="replace")[-2000:].strip()
    if proc.returncode != 0 and not out:
        how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
        raise WorkerError(f"worker crashed ({how}): {tail or 'no output'}", where=job)
    try:
        reply = json.loads(out.decode())
    except ValueError as exc:
        raise WorkerError(f"worker wrote no valid JSON reply: {tail or out[-200:]!r}", where=job) from exc
    if not reply.get("ok"):
        raise TunerError(f"{reply.get('error_type', 'Error')}: {reply.get('error', 'unknown error')}", where=job)
    return reply["result"]


def _communicate_relaying(proc: subprocess.Popen, data: bytes, timeout_s: float,
                          on_progress: Callable[[str], None]) -> tuple[bytes, bytes]:
    """``communicate`` that hands progress lines from stderr to ``on_progress`` as they arrive.

    Raises ``subprocess.TimeoutExpired`` like ``communicate`` (the caller kills the group)."""
    import threading

    out_chunks: list[bytes] = []
    err_lines: list[bytes] = []

    def read_out() -> None:
        out_chunks.append(proc.stdout.read())

    def read_err() -> None:
        for line in iter(proc.stderr.readline, b""):
            text = line.decode(errors="replace")
            if text.startswith(PROGRESS_PREFIX):
                try:
                    on_progress(text[len(PROGRESS_PREFIX):].rstrip("\n"))
                except Exception:  # a broken progress sink must not break the job
                    pass
            else:
                err_lines.append(line)

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
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # the readers own the pipes: let the caller's communicate() after the kill only wait
        proc.stdin = proc.stdout = proc.stderr = None
        raise
    for t in readers:
        t.join()
    return b"".join(out_chunks), b"".join(err_lines)

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


def run_in_worker(request: dict[str, Any], *, job: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                  python: str | None = None, popen: Callable[..., subprocess.Popen] = subprocess.Popen,
                  killpg: Callable[[int, int], None] = os.killpg) -> dict[str, Any]:
    """Run one job in a fresh worker process and return its result dict.

    Args:
        request: the job (see :func:`tuner.job.run_job`).
        job: a name for errors and logs (the drop name).
        timeout_s: wall-clock limit in seconds; on expiry the process group gets SIGKILL.
        python, popen, killpg: injectable for tests.

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
        out, err = proc.communicate(json.dumps(request).encode(), timeout=timeout_s)
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

"""Worker subprocess entry point: ``python -m tuner.worker_main`` (imports torch).

Reads one JSON request on stdin (:mod:`tuner.protocol`: a :class:`~tuner.protocol.JobRequest`, or a
:class:`~tuner.protocol.ValidateRequest` for ``"kind": "validate"``; another protocol version is
refused with a typed :class:`~tuner.errors.ProtocolError` reply), runs :func:`tuner.job.run_job`
(or :func:`tuner.validate.run_validate_request`), writes
``{"ok": true, "protocol": 1, "result": …}`` or ``{"ok": false, "error_type": …, "error_bases": […], "error": …,
"message": …, "where": …, "path": …, "field": …}`` on stdout (see :func:`error_reply`; the parent
re-raises the same class, :func:`tuner.worker.error_from_reply`).
Typed errors are replies; anything else is a crash with a traceback on stderr.
"""

from __future__ import annotations

import json
import os
import sys


def error_reply(exc: BaseException) -> dict:
    """The reply for a typed error: its class name (and its bases, for subclasses the parent may
    not know), the bare message, ``where`` and, for :class:`~tuner.errors.DropError` /
    :class:`~tuner.errors.SettingsError`, ``path`` and ``field``. ``error`` keeps the full text."""
    reply = {"ok": False, "error_type": type(exc).__name__,
             "error_bases": [c.__name__ for c in type(exc).__mro__[1:] if c is not Exception and c is not BaseException
                             and c is not object],
             "error": str(exc), "message": getattr(exc, "message", str(exc)), "where": getattr(exc, "where", None)}
    for key in ("path", "field"):
        value = getattr(exc, key, None)
        if value is not None:
            reply[key] = str(value)
    return reply


def _calibrate(request):
    """``calibration_db`` in a job request (the daemon): look the corrections up here, in the
    worker, so the daemon never reads the model's config.json itself
    (:func:`tuner.app.lookup_calibration` through a read-only store). A lookup that fails is a
    warning, not an error. Returns the request to run (``calibration_db`` consumed)."""
    url = request.calibration_db
    request = request.replace(calibration_db=None)
    if not url or request.calibration or request.method != "simulate":
        return request
    from tuner.app import lookup_calibration
    from tuner.errors import ModelConfigError, TunerError
    from tuner.store import open_store

    try:
        store = open_store(url, readonly=True)
    except TunerError as exc:
        return request.replace(warnings=(*request.warnings, f"calibration skipped: {exc}"))
    try:
        cal = lookup_calibration(request, store)
    except ModelConfigError:
        raise  # the job itself reports the unreadable config
    except TunerError as exc:
        return request.replace(warnings=(*request.warnings, f"calibration skipped: {exc}"))
    finally:
        store.close()
    return request.replace(calibration=cal) if cal is not None else request


def main() -> int:
    from tuner.worker_guard import install

    install()  # die with the parent, own deadline, memory limit: before anything big is imported
    data = json.loads(sys.stdin.read())
    # The reply owns stdout: anything else written there (vLLM's logger and C++ prints, when the
    # engine adapter imports vLLM) goes to stderr instead.
    reply_out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    from tuner.errors import TunerError, WorkerError

    from tuner.protocol import KIND_VALIDATE, ok_reply, request_from_wire

    where = "worker"
    try:
        request = request_from_wire(data)
        where = request.name
        if request.kind == KIND_VALIDATE:
            from tuner.validate import run_validate_request

            result = run_validate_request(request)
        else:
            from tuner.job import run_job

            request = _calibrate(request)
            result = run_job(request)
    except TunerError as exc:
        json.dump(error_reply(exc), reply_out)
        reply_out.flush()
        return 0
    except MemoryError:
        from tuner.worker_guard import ENV_MEMORY

        limit = os.environ.get(ENV_MEMORY)
        exc = WorkerError("the profile pass ran out of memory" + (
            f" (worker memory limit {int(limit):,} bytes, setting worker_memory_max_bytes)" if limit else ""),
            where=where)
        json.dump(error_reply(exc), reply_out)
        reply_out.flush()
        return 0
    json.dump(ok_reply(result), reply_out)
    reply_out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

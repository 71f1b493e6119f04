"""Worker subprocess entry point: ``python -m tuner.commands.worker_main`` (imports torch).

Reads one JSON request on stdin (:mod:`tuner.question.protocol`: a :class:`~tuner.question.protocol.JobRequest`, or a
:class:`~tuner.question.protocol.ValidateRequest` for ``"kind": "validate"``; another protocol version is
refused with a typed :class:`~tuner.errors.ProtocolError` reply), runs :func:`tuner.jobs.job.run_job`
(or :func:`tuner.accuracy.validate.run_validate_request`), writes
``{"ok": true, "protocol": 1, "result": …}`` or ``{"ok": false, "error_type": …, "error_bases": […], "error": …,
"message": …, "where": …, "path": …, "field": …}`` on stdout (see :func:`error_reply`; the parent
re-raises the same class, :func:`tuner.seam.worker.error_from_reply`).
Typed errors are replies; anything else is a crash with a traceback on stderr. With ``--serve``
(the daemon's warm worker, :mod:`tuner.seam.warmworker`) it answers one request per line until stdin
closes (:func:`serve`). With ``--preload`` (a worker started ahead of its request,
:func:`tuner.seam.worker.spawn_worker`) it imports what a simulate job needs *before* reading the
request, then answers that one request as without it (:func:`main`).
"""

from __future__ import annotations

import gc
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
    (:func:`tuner.jobs.app.lookup_calibration` through a read-only store). A lookup that fails is a
    warning, not an error. Returns the request to run (``calibration_db`` consumed)."""
    url = request.calibration_db
    request = request.replace(calibration_db=None)
    if not url or request.calibration or request.method != "simulate":
        return request
    from tuner.jobs.app import lookup_calibration
    from tuner.errors import ModelConfigError, TunerError
    from tuner.store.database import open_store

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


def handle(data: dict) -> dict:
    """One request's wire object → its reply (:func:`tuner.question.protocol.ok_reply` or an error reply).
    The request is read through the contract (:func:`tuner.question.protocol.request_from_wire`): another
    protocol version is a typed :class:`~tuner.errors.ProtocolError` reply."""
    from tuner.errors import TunerError, WorkerError
    from tuner.question.protocol import KIND_VALIDATE, ok_reply, request_from_wire

    where = "worker"
    try:
        request = request_from_wire(data)
        where = request.name
        if request.kind == KIND_VALIDATE:
            from tuner.accuracy.validate import run_validate_request

            result = run_validate_request(request)
        else:
            from tuner.jobs.job import run_job

            request = _calibrate(request)
            result = run_job(request)
    except TunerError as exc:
        return error_reply(exc)
    except (MemoryError, RuntimeError) as exc:
        # MemoryError, or PyTorch's "DefaultCPUAllocator: can't allocate memory" (a RuntimeError):
        # under the worker memory limit that is the limit, said with its bytes
        from tuner.seam.worker_guard import ENV_MEMORY

        limit = os.environ.get(ENV_MEMORY)
        if isinstance(exc, RuntimeError) and not (limit and _allocation_failed(str(exc))):
            raise
        exc = WorkerError("the profile pass ran out of memory" + (
            f" (worker memory limit {int(limit):,} bytes, setting worker_memory_max_bytes)" if limit else ""),
            where=where)
        return error_reply(exc)
    return ok_reply(result)


def _allocation_failed(text: str) -> bool:
    """Whether an error's text is an allocation failure (:data:`tuner.seam.worker._ALLOC_FAILED`)."""
    from tuner.seam.worker import _ALLOC_FAILED

    low = text.lower()
    return any(m.lower() in low for m in _ALLOC_FAILED)


def _reply_channel():
    """The reply owns stdout: anything else written there (vLLM's logger and C++ prints, when the
    engine adapter imports vLLM) goes to stderr instead."""
    reply_out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return reply_out


def preload_imports() -> bool:
    """Import what a simulate job (or a ``validate`` request) imports anyway — torch, the job, the
    simulator, transformers (:mod:`tuner.model.transformers_lean`), the plugins — with the cyclic garbage
    collector off, then freeze those objects (``gc.freeze``) and turn it back on: the hundreds of
    thousands of long-lived objects of torch and transformers are then never traversed again by
    the collections that the imports and the job's passes trigger (about 1 CPU s of a cold 70B
    worker, a quarter of it). The passes' own objects are collected as before. An import that
    fails is left to the job, which reports it as before. Returns True when the imports ran.
    Used by :func:`preload` (after the request) and by ``--preload`` (before it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        import torch  # noqa: F401

        import tuner.jobs.job  # noqa: F401
        import tuner.model.simulate.profile  # noqa: F401
        from tuner.model.plugin import load_registry
        from tuner.model.transformers_lean import import_transformers

        import_transformers()
        load_registry()
    except Exception:  # the job imports them again and reports what fails
        return False
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
    return True


def preload(data: dict) -> bool:
    """:func:`preload_imports` for a request that needs them: a simulate job or a ``validate``
    request. Other requests (``cuda`` / ``vllm`` methods, another kind) and a request that is not
    a JSON object import nothing here. Returns True when the imports ran."""
    if not isinstance(data, dict) or data.get("kind", "job") not in ("job", "validate") \
            or (data.get("kind", "job") == "job" and (data.get("method") or "simulate") != "simulate"):
        return False
    return preload_imports()


def main(ahead: bool = False) -> int:
    """One request on stdin, its reply on stdout. ``ahead`` (``--preload``: a worker the parent
    started before it knew the request, :func:`tuner.seam.worker.spawn_worker`) runs
    :func:`preload_imports` first and only then reads the request, so the imports overlap the
    parent's own work; it arms its deadline from the request's ``deadline_s``
    (:data:`tuner.seam.worker.DEADLINE_KEY`) once that comes. Any request is then handled as without
    it (one that is no simulate job just paid imports it did not need)."""
    from tuner.seam.worker_guard import arm_deadline, install

    # die with the parent, memory limit, own deadline: before anything big is imported; a worker
    # started ahead arms its deadline when its request comes (the request's deadline_s)
    install(arm=not ahead)
    reply_out = _reply_channel()
    if ahead:
        preload_imports()
    data = json.loads(sys.stdin.read())
    deadline_s = data.pop("deadline_s", None) if isinstance(data, dict) else None
    if ahead:
        arm_deadline(_seconds(deadline_s))
    else:
        preload(data)
    reply_out.write(json.dumps(handle(data)))
    reply_out.flush()
    if simulate_only(data):
        skip_teardown()
    return 0


def _seconds(value: object) -> float | None:
    """A request's ``deadline_s`` as seconds, None when absent or not a number (the environment's
    deadline then applies, :func:`tuner.seam.worker_guard.arm_deadline`)."""
    try:
        return float(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


def simulate_only(data: object) -> bool:
    """Whether a request runs nothing but this process's own Python — a ``simulate`` job or a
    ``validate`` request: no engine, no GPU, no child process, no file left open for writing."""
    if not isinstance(data, dict):
        return False
    kind = data.get("kind", "job")
    return kind == "validate" or (kind == "job" and (data.get("method") or "simulate") == "simulate")


def skip_teardown(exit_=os._exit) -> None:
    """End the one-shot worker now that its reply is written and flushed, without the interpreter's
    teardown: finalizing torch's and transformers' modules and objects costs a cold 70B worker
    about 0.2 s, and the parent waits for the process to exit before it reads the reply
    (``Popen.communicate``). Only for :func:`simulate_only` requests, which leave nothing to clean
    up; stderr and stdout are flushed first (:func:`tuner.seam.worker_guard.end_now`). ``exit_`` is
    injectable for tests."""
    from tuner.seam.worker_guard import end_now

    end_now(0, exit_=exit_)


def serve() -> int:
    """``--serve``: the daemon's warm worker (:mod:`tuner.seam.warmworker`): one JSON request per line
    on stdin, one reply per line on stdout, until stdin closes. Each request's ``deadline_s``
    arms this process's own deadline for that job. The parent is watched by ``getppid`` only
    (``PR_SET_PDEATHSIG`` would fire when the parent's job thread ends)."""
    import threading

    from tuner.seam.worker_guard import install, kill_own_group

    install(pdeathsig=lambda _sig: True)
    reply_out = _reply_channel()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        deadline = float(request.pop("deadline_s", 0) or 0)
        timer = threading.Timer(deadline, kill_own_group) if deadline > 0 else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            reply = handle(request)
        finally:
            if timer is not None:
                timer.cancel()
        reply_out.write(json.dumps(reply) + "\n")
        reply_out.flush()
        sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve() if "--serve" in sys.argv[1:] else main(ahead="--preload" in sys.argv[1:]))

"""The parent side of the pass memo (:mod:`tuner.jobs.passmemo`): answer a job from the store's stored
passes in this process — :func:`tuner.jobs.job.run_job` with a :class:`~tuner.jobs.passmemo.MemoSource`, no
worker, no torch — and the worker function that tries that first and runs the real worker
otherwise (:func:`memo_worker`, used by ``profile``, ``explain``, ``plot``, ``check`` and the
daemon).

Every result that passes through :func:`memo_worker` says where its passes came from, under
:data:`PASS_SOURCE` (``result["pass_source"]``): ``{"source": "memo", "stored_passes": N,
"computed_passes": 0}`` for an answer from the memo, ``{"source": "worker", "stored_passes": K,
"computed_passes": M, "reason": …}`` for a worker run (``reason``: ``no-cache``,
``not memoizable`` — a measured method, real tensors or another interpreter —,
``no store`` or ``missing``: the memo lacked the spec or a pass). ``profile`` adds the
``profile_runs.id`` / ``drops.id`` that first computed a memo answer's passes (``first_run_id``,
``first_drop_id``).

No torch here: the CLI and the daemon's main process import this module.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any, Callable

from tuner import __version__
from tuner.jobs.passmemo import ENTRIES, KNOWN_PASSES, PASS, MemoMiss, MemoSource

#: The result key naming where the job's passes came from (see the module docstring).
PASS_SOURCE = "pass_source"


def job_request(request: Any) -> Any:
    """The :class:`tuner.question.protocol.JobRequest` of a profile job given as one or as its wire object
    (:func:`tuner.question.protocol.as_job_request`); None for a ``validate`` request or one the contract
    refuses (the worker then reports it as it always does)."""
    from tuner.errors import TunerError
    from tuner.question.protocol import KIND_JOB, JobRequest, as_job_request

    if isinstance(request, JobRequest):
        return request
    if not isinstance(request, dict) or request.get("kind", KIND_JOB) != KIND_JOB:
        return None
    try:
        return as_job_request(request)
    except TunerError:
        return None


def memo_applies(request: Any, python: str | None = None) -> bool:
    """Whether the parent may answer ``request`` (a :class:`~tuner.question.protocol.JobRequest` or its
    wire object) from the memo: a simulate job with fake tensors (not ``validate``), run by a
    worker in this interpreter (``python`` and ``$CTX_TUNER_WORKER_PYTHON`` unset or this one),
    where no vLLM is importable or the engine adapter is off (``engine`` / ``$CTX_TUNER_ENGINE``) —
    or, where an installed vLLM takes part, from the engine's whole stored answer for the request
    and that vLLM build (:data:`tuner.jobs.passmemo.ENGINE_ANSWER`, :func:`answer_from_memo`)."""
    job = job_request(request)
    if job is None or (job.method or "simulate") != "simulate" or not job.fake:
        return False
    if job.calibration_db:
        return False
    from tuner.seam.worker import worker_python

    if os.path.realpath(worker_python(python)) != os.path.realpath(sys.executable):
        return False
    return True


def lookup_entries(store: Any, request: Any) -> dict[str, dict]:
    """The store's memo entries for the request's model config and this tool version.

    Raises:
        ModelConfigError: the config cannot be read; StoreError: the query failed.
    """
    from tuner.model.modelspec import config_hash, read_top
    from tuner.question.protocol import JobRequest

    path = request.config_path if isinstance(request, JobRequest) else request["config_path"]
    return store.memo_entries(config_hash(read_top(path)), __version__)


def answer_from_memo(request: Any, entries: dict[str, dict],
                     on_progress: Callable[[str], None] | None = None) -> tuple[dict | None, dict]:
    """Run the job in this process from memo ``entries``: ``(result, hits)``, the result exactly
    as a worker returns it (a JSON round trip), or ``(None, hits)`` when something is missing
    (``hits``: the pass rows that were found, for the worker).

    A job that fails here (an invalid setting, say) gives ``(None, {})`` too: the worker then
    reports the error exactly as without a memo.
    """
    from tuner.jobs.job import run_job

    job = job_request(request)
    if job is None:
        return None, {}
    from tuner.jobs import passmemo

    if passmemo.engine_takes_part(job):  # the engine's whole answer for this request and vLLM build, first
        key = passmemo.engine_answer_key(job)
        value = entries.get(key) if key else None
        if isinstance(value, dict):
            result = json.loads(json.dumps(value))
            result.pop(ENTRIES, None)
            result[PASS_SOURCE] = {"engine_answer": True}
            return result, {}
        # else the passes: a plugin-served model with a stored engine cross-check (tuner.engine.stored),
        # or a request that uses only a stored one, is answered like a host without vLLM; a job that
        # needs the engine itself raises MemoMiss in run_job (the worker runs it)
    src = MemoSource(entries)
    if on_progress is not None:
        src.progress = []
    try:
        result = run_job(job.replace(progress=False, known_passes=None), pass_memo=src)
    except MemoMiss:
        return None, src.hits
    except Exception:  # noqa: BLE001 - any error: the worker runs the job and reports it as it always does
        return None, {}
    result.pop(ENTRIES, None)
    for line in src.progress or ():  # the lines a worker would have relayed, once the answer stands
        try:
            on_progress(line)
        except Exception:  # noqa: BLE001 - a broken progress sink must not break the job
            pass
    return json.loads(json.dumps(result)), src.hits


def _entries_from_store(db_url: str | None, request: Any, store: Any = None) -> dict[str, dict] | None:
    """Memo entries for ``request`` from ``store`` (an open :class:`tuner.store.database.Store`), else from
    an existing store at ``db_url`` (opened read-only: a SQLite file at the head revision through
    the standard library, :func:`tuner.store.litestore.open_lite`, anything else through SQLAlchemy);
    None when there is no store, {} when it cannot be read (the job then simply runs)."""
    from tuner.errors import TunerError

    if store is not None:
        try:
            return lookup_entries(store, request)
        except TunerError:
            return {}
    from tuner.store.litestore import open_lite, store_missing

    try:
        if store_missing(db_url):
            return None
        store = open_lite(db_url, readonly=True, calibrate=False)
        if store is None:
            from tuner.store.database import open_store, store_exists

            if not store_exists(db_url):
                return None
            store = open_store(db_url, readonly=True)
    except TunerError:
        return {}
    try:
        return lookup_entries(store, request)
    except TunerError:
        return {}
    finally:
        store.close()


def memo_worker(db_url: str | None, inner: Callable[..., dict] | None = None, *, enabled: bool = True,
                write: bool = True, store: Any = None,
                on_written: Callable[[int], None] | None = None) -> Callable[..., dict]:
    """A worker function (``(request, *, job, timeout_s, **kw) -> result``, like
    :func:`tuner.seam.worker.run_in_worker`) that answers from the memo in ``db_url`` where it can and
    calls ``inner`` (default ``run_in_worker``) otherwise, handing it the passes found. Every
    result carries :data:`PASS_SOURCE`.

    ``store``: an open :class:`tuner.store.database.Store` to read (and, with ``write``, store) the memo
    through instead of opening ``db_url`` (``profile`` opens its store once for the calibration,
    the memo and the result). With ``write`` the worker's new entries are stored in that store
    or in ``db_url`` when that store exists (never created here); without, they stay in the
    result under :data:`~tuner.jobs.passmemo.ENTRIES` for the caller to store in its own transaction
    (``profile``, the daemon). ``enabled=False`` (``--no-cache``) always runs the worker (its
    entries are still stored: the memo is refreshed, not bypassed forever). ``on_written``: called
    with the number of new memo entries each job stored (``explain`` says what it wrote to the store).
    """

    def worker(request: Any, *, job: str, timeout_s: float | None = None,
               on_progress: Callable[[str], None] | None = None, **kw: Any) -> dict:
        req = request
        if on_progress is not None:  # a progress sink only where one is given (fake workers may lack it)
            kw["on_progress"] = on_progress
        python = kw.get("python") or (getattr(inner, "keywords", None) or {}).get("python")  # a partial's
        hits: dict = {}
        entries = None
        if not enabled:
            reason = "no-cache"
        elif not memo_applies(request, python):
            reason = "not memoizable"
        else:
            entries = _entries_from_store(db_url, request, store)
            reason = "no store" if entries is None else "missing"
            if entries:
                result, hits = answer_from_memo(request, entries, on_progress)
                if result is not None:
                    result[PASS_SOURCE] = {"source": "memo", "stored_passes": len(hits), "computed_passes": 0,
                                           **(result.get(PASS_SOURCE) or {})}
                    return result
                if hits:  # the request as the caller gave it (a JobRequest or its wire object), topped up
                    from tuner.question.protocol import JobRequest

                    req = (request.replace(known_passes=hits) if isinstance(request, JobRequest)
                           else {**request, KNOWN_PASSES: hits})
        req = with_crosschecks(req, entries if entries is not None else _crosscheck_entries(db_url, request, store))
        if inner is None:
            from tuner.seam.worker import run_in_worker as run
        else:
            run = inner
        args = {"job": job, **kw}
        if timeout_s is not None:
            args["timeout_s"] = timeout_s
        result = run(req, **args)
        if isinstance(result, dict):
            new = result.get(ENTRIES)
            computed = sum(1 for e in new if e.get("kind") == PASS) if isinstance(new, list) else None
            result[PASS_SOURCE] = {"source": "worker", "stored_passes": len(hits), "computed_passes": computed,
                                   "reason": reason}
            if write and new:
                if store is not None:
                    stored = _put(store, result.pop(ENTRIES))
                else:
                    stored = save_entries(db_url, result.pop(ENTRIES))
                if on_written is not None and stored:
                    on_written(stored)
        return result

    return worker


def _crosscheck_entries(db_url: str | None, request: Any, store: Any = None) -> dict | None:
    """The store's entries for the request's model config where the memo was not read (``--no-cache``,
    another interpreter): the worker still gets the stored engine cross-checks. None where no engine
    takes part or there is no store."""
    from tuner.jobs import passmemo

    job = job_request(request)
    if job is None or not passmemo.engine_takes_part(job):
        return None
    return _entries_from_store(db_url, request, store)


def with_crosschecks(request: Any, entries: dict | None) -> Any:
    """``request`` (a :class:`~tuner.question.protocol.JobRequest` or its wire object) carrying the stored
    engine cross-checks among ``entries`` (:mod:`tuner.engine.stored`), for the worker."""
    from tuner.engine.stored import REQUEST_KEY, records_in

    records = records_in(entries)
    if not records:
        return request
    from tuner.question.protocol import JobRequest

    if isinstance(request, JobRequest):
        return request.replace(engine_crosschecks=tuple(records))
    if isinstance(request, dict):
        return {**request, REQUEST_KEY: records}
    return request


_PUT_LOCK = threading.Lock()


def _put(store: Any, entries: list[dict]) -> int:
    """Store ``entries``; how many of their memo keys were new to the store (a key already stored is
    left as it is; 0 when storing failed)."""
    from tuner.errors import TunerError

    try:
        with _PUT_LOCK:  # jobs in parallel threads (explain's remedies): each new key counted once
            had: set = set()
            for sha, version in {(e.get("model_config_sha256"), e.get("tool_version")) for e in entries}:
                had |= set(store.memo_entries(sha, version))
            store.put_memo(entries)
    except TunerError:  # a failure only loses the optimisation
        return 0
    return len({e["memo_key"] for e in entries} - had)


def save_entries(db_url: str | None, entries: list[dict]) -> int:
    """Store memo entries in an existing store (a failure only loses the optimisation); how many
    new memo keys it gained (0 where there is no store or storing failed)."""
    from tuner.errors import TunerError
    from tuner.store.database import open_store, store_exists

    try:
        if not store_exists(db_url):
            return 0
        store = open_store(db_url)
    except TunerError:
        return 0
    try:
        return _put(store, entries)
    finally:
        store.close()


def pass_source_line(source: dict | None) -> str | None:
    """The one line ``profile`` and ``explain`` print for :data:`PASS_SOURCE`, e.g.
    ``passes: memo (1 stored pass, first computed in profile run 3 of drop 1; no worker, no torch)``
    or ``passes: worker (1 computed, 0 from the memo; --no-cache)``; None without one."""
    if not isinstance(source, dict) or source.get("source") not in ("memo", "worker"):
        return None
    n = int(source.get("stored_passes") or 0)
    stored = f"{n} stored pass{'' if n == 1 else 'es'}"
    if source["source"] == "memo" and source.get("engine_answer"):
        return "passes: memo (the engine's stored answer for this request and vLLM build; no worker, no torch, no vLLM import)"
    if source["source"] == "memo":
        first = ""
        if source.get("first_run_id") is not None:
            first = f", first computed in profile run {source['first_run_id']}"
            if source.get("first_drop_id") is not None:
                first += f" of drop {source['first_drop_id']}"
        return f"passes: memo ({stored}{first}; no worker, no torch)"
    computed = source.get("computed_passes")
    done = "computed" if computed is None else f"{computed} computed"
    why = {"no-cache": "--no-cache", "not memoizable": "not memoizable: measured, real tensors or another "
           "interpreter", "no store": "no store yet", "missing": "not all in the memo"}
    reason = why.get(source.get("reason"), source.get("reason"))
    return f"passes: worker ({done}, {n} from the memo{'; ' + reason if reason else ''})"


__all__ = ["PASS_SOURCE", "answer_from_memo", "job_request", "lookup_entries", "memo_applies", "memo_worker",
           "pass_source_line", "save_entries", "with_crosschecks"]

"""The pass memo: profile passes (and the model spec they were built from) kept in the store by
content hash, so that a job whose passes are all known is answered with arithmetic — no worker
subprocess, no torch, no transformers.

What a job needs from the worker is two things: the model spec (``config.json`` read with
transformers' config classes) and one profile pass per (profile batch, pipeline stage). Every
other step of :func:`tuner.job.run_job` — plugin choice, KV specs, the era's budget, the search —
is pure Python. So the worker records, beside its result, one memo entry per spec and per pass
(``result["memo_entries"]``), the parent stores them (table ``pass_memo``, revision 0008), and a
later job runs :func:`tuner.job.run_job` *in the parent process* with those entries
(:func:`answer_from_memo`); the first entry it lacks raises :class:`MemoMiss` and the job goes to
a worker as before, carrying the passes that were found (``known_passes``: a V0 sweep with one new
length computes one pass).

Keys (SHA-256 of canonical JSON, :func:`digest`):

* **spec** — the ``config.json`` path and its full content, the plugin and the defaults it
  supplies, the torch and transformers versions, the tool version and :data:`MEMO_VERSION`.
* **pass** — the model config hash (:func:`tuner.modelspec.config_hash`), the plugin, the rank's
  settings (dtype, ``kv_cache_dtype``, quantization, block size, TP/PP/DP/EP layout and stage,
  compute capability, release, compiled/eager, ``max_num_batched_tokens`` N, ``max_num_seqs`` R),
  the era, the profile batch, fake/real tensors, Model Runner V2, the device kind, the method,
  torch, transformers and tool versions. Not ``max_model_len`` nor ``gpu_memory_utilization``:
  under V1 one pass serves every length and u. The only part of a pass that depends on
  ``max_model_len`` — the runner's persistent buffers of V1 0.27+ (the block table) — is
  recomputed from the formula (:func:`persistent_bytes`) for the job at hand. A plugin that is not
  built in may read ``settings.max_model_len`` in its build, so for those it is in the key too.

Only ``simulate`` passes with fake tensors are memoized, and only where no vLLM engine takes part
(an installed engine adapter changes terms the memo does not hold): the parent answers from the
memo only when the worker would run in this interpreter and it has no ``vllm``. The memo is an
optimisation: an answer from it is the same document a worker returns (tests compare them; only
timings differ), and ``--no-cache`` (``profile``, ``explain``, ``plot``, ``check``) or the
daemon's ``pass_memo: false`` turn it off.

No torch here: the CLI and the daemon's main process import this module.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
from typing import Any, Callable

from tuner import __version__

#: Bump when what a stored entry means changes in a way the tool version does not capture.
MEMO_VERSION = 1
SPEC, PASS = "spec", "pass"
#: The request key that hands the worker the passes the parent found (``{memo_key: row}``).
KNOWN_PASSES = "known_passes"
#: The result key under which a worker returns its new entries (removed before anyone sees it).
ENTRIES = "memo_entries"


class MemoMiss(Exception):
    """A spec or pass the job needs is not in the memo (or the job cannot be answered from it):
    the job goes to a worker. Internal: never leaves :func:`memo_worker`."""


def digest(obj: Any) -> str:
    """SHA-256 of ``obj`` as canonical JSON (sorted keys, no spaces; other types as ``str``)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@functools.lru_cache(maxsize=None)
def env_versions() -> dict:
    """torch and transformers versions installed in this interpreter, from their package metadata
    (nothing imported): part of every key, so a pass from another environment misses."""
    from importlib import metadata

    out = {}
    for dist in ("torch", "transformers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def builtin_plugin(plugin: Any) -> bool:
    """The plugin ships with ctx-tuner (module ``tuner.plugins.*``): its builds never read
    ``settings.max_model_len`` (checked by the tests), so its pass keys leave it out."""
    return type(plugin).__module__.startswith("tuner.plugins.") or type(plugin).__module__.startswith("plugins.")


def spec_key(config_path: str, top: dict, plugin: Any, defaults: dict) -> str:
    """The memo key of the model spec :func:`tuner.modelspec.load_model_spec` reads from
    ``config_path`` (whose parsed content is ``top``) with the plugin's ``defaults``."""
    return digest({"v": MEMO_VERSION, "kind": SPEC, "tool": __version__, "versions": env_versions(),
                   "path": str(config_path), "top": top, "plugin": plugin.name,
                   "plugin_module": type(plugin).__module__, "defaults": defaults})


def pass_key(*, spec: Any, plugin: Any, settings: Any, era: Any, batch: Any, fake: bool, model_runner_v2: bool,
             device_name: str, method: str = "simulate") -> str:
    """The memo key of one rank's profile pass (see the module docstring for what goes in)."""
    s = dataclasses.asdict(settings)
    if builtin_plugin(plugin):
        s.pop("max_model_len", None)
    return digest({"v": MEMO_VERSION, "kind": PASS, "tool": __version__, "versions": env_versions(),
                   "model_config_sha256": spec.config_sha256, "plugin": plugin.name,
                   "plugin_module": type(plugin).__module__, "settings": s, "era": dataclasses.asdict(era),
                   "batch": dataclasses.asdict(batch), "fake": bool(fake), "model_runner_v2": bool(model_runner_v2),
                   "device": device_name, "method": method})


def persistent_bytes(era: Any, spec: Any, settings: Any, batch: Any, model_runner_v2: bool) -> int:
    """The model runner's persistent buffers a pass charges (:func:`tuner.budget.runner_persistent_bytes`),
    with the arguments :func:`tuner.simulate.profile.run_pass` gives it: the one term of a pass
    that depends on ``max_model_len``."""
    from tuner.budget import runner_persistent_bytes

    n = batch.max_num_batched_tokens
    return runner_persistent_bytes(
        era, model_runner_v2=model_runner_v2, max_num_batched_tokens=n,
        max_num_seqs=settings.max_num_seqs or batch.max_num_seqs,
        max_model_len=settings.max_model_len or n, hidden_size=int(spec.hidden_size),
        vocab_size=int(spec.vocab_size), dtype_bytes=DTYPE_BYTES.get(settings.dtype, 2),
        block_size=settings.block_size or 16)


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}


def with_persistent(row: dict, persistent: int) -> dict:
    """A stored pass row with its persistent buffers replaced by ``persistent`` (bytes): the
    activation peak is the stored peak without the old buffers plus the new ones."""
    old = int(row.get("persistent_bytes") or 0)
    return {**row, "activation_peak_bytes": int(row["activation_peak_bytes"]) - old + int(persistent),
            "persistent_bytes": int(persistent)}


def _enc(obj: Any) -> Any:
    """JSON form that keeps what plain JSON loses: tuples and dicts with non-string keys
    (``id2label`` has int keys)."""
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            if "__items__" in obj or "__tuple__" in obj:
                return {"__items__": [[k, _enc(v)] for k, v in obj.items()]}
            return {k: _enc(v) for k, v in obj.items()}
        return {"__items__": [[k, _enc(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_enc(v) for v in obj]}
    if isinstance(obj, list):
        return [_enc(v) for v in obj]
    return obj


def _dec(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__items__"}:
            return {k: _dec(v) for k, v in obj["__items__"]}
        if set(obj) == {"__tuple__"}:
            return tuple(_dec(v) for v in obj["__tuple__"])
        return {k: _dec(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_dec(v) for v in obj]
    return obj


def spec_to_value(spec: Any, versions: dict) -> dict | None:
    """A spec's memo value (every field, ``raw`` and ``top`` included) and the worker's versions;
    None when the spec does not survive the JSON round trip unchanged (then it is not memoized)."""
    d = dataclasses.asdict(spec)
    try:
        encoded = json.loads(json.dumps(_enc(d)))
        if _dec(encoded) != d:
            return None
    except (TypeError, ValueError):
        return None
    return {"spec": encoded, "versions": versions}


def spec_from_value(value: dict) -> Any:
    """The :class:`~tuner.modelspec.ModelSpec` of a memo value (:func:`spec_to_value`)."""
    from tuner.modelspec import ModelSpec

    return ModelSpec(**_dec(value["spec"]))


class MemoSource:
    """The entries a job may be answered from (``{memo_key: value}``), as :func:`tuner.job.run_job`
    asks for them; the pass rows it found are kept in ``hits`` (for the worker, on a miss)."""

    def __init__(self, entries: dict[str, dict]) -> None:
        self.entries = entries
        self.hits: dict[str, dict] = {}
        self.versions: dict | None = None
        #: progress lines of the job (a list when the caller wants them, else None)
        self.progress: list[str] | None = None

    def spec(self, key: str) -> Any:
        value = self.entries.get(key)
        if value is None:
            raise MemoMiss("model spec")
        self.versions = dict(value.get("versions") or {})
        return spec_from_value(value)

    def pass_row(self, key: str) -> dict:
        row = self.entries.get(key)
        if row is None:
            raise MemoMiss("profile pass")
        self.hits[key] = row
        return row


def entry(kind: str, key: str, value: dict, *, spec: Any, device_name: str | None = None, era: str | None = None,
          method: str = "simulate") -> dict:
    """One row for :meth:`tuner.store.Store.put_memo`."""
    return {"memo_key": key, "kind": kind, "model_config_sha256": spec.config_sha256, "tool_version": __version__,
            "method": method, "device_name": device_name, "era": era, "value": value}


# ---------------------------------------------------------------------------------------------
# The parent side
# ---------------------------------------------------------------------------------------------


def job_request(request: Any) -> Any:
    """The :class:`tuner.protocol.JobRequest` of a profile job given as one or as its wire object
    (:func:`tuner.protocol.as_job_request`); None for a ``validate`` request or one the contract
    refuses (the worker then reports it as it always does)."""
    from tuner.errors import TunerError
    from tuner.protocol import KIND_JOB, JobRequest, as_job_request

    if isinstance(request, JobRequest):
        return request
    if not isinstance(request, dict) or request.get("kind", KIND_JOB) != KIND_JOB:
        return None
    try:
        return as_job_request(request)
    except TunerError:
        return None


def memo_applies(request: Any, python: str | None = None) -> bool:
    """Whether the parent may answer ``request`` (a :class:`~tuner.protocol.JobRequest` or its
    wire object) from the memo: a simulate job with fake tensors (not ``validate``), run by a
    worker in this interpreter (``python`` and ``$CTX_TUNER_WORKER_PYTHON`` unset or this one),
    where no vLLM is importable or the engine adapter is off (``engine`` / ``$CTX_TUNER_ENGINE``)."""
    job = job_request(request)
    if job is None or (job.method or "simulate") != "simulate" or not job.fake:
        return False
    if job.calibration_db:
        return False
    from tuner.worker import worker_python

    if os.path.realpath(worker_python(python)) != os.path.realpath(sys.executable):
        return False
    mode = str(job.engine or os.environ.get("CTX_TUNER_ENGINE") or "auto")
    if mode != "off":
        from tuner.engine import vllm_importable

        if vllm_importable():
            return False
    return True


def lookup_entries(store: Any, request: Any) -> dict[str, dict]:
    """The store's memo entries for the request's model config and this tool version.

    Raises:
        ModelConfigError: the config cannot be read; StoreError: the query failed.
    """
    from tuner.modelspec import config_hash, read_top
    from tuner.protocol import JobRequest

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
    from tuner.job import run_job

    job = job_request(request)
    if job is None:
        return None, {}
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


def _entries_from_store(db_url: str | None, request: Any) -> dict[str, dict]:
    """Memo entries for ``request`` from an existing store (read-only); {} when there is none or
    it cannot be read (the job then simply runs)."""
    from tuner.errors import TunerError
    from tuner.store import open_store, store_exists

    try:
        if not store_exists(db_url):
            return {}
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
                write: bool = True) -> Callable[..., dict]:
    """A worker function (``(request, *, job, timeout_s, **kw) -> result``, like
    :func:`tuner.worker.run_in_worker`) that answers from the memo in ``db_url`` where it can and
    calls ``inner`` (default ``run_in_worker``) otherwise, handing it the passes found.

    With ``write`` the worker's new entries are stored in ``db_url`` when that store exists (never
    created here); without, they stay in the result under :data:`ENTRIES` for the caller to store
    in its own transaction (``profile``, the daemon). ``enabled=False`` (``--no-cache``) always
    runs the worker (its entries are still stored: the memo is refreshed, not bypassed forever).
    """

    def worker(request: Any, *, job: str, timeout_s: float | None = None,
               on_progress: Callable[[str], None] | None = None, **kw: Any) -> dict:
        req = request
        if on_progress is not None:  # a progress sink only where one is given (fake workers may lack it)
            kw["on_progress"] = on_progress
        python = kw.get("python") or (getattr(inner, "keywords", None) or {}).get("python")  # a partial's
        if enabled and memo_applies(request, python):
            entries = _entries_from_store(db_url, request)
            if entries:
                result, hits = answer_from_memo(request, entries, on_progress)
                if result is not None:
                    return result
                if hits:  # the request as the caller gave it (a JobRequest or its wire object), topped up
                    from tuner.protocol import JobRequest

                    req = (request.replace(known_passes=hits) if isinstance(request, JobRequest)
                           else {**request, KNOWN_PASSES: hits})
        if inner is None:
            from tuner.worker import run_in_worker as run
        else:
            run = inner
        args = {"job": job, **kw}
        if timeout_s is not None:
            args["timeout_s"] = timeout_s
        result = run(req, **args)
        if write and isinstance(result, dict) and result.get(ENTRIES):
            save_entries(db_url, result.pop(ENTRIES))
        return result

    return worker


def save_entries(db_url: str | None, entries: list[dict]) -> None:
    """Store memo entries in an existing store (a failure only loses the optimisation)."""
    from tuner.errors import TunerError
    from tuner.store import open_store, store_exists

    try:
        if not store_exists(db_url):
            return
        store = open_store(db_url)
    except TunerError:
        return
    try:
        store.put_memo(entries)
    except TunerError:
        pass
    finally:
        store.close()


__all__ = ["ENTRIES", "KNOWN_PASSES", "MEMO_VERSION", "MemoMiss", "MemoSource", "answer_from_memo", "digest",
           "env_versions", "job_request", "lookup_entries", "memo_applies", "memo_worker", "pass_key", "persistent_bytes",
           "save_entries", "spec_key"]

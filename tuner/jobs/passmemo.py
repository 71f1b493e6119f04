"""The pass memo: profile passes (and the model spec they were built from) kept in the store by
content hash, so that a job whose passes are all known is answered with arithmetic — no worker
subprocess, no torch, no transformers.

What a job needs from the worker is two things: the model spec (``config.json`` read with
transformers' config classes) and one profile pass per (profile batch, pipeline stage). Every
other step of :func:`tuner.jobs.job.run_job` — plugin choice, KV specs, the era's budget, the search —
is pure Python. So the worker records, beside its result, one memo entry per spec and per pass
(``result["memo_entries"]``), the parent stores them (table ``pass_memo``, revision 0008), and a
later job runs :func:`tuner.jobs.job.run_job` *in the parent process* with those entries
(:func:`tuner.jobs.memoanswer.answer_from_memo`); the first entry it lacks raises :class:`MemoMiss`
and the job goes to a worker as before, carrying the passes that were found (``known_passes``: a
V0 sweep with one new length computes one pass).

This module is the memo's vocabulary — keys, entries, values and the :class:`MemoSource` a job
reads them from — which :mod:`tuner.jobs.job` uses on both sides of the worker seam; the parent side
(answering from the store, the worker function that tries the memo first) is
:mod:`tuner.jobs.memoanswer`, which imports :mod:`tuner.jobs.job` (this module never does).

Keys (SHA-256 of canonical JSON, :func:`digest`):

* **spec** — the ``config.json`` path and its full content, the plugin and the defaults it
  supplies, the torch and transformers versions, the tool version and :data:`MEMO_VERSION`.
* **pass** — the model config hash (:func:`tuner.model.modelspec.config_hash`), the plugin, the rank's
  settings (dtype, ``kv_cache_dtype``, quantization, block size, TP/PP/DP/EP layout and stage,
  compute capability, release, compiled/eager, ``max_num_batched_tokens`` N, ``max_num_seqs`` R),
  the era, the profile batch, fake/real tensors, Model Runner V2, the device kind, the method,
  torch, transformers and tool versions. Not ``max_model_len`` nor ``gpu_memory_utilization``:
  under V1 one pass serves every length and u. The only part of a pass that depends on
  ``max_model_len`` — the runner's persistent buffers of V1 0.27+ (the block table) — is
  recomputed from the formula (:func:`tuner.memory.budget.persistent_bytes`) at each length the job
  evaluates (:meth:`tuner.jobs.job.Passes.passes_at`: grid points and the search's off-grid points), so
  the stored row's own ``persistent_bytes`` (at the storing job's largest length) is replaced
  wherever it is used. A plugin that is not
  built in may read ``settings.max_model_len`` in its build, so for those it is in the key too, as
  for a built-in plugin that says it reads it (``reads_max_model_len = True``: DeepSeek-V4, whose
  indexer buffers are sized on the length).

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
from typing import Any

from tuner import __version__
from tuner.question.wirejson import decode, encode

#: Bump when what a stored entry means changes in a way the tool version does not capture.
#: 2: a pass row carries ``mm_max_tokens_per_item`` (the encoder-budget refusal reads it; a row
#: stored before would answer without it).
MEMO_VERSION = 2
SPEC, PASS = "spec", "pass"
#: The request key that hands the worker the passes the parent found (``{memo_key: row}``).
KNOWN_PASSES = "known_passes"
#: The result key under which a worker returns its new entries (removed before anyone sees it).
ENTRIES = "memo_entries"


class MemoMiss(Exception):
    """A spec or pass the job needs is not in the memo (or the job cannot be answered from it):
    the job goes to a worker. Internal: never leaves :func:`tuner.jobs.memoanswer.memo_worker`."""


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
    for name in ("torch", "transformers"):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            out[name] = None
            continue
        out[name] = _version_header(dist.read_text("METADATA") or dist.read_text("PKG-INFO") or "") or dist.version
    return out


def _version_header(text: str) -> str | None:
    """The ``Version:`` header of a core-metadata file, read from its header lines only: what
    ``importlib.metadata.version`` returns, without parsing the whole file (transformers' holds its
    README) with the email package — about 20–40 ms of a cold CLI."""
    for line in text.splitlines():
        if not line.strip():
            return None  # the headers end at the first blank line
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip() or None
    return None


def builtin_plugin(plugin: Any) -> bool:
    """The plugin ships with ctx-tuner (module ``tuner.plugins.*``): its builds never read
    ``settings.max_model_len`` unless it says so (``reads_max_model_len``; checked by the tests), so
    its pass keys leave it out."""
    return type(plugin).__module__.startswith("tuner.plugins.") or type(plugin).__module__.startswith("plugins.")


def spec_key(config_path: str, top: dict, plugin: Any, defaults: dict) -> str:
    """The memo key of the model spec :func:`tuner.model.modelspec.load_model_spec` reads from
    ``config_path`` (whose parsed content is ``top``) with the plugin's ``defaults``."""
    return digest({"v": MEMO_VERSION, "kind": SPEC, "tool": __version__, "versions": env_versions(),
                   "path": str(config_path), "top": top, "plugin": plugin.name,
                   "plugin_module": type(plugin).__module__, "defaults": defaults})


#: The kind of a whole job's answer that an installed engine (vLLM) took part in (:func:`engine_answer_key`).
ENGINE_ANSWER = "engine-answer"
#: Environment variables the engine adapter sets itself (tuner.engine.adapter._prepare_env): not
#: part of an engine answer's key (a warm worker has them from its first job, its parent never).
_ADAPTER_ENV = frozenset({"VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL"})


def engine_takes_part(job: Any) -> bool:
    """Whether an installed vLLM takes part in ``job`` (a :class:`tuner.question.protocol.JobRequest`): the
    engine adapter is not off (``engine`` / ``$CTX_TUNER_ENGINE``) and ``vllm`` is importable here
    (found, not imported)."""
    import os

    from tuner.releases.installed import vllm_importable

    return str(job.engine or os.environ.get("CTX_TUNER_ENGINE") or "auto") != "off" and vllm_importable()


def engine_build() -> dict | None:
    """The installed vLLM build, without importing it (:func:`tuner.releases.installed.vllm_build`):
    distribution, version, and the location and modification time of its ``__init__.py``; None when
    none is importable."""
    from tuner.releases.installed import vllm_build

    return vllm_build()


def engine_answer_key(job: Any) -> str | None:
    """The memo key of a whole simulate job's answer that an installed engine took part in
    (issue 34: a repeated question on a host with vLLM is answered from the store, no ``import
    vllm``, no torch): the request (the drop's settings without its name, path and content hash;
    the device, method, engine mode, calibration), the model config's content and path (and the
    drafter's), this tool and its environment, the vLLM build (:func:`engine_build`) and the
    ``VLLM_*`` environment the caller set. None when there is no build or a config cannot be read
    (no memo then)."""
    import os

    from tuner.errors import TunerError
    from tuner.model.modelspec import config_hash, read_top

    build = engine_build()
    if build is None:
        return None
    wire = job.to_wire()
    drop = {k: v for k, v in wire["drop"].items() if k not in ("name", "path", "content_sha256")}
    request = {k: v for k, v in wire.items() if k not in ("protocol", "drop", "progress", KNOWN_PASSES,
                                                           "engine_crosschecks")}
    try:
        config = config_hash(read_top(job.config_path))
        draft = config_hash(read_top(job.draft_config_path)) if job.draft_config_path else None
    except TunerError:
        return None
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_") and k not in _ADAPTER_ENV}
    env["CTX_TUNER_ENGINE"] = os.environ.get("CTX_TUNER_ENGINE")
    return digest({"v": MEMO_VERSION, "kind": ENGINE_ANSWER, "tool": __version__, "versions": env_versions(),
                   "vllm": build, "config": config, "draft": draft, "request": request, "drop": drop, "env": env})


def pass_key(*, spec: Any, plugin: Any, settings: Any, era: Any, batch: Any, fake: bool, model_runner_v2: bool,
             device_name: str, method: str = "simulate") -> str:
    """The memo key of one rank's profile pass (see the module docstring for what goes in)."""
    s = dataclasses.asdict(settings)
    if builtin_plugin(plugin) and not getattr(plugin, "reads_max_model_len", False):
        s.pop("max_model_len", None)
    return digest({"v": MEMO_VERSION, "kind": PASS, "tool": __version__, "versions": env_versions(),
                   "model_config_sha256": spec.config_sha256, "plugin": plugin.name,
                   "plugin_module": type(plugin).__module__, "settings": s, "era": dataclasses.asdict(era),
                   "batch": dataclasses.asdict(batch), "fake": bool(fake), "model_runner_v2": bool(model_runner_v2),
                   "device": device_name, "method": method})


def with_persistent(row: dict, persistent: int) -> dict:
    """A stored pass row with its persistent buffers replaced by ``persistent`` (bytes): the
    activation peak is the stored peak without the old buffers plus the new ones."""
    old = int(row.get("persistent_bytes") or 0)
    return {**row, "activation_peak_bytes": int(row["activation_peak_bytes"]) - old + int(persistent),
            "persistent_bytes": int(persistent)}


def spec_to_value(spec: Any, versions: dict) -> dict | None:
    """A spec's memo value (every field, ``raw`` and ``top`` included) and the worker's versions;
    None when the spec does not survive the JSON round trip unchanged (then it is not memoized)."""
    d = dataclasses.asdict(spec)
    try:
        encoded = json.loads(json.dumps(encode(d)))
        if decode(encoded) != d:
            return None
    except (TypeError, ValueError):
        return None
    return {"spec": encoded, "versions": versions}


def spec_from_value(value: dict) -> Any:
    """The :class:`~tuner.model.modelspec.ModelSpec` of a memo value (:func:`spec_to_value`)."""
    from tuner.model.modelspec import ModelSpec

    return ModelSpec(**decode(value["spec"]))


class MemoSource:
    """The entries a job may be answered from (``{memo_key: value}``), as :func:`tuner.jobs.job.run_job`
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
    """One row for :meth:`tuner.store.database.Store.put_memo`."""
    return {"memo_key": key, "kind": kind, "model_config_sha256": spec.config_sha256, "tool_version": __version__,
            "method": method, "device_name": device_name, "era": era, "value": value}


__all__ = ["ENGINE_ANSWER", "ENTRIES", "KNOWN_PASSES", "MEMO_VERSION", "engine_answer_key", "engine_build",
           "engine_takes_part", "MemoMiss", "MemoSource", "digest", "entry", "env_versions",
           "pass_key", "spec_from_value", "spec_key", "spec_to_value", "with_persistent"]

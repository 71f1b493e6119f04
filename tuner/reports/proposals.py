"""Proposal files: ``STATE_DIR/proposals/NAME.yaml``, one per active drop name.

Each file holds the vLLM arguments proposed per ``gpu_memory_utilization`` and the numbers behind
them (bytes as integers): requested memory, weights, activation peak, non-torch, CUDA graphs,
available KV cache, blocks, KV tokens, concurrency, and where they came from (drop file, content
hash, drop and job ids, era, plugin) and the run's warnings (plugin fallbacks, assumed config
defaults). Built from the database rows, so a file can always be
regenerated. Written atomically (temporary file, fsync, rename); readers never see half a file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from tuner.errors import StoreError

if TYPE_CHECKING:
    from tuner.store.database import Store

_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_NUMBERS = ("requested_memory_bytes", "weights_bytes", "activation_peak_bytes", "non_torch_bytes",
            "cuda_graph_bytes", "available_kv_cache_bytes", "max_num_batched_tokens")



def _serve_model(drop) -> str:
    """``vllm serve``'s model argument for a stored drop (:class:`tuner.store.records.StoredDrop`): the
    absolute model directory when the drop's ``model`` is a local path (relative to the drop
    file), else the HF id unchanged."""
    if isinstance(drop, dict):
        from tuner.store.records import StoredDrop

        drop = StoredDrop.from_row(drop)
    model = str(drop.model)
    base = Path(drop.path).parent if drop.path else Path.cwd()
    p = Path(model) if Path(model).is_absolute() else base / model
    if not p.exists():
        return model
    return str((p.parent if p.is_file() else p).resolve())

def proposal_document(store: "Store", drop_id: int, *, job_id: int | None = None) -> dict[str, Any]:
    """The proposal file's content for drop row ``drop_id`` (read through :mod:`tuner.store.records`).

    Raises:
        StoreError: no such drop, or a database error.
    """
    from tuner.store import records

    drop = records.drop(store, drop_id)
    if drop is None:
        raise StoreError(f"no drop with id {drop_id}", where=store.where)
    props = records.proposals_of_drop(store, drop_id, by_utilization=True)
    cands = records.candidates_of_drop(store, drop_id)
    runs = records.runs_of_drop(store, drop_id, limit=1)
    model = _serve_model(drop)
    out_props = []
    for prop in props:
        entry: dict[str, Any] = {
            "gpu_memory_utilization": prop.gpu_memory_utilization,
            "max_model_len": prop.max_model_len,
            "num_gpu_blocks": prop.num_gpu_blocks,
            "kv_cache_tokens": prop.kv_cache_tokens,
            "max_concurrency": prop.max_concurrency,
            "vllm_args": prop.vllm_args,
            "command": f"vllm serve {model} {prop.vllm_args}" if prop.vllm_args else None,
            "reason": prop.reason,
        }
        if getattr(prop, "risk", None):  # the risk it was taken at and both answers (tuner/memory/uncertainty.py)
            entry.update(risk=prop.risk, max_model_len_safe=prop.max_model_len_safe,
                         max_model_len_expected=prop.max_model_len_expected,
                         kv_cache_tokens_low=prop.kv_cache_tokens_low, kv_cache_tokens_high=prop.kv_cache_tokens_high)
        numbers = point_numbers(prop, cands)
        if numbers is not None:
            entry["numbers"] = {k: numbers[k] for k in _NUMBERS}
        add_vllm_forms(entry, model, drop.engine_version,
                       numbers["available_kv_cache_bytes"] if numbers is not None else None)
        out_props.append(entry)
    doc: dict[str, Any] = {
        "drop": drop.name,
        "source": drop.path,
        "content_sha256": drop.content_sha256,
        "drop_id": drop_id,
        "model": drop.model,
        "device": drop.device_name,
        "engine_version": drop.engine_version,
        # what was assumed to pick the release (tuner.memory.eras.resolve_release), or null
        "release_assumed": _release_assumed(getattr(drop, "release_assumed", None)),
        "method": drop.method,
        "created_at": drop.created_at,
    }
    if job_id is not None:
        doc["job_id"] = job_id
    if runs:
        doc.update(era=runs[0].era, plugin=runs[0].plugin, dtype=runs[0].dtype, tool_version=runs[0].tool_version)
    doc["warnings"] = _warnings(drop.warnings)
    doc["proposals"] = out_props
    return doc


def _release_assumed(text: str | None) -> dict | None:
    """``drops.release_assumed`` (JSON, revision 0012) as a dict, None when absent or unreadable."""
    import json

    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _warnings(text: str | None) -> list[str]:
    """``drops.warnings`` (a JSON list, revision 0006) as a list of strings."""
    import json

    try:
        items = json.loads(text) if text else []
    except ValueError:
        return [str(text)]
    return [str(w) for w in items] if isinstance(items, list) else [str(items)]


def add_vllm_forms(entry: dict[str, Any], model: str, engine_version: str, kv_cache_bytes: int | None) -> None:
    """Add a proposal's vLLM forms to its entry (:mod:`tuner.question.vllm_forms`): ``vllm_config`` (the
    ``vllm serve --config`` mapping), ``vllm_args_kv_cache_memory_bytes`` and
    ``vllm_config_kv_cache_memory_bytes`` (the same start-up with ``--kv-cache-memory-bytes``;
    None before vLLM 0.10.2)."""
    from tuner.question.vllm_forms import proposal_configs

    forms = proposal_configs(model, entry, engine_version=engine_version, kv_cache_bytes=kv_cache_bytes)
    from tuner.question.protocol import point_of

    entry["vllm_config"] = point_of(forms).gpu_memory_utilization  # the --gpu-memory-utilization form
    entry["vllm_args_kv_cache_memory_bytes"] = forms["vllm_args_kv_cache_memory_bytes"]
    entry["vllm_config_kv_cache_memory_bytes"] = forms["kv_cache_memory_bytes"]


def point_numbers(prop, cands: list = ()) -> dict[str, int] | None:
    """The numbers behind a proposal (:data:`tuner.question.protocol.POINT_NUMBERS`): the proposed point's
    own, as the search evaluated it (a stored ``proposals`` row, revision 0009, or a
    :class:`tuner.question.protocol.ProposalResult`), on the grid or off it. A row stored before 0009 has
    none: then the grid candidate at exactly that point (``cands``), else None — never another
    length's, whose profile batch and activation differ."""
    from tuner.question.protocol import POINT_NUMBERS

    if prop.max_model_len is None:
        return None
    if getattr(prop, "available_kv_cache_bytes", None) is not None:
        return {k: None if getattr(prop, k) is None else int(getattr(prop, k)) for k in POINT_NUMBERS}
    same = [c for c in cands if abs(float(c.gpu_memory_utilization) - float(prop.gpu_memory_utilization)) < 1e-9
            and c.max_model_len == prop.max_model_len]
    if not same:
        return None
    return {k: None if same[0].get(k) is None else int(same[0].get(k)) for k in POINT_NUMBERS}


def proposal_path(directory: str | os.PathLike, name: str) -> Path:
    """``directory/NAME.yaml`` (drop names are ``[A-Za-z0-9_.-]``, never only dots, so this
    stays inside ``directory``)."""
    return Path(directory) / f"{name}.yaml"


def vllm_config_dir(directory: str | os.PathLike, name: str) -> Path:
    """``directory/NAME.vllm``: the proposal's ``vllm serve --config`` files, next to ``NAME.yaml``."""
    return Path(directory) / f"{name}.vllm"


def _atomic_write(dest: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_vllm_configs(directory: str | os.PathLike, doc: dict[str, Any]) -> list[Path]:
    """Write each proposal of ``doc`` as ``vllm serve --config`` files in ``directory/NAME.vllm/``
    (``gpu-memory-utilization-U.yaml`` and, vLLM 0.10.2+, ``kv-cache-memory-bytes-U.yaml``; in the
    form the release accepts, :func:`tuner.question.vllm_forms.release_form`: ``.sh`` command lines before
    vLLM 0.6.0), atomically; files of proposals no longer in ``doc`` are removed. Returns the paths written."""
    from tuner.question.vllm_forms import proposal_documents

    d = vllm_config_dir(directory, doc["drop"])
    d.mkdir(parents=True, exist_ok=True)
    model = next((p["vllm_config"]["model"] for p in doc.get("proposals", []) if (p.get("vllm_config") or {}).get("model")),
                 doc["model"])
    written = []
    for fname, text in proposal_documents(model, doc["engine_version"], doc.get("proposals", [])):
        _atomic_write(d / fname, text)
        written.append(d / fname)
    for old in [*d.glob("*.yaml"), *d.glob("*.sh")]:  # .sh: a release without --config
        if old not in written:
            old.unlink()
    return written


def write_proposal_file(directory: str | os.PathLike, doc: dict[str, Any]) -> Path:
    """Write ``doc`` as ``directory/NAME.yaml`` atomically (mode 0644), and its proposals as
    ``vllm serve --config`` files in ``directory/NAME.vllm/`` (:func:`write_vllm_configs`).
    Returns the path of ``NAME.yaml``.

    Raises:
        OSError: the directory cannot be created or written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dest = proposal_path(directory, doc["drop"])
    text = "# ctx-tuner proposal (written by the daemon; edits are overwritten)\n" + yaml.dump(
        doc, Dumper=_DUMPER, sort_keys=False, default_flow_style=False, allow_unicode=True)
    write_vllm_configs(directory, doc)
    _atomic_write(dest, text)
    return dest


def remove_proposal_file(directory: str | os.PathLike, name: str) -> bool:
    """Remove ``directory/NAME.yaml`` (and its ``NAME.vllm/`` config files) if present. Returns
    True if the proposal file was removed."""
    import shutil

    shutil.rmtree(vllm_config_dir(directory, name), ignore_errors=True)
    try:
        proposal_path(directory, name).unlink()
        return True
    except FileNotFoundError:
        return False

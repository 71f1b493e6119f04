"""Import a vLLM start-up log an operator already has as a measured run (``method = 'import'``).

Flow: log file → :func:`tuner.logs.logparse.parse_file` → settings resolved (command-line option >
what the log printed > the era's default) and validated with the drop schema → one ``drops`` row
(the import, ``method='import'``) and one ``profile_runs`` row holding what the engine printed →
optionally a simulate prediction of the same settings (worker subprocess) whose per-term residual
goes to the ``calibrations`` table, where :func:`tuner.jobs.calibrate.calibration_for` finds it.

No torch in this module (the prediction runs in the worker); bytes are ints throughout.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tuner import __version__
from tuner.memory import devices
from tuner.question.drop import Drop, parse_drop
from tuner.memory.eras import default_engine, era_for, mm_prefix_lm_item_tokens, parse_version, profile_batch, resolve_dtype
from tuner.errors import DeviceError, DropError, EraError, LogParseError, ModelConfigError
from tuner.logs.logparse import ParsedLog, parse_file
from tuner.model.modelspec import resolve_model_path
from tuner.store.database import Store, utc_text

__all__ = ["ImportOutcome", "import_log", "resolve_settings", "run_row", "config_path_for", "OPTION_KEYS"]

#: Engine settings an import takes from the command line (vLLM names; same meaning as in a drop).
OPTION_KEYS = ("gpu_memory_utilization", "max_model_len", "tensor_parallel_size", "pipeline_parallel_size",
               "dtype", "kv_cache_dtype", "quantization", "max_num_seqs", "max_num_batched_tokens",
               "block_size", "enable_chunked_prefill", "enforce_eager", "entry_point")
_DROP_KEYS = tuple(k for k in OPTION_KEYS if k not in ("gpu_memory_utilization", "max_model_len"))
#: A printed total within this of the catalog total is the catalog device (logs print 2 decimals).
_TOTAL_TOLERANCE = int(0.006 * (1 << 30))


@dataclass
class ImportOutcome:
    """What :func:`import_log` stored. ``already`` is True when the same log, model and device were
    imported before (nothing new written; ``drop_id`` is the earlier import's)."""

    parsed: ParsedLog
    drop: Drop
    run: dict
    drop_id: int | None = None
    already: bool = False
    predicted: dict | None = None
    calibration: dict | None = None
    warnings: list[str] = field(default_factory=list)
    #: the release assumed for a log that does not print its version (``release_assumed``,
    #: ``release_range``, evidence: :meth:`tuner.logs.release_infer.ReleaseInference.to_dict`); None
    #: when the version was given or printed.
    release: dict | None = None


def config_path_for(model: str, *, models_dir: str | Path | None = None, base_dir: str | Path | None = None) -> Path:
    """The model's config.json: ``models_dir/<org>--<name>/config.json`` for an HF id when
    ``models_dir`` is given and holds it, else :func:`tuner.model.modelspec.resolve_model_path`.

    Raises:
        ModelConfigError: no config found (names the places searched).
    """
    if models_dir is not None and model.count("/") == 1:
        p = Path(models_dir) / model.replace("/", "--") / "config.json"
        if p.is_file():
            return p.resolve()
    return resolve_model_path(model, base_dir)


def read_config(path: Path) -> tuple[dict, str]:
    from tuner.model.modelspec import parse_config_json, read_config_bytes

    top = parse_config_json(read_config_bytes(path), str(path))  # a regular file, bounded size and depth
    if not isinstance(top, dict):
        raise ModelConfigError("config.json is not a JSON object", where=str(path))
    from tuner.model.modelspec import config_hash

    return top, config_hash(top)  # the canonical hash profile runs store (ModelSpec.config_sha256)


def _text_config(top: dict) -> dict:
    tc = top.get("text_config")
    return tc if isinstance(tc, dict) else top


def _safe_name(path: Path) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", path.name).strip("-.") or "log"
    return ("import-" + stem)[:128]


def resolve_settings(parsed: ParsedLog, *, model: str, device: Any, engine_version: str | None = None,
                     engine: str | None = None, options: dict | None = None, config: dict | None = None,
                     source: str = "") -> tuple[Drop, dict]:
    """Settings of the logged start-up: an option wins, then what the log printed, then the era's default.

    Args:
        parsed: the parsed log.
        model: the model as the user names it (HF id or path); device: catalog name, ``auto`` or mapping.
        engine_version, engine: vLLM release and ``V0``/``V1``; default: what the log printed.
        options: any of :data:`OPTION_KEYS` (None values = not given).
        config: the model's config.json (for ``max_position_embeddings`` when the log has no
            max_model_len).

    Returns:
        ``(drop, extra)``: a validated :class:`~tuner.question.drop.Drop` with one ``gpu_memory_utilization``
        and one ``max_model_len`` candidate, and ``{"engine": "V0"|"V1", "device_name": canonical
        name, "total_memory_bytes": int, "warnings": [what was assumed]}``. A log that prints no
        version gets the newest modelled release consistent with what it names
        (:func:`tuner.logs.release_infer.infer_for_log`: its lines, the model's architecture and names, the rule
        ``validate`` uses), with a warning and ``extra["release"]`` (the range and evidence,
        :meth:`tuner.logs.release_infer.ReleaseInference.to_dict`; None when the version was given or
        printed); a missing ``gpu_memory_utilization`` is the release's
        default, with a warning.

    Raises:
        DropError: a value is invalid (the field is named; ``path`` is the log).
    """
    options = {k: v for k, v in (options or {}).items() if v is not None}
    printed = parsed.settings
    warnings: list[str] = []
    version = engine_version or parsed.vllm_version
    release = None
    if not version:
        from tuner.logs.release_infer import infer_for_log

        release = infer_for_log(parsed.release_lines, engine=engine or parsed.engine, config=config,
                                quantization=(options or {}).get("quantization") or printed.get("quantization"),
                                kv_cache_dtype=(options or {}).get("kv_cache_dtype") or printed.get("kv_cache_dtype"))
        if release.release is None:
            raise DropError("the log does not print the vLLM version and no modelled release is consistent with "
                            "what it names; give --engine-version", path=source, field="engine_version")
        version = release.release
        engine = engine or release.engine
        warnings.append(f"the log does not print the vLLM version; {release.describe()}; "
                        "give --engine-version if it was another release")
    try:
        v = parse_version(version)
        eng = (engine or parsed.engine or default_engine(v)).upper()
        era = era_for(version, eng)
    except EraError as exc:
        raise DropError(exc.message, path=source, field="engine_version") from exc
    dev = None
    if isinstance(device, str) and device.strip().lower() != "auto" and parsed.total_memory_bytes is not None:
        # the total the log printed picks among a name's cards ("NVIDIA H100": SXM, PCIe, NVL) and
        # gives a card the catalog lacks its total
        dev = devices.lookup(device, total_memory_bytes=parsed.total_memory_bytes) or devices.Device(
            name=device.strip(), total_memory_bytes=int(parsed.total_memory_bytes), source="printed by the log")
    if dev is None:
        dev = devices.resolve_device(device)
    total = dev.total_memory_bytes
    if parsed.total_memory_bytes is not None and abs(parsed.total_memory_bytes - total) > _TOTAL_TOLERANCE:
        total = parsed.total_memory_bytes  # the log's device total is what the engine saw
    known = devices.lookup(dev.name)
    dev_name = known.name if known is not None else dev.name

    def pick(key: str, fallback: Any = None) -> Any:
        if key in options:
            return options[key]
        if printed.get(key) is not None:
            return printed[key]
        return fallback

    gmu = pick("gpu_memory_utilization", parsed.gpu_memory_utilization)
    if gmu is None:
        gmu = era.default_gpu_memory_utilization
        warnings.append(f"the log has no gpu_memory_utilization line; assumed vLLM {version}'s default {gmu:g} "
                        "(give --gpu-memory-utilization if the engine ran with another)")
    mml = pick("max_model_len", parsed.max_model_len)
    if mml is None and config is not None:
        mml = _text_config(config).get("max_position_embeddings")
    if mml is None:
        raise DropError("the log does not print max_model_len and " + (
            "the model config has no max_position_embeddings" if config is not None else
            "no config.json of the model was found") + "; give --max-model-len", path=source, field="max_model_len")
    values: dict[str, Any] = {"gpu_memory_utilization": gmu, "max_model_len": mml}
    for key in _DROP_KEYS:
        value = pick(key)
        if value is not None and key != "entry_point":
            values[key] = value
    if isinstance(values.get("dtype"), str) and values["dtype"].startswith("torch."):
        values["dtype"] = values["dtype"][len("torch."):]
    # the one mapping from vLLM arguments to a drop (tuner.question.vllm_args), validated by the drop schema
    from tuner.question.vllm_args import ArgsInputError, equivalent_drop, from_settings

    try:
        sa = from_settings(values, model=model, source=source or "log")
        # the topology a --device NAME:GIB:IC or mapping states travels with the drop
        dev = {"name": dev_name, "total_memory_bytes": int(total),
               **{k: device[k] for k in ("interconnect", "p2p", "compute_capability")
                  if isinstance(device, dict) and device.get(k) is not None}}
        doc, not_modelled = equivalent_drop(sa, device=dev,
                                            engine_version=str(version), allow_unmodelled=True,
                                            name=_safe_name(Path(source or "log")), model=model)
    except ArgsInputError as exc:
        raise DropError(exc.message, path=source, field=None) from None
    doc["method"] = "simulate"
    if pick("entry_point") is not None:
        doc["entry_point"] = pick("entry_point")
    drop = parse_drop(json.dumps(doc), source or "log")
    return drop, {"engine": eng, "device_name": dev_name, "total_memory_bytes": int(total), "warnings": warnings,
                  "not_modelled": [n.to_dict() for n in not_modelled],
                  "release": release.to_dict() if release is not None else None}


def run_row(parsed: ParsedLog, drop: Drop, extra: dict, *, config: dict, config_sha256: str | None,
            log_sha256: str, started_at: str | None = None) -> dict:
    """The ``profile_runs`` row of an imported log (``method='import'``, ``source`` = the log file).

    ``cuda_graph_bytes`` holds the engine's CUDA-graph *estimate* where the log printed one (0.18+,
    the amount the 0.20+ budget subtracts), else the captured size ("Graph capturing finished …
    took"). For V0 0.6.4 logs, which print the torch peak including weights, the weights are
    ``initial_memory_usage − non_torch_memory`` when no weights line is printed, and the activation
    peak is ``peak_torch_memory − weights``.
    """
    era = era_for(drop.engine_version, extra["engine"], enforce_eager=drop.enforce_eager)
    tc = _text_config(config)
    gmu = drop.candidates.gpu_memory_utilization[0]
    mml = drop.candidates.max_model_len[0]
    batch = profile_batch(era, max_model_len=mml, entry_point=drop.entry_point, device_name=extra["device_name"],
                          total_memory_bytes=extra["total_memory_bytes"],
                          max_num_batched_tokens=drop.max_num_batched_tokens, max_num_seqs=drop.max_num_seqs,
                          enable_chunked_prefill=drop.enable_chunked_prefill,
                          has_sliding_window=tc.get("sliding_window") is not None,
                          is_multimodal="text_config" in config,
                          mm_prefix_lm_item_tokens=mm_prefix_lm_item_tokens(config))
    weights = parsed.weights_bytes
    if (weights is None and parsed.initial_memory_usage_bytes is not None
            and parsed.non_torch_bytes is not None):
        # V0 0.6.4 prints no "Loading model weights took" line in its profiling summary, but its
        # initial_memory_usage is the weights plus the non-torch memory (vllm/worker/worker.py
        # determine_num_available_blocks, 0.6.4): e.g. 15.34 = 14.99 + 0.35 GiB on an RTX 3090.
        weights = parsed.initial_memory_usage_bytes - parsed.non_torch_bytes
    activation = parsed.activation_peak_bytes
    if activation is None and parsed.peak_torch_memory_bytes is not None and weights is not None:
        activation = parsed.peak_torch_memory_bytes - weights
    graphs = parsed.cuda_graph_estimated_bytes if parsed.cuda_graph_estimated_bytes is not None \
        else parsed.cuda_graph_bytes
    config_dtype = str(tc.get("torch_dtype") or tc.get("dtype") or config.get("torch_dtype") or "float16")
    key = {"log_sha256": log_sha256, "model_config_sha256": config_sha256, "device": extra["device_name"],
           "engine_version": drop.engine_version, "engine": extra["engine"], "method": "import",
           "gpu_memory_utilization": gmu, "max_model_len": mml, "tp": drop.tensor_parallel_size,
           "pp": drop.pipeline_parallel_size}
    return {
        "key": "import", "pass_sha256": hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest(),
        "status": "ok", "error": None, "method": "import", "engine_version": drop.engine_version,
        "era": era.name, "model": drop.model, "model_config_sha256": config_sha256,
        "architecture": ",".join(config.get("architectures") or []) or None, "plugin": None,
        "device_name": extra["device_name"], "device_total_memory_bytes": extra["total_memory_bytes"],
        "dtype": resolve_dtype(drop.dtype, config_dtype.replace("torch.", "")), "kv_cache_dtype": drop.kv_cache_dtype,
        "tensor_parallel_size": drop.tensor_parallel_size, "pipeline_parallel_size": drop.pipeline_parallel_size,
        "max_num_batched_tokens": batch.max_num_batched_tokens, "max_num_seqs": batch.max_num_seqs,
        "num_sampled_rows": batch.num_reqs, "weights_bytes": weights,
        "activation_peak_bytes": activation, "forward_peak_bytes": None, "sampler_peak_bytes": None,
        "tool_version": __version__, "torch_version": None, "transformers_version": None,
        "started_at": started_at or utc_text(), "elapsed_s": None,
        "gpu_memory_utilization": gmu, "max_model_len": mml, "block_size": drop.block_size,
        "non_torch_bytes": parsed.non_torch_bytes, "cuda_graph_bytes": graphs,
        "available_kv_cache_bytes": parsed.available_kv_cache_bytes, "num_gpu_blocks": parsed.num_gpu_blocks,
        "kv_cache_tokens": parsed.kv_cache_tokens, "max_concurrency": parsed.max_concurrency,
        "error_message": parsed.error_message, "source": parsed.source,
    }


def prediction_request(drop: Drop, extra: dict, config_path: Path) -> dict:
    """The simulate worker request for the same settings as the imported run (uncalibrated)."""
    from tuner.question.protocol import JobRequest

    return JobRequest(drop=drop, config_path=str(config_path), search=False, engine_kind=extra["engine"],
                      device={"name": extra["device_name"], "total_memory_bytes": extra["total_memory_bytes"]},
                      ).to_wire()


def import_log(path: str | Path, *, model: str, device: Any, store: Store, engine_version: str | None = None,
               engine: str | None = None, options: dict | None = None, models_dir: str | Path | None = None,
               predict: bool = True, worker: Callable[..., dict] | None = None, timeout_s: float = 600.0,
               force: bool = False, parsed: ParsedLog | None = None) -> ImportOutcome:
    """Parse ``path`` and store it as a measured run; with ``predict``, store its calibration residual.

    Args:
        model: HF id or path of the model (its config.json is read offline; ``models_dir`` maps
            ``org/name`` to ``models_dir/org--name``).
        device: catalog name/alias, ``auto`` or a mapping (see :func:`tuner.memory.devices.resolve_device`).
        options: engine settings the log does not print (see :data:`OPTION_KEYS`).
        predict: run simulate on the same settings (``worker``, default :func:`tuner.seam.worker.run_in_worker`)
            and store the residual in ``calibrations``.
        force: import again even if the same log was imported for the same model and device.
        parsed: an already parsed log (tests, the ``vllm`` method); default: parse ``path``.

    Raises:
        LogParseError: unreadable log or no memory lines (names the file).
        DropError: a setting is missing or invalid (names the log and the field).
        ModelConfigError, DeviceError: model config or device not found.
        StoreError: database failure (nothing written: the run and its residual are one
            transaction); WorkerError: the prediction failed
            (the measured run is still stored; the outcome carries a warning instead of raising).
    """
    from tuner.jobs import calibrate

    path = Path(path)
    if parsed is None:
        parsed = parse_file(path)
    elif not parsed.has_memory_lines and parsed.error_message is None:
        raise LogParseError("no vLLM memory lines found", where=str(path))
    try:
        log_sha = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else \
            hashlib.sha256(json.dumps(parsed.to_dict(), sort_keys=True, default=str).encode()).hexdigest()
    except OSError as exc:
        raise LogParseError(f"cannot read log: {exc}", where=str(path)) from exc
    # what the log printed is stored first; modelling it (the config, a prediction) comes second: a
    # model no config.json (hence no plugin) is found for is still recorded, with what that leaves out
    config_path: Path | None
    try:
        config_path = config_path_for(model, models_dir=models_dir)
        config, config_sha = read_config(config_path)
        no_config = None
    except ModelConfigError as exc:
        config_path, config, config_sha, no_config = None, None, None, exc
    drop, extra = resolve_settings(parsed, model=model, device=device, engine_version=engine_version,
                                   engine=engine, options=options, config=config, source=str(path))
    row = run_row(parsed, drop, extra, config=config or {}, config_sha256=config_sha, log_sha256=log_sha)
    outcome = ImportOutcome(parsed=parsed, drop=drop, run=row, warnings=list(extra.get("warnings", [])),
                            release=extra.get("release"))
    if no_config is not None:
        predict = False
        outcome.warnings.append(
            f"no config.json of {model} ({no_config.message}): the log is stored as printed, without the model's "
            f"config hash or architecture, and with dtype {row['dtype']}"
            + (" as the log printed it" if drop.dtype not in (None, "auto") else " assumed (the log does not print it)")
            + "; no prediction or calibration residual: give --models-dir or a local model path and import "
              "again with --force to model it")
    earlier = store.find_run(row["pass_sha256"])
    if earlier is not None and not force:
        outcome.drop_id, outcome.already = earlier["drop_id"], True
        return outcome
    content = json.dumps({"log": str(path), "parsed": parsed.to_dict(), "settings": drop.to_dict(),
                          "engine": extra["engine"], "release": extra.get("release")}, sort_keys=True, default=str)
    drop_row = {"name": drop.name, "path": str(path), "content_sha256": log_sha, "content": content,
                "model": model, "device_name": extra["device_name"], "engine_version": drop.engine_version,
                "method": "import"}
    if predict:
        from tuner.seam.worker import run_in_worker

        try:
            result = (worker or run_in_worker)(prediction_request(drop, extra, config_path),
                                               job=drop.name, timeout_s=timeout_s)
            outcome.predicted = result["candidates"][0]
            outcome.warnings.extend(result.get("warnings", []))
        except Exception as exc:  # noqa: BLE001 - the measurement is worth keeping without a residual
            outcome.warnings.append(f"no calibration residual: prediction failed: {exc}")
    def residual_too(conn, drop_id: int) -> None:  # inside save_result's transaction: run and residual together
        if outcome.predicted is None:
            return
        run_id = store.run_ids(conn, drop_id)[0]
        cal = calibrate.residual_row({**row, "id": run_id}, outcome.predicted, quantization=drop.quantization,
                                     total_known=parsed.total_memory_bytes is not None)
        cal["id"] = store.insert_calibration(conn, cal)
        outcome.calibration = cal

    outcome.drop_id = store.save_result(drop_row, [row], [], [], also=residual_too)
    return outcome

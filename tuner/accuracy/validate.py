"""Predict real vLLM start-ups and compare (``ctx-tuner validate``).

A case file is JSON Lines in the format of ``shared/cases/README.md``: one start-up per line with
the model id, vLLM version and engine, GPU, parallel layout, settings and what the engine printed
(``observed``). For each case this module builds the job the case describes (a drop with exactly
its settings and one candidate), runs it, and reports predicted against observed:
``num_gpu_blocks`` (or the KV-cache GiB where the log printed no blocks, or the KV tokens), weights,
activation peak, the error in %, and whether the prediction is **unsafe**: more KV tokens than
the engine really had, beyond one block.

Parent side (no torch): :func:`load_cases`, :func:`case_request`, :func:`summarize`. Worker side:
:func:`predict_cases` runs every case in one worker process (imports torch through the job).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any, Callable

from tuner.logs import logparse
from tuner.errors import DropError, TunerError

GiB = 1 << 30

#: The fields a case must have (``shared/cases/README.md``).
REQUIRED_FIELDS = ("id", "model", "gpu", "settings", "observed")

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
           "float32": "float32", "fp32": "float32", "float": "float32"}


def load_cases(path: str | Path) -> list[dict]:
    """Read a JSON Lines case file.

    Raises:
        DropError: unreadable file, a line that is not a JSON object, or a case missing a
            required field (names the file, the line and the field).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise DropError(f"cannot read case file: {exc.strerror or exc}", path=str(p)) from exc
    cases = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            case = json.loads(line)
        except ValueError as exc:
            raise DropError(f"line {no}: not JSON: {exc}", path=str(p)) from exc
        if not isinstance(case, dict):
            raise DropError(f"line {no}: a case is a JSON object", path=str(p))
        for key in REQUIRED_FIELDS:
            if case.get(key) is None:
                raise DropError(f"line {no}: case {case.get('id', '?')!r} has no {key!r}", path=str(p), field=key)
        cases.append(case)
    return cases


def case_release(case: dict, models_dir: str | Path | None = None):
    """The release assumed for a case whose record has no ``vllm_version``: the newest modelled
    release consistent with its engine, names, settings, ``raw_lines`` and (with ``models_dir``)
    its model's config (:func:`tuner.logs.release_infer.infer_for_case`); None when the case states
    its version."""
    if case.get("vllm_version"):
        return None
    from tuner.logs.release_infer import infer_for_case

    config = None
    if models_dir is not None:
        path = Path(models_dir) / _model_dir_name(str(case.get("model"))) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            config = None
    return infer_for_case(case, config)


def infer_version(case: dict, models_dir: str | Path | None = None) -> tuple[str, str]:
    """``(version, engine)`` of a case: as stated, else :func:`case_release`'s (the one rule
    ``validate`` and ``import-log`` share: :mod:`tuner.logs.release_infer`).

    Raises:
        DropError: no modelled release is consistent with what the case names.
    """
    engine = (case.get("engine") or "").upper()
    engine = engine if engine in ("V0", "V1") else None
    if case.get("vllm_version"):
        return str(case["vllm_version"]), engine
    inferred = case_release(case, models_dir)
    if inferred.release is None:
        raise DropError(f"case {case.get('id')!r} has no vllm_version and no modelled release is consistent "
                        "with what it names", field="vllm_version")
    return inferred.release, inferred.engine


def _release_fields(case: dict, models_dir) -> dict:
    """``release_assumed`` / ``release`` / ``release_range`` of a report row (assumed: the case
    states no version; the uncertainty of the answer widens with the range)."""
    try:
        inferred = case_release(case, models_dir)
    except Exception:  # noqa: BLE001 - the row's own error says what failed
        inferred = None
    if inferred is None:
        return {"release_assumed": False, "release": case.get("vllm_version"), "release_range": None}
    d = inferred.to_dict()
    return {"release_assumed": True, "release": d["release"], "release_range": d["release_range"],
            "release_evidence": d["evidence"], "release_ignored": d["ignored"]}


def _model_dir_name(model: str) -> str:
    return model.replace("/", "--")


def config_path_for(case: dict, models_dir: str | Path) -> Path:
    """``<models_dir>/<org>--<name>/config.json`` for the case's model id.

    Raises:
        TunerError: no such file (names the path).
    """
    path = Path(models_dir) / _model_dir_name(str(case["model"])) / "config.json"
    if not path.is_file():
        raise TunerError(f"no config.json for model {case['model']!r}", where=str(path))
    return path


def derived_max_model_len(config_path: str | Path, hf_overrides: dict | None = None) -> int:
    """The ``max_model_len`` vLLM derives when none is given (:func:`tuner.model.modelspec.derived_max`:
    :func:`tuner.memory.search.derived_max_model_len` over the text config with the case's
    ``hf_overrides`` applied, so a RoPE scaling override raises it)."""
    from tuner.model.modelspec import derived_max

    return derived_max(str(config_path), hf_overrides)[0]


def _one_device(name: Any, gib: Any) -> dict:
    """One card of a case: ``{name, total_memory_bytes}`` with the total the log printed
    (``gpu_total_gib``) when there is one, else the catalog card the name names."""
    from tuner.memory.devices import candidates_for, lookup, resolve_device
    from tuner.errors import DeviceError

    if gib:
        return {"name": str(name), "total_memory_bytes": int(round(float(gib) * GiB))}
    try:
        dev = resolve_device(str(name))
    except DeviceError:
        several = candidates_for(str(name))
        if len(several) < 2:
            raise
        # a name that fits several cards ("NVIDIA H100": SXM, PCIe, NVL) without a printed total: the
        # card's usual value (cases README), the first of them in catalog order
        dev = several[0]
    out = {"name": dev.name, "total_memory_bytes": int(dev.total_memory_bytes)}
    known = lookup(dev.name)
    if known is not None and dev.interconnect and known.interconnect != dev.interconnect:
        out["interconnect"] = dev.interconnect  # a board word in the printed name ("... PCIe")
    return out


def _device(case: dict) -> dict:
    """The request's device for a case. ``gpu`` may be a list, one card per pipeline stage (as a
    drop's device list, :func:`tuner.jobs.app.prepare_job`): the request then carries the first stage's
    card and ``stages``, each stage sized on its own card (the engine takes the fewest blocks over
    the stages, vllm/v1/core/kv_cache_utils.py ``get_kv_cache_configs``); ``gpu_total_gib`` may be
    a list of the same length or one total for every stage.

    Raises:
        DeviceError: an unknown card (``gpu`` / ``gpu[I]``) without a stated total; a list whose
            length is not ``pipeline_parallel_size``."""
    from tuner.errors import DeviceError

    gpu, gib = case.get("gpu"), case.get("gpu_total_gib")
    if not isinstance(gpu, list):
        return _one_device(gpu, gib)
    pp = int(case.get("pipeline_parallel_size") or 1)
    if len(gpu) != pp:
        raise DeviceError(f"a gpu list names one card per pipeline stage: {len(gpu)} entries for "
                          f"pipeline_parallel_size {pp}", where="gpu")
    gibs = gib if isinstance(gib, list) else [gib] * len(gpu)
    if len(gibs) != len(gpu):
        raise DeviceError(f"gpu_total_gib lists {len(gibs)} totals for {len(gpu)} cards", where="gpu_total_gib")
    stages = []
    for i, (name, g) in enumerate(zip(gpu, gibs)):
        try:
            stages.append(_one_device(name, g))
        except DeviceError as exc:
            raise DeviceError(exc.message, where=f"gpu[{i}]") from exc
    return {**stages[0], "stages": stages}


def unmodelled_inputs(case: dict, mapped=None) -> list[dict]:
    """What a case states that the drop it becomes does not model, each classified for the interval
    (:func:`tuner.memory.uncertainty.classify_setting`: widens the band, or no effect on memory): the
    arguments the one mapping names (:func:`case_drop`'s ``not_modelled``, :mod:`tuner.question.vllm_args`;
    ``env_NAME`` variables included), those it ignores as not touching memory, and a release that
    was not stated (inferred from the log's formats) or is a development build."""
    from tuner.memory.uncertainty import Unmodelled, classify_setting

    out: list[dict] = []
    if mapped is not None:
        for n in mapped.not_modelled:
            name = str(n.argument).replace("env ", "env_", 1).lstrip("-").replace("-", "_")
            where = "environment" if name.startswith("env_") else str(n.source or "case settings")
            out.append(classify_setting(name, n.value, where=where, note=str(n.why or "")).to_dict())
        for e in (getattr(mapped.args, "ignored", None) or []) if mapped.args is not None else []:
            name = str(e.get("flag") or e.get("as_written") or "").split()[0].lstrip("-").replace("-", "_")
            out.append(Unmodelled(name, e.get("value"), "case settings", "no effect on memory",
                                  str(e.get("note") or "")).to_dict())
    version = case.get("vllm_version")
    if not version:
        inferred, _engine = infer_version(case)
        out.append(Unmodelled("vllm_version", inferred, "case", "widens",
                              f"not stated: vLLM {inferred} inferred from the log's formats",
                              "release_not_stated").to_dict())
    elif ".dev" in str(version):
        out.append(Unmodelled("vllm_version", str(version), "case", "widens",
                              "a development build: the rules of the nearest release",
                              "release_not_stated").to_dict())
    return out


def _speculative(value: Any) -> dict | None:
    """A case's ``settings.speculative_config`` as a drop's (vLLM's key names; unknown keys of the
    case, such as ``num_spec_tokens`` spellings, are mapped or dropped)."""
    if not isinstance(value, dict) or not value.get("method"):
        return None
    k = value.get("num_speculative_tokens") or value.get("num_spec_tokens")
    out = {"method": str(value["method"]).lower(), "num_speculative_tokens": int(k) if k else 1}
    for key in ("model", "prompt_lookup_min", "prompt_lookup_max", "draft_tensor_parallel_size"):
        if value.get(key) is not None:
            out[key] = value[key]
    return out


def _hf_overrides(settings: dict) -> dict | None:
    """A case's config overrides as the drop's ``hf_overrides``: its ``hf_overrides`` and a
    ``rope_scaling`` given on vLLM's command line (``--rope-scaling``, 0.4–0.9; later through
    ``--hf-overrides``)."""
    out = dict(settings.get("hf_overrides") or {})
    if isinstance(settings.get("rope_scaling"), dict):
        out["rope_scaling"] = dict(settings["rope_scaling"])
    return out or None


def case_config_format(case: dict) -> str:
    """``mistral`` where the case's command line (raw lines or notes) passes
    ``--config-format mistral``, else ``auto``."""
    text = " ".join(str(x) for x in list(case.get("raw_lines") or []) + [case.get("notes") or ""])
    return "mistral" if re.search(r"--config[-_]format[= ]+mistral", text) else "auto"


def case_entry_point(case: dict) -> str:
    """``offline`` where the case's raw lines construct vLLM's ``LLM`` class (``LLM(model=...)``:
    ``UsageContext.LLM_CLASS``, whose ``max_num_batched_tokens`` / ``max_num_seqs`` defaults differ,
    vllm/engine/arg_utils.py ``_set_default_args``), else ``serve``."""
    text = " ".join(str(x) for x in case.get("raw_lines") or [])
    return "offline" if re.search(r"(?<![\w.])LLM\(", text) else "serve"


def case_env(settings: dict) -> dict | None:
    """A case's environment variables (``env_NAME`` settings, cases/README.md) as a drop's
    ``env``."""
    out = {k[len("env_"):]: ("1" if v is True else "0" if v is False else str(v))
           for k, v in (settings or {}).items() if k.startswith("env_") and v is not None}
    return out or None


def case_arguments(case: dict) -> dict:
    """A case's vLLM arguments by destination name: its top-level ``dtype``, ``kv_cache_dtype``,
    ``quantization``, ``tensor_parallel_size``, ``pipeline_parallel_size`` and every ``settings`` key
    (``speculative_config`` in the drop's keys, ``rope_scaling`` folded into ``hf_overrides``);
    what ctx-tuner does not model stays in, for :func:`tuner.question.vllm_args.from_settings` to name."""
    s = dict(case.get("settings") or {})
    values = {k: v for k, v in s.items() if k not in ("rope_scaling", "hf_overrides", "speculative_config")}
    values.update(dtype=_DTYPES.get(str(case.get("dtype") or "auto").lower(), "auto"),
                  kv_cache_dtype=case.get("kv_cache_dtype") or "auto", quantization=case.get("quantization"),
                  tensor_parallel_size=int(case.get("tensor_parallel_size") or 1),
                  pipeline_parallel_size=int(case.get("pipeline_parallel_size") or 1),
                  speculative_config=_speculative(s.get("speculative_config")), hf_overrides=_hf_overrides(s))
    return values


def case_drop(case: dict, models_dir: str | Path):
    """The case's settings through the one mapping (:mod:`tuner.question.vllm_args`): the
    :class:`~tuner.question.vllm_args.MappedArgs` whose drop asks what the case ran (one candidate: its
    ``gpu_memory_utilization`` — the release's default when not stated — and its
    ``max_model_len`` or the derived one), with what ctx-tuner does not model named.

    Raises:
        TunerError / DeviceError / ArgsInputError: missing model config, unknown GPU without a
            stated total, a setting the drop schema refuses.
    """
    from tuner.question.vllm_args import NotModelled, drop_name, from_settings, to_drop

    version, _engine = infer_version(case, models_dir)
    config_path = config_path_for(case, models_dir)
    values = case_arguments(case)
    source = f"case {case['id']}"
    sa = from_settings(values, model=str(case["model"]), source=source)
    raw_spec = (case.get("settings") or {}).get("speculative_config")
    extra = [NotModelled("--speculative-config", raw_spec, "no method: the drop's speculative_config needs one",
                         source)] if raw_spec and values["speculative_config"] is None else []
    from tuner.question.protocol import point_of

    max_model_len = point_of(sa.values).max_model_len or derived_max_model_len(config_path, values["hf_overrides"])
    device = _device(case)
    # a drop states per-stage cards as a device list (the request carries the resolved ``stages``)
    return to_drop(sa, device=device.get("stages") or device, engine_version=version, allow_unmodelled=True,
                   name=drop_name(str(case["id"]), "case"), model=str(config_path.parent), max_model_len=max_model_len,
                   label=source, extra_not_modelled=extra)


def case_request(case: dict, models_dir: str | Path, *, calibration: dict | None = None) -> dict:
    """The job request (:func:`tuner.jobs.job.run_job`) that reproduces one case: the drop of
    :func:`case_drop` (its release, engine, device total, dtype, KV dtype, quantization, TP/PP and
    settings, one candidate), no search; ``not_modelled``: the case's arguments ctx-tuner does not
    model (:class:`tuner.question.vllm_args.NotModelled` as dicts).

    Raises:
        TunerError / DeviceError: missing model config, unknown GPU without a stated total.
    """
    version, engine = infer_version(case, models_dir)
    config_path = config_path_for(case, models_dir)
    mapped = case_drop(case, models_dir)
    drop = mapped.drop
    # what the case's lines and notes say beyond its settings: the FlashInfer package (the sampler
    # path before 0.17) and a --config-format given on its command line
    texts = list(case.get("raw_lines") or []) + [case.get("notes"), case.get("source_context")]
    installed = logparse.flashinfer_installed(texts)
    triton = logparse.triton_kernels_installed(texts)  # MXFP4 on Hopper before 0.12
    fmt = (case.get("settings") or {}).get("config_format") or case_config_format(case)
    entry = case_entry_point(case)
    if installed is not None or triton is not None or fmt != "auto" or entry != drop.entry_point:
        import dataclasses

        drop = dataclasses.replace(drop, flashinfer_installed=installed, config_format=fmt,
                                   triton_kernels_installed=triton, entry_point=entry)
    from tuner.question.protocol import JobRequest

    draft_path = draft_error = None
    spec = drop.speculative_config or {}
    if spec.get("model"):  # a drafter checkpoint: its config beside the target's in the models directory
        draft = Path(models_dir) / _model_dir_name(str(spec["model"])) / "config.json"
        if draft.is_file():
            draft_path = str(draft)
        else:
            draft_error = f"no config.json at {draft}"
    import os

    # the engine adapter costs seconds per case: validate leaves it off unless CTX_TUNER_ENGINE says so
    return JobRequest(drop=drop, config_path=str(config_path), device=_device(case), fake=True, search=False,
                      engine=os.environ.get("CTX_TUNER_ENGINE") or "off", engine_kind=engine,
                      calibration=dict(calibration) if calibration else None,
                      draft_config_path=draft_path, draft_config_error=draft_error,
                      unmodelled=tuple(unmodelled_inputs(case, mapped)),
                      device_total_stated=bool(case.get("gpu_total_gib"))).to_wire()


def _pct(pred: float | None, obs: float | None) -> float | None:
    if pred is None or obs is None or obs == 0:
        return None
    return round((pred - obs) / abs(obs) * 100.0, 3)


def compare(case: dict, result: dict, *, version: str | None = None) -> dict:
    """One report row: the case's observation beside the job's single candidate.

    ``error_pct`` is measured on ``num_gpu_blocks`` when the log printed them, else on the KV
    cache GiB, else on the KV tokens. ``unsafe``: the prediction promises more KV than the engine
    had by more than one block (tokens when the log printed them, else bytes, allowing the
    ±0.005 GiB rounding of the printed GiB). With pipeline stages, the KV GiB compared is the
    stage whose figure the release prints (:func:`tuner.memory.kvcache.logged_kv_stage`, ``version`` the
    case's release; the case's own ``vllm_version`` when not given), else the limiting stage's.
    """
    o = case.get("observed") or {}
    c = _logged_stage_candidate(result["candidates"][0], version or case.get("vllm_version"),
                                refused=bool(o.get("error_message")),
                                printed_stage=printed_kv_stage(case.get("raw_lines") or [], o.get("kv_cache_gib")))
    pred_blocks, pred_tokens = c["num_gpu_blocks"], c["kv_cache_tokens"]
    pred_kv = c["available_kv_cache_bytes"]
    block = int(result.get("block_size") or 16)
    obs_blocks, obs_tokens, obs_gib = o.get("num_gpu_blocks"), o.get("kv_cache_tokens"), o.get("kv_cache_gib")
    if obs_blocks:
        err, basis = _pct(pred_blocks, obs_blocks), "num_gpu_blocks"
    elif obs_gib:
        err, basis = _pct(pred_kv / GiB, obs_gib), "kv_cache_gib"
    elif obs_tokens:
        err, basis = _pct(pred_tokens, obs_tokens), "kv_cache_tokens"
    else:
        err, basis = None, None
    if obs_tokens:
        unsafe = pred_tokens - obs_tokens > block
    elif obs_gib is not None and pred_tokens:
        per_token = pred_kv / pred_tokens
        unsafe = pred_kv - obs_gib * GiB > max(block * per_token, 0.005 * GiB)
    else:
        unsafe = False
    observed_failed = bool(o.get("error_message")) or (obs_gib is not None and obs_gib < 0)
    interval = _interval_row(c, basis, obs_blocks, obs_gib, obs_tokens, block)
    bound = _needed_bound(o) if basis is None else None
    if bound is not None:  # vLLM refused at its KV pre-check and the available figure was not kept
        basis, unsafe = "kv_cache_needed_bound", bool(c["fits"])
        interval.update(_bound_interval(c, bound))
    unc = result.get("uncertainty") or {}
    return {**interval,
            "uncertain_inputs": [{k: u.get(k) for k in ("name", "value", "where", "effect", "note")}
                             for u in unc.get("unmodelled") or []],
        "id": case["id"],
        "status": "ok",
        "model": case["model"],
        "model_family": case.get("model_family"),
        "confidence": case.get("confidence") or "high",
        "plugin": result.get("plugin"),
        "era": result.get("era"),
        "predicted_num_gpu_blocks": pred_blocks,
        "observed_num_gpu_blocks": obs_blocks,
        "predicted_kv_cache_gib": round(pred_kv / GiB, 4),
        "observed_kv_cache_gib": obs_gib,
        # vLLM refused at its pre-check and kept only what one request needed: its KV was below this
        "observed_kv_cache_below_gib": bound,
        "predicted_kv_cache_tokens": pred_tokens,
        "observed_kv_cache_tokens": obs_tokens,
        "predicted_weights_gib": round(c["weights_bytes"] / GiB, 4),
        "observed_weights_gib": o.get("weights_gib"),
        # the modelled peak; the calibrated reserve for unexplained memory is reported apart
        "predicted_activation_peak_gib": round((c["activation_peak_bytes"] - c.get("reserve_bytes", 0)) / GiB, 4),
        "predicted_reserve_gib": round(c.get("reserve_bytes", 0) / GiB, 4),
        "observed_activation_peak_gib": o.get("activation_peak_gib"),
        "predicted_non_torch_gib": round(c["non_torch_bytes"] / GiB, 4),
        "predicted_cuda_graph_gib": round(c["cuda_graph_bytes"] / GiB, 4),
        "predicted_fits": bool(c["fits"]),
        "observed_fits": not observed_failed,
        "predicted_reason": c["reason"],
        "error_basis": basis,
        "error_pct": err,
        "unsafe": bool(unsafe),
        "warnings": result.get("warnings") or [],
        "assumptions": result.get("assumptions") or [],
    }


_PP_WORKER = re.compile(r"^\s*\([^)]*Worker[^)]*?_PP(\d+)\b")
_AVAILABLE_KV = re.compile(r"Available KV cache memory:\s*(-?\d+(?:\.\d+)?)\s*GiB")


def printed_kv_stage(lines: list, kv_cache_gib: float | None) -> int | None:
    """The pipeline stage a case's "Available KV cache memory" line names through its worker label
    (vllm/v1/executor/multiproc_executor.py / ray_utils.py name PP workers ``Worker_PP{k}`` or
    ``Worker_TP{t}_PP{k}``), for the line that printed the case's ``kv_cache_gib``; None otherwise."""
    if kv_cache_gib is None:
        return None
    for line in lines:
        if not isinstance(line, str):
            continue
        m, v = _PP_WORKER.match(line), _AVAILABLE_KV.search(line)
        if m and v and abs(float(v.group(1)) - float(kv_cache_gib)) < 0.006:
            return int(m.group(1))
    return None


def _logged_stage_candidate(c: dict, version: str | None, *, refused: bool, printed_stage: int | None = None) -> dict:
    """The candidate with its KV bytes (and interval ends) those of the pipeline stage whose figure
    the log prints: the stage its worker label names (``printed_stage``), else the release's rule
    (:func:`tuner.memory.kvcache.logged_kv_stage`); unchanged with one stage, an unknown release, or a
    release that does not say which stage prints."""
    stages = c.get("stages") or []
    if len(stages) < 2:
        return c
    from tuner.memory import kvcache

    i = printed_stage if printed_stage is not None and 0 <= printed_stage < len(stages) else None
    if i is None and version:
        try:
            i = kvcache.logged_kv_stage(version, [int(s["available_kv_cache_bytes"]) for s in stages],
                                        refused=refused)
        except TunerError:
            return c
    if i is None or i == c.get("limiting_stage"):
        return c
    st = stages[i]
    return {**c, **{k: st[k] for k in ("available_kv_cache_bytes", "available_kv_cache_bytes_low",
                                       "available_kv_cache_bytes_high") if st.get(k) is not None}}


#: vLLM's KV pre-check refusal (vllm/v1/core/kv_cache_utils.py ``check_enough_kv_cache_memory``,
#: 0.7 – 0.34): "... X GiB KV cache is needed, which is larger than the available KV cache memory"
#: (matched up to "is needed": stored excerpts may cut the rest).
KV_NEEDED_REFUSAL = "KV cache is needed"


def _needed_bound(observed: dict) -> float | None:
    """The GiB vLLM said one request needed where it refused at its KV pre-check and the case kept
    no available figure: the engine's available KV was below it (an upper bound, not a value)."""
    needed = observed.get("kv_cache_needed_gib")
    if needed is None or observed.get("kv_cache_gib") is not None:
        return None
    if KV_NEEDED_REFUSAL not in str(observed.get("error_message") or "").replace("\n", " "):
        return None
    return float(needed)


def _bound_interval(c: dict, needed_gib: float) -> dict:
    """The interval's verdicts against an upper bound on the engine's KV (GiB): covered where the safe
    end lies below it; unsafe at the safe end where the safe end promises at least what vLLM said one
    request needed (by more than the printed GiB's rounding) — vLLM had less."""
    lo_kv = c.get("available_kv_cache_bytes_low")
    if lo_kv is None:
        return {}
    lo = lo_kv / GiB
    return {"covered": lo < needed_gib + 0.005, "unsafe_at_safe_end": lo > needed_gib + 0.005}


def _interval_row(c: dict, basis: str | None, obs_blocks, obs_gib, obs_tokens, block: int) -> dict:
    """A row's interval (:mod:`tuner.memory.uncertainty`): the predicted blocks, KV GiB and KV tokens at
    the low (safe) and high ends; whether the observation lies inside (``covered``, on the error's
    basis, allowing one block or the printed GiB's ±0.005 rounding); ``unsafe_at_safe_end``: the
    safe end above the observation by more than 1 %; the half-width in % of the expected value;
    and ``band_basis`` — the bytes each fitted band scales (:func:`tuner.accuracy.uncertainty_fit.fit_bands`)."""
    lo_kv, hi_kv = c.get("available_kv_cache_bytes_low"), c.get("available_kv_cache_bytes_high")
    out: dict = {
        "predicted_num_gpu_blocks_low": c.get("num_gpu_blocks_low"),
        "predicted_num_gpu_blocks_high": c.get("num_gpu_blocks_high"),
        "predicted_kv_cache_gib_low": None if lo_kv is None else round(lo_kv / GiB, 4),
        "predicted_kv_cache_gib_high": None if hi_kv is None else round(hi_kv / GiB, 4),
        "predicted_kv_cache_tokens_low": c.get("kv_cache_tokens_low"),
        "predicted_kv_cache_tokens_high": c.get("kv_cache_tokens_high"),
    }
    pred = {"num_gpu_blocks": c["num_gpu_blocks"], "kv_cache_gib": c["available_kv_cache_bytes"] / GiB,
            "kv_cache_tokens": c["kv_cache_tokens"]}
    lows = {"num_gpu_blocks": c.get("num_gpu_blocks_low"),
            "kv_cache_gib": None if lo_kv is None else lo_kv / GiB, "kv_cache_tokens": c.get("kv_cache_tokens_low")}
    highs = {"num_gpu_blocks": c.get("num_gpu_blocks_high"),
             "kv_cache_gib": None if hi_kv is None else hi_kv / GiB, "kv_cache_tokens": c.get("kv_cache_tokens_high")}
    obs = {"num_gpu_blocks": obs_blocks, "kv_cache_gib": obs_gib, "kv_cache_tokens": obs_tokens}.get(basis or "")
    lo, hi, p = lows.get(basis or ""), highs.get(basis or ""), pred.get(basis or "")
    covered = unsafe_low = half = None
    if obs is not None and lo is not None and hi is not None:
        tol = {"num_gpu_blocks": 1, "kv_cache_gib": 0.005, "kv_cache_tokens": block}[basis]
        covered = lo - tol <= obs <= hi + tol
        unsafe_low = lo - obs > max(tol, 0.01 * abs(obs))
        half = round((hi - lo) / 2 / abs(p) * 100, 3) if p else None
    kv = int(c["available_kv_cache_bytes"])
    fixed, fixed_high, basis_bytes, basis_high = _band_basis(c.get("bands") or [])
    per = {"num_gpu_blocks": kv / c["num_gpu_blocks"] if c["num_gpu_blocks"] else None, "kv_cache_gib": GiB,
           "kv_cache_tokens": kv / c["kv_cache_tokens"] if c["kv_cache_tokens"] else None}.get(basis or "")
    out.update(covered=covered, unsafe_at_safe_end=unsafe_low, half_width_pct=half,
               band_basis={"expected_kv_bytes": kv, "observed_kv_bytes": None if obs is None or per is None
                           else int(obs * per), "bytes_per_unit": per, "tolerance_units":
                           {"num_gpu_blocks": 1, "kv_cache_gib": 0.005, "kv_cache_tokens": block}.get(basis or ""),
                           "fixed_half_bytes": int(fixed), "bytes": basis_bytes,
                           "fixed_high_bytes": int(fixed_high), "bytes_high": basis_high})
    return out


def _band_basis(bands: list) -> tuple[int, int, dict, dict]:
    """What the fit needs of a row's bands, per side of the KV (:func:`tuner.memory.uncertainty.band_sides`):
    the part of the low (safe) side that is no fitted fraction (floors, unfitted bands such as an
    assumption's computed alternative), the same of the high side, and the bytes each fitted band
    scales on the side it reaches (a one-sided band — a cold compile cache, an assumption's fraction
    beside its computed alternative — on that side alone)."""
    from tuner.memory.uncertainty import band_sides, fitted

    now = fitted()
    fixed = fixed_high = 0
    low: dict[str, int] = {}
    high: dict[str, int] = {}
    for b in bands:
        down, up = band_sides(b)
        p, basis = b.get("parameter"), int(b.get("basis_bytes") or 0)
        part = int(now[p] * basis) if p else 0
        if p and down:
            low[p] = low.get(p, 0) + basis
        if p and up:
            high[p] = high.get(p, 0) + basis
        fixed += down - (part if down else 0)
        fixed_high += up - (part if up else 0)
    return fixed, fixed_high, low, high


def predict_cases(cases: list[dict], models_dir: str | Path, *, calibrations: dict | None = None,
                  run: Callable[[dict], dict] | None = None) -> list[dict]:
    """Predict every case (worker side: ``run`` defaults to :func:`tuner.jobs.job.run_job`).

    Args:
        calibrations: optional ``{case id: calibration dict}`` (see :mod:`tuner.jobs.calibrate`).
    Returns:
        One row per case, in order; a case that cannot run gets ``status: "error"`` and the
        reason instead of numbers (it never stops the others).
    """
    if run is None:
        from tuner.jobs.job import run_job as run
    rows = []
    for case in cases:
        try:
            req = case_request(case, models_dir, calibration=(calibrations or {}).get(case["id"]))
            row = compare(case, run(req), version=infer_version(case, models_dir)[0])
            row["not_modelled"] = case_drop(case, models_dir).not_modelled_dicts()
        except TunerError as exc:
            row = _error_row(case, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # one broken case never hides the others
            row = _error_row(case, f"{type(exc).__name__}: {exc}")
        row.update(_release_fields(case, models_dir))
        rows.append(row)
    return rows


def _error_row(case: dict, reason: str) -> dict:
    o = case.get("observed") or {}
    return {"id": case.get("id"), "status": "error", "model": case.get("model"),
            "confidence": case.get("confidence") or "high", "reason": reason,
            "predicted_num_gpu_blocks": None, "observed_num_gpu_blocks": o.get("num_gpu_blocks"),
            "predicted_kv_cache_gib": None, "observed_kv_cache_gib": o.get("kv_cache_gib"),
            "predicted_kv_cache_tokens": None, "observed_kv_cache_tokens": o.get("kv_cache_tokens"),
            "error_pct": None, "unsafe": False}


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0–100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[k - 1]


def summarize(rows: list[dict]) -> dict:
    """Number of cases, median and p90 absolute % error (nearest rank), unsafe count, fit/fail
    agreement, and the cases that could not run with their reason."""
    ok = [r for r in rows if r["status"] == "ok"]
    errs = [abs(r["error_pct"]) for r in ok if r["error_pct"] is not None]
    return {
        "cases": len(rows),
        "predicted": len(ok),
        "with_error_pct": len(errs),
        "median_abs_error_pct": round(statistics.median(errs), 3) if errs else None,
        "p90_abs_error_pct": round(_percentile(errs, 90), 3) if errs else None,
        "max_abs_error_pct": round(max(errs), 3) if errs else None,
        "unsafe": sum(1 for r in ok if r["unsafe"]),
        "unsafe_cases": [r["id"] for r in ok if r["unsafe"]],
        "fit_verdict_agrees": sum(1 for r in ok if r["predicted_fits"] == r["observed_fits"]),
        "could_not_run": [{"id": r["id"], "reason": r["reason"]} for r in rows if r["status"] != "ok"],
        "interval": interval_summary(ok),
        "interval_high_confidence": interval_summary([r for r in ok if r.get("confidence", "high") != "low"]),
        "release_assumed": [{"id": r["id"], "release": r.get("release"), "release_range": r.get("release_range")}
                            for r in rows if r.get("release_assumed")],
    }


def interval_summary(rows: list[dict]) -> dict:
    """The interval's figures over predicted rows (:func:`_interval_row`): ``coverage_pct`` (the
    observation inside the interval), ``median_half_width_pct`` (of the expected value),
    ``unsafe_at_safe_end`` (the safe end above the observation by more than 1 %, with the case
    ids), and the expected value's median / p90 |error| over the same rows."""
    judged = [r for r in rows if r.get("covered") is not None]
    halves = [r["half_width_pct"] for r in judged if r.get("half_width_pct") is not None]
    errs = [abs(r["error_pct"]) for r in rows if r.get("error_pct") is not None]
    unsafe = [r["id"] for r in judged if r.get("unsafe_at_safe_end")]
    return {
        "cases": len(rows),
        "judged": len(judged),
        "coverage_pct": round(100.0 * sum(1 for r in judged if r["covered"]) / len(judged), 2) if judged else None,
        "not_covered": [r["id"] for r in judged if not r["covered"]],
        "median_half_width_pct": round(statistics.median(halves), 3) if halves else None,
        "unsafe_at_safe_end": len(unsafe),
        "unsafe_at_safe_end_pct": round(100.0 * len(unsafe) / len(judged), 2) if judged else None,
        "unsafe_at_safe_end_cases": unsafe,
        "median_abs_error_pct": round(statistics.median(errs), 3) if errs else None,
        "p90_abs_error_pct": round(_percentile(errs, 90), 3) if errs else None,
    }


def render(report: dict) -> str:
    """The human-readable table of a report (``{"cases": rows, "summary": {...}}``)."""
    def f(v, spec=""):
        return "-" if v is None else format(v, spec)

    lines = [f"{'case':<52} {'pred blocks':>11} {'obs blocks':>10} {'pred KV':>8} {'obs KV':>7} "
             f"{'W pred/obs':>13} {'act':>5} {'err %':>7} {'fits':>9}  note"]
    lines.append("-" * len(lines[0]))
    for r in report["cases"]:
        if r["status"] != "ok":
            lines.append(f"{r['id'][:52]:<52} {'':>11} {'':>10} {'':>8} {'':>7} {'':>13} {'':>5} {'':>7} {'':>9}  "
                         f"could not run: {r['reason']}")
            continue
        w = f"{f(r['predicted_weights_gib'], '.2f')}/{f(r['observed_weights_gib'], '.2f')}"
        fits = f"{'yes' if r['predicted_fits'] else 'NO'}/{'yes' if r['observed_fits'] else 'NO'}"
        note = "UNSAFE" if r["unsafe"] else ""
        below = r.get("observed_kv_cache_below_gib")
        obs_kv = f"<{below:.2f}" if below is not None else f(r["observed_kv_cache_gib"], ".2f")
        if below is not None:
            note = (note + " " if note else "") + f"vLLM refused: needed {below:.2f} GiB, had less"
        lines.append(f"{r['id'][:52]:<52} {f(r['predicted_num_gpu_blocks']):>11} {f(r['observed_num_gpu_blocks']):>10} "
                     f"{f(r['predicted_kv_cache_gib'], '.2f'):>8} {obs_kv:>7} {w:>13} "
                     f"{f(r['predicted_activation_peak_gib'], '.2f'):>5} {f(r['error_pct'], '+.2f'):>7} {fits:>9}  {note}")
    s = report["summary"]
    lines += ["", f"cases {s['cases']}, predicted {s['predicted']}, median |error| {f(s['median_abs_error_pct'], '.2f')} %, "
              f"p90 {f(s['p90_abs_error_pct'], '.2f')} %, max {f(s['max_abs_error_pct'], '.2f')} %, unsafe {s['unsafe']}, "
              f"fit verdict agrees on {s['fit_verdict_agrees']}/{s['predicted']}"]
    for key, label in (("interval", "all"), ("interval_high_confidence", "high confidence")):
        iv = s.get(key)
        if iv and iv.get("judged"):
            lines.append(f"interval ({label}, {iv['judged']} cases): coverage {f(iv['coverage_pct'], '.1f')} %, median "
                         f"half-width {f(iv['median_half_width_pct'], '.2f')} %, unsafe at the safe end "
                         f"{iv['unsafe_at_safe_end']} ({f(iv['unsafe_at_safe_end_pct'], '.1f')} %) (docs/uncertainty.md)")
    if "summary_calibrated" in report:  # validate --calibrate: before/after per case and a second summary
        c = report["summary_calibrated"]
        lines += ["", f"{'calibrated (leave-one-out)':<52} {'pred blocks':>11} {'cal blocks':>10} {'err %':>7} "
                      f"{'cal err %':>9}  note"]
        for r in report["cases"]:
            if r["status"] != "ok" or r.get("calibration") is None:
                continue
            note = "UNSAFE" if r.get("calibrated_unsafe") else ""
            lines.append(f"{r['id'][:52]:<52} {f(r['predicted_num_gpu_blocks']):>11} "
                         f"{f(r.get('calibrated_predicted_num_gpu_blocks')):>10} {f(r['error_pct'], '+.2f'):>7} "
                         f"{f(r.get('calibrated_error_pct'), '+.2f'):>9}  {note}")
        lines += [f"calibrated: median |error| {f(c['median_abs_error_pct'], '.2f')} %, p90 "
                  f"{f(c['p90_abs_error_pct'], '.2f')} %, max {f(c['max_abs_error_pct'], '.2f')} %, unsafe {c['unsafe']}; "
                  f"{len(report.get('calibration_better') or [])} better, {len(report.get('calibration_worse') or [])} worse"]
    for c in s["could_not_run"]:
        lines.append(f"could not run: {c['id']}: {c['reason']}")
    for r in report["cases"]:  # the case's arguments ctx-tuner does not model (tuner.question.vllm_args): named, not dropped
        if r.get("not_modelled"):
            lines.append(f"not modelled: {r['id']}: " + ", ".join(
                f"{n['argument']} {n['value']!r}" if not isinstance(n["value"], (dict, list)) else n["argument"]
                for n in r["not_modelled"]))
    for c in s.get("release_assumed") or []:
        rng = c["release_range"]
        span = "-" if not rng else rng[0] if rng[0] == rng[1] else f"{rng[0]} – {rng[1]}"
        lines.append(f"release assumed: {c['id']}: vLLM {c['release']} (no vllm_version; consistent: {span})")
    return "\n".join(lines)


#: Row fields repeated with a ``calibrated_`` prefix by ``validate --calibrate``.
CALIBRATED_FIELDS = ("predicted_num_gpu_blocks", "predicted_kv_cache_gib", "predicted_kv_cache_tokens",
                     "predicted_activation_peak_gib", "predicted_non_torch_gib", "predicted_cuda_graph_gib",
                     "predicted_fits", "error_pct", "unsafe")


def run_validate_request(request) -> dict:
    """Worker entry: a :class:`tuner.question.protocol.ValidateRequest` (or its wire object ``{"kind":
    "validate", "cases": [...], "models_dir": str, "calibrations"?, "calibrate"?}``) →
    ``{"cases": rows, "summary": {...}}``.

    With ``"calibrate": true`` every case is also predicted after calibrating it leave-one-out
    from the *other* cases' logs of its group (:func:`leave_one_out`): each row
    gains ``calibrated_<field>`` for :data:`CALIBRATED_FIELDS` and ``calibration`` (the corrections,
    bytes, or None when the case could not be calibrated — its calibrated fields then equal the
    uncalibrated ones), and the report gains ``summary_calibrated``, ``calibration_worse`` and
    ``calibration_better`` (case ids)."""
    from tuner.question.protocol import ValidateRequest

    if not isinstance(request, ValidateRequest):
        request = ValidateRequest.from_wire({"kind": "validate", **request}, required=False)
    cases = list(request.cases)
    if request.calibrate:
        loo = leave_one_out(cases, request.models_dir, predict_all=True)
        rows = []
        for b, a in zip(loo["before"], loo["after"]):
            row = dict(b)
            if b["status"] == "ok" and a["status"] == "ok":
                row.update({f"calibrated_{k}": a.get(k) for k in CALIBRATED_FIELDS})
            row["calibration"] = loo["calibrations"].get(b["id"])
            rows.append(row)
        return {"cases": rows, "summary": summarize(rows), "summary_calibrated": loo["summary_after"],
                "calibration_worse": loo["worse"], "calibration_better": loo["better"]}
    rows = predict_cases(cases, request.models_dir, calibrations=request.calibrations)
    return {"cases": rows, "summary": summarize(rows)}


def select(cases: list[dict], pattern: str | None) -> list[dict]:
    """Cases whose id or model matches the regular expression ``pattern`` (all when None)."""
    if not pattern:
        return cases
    rx = re.compile(pattern)
    return [c for c in cases if rx.search(str(c.get("id"))) or rx.search(str(c.get("model")))]


def _main() -> None:  # pragma: no cover - developer convenience: python -m tuner.accuracy.validate CASES DIR
    import sys

    cases = select(load_cases(sys.argv[1]), sys.argv[3] if len(sys.argv) > 3 else None)
    print(render(run_validate_request({"cases": cases, "models_dir": sys.argv[2]})))


if __name__ == "__main__":  # pragma: no cover
    _main()


# ---------------------------------------------------------------------------------------------
# Leave-one-out over a case file (worker side: runs the simulate job)
# ---------------------------------------------------------------------------------------------


def measured_from_case(case: dict, models_dir) -> dict:
    """The ``profile_runs`` row ``ctx-tuner import-log`` stores for a case's ``raw_lines``, with the
    case's settings as the command-line options (no database), plus ``quantization`` and
    ``total_known`` (the log printed the device total) for grouping and :func:`residual`.

    Raises:
        LogParseError: the raw lines carry no memory figure; DropError / ModelConfigError as
            :func:`tuner.accuracy.importlog.resolve_settings`.
    """
    import hashlib
    import json

    from tuner.errors import LogParseError
    from tuner.accuracy.importlog import config_path_for, read_config, resolve_settings, run_row
    from tuner.logs.logparse import parse_lines

    parsed = parse_lines(case.get("raw_lines") or [], source=f"case:{case['id']}")
    if not parsed.has_memory_lines:
        raise LogParseError("no vLLM memory lines", where=f"case {case['id']}")
    version, engine = infer_version(case, models_dir)
    s = case.get("settings") or {}
    dtype = _DTYPES.get(str(case.get("dtype") or "auto").lower(), "auto")
    from tuner.question.protocol import point_of

    options = {**point_of(s)._asdict(),
               "tensor_parallel_size": case.get("tensor_parallel_size") or 1,
               "pipeline_parallel_size": case.get("pipeline_parallel_size") or 1, "dtype": dtype,
               "kv_cache_dtype": case.get("kv_cache_dtype") or "auto", "quantization": case.get("quantization"),
               "max_num_seqs": s.get("max_num_seqs"), "max_num_batched_tokens": s.get("max_num_batched_tokens"),
               "block_size": s.get("block_size"), "enable_chunked_prefill": s.get("enable_chunked_prefill"),
               "enforce_eager": bool(s.get("enforce_eager"))}
    # the card as a prediction resolves the record (:func:`_device`; a gpu list's first stage)
    from tuner.memory.devices import lookup

    card = _device(case)
    known = lookup(str(card["name"]), total_memory_bytes=int(card["total_memory_bytes"]))
    device: Any = {"name": known.name if known else str(card["name"]),
                   "total_memory_bytes": int(card["total_memory_bytes"])}
    cfg_path = config_path_for(str(case["model"]), models_dir=models_dir)
    config, sha = read_config(cfg_path)
    drop, extra = resolve_settings(parsed, model=str(case["model"]), device=device, engine_version=version,
                                   engine=engine, options=options, config=config, source=f"case-{case['id']}")
    log_sha = hashlib.sha256(json.dumps(case.get("raw_lines")).encode()).hexdigest()
    row = run_row(parsed, drop, extra, config=config, config_sha256=sha, log_sha256=log_sha)
    return {**row, "quantization": drop.quantization, "total_known": parsed.total_memory_bytes is not None}


def leave_one_out(cases: list[dict], models_dir, *, run: Callable[[dict], dict] | None = None,
                  predict_all: bool = True) -> dict:
    """Validate every case before and after calibration, calibrating each case only from the
    *other* cases' imported observations of its group (:func:`group_key`).

    Args:
        run: the job runner (default :func:`tuner.jobs.job.run_job`, in this process).
        predict_all: also predict the cases alone in their group (they cannot be calibrated, so
            their rows are the same before and after); False skips them (their rows are absent).

    Returns:
        ``{"before": rows, "after": rows, "calibrations": {case id: corrections}, "worse": [ids],
        "better": [ids], "summary_before": …, "summary_after": …}`` with rows as
        :func:`tuner.compare` makes them (``after`` re-runs only the calibrated cases).
    """
    from tuner.jobs.calibrate import fit, group_key

    if run is None:
        from tuner.jobs.job import run_job as run
    measured: dict[str, dict] = {}
    for c in cases:
        try:
            measured[c["id"]] = measured_from_case(c, models_dir)
        except Exception:  # noqa: BLE001 - a case without a usable log calibrates nothing
            pass
    groups: dict[tuple, list[str]] = {}
    for cid, m in measured.items():
        groups.setdefault(group_key(m, m["quantization"]), []).append(cid)
    grouped = {cid for members in groups.values() if len(members) > 1 for cid in members}
    selected = [c for c in cases if predict_all or c["id"] in grouped]
    results: dict[str, dict] = {}
    for c in selected:
        try:
            results[c["id"]] = run(case_request(c, models_dir))
        except Exception:  # noqa: BLE001 - reported as "could not run" below
            pass
    calibrations: dict[str, dict] = {}
    for cid, m in measured.items():
        others = [o for o in groups[group_key(m, m["quantization"])] if o != cid and o in results]
        if not others or cid not in results:
            continue
        cal = fit([measured[o] for o in others], [results[o]["candidates"][0] for o in others],
                  total_known=[measured[o]["total_known"] for o in others])
        if any(cal.values()):
            calibrations[cid] = cal
    before = [{**compare(c, results[c["id"]], version=infer_version(c, models_dir)[0]),
               **_release_fields(c, models_dir)} if c["id"] in results else
              predict_cases([c], models_dir, run=run)[0] for c in selected]
    after = []
    for c, b in zip(selected, before):
        if c["id"] in calibrations and b["status"] == "ok":
            after.append(predict_cases([c], models_dir, calibrations=calibrations, run=run)[0])
        else:
            after.append(b)
    worse, better = [], []
    for b, a in zip(before, after):
        if b.get("error_pct") is None or a.get("error_pct") is None:
            continue
        if abs(a["error_pct"]) > abs(b["error_pct"]) + 1e-9:
            worse.append(b["id"])
        elif abs(a["error_pct"]) < abs(b["error_pct"]) - 1e-9:
            better.append(b["id"])
    return {"before": before, "after": after, "calibrations": calibrations, "worse": worse, "better": better,
            "summary_before": summarize(before), "summary_after": summarize(after)}

"""One profile job, worker side: model spec → plugin → profile passes → candidates → proposals.

Runs inside the worker subprocess (imports torch through the plugin and the simulator). Input
and output are the contract of :mod:`tuner.question.protocol` (a :class:`~tuner.question.protocol.JobRequest`, a
:class:`~tuner.question.protocol.JobResult`'s wire object) so the parent never needs torch. Passes are
memoized per (max_num_batched_tokens, num_reqs, stage): under V1 one pass serves every candidate.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from pathlib import Path
import sys
import time
from typing import TYPE_CHECKING, Any, Sequence

from tuner import __version__
from tuner.question.drop import Drop
from tuner.errors import DropError, EraError
from tuner.memory.budget import persistent_bytes, profile_overhead_bytes
from tuner.memory.eras import GiB, config_is_moe, era_for, profile_batch, resolve_dtype, uses_model_runner_v2
from tuner.memory.eras import mm_prefix_lm_item_tokens, release_warning, v0_uses_sliding_window
from tuner.memory.engine_checks import (VLLM_019_DEPRECATED, check_batch, check_draft_tensor_parallel_size, check_parallel_layout,
                                 check_architecture, check_quantization)
from tuner.model.modelspec import defaults_applied, load_model_spec, read_architectures, read_top, without_nulls
from tuner.memory.kvcache import with_kv_quant_mode
from tuner.model.plugin import RankSettings, load_registry
from tuner.memory.kvcache import dtype_bytes_for as _kv_dtype_bytes
from tuner.question.protocol import point_of
from tuner.memory.search import V0_CHUNKED_PREFILL_THRESHOLD, Layout, derived_max_model_len, evaluate, propose, search_regions

if TYPE_CHECKING:
    from tuner.question.protocol import JobRequest

# V0_CHUNKED_PREFILL_THRESHOLD (tuner.memory.search) stays importable from here.


def _typed(drop: Any) -> Drop:
    """A :class:`Drop` for a drop given as one or as its wire mapping (older callers)."""
    if isinstance(drop, Drop):
        return drop
    from tuner.question.protocol import drop_from_wire

    return drop_from_wire(drop, strict=False)


def _extra_args(drop: Drop | dict) -> str:
    """The ``vllm serve`` arguments besides ``--max-model-len`` / ``--gpu-memory-utilization``
    that reproduce the drop's settings."""
    d = _typed(drop)
    parts = []
    for flag, value in (("--tensor-parallel-size", d.tensor_parallel_size),
                        ("--pipeline-parallel-size", d.pipeline_parallel_size)):
        if value != 1:
            parts.append(f"{flag} {value}")
    if d.kv_cache_dtype != "auto":
        parts.append(f"--kv-cache-dtype {d.kv_cache_dtype}")
    if d.dtype != "auto":
        parts.append(f"--dtype {d.dtype}")
    if d.quantization:
        parts.append(f"--quantization {d.quantization}")
        version = _version_tuple(d.engine_version)
        if version and (0, 19, 0) <= version < (0, 20, 0) and d.quantization in VLLM_019_DEPRECATED:
            parts.append("--allow-deprecated-quantization")
    for key in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory_bytes"):
        if getattr(d, key) is not None:
            parts.append(f"--{key.replace('_', '-')} {getattr(d, key)}")
    if d.enable_chunked_prefill is not None:
        parts.append("--enable-chunked-prefill" if d.enable_chunked_prefill else "--no-enable-chunked-prefill")
    if d.enable_prefix_caching is not None:
        parts.append("--enable-prefix-caching" if d.enable_prefix_caching else "--no-enable-prefix-caching")
    if d.speculative_config:
        import json

        parts.append(f"--speculative-config '{json.dumps(d.speculative_config, sort_keys=True)}'")
    if d.hf_overrides:
        import json

        parts.append(f"--hf-overrides '{json.dumps(d.hf_overrides, sort_keys=True)}'")
    if int(d.data_parallel_size or 1) > 1:
        parts.append(f"--data-parallel-size {d.data_parallel_size}")
    if d.enable_expert_parallel:
        parts.append("--enable-expert-parallel")
    if d.disable_custom_all_reduce:
        parts.append("--disable-custom-all-reduce")
    if d.enforce_eager:
        parts.append("--enforce-eager")
    return " ".join(parts)


def model_max_len(spec: Any) -> tuple[int, str]:
    """vLLM's derived ``max_model_len`` of the model and the config key it comes from
    (:func:`tuner.memory.search.derived_max_model_len` over ``spec.raw``, which holds the drop's
    ``hf_overrides``: a RoPE scaling override raises it past ``max_position_embeddings``). The
    one maximum the grid default, the search regions, the proposal cap and vLLM's refusal use."""
    return derived_max_model_len(spec.raw, model_type=spec.model_type)


def _kv_cache_memory_bytes(d: Drop, era) -> int | None:
    """The drop's ``kv_cache_memory_bytes``, refused where the release has no such setting
    (V0, V1 before 0.10.2)."""
    v = d.kv_cache_memory_bytes
    if v is None:
        return None
    if era.engine != "V1" or era.version < (0, 10, 2):
        from tuner.errors import DropError

        raise DropError(f"vLLM {era.version} has no --kv-cache-memory-bytes (V1 0.10.2+)", path=d.path or None,
                        field="kv_cache_memory_bytes")
    return int(v)


def _version_tuple(text: Any) -> Any:
    from tuner.memory.eras import parse_version

    try:
        return parse_version(str(text))
    except Exception:  # an unparseable version is the era lookup's error, not this one's
        return None


def per_head_kv_totals(plugin: Any, spec: Any, settings: RankSettings) -> set[int]:
    """Total KV heads of the model's per-head attention layers (full, sliding-window, chunked
    local), read from the plugin's own KV specs at TP 1 / PP 1 (so per-layer geometries such as
    Gemma's global layers count); empty for MLA latents and Mamba state, which have no per-head
    KV to split. A plugin that cannot lay the layers out at TP 1 gives an empty set (the real
    call then raises its own error)."""
    from tuner.errors import TunerError
    from tuner.memory.kvcache import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    probe = dataclasses.replace(settings, tensor_parallel_size=1, pipeline_parallel_size=1, pp_rank=0)
    try:
        specs = plugin.kv_cache_spec(spec, probe)
    except TunerError:
        return set()
    return {int(s.num_kv_heads) for s in specs.values()
            if isinstance(s, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec))}


def kv_block_bytes(era, kv_specs: tuple, block_size: int) -> list[int | None]:
    """Bytes one KV block costs across each pipeline stage's layers: what the available KV bytes
    are divided by to give ``num_gpu_blocks`` (V0 ``cache_block_size``, V1 ``bytes_per_block``).
    None where the release cannot lay the layers out."""
    from tuner.memory import kvcache
    from tuner.errors import TunerError

    if era.engine == "V0":
        return [sum(s.page_size_bytes for s in specs.values()) for specs in kv_specs]
    try:
        cfgs = kvcache.get_kv_cache_configs(era.version, [(specs, 1 << 50) for specs in kv_specs],
                                            max_model_len=block_size)
        return [int(c.bytes_per_block) for c in cfgs]
    except TunerError:
        return [None for _ in kv_specs]


def _device_from_catalog(device: dict) -> bool:
    """The device total is the catalog's entry for its name (not a drop-given or NVML total); for
    a device list, every stage's card."""
    from tuner.memory.devices import lookup

    if device.get("stages"):
        return all(_device_from_catalog({k: v for k, v in s.items() if k != "stages"}) for s in device["stages"])

    dev = lookup(str(device.get("name", "")))
    return dev is not None and int(dev.total_memory_bytes) == int(device["total_memory_bytes"])


def _compute_capability(device: dict) -> str | None:
    """The device's compute capability: as given, else from the catalog by name, else None."""
    if device.get("compute_capability"):
        return str(device["compute_capability"])
    from tuner.memory.devices import lookup

    dev = lookup(str(device.get("name", "")), total_memory_bytes=device.get("total_memory_bytes"))
    return dev.compute_capability if dev is not None else None


def _platform(device: dict) -> str:
    """:func:`tuner.memory.platforms.platform_of` for a request's card."""
    from tuner.memory.platforms import platform_of

    return platform_of(device)


def _free_memory_from_host(device: dict, era: Any) -> bool:
    """:func:`tuner.memory.budget.free_memory_from_host` for the request's device (catalog ``integrated``)."""
    from tuner.memory.budget import free_memory_from_host
    from tuner.memory.devices import lookup

    dev = lookup(str(device.get("name", "")), total_memory_bytes=device.get("total_memory_bytes"))
    integrated = device.get("integrated", dev.integrated if dev is not None else None)
    return free_memory_from_host(era, compute_capability=_compute_capability(device), integrated=integrated)


def _engine_use(req: "JobRequest", spec: Any, plugin: Any, unserved: bool, top: dict, era: Any,
                stage_settings: list, total: int, pp: int, *, pass_memo: Any = None,
                crosscheck_entries: list | None = None) -> Any:
    """The job's use of an installed vLLM (:mod:`tuner.engine.use`), or None where none is
    importable or ``engine`` is ``off`` (request key, else env ``CTX_TUNER_ENGINE``).

    For a model a plugin serves, a current stored cross-check (:mod:`tuner.engine.stored`: from
    ``pass_memo``'s entries in the parent, the request's ``engine_crosschecks`` in the worker) is
    used without opening an engine; without one, the request's ``cross_check`` decides: ``stored``
    answers with the plugin and says the cross-check is missing or stale, ``run`` (default) runs
    it and appends its record to ``crosscheck_entries`` (stored by the caller).

    Raises:
        UnsupportedArchitectureError: no plugin serves the architecture, its config is not a
            standard decoder and no engine can serve it (:mod:`tuner.engine.fallback`).
        MemoMiss: ``pass_memo`` is given and the answer needs the engine itself (the worker runs it).
    """
    import os

    from tuner.jobs import passmemo

    from tuner.releases.installed import vllm_importable
    from tuner.engine.fallback import non_standard_features, refuse_unserved

    mode = str(req.engine or os.environ.get("CTX_TUNER_ENGINE") or "auto")
    available = mode != "off" and vllm_importable()
    features = non_standard_features(top) if unserved else []
    if features and not available:
        refuse_unserved(list(spec.architectures), features, path=req.config_path)
    if not available:
        return None
    from tuner.engine.use import EngineUse, engine_for_job

    if era.engine == "V0" or pp > 1:
        why = ("a V0 release" if era.engine == "V0" else
               "pipeline stages on different GPUs (a device list)" if req.device.get("stages") else
               "pipeline_parallel_size > 1")
        if features:
            from tuner.errors import UnsupportedArchitectureError

            raise UnsupportedArchitectureError(f"no plugin serves {', '.join(spec.architectures)} and the engine "
                                               f"adapter does not serve {why}; write a plugin",
                                               where=req.config_path)
        return EngineUse(report={"skipped": f"engine adapter not used for {why}"},
                         warnings=[f"engine cross-check skipped for {why}"])
    plugin_specs = None if unserved else plugin.kv_cache_spec(spec, stage_settings[0])
    d = req.to_wire()["drop"]
    record_for = None
    if not unserved:  # the stored cross-check first (tuner.engine.stored): no engine session, no import vllm
        from tuner.engine import stored
        from tuner.engine.use import gpu_block_size

        build = passmemo.engine_build()
        ck_settings = stored.settings_of(d, block_size=gpu_block_size(d, plugin_specs), plugin=plugin.name,
                                         trust_remote_code=bool(req.trust_remote_code))
        records = stored.records_in(pass_memo.entries) if pass_memo is not None else list(req.engine_crosschecks)
        state, record, why = stored.find(records, config_sha256=spec.config_sha256, build=build, settings=ck_settings)
        entry_point = str(d.get("entry_point") or "serve")
        if record is not None:
            return stored.use_from_record(record, device=dict(req.device), entry_point=entry_point, build=build)
        if (req.cross_check or "run") == "stored":
            return EngineUse(report={"cross_check": stored.state_block(state, build=build, why=why)},
                             warnings=[stored.not_current_warning(state, why)])
        record_for = (build, ck_settings, entry_point)
    if pass_memo is not None:
        raise passmemo.MemoMiss("an installed engine takes part")

    def specs_at(version: str) -> dict:
        return plugin.kv_cache_spec(spec, dataclasses.replace(stage_settings[0], engine_version=version))

    use = engine_for_job(d=d, model_dir=str(Path(req.config_path).parent), spec=spec,
                         plugin=plugin,
                         unserved=unserved, era=era, plugin_specs=plugin_specs, plugin_specs_at=specs_at,
                         reference_bytes=total // 2, trust_remote_code=bool(req.trust_remote_code))
    if record_for is not None and use.session is not None:
        use.report["cross_check"] = {"state": "ran", "build": record_for[0], "vllm": record_for[0].get("version")}
        use.record_for = record_for
    return use


def stage_devices(device: dict, pp: int) -> list[dict]:
    """Each pipeline stage's card: the request's ``device["stages"]`` (a drop's device list,
    :func:`tuner.jobs.app.stage_device_dicts`) when it has one entry per stage, else ``device`` itself
    for every stage."""
    stages = device.get("stages") or []
    if len(stages) == int(pp) and int(pp) > 0:
        return [dict(s) for s in stages]
    base = {k: v for k, v in device.items() if k != "stages"}
    return [base] * max(1, int(pp))


def other_processes_bytes(device: dict, drop: Drop | dict) -> int:
    """Co-tenant memory at start (bytes): the drop's ``other_processes_memory_gib``, else what the
    request's device says NVML saw in use (``device: auto``), else 0."""
    gib = _typed(drop).other_processes_memory_gib
    if gib is not None:
        return int(round(float(gib) * GiB))
    return max(0, int(device.get("other_processes_bytes") or 0))


#: Methods whose drafter is another checkpoint (:mod:`tuner.memory.specdecode`).
CHECKPOINT_DRAFTERS = ("draft_model", "eagle", "eagle3", "dflash")

#: First release read whose hybrid models follow ``cache_config.mamba_cache_mode`` with prefix
#: caching (vllm/model_executor/models/config.py ``MambaModelConfig``, 0.19 / 0.20.1 / 0.24 wheels).
MAMBA_CACHE_MODE_SINCE = (0, 19, 0)


def mamba_cache_mode(drop: Drop | dict, era, plugin, warnings: list[str]) -> str | None:
    """vLLM's ``mamba_cache_mode`` for a hybrid model: with ``enable_prefix_caching`` (off by
    default for hybrid models, ``ModelConfig.is_prefix_caching_supported``, 0.19–0.24 read) a
    model without ``SupportsMambaPrefixCaching`` gets ``"align"`` (the plugin's
    ``mamba_prefix_caching_mode``): one extra state block per request
    (``MambaSpec.max_memory_usage_bytes``: ``page · (2 + num_speculative_blocks)``). ``"all"``
    (Mamba-2 models that support it) aligns the block size to the SSM chunk and is not modelled
    (a warning says so); so are releases before :data:`MAMBA_CACHE_MODE_SINCE`. None = ``"none"``."""
    if not _typed(drop).enable_prefix_caching or era.engine != "V1":
        return None
    mode = getattr(plugin, "mamba_prefix_caching_mode", None)
    if mode is None:
        return None
    if era.version < MAMBA_CACHE_MODE_SINCE or mode != "align":
        warnings.append(f"enable_prefix_caching on a hybrid model: mamba_cache_mode {mode!r} in vLLM "
                        f"{era.version} is not modelled (state blocks counted as without it)")
        return None
    return mode


def _checkpoint_drafter(req: "JobRequest", spec_cfg: dict, spec, last_stage_specs: dict, tp: int,
                        dtype: str, settings=None) -> tuple[int, dict, int, str | None, Any]:
    """``(weights bytes, KV specs, aux hidden-state layers, None, its DrafterPass)`` of another checkpoint's drafter from the request's
    ``draft_config_path`` (resolved by the parent: :func:`tuner.jobs.app.prepare_job`, validate's
    models directory), or ``(0, {}, 0, warning, None)`` when its config is not at hand or not usable. The
    weights are weighed in the target's dtype, the drafter's linear layers at its checkpoint's
    own quantization (:func:`tuner.memory.specdecode.checkpoint_drafter_weights_bytes`)."""
    from tuner.errors import TunerError
    from tuner.memory.kvcache import dtype_bytes_for
    from tuner.model.modelspec import read_top
    from tuner.memory.specdecode import (aux_hidden_state_layers, checkpoint_drafter_kv_specs, checkpoint_drafter_pass,
                                  checkpoint_drafter_weights_bytes)

    method, model = spec_cfg["method"], spec_cfg.get("model")
    path = req.draft_config_path
    if not path:
        why = req.draft_config_error or "its config.json was not found"
        return 0, {}, 0, (f"speculative_config.model {model!r}: {why}; the {method} drafter's weights and KV "
                          "layers are not modelled; expect fewer KV blocks than predicted"), None
    try:
        cfg = read_top(path)
    except (ValueError, TunerError) as exc:
        return 0, {}, 0, f"speculative_config.model {model!r} ({path}): {exc}; the drafter is not modelled", None
    from tuner.memory.engine_checks import check_draft_vocab

    check_draft_vocab(spec_cfg, draft_config=cfg, target_config=spec.top, version=req.drop.engine_version,
                      path=req.drop.path or None)  # vLLM refuses it before loading anything
    try:
        weights = checkpoint_drafter_weights_bytes(
            method, cfg, spec.top, tensor_parallel_size=tp, dtype_bytes=dtype_bytes_for("auto", dtype),
            settings=None if settings is None else dataclasses.replace(settings, quantization=spec_cfg.get("quantization")))
        kv = checkpoint_drafter_kv_specs(cfg, last_stage_specs, tensor_parallel_size=tp,
                                         kv_dtype_bytes=dtype_bytes_for(req.drop.kv_cache_dtype, dtype),
                                         first_layer_index=spec.num_hidden_layers)
        fwd = checkpoint_drafter_pass(method, cfg, spec.top, tensor_parallel_size=tp,
                                      dtype_bytes=dtype_bytes_for("auto", dtype),
                                      num_speculative_tokens=int(spec_cfg.get("num_speculative_tokens") or 0))
    except (ValueError, TunerError) as exc:
        return 0, {}, 0, f"speculative_config.model {model!r} ({path}): {exc}; the drafter is not modelled", None
    return weights, kv, aux_hidden_state_layers(method, cfg), None, fwd


def num_speculative_tokens(drop: Drop | dict, era) -> int:
    """Draft tokens per request that size the CUDA-graph captures (``VllmConfig.num_speculative_tokens``,
    vllm/config/vllm.py): the drop's ``speculative_config.num_speculative_tokens`` on V1; 0 without
    speculative decoding and on V0 (no capture-size rule there)."""
    sc = _typed(drop).speculative_config or {}
    if era.engine != "V1" or not sc:
        return 0
    return int(sc.get("num_speculative_tokens") or 0)


#: The interconnect taken for a card neither the request nor the catalog describes: PCIe without
#: CUDA peer access, what is true of most cards (GeForce, workstation and most PCIe data-centre
#: cards in a plain host). With it vLLM keeps custom all-reduce off past two GPUs and without P2P
#: (vllm/distributed/device_communicators/custom_all_reduce.py ``CustomAllreduce.__init__``,
#: 0.5–0.34: ``is_fully_connected`` / ``_can_p2p``) and NCCL allocates no NVLink SHARP (NVLS)
#: buffers (those need an NVSwitch fabric, :func:`tuner.memory.budget.nccl_profile_bytes`). The old
#: default, the calibration centre (an H100 SXM box behind NVSwitch), charged an unknown card's TP
#: group 1.8 GiB of NVLS buffers it does not have.
ASSUMED_INTERCONNECT = "pcie"
ASSUMED_P2P = False


def topology_source(device: dict) -> str:
    """Where the card's interconnect comes from: ``"stated"`` (the request's ``interconnect``: a
    drop mapping's ``device.interconnect``, ``--device NAME:GIB:IC``), ``"catalog"`` (the catalog
    card's usual board) or ``"assumed"`` (:data:`ASSUMED_INTERCONNECT`, no P2P)."""
    from tuner.memory.devices import lookup

    if device.get("interconnect"):
        return "stated"
    known = lookup(str(device.get("name", "")), total_memory_bytes=device.get("total_memory_bytes"))
    return "catalog" if known is not None and known.interconnect else "assumed"


def topology_for(device: dict, drop: Drop | dict):
    """The TP group's :class:`tuner.memory.budget.Topology`: the device's ``interconnect`` / ``p2p`` as the
    request states them, else the catalog's for its name (and total), else
    :data:`ASSUMED_INTERCONNECT` without P2P (an unknown card is not an NVSwitch box; the job's
    ``assumptions`` say so, :func:`device_assumptions`); ``disable_custom_all_reduce`` from the drop.
    A stated interconnect without a stated ``p2p``: P2P on NVLink/NVSwitch/xGMI fabrics, the
    catalog's (else none) over PCIe."""
    from tuner.memory.budget import Topology
    from tuner.memory.devices import lookup

    known = lookup(str(device.get("name", "")), total_memory_bytes=device.get("total_memory_bytes"))
    ic = device.get("interconnect") or (known.interconnect if known is not None else None) or ASSUMED_INTERCONNECT
    p2p = device.get("p2p")
    if p2p is None:
        if known is not None:
            p2p = known.p2p if known.p2p is not None else True
        else:
            p2p = ic != "pcie" or ASSUMED_P2P
    from tuner.memory.platforms import platform_of

    return Topology(interconnect=ic, p2p=bool(p2p), compute_capability=_compute_capability(device),
                    disable_custom_all_reduce=bool(_typed(drop).disable_custom_all_reduce),
                    platform=platform_of(device))


def _catalog_hint(card: dict) -> str:
    """A did-you-mean for a card name the catalog lacks but nearly spells (``RTX4090`` → RTX-4090):
    named with its total (``--device RTX4090:23.53``) the card is taken as given, so the near miss
    is said where the assumptions it causes are."""
    from tuner.memory.devices import did_you_mean

    name = card.get("name")
    near = did_you_mean(name) if isinstance(name, str) else []
    if not near:
        return ""
    gib = f":{int(card['total_memory_bytes']) / (1 << 30):.2f}" if card.get("total_memory_bytes") else ""
    return (f" (did you mean {' or '.join(repr(x.name) for x in near)}? named so, e.g. --device "
            f"'{near[0].name}{gib}', the catalog's compute capability and interconnect are used)")


def device_assumptions(device: dict, drop: Drop | dict, era: Any = None) -> list[dict]:
    """What the job assumed about the device(s) rather than was told, as data (the job result's
    ``assumptions``; each widens the uncertainty band): ``{"name", "value", "where", "effect":
    "widens", "note", "kind": "not_modelled"}`` (the fields of :class:`tuner.memory.uncertainty.Unmodelled`
    where that module exists). The interconnect of a TP group on a card the catalog does not know
    (:data:`ASSUMED_INTERCONNECT`); the platform rules a ROCm or unified-memory card follows
    (:func:`tuner.memory.platforms.platform_assumptions`)."""
    from tuner.memory import platforms

    d = _typed(drop)
    out: list[dict] = []
    tp = int(d.tensor_parallel_size or 1)
    for i, card in enumerate(stage_devices(device, int(d.pipeline_parallel_size or 1))):
        where = f"device[{i}]" if device.get("stages") else "device"
        unknown = f"{card.get('name')!s} is not in the catalog{_catalog_hint(card)}"
        if tp > 1 and topology_source(card) == "assumed":
            entry = platforms.assumption(
                "device.interconnect", f"{ASSUMED_INTERCONNECT}, no P2P", where,
                f"{unknown} and no interconnect was stated (device.interconnect "
                "in a drop, --device NAME:GIB:nvlink|nvswitch|pcie|xgmi); it decides the TP group's non-torch "
                "memory: no NVLS buffers, custom all-reduce off")
            if entry not in out:
                out.append(entry)
        if _compute_capability(card) is None:
            entry = platforms.assumption(
                "device.compute_capability", "9.0 or newer", where,
                f"{unknown} and no compute_capability was stated (a drop mapping's "
                "compute_capability); the larger cuBLAS workspace (torch CublasHandlePool.cpp), Hopper's MLA block "
                "size and kernels are assumed")
            if entry not in out:
                out.append(entry)
        for entry in platforms.platform_assumptions(card, era, where=where):
            if entry not in out:
                out.append(entry)
    entry = compile_cache_assumption(d, era)
    if entry is not None:
        out.append(entry)
    return out


def compile_cache_assumption(drop: Drop | dict, era: Any = None) -> dict | None:
    """A cold compile cache as an unmodelled input (:func:`tuner.memory.platforms.assumption`, the band
    widens): on a V1 release that compiles (``era.compiled``: not ``enforce_eager``) the first boot
    runs Inductor in the profile run (vllm/compilation/backends.py: no cached graph, compile) and,
    for single-size compile ranges, max-autotune and coordinate-descent tuning
    (vllm/compilation/compiler_interface.py ``set_inductor_config``, ``VLLM_ENABLE_INDUCTOR_MAX_AUTOTUNE``
    default on) that benchmarks Triton configurations on the GPU; a warm boot loads the compiled
    graphs. The extra peak of the cold path is not in any modelled term; ``warm`` and unstated are
    answered as modelled. None where nothing is assumed."""
    from tuner.memory import platforms

    d = _typed(drop)
    if d.compile_cache != "cold" or era is None or getattr(era, "engine", "V1") != "V1" \
            or not getattr(era, "compiled", True):
        return None
    # side "low": the cold path only adds to the profile run's peak (a warm boot loads the graphs), so
    # its band widens the interval's safe end alone, never the high end
    return {**platforms.assumption(
        "compile_cache", "cold", "compile_cache",
        "a cold torch.compile cache: the first boot compiles every graph with Inductor during the profile run "
        "(vllm/compilation/backends.py) and tunes single-size ranges with max-autotune "
        "(compilation/compiler_interface.py set_inductor_config); its extra peak is not modelled, so the KV cache "
        "may be smaller on the first boot than on a warm one, never larger (the band widens the safe end only)"),
        "side": "low"}


def _kv_cache_dtype(drop: Drop | dict, spec, era, drop_path, warnings: list) -> str:
    """The cache dtype the release runs: the drop's name checked against the release's names
    (:func:`tuner.memory.engine_checks.check_kv_cache_dtype`), ``auto`` resolved from a ModelOpt
    checkpoint's ``kv_cache_quant_algo`` (:func:`tuner.memory.kvcache.resolve_kv_cache_dtype`)."""
    from tuner.memory.engine_checks import check_kv_cache_dtype
    from tuner.memory.kvcache import resolve_kv_cache_dtype

    asked = str(_typed(drop).kv_cache_dtype or "auto").lower()
    check_kv_cache_dtype(asked, version=era.version, path=drop_path)
    qc = spec.quantization_config or {}
    kv = resolve_kv_cache_dtype(asked, qc, era.version)
    if kv != asked:
        warnings.append(f"kv_cache_dtype auto is {kv}: the checkpoint's ModelOpt kv_cache_quant_algo, as vLLM "
                        f"{era.version} resolves it")
    elif asked == "auto" and isinstance(qc.get("kv_cache_scheme"), dict):
        warnings.append("the checkpoint's kv_cache_scheme only carries KV scales: with kv_cache_dtype auto vLLM keeps "
                        "the cache in the model dtype (set kv_cache_dtype fp8 to use them)")
    return kv


def run_job(request: "JobRequest | dict[str, Any]", *, pass_memo: Any = None) -> dict[str, Any]:
    """Execute one job.

    ``request``: a :class:`tuner.question.protocol.JobRequest` (or its wire object): ``drop`` (the validated
    drop), ``config_path`` (the model's config.json), ``device`` (``{name, total_memory_bytes}``),
    ``fake`` (default True), ``search`` (default True; False evaluates only the drop's
    ``max_model_len`` grid, no proposal search), ``calibration`` (optional byte corrections, see
    :class:`tuner.memory.search.Layout`), ``method``
    (``simulate`` default; ``cuda`` measures each pass on GPU 0 with :mod:`tuner.measure.cuda`;
    ``vllm`` simulates, then starts the installed engine for the needed candidates with
    :mod:`tuner.measure.vllm_engine`) and ``method_requested`` (``auto``: a ``cuda`` pick falls
    back to simulate, with a warning, where torch has no CUDA).

    The result also has ``method`` (what ran), ``calibration`` (the corrections applied, or None;
    candidates and proposals then carry ``uncalibrated``: the same numbers without them) and
    ``measured`` (``vllm``: one dict per engine start-up).

    Returns the wire object of a :class:`tuner.question.protocol.JobResult`: ``model``, ``plugin``,
    ``warnings``, ``era``, ``runs`` (one per pass), ``candidates`` and ``proposals`` (see
    :mod:`tuner.memory.search`; each with its ``budget`` ledger), and ``versions``.

    ``pass_memo`` (a :class:`tuner.jobs.passmemo.MemoSource`): answer from stored entries in this
    process, without torch or transformers — the model spec and every pass come from it, and the
    first one it lacks raises :class:`tuner.jobs.passmemo.MemoMiss`. Without it (the worker) the
    result also carries the new memo entries under ``memo_entries`` (simulate with fake tensors,
    no engine adapter), and the request's ``known_passes`` (``{memo_key: row}``) supplies passes
    the parent already had.

    The stages, in the design's order (DESIGN §2), one function each: :func:`load_model` (config →
    plugin → spec), :func:`rank_settings` (era, dtype, per-stage settings, vLLM's refusals),
    :func:`_engine_use` (the installed engine), :func:`kv_specs_for` (KV specs, drafter),
    :func:`method_for` (what runs), :func:`layout_for` (the budget's facts), :class:`Passes` (the
    profile passes, memoized), :func:`search_points` (candidates and proposals),
    :func:`verify_with_engine`, :func:`measure` (cuda / vllm) and :func:`job_result`.

    Warnings (``warnings``) include each plugin default used for a key the model's config.json
    lacks (:func:`tuner.model.modelspec.defaults_applied`).

    Raises:
        DropError: settings vLLM refuses for this model (:mod:`tuner.memory.engine_checks`: heads / KV
            heads vs ``tensor_parallel_size``, layers vs ``pipeline_parallel_size``,
            ``max_num_batched_tokens`` vs ``max_num_seqs`` / ``max_model_len``, ``quantization``),
            naming the drop file (``request["drop"]["path"]``) and the key.
        TunerError subclasses for bad configs, plugins or settings.
    """
    from tuner.jobs import passmemo
    from tuner.question.protocol import JobRequest

    if pass_memo is None:
        import torch

        versions = _worker_versions()
    req = request if isinstance(request, JobRequest) else JobRequest.from_wire(request, required=False)
    memo_entries: list[dict] = []
    # the key of the whole answer where an installed engine takes part (tuner.jobs.passmemo.ENGINE_ANSWER):
    # taken before the engine adapter touches the environment, as the parent will take it
    engine_key = (passmemo.engine_answer_key(req) if pass_memo is None and req.method == "simulate" and req.fake
                  and passmemo.engine_takes_part(req) else None)
    t_start = time.perf_counter()
    drop, device = req.drop, req.device
    total = int(device["total_memory_bytes"])
    warnings: list[str] = []
    model = load_model(req.config_path, warnings, hf_overrides=drop.hf_overrides, pass_memo=pass_memo,
                       memo_entries=memo_entries, versions=versions if pass_memo is None else None)
    era, ranks = _era_and_ranks(req, model, warnings)
    # The installed engine (tuner.engine): KV specs / weights for an unserved architecture, a
    # cross-check of the plugin's KV specs (stored once: tuner.engine.stored), vLLM's own argument
    # checks; no silent fallback.
    engine_use = _engine_use(req, model.spec, model.plugin, model.unserved is not None, model.top, era,
                             ranks.stages, total, ranks.pp, pass_memo=pass_memo)
    model = _served_by_engine(model, engine_use, warnings)
    kv = kv_specs_for(req, model, era, ranks, engine_use, warnings)
    method, calibration = method_for(req, (lambda: False) if pass_memo is not None else torch.cuda.is_available,
                                     warnings)
    layout = layout_for(drop, model, era, ranks, kv, device, method, calibration, warnings)
    assumptions = _job_assumptions(device, drop, era, ranks, warnings)
    assumptions.extend(plugin_not_modelled(model.plugin, model.spec, ranks.stages, warnings))
    # the passes of a plugin-served model are the plugin's with or without an engine (its cross-check
    # decides KV specs and defaults, which the pass keys and the search take as inputs)
    memoizable = method == "simulate" and req.fake and (engine_use is None or not (
        engine_use.weights or engine_use.trace_activation or engine_use.traced))
    if pass_memo is not None and not memoizable:
        raise passmemo.MemoMiss(f"method {method} is not memoized")
    passes = Passes(req, model, era, ranks, layout, method, engine_use=engine_use, pass_memo=pass_memo,
                    memo_entries=memo_entries if memoizable else None)
    _engine_defaults(passes, engine_use, era, drop, model, kv, device)

    def run_sources(*, before_passes: bool) -> dict:
        return _run_sources(model, engine_use, layout, device, passes, method, before_passes=before_passes)

    sources = run_sources(before_passes=True)
    context = uncertainty_context(req, device, era, sources, kv, warnings, assumptions)
    layout = dataclasses.replace(layout, uncertainty=context)
    candidates, proposals = search_points(req, era, layout, passes, t_start, pass_memo=pass_memo)
    if era.extensible_kv_cache:  # vLLM 0.34 warns where an explicit u < 1.0 withholds free memory
        _u_warnings(candidates, warnings)
    if engine_use is not None and engine_use.session is not None:
        verify_with_engine(engine_use, era, layout, passes, proposals, ranks.pp, warnings)
    if engine_use is not None:  # what the engine said during the passes (e.g. a trace that could not run)
        warnings.extend(w for w in engine_use.warnings if w not in warnings)
    measured = measure(req, era, method, passes, candidates, proposals, total, warnings)
    warnings.extend(req.warnings)  # what the worker saw before the job (a calibration lookup that failed)
    if pass_memo is not None:
        versions = {**(pass_memo.versions or {}), "python": platform.python_version()}
    if engine_use is not None:  # what the passes really did (a trace that ran, or its fallback)
        sources = run_sources(before_passes=False)
    out = job_result(
        method=method, calibration=calibration, layout=layout, measured=measured, model=model, warnings=warnings,
        uncertainty=context,
        sources=sources, engine_use=engine_use, era=era, dtype=ranks.dtype, kv=kv, runs=passes.runs,
        candidates=candidates, proposals=proposals, versions=versions,
        elapsed_s=round(time.perf_counter() - t_start, 3), total=total)
    out["release_assumed"] = dict(drop.release_assumed) if drop.release_assumed else None
    out["assumptions"] = assumptions  # what was assumed about the device(s), as data (tuner.memory.platforms)
    said = runner_default_assumption(drop, era, layout.model_runner_v2, model.spec.architectures)
    if said is not None:  # the runner the release's default picked (a rule, not a band: after the context)
        out["assumptions"] = [*assumptions, said]
    _memo_entries_of(out, req, model, era, method, device, engine_use, engine_key, memo_entries,
                     memoizable=memoizable, in_worker=pass_memo is None)
    return out


def _era_and_ranks(req: Any, model: Any, warnings: list[str]) -> tuple[Any, Any]:
    """The drop's era (its release said out loud where assumed) and the per-rank settings, each
    stage's checkpoint format included."""
    drop, device = req.drop, req.device
    era = drop_era(drop, req.engine_kind)
    loud = release_warning(drop.release_assumed)
    if loud:
        warnings.append(loud)
    ranks = rank_settings(drop, model, era, device, warnings)
    fmt = config_format(drop, req.config_path)
    if fmt != "hf":
        ranks = dataclasses.replace(ranks, stages=[dataclasses.replace(s, config_format=fmt) for s in ranks.stages])
    return era, ranks


def _served_by_engine(model: Any, engine_use: Any, warnings: list[str]) -> Any:
    """The model as the installed engine serves it (its plugin; no generic-fallback warning where
    the engine gives the weights), the engine's warnings said."""
    if engine_use is not None:
        model = dataclasses.replace(model, plugin=engine_use.plugin or model.plugin)
        if engine_use.weights and model.unserved in warnings:  # the engine, not the generic fallback, serves it
            warnings.remove(model.unserved)
        warnings.extend(engine_use.warnings)
    return model


def _worker_versions() -> dict:
    """The versions a worker's answer carries (tool, torch, transformers, python)."""
    import torch

    from tuner.model.transformers_lean import import_transformers

    transformers = import_transformers()  # without the scan of every model's source
    return {"tool": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def plugin_not_modelled(plugin: Any, spec: Any, stages: Sequence[Any], warnings: list[str]) -> list[dict]:
    """What the model's plugin says it does not model (its optional ``not_modelled(spec, settings)``:
    :func:`tuner.memory.platforms.assumption` entries, each widening the band), said in ``warnings``."""
    fn = getattr(plugin, "not_modelled", None)
    if fn is None or not stages:
        return []
    out = list(fn(spec, stages[0]))
    warnings.extend(f"not modelled {a['name']}: {a['value']} ({a['note']})" for a in out)
    return out


def _job_assumptions(device: dict, drop: Any, era: Any, ranks: Any, warnings: list[str]) -> list[dict]:
    """What the job assumed — about the device(s), the ranks' settings (the sampler's path) and the
    release — as data (:mod:`tuner.memory.platforms`); the device's are said in ``warnings`` too."""
    assumptions = device_assumptions(device, drop, era)
    warnings.extend(f"assumed {a['name']}: {a['value']} ({a['note']})" for a in assumptions)
    from tuner.memory.platforms import assumption

    for a in ranks.assumptions:  # what the ranks' settings assumed (the sampler's path), said in rank_settings
        assumptions.append(assumption(str(a["name"]), str(a["value"]).lower(), str(a["name"]), str(a["why"])))
    if drop.release_assumed:  # the release answered for (said above): an assumption the band widens for too

        assumptions.append(assumption("release", str(drop.release_assumed["value"]), "engine_version",
                                      str(drop.release_assumed["reason"])))
    return assumptions


def _engine_defaults(passes: Any, engine_use: Any, era: Any, drop: Any, model: Any, kv: Any, device: dict) -> None:
    """The engine's scheduler defaults into the passes' batch, when its release is the drop's
    (:mod:`tuner.engine.use`), or as a stored cross-check's engine applied them."""
    if engine_use is not None and engine_use.session is not None and era.engine == "V1":
        # the engine's scheduler defaults, when its release is the drop's (tuner.engine.use)
        from tuner.engine.use import reconcile_defaults

        grid = drop.candidates.max_model_len or [model_max_len(model.spec)[0]]
        passes.engine_batch.update(reconcile_defaults(engine_use, era_batch=passes.batch_for(max(grid)),
                                                      block_size=kv.block_size, d=drop.to_dict(), device=device))
    elif engine_use is not None and engine_use.stored_defaults and era.engine == "V1":
        passes.engine_batch.update(engine_use.stored_defaults)  # as the stored cross-check's engine applied them


def _run_sources(model: Any, engine_use: Any, layout: Any, device: dict, passes: Any, method: str, *,
                 before_passes: bool) -> dict:
    """Which source gave each term. Before the passes run (for the uncertainty context) a trace
    the engine will attempt counts as traced; after them, what really happened does."""
    from tuner.engine.crosscheck import term_sources

    traced = bool(engine_use and (engine_use.traced or (before_passes and engine_use.trace_activation
                                                        and engine_use.session is not None)))
    return term_sources(
        plugin=model.plugin.name, engine_kv=bool(engine_use and engine_use.kv_specs is not None),
        engine_weights=bool(engine_use and engine_use.weights),
        approximate_activation=bool(engine_use and engine_use.approximate_activation),
        traced_activation=traced,
        approximate_parts=engine_use.approximate_parts() if engine_use is not None else (),
        calibrated=bool(layout.corrections), device_from_catalog=_device_from_catalog(device),
        engine_defaults=bool(passes.engine_batch) or bool(
            engine_use and engine_use.report.get("releases_match")
            and (engine_use.report.get("defaults") or {}).get("engine")), method=method)


def _u_warnings(candidates: list[dict], warnings: list[str]) -> None:
    """vLLM 0.34's warning where an explicit u < 1.0 withholds free memory, once per u."""
    from tuner.memory.search import gpu_memory_utilization_warning

    warned: set[float] = set()
    for c in candidates:  # one per u (its largest length decides the batch)
        w = gpu_memory_utilization_warning(c)
        if w and c["gpu_memory_utilization"] not in warned:
            warned.add(c["gpu_memory_utilization"])
            warnings.append(f"vLLM would warn: {w}")


def _memo_entries_of(out: dict, req: Any, model: Any, era: Any, method: str, device: dict, engine_use: Any,
                     engine_key: Any, memo_entries: list[dict], *, memoizable: bool, in_worker: bool) -> None:
    """The new memo entries a worker's answer carries (``memo_entries``): its passes, the engine
    cross-check that ran (stored once, :mod:`tuner.engine.stored`) and an engine's whole answer."""
    from tuner.jobs import passmemo

    if not in_worker:  # an answer from the memo adds no entries
        return
    new_entries = list(memo_entries) if memoizable else []
    if engine_use is not None and getattr(engine_use, "record_for", None):
        # the cross-check that ran here, stored once (tuner.engine.stored): later jobs need no import vllm
        from tuner.engine import stored

        build, ck_settings, entry_point = engine_use.record_for
        new_entries.append(stored.record_entry(engine_use, config_sha256=model.spec.config_sha256, build=build,
                                               settings=ck_settings, device=dict(device), entry_point=entry_point))
    if new_entries:
        out[passmemo.ENTRIES] = new_entries
    if engine_use is not None and engine_use.live and engine_key is not None and method == "simulate":
        # the engine's answer, whole: a repeated question is answered from the store by the parent
        # (tuner.jobs.memoanswer.answer_from_memo) without importing vLLM or torch
        from tuner.model.modelspec import config_hash

        out.setdefault(passmemo.ENTRIES, []).append({"memo_key": engine_key, "kind": passmemo.ENGINE_ANSWER,
                                  "model_config_sha256": config_hash(read_top(req.config_path)),
                                  "tool_version": __version__, "method": method, "device_name": device.get("name"),
                                  "era": era.name, "value": json.loads(json.dumps(
                                      {k: v for k, v in out.items() if k != passmemo.ENTRIES}))})


def uncertainty_context(req: "JobRequest", device: dict, era: Any, sources: dict, kv: "KvLayout",
                        warnings: list[str], assumptions: Sequence[dict] = ()) -> Any:
    """What the job does not know (:class:`tuner.memory.uncertainty.Context`): the terms' sources, whether
    the device total was stated (the request's ``device_total_stated``; else a total other than
    the catalog's), and the inputs with no rule — the request's own (a serve line's
    flags, a case's settings, a release not stated), the device ``assumptions``
    (:func:`device_assumptions`) and a drafter method whose memory is not modelled."""
    from tuner.memory import uncertainty as unc

    items = [unc.Unmodelled.from_dict(u) for u in req.unmodelled]
    # what the job assumed about the device(s) (device_assumptions: an unknown card's interconnect or
    # capability, the ROCm platform, unified memory)
    for a in assumptions:  # the release answered for is a release not stated (its own, wider band)
        items.append(unc.Unmodelled.from_dict({**a, "kind": "release_not_stated"} if a.get("name") == "release" else a))
    spec_cfg = req.drop.speculative_config or {}
    if spec_cfg and not kv.drafter_modelled:
        items.append(unc.Unmodelled("speculative_config.method", spec_cfg.get("method"), "drop", "widens",
                                    "the drafter's weights, KV layers and profile run are not modelled"))
    stated = req.device_total_stated
    if stated is None:
        stated = not _device_from_catalog(device)
    return unc.Context(tuple(sorted(sources.items())), bool(stated), tuple(items))


#: vLLM 0.34's default KV block size (vllm/config/cache.py ``CacheConfig.DEFAULT_BLOCK_SIZE = 64``, 16
#: through 0.33), which ``Platform.update_block_size_for_backend`` keeps where the attention backend
#: supports it (FlashAttention, FlashInfer, Triton: multiples of 16).
DEFAULT_BLOCK_SIZE_0_34 = 64


def default_block_size(era: Any, spec: Any, plugin: Any) -> int | None:
    """The block size a drop without ``block_size`` gets before the plugin's own rules: None (the
    plugin's default, 16) through 0.33; 64 from 0.34. Hybrid models take it as the floor of the
    attention block aligned to the state page, as vLLM does (``Platform._align_hybrid_block_size``:
    ``if cache_config.block_size < attn_block_size``). MLA models (a ``kv_lora_rank`` in the config)
    keep their plugin's backend sizes (FlashMLA 64, CUTLASS MLA 128; not re-read for 0.34's default)."""
    if era.engine != "V1" or era.version < (0, 34, 0):
        return None
    raw = getattr(spec, "raw", None) or {}
    if raw.get("kv_lora_rank"):
        return None
    return DEFAULT_BLOCK_SIZE_0_34


def drop_era(drop: Drop | dict, engine: str | None = None):
    """The :class:`tuner.memory.eras.Era` a drop's settings select: its release, engine, ``enforce_eager``,
    and from 0.34 whether the extensible KV cache sizes the cache (``enable_extensible_kv_cache``,
    off with ``kv_cache_memory_bytes``)."""
    d = _typed(drop)
    if engine is None:
        engine = engine_from_env(d)
    try:
        era = era_for(d.engine_version, engine, enforce_eager=bool(d.enforce_eager),
                      extensible_kv_cache=d.enable_extensible_kv_cache, kv_cache_memory_bytes=d.kv_cache_memory_bytes)
    except EraError as exc:
        raise DropError(exc.message, path=d.path or None, field="enable_extensible_kv_cache") from None
    # the drop's environment (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS) as vLLM reads it
    return era_with_env(era, drop_env(d), enforce_eager=bool(d.enforce_eager))


# ------------------------------------------------------------------------------------------------
# The stages of a job, in order
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """The model's config read, its plugin chosen and its spec built (stage 1)."""

    plugin: Any
    spec: Any
    top: dict
    #: the registry's warning that no plugin serves the architecture (the generic one does), or None.
    unserved: str | None


def load_model(config_path: str, warnings: list[str], *, hf_overrides: Any = None, pass_memo: Any = None,
               memo_entries: list | None = None, versions: dict | None = None) -> LoadedModel:
    """Stage 1: the plugin for the config's architectures and the model spec, with the plugin's
    defaults for keys a partial config lacks (each one a warning,
    :func:`tuner.model.modelspec.defaults_applied`) and the drop's ``hf_overrides`` (vLLM
    ``--hf-overrides``); every plugin that failed to load is a warning.

    With ``pass_memo`` the spec comes from the memo (:class:`tuner.jobs.passmemo.MemoMiss` when it is
    not there); else it is built with transformers and, where it survives the JSON round trip,
    its memo entry is added to ``memo_entries`` (``versions``: the worker's)."""
    from tuner.jobs import passmemo

    registry = load_registry()
    for err in registry.errors:
        warnings.append(str(err))
    plugin, warn = registry.for_architectures(read_architectures(config_path))
    if warn:
        warnings.append(warn)
    top = read_top(config_path)
    defaults = plugin.config_defaults(without_nulls(top))  # a null key gets the default a missing one gets
    hf_overrides = dict(hf_overrides) if hf_overrides else None
    # the drop's hf_overrides change the spec: part of its memo key (pass keys follow config_sha256)
    spec_memo_key = passmemo.spec_key(config_path, top, plugin,
                                      {**defaults, "hf_overrides": hf_overrides} if hf_overrides else defaults)
    if pass_memo is not None:
        spec = pass_memo.spec(spec_memo_key)
    else:
        spec, _hf = load_model_spec(config_path, defaults=defaults, overrides=hf_overrides)
        value = passmemo.spec_to_value(spec, dict(versions or {}))
        if value is not None and memo_entries is not None:
            memo_entries.append(passmemo.entry(passmemo.SPEC, spec_memo_key, value, spec=spec))
    config_name = Path(config_path).name
    for key, value in defaults_applied(top, defaults).items():  # partial configs: say what was assumed
        warnings.append(f"{config_name} lacks {key}; using {value!r} (default of plugin {plugin.name})")
    return LoadedModel(plugin, spec, top, warn)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """The dtype vLLM runs, the KV cache dtype and one :class:`RankSettings` per pipeline stage (stage 2)."""

    dtype: str
    stages: list
    tp: int
    pp: int
    #: the cache dtype the release runs (:func:`_kv_cache_dtype`: ``auto`` resolved from a ModelOpt checkpoint).
    kv_cache_dtype: str = "auto"
    #: what was assumed for inputs the drop leaves open (``{"name", "value", "why"}`` each), reported
    #: with the result under ``assumptions`` (:func:`job_result`).
    assumptions: tuple = ()
    #: the assumptions whose other value ctx-tuner computes (:class:`tuner.memory.assumed.AlternativeSettings`):
    #: the passes run them too and the interval widens by exactly their effect (:meth:`Passes.passes_at`).
    alternatives: tuple = ()


def config_format(drop: Drop, config_path: str | None) -> str:
    """vLLM's ``--config-format`` resolved as ``get_config`` does (vllm/transformers_utils/config.py,
    0.19 read): ``auto`` is ``mistral`` when the model directory holds ``params.json`` and
    ``consolidated*.safetensors`` (``is_mistral_model_repo``), else ``hf``."""
    fmt = str(getattr(drop, "config_format", None) or "auto")
    if fmt != "auto":
        return fmt
    if config_path:
        d = Path(config_path).parent
        if (d / "params.json").is_file() and any(d.glob("consolidated*.safetensors")):
            return "mistral"
    return "hf"


def pp_layer_partition(env: dict) -> tuple[int, ...] | None:
    """``VLLM_PP_LAYER_PARTITION`` of a drop's ``env`` as layer counts (None when unset)."""
    text = (env or {}).get("VLLM_PP_LAYER_PARTITION")
    return tuple(int(x) for x in str(text).split(",")) if text else None


def era_with_env(era: Any, env: dict, *, enforce_eager: bool = False) -> Any:
    """The era as the drop's environment changes it: ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``
    (vllm/envs.py 0.18+: default "0" in 0.18–0.19, "1" from 0.20; vllm/v1/worker/gpu_worker.py
    ``determine_available_memory`` subtracts the estimate only when it is set) decides whether the
    CUDA-graph estimate comes off the KV budget; earlier releases have no such variable."""
    from tuner.memory.eras import _env_flag

    flag = _env_flag((env or {}).get("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"))
    if flag is None or era.engine != "V1" or era.version < (0, 18, 0):
        return era
    return dataclasses.replace(era, subtracts_cudagraph_estimate=bool(flag) and not enforce_eager)


#: The release that removed the V0 engine and, with it, ``VLLM_USE_V1`` from vllm/envs.py (read in
#: 0.10.1.1's envs.py, absent from 0.11.1's).
V0_REMOVED_IN = (0, 11, 0)


def engine_from_env(drop: Drop | dict) -> str | None:
    """The engine ``VLLM_USE_V1`` selects (vllm/envs.py ``bool(int(os.getenv("VLLM_USE_V1", "1")))``
    up to 0.10): ``"V0"`` for 0, ``"V1"`` for 1; None where it is unset or the release no longer
    reads it (0.11+: V1 is the only engine)."""
    from tuner.memory.eras import VllmVersion, _env_flag

    d = _typed(drop)
    flag = _env_flag((d.env or {}).get("VLLM_USE_V1"))
    if flag is None or VllmVersion.parse(d.engine_version) >= V0_REMOVED_IN:
        return None
    return "V1" if flag else "V0"


def _use_v1_note(drop: Drop | dict) -> str | None:
    """What ``VLLM_USE_V1`` does on the drop's release, for the answer: from 0.11 vLLM does not read it
    (V1 is the only engine), and from 0.17 its ``validate_environ`` (vllm/envs.py; vllm/platforms/interface.py from 0.31) warns of the unknown name."""
    from tuner.memory.eras import VllmVersion

    d = _typed(drop)
    value = (d.env or {}).get("VLLM_USE_V1")
    if value is None:
        return None
    v = VllmVersion.parse(d.engine_version)
    if v < V0_REMOVED_IN:
        return None
    return (f"env VLLM_USE_V1={value!r}: modelled as a no-op on vLLM {d.engine_version}: the V0 engine was removed in "
            "0.11, V1 is the only engine and vLLM does not read the variable"
            + (" (it logs 'Unknown vLLM environment variable detected: VLLM_USE_V1')" if v >= (0, 17, 0) else ""))


def drop_env(drop: Drop | dict, warnings: list[str] | None = None) -> dict:
    """The drop's ``env`` (vLLM environment variables); each one no rule reads is named in
    ``warnings`` as not modelled (:data:`tuner.question.drop.MODELLED_ENV`)."""
    from tuner.question.drop import MODELLED_ENV

    env = dict((drop.get("env") if isinstance(drop, dict) else drop.env) or {})
    if warnings is not None:
        for name in sorted(env):
            if name not in MODELLED_ENV:
                note = f"env {name}={env[name]!r} is not modelled: no rule reads it"
                if note not in warnings:
                    warnings.append(note)
        note = _use_v1_note(drop)
        if note and note not in warnings:
            warnings.append(note)
    return env


def _mm_limits(drop: Drop) -> tuple | None:
    """The drop's ``limit_mm_per_prompt`` / ``language_model_only`` as :attr:`RankSettings.mm_limits`."""
    if drop.language_model_only:
        return (("*", 0),)
    if not drop.limit_mm_per_prompt:
        return None
    return tuple(sorted((str(k), int(v)) for k, v in drop.limit_mm_per_prompt.items()))


def _mxfp4_triton_assumption(drop: Drop, spec: Any, era: Any, cards: Sequence[dict]) -> dict | None:
    """The ``triton_kernels_installed`` assumption (:func:`tuner.memory.quant.mxfp4_hopper_triton`)
    where it decides something: an MXFP4 checkpoint on a CUDA Hopper card, the drop not saying."""
    qc = getattr(spec, "quantization_config", None) or {}
    if str(qc.get("quant_method") or "").lower() != "mxfp4":
        return None
    if not any(_platform(c) == "cuda" and str(_compute_capability(c) or "").startswith("9.") for c in cards):
        return None
    from tuner.memory.quant import mxfp4_hopper_triton

    v = era.version
    return mxfp4_hopper_triton((v.major, v.minor, v.patch), drop.triton_kernels_installed)[1]


def rank_settings(drop: Drop, model: LoadedModel, era: Any, device: dict, warnings: list[str]) -> Ranks:
    """Stage 2: the quantization check, the dtype, one :class:`RankSettings` per pipeline stage,
    and what vLLM refuses before loading anything (every plugin): heads / KV heads vs TP, layers
    vs PP."""
    spec, plugin, path = model.spec, model.plugin, drop.path or None
    check_architecture(spec.architectures, version=era.version, path=path)
    warnings.extend(check_quantization(drop.quantization, spec.quantization_config, version=era.version, path=path))
    dtype = resolve_dtype(drop.dtype, spec.torch_dtype)
    kv_dtype = _kv_cache_dtype(drop, spec, era, path, warnings)
    tp, pp = int(drop.tensor_parallel_size), int(drop.pipeline_parallel_size)
    cards = stage_devices(device, pp)
    if era.engine == "V1":  # the attention backends that take an nvfp4 KV cache, by release and card
        from tuner.memory.engine_checks import nvfp4_kv_cache_check

        for card in cards:
            note = nvfp4_kv_cache_check(kv_dtype, version=era.version, compute_capability=_compute_capability(card),
                                        mla=bool((spec.raw or {}).get("kv_lora_rank")), path=path)
            if note and note not in warnings:
                warnings.append(note)
    block_size = drop.block_size if drop.block_size is not None else default_block_size(era, spec, plugin)
    env = drop_env(drop, warnings)
    from tuner.memory.eras import sampler_path

    sampler = sampler_path(era, flashinfer_installed=drop.flashinfer_installed,
                           use_flashinfer_sampler=env.get("VLLM_USE_FLASHINFER_SAMPLER"))
    assumptions = (sampler.assumption,) if sampler.assumption else ()
    triton_assumption = _mxfp4_triton_assumption(drop, spec, era, cards)
    if triton_assumption:
        assumptions += (triton_assumption,)
    stages = [
        RankSettings(engine_version=str(era.version), dtype=dtype, kv_cache_dtype=kv_dtype,
                     block_size=block_size, tensor_parallel_size=tp, pipeline_parallel_size=pp, pp_rank=r,
                     compiled=era.compiled, runs_attention=era.engine == "V0", quantization=drop.quantization,
                     compute_capability=_compute_capability(cards[r]), platform=_platform(cards[r]),
                     data_parallel_size=int(drop.data_parallel_size or 1),
                     enable_expert_parallel=bool(drop.enable_expert_parallel),
                     max_model_len=max(drop.candidates.max_model_len or [model_max_len(spec)[0]]),
                     num_speculative_tokens=num_speculative_tokens(drop, era),
                     mamba_cache_mode=mamba_cache_mode(drop, era, plugin, warnings),
                     flashinfer_sampler=sampler.flashinfer if era.engine == "V1" and era.version < (0, 17, 0)
                     else None,
                     pp_layer_partition=pp_layer_partition(env),
                     triton_kernels_installed=drop.triton_kernels_installed,
                     mm_limits=_mm_limits(drop))
        for r in range(pp)
    ]
    check_drop = getattr(plugin, "check_drop", None)  # what vLLM refuses for this model (the plugin's rule)
    for stage in stages if check_drop is not None else ():
        check_drop(spec, stage, path=path)
    check_parallel_layout(num_attention_heads=spec.num_attention_heads, num_hidden_layers=spec.num_hidden_layers,
                          kv_heads=per_head_kv_totals(plugin, spec, stages[0]) if tp > 1 else (),
                          tensor_parallel_size=tp, pipeline_parallel_size=pp, path=path)
    check_draft_tensor_parallel_size(drop.speculative_config, tensor_parallel_size=tp, engine=era.engine, path=path)
    for a in assumptions:
        warnings.append(f"assumed {a['name']} = {str(a['value']).lower()}: {a['why']}")
    return Ranks(dtype, stages, tp, pp, kv_dtype, assumptions,
                 assumption_alternatives(assumptions, era, env.get("VLLM_USE_FLASHINFER_SAMPLER")))


def assumption_alternatives(assumptions: Sequence[dict], era: Any, use_flashinfer_sampler: Any = None) -> tuple:
    """The ranks' assumptions whose other value has a rule (:func:`tuner.memory.assumed.alternative_settings`):
    their passes run too, and each widens the interval by exactly its effect on the KV."""
    from tuner.memory.assumed import alternative_settings

    out = (alternative_settings(a, era, use_flashinfer_sampler=use_flashinfer_sampler) for a in assumptions)
    return tuple(a for a in out if a is not None)


@dataclasses.dataclass(frozen=True)
class KvLayout:
    """Each pipeline stage's KV specs, the block size and the drafter's weights (stage 4)."""

    specs: tuple
    block_size: int
    drafter_weights_bytes: int
    #: the target's auxiliary hidden states a checkpoint drafter reads, bytes per token.
    drafter_activation_bytes_per_token: int = 0
    #: the drafter's weights, KV layers and profile run are modelled (else a warning says so).
    drafter_modelled: bool = True
    #: the drafter's geometry for its own profile pass and graph captures (:class:`tuner.memory.specdecode.DrafterPass`).
    drafter_pass: Any = None


def kv_specs_for(req: "JobRequest", model: LoadedModel, era: Any, ranks: Ranks, engine_use: Any,
                 warnings: list[str]) -> KvLayout:
    """Stage 4: the plugin's KV specs per stage (the engine's where it gave them), speculative
    decoding's state blocks, MTP layers and another checkpoint's drafter (:mod:`tuner.memory.specdecode`),
    the block size."""
    drop = req.drop
    spec, plugin = model.spec, model.plugin
    kv_specs = tuple(with_kv_quant_mode(plugin.kv_cache_spec(spec, s), ranks.kv_cache_dtype) for s in ranks.stages)
    if engine_use is not None and engine_use.kv_specs is not None:
        kv_specs = (dict(engine_use.kv_specs),)
    spec_cfg = drop.speculative_config or {}
    if spec_cfg and era.engine == "V1":
        from tuner.memory.specdecode import with_speculative_state_blocks

        kv_specs = with_speculative_state_blocks(kv_specs, int(spec_cfg.get("num_speculative_tokens") or 0))
    drafter_weights, drafter_pass = 0, None
    if spec_cfg.get("method") == "mtp" and era.engine == "V1":
        # the checkpoint's MTP layers: KV layers on the last stage, 16-bit weights (tuner.memory.specdecode)
        from tuner.memory.specdecode import drafter_kv_specs, mtp_dense_layer_weights_bytes, mtp_num_layers

        n_mtp = mtp_num_layers(spec.raw)
        extra = drafter_kv_specs(kv_specs[-1], n_mtp, first_layer_index=spec.num_hidden_layers)
        kv_specs = kv_specs[:-1] + ({**kv_specs[-1], **extra},)
        from tuner.memory.specdecode import mtp_drafter_pass

        drafter_pass = mtp_drafter_pass(spec.raw, tensor_parallel_size=ranks.tp, kv_layers=len(extra),
                                        dtype_bytes=_kv_dtype_bytes("auto", ranks.dtype),
                                        num_speculative_tokens=int(spec_cfg.get("num_speculative_tokens") or 0),
                                        data_parallel_size=int(drop.data_parallel_size or 1),
                                        enable_expert_parallel=bool(drop.enable_expert_parallel))
        if config_is_moe(spec.raw):
            from tuner.memory.specdecode import mtp_moe_layer_weights_bytes

            drafter_weights = mtp_moe_layer_weights_bytes(
                spec.raw, tensor_parallel_size=ranks.tp, data_parallel_size=int(drop.data_parallel_size or 1),
                enable_expert_parallel=bool(drop.enable_expert_parallel),
                dtype_bytes=_kv_dtype_bytes("auto", ranks.dtype), quantization_config=spec.quantization_config)
        else:
            drafter_weights = mtp_dense_layer_weights_bytes(spec.raw, tensor_parallel_size=ranks.tp)
    drafter_modelled = spec_cfg.get("method") in ("ngram", "suffix", "mtp")
    drafter_act_per_token = 0
    if spec_cfg.get("method") in CHECKPOINT_DRAFTERS and era.engine == "V1":
        # another checkpoint's drafter, from its config.json (tuner.memory.specdecode)
        drafter_weights, extra, n_aux, note, drafter_pass = _checkpoint_drafter(req, spec_cfg, spec, kv_specs[-1],
                                                                                ranks.tp, ranks.dtype,
                                                                                ranks.stages[-1])
        if note:
            warnings.append(note)
        else:
            drafter_modelled = True
            kv_specs = kv_specs[:-1] + ({**kv_specs[-1], **extra},)
            drafter_act_per_token = n_aux * spec.hidden_size * _kv_dtype_bytes("auto", ranks.dtype)
    first_spec = next(iter(kv_specs[0].values()), None)
    block_size = drop.block_size or (first_spec.block_size if first_spec is not None else 16)
    return KvLayout(kv_specs, block_size, drafter_weights, drafter_act_per_token, drafter_modelled, drafter_pass)


def method_for(req: "JobRequest", cuda_available: Any, warnings: list[str]) -> tuple[str, dict]:
    """Stage 5: the method that runs (``cuda`` without a CUDA torch is refused, or under ``auto``
    simulated with a warning) and the calibration that applies (simulate only)."""
    calibration = dict(req.calibration or {})
    method = req.method or "simulate"
    if method == "cuda" and not cuda_available():
        if req.method_requested != "auto":
            from tuner.errors import MeasureError

            raise MeasureError("torch sees no CUDA device in the worker (method 'cuda' needs a GPU and a CUDA "
                               "build of torch)", where="method cuda")
        warnings.append("method auto: NVML sees a GPU but torch has no CUDA in the worker; simulated instead")
        method = "simulate"
    if method != "simulate":
        calibration = {}  # corrections are learned for the simulate terms only
    return method, calibration


def plugin_cudagraph_warmup_bytes(plugin: Any, spec: Any, stages: Any) -> tuple:
    """Per stage, the plugin's ``cudagraph_warmup_bytes(spec, settings)`` (optional hook: bytes the
    first CUDA-graph capture's warmup allocates beyond the estimate's fit,
    :func:`tuner.memory.search.cudagraph_warmup_extra_bytes`); () for plugins without it."""
    hook = getattr(plugin, "cudagraph_warmup_bytes", None)
    if hook is None:
        return ()
    return tuple(int(hook(spec, s)) for s in stages)


def layout_for(drop: Drop, model: LoadedModel, era: Any, ranks: Ranks, kv: KvLayout, device: dict, method: str,
               calibration: dict, warnings: list[str]) -> Layout:
    """Stage 6: the facts the budget and the search need besides the passes (:class:`tuner.memory.search.Layout`)."""
    spec = model.spec
    total = int(device["total_memory_bytes"])
    derived_max, derived_key = model_max_len(spec)
    overhead = 0 if method == "cuda" else profile_overhead_bytes(_compute_capability(device), era)
    layout = Layout(total, kv.block_size, ranks.tp, ranks.pp, spec.num_hidden_layers, spec.max_position_embeddings,
                    kv.specs,
                    corrections=tuple(sorted((k, int(v)) for k, v in calibration.items() if k.endswith("_delta_bytes"))),
                    activation_overhead_bytes=overhead,
                    hidden_size=spec.hidden_size, derived_max_model_len=derived_max, derived_max_len_key=derived_key,
                    model_max_length=spec.raw.get("model_max_length"), topology=topology_for(device, drop),
                    num_speculative_tokens=num_speculative_tokens(drop, era),
                    drafter_weights_bytes=kv.drafter_weights_bytes,
                    drafter_activation_bytes_per_token=kv.drafter_activation_bytes_per_token,
                    drafter_pass=kv.drafter_pass,
                    other_processes_bytes=other_processes_bytes(device, drop),
                    moe_data_parallel_size=(int(drop.data_parallel_size or 1)
                                            if config_is_moe(spec.raw) or config_is_moe(spec.top) else 1),
                    kv_cache_memory_bytes=_kv_cache_memory_bytes(drop, era),
                    pp_layer_partition=pp_layer_partition(drop_env(drop)),
                    cudagraph_warmup_bytes=plugin_cudagraph_warmup_bytes(model.plugin, model.spec, ranks.stages))
    cards = stage_devices(device, ranks.pp)
    if len({tuple(sorted((k, str(v)) for k, v in c.items())) for c in cards}) > 1:
        # a device list: each stage sized on its own card (tuner.memory.search.evaluate, StageCard)
        from tuner.memory.search import StageCard

        layout = dataclasses.replace(layout, stage_cards=tuple(
            StageCard(name=str(c["name"]), total_memory_bytes=int(c["total_memory_bytes"]),
                      topology=topology_for(c, drop),
                      activation_overhead_bytes=0 if method == "cuda" else profile_overhead_bytes(
                          _compute_capability(c), era))
            for c in cards))
    if _free_memory_from_host(device, era):
        warnings.append(f"vLLM {era.version} reads free memory on this unified-memory device ({device.get('name')}) "
                        "from the host's available memory, not cudaMemGetInfo: RAM that other host processes use is "
                        "co-tenant memory to its start-up check (give it as other_processes_memory_gib)")
    spec_cfg = drop.speculative_config or {}
    if spec_cfg and not kv.drafter_modelled:
        warnings.append(f"speculative_config method {spec_cfg['method']!r}: the drafter's weights, KV layers and "
                        "profile run are not modelled (only its CUDA-graph capture sizes); expect fewer KV blocks "
                        "than predicted")
    from tuner.memory.kvcache import MambaSpec

    # Model Runner V2 or V1 runner (vllm/config/vllm.py use_v2_model_runner, 0.22+).
    runner_v2 = uses_model_runner_v2(
        era, spec.architectures, is_moe=config_is_moe(spec.raw) or config_is_moe(spec.top),
        is_hybrid=any(isinstance(x, MambaSpec) for specs in kv.specs for x in specs.values()),
        is_attention_free=not any(kv_specs_i for kv_specs_i in kv.specs),
        is_quantized=bool(spec.quantization_config or drop.quantization),
        speculative_method=(drop.speculative_config or {}).get("method"), platform=_platform(device))
    runner_v2 = _runner_asked_for(drop, era, runner_v2, warnings)
    said = runner_default_assumption(drop, era, runner_v2, spec.architectures)
    if said is not None:
        warnings.append(f"assumed {said['name']}: {said['value']} ({said['note']})")
    return dataclasses.replace(layout, model_runner_v2=runner_v2,
                               free_memory_from_host=_free_memory_from_host(device, era),
                               kv_cache_dtype=str(ranks.kv_cache_dtype or "auto"),
                               num_attention_heads_per_rank=int(spec.num_attention_heads or 0) // max(1, ranks.tp))


#: Model Runner V2's first release modelled here (:func:`tuner.memory.eras.uses_model_runner_v2`).
MODEL_RUNNER_V2_MODELLED_FROM = (0, 22, 0)
#: The release that removed the V1 model runner: ``VLLM_USE_V2_MODEL_RUNNER`` other than 1 is an
#: error (vllm/platforms/interface.py ``validate_environ``, 0.34.0).
V1_RUNNER_REMOVED_IN = (0, 34, 0)


def runner_default_assumption(drop: Drop, era, runner_v2: bool, architectures) -> dict | None:
    """The model runner the release's default picked, where the drop did not choose one
    (``use_v2_model_runner`` / ``VLLM_USE_V2_MODEL_RUNNER``) and the release has two (V1 0.22+): an
    assumption line (``effect`` ``modelled``: the release's rule, not a band; the job result's
    ``assumptions``) — the runners budget differently (V2: no CUDA-graph estimate subtracted)."""
    from tuner.memory.eras import _env_flag

    if era is None or era.engine != "V1" or era.version < MODEL_RUNNER_V2_MODELLED_FROM:
        return None
    if drop.use_v2_model_runner is not None or _env_flag((drop.env or {}).get("VLLM_USE_V2_MODEL_RUNNER")) is not None:
        return None
    arch = ", ".join(architectures or ()) or "this model"
    name = "Model Runner V2" if runner_v2 else "the V1 model runner"
    if era.version >= V1_RUNNER_REMOVED_IN:
        why = f"the only runner of vLLM {era.version}: Model Runner V1 has been removed"
    else:
        other = "0 selects the V1 runner" if runner_v2 else "1 selects Model Runner V2"
        why = (f"vLLM {era.version}'s default for {arch}, vllm/config/vllm.py use_v2_model_runner as "
               f"tuner/memory/eras.py uses_model_runner_v2 reads it; VLLM_USE_V2_MODEL_RUNNER={other}")
    return {"name": "model runner", "value": name, "where": "release default", "effect": "modelled",
            "note": why, "kind": "release_default"}


def _runner_asked_for(drop: Drop, era, default_v2: bool, warnings: list) -> bool:
    """The runner vLLM runs: the drop's ``use_v2_model_runner`` (as ``VLLM_USE_V2_MODEL_RUNNER``)
    over the release's default for the model.

    Raises:
        DropError: V2 asked for before it is modelled (0.22), or V1 asked for where vLLM removed it.
    """
    asked = drop.use_v2_model_runner
    if asked is None:  # the same variable given in the drop's env
        from tuner.memory.eras import _env_flag

        asked = _env_flag((drop.env or {}).get("VLLM_USE_V2_MODEL_RUNNER"))
    if asked is None or era.engine != "V1":
        return default_v2
    from tuner.errors import DropError

    if asked and era.version < MODEL_RUNNER_V2_MODELLED_FROM:
        raise DropError(f"Model Runner V2 on vLLM {era.version} is not modelled (its memory rules are read from "
                        "0.22 on)", path=drop.path or None, field="use_v2_model_runner")
    if not asked and era.version >= V1_RUNNER_REMOVED_IN:
        raise DropError("VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported: Model Runner V1 has been removed. "
                        f"Unset this variable. (vLLM {era.version})", path=drop.path or None,
                        field="use_v2_model_runner")
    if bool(asked) != bool(default_v2):
        warnings.append(f"use_v2_model_runner {str(bool(asked)).lower()}: vLLM {era.version} runs "
                        f"{'Model Runner V2' if asked else 'the V1 model runner'} (its default for this model is "
                        f"{'Model Runner V2' if default_v2 else 'the V1 runner'})")
    return bool(asked)


class Passes:
    """Stage 7: the era's profile batch for a ``max_model_len`` and the profile passes for a batch
    (one per pipeline stage), memoized per (N, R): under V1 one pass serves every candidate.
    ``runs`` lists every pass run, in order.

    A pass comes from the pass memo where it is known (``pass_memo``, the parent answering in
    process, or the request's ``known_passes``, handed to the worker); else it is run (an
    unserved architecture: vLLM's own profile run traced, ``engine_use.run_pass``) and, with
    ``memo_entries`` (a memoizable job), recorded there. ``engine_batch``: the engine's scheduler
    defaults the batch uses for what the drop leaves unset (:func:`tuner.engine.use.reconcile_defaults`)."""

    def __init__(self, req: "JobRequest", model: LoadedModel, era: Any, ranks: Ranks, layout: Layout,
                 method: str, *, engine_use: Any = None, pass_memo: Any = None,
                 memo_entries: list | None = None) -> None:
        self.req, self.model, self.era, self.ranks, self.layout, self.method = req, model, era, ranks, layout, method
        self.engine_use, self.pass_memo, self.memo_entries = engine_use, pass_memo, memo_entries
        self.known_passes = dict(req.known_passes or {})
        self.engine_batch: dict = {}
        self.memo: dict[tuple, list] = {}
        self.models = None
        if pass_memo is None:
            from tuner.model.simulate.profile import ModelCache

            self.models = ModelCache()  # V0 runs one pass per length: each rank's module is built once
        self.runs: list[dict] = []
        self.is_multimodal = "text_config" in model.spec.top

    def batch_for(self, m: int):
        d, spec, era = self.req.drop, self.model.spec, self.era
        device = stage_devices(self.req.device, self.ranks.pp)[0]  # the engine's defaults read GPU 0
        batch = profile_batch(era, max_model_len=m, entry_point=d.entry_point,
                              device_name=device["name"], total_memory_bytes=int(device["total_memory_bytes"]),
                              compute_capability=_compute_capability(device),
                              max_num_batched_tokens=d.max_num_batched_tokens
                              or self.engine_batch.get("max_num_batched_tokens"),
                              max_num_seqs=d.max_num_seqs or self.engine_batch.get("max_num_seqs"),
                              enable_chunked_prefill=d.enable_chunked_prefill,
                              has_sliding_window=v0_uses_sliding_window(spec.sliding_window,
                                                                         spec.raw.get("use_sliding_window")),
                              is_multimodal=self.is_multimodal,
                              mm_prefix_lm_item_tokens=mm_prefix_lm_item_tokens(
                                  spec.top, version=era.version,
                                  text_only=bool(_mm_limits(d)) and all(n == 0 for _m, n in _mm_limits(d))))
        # vLLM's SchedulerConfig: N >= S once the era's defaults are applied.
        check_batch(engine=era.engine, max_num_batched_tokens=batch.max_num_batched_tokens,
                    max_num_seqs=batch.max_num_seqs, chunked_prefill=batch.chunked_prefill,
                    user_max_num_batched_tokens=d.max_num_batched_tokens,
                    user_max_num_seqs=d.max_num_seqs, path=d.path or None)
        if d.speculative_config:  # vLLM's _set_max_num_scheduled_tokens (tuner.memory.specdecode)
            from tuner.memory.specdecode import check_drafting_slots

            check_drafting_slots(d.speculative_config, version=era.version, engine=era.engine,
                                 max_num_batched_tokens=batch.max_num_batched_tokens,
                                 max_num_seqs=batch.max_num_seqs, path=d.path or None)
        return batch

    def batch_stage(self, s: Any, batch: Any) -> Any:
        """A stage's settings for ``batch`` (at the grid's largest length, as its pass is run or stored)."""
        grid = self.req.drop.candidates.max_model_len or [self.layout.max_model_len_limit]
        return dataclasses.replace(s, max_num_batched_tokens=batch.max_num_batched_tokens,
                                   max_num_seqs=batch.max_num_seqs, max_model_len=max(grid))

    def one_pass(self, s: Any, batch: Any) -> tuple[Any, dict]:
        """One stage's pass for ``batch`` (settings ``s`` from :meth:`batch_stage`): from the memo where
        it is known, else run (and, in a memoizable job, recorded). Returns the pass and its row."""
        from tuner.jobs import passmemo

        spec, plugin, era = self.model.spec, self.model.plugin, self.era
        runner_v2, memo, known = self.layout.model_runner_v2, self.pass_memo, self.known_passes
        memoizable = memo is not None or self.memo_entries is not None
        card = stage_devices(self.req.device, self.ranks.pp)[s.pp_rank]["name"]
        pkey = (passmemo.pass_key(spec=spec, plugin=plugin, settings=s, era=era, batch=batch, fake=True,
                                  model_runner_v2=runner_v2, device_name=card)
                if memoizable else None)
        if pkey is not None and (memo is not None or pkey in known):
            # a stored pass: only the runner's persistent buffers depend on max_model_len; here at the
            # grid's largest, like a pass run now (each length's own in passes_at)
            stored = memo.pass_row(pkey) if memo is not None else known[pkey]
            row = passmemo.with_persistent(stored, persistent_bytes(era, spec, s, batch, runner_v2))
            return row, row
        if self.method == "cuda":  # the same module and batch on the GPU (tuner.measure.cuda)
            from tuner.measure.cuda import measured_pass

            r = measured_pass(plugin, spec, s, era, batch)
            return r, {**r, "method": "cuda"}
        # an unserved architecture: vLLM's own profile run traced (tuner.engine.use)
        from tuner.model.simulate.profile import run_pass

        eu = self.engine_use
        run = eu.run_pass if eu is not None and eu.trace_activation else run_pass
        r = run(plugin, spec, s, era, batch, fake=self.req.fake, model_runner_v2=runner_v2, models=self.models)
        row = {**r.to_dict(), "method": "simulate"}
        if pkey is not None:
            self.memo_entries.append(passmemo.entry(passmemo.PASS, pkey, row, spec=spec, device_name=card,
                                                    era=era.name))
        return r, row

    def passes_for(self, batch):
        key = (batch.max_num_batched_tokens, batch.num_reqs)
        if key not in self.memo:
            results = []
            for s in self.ranks.stages:
                s = self.batch_stage(s, batch)
                r, row = self.one_pass(s, batch)
                results.append(r)
                self.runs.append({"key": f"{key[0]}x{key[1]}@{s.pp_rank}", "pass": key, **row,
                                  "max_num_seqs": batch.max_num_seqs})
            self.check_encoder_budget(batch, results)
            self.memo[key] = results
        return self.memo[key]

    def computes_alternatives(self) -> bool:
        """Whether the assumptions' other values are computed here: simulated passes (a traced engine
        profile or a measured pass follows the installed packages, not the assumption)."""
        eu = self.engine_use
        return bool(self.ranks.alternatives) and self.method == "simulate" and not (
            eu is not None and (eu.trace_activation or eu.traced))

    def alternatives_for(self, batch) -> list[tuple]:
        """Per stage, each computed assumption's change of the pass (:class:`tuner.memory.assumed.AlternativeSettings`
        applied to the stage's settings, its pass run or read like the point's, never listed in
        ``runs``): ``{"name", "value", "alternative", "source", "weights_delta_bytes",
        "activation_peak_delta_bytes"}`` each (alternative less point, at the same length)."""
        key = (batch.max_num_batched_tokens, batch.num_reqs, "alternatives")
        if key not in self.memo:
            points = self.passes_for(batch)
            out = []
            for s, p in zip(self.ranks.stages, points):
                s = self.batch_stage(s, batch)
                deltas = []
                for alt in (self.ranks.alternatives if self.computes_alternatives() else ()):
                    dw = da = 0
                    if alt.changes(s):
                        q, _row = self.one_pass(alt.apply(s), batch)
                        dw = int(_pass_field(q, "weights_bytes")) - int(_pass_field(p, "weights_bytes"))
                        da = (int(_pass_field(q, "activation_peak_bytes")) - int(_pass_field(q, "persistent_bytes"))
                              - int(_pass_field(p, "activation_peak_bytes")) + int(_pass_field(p, "persistent_bytes")))
                    deltas.append({"name": alt.name, "value": alt.value, "alternative": alt.alternative,
                                   "source": alt.source, "weights_delta_bytes": dw, "activation_peak_delta_bytes": da})
                out.append(tuple(deltas))
            self.memo[key] = out
        return self.memo[key]

    def check_encoder_budget(self, batch, results: list) -> None:
        """vLLM's encoder-budget refusal (:func:`tuner.memory.engine_checks.check_chunked_mm_input`)
        with the largest item's tokens the passes report (``mm_max_tokens_per_item``). Checked only
        where ``max_num_batched_tokens`` does not depend on ``max_model_len`` (the drop sets it, or
        V1 with chunked prefill), so one verdict holds for every candidate, as :func:`check_batch`."""
        from tuner.memory.engine_checks import check_chunked_mm_input

        d, era = self.req.drop, self.era
        if d.max_num_batched_tokens is None and not (era.engine == "V1" and batch.chunked_prefill):
            return
        tokens = max((int((p.get("mm_max_tokens_per_item") if isinstance(p, dict)
                           else getattr(p, "mm_max_tokens_per_item", 0)) or 0) for p in results), default=0)
        check_chunked_mm_input(max_tokens_per_item=tokens, max_num_batched_tokens=batch.max_num_batched_tokens,
                               disable_chunked_mm_input=bool(d.disable_chunked_mm_input),
                               model_type=self.model.spec.top.get("model_type"), engine=era.engine,
                               version=era.version, user_max_num_batched_tokens=d.max_num_batched_tokens,
                               path=d.path or None)

    def passes_at(self, batch, m: int) -> list:
        """The passes for ``batch`` (:meth:`passes_for`) as they stand at ``max_model_len`` ``m``:
        each pass's runner persistent buffers (V1 0.27+, whose block table is ``[S, cdiv(m, bs)]``,
        :func:`tuner.memory.budget.runner_persistent_bytes`) recomputed at ``m`` — a pass is run (or
        stored) once at the grid's largest length and serves every length, the grid's and the
        proposal search's off-grid ones. A pass without the term (a measured ``cuda`` pass) is
        returned as it is."""
        spec, era, runner_v2 = self.model.spec, self.era, self.layout.model_runner_v2
        out = []
        for s, p, alts in zip(self.ranks.stages, self.passes_for(batch), self.alternatives_for(batch)):
            old = p.get("persistent_bytes") if isinstance(p, dict) else getattr(p, "persistent_bytes", None)
            if old is not None:
                s = dataclasses.replace(s, max_num_batched_tokens=batch.max_num_batched_tokens,
                                        max_num_seqs=batch.max_num_seqs, max_model_len=int(m))
                p = _with_persistent(p, persistent_bytes(era, spec, s, batch, runner_v2))
            if alts:  # the assumptions' computed alternatives (tuner.memory.search.evaluate bands them)
                p = ({**p, "assumed_alternatives": alts} if isinstance(p, dict)
                     else dataclasses.replace(p, assumed_alternatives=alts))
            out.append(p)
        return out

    def evaluate(self, layout: Layout, u: float, m: int, min_concurrency: float):
        """The candidate at one point (through the memoized passes, at its own length)."""
        batch = self.batch_for(m)
        return evaluate(self.era, layout, batch, self.passes_at(batch, m), gpu_memory_utilization=u,
                        max_model_len=m, min_concurrency=min_concurrency)


def _pass_field(p: Any, key: str) -> Any:
    """A pass's field (a row dict or a :class:`tuner.model.simulate.profile.PassResult`), 0 where it lacks it."""
    v = p.get(key) if isinstance(p, dict) else getattr(p, key, None)
    return v or 0


def _with_persistent(p: Any, persistent: int) -> Any:
    """A pass (a row dict or a :class:`tuner.model.simulate.profile.PassResult`) with its runner
    persistent buffers replaced by ``persistent`` bytes (:func:`tuner.jobs.passmemo.with_persistent`)."""
    from tuner.jobs import passmemo

    if isinstance(p, dict):
        return passmemo.with_persistent(p, persistent)
    old = int(p.persistent_bytes or 0)
    if old == int(persistent):
        return p
    return dataclasses.replace(p, activation_peak_bytes=int(p.activation_peak_bytes) - old + int(persistent),
                               persistent_bytes=int(persistent))


def search_points(req: "JobRequest", era: Any, layout: Layout, passes: Passes,
                  t_start: float, *, pass_memo: Any = None) -> tuple[list[dict], list[dict]]:
    """Stage 8: per ``gpu_memory_utilization``, the proposal (:func:`tuner.memory.search.propose` over the
    regions :func:`tuner.memory.search.search_regions` gives; with a calibration also ``uncalibrated``)
    and the candidates: the drop's grid, else every length the search evaluated. One progress line
    per u with ``progress`` (answered from the pass memo: kept in ``pass_memo.progress`` for the
    caller, where it wants them)."""
    d = req.drop
    min_conc = float(d.constraints.min_concurrency or 1.0)
    grid_m = d.candidates.max_model_len
    regions, cap = search_regions(era, derived_max=layout.max_model_len_limit,
                                  enable_chunked_prefill=d.enable_chunked_prefill,
                                  max_num_batched_tokens=d.max_num_batched_tokens,
                                  max_model_len_cap=d.constraints.max_model_len_cap, grid=grid_m, path=d.path or None)
    candidates, proposals = [], []
    us = d.candidates.gpu_memory_utilization or [era.default_gpu_memory_utilization]
    uncalibrated = dataclasses.replace(layout, corrections=())
    for u in us:
        searched = []
        if req.search or not grid_m:
            kw = dict(gpu_memory_utilization=u, batch_for=passes.batch_for, passes_at=passes.passes_at,
                      min_concurrency=min_conc, max_model_len_cap=cap, regions=regions, extra_args=_extra_args(d),
                      risk=d.constraints.risk)
            prop, searched = propose(era, layout, **kw)
            proposals.append(prop.to_dict())
            if layout.corrections:
                prop0, _ = propose(era, uncalibrated, **kw)
                proposals[-1]["uncalibrated"] = prop0.to_dict()
        for m in (grid_m or sorted({c.max_model_len for c in searched})):
            batch = passes.batch_for(m)
            c = passes.evaluate(layout, u, m, min_conc).to_dict()
            c["run_key"] = f"{batch.max_num_batched_tokens}x{batch.num_reqs}@{int(c.get('limiting_stage') or 0)}"
            if layout.corrections:
                c["uncalibrated"] = passes.evaluate(uncalibrated, u, m, min_conc).to_dict()
            candidates.append(c)
        if req.progress or (pass_memo is not None and pass_memo.progress is not None):
            # one line per u on stderr; the parent relays it (tuner.seam.worker); from the memo, kept for the caller
            from tuner.seam.worker import PROGRESS_PREFIX

            done = len(proposals) or len({point_of(x).gpu_memory_utilization for x in candidates})
            line = (f"gpu_memory_utilization {u:g} done ({done}/{len(us)}), {len(passes.runs)} passes, "
                    f"{time.perf_counter() - t_start:.1f} s")
            if pass_memo is not None:
                pass_memo.progress.append(line)
            else:
                print(f"{PROGRESS_PREFIX}{line}", file=sys.stderr, flush=True)
    return candidates, proposals


def verify_with_engine(engine_use: Any, era: Any, layout: Layout, passes: Passes, proposals: list[dict], pp: int,
                       warnings: list[str]) -> None:
    """Stage 9: the proposals checked against vLLM's own ``kv_cache_utils`` (installed engine);
    a disagreement on the same release is a warning."""
    from tuner.engine.use import verify_proposals

    min_conc = float(passes.req.drop.constraints.min_concurrency or 1.0)

    def available_at(u: float, m: int) -> int | None:
        return passes.evaluate(layout, u, m, min_conc).available_kv_cache_bytes

    verify_proposals(engine_use, proposals, available_at)
    runs = passes.runs
    if engine_use.report.get("weights") and runs and pp == 1:
        engine_use.report["weights"]["job_bytes"] = int(runs[0]["weights_bytes"])  # what the budget used
    for v in engine_use.report.get("proposals", []):
        if not v["agree"] and engine_use.report.get("releases_match", False):
            u, m = point_of(v)
            warnings.append(f"gmu {u:g}, max_model_len {m}: vLLM's "
                            f"kv_cache_utils gives {v['engine'].get('num_gpu_blocks')} blocks, ctx-tuner "
                            f"{v['ctx_tuner_num_gpu_blocks']}")


def measure(req: "JobRequest", era: Any, method: str, passes: Passes, candidates: list[dict], proposals: list[dict],
            total: int, warnings: list[str]) -> list[dict]:
    """Stage 10: ``cuda``: vLLM's refusal where free memory < total × u
    (:func:`tuner.measure.cuda.refuse_below_free_memory`); ``vllm``: the engine itself, with dummy
    weights, started for each needed candidate (one dict per start-up, also set as the matching
    candidate's ``measured``)."""
    runs = passes.runs
    measured: list[dict] = []
    if method == "cuda" and runs:
        from tuner.measure.cuda import refuse_below_free_memory

        refuse_below_free_memory(era, candidates, proposals=proposals,
                                 free_memory_bytes=min(r["free_memory_bytes"] for r in runs),
                                 total_memory_bytes=runs[0]["total_memory_bytes"])
        if abs(runs[0]["total_memory_bytes"] - total) > total // 100:
            warnings.append(f"method cuda ran on a GPU of {runs[0]['total_memory_bytes'] / GiB:.2f} GiB; the budget "
                            f"uses the drop's device total ({total / GiB:.2f} GiB)")
    if method == "vllm":
        from tuner.measure.vllm_engine import measure_candidates, needed_candidates

        d = req.to_wire()["drop"]
        model_dir = str(Path(req.config_path).parent)
        measured = measure_candidates(model_dir, d, needed_candidates(d, proposals),
                                      timeout_s=float(req.engine_timeout_s or 900.0))
        for mr in measured:
            at = point_of(mr)
            b = passes.batch_for(at.max_model_len)
            mr.update(max_num_batched_tokens=b.max_num_batched_tokens, max_num_seqs=b.max_num_seqs, num_reqs=b.num_reqs)
            for c in candidates:
                if point_of(c) == at:
                    c["measured"] = {k: v for k, v in mr.items() if k not in ("source",)}
    return measured


def job_result(*, method: str, calibration: dict, layout: Layout, measured: list, model: LoadedModel,
               warnings: list[str], sources: dict, engine_use: Any, era: Any, dtype: str, kv: KvLayout, runs: list,
               candidates: list[dict], proposals: list[dict], versions: dict, elapsed_s: float,
               total: int, assumptions: list | None = None, uncertainty: Any = None) -> dict[str, Any]:
    """Stage 11: the job's :class:`tuner.question.protocol.JobResult`, as its wire object (each candidate and
    proposal with its ``budget`` ledger, sources from ``term_sources``)."""
    from tuner.question.protocol import JobResult

    data = {
        "method": method,
        "calibration": ({k: int(v) for k, v in calibration.items() if k.endswith("_delta_bytes")}
                        | {"runs": int(calibration.get("runs", 0))}) if layout.corrections else None,
        "measured": measured,
        "model": model.spec.to_dict(),
        "plugin": model.plugin.name,
        "warnings": warnings,
        # inputs the drop left open and what was assumed for them ({name, value, why})
        "assumptions": list(assumptions or []),
        "term_sources": sources,
        # what the prediction does not know (tuner.memory.uncertainty): inputs with no rule, the device total's source
        "uncertainty": uncertainty.to_dict() if uncertainty is not None else None,
        "engine_check": engine_use.report if engine_use is not None else None,
        "era": era.name,
        "engine": era.engine,
        "dtype": dtype,
        "block_size": kv.block_size,
        "model_runner_v2": layout.model_runner_v2,
        "kv_block_bytes": kv_block_bytes(era, kv.specs, kv.block_size),
        "runs": runs,
        "candidates": candidates,
        "proposals": proposals,
        # --kv-cache-memory-bytes: the KV bytes as given (the ledgers' balancing term)
        "kv_cache_memory_bytes": layout.kv_cache_memory_bytes,
        "versions": versions,
        "elapsed_s": elapsed_s,
        "total_memory_gib": round(total / GiB, 2),
    }
    return JobResult.from_wire(data).to_wire()

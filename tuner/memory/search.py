"""Candidate evaluation and the max_model_len search (pure: no torch, no I/O).

``evaluate`` turns one profile pass per pipeline stage into vLLM's verdict for one
(``gpu_memory_utilization``, ``max_model_len``) point: budget → blocks → tokens → concurrency →
does it start. ``propose`` finds, per ``gpu_memory_utilization``, the largest block-multiple
(or capped) ``max_model_len`` that starts with ``min_concurrency`` full-length requests. The fit is monotone in
``max_model_len`` only inside a region where the profile batch does not change shape; where the
era makes the batch depend on ``max_model_len`` (V0 without chunked prefill, the 32768-token
chunked-prefill switch) each region is searched on its own, so a non-monotone surface (20k fits,
29k fails, 35k fits) is found rather than assumed away (DESIGN §6).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from tuner.memory import kvcache
from tuner.memory.attention import flashinfer_graph_workspace_bytes, full_graphs_captured
from tuner.memory.budget import (co_tenant_non_torch_bytes, cudagraph_estimate_bytes, extensible_kv_budget,
                          free_memory_refusal, kv_budget, moe_dp_group_bytes, platform_of, startup_baseline_bytes,
                          non_torch_bytes, Topology, uma_host_buffer_bytes, unexplained_bytes)
from tuner.memory.eras import V1_CONSUMED, Era, ProfileBatch
from tuner.errors import KVCacheError, TunerError
from tuner.memory.ledger import Proposal  # noqa: F401 - the one definition (the wire's typed fields too)


@dataclass(frozen=True)
class StageCard:
    """The card one pipeline stage runs on, where a drop's device list gives each stage its own
    (:attr:`Layout.stage_cards`): its name, the total memory the engine sees (bytes, times
    ``gpu_memory_utilization`` on that card), its TP group's topology and the cuBLAS workspace of
    its compute capability (:func:`tuner.memory.budget.profile_overhead_bytes`)."""

    name: str
    total_memory_bytes: int
    topology: object = None
    activation_overhead_bytes: int = 0


@dataclass(frozen=True)
class Layout:
    """What the search needs besides passes (per-rank facts, bytes as ints)."""

    total_memory_bytes: int
    block_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_layers: int
    max_position_embeddings: int
    kv_specs: tuple  # one dict[str, spec] per pipeline stage
    #: Byte corrections learned from measured runs (:mod:`tuner.jobs.calibrate`), added to the
    #: predicted terms: ``activation_peak_delta_bytes``, ``non_torch_delta_bytes``,
    #: ``cuda_graph_delta_bytes``. Empty = uncalibrated.
    corrections: tuple = ()
    #: Torch peak a real profile run adds beyond the simulated passes (the cuBLAS workspace,
    #: :func:`tuner.memory.budget.profile_overhead_bytes`; :func:`tuner.memory.budget.unexplained_bytes` is added
    #: per stage from its weights), bytes.
    activation_overhead_bytes: int = 0
    #: The model's hidden size (elements), for the CUDA-graph estimate.
    hidden_size: int = 4096
    #: The longest ``max_model_len`` vLLM accepts for this model (:func:`derived_max_model_len`);
    #: 0 = ``max_position_embeddings``. Longer lengths are refused before any profiling.
    derived_max_model_len: int = 0
    #: The config key the derived maximum comes from (named in vLLM's refusal).
    derived_max_len_key: str = "max_position_embeddings"
    #: The config's ``model_max_length`` (None when absent), also named in the refusal.
    model_max_length: int | None = None
    #: The TP group's interconnect and custom all-reduce (:class:`tuner.memory.budget.Topology`); None =
    #: the calibration centre (H100 SXM, NVSwitch) for direct callers; a job always sets it
    #: (:func:`tuner.jobs.job.topology_for`: an unknown card is PCIe without P2P).
    topology: object = None
    #: Speculative decoding's draft tokens per request (1 + k tokens per decode step size the
    #: CUDA-graph captures, :func:`tuner.memory.budget.cudagraph_capture_sizes`).
    num_speculative_tokens: int = 0
    #: Weights of a speculative-decoding drafter loaded on the last pipeline stage (MTP layers,
    #: :mod:`tuner.memory.specdecode`), bytes, added to that stage's weights.
    drafter_weights_bytes: int = 0
    #: Bytes per batched token a drafter adds to the last stage's profile peak: the target's
    #: auxiliary hidden states an EAGLE3 / DFlash drafter reads (:func:`tuner.memory.specdecode.aux_hidden_state_layers`
    #: × hidden × dtype), alive through the forward and the drafter's dummy run.
    drafter_activation_bytes_per_token: int = 0
    #: The drafter's geometry for its own forward in the profile run and its CUDA-graph captures
    #: (:class:`tuner.memory.specdecode.DrafterPass`, last stage); None = no drafter model.
    drafter_pass: object = None
    #: GPU memory other processes hold at start (co-tenants), bytes (:func:`tuner.memory.budget.free_memory_refusal`,
    #: :func:`tuner.memory.budget.co_tenant_non_torch_bytes`).
    other_processes_bytes: int = 0
    #: Data-parallel ranks whose MoE layers dispatch and combine over the DP group in the profile
    #: (``data_parallel_size`` for a MoE model, else 1): :func:`tuner.memory.budget.moe_dp_group_bytes`.
    moe_data_parallel_size: int = 1
    #: ``--kv-cache-memory-bytes`` (V1 0.10.2+): the KV cache bytes per GPU as given; the profile
    #: still runs but its terms no longer size the cache and ``gpu_memory_utilization`` is ignored
    #: (vllm/v1/worker/gpu_worker.py ``determine_available_memory``). None = sized by the budget.
    kv_cache_memory_bytes: int | None = None
    #: ``VLLM_PP_LAYER_PARTITION`` (layers per stage) or None (vLLM's even split).
    pp_layer_partition: tuple | None = None
    #: The release runs Model Runner V2 for this model (:func:`tuner.memory.eras.uses_model_runner_v2`):
    #: with async scheduling it keeps pp + 1 batches in flight (:func:`tuner.memory.kvcache.max_in_flight_tokens`).
    model_runner_v2: bool = False
    #: The release reads free memory from the host on this device (unified memory,
    #: :func:`tuner.memory.budget.free_memory_from_host`): host RAM the runner takes counts as consumed
    #: (:func:`tuner.memory.budget.uma_host_buffer_bytes`).
    free_memory_from_host: bool = False
    #: One :class:`StageCard` per pipeline stage when the stages run on different cards (a drop's
    #: device list); empty = every stage on ``total_memory_bytes`` / ``topology``.
    stage_cards: tuple = ()
    #: What the prediction does not know (:class:`tuner.memory.uncertainty.Context`: the terms' sources,
    #: whether the device total was stated, the inputs with no rule); None = every term from its
    #: default source (plugin, catalog), nothing unmodelled.
    uncertainty: object = None
    #: The KV cache dtype the release runs (``auto`` resolved, :func:`tuner.jobs.job._kv_cache_dtype`): it
    #: decides the attention backend (:func:`tuner.memory.attention.selects_flashinfer`).
    kv_cache_dtype: str = "auto"
    #: The rank's query heads (``num_attention_heads // tensor_parallel_size``): FlashInfer's workspace
    #: from 0.26 (:func:`tuner.memory.attention.workspace_buffer_bytes`); 0 = unknown (the default size).
    num_attention_heads_per_rank: int = 0
    #: Per pipeline stage, bytes the first CUDA-graph capture's warmup allocates that the fit of
    #: :func:`tuner.memory.budget.cudagraph_estimate_bytes` does not stand for (a plugin's
    #: ``cudagraph_warmup_bytes``, e.g. DeepSeek-V4's dummy indexer logits); added where the V1
    #: runner's estimate is subtracted (:func:`cudagraph_warmup_extra_bytes`). Empty = none.
    cudagraph_warmup_bytes: tuple = ()

    def card(self, stage: int) -> StageCard:
        """The card ``stage`` runs on (the layout's own device when no device list gives one)."""
        if self.stage_cards:
            return self.stage_cards[stage]
        return StageCard("", self.total_memory_bytes, self.topology, self.activation_overhead_bytes)

    @property
    def max_model_len_limit(self) -> int:
        """The derived maximum vLLM checks a user-specified ``max_model_len`` against."""
        return int(self.derived_max_model_len or self.max_position_embeddings)


#: vLLM's config keys for the model's maximum length, in its order
#: (vllm/transformers_utils/model_arch_config_convertor.py ``derive_max_model_len_and_key``).
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")


def derived_max_model_len(text_config: dict, *, model_type: str = "") -> tuple[int, str]:
    """vLLM's derived ``max_model_len`` and the key it comes from (vllm/config/model.py
    ``_get_and_verify_max_len``, 0.19): the smallest of :data:`MAX_LEN_KEYS` present in the
    text config (``model_max_length`` wins when set), 2048 when none is; then the RoPE scaling
    factor rule: for a ``rope_scaling``/``rope_parameters`` type other than ``su``, ``longrope``
    and ``llama3`` the length is multiplied by its ``factor`` (``yarn`` starting from
    ``original_max_position_embeddings``); Gemma 3 is already scaled. The tokenizer's
    ``model_max_length`` (tokenizer_config.json) is not read. Pure."""
    derived, key = float("inf"), None
    for k in MAX_LEN_KEYS:
        v = text_config.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            if v < derived:
                key = k
            derived = min(derived, v)
    mml = text_config.get("model_max_length")
    if isinstance(mml, (int, float)) and not isinstance(mml, bool) and mml > 0:
        derived, key = mml, "model_max_length"
    if derived == float("inf"):
        derived, key = 2048, "default"
    rope = text_config.get("rope_parameters") or text_config.get("rope_scaling")
    if isinstance(rope, dict) and rope and "gemma3" not in (model_type or str(text_config.get("model_type") or "")):
        nested = all(isinstance(v, dict) for v in rope.values())
        factor = 1.0
        for rp in (rope.values() if nested else [rope]):
            rtype = rp.get("rope_type") or rp.get("type") or "default"
            if rtype not in ("su", "longrope", "llama3"):
                f = rp.get("factor", factor)
                factor = f
                if rtype == "yarn" and rp.get("original_max_position_embeddings"):
                    derived = rp["original_max_position_embeddings"]
        derived = derived * (1.0 if factor is None else float(factor))
    return int(derived), key or "max_position_embeddings"


def max_len_refusal(max_model_len: int, derived: int, key: str, model_max_length: int | None = None) -> str:
    """vLLM's refusal of a ``max_model_len`` above the derived maximum (its wording, 0.19)."""
    return (f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
            f"({key}={derived} or model_max_length={model_max_length} in model's config.json). To allow "
            "overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.")


@dataclass(frozen=True)
class Candidate:
    """vLLM's verdict for one grid point (bytes per rank; the stage with the fewest blocks)."""

    gpu_memory_utilization: float
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    #: Starts and meets the drop's constraints (``min_concurrency``): what proposals require.
    fits: bool
    reason: str | None
    requested_memory_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int
    available_kv_cache_bytes: int
    num_gpu_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    #: The part of ``activation_peak_bytes`` that is the calibrated reserve for start-up memory
    #: no term explains (:func:`tuner.memory.budget.unexplained_bytes`), bytes.
    reserve_bytes: int = 0
    #: vLLM's own verdict: the engine starts (it may still miss ``min_concurrency``; ``fits``).
    starts: bool = True
    #: The part of ``activation_peak_bytes`` that is the cuBLAS workspace (and, 0.27+, nothing
    #: else: :attr:`Layout.activation_overhead_bytes`), bytes.
    workspace_bytes: int = 0
    #: Calibration corrections included in the activation peak, non-torch and CUDA-graph terms
    #: (measured - predicted, from :mod:`tuner.jobs.calibrate`; after the clamp at 0), bytes.
    activation_correction_bytes: int = 0
    non_torch_correction_bytes: int = 0
    cuda_graph_correction_bytes: int = 0
    #: The part of ``weights_bytes`` that is a speculative-decoding drafter's (last stage), bytes.
    drafter_weights_bytes: int = 0
    #: The part of ``activation_peak_bytes`` that is a drafter's (the aux hidden states), bytes.
    drafter_activation_bytes: int = 0
    #: The pipeline stage whose numbers these are: the one with the fewest blocks of its own
    #: (vLLM sizes every worker to the minimum, ``get_kv_cache_configs``).
    limiting_stage: int = 0
    #: Each stage's own terms and blocks before the minimum (PP > 1 only; dicts, bytes):
    #: ``pp_rank``, ``device_name``, ``total_memory_bytes``, ``requested_memory_bytes``,
    #: ``weights_bytes``, ``activation_peak_bytes``, ``non_torch_bytes``, ``cuda_graph_bytes``,
    #: ``available_kv_cache_bytes`` (and its ``_low`` / ``_high`` interval ends), ``num_gpu_blocks``.
    stages: tuple = ()
    #: The part of ``activation_peak_bytes`` the drafter's own forward adds above the target's
    #: peak (:func:`tuner.memory.specdecode.drafter_profile_extra_bytes`), bytes.
    drafter_forward_bytes: int = 0
    #: The drafter's forward peak in the profile run with the target's output hidden states
    #: alive (:func:`tuner.memory.specdecode.drafter_forward_peak_bytes` + ``N·H·d``), bytes; 0 = not run.
    drafter_forward_peak_bytes: int = 0
    #: The part of ``activation_peak_bytes`` that is the proposer's persistent buffers, charged
    #: where the budget is ``total_consumed``-based (V1 0.27+,
    #: :func:`tuner.memory.specdecode.drafter_persistent_bytes`), bytes.
    drafter_buffer_bytes: int = 0
    #: The part of ``cuda_graph_bytes`` that is the drafter's captures
    #: (:func:`tuner.memory.specdecode.drafter_graph_layer_hidden`), bytes.
    drafter_cuda_graph_bytes: int = 0
    #: The part of ``cuda_graph_bytes`` that is FlashInfer's workspace buffers, allocated in the first
    #: FULL capture (:func:`tuner.memory.attention.flashinfer_graph_workspace_bytes`), bytes.
    attention_workspace_bytes: int = 0
    #: The interval (:mod:`tuner.memory.uncertainty`): the KV bytes, blocks, tokens and concurrency at the
    #: low (safe) and high ends of the term bands, whether it starts (and meets ``min_concurrency``:
    #: ``fits_*``) at each end, and the limiting stage's term bands (dicts, bytes).
    available_kv_cache_bytes_low: int = 0
    available_kv_cache_bytes_high: int = 0
    num_gpu_blocks_low: int = 0
    num_gpu_blocks_high: int = 0
    kv_cache_tokens_low: int = 0
    kv_cache_tokens_high: int = 0
    max_concurrency_low: float = 0.0
    max_concurrency_high: float = 0.0
    starts_low: bool = True
    starts_high: bool = True
    fits_low: bool = True
    fits_high: bool = True
    bands: tuple = ()
    #: vLLM 0.34's extensible KV cache (:func:`tuner.memory.budget.extensible_kv_budget`; None in other
    #: releases): the device memory free after warmup and capture (the committed prefix included),
    #: the margin kept beyond the transient peak, and what the headroom cap withholds beyond the
    #: ledger's ``requested − terms`` (the ledger's ``extensible_headroom`` term), bytes.
    extensible_headroom_bytes: int | None = None
    extensible_margin_bytes: int | None = None
    extensible_withheld_bytes: int | None = None
    #: What ``gpu_memory_utilization`` below 1.0 keeps out of the cache: the budget with all memory
    #: free at start-up requested, less this one (vLLM 0.34 warns from 1 GiB at 0.7 < u < 1.0), bytes.
    extensible_u_withheld_bytes: int | None = None
    #: The reservation the first admission check runs on, before CUDA-graph capture and warmup
    #: (vllm/v1/core/kv_cache_planning.py ``get_kv_cache_configs``; :func:`extensible_refusal_note`), bytes.
    extensible_capacity_bytes: int | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("extensible_headroom_bytes", "extensible_margin_bytes", "extensible_withheld_bytes",
                  "extensible_u_withheld_bytes", "extensible_capacity_bytes"):
            if d[k] is None:
                d.pop(k)
        out = {}
        if not d["stages"]:  # one stage: the single-GPU shape is unchanged
            d.pop("stages")
            d.pop("limiting_stage")
        else:
            d["stages"] = [dict(x) for x in d["stages"]]
        d["bands"] = [dict(x) for x in d["bands"]]
        for k, v in d.items():  # ``starts`` next to ``fits``
            if k == "starts":
                continue
            out[k] = v
            if k == "fits":
                out["starts"] = d["starts"]
        return out


def candidate_starts(c: dict) -> bool:
    """vLLM's own verdict for a candidate dict (also rows that carry only ``fits``: the store's
    ``candidates`` table): it fits, or its only failing is ``min_concurrency`` (reason "only …").
    A candidate marked refused after evaluation (``fits`` false with another reason, e.g. the
    free-memory check of :mod:`tuner.measure.cuda`) does not start whatever its ``starts`` says."""
    if c.get("fits"):
        return True
    return c.get("starts") is not False and str(c.get("reason") or "").startswith("only ")


#: (profile batch, max_model_len) → one pass per PP stage as it stands at that length (the V1 0.27+
#: runner's persistent buffers hold a block table sized by max_model_len)
PassAtLength = Callable[[ProfileBatch, int], Sequence]


def _get(p, key):
    return p[key] if isinstance(p, dict) else getattr(p, key)


def evaluate(era: Era, layout: Layout, batch: ProfileBatch, passes: Sequence, *,
             gpu_memory_utilization: float, max_model_len: int, min_concurrency: float = 1.0) -> Candidate:
    """vLLM's outcome for one point: blocks, tokens, concurrency, and whether start-up succeeds.

    ``starts`` is vLLM's verdict: False when it would refuse to start (a ``max_model_len`` above
    the model's derived maximum, checked first as vLLM checks it before profiling; no memory for
    the cache blocks; the max-seq-len check: V0 ``raise_if_cache_size_invalid``, V1
    ``check_enough_kv_cache_memory``). ``fits`` is ``starts`` and at least ``min_concurrency``
    full-length requests fit; ``reason`` says why not.
    """
    u, m = gpu_memory_utilization, max_model_len
    n = batch.max_num_batched_tokens
    budgets, reserves, corrs, drafter_acts, drafter_fwds, drafter_graphs, drafter_peaks, drafter_bufs = (
        [], [], [], [], [], [], [], [])
    captured: list[int] = []
    workspaces: list[int] = []
    alternatives: list[tuple] = []
    corr = dict(layout.corrections)
    for stage, p in enumerate(passes):
        budget, reserve, corr_parts, graphs_captured, drafter, ws = _stage_terms(
            era, layout, batch, p, stage, len(passes), u=u, m=m, n=n, corr=corr)
        workspaces.append(ws)
        alternatives.append(_stage_alternatives(era, layout, batch, p, stage, len(passes), budget,
                                                u=u, m=m, n=n, corr=corr))
        budgets.append(budget)
        reserves.append(reserve)
        corrs.append(corr_parts)
        captured.append(graphs_captured)
        for parts, x in zip((drafter_acts, drafter_fwds, drafter_graphs, drafter_peaks, drafter_bufs), drafter):
            parts.append(x)
    if layout.kv_cache_memory_bytes is not None:  # the user's KV bytes replace the budget's
        import dataclasses

        budgets = [dataclasses.replace(b, available_kv_cache_bytes=int(layout.kv_cache_memory_bytes)) for b in budgets]
    reason, blocks, tokens, conc, worst, own_blocks = _size(era, layout, budgets, m, n, u)
    if reason is None and era.engine == "V1":
        reason = mamba_max_num_seqs_refusal(era, layout, max_num_seqs=batch.max_num_seqs, num_blocks=blocks)
    reason, other = _refusals(era, layout, budgets, captured, u, reason)
    limit = layout.max_model_len_limit
    if m > limit:  # vLLM refuses it in ModelConfig, before any profiling
        reason = other = max_len_refusal(m, limit, layout.derived_max_len_key, layout.model_max_length)
    starts = reason is None
    if starts and conc < min_concurrency:
        reason = f"only {conc:.2f} requests of {m} tokens fit; min_concurrency is {min_concurrency:g}"
    interval = _interval(era, layout, budgets, reserves, m, n, other, min_concurrency, batch.max_num_seqs, u,
                         alternatives)
    stage_ends = interval.pop("stage_kv_ends")
    b = budgets[worst]
    ca, cn, cg = corrs[worst]
    stages = _stage_rows(layout, budgets, stage_ends, own_blocks) if len(budgets) > 1 else ()
    return Candidate(u, m, n, batch.max_num_seqs, reason is None, reason, b.requested_memory_bytes, b.weights_bytes,
                     b.activation_peak_bytes, b.non_torch_bytes, b.cuda_graph_bytes, b.available_kv_cache_bytes,
                     blocks, tokens, round(conc, 4), reserves[worst], starts=starts,
                     workspace_bytes=layout.card(worst).activation_overhead_bytes, activation_correction_bytes=ca,
                     non_torch_correction_bytes=cn, cuda_graph_correction_bytes=cg,
                     drafter_weights_bytes=layout.drafter_weights_bytes if worst == len(budgets) - 1 else 0,
                     drafter_activation_bytes=drafter_acts[worst], drafter_forward_bytes=drafter_fwds[worst],
                     drafter_forward_peak_bytes=drafter_peaks[worst], drafter_buffer_bytes=drafter_bufs[worst],
                     drafter_cuda_graph_bytes=drafter_graphs[worst] if era.subtracts_cudagraph_estimate else 0,
                     attention_workspace_bytes=workspaces[worst],
                     limiting_stage=worst, stages=stages, **_extensible_fields(b), **interval)


def cudagraph_warmup_extra_bytes(layout: Layout, stage: int, graphs: int) -> int:
    """The stage's plugin-given warmup bytes (:attr:`Layout.cudagraph_warmup_bytes`) where the V1
    runner's ``profile_cudagraph_memory`` (vllm/v1/worker/gpu_model_runner.py 0.20 – 0.29) measures
    them: it calls ``empty_cache()`` before the captures and takes the free-memory drop around the
    first capture of each mode, warmup included (``_warmup_and_capture``), so a transient the warmup
    allocates anew is in the estimate. 0 where no estimate is subtracted (``graphs`` 0) and under
    Model Runner V2 (its own ``cudagraph_utils`` profiling, not read for this)."""
    extra = layout.cudagraph_warmup_bytes
    if not graphs or layout.model_runner_v2 or stage >= len(extra):
        return 0
    return int(extra[stage])


def _stage_alternatives(era: Era, layout: Layout, batch: ProfileBatch, p: Any, stage: int, n_passes: int,
                        budget: Any, *, u: float, m: int, n: int, corr: dict) -> tuple:
    """The stage's assumptions whose other value was computed (the pass's ``assumed_alternatives``,
    :meth:`tuner.jobs.job.Passes.alternatives_for`) as :class:`tuner.memory.uncertainty.Alternative`: the
    stage's budget again with the alternative's weights and activation peak (reserve, workspace and
    every other term as the point computes them), its KV less the point's."""
    import dataclasses

    from tuner.memory.uncertainty import Alternative

    out = []
    for a in (p.get("assumed_alternatives") if isinstance(p, dict) else getattr(p, "assumed_alternatives", ())) or ():
        w = int(_get(p, "weights_bytes")) + int(a["weights_delta_bytes"])
        act = int(_get(p, "activation_peak_bytes")) + int(a["activation_peak_delta_bytes"])
        q = ({**p, "weights_bytes": w, "activation_peak_bytes": act} if isinstance(p, dict)
             else dataclasses.replace(p, weights_bytes=w, activation_peak_bytes=act))
        other = _stage_terms(era, layout, batch, q, stage, n_passes, u=u, m=m, n=n, corr=corr)[0]
        out.append(Alternative(str(a["name"]), a["value"], a["alternative"],
                               int(other.available_kv_cache_bytes) - int(budget.available_kv_cache_bytes),
                               str(a.get("source") or "")))
    return tuple(out)


def _stage_terms(era: Era, layout: Layout, batch: ProfileBatch, p: Any, stage: int, n_passes: int, *,
                 u: float, m: int, n: int, corr: dict) -> tuple:
    """One pipeline stage's terms for :func:`evaluate`: its budget, reserve, the CUDA graphs it
    captures (subtracted or not), the drafter's parts and the calibration corrections applied."""
    card = layout.card(stage)
    peak = int(_get(p, "activation_peak_bytes"))
    reserve = unexplained_bytes(era, int(_get(p, "weights_bytes")), peak + card.activation_overhead_bytes)
    last = stage == n_passes - 1
    dp = layout.drafter_pass if last and era.engine == "V1" else None
    cc = getattr(card.topology, "compute_capability", None)
    # the target's layers (a drafter's KV layers are its own term), then the drafter's captures
    n_layers = max(0, len(layout.kv_specs[stage]) - (getattr(dp, "kv_layers", 0) or 0)) or layout.num_layers
    gkw = dict(num_layers=n_layers, max_num_seqs=batch.max_num_seqs, max_num_batched_tokens=n,
               hidden_size=layout.hidden_size, num_speculative_tokens=layout.num_speculative_tokens,
               compute_capability=cc, model_runner_v2=layout.model_runner_v2,
               platform=platform_of(card.topology))
    # spec decode on FlashInfer without TRT-LLM attention: PIECEWISE only (tuner/memory/attention.py, §20)
    gkw["full_graphs"] = gkw["platform"] != "cuda" or full_graphs_captured(
        era.version, compute_capability=cc, kv_cache_dtype=layout.kv_cache_dtype, kv_specs=layout.kv_specs[stage],
        num_speculative_tokens=layout.num_speculative_tokens)
    sizes = None
    if layout.num_speculative_tokens:  # spec decode rounds the sizes to multiples of 1 + k (V1 runner)
        from tuner.memory.budget import cudagraph_capture_sizes
        from tuner.memory.specdecode import spec_decode_capture_sizes

        sizes = spec_decode_capture_sizes(
            cudagraph_capture_sizes(era, batch.max_num_seqs, n, compute_capability=cc,
                                    num_speculative_tokens=layout.num_speculative_tokens),
            version=era.version, num_speculative_tokens=layout.num_speculative_tokens,
            model_runner_v2=layout.model_runner_v2)
        gkw["capture_sizes"] = sizes
    graphs = cudagraph_estimate_bytes(era, **gkw)
    # FlashInfer's workspace, allocated in the FULL mode's first sampled capture (§20), and a plugin's
    # warmup bytes (§22): both beside the fit, added after the drafter's share is taken from the fit
    fi_ws = flashinfer_graph_workspace_bytes(
        era.version, compute_capability=cc, kv_cache_dtype=layout.kv_cache_dtype, kv_specs=layout.kv_specs[stage],
        num_speculative_tokens=layout.num_speculative_tokens, model_runner_v2=layout.model_runner_v2,
        max_num_batched_tokens=n, num_qo_heads=layout.num_attention_heads_per_rank,
    ) if graphs and gkw["platform"] == "cuda" else 0
    warmup = cudagraph_warmup_extra_bytes(layout, stage, graphs)
    drafter_g = 0
    if dp is not None and graphs:
        from tuner.memory.specdecode import drafter_graph_layer_hidden

        x = drafter_graph_layer_hidden(dp, version=era.version, largest_capture_size=max(sizes or [0]),
                                       max_num_seqs=batch.max_num_seqs)
        drafter_g = cudagraph_estimate_bytes(era, **gkw, extra_layer_hidden=x) - graphs if x else 0
        graphs += drafter_g
    graphs += fi_ws + warmup
    # the graphs vLLM captures after the cache is allocated, subtracted or not (0.19, MRV2 < 0.29)
    captured = graphs if graphs or not era.compiled else cudagraph_estimate_bytes(era, **gkw, always=True)
    drafter_act = layout.drafter_activation_bytes_per_token * n if last else 0
    drafter_fwd, drafter_peak = 0, 0
    if dp is not None:
        from tuner.memory.specdecode import drafter_profile_extra_bytes

        # the pass's transient peak: 0.27+ passes include the runner's persistent buffers, alive
        # through the drafter's forward too
        persistent = int((p.get("persistent_bytes") if isinstance(p, dict) else getattr(p, "persistent_bytes", 0))
                         or 0)
        drafter_fwd = drafter_profile_extra_bytes(dp, target_peak_bytes=peak - persistent, n_tokens=n,
                                                  max_num_seqs=batch.max_num_seqs, version=era.version)
        drafter_peak = drafter_profile_extra_bytes(dp, target_peak_bytes=0, n_tokens=n,
                                                   max_num_seqs=batch.max_num_seqs, version=era.version)
    drafter_buf = 0
    if dp is not None and era.budget_formula == V1_CONSUMED:  # the proposer's buffers (0.27+)
        from tuner.memory.specdecode import drafter_persistent_bytes

        drafter_buf = drafter_persistent_bytes(dp, n_tokens=n, max_num_seqs=batch.max_num_seqs)
    act0 = peak + card.activation_overhead_bytes + reserve + drafter_act + drafter_fwd + drafter_buf
    nt0 = non_torch_bytes(era, tensor_parallel_size=layout.tensor_parallel_size,
                          pipeline_parallel_size=layout.pipeline_parallel_size, topology=card.topology) \
        + co_tenant_non_torch_bytes(era, layout.other_processes_bytes) \
        + moe_dp_group_bytes(era, layout.moe_data_parallel_size, card.topology or Topology()) \
        + uma_host_buffer_bytes(era, free_from_host=layout.free_memory_from_host,
                                model_runner_v2=layout.model_runner_v2, max_num_seqs=batch.max_num_seqs,
                                max_model_len=m, block_size=layout.block_size)
    act = max(0, act0 + int(corr.get("activation_peak_delta_bytes", 0)))
    nt = max(0, nt0 + int(corr.get("non_torch_delta_bytes", 0)))
    g = max(0, graphs + int(corr.get("cuda_graph_delta_bytes", 0))) if graphs else 0
    w = int(_get(p, "weights_bytes")) + (layout.drafter_weights_bytes if stage == n_passes - 1 else 0)
    if era.extensible_kv_cache:  # 0.34+: sized after warmup and capture (tuner.memory.budget.extensible_kv_budget)
        persistent = int((p.get("persistent_bytes") if isinstance(p, dict) else getattr(p, "persistent_bytes", 0))
                         or 0) + drafter_buf
        budget = (extensible_kv_budget(
            era, total_memory_bytes=card.total_memory_bytes, gpu_memory_utilization=u, weights_bytes=w,
            activation_peak_bytes=act, non_torch_bytes=nt, cuda_graph_bytes=g, persistent_bytes=persistent,
            other_processes_bytes=layout.other_processes_bytes,
            baseline_bytes=startup_baseline_bytes(era, tensor_parallel_size=layout.tensor_parallel_size,
                                                  topology=card.topology),
            platform=platform_of(card.topology)))
    else:
        budget = (kv_budget(era, total_memory_bytes=card.total_memory_bytes, gpu_memory_utilization=u,
                                 weights_bytes=w, activation_peak_bytes=act, non_torch_bytes=nt, cuda_graph_bytes=g))
    corr_parts = (act - act0, nt - nt0, (g - graphs) if era.subtracts_cudagraph_estimate else 0)
    return (budget, reserve, corr_parts, captured,
            (drafter_act, drafter_fwd, drafter_g, drafter_peak, drafter_buf), fi_ws if g else 0)


def _refusals(era: Era, layout: Layout, budgets: list, captured: list[int], u: float,
              reason: str | None) -> tuple[str | None, str | None]:
    """vLLM's refusals beside the KV check, in its order: every card's free memory (init_device),
    the weights' load, ``kv_cache_memory_bytes`` or the graph capture after the cache. Returns the
    reason and the refusal that does not depend on the KV bytes (``other``)."""
    other = None  # refusals that do not depend on the KV bytes
    for i, b in enumerate(budgets if not era.extensible_kv_cache else ()):  # every card checks its own free
        # memory in init_device (not with the extensible cache: vllm/v1/worker/utils.py request_memory, 0.34)
        refusal = free_memory_refusal(era, total_memory_bytes=layout.card(i).total_memory_bytes,
                                      other_processes_bytes=layout.other_processes_bytes, gpu_memory_utilization=u,
                                      requested_memory_bytes=b.requested_memory_bytes)
        if refusal:  # vLLM checks free memory in init_device, before it loads anything
            reason = other = refusal
            break
    if reason is None or reason.startswith("No available memory"):
        # loading happens after init_device's free-memory check and before the profile
        refused = weights_refusal(layout, budgets)
        if refused:
            reason = other = refused
    if layout.kv_cache_memory_bytes is not None and reason is None:
        reason = other = kv_cache_memory_refusal(layout, budgets, captured)
    elif reason is None and era.engine == "V1":
        reason = other = graph_capture_oom(layout, budgets, captured)
    return reason, other


def _stage_rows(layout: Layout, budgets: list, stage_ends: list, own_blocks: list) -> tuple:
    """Each pipeline stage's figures (PP > 1): its card, layers, terms, interval ends and blocks."""
    counts = kvcache.layers_per_pp_rank(layout.num_layers, len(budgets), layout.pp_layer_partition) \
        if layout.num_layers >= len(budgets) else [0] * len(budgets)
    starts_at = [sum(counts[:i]) for i in range(len(budgets))]
    return tuple({"pp_rank": i, "device_name": layout.card(i).name or None,
                    "decoder_layers": [starts_at[i], starts_at[i] + counts[i]],
                    "kv_layers": len(layout.kv_specs[i]) if i < len(layout.kv_specs) else 0,
                    "total_memory_bytes": int(layout.card(i).total_memory_bytes),
                    "requested_memory_bytes": int(x.requested_memory_bytes), "weights_bytes": int(x.weights_bytes),
                    "activation_peak_bytes": int(x.activation_peak_bytes), "non_torch_bytes": int(x.non_torch_bytes),
                    "cuda_graph_bytes": int(x.cuda_graph_bytes),
                    "available_kv_cache_bytes": int(x.available_kv_cache_bytes),
                    "available_kv_cache_bytes_low": stage_ends[i][0],
                    "available_kv_cache_bytes_high": stage_ends[i][1],
                    "num_gpu_blocks": None if own_blocks[i] is None else int(own_blocks[i])}
                   for i, x in enumerate(budgets))


def _interval(era: Era, layout: Layout, budgets: Sequence, reserves: Sequence[int], m: int, n: int,
              other_refusal: str | None, min_concurrency: float, max_num_seqs: int, u: float,
              alternatives: Sequence[tuple] = ()) -> dict:
    """The candidate's interval (:mod:`tuner.memory.uncertainty`): each stage's term bands (with its
    assumptions' computed ``alternatives``, :func:`_stage_alternatives`), its KV bytes at the low (safe)
    and high ends, and the release's sizing at both ends (blocks, tokens, concurrency, whether it
    starts); the bands of the stage that limits at the safe end."""
    import dataclasses

    from tuner.memory import uncertainty as unc

    ctx = layout.uncertainty or unc.Context()
    per_stage = [unc.term_bands(requested_memory_bytes=b.requested_memory_bytes, weights_bytes=b.weights_bytes,
                                activation_peak_bytes=b.activation_peak_bytes, reserve_bytes=r,
                                non_torch_bytes=b.non_torch_bytes, cuda_graph_bytes=b.cuda_graph_bytes,
                                sources=dict(ctx.sources), device_total_stated=ctx.device_total_stated,
                                unmodelled=ctx.unmodelled, kv_cache_memory_bytes=layout.kv_cache_memory_bytes,
                                alternatives=alts)
                 for b, r, alts in zip(budgets, reserves, list(alternatives) or [()] * len(budgets))]
    ends = [unc.kv_interval(b.available_kv_cache_bytes, bands) for b, bands in zip(budgets, per_stage)]
    out: dict = {}
    for end, k in (("low", 0), ("high", 1)):
        shifted = [dataclasses.replace(b, available_kv_cache_bytes=int(e[k])) for b, e in zip(budgets, ends)]
        reason, blocks, tokens, conc, worst, _own = _size(era, layout, shifted, m, n, u)
        if reason is None and era.engine == "V1":
            reason = mamba_max_num_seqs_refusal(era, layout, max_num_seqs=max_num_seqs, num_blocks=blocks)
        starts = reason is None and other_refusal is None
        out.update({f"available_kv_cache_bytes_{end}": int(shifted[worst].available_kv_cache_bytes),
                    f"num_gpu_blocks_{end}": int(blocks), f"kv_cache_tokens_{end}": int(tokens),
                    f"max_concurrency_{end}": round(float(conc), 4), f"starts_{end}": bool(starts),
                    f"fits_{end}": bool(starts and conc >= min_concurrency)})
        if end == "low":
            out["bands"] = tuple(b.to_dict() for b in per_stage[worst])
    # each stage's own KV bytes at both ends (a log may print another stage's figure than the limiting one)
    out["stage_kv_ends"] = tuple((int(e[0]), int(e[1])) for e in ends)
    return out


def _size(era: Era, layout: Layout, budgets: Sequence, m: int, n: int, u: float) -> tuple:
    """The release's KV sizing of per-stage budgets at ``max_model_len`` ``m`` and ``n`` batched
    tokens: ``(reason, blocks, tokens, concurrency, worst stage, each stage's own blocks)``
    (the expected budget and, for the interval, its low and high ends)."""
    reason = None
    blocks, tokens, conc = 0, 0, 0.0
    worst = min(range(len(budgets)), key=lambda i: budgets[i].available_kv_cache_bytes)
    own_blocks: list = [None] * len(budgets)  # each stage's blocks before the minimum
    if any(b.available_kv_cache_bytes <= 0 for b in budgets):
        reason = ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                  "when initializing the engine.")
        if era.version >= (0, 34, 0):  # vllm/v1/core/kv_cache_planning.py (0.34), the hint by sizing mode
            after = era.extensible_kv_cache and all((b.capacity_kv_cache_bytes or 0) > 0 for b in budgets)
            reason = ("No available memory for the cache blocks. " + kvcache.more_kv_cache_memory_hint(
                extensible=era.extensible_kv_cache, gpu_memory_utilization=u, after_warmup=after)
                + " " + kvcache.CONSERVING_MEMORY)
    elif era.engine == "V0":
        per_stage = []
        for b, specs in zip(budgets, layout.kv_specs):
            cache_block = sum(s.page_size_bytes for s in specs.values())
            per_stage.append(kvcache.v0_num_gpu_blocks(b.available_kv_cache_bytes, cache_block))
        blocks = min(per_stage)
        worst = per_stage.index(blocks)
        own_blocks = per_stage
        tokens = blocks * layout.block_size
        conc = kvcache.v0_max_concurrency(blocks, layout.block_size, m)
        if blocks <= 0:
            reason = "No available memory for the cache blocks."
        elif m > tokens:
            reason = (f"The model's max seq len ({m}) is larger than the maximum number of tokens that can be "
                      f"stored in KV cache ({tokens}).")
    else:
        workers = [(specs, b.available_kv_cache_bytes) for b, specs in zip(budgets, layout.kv_specs)]
        # Tokens in flight that sliding-window / chunked-local layers reserve (0.26+, kvcache.MAX_IN_FLIGHT_SINCE): async
        # scheduling is on by default on GPUs (vllm/config/vllm.py; off for pooling models, some
        # speculative methods and PP on the V1 runner, which the helper's pp term covers).
        kw = dict(max_num_batched_tokens=n, tensor_parallel_size=layout.tensor_parallel_size,
                  max_in_flight_tokens=kvcache.max_in_flight_tokens(
                      era.version, n, async_scheduling=True, pipeline_parallel_size=layout.pipeline_parallel_size,
                      model_runner_v2=layout.model_runner_v2))
        if era.extensible_kv_cache:  # 0.34: checked on the reservation, then again after warmup
            hint = dict(extensible=True, gpu_memory_utilization=u)
            try:
                kvcache.get_kv_cache_configs(era.version, [(sp, b.capacity_kv_cache_bytes) for (sp, _a), b
                                                           in zip(workers, budgets)], max_model_len=m,
                                             hint=kvcache.more_kv_cache_memory_hint(**hint), **kw)
                kw["hint"] = kvcache.more_kv_cache_memory_hint(**hint, after_warmup=True)
            except KVCacheError as exc:
                reason = exc.message
        elif era.version >= (0, 34, 0):
            kw["hint"] = kvcache.more_kv_cache_memory_hint(extensible=False, gpu_memory_utilization=u)
        try:  # the engine's own check for the release runs inside get_kv_cache_configs
            configs = kvcache.get_kv_cache_configs(era.version, workers, max_model_len=m, **kw)
            if era.extensible_kv_cache:  # 0.34 commits whole granules per segment: blocks_within
                from tuner.memory.budget import blocks_within, kv_segment_strides

                fit = [blocks_within(a, kv_segment_strides(c), capacity=c.num_blocks) if kv_segment_strides(c)
                       else c.num_blocks for (_s, a), c in zip(workers, configs)]
                # finalize_extensible_kv_cache / shrink_kv_cache_configs check (blocks - 1) x bytes per block
                committed = [(sp, min(fit) * int(c.bytes_per_block)) for (sp, _a), c in zip(workers, configs)]
                if committed != workers:
                    workers = committed
                    configs = kvcache.get_kv_cache_configs(era.version, workers, max_model_len=m, **kw)
        except KVCacheError as exc:
            reason = reason or exc.message
            configs = None
        try:
            if configs is None:  # still report the blocks the engine would have found
                configs = kvcache.get_kv_cache_configs(era.version, workers, max_model_len=layout.block_size, **kw)
            if len(configs) > 1:
                # vLLM sizes every worker to the fewest blocks (get_kv_cache_configs: min over
                # workers): the limiting stage is the one whose own bytes give the fewest.
                bpb = [int(c.bytes_per_block) for c in configs]
                own_blocks = [max(0, a // b) if b > 0 else None for (_s, a), b in zip(workers, bpb)]
                known = [i for i, x in enumerate(own_blocks) if x is not None]
                if known:
                    worst = min(known, key=lambda i: (own_blocks[i], budgets[i].available_kv_cache_bytes))
            cfg = configs[worst]
            blocks = int(cfg.num_blocks)
            tokens = int(kvcache.kv_cache_tokens(era.version, cfg, m, max_num_batched_tokens=n,
                                                 max_in_flight_tokens=kw["max_in_flight_tokens"]))
            conc = float(kvcache.max_concurrency(era.version, cfg, m, max_num_batched_tokens=n,
                                                 max_in_flight_tokens=kw["max_in_flight_tokens"]))
        except TunerError as exc:
            reason = reason or exc.message
    return reason, blocks, tokens, conc, worst, own_blocks


def _extensible_fields(b) -> dict:
    """The extensible-cache fields of :class:`Candidate` from one stage's budget (none before 0.34)."""
    if b.headroom_bytes is None:
        return {}
    by_terms = (b.requested_memory_bytes - b.weights_bytes - b.activation_peak_bytes - b.non_torch_bytes
                - b.cuda_graph_bytes)
    unbounded = max(0, int(b.headroom_bytes) - int(b.margin_bytes or 0) - int(b.transient_bytes or 0))
    return {"extensible_headroom_bytes": int(b.headroom_bytes), "extensible_margin_bytes": int(b.margin_bytes or 0),
            "extensible_withheld_bytes": int(by_terms - b.available_kv_cache_bytes),
            "extensible_u_withheld_bytes": max(0, unbounded - max(0, int(b.available_kv_cache_bytes))),
            "extensible_capacity_bytes": None if b.capacity_kv_cache_bytes is None else int(b.capacity_kv_cache_bytes)}


#: vLLM 0.34's hint on the reservation's check (before warmup), :func:`tuner.memory.kvcache.more_kv_cache_memory_hint`.
_BEFORE_WARMUP_HINT = "left after the model and its activations"


def extensible_refusal_note(c: dict, largest_max_model_len: int | None = None) -> str | None:
    """Why vLLM 0.34's refusal quotes other figures than the budget, where it does: with the extensible
    KV cache the admission check runs first on the reservation, before CUDA-graph capture and warmup
    (vllm/v1/core/kv_cache_planning.py ``get_kv_cache_configs``: ``requested − model − activations``,
    less the null block), and again after them on the blocks committed (``shrink_kv_cache_configs``).
    A refusal at the first check quotes the reservation and estimates a length from it; the budget is
    the cache after capture and warmup, where that estimated length would be refused again. None
    where the refusal is not the reservation's."""
    reason, cap = str(c.get("reason") or ""), c.get("extensible_capacity_bytes")
    if cap is None or _BEFORE_WARMUP_HINT not in reason or not reason.startswith("To serve at least one request"):
        return None
    gib = 1 << 30
    est = re.search(r"estimated maximum model length is (\d+)", reason)
    text = (f"vLLM's figures are its first check's, on the reservation before CUDA-graph capture and warmup "
            f"(vllm/v1/core/kv_cache_planning.py get_kv_cache_configs: {cap / gib:.2f} GiB less one block); the "
            f"budget below is the cache after them ({int(c.get('available_kv_cache_bytes') or 0) / gib:.2f} GiB), "
            "where shrink_kv_cache_configs checks again")
    if est:
        text += (f", so its estimated {est.group(1)} would be refused there"
                 + (f" (the largest that starts: {largest_max_model_len})" if largest_max_model_len else ""))
    return text


def gpu_memory_utilization_warning(c: "Candidate | dict") -> str | None:
    """vLLM 0.34's warning where an explicit ``gpu_memory_utilization`` in (0.7, 1.0) keeps at least
    1 GiB of free device memory out of the extensible KV cache
    (vllm/v1/worker/extensible_kv_cache.py ``measure_kv_cache_blocks``), else None."""
    get = c.get if isinstance(c, dict) else (lambda k, d=None: getattr(c, k, d))
    u, withheld = float(get("gpu_memory_utilization")), get("extensible_u_withheld_bytes")
    if withheld is None or not 0.7 < u < 1.0 or withheld < (1 << 30):
        return None
    gib = 1 << 30
    return (f"gpu_memory_utilization={u:g} caps this instance at {round(get('requested_memory_bytes') / gib, 2)} GiB, "
            f"keeping {round(withheld / gib, 2)} GiB of free device memory out of the KV cache. The extensible KV "
            "cache is sized from the memory measured after warmup and CUDA graph capture, so vLLM's own use needs "
            "no headroom below 1.0. Leave gpu_memory_utilization unset unless it leaves room for memory vLLM does "
            "not measure: other processes sharing the GPU (including ones that allocate on it later), the CPU on a "
            "unified-memory device, weight transfer buffers for weight updates, or a KV connector's own device "
            "buffers.")


#: The start of :func:`weights_refusal`'s message (``check`` and ``explain`` recognise it).
WEIGHTS_DO_NOT_FIT = "the weights do not fit the GPU"


def weights_refusal(layout: Layout, budgets: Sequence) -> str | None:
    """Why vLLM fails loading the weights, or None: a stage whose weights (drafter included) and
    non-torch memory (the CUDA context is created before loading) exceed its card's total memory
    (less other processes). vLLM loads the weights onto the GPU in ``load_model``
    (vllm/v1/worker/gpu_model_runner.py; vllm/worker/model_runner.py in V0) after ``init_device``
    and before the memory profile, so no ``gpu_memory_utilization`` helps: torch raises CUDA out
    of memory while loading — not the profile's "No available memory for the cache blocks. Try
    increasing `gpu_memory_utilization`". The message has the bytes and what would fit: the
    tensor-parallel size that splits the weights small enough, a quantized checkpoint (8-bit
    weights are about half of 16-bit ones, 4-bit about a quarter), or a card with more memory."""
    gib = 1 << 30
    for i, b in enumerate(budgets):
        card = layout.card(i)
        room = int(card.total_memory_bytes) - int(layout.other_processes_bytes)
        w, nt = int(b.weights_bytes), int(b.non_torch_bytes)
        if w + nt <= room:
            continue
        where = f" of pipeline stage {i}" if len(budgets) > 1 else ""
        whole = w * layout.tensor_parallel_size  # the model's weights before the TP split (about)
        tp = layout.tensor_parallel_size
        while tp < 64 and whole / (tp * 2) + nt > room:
            tp *= 2
        tp_text = f"--tensor-parallel-size {tp * 2} (about {whole / (tp * 2) / gib:.2f} GiB of weights per GPU)" \
            if tp < 64 else "more GPUs"
        return (f"{WEIGHTS_DO_NOT_FIT}: vLLM fails loading them (CUDA out of memory in load_model, before the "
                f"memory profile; no gpu_memory_utilization helps): the weights{where} are {w:,} bytes "
                f"({w / gib:.2f} GiB) and with the non-torch memory ({nt:,} bytes) need {w + nt:,} bytes, more "
                f"than the GPU's {room:,} bytes ({room / gib:.2f} GiB)"
                + (" left by other processes" if layout.other_processes_bytes else "")
                + f"; what would let them load (the KV cache and activations still need room beyond): {tp_text}, "
                  "a quantized checkpoint (8-bit weights are about half, 4-bit about a quarter of 16-bit ones), or a "
                  f"GPU with more than {(w + nt) / gib:.2f} GiB"
                + (" free" if layout.other_processes_bytes else "") + " plus the KV cache")
    return None


def graph_capture_oom(layout: Layout, budgets: Sequence, captured_graph_bytes: Sequence[int]) -> str | None:
    """CUDA out of memory while capturing the CUDA graphs after the cache is allocated, or None.

    The KV cache fills the budget up to ``total × gpu_memory_utilization``; ``compile_or_warm_up_model``
    then captures the CUDA graphs (vllm/v1/worker/gpu_worker.py). Where the release does not take
    the capture's estimate off the budget (0.19; Model Runner V2 before 0.29; ``era.subtracts_cudagraph_estimate``
    false), the captured graphs come on top of the requested memory: when requested + captured graphs
    exceed the card's memory (less what other processes hold) the capture fails with CUDA out of
    memory. Where the estimate is subtracted the capture is inside the budget (a capture larger than
    vLLM's own estimate is not modelled). Bytes per rank, each stage on its own card.
    """
    for i, b in enumerate(budgets):
        on_top = max(0, int(captured_graph_bytes[i]) - int(b.cuda_graph_bytes))
        if not on_top:
            continue
        card = layout.card(i)
        room = int(card.total_memory_bytes) - int(layout.other_processes_bytes)
        need = int(b.requested_memory_bytes) + on_top
        if need > room:
            gib = 1 << 30
            where = f" on pipeline stage {i}" if len(budgets) > 1 else ""
            return (f"CUDA out of memory{where} during CUDA graph capture: the KV cache fills the requested "
                    f"{int(b.requested_memory_bytes):,} bytes ({int(b.requested_memory_bytes) / gib:.2f} GiB) and the "
                    f"graphs captured after it ({on_top / gib:.2f} GiB, not taken off the budget by this release) "
                    f"need {need:,} bytes, more than the GPU's {room:,} bytes ({room / gib:.2f} GiB)"
                    + (" left by other processes" if layout.other_processes_bytes else "")
                    + "; lower gpu_memory_utilization or use --enforce-eager")
    return None


#: First release that refuses, rather than caps, a ``max_num_seqs`` above the Mamba state blocks
#: (vllm/config/compilation.py ``resolve_cudagraph_mode_and_sizes``, 0.20.0; 0.19.0 only capped the
#: CUDA-graph capture sizes in ``CompilationConfig.adjust_cudagraph_sizes_for_mamba_cache``).
MAMBA_MAX_NUM_SEQS_CHECK_FROM = (0, 20, 0)


def mamba_max_num_seqs_refusal(era: Era, layout: Layout, *, max_num_seqs: int, num_blocks: int) -> str | None:
    """vLLM's refusal of a ``max_num_seqs`` above the Mamba cache blocks, or None.

    From 0.20.0 ``CompilationConfig.resolve_cudagraph_mode_and_sizes`` (vllm/config/compilation.py,
    called by the V1 and V2 runners once the KV cache config is known, i.e. after the KV size
    check) raises when the CUDA-graph mode has full graphs, the model has Mamba / linear-attention
    layers and ``max_num_seqs > kv_cache_config.num_blocks``: each decode sequence needs one Mamba
    state block. Full graphs are vLLM's default (``FULL_AND_PIECEWISE``) unless ``enforce_eager``
    (``era.compiled`` false); a ``compilation_config.cudagraph_mode`` without full graphs is not
    modelled. 0.19.0 capped the capture sizes instead and started.
    """
    if not era.compiled or era.version < MAMBA_MAX_NUM_SEQS_CHECK_FROM:
        return None
    has_mamba = any(isinstance(s, kvcache.MambaSpec) for specs in layout.kv_specs for s in specs.values())
    if not has_mamba or max_num_seqs <= num_blocks:
        return None
    return (f"max_num_seqs ({max_num_seqs}) exceeds available Mamba cache blocks ({num_blocks}). Each decode "
            "sequence requires one Mamba cache block, so CUDA graph capture cannot proceed. Please lower "
            f"max_num_seqs to at most {num_blocks} or increase gpu_memory_utilization.")


def kv_cache_memory_refusal(layout: Layout, budgets: Sequence, captured_graph_bytes: Sequence[int]) -> str | None:
    """Why a ``kv_cache_memory_bytes`` larger than the card can hold does not start, or None.

    vLLM does not check the setting against the GPU: ``determine_available_memory`` returns it as
    given (vllm/v1/worker/gpu_worker.py, 0.10.2+), ``initialize_kv_cache`` then allocates it next
    to the weights, the cuBLAS workspace and the non-torch memory, and ``compile_or_warm_up_model``
    captures the CUDA graphs after it (``captured_graph_bytes`` per stage: the estimate whether or
    not the era subtracts it, 0 with ``enforce_eager``). When their sum exceeds the card's memory
    (less what other processes hold) one of those allocations fails with CUDA out of memory. The
    profile run's activations are freed back before the cache is allocated, so they are not in
    the sum (bytes per rank, each stage on its own card)."""
    kv = int(layout.kv_cache_memory_bytes or 0)
    for i, b in enumerate(budgets):
        card = layout.card(i)
        held = (int(b.weights_bytes) + int(card.activation_overhead_bytes) + int(b.non_torch_bytes)
                + int(captured_graph_bytes[i]))
        room = int(card.total_memory_bytes) - int(layout.other_processes_bytes)
        if held + kv > room:
            gib = 1 << 30
            where = f" on pipeline stage {i}" if len(budgets) > 1 else ""
            return (f"CUDA out of memory{where}: kv_cache_memory_bytes ({kv / gib:.2f} GiB) with the weights, "
                    f"cuBLAS workspace, non-torch memory and CUDA graphs ({held / gib:.2f} GiB) needs "
                    f"{held + kv:,} bytes ({(held + kv) / gib:.2f} GiB), more than the GPU's {room:,} bytes "
                    f"({room / gib:.2f} GiB)" + (" left by other processes" if layout.other_processes_bytes else "")
                    + "; vLLM does not check the setting against the GPU and fails allocating the cache")
    return None


#: The largest ``max_model_len`` below which V0 keeps chunked prefill off by default
#: (vllm/engine/arg_utils.py, 0.5.4+): the fit surface can jump at this boundary.
V0_CHUNKED_PREFILL_THRESHOLD = 32768


def search_regions(era: Era, *, derived_max: int, enable_chunked_prefill: bool | None,
                   max_num_batched_tokens: int | None, max_model_len_cap: int | None,
                   grid: Sequence[int] | None = None, path: str | None = None) -> tuple[list[tuple[int, int]], int | None]:
    """The token ranges :func:`propose` searches one by one (inside each the profile batch keeps
    its shape, so the fit is monotone) and the cap on ``max_model_len`` the batch settings add.

    V0 (0.5.4+) with chunked prefill and N left to the era: two regions split at
    :data:`V0_CHUNKED_PREFILL_THRESHOLD`. Chunked prefill off with the drop's N: vLLM refuses any
    length above N (the cap). V0 with the drop's N and chunked prefill left to the era: the
    lengths V0 runs unchunked (up to the threshold; every length before 0.5.4) must fit one batch
    of N, longer ones are chunked. ``derived_max``: the longest length vLLM accepts for the
    model (:attr:`Layout.max_model_len_limit`, RoPE scaling and ``hf_overrides`` applied).

    Raises:
        DropError: a grid length (``grid``: the drop's ``candidates.max_model_len``) vLLM refuses
            unchunked (:func:`tuner.memory.engine_checks.check_unchunked_lengths`), naming ``path``.
    """
    from tuner.memory.engine_checks import check_unchunked_lengths

    regions = [(1, derived_max)]
    cap = max_model_len_cap
    if (era.engine == "V0" and enable_chunked_prefill is None and max_num_batched_tokens is None
            and era.version >= (0, 5, 4)):
        regions = [(1, V0_CHUNKED_PREFILL_THRESHOLD), (V0_CHUNKED_PREFILL_THRESHOLD + 1, derived_max)]
    if enable_chunked_prefill is False and max_num_batched_tokens is not None:
        # Chunked prefill off: vLLM refuses any max_model_len above max_num_batched_tokens.
        n_user = int(max_num_batched_tokens)
        check_unchunked_lengths(max_num_batched_tokens=n_user, max_model_lens=grid or (), path=path)
        cap = min(cap, n_user) if cap else n_user
    elif era.engine == "V0" and enable_chunked_prefill is None and max_num_batched_tokens is not None:
        # V0 keeps chunked prefill off up to 32768 tokens (0.5.4+; always before): those lengths must
        # fit one batch of the drop's max_num_batched_tokens, longer ones are chunked.
        n_user = int(max_num_batched_tokens)
        limit = V0_CHUNKED_PREFILL_THRESHOLD if era.version >= (0, 5, 4) else None
        check_unchunked_lengths(max_num_batched_tokens=n_user, path=path,
                                max_model_lens=[m for m in (grid or ()) if limit is None or m <= limit])
        if limit is None:
            cap = min(cap, n_user) if cap else n_user
        elif n_user < limit:
            regions = [(1, n_user), (limit + 1, derived_max)]
    return regions, cap


def _largest_fitting(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """Largest k in [lo, hi] with fits(k), given fits is monotone non-increasing; None if none."""
    if lo > hi or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def propose(era: Era, layout: Layout, *, gpu_memory_utilization: float, batch_for: Callable[[int], ProfileBatch],
            passes_at: PassAtLength, min_concurrency: float = 1.0, max_model_len_cap: int | None = None,
            regions: Sequence[tuple[int, int]] = (), extra_args: str = "",
            risk: str = "expected") -> tuple[Proposal, list[Candidate]]:
    """Search the largest ``max_model_len`` that fits at one utilization: a block multiple, or the
    cap itself (the model's derived maximum, a drop's cap) when that is not one.

    Args:
        batch_for: ``max_model_len`` → the era's profile batch for it.
        passes_at: profile batch and ``max_model_len`` → passes per stage at that length (memoized
            by the caller; the runner's length-sized buffers, V1 0.27+, at the point's own length).
        regions: token ranges inside which the batch keeps its shape (fit monotone); defaults to
            one region ``[block_size, cap]``.
        risk: ``safe`` proposes the largest length that starts at the interval's safe (low-KV) end
            (:attr:`Candidate.fits_low`), ``expected`` at the expected value; both lengths are
            carried (``max_model_len_safe``, ``max_model_len_expected``).
    Returns:
        The proposal and every candidate evaluated during the search.
    """
    bs = layout.block_size
    limit = layout.max_model_len_limit  # vLLM's derived maximum (RoPE scaling, hf_overrides applied)
    cap = limit
    if max_model_len_cap:
        cap = min(cap, max_model_len_cap)
    seen: dict[int, Candidate] = {}

    def cand(m: int) -> Candidate:
        if m not in seen:
            batch = batch_for(m)
            seen[m] = evaluate(era, layout, batch, passes_at(batch, m), gpu_memory_utilization=gpu_memory_utilization,
                               max_model_len=m, min_concurrency=min_concurrency)
        return seen[m]

    def largest(ok: Callable[[Candidate], bool]) -> int | None:
        best: int | None = None
        for lo, hi in (regions or [(1, cap)]):
            hi = min(hi, cap)
            # Block multiples, and the region's top itself when it is not one: a length inside a block
            # costs the whole block (V1 ``max_memory_usage_bytes``: cdiv(max_model_len, block_size)
            # pages), so only the top can lie between multiples. Hybrid models' attention blocks are
            # hundreds to thousands of tokens (2080 for Nemotron-H on 0.19): without the top, a model
            # whose max_position_embeddings starts (8192) was proposed at the multiple below (6240).
            def length(k: int, hi: int = hi) -> int:
                return min(k * bs, hi)

            k = _largest_fitting(-(-max(lo, 1) // bs), -(-hi // bs), lambda k: ok(cand(length(k))))
            if k is not None and length(k) >= max(lo, 1) and (best is None or length(k) > best):
                best = length(k)
        return best

    expected = largest(lambda c: c.fits)
    safe = largest(lambda c: c.fits and c.fits_low) if expected is not None else None
    best = safe if risk == "safe" else expected
    both = dict(risk=risk, max_model_len_safe=safe, max_model_len_expected=expected)
    if best is None:
        smallest = cand(bs)
        why = smallest.reason or "nothing fits"
        if expected is not None:  # starts at the expected value only
            why = (f"nothing starts at the safe end of the interval (max_model_len {expected} starts at the expected "
                   "value; constraints.risk: expected proposes it)")
        return Proposal(gpu_memory_utilization, None, None, None, None, why, None, **both), list(seen.values())
    c = cand(best)
    args = f"--max-model-len {best} --gpu-memory-utilization {float(gpu_memory_utilization)!r}"  # the point as evaluated
    if extra_args:
        args += " " + extra_args
    why = None
    if best == limit:
        why = ("model's max_position_embeddings" if limit == layout.max_position_embeddings
               else f"model's derived max_model_len ({layout.derived_max_len_key}={limit})")
    return Proposal(gpu_memory_utilization, best, c.num_gpu_blocks, c.kv_cache_tokens, c.max_concurrency,
                    f"capped by the {why}" if why else None, args, limiting_stage=c.limiting_stage,
                    stages=c.stages, **point_numbers(c), **both,
                    available_kv_cache_bytes_low=c.available_kv_cache_bytes_low,
                    available_kv_cache_bytes_high=c.available_kv_cache_bytes_high,
                    kv_cache_tokens_low=c.kv_cache_tokens_low, kv_cache_tokens_high=c.kv_cache_tokens_high), \
        list(seen.values())


def point_numbers(c: Candidate) -> dict[str, int]:
    """One evaluated point's own numbers (:data:`tuner.memory.ledger.POINT_NUMBERS`: its profile batch
    and budget terms, bytes): what a proposal of that point carries, on the grid or off it."""
    from tuner.memory.ledger import POINT_NUMBERS

    return {k: int(getattr(c, k)) for k in POINT_NUMBERS}

"""``explain``: the KV-cache budget of one (``gpu_memory_utilization``, ``max_model_len``) point in
plain words, step by step, with the numbers — and, when the point does not start, what would.

Parent side (never imports torch). The numbers come from the simulate job run in a worker
subprocess (:func:`run_jobs`), or from a stored run (:func:`explain_stored`). The narrative is data
first (:func:`explain_point` returns a JSON-able dict whose ``steps`` carry the bytes of each term)
and text second (:func:`render`), so tests and ``--json`` read the same numbers the text prints.

The chain every era follows (see :mod:`tuner.memory.budget`)::

    requested = total × u            (int(), or ceil() from vLLM 0.14)
    − weights − activation peak − non-torch [− CUDA graphs]   = available KV bytes
    available // bytes per block                              = num_gpu_blocks
    blocks × block_size (as the release reports it)           = KV cache tokens
    tokens / max_model_len (as the release reports it)        = full-length requests that fit

"What would make it fit" gives the largest ``max_model_len`` at this ``u`` (the proposal), the ``u``
needed for ``max_model_len`` (arithmetic on the budget terms, then checked by a worker job), and
the same point with an fp8 KV cache and with twice the tensor parallelism (worker jobs).
"""

from __future__ import annotations

from types import SimpleNamespace

import dataclasses
import inspect
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from tuner.memory.budget import requested_memory_bytes
from tuner.question.drop import Drop, load_drop
from tuner.memory.eras import (GiB, V0_FREE_DELTA, V0_PROFILING, V0_WHOLE_GPU, V1_CONSUMED, V1_PROFILING, V1_WHOLE_GPU,
                        Era, era_for)
from tuner.errors import TunerError
from tuner.question.protocol import BudgetTerm, CandidateResult, JobRequest, JobResult, point_of
from tuner.seam.worker import DEFAULT_TIMEOUT_S
from tuner.store.storerules import DEFAULT_PATH

__all__ = ["ExplainInputError", "PreparedJob", "prepare", "run_jobs", "explain_drop", "explain_point",
           "explain_stored", "u_needed", "render", "is_non_monotone"]

Progress = Callable[[str], None]

#: What the budget subtracts, in the era's own words (tuner.memory.eras formula families).
FORMULA_TEXT = {
    V0_FREE_DELTA: "vLLM <=0.6.3: available = total x u - (free memory at start - free memory after the profile run)",
    V0_WHOLE_GPU: "vLLM 0.6.4: available = total x u - (torch allocation peak + everything else on the GPU); "
                  "the weights are part of the torch peak",
    V0_PROFILING: "vLLM 0.6.5-0.10: available = total x u - (weights + torch peak increase + non-torch increase)",
    V1_WHOLE_GPU: "vLLM V1 0.7-0.9.0: available = total x u - (torch allocation peak + everything else on the GPU)",
    V1_PROFILING: "vLLM V1 0.9.1-0.26: available = requested - (weights + torch peak increase + non-torch increase)"
                  " [- CUDA graph estimate from 0.20]",
    V1_CONSUMED: "vLLM V1 0.27+: available = requested - (memory consumed since start + transient headroom) "
                 "- CUDA graph estimate",
}


#: vLLM 0.34 with the extensible KV cache (tuner.memory.budget.extensible_kv_budget).
EXTENSIBLE_FORMULA_TEXT = ("vLLM V1 0.34 (extensible KV cache, sized after warmup and CUDA-graph capture): available = "
                           "min(requested - non-KV used, headroom - margin) - transient peak "
                           "(vllm/v1/worker/extensible_kv_cache.py measure_kv_cache_bytes)")


def _extensible_steps(cand: dict, withheld: int) -> list[dict]:
    """0.34's extra budget terms: the headroom cap (device memory free after warmup and capture less
    the margin) where it binds, else an info line saying the requested budget did."""
    head, margin = int(cand.get("extensible_headroom_bytes") or 0), int(cand.get("extensible_margin_bytes") or 0)
    text = (f"headroom after warmup and CUDA-graph capture {_gib(head)} GiB (total - other processes - CUDA context "
            f"and start-up baseline - non-KV memory) less the margin max(1 GiB, 0.75 x transient peak) = "
            f"{_gib(margin)} GiB (3 GiB floor on ROCm)")
    if withheld > 0:
        return [{"name": "extensible_headroom", "op": "-", "bytes": withheld,
                 "text": f"{text}: binds, takes this beyond requested - terms"}]
    return [{"name": "extensible_headroom", "op": "info", "bytes": head - margin,
             "text": f"{text}: does not bind (requested - terms is smaller)"}]


class ExplainInputError(TunerError):
    """The point to explain does not exist (no such stored run, no candidate at the given u/M)."""


def _gib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _same_u(a: float, b: float) -> bool:
    return abs(float(a) - float(b)) < 1e-9


def _tokens_how(era, blocks: int, block_size: int, tokens: int, per_req: int, m: int) -> str:
    """How the release's "GPU KV cache size" came out when it is not blocks x block_size: up to
    0.21 ``num_blocks // num_groups x block_size`` (the group count found from the numbers), from
    0.22 ``int(max_concurrency x max_model_len)`` with ``max_concurrency = num_blocks / per_req``
    (vllm/v1/core/kv_cache_utils.py). Printed only where the arithmetic gives ``tokens``."""
    if era.version < (0, 22, 0) and block_size and tokens % block_size == 0 and tokens:
        per = tokens // block_size
        groups = next((g for g in range(1, blocks + 1) if blocks // g == per), None)
        if groups:
            return f"{blocks} blocks // {groups} KV cache groups x {block_size} tokens"
    if era.version >= (0, 22, 0) and per_req and int(blocks / per_req * m) == tokens:
        return (f"int(concurrency x max_model_len) = int({blocks} / {per_req} blocks per request x {m})")
    return "as this release reports it (int(concurrency x max_model_len))"


def _weights_do_not_fit() -> str:
    """The start of the weights refusal (:data:`tuner.memory.search.WEIGHTS_DO_NOT_FIT`)."""
    from tuner.memory.search import WEIGHTS_DO_NOT_FIT

    return WEIGHTS_DO_NOT_FIT


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _default_worker() -> Callable[..., dict]:
    """:func:`tuner.seam.worker.run_in_worker`, looked up at call time (tests substitute it)."""
    from tuner.seam import worker

    return worker.run_in_worker


# ------------------------------------------------------------------------------------------------
# Running jobs (worker subprocesses; the parent never imports torch)
# ------------------------------------------------------------------------------------------------


@dataclass
class PreparedJob:
    """A validated drop, its resolved device and model config, ready to become worker requests."""

    drop: Drop
    device: dict
    config_path: str
    #: the request :func:`tuner.jobs.app.prepare_job` built (method, calibration, …); None = simulate.
    base: JobRequest | None = None

    @property
    def base_request(self) -> JobRequest:
        """The job's request as prepared (the drop as given)."""
        return self.base if self.base is not None else JobRequest(self.drop, self.config_path, dict(self.device))

    def request(self, *, gpu_memory_utilization: list[float] | None = None, max_model_len: list[int] | None = None,
                min_concurrency: float | None = None, **settings: Any) -> dict:
        """A worker request (its wire object) for this drop with some settings replaced
        (``kv_cache_dtype``, ``tensor_parallel_size``, …; the candidate lists;
        ``constraints.min_concurrency``)."""
        d = dataclasses.replace(self.drop, **settings)
        cand = d.candidates
        if gpu_memory_utilization is not None:
            cand = dataclasses.replace(cand, gpu_memory_utilization=tuple(sorted(set(float(u)
                                                                                   for u in gpu_memory_utilization))))
        if max_model_len is not None:
            cand = dataclasses.replace(cand, max_model_len=tuple(sorted(set(int(m) for m in max_model_len))))
        d = dataclasses.replace(d, candidates=cand)
        if min_concurrency is not None:
            d = dataclasses.replace(d, constraints=dataclasses.replace(d.constraints,
                                                                       min_concurrency=float(min_concurrency)))
        return self.base_request.replace(drop=d, config_path=self.config_path, device=dict(self.device)).to_wire()


def prepare(drop_path: str | None, *, nvml: Any = None, drop: Drop | None = None) -> PreparedJob:
    """Load and check a drop as ``profile`` does (:func:`tuner.jobs.app.prepare_job`: simulate only,
    device resolved, model config found offline). ``drop``: an already validated drop (``check``
    builds one from a ``vllm serve`` line) instead of the file ``drop_path``.

    Raises:
        DropError / DeviceError / EraError: invalid drop (names file and field).
    """
    from tuner.jobs.app import prepare_job

    drop = drop if drop is not None else load_drop(drop_path)
    from tuner.jobs.job import drop_era

    drop_era(drop)  # EraError / DropError early, naming the version
    request, dev = prepare_job(drop, nvml=nvml)
    return PreparedJob(drop, dev, request.config_path, request)


def run_jobs(jobs: list[tuple[str, dict]], *, job_name: str, worker: Callable[..., dict] | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S, progress: Progress | None = None,
             max_parallel: int = 4) -> dict[str, dict | TunerError]:
    """Run labelled worker requests, up to ``max_parallel`` at once (each its own subprocess).

    Returns ``{label: result}``, with the :class:`TunerError` in place of a result for a job that
    failed (the caller decides whether that is fatal). ``progress`` gets one line per finished job.
    """
    out: dict[str, dict | TunerError] = {}
    total = len(jobs)
    worker = worker or _default_worker()
    if not jobs:
        return out
    t0 = time.perf_counter()

    try:
        relays = progress is not None and "on_progress" in inspect.signature(worker).parameters
    except (TypeError, ValueError):
        relays = False

    def one(item):
        label, request = item
        kw = {"on_progress": (lambda line: progress(f"{label}: {line}"))} if relays else {}
        try:
            return label, worker(request, job=f"{job_name}[{label}]", timeout_s=timeout_s, **kw)
        except TunerError as exc:
            return label, exc

    with ThreadPoolExecutor(max_workers=max(1, min(max_parallel, total))) as pool:
        for done, (label, res) in enumerate(pool.map(one, jobs), 1):
            out[label] = res
            if progress:
                state = "failed" if isinstance(res, TunerError) else "done"
                progress(f"[{done}/{total}] {label} {state} ({time.perf_counter() - t0:.1f} s)")
    return out


# ------------------------------------------------------------------------------------------------
# The narrative as data
# ------------------------------------------------------------------------------------------------


def is_non_monotone(points: list[dict]) -> bool:
    """True when some ``max_model_len`` starts above one that does not (at one u)."""
    from tuner.memory.search import candidate_starts

    seen_fail = False
    for p in sorted(points, key=lambda p: point_of(p).max_model_len):
        if not candidate_starts(p):
            seen_fail = True
        elif seen_fail:
            return True
    return False


def surface_at(candidates: list[dict], u: float) -> list[dict]:
    """The recorded fit surface at one u: one row per max_model_len, ascending."""
    rows = [c for c in candidates if _same_u(point_of(c).gpu_memory_utilization, u)]
    from tuner.memory.search import candidate_starts

    keys = ("max_model_len", "max_num_batched_tokens", "fits", "num_gpu_blocks", "kv_cache_tokens", "max_concurrency",
            "reason")
    return [{**{k: c.get(k) for k in keys}, "starts": candidate_starts(c)}
            for c in sorted(rows, key=lambda c: point_of(c).max_model_len)]


def blocks_needed(era: Era, max_model_len: int, block_size: int, min_concurrency: float = 1.0) -> int:
    """Blocks the engine must find for ``max_model_len`` to start with ``min_concurrency`` full-length
    requests (dense full-attention model; the admission check and the concurrency log by era)."""
    m, bs = max_model_len, block_size
    per_req = _cdiv(m, bs)
    if era.engine == "V0" or era.version < (0, 9, 1):
        # admission: blocks·bs ≥ M (V0) / bytes ≥ cdiv(M, bs) pages (V1 0.7–0.9.0); concurrency = blocks·bs / M
        return max(per_req, math.ceil(min_concurrency * m / bs - 1e-9), 1)
    null = 1 if era.version >= (0, 30, 0) else 0  # 0.30+: the check plans without the null block
    return max(per_req + null, math.ceil(min_concurrency * per_req - 1e-9), 1)


def u_needed(era: Era, *, total_memory_bytes: int, fixed_bytes: int, block_bytes: int, blocks: int) -> dict:
    """The smallest ``gpu_memory_utilization`` (3 decimals) whose budget holds ``blocks`` blocks.

    ``fixed_bytes`` = weights + activation peak + non-torch + graphs (they do not depend on u).
    Returns ``{needed_available_kv_bytes, needed_requested_bytes, exact, value, possible}``;
    ``value`` is rounded up to 0.001 and checked against the era's rounding of total × u.
    """
    need_avail = blocks * block_bytes
    need_req = need_avail + fixed_bytes
    exact = need_req / total_memory_bytes
    value = math.ceil(exact * 1000 - 1e-6) / 1000
    while requested_memory_bytes(era, total_memory_bytes, value) < need_req and value <= 1.0:
        value = round(value + 0.001, 3)
    return {"blocks": blocks, "needed_available_kv_bytes": need_avail, "needed_requested_bytes": need_req,
            "exact": exact, "value": value, "possible": value <= 1.0}


def _safe_end_shortfall(bands: list | tuple, requested_bytes: int) -> tuple[int, float]:
    """How far the interval's safe (low-KV) end lies below the expected KV
    (:func:`tuner.memory.uncertainty.kv_interval`), split into the bytes that do not depend on
    ``gpu_memory_utilization`` and the fraction of the request that does (the request's own band and
    each not-modelled input's band are fractions of the request, tuner/memory/uncertainty.py)."""
    fixed, scaled = 0, 0
    for b in bands or ():
        if b.get("name") == "kv_cache_memory_bytes":
            continue
        down = int(b["bytes"]) - int(b["low_bytes"]) if b.get("op") == "=" else int(b["high_bytes"]) - int(b["bytes"])
        if b.get("name") == "requested" or str(b.get("name", "")).startswith("not modelled:"):
            scaled += down
        else:
            fixed += down
    return fixed, (scaled / requested_bytes if requested_bytes else 0.0)


def u_needed_safe(era: Era, *, total_memory_bytes: int, fixed_bytes: int, block_bytes: int, blocks: int,
                  bands: list | tuple, requested_bytes: int) -> dict:
    """:func:`u_needed` at the interval's safe end: the smallest ``gpu_memory_utilization`` (3
    decimals) whose budget holds ``blocks`` blocks with every band at its low-KV end (the safe end
    ``risk: safe`` proposes at, as the ``max_model_len`` remedy does). ``bands``: the candidate's
    term bands (dicts); ``requested_bytes``: the request they were computed at."""
    down_fixed, frac = _safe_end_shortfall(bands, requested_bytes)
    need_avail = blocks * block_bytes
    need_req = math.ceil((need_avail + fixed_bytes + down_fixed) / max(1e-9, 1.0 - frac))
    exact = need_req / total_memory_bytes
    value = math.ceil(exact * 1000 - 1e-6) / 1000

    def low_kv(v: float) -> int:
        req = requested_memory_bytes(era, total_memory_bytes, v)
        return int(req - fixed_bytes - down_fixed - frac * req)

    while low_kv(value) < need_avail and value <= 1.0:
        value = round(value + 0.001, 3)
    return {"blocks": blocks, "needed_available_kv_bytes": need_avail, "needed_requested_bytes": need_req,
            "exact": exact, "value": value, "possible": value <= 1.0, "risk": "safe"}


def _u_remedy_line(un: dict, approx: str) -> str:
    """explain's line for a ``gpu_memory_utilization`` that helps: at ``risk: safe`` the value whose
    interval's safe end starts, the expected-value one beside it, and what the check found."""
    safe = un.get("safe") if un.get("risk") == "safe" and (un.get("safe") or {}).get("possible") else None
    r = safe or un
    at = f" at the interval's safe end ({un['value']:.3f} at the expected value)" if safe else ""
    text = (f"    - gpu_memory_utilization >= {r['value']:.3f}{at}{approx}: {r['blocks']} blocks need "
            f"{_gib(r['needed_available_kv_bytes'])} GiB of KV{' at the safe end' if safe else ''}, so requested "
            f"must reach {_gib(r['needed_requested_bytes'])} GiB = {r['exact']:.4f} of total")
    v = r.get("verified")
    if v and "error" not in v and v.get("fits") is not None:
        if safe and v.get("fits_low") is not None:
            text += (f"; checked: {'starts' if v['fits_low'] else 'still does NOT start'} at the safe end with "
                     f"{v['kv_cache_tokens_low']} KV tokens ({v['kv_cache_tokens']} at the expected value)")
        else:
            text += (f"; checked: {'starts' if v['fits'] else 'still does NOT start'} with "
                     f"{v['kv_cache_tokens']} KV tokens")
    return text


def _run_for(result: dict, cand: dict) -> dict | None:
    """The first-stage pass a candidate was evaluated with."""
    key = cand.get("run_key")
    for r in result.get("runs", []):
        if key is not None and r.get("key") == key:
            return r
    runs = [r for r in result.get("runs", []) if r["max_num_batched_tokens"] == cand["max_num_batched_tokens"]]
    return runs[0] if runs else None


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype in ("float32", "fp32", "float") else 2


def _activation_detail(run: dict | None, model: dict | None, dtype: str, tp: int, plugin: str | None) -> list[str]:
    """Plain words for what makes the activation peak (the profile run's dummy batch)."""
    if not run:
        return []
    n, r = run["max_num_batched_tokens"], run.get("num_reqs") or run.get("num_sampled_rows")
    lines = [f"profile run: one forward over N = {n} tokens in R = {r} dummy requests, then the dummy sampler "
             f"over R rows of logits"]
    fwd, smp = run.get("forward_peak_bytes"), run.get("sampler_peak_bytes")
    if fwd is not None:
        text = f"forward over N = {n} tokens peaked at {_gib(fwd)} GiB"
        if model and model.get("intermediate_size") and plugin == "generic":
            inter = model["intermediate_size"] // tp
            db = _dtype_bytes(dtype)
            text += (f"; its largest tensors are the MLP's fused gate_up output [{n} x {2 * inter}] "
                     f"({_gib(n * 2 * inter * db)} GiB) and the activation [{n} x {inter}] ({_gib(n * inter * db)} GiB)"
                     f" in {dtype}")
        lines.append(text)
    if smp is not None and r:
        text = f"sampler over R x vocab"
        if model and model.get("vocab_size"):
            v = model["vocab_size"]
            text += f" = {r} x {v} fp32 logits ({_gib(r * v * 4)} GiB per copy)"
        text += f" added {_gib(smp)} GiB on top of what the forward left alive"
        lines.append(text)
    if fwd is not None and smp is not None:
        lines.append(f"simulated peak = the larger of the two (the forward peak, or the forward's output plus the "
                     f"sampler peak) = {_gib(run.get('activation_peak_bytes'))} GiB")
    return lines


def _batch_note(era: Era, n: int, m: int) -> str | None:
    if era.engine == "V0" and n == max(m, 2048) and m <= 32768:
        return (f"N = max(max_model_len, 2048) = {n}: this era keeps chunked prefill off at or below 32768 tokens, so "
                "the profile batch, and the activation peak, grow with max_model_len")
    if era.engine == "V0" and m > 32768 and n < m:
        return f"N = {n}: above 32768 tokens this era turns chunked prefill on and the profile batch shrinks"
    return None


#: Reason prefix of vLLM's refusal of a max_model_len above the model's derived maximum.
MAX_LEN_REFUSAL = "User-specified max_model_len"


def _signed(name: str, nbytes: int, text: str) -> dict:
    """A step whose bytes may be negative, written as ``+`` or ``-`` a non-negative amount."""
    return {"name": name, "op": "-" if nbytes >= 0 else "+", "bytes": abs(int(nbytes)), "text": text}


def steps_add_up(steps: list[dict]) -> int:
    """The KV bytes the steps give: the first ``=`` term, ``-``/``+`` the others (``info`` steps
    are shown, not counted) — equal to the ``available_kv`` step by construction."""
    total = None
    for s in steps:
        if "bytes" not in s or s["name"] == "available_kv":
            continue
        if s["op"] == "=" and total is None:
            total = s["bytes"]
        elif s["op"] == "-":
            total -= s["bytes"]
        elif s["op"] == "+":
            total += s["bytes"]
    return total


def _communication_steps(era: Era, drop: dict, device: dict, non_torch: int) -> list[dict]:
    """The TP group's share of the non-torch term as its own steps (bytes; empty at TP 1): NCCL
    (NVLS on NVSwitch, the communicator where the era charges it) and custom all-reduce's IPC
    buffers, with whether custom all-reduce is on and why (:mod:`tuner.memory.budget`)."""
    from tuner.memory.budget import (custom_all_reduce_buffer_bytes, custom_all_reduce_enabled,
                                     lazy_communicator_bytes, nccl_profile_bytes, symm_mem_buffer_bytes)
    from tuner.memory.eras import V0_PROFILING, V1_CONSUMED, V1_PROFILING
    from tuner.jobs.job import topology_for

    tp = int(drop.get("tensor_parallel_size") or 1)
    if tp <= 1 or era.budget_formula not in (V0_PROFILING, V1_PROFILING, V1_CONSUMED):
        return []
    if era.engine == "V0" and era.version < (0, 7, 0):
        return []
    topo = topology_for(device, drop)
    nccl = nccl_profile_bytes(era, tp, topo)
    lazy = lazy_communicator_bytes(era, tp, topo)
    on, why = custom_all_reduce_enabled(tp, topo)
    charged = era.engine == "V0" or era.version < (0, 11, 0)
    ar = custom_all_reduce_buffer_bytes(era, tp, topo) if charged else 0
    symm = symm_mem_buffer_bytes(era, tp, topo)
    if nccl + ar + (symm if charged else 0) > non_torch:
        return []
    out = [{"name": "nccl", "op": "-", "bytes": nccl,
            "text": f"NCCL buffers of the TP{tp} group ({topo.interconnect}"
                    f"{', NVLS' if topo.interconnect == 'nvswitch' and nccl > lazy else ''}"
                    f"{', the communicator the profile creates' if lazy else ''})"}]
    state = "on" if on else f"off: {why}"
    out.append({"name": "custom_all_reduce", "op": "-", "bytes": ar,
                "text": f"custom all-reduce IPC buffers ({state}"
                        f"{'' if charged or not on else '; allocated before the start-up snapshot, not charged'})"})
    if symm:
        out.append({"name": "symmetric_memory", "op": "-" if charged else "info", "bytes": symm,
                    "text": f"torch symmetric-memory all-reduce buffer (capability {topo.compute_capability}, TP{tp}; "
                            "VLLM_ALLREDUCE_USE_SYMM_MEM on by default"
                            + (")" if charged else "; allocated at the distributed init, before the start-up "
                                                   "snapshot: not charged)")})
    return out


def _info_steps(era: Era, drop: dict, device: dict, model: dict | None, cand: dict, n: int, tp: int,
                drafter_w: int = 0, run: dict | None = None) -> list[dict]:
    """The ``info`` steps of a point (shown, not subtracted): co-tenants at start, data / expert
    parallelism, speculative decoding."""
    steps: list[dict] = []
    from tuner.jobs.job import other_processes_bytes

    others = other_processes_bytes(device, drop)
    if others:
        from tuner.memory.budget import co_tenant_non_torch_bytes

        charged = co_tenant_non_torch_bytes(era, others)
        steps.append({"name": "other_processes", "op": "info", "bytes": others,
                      "text": "memory other processes hold at start: "
                              + ("counted in the non-torch step (this era's budget is whole-GPU)" if charged else
                                 "outside this instance's budget; vLLM refuses to start when total minus it is below "
                                 "the requested memory" if era.engine == "V1" and era.version >= (0, 9, 1) else
                                 "outside this instance's budget (no free-memory check in this era)")})
    dp, ep = int(drop.get("data_parallel_size") or 1), bool(drop.get("enable_expert_parallel"))
    if dp > 1 or ep:
        from tuner.memory.budget import moe_rank_shape
        from tuner.memory.eras import NUM_EXPERTS_KEYS

        raw = {}
        try:  # the experts come from the model's config.json (parent side: JSON only)
            from tuner.model.modelspec import read_top

            top = read_top((model or {}).get("path") or "")
            raw = top.get("text_config") if isinstance(top.get("text_config"), dict) else top
        except Exception:  # noqa: BLE001 - an explanation never fails on this info step
            raw = {}
        e = next((int(raw[k]) for k in NUM_EXPERTS_KEYS if isinstance(raw.get(k), int) and raw[k] > 0), 0)
        if e:
            here, _i = moe_rank_shape(e, 1 << 20, tensor_parallel_size=tp, data_parallel_size=dp,
                                      enable_expert_parallel=ep)
            how = (f"{here} of {e} experts per MoE layer, whole" if ep and dp * tp > 1
                   else f"all {e} experts, each 1/{dp * tp} of its intermediate size")
        else:
            how = "no MoE layers: every DP rank holds the TP shard of the whole model"
        steps.append({"name": "data_expert_parallel", "op": "info", "bytes": 0,
                      "text": f"data_parallel_size {dp}, expert parallel {'on' if ep else 'off'}: {how} on this "
                              "rank (in the weights step); dense layers TP-sharded, replicated per DP rank"})
    spec = drop.get("speculative_config") or {}
    if spec:
        from tuner.memory.budget import cudagraph_capture_sizes
        from tuner.jobs.job import num_speculative_tokens

        k = num_speculative_tokens(drop, era)
        from tuner.memory.specdecode import spec_decode_capture_sizes

        sizes = spec_decode_capture_sizes(
            cudagraph_capture_sizes(era, int(cand.get("max_num_seqs") or 1), int(n), num_speculative_tokens=k),
            version=era.version, num_speculative_tokens=k, model_runner_v2=bool((run or {}).get("model_runner_v2")))
        steps.append({"name": "speculative_decoding", "op": "info", "bytes": 0,
                      "text": f"speculative decoding {spec.get('method')} with {spec.get('num_speculative_tokens')} "
                              f"tokens: decode steps of {1 + k} tokens per request, {len(sizes)} CUDA-graph capture "
                              f"sizes up to {max(sizes) if sizes else 0} ("
                              + ("no drafter model" if spec.get("method") in ("ngram", "suffix") else
                                 "the checkpoint's MTP layers: their KV layers are in the blocks, their weights "
                                 "in the drafter weights step" if spec.get("method") == "mtp" else
                                 f"the drafter {spec.get('model')}: its KV layers are in the blocks, its weights in "
                                 "the drafter weights step" if drafter_w else
                                 "the drafter's weights, KV layers and profile run are not modelled") + ")"})
    return steps


def _stage_steps(stages: list[dict], limiting: int, u: float) -> list[dict]:
    """One ``info`` step per pipeline stage (PP > 1): its card, layers and terms, and its own
    blocks; the limiting one named (vLLM sizes every worker to the fewest blocks:
    vllm/v1/core/kv_cache_utils.py ``get_kv_cache_configs``, V0 ``determine_num_available_blocks``
    min over workers). The point's other steps are the limiting stage's."""
    out = []
    for st in stages:
        r = int(st.get("pp_rank") or 0)
        lay = st.get("decoder_layers") or []
        card = st.get("device_name") or "the drop's device"
        own = st.get("num_gpu_blocks")
        text = (f"pipeline stage {r} on {card} ({_gib(st.get('total_memory_bytes'))} GiB x {u:g} = "
                f"{_gib(st.get('requested_memory_bytes'))} GiB)"
                + (f", decoder layers {lay[0]}-{lay[1] - 1}" if len(lay) == 2 and lay[1] > lay[0] else "")
                + f", {st.get('kv_layers', 0)} KV layers: weights {_gib(st.get('weights_bytes'))}, activation "
                f"{_gib(st.get('activation_peak_bytes'))}, non-torch {_gib(st.get('non_torch_bytes'))}, graphs "
                f"{_gib(st.get('cuda_graph_bytes'))} GiB -> KV {_gib(st.get('available_kv_cache_bytes'))} GiB"
                + (f", {own} blocks of its own" if own is not None else ""))
        if r == limiting:
            text += ("; the limiting stage: vLLM gives every stage its block count (the minimum over workers); "
                     "the steps above are this stage's")
        out.append({"name": f"stage_{r}", "op": "info", "bytes": int(st.get("available_kv_cache_bytes") or 0),
                    "text": text, "limiting": r == limiting})
    return out


def explain_point(*, drop: dict, device: dict, era: Era, cand: dict, run: dict | None = None,
                  model: dict | None = None, plugin: str | None = None, dtype: str = "bfloat16",
                  block_size: int | None = 16, block_bytes: int | None = None, block_bytes_exact: bool = True,
                  surface: list[dict] | None = None, proposal: dict | None = None,
                  min_concurrency: float = 1.0, measured: bool = False, serve_model: str | None = None,
                  budget: Sequence[BudgetTerm] | None = None, term_sources: dict | None = None) -> dict:
    """One point's budget as data: the terms in bytes, the ``steps`` (name, op, bytes or value,
    text; ``-``/``+`` steps add up from ``requested`` to ``available_kv`` exactly, ``info`` steps
    are shown and not subtracted), the fit surface at this u and, when it does not start,
    ``remedies`` to fill in.

    The terms are the ledger it is given (``budget``: the candidate's itemised terms from the job
    result, :class:`tuner.question.protocol.BudgetTerm`; else the candidate's own, with ``term_sources``):
    each step of a ledger term carries that term's ``source``.

    A simulated point splits the activation term into the simulated profile run, the cuBLAS
    workspace, the safety reserve (``reserve_bytes``) and calibration corrections; ``measured``
    (an engine's own log: ``explain --run`` of a vllm/import run) shows the terms as logged, the
    difference the log's 2-decimal GiB rounding leaves, and blocks inferred from the KV tokens when
    the log printed none (approximate)."""
    p = _point_setup(drop=drop, device=device, era=era, cand=cand, run=run, model=model, plugin=plugin, dtype=dtype,
                     block_size=block_size, block_bytes=block_bytes, block_bytes_exact=block_bytes_exact,
                     surface=surface, proposal=proposal, min_concurrency=min_concurrency, measured=measured,
                     serve_model=serve_model, budget=budget, term_sources=term_sources)
    steps = _activation_steps(p)
    _other_budget_steps(p, steps)
    _kv_steps(p, steps)
    _name_sources(p, steps)
    out = _point_record(p, steps)
    if not out["fits"]:
        out["remedies"] = _remedies(p)
    return out


def _point_setup(*, drop, device, era, cand, run, model, plugin, dtype, block_size, block_bytes,
                 block_bytes_exact, surface, proposal, min_concurrency, measured, serve_model, budget,
                 term_sources) -> SimpleNamespace:
    """Step 1 of :func:`explain_point`: the point's ledger, its limiting pipeline stage's card and the
    activation term's parts (simulated passes, cuBLAS workspace, safety reserve, corrections)."""
    from tuner.memory.budget import unexplained_bytes
    from tuner.memory.search import candidate_starts

    point = CandidateResult.from_wire(cand, term_sources)
    ledger = {t.name: t for t in (budget if budget is not None else point.budget)}
    u, m = point.gpu_memory_utilization, point.max_model_len
    total = int(device["total_memory_bytes"])
    pp_stages = list(cand.get("stages") or [])
    limiting = int(cand.get("limiting_stage") or 0)
    if pp_stages and limiting < len(pp_stages):  # the terms are the limiting stage's, on its own card
        total = int(pp_stages[limiting].get("total_memory_bytes") or total)
        cards = (device.get("stages") or [])
        if len(cards) == len(pp_stages):
            device = {**{k: v for k, v in device.items() if k != "stages"}, **cards[limiting]}
    tp = int(drop.get("tensor_parallel_size") or 1)
    req, w, act = (ledger[k].bytes for k in ("requested", "weights", "activation_peak"))
    nt, g, avail = (ledger[k].bytes for k in ("non_torch", "cuda_graphs", "available_kv"))
    blocks, tokens, conc = cand["num_gpu_blocks"], cand["kv_cache_tokens"], cand["max_concurrency"]
    n = cand["max_num_batched_tokens"]
    starts = candidate_starts(cand)
    rounding = "ceil" if era.requested_rounds_up else "int"
    subtracts_graphs = era.subtracts_cudagraph_estimate
    sim = None if measured else (run or {}).get("activation_peak_bytes")
    # the activation term's parts: simulated passes + cuBLAS workspace + safety reserve + correction
    ws = int(cand.get("workspace_bytes") or 0)
    reserve = cand.get("reserve_bytes")
    act_corr = int(cand.get("activation_correction_bytes") or 0)
    nt_corr = int(cand.get("non_torch_correction_bytes") or 0)
    g_corr = int(cand.get("cuda_graph_correction_bytes") or 0) if subtracts_graphs else 0
    split = not measured and "workspace_bytes" in cand
    if not measured and reserve is None:  # a stored row: the reserve is a function of the era and weights
        reserve = unexplained_bytes(era, int(w or 0), int(sim or 0) + ws)
    reserve = int(reserve or 0)
    if measured:
        act_sim, rest = act, 0
    elif split:
        act_sim, rest = (act - ws - reserve - act_corr - int(cand.get("unattributed_activation_bytes") or 0)
                         - int(cand.get("drafter_activation_bytes") or 0)
                         - int(cand.get("drafter_forward_bytes") or 0) - int(cand.get("drafter_buffer_bytes") or 0)), 0
    elif sim is not None:  # stored simulate row: workspace and corrections are not stored apart
        act_sim, rest = sim, act - sim - reserve
    else:
        act_sim, rest, reserve = act - reserve, 0, reserve
    act_text = ("activation peak of the profile run (torch peak increase, as the engine logged it)" if measured
                else "activation peak of the profile run (simulated passes)")
    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "unexplained_bytes"})


def _activation_steps(p: SimpleNamespace) -> list[dict]:
    """Step 2: the steps from ``requested`` through the activation term's parts (drafter, workspace, reserve)."""
    act_sim, act_text, cand, drop, dtype = p.act_sim, p.act_text, p.cand, p.drop, p.dtype
    measured, model = p.measured, p.model
    n, plugin, req, reserve, rest, rounding, run = p.n, p.plugin, p.req, p.reserve, p.rest, p.rounding, p.run
    split, total, tp, u, w, ws = p.split, p.total, p.tp, p.u, p.w, p.ws
    steps = [
        {"name": "requested", "op": "=", "bytes": req,
         "text": f"requested = total {_gib(total)} GiB x gpu_memory_utilization {u:g} ({rounding}, bytes)"},
        {"name": "weights", "op": "-", "bytes": w - int(cand.get("drafter_weights_bytes") or 0),
         "text": f"weights of one GPU's shard ({dtype}, TP {tp})"},
        {"name": "activation_peak", "op": "-", "bytes": act_sim,
         "text": act_text, "detail": _activation_detail(run, model, dtype, tp, plugin)},
    ]
    drafter_w = int(cand.get("drafter_weights_bytes") or 0)
    drafter_act = int(cand.get("drafter_activation_bytes") or 0) if split else 0
    if drafter_act:
        steps.append({"name": "drafter_activation", "op": "-", "bytes": drafter_act,
                      "text": f"the target's auxiliary hidden states the drafter reads, alive through the profile "
                              f"run ({n} tokens x hidden x dtype per aux layer)"})
    drafter_fwd = int(cand.get("drafter_forward_bytes") or 0) if split else 0
    if drafter_fwd:
        steps.append({"name": "drafter_forward", "op": "-", "bytes": drafter_fwd,
                      "text": f"the drafter's own forward in the profile run ({n} tokens, after the target's; "
                              "what it adds above the target's peak with the target's output hidden states alive, "
                              "tuner/memory/specdecode.py)"})
    elif split and int(cand.get("drafter_forward_peak_bytes") or 0):
        steps.append({"name": "drafter_forward", "op": "info", "bytes": int(cand["drafter_forward_peak_bytes"]),
                      "text": f"the drafter's own forward in the profile run ({n} tokens, after the target's, with "
                              "the target's output hidden states alive) peaks below the target's: adds nothing "
                              "(tuner/memory/specdecode.py)"})
    drafter_buf = int(cand.get("drafter_buffer_bytes") or 0) if split else 0
    if drafter_buf:
        steps.append({"name": "drafter_buffers", "op": "-", "bytes": drafter_buf,
                      "text": f"the drafter's persistent input buffers ({n} tokens: hidden states and input "
                              "embeddings, ids, positions, slot mapping), charged by this release's "
                              "consumed-memory budget (tuner/memory/specdecode.py)"})
    if drafter_w:
        sc = drop.get("speculative_config") or {}
        steps.append({"name": "drafter_weights", "op": "-", "bytes": drafter_w,
                      "text": f"speculative decoding drafter's weights on this rank ({sc.get('method')}"
                              + (f" {sc['model']}" if sc.get("model") else ": the checkpoint's MTP layers")
                              + ", tuner/memory/specdecode.py)"})
    if split and ws:
        steps.append({"name": "cublas_workspace", "op": "-", "bytes": ws,
                      "text": "cuBLAS workspace torch allocates on the profile run's first GEMM"})
    unattributed = int(cand.get("unattributed_activation_bytes") or 0) if split else 0
    if unattributed:  # a stored row's activation term beyond its parts, with no calibration in the store
        steps.append(_signed("unattributed", unattributed, "the stored activation term beyond its simulated "
                                                           "passes, workspace and reserve (no calibration applies; "
                                                           "no stored column explains it)"))
    if rest:
        steps.append(_signed("cublas_workspace", rest, "cuBLAS workspace and calibration corrections (a stored row "
                                                        "keeps them together)"))
    if reserve and not measured:
        steps.append({"name": "safety_reserve", "op": "-", "bytes": reserve,
                      "text": "safety reserve for start-up memory no term explains, see docs/prediction.md"})
    p.drafter_w = drafter_w
    return steps


def _other_budget_steps(p: SimpleNamespace, steps: list[dict]) -> None:
    """Step 3: non-torch memory, its communication and info steps, pipeline stages, CUDA graphs,
    calibration, the extensible cache and the balancing step, down to ``available_kv``."""
    act_corr, avail, cand, device, drafter_w = p.act_corr, p.avail, p.cand, p.device, p.drafter_w
    drop, era = p.drop, p.era
    g, g_corr, limiting, measured, model, n, nt = p.g, p.g_corr, p.limiting, p.measured, p.model, p.n, p.nt
    nt_corr, pp_stages, run, split, subtracts_graphs = p.nt_corr, p.pp_stages, p.run, p.split, p.subtracts_graphs
    tp, u = p.tp, p.u
    nt_text = ("non-torch memory (as the engine logged it)" if measured
               else "non-torch memory (CUDA context, NCCL and cuBLAS workspaces, allocator overhead)")
    comm = [] if measured else _communication_steps(era, drop, device, nt - nt_corr)
    # an ``info`` step (symmetric memory from 0.11 on) is shown beside the term, not carved out of it
    steps.append({"name": "non_torch", "op": "-", "bytes": nt - nt_corr - sum(s["bytes"] for s in comm
                                                                           if s["op"] == "-"),
                  "text": nt_text if not comm else "non-torch memory besides the TP group's communication buffers "
                                                   "(module loads: cuBLAS/cuBLASLt, Triton, attention kernels)"})
    steps.extend(comm)
    steps.extend(_info_steps(era, drop, device, model, cand, n, tp, drafter_w, run=run))
    if cand.get("drafter_terms_not_stored"):  # explain --run: the store keeps the drafter's weights only
        steps.append({"name": "drafter_terms", "op": "info", "bytes": 0,
                      "text": "the drafter's activation, forward, input buffers and CUDA graphs are not stored "
                              "columns: they stay inside the activation and CUDA graph steps (live explain "
                              "shows them apart)"})
    steps.extend(_stage_steps(pp_stages, limiting, u))
    drafter_g = int(cand.get("drafter_cuda_graph_bytes") or 0) if subtracts_graphs else 0
    attn_ws = int(cand.get("attention_workspace_bytes") or 0) if subtracts_graphs else 0
    if subtracts_graphs and not g and (run or {}).get("model_runner_v2") and era.version < (0, 29, 0):
        steps.append({"name": "cuda_graphs", "op": "-", "bytes": 0,
                      "text": "CUDA graph memory estimate (none: Model Runner V2 before 0.29 estimates 0; "
                              "graphs are captured after the cache is sized)"})
    elif subtracts_graphs:
        steps.append({"name": "cuda_graphs", "op": "-", "bytes": g - g_corr - drafter_g - attn_ws,
                      "text": "CUDA graphs captured before the cache is sized (in the memory measured after warmup)"
                              if getattr(era, "extensible_kv_cache", False) else "CUDA graph memory estimate"})
        if attn_ws:
            steps.append({"name": "attention_workspace", "op": "-", "bytes": attn_ws,
                          "text": "FlashInfer workspace, in the first FULL graph capture (tuner/memory/attention.py)"})
        if drafter_g:
            steps.append({"name": "drafter_cuda_graphs", "op": "-", "bytes": drafter_g,
                          "text": "the drafter's PIECEWISE graphs, captured with the target's in the CUDA-graph "
                                  "memory profile (tuner/memory/specdecode.py)"})
    else:
        steps.append({"name": "cuda_graphs", "op": "info", "bytes": g,
                      "text": "CUDA graph memory (captured after the cache is sized in this era)"})
    corr = act_corr + nt_corr + g_corr
    if split and (act_corr or nt_corr or g_corr):
        parts = ", ".join(f"{k} {v / GiB:+.3f} GiB" for k, v in
                          (("activation", act_corr), ("non-torch", nt_corr), ("graphs", g_corr)) if v)
        steps.append(_signed("calibration", corr, f"calibration corrections from measured runs ({parts})"))
    withheld = 0 if measured else int(cand.get("extensible_withheld_bytes") or 0)
    if cand.get("extensible_headroom_bytes") is not None and not measured:
        steps.extend(_extensible_steps(cand, withheld))
    gap = steps_add_up(steps + [{"name": "available_kv"}]) - avail
    # --kv-cache-memory-bytes: vLLM returns the given bytes (gpu_worker.py determine_available_memory)
    kv_fixed = None if measured else drop.get("kv_cache_memory_bytes")
    if gap and kv_fixed is not None:
        steps.append(_signed("kv_cache_memory_bytes", gap, (
            "the rest of total x u, not used" if gap > 0 else "beyond total x u") + ": kv_cache_memory_bytes "
            "fixes the KV cache and vLLM ignores gpu_memory_utilization"))
    elif gap:  # a measured run's terms are logged in GiB with 2 decimals
        steps.append(_signed("rounding", gap, "difference to the engine's KV bytes (its log prints GiB with 2 "
                                              "decimals)" if measured else "difference not attributed to a term"))
    steps.append({"name": "available_kv", "op": "=", "bytes": avail,
                  "text": "KV cache bytes" + (" (as the engine logged it)" if measured else
                                              " (kv_cache_memory_bytes, as given)" if kv_fixed is not None else "")})
    p.corr = corr
    p.kv_fixed = kv_fixed
    p.withheld = withheld


def _kv_steps(p: SimpleNamespace, steps: list[dict]) -> None:
    """Step 4: the KV cache's blocks, tokens and full-length concurrency."""
    avail, block_bytes, block_bytes_exact, block_size, blocks = p.avail, p.block_bytes, p.block_bytes_exact, p.block_size, p.blocks
    cand, conc = p.cand, p.conc
    era, m, measured, n, tokens = p.era, p.m, p.measured, p.n, p.tokens
    note = _batch_note(era, n, m)
    if note:
        steps[2]["detail"] = [note] + steps[2]["detail"]
    blocks_inferred = False
    if measured and not blocks and tokens and avail > 0 and block_size:  # the log printed no block count
        blocks, blocks_inferred = int(tokens) // block_size, True
        block_bytes, block_bytes_exact = (avail // blocks if blocks else None), False
    if avail <= 0:
        steps.append({"name": "blocks", "op": "->", "value": 0, "text": "nothing is left for the KV cache"})
    elif blocks_inferred:
        steps.append({"name": "blocks", "op": "->", "value": blocks, "approximate": True, "block_bytes": block_bytes,
                      "block_bytes_exact": False,
                      "text": f"blocks ~ {tokens} KV tokens / {block_size} (no block count in the log; "
                              f"~{block_bytes:,} bytes per block)"})
    else:
        approx = "" if block_bytes_exact else "~"
        bb = f"{approx}{block_bytes:,} bytes per block" if block_bytes else "bytes per block"
        per = f"{block_size} tokens" if block_size else "the run's block size, not stored,"
        steps.append({"name": "blocks", "op": "->", "value": blocks, "block_bytes": block_bytes,
                      "block_bytes_exact": block_bytes_exact,
                      "text": f"blocks = {avail:,} // {bb} ({per} x every layer's K and V)"
                              + (" less what whole 2 MiB granules per layer segment leave out (0.34 extensible "
                                 "KV cache, blocks_within)" if block_bytes and avail > 0 and blocks < avail // block_bytes
                                 and cand.get("extensible_headroom_bytes") is not None else "")})
    # blocks per full-length request, from the (4-decimal) concurrency: a dense model's is cdiv(M, bs)
    per_req = round(blocks / conc) if conc and blocks and block_size else 0
    if per_req and abs(blocks / conc - _cdiv(m, block_size)) <= 1e-3 * _cdiv(m, block_size) + 0.5:
        per_req = _cdiv(m, block_size)
    if measured:
        how = "as the engine logged it" + (f" ({blocks} blocks x {block_size} tokens)"
                                           if blocks and block_size and tokens == blocks * block_size
                                           and not blocks_inferred else "")
    elif not block_size:
        how = "as stored (the run's block size is not stored)"
    else:
        how = (f"{blocks} blocks x {block_size} tokens" if tokens == blocks * block_size
               else _tokens_how(era, blocks, block_size, tokens, per_req, m))
    steps.append({"name": "tokens", "op": "->", "value": tokens, "text": f"KV cache tokens = {how}"})
    tilde = "~" if blocks_inferred else ""
    conc_how = (f"{tokens} tokens / {m}" if era.engine == "V0" or era.version < (0, 9, 1)
                else f"{tilde}{blocks} blocks / cdiv({m}, block_size) (the run's block size is not stored)"
                if not block_size
                else f"{tilde}{blocks} blocks / cdiv({m}, {block_size}) = {tilde}{blocks} / {_cdiv(m, block_size)}"
                if not per_req or per_req == _cdiv(m, block_size)
                else f"{tilde}{blocks} blocks / {per_req} blocks per full-length request (every KV cache group's "
                     f"pages for {m} tokens: attention cdiv({m}, {block_size}) = {_cdiv(m, block_size)}, plus state "
                     "or window groups; vllm/v1/core/kv_cache_utils.py)")
    if measured:
        conc_how = f"as the engine logged it ({conc_how})"
    steps.append({"name": "concurrency", "op": "->", "value": conc,
                  "text": f"full-length requests that fit = {conc_how}"})
    p.block_bytes = block_bytes
    p.block_bytes_exact = block_bytes_exact
    p.blocks = blocks
    p.blocks_inferred = blocks_inferred


def _name_sources(p: SimpleNamespace, steps: list[dict]) -> None:
    """Step 5: each ledger term's step names where its bytes came from."""
    ledger = p.ledger
    for step in steps:  # each ledger term's step names where its bytes came from
        term = ledger.get(step["name"])
        if term is not None and step["op"] in ("=", "-", "info"):
            step["source"] = term.source


def _point_record(p: SimpleNamespace, steps: list[dict]) -> dict:
    """Step 6: the point as data (every figure the report prints)."""
    act, avail, block_bytes, block_size, blocks = p.act, p.avail, p.block_bytes, p.block_size, p.blocks
    blocks_inferred, cand = p.blocks_inferred, p.cand
    conc, corr, device, drop, dtype, era, g = p.conc, p.corr, p.device, p.drop, p.dtype, p.era, p.g
    kv_fixed, m, measured, min_concurrency, model = p.kv_fixed, p.m, p.measured, p.min_concurrency, p.model
    n, nt = p.n, p.nt
    proposal, req, reserve, run, serve_model = p.proposal, p.req, p.reserve, p.run, p.serve_model
    split, starts = p.split, p.starts
    subtracts_graphs, surface, tokens, total, tp = p.subtracts_graphs, p.surface, p.tokens, p.total, p.tp
    u, w = p.u, p.w
    withheld, ws = p.withheld, p.ws
    surf = surface or []
    refused_len = str(cand.get("reason") or "").startswith(MAX_LEN_REFUSAL)
    out = {
        "drop": drop.get("name"), "model": drop.get("model"), "device": dict(device), "era": era.name,
        "engine": era.engine, "budget_formula": era.budget_formula,
        "formula_text": (EXTENSIBLE_FORMULA_TEXT if getattr(era, "extensible_kv_cache", False) else FORMULA_TEXT.get(era.budget_formula)) if kv_fixed is None else (
            "kv_cache_memory_bytes: the KV cache is the given bytes; the profile run still runs, gpu_memory_utilization "
            "is not used (vllm/v1/worker/gpu_worker.py determine_available_memory)"),
        "dtype": dtype, "kv_cache_dtype": drop.get("kv_cache_dtype", "auto"), "tensor_parallel_size": tp,
        "pipeline_parallel_size": int(drop.get("pipeline_parallel_size") or 1), "block_size": block_size,
        "gpu_memory_utilization": u, "max_model_len": m, "total_memory_bytes": total,
        "requested_memory_bytes": req, "weights_bytes": w, "activation_peak_bytes": act, "non_torch_bytes": nt,
        "cuda_graph_bytes": g, "cuda_graph_subtracted": bool(subtracts_graphs),
        "reserve_bytes": 0 if measured else reserve, "workspace_bytes": ws if split else None,
        "calibration_bytes": corr if split else None,
        "available_kv_cache_bytes": avail, "kv_block_bytes": block_bytes,
        "num_gpu_blocks": blocks, "num_gpu_blocks_inferred": blocks_inferred,
        "kv_cache_tokens": tokens, "max_concurrency": conc,
        "max_num_batched_tokens": n, "num_reqs": (run or {}).get("num_reqs") or (run or {}).get("num_sampled_rows"),
        "forward_peak_bytes": (run or {}).get("forward_peak_bytes"),
        "sampler_peak_bytes": (run or {}).get("sampler_peak_bytes"),
        "vocab_size": (model or {}).get("vocab_size"), "min_concurrency": min_concurrency,
        "starts": starts, "fits": bool(cand["fits"]), "reason": cand.get("reason"), "steps": steps,
        "max_len_refused": refused_len,
        "surface": surf, "non_monotone": is_non_monotone(surf), "notes": [], "remedies": None,
        "interval": interval_of(cand),
        # the proposal at this u: the largest length that starts at the interval's safe end and at the
        # expected value (tuner.memory.search.propose), for check's "starts for sure" setting
        "max_model_len_safe": (proposal or {}).get("max_model_len_safe"),
        "max_model_len_expected": (proposal or {}).get("max_model_len_expected"),
    }
    if cand.get("extensible_headroom_bytes") is not None and not measured:  # vLLM 0.34's extensible cache
        out.update(extensible_headroom_bytes=int(cand["extensible_headroom_bytes"]),
                   extensible_margin_bytes=int(cand.get("extensible_margin_bytes") or 0),
                   extensible_withheld_bytes=withheld,
                   extensible_u_withheld_bytes=cand.get("extensible_u_withheld_bytes"),
                   extensible_capacity_bytes=cand.get("extensible_capacity_bytes"))
        from tuner.memory.search import extensible_refusal_note

        # 0.34: a refusal on the reservation quotes other figures than the budget (said why)
        out["engine_error_note"] = extensible_refusal_note(
            cand, (proposal or {}).get("max_model_len_expected") or (proposal or {}).get("max_model_len"))
    if serve_model and proposal and proposal.get("vllm_args") and point_of(proposal).max_model_len == m and out["fits"]:
        out["command"] = f"vllm serve {serve_model} {proposal['vllm_args']}"
    p.refused_len = refused_len
    return out


def _u_remedy(p: SimpleNamespace, fixed: int) -> dict:
    """The ``gpu_memory_utilization`` remedy: the smallest value that starts at the expected value
    (:func:`u_needed`) and, under ``safe``, the smallest that starts at the interval's safe end
    (:func:`u_needed_safe`, as the ``max_model_len`` remedy proposes at ``risk: safe``); ``risk``: the
    drop's, which one explain leads with."""
    blocks = blocks_needed(p.era, p.m, p.block_size, p.min_concurrency)
    kw = dict(total_memory_bytes=p.total, fixed_bytes=fixed, block_bytes=p.block_bytes, blocks=blocks)
    risk = (p.proposal or {}).get("risk") or (p.drop.get("constraints") or {}).get("risk") or "safe"
    out = {**u_needed(p.era, **kw), "risk": risk, "approximate": not p.block_bytes_exact, "verified": None}
    if p.cand.get("bands"):
        out["safe"] = {**u_needed_safe(p.era, **kw, bands=list(p.cand["bands"]), requested_bytes=int(p.req)),
                       "verified": None}
    return out


def _remedies(p: SimpleNamespace) -> dict:
    """Step 7 (a point that does not start): the remedies to fill in."""
    act, block_bytes, block_bytes_exact, block_size, cand = p.act, p.block_bytes, p.block_bytes_exact, p.block_size, p.cand
    device, drop = p.device, p.drop
    era, g, kv_fixed, m, min_concurrency = p.era, p.g, p.kv_fixed, p.m, p.min_concurrency
    nt, proposal = p.nt, p.proposal
    refused_len, subtracts_graphs, total, w, withheld = p.refused_len, p.subtracts_graphs, p.total, p.w, p.withheld
    rem: dict[str, Any] = {"largest_max_model_len": None, "gpu_memory_utilization": None}
    if proposal is not None:
        rem["largest_max_model_len"] = {k: proposal.get(k) for k in
                                        ("max_model_len", "num_gpu_blocks", "kv_cache_tokens", "max_concurrency",
                                         "risk", "max_model_len_expected", "max_model_len_safe")}
    if refused_len:  # no memory setting helps: the length itself is refused
        rem["max_len_refused"] = True
    elif str(cand.get("reason") or "").startswith(_weights_do_not_fit()):
        # vLLM fails loading the weights before the memory profile: no gpu_memory_utilization helps
        rem.update(gpu_memory_utilization={
            "possible": False, "value": None, "exact": None, "verified": None,
            "why": "the weights do not load; vLLM fails before it sizes anything from gpu_memory_utilization"})
    elif block_bytes and block_size and kv_fixed is None:  # with kv_cache_memory_bytes no u changes the cache
        fixed = w + act + nt + (g if subtracts_graphs else 0)
        rem.update(gpu_memory_utilization=_u_remedy(p, fixed))
        from tuner.memory.budget import co_tenant_non_torch_bytes
        from tuner.jobs.job import other_processes_bytes

        others = other_processes_bytes(device, drop)
        un = rem["gpu_memory_utilization"]
        if others and not co_tenant_non_torch_bytes(era, others) \
                and un["needed_requested_bytes"] > total - others:
            # init_device's free-memory check (vllm/v1/worker/gpu_worker.py): the requested budget
            # total × u must not exceed the memory other processes leave free
            un.update(possible=False, value=None, free_bytes=int(total - others),
                      why=f"other processes leave {(total - others) / (1 << 30):.2f} GiB free, less than the "
                          f"{un['needed_requested_bytes'] / (1 << 30):.2f} GiB it would take")
        if withheld > 0:  # 0.34: the device headroom, not gpu_memory_utilization, caps the cache
            rem["gpu_memory_utilization"].update(
                possible=False, value=None,
                why="the extensible KV cache is capped by the device memory left after warmup and CUDA-graph "
                    "capture less its margin; a larger gpu_memory_utilization does not add to it")
    return rem




# ------------------------------------------------------------------------------------------------
# explain DROP.yaml
# ------------------------------------------------------------------------------------------------


def _find(cands: list[dict], u: float, m: int) -> dict | None:
    for c in cands:
        if _same_u(point_of(c).gpu_memory_utilization, u) and point_of(c).max_model_len == m:
            return c
    return None


def _stage_block_bytes(per_stage: list | None, cand: dict) -> int | None:
    """Bytes per block of the pipeline stage the candidate's numbers come from (the one whose
    ``available // bytes per block`` gives its blocks; stage 0 when none does)."""
    lim = cand.get("limiting_stage")
    if lim is not None and per_stage and int(lim) < len(per_stage) and per_stage[int(lim)]:
        return per_stage[int(lim)]  # the stage the engine's minimum comes from
    stages = [b for b in (per_stage or []) if b]
    for b in stages:
        if cand["available_kv_cache_bytes"] > 0 and cand["available_kv_cache_bytes"] // b == cand["num_gpu_blocks"]:
            return b
    return stages[0] if stages else None


def _variant_summary(result: dict | TunerError | None, u: float, m: int) -> dict | None:
    if result is None:
        return None
    if isinstance(result, TunerError):
        return {"error": str(result)}
    c = _find(result["candidates"], u, m)
    prop = next((p for p in result["proposals"] if _same_u(point_of(p).gpu_memory_utilization, u)), None)
    return {"fits": None if c is None else bool(c["fits"]), "num_gpu_blocks": c and c["num_gpu_blocks"],
            "kv_cache_tokens": c and c["kv_cache_tokens"], "max_concurrency": c and c["max_concurrency"],
            "available_kv_cache_bytes": c and c["available_kv_cache_bytes"], "reason": c and c["reason"],
            "largest_max_model_len": prop and point_of(prop).max_model_len,
            "fits_low": c and c.get("fits_low"), "kv_cache_tokens_low": c and c.get("kv_cache_tokens_low")}


def calibration_for_job(job: PreparedJob, db_url: str | None) -> dict | None:
    """The stored calibration (:func:`tuner.jobs.app.lookup_calibration`) for a simulate job, or None when
    the store does not exist or holds no measured runs for this model, device kind and era."""
    from tuner.jobs.app import lookup_calibration
    from tuner.store.litestore import open_lite, store_missing

    if job.base_request.method != "simulate" or store_missing(db_url):
        return None
    lite = open_lite(db_url, readonly=True)  # opens only a store with no calibrations: none apply
    if lite is not None:
        lite.close()
        return None
    from tuner.store.database import open_store, store_exists

    if not store_exists(db_url):
        return None
    store = open_store(db_url, readonly=True)
    try:
        return lookup_calibration(job.base_request, store)
    finally:
        store.close()


def _calibration_note(cand: dict, cal: dict) -> dict:
    """Before/after of one point: the corrections applied and the uncalibrated KV numbers."""
    unc = cand.get("uncalibrated") or {}
    return {"corrections": {k: v for k, v in cal.items() if k.endswith("_delta_bytes")},
            "runs": cal.get("runs"),
            "uncalibrated_available_kv_cache_bytes": unc.get("available_kv_cache_bytes"),
            "uncalibrated_num_gpu_blocks": unc.get("num_gpu_blocks"),
            "uncalibrated_kv_cache_tokens": unc.get("kv_cache_tokens"),
            "uncalibrated_fits": unc.get("fits")}


def explain_drop(drop_path: str, *, gpu_memory_utilization: float | None = None, max_model_len: int | None = None,
                 worker: Callable[..., dict] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 progress: Progress | None = None, variants: bool = True, nvml: Any = None,
                 db_url: str | None = None, calibrate: bool = True, drop: Drop | None = None,
                 cache: bool = True, unmodelled: Sequence[dict] = (), cross_check: str | None = None) -> dict:
    """Explain a drop at ``u`` (default: each of the drop's) and ``M`` (default: the proposal at u).

    Runs the drop's job in a worker (restricted to ``u``; ``M`` added to the drop's grid so the fit
    surface around it is shown), then, for points that do not start, the remedy jobs (the u needed,
    fp8 KV cache, twice the tensor parallelism) in parallel workers.

    Returns ``{"drop", "device", "explanations": [one per point]}``.

    Raises:
        DropError / DeviceError / EraError: invalid drop or option; WorkerError / TunerError: the job failed.
    """
    store_note = None  # what this explanation read from and wrote to the store (None: the caller's worker)
    if worker is None:  # the store's pass memo first (tuner.jobs.passmemo; cache=False: --no-cache)
        worker, store_note = memo_with_store_note(db_url, cache)
    from tuner.jobs.app import serve_model

    job = prepare(drop_path, nvml=nvml, drop=drop)
    d = job.drop
    model_dir = serve_model(d)
    cal_warning = None
    try:
        cal = calibration_for_job(job, db_url) if calibrate else None
    except TunerError as exc:  # an unreadable store never stops an explanation
        cal, cal_warning = None, f"calibration skipped: {exc}"
    if cal is not None:  # measured runs of this model/device/era correct the simulation
        job.base = job.base_request.replace(calibration=cal)
    if unmodelled:  # inputs read but not modelled (check's flags): named, and they widen the interval
        job.base = job.base_request.replace(unmodelled=tuple(dict(x) for x in unmodelled))
    if cross_check is not None:  # the engine cross-check: stored only, or run where none is current (tuner.engine.stored)
        job.base = job.base_request.replace(cross_check=cross_check)
    us = [gpu_memory_utilization] if gpu_memory_utilization is not None else None
    grid = None
    if max_model_len is not None:
        grid = sorted(set(d.candidates.max_model_len or ()) | {int(max_model_len)})
    if progress:
        progress(f"explain {d.name}: running the profile job")
    base = run_jobs([("profile", job.request(gpu_memory_utilization=us, max_model_len=grid))], job_name=d.name,
                    worker=worker, timeout_s=timeout_s, progress=progress)["profile"]
    if isinstance(base, TunerError):
        raise base
    from tuner.jobs.job import drop_era

    era = drop_era(d)
    dd = {**d.to_dict(), "model": model_dir}
    targets = []
    for prop in base["proposals"]:
        u = point_of(prop).gpu_memory_utilization
        m = max_model_len if max_model_len is not None else (
            point_of(prop).max_model_len or _wanted_length(job, base))
        targets.append((prop, u, m))
    missing = [(u, m) for _, u, m in targets if _find(base["candidates"], u, m) is None]
    extra: dict = {"candidates": [], "runs": []}
    if missing:  # a proposal that is not a grid point: evaluate it in one more job
        got = run_jobs([("points", job.request(gpu_memory_utilization=[u for u, _ in missing],
                                               max_model_len=[m for _, m in missing]))],
                       job_name=d.name, worker=worker, timeout_s=timeout_s, progress=progress)["points"]
        if isinstance(got, TunerError):
            raise got
        extra = got
    explanations = []
    for prop, u, m in targets:
        cand, src = _find(base["candidates"], u, m), base
        if cand is None:
            cand, src = _find(extra["candidates"], u, m), extra
        point = JobResult.from_wire(src).candidate(u, m)
        explanations.append(explain_point(
            budget=point.budget if point is not None else None, term_sources=src.get("term_sources"),
            drop=dd, device=job.device, era=era, cand=cand, run=_run_for(src, cand), model=base["model"],
            plugin=base["plugin"], dtype=base["dtype"], block_size=base["block_size"],
            block_bytes=_stage_block_bytes(base.get("kv_block_bytes"), cand), surface=surface_at(base["candidates"], u),
            proposal=prop, min_concurrency=d.constraints.min_concurrency, serve_model=model_dir))
        if cal is not None:
            explanations[-1]["calibration"] = _calibration_note(cand, cal)
    if variants:
        _fill_remedies(job, explanations, base, worker=worker, timeout_s=timeout_s, progress=progress)
    return {"drop": d.name, "model": model_dir, "device": job.device, "era": base["era"], "plugin": base["plugin"],
            "engine_version": d.engine_version, "release_assumed": base.get("release_assumed"),
            "warnings": base.get("warnings", []) + ([cal_warning] if cal_warning else []),
            "assumptions": list(base.get("assumptions") or []),
            "term_sources": base.get("term_sources"), "engine_check": base.get("engine_check"),
            "uncertainty": base.get("uncertainty"),
            "pass_source": base.get("pass_source"), "store": store_note, "explanations": explanations}


def memo_with_store_note(db_url: str | None, cache: bool) -> tuple[Callable[..., dict], dict]:
    """The pass-memo worker of ``explain`` and ``plot`` (:func:`tuner.jobs.memoanswer.memo_worker`) and the note of
    what it does to the store, filled in as its jobs run: ``{"path", "read", "pass_memo_entries_written"}``
    (``path`` None where the store does not exist: the memo neither reads nor creates one)."""
    import os
    import threading

    from tuner.jobs.memoanswer import memo_worker
    from tuner.store.litestore import sqlite_file

    file = sqlite_file(db_url, DEFAULT_STORE)  # None: a server URL (it exists; the store says if not)
    exists = file is None or os.path.exists(file)  # as tuner.store.database.store_exists, without SQLAlchemy
    note = {"path": store_label(db_url) if exists else None, "named": db_url or DEFAULT_STORE,
            "read": "pass memo" if exists and cache else None, "pass_memo_entries_written": 0}
    lock = threading.Lock()  # the remedy jobs run in parallel threads

    def wrote(n: int) -> None:
        with lock:
            note["pass_memo_entries_written"] += n

    return memo_worker(db_url, _default_worker(), enabled=cache, on_written=wrote), note


#: The store ``explain`` reads and writes the pass memo of without ``--db`` (``profile``'s default,
#: relative to the current directory).
DEFAULT_STORE = DEFAULT_PATH


def store_label(db_url: str | None) -> str:
    """The store as the report names it: a SQLite file's absolute path, a server URL without its password."""
    import os
    import re

    from tuner.store.litestore import sqlite_file

    path = sqlite_file(db_url, DEFAULT_STORE)
    if path is not None:
        return os.path.abspath(path)
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", str(db_url))


def store_line(note: dict | None) -> str | None:
    """The report's ``store:`` line (as ``check``'s): which store was read and what was written to
    it, e.g. ``store: /srv/var/ctx-tuner.sqlite (its pass memo read; 14 pass-memo entries written)``;
    None where the caller gave its own worker (no store was read here)."""
    if not note:
        return None
    if not note.get("path"):
        named = note.get("named") or DEFAULT_STORE
        missing = f"{named} does not exist here" if named == DEFAULT_STORE else f"--db {named} does not exist"
        return f"store: none ({missing}; nothing read or written)"
    n = int(note.get("pass_memo_entries_written") or 0)
    read = note.get("read")
    read = ("its pass memo read" if read == "pass memo" else f"{read} read" if read
            else "its pass memo not read (--no-cache)")
    wrote = f"{n} pass-memo entr{'y' if n == 1 else 'ies'} written" if n else "nothing written"
    return f"store: {note['path']} ({read}; {wrote})"


def _wanted_length(job: PreparedJob, base: dict) -> int:
    """The length to explain where nothing starts at a utilization: the longest of the drop's grid,
    else the model's derived maximum (what ``vllm serve`` without ``--max-model-len`` asks for),
    within ``constraints.max_model_len_cap`` — not the search's first probe (one block, 16 tokens,
    which no one serves)."""
    d = job.drop
    if d.candidates.max_model_len:
        return int(max(d.candidates.max_model_len))
    try:
        from tuner.model.modelspec import derived_max

        m = int(derived_max(job.config_path, d.hf_overrides)[0])
    except (TunerError, OSError, ValueError, TypeError, KeyError):
        m = int(base["model"].get("max_position_embeddings") or base["block_size"])
    cap = getattr(d.constraints, "max_model_len_cap", None)
    return min(m, int(cap)) if cap else m


def _fill_remedies(job: PreparedJob, explanations: list[dict], base: dict, **kw: Any) -> None:
    """Worker jobs for the remedies of every point that does not start (one batch, in parallel)."""
    failing = [e for e in explanations if not e["fits"] and not e.get("max_len_refused")]
    if not failing:
        return
    d = job.drop
    us = sorted({point_of(e).gpu_memory_utilization for e in failing})
    ms = sorted({point_of(e).max_model_len for e in failing})
    jobs: list[tuple[str, dict]] = []
    if d.kv_cache_dtype == "auto":
        jobs.append(("fp8_kv_cache", job.request(gpu_memory_utilization=us, max_model_len=ms, kv_cache_dtype="fp8")))
    tp2 = d.tensor_parallel_size * 2
    heads = base["model"].get("num_attention_heads") or 0
    tp_ok = heads and heads % tp2 == 0
    if tp_ok:
        jobs.append(("tensor_parallel", job.request(gpu_memory_utilization=us, max_model_len=ms,
                                                    tensor_parallel_size=tp2)))
    u_remedies = [point_of(e["remedies"]).gpu_memory_utilization for e in failing]
    checks = sorted({r["value"] for r in u_remedies if r and r["possible"]}
                    | {r["safe"]["value"] for r in u_remedies if r and (r.get("safe") or {}).get("possible")})
    if checks:
        jobs.append(("u_check", {**job.request(gpu_memory_utilization=checks, max_model_len=ms), "search": False}))
    res = run_jobs(jobs, job_name=d.name, progress=kw.get("progress"), worker=kw["worker"], timeout_s=kw["timeout_s"])
    for e in failing:
        u, m, rem = point_of(e).gpu_memory_utilization, point_of(e).max_model_len, e["remedies"]
        rem["fp8_kv_cache"] = (_variant_summary(res.get("fp8_kv_cache"), u, m) if d.kv_cache_dtype == "auto"
                               else {"error": f"kv_cache_dtype is already {d.kv_cache_dtype}"})
        if rem["fp8_kv_cache"] is not None:
            rem["fp8_kv_cache"]["kv_cache_dtype"] = "fp8"
        if tp_ok:
            rem["tensor_parallel"] = {**_variant_summary(res.get("tensor_parallel"), u, m), "tensor_parallel_size": tp2}
        else:
            rem["tensor_parallel"] = {"tensor_parallel_size": tp2,
                                      "error": f"{heads} attention heads do not split over {tp2} GPUs"}
        un = point_of(rem).gpu_memory_utilization
        if un and un["possible"] and "u_check" in res:
            un["verified"] = _variant_summary(res["u_check"], un["value"], m)
        if un and (un.get("safe") or {}).get("possible") and "u_check" in res:
            un["safe"]["verified"] = _variant_summary(res["u_check"], un["safe"]["value"], m)


# ------------------------------------------------------------------------------------------------
# explain --run ID (stored; no job)
# ------------------------------------------------------------------------------------------------


def _stored_model_dir(model: str, drop_path: str | None) -> str:
    """A stored drop's model as ``vllm serve`` needs it: a local path resolved against the drop
    file's directory (absolute), an HF id or a path-less imported run unchanged."""
    import os
    from pathlib import Path

    if not model or not drop_path or not Path(drop_path).is_absolute() and not Path(drop_path).exists():
        return model
    p = Path(os.path.normpath(Path(drop_path).resolve().parent / os.path.expanduser(model)))
    if model.startswith((".", "/", "~")) or p.exists():
        return str(p.parent if p.name == "config.json" else p)
    return model


def explain_stored(store, run_id: int, *, gpu_memory_utilization: float | None = None,
                   max_model_len: int | None = None) -> dict:
    """Explain a stored profile run: its candidates (simulate) or its own measurement (cuda, vllm,
    import), optionally only at ``u`` / ``M``. Bytes per block are inferred (``available // blocks``;
    for a log that printed no block count, blocks from the KV tokens), marked approximate.

    Raises:
        ExplainInputError: no run with that id, or no candidate at the given u / M.
    """
    from tuner.store import records

    stored = records.run(store, run_id)
    if stored is None:
        raise ExplainInputError(f"no profile run with id {run_id}", where=store.where)
    run = stored.as_dict()
    drop_rec = records.drop(store, stored.drop_id)
    drop_row = drop_rec.as_dict() if drop_rec is not None else {}
    era = era_for(stored.engine_version)
    total = int(stored.device_total_memory_bytes or 0)
    device = {"name": stored.device_name, "total_memory_bytes": total}
    model_dir = _stored_model_dir(stored.model, drop_row.get("path"))
    dd = {**_stored_drop_fields(drop_row), "name": drop_row.get("name"), "model": model_dir,
          "kv_cache_dtype": stored.kv_cache_dtype, "tensor_parallel_size": stored.tensor_parallel_size,
          "pipeline_parallel_size": stored.pipeline_parallel_size}
    run_d = {**run, "num_reqs": stored.num_sampled_rows}
    if stored.method == "simulate":
        cands = [c.as_dict() for c in records.candidates_of_run(store, stored.id)]
        all_drop = [c.as_dict() for c in records.candidates_of_drop(store, stored.drop_id)]
        if not cands:  # a pipeline stage that did not limit the blocks: the drop's candidates are another run's
            holders = sorted({c.get("profile_run_id") for c in all_drop if c.get("profile_run_id") is not None})
            if holders:
                raise ExplainInputError(
                    f"profile run {run_id} ({stored.device_name}) has no candidates of its own: drop "
                    f"{stored.drop_id}'s candidates are stored under profile run "
                    f"{', '.join(map(str, holders))} ("
                    + ("the limiting pipeline stage" if int(stored.pipeline_parallel_size or 1) > 1
                       else "the pass they were evaluated with; this run is another pass of the same job")
                    + f"); use explain --run {holders[0]}",
                    where=store.where)
            raise ExplainInputError(f"profile run {run_id} has no candidates", where=store.where)
    else:
        u0 = stored.gpu_memory_utilization
        if u0 is None or not total:
            raise ExplainInputError(f"profile run {run_id} ({stored.method}) has no gpu_memory_utilization or device "
                                    "total memory to explain", where=store.where)
        fits = stored.status == "ok" and not stored.error_message
        cands = [{
            "gpu_memory_utilization": u0, "max_model_len": stored.max_model_len or 0,
            "max_num_batched_tokens": stored.max_num_batched_tokens, "fits": fits, "starts": fits,
            "reason": stored.error_message or stored.error,
            "requested_memory_bytes": requested_memory_bytes(era, total, u0), "weights_bytes": stored.weights_bytes or 0,
            "activation_peak_bytes": stored.activation_peak_bytes or 0, "non_torch_bytes": stored.non_torch_bytes or 0,
            "cuda_graph_bytes": stored.cuda_graph_bytes or 0,
            "available_kv_cache_bytes": stored.available_kv_cache_bytes or 0,
            "num_gpu_blocks": stored.num_gpu_blocks or 0, "kv_cache_tokens": stored.kv_cache_tokens or 0,
            "max_concurrency": stored.max_concurrency or 0.0}]
        all_drop = cands
    if gpu_memory_utilization is not None:
        cands = [c for c in cands if _same_u(point_of(c).gpu_memory_utilization, gpu_memory_utilization)]
    if max_model_len is not None:
        cands = [c for c in cands if point_of(c).max_model_len == max_model_len]
    if not cands:
        at = ", ".join(f"{k} {v}" for k, v in (("gpu_memory_utilization", gpu_memory_utilization),
                                                ("max_model_len", max_model_len)) if v is not None)
        raise ExplainInputError(f"profile run {run_id} has no candidate at {at}", where=store.where)
    props = [p.as_dict() for p in records.proposals_of_drop(store, stored.drop_id)]
    grid = (dd.get("candidates") or {}).get("max_model_len")
    if max_model_len is None and stored.method == "simulate" and dd.get("candidates") and not grid:
        # no max_model_len grid: the candidates are the search's probe points (16, ...); explain the
        # proposal's point at each u, as live explain does
        at_prop = [c for c in cands if any(_same_u(point_of(p).gpu_memory_utilization, point_of(c).gpu_memory_utilization)
                                           and point_of(p).max_model_len == point_of(c).max_model_len for p in props)]
        cands = at_prop or cands
    # the block size the run sized its blocks with (a hybrid model's is its page: 1600, 784, ...);
    # a run stored before the column was written for simulate rows has none: said, not assumed 16
    # (a measured log that named none: vLLM's default 16, as before)
    block_size = (int(run["block_size"]) if run.get("block_size")
                  else 16 if run["method"] != "simulate" else None)
    calibrated = _store_has_calibrations(store, stored, dd.get("quantization"))
    # every candidate of the drop shares one block size: the tightest available // blocks bounds it
    bounds = [x["available_kv_cache_bytes"] // x["num_gpu_blocks"] for x in all_drop
              if x.get("num_gpu_blocks") and x.get("available_kv_cache_bytes")]
    explanations = []
    for c in cands:
        bb = min(bounds) if bounds else None
        if run["method"] == "simulate" and run.get("activation_peak_bytes") is not None \
                and int(run.get("pipeline_parallel_size") or 1) == 1:
            # the stored row keeps the activation term whole: the reserve and the cuBLAS workspace
            # follow from the era, the weights and the device; the rest is the calibration
            from tuner.memory.budget import profile_overhead_bytes, unexplained_bytes
            from tuner.memory.devices import lookup

            dev = lookup(str(run["device_name"] or ""))
            ws = profile_overhead_bytes(dev.compute_capability if dev is not None else None, era)
            # the candidate's weights are the target's (the pass row's) plus a drafter's
            target_w = int(run.get("weights_bytes") or c["weights_bytes"] or 0)
            drafter_w = max(0, int(c["weights_bytes"] or 0) - target_w)
            reserve = unexplained_bytes(era, target_w, int(run["activation_peak_bytes"] or 0) + ws)
            rest = c["activation_peak_bytes"] - run["activation_peak_bytes"] - ws - reserve
            c = {**c, "workspace_bytes": ws, "reserve_bytes": reserve, "drafter_weights_bytes": drafter_w,
                 "max_num_seqs": c.get("max_num_seqs") or run.get("max_num_seqs"),
                 "drafter_terms_not_stored": bool(dd.get("speculative_config")),
                 "activation_correction_bytes": rest if calibrated else 0,
                 "unattributed_activation_bytes": 0 if calibrated else rest}
        u_c = point_of(c).gpu_memory_utilization
        prop = next((p for p in props if _same_u(point_of(p).gpu_memory_utilization, u_c)), None)
        e = explain_point(term_sources=records.json_column(stored.term_sources),
                          drop=dd, device=device, era=era, cand=c, run=run_d, dtype=run["dtype"],
                          block_size=block_size, block_bytes=bb, block_bytes_exact=False,
                          surface=surface_at(all_drop, point_of(c).gpu_memory_utilization), proposal=prop,
                          measured=run["method"] != "simulate")
        e["run_id"] = run["id"]
        e["method"] = run["method"]
        explanations.append(e)
    return {"drop": drop_row.get("name"), "model": model_dir, "device": device, "era": era.name,
            "plugin": run.get("plugin"), "warnings": [], "run_id": run["id"], "explanations": explanations,
            "term_sources": _json_column(run.get("term_sources")), "engine_check": _json_column(run.get("engine_check"))}


def _stored_drop_fields(drop_row: dict) -> dict:
    """The stored drop's own fields (speculative_config, disable_custom_all_reduce, ...) as the live
    explain passes them (``Drop.to_dict``), parsed from ``drops.content``; {} when it does not parse."""
    from tuner.question.drop import parse_drop

    text = drop_row.get("content")
    if not text:
        return {}
    try:
        return parse_drop(text, drop_row.get("path") or "stored.yaml").to_dict()
    except Exception:  # an old or foreign drop text: explain from the columns alone
        return {}


def _store_has_calibrations(store, stored, quantization: str | None) -> bool:
    """Whether the store holds usable calibrations for the run's model config, device, era, layout,
    dtype and quantization (the key :func:`tuner.jobs.app.lookup_calibration` matches): only then is the
    remainder of a stored activation term a calibration correction."""
    try:
        return bool(store.calibration_rows(
            device_name=stored.device_name, era=stored.era, model_config_sha256=stored.model_config_sha256,
            model=stored.model, tensor_parallel_size=stored.tensor_parallel_size,
            pipeline_parallel_size=stored.pipeline_parallel_size, dtype=stored.dtype, quantization=quantization))
    except Exception:  # a store without the query: no calibrations it could show
        return False


def _json_column(text: str | None) -> Any:
    """A stored JSON text column (``term_sources``, ``engine_check``), None when absent or unreadable."""
    import json

    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


# ------------------------------------------------------------------------------------------------
# Text
# ------------------------------------------------------------------------------------------------


def _term(step: dict) -> str:
    if step["op"] == "info":  # shown, not subtracted
        return f"  {_gib(step['bytes']):>7} GiB  ({step['bytes']:,} bytes; not subtracted)"
    return f"{step['op']} {_gib(step['bytes']):>7} GiB  ({step['bytes']:,} bytes)"


def verdict_text(e: dict) -> str:
    """"starts", "starts, but fewer than min_concurrency …" or "does NOT start"."""
    starts = e.get("starts", e["fits"])
    if e["fits"]:
        return "starts"
    if starts:
        return (f"starts, but fewer than min_concurrency ({e.get('min_concurrency', 1):g}) full-length requests fit")
    return "does NOT start"


def interval_of(cand: dict) -> dict | None:
    """A candidate's interval (:mod:`tuner.memory.uncertainty`) as ``explain`` shows it: the KV bytes,
    blocks, tokens and concurrency at the low (safe) and high ends, whether it starts at each, and
    the term bands that are not exact, the widest first. None for a candidate without bands (a
    stored row, a measured run)."""
    if not cand.get("bands"):
        return None
    from tuner.memory.uncertainty import TermBand, widest_first

    bands = [TermBand(**{k: b[k] for k in TermBand.__dataclass_fields__ if k in b}) for b in cand["bands"]]
    out = {f"{k}_{end}": cand.get(f"{k}_{end}") for k in ("available_kv_cache_bytes", "num_gpu_blocks",
                                                         "kv_cache_tokens", "max_concurrency", "starts")
           for end in ("low", "high")}
    out["bands"] = [b.to_dict() for b in widest_first(bands)]
    return out


def interval_lines(iv: dict | None, indent: str = "  ") -> list[str]:
    """The interval in words: both ends, then each band, the widest first, with its source and
    what widened it."""
    if not iv:
        return []
    lines = [f"{indent}interval: KV {_gib(iv['available_kv_cache_bytes_low'])}-{_gib(iv['available_kv_cache_bytes_high'])}"
             f" GiB, {iv['num_gpu_blocks_low']}-{iv['num_gpu_blocks_high']} blocks, {iv['kv_cache_tokens_low']}-"
             f"{iv['kv_cache_tokens_high']} KV tokens; at the safe end it "
             f"{'starts' if iv['starts_low'] else 'does NOT start'}, at the high end it "
             f"{'starts' if iv['starts_high'] else 'does NOT start'} (tuner/memory/uncertainty.py)"]
    if iv["bands"]:
        lines.append(f"{indent}bands, widest first (± on the KV; source -> band):")
    for b in iv["bands"]:
        from tuner.memory.uncertainty import band_text

        why = f"; {b['widened_by']}" if b.get("widened_by") else ""
        lines.append(f"{indent}  {b['name']:<40} {band_text(b)}  ({b['source']} -> {b['band_source']}{why})")
    return lines


def render_point(e: dict) -> str:
    """One explanation as numbered plain-text steps."""
    u, m = point_of(e).gpu_memory_utilization, point_of(e).max_model_len
    verdict = verdict_text(e)
    src = f" (stored run {e['run_id']}, {e['method']})" if e.get("run_id") else ""
    lines = [f"gpu_memory_utilization {u:g}, max_model_len {m}: {verdict}{src}"]
    if e.get("formula_text"):
        lines.append(f"  budget rule: {e['formula_text']}")
    from tuner.memory.search import WEIGHTS_DO_NOT_FIT

    weights_refused = not e["fits"] and str(e.get("reason") or "").startswith(WEIGHTS_DO_NOT_FIT)
    # vLLM fails loading the weights: the budget below them is never computed
    steps = e["steps"][:2] if weights_refused else e["steps"]
    k = 0
    for s in steps:
        k += 1
        if "bytes" in s:
            lines.append(f"  {k}. {s['text']:<84} {_term(s)}")
            for d in s.get("detail") or []:
                lines.append(f"       {d}")
        else:
            approx = "~" if s.get("approximate") else ""
            lines.append(f"  {k}. {s['text']:<84} = {approx}{s['value']}")
    if e.get("command"):
        lines.append(f"  {e['command']}")
    lines += [] if weights_refused else interval_lines(e.get("interval"))
    if weights_refused:
        lines.append(f"  {e['reason']}")
    elif not e["fits"]:
        lines.append(f"  {'vLLM' if not e.get('starts', False) else 'constraint'}: {e['reason']}")
        if e.get("engine_error_note"):
            lines.append(f"  why other figures: {e['engine_error_note']}")
    cal = e.get("calibration")
    if cal:
        terms = ", ".join(f"{k.replace('_delta_bytes', '')} {v / GiB:+.3f} GiB" for k, v in cal["corrections"].items() if v)
        lines.append(f"  calibrated from measured runs ({terms or 'no correction'}); before calibration: "
                     f"{_gib(cal['uncalibrated_available_kv_cache_bytes'])} GiB KV, {cal['uncalibrated_num_gpu_blocks']} blocks, "
                     f"{cal['uncalibrated_kv_cache_tokens']} tokens, "
                     f"{'starts' if cal['uncalibrated_fits'] else 'does NOT start'}")
    for n in e.get("notes") or []:
        lines.append(f"  note: {n}")
    surf = e.get("surface") or []
    if len(surf) > 1:
        lines += ["", f"  fit surface at gpu_memory_utilization {u:g}:",
                  f"    {'max_model_len':>13} {'N':>7} {'starts':>6} {'ok':>3} {'blocks':>7} {'KV tokens':>10} "
                  f"{'conc.':>7}"]
        for p in surf:
            mark = "  <- explained" if point_of(p).max_model_len == m else ""
            lines.append(f"    {point_of(p).max_model_len:>13} {p['max_num_batched_tokens']:>7} "
                         f"{'yes' if p.get('starts', p['fits']) else 'NO':>6} {'yes' if p['fits'] else 'NO':>3} "
                         f"{p['num_gpu_blocks']:>7} {p['kv_cache_tokens']:>10} {p['max_concurrency']:>7.2f}{mark}")
        if e["non_monotone"]:
            lines.append("    not monotone: a longer max_model_len starts where a shorter one does not "
                         "(the profile batch N changes with max_model_len in this era)")
    rem = e.get("remedies")
    if rem:
        goal = "start" if not e.get("starts") else f"meet min_concurrency {e.get('min_concurrency', 1):g}"
        lines += ["", f"  what would make max_model_len {m} {goal}:"]
        if rem.get("max_len_refused"):
            lines.append("    - a max_model_len at or below the model's derived maximum (no memory setting helps; "
                         "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 overrides the check at the model's own risk: positions "
                         "beyond it give NaNs or out-of-bounds errors)")
        lm = rem.get("largest_max_model_len")
        if lm and point_of(lm).max_model_len:
            longer = (" -- longer than the one asked for: the fit is not monotone here"
                      if point_of(lm).max_model_len > m else "")
            mc = e.get("min_concurrency") or 1
            cond = f"starts with at least {mc:g} full-length requests" if mc != 1 else "starts"
            at_risk = (f" at the interval's safe end ({lm['max_model_len_expected']} at the expected value)"
                       if lm.get("risk") == "safe" and lm.get("max_model_len_expected") else "")
            lines.append(f"    - another max_model_len: the largest that {cond} at {u:g}{at_risk} is "
                         f"{point_of(lm).max_model_len} ({lm['num_gpu_blocks']} blocks, {lm['kv_cache_tokens']} KV "
                         f"tokens){longer}")
            shorter = [point_of(p).max_model_len for p in surf if p["fits"] and point_of(p).max_model_len < m]
            if shorter:
                lines.append(f"    - a shorter one from the grid: {max(shorter)} starts")
        elif lm is not None:
            lines.append(f"    - no max_model_len starts at gpu_memory_utilization {u:g}")
        un = point_of(rem).gpu_memory_utilization
        if un:
            approx = " (approximate: bytes per block inferred)" if un.get("approximate") else ""
            if un["possible"]:
                lines.append(_u_remedy_line(un, approx))
            elif un.get("exact") is None:  # no u helps at all (the weights do not load)
                lines.append(f"    - no gpu_memory_utilization helps: {un.get('why') or 'none is enough'}")
            elif un.get("free_bytes") is not None:  # co-tenants: the budget must fit the free memory
                lines.append(f"    - no gpu_memory_utilization is enough: it would take {un['exact']:.3f} of total "
                             f"({_gib(un['needed_requested_bytes'])} GiB), more than the {_gib(un['free_bytes'])} GiB "
                             f"other processes leave free{approx}")
            else:
                lines.append(f"    - no gpu_memory_utilization <= 1 is enough: it would take {un['exact']:.3f} of "
                             f"total ({_gib(un['needed_requested_bytes'])} GiB){approx}")
        for key, label in (("fp8_kv_cache", "--kv-cache-dtype fp8"), ("tensor_parallel", "tensor parallelism")):
            v = rem.get(key)
            if not v:
                continue
            if key == "tensor_parallel":
                label = f"--tensor-parallel-size {v['tensor_parallel_size']} (that many GPUs)"
            if "error" in v:
                lines.append(f"    - {label}: not tried ({v['error']})")
            elif v.get("fits") is None:
                lines.append(f"    - {label}: no result at this point")
            else:
                lines.append(f"    - {label}: {'starts' if v['fits'] else 'still does NOT start'} with "
                             f"{v['num_gpu_blocks']} blocks, {v['kv_cache_tokens']} KV tokens, "
                             f"{v['max_concurrency']:.2f}x concurrency (largest max_model_len at {u:g}: "
                             f"{v['largest_max_model_len'] or 'none starts'})")
    return "\n".join(lines)


def unmodelled_line(x: dict, computed: Iterable[str] = ()) -> str:
    """``not modelled: NAME VALUE (where): widens the interval — why`` or ``… no effect on memory``;
    an assumption whose other value was computed (``computed``: :func:`computed_alternatives`):
    ``assumed: NAME VALUE (where): the other value computed, its effect is the band …``."""
    val = f" {x['value']}" if x.get("value") is not None else ""
    note = f" ({x['note']})" if x.get("note") else ""
    if x.get("name") in set(computed):
        return (f"assumed: {x.get('name')}{val} [{x.get('where')}]: the other value computed, its effect is the "
                f"band 'assumed {x.get('name')}={str(x.get('value')).lower()}'{note}")
    effect = "widens the interval" if x.get("effect") == "widens" else str(x.get("effect"))
    return f"not modelled: {x.get('name')}{val} [{x.get('where')}]: {effect}{note}"


def computed_alternatives(obj: Any, depth: int = 4) -> set[str]:
    """The inputs whose assumed value's alternative a result's bands hold (band class ``assumed
    (alternative computed)``, :data:`tuner.memory.uncertainty.ASSUMED_ALTERNATIVE`), found in its
    candidates / explanations."""
    from tuner.memory.uncertainty import ASSUMED_ALTERNATIVE

    out: set[str] = set()
    if depth < 0:
        return out
    if isinstance(obj, dict):
        if obj.get("band_source") == ASSUMED_ALTERNATIVE and str(obj.get("name", "")).startswith("assumed "):
            out.add(str(obj["name"])[len("assumed "):].split("=", 1)[0])
        for v in obj.values():
            if isinstance(v, (dict, list)):
                out |= computed_alternatives(v, depth - 1)
    elif isinstance(obj, list):
        for v in obj:
            out |= computed_alternatives(v, depth - 1)
    return out


def term_sources_line(sources: dict) -> str:
    """``sources: kv_cache_spec engine, weights engine, …`` (see :mod:`tuner.engine.crosscheck`)."""
    return "sources: " + ", ".join(f"{k} {v}" for k, v in sources.items() if k != "plugin")


def engine_check_lines(check: dict | None) -> list[str]:
    """The engine adapter's cross-check in words: release, decision, differences, vLLM's blocks
    at each proposal next to ctx-tuner's. Empty when no engine ran."""
    if not check:
        return []
    if check.get("skipped"):
        return [f"engine: {check['skipped']}"]
    from tuner.engine.stored import state_line

    ck = state_line(check.get("cross_check"))
    if ck and check.get("cross_check", {}).get("state") in ("missing", "stale"):
        return [ck]  # no engine took part: the line says why
    rel = check.get("release")
    same = "same release as the drop" if check.get("releases_match") else f"drop asks {check.get('drop_release')}"
    out = [f"engine: vLLM {rel} ({same}); KV specs: {check.get('decision', 'not compared')}"]
    if ck:
        out.append(f"  {ck}")
    if check.get("error"):
        out.append(f"  engine error: {check['error']}")
    chk = check.get("check") or {}
    for side in ("plugin", "engine"):
        if chk.get(side):
            x = chk[side]
            specs = ", ".join(f"{g['layers']}×{g['kind']} bs {g['block_size']} page {g['page_size_bytes']}"
                              for g in x.get("specs", []))
            out.append(f"  {side:<6} {specs}; {x.get('num_gpu_blocks', '-')} blocks in "
                       f"{_gib(chk.get('reference_bytes'))} GiB, {x.get('num_groups', '-')} groups")
    if chk.get("note"):
        out.append(f"  note: {chk['note']}")
    for dline in chk.get("differences") or []:
        out.append(f"  difference: {dline}")
    cfg = check.get("config") or {}
    if cfg:
        out.append(f"  engine config ({cfg.get('platform')}): max_model_len {point_of(cfg).max_model_len}, "
                   f"max_num_batched_tokens {cfg.get('max_num_batched_tokens')}, max_num_seqs {cfg.get('max_num_seqs')}, "
                   f"block_size {cfg.get('block_size')}, quantization {cfg.get('quantization')}")
    dfl = check.get("defaults") or {}
    if dfl.get("engine"):
        e, c = dfl["engine"], dfl.get("ctx_tuner") or {}
        out.append("  scheduler defaults (engine / era rule): " + ", ".join(
            f"{k} {e.get(k)} / {c.get(k)}" for k in ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill",
                                                    "block_size")) + f"; used: {dfl.get('rule')}")
        for dline in dfl.get("differences") or []:
            out.append(f"  default differs: {dline}" + (" (engine's applied)" if dline.split(":")[0] in
                                                         (dfl.get("applied") or {}) else ""))
    elif dfl.get("error"):
        out.append(f"  scheduler defaults not asked: {dfl['error']}")
    w = check.get("weights")
    if w:
        out.append(f"  engine weights (meta model, before process_weights_after_loading): {w['bytes']} B "
                   f"({_gib(w['bytes'])} GiB), " + ", ".join(f"{k} {v}" for k, v in w.get("by_dtype", {}).items())
                   + (f"; the run's weights {w['job_bytes']} B ({w['job_bytes'] - w['bytes']:+d})"
                      if w.get("job_bytes") is not None else ""))
    for t in check.get("trace") or []:
        if t.get("error"):
            out.append(f"  engine-trace not run: {t['error']}")
            continue
        out.append(f"  engine-trace (vLLM {t.get('release')} _dummy_run + _dummy_sampler_run, N {t['max_num_batched_tokens']}, "
                   f"R {t['num_reqs']}): forward peak {t['forward_peak_bytes']} B, sampler {t['sampler_peak_bytes']} B, "
                   f"activation {t['activation_peak_bytes']} B + margin {t.get('margin_bytes', 0)} B + runner buffers "
                   f"{t.get('persistent_bytes', 0)} B; approximate: {', '.join(t.get('approximate') or []) or 'none'}")
    for v in check.get("proposals") or []:
        e = v["engine"]
        got = e.get("num_gpu_blocks") if e.get("starts") else f"refuses ({(e.get('error') or '')[:120]})"
        out.append(f"  gmu {point_of(v).gpu_memory_utilization:g} max_model_len {point_of(v).max_model_len}: vLLM kv_cache_utils "
                   f"{got} blocks, ctx-tuner {v['ctx_tuner_num_gpu_blocks']}"
                   + ("" if v["agree"] else "  <- differ"))
    t = check.get("timings")
    if t:
        out.append("  engine time: " + ", ".join(f"{k} {v}" for k, v in t.items()))
    return out


def render(doc: dict) -> str:
    """The whole ``explain`` report: a header, then each point."""
    from tuner.memory.devices import device_label

    e0 = doc["explanations"][0] if doc["explanations"] else {}
    dev = doc["device"]
    lines = [f"explain {doc.get('drop') or ''}: {doc.get('model')} on {device_label(dev)}, "
             f"vLLM {doc.get('era')}",
             f"dtype {e0.get('dtype')}, kv_cache_dtype {e0.get('kv_cache_dtype')}, TP {e0.get('tensor_parallel_size')}, "
             f"PP {e0.get('pipeline_parallel_size')}, block_size {e0.get('block_size') or 'not stored'}"]
    for w in doc.get("warnings") or []:
        lines.append(f"warning: {w}")
    if doc.get("term_sources"):
        lines.append(term_sources_line(doc["term_sources"]))
    computed = computed_alternatives(doc.get("explanations"))
    for x in (doc.get("uncertainty") or {}).get("unmodelled") or []:
        lines.append(unmodelled_line(x, computed))
    from tuner.jobs.memoanswer import pass_source_line

    passes = pass_source_line(doc.get("pass_source"))
    if passes:  # the profile job's passes: from the pass memo or a worker
        lines.append(passes)
    store = store_line(doc.get("store"))
    if store:  # the store read and what was written to it (the pass memo's new entries)
        lines.append(store)
    lines += engine_check_lines(doc.get("engine_check"))
    for e in doc["explanations"]:
        lines += ["", render_point(e)]
    return "\n".join(lines)

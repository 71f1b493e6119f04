"""The ``cuda`` method: the plugin's module and vLLM's dummy batch, run for real on the GPU with
random weights, measured the way vLLM's worker measures (worker side; imports torch).

Follows vLLM 0.9.1–0.26 ``vllm/v1/worker/gpu_worker.py::determine_available_memory`` with
``vllm/utils/mem_utils.py::memory_profiling``:

1. ``requested = total × gpu_memory_utilization`` (``ceil`` from 0.14); if the free memory at start
   is below it, vLLM refuses: "Free memory on device … is less than desired GPU memory
   utilization" — reproduced here as the run's ``error_message`` (nothing is allocated).
2. baseline snapshot: ``torch.cuda.mem_get_info()`` and ``memory_reserved()``.
3. weights: ``max_memory_allocated()`` increase while building the module (``reset_peak_memory_stats``
   before), as ``DeviceMemoryProfiler`` around ``load_model``.
4. profile: ``empty_cache(); reset_peak_memory_stats()``; forward over N tokens in R requests and
   the era's dummy sampler on ``[R, vocab]``; activation peak = ``max_memory_allocated()`` −
   allocated at start; ``empty_cache()``.
5. non-torch increase = ``(total − free)`` increase since the baseline minus the increase of
   ``memory_reserved()`` — what grew outside torch's allocator (cuBLAS workspaces, …).

CUDA graphs and NCCL are not exercised (single rank, eager): ``cuda_graph_bytes`` is None.
"""

from __future__ import annotations

import math
import time
from typing import Any

from tuner.errors import MeasureError


def measure_pass(plugin, spec, settings, era, batch, *, gpu_memory_utilization: float, device_index: int = 0) -> dict:
    """One measured pass on ``cuda:device_index``; returns a run dict (bytes as ints).

    Keys: ``total_memory_bytes``, ``free_memory_bytes`` (at start), ``requested_memory_bytes``,
    ``weights_bytes``, ``activation_peak_bytes``, ``non_torch_bytes``, ``cuda_graph_bytes`` (None),
    ``error_message`` (vLLM's refusal text, or None), ``elapsed_s``.

    Raises:
        MeasureError: torch has no CUDA device here, or the pass ran out of memory (the message
            carries torch's error).
    """
    import torch

    if not torch.cuda.is_available():
        raise MeasureError("torch sees no CUDA device (method 'cuda' needs a GPU)", where="cuda")
    from tuner.model.simulate.sampler import run_dummy_sampler
    from tuner.memory.eras import sampler_family

    dev = torch.device("cuda", device_index)
    t0 = time.perf_counter()
    torch.cuda.set_device(dev)
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info(dev)
    raw = total * gpu_memory_utilization
    requested = math.ceil(raw) if era.requested_rounds_up else int(raw)
    out: dict[str, Any] = {"total_memory_bytes": int(total), "free_memory_bytes": int(free0),
                           "requested_memory_bytes": int(requested), "weights_bytes": None,
                           "activation_peak_bytes": None, "non_torch_bytes": None, "cuda_graph_bytes": None,
                           "error_message": None}
    gib = lambda b: round(b / (1 << 30), 2)  # noqa: E731 - vLLM's own format_gib
    if era.engine == "V1" and era.version >= (0, 9, 1) and free0 < requested:
        out["error_message"] = (
            f"Free memory on device cuda:{device_index} ({gib(free0)}/{gib(total)} GiB) on startup is less than "
            f"desired GPU memory utilization ({gpu_memory_utilization}, {gib(requested)} GiB). Decrease GPU memory "
            "utilization or reduce GPU memory used by other processes.")
        out["elapsed_s"] = round(time.perf_counter() - t0, 3)
        return out
    base_used = total - free0
    base_reserved = torch.cuda.memory_reserved(dev)
    try:
        with torch.no_grad():
            torch.cuda.reset_peak_memory_stats(dev)
            before_w = torch.cuda.memory_allocated(dev)
            with torch.device(dev):
                model = plugin.build_model(spec, settings)
            out["weights_bytes"] = int(torch.cuda.max_memory_allocated(dev) - before_w)
            n, r = batch.max_num_batched_tokens, batch.num_reqs
            input_ids = torch.zeros(n, dtype=torch.long, device=dev)
            positions = torch.zeros(n, dtype=torch.long, device=dev)
            intermediate = None
            if settings.pp_rank > 0:
                p = next(model.parameters())
                intermediate = (torch.empty(n, spec.hidden_size, dtype=p.dtype, device=dev),
                                torch.empty(n, spec.hidden_size, dtype=p.dtype, device=dev))
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            start_alloc = torch.cuda.memory_allocated(dev)
            with torch.device(dev):
                hidden = model(input_ids, positions, intermediate)
                if settings.pp_rank == settings.pipeline_parallel_size - 1:
                    run_dummy_sampler(sampler_family(era, flashinfer=settings.flashinfer_sampler), model, hidden, num_reqs=r,
                                      num_sms=torch.cuda.get_device_properties(dev).multi_processor_count,
                                      version=era.version.key)
            torch.cuda.synchronize(dev)
            out["activation_peak_bytes"] = int(torch.cuda.max_memory_allocated(dev) - start_alloc)
            del hidden
            torch.cuda.empty_cache()
            free1, _ = torch.cuda.mem_get_info(dev)
            used_increase = (total - free1) - base_used
            reserved_increase = torch.cuda.memory_reserved(dev) - base_reserved
            out["non_torch_bytes"] = int(max(0, used_increase - reserved_increase))
            del model
    except torch.cuda.OutOfMemoryError as exc:
        raise MeasureError(f"CUDA out of memory during the measured pass: {exc}", where="cuda") from exc
    finally:
        torch.cuda.empty_cache()
    out["elapsed_s"] = round(time.perf_counter() - t0, 3)
    return out


def measured_pass(plugin, spec, settings, era, batch, *, device_index: int = 0) -> dict:
    """:func:`measure_pass` shaped like a simulate pass (:class:`tuner.model.simulate.profile.PassResult`
    as a dict) for :func:`tuner.jobs.job.run_job`: ``max_num_batched_tokens``, ``num_reqs``,
    ``pp_rank``, ``weights_bytes``, ``activation_peak_bytes`` (measured), ``forward_peak_bytes``
    and ``sampler_peak_bytes`` (None: one peak is measured), ``elapsed_s``, plus the measured
    ``non_torch_bytes``, ``total_memory_bytes`` and ``free_memory_bytes`` (at start).

    The free-memory refusal is not applied here (it depends on ``gpu_memory_utilization``; see
    :func:`refuse_below_free_memory`).

    Raises:
        MeasureError: as :func:`measure_pass`.
    """
    out = measure_pass(plugin, spec, settings, era, batch, gpu_memory_utilization=0.0, device_index=device_index)
    return {"max_num_batched_tokens": batch.max_num_batched_tokens, "num_reqs": batch.num_reqs,
            "pp_rank": settings.pp_rank, "weights_bytes": out["weights_bytes"],
            "activation_peak_bytes": out["activation_peak_bytes"], "forward_peak_bytes": None,
            "sampler_peak_bytes": None, "elapsed_s": out["elapsed_s"], "non_torch_bytes": out["non_torch_bytes"],
            "total_memory_bytes": out["total_memory_bytes"], "free_memory_bytes": out["free_memory_bytes"]}


def refuse_below_free_memory(era, candidates: list[dict], *, free_memory_bytes: int, total_memory_bytes: int,
                             proposals: list[dict] = (), device_index: int = 0) -> int:
    """Mark the candidates (and proposals) whose requested memory (``total × u``, rounded as the era
    rounds it) exceeds the free memory at start as refused, with
    vLLM's own message (V1 ≥ 0.9.1 ``vllm/v1/worker/gpu_worker.py::init_device``: "Free memory on
    device … on startup is less than desired GPU memory utilization"). Earlier releases do not
    check. Returns how many candidates were marked. Pure (no torch)."""
    if not (era.engine == "V1" and era.version >= (0, 9, 1)):
        return 0
    from tuner.question.protocol import point_of

    gib = lambda b: round(b / (1 << 30), 2)  # noqa: E731 - vLLM's format_gib
    marked = 0
    for c in candidates:
        if c["requested_memory_bytes"] > free_memory_bytes:
            c["fits"] = False
            c["reason"] = (f"Free memory on device cuda:{device_index} ({gib(free_memory_bytes)}/"
                           f"{gib(total_memory_bytes)} GiB) on startup is less than desired GPU memory utilization "
                           f"({point_of(c).gpu_memory_utilization}, "
                           f"{gib(c['requested_memory_bytes'])} GiB). Decrease GPU "
                           "memory utilization or reduce GPU memory used by other processes.")
            marked += 1
    for p in proposals:
        raw = total_memory_bytes * point_of(p).gpu_memory_utilization
        requested = math.ceil(raw) if era.requested_rounds_up else int(raw)
        if requested > free_memory_bytes:
            p.update(max_model_len=None, num_gpu_blocks=None, kv_cache_tokens=None, max_concurrency=None,
                     vllm_args=None, reason=f"free memory at start ({gib(free_memory_bytes)} GiB) is below "
                                            f"total × gpu_memory_utilization ({gib(requested)} GiB): vLLM refuses")
            marked += 1
    return marked

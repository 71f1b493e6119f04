"""``engine-trace``: vLLM's own profile run traced under fake tensors (worker side; imports vLLM).

What runs is the installed release's ``GPUModelRunner._dummy_run(max_num_batched_tokens,
is_profile=True)`` followed by ``_dummy_sampler_run`` on its last hidden states — the two calls of
``GPUModelRunner.profile_run`` (vllm/v1/worker/gpu_model_runner.py) for a text model — on a real
model runner (the CPU build's ``CPUModelRunner``, which subclasses it) whose model is vLLM's own,
built with ``initialize_model`` under ``FakeTensorMode`` (shapes, dtypes and storages, no memory).
The simulate tracker (:class:`tuner.model.simulate.tracker.MemoryTracker`) counts every storage the run
creates and their peak, as vLLM's ``torch_peak_increase`` does on a GPU: the forward's peak, then
the sampler's peak on top of what the forward leaves alive (its N-token hidden states).

What is not vLLM's own code, and why (each is a documented part of the run's ``notes``):

- the compiled ``_C`` kernels get no-op fake kernels (:mod:`tuner.engine.fakes`): exact for the
  buffers the Python allocates, blind to a kernel's internal scratch;
- unquantized linear layers and the LM head use ``torch.nn.functional.linear`` — the CPU build's
  own fallback and the GPU's default GEMM — because ``process_weights_after_loading`` (which packs
  weights for oneDNN) does not run on fake weights;
- the top-k/top-p sampler runs vLLM's PyTorch-native path (``TopKTopPSampler.forward_native``,
  what a CUDA build runs without FlashInfer and for every request with a generator) instead of the
  CPU build's fused Gumbel kernel; a per-request ``torch.Generator`` is dropped from in-place
  random fills (fake tensors cannot draw from it; the fill allocates nothing);
- the runner is built with ``max_model_len`` lowered to the batch (its block table and token
  history are host buffers that exist before the profile and are not part of the peak).

Kernel-dependent parts (:data:`tuner.engine.fakes.KERNEL_DEPENDENT`: fused MoE, quantized GEMMs,
SSM / linear-attention kernels, MLA prefill, the top-k/top-p sampler) are listed in the result as
``approximate`` when the trace meets them; the job adds their margin (:func:`approximate_margin_bytes`).
Only the CPU platform is traced (a CUDA build would build its runner's buffers on the GPU).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from tuner.errors import EngineError

#: Margin added to a traced activation peak per kernel-dependent part met (fraction of the traced
#: forward peak): a fake kernel does not see a kernel's own workspace. Documented in docs/engine-adapter.md
#: (the approximate parts); 0 for a trace that meets none (a dense decoder: the trace is exact up to
#: the kernels' scratch, which the GEMMs and norms of a dense model do not allocate through torch).
MARGIN_PER_PART = 0.10

#: The sampler path is always vLLM's native one (see the module docstring): named approximate.
SAMPLER_PART = "top-k/top-p sampler"


class EngineTraceUnavailable(EngineError):
    """The profile run cannot be traced here (platform, an op without a fake kernel, a layer
    whose kernels need loaded weights); the job falls back and says why."""


#: Parts whose kernels keep workspace a fake kernel does not see (a margin each). The sampler
#: parts get none: vLLM's native top-k/top-p path allocates more than the fused kernels it stands
#: for, and Model Runner V2's sampler keeps less than the V1 runner's traced in its place.
MARGIN_PARTS = frozenset({"fused MoE", "MoE routing", "quantized GEMM", "SSM / linear-attention kernel", "MLA prefill",
                          "sparse attention top-k"})


def approximate_margin_bytes(forward_peak_bytes: int, parts: list[str], *, moe_workspace_bytes: int | None = None) -> int:
    """Margin for the kernel-dependent ``parts`` a trace met (bytes): for ``fused MoE``, the GPU
    Triton experts' workspace where it is known (``moe_workspace_bytes``,
    :func:`moe_gpu_workspace_bytes`), else :data:`MARGIN_PER_PART` of the traced forward peak;
    :data:`MARGIN_PER_PART` of it for each other part of :data:`MARGIN_PARTS` met."""
    met = set(parts) & MARGIN_PARTS
    total = 0
    if "fused MoE" in met and moe_workspace_bytes is not None:
        total += int(moe_workspace_bytes)
        met.discard("fused MoE")
    return total + int(forward_peak_bytes * MARGIN_PER_PART * len(met))


def moe_gpu_workspace_bytes(model: Any, num_tokens: int) -> int | None:
    """The workspace a CUDA build's Triton fused-MoE experts allocate for ``num_tokens`` tokens in
    the largest MoE layer, beyond the output buffer the CPU build also allocates: vLLM's own
    ``TritonExperts.workspace_shapes`` (vllm/model_executor/layers/fused_moe/experts/triton_moe.py)
    as ``FusedMoEKernel._allocate_buffers`` (modular_kernel.py) lays them out — workspace13 shared
    with the output, plus workspace2 — in the activation dtype, each rounded like the allocator.
    None where the release or the layers do not expose it (the fraction rule then applies)."""
    from math import prod

    from tuner.model.simulate.tracker import round_allocation

    try:
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    except ImportError:
        return None
    best = None
    for m in model.modules():
        w13, topk, act = getattr(m, "w13_weight", None), getattr(m, "top_k", None), getattr(m, "activation", None)
        if w13 is None or topk is None or act is None or getattr(w13, "dim", lambda: 0)() != 3:
            continue
        e_local, n, k = (int(x) for x in w13.shape)
        dtype_bytes = int(getattr(m, "moe_config", None).in_dtype.itemsize) if getattr(
            getattr(m, "moe_config", None), "in_dtype", None) is not None else 2
        try:
            ws13, ws2, out = TritonExperts.workspace_shapes(TritonExperts, int(num_tokens), n, k, int(topk),
                                                            e_local, e_local, None, act)
        except Exception:
            return None
        common = max(prod(ws13), prod(out))
        extra = round_allocation(common * dtype_bytes) - round_allocation(prod(out) * dtype_bytes) \
            + round_allocation(prod(ws2) * dtype_bytes)
        best = extra if best is None else max(best, extra)
    return best


class _Ops:
    """A dispatch mode under the tracker: records non-aten ops called and drops ``generator``
    arguments (in-place random fills on fake tensors cannot use a real generator)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = set()

        class Mode(TorchDispatchMode):
            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                return False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                ns = getattr(func, "namespace", "aten")
                if ns not in ("aten", "prim", "prims"):
                    ops.add(f"{ns}::{func._schema.name.split('::')[-1]}")
                if kwargs.get("generator") is not None:
                    kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
                return func(*args, **kwargs)

        self.mode = Mode()


def _prepare_model(model: Any) -> int:
    """F.linear for unquantized linear / LM-head layers whose CPU GEMM is set up by
    ``process_weights_after_loading`` (vllm/model_executor/layers/linear.py: its own fallback)."""
    import torch

    n = 0
    for m in model.modules():
        qm = getattr(m, "quant_method", None)
        if qm is not None and type(qm).__name__ in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod") \
                and not hasattr(m, "cpu_linear"):
            m.cpu_linear = torch.nn.functional.linear
            n += 1
        elif qm is not None and getattr(qm, "moe_kernel", False) is None and hasattr(qm, "_init_moe_kernel"):
            qm._init_moe_kernel(m)  # vLLM's own MoE kernel object, without the weight repacking
            n += 1
    return n


@contextlib.contextmanager
def _fresh_rope_cache():
    """vLLM caches rotary embeddings by their parameters, not by device
    (vllm/model_executor/layers/rotary_embedding/__init__.py ``_ROPE_DICT``): the fake build must
    not reuse the meta build's (meta tables cannot be read), nor leave fake ones behind."""
    try:
        from vllm.model_executor.layers import rotary_embedding as rope
    except ImportError:
        yield
        return
    cache = getattr(rope, "_ROPE_DICT", None)
    kept = dict(cache) if isinstance(cache, dict) else None
    if kept is not None:
        cache.clear()
    try:
        yield
    finally:
        if kept is not None:
            cache.clear()
            cache.update(kept)


def _gpu_activation_path(model: Any) -> int:
    """Activation CustomOps (``SiluAndMul``, ``GeluAndMul``, …) run their CUDA path — one output
    buffer written by the ``_C`` op of the op's registered name — where the CPU build would run
    the PyTorch-native one (two temporaries of the intermediate width on x86). Only ops whose
    ``_C`` kernel exists in the build and whose CUDA path calls ``self.op`` are switched."""
    import torch
    from vllm.model_executor.custom_op import CustomOp

    n = 0
    for m in model.modules():
        cls = type(m)
        if not isinstance(m, CustomOp) or cls.forward_cuda is CustomOp.forward_cuda:
            continue
        name = getattr(cls, "name", None)
        if not name or "self.op(" not in _source(cls.forward_cuda):
            continue
        op = getattr(torch.ops._C, name, None) if hasattr(torch.ops, "_C") else None
        try:
            op = op if op is not None and op.overloads() else None
        except Exception:
            op = None
        if op is None:
            continue
        if getattr(m, "op", None) is None:
            m.op = op
        m._forward_method = m.forward_cuda
        n += 1
    return n


def _source(fn: Any) -> str:
    import inspect

    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def trace_profile_run(session: Any, *, max_num_batched_tokens: int, max_num_seqs: int) -> dict:
    """Trace vLLM's ``_dummy_run`` + ``_dummy_sampler_run`` for one batch (see the module docstring).

    Returns ``{"forward_peak_bytes", "sampler_peak_bytes", "activation_peak_bytes", "num_reqs",
    "ops", "approximate", "fake_kernels", "notes", "timings"}`` (bytes as ints; ``approximate``
    the kernel-dependent parts met, sorted).

    Raises:
        EngineTraceUnavailable: the run cannot be traced here (its message says why).
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_default_torch_dtype

    from tuner.engine.adapter import _init_single_rank
    from tuner.engine.fakes import kernel_part, register_fake_kernels
    from tuner.model.simulate.tracker import MemoryTracker

    if not current_platform.is_cpu():
        raise EngineTraceUnavailable(f"engine-trace runs on vLLM's CPU build only (platform "
                                     f"{current_platform.device_name})", where="vllm")
    vc = session.vllm_config
    n, s = int(max_num_batched_tokens), int(max_num_seqs)
    t0 = time.perf_counter()
    fakes = register_fake_kernels()
    sc, mc, cc = vc.scheduler_config, vc.model_config, vc.compilation_config
    saved = (sc.max_num_batched_tokens, sc.max_num_seqs, mc.max_model_len, cc.static_forward_context)
    timings: dict = {}
    try:
        sc.max_num_batched_tokens, sc.max_num_seqs = n, s
        cc.static_forward_context = {}  # this build's layers (the meta model's stay registered apart)
        with set_current_vllm_config(vc):
            _init_single_rank(vc, session.settings.tensor_parallel_size)
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with set_default_torch_dtype(mc.dtype), mode, _fresh_rope_cache():
                model = initialize_model(vllm_config=vc, model_config=mc)
            timings["build_s"] = round(time.perf_counter() - t0, 3)
            gemms = _prepare_model(model)
            moe_ws = moe_gpu_workspace_bytes(model, n)
            acts = _gpu_activation_path(model)
            from vllm.v1.worker.cpu_model_runner import CPUModelRunner

            mc.max_model_len = min(int(saved[2]), max(n, 16))
            with contextlib.redirect_stdout(None):
                runner = CPUModelRunner(vc, torch.device("cpu"))
            mc.max_model_len = saved[2]
            runner.model = model
            sampler = getattr(runner.sampler, "topk_topp_sampler", None)
            if sampler is not None:
                sampler.forward = sampler.forward_native
            ops = _Ops()
            t1 = time.perf_counter()
            with torch.no_grad(), mode, ops.mode, MemoryTracker() as tracker:
                hidden, last = runner._dummy_run(n, is_profile=True)
                forward_peak = tracker.peak_bytes
                before = tracker.live_bytes
                tracker.reset_peak()
                out = runner._dummy_sampler_run(last)
                sampler_peak = tracker.peak_bytes - before
                num_reqs = int(last.shape[0])
                del hidden, last, out
            timings["trace_s"] = round(time.perf_counter() - t1, 3)
            del runner, model
    except EngineError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise EngineTraceUnavailable(f"vLLM {session.version}'s profile run could not be traced: "
                                     f"{type(exc).__name__}: {first[:300]}", where=session.model_dir) from exc
    finally:
        sc.max_num_batched_tokens, sc.max_num_seqs, mc.max_model_len, cc.static_forward_context = saved
    parts = sorted({p for p in map(kernel_part, ops.ops) if p} | {SAMPLER_PART})
    notes = [f"{len(fakes)} _C ops with no-op fake kernels", f"{gemms} unquantized GEMMs as F.linear",
             f"{acts} activation ops on their CUDA path (the _C kernel's one output buffer)",
             "top-k/top-p: vLLM's native sampler path"]
    return {"max_num_batched_tokens": n, "num_reqs": num_reqs, "forward_peak_bytes": int(forward_peak),
            "sampler_peak_bytes": int(sampler_peak),
            "activation_peak_bytes": int(max(forward_peak, before + sampler_peak)),
            "ops": sorted(ops.ops), "approximate": parts, "moe_workspace_bytes": moe_ws, "fake_kernels": len(fakes), "notes": notes,
            "timings": timings}

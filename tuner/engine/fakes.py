"""No-op fake kernels for vLLM's compiled ``_C`` ops, so vLLM's own Python runs under fake tensors.

Worker side; imported only by :mod:`tuner.engine.trace` (imports torch and vLLM's ``_C``).

The CPU build's out-variant ops (schema ``-> ()``: ``rms_norm``, ``fused_add_rms_norm``,
``silu_and_mul``, ``rotary_embedding``, ``onednn_mm``, ``cpu_fused_moe``, ``cpu_gemm_wna16``,
``mamba_chunk_scan_fwd_cpu``, the attention and cache writers, …) write into tensors the Python
allocated before the call: under ``FakeTensorMode`` a no-op fake kernel is exact for what torch's
allocator sees (the output buffers are counted where the Python allocates them), and misses only
the kernel's own scratch — which is why every kernel-dependent part is named approximate
(:data:`KERNEL_DEPENDENT`). Ops that return new tensors get a fake kernel here only where the
output shape follows from the inputs (:data:`RETURNING`); any other op a trace meets raises
``UnsupportedOperatorException`` and the trace is reported as not run.
"""

from __future__ import annotations

from typing import Any, Callable

#: Op name fragments → the kernel-dependent part of the model they belong to (named approximate in
#: the run when the trace calls them: their internal workspace is not seen by a fake kernel).
KERNEL_DEPENDENT = (
    ("fused_moe", "fused MoE"), ("fused_experts", "fused MoE"), ("moe", "fused MoE"), ("topk_cpu", "MoE routing"),
    ("gemm_wna16", "quantized GEMM"), ("scaled_mm", "quantized GEMM"), ("int8_quant", "quantized GEMM"),
    ("fp8_quant", "quantized GEMM"), ("fp8_linear", "quantized GEMM"), ("int4", "quantized GEMM"),
    ("mamba", "SSM / linear-attention kernel"), ("causal_conv1d", "SSM / linear-attention kernel"),
    ("selective_state", "SSM / linear-attention kernel"), ("delta_rule", "SSM / linear-attention kernel"),
    ("gdn", "SSM / linear-attention kernel"), ("mla", "MLA prefill"), ("extend_attention", "MLA prefill"),
    ("gumbel", "top-k/top-p sampler"), ("topk_transform", "sparse attention top-k"),
)

#: Ops returning new tensors, with the output they return (shapes from the inputs).
RETURNING: dict[str, Callable[..., Any]] = {}


def _returning() -> None:
    import torch

    def greedy_argmax(logits):
        return logits.new_empty((logits.shape[0],), dtype=torch.long)

    def fused_gumbel_argmax(logits, seeds):
        return logits.new_empty((logits.shape[0],), dtype=torch.long)

    RETURNING.update({"_C::greedy_argmax": greedy_argmax, "_C::fused_gumbel_argmax": fused_gumbel_argmax})


_LIBS: list = []
_REGISTERED: list[str] = []


def register_fake_kernels() -> list[str]:
    """Register the fake kernels once per process; returns the op names registered (an op that
    already has a fake impl or a Meta kernel keeps it)."""
    if _REGISTERED or _LIBS:
        return list(_REGISTERED)
    import torch
    import vllm._custom_ops  # noqa: F401  (loads vllm._C)

    _returning()
    lib = torch.library.Library("_C", "FRAGMENT")  # noqa: TOR901
    _LIBS.append(lib)
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("_C::"))
    for name in names:
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta"):
            continue
        entry = torch._library.simple_registry.singleton.find(name)
        if entry.fake_impl.kernel is not None:
            continue
        packet = getattr(torch.ops._C, name.split("::", 1)[1])
        schemas = [getattr(packet, ov)._schema for ov in packet.overloads()]
        if name in RETURNING:
            fn = RETURNING[name]
        elif schemas and all(len(s.returns) == 0 for s in schemas):
            def fn(*args, **kwargs):  # an out-variant kernel: the Python allocated its outputs
                return None
        else:
            continue
        try:
            torch.library.register_fake(name, fn, lib=lib)
        except (RuntimeError, ValueError):  # e.g. registered meanwhile by vLLM itself
            continue
        _REGISTERED.append(name)
    return list(_REGISTERED)


def kernel_part(op_name: str) -> str | None:
    """The kernel-dependent part an op belongs to (:data:`KERNEL_DEPENDENT`), None for plain ops."""
    low = op_name.lower()
    for frag, part in KERNEL_DEPENDENT:
        if frag in low:
            return part
    return None

"""A quantization scheme's parameters registered on a simulated module (worker side, imports torch).

:class:`tuner.memory.quant.QuantScheme` gives the layouts (pure); these functions register them as
tensors: ``make_linear_weights(scheme, module, in_features, out_features, dtype, prefix) -> bool``
and ``make_expert_weights(scheme, module, num_experts, hidden, intermediate, dtype, prefix,
has_bias=False) -> bool`` (the conventions are :mod:`tuner.memory.quant`'s docstring).
"""

from __future__ import annotations

from tuner.memory.quant import Layout


def make_linear_weights(scheme, module, in_features: int, out_features: int, dtype, prefix: str = "") -> bool:
    """Register the quantized parameters of a linear on ``module``; False = keep 16-bit."""
    got = scheme.linear_layout(in_features, out_features, _dtype_name(dtype), prefix)
    if got is None:
        return False
    lay, act = got
    _register(module, lay)
    module.input_quant = act
    module.gemm_temp = scheme.gemm_temp_for(in_features, out_features, _dtype_name(dtype), prefix)
    return True


def make_expert_weights(scheme, module, num_experts: int, hidden: int, intermediate: int, dtype, prefix: str = "",
                        has_bias: bool = False) -> bool:
    """Register a quantized expert bank on ``module`` (see :mod:`tuner.memory.quant`); False =
    16-bit experts (the caller registers its own weights and biases)."""
    lay = scheme.expert_layout(num_experts, hidden, intermediate, _dtype_name(dtype), prefix, has_bias=has_bias)
    if lay is None:
        return False
    _register(module, lay)
    return True


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _register(module, lay: Layout) -> None:
    import torch

    for name, shape, dt in lay:
        t = torch.empty(*shape, dtype=getattr(torch, dt))
        if name.endswith("workspace"):
            module.register_buffer(name, t, persistent=False)
        else:
            module.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))

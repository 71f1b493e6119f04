"""Memory-equivalent state-space / linear-attention layers of hybrid decoders (torch).

What vLLM 0.19 allocates for these layers, per tensor-parallel rank (N tokens, H hidden):

* :class:`Mamba2Mixer` — ``MambaMixer2`` (vllm/model_executor/layers/mamba/mamba_mixer2.py):
  ``in_proj [H → (2·I + 2·G·S + nh)/tp]``, ``conv1d`` weight ``[conv_dim/tp, 1, k]`` (+ bias),
  ``A`` fp32 ``[nh/tp]``, ``D``/``dt_bias`` ``[nh/tp]`` (model dtype), gated RMSNorm weight
  ``[I/tp]``, ``out_proj [I/tp → H]``. ``G`` is ``n_groups`` extended to ``tp`` when it does not
  divide (``extra_groups_for_head_shards``). Profile run (no attention metadata): projection
  output ``[N, P]``, SSM output ``[N, I/tp]``, a contiguous clone of the conv input
  ``[N, conv_dim/tp]`` freed when the custom op returns, the gated-norm output ``[N, I/tp]``.
* :class:`GatedDeltaNet` — ``GatedDeltaNetAttention`` (vllm/model_executor/layers/mamba/
  gdn_linear_attn.py, Qwen3.5 layout ``gqa_interleaved_layout=False``): ``in_proj_qkvz
  [H → (2·Kd + 2·Vd)/tp]``, ``in_proj_ba [H → 2·nv/tp]``, ``conv1d`` ``[(2·Kd + Vd)/tp, 1, k]``,
  ``dt_bias`` ``[nv/tp]`` (model dtype), ``A_log`` fp32 ``[nv/tp]``, gated RMSNorm ``[dv]``,
  ``out_proj [Vd/tp → H]`` (``Kd = nk·dk``, ``Vd = nv·dv``). Profile run: ``qkvz``, ``ba``,
  contiguous ``b``/``a``, the zero-filled core output ``[N, nv/tp, dv]``, the norm output, the
  ``out_proj`` output copied into the decoder's preallocated ``[N, H]`` buffer.
* :class:`GatedOutputAttention` — ``Qwen3NextAttention`` (vllm/model_executor/models/
  qwen3_next.py): fused QKV whose Q part carries a per-head output gate
  (``qkv = [N, 2·q + 2·kv]``), per-head q/k RMSNorms, ``attn · sigmoid(gate)`` before ``o_proj``.

State pages (the ``MambaSpec`` shapes) are computed without torch in the plugins
(``plugins/hybrid.py``); this module holds only the torch modules.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.model.simulate.layers import Linear, RMSNorm


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def mamba2_extra_groups(n_groups: int, tp: int) -> int:
    """``MambaStateShapeCalculator.extra_groups_for_head_shards``: groups added so every TP
    rank holds the groups its heads need (0 when ``tp`` divides ``n_groups``)."""
    return 0 if n_groups % tp == 0 else tp - n_groups


class Mamba2Mixer(nn.Module):
    """Mamba-2 mixer of one rank (``MambaMixer2``, vLLM 0.19). Shapes in the module docstring.

    Raises:
        ValueError: ``tp`` does not divide ``num_heads``, or divides neither ``n_groups`` nor
            is ``n_groups`` 1 (vLLM asserts the same).
    """

    def __init__(self, hidden: int, num_heads: int, head_dim: int, n_groups: int, state_size: int,
                 conv_kernel: int, tp: int, dtype: torch.dtype, *, use_conv_bias: bool = True,
                 use_bias: bool = False, quant=None, prefix: str = "", compiled: bool = True) -> None:
        super().__init__()
        if num_heads % tp:
            raise ValueError(f"Tensor parallel world size ({tp}) must divide num heads ({num_heads}).")
        if n_groups % tp and n_groups != 1:
            raise ValueError("If tensor parallel world size does not divide num_groups, then num_groups must equal 1.")
        inter = num_heads * head_dim
        groups = n_groups + mamba2_extra_groups(n_groups, tp)
        self.inter = inter // tp
        self.conv_dim = (inter + 2 * groups * state_size) // tp
        self.heads = num_heads // tp
        proj = 2 * self.inter + 2 * groups * state_size // tp + self.heads
        self.in_proj = Linear(hidden, proj, dtype, bias=use_bias, quant=quant, prefix=f"{prefix}.in_proj")
        self.conv1d_weight = _param(self.conv_dim, 1, conv_kernel, dtype=dtype)
        self.conv1d_bias = _param(self.conv_dim, dtype=dtype) if use_conv_bias else None
        self.A = _param(self.heads, dtype=torch.float32)
        self.D = _param(self.heads, dtype=dtype)
        self.dt_bias = _param(self.heads, dtype=dtype)
        self.norm_weight = _param(self.inter, dtype=dtype)
        self.out_proj = Linear(self.inter, hidden, dtype, bias=use_bias, quant=quant, prefix=f"{prefix}.out_proj")
        self.compiled = compiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        projected = self.in_proj(x)
        ssm_out = x.new_empty(n, self.inter)
        conv_in = x.new_empty(n, self.conv_dim)  # profile path: transpose().clone() of xBC
        del conv_in
        normed = torch.empty_like(ssm_out)  # Mixer2RMSNormGated(ssm_out, gate)
        if self.compiled:
            del projected, ssm_out
        return self.out_proj(normed)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention of one rank (``GatedDeltaNetAttention``, vLLM 0.19).

    ``forward(x, output)`` writes the ``[N, H]`` result into ``output`` like vLLM.

    Raises:
        ValueError: ``tp`` does not divide the key/value head counts.
    """

    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, tp: int, dtype: torch.dtype, *, quant=None, prefix: str = "",
                 compiled: bool = True) -> None:
        super().__init__()
        if num_k_heads % tp or num_v_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide linear_num_key_heads ({num_k_heads}) "
                             f"and linear_num_value_heads ({num_v_heads})")
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.nv, self.dv = num_v_heads // tp, head_v_dim
        self.qkvz = (2 * key_dim + 2 * value_dim) // tp
        self.conv_dim = (2 * key_dim + value_dim) // tp
        self.conv1d_weight = _param(self.conv_dim, 1, conv_kernel, dtype=dtype)
        self.in_proj_qkvz = Linear(hidden, self.qkvz, dtype, quant=quant, prefix=f"{prefix}.in_proj_qkvz")
        self.in_proj_ba = Linear(hidden, 2 * self.nv, dtype, quant=quant, prefix=f"{prefix}.in_proj_ba")
        self.dt_bias = _param(self.nv, dtype=dtype)
        self.A_log = _param(self.nv, dtype=torch.float32)
        self.norm_weight = _param(head_v_dim, dtype=dtype)
        self.out_proj = Linear(value_dim // tp, hidden, dtype, quant=quant, prefix=f"{prefix}.out_proj")
        self.compiled = compiled

    def forward(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        qkvz = self.in_proj_qkvz(x)
        ba = self.in_proj_ba(x)
        b = x.new_empty(n, self.nv)
        a = x.new_empty(n, self.nv)  # .contiguous() copies of the chunks
        core = x.new_empty(n, self.nv, self.dv)  # torch.zeros
        normed = x.new_empty(n * self.nv, self.dv)  # RMSNormGated(core, z)
        if self.compiled:
            del qkvz, ba, b, a, core
        out = self.out_proj(normed.view(n, self.nv * self.dv))
        del normed
        output.copy_(out)
        return output


class GatedOutputAttention(nn.Module):
    """Full attention with a sigmoid output gate (``Qwen3NextAttention``, vLLM 0.19), one rank.

    ``forward(positions, x, output)`` writes ``[N, H]`` into ``output``. The V1 profile run skips
    the attention kernel but still allocates its output ``[N, heads·d]``.
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 rope, *, gated: bool = True, qkv_bias: bool = False, compiled: bool = True, quant=None,
                 prefix: str = "") -> None:
        super().__init__()
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.gated = gated
        width = self.q_size * (2 if gated else 1) + 2 * self.kv_size
        self.qkv_proj = Linear(hidden, width, dtype, bias=qkv_bias, quant=quant, prefix=f"{prefix}.qkv_proj")
        self.o_proj = Linear(self.q_size, hidden, dtype, quant=quant, prefix=f"{prefix}.o_proj")
        self.q_norm = RMSNorm(head_dim, dtype)
        self.k_norm = RMSNorm(head_dim, dtype)
        self.rotary_emb = rope
        self.compiled = compiled

    def forward(self, positions, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        q = x.new_empty(n, self.q_size)  # q/k norms (out of place)
        k = x.new_empty(n, self.kv_size)
        attn = x.new_empty(n, self.q_size)
        if self.gated:
            gate = torch.empty_like(attn)  # sigmoid(gate)
            gated = torch.empty_like(attn)  # attn * gate
            del gate
            attn = gated
        if self.compiled:
            del qkv, q, k
        out = self.o_proj(attn)
        del attn
        output.copy_(out)
        return output

"""Memory-equivalent building blocks of a vLLM decoder (torch).

Each module allocates what vLLM's own layer allocates during the profile run, in the same order
and with the same lifetimes; the values themselves are never meaningful. Fused custom ops that
vLLM runs as one kernel (``silu_and_mul``, ``fused_add_rms_norm``, rotary embedding) are modelled
as a single output allocation or as in-place ops, because that is what they cost in memory.

Two lifetime regimes (``compiled``):
- eager (V0, ``--enforce-eager``): Python locals keep intermediates alive until the function
  returns, e.g. vLLM's ``LlamaMLP.forward`` still holds ``gate_up`` while ``down_proj`` allocates
  its output (vllm/model_executor/models/llama.py);
- compiled (V1 default, torch.compile/inductor): buffers die at their last use.

Shapes are per tensor-parallel rank: N tokens, H hidden size, I intermediate size / tp,
heads / tp, ``max(1, kv_heads // tp)`` KV heads, vocab padded to a multiple of 64 then / tp.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.model.simulate.quant_weights import make_linear_weights


def pad_vocab(vocab_size: int, multiple: int = 64) -> int:
    """``pad_vocab_size`` (vllm/model_executor/layers/vocab_parallel_embedding.py)."""
    return -(-vocab_size // multiple) * multiple


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """A (column- or row-parallel) linear layer with a per-rank weight ``[out, in]``.

    ``quant`` is the checkpoint's quantization scheme (:func:`tuner.memory.quant.scheme_for`) or
    ``None``; ``prefix`` is the layer's vLLM module name (``model.layers.0.mlp.down_proj``) so the
    scheme can keep ignored layers in 16-bit. A scheme that quantizes the layer registers its own
    parameters (packed weights, scales, zero points) in place of ``weight``.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, bias: bool = False, *,
                 quant=None, prefix: str = "") -> None:
        super().__init__()
        self.in_features, self.out_features, self.prefix = in_features, out_features, prefix
        if quant is None or not make_linear_weights(quant, self, in_features, out_features, dtype, prefix):
            self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.out_dtype = dtype
        #: set by :func:`mark_tp_all_reduce` on a row-parallel layer whose output the release
        #: all-reduces out of place (a new tensor while the partial sum is still alive).
        self.all_reduce_out_of_place = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        if self.all_reduce_out_of_place:
            reduced = torch.empty_like(out)  # tensor_model_parallel_all_reduce(output_parallel)
            del out
            return reduced
        return out

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        w = getattr(self, "weight", None)
        if w is None or w.dtype != x.dtype or w.shape != (self.out_features, self.in_features):
            aq = getattr(self, "input_quant", None)  # W8A8: (dtype name, scale columns), see quant.py
            xq = None if aq is None else (x.new_empty(x.shape[0], self.in_features, dtype=getattr(torch, aq[0])),
                                          x.new_empty(x.shape[0], aq[1], dtype=torch.float32))
            tmp = getattr(self, "gemm_temp", None)  # a dequantized weight the kernel multiplies (quant.py)
            dq = x.new_empty(*tmp[1], dtype=getattr(torch, tmp[2])) if tmp and x.shape[0] >= tmp[0] else None
            out = x.new_empty(x.shape[0], self.out_features)  # quantized GEMM: one output allocation
            del xq, dq
            return out
        if self.bias is None:
            return torch.nn.functional.linear(x, w)
        # as torch's own linear for inputs of other than 2 dims (matmul, then add_ of the bias): the
        # same one [N, out] allocation as addmm, without addmm's Python meta decomposition, whose
        # first call imports torch._dynamo (about 1.5 CPU s of a cold worker)
        out = torch.nn.functional.linear(x, w)
        out.add_(self.bias)
        return out


class RMSNorm(nn.Module):
    """vLLM ``RMSNorm``: out-of-place without residual, fused add+norm in place with one."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(hidden, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return torch.empty_like(x)
        residual.add_(x)  # fused_add_rms_norm: both updated in place
        return x, residual


class RotaryEmbedding(nn.Module):
    """vLLM ``RotaryEmbedding``: a persistent ``cos_sin_cache [max_position, rotary_dim]`` in the
    model dtype (counted in "Model loading took"), applied to q and k in place."""

    def __init__(self, max_position: int, rotary_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.empty(max_position, rotary_dim, dtype=dtype), persistent=False)

    def forward(self, positions, q, k):
        return q, k


class Attention(nn.Module):
    """QKV projection, rotary, attention and output projection of one layer (per rank).

    The V1 profile run skips the attention kernel (no KV cache yet) but still allocates its output
    ``[N, heads·head_dim]``; V0 runs prefill attention (FlashAttention: output plus an fp32
    log-sum-exp ``[heads, N]``), never an N² tensor.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        rope: RotaryEmbedding | None,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        v_head_dim: int | None = None,
        compiled: bool = True,
        runs_attention: bool = False,
        quant=None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.v_size = num_kv_heads * (v_head_dim or head_dim)
        self.num_heads = num_heads
        self.out_size = num_heads * (v_head_dim or head_dim)
        self.qkv_proj = Linear(hidden, self.q_size + self.kv_size + self.v_size, dtype, bias=qkv_bias,
                               quant=quant, prefix=f"{prefix}.qkv_proj")
        self.o_proj = Linear(self.out_size, hidden, dtype, bias=o_bias, quant=quant, prefix=f"{prefix}.o_proj")
        self.rotary_emb = rope
        self.compiled = compiled
        self.runs_attention = runs_attention

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.v_size], dim=-1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        attn_out = qkv.new_empty(qkv.shape[0], self.out_size)
        if self.runs_attention:
            lse = qkv.new_empty(self.num_heads, qkv.shape[0], dtype=torch.float32)
            del lse
        if self.compiled:
            del qkv, q, k, v
        out = self.o_proj(attn_out)
        return out


class GatedMLP(nn.Module):
    """``gate_up_proj`` → ``silu_and_mul`` → ``down_proj`` (vLLM ``LlamaMLP``).

    ``holds_gate_up``: the vLLM class keeps the ``gate_up`` output in a named local across
    ``down_proj`` (``gate_up, _ = self.gate_up_proj(x); x = self.act_fn(gate_up); x, _ =
    self.down_proj(x)``: ``Qwen2MLP`` — also Qwen3's —, ``GraniteMLP``, ``InternLM2MLP``,
    ``Gemma2MLP``, vllm/model_executor/models/*.py 0.6.4–0.10.1 read), which matters only where the
    profile runs eagerly; ``LlamaMLP`` rebinds ``x`` and frees it (the default)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, *, compiled: bool = True, bias: bool = False,
                 quant=None, prefix: str = "", holds_gate_up: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, dtype, bias=bias, quant=quant, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = Linear(intermediate, hidden, dtype, bias=bias, quant=quant, prefix=f"{prefix}.down_proj")
        self.compiled = compiled
        self.holds_gate_up = holds_gate_up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = gate_up.new_empty(gate_up.shape[0], self.intermediate)  # silu_and_mul output
        if not self.compiled and not self.holds_gate_up:
            # Eager LlamaMLP (``x, _ = self.gate_up_proj(x); x = self.act_fn(x)``) drops gate_up
            # before down_proj allocates: V0 start-ups (RTX 3090, Llama-3.1-8B, N = 20000 and 29000)
            # grow by ~110 KB/token = 3·[N, H] + gate_up + act; V1's compiled graphs hold it
            # (CodeLlama-7B, 0.19: ~101 KB/token).
            del gate_up
        out = self.down_proj(act)
        return out


class PlainMLP(nn.Module):
    """``fc1`` → activation → ``fc2`` (Phi-2 / GPT-style, no gate)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, *, compiled: bool = True, bias: bool = True,
                 quant=None, prefix: str = "") -> None:
        super().__init__()
        self.fc1 = Linear(hidden, intermediate, dtype, bias=bias, quant=quant, prefix=f"{prefix}.fc1")
        self.fc2 = Linear(intermediate, hidden, dtype, bias=bias, quant=quant, prefix=f"{prefix}.fc2")
        self.compiled = compiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        a = torch.empty_like(h)
        if self.compiled:
            del h
        return self.fc2(a)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer with vLLM's residual handling (first layer norms out of place)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, dtype)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden, dtype)
        self.mlp = mlp

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


def mark_tp_all_reduce(model: nn.Module) -> int:
    """Make the row-parallel projections of every :class:`DecoderLayer` all-reduce out of place:
    the attention's ``o_proj`` and the dense MLP's ``down_proj`` / ``fc2`` (MoE blocks and MLA
    model their own reduce; a shared expert under an MoE block is not the layer's ``mlp`` and
    is left alone). vLLM ``RowParallelLinear.forward`` (vllm/model_executor/layers/linear.py)
    returns ``tensor_model_parallel_all_reduce(output_parallel)`` while ``output_parallel`` is still
    a live local; from 0.6.5 that all-reduce always returns a new tensor (custom all-reduce, pynccl
    ``out_tensor = torch.empty_like(in_tensor)``, symmetric memory), so both are alive at once.
    Returns the number of layers marked."""
    n = 0
    for m in model.modules():
        if not isinstance(m, DecoderLayer):
            continue
        targets = []
        if isinstance(m.self_attn, Attention):
            targets.append(m.self_attn.o_proj)
        if isinstance(m.mlp, GatedMLP):
            targets.append(m.mlp.down_proj)
        elif isinstance(m.mlp, PlainMLP):
            targets.append(m.mlp.fc2)
        for lin in targets:
            lin.all_reduce_out_of_place = True
            n += 1
    return n


class VocabEmbedding(nn.Module):
    """``VocabParallelEmbedding``: weight ``[pad(V)/tp, H]``; with tp > 1 the lookup masks the
    input ids and all-reduces the partial embeddings (one extra ``[N, H]`` temporary)."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tp: int) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _param(pad_vocab(vocab_size) // tp, hidden, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            # the ids masked into this rank's shard (vLLM: a clamp/where over ``input_ids``): one new
            # [N] int64 tensor, allocated as such (values never matter; ``clamp`` on meta tensors
            # would run a Python reference and import torch._dynamo, seconds of a cold worker)
            masked = torch.empty_like(input_ids)
            out = torch.nn.functional.embedding(masked, self.weight)
            del masked
            return out
        return torch.nn.functional.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """``ParallelLMHead`` + ``LogitsProcessor``: logits ``[R, pad(V)/tp]`` gathered to
    ``[R, pad(V)]`` on every rank when tp > 1, then cut to the real vocab (a view)."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tp: int, tied_to: VocabEmbedding | None = None,
                 soft_cap: float | None = None, *, quant=None, prefix: str = "lm_head") -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.soft_cap = soft_cap
        self.quantized = False
        if tied_to is not None:
            self.tied = [tied_to]  # not registered: the weight is shared, counted once
            self.weight = None
        else:
            self.tied = None
            rows = pad_vocab(vocab_size) // tp
            # only methods that quantize ParallelLMHead (GPTQ ``lm_head: true``) register here
            self.quantized = quant is not None and make_linear_weights(quant, self, hidden, rows, dtype, prefix)
            if not self.quantized:
                self.weight = _param(rows, hidden, dtype=dtype)
            elif "weight" not in self._parameters:
                self.weight = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            logits = hidden.new_empty(hidden.shape[0], pad_vocab(self.vocab_size) // self.tp)
        else:
            w = self.weight if self.weight is not None else self.tied[0].weight
            logits = torch.nn.functional.linear(hidden, w)
        if self.tp > 1:
            gathered = logits.new_empty(logits.shape[0], logits.shape[1] * self.tp)
            del logits
            logits = gathered
        if self.soft_cap is not None:
            logits = logits.div_(self.soft_cap).tanh_().mul_(self.soft_cap)
        return logits[:, : self.vocab_size]


class CausalLM(nn.Module):
    """Embedding → decoder layers → final norm; ``forward`` returns the last hidden states
    ``[N, H]`` like vLLM models, ``compute_logits`` applies the LM head to sampled rows."""

    def __init__(self, embed: VocabEmbedding | None, layers: list[nn.Module], norm: RMSNorm | None,
                 lm_head: LMHead | None, extra: dict[str, nn.Module] | None = None) -> None:
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.extra = nn.ModuleDict(extra or {})

    def forward(self, input_ids, positions, intermediate: tuple | None = None):
        if intermediate is None:
            hidden_states = self.embed_tokens(input_ids)
            residual = None
        else:
            hidden_states, residual = intermediate
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if self.norm is None:
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

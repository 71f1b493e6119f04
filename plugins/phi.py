"""Phi family plugin: Phi-2 (``PhiForCausalLM``) and Phi-3 / Phi-3.5 / Phi-4 (``Phi3ForCausalLM``).

What is modelled per rank:

* **Phi-2** (vllm/model_executor/models/phi.py, vLLM 0.19): parallel attention + MLP on one
  ``nn.LayerNorm`` (weight and bias) per layer — ``h = attn(ln(x)) + mlp(ln(x)) + x``; fused
  ``qkv_proj`` with bias, KV heads = attention heads (``Attention`` gets no ``num_kv_heads``);
  ``dense`` output projection with bias; partial rotary ``rotary_dim = d · partial_rotary_factor``
  (0.4 → 32 of 80) with a ``cos_sin_cache [max_position_embeddings, rotary_dim]``; ``PlainMLP``
  ``fc1 [H → n_inner]`` (``4·H`` unless ``n_inner``) → ``gelu_new`` → ``fc2``, both with bias;
  final LayerNorm; untied ``lm_head`` with a bias (vLLM asserts untied).
* **Phi-3 / Phi-4** (vllm/model_executor/models/phi3.py = ``LlamaForCausalLM``): the generic
  Llama decoder (fused ``qkv_proj`` and ``gate_up_proj``, RMSNorm), partial rotary where the
  config sets it (Phi-4-mini 0.75), ``longrope`` scaling's ``long_short_cos_sin_cache`` of
  ``original_max_position_embeddings + max_position_embeddings`` rows
  (phi3_long_rope_scaled_rope.py), and a sliding window on every layer when the config sets
  ``sliding_window`` (Phi-3-mini: 2047 → ``SlidingWindowSpec``).

KV cache: one spec per layer, page ``2 · bs · max(1, kv // tp) · d · dtype`` bytes
(Phi-2: ``kv = num_attention_heads``).
"""

from __future__ import annotations

from tuner.memory.kvcache import FullAttentionSpec, dtype_bytes_for, kv_heads_per_rank
from tuner.model.plugin import RankSettings, stage_layers
from tuner.plugins.generic import GenericDecoderPlugin

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def _longrope_rows(spec) -> int | None:
    """Rows of Phi-3's ``long_short_cos_sin_cache`` (short + long), or None without longrope."""
    rp = spec.raw.get("rope_parameters") or spec.raw.get("rope_scaling") or {}
    kind = rp.get("rope_type") or rp.get("type")
    if kind not in ("longrope", "su"):
        return None
    orig = int(rp.get("original_max_position_embeddings") or spec.raw.get("original_max_position_embeddings")
               or spec.max_position_embeddings)
    return orig + spec.max_position_embeddings


class PhiPlugin(GenericDecoderPlugin):
    """Phi-2 (parallel attention/MLP, LayerNorm, biases) and Phi-3/Phi-4 (Llama layout)."""

    name = "phi"
    architectures = ("PhiForCausalLM", "Phi3ForCausalLM")

    @staticmethod
    def _is_phi2(spec) -> bool:
        return "PhiForCausalLM" in spec.architectures or spec.model_type == "phi"

    def kv_cache_spec(self, spec, settings: RankSettings) -> dict:
        if not self._is_phi2(spec):
            return super().kv_cache_spec(spec, settings)
        bs = settings.block_size or 16
        heads = kv_heads_per_rank(spec.num_attention_heads, settings.tensor_parallel_size)
        dt = dtype_bytes_for(settings.kv_cache_dtype, settings.dtype)
        return {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(block_size=bs, num_kv_heads=heads,
                                                                      head_size=spec.head_dim, dtype_bytes=dt)
                for i in stage_layers(spec, settings)}

    def qkv_bias(self, spec) -> bool:
        return bool(spec.raw.get("attention_bias") or spec.raw.get("qkv_bias"))

    def build_model(self, spec, settings: RankSettings):
        import torch

        if not self._is_phi2(spec):
            model = super().build_model(spec, settings)
            rows = _longrope_rows(spec)
            if rows is not None:
                rope = model.extra["rotary_emb"]
                rope.cos_sin_cache = torch.empty(rows, spec.rotary_dim, dtype=rope.cos_sin_cache.dtype)
            return model
        return _build_phi2(spec, settings)


def _build_phi2(spec, settings: RankSettings):
    import torch
    from torch import nn

    from tuner.model.simulate import layers as L
    from tuner.memory.quant import scheme_for

    dtype = getattr(torch, _DTYPES.get(settings.dtype, "bfloat16"))
    tp, pp, rank = settings.tensor_parallel_size, settings.pipeline_parallel_size, settings.pp_rank
    h = spec.hidden_size
    heads = spec.num_attention_heads // tp
    inter = int(spec.raw.get("n_inner") or 4 * h) // tp
    quant = scheme_for(spec, settings)
    rope = L.RotaryEmbedding(spec.max_position_embeddings, spec.rotary_dim, dtype)

    class LayerNorm(nn.Module):
        """``nn.LayerNorm(H)``: weight and bias, always out of place."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(h, dtype=dtype), requires_grad=False)
            self.bias = nn.Parameter(torch.empty(h, dtype=dtype), requires_grad=False)

        def forward(self, x):
            return torch.empty_like(x)

    class PhiLayer(nn.Module):
        """``PhiLayer``: ``attn(ln(x)) + mlp(ln(x)) + x`` (both branches read the same norm output)."""

        def __init__(self, i: int) -> None:
            super().__init__()
            p = f"model.layers.{i}"
            self.input_layernorm = LayerNorm()
            self.self_attn = L.Attention(h, heads, heads, spec.head_dim, dtype, rope, qkv_bias=True, o_bias=True,
                                         compiled=settings.compiled, runs_attention=settings.runs_attention,
                                         quant=quant, prefix=f"{p}.self_attn")
            self.mlp = L.PlainMLP(h, inter, dtype, compiled=settings.compiled, bias=True, quant=quant, prefix=f"{p}.mlp")

        def forward(self, positions, hidden_states, residual):
            normed = self.input_layernorm(hidden_states)
            attn = self.self_attn(positions, normed)
            ff = self.mlp(normed)
            del normed
            s = attn + ff
            del attn, ff
            out = s + hidden_states
            return out, None

    class PhiLM(L.CausalLM):
        def forward(self, input_ids, positions, intermediate=None):
            hs = self.embed_tokens(input_ids) if intermediate is None else intermediate[0]
            for layer in self.layers:
                hs, _ = layer(positions, hs, None)
            if self.norm is None:
                return hs, torch.zeros_like(hs)
            return self.norm(hs)

    class PhiHead(L.LMHead):
        """Untied ``ParallelLMHead`` with a bias ``[pad(V)/tp]``."""

        def __init__(self) -> None:
            super().__init__(spec.vocab_size, h, dtype, tp)
            self.bias = nn.Parameter(torch.empty(self.weight.shape[0], dtype=dtype), requires_grad=False)

    first, last = rank == 0, rank == pp - 1
    layers = [PhiLayer(i) for i in stage_layers(spec, settings)]
    embed = L.VocabEmbedding(spec.vocab_size, h, dtype, tp) if first else None
    return PhiLM(embed, layers, LayerNorm() if last else None, PhiHead() if last else None,
                 extra={"rotary_emb": rope})


plugin = PhiPlugin()

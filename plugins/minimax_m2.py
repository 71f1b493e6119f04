"""MiniMax-M2 plugin (``MiniMaxM2ForCausalLM``: MiniMax-M2 / M2.1 / M2.5 / M2.7): full-attention
decoder with a 256-expert sigmoid-routed MoE in every layer.

Follows vLLM vllm/model_executor/models/minimax_m2.py (0.19). Per rank: vocab-parallel embedding
and untied LM head (``[pad64(V)/tp, H]``, the LM head never quantized); attention
``model.layers.<i>.self_attn``: fused QKV (bias only with ``attention_bias``), ``o_proj``, and
TP-sharded q/k RMSNorms over all heads (``MiniMaxText01RMSNormTP``: ``q_norm [heads·head_dim/tp]``,
``k_norm [kv_heads·head_dim/tp]``, model dtype); rotary ``cos_sin_cache [max_position_embeddings,
rotary_dim]`` in the model dtype (``rotary_dim`` from the config, else ``head_dim ·
partial_rotary_factor``; vLLM sizes it by ``max(max_position_embeddings, max_model_len)``, and the
plugin does not know ``max_model_len``: the cache is too small only when ``max_model_len`` exceeds
the config's positions). MoE ``model.layers.<i>.mlp``: router ``gate`` = replicated **fp32**
``Linear [E, H]`` fed an fp32 copy of the hidden states (fp32 router logits), fp32
``e_score_correction_bias [E]`` when ``use_routing_bias``, and :class:`tuner.model.simulate.moe.FusedMoE`
with ``num_local_experts`` experts of ``intermediate_size / tp``, top-``num_experts_per_tok``,
all-reduced by the block. The MTP modules (``num_mtp_modules``) are draft layers loaded only for
speculative decoding: not built. KV cache: one ``FullAttentionSpec`` per layer (M2 has no
lightning-attention layers; ``attn_type_list`` is all 1). Quantized checkpoints (NVFP4, AWQ,
compressed-tensors) get their bytes from :func:`tuner.memory.quant.scheme_for`.
"""

from __future__ import annotations

from tuner.model.plugin import ModelPlugin, RankSettings, stage_layers
from tuner.plugins.generic import decoder_kv_specs


def rotary_dim(spec) -> int:
    """``rotary_dim`` from the config (MiniMax-M2.7: 64), else ``head_dim · partial_rotary_factor``."""
    return int(spec.raw.get("rotary_dim") or spec.rotary_dim)


class MiniMaxM2Plugin(ModelPlugin):
    """MiniMax-M2 family."""

    name = "minimax_m2"
    architectures = ("MiniMaxM2ForCausalLM",)

    def kv_cache_spec(self, spec, settings: RankSettings) -> dict:
        return decoder_kv_specs(spec, settings)

    def build_model(self, spec, settings: RankSettings):
        from tuner.model.simulate import layers as L
        from tuner.model.simulate.moe import Fp32Router, FusedMoE, SparseMoeBlock, build_decoder, torch_dtype
        from tuner.memory.quant import scheme_for

        raw = spec.raw
        dtype = torch_dtype(settings.dtype)
        tp = settings.tensor_parallel_size
        quant = scheme_for(spec, settings)
        h = spec.hidden_size
        experts = int(raw.get("num_local_experts") or 256)
        top_k = int(raw.get("num_experts_per_tok") or 8)
        rope = L.RotaryEmbedding(spec.max_position_embeddings, rotary_dim(spec), dtype)

        def mlp(i: int, prefix: str):
            p = f"{prefix}.mlp"
            gate = Fp32Router(h, experts, correction_bias=bool(raw.get("use_routing_bias")))
            moe = FusedMoE(h, spec.intermediate_size // tp, experts, top_k, dtype, quant=quant, prefix=f"{p}.experts",
                           compiled=settings.compiled, engine_version=settings.engine_version,
                           tensor_parallel_size=tp, reduce_results=False)
            return SparseMoeBlock(gate, moe, tensor_parallel_size=tp)

        model = build_decoder(spec, settings, stage_layers(spec, settings), mlp_for_layer=mlp, rope=rope, quant=quant,
                              qkv_bias=bool(raw.get("attention_bias", False)), lm_head_quant=True)
        for layer in model.layers:  # MiniMaxText01RMSNormTP over all heads, sharded by tp
            attn = layer.self_attn
            attn.q_norm = L.RMSNorm(spec.num_attention_heads * spec.head_dim // tp, dtype)
            attn.k_norm = L.RMSNorm(spec.num_key_value_heads * spec.head_dim // tp, dtype)
        return model


plugin = MiniMaxM2Plugin()

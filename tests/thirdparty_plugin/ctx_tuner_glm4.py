"""GLM-4 plugin for ctx-tuner (``Glm4ForCausalLM``: GLM-4-0414, GLM-Z1).

Follows vLLM ``Glm4ForCausalLM`` (vllm/model_executor/models/glm4.py): the Llama layout that
``tuner.model.kit.build_decoder`` builds (fused QKV, biased when ``attention_bias``, ``o_proj``, gated
MLP, vocab-parallel embedding and LM head) plus two more RMSNorms ``[H]`` per layer,
``post_self_attn_layernorm`` after the attention and ``post_mlp_layernorm`` after the MLP, each
applied out of place (a new ``[N, H]``). Rotary cache ``[max_position_embeddings, head_dim ·
partial_rotary_factor]`` (vLLM's default factor: 0.5). KV cache: one full-attention spec per layer.
"""

from __future__ import annotations

from tuner.model.kit import FullAttentionSpec, ModelPlugin, RankSettings, dtype_bytes_for, kv_heads_per_rank, stage_layers


def rotary_dim(spec) -> int:
    """``head_dim · partial_rotary_factor``, the factor 0.5 when the config gives none (glm4.py)."""
    rope = spec.raw.get("rope_parameters") or spec.raw.get("rope_scaling") or {}
    return int(spec.head_dim * (spec.raw.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5))


class Glm4Plugin(ModelPlugin):
    """GLM-4 dense decoder (Glm4ForCausalLM)."""

    name = "glm4"
    architectures = ("Glm4ForCausalLM",)

    def kv_cache_spec(self, spec, settings: RankSettings) -> dict:
        heads = kv_heads_per_rank(spec.num_key_value_heads, settings.tensor_parallel_size)
        dtype_bytes = dtype_bytes_for(settings.kv_cache_dtype, settings.dtype)
        return {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
                    block_size=settings.block_size or 16, num_kv_heads=heads, head_size=spec.head_dim,
                    dtype_bytes=dtype_bytes)
                for i in stage_layers(spec, settings)}

    def build_model(self, spec, settings: RankSettings):
        import torch

        from tuner.model.kit import GatedMLP, RMSNorm, RotaryEmbedding, build_decoder, scheme_for, torch_dtype

        dtype, quant = torch_dtype(settings.dtype), scheme_for(spec, settings)
        h, tp = spec.hidden_size, settings.tensor_parallel_size

        class PostNorm(torch.nn.Module):
            """``block``, then an out-of-place RMSNorm of its output."""

            def __init__(self, block):
                super().__init__()
                self.block, self.norm = block, RMSNorm(h, dtype)

            def forward(self, *args):
                return self.norm(self.block(*args))

        def mlp(i: int, prefix: str):
            return PostNorm(GatedMLP(h, spec.intermediate_size // tp, dtype, compiled=settings.compiled,
                                     quant=quant, prefix=f"{prefix}.mlp"))

        rope = RotaryEmbedding(spec.max_position_embeddings, rotary_dim(spec), dtype)
        model = build_decoder(spec, settings, stage_layers(spec, settings), mlp_for_layer=mlp, rope=rope,
                              quant=quant, qkv_bias=bool(spec.raw.get("attention_bias")))
        for layer in model.layers:
            layer.self_attn = PostNorm(layer.self_attn)
        return model


plugin = Glm4Plugin()

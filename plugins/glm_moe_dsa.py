"""GLM-5.x plugin (``GlmMoeDsaForCausalLM``): DeepSeek-V3.2-style sparse MLA with the DSA indexer.

vLLM 0.19.0 registers ``GlmMoeDsaForCausalLM`` as a plain subclass of ``DeepseekV2ForCausalLM``
(vllm/model_executor/models/deepseek_v2.py), so everything is modelled by
:class:`plugins.deepseek.DeepseekPlugin`: MLA attention (``q_lora_rank`` 2048, latent 512 + 64,
``qk_nope_head_dim`` 192, ``v_head_dim`` 256), 3 dense layers then 256 routed experts top-8 + 1
shared, fp32 ``e_score_correction_bias``, fp8 block-quantized checkpoint weights, and per layer the
indexer (``index_n_heads`` × ``index_head_dim`` query projection, ``wk``, ``k_norm``,
``weights_proj``) whose KV cache is a second MLA-type layer of ``128 + 4`` uint8 per token.
Rotary cache ``[max_position_embeddings, 64]`` (1 Mi rows, default rope, no yarn) shared with the
indexer (``indexer_rope_interleave`` → same ``get_rope`` key).

Differences from the GLM config that vLLM 0.19 ignores (so they are ignored here too):
``index_topk_freq`` / ``indexer_types`` ("shared" indexer layers) — 0.19 builds an indexer and its
cache on every layer (``is_v32 = hasattr(config, "index_topk")``); ``mlp_layer_types`` (0.19 uses
``first_k_dense_replace``, which agrees); ``moe_router_dtype`` (the 0.19 DeepSeek gate is 16-bit).

KV cache on Hopper, 0.19: ``FLASHMLA_SPARSE``, block 64; ``--kv-cache-dtype fp8`` becomes
``fp8_ds_mla`` (656 B per token per layer).
"""

from __future__ import annotations

from tuner.plugins.deepseek import DeepseekPlugin


class GlmMoeDsaPlugin(DeepseekPlugin):
    """GLM-5 / GLM-5.x (``GlmMoeDsaForCausalLM``), modelled as DeepSeek-V3.2 sparse MLA."""

    name = "glm_moe_dsa"
    architectures = ("GlmMoeDsaForCausalLM",)


plugin = GlmMoeDsaPlugin()

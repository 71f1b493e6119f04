"""Mixtral plugin: Llama-style attention with a sparse mixture-of-experts MLP in every layer.

Follows vLLM ``MixtralForCausalLM`` (vllm/model_executor/models/mixtral.py, 0.6–0.19). Per rank:
vocab-parallel embedding and LM head (vocab padded to 64, / tp), fused QKV without bias (KV heads
``max(1, kv // tp)``, replicated below tp), ``o_proj``, RMSNorms, rotary ``cos_sin_cache
[max_position_embeddings, head_dim]`` in the model dtype, and per layer a ``MixtralMoE`` block
(``model.layers.<i>.block_sparse_moe``): router ``gate`` = replicated ``Linear [E, H]`` without
bias in 16 bit, and :class:`tuner.model.simulate.moe.FusedMoE` with ``E = num_local_experts`` experts of
``I / tp`` (``w13 [E, 2·I/tp, H]``, ``w2 [E, H, I/tp]``), top-``num_experts_per_tok`` routing; the
experts' output is all-reduced by the layer (``reduce_results=True``). Quantized checkpoints get
their bytes from :func:`tuner.memory.quant.scheme_for` (registered by ``make_linear_weights`` /
``make_expert_weights``). KV cache: one ``FullAttentionSpec`` per layer (``SlidingWindowSpec``
when the config sets ``sliding_window``, as Mixtral-8x7B-v0.1's first configs did).

Profile run: the fused-MoE buffers of :mod:`tuner.model.simulate.moe` (0.19: a persistent workspace of
``M·k·(max(I/tp, H) + max(2·I/tp, H))`` elements that is still allocated when the sampler runs).
"""

from __future__ import annotations

from tuner.plugins.generic import decoder_kv_specs
from tuner.model.plugin import ModelPlugin, RankSettings, stage_layers


class MixtralPlugin(ModelPlugin):
    """Mixtral-8x7B / 8x22B (MixtralForCausalLM)."""

    name = "mixtral"
    architectures = ("MixtralForCausalLM",)

    def kv_cache_spec(self, spec, settings: RankSettings) -> dict:
        return decoder_kv_specs(spec, settings)

    def build_model(self, spec, settings: RankSettings):
        from tuner.model.simulate import layers as L
        from tuner.model.simulate.moe import FusedMoE, SparseMoeBlock, build_decoder, torch_dtype
        from tuner.memory.quant import scheme_for

        dtype = torch_dtype(settings.dtype)
        tp = settings.tensor_parallel_size
        quant = scheme_for(spec, settings)
        h = spec.hidden_size
        experts = int(spec.raw.get("num_local_experts") or 8)
        top_k = int(spec.raw.get("num_experts_per_tok") or 2)
        rope = L.RotaryEmbedding(spec.max_position_embeddings, spec.rotary_dim, dtype)

        def mlp(i: int, prefix: str):
            p = f"{prefix}.block_sparse_moe"
            gate = L.Linear(h, experts, dtype, prefix=f"{p}.gate")  # quant_config=None in vLLM
            moe = FusedMoE(h, spec.intermediate_size // tp, experts, top_k, dtype, quant=quant, prefix=f"{p}.experts",
                           compiled=settings.compiled, engine_version=settings.engine_version,
                           tensor_parallel_size=tp, reduce_results=True)
            return SparseMoeBlock(gate, moe, tensor_parallel_size=tp)

        return build_decoder(spec, settings, stage_layers(spec, settings), mlp_for_layer=mlp, rope=rope, quant=quant,
                             lm_head_quant=True)


plugin = MixtralPlugin()

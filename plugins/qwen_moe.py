"""Qwen MoE plugins: Qwen1.5-MoE / Qwen2-MoE (``Qwen2MoeForCausalLM``) and Qwen3-MoE / Qwen3-Coder
(``Qwen3MoeForCausalLM``).

Follows vLLM vllm/model_executor/models/qwen2_moe.py and qwen3_moe.py (0.19). Per rank: vocab-
parallel embedding and LM head (tied when the config ties them), fused QKV (Qwen2-MoE with bias;
Qwen3-MoE with ``attention_bias`` and per-head ``q_norm``/``k_norm [head_dim]``), rotary
``cos_sin_cache [max_position_embeddings, rotary_dim]`` in the model dtype, RMSNorms. Layer ``i`` is
sparse when ``i`` is not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``
(``num_experts > 0``); other layers get a dense gated MLP of ``intermediate_size / tp``. A sparse
block (``model.layers.<i>.mlp``) holds: router ``gate`` = replicated 16-bit ``Linear [E, H]``;
``shared_expert_gate`` = replicated ``Linear [1, H]`` (Qwen2-MoE always creates it, Qwen3-MoE only
with a shared expert); a shared expert (gated MLP of ``shared_expert_intermediate_size / tp``,
summed before the all-reduce) when that size is > 0; and :class:`tuner.model.simulate.moe.FusedMoE` with
``num_experts`` experts of ``moe_intermediate_size / tp``, top-``num_experts_per_tok``, all-reduced
once by the block. Quantized checkpoints (FP8 block-wise Qwen3 / Qwen3-Coder, AWQ, GPTQ) get their
bytes from :func:`tuner.memory.quant.scheme_for`. KV cache: one ``FullAttentionSpec`` per layer
(``SlidingWindowSpec`` only when ``use_sliding_window`` is true; vLLM's MoE models never slide).
"""

from __future__ import annotations

from tuner.model.plugin import ModelPlugin, RankSettings, stage_layers
from tuner.plugins.generic import decoder_kv_specs


def num_experts(raw: dict) -> int:
    """The config's ``num_experts`` (transformers 5 exposes it as ``num_local_experts``)."""
    return int(raw.get("num_experts") or raw.get("num_local_experts") or 0)


def is_sparse_layer(raw: dict, i: int) -> bool:
    """vLLM's rule (Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer): layer ``i`` gets the sparse
    MoE block unless listed in ``mlp_only_layers``; needs ``num_experts > 0`` and
    ``(i + 1) % decoder_sparse_step == 0``."""
    step = int(raw.get("decoder_sparse_step") or 1)
    return (i not in (raw.get("mlp_only_layers") or [])) and num_experts(raw) > 0 and (i + 1) % step == 0


class QwenMoePlugin(ModelPlugin):
    """Qwen2-MoE / Qwen3-MoE decoder with optional shared expert."""

    def __init__(self, name: str, architectures: tuple[str, ...], qwen3: bool) -> None:
        self.name = name
        self.architectures = architectures
        self.qwen3 = qwen3

    def kv_cache_spec(self, spec, settings: RankSettings) -> dict:
        return decoder_kv_specs(spec, settings)

    def build_model(self, spec, settings: RankSettings):
        from tuner.model.simulate import layers as L
        from tuner.model.simulate.moe import FusedMoE, SparseMoeBlock, build_decoder, torch_dtype
        from tuner.memory.quant import scheme_for

        raw = spec.raw
        dtype = torch_dtype(settings.dtype)
        tp = settings.tensor_parallel_size
        quant = scheme_for(spec, settings)
        h = spec.hidden_size
        experts = num_experts(raw)
        top_k = int(raw.get("num_experts_per_tok") or 1)
        moe_i = int(raw.get("moe_intermediate_size") or spec.intermediate_size)
        shared_i = int(raw.get("shared_expert_intermediate_size") or 0)
        rope = L.RotaryEmbedding(spec.max_position_embeddings, spec.rotary_dim, dtype)

        def mlp(i: int, prefix: str):
            p = f"{prefix}.mlp"
            if not is_sparse_layer(raw, i):
                return L.GatedMLP(h, spec.intermediate_size // tp, dtype, compiled=settings.compiled, quant=quant, prefix=p)
            gate = L.Linear(h, experts, dtype, prefix=f"{p}.gate")  # quant_config=None in vLLM
            shared = shared_gate = None
            if shared_i > 0 or not self.qwen3:
                shared_gate = L.Linear(h, 1, dtype, prefix=f"{p}.shared_expert_gate")
            if shared_i > 0:
                shared = L.GatedMLP(h, shared_i // tp, dtype, compiled=settings.compiled, quant=quant,
                                    prefix=f"{p}.shared_expert")
            moe = FusedMoE(h, moe_i // tp, experts, top_k, dtype, quant=quant, prefix=f"{p}.experts",
                           compiled=settings.compiled, engine_version=settings.engine_version,
                           tensor_parallel_size=tp, reduce_results=False)
            block = SparseMoeBlock(gate, moe, shared_expert=shared,
                                   shared_expert_gate=shared_gate if shared is not None else None,
                                   tensor_parallel_size=tp)
            if shared is None and shared_gate is not None:
                block.unused_shared_expert_gate = shared_gate  # Qwen2-MoE creates it regardless
            return block

        qkv_bias = bool(raw.get("attention_bias", False)) if self.qwen3 else True
        return build_decoder(spec, settings, stage_layers(spec, settings), mlp_for_layer=mlp, rope=rope, quant=quant,
                             qkv_bias=qkv_bias, qk_norm=self.qwen3, lm_head_quant=True)


qwen2_moe = QwenMoePlugin("qwen_moe", ("Qwen2MoeForCausalLM",), qwen3=False)
qwen3_moe = QwenMoePlugin("qwen3_moe", ("Qwen3MoeForCausalLM",), qwen3=True)

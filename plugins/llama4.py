"""Llama-4 plugin (``Llama4ForConditionalGeneration``: Llama-4 Scout / Maverick).

Follows vllm/model_executor/models/llama4.py and mllama4.py (0.19.0). Text model per rank:
vocab-parallel embedding and LM head (vocab padded to 64, / tp), per layer fused QKV / o_proj
(no bias; KV heads ``max(1, kv // tp)``), weightless q/k L2 norm on RoPE layers, RMSNorms, one
shared rotary ``cos_sin_cache [max_position_embeddings, head_dim]`` (Scout's 10,485,760
positions make it 2.5 GiB in bf16: vLLM builds it from the config, not from ``max_model_len``), and
a feed-forward that is

- a MoE block on layers with ``(i + 1) % interleave_moe_layer_step == 0``: replicated 16-bit
  router ``[E, H]``, :class:`tuner.model.simulate.moe.FusedMoE` with ``E = num_local_experts`` experts of
  ``intermediate_size / tp`` (top-``num_experts_per_tok``, sigmoid routing) and a shared expert
  (gated MLP of ``intermediate_size / tp``) summed before one all-reduce;
- a dense gated MLP of ``intermediate_size_mlp / tp`` otherwise.

KV cache (0.19 ``Llama4Attention``): layers with ``no_rope_layers[i] == 0`` (every 4th layer,
``(i + 1) % no_rope_layer_interval == 0``, transformers ``Llama4TextConfig``) are global NoPE
layers -> ``FullAttentionSpec``; the others use chunked local attention over
``attention_chunk_size`` tokens -> ``ChunkedLocalAttentionSpec`` (vLLM 0.10+). Where the release
disables the hybrid KV cache manager for chunked local attention by default
(``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE`` = 0: read in 0.11.0; 1 in 0.19.0; the flip
is assumed at 0.12.0, unverified), and before 0.10, local layers are full attention in memory
terms and are emitted as ``FullAttentionSpec``.

Vision: ``Llama4VisionModel`` + ``Llama4MultiModalProjector`` (always 16-bit: vLLM passes
``quant_config=None``) and the V1 encoder profile from :mod:`tuner.model.simulate.vision` (kind
``llama4``: 17 tiles of 336² per dummy image, 2448 tokens per image).
"""

from __future__ import annotations

from tuner.memory.kvcache import ChunkedLocalAttentionSpec, FullAttentionSpec, dtype_bytes_for, kv_heads_per_rank
from tuner.model.plugin import ModelPlugin, RankSettings, stage_layers

#: First release whose default keeps chunked local attention in the hybrid KV cache manager.
HYBRID_CHUNKED_FROM = (0, 12, 0)


def _ver(v: str) -> tuple:
    parts = []
    for p in str(v).split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def no_rope_layers(spec) -> list[int]:
    """``no_rope_layers`` (1 = RoPE + chunked local attention, 0 = NoPE global layer)."""
    raw = spec.raw
    given = raw.get("no_rope_layers")
    if given:
        return [int(x) for x in given]
    interval = int(raw.get("no_rope_layer_interval") or 4)
    return [int((i + 1) % interval != 0) for i in range(spec.num_hidden_layers)]


def is_moe_layer(spec, i: int) -> bool:
    step = int(spec.raw.get("interleave_moe_layer_step") or 1)
    return step > 0 and (i + 1) % step == 0


class Llama4Plugin(ModelPlugin):
    """Llama-4 text (chunked local + global NoPE attention, interleaved MoE) + vision tower."""

    name = "llama4"
    architectures = ("Llama4ForConditionalGeneration",)

    def kv_cache_spec(self, spec, settings: RankSettings) -> dict:
        bs = settings.block_size or 16
        heads = kv_heads_per_rank(spec.num_key_value_heads, settings.tensor_parallel_size)
        dt = dtype_bytes_for(settings.kv_cache_dtype, settings.dtype)
        chunk = spec.raw.get("attention_chunk_size")
        v = _ver(settings.engine_version)
        local_spec = bool(chunk) and v >= HYBRID_CHUNKED_FROM
        nope = no_rope_layers(spec)
        out = {}
        for i in stage_layers(spec, settings):
            name = f"model.layers.{i}.self_attn.attn"
            if local_spec and nope[i] == 1:
                out[name] = ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=spec.head_dim,
                                                      dtype_bytes=dt, attention_chunk_size=int(chunk))
            else:
                out[name] = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=spec.head_dim, dtype_bytes=dt)
        return out

    def build_model(self, spec, settings: RankSettings):
        from tuner.model.simulate import layers as L
        from tuner.model.simulate.moe import FusedMoE, SparseMoeBlock, build_decoder, torch_dtype
        from tuner.memory.quant import scheme_for
        from tuner.model.simulate.vision import MultimodalCausalLM, VisionTower

        dtype = torch_dtype(settings.dtype)
        tp = settings.tensor_parallel_size
        quant = scheme_for(spec, settings)
        h = spec.hidden_size
        raw = spec.raw
        experts = int(raw.get("num_local_experts") or 16)
        top_k = int(raw.get("num_experts_per_tok") or 1)
        inter_moe = int(raw.get("intermediate_size") or spec.intermediate_size) // tp
        inter_mlp = int(raw.get("intermediate_size_mlp") or 2 * spec.intermediate_size) // tp
        rope = L.RotaryEmbedding(spec.max_position_embeddings, spec.rotary_dim, dtype)

        def mlp(i: int, prefix: str):
            pre = f"{prefix}.feed_forward"
            if not is_moe_layer(spec, i):
                return L.GatedMLP(h, inter_mlp, dtype, compiled=settings.compiled, quant=quant, prefix=pre)
            gate = L.Linear(h, experts, dtype, prefix=f"{pre}.router")
            fused = FusedMoE(h, inter_moe, experts, top_k, dtype, quant=quant, prefix=f"{pre}.experts",
                             compiled=settings.compiled, engine_version=settings.engine_version,
                             tensor_parallel_size=tp, reduce_results=False, global_num_experts=experts)
            shared = L.GatedMLP(h, inter_moe, dtype, compiled=settings.compiled, quant=quant, prefix=f"{pre}.shared_expert")
            return SparseMoeBlock(gate, fused, shared_expert=shared, tensor_parallel_size=tp)

        text = build_decoder(spec, settings, stage_layers(spec, settings), mlp_for_layer=mlp, rope=rope, quant=quant)
        v0 = settings.runs_attention
        vision = None
        if "vision_config" in spec.top and (settings.pp_rank == 0 or not v0):
            vision = VisionTower(spec.top, dtype, kind="llama4", tp=tp, quant=None,
                                 engine_version=settings.engine_version, v0=v0)
        return MultimodalCausalLM(text, vision, h, v0=v0)


plugin = Llama4Plugin()

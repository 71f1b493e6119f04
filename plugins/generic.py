"""Generic decoder plugin: dense pre-norm decoders with GQA attention and a gated MLP.

Serves Llama / CodeLlama / Llama-3.x, Mistral, Qwen2 / Qwen2.5 / Qwen3, Granite, InternLM-style
configs, and is the fallback (with a warning) for any standard decoder config. What it models per
rank (vLLM ``LlamaForCausalLM``, vllm/model_executor/models/llama.py): vocab-parallel embedding and
LM head (vocab padded to 64), fused QKV (KV heads ``max(1, kv // tp)``, replicated below tp),
rotary ``cos_sin_cache [max_position_embeddings, rotary_dim]`` in the model dtype, fused
gate_up/down MLP, RMSNorms; Qwen2 adds QKV bias, Qwen3 per-head q/k norms. KV cache: one
``FullAttentionSpec`` per layer (``SlidingWindowSpec`` when the config slides every layer).
"""

from __future__ import annotations

from tuner.memory.kvcache import FullAttentionSpec, SlidingWindowSpec, dtype_bytes_for, kv_heads_per_rank
from tuner.model.plugin import ModelPlugin, RankSettings, stage_layers

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def _uses_sliding_window(spec) -> int | None:
    raw = spec.raw
    w = spec.sliding_window
    if not w or raw.get("use_sliding_window") is False:
        return None
    if raw.get("layer_types"):
        return None  # interleaved patterns belong to specific plugins
    return int(w)


def decoder_kv_specs(spec, settings: RankSettings) -> dict:
    """KV specs of a standard decoder on one rank and PP stage: ``model.layers.i.self_attn.attn`` →
    :class:`FullAttentionSpec` (``max(1, kv_heads // tp)`` heads of ``head_dim``, the KV dtype's
    bytes, ``block_size`` or 16), or :class:`SlidingWindowSpec` when the config slides every layer."""
    bs = settings.block_size or 16
    heads = kv_heads_per_rank(spec.num_key_value_heads, settings.tensor_parallel_size)
    dt = dtype_bytes_for(settings.kv_cache_dtype, settings.dtype)
    window = _uses_sliding_window(spec)
    out = {}
    for i in stage_layers(spec, settings):
        name = f"model.layers.{i}.self_attn.attn"
        if window:
            out[name] = SlidingWindowSpec(block_size=bs, num_kv_heads=heads, head_size=spec.head_dim,
                                          dtype_bytes=dt, sliding_window=window)
        else:
            out[name] = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=spec.head_dim, dtype_bytes=dt)
    return out


#: The Llama-3 tokenizer's vocabulary (every Llama-3.x checkpoint).
LLAMA3_VOCAB_SIZE = 128256


def llama_ffn_size(hidden: int, multiplier: float = 1.3, multiple_of: int = 1024) -> int:
    """Meta's Llama MLP width for ``hidden`` (elements): ``multiplier · int(2·4·hidden/3)`` rounded
    up to ``multiple_of`` (meta-llama/llama-models ``FeedForward``; Llama-3 8B/70B values)."""
    width = int(2 * 4 * hidden / 3)
    width = int(multiplier * width)
    return -(-width // multiple_of) * multiple_of


#: Qwen2 / Qwen2.5 family shapes, keyed by (hidden_size, num_hidden_layers): (attention heads,
#: MLP width), from the published Qwen2.5 0.5B–72B configs (Qwen2 uses the same per size).
QWEN2_SHAPES = {
    (896, 24): (14, 4864), (1536, 28): (12, 8960), (2048, 36): (16, 11008), (3584, 28): (28, 18944),
    (5120, 48): (40, 13824), (5120, 64): (40, 27648), (8192, 80): (64, 29568),
}


def qwen2_defaults(text: dict) -> dict:
    """Defaults for a partial Qwen2-architecture config (keys the file lacks): heads and MLP width
    of the Qwen2.5 family member with the same hidden size and depth (:data:`QWEN2_SHAPES`; other
    shapes: 128-wide heads, no MLP default), 32768 positions, rope_theta 1e6, bfloat16 —
    derivatives such as Kimi-Dev-72B and DeepSeek-R1-Distill-Qwen keep the base model's shapes."""
    out: dict = {}
    h, n = text.get("hidden_size"), text.get("num_hidden_layers")
    heads, inter = QWEN2_SHAPES.get((h, n), (h // 128 if isinstance(h, int) and h % 128 == 0 else None, None))
    for key, value in (("num_attention_heads", heads), ("intermediate_size", inter), ("max_position_embeddings", 32768),
                       ("rope_theta", 1000000.0), ("torch_dtype", "bfloat16")):
        if value is not None and key not in text:
            out[key] = value
    return out


#: Architectures whose vLLM MLP keeps the ``gate_up`` output in a named local across
#: ``down_proj`` (``Qwen2MLP``, which qwen3.py imports as ``Qwen3MLP``; ``GraniteMLP``;
#: ``InternLM2MLP``; vllm/model_executor/models/*.py 0.6.4, 0.7.3, 0.8.4, 0.9.2, 0.10.1.1 read).
#: ``LlamaMLP`` (Llama, Mistral, Yi) rebinds ``x`` and frees it. Matters for eager profiles only
#: (:class:`tuner.model.simulate.layers.GatedMLP` ``holds_gate_up``).
MLP_HOLDS_GATE_UP = frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM", "GraniteForCausalLM", "InternLM2ForCausalLM"})


def rope_cache_rows(spec) -> int:
    """Rows of vLLM's ``cos_sin_cache`` (vllm/model_executor/layers/rotary_embedding.py ``get_rope``,
    0.6.4 / 0.8.4 read): ``yarn`` → ``original_max_position_embeddings × factor``
    (``YaRNScalingRotaryEmbedding``); ``linear`` and ``dynamic`` → ``max_position × factor``
    (``LinearScalingRotaryEmbedding``, ``DynamicNTKScalingRotaryEmbedding``); the default and
    ``llama3`` → ``max_position_embeddings``."""
    rp = spec.raw.get("rope_scaling") or spec.raw.get("rope_parameters") or {}
    kind = (rp.get("rope_type") or rp.get("type") or "default") if isinstance(rp, dict) else "default"
    try:
        factor = float(rp.get("factor") or 1.0)
    except (TypeError, ValueError, AttributeError):
        factor = 1.0
    if kind == "yarn":
        base = int(rp.get("original_max_position_embeddings") or spec.max_position_embeddings)
        return int(base * factor)
    if kind in ("linear", "dynamic"):
        return int(spec.max_position_embeddings * factor)
    return spec.max_position_embeddings


class GenericDecoderPlugin(ModelPlugin):
    """Dense decoder (Llama family and look-alikes)."""

    name = "generic"
    architectures = (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "GraniteForCausalLM",
        "InternLM2ForCausalLM",
        "YiForCausalLM",
    )

    # -- partial configs ---------------------------------------------------------------------
    def config_defaults(self, top: dict) -> dict:
        """Family defaults for a partial Llama config (keys the file lacks; the file wins).

        - ``intermediate_size``: Meta's Llama FFN rule (llama/model.py ``FeedForward``):
          ``ffn_dim_multiplier · 2·4H/3`` rounded up to ``multiple_of``, with the Llama-3 values
          1.3 and 1024 (8B: 14336, 70B: 28672) — transformers' class default (11008) belongs to
          Llama-2-7B and would halve a 70B's MLP.
        - With the Llama-3 tokenizer (``vocab_size`` 128256): ``max_position_embeddings`` 131072,
          ``rope_theta`` 500000 and bfloat16 weights, as every Llama-3.1+ checkpoint ships.
        """
        text = top.get("text_config") if isinstance(top.get("text_config"), dict) else top
        model_type = text.get("model_type") or top.get("model_type")
        if model_type == "qwen2":
            return qwen2_defaults(text)
        if model_type != "llama":
            return {}
        out: dict = {}
        hidden = text.get("hidden_size")
        if "intermediate_size" not in text and isinstance(hidden, int) and hidden > 0:
            out["intermediate_size"] = llama_ffn_size(hidden)
        if text.get("vocab_size") == LLAMA3_VOCAB_SIZE:
            out.update({k: v for k, v in (("max_position_embeddings", 131072), ("rope_theta", 500000.0),
                                          ("torch_dtype", "bfloat16")) if k not in text})
        return out

    # -- KV cache ----------------------------------------------------------------------------
    def kv_cache_spec(self, spec, settings: RankSettings) -> dict:
        return decoder_kv_specs(spec, settings)

    # -- module ------------------------------------------------------------------------------
    def qkv_bias(self, spec) -> bool:
        return bool(spec.raw.get("attention_bias") or spec.raw.get("qkv_bias") or spec.model_type == "qwen2")

    def build_model(self, spec, settings: RankSettings):
        import torch

        from tuner.model.simulate import layers as L
        from tuner.memory.quant import scheme_for

        quant = scheme_for(spec, settings)
        dtype = getattr(torch, _DTYPES.get(settings.dtype, "bfloat16"))
        tp = settings.tensor_parallel_size
        pp, rank = settings.pipeline_parallel_size, settings.pp_rank
        h = spec.hidden_size
        heads = spec.num_attention_heads // tp
        kv = kv_heads_per_rank(spec.num_key_value_heads, tp)
        inter = spec.intermediate_size // tp
        rope = L.RotaryEmbedding(rope_cache_rows(spec), spec.rotary_dim, dtype)
        holds = bool(set(spec.architectures or ()) & MLP_HOLDS_GATE_UP)
        layers = []
        for i in stage_layers(spec, settings):
            attn = L.Attention(h, heads, kv, spec.head_dim, dtype, rope, qkv_bias=self.qkv_bias(spec),
                               compiled=settings.compiled, runs_attention=settings.runs_attention,
                               quant=quant, prefix=f"model.layers.{i}.self_attn")
            if spec.model_type == "qwen3":
                attn.q_norm = L.RMSNorm(spec.head_dim, dtype)
                attn.k_norm = L.RMSNorm(spec.head_dim, dtype)
            mlp = L.GatedMLP(h, inter, dtype, compiled=settings.compiled, bias=bool(spec.raw.get("mlp_bias")),
                             quant=quant, prefix=f"model.layers.{i}.mlp", holds_gate_up=holds)
            layers.append(L.DecoderLayer(attn, mlp, h, dtype))
        first, last = rank == 0, rank == pp - 1
        embed = L.VocabEmbedding(spec.vocab_size, h, dtype, tp) if (first or (last and spec.tie_word_embeddings)) else None
        lm_head = None
        if last:
            tied = embed if spec.tie_word_embeddings else None
            lm_head = L.LMHead(spec.vocab_size, h, dtype, tp, tied_to=tied, quant=quant, prefix="lm_head")
        norm = L.RMSNorm(h, dtype) if last else None
        model = L.CausalLM(embed, layers, norm, lm_head, extra={"rotary_emb": rope})
        return model


plugin = GenericDecoderPlugin()

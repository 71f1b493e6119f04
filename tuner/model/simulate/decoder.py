"""The pre-norm decoder builder (torch): embedding, decoder layers, final norm and LM head of one
rank and pipeline stage, with the MLP of each layer supplied by the plugin.

What it builds follows vLLM ``LlamaForCausalLM`` (vllm/model_executor/models/llama.py, 0.6–0.19):
the vocab-parallel embedding on the first PP rank (and on the last when the embeddings are tied),
per layer :class:`tuner.model.simulate.layers.Attention` (fused QKV, ``max(1, kv_heads // tp)`` KV
heads) plus the plugin's MLP inside a :class:`tuner.model.simulate.layers.DecoderLayer`, and on the last
PP rank the final RMSNorm and the LM head. Dense (``GatedMLP``) and MoE (``SparseMoeBlock``)
families use it alike; it used to live in :mod:`tuner.model.simulate.moe`, which still re-exports it.
"""

from __future__ import annotations

import torch
from torch import nn


def torch_dtype(name: str):
    """``"bfloat16"`` → ``torch.bfloat16`` (bfloat16 for anything unknown)."""
    return getattr(torch, name) if name in ("bfloat16", "float16", "float32") else torch.bfloat16


def build_decoder(spec, settings, layer_indices, *, mlp_for_layer, rope: nn.Module | None, quant=None,
                  attn_name: str = "self_attn", qkv_bias: bool = False, o_bias: bool = False,
                  qk_norm: bool = False, sinks: bool = False, lm_head_quant: bool = False):
    """A pre-norm decoder of one rank and pipeline stage whose MLPs come from ``mlp_for_layer``.

    Args:
        spec: :class:`tuner.model.modelspec.ModelSpec`.
        settings: :class:`tuner.model.plugin.RankSettings`.
        layer_indices: the stage's global layer indices.
        mlp_for_layer: ``(layer_index, prefix) -> nn.Module`` (``prefix`` = ``model.layers.<i>``).
        rope: the shared rotary module (its ``cos_sin_cache`` counted once), or None.
        quant: the checkpoint's quantization scheme, handed to every Linear with its vLLM prefix.
        attn_name: the attention submodule's vLLM name (``self_attn``; gpt-oss ``attn``).
        qkv_bias, o_bias: projection biases; qk_norm: per-head q/k RMSNorm ``[head_dim]`` (Qwen3);
        sinks: per-head attention-sink parameter ``[heads / tp]`` in the model dtype (gpt-oss).
        lm_head_quant: the vLLM model passes its quant config to ``ParallelLMHead`` (qwen2_moe.py,
            qwen3_moe.py, mixtral.py, minimax_m2.py in 0.24; not llama4.py, gpt_oss.py): a scheme
            that quantizes the head (ModelOpt from 0.23, GPTQ ``lm_head: true``) registers it so.

    Embedding / LM head / final norm follow vLLM's PP rules as in :mod:`tuner.plugins.generic`.
    """
    from tuner.memory.kvcache import kv_heads_per_rank
    from tuner.model.simulate import layers as L

    dtype = torch_dtype(settings.dtype)
    tp = settings.tensor_parallel_size
    pp, rank = settings.pipeline_parallel_size, settings.pp_rank
    h = spec.hidden_size
    heads = spec.num_attention_heads // tp
    kv = kv_heads_per_rank(spec.num_key_value_heads, tp)
    layers = []
    for i in layer_indices:
        prefix = f"model.layers.{i}"
        attn = L.Attention(h, heads, kv, spec.head_dim, dtype, rope, qkv_bias=qkv_bias, o_bias=o_bias,
                           compiled=settings.compiled, runs_attention=settings.runs_attention, quant=quant,
                           prefix=f"{prefix}.{attn_name}")
        if qk_norm:
            attn.q_norm = L.RMSNorm(spec.head_dim, dtype)
            attn.k_norm = L.RMSNorm(spec.head_dim, dtype)
        if sinks:
            attn.sinks = L._param(heads, dtype=dtype)
        layers.append(L.DecoderLayer(attn, mlp_for_layer(i, prefix), h, dtype))
    first, last = rank == 0, rank == pp - 1
    tie = bool(spec.tie_word_embeddings)
    embed = L.VocabEmbedding(spec.vocab_size, h, dtype, tp) if (first or (last and tie)) else None
    lm_head = None
    if last:
        lm_head = L.LMHead(spec.vocab_size, h, dtype, tp, tied_to=embed if tie else None,
                           quant=quant if lm_head_quant else None, prefix="lm_head")
    norm = L.RMSNorm(h, dtype) if last else None
    return L.CausalLM(embed, layers, norm, lm_head, extra={"rotary_emb": rope} if rope is not None else None)

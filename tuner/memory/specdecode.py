"""Speculative decoding's memory on the target's ranks (pure: no torch, no I/O).

What a drop's ``speculative_config`` adds besides the CUDA-graph capture sizes
(:func:`tuner.memory.budget.cudagraph_capture_sizes`): for ``mtp`` the drafter is the checkpoint's own
multi-token-prediction layers, loaded into the same workers (vllm/v1/spec_decode/eagle.py
``EagleProposer.load_model``; the MTP models in vllm/model_executor/models/*_mtp.py). Their
attention layers get KV cache like the target's (``GPUModelRunner.get_kv_cache_spec`` walks every
``Attention`` layer of the runner, drafter included, vllm/v1/worker/gpu_model_runner.py), and
their weights are part of "Model loading took". n-gram and suffix decoding have no model.

Drafters from another checkpoint (``draft_model``, ``eagle``, ``eagle3``, ``dflash``) are sized
from that checkpoint's config.json (the drop's ``speculative_config.model``), read in the 0.20.1
and 0.24 wheels: :func:`checkpoint_drafter_weights_bytes` (their weights on one rank, in the
target's dtype: ``SpeculativeConfig`` builds the draft ``ModelConfig`` with the target's dtype)
and :func:`checkpoint_drafter_kv_specs` (one full-attention KV layer per drafter decoder layer,
of the drafter's own KV heads and head size, at the target's attention block size:
``SpecDecodeBaseProposer.load_model`` collects the attention layers the drafter adds and
``GPUModelRunner.get_kv_cache_spec`` gives each its spec; a geometry other than the target's is
its own KV-cache group, vllm/v1/core/kv_cache_utils.py ``_get_kv_cache_groups_uniform_page_size``).
``medusa`` / ``mlp_speculator`` heads are not modelled (the job warns).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    from tuner.memory.kvcache import FullAttentionSpec, MLAAttentionSpec

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
    from tuner.memory.kvcache import MambaSpec

    if num_speculative_tokens <= 0:
        return kv_specs
    return tuple({name: (replace(s, num_speculative_blocks=num_speculative_tokens) if isinstance(s, MambaSpec) else s)
                  for name, s in specs.items()} for specs in kv_specs)


#: A drafter ``model`` given without ``method`` (vllm/config/speculative.py ``SpeculativeConfig.__post_init__``):
#: from 0.17.0 vLLM takes it as ``draft_model`` ("infer method from user args") before the name/config
#: detection below; 0.15.0–0.16.x refuse it ("Unsupported speculative method: 'None'"); before 0.15 a
#: model the detection does not place is refused as an unsupported draft model.
DRAFT_MODEL_BY_DEFAULT_FROM = (0, 17, 0)
UNSUPPORTED_NONE_FROM = (0, 15, 0)


def inferred_speculative_method(model: str | None, *, draft_model_type: str | None, version: tuple) -> str:
    """The ``method`` vLLM gives a ``--speculative-config`` without one, as
    ``SpeculativeConfig.__post_init__`` does in 0.10–0.34 (vllm/config/speculative.py): ``ngram`` for
    the model ``ngram``/``[ngram]``; else, from the drafter: ``eagle`` when its name holds
    ``eagle-``, ``eagle3`` when it holds ``eagle3``, ``medusa`` / ``mlp_speculator`` by its config's
    ``model_type``, ``mtp`` for an MTP ``model_type`` (``*_mtp``); anything else is ``draft_model``
    from 0.17 (:data:`DRAFT_MODEL_BY_DEFAULT_FROM`) and refused before.

    Raises:
        ValueError: vLLM's message where the release refuses it (no model; an undetected drafter
            before 0.17).
    """
    if model is None:
        raise ValueError("num_speculative_tokens was provided but without speculative model.")
    if model in ("ngram", "[ngram]"):
        return "ngram"
    name, mt = model.lower(), (draft_model_type or "").lower()
    if "eagle-" in name:
        return "eagle"
    if "eagle3" in name:
        return "eagle3"
    if mt in ("medusa", "mlp_speculator"):
        return mt
    if mt == "mtp" or mt.endswith("_mtp"):
        return "mtp"
    if tuple(version) >= DRAFT_MODEL_BY_DEFAULT_FROM:
        return "draft_model"
    if tuple(version) >= UNSUPPORTED_NONE_FROM:
        raise ValueError("Unsupported speculative method: 'None'")
    raise ValueError("Speculative decoding with draft model is not supported yet. Please consider using other "
                     "speculative decoding methods such as ngram, medusa, eagle, or mtp.")


#: Methods whose drafter is another checkpoint sized from its config.json (:func:`checkpoint_drafter_weights_bytes`).
CHECKPOINT_DRAFTERS = ("draft_model", "eagle", "eagle3", "dflash")


def _pad_vocab(v: int) -> int:
    """``pad_vocab_size(v, 64)`` (vllm/model_executor/layers/vocab_parallel_embedding.py)."""
    return -(-int(v) // 64) * 64


def _text(cfg: dict) -> dict:
    cfg = cfg or {}
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def drafter_geometry(draft_config: dict) -> dict:
    """The drafter's decoder shape from its config.json: ``layers``, ``hidden``, ``heads``,
    ``kv_heads``, ``head_dim``, ``intermediate``, ``vocab``, ``bias`` (attention bias).

    Raises:
        ValueError: a size the config lacks or that is not a positive integer (names the key).
    """
    t = _text(draft_config)

    def need(key: str, default=None) -> int:
        v = t.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"drafter config.json: {key} must be a positive integer, not {v!r}")
        return int(v)

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    return {"layers": need("num_hidden_layers"), "hidden": hidden, "heads": heads,
            "kv_heads": need("num_key_value_heads", heads),
            "head_dim": need("head_dim", hidden // heads if hidden % heads == 0 else None),
            "intermediate": need("intermediate_size"), "vocab": need("vocab_size"),
            "bias": bool(t.get("attention_bias", False))}


def _decoder_layer_bytes(g: dict, tp: int, dtype_bytes: int, scheme, layer: int, *, qkv_input: int | None = None,
                         qk_norm: bool = False) -> int:
    """One Llama / Qwen3 decoder layer on one rank (bytes): ``QKVParallelLinear`` (KV heads
    replicated when fewer than ranks), ``RowParallelLinear`` o, the gated MLP
    ``MergedColumnParallelLinear`` gate_up + ``RowParallelLinear`` down (``3·H·I/tp``), each in the
    layout the checkpoint's quantization keeps after loading (``scheme``: a
    :class:`tuner.memory.quant.QuantScheme`, weights and scales; None = ``dtype_bytes``), plus
    biases, two RMSNorms (+ per-head q/k norms for Qwen3) in the model dtype."""
    from tuner.memory.quant import layout_bytes

    h, hd = g["hidden"], g["head_dim"]
    q = g["heads"] * hd // tp
    kv = max(1, g["kv_heads"] // tp) * hd
    inp = qkv_input or h
    i = g["intermediate"] // tp
    dtype = {1: "float8_e4m3fn", 4: "float32"}.get(dtype_bytes, "bfloat16")
    total = 0
    for name, fin, fout in (("self_attn.qkv_proj", inp, q + 2 * kv), ("self_attn.o_proj", q, h),
                            ("mlp.gate_up_proj", h, 2 * i), ("mlp.down_proj", i, h)):
        lay = scheme.linear_layout(fin, fout, dtype, f"model.layers.{layer}.{name}") if scheme is not None else None
        total += layout_bytes(lay[0]) if lay is not None else fin * fout * dtype_bytes
    other = ((q + 2 * kv) + h if g["bias"] else 0) + 2 * h + (2 * hd if qk_norm else 0)
    return total + other * dtype_bytes


def checkpoint_drafter_weights_bytes(method: str, draft_config: dict, target_config: dict, *,
                                     tensor_parallel_size: int, dtype_bytes: int = 2, settings=None) -> int:
    """Weights of another checkpoint's drafter on one rank (bytes), as vLLM builds it:

    * ``draft_model`` (vllm/v1/spec_decode/draft_model.py): the whole dense model, its own
      embedding and LM head (``_maybe_share_embeddings`` / ``_maybe_share_lm_head`` do nothing),
      the head tied when ``tie_word_embeddings``; vocab padded to 64 and split over TP.
    * ``eagle`` (vllm/model_executor/models/llama_eagle.py): the decoder layers and the
      ``ReplicatedLinear`` ``fc`` ``2H → H`` on every rank; embedding and LM head are the target's
      (EAGLE checkpoints carry none or an identical copy: ``llm_base_proposer`` shares them).
    * ``eagle3`` (llama_eagle3.py): the first layer's QKV reads ``2H``; ``fc`` ``H_t·n_aux → H``
      replicated (``num_aux_hidden_states`` or the aux layer ids, default 3); its own LM head of
      ``draft_vocab_size`` (split over TP) and the int64 ``draft_id_to_target_id`` map when the
      draft vocabulary differs from the target's; embedding shared.
    * ``dflash`` (qwen3_dflash.py ``DFlashQwen3Model``): Qwen3 decoder layers (per-head q/k
      norms), ``hidden_norm`` and ``norm``, ``fc`` ``H_t·n → H`` replicated (``n`` = the
      ``dflash_config.target_layer_ids``, else the drafter's layer count), and the fused K/V copy
      ``_build_fused_kv_buffers`` concatenates from every layer (``layers·2·kv/tp·d·H``);
      embedding and LM head shared unless ``draft_vocab_size`` differs from the target's.

    The decoder layers' linear weights take the layout of the drafter checkpoint's own
    ``quantization_config`` (vLLM builds the draft model config from the drafter's checkpoint,
    vllm/config/speculative.py, so a w8a8 drafter loads in 8 bits): the same
    :func:`tuner.memory.quant.scheme_for` layouts, scales included, that weigh a target
    (``settings``: its compute capability and release, its ``quantization`` the speculative
    config's). Embeddings, LM head, ``fc`` and norms stay in ``dtype_bytes``.

    Raises:
        ValueError: ``method`` not in :data:`CHECKPOINT_DRAFTERS`, or a size the config lacks.
    """
    if method not in CHECKPOINT_DRAFTERS:
        raise ValueError(f"no checkpoint drafter for method {method!r}")
    tp = max(1, int(tensor_parallel_size))
    g = drafter_geometry(draft_config)
    t, tt = _text(draft_config), _text(target_config)
    h, n = g["hidden"], g["layers"]
    target_hidden = int(t.get("target_hidden_size") or tt.get("hidden_size") or h)
    target_vocab = int(tt.get("vocab_size") or g["vocab"])
    from types import SimpleNamespace

    from tuner.memory.quant import scheme_for

    qc = draft_config.get("quantization_config") or t.get("quantization_config")
    scheme = scheme_for(SimpleNamespace(quantization_config=qc, top=draft_config), settings) if qc else None
    def layers(start: int, stop: int, **kw) -> float:  # decoder layers [start, stop), in dtype-byte units
        return sum(_decoder_layer_bytes(g, tp, dtype_bytes, scheme, i, **kw) for i in range(start, stop)) / dtype_bytes

    params = 0.0
    if method == "draft_model":
        emb = _pad_vocab(g["vocab"]) * h // tp
        params = emb * (1 if draft_config.get("tie_word_embeddings", t.get("tie_word_embeddings")) else 2)
        params += layers(0, n) + h
    elif method == "eagle":
        params = layers(0, n) + 2 * h * h
    elif method == "eagle3":
        params = layers(0, 1, qkv_input=2 * h) + layers(1, n) + h
        ec = t.get("eagle_config") or {}
        n_aux = t.get("num_aux_hidden_states") or len(ec.get("eagle_aux_hidden_state_layer_ids") or []) or 3
        params += target_hidden * int(n_aux) * h
        dv = int(t.get("draft_vocab_size") or g["vocab"])
        if dv != target_vocab:
            params += _pad_vocab(dv) * h // tp
            return int(params * dtype_bytes + 8 * dv)
    else:  # dflash
        dc = {**(t.get("eagle_config") or {}), **(t.get("dflash_config") or {})}
        feats = len(dc.get("target_layer_ids") or dc.get("layer_ids") or []) or n
        params = layers(0, n, qk_norm=True) + 2 * h
        if dc.get("use_aux_hidden_state", True):
            params += target_hidden * feats * h
        params += n * 2 * max(1, g["kv_heads"] // tp) * g["head_dim"] * h  # the fused K/V copy
        dv = int(t.get("draft_vocab_size") or g["vocab"])
        if dv != target_vocab:
            params += _pad_vocab(dv) * h // tp
            return int(params * dtype_bytes + 8 * dv)
    return int(params * dtype_bytes)


def checkpoint_drafter_kv_specs(draft_config: dict, stage_specs: dict, *, tensor_parallel_size: int,
                                kv_dtype_bytes: int, first_layer_index: int) -> dict:
    """One ``FullAttentionSpec`` per drafter decoder layer (the drafter's KV heads per rank and
    head size, the target's attention block size: vLLM gives every attention layer
    ``cache_config.block_size``, which a hybrid target has already raised), named
    ``model.layers.{first_layer_index + i}.self_attn.attn`` as the drafters number their layers
    after the target's (``start_layer_id``)."""
    from tuner.memory.kvcache import FullAttentionSpec, kv_heads_per_rank

    g = drafter_geometry(draft_config)
    bs = next((s.block_size for s in stage_specs.values() if type(s) is FullAttentionSpec), 16)
    kv = kv_heads_per_rank(g["kv_heads"], tensor_parallel_size)
    return {f"model.layers.{first_layer_index + i}.self_attn.attn": FullAttentionSpec(bs, kv, g["head_dim"], kv_dtype_bytes)
            for i in range(g["layers"])}


def aux_hidden_state_layers(method: str, draft_config: dict) -> int:
    """Target layers whose hidden states an EAGLE3 / DFlash drafter reads (0 for other methods):
    vLLM asks the target for them (``use_aux_hidden_state_outputs``) and each is a fresh
    ``hidden + residual`` ``[N, H]`` tensor, alive through the profile run's forward and the
    drafter's ``dummy_run`` (vllm/v1/worker/gpu_model_runner.py ``_dummy_run``,
    ``_get_eagle3_aux_layers_from_config``, 0.24): the config's
    ``eagle_aux_hidden_state_layer_ids``, else ``dflash_config.target_layer_ids``, else
    ``eagle_config``'s ids, else the model's default ``(2, L // 2, L − 3)``; none for an EAGLE3
    drafter with ``use_aux_hidden_state`` false."""
    if method not in ("eagle3", "dflash"):
        return 0
    t = _text(draft_config)
    ec = t.get("eagle_config") if isinstance(t.get("eagle_config"), dict) else {}
    dc = t.get("dflash_config") if isinstance(t.get("dflash_config"), dict) else {}
    if method == "eagle3" and ec.get("use_aux_hidden_state") is False:
        return 0
    ids = (t.get("eagle_aux_hidden_state_layer_ids") or ec.get("eagle_aux_hidden_state_layer_ids")
           or dc.get("target_layer_ids"))
    return len(ids) if isinstance(ids, (list, tuple)) and ids else 3


def quantized_param_bytes(quantization_config: dict | None, dtype_bytes: int) -> float:
    """Bytes per weight of a quantized checkpoint's linear layers (scales not counted): fp8
    (``quant_method`` fp8 / fbgemm_fp8, compressed-tensors ``float`` 8-bit) 1, 4-bit methods
    (``bits`` 4: GPTQ / AWQ / AutoRound, mxfp4, nvfp4 / modelopt_fp4) 0.5, else the dtype's."""
    q = quantization_config or {}
    method = str(q.get("quant_method") or "").lower()
    bits = q.get("bits") or q.get("w_bit")
    if method in ("mxfp4", "modelopt_fp4", "nvfp4") or bits == 4:
        return 0.5
    if "fp8" in method or method == "modelopt":
        return 1.0
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        nb = {(g.get("weights") or {}).get("num_bits") for g in groups.values() if isinstance(g, dict)}
        if nb == {4}:
            return 0.5
        if nb == {8}:
            return 1.0
    return float(dtype_bytes)


def mtp_moe_layer_weights_bytes(text_config: dict, *, tensor_parallel_size: int, data_parallel_size: int = 1,
                                enable_expert_parallel: bool = False, dtype_bytes: int = 2,
                                quantization_config: dict | None = None) -> int:
    """Weights of the MTP block of a MoE decoder on one rank (bytes), per MTP layer a decoder
    layer of the target's MoE kind, loaded with the target's quantization:

    * experts (FusedMoE ``w13`` ``2·I`` + ``w2`` ``I`` per expert and ``H``): the rank's share by
      :func:`tuner.memory.budget.moe_rank_shape` (TP-sliced over dp × tp, or whole experts with expert
      parallelism), in the checkpoint's weight bytes (:func:`quantized_param_bytes`);
    * shared experts (``n_shared_experts · moe_intermediate_size``, or Qwen3-Next's
      ``shared_expert_intermediate_size`` + its 1-wide gate) TP-sharded; the router ``E × H`` and
      DeepSeek's ``e_score_correction_bias`` replicated, unquantized;
    * attention: MLA (``kv_lora_rank``: fused ``q_a``/``kv_a`` replicated, ``q_b``/``kv_b``/``o``
      sharded; vllm/model_executor/models/deepseek_v2.py) or GQA (gated q for Qwen3-Next);
    * the block's ``eh_proj`` / ``fc`` ``2H → H`` in the model dtype: a plain ``nn.Linear`` on every rank for
      DeepSeek / GLM (deepseek_mtp.py, glm4_moe_mtp.py), ``ColumnParallelLinear`` for Qwen3-Next /
      Qwen3.5 (qwen3_next_mtp.py); embeddings and LM head are the target's."""
    from tuner.memory.budget import moe_rank_shape
    from tuner.memory.eras import NUM_EXPERTS_KEYS

    t = text_config or {}
    tp = max(1, int(tensor_parallel_size))
    h = int(t.get("hidden_size") or 0)
    e = next((int(t[k]) for k in NUM_EXPERTS_KEYS if isinstance(t.get(k), int) and t[k] > 0), 0)
    moe_i = int(t.get("moe_intermediate_size") or t.get("intermediate_size") or 0)
    wq = quantized_param_bytes(quantization_config, dtype_bytes)
    here, i_rank = moe_rank_shape(e, moe_i, tensor_parallel_size=tp, data_parallel_size=data_parallel_size,
                                  enable_expert_parallel=enable_expert_parallel)
    experts = here * 3 * h * i_rank * wq
    shared_i = int(t.get("shared_expert_intermediate_size") or (t.get("n_shared_experts") or 0) * moe_i)
    shared = 3 * h * shared_i // tp * wq + (h if t.get("shared_expert_intermediate_size") else 0) * dtype_bytes
    router = e * h * dtype_bytes + (4 * e if str(t.get("topk_method") or "") == "noaux_tc" else 0)
    heads = int(t.get("num_attention_heads") or 1)
    if t.get("kv_lora_rank"):
        nope, rope = int(t.get("qk_nope_head_dim") or 0), int(t.get("qk_rope_head_dim") or 0)
        v, kv_lora, q_lora = int(t.get("v_head_dim") or 0), int(t["kv_lora_rank"]), int(t.get("q_lora_rank") or 0)
        qh = heads * (nope + rope) // tp
        attn = (h * (q_lora + kv_lora + rope) + q_lora * qh if q_lora else h * (kv_lora + rope) + h * qh) \
            + kv_lora * heads * (nope + v) // tp + heads * v * h // tp
    else:
        kvh = int(t.get("num_key_value_heads") or heads)
        hd = int(t.get("head_dim") or (h // heads))
        gated = 2 if t.get("attn_output_gate") or str(t.get("model_type", "")).startswith(("qwen3_next", "qwen3_5")) else 1
        attn = h * (heads * hd * gated // tp + 2 * max(1, kvh // tp) * hd) + heads * hd * h // tp
    replicated_fc = str(t.get("model_type", "")).startswith(("deepseek", "glm", "kimi"))
    fc = 2 * h * h // (1 if replicated_fc else tp)
    n = mtp_num_layers(t)
    return int(n * (experts + shared + attn * wq + router + fc * dtype_bytes))


# --- the drafter's own profile pass and CUDA-graph captures ------------------------------------

#: First V1 release whose profile run runs the drafter (vllm/v1/worker/gpu_model_runner.py
#: ``_dummy_run``: after the target's forward, ``self.drafter.dummy_run(num_tokens)`` for
#: ``use_eagle()`` methods: eagle, eagle3 and MTP from 0.9.0 (0.8.4 has none); the
#: ``DraftModelProposer`` and ``DFlashProposer`` from 0.20.0, the first read that has them;
#: Model Runner V2 (0.33 ``vllm/v1/worker/gpu/model_runner.py``) runs the speculator's
#: ``propose(dummy_run=True)``, a draft prefill over the same tokens).
DRAFTER_PROFILE_SINCE = {"eagle": (0, 9, 0), "eagle3": (0, 9, 0), "mtp": (0, 9, 0),
                         "draft_model": (0, 20, 0), "dflash": (0, 20, 0)}

#: First release read whose DFlash context-KV precompute frees the normed input and the flat
#: projection before the K norm (vllm/model_executor/models/qwen3_dflash.py
#: ``_project_context_kv``: 0.26 and 0.28 have it, 0.20.0–0.24 keep every buffer alive).
DFLASH_SPLIT_PROJECTION_SINCE = (0, 26, 0)


@dataclass(frozen=True)
class DrafterPass:
    """The drafter's geometry on one rank, as its profile pass and graph captures see it.

    ``fc_input`` is the width the drafter's ``fc`` / ``eh_proj`` reads before its first layer
    (``2H`` for EAGLE / MTP, 0 for a draft model; DFlash reads its context states without it in
    the dummy run). ``kv_layers`` is the number of KV specs it adds on the last stage (not the
    target's layers in the CUDA-graph fit). MoE MTP layers carry ``moe_topk`` and the rank's
    expert width ``moe_intermediate``; ``shared_intermediate`` a shared expert's."""

    method: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tensor_parallel_size: int = 1
    dtype_bytes: int = 2
    target_hidden: int = 0
    fc_input: int = 0
    q_mult: int = 1
    kv_layers: int = 0
    num_speculative_tokens: int = 0
    moe_topk: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0


def drafter_layer_peak_bytes(p: DrafterPass, n_tokens: int) -> int:
    """One drafter decoder layer's transient peak over ``n_tokens`` (bytes, one rank): the
    residual and hidden ``2·N·H`` alive through the layer, plus the larger of the attention
    phase (``QKVParallelLinear`` output ``(q·g + 2·kv)·d``, the attention output ``q·d`` and
    ``o_proj``'s ``H``; ``g`` 2 for a gated q) and the MLP phase (``gate_up`` ``2I``,
    ``SiluAndMul`` ``I``, ``down_proj`` ``H``; a FusedMoE layer's ``intermediate_cache1..3``
    ``topk·(2I + I + H)`` per token plus a shared expert's ``3I``), widths per rank
    (vllm/model_executor/models/llama.py / qwen3.py / qwen2_moe.py,
    layers/fused_moe/fused_moe.py)."""
    tp = max(1, p.tensor_parallel_size)
    h, hd = p.hidden, p.head_dim
    q = p.heads // tp * hd
    kv = max(1, p.kv_heads // tp) * hd
    attn = q * p.q_mult + 2 * kv + q + h
    if p.moe_topk:
        mlp = p.moe_topk * (3 * p.moe_intermediate + h) + 3 * p.shared_intermediate // tp
    else:
        mlp = 3 * p.intermediate // tp + h
    return int(n_tokens) * p.dtype_bytes * (2 * h + max(attn, mlp))


def dflash_context_kv_peak_bytes(p: DrafterPass, n_tokens: int, version: tuple) -> int:
    """DFlash's context-KV precompute over ``n_tokens`` context states (bytes, one rank):
    ``precompute_and_store_context_kv`` (vllm/model_executor/models/qwen3_dflash.py) norms the
    states (``N·H``), runs one fused K/V GEMM for every layer (``F = N·L·2·kv·d``), copies it
    layer-major (``.contiguous()``, another ``F``), norms K (``F / 2``) and repeats the
    positions ``L`` times (int64). Before :data:`DFLASH_SPLIT_PROJECTION_SINCE` all are alive
    together; from it ``_project_context_kv`` returns K/V only, so the peak is the larger of
    ``N·H + 2F`` and ``F + F/2`` + positions."""
    tp = max(1, p.tensor_parallel_size)
    n, d = int(n_tokens), p.dtype_bytes
    f = n * p.layers * 2 * max(1, p.kv_heads // tp) * p.head_dim * d
    normed, k_normed, positions = n * p.hidden * d, f // 2, 8 * n * p.layers
    if version >= DFLASH_SPLIT_PROJECTION_SINCE:
        return max(normed + 2 * f, f + k_normed + positions)
    return normed + 2 * f + k_normed + positions


def drafter_runs_in_profile(method: str, version: tuple) -> bool:
    """The release's profile run runs this drafter's forward (:data:`DRAFTER_PROFILE_SINCE`)."""
    since = DRAFTER_PROFILE_SINCE.get(method)
    return since is not None and version >= since


def drafter_forward_peak_bytes(p: DrafterPass, n_tokens: int, max_num_seqs: int, version: tuple) -> int:
    """The drafter's own transient peak in the profile run's ``dummy_run`` (bytes, one rank; 0
    where the release does not run it, :func:`drafter_runs_in_profile`).

    EAGLE / EAGLE3 / MTP / draft model (vllm/v1/spec_decode/eagle.py 0.9–0.14,
    llm_base_proposer.py ``dummy_run`` 0.20+): ``self.model(input_ids[:N], positions,
    hidden_states[:N])`` over the profile's ``N`` tokens, one pass at a time (each pass's
    outputs are dropped before the next): the larger of the input step (embedding ``H``, the
    ``fc`` input ``2H`` and its output ``H``) and one decoder layer
    (:func:`drafter_layer_peak_bytes`); no logits (``compute_logits`` is not called).
    DFlash (vllm/v1/spec_decode/dflash.py ``dummy_run``): the context-KV precompute over ``N``
    (:func:`dflash_context_kv_peak_bytes`), then a forward over only
    ``min(N, max_num_seqs·(1 + k))`` query tokens."""
    if not drafter_runs_in_profile(p.method, version):
        return 0
    n = int(n_tokens)
    if p.method == "dflash":
        q = min(n, max(1, int(max_num_seqs)) * (1 + p.num_speculative_tokens))
        return max(dflash_context_kv_peak_bytes(p, n, version), drafter_layer_peak_bytes(p, q))
    pre = n * p.dtype_bytes * (2 * p.hidden + p.fc_input) if p.fc_input else 0
    return max(pre, drafter_layer_peak_bytes(p, n))


def drafter_profile_extra_bytes(p: DrafterPass | None, *, target_peak_bytes: int, n_tokens: int,
                                max_num_seqs: int, version: tuple) -> int:
    """What the drafter's forward adds to the profile run's torch peak above the target's
    (bytes, ≥ 0): it runs after the target's forward has freed its activations, while
    ``_dummy_run`` still holds the target's output ``hidden_states`` ``[N, H_t]`` (and the
    auxiliary hidden states, counted on their own), so the peak is
    ``max(target peak, N·H_t·d + drafter peak)`` (vllm/utils/mem_utils.py
    ``memory_profiling``: the torch peak over the whole profile run)."""
    if p is None:
        return 0
    d = drafter_forward_peak_bytes(p, n_tokens, max_num_seqs, version)
    if not d:
        return 0
    live = int(n_tokens) * (p.target_hidden or p.hidden) * p.dtype_bytes
    return max(0, live + d - int(target_peak_bytes))


def drafter_graph_layer_hidden(p: DrafterPass | None, *, version: tuple, largest_capture_size: int,
                               max_num_seqs: int) -> int:
    """The drafter's share of the CUDA-graph estimate's residual stream (layers × hidden, the
    unit of :func:`tuner.memory.budget.cudagraph_estimate_bytes`): ``profile_cudagraph_memory``
    (vllm/v1/worker/gpu_model_runner.py, 0.19–0.33 read) captures through ``_dummy_run``
    (``is_graph_capturing``), which runs ``drafter.dummy_run`` with the graph pool swapped to
    the profiling pool, so the estimate measures the drafter's PIECEWISE graphs with the
    target's, at the same token counts and extrapolated over the same sizes — all its layers
    for EAGLE / EAGLE3 / MTP / draft model; DFlash captures only ``min(size, max_num_seqs·(1 +
    k))`` query tokens, its share scaled by that over the largest capture size. Model Runner V2
    (0.33 vllm/v1/worker/gpu/cudagraph_utils.py ``profile_cudagraph_memory``) runs
    ``capture_model(profile_only=True)``, whose ``speculator.capture()`` lands in the same
    throwaway pool: measured in full, the same share. 0 where the release does not run the
    drafter in its dummy runs."""
    if p is None or not drafter_runs_in_profile(p.method, version):
        return 0
    x = p.layers * p.hidden
    if p.method == "dflash" and largest_capture_size > 0:
        q = max(1, int(max_num_seqs)) * (1 + p.num_speculative_tokens)
        return int(x * min(1.0, q / largest_capture_size))
    return x


def checkpoint_drafter_pass(method: str, draft_config: dict, target_config: dict, *, tensor_parallel_size: int,
                            dtype_bytes: int = 2, num_speculative_tokens: int = 0) -> DrafterPass:
    """:class:`DrafterPass` of another checkpoint's drafter from its config.json (its layers in
    the target's dtype, the ``fc`` input of EAGLE / EAGLE3: ``cat([embeds, hidden])`` ``2H``,
    llama_eagle.py / llama_eagle3.py; a draft model and DFlash have none in the dummy run).

    Raises:
        ValueError: a size the config lacks (names the key)."""
    g = drafter_geometry(draft_config)
    t, tt = _text(draft_config), _text(target_config)
    return DrafterPass(method=method, layers=g["layers"], hidden=g["hidden"], heads=g["heads"],
                       kv_heads=g["kv_heads"], head_dim=g["head_dim"], intermediate=g["intermediate"],
                       tensor_parallel_size=max(1, int(tensor_parallel_size)), dtype_bytes=int(dtype_bytes),
                       target_hidden=int(tt.get("hidden_size") or t.get("target_hidden_size") or g["hidden"]),
                       fc_input=2 * g["hidden"] if method in ("eagle", "eagle3") else 0,
                       kv_layers=g["layers"], num_speculative_tokens=int(num_speculative_tokens))


def mtp_drafter_pass(text_config: dict, *, tensor_parallel_size: int, kv_layers: int, dtype_bytes: int = 2,
                     num_speculative_tokens: int = 0, data_parallel_size: int = 1,
                     enable_expert_parallel: bool = False) -> DrafterPass:
    """:class:`DrafterPass` of the checkpoint's MTP layers: decoder layers of the target's own
    shape (gated q for Qwen3-Next / Qwen3.5; MLA attention as its decompressed prefill heads
    ``nope + rope``; a MoE layer's experts as the rank holds them,
    :func:`tuner.memory.budget.moe_rank_shape`), the ``eh_proj`` / ``fc`` input ``2H``
    (deepseek_mtp.py, qwen3_next_mtp.py)."""
    from tuner.memory.budget import moe_rank_shape
    from tuner.memory.eras import NUM_EXPERTS_KEYS

    t = text_config or {}
    h = int(t.get("hidden_size") or 0)
    heads = int(t.get("num_attention_heads") or 1)
    if t.get("kv_lora_rank"):
        hd = int(t.get("qk_nope_head_dim") or 0) + int(t.get("qk_rope_head_dim") or 0)
        kvh = heads
    else:
        hd = int(t.get("head_dim") or (h // heads))
        kvh = int(t.get("num_key_value_heads") or heads)
    gated = t.get("attn_output_gate") or str(t.get("model_type", "")).startswith(("qwen3_next", "qwen3_5"))
    e = next((int(t[k]) for k in NUM_EXPERTS_KEYS if isinstance(t.get(k), int) and t[k] > 0), 0)
    topk, i_rank, shared = 0, 0, 0
    if e:
        moe_i = int(t.get("moe_intermediate_size") or t.get("intermediate_size") or 0)
        _here, i_rank = moe_rank_shape(e, moe_i, tensor_parallel_size=tensor_parallel_size,
                                       data_parallel_size=data_parallel_size,
                                       enable_expert_parallel=enable_expert_parallel)
        topk = int(t.get("num_experts_per_tok") or t.get("moe_topk") or 1)
        shared = int(t.get("shared_expert_intermediate_size") or (t.get("n_shared_experts") or 0) * moe_i)
    return DrafterPass(method="mtp", layers=mtp_num_layers(t), hidden=h, heads=heads, kv_heads=kvh, head_dim=hd,
                       intermediate=int(t.get("intermediate_size") or 0),
                       tensor_parallel_size=max(1, int(tensor_parallel_size)), dtype_bytes=int(dtype_bytes),
                       target_hidden=h, fc_input=2 * h, q_mult=2 if gated else 1, kv_layers=int(kv_layers),
                       num_speculative_tokens=int(num_speculative_tokens), moe_topk=topk,
                       moe_intermediate=int(i_rank), shared_intermediate=shared)


#: First release read that refuses a speculative config leaving no tokens to schedule
#: (vllm/config/vllm.py ``_set_max_num_scheduled_tokens``: 0.20.0 raises when
#: ``max_num_scheduled_tokens`` ≤ 0; 0.19 sets the difference without the check).
DRAFTING_SLOTS_CHECK_SINCE = (0, 20, 0)


def new_slots_for_drafting(method: str, num_speculative_tokens: int, *, parallel_drafting: bool = False) -> int:
    """Slots per request a drafter inserts into the batch (vllm/config/speculative.py
    ``max_num_new_slots_for_drafting``, 0.19–0.33): ``k − 1`` with parallel drafting (DFlash
    always sets it), plus 1 for a draft model (its draft tokens are not sliced); 0 for serial
    EAGLE / MTP / n-gram."""
    slots = int(num_speculative_tokens) - 1 if (parallel_drafting or method == "dflash") else 0
    return slots + (1 if method == "draft_model" else 0)


def check_drafting_slots(spec_cfg: dict | None, *, version: tuple, engine: str, max_num_batched_tokens: int,
                         max_num_seqs: int, path: str | None = None) -> None:
    """vLLM's refusal of a speculative config whose drafting slots take every batched token:
    ``max_num_scheduled_tokens = max_num_batched_tokens − slots × max_num_seqs`` must stay
    positive (V1 from :data:`DRAFTING_SLOTS_CHECK_SINCE`). The profile run itself still runs
    ``max_num_batched_tokens`` tokens (the runner's buffers are sized by it).

    Raises:
        DropError: vLLM's message, ``field`` ``speculative_config.num_speculative_tokens``."""
    from tuner.errors import DropError

    sc = spec_cfg or {}
    if not sc or engine != "V1" or not version >= DRAFTING_SLOTS_CHECK_SINCE:
        return
    slots = new_slots_for_drafting(str(sc.get("method")), int(sc.get("num_speculative_tokens") or 0),
                                   parallel_drafting=bool(sc.get("parallel_drafting")))
    scheduled = int(max_num_batched_tokens) - slots * int(max_num_seqs)
    if scheduled <= 0:
        raise DropError(f"max_num_scheduled_tokens is set to {scheduled} based on the speculative decoding settings, "
                        "which does not allow any tokens to be scheduled. Increase max_num_batched_tokens to "
                        "accommodate the additional draft token slots, or decrease num_speculative_tokens or "
                        "max_num_seqs.", path=path, field="speculative_config.num_speculative_tokens")


def drafter_persistent_bytes(p: DrafterPass | None, *, n_tokens: int, max_num_seqs: int) -> int:
    """The proposer's persistent GPU buffers (bytes, one rank), which only a ``total_consumed``
    budget sees (V1 0.27+, like :func:`tuner.memory.budget.runner_persistent_bytes` for the target's):
    ``SpecDecodeBaseProposer.__init__`` (vllm/v1/spec_decode/llm_base_proposer.py, 0.26–0.33
    read) allocates ``input_ids [N]`` int32, ``positions [N]`` and the slot mapping ``[N]``
    int64, ``hidden_states`` and ``inputs_embeds`` ``[N, H]`` in the model dtype, ``arange
    [max(S + 1, N)]`` int32, and with extra input slots (draft model, parallel drafting) two
    ``[N]`` bool masks; DFlash (dflash.py) adds its context slot mapping and positions ``[N]``
    int64 (its query buffers, ``max_num_seqs·(1 + k)`` long, are left out). Model Runner V2's
    speculators are taken to hold the same (not read buffer by buffer)."""
    if p is None:
        return 0
    from tuner.memory.budget import _alloc

    n, s = int(n_tokens), int(max_num_seqs)
    total = (_alloc(4 * n) + _alloc(8 * n) + _alloc(8 * n) + 2 * _alloc(n * p.hidden * p.dtype_bytes)
             + _alloc(4 * max(s + 1, n)))
    if new_slots_for_drafting(p.method, p.num_speculative_tokens):
        total += 2 * _alloc(n)
    if p.method == "dflash":
        total += 2 * _alloc(8 * n)
    return total


#: First release read whose V1 runner rounds the CUDA-graph capture sizes to multiples of the
#: uniform decode query length ``1 + k`` when decode graphs are FULL (the default
#: ``FULL_AND_PIECEWISE``): ``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``, called
#: from gpu_model_runner.py in 0.14 / 0.19 and from the attention-backend check in
#: vllm/config/compilation.py 0.20.1–0.33 (0.10.1 has none).
SPEC_CAPTURE_ROUNDING_SINCE = (0, 14, 0)
#: From this release Model Runner V2 sizes its own captures and skips the rounding
#: (vllm/config/compilation.py 0.33: ``not use_v2_model_runner``; 0.24's MRv2 still calls it).
MRV2_OWN_CAPTURE_SIZES_SINCE = (0, 33, 0)


def spec_decode_capture_sizes(sizes: list[int], *, version: tuple, num_speculative_tokens: int,
                              model_runner_v2: bool = False) -> list[int]:
    """The capture sizes after ``adjust_cudagraph_sizes_for_spec_decode``: each size rounded up
    to a multiple of ``q = 1 + k``, those above the largest size dropped, deduplicated (``[q]``
    when none is left and ``q`` fits); unchanged without spec decode, before
    :data:`SPEC_CAPTURE_ROUNDING_SINCE`, and on Model Runner V2 from
    :data:`MRV2_OWN_CAPTURE_SIZES_SINCE`. Taken with the default FULL decode graphs (a backend
    that forces PIECEWISE, or sequence parallelism's multiple of TP, are not modelled)."""
    q = 1 + int(num_speculative_tokens)
    if q <= 1 or not sizes or not version >= SPEC_CAPTURE_ROUNDING_SINCE:
        return list(sizes)
    if model_runner_v2 and version >= MRV2_OWN_CAPTURE_SIZES_SINCE:
        return list(sizes)
    top = max(sizes)
    rounded = sorted({-(-s // q) * q for s in sizes if -(-s // q) * q <= top})
    if not rounded and q <= top:
        rounded = [q]
    return rounded

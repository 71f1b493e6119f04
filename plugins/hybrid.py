"""Hybrid attention + state-space plugins: Nemotron-H (Mamba-2) and Qwen3.5 / Qwen3.6 (Gated DeltaNet).

Two plugin instances (entry points ``nemotron_h`` and ``qwen3_5``):

* ``nemotron_h`` — ``NemotronHForCausalLM`` (vllm/model_executor/models/nemotron_h.py, 0.19): one
  layer per character of ``hybrid_override_pattern``: ``M`` Mamba-2 mixer, ``-`` MLP
  (``up_proj → relu² → down_proj``, no gate), ``*`` attention (GQA, **no rotary**), ``E`` MoE
  (FusedMoE + shared expert); each layer has one pre-norm (fused residual add); untied LM head.
* ``qwen3_5`` — ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``
  (vllm/model_executor/models/qwen3_5.py, qwen3_next.py, 0.19): ``layer_types`` (else every
  ``full_attention_interval``-th layer is full attention) of Gated DeltaNet linear attention and
  gated full attention (``attn_output_gate``: Q carries a sigmoid gate; per-head q/k norms;
  M-RoPE cache ``[max_pos, d · partial_rotary_factor]``); dense gated MLP (``qwen3_5_text``) or
  sparse MoE block (``qwen3_5_moe_text``: router ``[E, H]``, shared expert + its 1-wide gate,
  FusedMoE of ``moe_intermediate_size``); MTP weights are skipped at load (as vLLM).
  Memory-equivalent layers live in :mod:`tuner.model.simulate.ssm`.

KV cache (V1). State pages follow ``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator``
(vllm/model_executor/layers/mamba/mamba_utils.py):

* Mamba-2: conv ``(k − 1, (I + 2·G·S)/tp)`` in the model dtype + SSM ``(nh/tp, hd, S)`` in
  ``mamba_ssm_cache_dtype`` — for Nemotron-H the config's key, else ``float16`` before vLLM
  0.20 and ``float32`` from 0.20 (:func:`nemotron_h_default_ssm_dtype`)
  (``NemotronHForCausalLMConfig``; the checkpoints' config.json has no such key);
  ``G = n_groups`` (+ ``tp − n_groups`` when tp does not divide it).
* Both conv states keep ``k − 1 + num_speculative_tokens`` columns with speculative decoding
  (``num_spec`` of ``mamba2_state_shape`` / ``gated_delta_net_state_shape``, read in the 0.19,
  0.20.1 and 0.24 wheels: the draft tokens' conv inputs), which raises the state page and with it
  the hybrid attention block size (Qwen3.6-27B TP4 with 3 MTP tokens: 1568 → 1600 tokens).
* Gated DeltaNet: conv ``(k − 1, (2·nk·dk + nv·dv)/tp)`` in the model dtype + recurrent
  ``(nv/tp, dv, dk)`` in ``mamba_ssm_dtype`` (Qwen3.5 configs: float32,
  ``Qwen3_5ForConditionalGenerationConfig``), else the model dtype.

``HybridAttentionMambaModelConfig`` (vllm/model_executor/models/config.py, 0.10+; prefix caching
off, which is vLLM 0.19's default for hybrid models) raises the attention block size to
``16 · cdiv(mamba_page, 16 · attn_bytes_per_token)`` (``attn_bytes_per_token`` =
``2 · kv_heads/tp · d · kv_dtype``; a user block size below it is overridden) and pads the state
page to the attention page (``page_size_padded``). The ``MambaSpec`` gets that attention block
size (vLLM's is ``max_model_len``, which a plugin does not know; only the "GPU KV cache size"
report of a run with ``max_model_len`` below the attention block size would differ).
V0 eras: only the attention layers have KV specs (V0 counts attention layers only).

Errors: :class:`tuner.errors.PluginError` for a config without a layer pattern;
``ValueError`` from the layers when ``tp`` does not divide the head counts (as vLLM asserts).
"""

from __future__ import annotations

import math

from tuner.errors import PluginError
from tuner.memory.kvcache import (FullAttentionSpec, MambaSpec, cdiv, dtype_bytes_for, kv_content_bytes, kv_heads_per_rank,
                           kv_quant_mode_for)
from tuner.model.plugin import ModelPlugin, RankSettings, stage_layers

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
_STATE_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp32": 4, "fp16": 2, "bf16": 2}

#: FlashAttention's block-size alignment used by ``HybridAttentionMambaModelConfig`` (non-MLA).
KERNEL_BLOCK_ALIGNMENT = 16


def _state_bytes(name: str | None, model_dtype: str) -> int:
    if not name or name == "auto":
        return dtype_bytes_for("auto", model_dtype)
    try:
        return _STATE_DTYPE_BYTES[str(name).replace("torch.", "")]
    except KeyError as exc:
        raise PluginError(f"unknown mamba state dtype {name!r}", where="mamba_ssm_cache_dtype") from exc


#: First release aligning the hybrid attention block to ``max(kernel alignment, cache block size)``
#: (vllm/platforms/interface.py ``Platform._align_hybrid_block_size``, 0.20.0; 0.19's
#: ``HybridAttentionMambaModelConfig`` aligns to 16 and then keeps a larger user block size).
HYBRID_ALIGN_TO_BLOCK_SIZE_SINCE = (0, 20, 0)


def hybrid_attention_block_size(mamba_page_bytes: int, attn_bytes_per_token: int, user_block_size: int | None = None,
                                alignment: int = KERNEL_BLOCK_ALIGNMENT, *, engine_version: str | None = None) -> int:
    """Attention block size of a hybrid model (prefix caching off), bytes in, tokens out.

    ≤0.19 (``HybridAttentionMambaModelConfig``): ``alignment · cdiv(mamba_page, alignment ·
    attn_bytes_per_token)``, or the block size given when that is larger. 0.20+
    (``Platform._align_hybrid_block_size``, :data:`HYBRID_ALIGN_TO_BLOCK_SIZE_SINCE`): the alignment
    itself is ``max(kernel alignment, cache block size)`` — the block size given, or the release's
    default (16; 64 from 0.34) — so the result is a multiple of it. ``engine_version`` None: 0.19's rule."""
    if engine_version:
        from tuner.memory.eras import parse_version

        if parse_version(str(engine_version)) >= HYBRID_ALIGN_TO_BLOCK_SIZE_SINCE:
            alignment = max(alignment, user_block_size or 16)
    need = alignment * cdiv(mamba_page_bytes, alignment * attn_bytes_per_token)
    return max(user_block_size or 16, need)


def mamba2_state(spec, tp: int, model_dtype: str, ssm_dtype: str | None, num_spec: int = 0) -> tuple[tuple, tuple]:
    """``(shapes, dtype_bytes)`` of one Mamba-2 layer's state (``mamba2_state_shape``, 0.19).

    Raises:
        PluginError: ``tp`` does not divide the conv dimension or the head count.
    """
    raw = spec.raw
    nh, hd = int(raw["mamba_num_heads"]), int(raw["mamba_head_dim"])
    groups = int(raw.get("n_groups") or raw.get("mamba_n_groups") or 1)
    state = int(raw["ssm_state_size"])
    kernel = int(raw.get("conv_kernel") or raw.get("mamba_d_conv") or 4)
    groups += 0 if groups % tp == 0 else tp - groups
    conv_dim = nh * hd + 2 * groups * state
    if conv_dim % tp or nh % tp:
        raise PluginError(f"tensor_parallel_size {tp} does not divide the Mamba conv dim {conv_dim} / heads {nh}",
                          where=spec.path)
    shapes = ((kernel - 1 + num_spec, conv_dim // tp), (nh // tp, hd, state))
    return shapes, (dtype_bytes_for("auto", model_dtype), _state_bytes(ssm_dtype, model_dtype))


def gdn_state(spec, tp: int, model_dtype: str, ssm_dtype: str | None, num_spec: int = 0) -> tuple[tuple, tuple]:
    """``(shapes, dtype_bytes)`` of one Gated DeltaNet layer's state (``gated_delta_net_state_shape``).

    Raises:
        PluginError: ``tp`` does not divide the conv dimension or the value heads.
    """
    raw = spec.raw
    nk, nv = int(raw["linear_num_key_heads"]), int(raw["linear_num_value_heads"])
    dk, dv = int(raw["linear_key_head_dim"]), int(raw["linear_value_head_dim"])
    kernel = int(raw.get("linear_conv_kernel_dim") or 4)
    conv_dim = 2 * nk * dk + nv * dv
    if conv_dim % tp or nv % tp:
        raise PluginError(f"tensor_parallel_size {tp} does not divide the DeltaNet conv dim {conv_dim} / heads {nv}",
                          where=spec.path)
    shapes = ((kernel - 1 + num_spec, conv_dim // tp), (nv // tp, dv, dk))
    return shapes, (dtype_bytes_for("auto", model_dtype), _state_bytes(ssm_dtype, model_dtype))



def _moe_layer(*args, **kwargs):
    """:class:`tuner.model.simulate.moe.FusedMoE` (imported when a model is built: plugins import no
    torch at module level)."""
    from tuner.model.simulate.moe import FusedMoE

    return FusedMoE(*args, **kwargs)


class _HybridPlugin(ModelPlugin):
    """Shared KV-spec logic: ``layer_kinds`` gives ``"attention"`` / ``"state"`` / other per layer."""

    def layer_kinds(self, spec) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def state(self, spec, settings: RankSettings) -> tuple[tuple, tuple]:  # pragma: no cover - abstract
        raise NotImplementedError

    def attn_geometry(self, spec) -> tuple[int, int]:
        return spec.num_key_value_heads, int(spec.raw.get("head_dim") or spec.head_dim)

    def layer_name(self, i: int, kind: str) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def kv_cache_spec(self, spec, settings: RankSettings) -> dict:
        """Attention layers ``FullAttentionSpec`` and state layers ``MambaSpec``, both with the hybrid
        attention block size; the state page padded to the attention page (0.19)."""
        kinds = self.layer_kinds(spec)
        kv_total, head = self.attn_geometry(spec)
        kv = kv_heads_per_rank(kv_total, settings.tensor_parallel_size)
        dt = dtype_bytes_for(settings.kv_cache_dtype, settings.dtype)
        # the attention page of one token as vLLM aligns it (vllm/platforms/interface.py
        # ``_align_hybrid_block_size``, 0.20 and 0.24 read: ``FullAttentionSpec(block_size=1, …,
        # kv_quant_mode=get_kv_quant_mode(cache_dtype)).page_size_bytes``): per-token-head scales and
        # packed NVFP4 / int4 included, so the padded state page equals the attention page that
        # :func:`tuner.memory.kvcache.with_kv_quant_mode` later gives the attention layers
        mode = kv_quant_mode_for(settings.kv_cache_dtype)
        mode = None if mode in (None, "FP8_PER_TENSOR") or str(mode).startswith("TURBOQUANT") else mode
        per_token = kv * kv_content_bytes(mode, head, head, dt)
        stage = stage_layers(spec, settings, num_layers=len(kinds))
        if settings.runs_attention:  # V0 engine: the profile runs attention; only attention layers hold KV
            bs = settings.block_size or 16
            return {self.layer_name(i, "attention"): FullAttentionSpec(bs, kv, head, dt)
                    for i in stage if kinds[i] == "attention"}
        shapes, dts = self.state(spec, settings)
        mamba_page = sum(math.prod(s) * d for s, d in zip(shapes, dts))
        bs = hybrid_attention_block_size(mamba_page, per_token, settings.block_size,
                                         engine_version=settings.engine_version)
        attn_page = bs * per_token
        pad = attn_page if attn_page != mamba_page else None
        out = {}
        for i in stage:
            if kinds[i] == "attention":
                out[self.layer_name(i, "attention")] = FullAttentionSpec(bs, kv, head, dt, kv_quant_mode=mode)
            elif kinds[i] == "state":
                out[self.layer_name(i, "state")] = MambaSpec(bs, shapes, dts, page_size_padded=pad,
                                                             mamba_cache_mode=settings.mamba_cache_mode)
        return out


# --------------------------------------------------------------------------- Nemotron-H

#: First vLLM release whose Nemotron-H SSM state defaults to float32 (model_executor/models/config.py).
NEMOTRON_H_FP32_SSM_SINCE = (0, 20, 0)


def nemotron_h_default_ssm_dtype(engine_version: str | None) -> str:
    """The SSM state dtype vLLM gives a Nemotron-H config without ``mamba_ssm_cache_dtype``:
    ``float16`` before 0.20.0, ``float32`` from 0.20.0 (an unparseable or missing release: the
    newer rule)."""
    from tuner.memory.eras import parse_version

    try:
        v = parse_version(str(engine_version)) if engine_version else None
    except Exception:
        v = None
    if v is not None and v.key < NEMOTRON_H_FP32_SSM_SINCE:
        return "float16"
    return "float32"


class NemotronHPlugin(_HybridPlugin):
    """Nemotron-H: Mamba-2 / MLP / attention / MoE layers per ``hybrid_override_pattern``."""

    name = "nemotron_h"
    #: ``NemotronHForCausalLM`` implements ``SupportsMambaPrefixCaching``: prefix caching gives
    #: ``mamba_cache_mode="all"`` (vllm/model_executor/models/config.py ``MambaModelConfig``).
    mamba_prefix_caching_mode = "all"
    architectures = ("NemotronHForCausalLM", "NemotronHPuzzleForCausalLM")

    def layer_kinds(self, spec) -> list[str]:
        pat = spec.raw.get("hybrid_override_pattern") or spec.top.get("hybrid_override_pattern")
        if not pat:
            raise PluginError("Nemotron-H config has no hybrid_override_pattern", where=spec.path)
        return [{"M": "state", "*": "attention", "-": "mlp", "E": "moe"}.get(c, c) for c in pat]

    def ssm_dtype(self, spec, engine_version: str | None = None) -> str:
        """``mamba_ssm_cache_dtype`` of the checkpoint's config.json, else the release's default:
        ``float16`` in vLLM 0.19.x, ``float32`` from 0.20.0 (``NemotronHForCausalLMConfig`` in
        vllm/model_executor/models/config.py falls back to ``DEFAULT_MAMBA_SSM_CACHE_DTYPE =
        "float32"`` from 0.20.0; checked in the 0.20.0 … 0.32.0 wheels; found by the engine
        adapter's cross-check)."""
        text = spec.top.get("text_config") if isinstance(spec.top.get("text_config"), dict) else spec.top
        if text.get("mamba_ssm_cache_dtype"):
            return text["mamba_ssm_cache_dtype"]
        return nemotron_h_default_ssm_dtype(engine_version)

    def state(self, spec, settings):
        return mamba2_state(spec, settings.tensor_parallel_size, settings.dtype,
                            self.ssm_dtype(spec, settings.engine_version), settings.num_speculative_tokens)

    def attn_geometry(self, spec):
        raw = spec.raw
        head = raw.get("head_dim") or raw.get("attention_head_dim") or spec.hidden_size // spec.num_attention_heads
        return spec.num_key_value_heads, int(head)

    def layer_name(self, i, kind):
        return f"model.layers.{i}.mixer" + (".attn" if kind == "attention" else "")

    def build_model(self, spec, settings: RankSettings):
        import torch
        from torch import nn

        from tuner.model.simulate import layers as L
        from tuner.memory.quant import scheme_for
        from tuner.model.simulate.ssm import Mamba2Mixer

        dtype = getattr(torch, _DTYPES.get(settings.dtype, "bfloat16"))
        tp, pp, rank = settings.tensor_parallel_size, settings.pipeline_parallel_size, settings.pp_rank
        raw, h = spec.raw, spec.hidden_size
        quant = scheme_for(spec, settings)
        kinds = self.layer_kinds(spec)
        kv_total, head = self.attn_geometry(spec)
        inter_cfg = raw.get("intermediate_size") or spec.intermediate_size

        class Layer(nn.Module):
            """One pre-norm (fused add) + mixer; returns (mixer output, residual)."""

            def __init__(self, mixer, kind: str) -> None:
                super().__init__()
                self.norm = L.RMSNorm(h, dtype)
                self.mixer = mixer
                self.kind = kind

            def forward(self, positions, hidden_states, residual):
                if residual is None:
                    residual = hidden_states
                    hidden_states = self.norm(hidden_states)
                else:
                    hidden_states, residual = self.norm(hidden_states, residual)
                if self.kind == "attention":
                    return self.mixer(positions, hidden_states), residual
                if self.kind == "moe":
                    logits = self.mixer.gate(hidden_states).float()
                    out = self.mixer.experts(hidden_states, logits)
                    if self.mixer.shared is not None:
                        s = self.mixer.shared(hidden_states)
                        out = out + s
                    return out, residual
                return self.mixer(hidden_states), residual

        layers, mlp_index = [], -1
        stage = set(stage_layers(spec, settings, num_layers=len(kinds)))
        for i, kind in enumerate(kinds):
            if kind == "mlp":
                mlp_index += 1
            if i not in stage:
                continue
            p = f"model.layers.{i}.mixer"
            if kind == "state":
                mixer = Mamba2Mixer(h, int(raw["mamba_num_heads"]), int(raw["mamba_head_dim"]),
                                    int(raw.get("n_groups") or 1), int(raw["ssm_state_size"]),
                                    int(raw.get("conv_kernel") or 4), tp, dtype,
                                    use_conv_bias=bool(raw.get("use_conv_bias", True)),
                                    use_bias=bool(raw.get("use_bias", False)), quant=quant, prefix=p,
                                    compiled=settings.compiled)
            elif kind == "attention":
                mixer = L.Attention(h, spec.num_attention_heads // tp, kv_heads_per_rank(kv_total, tp), head, dtype,
                                    None, compiled=settings.compiled, runs_attention=settings.runs_attention,
                                    quant=quant, prefix=p)
            elif kind == "mlp":
                inter = inter_cfg[mlp_index if len(inter_cfg) > 1 else 0] if isinstance(inter_cfg, list) else inter_cfg
                mixer = L.PlainMLP(h, int(inter) // tp, dtype, compiled=settings.compiled,
                                   bias=bool(raw.get("mlp_bias")), quant=quant, prefix=p)
            elif kind == "moe":
                mixer = nn.Module()
                e = int(raw["n_routed_experts"])
                mixer.gate = L.Linear(h, e, dtype)
                mixer.experts = _moe_layer(h, int(raw["moe_intermediate_size"]) // tp, e,
                                           int(raw["num_experts_per_tok"]), dtype, quant=quant,
                                           prefix=f"{p}.experts", compiled=settings.compiled)
                shared = int(raw.get("moe_shared_expert_intermediate_size") or 0) * int(raw.get("n_shared_experts") or 0)
                mixer.shared = (L.PlainMLP(h, shared // tp, dtype, compiled=settings.compiled, bias=False, quant=quant,
                                           prefix=f"{p}.shared_experts") if shared else None)
            else:
                raise PluginError(f"unknown Nemotron-H layer type {kind!r}", where=spec.path)
            layers.append(Layer(mixer, kind))
        first, last = rank == 0, rank == pp - 1
        tied = spec.tie_word_embeddings
        embed = L.VocabEmbedding(spec.vocab_size, h, dtype, tp) if (first or (last and tied)) else None
        # nemotron_h.py passes quant_config to ParallelLMHead (0.24): a method that quantizes the
        # head (ModelOpt from 0.23, GPTQ ``lm_head: true``) registers it quantized
        lm_head = (L.LMHead(spec.vocab_size, h, dtype, tp, tied_to=embed if tied else None, quant=quant, prefix="lm_head")
                   if last else None)
        return L.CausalLM(embed, layers, L.RMSNorm(h, dtype) if last else None, lm_head)


# --------------------------------------------------------------------------- Qwen3.5 / Qwen3.6

class Qwen35Plugin(_HybridPlugin):
    """Qwen3.5 / Qwen3.6 (dense and MoE): Gated DeltaNet + gated full attention."""

    name = "qwen3_5"
    #: Qwen3.5 lacks ``SupportsMambaPrefixCaching``: prefix caching gives ``mamba_cache_mode="align"``
    #: (``MambaModelConfig``, 0.19–0.24 read; the 0.20.1 and 0.24 Qwen3.6-27B logs' tokens need it).
    mamba_prefix_caching_mode = "align"
    architectures = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                     "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")

    def layer_kinds(self, spec) -> list[str]:
        n = spec.num_hidden_layers
        lt = spec.raw.get("layer_types")
        if not lt:
            k = int(spec.raw.get("full_attention_interval") or 4)
            lt = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
        return ["attention" if t == "full_attention" else "state" for t in list(lt)[:n]]

    def state(self, spec, settings):
        return gdn_state(spec, settings.tensor_parallel_size, settings.dtype,
                         spec.raw.get("mamba_ssm_dtype") or spec.top.get("mamba_ssm_dtype"),
                         settings.num_speculative_tokens)

    def layer_name(self, i, kind):
        return f"model.language_model.layers.{i}." + ("self_attn.attn" if kind == "attention" else "linear_attn")

    def build_model(self, spec, settings: RankSettings):
        import torch
        from torch import nn

        from tuner.model.simulate import layers as L
        from tuner.memory.quant import scheme_for
        from tuner.model.simulate.ssm import GatedDeltaNet, GatedOutputAttention

        dtype = getattr(torch, _DTYPES.get(settings.dtype, "bfloat16"))
        tp, pp, rank = settings.tensor_parallel_size, settings.pipeline_parallel_size, settings.pp_rank
        raw, h = spec.raw, spec.hidden_size
        quant = scheme_for(spec, settings)
        compiled = settings.compiled
        kinds = self.layer_kinds(spec)
        kv_total, head = self.attn_geometry(spec)
        moe = (raw.get("model_type") or "").startswith("qwen3_5_moe") or bool(raw.get("num_experts"))
        rope = L.RotaryEmbedding(spec.max_position_embeddings, spec.rotary_dim, dtype)
        base = "model.language_model.layers"

        class SparseMoe(nn.Module):
            """``Qwen3NextSparseMoeBlock``: router, FusedMoE, shared expert with a sigmoid gate."""

            def __init__(self, p: str) -> None:
                super().__init__()
                e = int(raw["num_experts"])
                self.gate = L.Linear(h, e, dtype)
                self.shared_expert_gate = L.Linear(h, 1, dtype)
                si = int(raw.get("shared_expert_intermediate_size") or 0)
                self.shared_expert = (L.GatedMLP(h, si // tp, dtype, compiled=compiled, quant=quant,
                                                 prefix=f"{p}.shared_expert") if si else None)
                self.experts = _moe_layer(h, int(raw["moe_intermediate_size"]) // tp, e,
                                          int(raw.get("num_experts_per_tok") or 8), dtype, quant=quant,
                                          prefix=f"{p}.experts", compiled=compiled)

            def forward(self, x):
                logits = self.gate(x)
                out = self.experts(x, logits)
                del logits
                if self.shared_expert is not None:
                    s = self.shared_expert(x)
                    g = self.shared_expert_gate(x)
                    s2 = s * torch.sigmoid(g)
                    del s, g
                    out = out + s2
                return out

        class Layer(nn.Module):
            """``Qwen3_5DecoderLayer``: fused-add norms, the mixer writes into ``empty_like(x)``."""

            def __init__(self, i: int, kind: str) -> None:
                super().__init__()
                p = f"{base}.{i}"
                self.kind = kind
                self.input_layernorm = L.RMSNorm(h, dtype)
                if kind == "state":
                    self.linear_attn = GatedDeltaNet(h, int(raw["linear_num_key_heads"]),
                                                     int(raw["linear_num_value_heads"]), int(raw["linear_key_head_dim"]),
                                                     int(raw["linear_value_head_dim"]),
                                                     int(raw.get("linear_conv_kernel_dim") or 4), tp, dtype,
                                                     quant=quant, prefix=f"{p}.linear_attn", compiled=compiled)
                else:
                    self.self_attn = GatedOutputAttention(h, spec.num_attention_heads // tp,
                                                          kv_heads_per_rank(kv_total, tp), head, dtype, rope,
                                                          gated=bool(raw.get("attn_output_gate", True)),
                                                          qkv_bias=bool(raw.get("attention_bias")), compiled=compiled,
                                                          quant=quant, prefix=f"{p}.self_attn")
                self.post_attention_layernorm = L.RMSNorm(h, dtype)
                self.mlp = SparseMoe(f"{p}.mlp") if moe else L.GatedMLP(
                    h, spec.intermediate_size // tp, dtype, compiled=compiled, quant=quant, prefix=f"{p}.mlp")

            def forward(self, positions, hidden_states, residual):
                if residual is None:
                    residual = hidden_states
                    hidden_states = self.input_layernorm(hidden_states)
                else:
                    hidden_states, residual = self.input_layernorm(hidden_states, residual)
                out = torch.empty_like(hidden_states)
                if self.kind == "state":
                    self.linear_attn(hidden_states, out)
                else:
                    self.self_attn(positions, hidden_states, out)
                del hidden_states
                hidden_states, residual = self.post_attention_layernorm(out, residual)
                return self.mlp(hidden_states), residual

        layers = [Layer(i, kinds[i]) for i in stage_layers(spec, settings, num_layers=len(kinds))]
        first, last = rank == 0, rank == pp - 1
        tied = spec.tie_word_embeddings
        embed = L.VocabEmbedding(spec.vocab_size, h, dtype, tp) if (first or (last and tied)) else None
        # qwen3_5.py passes quant_config to ParallelLMHead: methods that quantize the head
        # (ModelOpt from 0.23, GPTQ ``lm_head: true``) register it quantized
        lm_head = (L.LMHead(spec.vocab_size, h, dtype, tp, tied_to=embed if tied else None, quant=quant, prefix="lm_head")
                   if last else None)
        text = L.CausalLM(embed, layers, L.RMSNorm(h, dtype) if last else None, lm_head, extra={"rotary_emb": rope})
        return _with_vision(text, spec, settings, dtype, quant)


def _with_vision(text, spec, settings: RankSettings, dtype, quant):
    """Wrap the text model with the Qwen3-VL vision transformer + merger of the checkpoint
    (``tuner.model.simulate.vision``: ``VisionTower(kind="qwen3_5")`` in ``MultimodalCausalLM``: the
    tower's weights and vLLM's V1 encoder profile, one 4096² dummy image = 65536 patches /
    16384 tokens for the published 16.8 MP processor limit)."""
    if not isinstance(spec.top.get("vision_config"), dict):
        return text
    try:
        from tuner.model.simulate.vision import MultimodalCausalLM, VisionTower
    except ImportError:  # pragma: no cover - the multimodal engineer's module
        return text
    tower = VisionTower(spec.top, dtype, kind="qwen3_5", tp=settings.tensor_parallel_size, quant=quant,
                        engine_version=settings.engine_version, v0=settings.runs_attention)
    return MultimodalCausalLM(text, tower, spec.hidden_size, v0=settings.runs_attention)


nemotron_h = NemotronHPlugin()
qwen3_5 = Qwen35Plugin()

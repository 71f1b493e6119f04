"""Gemma family plugin: Gemma 1, Gemma 2, Gemma 3 (text and ``-it`` multimodal), Gemma 4.

What is modelled per rank, following vLLM 0.19 (vllm/model_executor/models/gemma.py, gemma2.py,
gemma3.py, gemma3_mm.py, gemma4.py, gemma4_mm.py):

* **Gemma 1** (``GemmaForCausalLM``): GeGLU gated MLP (``gate_up → gelu_and_mul → down``),
  ``head_dim`` from the config (256), tied embeddings (vLLM asserts them), embedding multiplied
  by the ``normalizer`` buffer ``sqrt(H)`` (a 0-d tensor in the model dtype), all layers full
  attention.
* **Gemma 2** (``Gemma2ForCausalLM``): interleaved sliding window — ``config.layer_types`` (the
  HF default, used when the file has none, is "even layers slide": ``(i + 1) % 2``), window
  ``sliding_window`` (4096); pre+post attention and pre+post feed-forward norms (4 norms per
  layer, the two "post" norms out of place); ``attn_logit_softcapping`` (no memory) and
  ``final_logit_softcapping`` on the logits; ``query_pre_attn_scalar`` (scaling only).
* **Gemma 3** (``Gemma3ForCausalLM``, text of ``Gemma3ForConditionalGeneration``): 5 local : 1
  global (``layer_types``; default ``(i + 1) % sliding_window_pattern``, pattern 6), window 1024,
  per-head q/k norms, two rotary caches: local ``[max_pos, d]`` (``rope_local_base_freq``) and
  global, which for ``rope_type="linear"`` is ``LinearScalingRotaryEmbedding`` with
  ``[max_pos · factor, d]`` rows (512 MiB for the 4B/12B at 131072 × 8 × 256 × 2 B).
* **Gemma 4** (``Gemma4ForConditionalGeneration`` / ``Gemma4ForCausalLM``): per-layer attention
  geometry — sliding layers ``num_key_value_heads × head_dim``; full layers ``global_head_dim``
  and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` (K reused as V, the V slot of
  the fused QKV still exists); the last ``num_kv_shared_layers`` layers reuse an earlier layer's
  KV (no KV of their own); optional MoE block next to the dense MLP (``enable_moe_block``: router
  ``[E, H]`` + ``scale [H]`` + ``per_expert_scale [E]``, FusedMoE with ``moe_intermediate_size``)
  and per-layer embeddings (``hidden_size_per_layer_input``); a ``layer_scalar`` buffer per
  layer; rotary caches ``[max_pos, d]`` per layer type (``proportional`` rope spans the head).

KV cache (``kv_cache_spec``): ``SlidingWindowSpec`` for sliding layers, ``FullAttentionSpec``
for global ones, KV heads ``max(1, kv // tp)``. The grouping of sliding/full layers, the page
unification of Gemma-4's unequal pages and the "GPU KV cache size" token count are
:mod:`tuner.memory.kvcache`'s (e.g. vLLM 0.19, Gemma-2: 13 sliding + 13 full layers → two groups of
13, ``bytes_per_block = 13 · page``, tokens = ``num_blocks // 2 · 16``).

Multimodal ``-it`` checkpoints: Gemma 3's SigLIP tower and projector (and the V1 encoder
profile) come from :mod:`tuner.model.simulate.vision` (``VisionTower(kind="siglip")`` wrapped in
``MultimodalCausalLM``). Gemma 4's tower (transformers ``Gemma4VisionModel``, which vLLM 0.19
builds with ``AutoModel.from_config``: replicated, never quantized, ~0.57 B parameters) and
``embed_vision`` projector come from ``VisionTower(kind="gemma4")`` (weights only: its encoder
profile is not simulated).

Errors: :class:`tuner.errors.PluginError` when a Gemma-4 config lacks ``layer_types``.
"""

from __future__ import annotations

from tuner.errors import PluginError
from tuner.memory.kvcache import FullAttentionSpec, SlidingWindowSpec, dtype_bytes_for, kv_heads_per_rank
from tuner.model.plugin import ModelPlugin, RankSettings, stage_layers

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
SLIDING, FULL = "sliding_attention", "full_attention"


def _family(spec) -> int:
    """Gemma generation 1-4 from ``model_type`` (``gemma``, ``gemma2``, ``gemma3[_text]``, ``gemma4[_text]``)."""
    mt = (spec.raw.get("model_type") or spec.model_type or "").lower()
    for gen in (4, 3, 2):
        if mt.startswith(f"gemma{gen}"):
            return gen
    return 1


def layer_types(spec) -> list[str]:
    """Per-layer attention kind (``sliding_attention`` / ``full_attention``) as vLLM 0.19 reads it.

    ``config.layer_types`` when present; else Gemma 2: even layers slide; Gemma 3:
    ``(i + 1) % sliding_window_pattern != 0`` slides (pattern 6); Gemma 1: all full.

    Raises:
        PluginError: a Gemma-4 config without ``layer_types``.
    """
    n = spec.num_hidden_layers
    lt = spec.raw.get("layer_types")
    if lt:
        return list(lt)[:n]
    gen = _family(spec)
    if gen == 4:
        raise PluginError("Gemma-4 config has no layer_types", where=spec.path)
    if gen == 1 or not spec.sliding_window:
        return [FULL] * n
    if gen == 2:
        return [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    pattern = int(spec.raw.get("sliding_window_pattern") or spec.raw.get("_sliding_window_pattern") or 6)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]


def cfg(spec, key: str, default=None):
    """A text-config value: transformers' parsed dict first, else the file's ``text_config`` /
    top level (transformers 5 drops some Gemma-4 keys such as ``global_head_dim`` from
    ``to_dict()``)."""
    v = spec.raw.get(key)
    if v is None:
        text = spec.top.get("text_config") if isinstance(spec.top.get("text_config"), dict) else {}
        v = text.get(key, spec.top.get(key))
    return default if v is None else v


def merged_config(spec) -> dict:
    """The file's text config overlaid with transformers' parsed values that are not None."""
    text = spec.top.get("text_config") if isinstance(spec.top.get("text_config"), dict) else spec.top
    return {**text, **{k: v for k, v in spec.raw.items() if v is not None}}


def attention_geometry(spec, layer: int, kind: str) -> tuple[int, int]:
    """``(total_kv_heads, head_dim)`` of one layer. Gemma 4 full layers use ``global_head_dim``
    and, with ``attention_k_eq_v``, ``num_global_key_value_heads``; every other layer the
    config's ``num_key_value_heads`` × ``head_dim``."""
    head = int(cfg(spec, "head_dim") or spec.head_dim)
    kv = int(cfg(spec, "num_key_value_heads") or spec.num_key_value_heads)
    if _family(spec) == 4 and kind == FULL:
        head = int(cfg(spec, "global_head_dim") or head)
        if cfg(spec, "attention_k_eq_v"):
            kv = int(cfg(spec, "num_global_key_value_heads") or kv)
    return kv, head


def kv_shared_layers(spec) -> set[int]:
    """Gemma-4 layers that reuse an earlier layer's KV (the last ``num_kv_shared_layers``)."""
    k = int(cfg(spec, "num_kv_shared_layers") or 0) if _family(spec) == 4 else 0
    n = spec.num_hidden_layers
    return set(range(n - k, n)) if 0 < k < n else set()


def rope_cache_rows(params: dict | None, max_pos: int) -> int:
    """Rows of vLLM's ``cos_sin_cache`` for one rope config (``get_rope``, 0.19): ``linear``
    → ``max_pos · Σ factors``; ``yarn``/``dynamic`` with a factor → ``max_pos · factor``;
    ``longrope`` → ``original + max_pos``; everything else ``max_pos``."""
    p = params or {}
    kind = p.get("rope_type") or p.get("type") or "default"
    if kind == "linear":
        f = p.get("factor", 1.0)
        fs = f if isinstance(f, (list, tuple)) else [f]
        return int(sum(int(max_pos * float(x)) for x in fs))
    if kind == "yarn":
        return int(max_pos * float(p.get("factor", 1.0)))
    if kind == "longrope":
        return int(p.get("original_max_position_embeddings", max_pos)) + max_pos
    return max_pos


def _rope_params_for(spec, kind: str) -> dict:
    rp = spec.raw.get("rope_parameters") or spec.raw.get("rope_scaling") or {}
    if isinstance(rp.get(kind), dict):
        return dict(rp[kind])
    out = dict(rp)
    if kind == SLIDING and _family(spec) >= 3:
        out = {"rope_type": "default", "rope_theta": spec.raw.get("rope_local_base_freq", 10000.0)}
    return out



def _moe_layer(*args, **kwargs):
    """:class:`tuner.model.simulate.moe.FusedMoE` (imported when a model is built: plugins import no
    torch at module level)."""
    from tuner.model.simulate.moe import FusedMoE

    return FusedMoE(*args, **kwargs)


class GemmaPlugin(ModelPlugin):
    """Gemma 1/2/3/4 decoders (and the text side of Gemma 3/4 multimodal checkpoints)."""

    name = "gemma"
    architectures = (
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "Gemma4ForCausalLM",
        "Gemma4ForConditionalGeneration",
    )

    # -- KV cache ----------------------------------------------------------------------------
    def kv_cache_spec(self, spec, settings: RankSettings) -> dict:
        """Per-layer specs of one rank: sliding layers ``SlidingWindowSpec(window)``, global layers
        ``FullAttentionSpec``; page = ``2 · bs · max(1, kv // tp) · d · dtype`` bytes; Gemma-4
        KV-shared layers are omitted."""
        bs = settings.block_size or 16
        dt = dtype_bytes_for(settings.kv_cache_dtype, settings.dtype)
        kinds = layer_types(spec)
        window = spec.sliding_window or spec.raw.get("sliding_window")
        shared = kv_shared_layers(spec)
        out = {}
        for i in stage_layers(spec, settings):
            if i in shared:
                continue
            kv, head = attention_geometry(spec, i, kinds[i])
            heads = kv_heads_per_rank(kv, settings.tensor_parallel_size)
            name = f"model.layers.{i}.self_attn.attn"
            if kinds[i] == SLIDING and window:
                out[name] = SlidingWindowSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype_bytes=dt,
                                              sliding_window=int(window))
            else:
                out[name] = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype_bytes=dt)
        return out

    # -- module ------------------------------------------------------------------------------
    def build_model(self, spec, settings: RankSettings):
        import torch

        from tuner.model.simulate import layers as L
        from tuner.memory.quant import scheme_for

        dtype = getattr(torch, _DTYPES.get(settings.dtype, "bfloat16"))
        tp = settings.tensor_parallel_size
        pp, rank = settings.pipeline_parallel_size, settings.pp_rank
        raw = merged_config(spec)
        gen = _family(spec)
        h = spec.hidden_size
        heads = spec.num_attention_heads // tp
        kinds = layer_types(spec)
        quant = scheme_for(spec, settings)
        compiled = settings.compiled
        Sandwich, Gemma4Layer, GemmaLM, Router = _classes()

        max_pos = spec.max_position_embeddings
        ropes: dict = {}

        def rope_for(kind: str, head: int):
            params = _rope_params_for(spec, kind)
            partial = float(params.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0)
            kind_name = params.get("rope_type") or params.get("type") or "default"
            rot = head if kind_name == "proportional" else int(head * partial)
            key = (head, rot, repr(sorted(params.items())))
            if key not in ropes:  # get_rope caches one instance per distinct configuration
                ropes[key] = L.RotaryEmbedding(rope_cache_rows(params, max_pos), rot, dtype)
            return ropes[key]

        first, last = rank == 0, rank == pp - 1
        prefix = "model.language_model" if "text_config" in spec.top else "model"
        layers = []
        for i in stage_layers(spec, settings):
            kind = kinds[i]
            kv_total, head = attention_geometry(spec, i, kind)
            kv = kv_heads_per_rank(kv_total, tp)
            p = f"{prefix}.layers.{i}"
            attn = L.Attention(h, heads, kv, head, dtype, rope_for(kind, head),
                               qkv_bias=bool(raw.get("attention_bias")), o_bias=bool(raw.get("attention_bias")),
                               compiled=compiled, runs_attention=settings.runs_attention, quant=quant,
                               prefix=f"{p}.self_attn")
            if gen >= 3:
                attn.q_norm = L.RMSNorm(head, dtype)
                attn.k_norm = L.RMSNorm(head, dtype)
            inter = int(raw.get("intermediate_size") or spec.intermediate_size)
            if gen == 4:
                first_shared = spec.num_hidden_layers - int(raw.get("num_kv_shared_layers") or 0)
                if raw.get("use_double_wide_mlp") and i >= first_shared > 0:
                    inter *= 2
            mlp = L.GatedMLP(h, inter // tp, dtype, compiled=compiled, quant=quant, prefix=f"{p}.mlp")
            if gen == 1:
                layers.append(L.DecoderLayer(attn, mlp, h, dtype))
            elif gen in (2, 3):
                layers.append(Sandwich(attn, mlp, h, dtype))
            else:
                moe = router = None
                if raw.get("enable_moe_block") or raw.get("num_experts"):
                    router = Router(h, int(raw["num_experts"]), dtype)
                    moe = _moe_layer(h, int(raw.get("moe_intermediate_size") or raw.get("expert_intermediate_size")) // tp,
                                     int(raw["num_experts"]), int(raw.get("top_k_experts") or raw.get("num_experts_per_tok")),
                                     dtype, quant=quant, prefix=f"{p}.moe.experts", compiled=compiled)
                ple = int(raw.get("hidden_size_per_layer_input") or 0)
                layers.append(Gemma4Layer(attn, mlp, h, dtype, router=router, moe=moe, ple_dim=ple))

        vocab = spec.vocab_size
        embed = L.VocabEmbedding(vocab, h, dtype, tp) if (first or last) else None  # Gemma ties embeddings
        lm_head = L.LMHead(vocab, h, dtype, tp, tied_to=embed, soft_cap=raw.get("final_logit_softcapping")) if last else None
        norm = L.RMSNorm(h, dtype) if last else None
        extra: dict = {f"rotary_{j}": r for j, r in enumerate(ropes.values())}
        ple = int(raw.get("hidden_size_per_layer_input") or 0) if gen == 4 else 0
        if ple and first:
            total = ple * spec.num_hidden_layers
            extra["embed_tokens_per_layer"] = L.VocabEmbedding(int(raw.get("vocab_size_per_layer_input") or vocab),
                                                               total, dtype, tp)
            extra["per_layer_model_projection"] = L.Linear(h, total // tp, dtype, quant=quant,
                                                           prefix=f"{prefix}.per_layer_model_projection")
            extra["per_layer_projection_norm"] = L.RMSNorm(ple, dtype)
        text = GemmaLM(embed, layers, norm, lm_head, extra=extra, hidden=h, dtype=dtype)
        if ple:
            text.ple_total = ple * spec.num_hidden_layers
            mnbt = settings.max_num_batched_tokens
            if gen == 4 and isinstance(spec.top.get("vision_config"), dict) and "text_config" in spec.top and mnbt:
                # gemma4_mm.py __init__ (0.19): the PLE buffer pre-allocated for CUDA graphs,
                # [max_num_batched_tokens, L, ple] in the model dtype, on every rank ("Model loading took")
                import torch

                text.register_buffer("per_layer_embeddings",
                                     torch.empty(int(mnbt), spec.num_hidden_layers, ple, dtype=dtype), persistent=False)
        return _with_vision(text, spec, settings, dtype, quant, gen)


def _with_vision(text, spec, settings: RankSettings, dtype, quant, gen: int):
    """Wrap the text model with the checkpoint's vision tower + projector when the top-level
    config has a ``vision_config`` (``tuner.model.simulate.vision``: ``VisionTower`` and
    ``MultimodalCausalLM``, which also replays the V1 encoder profile). Gemma 3 uses
    ``kind="siglip"`` (SigLIP + ``Gemma3MultiModalProjector``).

    Gemma 4 (gemma4_mm.py) uses ``kind="gemma4"`` (transformers ``Gemma4VisionModel`` +
    ``Gemma4MultimodalEmbedder``; 16-bit whatever the checkpoint's scheme, replicated on every TP
    rank; weights only), and with an ``audio_config`` the audio tower + ``embed_audio``
    (:func:`tuner.model.simulate.towers.gemma4.audio_tower`, weights only).
    """
    vc = spec.top.get("vision_config")
    if not isinstance(vc, dict) or "text_config" not in spec.top or gen not in (3, 4):
        return text
    try:
        from tuner.model.simulate.vision import MultimodalCausalLM, VisionTower
    except ImportError:  # pragma: no cover - the multimodal engineer's module
        return text
    kind = "siglip" if gen == 3 else "gemma4"
    tower = VisionTower(spec.top, dtype, kind=kind, tp=settings.tensor_parallel_size, quant=quant,
                        engine_version=settings.engine_version, v0=settings.runs_attention)
    mm = MultimodalCausalLM(text, tower, spec.hidden_size, v0=settings.runs_attention)
    ac = spec.top.get("audio_config")
    if gen == 4 and isinstance(ac, dict):  # gemma4_mm.py: the audio tower of the variants that have one
        from tuner.model.simulate.towers.gemma4 import audio_tower

        mm.audio = audio_tower(ac, spec.top, dtype)
    return mm


_CLASSES = None


def _classes():
    """Torch module classes of this plugin, defined on first use (plugins import no torch at
    module level)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    GemmaSandwichLayer, Gemma4Router, Gemma4DecoderLayer = _layer_classes()
    _CLASSES = (GemmaSandwichLayer, Gemma4DecoderLayer, _lm_class(), Gemma4Router)
    return _CLASSES


def _layer_classes():
    """The decoder-layer classes: Gemma 2/3's sandwich layer, Gemma 4's router and layer."""
    import torch
    from torch import nn

    from tuner.model.simulate import layers as L

    class GemmaSandwichLayer(nn.Module):
        """Gemma 2/3 decoder layer: input norm (fused add), attention, post-attention norm (out
        of place), pre-feed-forward norm (fused add), GeGLU MLP, post-feed-forward norm (out of
        place) — vllm/model_executor/models/gemma2.py ``Gemma2DecoderLayer.forward``."""

        def __init__(self, attn, mlp, hidden, dtype) -> None:
            super().__init__()
            self.input_layernorm = L.RMSNorm(hidden, dtype)
            self.self_attn = attn
            self.post_attention_layernorm = L.RMSNorm(hidden, dtype)
            self.pre_feedforward_layernorm = L.RMSNorm(hidden, dtype)
            self.mlp = mlp
            self.post_feedforward_layernorm = L.RMSNorm(hidden, dtype)

        def forward(self, positions, hidden_states, residual):
            if residual is None:
                residual = hidden_states
                hidden_states = self.input_layernorm(hidden_states)
            else:
                hidden_states, residual = self.input_layernorm(hidden_states, residual)
            hidden_states = self.self_attn(positions, hidden_states)
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
            hidden_states = self.mlp(hidden_states)
            hidden_states = self.post_feedforward_layernorm(hidden_states)
            return hidden_states, residual

    class Gemma4Router(nn.Module):
        """``Gemma4Router``: weightless norm, ``scale [H]``, ``proj [E, H]`` (bf16 in, fp32 out)."""

        def __init__(self, hidden, experts, dtype) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)
            self.proj = L.Linear(hidden, experts, dtype)
            self.per_expert_scale = nn.Parameter(torch.empty(experts, dtype=dtype), requires_grad=False)

        def forward(self, x):
            y = torch.empty_like(x)  # norm · root_size · scale
            out = x.new_empty(x.shape[0], self.proj.out_features, dtype=torch.float32)
            del y
            return out

    class Gemma4DecoderLayer(nn.Module):
        """``Gemma4DecoderLayer``: out-of-place norms and explicit residual adds, dense MLP plus
        an optional MoE branch on the residual, optional per-layer input (PLE), ``layer_scalar``."""

        def __init__(self, attn, mlp, hidden, dtype, *, router=None, moe=None, ple_dim: int = 0) -> None:
            super().__init__()
            self.input_layernorm = L.RMSNorm(hidden, dtype)
            self.self_attn = attn
            self.post_attention_layernorm = L.RMSNorm(hidden, dtype)
            self.pre_feedforward_layernorm = L.RMSNorm(hidden, dtype)
            self.mlp = mlp
            self.post_feedforward_layernorm = L.RMSNorm(hidden, dtype)
            self.router, self.moe = router, moe
            if moe is not None:
                self.post_feedforward_layernorm_1 = L.RMSNorm(hidden, dtype)
                self.post_feedforward_layernorm_2 = L.RMSNorm(hidden, dtype)
                self.pre_feedforward_layernorm_2 = L.RMSNorm(hidden, dtype)
            if ple_dim:
                self.per_layer_input_gate = L.Linear(hidden, ple_dim, dtype)
                self.per_layer_projection = L.Linear(ple_dim, hidden, dtype)
                self.post_per_layer_input_norm = L.RMSNorm(hidden, dtype)
            self.register_buffer("layer_scalar", torch.empty(1, dtype=dtype))

        def forward(self, positions, hidden_states, residual):
            if residual is not None:  # a PP stage boundary hands (hidden, None) on
                hidden_states = hidden_states + residual
            residual = hidden_states
            h = self.input_layernorm(residual)
            h = self.self_attn(positions, h)
            h = self.post_attention_layernorm(h)
            h = h + residual
            residual = h
            h = self.pre_feedforward_layernorm(h)
            h = self.mlp(h)
            if self.moe is not None:
                h1 = self.post_feedforward_layernorm_1(h)
                del h
                logits = self.router(residual)
                h2 = self.pre_feedforward_layernorm_2(residual)
                h2 = self.moe(h2, logits)
                del logits
                h2 = self.post_feedforward_layernorm_2(h2)
                h = h1 + h2
                del h1, h2
            h = self.post_feedforward_layernorm(h)
            h = h + residual
            del residual
            ple_in = getattr(self, "ple_input", None)  # set by the LM: this layer's [N, ple] slice
            if ple_in is not None and hasattr(self, "per_layer_input_gate"):
                # gemma4.py Gemma4DecoderLayer.forward (0.19): gate, gelu, x per-layer input,
                # projection back to H, norm, residual add
                gate = self.per_layer_input_gate(h)
                act = torch.empty_like(gate)
                del gate
                gated = act * ple_in
                del act
                contrib = self.per_layer_projection(gated)
                del gated
                normed = self.post_per_layer_input_norm(contrib)
                del contrib
                h = h + normed
                del normed
            h = h * self.layer_scalar
            return h, None

    return GemmaSandwichLayer, Gemma4Router, Gemma4DecoderLayer


def _lm_class():
    """The causal LM class: the normalizer buffer and Gemma 4's per-layer inputs."""
    import torch

    from tuner.model.simulate import layers as L

    class GemmaCausalLM(L.CausalLM):
        """``CausalLM`` whose embedding output is multiplied by the ``normalizer`` buffer
        (``sqrt(H)`` in the model dtype), as every Gemma ``embed_input_ids``."""

        def __init__(self, embed, layers, norm, lm_head, extra=None, *, hidden: int, dtype) -> None:
            super().__init__(embed, layers, norm, lm_head, extra=extra)
            self.register_buffer("normalizer", torch.empty((), dtype=dtype), persistent=False)
            self.ple_total = 0  # L·ple of the per-layer embeddings (Gemma 4 with PLE; set by the plugin)

        def _per_layer_inputs(self, input_ids, hidden_states, mm: bool):
            """gemma4.py ``get_per_layer_inputs`` + ``project_per_layer_inputs`` (0.19) on the first
            rank: the packed per-layer embeddings ``[N, L·ple]`` (text path: looked up and scaled;
            multimodal path: the wrapper's persistent buffer, a view), the projection of the hidden
            states (gathered to ``L·ple`` under TP), scaled, normed, added and scaled — the result
            stays alive through every layer."""
            n = hidden_states.shape[0]
            if mm and hasattr(self, "per_layer_embeddings"):
                embeds = self.per_layer_embeddings[:n].reshape(n, -1)
            elif mm:
                embeds = None
            else:
                looked = self.extra["embed_tokens_per_layer"](input_ids)
                embeds = looked * 1.0  # * embed_scale_per_layer
                del looked
            proj = self.extra["per_layer_model_projection"](hidden_states)
            if proj.shape[-1] != self.ple_total:  # ColumnParallelLinear(gather_output=True)
                gathered = proj.new_empty(n, self.ple_total)
                del proj
                proj = gathered
            scaled = proj * 1.0  # * per_layer_projection_scale
            del proj
            normed = torch.empty_like(scaled)  # per_layer_projection_norm over [N, L, ple]
            del scaled
            if embeds is None:
                return normed
            summed = normed + embeds
            del normed, embeds
            out = summed * 1.0  # * per_layer_input_scale
            del summed
            return out

        def forward(self, input_ids, positions, intermediate=None):
            ple = None
            if intermediate is None:
                e = self.embed_tokens(input_ids)
                hidden_states = e * self.normalizer
                del e
                residual = None
                if "per_layer_model_projection" in self.extra:
                    ple = self._per_layer_inputs(input_ids, hidden_states, mm=False)
            else:
                hidden_states, residual = intermediate
                if "per_layer_model_projection" in self.extra:  # first rank: the multimodal wrapper's embeds
                    ple = self._per_layer_inputs(input_ids, hidden_states, mm=True)
            for i, layer in enumerate(self.layers):
                if ple is not None:
                    layer.ple_input = ple.view(ple.shape[0], len(self.layers), -1)[:, i]
                hidden_states, residual = layer(positions, hidden_states, residual)
                if ple is not None:
                    layer.ple_input = None
            del ple
            if self.norm is None:
                if residual is None:
                    residual = torch.zeros_like(hidden_states)
                return hidden_states, residual
            if residual is None:
                return self.norm(hidden_states)
            hidden_states, _ = self.norm(hidden_states, residual)
            return hidden_states

    return GemmaCausalLM


plugin = GemmaPlugin()

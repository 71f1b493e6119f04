"""Vision towers + projectors of multimodal wrappers, and the V1 encoder profile pass.

Two things a multimodal checkpoint adds to vLLM's memory budget:

1. **Weights** ("Model loading took"): the vision tower and the projector into the text model,
   built with vLLM's module structure (fused ``qkv_proj``, ``gate_up_proj``, TP-sharded
   column/row linears, replicated norms/convs/position tables, persistent rotary buffers).
2. **The encoder profile** (V1 ``GPUModelRunner.profile_run``, vllm/v1/worker/gpu_model_runner.py
   0.9-0.19): before the text dummy run the engine runs ``embed_multimodal`` on
   ``max_items`` dummy items of the largest size and keeps the outputs in the encoder cache until
   the sampler has run. The torch peak increase is the larger of the encoder pass's peak and the
   text run's peak on top of the cached encoder outputs. The encoder runs eagerly (no
   torch.compile by default), so Python locals keep intermediates alive until their function
   returns; :class:`VisionTower.forward` replays those allocations in order.

``max_items`` (vllm/multimodal/encoder_budget.py ``MultiModalBudget``, 0.10+; the same formula
lived in vllm/v1/worker/utils.py in 0.11): encoder budget ``B = max(N, T)`` with N the
``max_num_batched_tokens`` and T the largest item's token count, ``max_items = max(1, B // T)``
(0.9.x: ``cdiv(B, T)``). The decoder-side limit ``max_num_seqs x max(1, min(999, M // T))`` is
assumed not to bind (it only does with a handful of sequences). V0 (``runs_attention``) runs the
encoder inside the model forward on ``max(1, N // T)`` prompts of one item each.

Kinds (``kind=``), each following vLLM 0.19's module structure:

- ``pixtral``: Mistral3 (vllm/model_executor/models/pixtral.py ``PixtralHFVisionModel`` +
  mistral3.py ``Mistral3MultiModalProjector``). ``patch_conv`` (no bias), ``ln_pre``, L blocks of
  RMSNorm / fused QKV / o_proj / gated SiLU MLP, a float32 rotary ``inv_freq [P^2, head_dim]``
  (P = image_size // patch_size); projector: RMSNorm, ``patch_merger.merging_layer [D, D·m²]``,
  ``linear_1 [H, D]``, ``linear_2 [H, H]``. Without xformers (not a vLLM dependency from 0.12
  on) the tower builds a dense block-diagonal bf16 mask ``[S, S]`` over the S patches of all
  items: for two 1540x1540 images S = 24200 and the mask alone is 1.09 GiB.
- ``siglip``: SigLIP (siglip.py ``SiglipVisionModel``): conv + bias, position table, L blocks of
  LayerNorm / QKV+bias / out_proj+bias / fc1,fc2+bias (fc1/fc2 stay 16-bit unless both sizes are
  multiples of 64), ``post_layernorm`` when every layer is used. Projector by wrapper:
  Gemma-3 (gemma3_mm.py): ``mm_input_projection_weight [Dv, H]`` + ``mm_soft_emb_norm``;
  LLaVA-NeXT / granite-vision (llava_next.py): ``linear_1 [H, Dv·len(feature_layers)]``,
  ``linear_2 [H, H]`` (+bias) and ``image_newline [H]``; with several feature layers the tower
  keeps every hidden state (``return_all_hidden_states``) during the encoder pass.
- ``llama4``: Llama-4 (mllama4.py ``Llama4VisionModel``, ``Llama4MultiModalProjector``): unfold
  linear, class/position embeddings, LayerNorms, L blocks with biased QKV/o/fc1/fc2, the
  pixel-shuffle adapter MLP and ``linear_1 [H, vision_output_dim]``; never quantized
  (vLLM passes ``quant_config=None``). Complex64 rotary cache ``[(P^2+1), head_dim/2]``.
- ``moonvit``: Kimi-VL (moonvit.py ``MoonVitPretrainedModel`` + kimi_vl.py projector): conv+bias,
  learnable 2-D position table ``[64, 64, D]``, L blocks (LayerNorms, biased wqkv/wo, fc0/fc1),
  final LayerNorm; projector ``pre_norm``, ``linear_1 [4D, 4D]``, ``linear_2 [H, 4D]``
  (replicated, 16-bit). Encoder pass: ``max(N, T) // T`` dummy 1024² images, each scaled to the
  processor's ``in_token_limit`` (4096 patches) and padded to the 28-pixel merge unit: 66x66
  patches, T = 1089 tokens (7 images at N = 8192); float32/complex64 rotary products per block,
  varlen FlashAttention (no scores); the 512x512 complex64 rotary table is built on the first
  forward and stays allocated (a ``cached_property``).
- ``qwen3_5``: Qwen3.5/3.6 (qwen3_vl.py ``Qwen3_VisionTransformer``): Conv3d + bias, position
  table, L blocks (LayerNorms, biased qkv/proj/fc1/fc2), merger (LayerNorm, ``linear_fc1 [4D,4D]``,
  ``linear_fc2 [H, 4D]``), bf16 rotary cache ``[8192, head_dim/2]``. Encoder pass: the image
  with the most features under the processor's 16.8 MP limit (4096², 65536 patches, T = 16384
  tokens; budget ``max(N, T)`` gives one image for N <= 16384), bilinear position interpolation,
  q/k contiguous copy + out-of-place rotary, varlen FlashAttention.
- ``gemma4``: Gemma 4 (transformers ``Gemma4VisionModel``, built by vLLM 0.19 gemma4_mm.py with
  ``AutoModel.from_config``: plain ``nn.Linear`` without bias, never TP-sharded or quantized):
  patch ``input_proj [D, 3p²]``, 2-D position table ``[2, 10240, D]``, L blocks of separate
  q/k/v/o, q/k norms ``[hd]``, 4 RMSNorms, gated MLP gate/up/down; ``std_bias``/``std_scale``
  when ``standardize``; float32 axial rotary ``inv_freq``; projector
  ``embed_vision.embedding_projection [H, D]`` (weightless norm). Weights only.

The V1 profile keeps the dummy pixel batch (``batched_dummy_mm_inputs``) and the encoder outputs
allocated through the text dummy run and the sampler (locals of ``profile_run``).

Defaults for vision-config keys a partial file lacks come from transformers' config classes or
vLLM's own config class (named where used). Sizes: D vision hidden, I vision intermediate,
H text hidden, all per tensor-parallel rank where vLLM shards them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tuner.simulate import layers as L

KINDS = ("pixtral", "siglip", "llama4", "moonvit", "qwen3_5", "gemma4")

#: Kimi-VL dummy image (vllm/model_executor/models/kimi_vl.py ``MaxImageTokenMeta``: 1024x1024)
#: and the image processor's ``in_token_limit`` (patches per image before the 2x2 merge) and
#: ``pad_input`` of Kimi-VL-A3B's preprocessor_config.json (4096 patches = 0.8 MP; the 2506
#: release raised it to 16384). A vision config's own ``in_token_limit`` wins.
KIMI_DUMMY_IMAGE = 1024
KIMI_IN_TOKEN_LIMIT = 4096

#: Qwen3-VL / Qwen3.5 image processor ``size.longest_edge`` (max pixels per image) of the
#: published preprocessor_config.json (16777216 = 4096²); video frames are capped at
#: ``25165824 / temporal_patch_size`` pixels (video_preprocessor_config.json), so an image is
#: the modality with the most tokens. A top-level ``max_pixels`` key wins.
QWEN3_VL_MAX_PIXELS = 16777216
QWEN3_VL_VIDEO_MAX_PIXELS = 25165824

#: MoonViT's 2-D rotary table ``Rope2DPosEmb(head_dim, 512, 512)`` (moonvit.py), complex64,
#: computed on the GPU on the first encoder forward (a ``cached_property``) and kept.
MOONVIT_ROPE_GRID = 512

#: vLLM stopped depending on xformers (``requirements/cuda.txt``) after 0.11 (0.11.0 pins
#: xformers 0.0.32; 0.19.0 has none), so Pixtral falls back to SDPA with a dense mask.
XFORMERS_UNTIL = (0, 12, 0)

#: Llama-4 image processor ``max_patches`` (transformers Llama4ImageProcessorFast default, also
#: the value in the published preprocessor_config.json): tiles per image, plus one global tile.
LLAMA4_MAX_TILES = 16

#: LLaVA-NeXT anyres pinpoints when a config lacks them (transformers ``LlavaNextConfig`` default).
LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


def _ver(v) -> tuple:
    if isinstance(v, tuple):
        return v
    parts = []
    for p in str(v).split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def _split(cfg: dict, top: dict | None) -> tuple[dict, dict]:
    """Accept either the vision_config or the whole top-level config as the first argument."""
    if isinstance(cfg.get("vision_config"), dict):
        return cfg["vision_config"], cfg
    return cfg, (top or {})


def _text_hidden(top: dict) -> int | None:
    tc = top.get("text_config") if isinstance(top.get("text_config"), dict) else {}
    return tc.get("hidden_size") or top.get("hidden_size")


# -- geometry ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Geometry:
    """Facts of one tower (vision-config values with their defaults resolved)."""

    kind: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    patch: int
    image_size: int
    channels: int
    wrapper: str  # "mistral3" | "gemma3" | "llava_next" | "llama4" | "kimi_vl" | "qwen3_5" | "gemma4" | ""


def _feature_layers(top: dict, vc: dict):
    return top.get("vision_feature_layer", vc.get("vision_feature_layer", -1))


def _layers_used(total: int, feature_layers) -> int:
    """``_get_num_hidden_layers`` (llava.py / mistral3.py): layers up to the deepest feature layer."""
    idx = feature_layers if isinstance(feature_layers, (list, tuple)) else [feature_layers]
    return max((total + i + 1) if i < 0 else i for i in idx)


def geometry(vision_config: dict, *, kind: str, top: dict | None = None) -> Geometry:
    """Resolve a tower's sizes. Raises ValueError for an unknown ``kind``."""
    vc, top = _split(vision_config, top)
    mt = str(top.get("model_type") or "")
    if kind == "pixtral":
        # transformers PixtralVisionConfig defaults
        g = Geometry(kind, vc.get("hidden_size", 1024), vc.get("intermediate_size", 4096),
                     vc.get("num_hidden_layers", 24), vc.get("num_attention_heads", 16), vc.get("patch_size", 16),
                     vc.get("image_size", 1024), vc.get("num_channels", 3), "mistral3")
        return g
    if kind == "siglip":
        wrapper = "gemma3" if (mt == "gemma3" or "mm_tokens_per_image" in top) else "llava_next"
        # transformers SiglipVisionConfig defaults (so400m values for the checkpoints in use)
        return Geometry(kind, vc.get("hidden_size", 1152), vc.get("intermediate_size", 4304),
                        vc.get("num_hidden_layers", 27), vc.get("num_attention_heads", 16), vc.get("patch_size", 14),
                        vc.get("image_size", 896 if wrapper == "gemma3" else 384), vc.get("num_channels", 3), wrapper)
    if kind == "llama4":
        return Geometry(kind, vc.get("hidden_size", 1408), vc.get("intermediate_size", 5632),
                        vc.get("num_hidden_layers", 34), vc.get("num_attention_heads", 16), vc.get("patch_size", 14),
                        vc.get("image_size", 336), vc.get("num_channels", 3), "llama4")
    if kind == "moonvit":
        # vLLM vllm/transformers_utils/configs/moonvit.py MoonViTConfig defaults
        return Geometry(kind, vc.get("hidden_size", 1152), vc.get("intermediate_size", 4304),
                        vc.get("num_hidden_layers", 27), vc.get("num_attention_heads", 16), vc.get("patch_size", 14),
                        0, 3, "kimi_vl")
    if kind == "qwen3_5":
        return Geometry(kind, vc.get("hidden_size", 1152), vc.get("intermediate_size", 4304),
                        vc.get("depth", vc.get("num_hidden_layers", 27)), vc.get("num_heads", 16),
                        vc.get("patch_size", 16), 0, vc.get("in_channels", 3), "qwen3_5")
    if kind == "gemma4":
        # transformers Gemma4VisionConfig defaults
        return Geometry(kind, vc.get("hidden_size", 1152), vc.get("intermediate_size", 4304),
                        vc.get("num_hidden_layers", 27), vc.get("num_attention_heads", 16), vc.get("patch_size", 16),
                        0, 3, "gemma4")
    raise ValueError(f"unknown vision tower kind {kind!r} (known: {', '.join(KINDS)})")


# -- parameter lists -------------------------------------------------------------------------
# Entries: (name, shape, storage) with storage "w" (model dtype), "f32", "i64", "c64", or
# ("lin", in, out, bias, split, quantizable) for linears; split "col" | "row" | "rep".
def _lin(name, in_f, out_f, bias, split, quantizable=True):
    return (name, ("lin", in_f, out_f, bias, split, quantizable), "lin")


def _vit_block(prefix, d, i, *, bias, gated, names, quant_mlp=True):
    q, o, f1, f2, n1, n2 = names
    out = [
        (f"{prefix}.{n1}.weight", (d,), "w"),
        _lin(f"{prefix}.{q}", d, 3 * d, bias, "col"),
        _lin(f"{prefix}.{o}", d, d, bias, "row"),
        (f"{prefix}.{n2}.weight", (d,), "w"),
    ]
    if bias:  # LayerNorm
        out.insert(1, (f"{prefix}.{n1}.bias", (d,), "w"))
        out.append((f"{prefix}.{n2}.bias", (d,), "w"))
    if gated:
        out += [_lin(f"{prefix}.{f1}", d, 2 * i, bias, "col", quant_mlp), _lin(f"{prefix}.{f2}", i, d, bias, "row", quant_mlp)]
    else:
        out += [_lin(f"{prefix}.{f1}", d, i, bias, "col", quant_mlp), _lin(f"{prefix}.{f2}", i, d, bias, "row", quant_mlp)]
    return out


def param_list(vision_config: dict, *, kind: str, top: dict | None = None) -> list:
    """The tower's and projector's parameters/buffers as vLLM 0.19 allocates them (full,
    un-sharded shapes; :class:`VisionTower` applies TP). Raises ValueError for unknown kinds or a
    projector whose text hidden size is unknown."""
    vc, top = _split(vision_config, top)
    g = geometry(vc, kind=kind, top=top)
    d, i, p, c = g.hidden, g.intermediate, g.patch, g.channels
    hd = d // g.heads
    h_text = _text_hidden(top)
    out: list = []
    if kind == "pixtral":
        pre = "vision_tower"
        n_layers = _layers_used(g.layers, _feature_layers(top, vc))
        side = g.image_size // p
        out += [(f"{pre}.patch_conv.weight", (d, c, p, p), "w"), (f"{pre}.ln_pre.weight", (d,), "w"),
                (f"{pre}.patch_positional_embedding.inv_freq", (side * side, hd), "f32")]
        for li in range(n_layers):
            out += _vit_block(f"{pre}.transformer.layers.{li}", d, i, bias=False, gated=True,
                              names=("attention.qkv_proj", "attention.o_proj", "feed_forward.gate_up_proj",
                                     "feed_forward.down_proj", "attention_norm", "ffn_norm"))
        if h_text:
            m = int(top.get("spatial_merge_size", 2))
            pb = bool(top.get("multimodal_projector_bias", False))
            out += [("multi_modal_projector.norm.weight", (d,), "w"),
                    _lin("multi_modal_projector.patch_merger.merging_layer", d * m * m, d, False, "rep", False),
                    _lin("multi_modal_projector.linear_1", d, h_text, pb, "col"),
                    _lin("multi_modal_projector.linear_2", h_text, h_text, pb, "row")]
        return out
    if kind == "siglip":
        pre = "vision_tower.vision_model"
        npos = (g.image_size // p) ** 2
        feats = _feature_layers(top, vc) if g.wrapper == "llava_next" else -1
        n_layers = _layers_used(g.layers, feats) if g.wrapper == "llava_next" else g.layers
        quant_mlp = d % 64 == 0 and i % 64 == 0  # SiglipMLP: quantizable only for multiples of 64
        out += [(f"{pre}.embeddings.patch_embedding.weight", (d, c, p, p), "w"),
                (f"{pre}.embeddings.patch_embedding.bias", (d,), "w"),
                (f"{pre}.embeddings.position_embedding.weight", (npos, d), "w"),
                (f"{pre}.embeddings.position_ids", (npos,), "i64")]
        for li in range(n_layers):
            out += _vit_block(f"{pre}.encoder.layers.{li}", d, i, bias=True, gated=False, quant_mlp=quant_mlp,
                              names=("self_attn.qkv_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2",
                                     "layer_norm1", "layer_norm2"))
        # require_post_norm: Gemma-3 None -> all layers used -> kept; LLaVA passes False.
        if g.wrapper == "gemma3" and n_layers == g.layers:
            out += [(f"{pre}.post_layernorm.weight", (d,), "w"), (f"{pre}.post_layernorm.bias", (d,), "w")]
        if h_text and g.wrapper == "gemma3":
            out += [("multi_modal_projector.mm_input_projection_weight", (d, h_text), "w"),
                    ("multi_modal_projector.mm_soft_emb_norm.weight", (d,), "w")]
        elif h_text:
            n_feat = len(feats) if isinstance(feats, (list, tuple)) else 1
            pb = bool(top.get("multimodal_projector_bias", True))
            out += [("image_newline", (h_text,), "w"),
                    _lin("multi_modal_projector.linear_1", d * n_feat, h_text, pb, "col"),
                    _lin("multi_modal_projector.linear_2", h_text, h_text, pb, "row")]
        return out
    if kind == "llama4":
        pre = "vision_model"
        npatch = (g.image_size // p) ** 2 + 1
        pin = int(vc.get("projector_input_dim", 4096))
        pout = int(vc.get("projector_output_dim", 4096))
        pbias = bool(vc.get("multi_modal_projector_bias", False))
        out += [_lin(f"{pre}.patch_embedding.linear", c * p * p, d, False, "col", False),
                (f"{pre}.class_embedding", (d,), "w"), (f"{pre}.positional_embedding_vlm", (npatch, d), "w"),
                (f"{pre}.layernorm_pre.weight", (d,), "w"), (f"{pre}.layernorm_pre.bias", (d,), "w"),
                (f"{pre}.layernorm_post.weight", (d,), "w"), (f"{pre}.layernorm_post.bias", (d,), "w")]
        for li in range(g.layers):
            blk = _vit_block(f"{pre}.model.layers.{li}", d, i, bias=True, gated=False,
                             names=("self_attn.qkv_proj", "self_attn.o_proj", "mlp.fc1", "mlp.fc2",
                                    "input_layernorm", "post_attention_layernorm"))
            # the rotary cache is shared (get_rope caches identical instances): counted once below
            out += [(n, s, st) if st != "lin" else (n, s[:5] + (False,), st) for n, s, st in blk]
        out += [(f"{pre}.rotary_emb.cos_sin_cache", (npatch, hd // 2), "c64"),
                _lin(f"{pre}.vision_adapter.mlp.fc1", i, pin, pbias, "col", False),
                _lin(f"{pre}.vision_adapter.mlp.fc2", pin, pout, pbias, "row", False)]
        if h_text:
            out.append(_lin("multi_modal_projector.linear_1", int(vc.get("vision_output_dim", pout)), h_text,
                            False, "col", False))
        return out
    if kind == "moonvit":
        pre = "vision_tower"
        ph, pw = vc.get("init_pos_emb_height", 64), vc.get("init_pos_emb_width", 64)
        mk = vc.get("merge_kernel_size", [2, 2])
        out += [(f"{pre}.patch_embed.proj.weight", (d, 3, p, p), "w"), (f"{pre}.patch_embed.proj.bias", (d,), "w"),
                (f"{pre}.patch_embed.pos_emb.weight", (ph, pw, d), "w")]
        for li in range(g.layers):
            blk = _vit_block(f"{pre}.encoder.blocks.{li}", d, i, bias=True, gated=False,
                             names=("wqkv", "wo", "mlp.fc0", "mlp.fc1", "norm0", "norm1"))
            out += [(n, s, st) if st != "lin" else (n, s[:5] + (False,), st) for n, s, st in blk]
        out += [(f"{pre}.encoder.final_layernorm.weight", (d,), "w"), (f"{pre}.encoder.final_layernorm.bias", (d,), "w")]
        if h_text:
            dm = d * mk[0] * mk[1]
            out += [("multi_modal_projector.pre_norm.weight", (d,), "w"), ("multi_modal_projector.pre_norm.bias", (d,), "w"),
                    _lin("multi_modal_projector.linear_1", dm, dm, True, "rep", False),
                    _lin("multi_modal_projector.linear_2", dm, h_text, True, "rep", False)]
        return out
    if kind == "qwen3_5":
        pre = "visual"
        t = vc.get("temporal_patch_size", 2)
        m = vc.get("spatial_merge_size", 2)
        h_out = int(vc.get("out_hidden_size", h_text or d))
        npos = int(vc.get("num_position_embeddings", 2304))
        out += [(f"{pre}.patch_embed.proj.weight", (d, c, t, p, p), "w"), (f"{pre}.patch_embed.proj.bias", (d,), "w"),
                (f"{pre}.pos_embed.weight", (npos, d), "w"), (f"{pre}.rotary_pos_emb.cos_sin_cache", (8192, hd // 2), "w")]
        for li in range(g.layers):
            out += _vit_block(f"{pre}.blocks.{li}", d, i, bias=True, gated=False,
                              names=("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2", "norm1", "norm2"))
        dm = d * m * m
        n_merge = 1 + len(vc.get("deepstack_visual_indexes") or [])
        for k in range(n_merge):
            mp = f"{pre}.merger" if k == 0 else f"{pre}.deepstack_merger_list.{k - 1}"
            nd = d if k == 0 else dm  # deepstack mergers use the post-shuffle norm
            out += [(f"{mp}.norm.weight", (nd,), "w"), (f"{mp}.norm.bias", (nd,), "w"),
                    _lin(f"{mp}.linear_fc1", dm, dm, True, "col"), _lin(f"{mp}.linear_fc2", dm, h_out, True, "row")]
        return out
    if kind == "gemma4":
        # transformers Gemma4VisionModel (vLLM 0.19 gemma4_mm.py builds it with AutoModel.from_config:
        # plain nn.Linear, no TP sharding, no quantization) + vLLM's Gemma4MultimodalEmbedder
        # (ReplicatedLinear without quant_config, weightless RMSNorm).
        pre = "vision_tower"
        hdv = int(vc.get("head_dim") or hd)
        kvh = int(vc.get("num_key_value_heads") or g.heads)
        npos = int(vc.get("position_embedding_size", 10240))
        clipped = bool(vc.get("use_clipped_linears", False))
        out += [_lin(f"{pre}.patch_embedder.input_proj", 3 * p * p, d, False, "rep", False),
                (f"{pre}.patch_embedder.position_embedding_table", (2, npos, d), "w")]
        spatial = hdv // 2
        nfreq = len(range(0, spatial, 2))
        out += [(f"{pre}.encoder.rotary_emb.inv_freq", (nfreq,), "f32"),
                (f"{pre}.encoder.rotary_emb.original_inv_freq", (nfreq,), "f32")]
        for li in range(g.layers):
            b = f"{pre}.encoder.layers.{li}"
            lins = [("self_attn.q_proj", d, g.heads * hdv), ("self_attn.k_proj", d, kvh * hdv),
                    ("self_attn.v_proj", d, kvh * hdv), ("self_attn.o_proj", g.heads * hdv, d),
                    ("mlp.gate_proj", d, i), ("mlp.up_proj", d, i), ("mlp.down_proj", i, d)]
            for n, fi, fo in lins:
                out.append(_lin(f"{b}.{n}.linear", fi, fo, False, "rep", False))
                if clipped:  # input/output min/max scalars (default dtype)
                    out += [(f"{b}.{n}.{m}", (), "w") for m in ("input_min", "input_max", "output_min", "output_max")]
            out += [(f"{b}.self_attn.q_norm.weight", (hdv,), "w"), (f"{b}.self_attn.k_norm.weight", (hdv,), "w")]
            out += [(f"{b}.{n}.weight", (d,), "w") for n in ("input_layernorm", "post_attention_layernorm",
                                                            "pre_feedforward_layernorm", "post_feedforward_layernorm")]
        if vc.get("standardize", False):
            out += [(f"{pre}.std_bias", (d,), "w"), (f"{pre}.std_scale", (d,), "w")]
        if h_text:
            dim = int(vc.get("output_proj_dims") or d)
            out.append(_lin("embed_vision.embedding_projection", dim, h_text, False, "rep", False))
        return out
    raise ValueError(f"unknown vision tower kind {kind!r}")


_STORE_BYTES = {"f32": 4, "i64": 8, "c64": 8}


def _numel(shape) -> int:
    return math.prod(shape)


def _sharded(spec, tp: int) -> tuple[int, int, int]:
    """(in, out, bias elements) of a linear on one rank."""
    _, in_f, out_f, bias, split, _q = spec
    if split == "col":
        return in_f, out_f // tp, (out_f // tp if bias else 0)
    if split == "row":
        return in_f // tp, out_f, (out_f if bias else 0)
    return in_f, out_f, (out_f if bias else 0)


def vision_tower_bytes(vision_config: dict, dtype_bytes: int, *, kind: str, top: dict | None = None, tp: int = 1) -> int:
    """Bytes of the vision tower + projector on one TP rank, all 16-bit (``dtype_bytes`` per
    element) except float32/int64/complex64 buffers.

    Args:
        vision_config: the ``vision_config`` dict, or the whole top-level config (then the
            projector, which needs the text hidden size and wrapper keys, is included).
        top: the top-level config when ``vision_config`` is only the sub-dict (adds the projector).
        tp: tensor-parallel size (vLLM shards the ViT's column/row linears unless
            ``mm_encoder_tp_mode="data"``).

    Raises:
        ValueError: unknown ``kind``.
    """
    total = 0
    for _name, shape, st in param_list(vision_config, kind=kind, top=top):
        if st == "lin":
            in_f, out_f, b = _sharded(shape, tp)
            total += (in_f * out_f + b) * dtype_bytes
        else:
            total += _numel(shape) * _STORE_BYTES.get(st, dtype_bytes)
    return total


# -- encoder profile: items --------------------------------------------------------------------
def max_tokens_per_item(vision_config: dict, *, kind: str, top: dict | None = None) -> tuple[int, int, int]:
    """``(T, crops, patches_per_crop)``: embeddings the largest dummy item yields (vLLM's
    ``get_mm_max_tokens_per_item``), the crops/tiles the tower sees per item, and the patches per
    crop. Raises ValueError for kinds whose encoder pass is not simulated."""
    vc, top = _split(vision_config, top)
    g = geometry(vc, kind=kind, top=top)
    if kind == "pixtral":
        m = int(top.get("spatial_merge_size", 1) or 1)
        grid = (g.image_size - 1) // (g.patch * m) + 1  # PixtralHFEncoderInfo.get_patch_grid_size
        side = (g.image_size - 1) // g.patch + 1
        return grid * grid, 1, side * side
    if kind == "siglip":
        side = g.image_size // g.patch
        if g.wrapper == "gemma3":  # pan-and-scan off (default): one crop, mm_tokens_per_image
            return int(top.get("mm_tokens_per_image", 256)), 1, side * side
        strategy = top.get("vision_feature_select_strategy", "default")
        base = side * side - (1 if strategy == "default" else 0)
        best = (0, 1)
        for h, w in top.get("image_grid_pinpoints") or LLAVA_NEXT_PINPOINTS:
            gh, gw = h // g.image_size, w // g.image_size
            toks = (gh * side) * (gw * side) + gh * side + base  # exact-aspect pinpoint: no unpadding
            if toks > best[0]:
                best = (toks, gh * gw + 1)
        return best[0], best[1], side * side
    if kind == "llama4":
        side = g.image_size // g.patch
        ratio = float(vc.get("pixel_shuffle_ratio", 0.5))
        per_tile = int(side * side * ratio * ratio)
        tiles = LLAMA4_MAX_TILES + 1  # 16:1 image -> 16 tiles + the global tile
        return tiles * per_tile, tiles, side * side + 1
    if kind == "moonvit":
        # KimiVLProcessingInfo.get_num_image_tokens on the 1024² dummy image: scale down to
        # ``in_token_limit`` patches, pad to the merge unit (pad_input), 2x2 merge.
        p = g.patch
        kh, kw = (vc.get("merge_kernel_size") or [2, 2])[:2]
        limit = int(vc.get("in_token_limit", KIMI_IN_TOKEN_LIMIT))
        w = h = KIMI_DUMMY_IMAGE
        if (w // p) * (h // p) > limit:
            scale = math.sqrt(limit / ((w // p) * (h // p)))
            w, h = int(w * scale), int(h * scale)
        h += (kh * p - h % (kh * p)) % (kh * p)
        w += (kw * p - w % (kw * p)) % (kw * p)
        gh, gw = h // p, w // p
        return (gh // kh) * (gw // kw), 1, gh * gw
    if kind == "qwen3_5":
        # Qwen2VLProcessingInfo.get_image_size_with_most_features + get_num_image_tokens
        # (qwen2_vl.py / qwen3_vl.py, 0.19): the max-pixel budget in merge units, factored
        # into the closest pair (aspect <= 200), one temporal patch.
        m = int(vc.get("spatial_merge_size", 2))
        unit = g.patch * m
        max_seq = int(top.get("max_pixels", QWEN3_VL_MAX_PIXELS)) // (unit * unit)
        hf, wf = 1, max_seq
        for n in range(max_seq, 0, -1):
            hf = next(d for d in range(math.isqrt(n), 0, -1) if n % d == 0)
            wf = n // hf
            if wf / hf <= 200:
                break
        patches = (hf * m) * (wf * m)
        return patches // (m * m), 1, patches
    raise ValueError(f"encoder profile of kind {kind!r} is not simulated")


def encoder_profile_items(num_batched_tokens: int, tokens_per_item: int, engine_version, *, v0: bool = False) -> int:
    """Dummy items the profile run encodes (see the module docstring)."""
    n, t = int(num_batched_tokens), max(1, int(tokens_per_item))
    if v0:
        return max(1, n // t)
    budget = max(n, t)
    if _ver(engine_version) < (0, 10, 0):
        return max(1, -(-budget // t))
    return max(1, budget // t)


# -- module ----------------------------------------------------------------------------------
_TORCH = {"f32": torch.float32, "i64": torch.int64, "c64": torch.complex64}


class VisionTower(nn.Module):
    """Memory-equivalent vision tower + projector of one TP rank.

    Parameters are registered with vLLM's names (dots become ``__``); linears go through
    :class:`tuner.simulate.layers.Linear` with ``quant``/``prefix`` so a quantized checkpoint's
    scheme decides per layer (Llama-4 and Kimi-VL towers never get a scheme, like vLLM).
    ``forward(num_tokens)`` replays the V1 encoder profile for a ``num_tokens``-token batch and
    returns the encoder outputs the engine keeps in its encoder cache (``[items·T, H]``).

    Args:
        vision_config: vision sub-config, or the whole top-level config (preferred: the
            projector needs text and wrapper keys).
        dtype: model dtype. top: the top-level config when ``vision_config`` is the sub-dict.
        tp: tensor-parallel size. quant: the checkpoint's quantization scheme or None.
        engine_version: vLLM release (decides item counting and the Pixtral mask path).
        v0: V0 engine (encoder runs inside the forward on ``N // T`` one-item prompts).

    Raises:
        ValueError: unknown ``kind``.
    """

    def __init__(self, vision_config: dict, dtype: torch.dtype, *, kind: str, top: dict | None = None, tp: int = 1,
                 quant=None, engine_version: str = "0.19.0", v0: bool = False) -> None:
        super().__init__()
        self.vc, self.top = _split(vision_config, top)
        self.kind, self.dtype, self.tp = kind, dtype, tp
        self.engine_version, self.v0 = engine_version, v0
        self.geom = geometry(self.vc, kind=kind, top=self.top)
        use_quant = quant if kind not in ("llama4", "moonvit", "gemma4") else None
        self._dummy_batch: list = []  # V1: the profile's dummy pixel batch (kept through the text run)
        self._rope_cache = None  # MoonViT's cached 2-D rotary table (allocated on the first forward)
        self.linears = nn.ModuleDict()
        for name, shape, st in param_list(self.vc, kind=kind, top=self.top):
            key = name.replace(".", "__")
            if st == "lin":
                in_f, out_f, b = _sharded(shape, tp)
                q = use_quant if shape[5] else None
                self.linears[key] = L.Linear(in_f, out_f, dtype, bias=bool(b), quant=q, prefix=name)
            elif st in _TORCH:
                self.register_buffer(key, torch.empty(tuple(shape), dtype=_TORCH[st]), persistent=False)
            else:
                self.register_parameter(key, nn.Parameter(torch.empty(tuple(shape), dtype=dtype), requires_grad=False))

    # -- encoder pass ---------------------------------------------------------------------
    def profile_items(self, num_tokens: int) -> tuple[int, int, int, int]:
        """``(items, T, crops_per_item, patches_per_crop)`` of the encoder profile."""
        t, crops, patches = max_tokens_per_item(self.vc, kind=self.kind, top=self.top)
        return encoder_profile_items(num_tokens, t, self.engine_version, v0=self.v0), t, crops, patches

    def forward(self, num_tokens: int):
        """Replay the encoder profile; returns the encoder outputs the engine caches, or None
        for kinds whose pass is not simulated (``gemma4``: weights only).

        V1 (vllm/v1/worker/gpu_model_runner.py ``profile_run``, 0.19) binds the dummy batch
        (``batched_dummy_mm_inputs``) and the outputs to locals of ``profile_run``, so both stay
        allocated through the text dummy run and the sampler: the pixel batch is kept on
        ``self._dummy_batch`` until the next forward. V0 encodes inside the forward and frees both.
        """
        if self.kind == "gemma4":
            return None
        self._dummy_batch = []
        items, t, crops, patches = self.profile_items(num_tokens)
        h_text = _text_hidden(self.top) or self.geom.hidden
        if self.kind == "moonvit":
            return self._moonvit(items, patches)
        if self.kind == "qwen3_5":
            return self._qwen3_5(items, patches)
        if self.kind == "pixtral":
            out = self._pixtral(items, patches)
        elif self.kind == "siglip":
            out = self._siglip(items * crops, patches)
        else:
            out = self._llama4(items * crops, patches)
        del out
        return torch.empty(items * t, h_text, dtype=self.dtype)  # projected embeddings (encoder cache)

    def _e(self, *shape, dtype=None):
        return torch.empty(*shape, dtype=dtype or self.dtype)

    def _pixels(self, *shape):
        """The dummy pixel batch in the model dtype (vLLM's processor casts floating inputs to
        the model dtype, vllm/multimodal/processing/context.py); kept past the encoder in V1."""
        t = self._e(*shape)
        if not self.v0:
            self._dummy_batch.append(t)
        return t

    def _moonvit(self, items: int, patches: int):
        """MoonViT + Kimi-VL projector (vllm/model_executor/models/moonvit.py, kimi_vl.py, 0.19),
        eager, ``items`` images of ``patches`` = side² patches each (S = items·patches).

        Per block (``MoonVitEncoderLayer``): norm0, fused wqkv ``[S, 3D]``, ``apply_rope`` (q and
        k cast to float32, complex products ``[S, heads, hd/2]`` complex64, cast back), varlen
        FlashAttention output ``[S, D]`` (no mask or scores), wo, residual add; ``attn_out``
        stays bound until the block returns; MLP2 fc0 ``[S, I]`` + GELU + fc1 with norm1's output
        held by the module call. The block's input stays alive (caller's loop variable). Extras:
        the 2-D position table interpolated per image (bicubic, ``[D, side, side]``) when the grid
        differs from ``init_pos_emb`` (64x64); the rotary table ``[512, 512, hd/2]`` complex64
        computed on the first forward and kept (``cached_property``); per-image rotary slices
        concatenated to ``[S, hd/2]``; ``patch_merger`` copies ``[S, D]``; projector LayerNorm,
        ``linear_1 [S/4, 4D]``, GELU, ``linear_2 [S/4, H]`` (replicated).
        """
        g, tp = self.geom, self.tp
        d, i, dl = g.hidden, g.intermediate // tp, g.hidden // tp
        hd = d // g.heads
        side = math.isqrt(patches)
        s = items * patches
        kh, kw = (self.vc.get("merge_kernel_size") or [2, 2])[:2]
        h_text = _text_hidden(self.top) or d
        pixels = self._pixels(s, g.channels, g.patch, g.patch)
        # MoonVisionPatchEmbed: conv -> [S, D], + interpolated position table
        conv = self._e(s, d)
        ph, pw = int(self.vc.get("init_pos_emb_height", 64)), int(self.vc.get("init_pos_emb_width", 64))
        pos = []
        if (side, side) != (ph, pw):
            for _ in range(items):
                interp = self._e(1, d, side, side)
                pos.append(self._e(patches, d))  # permute(...).flatten(end_dim=1) copies
                del interp
        cat = self._e(s, d) if pos else None
        h = self._e(s, d)  # x + cat(pos_embs)
        del pos, cat, conv
        # Rope2DPosEmb.precomputed_freqs_cis (first call only), then get_freqs_cis_by_seqlens
        if self._rope_cache is None:
            n = MOONVIT_ROPE_GRID * MOONVIT_ROPE_GRID
            flat, xp, yp = (self._e(n, dtype=torch.float32) for _ in range(3))
            xf, yf = self._e(n, hd // 4, dtype=torch.float32), self._e(n, hd // 4, dtype=torch.float32)
            ones = self._e(n, hd // 4, dtype=torch.float32)
            xc = self._e(n, hd // 4, dtype=torch.complex64)
            del ones
            ones = self._e(n, hd // 4, dtype=torch.float32)
            yc = self._e(n, hd // 4, dtype=torch.complex64)
            del ones
            self._rope_cache = self._e(MOONVIT_ROPE_GRID, MOONVIT_ROPE_GRID, hd // 2, dtype=torch.complex64)
            del flat, xp, yp, xf, yf, xc, yc
        slices = [self._e(patches, hd // 2, dtype=torch.complex64) for _ in range(items)]
        freqs = self._e(s, hd // 2, dtype=torch.complex64)
        del slices
        for _ in range(g.layers):
            n0 = self._e(s, d)
            qkv = self._e(s, 3 * dl)
            qf, kf = self._e(s, dl, dtype=torch.float32), self._e(s, dl, dtype=torch.float32)
            qc, kc = self._e(s, dl // 2, dtype=torch.complex64), self._e(s, dl // 2, dtype=torch.complex64)
            q, k = self._e(s, dl), self._e(s, dl)  # .type_as(x)
            del qf, kf, qc, kc
            attn = self._e(s, dl)
            attn_out = self._e(s, d)  # wo (all-reduced)
            del attn, q, k, qkv
            hs = self._e(s, d)  # residual + attn_out
            del n0
            n1 = self._e(s, d)
            f0 = self._e(s, i)
            a = self._e(s, i)
            del f0
            f1 = self._e(s, d)
            del a
            out = self._e(s, d)  # residual + mlp
            del f1, n1, attn_out, hs
            del h
            h = out
        fl = self._e(s, d)  # final_layernorm
        del h
        merged = [self._e(patches, d) for _ in range(items)]  # patch_merger: permute(...).contiguous()
        del fl, freqs
        feats = self._e(s, d)  # torch.cat(image_features)
        normed = self._e(s, d)  # pre_norm, viewed [S/4, 4D]
        l1 = self._e(s // (kh * kw), d * kh * kw)
        del normed
        act = self._e(s // (kh * kw), d * kh * kw)
        del l1
        out = self._e(s // (kh * kw), h_text)
        del act, feats, merged
        return out  # split per image: views (encoder cache)

    def _qwen3_5(self, items: int, patches: int):
        """Qwen3-VL vision transformer + merger (vllm/model_executor/models/qwen3_vl.py
        ``Qwen3_VisionTransformer``, attention ``qwen2_5_vl.py Qwen2_5_VisionAttention``, 0.19),
        eager (``compile_mm_encoder`` off), ``items`` images of ``patches`` patches (S total).

        Patch embed ``[S, D]``; ``prepare_encoder_metadata``: per image the bilinear position
        interpolation (``pos_embed(indices)`` ``[4, hw, D]`` with int64 index grids and float32
        weights, summed and permuted to ``[hw, D]``), concatenated ``pos_embeds [S, D]`` (kept
        for the whole forward), rotary ``cos``/``sin [S, hd/2]``. Per block: norm1 (held by the
        call), qkv ``[S, 3D]``, q/k made contiguous ``[2, S, D]`` and rotated out of place
        (both kept until the attention returns), varlen FlashAttention output ``[S, D]``, proj,
        residual add; norm2, fc1 ``[S, I]``, GELU, fc2, residual add. Deepstack layers run a
        post-shuffle merger whose output is kept. Merger: LayerNorm ``[S, D]`` (kept until it
        returns), fc1 ``[S/4, 4D]``, GELU, fc2 ``[S/4, H]``; ``torch.cat`` with the deepstack
        features copies into the cached output ``[S/4, H·(1 + deepstack)]``.
        """
        g, tp = self.geom, self.tp
        d, i, dl = g.hidden, g.intermediate // tp, g.hidden // tp
        hd = d // g.heads
        s = items * patches
        m = int(self.vc.get("spatial_merge_size", 2))
        tps = int(self.vc.get("temporal_patch_size", 2))
        h_out = int(self.vc.get("out_hidden_size", _text_hidden(self.top) or d))
        ds_idx = list(self.vc.get("deepstack_visual_indexes") or [])
        pixels = self._pixels(s, g.channels * tps * g.patch * g.patch)
        pe = self._e(s, d)  # Conv3d patch embed
        outs = []
        for _ in range(items):
            hw = patches
            grids = [self._e(4, hw, dtype=torch.int64) for _ in range(3)]  # h_grid, w_grid, h_grid * side
            idx = self._e(4, hw, dtype=torch.int64)
            wf = self._e(4, hw, dtype=torch.float32)
            wb = self._e(4, hw, 1)
            emb = self._e(4, hw, d)  # pos_embed(indices); *= weights in place
            comb = self._e(hw, d)  # sum(dim=0)
            outs.append(self._e(hw, d))  # permute(...).reshape copies
            del grids, idx, wf, wb, emb, comb
        pos = self._e(s, d)  # torch.cat(outputs)
        del outs
        pos_ids = self._e(s, 2, dtype=torch.int64)
        cos, sin = self._e(s, hd // 2), self._e(s, hd // 2)
        h = self._e(s, d)  # hidden_states + pos_embeds
        del pe
        deep = []
        for li in range(g.layers):
            n1 = self._e(s, d)
            qkv = self._e(s, 3 * dl)
            qk = self._e(2, s, dl)  # rearrange(...).contiguous()
            qkr = self._e(2, s, dl)  # apply_rotary_emb
            ctx = self._e(s, dl)
            proj = self._e(s, d)
            del qkv, qk, qkr, ctx
            x1 = self._e(s, d)
            del proj, n1
            n2 = self._e(s, d)
            f1 = self._e(s, i)
            a = self._e(s, i)
            del f1
            f2 = self._e(s, d)
            del a
            x2 = self._e(s, d)
            del f2, n2, x1
            del h
            h = x2
            if li in ds_idx:
                nn_ = self._e(s // (m * m), d * m * m)
                c1 = self._e(s // (m * m), d * m * m // tp)
                c2 = self._e(s // (m * m), d * m * m // tp)
                del c1
                deep.append(self._e(s // (m * m), h_out))
                del c2, nn_
        normed = self._e(s, d)
        c1 = self._e(s // (m * m), d * m * m // tp)
        c2 = self._e(s // (m * m), d * m * m // tp)
        del c1
        merged = self._e(s // (m * m), h_out)
        del c2, normed, h
        out = self._e(s // (m * m), h_out * (1 + len(deep)))  # torch.cat([merged] + deepstack, dim=1)
        del merged, deep, pos, pos_ids, cos, sin
        return out

    def _pixtral(self, items: int, patches: int):
        g, tp = self.geom, self.tp
        d, i = g.hidden, g.intermediate // tp
        dl = d // tp  # heads·head_dim per rank
        s = items * patches
        side = (g.image_size - 1) // g.patch + 1
        pixels = self._pixels(items, g.channels, side * g.patch, side * g.patch)  # dummy batch, model dtype
        convs = [self._e(1, d, side, side) for _ in range(items)]  # patch_embeds_list (kept)
        x = self._e(1, s, d)  # cat
        x0 = self._e(1, s, d)  # ln_pre (kept by hidden_states_pool)
        del x
        cos, sin = self._e(s, d // g.heads), self._e(s, d // g.heads)
        mask = None
        if _ver(self.engine_version) >= XFORMERS_UNTIL:
            mask = self._e(s, s)  # generate_block_attention_mask: dense [S, S]
        h = x0
        for _ in range(len([k for k in self.linears if k.endswith("attention__qkv_proj")])):
            normed = self._e(s, d)
            qkv = self._e(s, 3 * dl)
            qc = self._e(s, dl); rh = self._e(s, dl // 2); cat = self._e(s, dl); del rh
            qs = self._e(s, dl); del cat
            q = self._e(s, dl); del qc, qs  # q*cos + rotate_half(q)*sin
            kc = self._e(s, dl); rh = self._e(s, dl // 2); cat = self._e(s, dl); del rh
            ks = self._e(s, dl); del cat
            k = self._e(s, dl); del kc, ks
            attn = self._e(s, dl)  # SDPA / xformers output
            r = self._e(s, d)  # o_proj (all-reduced)
            del attn, q, k, qkv, normed  # attention forward returns
            hh = self._e(s, d)  # h = hidden_states + r
            normed = self._e(s, d)
            gate_up = self._e(s, 2 * i)
            act = self._e(s, i)
            r2 = self._e(s, d)  # the attention's r stays bound until feed_forward returns
            del gate_up, act, normed, r
            out = self._e(s, d)  # h + r
            del r2, hh
            if h is not x0:
                del h
            h = out
        del cos, sin, mask, convs, pixels
        # projector (mask and pool freed when the tower returns)
        feats = self._e(s, d)  # cat(image_features)
        del h, x0
        normed = self._e(s, d)
        unf = self._e(s, d)
        del feats
        merged = self._e(s // 4, d)
        del unf, normed
        h_text = _text_hidden(self.top) or d
        a = self._e(s // 4, h_text // tp)
        b = self._e(s // 4, h_text // tp)
        del a, merged
        return b

    def _siglip(self, crops: int, patches: int):
        g, tp = self.geom, self.tp
        d, i, dl = g.hidden, g.intermediate // tp, g.hidden // tp
        s = crops * patches
        side = g.image_size // g.patch
        pixels = self._pixels(crops, g.channels, side * g.patch, side * g.patch)
        conv = self._e(crops, d, side, side)
        x0 = conv  # embeddings += position_embedding (in place)
        feats = _feature_layers(self.top, self.vc) if g.wrapper == "llava_next" else -1
        keep_all = isinstance(feats, (list, tuple))
        n_layers = len([k for k in self.linears if k.endswith("self_attn__qkv_proj")])
        pool, h = [x0], x0
        for _ in range(n_layers):
            normed = self._e(s, d)
            qkv = self._e(s, 3 * dl)
            attn = self._e(s, dl)
            r = self._e(s, d)
            del attn, qkv, normed
            hs = r  # hidden_states += residual (in place on the attention output)
            normed = self._e(s, d)
            f1 = self._e(s, i)
            act = self._e(s, i)
            del f1
            f2 = self._e(s, d)
            del act, normed
            out = f2  # += residual in place
            del hs
            if not keep_all and h is not x0:
                del h
            h = out
            if keep_all:
                pool.append(out)
        post = self._e(s, d) if g.wrapper == "gemma3" else None
        del pixels
        h_text = _text_hidden(self.top) or d
        if g.wrapper == "gemma3":
            resh = self._e(s, d)  # transpose/reshape(...).contiguous()
            del post, h, pool
            pooled = self._e(crops, int(self.top.get("mm_tokens_per_image", 256)), d)
            del resh
            normed = self._e(*pooled.shape)
            proj = self._e(crops * pooled.shape[1], h_text)
            del normed, pooled
            return proj
        n_feat = len(feats) if keep_all else 1
        cat = self._e(s, d * n_feat)
        del pool, h
        a = self._e(s, h_text // tp)
        act = self._e(s, h_text // tp)
        del a, cat
        b = self._e(s, h_text)
        del act
        return b

    def _llama4(self, tiles: int, patches: int):
        g = self.geom
        d, i = g.hidden, g.intermediate
        s = tiles * patches
        side = g.image_size // g.patch
        pixels = self._pixels(tiles, g.channels, g.image_size, g.image_size)
        unf = self._e(tiles, g.channels * g.patch * g.patch, side * side)
        emb = self._e(tiles, side * side, d)
        del unf
        x = self._e(tiles, patches, d)  # cat cls
        del emb
        x2 = self._e(tiles, patches, d)  # + position
        del x
        h = self._e(tiles, patches, d)  # layernorm_pre
        del x2
        hd = d // g.heads
        for _ in range(g.layers):
            normed = self._e(s, d)
            qkv = self._e(s, 3 * d // self.tp)
            qf = self._e(s, d // self.tp, dtype=torch.float32); kf = self._e(s, d // self.tp, dtype=torch.float32)
            q = self._e(s, d // self.tp); k = self._e(s, d // self.tp)
            del qf, kf
            attn = self._e(s, d // self.tp)
            del q, k, qkv
            r = self._e(s, d)
            del attn, normed
            hh = self._e(s, d)
            del r
            normed = self._e(s, d)
            f1 = self._e(s, i // self.tp)
            a = self._e(s, i // self.tp)
            del f1
            r = self._e(s, d)
            del a, normed
            out = self._e(s, d)
            del r, hh, h
            h = out
        del hd
        post = self._e(s, d)
        del h
        shuffled = self._e(tiles * (patches - 1) // 4, 4 * d)
        shuffled2 = self._e(tiles * (patches - 1) // 4, 4 * d)
        del shuffled, post
        pin = int(self.vc.get("projector_input_dim", 4096))
        a = self._e(shuffled2.shape[0], pin)
        b = self._e(shuffled2.shape[0], pin)
        del a, shuffled2
        c = self._e(b.shape[0], int(self.vc.get("projector_output_dim", 4096)))
        del b, pixels
        return c


# -- wrapper ----------------------------------------------------------------------------------
class MultimodalCausalLM(nn.Module):
    """A text model (:class:`tuner.simulate.layers.CausalLM` or look-alike) plus an optional
    vision tower, run as vLLM's V1 profile does: encoder pass first (its outputs stay in the
    encoder cache until the module is dropped, i.e. through the sampler), then the text dummy run
    fed with ``inputs_embeds``. V1 multimodal runners pass the persistent ``inputs_embeds`` buffer
    ``[max_num_tokens, H]`` (allocated at runner init, before the profile) instead of looking up
    token embeddings, so the text run allocates no embedding output; the simulation stands the
    buffer in with a view of an existing model-dtype weight of at least ``N·H`` elements (never a
    new allocation), falling back to a counted allocation when none is large enough. V0 embeds the
    tokens (counted) and keeps the encoder outputs only for the forward.
    """

    def __init__(self, text: nn.Module, vision: VisionTower | None, hidden: int, *, v0: bool = False) -> None:
        super().__init__()
        self.text = text
        self.vision = vision
        self.hidden = hidden
        self.v0 = v0
        self._encoder_cache = None

    def _embeds(self, n: int) -> torch.Tensor | None:
        need = n * self.hidden
        dtype = None
        for p in self.text.parameters():
            if dtype is None:
                dtype = p.dtype
            if p.dtype == dtype and p.numel() >= need and p.is_floating_point():
                return p.reshape(-1)[:need].view(n, self.hidden)
        return None

    def forward(self, input_ids, positions, intermediate=None):
        n = input_ids.shape[0]
        enc = self.vision(n) if (self.vision is not None and intermediate is None) else None
        if intermediate is None and not self.v0:
            embeds = self._embeds(n)
            if embeds is None:
                p = next(self.text.parameters())
                embeds = torch.empty(n, self.hidden, dtype=p.dtype)
            self._encoder_cache = enc
            return self.text(input_ids, positions, (embeds, None))
        out = self.text(input_ids, positions, intermediate)
        del enc
        return out

    def compute_logits(self, hidden):
        return self.text.compute_logits(hidden)

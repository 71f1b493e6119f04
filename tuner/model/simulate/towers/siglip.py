"""SigLIP (Gemma 3, LLaVA-NeXT, granite-vision): the vision tower ``kind="siglip"``
(:class:`tuner.model.simulate.vision.VisionTower`; the interface is in :mod:`tuner.model.simulate.towers`).

SigLIP (siglip.py ``SiglipVisionModel``): conv + bias, position table, L blocks of
LayerNorm / QKV+bias / out_proj+bias / fc1,fc2+bias (fc1/fc2 stay 16-bit unless both sizes are
multiples of 64), ``post_layernorm`` when every layer is used. Projector by wrapper:
Gemma-3 (gemma3_mm.py): ``mm_input_projection_weight [Dv, H]`` + ``mm_soft_emb_norm``;
LLaVA-NeXT / granite-vision (llava_next.py): ``linear_1 [H, Dv·len(feature_layers)]``,
``linear_2 [H, H]`` (+bias) and ``image_newline [H]``; with several feature layers the tower
keeps every hidden state (``return_all_hidden_states``) during the encoder pass.
"""

from __future__ import annotations

import torch

from tuner.model.simulate.towers.base import Geometry, feature_layers, layers_used, lin, text_hidden, vit_block

KIND = "siglip"
#: Whether the checkpoint's quantization scheme may take the tower's quantizable linears (vLLM
#: passes ``quant_config`` to this tower).
QUANTIZABLE = True

#: LLaVA-NeXT anyres pinpoints when a config lacks them (transformers ``LlavaNextConfig`` default).
LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


def geometry(vc: dict, top: dict) -> Geometry:
    """The tower's sizes, the vision-config values with their defaults resolved."""
    mt = str(top.get("model_type") or "")
    kind = KIND
    wrapper = "gemma3" if (mt == "gemma3" or "mm_tokens_per_image" in top) else "llava_next"
    # transformers SiglipVisionConfig defaults (so400m values for the checkpoints in use)
    return Geometry(kind, vc.get("hidden_size", 1152), vc.get("intermediate_size", 4304),
                    vc.get("num_hidden_layers", 27), vc.get("num_attention_heads", 16), vc.get("patch_size", 14),
                    vc.get("image_size", 896 if wrapper == "gemma3" else 384), vc.get("num_channels", 3), wrapper)


def params(vc: dict, top: dict, g: Geometry) -> list:
    """Parameters and buffers of the tower and its projector as vLLM allocates them (full,
    un-sharded shapes; entries as :func:`tuner.model.simulate.vision.param_list`)."""
    d = g.hidden
    i = g.intermediate
    p = g.patch
    c = g.channels
    h_text = text_hidden(top)
    out: list = []
    pre = "vision_tower.vision_model"
    npos = (g.image_size // p) ** 2
    feats = feature_layers(top, vc) if g.wrapper == "llava_next" else -1
    n_layers = layers_used(g.layers, feats) if g.wrapper == "llava_next" else g.layers
    quant_mlp = d % 64 == 0 and i % 64 == 0  # SiglipMLP: quantizable only for multiples of 64
    out += [(f"{pre}.embeddings.patch_embedding.weight", (d, c, p, p), "w"),
            (f"{pre}.embeddings.patch_embedding.bias", (d,), "w"),
            (f"{pre}.embeddings.position_embedding.weight", (npos, d), "w"),
            (f"{pre}.embeddings.position_ids", (npos,), "i64")]
    for li in range(n_layers):
        out += vit_block(f"{pre}.encoder.layers.{li}", d, i, bias=True, gated=False, quant_mlp=quant_mlp,
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
                lin("multi_modal_projector.linear_1", d * n_feat, h_text, pb, "col"),
                lin("multi_modal_projector.linear_2", h_text, h_text, pb, "row")]
    return out


def max_tokens_per_item(vc: dict, top: dict, g: Geometry) -> tuple[int, int, int]:
    """``(T, crops, patches_per_crop)`` of the largest dummy item (vLLM's
    ``get_mm_max_tokens_per_item``)."""
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


def encode(tower, items: int, t: int, crops: int, patches: int):
    """The encoder profile of ``items`` dummy items: the tower pass, then the projected
    embeddings ``[items·T, H]`` the engine keeps in its encoder cache."""
    h_text = text_hidden(tower.top) or tower.geom.hidden
    out = _encoder_pass(tower, items * crops, patches)
    del out
    return torch.empty(items * t, h_text, dtype=tower.dtype)  # projected embeddings (encoder cache)


def _encoder_pass(tower, crops: int, patches: int):
    g, tp = tower.geom, tower.tp
    d, i, dl = g.hidden, g.intermediate // tp, g.hidden // tp
    s = crops * patches
    side = g.image_size // g.patch
    pixels = tower.pixels(crops, g.channels, side * g.patch, side * g.patch)
    conv = tower.empty(crops, d, side, side)
    x0 = conv  # embeddings += position_embedding (in place)
    feats = feature_layers(tower.top, tower.vc) if g.wrapper == "llava_next" else -1
    keep_all = isinstance(feats, (list, tuple))
    n_layers = len([k for k in tower.linears if k.endswith("self_attn__qkv_proj")])
    pool, h = [x0], x0
    for _ in range(n_layers):
        normed = tower.empty(s, d)
        qkv = tower.empty(s, 3 * dl)
        attn = tower.empty(s, dl)
        r = tower.empty(s, d)
        del attn, qkv, normed
        hs = r  # hidden_states += residual (in place on the attention output)
        normed = tower.empty(s, d)
        f1 = tower.empty(s, i)
        act = tower.empty(s, i)
        del f1
        f2 = tower.empty(s, d)
        del act, normed
        out = f2  # += residual in place
        del hs
        if not keep_all and h is not x0:
            del h
        h = out
        if keep_all:
            pool.append(out)
    post = tower.empty(s, d) if g.wrapper == "gemma3" else None
    del pixels
    h_text = text_hidden(tower.top) or d
    if g.wrapper == "gemma3":
        resh = tower.empty(s, d)  # transpose/reshape(...).contiguous()
        del post, h, pool
        pooled = tower.empty(crops, int(tower.top.get("mm_tokens_per_image", 256)), d)
        del resh
        normed = tower.empty(*pooled.shape)
        proj = tower.empty(crops * pooled.shape[1], h_text)
        del normed, pooled
        return proj
    n_feat = len(feats) if keep_all else 1
    cat = tower.empty(s, d * n_feat)
    del pool, h
    a = tower.empty(s, h_text // tp)
    act = tower.empty(s, h_text // tp)
    del a, cat
    b = tower.empty(s, h_text)
    del act
    return b

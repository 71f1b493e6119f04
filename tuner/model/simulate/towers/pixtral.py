"""Pixtral (Mistral3): the vision tower ``kind="pixtral"``
(:class:`tuner.model.simulate.vision.VisionTower`; the interface is in :mod:`tuner.model.simulate.towers`).

Mistral3 (vllm/model_executor/models/pixtral.py ``PixtralHFVisionModel`` +
mistral3.py ``Mistral3MultiModalProjector``). ``patch_conv`` (no bias), ``ln_pre``, L blocks of
RMSNorm / fused QKV / o_proj / gated SiLU MLP, a float32 rotary ``inv_freq [P^2, head_dim]``
(P = image_size // patch_size); projector: RMSNorm, ``patch_merger.merging_layer [D, D·m²]``,
``linear_1 [H, D]``, ``linear_2 [H, H]``. Without xformers (not a vLLM dependency from 0.12
on) the tower builds a dense block-diagonal bf16 mask ``[S, S]`` over the S patches of all
items: for two 1540x1540 images S = 24200 and the mask alone is 1.09 GiB.
"""

from __future__ import annotations

import torch

from tuner.model.simulate.towers.base import Geometry, feature_layers, layers_used, lin, text_hidden, version_tuple, vit_block

KIND = "pixtral"
#: Whether the checkpoint's quantization scheme may take the tower's quantizable linears (vLLM
#: passes ``quant_config`` to this tower).
QUANTIZABLE = True

#: vLLM stopped depending on xformers (``requirements/cuda.txt``) after 0.11 (0.11.0 pins
#: xformers 0.0.32; 0.19.0 has none), so Pixtral falls back to SDPA with a dense mask.
XFORMERS_UNTIL = (0, 12, 0)


def geometry(vc: dict, top: dict) -> Geometry:
    """The tower's sizes, the vision-config values with their defaults resolved."""
    kind = KIND
    # transformers PixtralVisionConfig defaults
    g = Geometry(kind, vc.get("hidden_size", 1024), vc.get("intermediate_size", 4096),
                 vc.get("num_hidden_layers", 24), vc.get("num_attention_heads", 16), vc.get("patch_size", 16),
                 vc.get("image_size", 1024), vc.get("num_channels", 3), "mistral3")
    return g


def params(vc: dict, top: dict, g: Geometry) -> list:
    """Parameters and buffers of the tower and its projector as vLLM allocates them (full,
    un-sharded shapes; entries as :func:`tuner.model.simulate.vision.param_list`)."""
    d = g.hidden
    i = g.intermediate
    p = g.patch
    c = g.channels
    hd = d // g.heads
    h_text = text_hidden(top)
    out: list = []
    pre = "vision_tower"
    n_layers = layers_used(g.layers, feature_layers(top, vc))
    side = g.image_size // p
    out += [(f"{pre}.patch_conv.weight", (d, c, p, p), "w"), (f"{pre}.ln_pre.weight", (d,), "w"),
            (f"{pre}.patch_positional_embedding.inv_freq", (side * side, hd), "f32")]
    for li in range(n_layers):
        out += vit_block(f"{pre}.transformer.layers.{li}", d, i, bias=False, gated=True,
                         names=("attention.qkv_proj", "attention.o_proj", "feed_forward.gate_up_proj",
                                "feed_forward.down_proj", "attention_norm", "ffn_norm"))
    if h_text:
        m = int(top.get("spatial_merge_size", 2))
        pb = bool(top.get("multimodal_projector_bias", False))
        out += [("multi_modal_projector.norm.weight", (d,), "w"),
                lin("multi_modal_projector.patch_merger.merging_layer", d * m * m, d, False, "rep", False),
                lin("multi_modal_projector.linear_1", d, h_text, pb, "col"),
                lin("multi_modal_projector.linear_2", h_text, h_text, pb, "row")]
    return out


def max_tokens_per_item(vc: dict, top: dict, g: Geometry) -> tuple[int, int, int]:
    """``(T, crops, patches_per_crop)`` of the largest dummy item (vLLM's
    ``get_mm_max_tokens_per_item``)."""
    m = int(top.get("spatial_merge_size", 1) or 1)
    grid = (g.image_size - 1) // (g.patch * m) + 1  # PixtralHFEncoderInfo.get_patch_grid_size
    side = (g.image_size - 1) // g.patch + 1
    return grid * grid, 1, side * side


def encode(tower, items: int, t: int, crops: int, patches: int):
    """The encoder profile of ``items`` dummy items: the tower pass, then the projected
    embeddings ``[items·T, H]`` the engine keeps in its encoder cache."""
    h_text = text_hidden(tower.top) or tower.geom.hidden
    out = _encoder_pass(tower, items, patches)
    del out
    return torch.empty(items * t, h_text, dtype=tower.dtype)  # projected embeddings (encoder cache)


def _encoder_pass(tower, items: int, patches: int):
    g, tp = tower.geom, tower.tp
    d, i = g.hidden, g.intermediate // tp
    dl = d // tp  # heads·head_dim per rank
    s = items * patches
    side = (g.image_size - 1) // g.patch + 1
    pixels = tower.pixels(items, g.channels, side * g.patch, side * g.patch)  # dummy batch, model dtype
    convs = [tower.empty(1, d, side, side) for _ in range(items)]  # patch_embeds_list (kept)
    x = tower.empty(1, s, d)  # cat
    x0 = tower.empty(1, s, d)  # ln_pre (kept by hidden_states_pool)
    del x
    cos, sin = tower.empty(s, d // g.heads), tower.empty(s, d // g.heads)
    mask = None
    if version_tuple(tower.engine_version) >= XFORMERS_UNTIL:
        mask = tower.empty(s, s)  # generate_block_attention_mask: dense [S, S]
    h = x0
    for _ in range(len([k for k in tower.linears if k.endswith("attention__qkv_proj")])):
        normed = tower.empty(s, d)
        qkv = tower.empty(s, 3 * dl)
        qc = tower.empty(s, dl); rh = tower.empty(s, dl // 2); cat = tower.empty(s, dl); del rh
        qs = tower.empty(s, dl); del cat
        q = tower.empty(s, dl); del qc, qs  # q*cos + rotate_half(q)*sin
        kc = tower.empty(s, dl); rh = tower.empty(s, dl // 2); cat = tower.empty(s, dl); del rh
        ks = tower.empty(s, dl); del cat
        k = tower.empty(s, dl); del kc, ks
        attn = tower.empty(s, dl)  # SDPA / xformers output
        r = tower.empty(s, d)  # o_proj (all-reduced)
        del attn, q, k, qkv, normed  # attention forward returns
        hh = tower.empty(s, d)  # h = hidden_states + r
        normed = tower.empty(s, d)
        gate_up = tower.empty(s, 2 * i)
        act = tower.empty(s, i)
        r2 = tower.empty(s, d)  # the attention's r stays bound until feed_forward returns
        del gate_up, act, normed, r
        out = tower.empty(s, d)  # h + r
        del r2, hh
        if h is not x0:
            del h
        h = out
    del cos, sin, mask, convs, pixels
    # projector (mask and pool freed when the tower returns)
    feats = tower.empty(s, d)  # cat(image_features)
    del h, x0
    normed = tower.empty(s, d)
    unf = tower.empty(s, d)
    del feats
    merged = tower.empty(s // 4, d)
    del unf, normed
    h_text = text_hidden(tower.top) or d
    a = tower.empty(s // 4, h_text // tp)
    b = tower.empty(s // 4, h_text // tp)
    del a, merged
    return b

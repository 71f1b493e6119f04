"""Llama-4 vision model: the vision tower ``kind="llama4"``
(:class:`tuner.model.simulate.vision.VisionTower`; the interface is in :mod:`tuner.model.simulate.towers`).

Llama-4 (mllama4.py ``Llama4VisionModel``, ``Llama4MultiModalProjector``): unfold
linear, class/position embeddings, LayerNorms, L blocks with biased QKV/o/fc1/fc2, the
pixel-shuffle adapter MLP and ``linear_1 [H, vision_output_dim]``; never quantized
(vLLM passes ``quant_config=None``). Complex64 rotary cache ``[(P^2+1), head_dim/2]``.
"""

from __future__ import annotations

import torch

from tuner.model.simulate.towers.base import Geometry, lin, text_hidden, vit_block

KIND = "llama4"
#: Whether the checkpoint's quantization scheme may take the tower's quantizable linears (vLLM
#: passes ``quant_config`` to this tower).
QUANTIZABLE = False

#: Llama-4 image processor ``max_patches`` (transformers Llama4ImageProcessorFast default, also
#: the value in the published preprocessor_config.json): tiles per image, plus one global tile.
LLAMA4_MAX_TILES = 16


def geometry(vc: dict, top: dict) -> Geometry:
    """The tower's sizes, the vision-config values with their defaults resolved."""
    kind = KIND
    return Geometry(kind, vc.get("hidden_size", 1408), vc.get("intermediate_size", 5632),
                    vc.get("num_hidden_layers", 34), vc.get("num_attention_heads", 16), vc.get("patch_size", 14),
                    vc.get("image_size", 336), vc.get("num_channels", 3), "llama4")


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
    pre = "vision_model"
    npatch = (g.image_size // p) ** 2 + 1
    pin = int(vc.get("projector_input_dim", 4096))
    pout = int(vc.get("projector_output_dim", 4096))
    pbias = bool(vc.get("multi_modal_projector_bias", False))
    out += [lin(f"{pre}.patch_embedding.linear", c * p * p, d, False, "col", False),
           (f"{pre}.class_embedding", (d,), "w"), (f"{pre}.positional_embedding_vlm", (npatch, d), "w"),
           (f"{pre}.layernorm_pre.weight", (d,), "w"), (f"{pre}.layernorm_pre.bias", (d,), "w"),
           (f"{pre}.layernorm_post.weight", (d,), "w"), (f"{pre}.layernorm_post.bias", (d,), "w")]
    for li in range(g.layers):
        blk = vit_block(f"{pre}.model.layers.{li}", d, i, bias=True, gated=False,
                        names=("self_attn.qkv_proj", "self_attn.o_proj", "mlp.fc1", "mlp.fc2",
                               "input_layernorm", "post_attention_layernorm"))
        # the rotary cache is shared (get_rope caches identical instances): counted once below
        out += [(n, s, st) if st != "lin" else (n, s[:5] + (False,), st) for n, s, st in blk]
    out += [(f"{pre}.rotary_emb.cos_sin_cache", (npatch, hd // 2), "c64"),
            lin(f"{pre}.vision_adapter.mlp.fc1", i, pin, pbias, "col", False),
            lin(f"{pre}.vision_adapter.mlp.fc2", pin, pout, pbias, "row", False)]
    if h_text:
        out.append(lin("multi_modal_projector.linear_1", int(vc.get("vision_output_dim", pout)), h_text,
                       False, "col", False))
    return out


def max_tokens_per_item(vc: dict, top: dict, g: Geometry) -> tuple[int, int, int]:
    """``(T, crops, patches_per_crop)`` of the largest dummy item (vLLM's
    ``get_mm_max_tokens_per_item``)."""
    side = g.image_size // g.patch
    ratio = float(vc.get("pixel_shuffle_ratio", 0.5))
    per_tile = int(side * side * ratio * ratio)
    tiles = LLAMA4_MAX_TILES + 1  # 16:1 image -> 16 tiles + the global tile
    return tiles * per_tile, tiles, side * side + 1


def encode(tower, items: int, t: int, crops: int, patches: int):
    """The encoder profile of ``items`` dummy items: the tower pass, then the projected
    embeddings ``[items·T, H]`` the engine keeps in its encoder cache."""
    h_text = text_hidden(tower.top) or tower.geom.hidden
    out = _encoder_pass(tower, items * crops, patches)
    del out
    return torch.empty(items * t, h_text, dtype=tower.dtype)  # projected embeddings (encoder cache)


def _encoder_pass(tower, tiles: int, patches: int):
    g = tower.geom
    d, i = g.hidden, g.intermediate
    s = tiles * patches
    side = g.image_size // g.patch
    pixels = tower.pixels(tiles, g.channels, g.image_size, g.image_size)
    unf = tower.empty(tiles, g.channels * g.patch * g.patch, side * side)
    emb = tower.empty(tiles, side * side, d)
    del unf
    x = tower.empty(tiles, patches, d)  # cat cls
    del emb
    x2 = tower.empty(tiles, patches, d)  # + position
    del x
    h = tower.empty(tiles, patches, d)  # layernorm_pre
    del x2
    hd = d // g.heads
    for _ in range(g.layers):
        normed = tower.empty(s, d)
        qkv = tower.empty(s, 3 * d // tower.tp)
        qf = tower.empty(s, d // tower.tp, dtype=torch.float32); kf = tower.empty(s, d // tower.tp, dtype=torch.float32)
        q = tower.empty(s, d // tower.tp); k = tower.empty(s, d // tower.tp)
        del qf, kf
        attn = tower.empty(s, d // tower.tp)
        del q, k, qkv
        r = tower.empty(s, d)
        del attn, normed
        hh = tower.empty(s, d)
        del r
        normed = tower.empty(s, d)
        f1 = tower.empty(s, i // tower.tp)
        a = tower.empty(s, i // tower.tp)
        del f1
        r = tower.empty(s, d)
        del a, normed
        out = tower.empty(s, d)
        del r, hh, h
        h = out
    del hd
    post = tower.empty(s, d)
    del h
    shuffled = tower.empty(tiles * (patches - 1) // 4, 4 * d)
    shuffled2 = tower.empty(tiles * (patches - 1) // 4, 4 * d)
    del shuffled, post
    pin = int(tower.vc.get("projector_input_dim", 4096))
    a = tower.empty(shuffled2.shape[0], pin)
    b = tower.empty(shuffled2.shape[0], pin)
    del a, shuffled2
    c = tower.empty(b.shape[0], int(tower.vc.get("projector_output_dim", 4096)))
    del b, pixels
    return c

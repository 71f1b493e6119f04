"""Qwen3-VL vision transformer (Qwen3.5 / 3.6): the vision tower ``kind="qwen3_5"``
(:class:`tuner.model.simulate.vision.VisionTower`; the interface is in :mod:`tuner.model.simulate.towers`).

Qwen3.5/3.6 (qwen3_vl.py ``Qwen3_VisionTransformer``): Conv3d + bias, position
table, L blocks (LayerNorms, biased qkv/proj/fc1/fc2), merger (LayerNorm, ``linear_fc1 [4D,4D]``,
``linear_fc2 [H, 4D]``), bf16 rotary cache ``[8192, head_dim/2]``. Encoder pass: the image
with the most features under the processor's 16.8 MP limit (4096², 65536 patches, T = 16384
tokens; budget ``max(N, T)`` gives one image for N <= 16384), bilinear position interpolation,
q/k contiguous copy + out-of-place rotary, varlen FlashAttention.
"""

from __future__ import annotations

import math

import torch

from tuner.model.simulate.towers.base import Geometry, lin, text_hidden, vit_block

KIND = "qwen3_5"
#: Whether the checkpoint's quantization scheme may take the tower's quantizable linears (vLLM
#: passes ``quant_config`` to this tower).
QUANTIZABLE = True
#: The modalities the tower serves (vLLM 0.19 qwen3_vl.py / qwen3_5.py ``_mark_tower_model(vllm_config, {"image", "video"})``):
#: it is not built only when both are limited to 0 (:func:`tuner.model.simulate.vision.drop_unbuilt_towers`).
MODALITIES = ("image", "video")

#: Qwen3-VL / Qwen3.5 image processor ``size.longest_edge`` (max pixels per image) of the
#: published preprocessor_config.json (16777216 = 4096²); video frames are capped at
#: ``25165824 / temporal_patch_size`` pixels (video_preprocessor_config.json), so an image is
#: the modality with the most tokens. A top-level ``max_pixels`` key wins.
QWEN3_VL_MAX_PIXELS = 16777216
QWEN3_VL_VIDEO_MAX_PIXELS = 25165824


def geometry(vc: dict, top: dict) -> Geometry:
    """The tower's sizes, the vision-config values with their defaults resolved."""
    kind = KIND
    return Geometry(kind, vc.get("hidden_size", 1152), vc.get("intermediate_size", 4304),
                    vc.get("depth", vc.get("num_hidden_layers", 27)), vc.get("num_heads", 16),
                    vc.get("patch_size", 16), 0, vc.get("in_channels", 3), "qwen3_5")


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
    pre = "visual"
    t = vc.get("temporal_patch_size", 2)
    m = vc.get("spatial_merge_size", 2)
    h_out = int(vc.get("out_hidden_size", h_text or d))
    npos = int(vc.get("num_position_embeddings", 2304))
    out += [(f"{pre}.patch_embed.proj.weight", (d, c, t, p, p), "w"), (f"{pre}.patch_embed.proj.bias", (d,), "w"),
            (f"{pre}.pos_embed.weight", (npos, d), "w"), (f"{pre}.rotary_pos_emb.cos_sin_cache", (8192, hd // 2), "w")]
    for li in range(g.layers):
        out += vit_block(f"{pre}.blocks.{li}", d, i, bias=True, gated=False,
                         names=("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2", "norm1", "norm2"))
    dm = d * m * m
    n_merge = 1 + len(vc.get("deepstack_visual_indexes") or [])
    for k in range(n_merge):
        mp = f"{pre}.merger" if k == 0 else f"{pre}.deepstack_merger_list.{k - 1}"
        nd = d if k == 0 else dm  # deepstack mergers use the post-shuffle norm
        out += [(f"{mp}.norm.weight", (nd,), "w"), (f"{mp}.norm.bias", (nd,), "w"),
                lin(f"{mp}.linear_fc1", dm, dm, True, "col"), lin(f"{mp}.linear_fc2", dm, h_out, True, "row")]
    return out


def max_tokens_per_item(vc: dict, top: dict, g: Geometry) -> tuple[int, int, int]:
    """``(T, crops, patches_per_crop)`` of the largest dummy item (vLLM's
    ``get_mm_max_tokens_per_item``)."""
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


def encode(tower, items: int, t: int, crops: int, patches: int):
    """The encoder profile of ``items`` dummy items; returns the encoder outputs the engine
    caches."""
    return _encoder_pass(tower, items, patches)


def _encoder_pass(tower, items: int, patches: int):
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
    g, tp = tower.geom, tower.tp
    d, i, dl = g.hidden, g.intermediate // tp, g.hidden // tp
    hd = d // g.heads
    s = items * patches
    m = int(tower.vc.get("spatial_merge_size", 2))
    tps = int(tower.vc.get("temporal_patch_size", 2))
    h_out = int(tower.vc.get("out_hidden_size", text_hidden(tower.top) or d))
    ds_idx = list(tower.vc.get("deepstack_visual_indexes") or [])
    pixels = tower.pixels(s, g.channels * tps * g.patch * g.patch)
    pe = tower.empty(s, d)  # Conv3d patch embed
    outs = []
    for _ in range(items):
        hw = patches
        grids = [tower.empty(4, hw, dtype=torch.int64) for _ in range(3)]  # h_grid, w_grid, h_grid * side
        idx = tower.empty(4, hw, dtype=torch.int64)
        wf = tower.empty(4, hw, dtype=torch.float32)
        wb = tower.empty(4, hw, 1)
        emb = tower.empty(4, hw, d)  # pos_embed(indices); *= weights in place
        comb = tower.empty(hw, d)  # sum(dim=0)
        outs.append(tower.empty(hw, d))  # permute(...).reshape copies
        del grids, idx, wf, wb, emb, comb
    pos = tower.empty(s, d)  # torch.cat(outputs)
    del outs
    pos_ids = tower.empty(s, 2, dtype=torch.int64)
    cos, sin = tower.empty(s, hd // 2), tower.empty(s, hd // 2)
    h = tower.empty(s, d)  # hidden_states + pos_embeds
    del pe
    deep = []
    for li in range(g.layers):
        n1 = tower.empty(s, d)
        qkv = tower.empty(s, 3 * dl)
        qk = tower.empty(2, s, dl)  # rearrange(...).contiguous()
        qkr = tower.empty(2, s, dl)  # apply_rotary_emb
        ctx = tower.empty(s, dl)
        proj = tower.empty(s, d)
        del qkv, qk, qkr, ctx
        x1 = tower.empty(s, d)
        del proj, n1
        n2 = tower.empty(s, d)
        f1 = tower.empty(s, i)
        a = tower.empty(s, i)
        del f1
        f2 = tower.empty(s, d)
        del a
        x2 = tower.empty(s, d)
        del f2, n2, x1
        del h
        h = x2
        if li in ds_idx:
            nn_ = tower.empty(s // (m * m), d * m * m)
            c1 = tower.empty(s // (m * m), d * m * m // tp)
            c2 = tower.empty(s // (m * m), d * m * m // tp)
            del c1
            deep.append(tower.empty(s // (m * m), h_out))
            del c2, nn_
    normed = tower.empty(s, d)
    c1 = tower.empty(s // (m * m), d * m * m // tp)
    c2 = tower.empty(s // (m * m), d * m * m // tp)
    del c1
    merged = tower.empty(s // (m * m), h_out)
    del c2, normed, h
    out = tower.empty(s // (m * m), h_out * (1 + len(deep)))  # torch.cat([merged] + deepstack, dim=1)
    del merged, deep, pos, pos_ids, cos, sin
    return out

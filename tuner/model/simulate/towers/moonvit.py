"""MoonViT (Kimi-VL): the vision tower ``kind="moonvit"``
(:class:`tuner.model.simulate.vision.VisionTower`; the interface is in :mod:`tuner.model.simulate.towers`).

Kimi-VL (moonvit.py ``MoonVitPretrainedModel`` + kimi_vl.py projector): conv+bias,
learnable 2-D position table ``[64, 64, D]``, L blocks (LayerNorms, biased wqkv/wo, fc0/fc1),
final LayerNorm; projector ``pre_norm``, ``linear_1 [4D, 4D]``, ``linear_2 [H, 4D]``
(replicated, 16-bit). Encoder pass: ``max(N, T) // T`` dummy 1024² images, each scaled to the
processor's ``in_token_limit`` (4096 patches) and padded to the 28-pixel merge unit: 66x66
patches, T = 1089 tokens (7 images at N = 8192); float32/complex64 rotary products per block,
varlen FlashAttention (no scores); the 512x512 complex64 rotary table is built on the first
forward and stays allocated (a ``cached_property``).
"""

from __future__ import annotations

import math

import torch

from tuner.model.simulate.towers.base import Geometry, lin, text_hidden, vit_block

KIND = "moonvit"
#: Whether the checkpoint's quantization scheme may take the tower's quantizable linears (vLLM
#: passes ``quant_config`` to this tower).
QUANTIZABLE = False

#: Kimi-VL dummy image (vllm/model_executor/models/kimi_vl.py ``MaxImageTokenMeta``: 1024x1024)
#: and the image processor's ``in_token_limit`` (patches per image before the 2x2 merge) and
#: ``pad_input`` of Kimi-VL-A3B's preprocessor_config.json (4096 patches = 0.8 MP; the 2506
#: release raised it to 16384). A vision config's own ``in_token_limit`` wins.
KIMI_DUMMY_IMAGE = 1024
KIMI_IN_TOKEN_LIMIT = 4096

#: MoonViT's 2-D rotary table ``Rope2DPosEmb(head_dim, 512, 512)`` (moonvit.py), complex64,
#: computed on the GPU on the first encoder forward (a ``cached_property``) and kept.
MOONVIT_ROPE_GRID = 512


def geometry(vc: dict, top: dict) -> Geometry:
    """The tower's sizes, the vision-config values with their defaults resolved."""
    kind = KIND
    # vLLM vllm/transformers_utils/configs/moonvit.py MoonViTConfig defaults
    return Geometry(kind, vc.get("hidden_size", 1152), vc.get("intermediate_size", 4304),
                    vc.get("num_hidden_layers", 27), vc.get("num_attention_heads", 16), vc.get("patch_size", 14),
                    0, 3, "kimi_vl")


def params(vc: dict, top: dict, g: Geometry) -> list:
    """Parameters and buffers of the tower and its projector as vLLM allocates them (full,
    un-sharded shapes; entries as :func:`tuner.model.simulate.vision.param_list`)."""
    d = g.hidden
    i = g.intermediate
    p = g.patch
    h_text = text_hidden(top)
    out: list = []
    pre = "vision_tower"
    ph, pw = vc.get("init_pos_emb_height", 64), vc.get("init_pos_emb_width", 64)
    mk = vc.get("merge_kernel_size", [2, 2])
    out += [(f"{pre}.patch_embed.proj.weight", (d, 3, p, p), "w"), (f"{pre}.patch_embed.proj.bias", (d,), "w"),
            (f"{pre}.patch_embed.pos_emb.weight", (ph, pw, d), "w")]
    for li in range(g.layers):
        blk = vit_block(f"{pre}.encoder.blocks.{li}", d, i, bias=True, gated=False,
                        names=("wqkv", "wo", "mlp.fc0", "mlp.fc1", "norm0", "norm1"))
        out += [(n, s, st) if st != "lin" else (n, s[:5] + (False,), st) for n, s, st in blk]
    out += [(f"{pre}.encoder.final_layernorm.weight", (d,), "w"), (f"{pre}.encoder.final_layernorm.bias", (d,), "w")]
    if h_text:
        dm = d * mk[0] * mk[1]
        out += [("multi_modal_projector.pre_norm.weight", (d,), "w"), ("multi_modal_projector.pre_norm.bias", (d,), "w"),
                lin("multi_modal_projector.linear_1", dm, dm, True, "rep", False),
                lin("multi_modal_projector.linear_2", dm, h_text, True, "rep", False)]
    return out


def max_tokens_per_item(vc: dict, top: dict, g: Geometry) -> tuple[int, int, int]:
    """``(T, crops, patches_per_crop)`` of the largest dummy item (vLLM's
    ``get_mm_max_tokens_per_item``)."""
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


def encode(tower, items: int, t: int, crops: int, patches: int):
    """The encoder profile of ``items`` dummy items; returns the encoder outputs the engine
    caches."""
    return _encoder_pass(tower, items, patches)


def _encoder_pass(tower, items: int, patches: int):
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
    g, tp = tower.geom, tower.tp
    d, i, dl = g.hidden, g.intermediate // tp, g.hidden // tp
    hd = d // g.heads
    side = math.isqrt(patches)
    s = items * patches
    kh, kw = (tower.vc.get("merge_kernel_size") or [2, 2])[:2]
    h_text = text_hidden(tower.top) or d
    pixels = tower.pixels(s, g.channels, g.patch, g.patch)
    # MoonVisionPatchEmbed: conv -> [S, D], + interpolated position table
    conv = tower.empty(s, d)
    ph, pw = int(tower.vc.get("init_pos_emb_height", 64)), int(tower.vc.get("init_pos_emb_width", 64))
    pos = []
    if (side, side) != (ph, pw):
        for _ in range(items):
            interp = tower.empty(1, d, side, side)
            pos.append(tower.empty(patches, d))  # permute(...).flatten(end_dim=1) copies
            del interp
    cat = tower.empty(s, d) if pos else None
    h = tower.empty(s, d)  # x + cat(pos_embs)
    del pos, cat, conv
    # Rope2DPosEmb.precomputed_freqs_cis (first call only), then get_freqs_cis_by_seqlens
    if tower._rope_cache is None:
        n = MOONVIT_ROPE_GRID * MOONVIT_ROPE_GRID
        flat, xp, yp = (tower.empty(n, dtype=torch.float32) for _ in range(3))
        xf, yf = tower.empty(n, hd // 4, dtype=torch.float32), tower.empty(n, hd // 4, dtype=torch.float32)
        ones = tower.empty(n, hd // 4, dtype=torch.float32)
        xc = tower.empty(n, hd // 4, dtype=torch.complex64)
        del ones
        ones = tower.empty(n, hd // 4, dtype=torch.float32)
        yc = tower.empty(n, hd // 4, dtype=torch.complex64)
        del ones
        tower._rope_cache = tower.empty(MOONVIT_ROPE_GRID, MOONVIT_ROPE_GRID, hd // 2, dtype=torch.complex64)
        del flat, xp, yp, xf, yf, xc, yc
    slices = [tower.empty(patches, hd // 2, dtype=torch.complex64) for _ in range(items)]
    freqs = tower.empty(s, hd // 2, dtype=torch.complex64)
    del slices
    for _ in range(g.layers):
        n0 = tower.empty(s, d)
        qkv = tower.empty(s, 3 * dl)
        qf, kf = tower.empty(s, dl, dtype=torch.float32), tower.empty(s, dl, dtype=torch.float32)
        qc, kc = tower.empty(s, dl // 2, dtype=torch.complex64), tower.empty(s, dl // 2, dtype=torch.complex64)
        q, k = tower.empty(s, dl), tower.empty(s, dl)  # .type_as(x)
        del qf, kf, qc, kc
        attn = tower.empty(s, dl)
        attn_out = tower.empty(s, d)  # wo (all-reduced)
        del attn, q, k, qkv
        hs = tower.empty(s, d)  # residual + attn_out
        del n0
        n1 = tower.empty(s, d)
        f0 = tower.empty(s, i)
        a = tower.empty(s, i)
        del f0
        f1 = tower.empty(s, d)
        del a
        out = tower.empty(s, d)  # residual + mlp
        del f1, n1, attn_out, hs
        del h
        h = out
    fl = tower.empty(s, d)  # final_layernorm
    del h
    merged = [tower.empty(patches, d) for _ in range(items)]  # patch_merger: permute(...).contiguous()
    del fl, freqs
    feats = tower.empty(s, d)  # torch.cat(image_features)
    normed = tower.empty(s, d)  # pre_norm, viewed [S/4, 4D]
    l1 = tower.empty(s // (kh * kw), d * kh * kw)
    del normed
    act = tower.empty(s // (kh * kw), d * kh * kw)
    del l1
    out = tower.empty(s // (kh * kw), h_text)
    del act, feats, merged
    return out  # split per image: views (encoder cache)

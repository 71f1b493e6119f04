"""What every vision tower module shares: the :class:`Geometry` of a tower, vision-config
helpers, and the entries of a parameter list.

Parameter-list entries are ``(name, shape, storage)`` with storage ``"w"`` (model dtype),
``"f32"``, ``"i64"``, ``"c64"``, or ``(name, ("lin", in, out, bias, split, quantizable), "lin")``
for linears (:func:`lin`), ``split`` = ``"col"`` | ``"row"`` | ``"rep"`` (column-, row-parallel or
replicated under tensor parallelism). Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass


def version_tuple(v) -> tuple:
    """``"0.19.0"`` (or a tuple) → ``(0, 19, 0)``; non-digits in a part are ignored."""
    if isinstance(v, tuple):
        return v
    parts = []
    for p in str(v).split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def split_config(cfg: dict, top: dict | None) -> tuple[dict, dict]:
    """Accept either the vision_config or the whole top-level config as the first argument."""
    if isinstance(cfg.get("vision_config"), dict):
        return cfg["vision_config"], cfg
    return cfg, (top or {})


def text_hidden(top: dict) -> int | None:
    """The text model's ``hidden_size`` (``text_config`` first), or None: what projectors map into."""
    tc = top.get("text_config") if isinstance(top.get("text_config"), dict) else {}
    return tc.get("hidden_size") or top.get("hidden_size")


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


def feature_layers(top: dict, vc: dict):
    """``vision_feature_layer`` of the wrapper (else of the vision config; -1: the last layer)."""
    return top.get("vision_feature_layer", vc.get("vision_feature_layer", -1))


def layers_used(total: int, feature_layers) -> int:
    """``_get_num_hidden_layers`` (llava.py / mistral3.py): layers up to the deepest feature layer."""
    idx = feature_layers if isinstance(feature_layers, (list, tuple)) else [feature_layers]
    return max((total + i + 1) if i < 0 else i for i in idx)


def lin(name, in_f, out_f, bias, split, quantizable=True):
    """A linear entry of a parameter list (split ``col`` | ``row`` | ``rep``)."""
    return (name, ("lin", in_f, out_f, bias, split, quantizable), "lin")


def vit_block(prefix, d, i, *, bias, gated, names, quant_mlp=True):
    """Parameter entries of one ViT block: two norms (LayerNorm with ``bias``, else RMSNorm),
    fused QKV, output projection and a (``gated``) MLP; ``names`` = (qkv, o, fc1, fc2, norm1, norm2)."""
    q, o, f1, f2, n1, n2 = names
    out = [
        (f"{prefix}.{n1}.weight", (d,), "w"),
        lin(f"{prefix}.{q}", d, 3 * d, bias, "col"),
        lin(f"{prefix}.{o}", d, d, bias, "row"),
        (f"{prefix}.{n2}.weight", (d,), "w"),
    ]
    if bias:  # LayerNorm
        out.insert(1, (f"{prefix}.{n1}.bias", (d,), "w"))
        out.append((f"{prefix}.{n2}.bias", (d,), "w"))
    if gated:
        out += [lin(f"{prefix}.{f1}", d, 2 * i, bias, "col", quant_mlp), lin(f"{prefix}.{f2}", i, d, bias, "row", quant_mlp)]
    else:
        out += [lin(f"{prefix}.{f1}", d, i, bias, "col", quant_mlp), lin(f"{prefix}.{f2}", i, d, bias, "row", quant_mlp)]
    return out

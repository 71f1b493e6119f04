"""Gemma 4 vision tower: the vision tower ``kind="gemma4"``
(:class:`tuner.model.simulate.vision.VisionTower`; the interface is in :mod:`tuner.model.simulate.towers`).

Gemma 4 (transformers ``Gemma4VisionModel``, built by vLLM 0.19 gemma4_mm.py with
``AutoModel.from_config``: plain ``nn.Linear`` without bias, never TP-sharded or quantized):
patch ``input_proj [D, 3p²]``, 2-D position table ``[2, 10240, D]``, L blocks of separate
q/k/v/o, q/k norms ``[hd]``, 4 RMSNorms, gated MLP gate/up/down; ``std_bias``/``std_scale``
when ``standardize``; float32 axial rotary ``inv_freq``; projector
``embed_vision.embedding_projection [H, D]`` (weightless norm). Weights only.
"""

from __future__ import annotations


from tuner.model.simulate.towers.base import Geometry, lin, text_hidden

KIND = "gemma4"
#: Whether the checkpoint's quantization scheme may take the tower's quantizable linears (vLLM
#: passes ``quant_config`` to this tower).
QUANTIZABLE = False
#: The modalities the tower serves (vLLM 0.19 gemma4_mm.py ``_mark_tower_model(vllm_config, {"image", "video"})``):
#: it is not built only when both are limited to 0 (:func:`tuner.model.simulate.vision.drop_unbuilt_towers`).
MODALITIES = ("image", "video")


def geometry(vc: dict, top: dict) -> Geometry:
    """The tower's sizes, the vision-config values with their defaults resolved."""
    kind = KIND
    # transformers Gemma4VisionConfig defaults
    return Geometry(kind, vc.get("hidden_size", 1152), vc.get("intermediate_size", 4304),
                    vc.get("num_hidden_layers", 27), vc.get("num_attention_heads", 16), vc.get("patch_size", 16),
                    0, 3, "gemma4")


def params(vc: dict, top: dict, g: Geometry) -> list:
    """Parameters and buffers of the tower and its projector as vLLM allocates them (full,
    un-sharded shapes; entries as :func:`tuner.model.simulate.vision.param_list`)."""
    d = g.hidden
    i = g.intermediate
    p = g.patch
    hd = d // g.heads
    h_text = text_hidden(top)
    out: list = []
    # transformers Gemma4VisionModel (vLLM 0.19 gemma4_mm.py builds it with AutoModel.from_config:
    # plain nn.Linear, no TP sharding, no quantization) + vLLM's Gemma4MultimodalEmbedder
    # (ReplicatedLinear without quant_config, weightless RMSNorm).
    pre = "vision_tower"
    hdv = int(vc.get("head_dim") or hd)
    kvh = int(vc.get("num_key_value_heads") or g.heads)
    npos = int(vc.get("position_embedding_size", 10240))
    clipped = bool(vc.get("use_clipped_linears", False))
    out += [lin(f"{pre}.patch_embedder.input_proj", 3 * p * p, d, False, "rep", False),
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
            out.append(lin(f"{b}.{n}.linear", fi, fo, False, "rep", False))
            if clipped:  # input/output min/max scalars (default dtype)
                out += [(f"{b}.{n}.{m}", (), "w") for m in ("input_min", "input_max", "output_min", "output_max")]
        out += [(f"{b}.self_attn.q_norm.weight", (hdv,), "w"), (f"{b}.self_attn.k_norm.weight", (hdv,), "w")]
        out += [(f"{b}.{n}.weight", (d,), "w") for n in ("input_layernorm", "post_attention_layernorm",
                                                        "pre_feedforward_layernorm", "post_feedforward_layernorm")]
    if vc.get("standardize", False):
        out += [(f"{pre}.std_bias", (d,), "w"), (f"{pre}.std_scale", (d,), "w")]
    if h_text:
        dim = int(vc.get("output_proj_dims") or d)
        out.append(lin("embed_vision.embedding_projection", dim, h_text, False, "rep", False))
    return out


def audio_tower(audio_config: dict, top: dict, dtype):
    """Gemma 4's audio tower and its projector on one rank, as vLLM 0.19 gemma4_mm.py builds them
    when the checkpoint has an ``audio_config``: ``AutoModel.from_config(config.audio_config)``
    (transformers ``Gemma4AudioModel``, a conformer: subsampling convolutions, clipped linears,
    relative-position attention; plain ``nn.Linear``, never TP-sharded or quantized) plus
    ``post_init()`` (buffers absent from the checkpoint: ``inv_timescales``, the clip bounds), and
    ``embed_audio = Gemma4MultimodalEmbedder`` (``ReplicatedLinear(output_proj_dims or hidden_size,
    text hidden)`` without bias, weightless RMSNorm). The tower is transformers' own class built on
    the meta device in the model dtype (vLLM builds the model under ``set_default_torch_dtype``),
    so its parameters and buffers are the installed transformers' (transformers' defaults:
    304,824,608 parameters). Weights only: the audio encoder's profile pass is not simulated.

    Returns a module holding ``audio_tower`` and ``embed_audio``. Raises PluginError when the
    installed transformers has no Gemma 4 audio model."""
    import torch
    from torch import nn

    from tuner.errors import PluginError
    from tuner.model.simulate import layers as L
    from tuner.model.transformers_lean import import_transformers

    tf = import_transformers()
    try:
        cfg_cls = getattr(tf, "Gemma4AudioConfig")
        model_cls = getattr(tf, "Gemma4AudioModel")
    except AttributeError:
        raise PluginError(f"transformers {getattr(tf, '__version__', '?')} has no Gemma4AudioModel: the Gemma 4 "
                          "audio tower (audio_config) cannot be sized; install transformers >= 5", where="gemma") from None
    known = set(cfg_cls().to_dict())
    cfg = cfg_cls(**{k: v for k, v in audio_config.items() if k in known and k != "model_type"})
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            tower = model_cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    h_text = text_hidden(top) or int(cfg.hidden_size)
    dim = int(getattr(cfg, "output_proj_dims", None) or cfg.hidden_size)
    holder = nn.Module()
    holder.audio_tower = tower
    holder.embed_audio = L.Linear(dim, h_text, dtype)
    return holder

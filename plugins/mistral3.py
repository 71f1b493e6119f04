"""Mistral3 plugin: Mistral-Small-3.x (``Mistral3ForConditionalGeneration``) = a Mistral text
decoder plus a Pixtral vision tower and projector.

Follows vllm/model_executor/models/mistral3.py (0.19.0): the language model is vLLM's
``MistralForCausalLM`` (= ``LlamaForCausalLM``), modelled by the generic plugin's decoder
(subclassed, not copied); the vision tower (``PixtralHFVisionModel``, every vision layer up to
``vision_feature_layer``) and ``Mistral3MultiModalProjector`` come from
:mod:`tuner.model.simulate.vision` (kind ``pixtral``) and sit on every pipeline stage, like vLLM's
wrapper. The profile pass is vLLM's V1 multimodal profile: the Pixtral encoder on
``max(N, T) // T`` dummy images of ``image_size``² (T = 55² = 3025 tokens for 1540-pixel
images), outputs kept in the encoder cache, then the text dummy run fed from the persistent
``inputs_embeds`` buffer (no embedding output allocated). Quantized checkpoints: every linear of
the tower and projector is offered to the checkpoint's scheme with its vLLM prefix
(``vision_tower.transformer.layers.N...``, ``multi_modal_projector.linear_1``), which keeps
modules its ignore list names in 16-bit.

Partial configs (Mistral-Small-3.2's published facts lack most keys): missing text keys take the
Mistral3 family values of transformers' ``Mistral3Config`` default sub-configs (the
Mistral-Small-3.1-24B file: intermediate 32768, vocab 131072, 131072 positions, rope_theta 1e9,
no sliding window); a missing ``vision_config`` takes that class's Pixtral default (hidden 1024,
24 layers, 16 heads, intermediate 4096, patch 14, image 1540), ``spatial_merge_size`` 2,
``multimodal_projector_bias`` false, ``vision_feature_layer`` -1.
"""

from __future__ import annotations

import dataclasses

from tuner.plugins.generic import _DTYPES, GenericDecoderPlugin
from tuner.model.plugin import RankSettings

#: transformers ``Mistral3Config`` sub-config defaults (the Mistral-Small-3.1-24B values).
TEXT_DEFAULTS = {"intermediate_size": 32768, "vocab_size": 131072, "max_position_embeddings": 131072,
                 "rope_theta": 1.0e9, "sliding_window": None, "head_dim": 128, "rms_norm_eps": 1e-5}
VISION_DEFAULTS = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                   "patch_size": 14, "image_size": 1540, "head_dim": 64, "num_channels": 3, "hidden_act": "gelu",
                   "model_type": "pixtral"}
TOP_DEFAULTS = {"spatial_merge_size": 2, "multimodal_projector_bias": False, "vision_feature_layer": -1,
                "projector_hidden_act": "gelu"}


def effective_top(top: dict, text_defaults: dict, vision_defaults: dict, top_defaults: dict) -> dict:
    """The top-level config with family defaults under every key the file lacks (file wins)."""
    out = {**top_defaults, **top}
    out["text_config"] = {**text_defaults, **(top.get("text_config") or {})}
    out["vision_config"] = {**vision_defaults, **(top.get("vision_config") or {})}
    return out


def effective_spec(spec, text_defaults: dict):
    """``spec`` with the family defaults for text keys the JSON file itself lacks.

    transformers fills a partial ``text_config`` with its class defaults (e.g. MistralConfig's
    intermediate 14336, vocab 32000, sliding window 4096), which would otherwise win over the
    plugin's :meth:`config_defaults`; only keys absent from the file are replaced.
    """
    tc = spec.top.get("text_config") if isinstance(spec.top.get("text_config"), dict) else spec.top
    fields = {f.name for f in dataclasses.fields(spec)} - {"raw", "top", "path", "config_sha256"}
    changes, raw = {}, dict(spec.raw)
    for key, value in text_defaults.items():
        if key in tc or (key == "tie_word_embeddings" and key in spec.top):
            continue
        raw[key] = value
        if key in fields:
            changes[key] = value
    if "head_dim" in changes:
        changes["rotary_dim"] = int(changes["head_dim"])
    if not changes and raw == spec.raw:
        return spec
    return dataclasses.replace(spec, raw=raw, **changes)


class Mistral3Plugin(GenericDecoderPlugin):
    """Mistral text decoder (generic) + Pixtral tower/projector + V1 encoder profile. Other
    "generic decoder + vision tower" wrappers subclass it with their ``vision_kind`` and defaults."""

    name = "mistral3"
    architectures = ("Mistral3ForConditionalGeneration",)
    #: The :mod:`tuner.model.simulate.vision` tower kind of this wrapper.
    vision_kind = "pixtral"

    def config_defaults(self, top: dict) -> dict:
        """Mistral3 family text defaults (transformers ``Mistral3Config``; see module docstring)."""
        return dict(TEXT_DEFAULTS)

    def text_defaults(self, spec) -> dict:
        """Family defaults for text keys the file lacks (they beat transformers' class defaults)."""
        return TEXT_DEFAULTS

    def top_config(self, spec) -> dict:
        return effective_top(spec.top, TEXT_DEFAULTS, VISION_DEFAULTS, TOP_DEFAULTS)

    def kv_cache_spec(self, spec, settings: RankSettings) -> dict:
        return super().kv_cache_spec(effective_spec(spec, self.text_defaults(spec)), settings)

    def build_model(self, spec, settings: RankSettings):
        import torch

        from tuner.memory.quant import scheme_for
        from tuner.model.simulate.vision import MultimodalCausalLM, VisionTower

        spec = effective_spec(spec, self.text_defaults(spec))
        text = super().build_model(spec, settings)
        dtype = getattr(torch, _DTYPES.get(settings.dtype, "bfloat16"))
        v0 = settings.runs_attention
        vision = None
        if settings.pp_rank == 0 or not v0:
            # the Mistral format (PixtralForConditionalGeneration, vllm/model_executor/models/pixtral.py
            # 0.19: VisionTransformer of plain nn.Linear) holds the whole encoder on every TP rank
            tower_tp = 1 if getattr(settings, "config_format", "hf") == "mistral" else settings.tensor_parallel_size
            vision = VisionTower(self.top_config(spec), dtype, kind=self.vision_kind, tp=tower_tp,
                                 quant=scheme_for(spec, settings), engine_version=settings.engine_version, v0=v0)
        return MultimodalCausalLM(text, vision, spec.hidden_size, v0=v0)


plugin = Mistral3Plugin()

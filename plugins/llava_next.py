"""LLaVA-NeXT plugin (``LlavaNextForConditionalGeneration``): granite-vision-3.x and other
LLaVA-1.6-style checkpoints = a text decoder (generic plugin: Granite / Llama / Mistral) plus a
SigLIP (or CLIP) tower, a two-layer MLP projector and ``image_newline``.

Follows vllm/model_executor/models/llava_next.py (0.19.0): the tower is built up to the deepest
``vision_feature_layer`` with ``require_post_norm=False``; with a list of feature layers
(granite-vision) the projector's ``linear_1`` takes ``len(layers)·D`` inputs and the tower keeps
every hidden state while encoding. Weights and the V1 encoder profile (anyres: ``1 + gh·gw``
crops of ``image_size``² per dummy image, the largest pinpoint's token count T, ``max(N, T)//T``
images) come from :mod:`tuner.model.simulate.vision` (kind ``siglip``); CLIP towers are modelled with
the same block structure (their class/pre-norm parameters, a few KB, are not counted). KV cache:
the generic decoder's full attention.

Partial configs: granite-vision-3.3-2b's published facts cover only hidden size, layers and KV
heads. Missing text keys for a Granite language model (``text_config.model_type == "granite"``)
take the values of ibm-granite/granite-3.1-2b-instruct, the language model granite-vision-3.x is
built on (../models/ibm-granite--granite-3.1-2b-instruct/config.json: intermediate 8192, vocab
49155, 32 heads, 131072 positions, tied embeddings); its missing vision/top keys take the
granite-vision-3.x published values (SigLIP so400m-384: 27 layers, 16 heads, intermediate 4304,
patch 14, image 384; ``vision_feature_layer`` [-24, -20, -12, -1], consistent with the runtime
log's ``linear_1 [2048, 4608]`` = 4 x 1152; strategy ``full``; anyres pinpoints of 384-pixel tiles
up to 10 tiles). Other LLaVA-NeXT configs fall back to transformers ``LlavaNextConfig`` defaults.
"""

from __future__ import annotations

from tuner.plugins.mistral3 import Mistral3Plugin, effective_top

#: ibm-granite/granite-3.1-2b-instruct (the granite-vision-3.x language model).
GRANITE_TEXT_DEFAULTS = {"intermediate_size": 8192, "vocab_size": 49155, "num_attention_heads": 32,
                         "max_position_embeddings": 131072, "rope_theta": 5000000.0, "rms_norm_eps": 1e-5,
                         "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
                         "embedding_multiplier": 12.0, "logits_scaling": 8.0, "residual_multiplier": 0.22,
                         "attention_multiplier": 0.015625}
#: google/siglip-so400m-patch14-384 (granite-vision-3.x's tower).
SIGLIP_384 = {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
              "num_hidden_layers": 27, "num_attention_heads": 16, "patch_size": 14, "image_size": 384,
              "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"}
_GV_PINPOINTS = [[384 * a, 384 * b] for a in range(1, 11) for b in range(1, 11) if a * b <= 10]
GRANITE_VISION_TOP = {"vision_feature_layer": [-24, -20, -12, -1], "vision_feature_select_strategy": "full",
                      "image_grid_pinpoints": _GV_PINPOINTS, "multimodal_projector_bias": True,
                      "projector_hidden_act": "gelu"}
#: transformers ``LlavaNextConfig`` defaults.
LLAVA_NEXT_TOP = {"vision_feature_layer": -2, "vision_feature_select_strategy": "default",
                  "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
                  "multimodal_projector_bias": True, "projector_hidden_act": "gelu"}


def _is_granite(top: dict) -> bool:
    tc = top.get("text_config") if isinstance(top.get("text_config"), dict) else {}
    return tc.get("model_type") == "granite"


class LlavaNextPlugin(Mistral3Plugin):
    """Generic text decoder + SigLIP/CLIP tower + LLaVA projector + V1 encoder profile."""

    name = "llava_next"
    architectures = ("LlavaNextForConditionalGeneration",)
    vision_kind = "siglip"

    def config_defaults(self, top: dict) -> dict:
        """Granite-vision text defaults (granite-3.1-2b-instruct) for Granite language models."""
        return dict(GRANITE_TEXT_DEFAULTS) if _is_granite(top) else {}

    def text_defaults(self, spec) -> dict:
        return self.config_defaults(spec.top)

    def top_config(self, spec) -> dict:
        if _is_granite(spec.top):
            return effective_top(spec.top, GRANITE_TEXT_DEFAULTS, SIGLIP_384, GRANITE_VISION_TOP)
        return effective_top(spec.top, {}, {}, LLAVA_NEXT_TOP)


plugin = LlavaNextPlugin()

"""Kimi-VL plugin (``KimiVLForConditionalGeneration``): a DeepSeek-V3-style MLA + MoE text model
(Moonlight-16B-A3B) plus a MoonViT vision tower and its patch-merger projector.

Follows vllm/model_executor/models/kimi_vl.py (0.19.0): the language model is vLLM's
``DeepseekV2Model`` (modelled by :mod:`tuner.plugins.deepseek`, subclassed here, not copied), the
tower ``MoonVitPretrainedModel`` and ``KimiVLMultiModalProjector`` come from
:mod:`tuner.model.simulate.vision` (kind ``moonvit``), which also replays vLLM's V1 encoder profile:
``max(N, T) // T`` dummy 1024² images (T = 1089 tokens: scaled to the processor's 4096-patch
limit, padded to 66x66 patches, 2x2 merge; 7 images at N = 8192), their pixel batch, outputs and
MoonViT's cached 512x512 rotary table kept through the text dummy run and the sampler. KV cache: one 576-element latent per token per layer
(``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64), not sharded by TP.

Partial configs: the published Kimi-VL facts lack most text keys (shared/models source.txt:
hidden 2048, 27 layers, 64 routed + 2 shared experts, top-6, expert width 1408, latent head 576).
Missing keys take the Moonlight-16B-A3B values (moonshotai/Moonlight-16B-A3B config.json, the
text model Kimi-VL-A3B is built on): 16 heads, no q LoRA, 128 + 64 query/key head dims, 128 value
head dim, latent rank 512, dense MLP 11264 on the first layer, vocab 163840, sigmoid router with
``noaux_tc`` correction bias, untied embeddings, bfloat16, 131072 positions (Kimi-VL's 128K
context).
"""

from __future__ import annotations

from tuner.model.plugin import RankSettings
from tuner.plugins.deepseek import _DTYPES, DeepseekPlugin

#: Moonlight-16B-A3B text defaults (see module docstring); the file's own keys win.
TEXT_DEFAULTS = {
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 11264,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "vocab_size": 163840, "max_position_embeddings": 131072,
    "rope_theta": 800000.0, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5, "hidden_act": "silu",
}


class KimiVLPlugin(DeepseekPlugin):
    """Kimi-VL: DeepSeek-V3-style text model (MLA + MoE) + MoonViT tower and projector."""

    name = "kimi_vl"
    architectures = ("KimiVLForConditionalGeneration",)

    def config_defaults(self, top: dict) -> dict:
        """Moonlight-16B-A3B text defaults for keys a partial config lacks (module docstring)."""
        return dict(TEXT_DEFAULTS)

    def build_model(self, spec, settings: RankSettings):
        import torch

        from tuner.model.simulate.vision import MultimodalCausalLM, VisionTower

        text = super().build_model(spec, settings)
        dtype = getattr(torch, _DTYPES.get(settings.dtype, "bfloat16"))
        v0 = settings.runs_attention
        vision = None
        if isinstance(spec.top.get("vision_config"), dict) and (settings.pp_rank == 0 or not v0):
            vision = VisionTower(spec.top, dtype, kind="moonvit", tp=settings.tensor_parallel_size,
                                 engine_version=settings.engine_version, v0=v0)
        return MultimodalCausalLM(text, vision, spec.hidden_size, v0=v0)


plugin = KimiVLPlugin()

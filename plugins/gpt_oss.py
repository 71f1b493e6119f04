"""gpt-oss plugin (``GptOssForCausalLM``): alternating sliding-window / full attention with
attention sinks, and MXFP4 mixture-of-experts MLPs with biases.

Follows vLLM vllm/model_executor/models/gpt_oss.py (0.11–0.19) and, for the MXFP4 experts,
vllm/model_executor/layers/quantization/mxfp4.py + fused_moe/oracle/mxfp4.py (0.19) with the
Hopper layouts of triton_kernels (vllm/third_party/triton_kernels/tensor_details/layout_details/
hopper_value.py, hopper_scale.py). Per rank:

- vocab-parallel embedding and (untied) LM head, ``[pad64(V) / tp, H]`` in the model dtype;
- attention ``model.layers.<i>.attn``: fused QKV with bias (``heads/tp`` query heads, KV heads
  ``max(1, kv // tp)``), ``o_proj`` with bias, ``sinks [heads / tp]`` (created under the model's
  default dtype), no q/k norm; layer ``i`` slides over ``sliding_window`` (128) tokens when ``i`` is
  even (vLLM's rule, which equals the config's ``layer_types``), else full attention;
- one YaRN rotary cache in **fp32**: ``[original_max_position_embeddings · factor, head_dim]``
  (131072 × 64 × 4 B = 32 MiB), shared by all layers;
- MLP ``model.layers.<i>.mlp``: ``router`` = replicated ``Linear [E, H]`` with bias (16-bit, listed
  in ``modules_to_not_convert``) and :class:`tuner.model.simulate.moe.FusedMoE` with biases, SwiGLU-OAI
  activation, ``I_rank = round_up(I / tp, 64)`` for MXFP4 on Hopper (``mxfp4_round_up_hidden_size_and_intermediate_size``,
  Triton backend; other backends below), run through triton_kernels ``matmul_ogs`` (``kernel="oai_triton"``).

MXFP4 expert bytes come from :func:`tuner.memory.quant.scheme_for` (``Mxfp4ExpertsFormat``), in the
layout of the backend vLLM picks for the GPU's compute capability and the release
(:func:`tuner.memory.quant.mxfp4_backend`, fused_moe/oracle/mxfp4.py 0.19–0.28): Triton on Hopper 9.x,
FlashInfer TRT-LLM on Blackwell 10.x, Marlin elsewhere (8.x, 11.0, the RTX Blackwell family 12.x), each
padding ``(H, I / tp)`` its own way (Marlin: H to 256, I to 128; gpt-oss-120b TP8 on an RTX PRO 4500:
``(3072, 384)``). Marlin experts run through the modular kernel, whose persistent workspace
(``TritonExperts``' shapes at the padded sizes) is still alive while the dummy sampler runs
(``kernel="triton"``); Triton and TRT-LLM are profiled as matmul_ogs (``kernel="oai_triton"``). On
Hopper (Triton backend) the loaded ``weight [E, out, in/2]`` uint8 is swizzled (HopperMXValueLayout)
and freed, the loaded ``weight_scale [E, out, in/32]`` **stays registered** next to a swizzled copy
``[E, round_up(out, 256), round_up(in/32, 2)]`` (HopperMXScaleLayout, 8 warps; the loaded scales
are freed from 0.25 and the groups padded to 4 from 0.26), biases become fp32
``[E, out]``; ``I / tp`` is padded to 64 (the scheme's ``expert_sizes``). Checked against the visible
start-ups (H100): 0.19.0 13.634 GiB predicted / 13.64 printed (TP1), 6.989 / 7.01 (TP2). The
vendored triton_kernels pre-pad the swizzled values to multiples of 64 in vLLM 0.17–0.19 only
(0.13.0, 0.15.0 and 0.33.0 pad to the 16 × 32 MMA packing only).

KV cache: ``SlidingWindowSpec(128)`` on even layers, ``FullAttentionSpec`` on odd ones; vLLM ≥ 0.9.1
groups them (hybrid manager, :mod:`tuner.memory.kvcache`): 12 + 12 layers for gpt-oss-20b → two groups
sharing one block pool, ``bytes_per_block = 12 · page``.
"""

from __future__ import annotations

from tuner.memory.kvcache import FullAttentionSpec, SlidingWindowSpec, dtype_bytes_for, kv_heads_per_rank
from tuner.model.plugin import ModelPlugin, RankSettings, stage_layers


def is_mxfp4(spec, settings: RankSettings) -> bool:
    """The experts are MXFP4 (checkpoint ``quant_method`` or the drop's ``quantization``)."""
    q = (settings.quantization or (spec.quantization_config or {}).get("quant_method") or "").lower()
    return q == "mxfp4"


def rope_cache_len(spec) -> int:
    """YaRN cache rows: ``original_max_position_embeddings · factor`` (vLLM
    ``YaRNScalingRotaryEmbedding``); ``max_position_embeddings`` without YaRN."""
    rp = spec.raw.get("rope_parameters") or spec.raw.get("rope_scaling") or {}
    if (rp.get("rope_type") or rp.get("type")) == "yarn" and rp.get("factor"):
        base = int(rp.get("original_max_position_embeddings") or spec.max_position_embeddings)
        return int(base * float(rp["factor"]))
    return spec.max_position_embeddings


class GptOssPlugin(ModelPlugin):
    """gpt-oss-20b / gpt-oss-120b."""

    name = "gpt_oss"
    architectures = ("GptOssForCausalLM",)

    def kv_cache_spec(self, spec, settings: RankSettings) -> dict:
        bs = settings.block_size or 16
        heads = kv_heads_per_rank(spec.num_key_value_heads, settings.tensor_parallel_size)
        dt = dtype_bytes_for(settings.kv_cache_dtype, settings.dtype)
        window = spec.sliding_window
        out = {}
        for i in stage_layers(spec, settings):
            name = f"model.layers.{i}.attn.attn"
            if window and i % 2 == 0:
                out[name] = SlidingWindowSpec(block_size=bs, num_kv_heads=heads, head_size=spec.head_dim,
                                              dtype_bytes=dt, sliding_window=int(window))
            else:
                out[name] = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=spec.head_dim, dtype_bytes=dt)
        return out

    def build_model(self, spec, settings: RankSettings):
        import torch

        from tuner.model.simulate import layers as L
        from tuner.model.simulate.moe import FusedMoE, SparseMoeBlock, build_decoder, torch_dtype
        from tuner.memory.quant import scheme_for

        raw = spec.raw
        dtype = torch_dtype(settings.dtype)
        tp = settings.tensor_parallel_size
        quant = scheme_for(spec, settings)
        h = spec.hidden_size
        experts = int(raw.get("num_local_experts") or 32)
        top_k = int(raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 4)
        mx = is_mxfp4(spec, settings) and quant is not None
        rope = L.RotaryEmbedding(rope_cache_len(spec), spec.head_dim, torch.float32)
        # the MXFP4 backend's profile path (Marlin: the modular kernel's workspace; Triton: matmul_ogs)
        kernel = getattr(quant.expert_format, "kernel", "oai_triton") if mx else "triton"

        def mlp(i: int, prefix: str):
            p = f"{prefix}.mlp"
            router = L.Linear(h, experts, dtype, bias=True, prefix=f"{p}.router")
            moe = FusedMoE(h, spec.intermediate_size // tp, experts, top_k, dtype, quant=quant, prefix=f"{p}.experts",
                           compiled=settings.compiled, has_bias=True, engine_version=settings.engine_version,
                           tensor_parallel_size=tp, reduce_results=True, kernel=kernel)
            return SparseMoeBlock(router, moe, tensor_parallel_size=tp)

        return build_decoder(spec, settings, stage_layers(spec, settings), mlp_for_layer=mlp, rope=rope, quant=quant,
                             attn_name="attn", qkv_bias=True, o_bias=True, sinks=True)


plugin = GptOssPlugin()

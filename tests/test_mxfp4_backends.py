"""MXFP4 MoE experts (gpt-oss) by the backend vLLM picks for the GPU's compute capability and the
release: the choice (fused_moe/oracle/mxfp4.py priority list x each experts class's device check),
the per-rank padding (``mxfp4_round_up_hidden_size_and_intermediate_size``), the bytes each backend
keeps after ``process_weights_after_loading``, and the profile path (Marlin's modular-kernel
workspace). Every figure below is computed by hand from those vLLM sources (0.19.0, 0.22.0,
0.24.0, 0.25.0, 0.26.0, 0.27.0, 0.28.0 wheels)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tuner.model.plugin import RankSettings
from tuner.memory.quant import (MXFP4_HOPPER_SCALE_PAD4_FROM, MXFP4_TRITON_FREES_SCALES_FROM, MXFP4_TRTLLM_I128_FROM, Mxfp4ExpertsFormat,
                                  layout_bytes, mxfp4_alignment, mxfp4_backend, scheme_for)

GiB = 2**30
QC = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                          "model.embed_tokens", "lm_head"]}
E120, H, I = 128, 2880, 2880  # gpt-oss-120b: 128 experts, hidden 2880, intermediate 2880, 36 layers


def _scheme(cc: str, version: str, triton_kernels_installed: bool | None = True):
    """``triton_kernels_installed`` True: the image's environment (before 0.12 a pip install lacks the
    package and Hopper runs Marlin: tests/test_accuracy_mechanisms.py)."""
    spec = SimpleNamespace(quantization_config=QC, top={"quantization_config": QC}, raw={})
    return scheme_for(spec, RankSettings(engine_version=version, dtype="bfloat16", compute_capability=cc,
                                         triton_kernels_installed=triton_kernels_installed))


@pytest.mark.parametrize("cc, version, backend", [
    ((9, 0), "0.19.0", "triton_swizzle"),    # H100/H200: Triton (9.0 <= cc < 11.0), swizzled
    ((9, 0), "0.11.0", "triton_strided"),    # 0.11.0 / torch 2.8.0: StridedLayout
    ((10, 0), "0.28.0", "flashinfer_trtllm"),  # B200/GB200: TRT-LLM BF16 comes first (family 100)
    ((10, 3), "0.19.0", "flashinfer_trtllm"),  # B300: same family
    ((12, 0), "0.28.0", "marlin"),           # RTX 50xx / RTX PRO Blackwell: not Triton (< 11.0), not TRT-LLM
    ((12, 0), "0.19.0", "marlin"),
    ((11, 0), "0.28.0", "marlin"),           # Thor: CUTLASS excludes SM110, Triton stops below 11.0
    ((8, 9), "0.28.0", "marlin"),            # L40 / RTX 4090
    ((8, 0), "0.19.0", "marlin"),            # A100
])
def test_mxfp4_backend_by_capability_and_release(cc, version, backend):
    ver = tuple(int(p) for p in version.split("."))
    assert mxfp4_backend(cc, ver) == backend
    assert _scheme(f"{cc[0]}.{cc[1]}", version).expert_format.backend == backend


def test_mxfp4_padding_per_backend_and_release():
    assert mxfp4_alignment("triton_swizzle", (0, 28, 0)) == (1, 64)
    assert mxfp4_alignment("marlin", (0, 19, 0)) == mxfp4_alignment("marlin", (0, 28, 0)) == (256, 128)
    assert mxfp4_alignment("flashinfer_trtllm", (0, 26, 0)) == (256, 256)
    assert MXFP4_TRTLLM_I128_FROM == (0, 27, 0)
    assert mxfp4_alignment("flashinfer_trtllm", (0, 27, 0)) == (256, 128)
    # gpt-oss-120b per rank: TP8 on an RTX PRO 4500 (12.0) -> 2880/8 = 360 -> 384, H 2880 -> 3072
    assert _scheme("12.0", "0.28.0").expert_sizes(H, I // 8) == (3072, 384)
    # TP1 on a B200: I 2880 -> 2944 (128) in 0.28, 3072 (256) in 0.26; Hopper keeps 2880 (2880 % 64 == 0)
    assert _scheme("10.0", "0.28.0").expert_sizes(H, I) == (3072, 2944)
    assert _scheme("10.0", "0.26.0").expert_sizes(H, I) == (3072, 3072)
    assert _scheme("9.0", "0.28.0").expert_sizes(H, I) == (2880, 2880)


def test_marlin_layer_bytes_gpt_oss_120b_tp8_on_sm120():
    """prepare_moe_mxfp4_layer_for_marlin (0.28): values repacked at the same size, e8m0 scales
    back to 1 byte, biases in the model dtype; the loaded tensors are replaced."""
    s = _scheme("12.0", "0.28.0")
    h, n = 3072, 384
    w13 = E120 * 2 * n * h // 2 + E120 * 2 * n * h // 32   # 150,994,944 + 9,437,184
    w2 = E120 * h * n // 2 + E120 * h * n // 32            # 75,497,472 + 4,718,592
    bias = E120 * (2 * n + h) * 2                          # bf16
    got = layout_bytes(s.expert_layout(E120, H, I // 8, "bfloat16", "model.layers.0.mlp.experts", has_bias=True))
    assert got == w13 + w2 + bias == 241_631_232
    assert s.expert_format.kernel == "triton"  # MarlinExperts: the modular kernel's workspace


def test_trtllm_layer_bytes_gpt_oss_120b_on_b200():
    """TRT-LLM (0.28): shuffled values and interleaved scales at the padded size, fp32 biases."""
    s = _scheme("10.0", "0.28.0")
    h, n = 3072, 2944
    want = (E120 * 2 * n * h // 2 + E120 * 2 * n * h // 32 + E120 * h * n // 2 + E120 * h * n // 32
            + E120 * (2 * n + h) * 4)
    assert layout_bytes(s.expert_layout(E120, H, I, "bfloat16", "x.experts", has_bias=True)) == want


def test_triton_frees_loaded_scales_from_0_25():
    """0.25+ ``del layer.w13_weight_scale`` after swizzling: only the swizzled copy stays (gpt-oss-20b
    layer, 32 experts, TP1, bf16 -> fp32 biases)."""
    e = 32
    kept = layout_bytes(_scheme("9.0", "0.24.0").expert_layout(e, H, I, "bfloat16", "x.experts", has_bias=True))
    freed = layout_bytes(_scheme("9.0", "0.25.0").expert_layout(e, H, I, "bfloat16", "x.experts", has_bias=True))
    assert MXFP4_TRITON_FREES_SCALES_FROM == (0, 25, 0)
    assert kept == 458_772_480  # the 0.19 layout (tests/test_quant.py), unchanged through 0.24
    assert kept - freed == e * 5760 * 90 + e * 2880 * 90 == 24_883_200
    assert _scheme("9.0", "0.25.0").expert_format == Mxfp4ExpertsFormat(backend="triton_swizzle", prepad=True,
                                                                         scales_freed=True, align=(1, 64))


def _plugin_model(shared_dir, cc: str, version: str, tp: int):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tuner.model.modelspec import load_model_spec
    from tuner.model.plugin import load_registry

    plugin = load_registry().by_name("gpt_oss")
    spec = load_model_spec(shared_dir / "models" / "openai--gpt-oss-120b" / "config.json")[0]
    s = RankSettings(engine_version=version, dtype="bfloat16", compute_capability=cc, tensor_parallel_size=tp)
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        model = plugin.build_model(spec, s)
        return plugin, model, plugin.weights_bytes(spec, s, model)


def test_gpt_oss_120b_tp8_marlin_weights_and_kernel(shared_dir):
    """The RTX PRO 4500 TP8 start-up (case vllm-pr51590-*, 0.28.0, 12.0): 36 Marlin layers of
    241,631,232 B, plus attention/router/norms, two 25136 x 2880 vocab shards and the 32 MiB fp32
    YaRN cache -> 8.65 GiB per rank. The reporter's table says 9.98 GiB; no backend layout of the
    0.28.0 source reaches it (see the README's MXFP4 paragraph)."""
    _, model, got = _plugin_model(shared_dir, "12.0", "0.28.0", 8)
    experts = model.layers[0].mlp.experts
    assert (experts.kernel, experts.hidden_padded, experts.intermediate) == ("triton", 3072, 384)
    assert got / GiB == pytest.approx(8.650, abs=0.002)
    _, hopper, _ = _plugin_model(shared_dir, "9.0", "0.28.0", 8)
    assert hopper.layers[0].mlp.experts.kernel == "oai_triton"


def test_marlin_profile_keeps_the_modular_workspace():
    """MarlinExperts.workspace_shapes (experts/marlin_moe.py, 0.28) equals TritonExperts': the
    WorkspaceManager buffer (M·k·max(I, H) + M·k·max(2I, H) at the padded sizes) outlives the
    forward, next to the padded input's output."""
    import torch

    from tuner.model.simulate.moe import FusedMoE, workspace_bytes
    from tuner.model.simulate.tracker import MemoryTracker

    s = _scheme("12.0", "0.28.0")
    m, k = 64, 4
    mod = FusedMoE(H, I // 8, 8, k, torch.bfloat16, quant=s, prefix="model.layers.0.mlp.experts",
                   engine_version="0.28.0", kernel=s.expert_format.kernel, has_bias=True)
    x = torch.zeros(m, H, dtype=torch.bfloat16)
    with torch.no_grad(), MemoryTracker() as tr:
        out = mod(x, torch.zeros(m, 8, dtype=torch.bfloat16))
        live = tr.live_bytes
        del out
    ws = workspace_bytes(m, k, 384, 3072, 2)
    assert ws == 64 * 4 * 3072 * 2 * 2
    assert live == ws + m * 3072 * 2  # the [M, 3072] output (sliced to 2880 as a view)


def test_hopper_swizzled_scales_pad_groups_to_4_from_0_26():
    """0.26+ ``_swizzle_mxfp4`` pads K = in/32 to a multiple of 4 on 9.0 before HopperMXScaleLayout:
    gpt-oss-20b layer (32 experts, TP1): w13 [32, 5888, 90 -> 92], w2 [32, 3072, 90 -> 92]; TP2's
    w2 K = 1472/32 = 46 -> 48 (its w13 rows 2 x 1472 = 2944 -> 3072)."""
    e = 32
    b25 = layout_bytes(_scheme("9.0", "0.25.0").expert_layout(e, H, I, "bfloat16", "x.experts"))
    b26 = layout_bytes(_scheme("9.0", "0.26.0").expert_layout(e, H, I, "bfloat16", "x.experts"))
    assert MXFP4_HOPPER_SCALE_PAD4_FROM == (0, 26, 0)
    assert b26 - b25 == e * 5888 * 2 + e * 3072 * 2 == 573_440
    lay = dict((n, shape) for n, shape, _ in _scheme("9.0", "0.28.0").expert_layout(e, H, I // 2, "bfloat16", "x"))
    assert lay["w2_weight_scale_swizzled"] == (e, 3072, 48) and lay["w13_weight_scale_swizzled"] == (e, 3072, 92)
    assert "w13_weight_scale" not in lay  # freed since 0.25

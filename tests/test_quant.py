"""Quantized-checkpoint weights (tuner/memory/quant.py): hand-computed bytes per scheme for one
4096 x 4096 layer, ignore lists, expert banks, and the weights of the quantized start-ups we have
(the visible qfp8 / gpt-oss cases and the printed weights of the RedHatAI logs named in the model
configs' source.txt)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tuner.model.plugin import RankSettings
from tuner.memory.quant import (Fp8Format, Int8Format, Mxfp4ExpertsFormat, QuantScheme, WNA16Format,
                                  canonical, layout_bytes, matches, scheme_for)

GIB = 2**30
K = N = 4096
DENSE_FP8 = K * N  # one byte per weight


def _spec(qc: dict | None, top_extra: dict | None = None):
    top = {"quantization_config": qc} if qc else {}
    top.update(top_extra or {})
    return SimpleNamespace(quantization_config=qc, top=top, raw={})


def _settings(**kw):
    kw.setdefault("engine_version", "0.19.0")
    kw.setdefault("dtype", "bfloat16")
    return RankSettings(**kw)


def _linear_bytes(scheme, prefix="model.layers.0.mlp.down_proj", dtype="bfloat16", i=K, o=N):
    got = scheme.linear_layout(i, o, dtype, prefix)
    return None if got is None else layout_bytes(got[0])


# -- per-scheme bytes of one 4096 x 4096 layer ---------------------------------------------------
def test_gptq_4bit_g128_machete_hopper():
    s = scheme_for(_spec({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}),
                   _settings())
    qweight = K * N // 8 * 4          # int32 [in/8, out]
    scales = (K // 128) * N * 2        # bf16 [in/128, out]
    qzeros = (K // 128) * (N // 8) * 4  # int32 [in/128, out/8], kept by Machete
    g_idx = K * 4                      # int32 [in], kept by Machete
    assert _linear_bytes(s) == qweight + scales + qzeros + g_idx == 8_732_672


def test_gptq_marlin_on_ampere_frees_zeros_and_gidx():
    s = scheme_for(_spec({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}),
                   SimpleNamespace(engine_version="0.19.0", quantization=None, compute_capability="8.0"))
    assert _linear_bytes(s) == K * N // 2 + (K // 128) * N * 2 + 132 * 4  # + int32 workspace per SM


def test_gptq_forced_plain_kernel_and_desc_act():
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": True}
    s = scheme_for(_spec(qc), _settings(quantization="gptq"))
    assert _linear_bytes(s) == K * N // 2 + 32 * N * 2 + 32 * (N // 8) * 4 + K * 4
    s8 = scheme_for(_spec({**qc, "bits": 8, "desc_act": False}), _settings())
    assert _linear_bytes(s8) == K * N + 32 * N * 2 + 32 * (N // 4) * 4 + K * 4


def test_awq_zero_points_machete_vs_marlin():
    qc = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
    hopper = scheme_for(_spec(qc), _settings())
    assert _linear_bytes(hopper) == K * N // 2 + 32 * N * 2 + 32 * N * 2  # zero points unpacked to bf16
    ampere = scheme_for(_spec(qc), SimpleNamespace(engine_version="0.19.0", quantization=None, compute_capability="8.6"))
    assert _linear_bytes(ampere) == K * N // 2 + 32 * N * 2 + 32 * (N // 8) * 4 + 132 * 4


def test_fp8_per_tensor_block_and_online():
    tensor = scheme_for(_spec({"quant_method": "fp8", "activation_scheme": "dynamic"}), _settings())
    assert _linear_bytes(tensor) == DENSE_FP8 + 4
    block = scheme_for(_spec({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
                       _settings())
    assert _linear_bytes(block) == DENSE_FP8 + 32 * 32 * 4  # fp32 scale_inv per 128x128 block
    assert _linear_bytes(block, o=4096 + 64) == (4096 + 64) * K + 33 * 32 * 4  # partial block rounds up
    online = scheme_for(_spec(None), _settings(quantization="fp8"))
    assert online.method == "fp8" and _linear_bytes(online) == DENSE_FP8 + 4
    assert scheme_for(_spec(None), _settings()) is None
    assert scheme_for(_spec(None), _settings(quantization="awq")) is None  # needs an AWQ checkpoint


def test_compressed_tensors_w8a8_and_wna16():
    fp8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"], "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
    assert _linear_bytes(scheme_for(_spec(fp8), _settings())) == DENSE_FP8 + N * 4
    int8 = json.loads(json.dumps(fp8).replace('"float"', '"int"').replace("float-quantized", "int-quantized"))
    int8["config_groups"]["group_0"]["input_activations"]["symmetric"] = False
    assert _linear_bytes(scheme_for(_spec(int8), _settings())) == DENSE_FP8 + N * 4 + N * 4  # + azp_adj int32
    w4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                           "symmetric": True}}}}
    assert _linear_bytes(scheme_for(_spec(w4), _settings())) == K * N // 2 + 32 * N * 2 + 16  # + weight_shape int64[2]
    w4["config_groups"]["g"]["weights"]["symmetric"] = False
    assert _linear_bytes(scheme_for(_spec(w4), _settings())) == K * N // 2 + 32 * N * 2 + 16 + 32 * N * 2


def test_nvfp4_modelopt():
    s = scheme_for(_spec({"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"],
                          "config_groups": {}}), _settings())
    assert _linear_bytes(s) == K * N // 2 + K * N // 16 + 4 * 4  # fp4 x2/byte + fp8 per 16 + fp32 globals


def test_minimal_partial_configs_use_the_tools_defaults():
    gptq = scheme_for(_spec({"bits": 4, "quant_method": "gptq"}), _settings())
    assert gptq.linear_format == WNA16Format(bits=4, group_size=128, zero_points=False, desc_act=False,
                                             flavor="gptq", kernel="machete")
    awq = scheme_for(_spec({"bits": 4, "quant_method": "awq"}), _settings())
    assert awq.linear_format.zero_points and awq.linear_format.group_size == 128
    ct = scheme_for(_spec({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8, "type": "int"}}}}), _settings())
    assert isinstance(ct.linear_format, Int8Format)
    ar = scheme_for(_spec({"bits": 4, "quant_method": "auto-round"}), _settings())
    assert ar.linear_format.flavor == "gptq" and ar.linear_format.group_size == 128


def test_unknown_method_is_an_error():
    from tuner.errors import ModelConfigError

    with pytest.raises(ModelConfigError, match="not modelled"):
        scheme_for(_spec({"quant_method": "gguf"}), _settings())


# -- ignore lists ----------------------------------------------------------------------------------
def test_matching_rules():
    assert canonical("model.language_model.layers.3.mlp") == canonical("language_model.model.layers.3.mlp") == "layers.3.mlp"
    assert matches("model.layers.0.self_attn.qkv_proj", ["model.language_model.layers.0.self_attn*"])
    assert not matches("model.layers.10.self_attn.qkv_proj", ["model.language_model.layers.1.self_attn*"])
    assert matches("model.layers.3.self_attn.qkv_proj", ["model.layers.*.self_attn"])
    qkv = ["model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj", "model.layers.3.self_attn.v_proj"]
    assert matches("model.layers.3.self_attn.qkv_proj", qkv)            # all shards ignored
    assert not matches("model.layers.3.self_attn.qkv_proj", qkv[:1])    # not all shards
    assert not matches("model.layers.0.mlp.gate_up_proj", ["model.layers.0.mlp.gate"])
    assert matches("vision_tower.transformer.layers.0.attention.qkv_proj", ["re:.*vision_tower.*"])


def test_ignored_layers_stay_16bit():
    qwen = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]}
    s = scheme_for(_spec(qwen), _settings())
    assert s.linear_layout(2048, 128, "bfloat16", "model.layers.0.mlp.gate") is None
    assert s.linear_layout(2048, 128, "bfloat16", "model.layers.1.mlp.gate") is not None
    assert s.linear_layout(2048, 151936, "bfloat16", "lm_head") is None
    assert s.is_ignored("model.layers.0.mlp.gate") and not s.is_ignored("model.layers.0.mlp.experts")
    # ModelOpt: wildcards, vision towers hard-skipped
    mo = scheme_for(_spec({"quant_method": "modelopt", "quant_algo": "NVFP4",
                           "ignore": ["lm_head", "model.language_model.layers.1.self_attn*"]}), _settings())
    assert mo.linear_layout(K, N, "bfloat16", "model.layers.1.self_attn.o_proj") is None
    assert mo.linear_layout(K, N, "bfloat16", "model.layers.11.self_attn.o_proj") is not None
    assert mo.is_ignored("model.vision_tower.encoder.layers.0.mlp.fc1")
    # compressed-tensors without an "ignore" key: lm_head and multimodal towers stay 16-bit
    ct = scheme_for(_spec({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float"}, "input_activations": {"num_bits": 8, "type": "float"}}}}), _settings())
    assert ct.is_ignored("vision_tower.transformer.layers.0.feed_forward.gate_up_proj")
    assert ct.is_ignored("multi_modal_projector.linear_1") and not ct.is_ignored("model.layers.0.mlp.down_proj")
    # GPTQ quantizes lm_head only when the checkpoint says so
    g = scheme_for(_spec({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
                          "lm_head": True}), _settings())
    assert g.linear_layout(K, 128256, "bfloat16", "lm_head") is not None


def test_modelopt_mixed_precision_per_layer():
    qc = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "ignore": ["mtp*"], "quantized_layers": {
        "model.language_model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
        "model.language_model.layers.0.self_attn.k_proj": {"quant_algo": "FP8"},
        "model.language_model.layers.0.self_attn.v_proj": {"quant_algo": "FP8"},
        "model.language_model.layers.0.mlp.experts": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}}
    s = scheme_for(_spec(qc), _settings())
    assert isinstance(s.per_layer["model.language_model.layers.0.self_attn.q_proj"], Fp8Format)
    assert layout_bytes(s.linear_layout(K, N, "bfloat16", "model.layers.0.self_attn.qkv_proj")[0]) == DENSE_FP8 + 4 + 4
    assert s.linear_layout(K, N, "bfloat16", "model.layers.0.self_attn.o_proj") is None  # not listed
    bank = s.expert_layout(4, 256, 64, "bfloat16", "model.layers.0.mlp.experts")
    assert layout_bytes(bank) == 4 * (128 * 128 + 128 * 16 + 4 * 4) + 4 * (256 * 32 + 256 * 4 + 4 * 4)


# -- expert banks ----------------------------------------------------------------------------------
def test_mxfp4_experts_gpt_oss_20b_layer_on_hopper():
    s = scheme_for(_spec({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                              "model.layers.*.mlp.router"]}), _settings())
    assert s.linear_layout(2880, 4096, "bfloat16", "model.layers.0.attn.qkv_proj") is None
    assert s.expert_sizes(2880, 1440) == (2880, 1472)  # I / tp rounded up to 64 (Triton backend)
    e, h, n = 32, 2880, 2880
    w13 = e * 1472 * 5760 + e * 5760 * 90 + e * 5888 * 90   # swizzled values + loaded + swizzled scales
    w2 = e * 2880 * 1472 + e * 2880 * 90 + e * 3072 * 90
    bias = e * (2 * n + h) * 4                              # fp32 on the Triton path
    assert layout_bytes(s.expert_layout(e, h, n, "bfloat16", "model.layers.0.mlp.experts", has_bias=True)) \
        == w13 + w2 + bias == 458_772_480
    old = scheme_for(_spec({"quant_method": "mxfp4"}), _settings(engine_version="0.11.0", triton_kernels_installed=True))
    assert old.expert_format == Mxfp4ExpertsFormat(backend="triton_strided", prepad=False)
    assert layout_bytes(old.expert_layout(e, h, n, "bfloat16", "x.experts")) == e * (2 * n * h // 2 + h * n // 2) + \
        2 * e * (2 * n * h // 32 + h * n // 32)


def test_expert_banks_fp8_block_and_wna16():
    s = scheme_for(_spec({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
                   _settings())
    e, h, n = 8, 2048, 768
    assert layout_bytes(s.expert_layout(e, h, n, "bfloat16", "model.layers.0.mlp.experts")) == \
        e * 2 * n * h + e * 12 * 16 * 4 + e * h * n + e * 16 * 6 * 4
    g = scheme_for(_spec({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}), _settings())
    assert layout_bytes(g.expert_layout(e, h, n, "float16", "model.layers.0.mlp.experts")) == \
        e * (h * 2 * n // 2 + 16 * 2 * n * 2 + 16 * 2 * n // 8 * 4) + e * (n * h // 2 + 6 * h * 2 + 6 * h // 8 * 4)


def test_make_weights_registers_parameters_and_input_quant():
    import torch

    from tuner.model.simulate import layers as L

    from tuner.model.simulate.quant_weights import make_expert_weights
    s = scheme_for(_spec({"quant_method": "fp8", "activation_scheme": "dynamic"}), _settings())
    lin = L.Linear(64, 32, torch.bfloat16, quant=s, prefix="model.layers.0.mlp.down_proj")
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.input_quant == ("float8_e4m3fn", 1)
    assert lin(torch.zeros(5, 64, dtype=torch.bfloat16)).shape == (5, 32)
    head = L.LMHead(1000, 64, torch.bfloat16, 1, quant=s)
    assert head.weight.dtype == torch.bfloat16  # fp8 never quantizes ParallelLMHead
    mod = torch.nn.Module()
    assert make_expert_weights(s, mod, 4, 64, 32, torch.bfloat16, "model.layers.0.mlp.experts", has_bias=True)
    assert {n for n, _ in mod.named_parameters()} == {"w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale",
                                                      "w13_bias", "w2_bias"}
    assert make_expert_weights(QuantScheme("x"), torch.nn.Module(), 4, 64, 32, torch.bfloat16) is False


# -- the shared model configs -----------------------------------------------------------------------
# bytes per weight of a 4096 x 4096 layer: (low, high) per method family
_BPW = {"fp8": (1.0, 1.01), "compressed-tensors": (1.0, 1.01), "gptq_marlin": (0.5, 0.54), "awq_marlin": (0.5, 0.54),
        "auto-round": (0.5, 0.54), "modelopt": (0.56, 0.57), "modelopt_mixed": (0.56, 1.01)}


def test_every_shared_quantized_config_has_a_scheme(shared_dir):
    seen = 0
    for cfg in sorted((shared_dir / "models").glob("*/config.json")):
        top = json.loads(cfg.read_text())
        qc = top.get("quantization_config") or (top.get("text_config") or {}).get("quantization_config")
        if not qc:
            continue
        seen += 1
        s = scheme_for(_spec(qc), _settings())
        assert s is not None, cfg
        if s.method == "mxfp4":
            bank = s.expert_layout(32, 2880, 2880, "bfloat16", "model.layers.0.mlp.experts")
            assert 0.53 < layout_bytes(bank) / (32 * 3 * 2880 * 2880) < 0.58, cfg
            continue
        if s.method == "modelopt_mixed":
            prefix = "model.layers.0.mlp.shared_expert.down_proj"
        else:
            prefix = "model.layers.5.mlp.down_proj"
        lo, hi = _BPW[s.method]
        assert lo <= _linear_bytes(s, prefix=prefix) / (K * N) <= hi, (cfg, s.method)
    assert seen >= 20


# -- whole models against printed start-up weights --------------------------------------------------
def _weights_gib(shared_dir, model_dir: str, **settings) -> float:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tuner.model.modelspec import load_model_spec, read_architectures, read_top
    from tuner.model.plugin import load_registry

    cfg = shared_dir / "models" / model_dir / "config.json"
    plugin, _ = load_registry().for_architectures(read_architectures(cfg))
    spec, _ = load_model_spec(cfg, defaults=plugin.config_defaults(read_top(cfg)))
    s = _settings(**settings)
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        model = plugin.build_model(spec, s)
        return plugin.weights_bytes(spec, s, model) / GIB


def test_qfp8_case_llama_online_fp8(shared_dir, observed_cases):
    case = observed_cases["llmd-v019-meta-llama-llama-3--tp1pp1dp1--8192-qfp8"]
    assert case["quantization"] == "fp8" and case["observed"]["weights_gib"] == 8.49
    got = _weights_gib(shared_dir, "meta-llama--Llama-3.1-8B-Instruct", quantization="fp8")
    assert got == pytest.approx(8.49, rel=0.005)


@pytest.mark.parametrize("case_id,tp,version", [
    ("llmd-v019-openai-gpt-oss-20b-tp1pp1dp1--8192-FAILED", 1, "0.19.0"),
    ("llmd-v019-openai-gpt-oss-20b-tp2pp1dp1--8192", 2, "0.19.0"),
    ("llmd-bench-v011-h100-gpt-oss-20b", 1, "0.11.0"),
])
def test_gpt_oss_mxfp4_cases(shared_dir, observed_cases, case_id, tp, version):
    from tuner.model.plugin import load_registry

    if not any(p.name == "gpt_oss" for p in load_registry().plugins):
        pytest.skip("gpt_oss plugin not installed")
    obs = observed_cases[case_id]["observed"]["weights_gib"]
    # the v0.11.0 case ran the vllm/vllm-openai image, which has triton_kernels (Triton, not Marlin)
    got = _weights_gib(shared_dir, "openai--gpt-oss-20b", tensor_parallel_size=tp, engine_version=version,
                       triton_kernels_installed=True)
    assert got == pytest.approx(obs, rel=0.005)


# "Model loading took" printed by the vLLM 0.19.0 H100 logs cited in these configs' source.txt.
@pytest.mark.parametrize("model_dir,dtype,printed", [
    ("RedHatAI--Meta-Llama-3.1-8B-Instruct-quantized.w4a16", "float16", 5.38),   # gptq_marlin, Machete
    ("RedHatAI--Meta-Llama-3.1-8B-Instruct-quantized.w8a8", "bfloat16", 8.49),   # CompressedTensorsW8A8Int8
])
def test_redhatai_logged_weights(shared_dir, model_dir, dtype, printed):
    assert _weights_gib(shared_dir, model_dir, dtype=dtype) == pytest.approx(printed, rel=0.005)

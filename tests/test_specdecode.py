"""Speculative decoding's memory terms from vLLM's source (tuner.memory.specdecode, the hybrid plugin's
conv state, prefix caching's mamba_cache_mode) and the two club-3090 Qwen3.6-27B logs whose
token counts they reproduce from the logged KV GiB."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._paths import SHARED

from tuner.memory.kvcache import FullAttentionSpec, MambaSpec, get_kv_cache_config, kv_cache_tokens, max_concurrency
from tuner.model.plugin import RankSettings, load_registry
from tuner.memory.specdecode import (aux_hidden_state_layers, checkpoint_drafter_kv_specs, checkpoint_drafter_weights_bytes,
                              drafter_kv_specs, with_speculative_state_blocks)

GiB = 1 << 30
QWEN36 = SHARED / "models" / "Lorbus--Qwen3.6-27B-int4-AutoRound"


@pytest.fixture(scope="module")
def qwen36():
    from tuner.model.modelspec import load_model_spec

    if not (QWEN36 / "config.json").is_file():
        pytest.skip("shared/models not present")
    spec, _ = load_model_spec(str(QWEN36 / "config.json"))
    plugin, _ = load_registry().for_architectures(spec.architectures)
    return spec, plugin


def _settings(**kw):
    base = dict(engine_version="0.24.0", dtype="float16", kv_cache_dtype="fp8_e5m2", tensor_parallel_size=4)
    base.update(kw)
    return RankSettings(**base)


def test_gdn_conv_state_keeps_the_draft_tokens_columns(qwen36):
    # vllm/model_executor/layers/mamba/mamba_utils.py gated_delta_net_state_shape (0.19, 0.20.1, 0.24):
    # conv (k - 1 + num_spec, (2·16·128 + 48·128)/tp), recurrent (48/tp, 128, 128) in float32
    spec, plugin = qwen36
    plain = plugin.kv_cache_spec(spec, _settings())
    mtp3 = plugin.kv_cache_spec(spec, _settings(num_speculative_tokens=3))
    m0 = next(s for s in plain.values() if isinstance(s, MambaSpec))
    m3 = next(s for s in mtp3.values() if isinstance(s, MambaSpec))
    assert m0.shapes == ((3, 2560), (12, 128, 128)) and m3.shapes == ((6, 2560), (12, 128, 128))
    # the attention block size follows the larger state page: 16·cdiv(page, 16·512 B per token)
    assert m0.unpadded_page_size_bytes == 3 * 2560 * 2 + 12 * 128 * 128 * 4 == 801_792
    assert m3.unpadded_page_size_bytes == 817_152
    a0 = next(s for s in plain.values() if isinstance(s, FullAttentionSpec))
    a3 = next(s for s in mtp3.values() if isinstance(s, FullAttentionSpec))
    assert (a0.block_size, a3.block_size) == (1568, 1600)
    assert m3.page_size_bytes == a3.page_size_bytes == 1600 * 512


def test_prefix_caching_mamba_align_mode_reproduces_the_4x3090_mtp_log(qwen36):
    # club3090-584: 0.24.0, TP4, fp8_e5m2, MTP x3, "Available KV cache memory: 15.72 GiB" →
    # "GPU KV cache size: 1,774,963 tokens". 16 attention + 1 MTP layer (group size 17), 48 DeltaNet
    # layers in 3 groups; align mode: 2 + 3 state blocks per group and request (MambaSpec).
    spec, plugin = qwen36
    specs = plugin.kv_cache_spec(spec, _settings(num_speculative_tokens=3, mamba_cache_mode="align"))
    specs = {**specs, **drafter_kv_specs(specs, 1, first_layer_index=64)}
    (specs,) = with_speculative_state_blocks((specs,), 3)
    cfg = get_kv_cache_config("0.24.0", specs, int(15.72 * GiB), max_model_len=262144)
    assert cfg.num_blocks == 1212
    assert kv_cache_tokens("0.24.0", cfg, 262144) == 1_774_963
    # without prefix caching ("none": 1 + 3 blocks) the same memory would report more tokens
    plain = plugin.kv_cache_spec(spec, _settings(num_speculative_tokens=3))
    plain = {**plain, **drafter_kv_specs(plain, 1, first_layer_index=64)}
    (plain,) = with_speculative_state_blocks((plain,), 3)
    cfg0 = get_kv_cache_config("0.24.0", plain, int(15.72 * GiB), max_model_len=262144)
    assert kv_cache_tokens("0.24.0", cfg0, 262144) > 1_774_963 + 1600


#: The drafter geometry the 2x RTX 4090 DFlash log admits (5 layers of 2048 B/token/rank at TP2
#: in a KV spec of their own); the checkpoint's config.json itself is not in shared/models.
DFLASH = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 5,
          "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 17408,
          "vocab_size": 248320, "dflash_config": {"target_layer_ids": [1, 16, 31, 46, 61]}}


def test_dflash_drafter_layers_are_their_own_group_and_reproduce_the_2x4090_log(qwen36):
    # club3090-46: 0.20.1rc1 nightly, TP2, bf16, DFlash x5, "Available KV cache memory: 9.74 GiB" →
    # "GPU KV cache size: 67,728 tokens", "Maximum concurrency for 180,000 tokens: 1.06x".
    # Groups (kv_cache_utils._get_kv_cache_groups_uniform_page_size): 16 target attention, 5 drafter
    # attention (other heads/head size), 48 DeltaNet → group size 5: 4 + 1 + 10 = 15 groups.
    spec, plugin = qwen36
    s = _settings(engine_version="0.20.1", dtype="bfloat16", kv_cache_dtype="auto", tensor_parallel_size=2,
                  num_speculative_tokens=5, mamba_cache_mode="align")
    specs = plugin.kv_cache_spec(spec, s)
    assert next(x for x in specs.values() if isinstance(x, FullAttentionSpec)).block_size == 816
    extra = checkpoint_drafter_kv_specs(DFLASH, specs, tensor_parallel_size=2, kv_dtype_bytes=2, first_layer_index=64)
    assert list(extra)[0] == "model.layers.64.self_attn.attn" and len(extra) == 5
    assert set(extra.values()) == {FullAttentionSpec(816, 4, 128, 2)}
    (specs,) = with_speculative_state_blocks(({**specs, **extra},), 5)
    cfg = get_kv_cache_config("0.20.1", specs, int(9.74 * GiB), max_model_len=180000)
    assert len(cfg.kv_cache_groups) == 15 and cfg.num_blocks == 1251
    assert kv_cache_tokens("0.20.1", cfg, 180000) == 67_728
    assert f"{max_concurrency('0.20.1', cfg, 180000):.2f}" == "1.06"


def test_checkpoint_drafter_weights_follow_the_proposers_sharing_rules():
    target = {"hidden_size": 4096, "vocab_size": 128256}
    g = {"hidden_size": 4096, "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256}
    layer = lambda inp: inp * (4096 + 2 * 1024) // 2 + 4096 * 4096 // 2 + 3 * 4096 * 14336 // 2 + 2 * 4096  # noqa: E731
    # eagle (llama_eagle.py): layers + replicated fc 2H -> H; embedding and head are the target's
    assert checkpoint_drafter_weights_bytes("eagle", g, target, tensor_parallel_size=2) == 2 * (
        layer(4096) + 2 * 4096 * 4096)
    # eagle3 (llama_eagle3.py): first QKV reads 2H, fc 3H -> H, own 32000-token head + int64 d2t map
    e3 = {**g, "draft_vocab_size": 32000}
    assert checkpoint_drafter_weights_bytes("eagle3", e3, target, tensor_parallel_size=2) == 2 * (
        layer(8192) + 4096 + 3 * 4096 * 4096 + 32000 * 4096 // 2) + 8 * 32000
    # the same vocabulary: the head is the target's
    assert checkpoint_drafter_weights_bytes("eagle3", g, target, tensor_parallel_size=2) == 2 * (
        layer(8192) + 4096 + 3 * 4096 * 4096)
    # draft_model (draft_model.py): the whole model with its own embedding and (untied) head
    small = {**g, "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 64, "intermediate_size": 8192, "tie_word_embeddings": True}
    w = checkpoint_drafter_weights_bytes("draft_model", small, target, tensor_parallel_size=1)
    per_layer = 2048 * (2048 + 2 * 512) + 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048
    assert w == 2 * (128256 * 2048 + 16 * per_layer + 2048)  # Llama-3.2-1B: 1.24e9 params (tied)
    untied = checkpoint_drafter_weights_bytes("draft_model", {**small, "tie_word_embeddings": False}, target,
                                              tensor_parallel_size=1)
    assert untied - w == 2 * 128256 * 2048
    with pytest.raises(ValueError, match="num_key_value_heads|num_hidden_layers"):
        checkpoint_drafter_weights_bytes("eagle", {**g, "num_hidden_layers": 0}, target, tensor_parallel_size=1)
    with pytest.raises(ValueError):
        checkpoint_drafter_weights_bytes("medusa", g, target, tensor_parallel_size=1)


def test_dflash_weights_count_the_replicated_fc_and_the_fused_kv_copy():
    # qwen3_dflash.py: 5 Qwen3 layers (q/k norms), fc 5·5120 -> 5120 on every rank, the torch.cat of
    # every layer's K/V weights (_build_fused_kv_buffers), hidden_norm + norm; embedding/head shared
    tp = 2
    layer = 5120 * (16 * 128 + 2 * 4 * 128) + 16 * 128 * 5120 + 3 * 5120 * 17408 // 2 + 2 * 5120 + 2 * 128
    expected = 5 * layer + 2 * 5120 + 5 * 5120 * 5120 + 5 * 2 * 4 * 128 * 5120
    assert checkpoint_drafter_weights_bytes("dflash", DFLASH, {"hidden_size": 5120, "vocab_size": 248320},
                                            tensor_parallel_size=tp) == 2 * expected


def test_aux_hidden_state_layers_as_the_runner_picks_them():
    # gpu_model_runner._get_eagle3_aux_layers_from_config (0.24): explicit ids, DFlash target ids, default 3
    assert aux_hidden_state_layers("dflash", DFLASH) == 5
    assert aux_hidden_state_layers("eagle3", {"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}) == 4
    assert aux_hidden_state_layers("eagle3", {}) == 3
    assert aux_hidden_state_layers("eagle3", {"eagle_config": {"use_aux_hidden_state": False}}) == 0
    assert aux_hidden_state_layers("eagle", {}) == 0 and aux_hidden_state_layers("draft_model", {}) == 0


def _drop(tmp_path, extra: str) -> Path:
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(DFLASH))
    p = tmp_path / "d.yaml"
    p.write_text(f"name: d\nmodel: {QWEN36}\ndevice: NVIDIA GeForce RTX 4090\nengine_version: '0.20.1'\n"
                 "dtype: bfloat16\nquantization: auto_round\ntensor_parallel_size: 2\ndisable_custom_all_reduce: true\n"
                 "max_num_seqs: 1\nmax_num_batched_tokens: 8192\n" + extra +
                 "candidates: {gpu_memory_utilization: [0.95], max_model_len: [180000]}\n")
    return p


def test_dflash_drop_explains_drafter_weights_activation_and_kv(qwen36, tmp_path):
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import load_drop
    from tuner.jobs.job import run_job

    p = _drop(tmp_path, "enable_prefix_caching: true\n"
                        "speculative_config: {method: dflash, num_speculative_tokens: 5, model: drafter}\n")
    req, _dev = prepare_request(load_drop(str(p)), download=False)
    assert req["draft_config_path"] == str((tmp_path / "drafter" / "config.json").resolve())
    res = run_job({**req, "fake": True, "search": False, "engine": "off"})
    c = res["candidates"][0]
    assert c["drafter_weights_bytes"] == checkpoint_drafter_weights_bytes(
        "dflash", DFLASH, json.loads((QWEN36 / "config.json").read_text()), tensor_parallel_size=2)
    assert c["drafter_activation_bytes"] == 5 * 8192 * 5120 * 2
    assert c["num_gpu_blocks"] == c["available_kv_cache_bytes"] // (5 * 816 * 2048)
    assert not any("not modelled" in w for w in res["warnings"])


def test_missing_drafter_config_warns_and_models_nothing(qwen36, tmp_path):
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import load_drop
    from tuner.jobs.job import run_job

    p = _drop(tmp_path, "speculative_config: {method: eagle3, num_speculative_tokens: 2, model: nowhere/none}\n")
    req, _dev = prepare_request(load_drop(str(p)), download=False)
    assert "draft_config_path" not in req and "nowhere/none" in req["draft_config_error"]
    res = run_job({**req, "fake": True, "search": False, "engine": "off"})
    assert res["candidates"][0]["drafter_weights_bytes"] == 0
    assert any("speculative_config.model 'nowhere/none'" in w and "not modelled" in w for w in res["warnings"])


def test_enable_prefix_caching_is_a_validated_drop_field(tmp_path):
    from tuner.question.drop import parse_drop
    from tuner.errors import DropError

    base = "name: x\nmodel: m\ndevice: H100-80GB\ncandidates: {gpu_memory_utilization: [0.9]}\n"
    assert parse_drop(base + "enable_prefix_caching: true\n", "x.yaml").enable_prefix_caching is True
    assert parse_drop(base, "x.yaml").enable_prefix_caching is None
    with pytest.raises(DropError) as e:
        parse_drop(base + "enable_prefix_caching: maybe\n", "x.yaml")
    assert e.value.field == "enable_prefix_caching" and e.value.path == "x.yaml"


def test_mtp_of_a_moe_model_weighs_its_experts_per_rank():
    # DeepSeek-V3's MTP block (deepseek_mtp.py): one DeepseekV2DecoderLayer (MLA + 256 routed experts
    # of 2048, 1 shared) in the checkpoint's fp8, eh_proj a plain nn.Linear (bf16, every rank)
    from tuner.memory.specdecode import mtp_moe_layer_weights_bytes, quantized_param_bytes

    path = SHARED / "models" / "deepseek-ai--DeepSeek-V3" / "config.json"
    if not path.is_file():
        pytest.skip(f"shared models not found at {SHARED}")
    cfg = json.loads(path.read_text())
    fp8 = cfg["quantization_config"]
    assert quantized_param_bytes(fp8, 2) == 1.0 and quantized_param_bytes({"bits": 4}, 2) == 0.5
    assert quantized_param_bytes(None, 2) == 2.0
    h, e, i = 7168, 256, 2048
    attn = h * (1536 + 512 + 64) + 1536 * 128 * 192 // 8 + 512 * 128 * 256 // 8 + 128 * 128 * h // 8
    common = 3 * h * i // 8 + attn + e * h * 2 + 4 * e + 2 * h * h * 2
    tp8 = mtp_moe_layer_weights_bytes(cfg, tensor_parallel_size=8, dtype_bytes=2, quantization_config=fp8)
    assert tp8 == e * 3 * h * (i // 8) + common
    # expert parallel over dp 2 × tp 8: 16 whole experts per rank, the same bytes as 1/16 of each
    ep = mtp_moe_layer_weights_bytes(cfg, tensor_parallel_size=8, data_parallel_size=2, enable_expert_parallel=True,
                                     dtype_bytes=2, quantization_config=fp8)
    assert ep == 16 * 3 * h * i + common
    assert 1.5 * GiB < tp8 < 1.6 * GiB  # ~11.7e9 parameters of MTP block over 8 ranks in fp8


def test_serve_line_prefix_caching_reaches_the_drop_field():
    from tuner.memory.serve_args import parse_serve

    sa = parse_serve(["vllm", "serve", "m", "--enable-prefix-caching"])
    assert sa.values["enable_prefix_caching"] is True
    assert parse_serve(["vllm", "serve", "m", "--no-enable-prefix-caching"]).values["enable_prefix_caching"] is False


def test_validate_finds_a_cases_drafter_beside_the_target(tmp_path):
    from tuner.accuracy.validate import case_request

    for name, cfg in (("org--target", {"architectures": ["LlamaForCausalLM"]}), ("z-lab--drafter", DFLASH)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    case = {"id": "c", "model": "org/target", "gpu": "H100-80GB", "vllm_version": "0.24.0", "engine": "V1",
            "settings": {"max_model_len": 4096, "enable_prefix_caching": True,
                         "speculative_config": {"method": "dflash", "model": "z-lab/drafter", "num_spec_tokens": 5}},
            "observed": {}}
    req = case_request(case, tmp_path)
    assert req["draft_config_path"] == str(tmp_path / "z-lab--drafter" / "config.json")
    assert req["drop"]["enable_prefix_caching"] is True
    assert req["drop"]["speculative_config"] == {"method": "dflash", "num_speculative_tokens": 5, "model": "z-lab/drafter"}
    case["settings"]["speculative_config"]["model"] = "z-lab/absent"
    assert "no config.json at" in case_request(case, tmp_path)["draft_config_error"]


def test_quantized_draft_model_weighs_its_own_checkpoint_quantization():
    """A w8a8 (compressed-tensors int8) Llama-3.1-8B as the draft_model of Llama-3.1-70B on TP4:
    vLLM builds the drafter's model config from its own checkpoint, so its linear layers load in
    int8. It was weighed as bf16 (3.74 GiB per rank, 1.6 GiB too much)."""
    from tuner.model.plugin import RankSettings

    path = SHARED / "models" / "RedHatAI--Meta-Llama-3.1-8B-Instruct-quantized.w8a8" / "config.json"
    if not path.is_file():
        pytest.skip(f"shared models not found at {SHARED}")
    draft = json.loads(path.read_text())
    target = {"hidden_size": 8192, "vocab_size": 128256}
    s = RankSettings(engine_version="0.24.0", dtype="bfloat16", tensor_parallel_size=4, compute_capability="9.0")
    got = checkpoint_drafter_weights_bytes("draft_model", draft, target, tensor_parallel_size=4, dtype_bytes=2,
                                           settings=s)
    h, i, n, v = 4096, 14336 // 4, 32, 128256
    q, kv = 32 * 128 // 4, 2 * 128  # per rank: 8 KV heads over 4 ranks
    int8 = h * (q + 2 * kv) + q * h + h * 2 * i + i * h  # qkv, o, gate_up, down
    scales = 4 * ((q + 2 * kv) + 2 * i)  # tensor strategy: fused qkv / gate_up keep fp32 per-channel scales
    scales += 4 * 2  # o_proj, down_proj: one fp32 scale each
    norms = 2 * h * 2
    embed_and_head = 2 * (v * h // 4) * 2  # bf16, untied, vocab split over TP (never quantized)
    assert got == n * (int8 + scales + norms) + embed_and_head + h * 2
    bf16 = checkpoint_drafter_weights_bytes("draft_model", {k: x for k, x in draft.items() if k != "quantization_config"},
                                            target, tensor_parallel_size=4, dtype_bytes=2, settings=s)
    assert bf16 - got > 1.6 * GiB

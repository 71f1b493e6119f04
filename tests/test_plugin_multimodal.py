"""Multimodal wrappers (mistral3, llava_next, llama4) and tuner.model.simulate.vision: hand-computed
tower bytes, the Mistral-Small-3.1 case prediction (vision tower + V1 encoder profile), Llama-4's
chunked-local / global-NoPE layer pattern and page sizes, and weights against printed
"Model loading took" values."""

from __future__ import annotations

import json

import pytest

from tuner.memory.kvcache import ChunkedLocalAttentionSpec, FullAttentionSpec
from tuner.model.modelspec import load_model_spec
from tuner.model.plugin import RankSettings, load_registry

GiB = 1 << 30
MISTRAL = "mistralai--Mistral-Small-3.1-24B-Instruct-2503"
SCOUT = "meta-llama--Llama-4-Scout-17B-16E-Instruct"


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def _top(shared_dir, name):
    return json.loads((shared_dir / "models" / name / "config.json").read_text())


def _spec(shared_dir, name, plugin=None):
    path = shared_dir / "models" / name / "config.json"
    defaults = plugin.config_defaults(json.loads(path.read_text())) if plugin is not None else None
    return load_model_spec(path, defaults=defaults)[0]


def _settings(**kw):
    base = dict(engine_version="0.19.0", dtype="bfloat16")
    base.update(kw)
    return RankSettings(**base)


def _fake_weights(plugin, spec, settings):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        module = plugin.build_model(spec, settings)
        return plugin.weights_bytes(spec, settings, module)


def test_pixtral_tower_bytes_hand_computed(shared_dir):
    from tuner.model.simulate.vision import vision_tower_bytes

    top = _top(shared_dir, MISTRAL)
    d, i, layers, p, hd, side, h = 1024, 4096, 24, 14, 64, 1540 // 14, 5120
    per_layer = 2 * d + 3 * d * d + d * d + 2 * i * d + i * d  # 2 RMSNorms, qkv, o, gate_up, down
    tower = 3 * p * p * d + d + layers * per_layer  # patch_conv (no bias), ln_pre
    projector = d + (4 * d) * d + d * h + h * h  # norm, patch_merger (2x2), linear_1, linear_2
    rotary = side * side * hd * 4  # float32 inv_freq [110², 64]
    assert vision_tower_bytes(top, 2, kind="pixtral") == 2 * (tower + projector) + rotary == 881_013_760
    # TP shards the fused QKV / gate_up (columns) and o / down / linear_2 inputs (rows)
    tp2 = vision_tower_bytes(top, 2, kind="pixtral", tp=2)
    sharded = layers * (per_layer - 2 * d) + d * h + h * h
    assert tp2 == 2 * (tower + projector - sharded // 2) + rotary
    # vision_config alone: tower only (the projector needs the text hidden size)
    assert vision_tower_bytes(top["vision_config"], 2, kind="pixtral") == 2 * tower + rotary


def test_siglip_gemma3_tower_and_projector(shared_dir):
    from tuner.model.simulate.vision import param_list, vision_tower_bytes

    top = _top(shared_dir, "google--gemma-3-27b-it")
    names = {n for n, _s, _t in param_list(top, kind="siglip")}
    assert "vision_tower.vision_model.post_layernorm.weight" in names  # every layer used
    assert "multi_modal_projector.mm_input_projection_weight" in names
    d, i, p, npos, h, layers = 1152, 4304, 14, (896 // 14) ** 2, 5376, 27
    per_layer = 4 * d + 3 * d * d + 3 * d + d * d + d + i * d + i + d * i + d  # 2 LayerNorms, biased linears
    elems = d * 3 * p * p + d + npos * d + layers * per_layer + 2 * d + d * h + d
    assert vision_tower_bytes(top, 2, kind="siglip") == 2 * elems + npos * 8  # + int64 position_ids


def test_encoder_profile_items():
    from tuner.model.simulate.vision import encoder_profile_items

    # Mistral-Small-3.1: 3025 tokens per 1540² image, N = 8192 -> two images (0.10+: floor)
    assert encoder_profile_items(8192, 3025, "0.19.0") == 2
    assert encoder_profile_items(8192, 3025, "0.9.2") == 3  # 0.9.x: cdiv
    assert encoder_profile_items(2048, 3025, "0.19.0") == 1  # budget = max(N, T)


def test_mistral_small_weights_and_case_prediction(shared_dir, observed_cases, registry):
    from tuner.jobs.job import run_job

    case = observed_cases["llmd-v019-mistralai-mistral-small--tp1pp1dp1--8192"]
    s, o = case["settings"], case["observed"]
    drop = {"engine_version": case["vllm_version"], "dtype": "bfloat16", "kv_cache_dtype": "auto",
            "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "max_num_seqs": s["max_num_seqs"],
            "max_num_batched_tokens": s["max_num_batched_tokens"], "enable_chunked_prefill": True,
            "candidates": {"gpu_memory_utilization": [s["gpu_memory_utilization"]],
                           "max_model_len": [s["max_model_len"]]}}
    device = {"name": case["gpu"], "total_memory_bytes": int(round(case["gpu_total_gib"] * GiB))}
    res = run_job({"drop": drop, "config_path": str(shared_dir / "models" / MISTRAL / "config.json"), "device": device})
    assert res["plugin"] == "mistral3"
    cand = res["candidates"][0]
    assert cand["weights_bytes"] / GiB == pytest.approx(o["weights_gib"], rel=0.005)
    assert cand["num_gpu_blocks"] == pytest.approx(o["num_gpu_blocks"], rel=0.01)
    # the simulated pass (before the budget's calibrated extras): the encoder pass of 2 images
    # with its dense 24200² bf16 mask is the profile's peak (2.00 GiB; observed torch peak 2.03)
    run = next(r for r in res["runs"] if r["pp_rank"] == 0)
    assert run["activation_peak_bytes"] == run["forward_peak_bytes"]
    assert run["activation_peak_bytes"] / GiB == pytest.approx(o["activation_peak_gib"], rel=0.03)


def test_granite_vision_weights(shared_dir, registry):
    """granite-vision-3.3-2b: "Model loading took 5.54 GiB" (its source.txt, vLLM 0.19 log)."""
    plugin = registry.by_name("llava_next")
    spec = _spec(shared_dir, "ibm-granite--granite-vision-3.3-2b", plugin)
    assert _fake_weights(plugin, spec, _settings()) / GiB == pytest.approx(5.54, rel=0.005)


def test_llama4_layer_pattern_and_page_sizes(shared_dir, registry):
    plugin = registry.by_name("llama4")
    spec = _spec(shared_dir, SCOUT)
    specs = plugin.kv_cache_spec(spec, _settings())
    assert len(specs) == 48
    glob = [i for i in range(48) if isinstance(specs[f"model.layers.{i}.self_attn.attn"], FullAttentionSpec)]
    assert glob == list(range(3, 48, 4))  # NoPE global layers: every 4th
    local = [s for s in specs.values() if isinstance(s, ChunkedLocalAttentionSpec)]
    assert len(local) == 36 and {s.attention_chunk_size for s in local} == {8192}
    # 16 tokens × (K + V) × 8 KV heads × 128 × 2 bytes, same page for both kinds
    assert {s.page_size_bytes for s in specs.values()} == {16 * 2 * 8 * 128 * 2}
    fp8 = plugin.kv_cache_spec(spec, _settings(kv_cache_dtype="fp8", tensor_parallel_size=4))
    assert {s.page_size_bytes for s in fp8.values()} == {16 * 2 * 2 * 128 * 1}
    tp16 = plugin.kv_cache_spec(spec, _settings(tensor_parallel_size=16))  # 8 KV heads replicated
    assert {s.page_size_bytes for s in tp16.values()} == {16 * 2 * 1 * 128 * 2}
    # 0.11 disabled the hybrid manager for chunked local attention by default: all full
    old = plugin.kv_cache_spec(spec, _settings(engine_version="0.11.0"))
    assert all(isinstance(s, FullAttentionSpec) for s in old.values())


def test_llama4_vision_bytes(shared_dir):
    from tuner.model.simulate.vision import vision_tower_bytes

    top = _top(shared_dir, SCOUT)
    d, i, layers, p, npatch, h = 1408, 5632, 34, 14, (336 // 14) ** 2 + 1, 5120
    per_layer = 4 * d + 3 * d * d + 3 * d + d * d + d + i * d + i + d * i + d
    elems = (3 * p * p * d + d + npatch * d + 4 * d + layers * per_layer
             + i * 4096 + 4096 * 4096 + 4096 * h)  # adapter fc1/fc2 (no bias), projector
    rotary = npatch * (d // 16 // 2) * 8  # complex64 [577, 44]
    assert vision_tower_bytes(top, 2, kind="llama4") == 2 * elems + rotary


# -- MoonViT / Qwen3.5 encoder profile, every multimodal config --------------------------------
KIMI_VL = "moonshotai--Kimi-VL-A3B-Instruct"


def _tower_pass(top, kind, n):
    """Replay one tower's V1 encoder profile under FakeTensorMode: (tower, peak, kept bytes)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tuner.model.simulate.tracker import MemoryTracker
    from tuner.model.simulate.vision import VisionTower

    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        tower = VisionTower(top, torch.bfloat16, kind=kind)
        with MemoryTracker() as tr:
            out = tower(n)
            kept = tr.live_bytes
        del out
    return tower, tr.peak_bytes, kept


def test_moonvit_dummy_items():
    from tuner.model.simulate.vision import encoder_profile_items, max_tokens_per_item

    # 1024² dummy: 73² patches > 4096 -> scale sqrt(4096/5329) -> 897 px -> padded to 924 = 66·14
    assert max_tokens_per_item({"hidden_size": 1152, "patch_size": 14}, kind="moonvit") == (33 * 33, 1, 66 * 66)
    assert encoder_profile_items(8192, 1089, "0.19.0") == 7
    # a 2506-style processor limit of 16384 patches keeps the 1024² image: 74² padded patches
    assert max_tokens_per_item({"patch_size": 14, "in_token_limit": 16384}, kind="moonvit")[0] == 37 * 37


def test_moonvit_encoder_pass_hand_computed(shared_dir):
    from plugins.kimi_vl import TEXT_DEFAULTS

    top = _top(shared_dir, KIMI_VL)
    top["text_config"] = {**TEXT_DEFAULTS, **top.get("text_config", {})}
    _tower, peak, kept = _tower_pass(top, "moonvit", 8192)
    s, d, h = 7 * 66 * 66, 1152, 2048  # 7 images x 4356 patches
    pixels = s * 3 * 14 * 14 * 2
    rope_table = 512 * 512 * 36 * 8  # complex64 [512, 512, hd/2], cached on the first forward
    freqs = s * 36 * 8
    # the block's rotary phase: input + norm0 + wqkv (3D) + q,k float32 + q,k complex64 + q,k bf16
    block = s * d * (2 + 2 + 6 + 8 + 8 + 4)
    assert peak == pytest.approx(pixels + rope_table + freqs + block, rel=1e-5)  # 1.093 GiB
    # kept through the text run and the sampler: pixel batch, rotary table, outputs [7·1089, H]
    assert kept == pytest.approx(pixels + rope_table + 7 * 1089 * h * 2, rel=1e-5)


def test_qwen3_5_encoder_pass(shared_dir):
    from tuner.model.simulate.vision import encoder_profile_items, max_tokens_per_item, vision_tower_bytes

    top = _top(shared_dir, "Qwen--Qwen3.5-27B")
    # 16.8 MP processor limit in 32-pixel merge units: 128x128 -> 4096² image, 256² patches
    assert max_tokens_per_item(top, kind="qwen3_5") == (16384, 1, 65536)
    assert encoder_profile_items(8192, 16384, "0.19.0") == 1  # budget max(N, T) = T
    d, i, p, layers, out = 1152, 4304, 16, 27, 5120
    per_layer = 4 * d + 3 * d * d + 3 * d + d * d + d + d * i + i + i * d + d
    merger = 2 * d + 16 * d * d + 4 * d + 4 * d * out + out
    elems = d * 3 * 2 * p * p + d + 2304 * d + 8192 * 36 + layers * per_layer + merger
    assert vision_tower_bytes(top, 2, kind="qwen3_5") == 2 * elems
    _tower, peak, kept = _tower_pass(top, "qwen3_5", 8192)
    s = 65536
    pixels, pos, cos_sin = s * 1536 * 2, s * d * 2, 2 * s * 36 * 2
    # attention phase: input, norm1, qkv, q/k contiguous + rotated, context, proj (all [S, *] bf16)
    block = s * d * 2 * (1 + 1 + 3 + 2 + 2 + 1 + 1)
    assert peak == pytest.approx(pixels + pos + s * 2 * 8 + cos_sin + block, rel=1e-5)  # 1.885 GiB
    assert kept == pytest.approx(pixels + s // 4 * out * 2, rel=1e-5)


#: vision.py kind of each multimodal architecture's tower
_KIND = {"Qwen3_5ForConditionalGeneration": "qwen3_5", "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
         "Mistral3ForConditionalGeneration": "pixtral", "Gemma3ForConditionalGeneration": "siglip",
         "Gemma4ForConditionalGeneration": "gemma4", "LlavaNextForConditionalGeneration": "siglip",
         "Llama4ForConditionalGeneration": "llama4", "KimiVLForConditionalGeneration": "moonvit"}


def test_every_multimodal_tower_runs(shared_dir):
    """Every config with a vision_config: its tower builds and replays the V1 encoder profile."""
    from tuner.model.simulate.vision import vision_tower_bytes

    seen = 0
    for cfg in sorted((shared_dir / "models").glob("*/config.json")):
        top = json.loads(cfg.read_text())
        if not isinstance(top.get("vision_config"), dict):
            continue
        kind = _KIND[top["architectures"][0]]
        tower, peak, kept = _tower_pass(top, kind, 8192)
        assert vision_tower_bytes(top, 2, kind=kind) > 0
        assert (peak > kept > 0) if kind != "gemma4" else peak == 0, cfg.parent.name
        seen += 1
    assert seen >= 14


@pytest.mark.parametrize("name", [KIMI_VL, "Qwen--Qwen3.5-27B", "google--gemma-4-26B-A4B"])
def test_multimodal_plugin_pass_runs(shared_dir, registry, name):
    """The full V1 profile pass (encoder, text run, sampler) of the changed wrappers."""
    from tuner.memory.eras import ProfileBatch, era_for
    from tuner.model.simulate.profile import run_pass

    era = era_for("0.19.0")
    plugin, _ = registry.for_architectures(_top(shared_dir, name)["architectures"])
    spec = _spec(shared_dir, name, plugin)
    st = RankSettings("0.19.0", "bfloat16", compiled=era.compiled, runs_attention=False)
    res = run_pass(plugin, spec, st, era, ProfileBatch(2048, 16, 16, True))
    assert res.weights_bytes > 0 and res.activation_peak_bytes > 0

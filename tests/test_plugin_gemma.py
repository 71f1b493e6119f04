"""Gemma plugin: hand-computed KV pages for each sliding pattern (Gemma 2 1:1, Gemma 3 5:1, Gemma 4
unequal pages), fp8 KV and TP replication, weights against transformers' parameter counts and
vLLM's "Model loading took", and the Gemma-2 case predictions on vLLM 0.19 (H100)."""

from __future__ import annotations

import pytest

from tuner.memory import kvcache
from tuner.memory.kvcache import FullAttentionSpec, SlidingWindowSpec
from tuner.model.modelspec import load_model_spec
from tuner.model.plugin import RankSettings, load_registry

GiB = 1 << 30


@pytest.fixture(scope="module")
def gemma():
    return load_registry().by_name("gemma")


def _spec(shared_dir, name):
    return load_model_spec(shared_dir / "models" / name / "config.json")[0]


def _settings(**kw):
    return RankSettings(**{"engine_version": "0.19.0", "dtype": "bfloat16", **kw})


def _weights(plugin, spec, settings):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        module = plugin.build_model(spec, settings)
        params = sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())
        return params, plugin.weights_bytes(spec, settings, module)


def test_gemma2_interleaves_sliding_and_full(shared_dir, gemma):
    spec = _spec(shared_dir, "google--gemma-2-2b-it")  # 26 layers, 4 KV heads × 256, window 4096
    specs = gemma.kv_cache_spec(spec, _settings())
    kinds = [type(specs[f"model.layers.{i}.self_attn.attn"]) for i in range(26)]
    assert kinds == [SlidingWindowSpec, FullAttentionSpec] * 13  # even layers slide
    assert {s.sliding_window for s in specs.values() if isinstance(s, SlidingWindowSpec)} == {4096}
    assert {s.page_size_bytes for s in specs.values()} == {16 * 2 * 4 * 256 * 2}  # 65536
    fp8 = gemma.kv_cache_spec(spec, _settings(kv_cache_dtype="fp8"))
    assert {s.page_size_bytes for s in fp8.values()} == {16 * 2 * 4 * 256}
    # 8 ranks > 4 KV heads: one replicated head per rank
    assert {s.page_size_bytes for s in gemma.kv_cache_spec(spec, _settings(tensor_parallel_size=8)).values()} \
        == {16 * 2 * 1 * 256 * 2}
    # vLLM 0.19 groups: 13 sliding + 13 full -> 2 groups of 13, 13 pages per block, 8 tokens per block reported
    cfg = kvcache.get_kv_cache_config("0.19.0", specs, 13 * 65536 * 1000, max_model_len=256,
                                      max_num_batched_tokens=256)
    assert len(cfg.kv_cache_groups) == 2 and cfg.bytes_per_block == 13 * 65536 and cfg.num_blocks == 1000
    assert kvcache.kv_cache_tokens("0.19.0", cfg, 256) == 1000 // 2 * 16


def test_gemma3_five_local_one_global(shared_dir, gemma):
    spec = _spec(shared_dir, "google--gemma-3-27b-it")  # 62 layers, 16 KV heads × 128, window 1024
    specs = gemma.kv_cache_spec(spec, _settings())
    full = [i for i in range(62) if isinstance(specs[f"model.layers.{i}.self_attn.attn"], FullAttentionSpec)]
    assert full == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert {s.sliding_window for s in specs.values() if isinstance(s, SlidingWindowSpec)} == {1024}
    assert {s.page_size_bytes for s in specs.values()} == {16 * 2 * 16 * 128 * 2}
    # 52 sliding + 10 full: group size 10 -> 6 sliding groups (round-robin) + 1 full, 10 pages per block
    cfg = kvcache.get_kv_cache_config("0.19.0", specs, 1 << 40, max_model_len=256, max_num_batched_tokens=256)
    assert len(cfg.kv_cache_groups) == 7 and cfg.bytes_per_block == 10 * 16 * 2 * 16 * 128 * 2


def test_gemma4_unequal_pages_and_global_heads(shared_dir, gemma):
    spec = _spec(shared_dir, "nvidia--Gemma-4-31B-IT-NVFP4")  # 60 layers; sliding 16×256, full k_eq_v 4×512
    specs = gemma.kv_cache_spec(spec, _settings())
    s0, f5 = specs["model.layers.0.self_attn.attn"], specs["model.layers.5.self_attn.attn"]
    assert isinstance(s0, SlidingWindowSpec) and s0.page_size_bytes == 16 * 2 * 16 * 256 * 2
    assert isinstance(f5, FullAttentionSpec) and f5.page_size_bytes == 16 * 2 * 4 * 512 * 2
    cfg = kvcache.get_kv_cache_config("0.19.0", specs, 1 << 40, max_model_len=256, max_num_batched_tokens=256)
    # full layers' block size doubles to match the sliding page; 50 sliding + 10 full -> 6 groups of 10
    assert len(cfg.kv_cache_groups) == 6 and cfg.bytes_per_block == 10 * 262144
    tp2 = gemma.kv_cache_spec(spec, _settings(tensor_parallel_size=2))
    assert tp2["model.layers.5.self_attn.attn"].page_size_bytes == 16 * 2 * 2 * 512 * 2


@pytest.mark.parametrize("model,params", [
    # parameter counts of transformers' own modules (meta device), all tied embeddings
    ("google--gemma-7b", 8_537_680_896),
    ("google--gemma-2-2b-it", 2_614_341_888),
    ("google--gemma-3-27b-it", 27_432_406_640),  # incl. the SigLIP tower + projector (423,060,336)
])
def test_parameters_match_transformers(shared_dir, gemma, model, params):
    spec = _spec(shared_dir, model)
    p, w = _weights(gemma, spec, _settings())
    assert p == 2 * params
    assert w > p  # rotary caches (Gemma 3: linear-scaled global cache of 131072·8 rows) and the normalizer


def test_gemma3_linear_rope_cache(shared_dir, gemma):
    spec = _spec(shared_dir, "google--gemma-3-4b-it")
    p, w = _weights(gemma, spec, _settings())
    # buffers: local rope [131072, 256] + global linear ×8 rope [1048576, 256] in bf16 (576 MiB),
    # the normalizer, and the SigLIP tower's small buffers
    rope = (131072 + 131072 * 8) * 256 * 2
    assert rope <= w - p < rope + (1 << 20)


@pytest.mark.parametrize("model,observed_gib,tol", [
    ("google--gemma-2-9b-it", 17.22, 0.005),
    # the 2b logs 4.90 GiB; parameters + rope are 4.8735 GiB (its checkpoint is float32, the
    # conversion may leave a few MiB behind); within 0.6 %
    ("google--gemma-2-2b-it", 4.90, 0.006),
])
def test_weights_match_model_loading_took(shared_dir, gemma, model, observed_gib, tol):
    _, w = _weights(gemma, _spec(shared_dir, model), _settings())
    assert abs(w / GiB - observed_gib) / observed_gib <= tol


def _predict(shared_dir, case):
    from tuner.jobs.job import run_job

    s, total = case["settings"], case["gpu_total_gib"]
    drop = {"engine_version": case["vllm_version"], "dtype": case["dtype"], "kv_cache_dtype": "auto",
            "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "max_num_seqs": s["max_num_seqs"],
            "max_num_batched_tokens": s["max_num_batched_tokens"], "block_size": None,
            "enable_chunked_prefill": s["enable_chunked_prefill"], "enforce_eager": False,
            "candidates": {"gpu_memory_utilization": [s["gpu_memory_utilization"]],
                           "max_model_len": [s["max_model_len"]]}, "constraints": {}}
    model = case["model"].replace("/", "--")
    r = run_job({"drop": drop, "config_path": str(shared_dir / "models" / model / "config.json"),
                 "device": {"name": case["gpu"], "total_memory_bytes": int(round(total * GiB))}})
    assert r["plugin"] == "gemma"
    return r["candidates"][0]


@pytest.mark.parametrize("case_id", [
    "llmd-v019-google-gemma-2-2b-it-tp1pp1dp1--8192",
    "llmd-v019-google-gemma-2-9b-it-tp1pp1dp1--8192",
])
def test_gemma2_case_predictions(shared_dir, observed_cases, case_id):
    case = observed_cases[case_id]
    obs = case["observed"]
    c = _predict(shared_dir, case)
    assert abs(c["num_gpu_blocks"] - obs["num_gpu_blocks"]) / obs["num_gpu_blocks"] < 0.01
    assert abs(c["kv_cache_tokens"] - obs["kv_cache_tokens"]) / obs["kv_cache_tokens"] < 0.01
    assert abs(c["max_concurrency"] - obs["max_concurrency"]) / obs["max_concurrency"] < 0.01
    assert abs(c["available_kv_cache_bytes"] / GiB - obs["kv_cache_gib"]) / obs["kv_cache_gib"] < 0.01


@pytest.mark.parametrize("model,text_hidden", [("google--gemma-4-26B-A4B", 2816), ("nvidia--Gemma-4-31B-IT-NVFP4", 5376)])
def test_gemma4_vision_tower(shared_dir, gemma, model, text_hidden):
    """Gemma-4 tower (transformers Gemma4VisionModel: 569,548,080 parameters on the meta device for
    both configs) + embed_vision projection [H, 1152], 16-bit even in the NVFP4 checkpoint."""
    import json

    import torch

    from tuner.memory.quant import scheme_for
    from tuner.model.simulate.vision import VisionTower, vision_tower_bytes

    top = json.loads((shared_dir / "models" / model / "config.json").read_text())
    d, i, layers, p, hd = 1152, 4304, 27, 16, 72
    per_layer = 4 * d * d + 3 * d * i + 2 * hd + 4 * d  # q,k,v,o; gate,up,down; q/k norms; 4 RMSNorms
    tower = 3 * p * p * d + 2 * 10240 * d + layers * per_layer
    assert tower == 569_548_080  # transformers' parameters (std_bias/std_scale are buffers there)
    # + std_bias/std_scale [D] in the default (model) dtype, embed_vision, float32 axial inv_freq x2
    expected = 2 * (tower + 2 * d + d * text_hidden) + 2 * 18 * 4
    assert vision_tower_bytes(top, 2, kind="gemma4") == expected
    assert vision_tower_bytes(top, 2, kind="gemma4", tp=4) == expected  # HF module: replicated
    spec = _spec(shared_dir, model)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        vt = VisionTower(top, torch.bfloat16, kind="gemma4", quant=scheme_for(spec, _settings()))
        got = sum(t.numel() * t.element_size() for t in list(vt.parameters()) + list(vt.buffers()))
    assert got == expected
    # the plugin's module carries the tower (its weights exceed the text model's by the tower)
    _, w = _weights(gemma, spec, _settings())
    assert w > expected

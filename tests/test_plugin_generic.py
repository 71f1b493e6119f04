"""The generic decoder plugin: hand-computed KV page sizes (fp8 KV, TP replication, PP stages) and
weights per rank against the "Model loading took" values real vLLM start-ups printed."""

from __future__ import annotations

import pytest

from tuner.memory.kvcache import FullAttentionSpec, SlidingWindowSpec
from tuner.model.modelspec import load_model_spec
from tuner.model.plugin import RankSettings, load_registry

GiB = 1 << 30


@pytest.fixture(scope="module")
def generic():
    return load_registry().by_name("generic")


def _spec(shared_dir, name):
    return load_model_spec(shared_dir / "models" / name / "config.json")[0]


def _settings(**kw):
    base = dict(engine_version="0.19.0", dtype="bfloat16")
    base.update(kw)
    return RankSettings(**base)


def test_llama_page_sizes_fp8_and_tp_replication(shared_dir, generic):
    spec = _spec(shared_dir, "meta-llama--Llama-3.1-8B-Instruct")  # 32 layers, 8 KV heads, head_dim 128
    specs = generic.kv_cache_spec(spec, _settings())
    assert len(specs) == 32 and all(isinstance(s, FullAttentionSpec) for s in specs.values())
    # 16 tokens × (K + V) × 8 heads × 128 × 2 bytes
    assert {s.page_size_bytes for s in specs.values()} == {16 * 2 * 8 * 128 * 2}
    fp8 = generic.kv_cache_spec(spec, _settings(kv_cache_dtype="fp8"))
    assert {s.page_size_bytes for s in fp8.values()} == {16 * 2 * 8 * 128 * 1}
    tp2 = generic.kv_cache_spec(spec, _settings(tensor_parallel_size=2))
    assert {s.page_size_bytes for s in tp2.values()} == {16 * 2 * 4 * 128 * 2}
    # 16 ranks > 8 KV heads: each rank keeps one replicated head
    tp16 = generic.kv_cache_spec(spec, _settings(tensor_parallel_size=16))
    assert {s.page_size_bytes for s in tp16.values()} == {16 * 2 * 1 * 128 * 2}


def test_pipeline_stages_split_the_layers(shared_dir, generic):
    spec = _spec(shared_dir, "meta-llama--Llama-3.1-8B-Instruct")
    stages = [generic.kv_cache_spec(spec, _settings(pipeline_parallel_size=4, pp_rank=r)) for r in range(4)]
    assert [len(s) for s in stages] == [8, 8, 8, 8]
    assert "model.layers.0.self_attn.attn" in stages[0] and "model.layers.31.self_attn.attn" in stages[3]


def test_sliding_window_on_every_layer(tiny_config, generic):
    import json

    cfg = json.loads((tiny_config / "config.json").read_text())
    cfg.update({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 1024})
    (tiny_config / "config.json").write_text(json.dumps(cfg))
    spec = load_model_spec(tiny_config / "config.json")[0]
    specs = generic.kv_cache_spec(spec, _settings())
    assert all(isinstance(s, SlidingWindowSpec) and s.sliding_window == 1024 for s in specs.values())
    assert {s.page_size_bytes for s in specs.values()} == {16 * 2 * 2 * 16 * 2}  # 2 KV heads × head_dim 16


@pytest.mark.parametrize("model,tp,pp,observed_gib,tol_gib", [
    ("meta-llama--Llama-3.1-8B-Instruct", 1, 1, 14.9888, 0.0005),
    ("meta-llama--Llama-3.1-8B-Instruct", 2, 1, 7.51, 0.006),
    ("meta-llama--Llama-3.1-8B-Instruct", 4, 1, 3.77, 0.006),
    ("meta-llama--Llama-3.1-8B-Instruct", 1, 2, 7.51, 0.006),
    ("meta-llama--Llama-3.1-8B-Instruct", 1, 4, 4.26, 0.006),
    ("codellama--CodeLlama-7b-hf", 1, 1, 12.56, 0.006),
    ("Qwen--Qwen3-8B", 1, 1, 15.27, 0.006),
    ("Qwen--Qwen3-0.6B", 1, 1, 1.12, 0.006),
    ("Qwen--Qwen2.5-7B-Instruct", 4, 1, 3.55, 0.006),
])
def test_weights_match_model_loading_took(shared_dir, generic, model, tp, pp, observed_gib, tol_gib):
    """Bytes of the rank's module (PP: the first stage, whose log line the cases quote)."""
    import torch  # noqa: F401  (build_model imports torch)
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = _spec(shared_dir, model)
    s = _settings(tensor_parallel_size=tp, pipeline_parallel_size=pp, pp_rank=0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        module = generic.build_model(spec, s)
        weights = generic.weights_bytes(spec, s, module)
    assert abs(weights / GiB - observed_gib) <= tol_gib, weights / GiB

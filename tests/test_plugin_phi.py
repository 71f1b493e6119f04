"""Phi plugin: Phi-2 (MHA KV, partial rotary, biases, untied biased head) and Phi-3/Phi-4 (Llama
layout, longrope cache, sliding window on every layer): pages and weights vs transformers."""

from __future__ import annotations

import json

import pytest

from tuner.memory.kvcache import FullAttentionSpec, SlidingWindowSpec
from tuner.model.modelspec import load_model_spec
from tuner.model.plugin import RankSettings, load_registry


@pytest.fixture(scope="module")
def phi():
    return load_registry().by_name("phi")


def _settings(**kw):
    return RankSettings(**{"engine_version": "0.19.0", "dtype": "bfloat16", **kw})


def _weights(plugin, spec, settings):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        module = plugin.build_model(spec, settings)
        params = sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())
        return params, plugin.weights_bytes(spec, settings, module), module


def test_registry_picks_phi(phi):
    reg = load_registry()
    assert reg.for_architectures(["PhiForCausalLM"])[0] is phi
    assert reg.for_architectures(["Phi3ForCausalLM"])[0] is phi


def test_phi2_pages_and_weights(shared_dir, phi):
    spec = load_model_spec(shared_dir / "models" / "microsoft--phi-2" / "config.json")[0]
    specs = phi.kv_cache_spec(spec, _settings(dtype="float16"))
    assert len(specs) == 32 and all(isinstance(s, FullAttentionSpec) for s in specs.values())
    assert {s.page_size_bytes for s in specs.values()} == {16 * 2 * 32 * 80 * 2}  # 32 KV heads × 80
    assert {s.page_size_bytes for s in phi.kv_cache_spec(spec, _settings(tensor_parallel_size=4)).values()} \
        == {16 * 2 * 8 * 80 * 2}
    p, w, module = _weights(phi, spec, _settings(dtype="float16"))
    assert p == 2 * 2_779_683_840  # transformers' PhiForCausalLM parameter count (biases, LayerNorms, lm_head bias)
    assert w - p == 2048 * 32 * 2  # cos_sin_cache [max_pos 2048, rotary_dim 0.4·80 = 32]


def test_phi4_weights_and_tp(shared_dir, phi):
    spec = load_model_spec(shared_dir / "models" / "microsoft--phi-4" / "config.json")[0]
    p, w, _ = _weights(phi, spec, _settings())
    assert p == 2 * 14_659_507_200
    assert w - p == 16384 * 128 * 2
    assert {s.page_size_bytes for s in phi.kv_cache_spec(spec, _settings()).values()} == {16 * 2 * 10 * 128 * 2}


def test_phi3_sliding_window_and_longrope(tmp_path, phi):
    cfg = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 320,
           "max_position_embeddings": 4096, "original_max_position_embeddings": 1024, "sliding_window": 1023,
           "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
           "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model_spec(tmp_path / "config.json")[0]
    specs = phi.kv_cache_spec(spec, _settings())
    assert all(isinstance(s, SlidingWindowSpec) and s.sliding_window == 1023 for s in specs.values())
    p, w, _ = _weights(phi, spec, _settings())
    assert w - p == (1024 + 4096) * 16 * 2  # short + long cos/sin caches, head_dim 16

"""Simulated profile passes: fake equals real, and the terms match real vLLM start-ups."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tuner.memory.eras import GiB, ProfileBatch, era_for  # noqa: E402
from tuner.model.modelspec import load_model_spec, resolve_model_path  # noqa: E402
from tuner.model.plugin import RankSettings, load_registry  # noqa: E402
from tuner.model.simulate.profile import run_pass  # noqa: E402
from tuner.model.simulate.tracker import MemoryTracker, round_allocation  # noqa: E402


def _pass(config_dir, version, n, r, *, fake=True, tp=1, dtype=None):
    spec, _ = load_model_spec(resolve_model_path(str(config_dir)))
    era = era_for(version)
    plugin, _ = load_registry().for_architectures(spec.architectures)
    st = RankSettings(version, dtype or spec.torch_dtype, tensor_parallel_size=tp, compiled=era.compiled,
                      runs_attention=era.engine == "V0")
    return run_pass(plugin, spec, st, era, ProfileBatch(n, r, r, True), fake=fake)


def test_round_allocation_follows_cuda_allocator():
    assert round_allocation(1) == 512
    assert round_allocation(512) == 512
    assert round_allocation(513) == 1024
    assert round_allocation(0) == 0


def test_tracker_counts_new_storages_not_views_or_inplace():
    with torch.no_grad():
        x = torch.empty(100, 16)
        with MemoryTracker() as t:
            y = x @ torch.empty(16, 32)  # the weight (2048 B) and y (12800 B)
            y.add_(1)
            z = y.view(-1)
            del z
        assert t.peak_bytes == 2048 + 12800
        assert t.live_bytes == 12800  # the temporary weight is gone, y lives


@pytest.mark.parametrize("version", ["0.19.0", "0.6.4", "0.11.0", "0.13.0", "0.7.3"])
def test_fake_pass_equals_real_cpu_pass(tiny_config, version):
    fake = _pass(tiny_config, version, 512, 64, fake=True)
    real = _pass(tiny_config, version, 512, 64, fake=False)
    assert fake.activation_peak_bytes == real.activation_peak_bytes
    assert fake.forward_peak_bytes == real.forward_peak_bytes
    assert fake.sampler_peak_bytes == real.sampler_peak_bytes
    assert fake.weights_bytes == real.weights_bytes
    assert fake.activation_peak_bytes > 0


def test_tiny_weights_by_hand(tiny_config):
    r = _pass(tiny_config, "0.19.0", 256, 16)
    h, i, v, layers, kv, hd = 64, 176, 1024, 2, 2, 16  # vocab 1000 padded to 1024
    per_layer = h * (4 * hd + 2 * kv * hd) + 4 * hd * h + h * 2 * i + i * h + 2 * h
    params = 2 * v * h + layers * per_layer + h
    rope = 4096 * 16
    # + the caching allocator's 512 B minimum block on the five 128 B norms (V1 too since §24): 5 × 384
    assert r.weights_bytes == 2 * (params + rope) + 5 * 384


def test_llama31_8b_weights_match_vllm_log(shared_dir):
    r = _pass(shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct", "0.19.0", 8192, 1024)
    # "Model loading took 14.9889 GiB" (8,030,261,248 bf16 params + a 32 MiB rotary cache)
    assert r.weights_bytes == 8_030_261_248 * 2 + 131072 * 128 * 2
    assert abs(r.weights_bytes / GiB - 14.99) / 14.99 < 0.005
    # the 0.19 profile peak is the Triton sampler over [1024, 128256] fp32 logits: 1.89 GiB logged
    assert abs(r.activation_peak_bytes / GiB - 1.89) < 0.1
    assert r.sampler_peak_bytes > r.forward_peak_bytes


def test_v0_activation_grows_with_max_num_batched_tokens(shared_dir):
    cfg = shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct"
    a20 = _pass(cfg, "0.6.4", 20000, 256).activation_peak_bytes / GiB
    a29 = _pass(cfg, "0.6.4", 29000, 256).activation_peak_bytes / GiB
    # logged: 17.06 and 17.98 GiB torch peak minus 14.99 GiB weights
    assert abs(a20 - 2.07) < 0.1
    assert abs(a29 - 2.99) < 0.1


def test_tensor_parallel_shards_weights_not_sampler(shared_dir):
    cfg = shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct"
    one = _pass(cfg, "0.19.0", 8192, 1024)
    two = _pass(cfg, "0.19.0", 8192, 1024, tp=2)
    assert abs(two.weights_bytes / GiB - 7.51) < 0.05  # logged 7.51 GiB at TP2
    assert two.sampler_peak_bytes >= one.sampler_peak_bytes  # logits gathered to the full vocab


def test_config_without_torch_dtype_loads(tmp_path):
    """Regression: a config with no ``torch_dtype`` key (gpt-oss) crashed ModelSpec loading."""
    import json

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100, "tie_word_embeddings": True}))
    spec, _ = load_model_spec(d / "config.json")
    assert spec.torch_dtype in ("float16", "float32", "bfloat16")
    assert spec.tie_word_embeddings is True
    assert spec.num_key_value_heads == 4 and spec.head_dim == 16

"""MLA plugins (plugins/deepseek.py, plugins/glm_moe_dsa.py, tuner/model/simulate/mla.py): hand-computed
KV pages, block size by era/backend, weights of DeepSeek-V2-Lite against vLLM 0.19's log, and the
visible case's prediction."""

from __future__ import annotations

import pytest

from tuner.memory import kvcache
from tuner.errors import ModelConfigError
from tuner.model.plugin import RankSettings

GiB = 1 << 30
V2_LITE = "deepseek-ai--DeepSeek-V2-Lite-Chat"
CASE = "llmd-v019-deepseek-ai-deepseek-v2--tp1pp1dp1--8192"


def _spec(shared_dir, name):
    from tuner.model.modelspec import load_model_spec

    spec, _ = load_model_spec(shared_dir / "models" / name / "config.json")
    return spec


def _plugin(name):
    from tuner.model.plugin import load_registry

    return load_registry().by_name(name)


def _settings(**kw):
    base = dict(engine_version="0.19.0", dtype="bfloat16")
    base.update(kw)
    return RankSettings(**base)


# ------------------------------------------------------------------------------- block size

def test_mla_block_size_by_era_and_backend():
    from tuner.plugins.deepseek import mla_block_size

    # 0.19 Hopper: FLASH_ATTN_MLA (multiple of 16) for 16-bit KV, FLASHMLA (64) for fp8.
    assert mla_block_size("0.19.0", "auto") == 16
    assert mla_block_size("0.19.0", "fp8") == 64
    assert mla_block_size("0.19.0", "auto", sparse=True) == 64
    assert mla_block_size("0.19.0", "auto", user_block_size=32) == 32
    # 0.19 Blackwell (FLASHINFER_MLA 32/64) and Ampere (TRITON_MLA).
    assert mla_block_size("0.19.0", "auto", capability=(10, 0)) == 32
    assert mla_block_size("0.19.0", "auto", capability=(8, 0)) == 16
    # <= 0.18: FlashMLA forced to 64 on Hopper (user 16 replaced), CUTLASS MLA 128 on Blackwell.
    assert mla_block_size("0.17.0", "auto") == 64
    assert mla_block_size("0.13.0", "auto", user_block_size=16) == 64
    assert mla_block_size("0.13.0", "auto", user_block_size=128) == 128
    assert mla_block_size("0.11.0", "auto", capability=(10, 0)) == 128
    assert mla_block_size("0.11.0", "auto", capability=(8, 6)) == 16
    assert mla_block_size("0.7.2", "auto") == 16


# ------------------------------------------------------------------------------- KV pages

def test_v2_lite_mla_pages_bf16_fp8_and_tp(shared_dir):
    spec, p = _spec(shared_dir, V2_LITE), _plugin("deepseek")
    bf16 = p.kv_cache_spec(spec, _settings())
    assert len(bf16) == 27
    s = bf16["model.layers.0.self_attn.attn"]
    assert isinstance(s, kvcache.MLAAttentionSpec)
    # one latent per token: (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 B x 16 tokens
    assert (s.block_size, s.num_kv_heads, s.head_size) == (16, 1, 576)
    assert s.page_size_bytes == 16 * 576 * 2 == 18432
    fp8 = p.kv_cache_spec(spec, _settings(kv_cache_dtype="fp8"))["model.layers.26.self_attn.attn"]
    assert (fp8.block_size, fp8.page_size_bytes) == (64, 64 * 576 * 1)
    # TP does not shard the latent: every rank holds the full 576-wide vector.
    for tp in (2, 4, 8):
        t = p.kv_cache_spec(spec, _settings(tensor_parallel_size=tp))["model.layers.5.self_attn.attn"]
        assert t.page_size_bytes == 18432 and t.num_kv_heads == 1
    # bytes of one block across the 27 layers (what available KV bytes are divided by)
    cfg = kvcache.get_kv_cache_configs("0.19.0", [(bf16, 1 << 40)], max_model_len=16)[0]
    assert cfg.bytes_per_block == 27 * 18432 == 497664
    # PP splits the layers, the page stays
    st = p.kv_cache_spec(spec, _settings(pipeline_parallel_size=2, pp_rank=1))
    assert len(st) == 13 and "model.layers.26.self_attn.attn" in st


def test_pre_mla_era_is_mha(shared_dir):
    spec, p = _spec(shared_dir, V2_LITE), _plugin("deepseek")
    s = p.kv_cache_spec(spec, _settings(engine_version="0.6.4", tensor_parallel_size=2))["model.layers.0.self_attn.attn"]
    assert isinstance(s, kvcache.FullAttentionSpec)
    assert s.page_size_bytes == 2 * 16 * 8 * 192 * 2  # K and V, 16/2 heads x qk_head_dim 192


def test_glm_sparse_mla_and_indexer_pages(shared_dir):
    spec, p = _spec(shared_dir, "zai-org--GLM-5.3"), _plugin("glm_moe_dsa")
    kv = p.kv_cache_spec(spec, _settings(tensor_parallel_size=8))
    assert len(kv) == 2 * 78
    main, idx = kv["model.layers.3.self_attn.attn"], kv["model.layers.3.self_attn.indexer.k_cache"]
    assert main.page_size_bytes == 64 * 576 * 2
    assert idx.page_size_bytes == 64 * (128 + 4)  # fp8 values + fp32 scale per 128, uint8
    fp8 = p.kv_cache_spec(spec, _settings(tensor_parallel_size=8, kv_cache_dtype="fp8"))
    assert fp8["model.layers.0.self_attn.attn"].page_size_bytes == 64 * 656  # fp8_ds_mla
    cfg = kvcache.get_kv_cache_configs("0.19.0", [(kv, 1 << 40)], max_model_len=64)[0]
    assert cfg.bytes_per_block == 78 * (73728 + 8448)


def test_deepseek_v4_fails_clearly(shared_dir):
    spec = _spec(shared_dir, "deepseek-ai--DeepSeek-V4-Flash")
    with pytest.raises(ModelConfigError, match="DeepseekV4ForCausalLM is not supported by vLLM 0.19.0"):
        _plugin("deepseek_v4").kv_cache_spec(spec, _settings(tensor_parallel_size=8))
    with pytest.raises(ModelConfigError, match="served by the deepseek_v4 plugin"):
        _plugin("deepseek").kv_cache_spec(spec, _settings(tensor_parallel_size=8))


# ------------------------------------------------------------------------------- weights

def _weights(p, spec, settings):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        module = p.build_model(spec, settings)
        return p.weights_bytes(spec, settings, module), module


def test_v2_lite_weights_vs_vllm_019_log(shared_dir, observed_cases):
    spec, p = _spec(shared_dir, V2_LITE), _plugin("deepseek")
    w, module = _weights(p, spec, _settings())
    observed = observed_cases[CASE]["observed"]["weights_gib"]  # "Model loading took 29.43 GiB"
    # 15.70 B parameters in bf16 + the 160k x 64 yarn rotary cache; no W_UK/W_UV copy for bf16.
    assert not any("w_uk_uv" in n for n, _ in module.named_buffers())
    # Known gap: vLLM holds ~0.155 GiB more than the parameters (not found in the 0.19 sources).
    assert abs(w / GiB - observed) / observed < 0.006
    w2, _ = _weights(p, spec, _settings(tensor_parallel_size=2))
    assert 0.49 < w2 / w < 0.52  # everything but the replicated kv_a projection / norms / gate halves


def test_fp8_kv_b_dequant_copy_counts(shared_dir):
    spec, p = _spec(shared_dir, "deepseek-ai--DeepSeek-V3"), _plugin("deepseek")
    from tuner.memory.quant import scheme_for

    if scheme_for(spec, _settings(tensor_parallel_size=8)) is None:
        pytest.skip("fp8 quantization scheme not available")
    w, module = _weights(p, spec, _settings(tensor_parallel_size=8))
    copies = [b for n, b in module.named_buffers() if n.endswith("w_uk_uv")]
    assert len(copies) == 61
    assert copies[0].shape == (512, 16 * (128 + 128))  # [kv_lora, heads/tp x (P+V)] bf16


# ------------------------------------------------------------------------------- the case

def test_v2_lite_case_prediction(shared_dir, observed_cases):
    from tuner.accuracy.validate import predict_cases

    row = predict_cases([observed_cases[CASE]], shared_dir / "models")[0]
    assert row["status"] == "ok", row
    assert row["plugin"] == "deepseek"
    obs = observed_cases[CASE]["observed"]
    # 16 tokens per block (FLASH_ATTN_MLA on H100, 0.19): tokens = blocks x 16.
    assert row["predicted_kv_cache_tokens"] == row["predicted_num_gpu_blocks"] * 16
    assert obs["kv_cache_tokens"] == obs["num_gpu_blocks"] * 16
    assert abs(row["predicted_num_gpu_blocks"] - obs["num_gpu_blocks"]) / obs["num_gpu_blocks"] < 0.01

"""Hand-computed KV-cache sizes (tuner.kvcache); numbers from reference §2.5, §4.7–4.9, §7."""

from __future__ import annotations

import pytest

from tuner import kvcache as kv
from tuner.errors import KVCacheError

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


def dense(n_layers: int, spec) -> dict:
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(n_layers)}


# ----------------------------------------------------------------------------- dense GQA

def test_llama31_8b_page_and_block_bytes():
    spec = kv.FullAttentionSpec(16, 8, 128, 2)
    assert spec.page_size_bytes == 65_536  # 16 · 2 · 8 · 128 · 2
    cfg = kv.get_kv_cache_config("0.19.0", dense(32, spec), 10 * GiB, max_model_len=32_768)
    assert cfg.bytes_per_block == 2_097_152  # 32 · 65,536 = 2 MiB
    assert cfg.num_blocks == 5_120  # 10 GiB / 2 MiB
    assert kv.kv_cache_tokens("0.19.0", cfg, 32_768) == 81_920
    assert kv.max_concurrency("0.19.0", cfg, 32_768) == pytest.approx(2.5)  # 5120 / cdiv(32768, 16)
    assert len(cfg.kv_cache_groups) == 1 and len(cfg.kv_cache_groups[0].layer_names) == 32
    assert [t.size_bytes for t in cfg.kv_cache_tensors] == [5_120 * 65_536] * 32


def test_v0_block_equals_v1_bytes_per_block():
    assert kv.v0_cache_block_size(32, 16, 8, 128, 2) == 2_097_152
    assert kv.v0_num_gpu_blocks(int(53.29 * GiB), 2 * MiB) == 27_284  # reference §7A
    assert kv.v0_num_gpu_blocks(-1, 2 * MiB) == 0
    assert kv.v0_num_gpu_blocks(GiB, 0) == 0  # attention-free
    assert kv.v0_max_concurrency(27_284, 16, 8_192) == pytest.approx(53.289, abs=1e-3)


def test_fp8_kv_halves_the_block():
    dt = kv.dtype_bytes_for("fp8", "bfloat16")
    assert dt == 1
    cfg = kv.get_kv_cache_config("0.19.0", dense(32, kv.FullAttentionSpec(16, 8, 128, dt)), 10 * GiB,
                                 max_model_len=8_192)
    assert cfg.bytes_per_block == MiB
    assert cfg.num_blocks == 10_240


@pytest.mark.parametrize("kv_dtype,model_dtype,want", [
    ("auto", "bfloat16", 2), ("auto", "float16", 2), ("auto", "float32", 4), ("fp8_e4m3", "bfloat16", 1),
    ("fp8_e5m2", "float16", 1), ("fp8_inc", "bfloat16", 1), ("bfloat16", "float32", 2),
])
def test_dtype_bytes_for(kv_dtype, model_dtype, want):
    assert kv.dtype_bytes_for(kv_dtype, model_dtype) == want


# ----------------------------------------------------------------------------- TP / PP

def test_qwen25_7b_tp8_replicates_kv_heads():
    # 28 layers, 4 KV heads, head 128, bf16: 56 KiB/token at TP1; TP8 keeps 1 head per rank.
    per_token = lambda heads: 28 * 2 * heads * 128 * 2
    assert per_token(kv.kv_heads_per_rank(4, 1)) == 56 * KiB
    assert kv.kv_heads_per_rank(4, 2) == 2
    assert kv.kv_heads_per_rank(4, 8) == 1
    assert per_token(kv.kv_heads_per_rank(4, 8)) == 14 * KiB  # not 7 KiB
    spec = kv.FullAttentionSpec(16, kv.kv_heads_per_rank(4, 8), 128, 2)
    cfg = kv.get_kv_cache_config("0.19.0", dense(28, spec), GiB, max_model_len=4_096)
    assert cfg.bytes_per_block == 16 * 14 * KiB


@pytest.mark.parametrize("heads,tp", [(6, 4), (4, 3)])
def test_kv_heads_must_divide(heads, tp):
    with pytest.raises(KVCacheError):
        kv.kv_heads_per_rank(heads, tp)


def test_layers_per_pp_rank_skips_last_stage():
    assert kv.layers_per_pp_rank(32, 2) == [16, 16]
    assert kv.layers_per_pp_rank(10, 4) == [2, 3, 3, 2]
    assert kv.layers_per_pp_rank(32, 3) == [11, 11, 10]


def test_pp_workers_take_min_blocks():
    spec = kv.FullAttentionSpec(16, 8, 128, 2)
    stage0 = {f"l{i}": spec for i in range(16)}
    stage1 = {f"l{i}": spec for i in range(16, 32)}
    cfgs = kv.get_kv_cache_configs("0.19.0", [(stage0, 10 * GiB), (stage1, 8 * GiB)], max_model_len=4_096)
    assert [c.bytes_per_block for c in cfgs] == [MiB, MiB]
    assert [c.num_blocks for c in cfgs] == [8_192, 8_192]  # min(10240, 8192)


# ----------------------------------------------------------------------------- MLA

def test_deepseek_v3_mla_page():
    spec = kv.MLAAttentionSpec(64, 1, 512 + 64, 2)
    assert spec.page_size_bytes == 73_728
    cfg = kv.get_kv_cache_config("0.19.0", dense(61, spec), 45 * GiB, max_model_len=8_192)
    assert cfg.bytes_per_block == 4_497_408  # 61 · 73,728
    assert cfg.num_blocks == 45 * GiB // 4_497_408
    assert kv.v0_cache_block_size(61, 64, 1, 576, 2, use_mla=True) == 4_497_408
    assert kv.MLAAttentionSpec(64, 1, 576, 1, cache_dtype_str="fp8_ds_mla").page_size_bytes == 64 * 656
    assert kv.mla_spec("0.33.0", 64, 576, 1, cache_dtype_str="fp8_ds_mla").page_size_bytes == 64 * 576


# ----------------------------------------------------------------------------- hybrid

def gemma3_27b(window: int = 1024) -> dict:
    specs = {}
    for i in range(62):
        if i % 6 == 5:
            specs[f"layers.{i}"] = kv.FullAttentionSpec(16, 16, 128, 2)
        else:
            specs[f"layers.{i}"] = kv.SlidingWindowSpec(16, 16, 128, 2, window)
    return specs


def test_gemma3_27b_hybrid_groups():
    specs = gemma3_27b()
    assert sum(isinstance(s, kv.SlidingWindowSpec) for s in specs.values()) == 52
    page = 2 * 16 * 16 * 128 * 2
    groups = kv.get_kv_cache_groups("0.19.0", specs)
    # layer 0 is SWA, so its bucket comes first: 52 SWA round-robin into 6 groups (8 padding), then 10 full
    assert [len(g.layer_names) for g in groups] == [9, 9, 9, 9, 8, 8, 10]
    assert isinstance(groups[-1].spec, kv.FullAttentionSpec)
    cfg = kv.get_kv_cache_config("0.19.0", specs, 20 * GiB, max_model_len=32_768)
    assert cfg.bytes_per_block == 10 * page == 1_310_720
    assert cfg.num_blocks == 20 * GiB // (10 * page) == 16_384
    # ≤0.21 log: blocks // groups · block size; 0.22+: int(concurrency · M)
    assert kv.kv_cache_tokens("0.19.0", cfg, 32_768) == 16_384 // 7 * 16
    per_req = 32_768 // 16 + 6 * (((1023 + 2048) // 16 + 1) + 1)
    assert kv.max_concurrency("0.28.0", cfg, 32_768) == pytest.approx(16_384 / per_req)
    off = kv.get_kv_cache_config("0.19.0", specs, 20 * GiB, max_model_len=32_768, enable_hybrid_kv_cache_manager=False)
    assert off.bytes_per_block == 62 * page and len(off.kv_cache_groups) == 1


def test_grouping_order_changed_after_010():
    f, s = kv.FullAttentionSpec(16, 2, 64, 4), kv.SlidingWindowSpec(16, 2, 64, 4, 1)
    specs = {"l1": f, "l2": f, "l3": s, "l4": s, "l5": s, "l6": s}
    old = kv.get_kv_cache_groups("0.10.1.1", specs)
    new = kv.get_kv_cache_groups("0.19.0", specs)
    assert [g.layer_names for g in old] == [["l1", "l2"], ["l3", "l4"], ["l5", "l6"]]
    assert [g.layer_names for g in new] == [["l1", "l2"], ["l3", "l5"], ["l4", "l6"]]
    assert kv.get_kv_cache_groups("0.8.0", specs)[0].layer_names == ["l1", "l2", "l3", "l4", "l5", "l6"]


def test_sliding_window_request_blocks():
    s = kv.SlidingWindowSpec(16, 32, 128, 2, 1024)
    assert s.max_memory_usage_bytes("0.19.0", 16_384, 1_024) == 129 * s.page_size_bytes  # cdiv(2047,16)+1


# ----------------------------------------------------------------------------- null block / forms by version

def test_null_block_in_estimate_from_030():
    specs = dense(32, kv.FullAttentionSpec(16, 8, 128, 2))
    assert kv.estimate_max_model_len("0.19.0", specs, 10 * GiB, max_model_len=131_072) == 81_920
    with pytest.raises(KVCacheError, match="estimated maximum model length is 81920"):
        kv.get_kv_cache_config("0.19.0", specs, 10 * GiB, max_model_len=131_072)
    with pytest.raises(KVCacheError, match="estimated maximum model length is 81904"):
        kv.get_kv_cache_config("0.33.0", specs, 10 * GiB, max_model_len=131_072)
    # exactly M/bs blocks: 0.19 accepts, 0.33 rejects (one block is the null block)
    assert kv.get_kv_cache_config("0.19.0", specs, 16 * GiB, max_model_len=131_072).num_blocks == 8_192
    with pytest.raises(KVCacheError, match="model's max seq len"):
        kv.get_kv_cache_config("0.33.0", specs, 16 * GiB, max_model_len=131_072)


def test_message_wording_by_version():
    specs = dense(2, kv.FullAttentionSpec(16, 8, 128, 2))
    with pytest.raises(KVCacheError, match="models's max seq len"):
        kv.check_enough_kv_cache_memory("0.19.0", specs, MiB, max_model_len=4_096)
    with pytest.raises(KVCacheError, match="No available memory"):
        kv.check_enough_kv_cache_memory("0.10.1.1", specs, 0, max_model_len=4_096)


def test_auto_fit_by_version():
    specs = dense(2, kv.FullAttentionSpec(16, 2, 64, 4))  # page 16 KiB, 32 blocks in 1 MiB
    assert kv.auto_fit_max_model_len("0.19.0", specs, MiB, max_model_len=1_024) == 512
    assert kv.auto_fit_max_model_len("0.33.0", specs, MiB, max_model_len=1_024) == 496
    with pytest.raises(KVCacheError, match="Cannot auto-fit"):
        kv.auto_fit_max_model_len("0.19.0", specs, 1_000, max_model_len=1_024)


def test_concurrency_and_tokens_forms_by_version():
    # Reference §4.9: M = 32001, 27,284 blocks of 16 tokens.
    cfg = kv.KVCacheConfig(27_284, 2 * MiB, [kv.KVCacheGroup(["l"], kv.FullAttentionSpec(16, 8, 128, 2))], [])
    assert kv.max_concurrency("0.8.0", cfg, 32_001) == pytest.approx(13.6416, abs=1e-4)
    assert kv.max_concurrency("0.9.2", cfg, 32_001) == pytest.approx(27_284 / 2_001)
    assert kv.kv_cache_tokens("0.19.0", cfg, 32_001) == 436_544
    assert kv.kv_cache_tokens("0.22.0", cfg, 32_001) == 436_339


def test_num_gpu_blocks_override():
    specs = dense(2, kv.FullAttentionSpec(16, 2, 64, 4))
    assert kv.get_kv_cache_config("0.19.0", specs, MiB, max_model_len=16, num_gpu_blocks_override=16).num_blocks == 16
    with pytest.raises(KVCacheError, match="max seq len"):  # 0.33: override caps the admission check
        kv.get_kv_cache_config("0.33.0", specs, 32 * MiB, max_model_len=16_384, num_gpu_blocks_override=32)


def test_attention_free_has_only_the_null_block():
    cfg = kv.get_kv_cache_config("0.19.0", {}, 0, max_model_len=16)
    assert cfg.num_blocks == 1 and cfg.kv_cache_groups == []

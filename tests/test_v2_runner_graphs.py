"""Model Runner V2 and the CUDA-graph estimate of the KV budget (issue 16, held-back releases).

vLLM 0.19–0.28 ``vllm/v1/worker/gpu/model_runner.py`` ``GPUModelRunner.profile_cudagraph_memory``
is ``return 0`` (0.19, 0.20.0, 0.20.1, 0.21, 0.22, 0.24, 0.25, 0.26, 0.27, 0.28 read), so
``Worker.determine_available_memory`` (vllm/v1/worker/gpu_worker.py) subtracts no graph memory for
a model on the V2 runner even though ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` is on; from 0.29
(0.29–0.33 read) it calls ``vllm/v1/worker/gpu/cudagraph_utils.py`` ``profile_cudagraph_memory``.
Expected values are computed by hand from :func:`tuner.memory.budget.cudagraph_estimate_bytes`'s fit
(0.84 GiB at 32 layers × 4096 hidden, 0.5 GiB floor) and the release's capture sizes."""

from __future__ import annotations

from tuner.memory.budget import cudagraph_capture_sizes, cudagraph_estimate_bytes
from tuner.memory.eras import GiB, era_for

H100 = 85030076416


def _est(version, *, v2, **kw):
    return cudagraph_estimate_bytes(era_for(version), num_layers=32, hidden_size=4096, max_num_seqs=1024,
                                    max_num_batched_tokens=8192, model_runner_v2=v2, **kw)


def test_v2_runner_before_0_29_subtracted_a_cudagraph_estimate_vllm_never_made():
    """1024 seqs / 8192 tokens: max capture size min(2·1024, 512) = 512 → [1, 2, 4] + 8..248 step 8
    (31) + 256..512 step 16 (17) = 51 sizes, the anchor's: the fit's 0.84 GiB exactly."""
    assert len(cudagraph_capture_sizes(era_for("0.26.0"), 1024, 8192)) == 51
    full = int(0.84 * GiB)
    for version in ("0.22.0", "0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0"):
        assert _est(version, v2=True) == 0, version  # V2 runner: profile_cudagraph_memory returns 0
        assert _est(version, v2=False) == full, version  # V1 runner: the estimate is subtracted
    for version in ("0.29.0", "0.33.0"):  # V2 estimates through cudagraph_utils.profile_cudagraph_memory
        assert _est(version, v2=True) == full, version
    # reports may still ask what capture would cost
    assert _est("0.26.0", v2=True, always=True) == full
    # enforce_eager: no estimate on either runner
    assert cudagraph_estimate_bytes(era_for("0.26.0", enforce_eager=True), num_layers=32, max_num_seqs=1024,
                                    max_num_batched_tokens=8192, model_runner_v2=False) == 0


def test_job_v2_runner_graph_memory_stays_out_of_the_budget_until_0_29(tiny_config):
    """Tiny Llama (2 layers × 64 hidden: the 0.5 GiB floor; 51 capture sizes at the H100 serve
    defaults N 8192 / S 1024). ``LlamaForCausalLM`` runs V1 in 0.22 (V2 there: Qwen3 only), V2
    from 0.24 (listed) and 0.25 (every non-MoE model): 0.22 and 0.29 subtract 0.5 GiB, 0.24 and
    0.26 none, and their KV budget is larger by exactly what the others subtract less the
    difference of the other terms."""
    from tuner.jobs.job import run_job

    def cand(version):
        d = {"engine_version": version, "dtype": "auto", "kv_cache_dtype": "auto", "tensor_parallel_size": 1,
             "pipeline_parallel_size": 1, "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [4096]},
             "constraints": {}}
        r = run_job({"drop": d, "config_path": str(tiny_config / "config.json"),
                     "device": {"name": "H100-80GB", "total_memory_bytes": H100}, "search": False})
        return r["model_runner_v2"], r["candidates"][0]

    floor = int(0.5 * GiB)
    got = {v: cand(v) for v in ("0.22.0", "0.24.0", "0.26.0", "0.29.0")}
    assert {v: (v2, c["cuda_graph_bytes"]) for v, (v2, c) in got.items()} == {
        "0.22.0": (False, floor), "0.24.0": (True, 0), "0.26.0": (True, 0), "0.29.0": (True, floor)}
    for v2, c in got.values():  # the budget adds up: requested − weights − activation − non-torch − graphs
        assert c["available_kv_cache_bytes"] == (c["requested_memory_bytes"] - c["weights_bytes"]
                                                 - c["activation_peak_bytes"] - c["non_torch_bytes"]
                                                 - c["cuda_graph_bytes"])


def test_ngram_draft_on_v2_runner_took_the_v1_runners_graph_estimate_away():
    """``_get_v2_model_runner_unsupported_features`` (vllm/config/vllm.py): a speculative method V2
    lacks keeps the V1 runner — and with it the graph estimate 0.20–0.28 subtract."""
    from tuner.memory.eras import uses_model_runner_v2, v2_runner_runs_speculative_method as ok

    assert [m for m in ("eagle", "eagle3", "mtp", "qwen3_next_mtp", "dflash", "dspark", "ngram", "draft_model")
            if ok("0.22.0", m)] == ["eagle", "eagle3", "mtp", "qwen3_next_mtp"]
    assert ok("0.24.0", "dflash") and not ok("0.24.0", "dspark")
    assert [m for m in ("eagle", "mtp", "dflash", "dspark", "ngram", "ngram_gpu", "draft_model", "suffix")
            if ok("0.26.0", m)] == ["eagle", "mtp", "dflash", "dspark"]
    assert not ok("0.30.0", "draft_model") and ok("0.31.0", "draft_model")
    assert not ok("0.31.0", "ngram") and ok("0.32.0", "ngram")
    assert not ok("0.32.0", "medusa") and ok("0.33.0", "medusa") and not ok("0.33.0", "suffix")
    assert ok("0.26.0", None)
    llama = ["LlamaForCausalLM"]
    assert uses_model_runner_v2(era_for("0.26.0"), llama, is_moe=False, speculative_method="eagle3")
    assert not uses_model_runner_v2(era_for("0.26.0"), llama, is_moe=False, speculative_method="ngram")
    assert not uses_model_runner_v2(era_for("0.33.0"), llama, is_moe=False, speculative_method="suffix")
    assert uses_model_runner_v2(era_for("0.33.0"), llama, is_moe=False, speculative_method="ngram")


def test_job_ngram_drop_runs_v1_runner_and_subtracts_graphs_at_0_26(tiny_config):
    """The tiny Llama at 0.26 with an n-gram drafter: V1 runner (V2 lacks ngram before 0.32), so
    the graph estimate is subtracted; without a drafter it is V2 and none.
    n-gram with k = 3: capture sizes up to min(1024·4·2, 512) = 512 → 51, which the V1 runner rounds up
    to multiples of 1 + k = 4 (adjust_cudagraph_sizes_for_spec_decode) → 49 sizes: the 0.5 GiB floor
    scaled by 49 / 51."""
    from tuner.jobs.job import run_job

    def result(spec):
        d = {"engine_version": "0.26.0", "dtype": "auto", "kv_cache_dtype": "auto", "tensor_parallel_size": 1,
             "pipeline_parallel_size": 1, "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [4096]},
             "constraints": {}, "speculative_config": spec}
        return run_job({"drop": d, "config_path": str(tiny_config / "config.json"),
                        "device": {"name": "H100-80GB", "total_memory_bytes": H100}, "search": False})

    ngram = result({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    plain = result(None)
    assert (ngram["model_runner_v2"], plain["model_runner_v2"]) == (False, True)
    assert ngram["candidates"][0]["cuda_graph_bytes"] == int(0.5 * GiB * 49 / 51)
    assert plain["candidates"][0]["cuda_graph_bytes"] == 0

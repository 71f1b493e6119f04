"""CPU-side parts of the measured methods: vLLM engine arguments and the no-GPU errors."""

from __future__ import annotations

import pytest

from tuner.errors import MeasureError
from tuner.measure import vllm_engine


def test_engine_args_use_dummy_weights_and_only_set_values():
    args = vllm_engine.engine_args("/m/llama", {"tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                                                "dtype": "auto", "kv_cache_dtype": "fp8", "max_num_seqs": None,
                                                "enforce_eager": False, "block_size": 16},
                                   gpu_memory_utilization=0.9, max_model_len=8192)
    assert args == {"model": "/m/llama", "load_format": "dummy", "skip_tokenizer_init": True,
                    "trust_remote_code": False, "gpu_memory_utilization": 0.9, "max_model_len": 8192,
                    "tensor_parallel_size": 2, "kv_cache_dtype": "fp8", "block_size": 16}
    cmd = vllm_engine.serve_command(args)
    assert cmd.startswith("vllm serve /m/llama --load-format dummy") and "--tensor-parallel-size 2" in cmd


def test_vllm_method_without_vllm_is_a_measure_error(monkeypatch):
    import tuner.measure as m

    monkeypatch.setattr(m, "has_vllm", lambda: False)
    with pytest.raises(MeasureError, match="vllm is not importable"):
        vllm_engine.run_engine({"model": "x"})


def test_cuda_method_without_cuda_is_a_measure_error():
    import torch

    if torch.cuda.is_available():  # pragma: no cover - GPU hosts run selftest instead
        pytest.skip("a CUDA device is present")
    from tuner.measure.cuda import measure_pass

    with pytest.raises(MeasureError, match="no CUDA device"):
        measure_pass(None, None, None, None, None, gpu_memory_utilization=0.9)


def test_needed_candidates_grid_else_proposals_capped():
    drop = {"candidates": {"gpu_memory_utilization": [0.8, 0.9], "max_model_len": [4096, 8192]}}
    assert vllm_engine.needed_candidates(drop, []) == [(0.8, 4096), (0.8, 8192), (0.9, 4096), (0.9, 8192)]
    props = [{"gpu_memory_utilization": 0.9, "max_model_len": 40128}, {"gpu_memory_utilization": 0.95, "max_model_len": None}]
    assert vllm_engine.needed_candidates({"candidates": {"gpu_memory_utilization": [0.9, 0.95]}}, props) == [(0.9, 40128)]
    big = {"candidates": {"gpu_memory_utilization": [0.5, 0.9], "max_model_len": list(range(1024, 11264, 1024))}}
    assert len(vllm_engine.needed_candidates(big, [])) == vllm_engine.MAX_STARTS


def test_measure_candidates_records_refusals_and_failures_without_raising(monkeypatch):
    """The engine runner is replaced by parsed logs (a refusal and a timeout): this checks the
    bookkeeping only, not what a GPU does."""
    import tuner.measure as m
    from tuner.logs.logparse import GIB, parse_text

    monkeypatch.setattr(m, "has_vllm", lambda: True)
    refused = parse_text("ValueError: To serve at least one request with the models's max seq len (131072), "
                         "(16.0 GiB KV cache is needed, which is larger than the available KV cache memory "
                         "(9.5 GiB). Based on the available memory, the estimated maximum model length is 77824.\n"
                         "Model loading took 15.0 GiB and 3 seconds\n")

    def fake_run(args, timeout_s):
        if args["max_model_len"] == 131072:
            return refused, "", 1
        raise MeasureError("vLLM engine did not start within 1 s; process group killed", where="vllm")

    runs = vllm_engine.measure_candidates("/m", {}, [(0.9, 131072), (0.9, 8192)], run=fake_run)
    assert runs[0]["error_message"].startswith("To serve at least one request") and not runs[0]["failed"]
    assert runs[0]["available_kv_cache_bytes"] == round(9.5 * GIB) and runs[0]["weights_bytes"] == 15 * GIB
    assert runs[1]["failed"] and "did not start" in runs[1]["error_message"]
    assert "--max-model-len 8192" in runs[1]["source"]


def test_free_memory_refusal_marks_candidates_and_proposals():
    from tuner.memory.eras import era_for
    from tuner.measure.cuda import refuse_below_free_memory

    total, free = 80 << 30, 60 << 30
    cands = [{"gpu_memory_utilization": u, "requested_memory_bytes": int(total * u), "fits": True, "reason": None}
             for u in (0.7, 0.9)]
    props = [{"gpu_memory_utilization": 0.9, "max_model_len": 8192, "num_gpu_blocks": 10, "kv_cache_tokens": 160,
              "max_concurrency": 1.0, "vllm_args": "x", "reason": None}]
    assert refuse_below_free_memory(era_for("0.19.0"), cands, proposals=props, free_memory_bytes=free,
                                    total_memory_bytes=total) == 2
    assert cands[0]["fits"] and not cands[1]["fits"]
    assert cands[1]["reason"].startswith("Free memory on device cuda:0 (60.0/80.0 GiB) on startup is less than "
                                         "desired GPU memory utilization (0.9, 72.0 GiB)")
    assert props[0]["max_model_len"] is None and "vLLM refuses" in props[0]["reason"]
    assert refuse_below_free_memory(era_for("0.6.4"), cands, free_memory_bytes=0, total_memory_bytes=total) == 0


def test_engine_figures_fill_the_block_count_the_cpu_build_does_not_print():
    from tuner.logs.logparse import parse_text
    from tuner.measure.vllm_engine import apply_figures, engine_figures, measured_run

    text = ("(Worker pid=7) INFO Explicitly set (0.7/23.54) GiB for KV cache on node 0.\n"
            "INFO CPU KV cache size: 2,936,000 tokens, Maximum concurrency for 2,048 tokens per request: 1433.59x\n"
            "CTX_TUNER_ENGINE_READY\n"
            'CTX_TUNER_ENGINE_FIGURES {"device_type": "cpu", "num_gpu_blocks": 22937, "block_size": 128, '
            '"kv_cache_memory_bytes": 751619276, "max_model_len": 2048, "VLLM_CPU_KVCACHE_SPACE": "0.7"}\n')
    parsed = parse_text(text, source="vllm serve m")
    assert parsed.num_gpu_blocks is None and parsed.available_kv_cache_bytes == round(0.7 * (1 << 30))
    figures = engine_figures(text)
    apply_figures(parsed, figures)
    assert parsed.num_gpu_blocks == 22937 and parsed.available_kv_cache_bytes == 751619276  # exact, not 2 decimals
    m = measured_run(parsed, gpu_memory_utilization=0.9, max_model_len=2048, elapsed_s=1.0, figures=figures)
    assert (m["engine_device"], m["block_size"], m["kv_cache_space"]) == ("cpu", 128, "VLLM_CPU_KVCACHE_SPACE=0.7 GiB")
    assert m["source"].startswith("vllm serve m (CPU build: KV cache space from VLLM_CPU_KVCACHE_SPACE=0.7 GiB")


def test_engine_figures_on_a_gpu_build_only_fill_what_the_log_lacks():
    from tuner.logs.logparse import parse_text
    from tuner.measure.vllm_engine import apply_figures, engine_figures, measured_run

    text = ("INFO Available KV cache memory: 58.40 GiB\nINFO GPU KV cache size: 478,416 tokens\n"
            'CTX_TUNER_ENGINE_FIGURES {"device_type": "cuda", "num_gpu_blocks": 29901, "block_size": 16, '
            '"kv_cache_memory_bytes": null, "max_model_len": 8192, "VLLM_CPU_KVCACHE_SPACE": null}\n')
    figures = engine_figures(text)
    parsed = apply_figures(parse_text(text), figures)
    assert parsed.available_kv_cache_bytes == round(58.40 * (1 << 30)) and parsed.num_gpu_blocks == 29901
    m = measured_run(parsed, gpu_memory_utilization=0.9, max_model_len=8192, elapsed_s=1.0, figures=figures)
    assert m["engine_device"] == "cuda" and m["kv_cache_space"] is None and "CPU build" not in m["source"]
    assert engine_figures("CTX_TUNER_ENGINE_FIGURES {not json\n") == {} and engine_figures("") == {}

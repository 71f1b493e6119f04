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

"""Issue 28, mechanism 3 on vLLM 0.24 (club-3090 cases): the CUDA-graph estimate's graph counts as
vLLM 0.20 – 0.24 derive them, the estimate's default, and ModelOpt's quantized ``lm_head`` (0.23+).
Every expected value is read from vLLM's source or from a printed log line (named per test);
docs/accuracy-mechanisms.md, section "CUDA-graph estimate and activation on 0.24 (club-3090)"."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tuner.memory.budget import cudagraph_capture_sizes, full_decode_capture_sizes
from tuner.memory.eras import era_for
from tuner.memory.quant import MODELOPT_QUANTIZES_LM_HEAD_FROM, layout_bytes, scheme_for
from tuner.memory.specdecode import spec_decode_capture_sizes
from tuner.model.plugin import RankSettings

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
NVFP4 = SHARED / "models" / "nvidia--Qwen3.6-35B-A3B-NVFP4" / "config.json"


def _groups(version: str, max_num_seqs: int, n: int, k: int = 0, cc: str = "8.6") -> tuple:
    """vLLM's "Profiling CUDA graph memory: PIECEWISE=a (largest=b), FULL=c (largest=d)" from the
    tuner's capture sizes (vllm/config/vllm.py ``_set_cudagraph_sizes``, then
    vllm/config/compilation.py ``adjust_cudagraph_sizes_for_spec_decode``, then
    vllm/v1/cudagraph_dispatcher.py ``initialize_cudagraph_keys``)."""
    era = era_for(version)
    sizes = spec_decode_capture_sizes(
        cudagraph_capture_sizes(era, max_num_seqs, n, num_speculative_tokens=k, compute_capability=cc),
        version=era.version.key, num_speculative_tokens=k)
    full = full_decode_capture_sizes(sizes, max_num_seqs, k)
    return len(sizes), max(sizes), len(full), max(full)


def test_cudagraph_counts_match_printed_profile_lines():
    # lmcache-3430 (0.21.0, RTX A5000: 256 sequences, 2048 tokens by default):
    # "Profiling CUDA graph memory: PIECEWISE=51 (largest=512), FULL=35 (largest=256)"
    assert _groups("0.21.0", 256, 2048) == (51, 512, 35, 256)
    # vllm-46462 (0.20.2 image, A800, max_num_seqs 24, DFlash with 6 speculative tokens, q = 7):
    # "Profiling CUDA graph memory: PIECEWISE=38 (largest=336), FULL=22 (largest=168)" -- the
    # sizes are rounded up to multiples of q before the FULL decode graphs are chosen
    assert _groups("0.20.2", 24, 8192, k=6, cc="8.0") == (38, 336, 22, 168)


def test_club3090_mtp3_two_sequences_capture_five_graphs():
    # the club-3090 dual composes (0.24.0, max_num_seqs 2, 8192 tokens, MTP with 3 tokens, q = 4):
    # max capture size min(2 * 4 * 2, 512) = 16 -> [1, 2, 4, 8, 16] -> rounded to 4: [4, 8, 16];
    # FULL decode graphs for 4 <= x <= 4 * 2: [4, 8]
    assert _groups("0.24.0", 2, 8192, k=3) == (3, 16, 2, 8)
    # vLLM's default 256 sequences at 2048 tokens (a 24 GB card): 49 + 49 graphs
    assert _groups("0.24.0", 256, 2048, k=3) == (49, 512, 49, 512)


def test_cudagraph_estimate_on_by_default_from_020():
    # vllm/envs.py: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to "0" in 0.19.0 / 0.19.1 and
    # to "1" from 0.20.0 (read 0.20.0 - 0.24.0); gpu_worker.py subtracts it from the KV budget
    assert era_for("0.24.0").subtracts_cudagraph_estimate
    assert era_for("0.20.0").subtracts_cudagraph_estimate
    assert not era_for("0.19.1").subtracts_cudagraph_estimate


def _nvfp4_scheme(version: str):
    qc = json.loads(NVFP4.read_text())["quantization_config"]
    spec = SimpleNamespace(quantization_config=qc, top={"quantization_config": qc}, raw={})
    return scheme_for(spec, RankSettings(engine_version=version, dtype="bfloat16"))


@pytest.mark.skipif(not NVFP4.is_file(), reason="shared model configs not present")
def test_modelopt_quantizes_lm_head_from_023():
    # vllm/model_executor/layers/quantization/modelopt.py get_quant_method: ParallelLMHead joins
    # LinearBase in 0.23.0; MIXED_PRECISION quantizes it when quantized_layers names "lm_head"
    # (here W4A16_NVFP4, group 16): uint8 [V, H/2] + fp8 scales [V, H/16] + fp32 globals
    assert MODELOPT_QUANTIZES_LM_HEAD_FROM == (0, 23, 0)
    v, h = 248320, 2048  # Qwen3.6-35B-A3B vocab (a multiple of 64: no padding) and hidden size
    lay = _nvfp4_scheme("0.24.0").linear_layout(h, v, "bfloat16", "lm_head")
    assert lay is not None
    assert layout_bytes(lay[0]) == v * h // 2 + v * h // 16 + 4 * 4 == 286_064_656
    assert _nvfp4_scheme("0.22.1").linear_layout(h, v, "bfloat16", "lm_head") is None  # LinearBase only


@pytest.mark.skipif(not NVFP4.is_file(), reason="shared model configs not present")
def test_modelopt_nvfp4_lm_head_counted_as_bf16():
    """club3090-612 / -652 (0.24.0, RTX 5090, nvidia/Qwen3.6-35B-A3B-NVFP4): the head was counted
    as a bf16 [248320, 2048] (1 017 118 720 B) where vLLM 0.24 loads it W4A16_NVFP4
    (286 064 656 B): weights 731 054 064 B too high, KV -6.3 % / -6.8 %."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tuner.accuracy.validate import case_request, load_cases
    from tuner.jobs.job import run_job

    case = next(c for c in load_cases(SHARED / "cases" / "vllm-observed.jsonl")
                if c["id"] == "club3090-612-rtx5090-qwen36-35b-a3b-nvfp4-131k")
    result = run_job(case_request(case, SHARED / "models"))
    weights = {e["value"]["weights_bytes"] for e in result["memo_entries"]
               if isinstance(e.get("value"), dict) and "weights_bytes" in e["value"]}
    # + 205,840 B of the caching allocator's rounding, applied to V1 weights since §24
    assert weights == {21_752_733_184}
    assert 22_483_581_408 - 21_752_527_344 == 248320 * 2048 * 2 - 286_064_656


def test_moe_decoders_quantize_lm_head_where_vllm_passes_quant_config():
    # qwen3_moe.py (0.24) builds ParallelLMHead(..., quant_config=quant_config): a ModelOpt NVFP4
    # checkpoint that does not exclude lm_head loads it NVFP4 from 0.23.0, bf16 in 0.22.1
    import dataclasses

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tuner.model.modelspec import load_model_spec
    from tuner.model.plugin import load_registry

    path = SHARED / "models" / "Qwen--Qwen3-30B-A3B" / "config.json"
    if not path.is_file():
        pytest.skip("shared model configs not present")
    qc = {"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4", "group_size": 16}}
    spec = load_model_spec(path)[0]
    spec = dataclasses.replace(spec, quantization_config=qc)
    plugin = load_registry().by_name("qwen3_moe")

    def weights(version: str) -> int:
        settings = RankSettings(engine_version=version, dtype="bfloat16")
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
            return plugin.weights_bytes(spec, settings, plugin.build_model(spec, settings))

    v, h = 151936, 2048  # Qwen3-30B-A3B vocab (a multiple of 64) and hidden size
    assert weights("0.22.1") - weights("0.24.0") == v * h * 2 - (v * h // 2 + v * h // 16 + 4 * 4) == 447_299_568

"""Devices and platforms (issues 29, 33, 28 §9/§11): an unknown card is not an NVSwitch box, the
interconnect a drop or ``--device`` states, ROCm's rules from vllm/platforms/rocm.py, unified
memory's free-memory reading, and the assumptions the job names as data."""

from __future__ import annotations

import argparse

import pytest

from tuner.memory.budget import (NVLS_TP2_GIB, Topology, custom_all_reduce_enabled, nccl_profile_bytes, non_torch_bytes)
from tuner.memory.eras import GiB, era_for
from tuner.jobs.job import device_assumptions, topology_for, topology_source
from tuner.memory.platforms import is_integrated, platform_assumptions, platform_of

UNKNOWN = {"name": "Quantum Card 9000", "total_memory_bytes": 48 * GiB}


def test_unknown_card_is_not_assumed_nvswitch():
    """An unknown card once took the calibration centre's topology (H100 SXM behind NVSwitch) and
    its TP2 group was charged 1.82 GiB of NVLS buffers; now: PCIe without P2P, said as an assumption."""
    topo = topology_for(UNKNOWN, {"tensor_parallel_size": 2})
    assert (topo.interconnect, topo.p2p) == ("pcie", False)
    assert topology_source(UNKNOWN) == "assumed"
    v19 = era_for("0.19.0")
    assert nccl_profile_bytes(v19, 2, topo) == 0
    assert nccl_profile_bytes(v19, 2, Topology("nvswitch", True, "9.0")) == int(NVLS_TP2_GIB * GiB)
    assert custom_all_reduce_enabled(2, topo) == (False, "no P2P access between the GPUs")
    assert non_torch_bytes(v19, tensor_parallel_size=2, topology=topo) == int(0.25 * GiB)
    entry, cc = device_assumptions(UNKNOWN, {"tensor_parallel_size": 2, "pipeline_parallel_size": 1})
    assert (cc["name"], cc["value"]) == ("device.compute_capability", "9.0 or newer")
    assert (entry["name"], entry["value"], entry["where"], entry["effect"]) == (
        "device.interconnect", "pcie, no P2P", "device", "widens")
    assert "Quantum Card 9000 is not in the catalog" in entry["note"]
    # TP1 has no group: nothing is assumed about links
    assert device_assumptions(UNKNOWN, {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}) == [cc]


def test_stated_interconnect_decides_nvls_and_custom_all_reduce():
    nvsw = {**UNKNOWN, "interconnect": "nvswitch", "compute_capability": "9.0"}
    topo = topology_for(nvsw, {"tensor_parallel_size": 4})
    assert (topo.interconnect, topo.p2p) == ("nvswitch", True) and topology_source(nvsw) == "stated"
    assert nccl_profile_bytes(era_for("0.19.0"), 4, topo) == int((NVLS_TP2_GIB + 0.06) * GiB)
    assert device_assumptions(nvsw, {"tensor_parallel_size": 4, "pipeline_parallel_size": 1}) == []  # cc stated
    pcie = topology_for({**UNKNOWN, "interconnect": "pcie", "p2p": True}, {"tensor_parallel_size": 2})
    assert custom_all_reduce_enabled(2, pcie) == (True, "on")
    # a catalog card keeps its catalog topology
    h100 = topology_for({"name": "H100-80GB", "total_memory_bytes": 85030076416}, {})
    assert (h100.interconnect, h100.p2p) == ("nvswitch", True)


def test_check_device_flag_states_the_interconnect():
    from tuner.commands.check import _device

    assert _device("My card:24:nvlink") == {"name": "My card", "total_memory_gib": 24.0, "interconnect": "nvlink"}
    assert _device("My card:24") == {"name": "My card", "total_memory_gib": 24.0}
    assert _device("A100-80GB:pcie") == {"name": "A100-80GB", "interconnect": "pcie"}
    assert _device("My card:24:pcie:p2p") == {"name": "My card", "total_memory_gib": 24.0, "interconnect": "pcie",
                                              "p2p": True}
    assert _device("H100-80GB") == "H100-80GB"
    with pytest.raises(argparse.ArgumentTypeError, match="not NAME:GIB"):
        _device("My card:lots")


def test_drop_device_interconnect_field_is_read(shared_dir):
    from tuner.jobs.app import prepare_job
    from tuner.question.drop import parse_drop

    model = shared_dir / "models" / "Qwen--Qwen3-0.6B"
    text = (f"name: x\nmodel: {model}\nengine_version: 0.19.0\ntensor_parallel_size: 2\n"
            "device: {name: Quantum Card 9000, total_memory_gib: 48, interconnect: nvswitch, compute_capability: '9.0'}\n"
            "candidates: {gpu_memory_utilization: [0.9], max_model_len: [4096]}\n")
    req, _dev = prepare_job(parse_drop(text, "x.yaml"))
    assert req.device["interconnect"] == "nvswitch"
    assert topology_source(req.device) == "stated"


def test_job_result_names_the_assumed_interconnect(shared_dir):
    from tuner.jobs.job import run_job
    from tuner.accuracy.validate import case_request

    case = {"id": "u", "model": "Qwen/Qwen3-0.6B", "vllm_version": "0.19.0", "engine": "V1",
            "gpu": "Quantum Card 9000", "gpu_total_gib": 48, "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
            "dtype": "bfloat16", "settings": {"gpu_memory_utilization": 0.9, "max_model_len": 4096}, "observed": {}}
    res = run_job(case_request(case, shared_dir / "models"))
    assert [a["name"] for a in res["assumptions"]] == ["device.interconnect", "device.compute_capability"]
    assert any(w.startswith("assumed device.interconnect: pcie, no P2P") for w in res["warnings"])
    cand = res["candidates"][0]
    assert cand["non_torch_bytes"] < 0.5 * GiB  # no 1.82 GiB of NVLS buffers


# ------------------------------------------------------------------------------------------------
# ROCm (vllm/platforms/rocm.py, custom_all_reduce.py 0.33 / 0.34)
# ------------------------------------------------------------------------------------------------


def test_rocm_card_platform_and_its_rules():
    mi = {"name": "AMD Instinct MI300X", "total_memory_bytes": int(round(191.98 * GiB))}
    assert platform_of(mi) == "rocm" and platform_of({"name": "H100-80GB"}) == "cuda"
    topo = topology_for(mi, {})
    assert (topo.platform, topo.interconnect) == ("rocm", "xgmi")
    assert nccl_profile_bytes(era_for("0.19.0"), 8, topo) == 0  # no NVLS on AMD
    # ROCm skips the P2P check: custom all-reduce stays on for two PCIe Radeon cards without P2P
    radeon = Topology("pcie", False, "11.0", platform="rocm")
    assert custom_all_reduce_enabled(2, radeon) == (True, "on")
    assert custom_all_reduce_enabled(2, Topology("pcie", False, "8.9")) == (False, "no P2P access between the GPUs")
    [entry] = platform_assumptions(mi, era_for("0.19.0"))
    assert entry["name"] == "platform" and "RCCL" in entry["note"] and "AITER" in entry["note"]


# ------------------------------------------------------------------------------------------------
# Unified memory (vllm/utils/mem_utils.py MemorySnapshot.measure 0.33, device_memory_info 0.34)
# ------------------------------------------------------------------------------------------------


def test_unified_memory_host_ram_is_named_as_an_assumption():
    gb10 = {"name": "GB10", "total_memory_bytes": 128526516224}
    assert is_integrated(gb10) is True and not is_integrated({"name": "GH200"})
    [entry] = platform_assumptions(gb10, era_for("0.29.0"))
    assert entry["name"] == "unified memory"
    assert "reads free memory from the host's available memory" in entry["note"]
    assert "--other-processes-memory-gib" in entry["note"]
    assert platform_assumptions({"name": "GH200", "total_memory_bytes": 101468602368}, era_for("0.29.0")) == []


def test_rocm_mla_block_size_is_not_flashmla(shared_dir):
    """On MI300X (torch capability 9.4) the Hopper FlashMLA rule once gave DeepSeek-V2-Lite's fp8
    cache 64-token blocks; ROCm runs TRITON_MLA at the default block size (vllm/platforms/rocm.py,
    interface.py update_block_size_for_backend): 16 in 0.19–0.33, 64 in 0.34."""
    from tuner.model.modelspec import load_model_spec
    from tuner.model.plugin import RankSettings, load_registry
    from tuner.memory.platforms import rocm_mla_block_size

    spec, _ = load_model_spec(shared_dir / "models" / "deepseek-ai--DeepSeek-V2-Lite-Chat" / "config.json")
    plugin = load_registry().by_name("deepseek")
    s = RankSettings(engine_version="0.19.0", dtype="bfloat16", kv_cache_dtype="fp8", compute_capability="9.4")
    cuda = plugin.kv_cache_spec(spec, s)["model.layers.0.self_attn.attn"]
    rocm = plugin.kv_cache_spec(spec, RankSettings(**{**s.__dict__, "platform": "rocm"}))["model.layers.0.self_attn.attn"]
    assert (cuda.block_size, rocm.block_size) == (64, 16)
    assert rocm.page_size_bytes == 16 * 576
    assert [rocm_mla_block_size(v) for v in ("0.10.0", "0.19.0", "0.33.0", "0.34.0")] == [16, 16, 16, 64]
    # sparse MLA: ROCM_AITER_MLA_SPARSE's kernel sizes [1] / [1, 64] refuse 16 until 0.28's MultipleOf(16)
    assert [rocm_mla_block_size(v, sparse=True) for v in ("0.19.0", "0.27.1", "0.28.0", "0.34.0")] == [1, 1, 16, 64]
    assert rocm_mla_block_size("0.19.0", user_block_size=32) == 32


def test_rank_settings_carry_the_cards_platform(shared_dir):
    from tuner.jobs.job import run_job
    from tuner.accuracy.validate import case_request

    case = {"id": "mi", "model": "deepseek-ai/DeepSeek-V2-Lite-Chat", "vllm_version": "0.19.0", "engine": "V1",
            "gpu": "AMD Instinct MI300X", "gpu_total_gib": 191.98, "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1, "kv_cache_dtype": "fp8",
            "settings": {"gpu_memory_utilization": 0.9, "max_model_len": 4096}, "observed": {}}
    res = run_job(case_request(case, shared_dir / "models"))
    assert res["block_size"] == 16
    assert [a["name"] for a in res["assumptions"]] == ["platform"]


def test_gb10_batch_tier_follows_the_capability_not_the_name():
    """0.33's get_batch_defaults keeps ``is_device_capability((12, 1))`` on the small tier: a GB10
    given under another name (a mapping with its capability) gets it too; a 12.0 card does not."""
    from tuner.memory.eras import profile_batch

    total = int(119.7 * GiB)
    other = profile_batch(era_for("0.33.0"), max_model_len=8192, device_name="DGX Spark node 3",
                          total_memory_bytes=total, compute_capability="12.1")
    assert (other.max_num_batched_tokens, other.max_num_seqs) == (2048, 256)
    big = profile_batch(era_for("0.33.0"), max_model_len=8192, device_name="RTX-PRO-6000-Blackwell",
                        total_memory_bytes=101973229568)
    assert (big.max_num_batched_tokens, big.max_num_seqs) == (8192, 1024)


def test_gpt_oss_on_rocm_pads_experts_to_256():
    """gpt-oss on MI300X (capability 9.4) was sized with Hopper's Triton swizzle (I to 64, H as is);
    ROCm pads H and I to 256 (fused_moe/oracle/mxfp4.py mxfp4_round_up_hidden_size_and_intermediate_size,
    0.19–0.33; quantization/mxfp4.py 0.11–0.18), with the strided layout."""
    from tuner.model.plugin import RankSettings
    from tuner.memory.quant import mxfp4_alignment, mxfp4_backend, scheme_for

    assert mxfp4_backend((9, 4), (0, 19, 0), "rocm") == "rocm_triton"
    assert mxfp4_backend((9, 4), (0, 19, 0)) == "triton_swizzle"
    assert mxfp4_alignment("rocm_triton", (0, 19, 0)) == (256, 256)
    assert mxfp4_alignment("rocm_triton", (0, 10, 1)) == (1, 128)

    class Spec:
        quantization_config = {"quant_method": "mxfp4"}
        raw = {"quantization_config": {"quant_method": "mxfp4"}}

    s = RankSettings(engine_version="0.19.0", dtype="bfloat16", compute_capability="9.4", platform="rocm")
    fmt = scheme_for(Spec(), s).expert_format
    assert fmt.backend == "rocm_triton" and fmt.sizes(2880, 2880 // 4) == (3072, 768)
    # values [E, out, in/2] + scales [E, out, in/32] at the padded sizes
    assert fmt.bank(32, 3072, 1536, "bfloat16") == [("weight", (32, 1536, 1536), "uint8"),
                                                   ("weight_scale", (32, 1536, 96), "uint8")]


def test_gpt_oss_20b_weights_on_mi300x_and_h100(shared_dir):
    from tuner.jobs.job import run_job
    from tuner.accuracy.validate import case_request

    out = {}
    for gpu, gib in (("AMD Instinct MI300X", 191.98), ("NVIDIA H100 80GB HBM3", 79.19)):
        case = {"id": "g", "model": "openai/gpt-oss-20b", "vllm_version": "0.19.0", "engine": "V1", "gpu": gpu,
                "gpu_total_gib": gib, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                "settings": {"gpu_memory_utilization": 0.9, "max_model_len": 8192}, "observed": {}}
        out[gpu] = run_job(case_request(case, shared_dir / "models"))["candidates"][0]["weights_bytes"]
    # + the caching allocator's rounding since §24 (V1 too): +48,000 B on MI300X, +20,298,624 B on H100
    assert out == {"AMD Instinct MI300X": 15208675328, "NVIDIA H100 80GB HBM3": 14660040704}


def test_check_device_list_names_one_card_per_stage():
    from tuner.commands.check import _device

    assert _device("RTX 5070 Ti,RTX 5090 D:31.36") == ["RTX 5070 Ti", {"name": "RTX 5090 D", "total_memory_gib": 31.36}]
    with pytest.raises(argparse.ArgumentTypeError, match="'auto' reads GPU 0 only"):
        _device("auto,H100-80GB")


def test_free_memory_from_host_boundaries_read_in_every_wheel():
    """vllm/utils/mem_utils.py: no psutil through 0.11.0; the capability list (8.7, 11.0, 12.1)
    0.11.1–0.19.1; ``is_integrated_gpu`` from 0.20.0 (was: from 0.12 and from 0.26)."""
    from tuner.memory.budget import free_memory_from_host

    cases = [("0.11.0", "12.1", True, False), ("0.11.1", "12.1", None, True), ("0.19.1", "12.1", False, True),
             ("0.19.1", "9.0", True, False), ("0.20.0", "12.1", False, False), ("0.20.0", "12.1", True, True),
             ("0.24.0", "11.0", True, True)]
    for version, cc, integrated, expected in cases:
        assert free_memory_from_host(era_for(version), compute_capability=cc, integrated=integrated) is expected, version


def test_rocm_profile_sampler_sorts_where_cuda_runs_flashinfer(shared_dir):
    """0.8–0.11.0's FlashInfer top-k/top-p is CUDA-only (topk_topp_sampler.py ``is_cuda()``): on
    MI300X the dummy sampler runs PyTorch's sort; Llama-3.1-8B, 1024 sequences, vLLM 0.10.1."""
    from tuner.jobs.job import run_job
    from tuner.accuracy.validate import case_request

    peaks = {}
    for gpu, gib in (("AMD Instinct MI300X", 191.98), ("NVIDIA H100 80GB HBM3", 79.19)):
        case = {"id": "s", "model": "meta-llama/Llama-3.1-8B-Instruct", "vllm_version": "0.10.1", "engine": "V1",
                "gpu": gpu, "gpu_total_gib": gib, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                "settings": {"gpu_memory_utilization": 0.9, "max_model_len": 8192, "max_num_seqs": 1024,
                             "max_num_batched_tokens": 8192}, "observed": {}}
        req = case_request(case, shared_dir / "models")
        # FlashInfer installed (drop field flashinfer_installed): CUDA runs it, ROCm still sorts
        req = {**req, "drop": {**req["drop"], "flashinfer_installed": True}}
        peaks[gpu] = run_job(req)["candidates"][0]["activation_peak_bytes"]
    # ROCm sorts with PyTorch (38 B per sampled logit at >= 128 rows, issue 28 #1) though FlashInfer is installed
    # the reserve inside these figures is 0.1 % of W + 0.5 % of the activation since §24 (0.56 % of W before:
    # 5,215,383,186 / 2,047,603,633)
    assert peaks == {"AMD Instinct MI300X": 5141350432, "NVIDIA H100 80GB HBM3": 1973570879}

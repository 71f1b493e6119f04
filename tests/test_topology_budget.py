"""Communication memory of TP groups by topology and release, CUDA-graph capture sizes, the
speculative_config drop field and device-name matching (tuner.memory.budget, tuner.question.drop, tuner.memory.devices).

Each expected value is computed from the vLLM source the term cites (custom_all_reduce.py,
all_reduce_utils.py, config/vllm.py) or from the documented fit's data points."""

from __future__ import annotations

import pytest

from tuner.memory.budget import (CUSTOM_ALL_REDUCE_META_SIZE, Topology, cudagraph_capture_sizes, cudagraph_estimate_bytes,
                          custom_all_reduce_buffer_bytes, custom_all_reduce_enabled, nccl_profile_bytes, non_torch_bytes)
from tuner.memory.devices import GIB, candidates_for, lookup, resolve_device
from tuner.question.drop import parse_drop
from tuner.memory.engine_checks import check_quantization
from tuner.errors import DeviceError, DropError
from tuner.memory.eras import GiB, MiB, era_for

NVSWITCH_H100 = Topology("nvswitch", True, "9.0")
PCIE_L40 = Topology("pcie", True, "8.9")
PCIE_GEFORCE = Topology("pcie", False, "8.6")


@pytest.mark.parametrize("world,topo,expected", [
    (1, NVSWITCH_H100, (False, "world size 1")),
    (3, NVSWITCH_H100, (False, "world size 3 not in [2, 4, 6, 8]")),
    (8, NVSWITCH_H100, (True, "on")),
    (2, PCIE_L40, (True, "on")),  # two PCIe GPUs with P2P: allowed
    (4, PCIE_L40, (False, "not supported on more than two PCIe-only GPUs")),
    (2, PCIE_GEFORCE, (False, "no P2P access between the GPUs")),
    (2, Topology(disable_custom_all_reduce=True), (False, "disable_custom_all_reduce")),
    (2, Topology(single_node=False), (False, "group spans several nodes")),
])
def test_custom_all_reduce_enabled_follows_vllm_checks(world, topo, expected):
    assert custom_all_reduce_enabled(world, topo) == expected


def test_custom_all_reduce_buffer_bytes_by_release_and_world_size():
    # 0.8.4: max_size 8 MiB → meta (2560 B) + 8 MiB, and an 8 MiB buffer
    assert custom_all_reduce_buffer_bytes(era_for("0.8.4", "V0"), 2, NVSWITCH_H100) == 2560 + 2 * 8 * MiB
    # 0.19 on Hopper: min(CUSTOM_ALL_REDUCE_MAX_SIZES["9.0"][8] = 256 KiB, 8 MiB)
    assert custom_all_reduce_buffer_bytes(era_for("0.19.0"), 8, NVSWITCH_H100) == CUSTOM_ALL_REDUCE_META_SIZE + 2 * 256 * 1024
    # TP2 on Hopper keeps 8 MiB (the table's 64 MiB is above max_size)
    assert custom_all_reduce_buffer_bytes(era_for("0.19.0"), 2, NVSWITCH_H100) == 2560 + 2 * 8 * MiB
    # Ampere has no table entry: 8 MiB; off → 0
    assert custom_all_reduce_buffer_bytes(era_for("0.19.0"), 2, Topology("nvswitch", True, "8.0")) == 2560 + 16 * MiB
    assert custom_all_reduce_buffer_bytes(era_for("0.19.0"), 4, PCIE_L40) == 0


def test_nccl_bytes_nvls_only_on_hopper_nvswitch():
    v19 = era_for("0.19.0")
    assert nccl_profile_bytes(v19, 2, NVSWITCH_H100) == int(1.82 * GiB)
    assert nccl_profile_bytes(v19, 4, NVSWITCH_H100) == int(1.88 * GiB)
    assert nccl_profile_bytes(v19, 2, Topology("nvswitch", True, "8.0")) == 0  # A100: no NVLS
    assert nccl_profile_bytes(v19, 4, PCIE_L40) == 0  # 0.11+: the communicator is baseline
    assert nccl_profile_bytes(era_for("0.8.4", "V0"), 4, PCIE_L40) == int(0.12 * GiB)
    assert nccl_profile_bytes(v19, 1, NVSWITCH_H100) == 0


def test_non_torch_tp_on_pcie_is_far_below_the_nvswitch_figure():
    """The 2.07 GiB of the H100 TP2 logs holds on NVSwitch; a PCIe group with custom all-reduce off
    (4× RTX 3090, --disable-custom-all-reduce) charges only the TP1 term in 0.24."""
    v19, v24 = era_for("0.19.0"), era_for("0.24.0")
    assert abs(non_torch_bytes(v19, tensor_parallel_size=2) / GiB - 2.07) < 0.005
    assert abs(non_torch_bytes(v19, tensor_parallel_size=4) / GiB - 2.13) < 0.005
    off = Topology("pcie", False, "8.6", disable_custom_all_reduce=True)
    assert non_torch_bytes(v24, tensor_parallel_size=4, topology=off) == int(0.25 * GiB)
    # the fit's own data point: 4× L40, V0 0.8.4, 0.37 GiB
    assert abs(non_torch_bytes(era_for("0.8.4", "V0"), tensor_parallel_size=4, topology=PCIE_L40) / GiB - 0.37) < 0.005


def test_cudagraph_capture_sizes_as_vllm_derives_them():
    v19, v24 = era_for("0.19.0"), era_for("0.24.0")
    assert len(cudagraph_capture_sizes(v19, 1024, 8192)) == 51  # 3 + 31 + 17
    assert cudagraph_capture_sizes(v19, 1, 8192) == [1, 2]  # max = 1 × 1 × 2
    assert cudagraph_capture_sizes(v19, 4, 8192) == [1, 2, 4, 8]
    # MTP with 3 tokens: max = 4 × (1 + 3) × 2 = 32
    assert cudagraph_capture_sizes(v24, 4, 8192, num_speculative_tokens=3) == [1, 2, 4, 8, 16, 24, 32]
    # 0.24 appends max_num_batched_tokens when it is below the largest size; 0.19 does not
    assert cudagraph_capture_sizes(v24, 256, 100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 100]
    assert cudagraph_capture_sizes(v19, 256, 100)[-1] == 96
    assert cudagraph_capture_sizes(v24, 256, 8192, cudagraph_capture_sizes=[8, 4, 4, 9000]) == [4, 8]
    # ≤0.11: [1, 2, 4] + range(8, 2·S + 1, 8)
    assert cudagraph_capture_sizes(era_for("0.10.1"), 16, 8192) == [1, 2, 4, 8, 16, 24, 32]


def test_cudagraph_estimate_scales_with_the_capture_count():
    v20 = era_for("0.20.0")
    full = cudagraph_estimate_bytes(v20, num_layers=32, max_num_seqs=1024, max_num_batched_tokens=8192)
    assert abs(full / GiB - 0.84) < 0.001
    one_seq = cudagraph_estimate_bytes(v20, num_layers=32, max_num_seqs=1, max_num_batched_tokens=8192)
    # PIECEWISE [1, 2] + FULL [1] (sizes in [1, 1 · max_num_seqs]) of the anchor's 51 + 51
    assert one_seq == int(0.84 * GiB * 3 / 102)
    spec = cudagraph_estimate_bytes(v20, num_layers=32, max_num_seqs=4, max_num_batched_tokens=8192,
                                    num_speculative_tokens=3)
    # PIECEWISE 7 sizes up to 32 + FULL 4, 8, 16 (in [q, q · 4], q = 4)
    assert spec == int(0.84 * GiB * 10 / 102)


_DROP = """name: d
model: ./m
device: H100-80GB
candidates: {gpu_memory_utilization: [0.9]}
"""


def test_speculative_config_is_validated_with_its_field():
    d = parse_drop(_DROP + "speculative_config: {method: qwen3_5_mtp, num_speculative_tokens: 3}\n", "x.yaml")
    assert d.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    assert d.to_dict()["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    with pytest.raises(DropError) as e:
        parse_drop(_DROP + "speculative_config: {method: magic, num_speculative_tokens: 3}\n", "x.yaml")
    assert e.value.field == "speculative_config.method" and e.value.path == "x.yaml"
    with pytest.raises(DropError) as e:
        parse_drop(_DROP + "speculative_config: {method: ngram, num_speculative_tokens: 0}\n", "x.yaml")
    assert e.value.field == "speculative_config.num_speculative_tokens"
    with pytest.raises(DropError) as e:
        parse_drop(_DROP + "speculative_config: {method: eagle3, num_speculative_tokens: 2}\n", "x.yaml")
    assert e.value.field == "speculative_config.model"
    with pytest.raises(DropError) as e:
        parse_drop(_DROP + "speculative_config: {method: ngram, num_speculative_tokens: 2, foo: 1}\n", "x.yaml")
    assert e.value.field == "speculative_config.foo"


def test_disable_custom_all_reduce_and_device_interconnect_fields():
    d = parse_drop(_DROP.replace("device: H100-80GB", "device: {name: My Card, total_memory_gib: 23.5, "
                                 "interconnect: pcie, p2p: false}") + "disable_custom_all_reduce: true\n", "x.yaml")
    assert d.disable_custom_all_reduce is True
    dev = d.resolve_device()
    assert (dev.interconnect, dev.p2p) == ("pcie", False)
    with pytest.raises(DropError) as e:
        parse_drop(_DROP.replace("device: H100-80GB", "device: {name: X, total_memory_gib: 20, interconnect: wifi}"),
                   "x.yaml")
    assert e.value.field == "device.interconnect"
    with pytest.raises(DropError) as e:
        parse_drop(_DROP + "disable_custom_all_reduce: 1\n", "x.yaml")
    assert e.value.field == "disable_custom_all_reduce"


@pytest.mark.parametrize("name,expected", [
    ("NVIDIA H100 80GB HBM3", "H100-80GB"),
    ("NVIDIA GeForce RTX 4090 (24G)", "RTX-4090"),
    ("NVIDIA RTX PRO 4500 Blackwell Server Edition", "RTX-PRO-4500-Blackwell"),
    ("NVIDIA GeForce RTX 5070 Ti", "RTX-5070-Ti"),
    ("NVIDIA GeForce RTX 5090 D", "RTX-5090-D"),
    ("NVIDIA RTX A5000", "RTX-A5000"),
    ("NVIDIA GB10", "GB10"),
    ("AMD Instinct MI325X", "MI325X"),
])
def test_device_names_as_nvml_and_vllm_print_them(name, expected):
    assert lookup(name).name == expected


def test_ambiguous_device_name_resolved_by_total():
    assert {d.name for d in candidates_for("NVIDIA A100")} == {"A100-80GB", "A100-40GB"}
    assert lookup("NVIDIA A100") is None
    assert lookup("NVIDIA A100", total_memory_bytes=int(39.39 * GIB)).name == "A100-40GB"
    assert lookup("NVIDIA H20", total_memory_bytes=int(139.8 * GIB)).name == "H20-141GB"
    with pytest.raises(DeviceError, match=r"may be any of 2 cards: A100-80GB \(79.15 GiB, nvswitch\), A100-40GB"):
        resolve_device("NVIDIA A100")
    # any name with an explicit total is accepted; a known card's interconnect comes along
    dev = resolve_device({"name": "NVIDIA A100", "total_memory_gib": 79.15})
    assert dev.interconnect == "nvswitch" and dev.compute_capability == "8.0"


def test_auto_round_checkpoint_accepts_any_spelling_of_the_argument():
    """vLLM's _verify_quantization runs INCConfig.override_quantization_method (→ "inc") before the
    unknown-name check: `--quantization auto_round` starts an auto-round checkpoint."""
    assert check_quantization("auto_round", {"quant_method": "auto-round", "bits": 4}, version=era_for("0.20.1").version,
                              path="x.yaml") == []
    with pytest.raises(DropError) as e:
        check_quantization("auto_round", None, version=era_for("0.20.1").version, path="x.yaml")
    assert e.value.field == "quantization" and "Unknown quantization method: auto_round" in e.value.message


def test_explain_shows_nccl_and_custom_all_reduce_as_their_own_steps():
    from tuner.reports.explain import _communication_steps

    v19 = era_for("0.19.0")
    nt = non_torch_bytes(v19, tensor_parallel_size=4)
    steps = _communication_steps(v19, {"tensor_parallel_size": 4}, {"name": "H100-80GB",
                                                                     "total_memory_bytes": 85030076416}, nt)
    assert [s["name"] for s in steps] == ["nccl", "custom_all_reduce", "symmetric_memory"]
    assert steps[0]["bytes"] == int(1.88 * GiB) and "NVLS" in steps[0]["text"]
    # Hopper TP4: the 32 MiB torch symmetric-memory buffer, baseline in 0.19 (an info step)
    assert steps[2]["op"] == "info" and steps[2]["bytes"] == 34 * (1 << 20)
    # 0.19 allocates custom all-reduce before the start-up snapshot: shown, not charged
    assert steps[1]["bytes"] == 0 and "on" in steps[1]["text"] and "not charged" in steps[1]["text"]
    l40 = {"name": "NVIDIA L40", "total_memory_bytes": int(44.32 * GiB)}
    v0 = era_for("0.8.4", "V0")
    steps = _communication_steps(v0, {"tensor_parallel_size": 4}, l40,
                                 non_torch_bytes(v0, tensor_parallel_size=4, topology=PCIE_L40))
    assert steps[0]["bytes"] == int(0.12 * GiB)
    assert "off: not supported on more than two PCIe-only GPUs" in steps[1]["text"]
    assert _communication_steps(v19, {"tensor_parallel_size": 1}, l40, int(0.25 * GiB)) == []


def test_mtp_drafter_layers_from_the_checkpoint_config():
    from tuner.memory.kvcache import FullAttentionSpec, MambaSpec
    from tuner.memory.specdecode import drafter_kv_specs, mtp_dense_layer_weights_bytes, mtp_num_layers

    assert mtp_num_layers({"mtp_num_hidden_layers": 1}) == 1
    assert mtp_num_layers({"num_nextn_predict_layers": 3}) == 3
    assert mtp_num_layers({}) == 1
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=256, dtype_bytes=1)
    stage = {"model.layers.3.self_attn.attn": full,
             "model.layers.0.linear_attn": MambaSpec(block_size=16, shapes=((3, 8),), dtypes_bytes=(4,))}
    extra = drafter_kv_specs(stage, 2, first_layer_index=64)
    assert list(extra) == ["model.layers.64.self_attn.attn", "model.layers.65.self_attn.attn"]
    assert all(s == full for s in extra.values())
    assert drafter_kv_specs({"x": stage["model.layers.0.linear_attn"]}, 1, first_layer_index=1) == {}
    # Qwen3.6-27B's MTP block (hidden 5120, 24 heads × 256 with a gated q, 4 KV heads, I 17408) at TP4
    cfg = {"model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408, "num_attention_heads": 24,
           "num_key_value_heads": 4, "head_dim": 256, "mtp_num_hidden_layers": 1}
    attn = 5120 * (24 * 256 * 2 + 2 * 4 * 256) + 24 * 256 * 5120
    assert mtp_dense_layer_weights_bytes(cfg, tensor_parallel_size=4) == (attn + 3 * 5120 * 17408 + 2 * 5120 * 5120) * 2 // 4


def test_speculative_tokens_add_mamba_state_blocks():
    from tuner.memory.kvcache import FullAttentionSpec, MambaSpec
    from tuner.memory.specdecode import with_speculative_state_blocks

    m = MambaSpec(block_size=16, shapes=((3, 8),), dtypes_bytes=(4,))
    f = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype_bytes=2)
    out = with_speculative_state_blocks(({"a": m, "b": f},), 3)
    assert out[0]["a"].num_speculative_blocks == 3 and out[0]["b"] is f
    assert (out[0]["a"].max_memory_usage_bytes("0.24.0", 4096) - m.max_memory_usage_bytes("0.24.0", 4096)
            == 3 * m.page_size_bytes)
    assert with_speculative_state_blocks(({"a": m},), 0)[0]["a"] is m


def test_co_tenant_memory_by_era():
    from tuner.memory.budget import co_tenant_non_torch_bytes, free_memory_refusal

    other = 10 * GiB
    assert co_tenant_non_torch_bytes(era_for("0.6.4", "V0"), other) == other  # whole-GPU budget
    assert co_tenant_non_torch_bytes(era_for("0.8.5"), other) == other  # V1 0.7–0.9.0 (fixed by #19312)
    assert co_tenant_non_torch_bytes(era_for("0.19.0"), other) == 0  # per-instance budget
    total = 85030076416
    msg = free_memory_refusal(era_for("0.19.0"), total_memory_bytes=total, other_processes_bytes=other,
                              gpu_memory_utilization=0.9, requested_memory_bytes=int(total * 0.9))
    assert msg.startswith("Free memory on device cuda:0 (69.19/79.19 GiB) on startup is less than desired GPU memory "
                          "utilization (0.9, 71.27 GiB).")
    assert free_memory_refusal(era_for("0.19.0"), total_memory_bytes=total, other_processes_bytes=other,
                               gpu_memory_utilization=0.8, requested_memory_bytes=int(total * 0.8)) is None
    assert free_memory_refusal(era_for("0.10.1"), total_memory_bytes=total, other_processes_bytes=other,
                               gpu_memory_utilization=0.9, requested_memory_bytes=int(total * 0.9)).startswith(
        "Free memory on device (")
    assert free_memory_refusal(era_for("0.8.4", "V0"), total_memory_bytes=total, other_processes_bytes=other,
                               gpu_memory_utilization=0.9, requested_memory_bytes=int(total * 0.9)) is None


def test_co_tenant_drop_field_refuses_what_the_free_memory_check_refuses(tmp_path):
    from tuner.jobs.job import other_processes_bytes
    from tuner.memory.search import Layout, evaluate
    from tuner.memory.eras import ProfileBatch
    from tuner.memory.kvcache import FullAttentionSpec

    d = parse_drop(_DROP + "other_processes_memory_gib: 10\n", "x.yaml")
    assert d.other_processes_memory_gib == 10.0
    with pytest.raises(DropError) as e:
        parse_drop(_DROP + "other_processes_memory_gib: -1\n", "x.yaml")
    assert e.value.field == "other_processes_memory_gib"
    assert other_processes_bytes({}, d.to_dict()) == 10 * GiB
    assert other_processes_bytes({"other_processes_bytes": 5}, {}) == 5
    specs = ({f"l{i}": FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype_bytes=2) for i in range(32)},)
    layout = Layout(85030076416, 16, 1, 1, 32, 131072, specs, other_processes_bytes=10 * GiB)
    p = {"weights_bytes": 15 * GiB, "activation_peak_bytes": 2 * GiB}
    c = evaluate(era_for("0.19.0"), layout, ProfileBatch(8192, 256, 256, True), [p], gpu_memory_utilization=0.9,
                 max_model_len=8192)
    assert not c.starts and c.reason.startswith("Free memory on device cuda:0")
    c = evaluate(era_for("0.19.0"), layout, ProfileBatch(8192, 256, 256, True), [p], gpu_memory_utilization=0.85,
                 max_model_len=8192)
    assert c.starts


def test_free_memory_from_host_on_unified_memory_by_release():
    """vllm/utils/mem_utils.py ``MemorySnapshot.measure``: none in 0.11.0; by capability in 0.19
    (Orin 8.7, Thor 11.0, Spark 12.1); by the ``is_integrated`` property in 0.26 / 0.28."""
    from tuner.memory.budget import free_memory_from_host

    spark = lookup("NVIDIA GB10")
    assert spark is not None and spark.integrated is True and spark.compute_capability == "12.1"
    gh200 = lookup("NVIDIA GH200 480GB")
    assert gh200 is not None and not gh200.integrated  # own HBM: cudaMemGetInfo
    for version, cc, integrated, expected in [("0.11.0", "12.1", True, False), ("0.19.0", "12.1", None, True),
                                              ("0.19.0", "9.0", None, False), ("0.19.0", "8.7", None, True),
                                              ("0.26.0", "12.1", False, False), ("0.28.0", "12.1", True, True),
                                              ("0.28.0", "9.0", False, False)]:
        assert free_memory_from_host(era_for(version), compute_capability=cc, integrated=integrated) is expected, version
    assert free_memory_from_host(era_for("0.8.4", "V0"), compute_capability="12.1", integrated=True) is False


def test_unified_memory_device_warns_that_host_ram_is_co_tenant_memory(shared_dir):
    from tuner.jobs.job import run_job
    from tuner.accuracy.validate import case_request

    case = {"id": "spark", "model": "Qwen/Qwen3-0.6B", "vllm_version": "0.28.0", "engine": "V1", "gpu": "NVIDIA GB10",
            "gpu_total_gib": None, "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "dtype": "bfloat16",
            "settings": {"gpu_memory_utilization": 0.5, "max_model_len": 4096}, "observed": {}}
    warned = [w for w in run_job(case_request(case, shared_dir / "models"))["warnings"] if "unified-memory" in w]
    assert len(warned) == 1 and "other_processes_memory_gib" in warned[0]
    case.update(gpu="NVIDIA H100 80GB")
    assert not [w for w in run_job(case_request(case, shared_dir / "models"))["warnings"] if "unified-memory" in w]

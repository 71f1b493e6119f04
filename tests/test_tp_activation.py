"""Activation terms of tensor-parallel and eager profiles, each from the vLLM source it cites:
the out-of-place all-reduce of ``RowParallelLinear`` (vllm/distributed/parallel_state.py,
device_communicators/pynccl.py) and the MLP classes that keep ``gate_up`` alive across
``down_proj`` (vllm/model_executor/models/qwen2.py vs llama.py)."""

from __future__ import annotations

import torch

from tuner.memory.eras import tp_all_reduce_out_of_place
from tuner.model.simulate import layers as L
from tuner.model.simulate.tracker import MemoryTracker

N, H, I = 64, 128, 256  # tokens, hidden, intermediate per rank (every tensor a multiple of 512 B)
BF16 = 2


def _peak(module, *args) -> int:
    with torch.no_grad(), MemoryTracker() as t:
        out = module(*args)
        del out
    return t.peak_bytes


def test_all_reduce_is_out_of_place_from_0_6_5():
    """0.6.4 ``GroupCoordinator.all_reduce``: ``inplace_all_reduce`` unless custom all-reduce takes
    the tensor (only under its 8 MiB ``max_size``); 0.6.5, 0.6.6, 0.7.x, 0.8.x: always
    ``torch.ops.vllm.all_reduce`` → ``_all_reduce_out_place`` (pynccl ``torch.empty_like``)."""
    assert tp_all_reduce_out_of_place("0.6.4") is False
    assert tp_all_reduce_out_of_place("0.6.3") is False
    assert tp_all_reduce_out_of_place("0.6.5") is True
    assert tp_all_reduce_out_of_place("0.7.0") is True
    assert tp_all_reduce_out_of_place("0.8.4") is True
    assert tp_all_reduce_out_of_place("0.19.0") is True


def test_row_parallel_all_reduce_holds_the_partial_sum_and_the_result():
    """``output = tensor_model_parallel_all_reduce(output_parallel)``: both ``[N, H]`` alive at once."""
    lin = L.Linear(I, H, torch.bfloat16)
    x = torch.empty(N, I, dtype=torch.bfloat16)
    assert _peak(lin, x) == N * H * BF16
    lin.all_reduce_out_of_place = True
    assert _peak(lin, x) == 2 * N * H * BF16


def test_mark_tp_all_reduce_marks_the_layers_row_parallel_projections_only():
    dtype = torch.bfloat16
    attn = L.Attention(H, 4, 2, 32, dtype, None)
    mlp = L.GatedMLP(H, I, dtype)
    shared = L.GatedMLP(H, I, dtype)  # e.g. a shared expert inside an MoE block: the block reduces
    layer = L.DecoderLayer(attn, mlp, H, dtype)
    layer.extra_shared = shared
    model = L.CausalLM(None, [layer], None, None)
    assert L.mark_tp_all_reduce(model) == 2
    assert attn.o_proj.all_reduce_out_of_place and mlp.down_proj.all_reduce_out_of_place
    assert not attn.qkv_proj.all_reduce_out_of_place and not mlp.gate_up_proj.all_reduce_out_of_place
    assert not shared.down_proj.all_reduce_out_of_place


def test_eager_mlp_peak_by_how_the_vllm_class_binds_gate_up():
    """Eager: ``LlamaMLP`` rebinds ``x`` (gate_up freed before down_proj), ``Qwen2MLP`` keeps
    ``gate_up`` in a local, so down_proj's output and its all-reduce add to gate_up + act."""
    x = torch.empty(N, H, dtype=torch.bfloat16)
    gate_up, act, out = N * 2 * I * BF16, N * I * BF16, N * H * BF16
    llama = L.GatedMLP(H, I, torch.bfloat16, compiled=False)
    qwen2 = L.GatedMLP(H, I, torch.bfloat16, compiled=False, holds_gate_up=True)
    assert _peak(llama, x) == gate_up + act
    assert _peak(qwen2, x) == gate_up + act + out
    qwen2.down_proj.all_reduce_out_of_place = True
    llama.down_proj.all_reduce_out_of_place = True
    assert _peak(qwen2, x) == gate_up + act + 2 * out
    assert _peak(llama, x) == max(gate_up + act, act + 2 * out)


def test_v0_tp4_activation_peak_counts_the_out_of_place_all_reduce(shared_dir):
    """vllm#16883: Qwen2.5-Coder-32B, V0 0.8.x, TP4 on L40, eager, 131072 batched tokens; the
    engine logged a 11.32 GiB activation peak per rank (8.82 GiB before this mechanism):
    5·[N, H] + gate_up + act (residual, the previous layer's output, the attention output, the
    down_proj partial sum and its all-reduce)."""
    from tuner.accuracy.validate import load_cases, predict_cases

    cases = [c for c in load_cases(shared_dir / "cases" / "vllm-observed.jsonl")
             if c["id"] == "vllm-16883-4xl40-tp4-qwen25-coder-32b-ngram-v0-131k"]
    row = predict_cases(cases, shared_dir / "models")[0]
    n, h, i = 131072, 5120 * BF16, 27648 // 4 * BF16
    assert abs(row["predicted_activation_peak_gib"] * (1 << 30) - n * (5 * h + 3 * i)) < 0.02 * (1 << 30)
    assert abs(row["predicted_activation_peak_gib"] - 11.32) < 0.02


# -- the CUDA caching allocator's blocks (torch c10/core/AllocatorConfig.h, CUDACachingAllocator.cpp)

def test_allocator_keeps_the_rounded_segment_when_at_most_1_mib_remains():
    from tuner.memory.allocator import fresh_segment_block_bytes, round_request

    MiB = 1 << 20
    assert round_request(1) == 512 and round_request(0) == 0
    assert fresh_segment_block_bytes(9 * MiB + 1) == 9 * MiB + 512  # 1-10 MiB: split out of a 20 MiB segment
    assert fresh_segment_block_bytes(int(17.5 * MiB)) == 18 * MiB  # 0.5 MiB left: not split
    assert fresh_segment_block_bytes(135 * MiB) == 136 * MiB  # exactly 1 MiB left: not split (> kSmallSize)
    assert fresh_segment_block_bytes(int(134.5 * MiB)) == int(134.5 * MiB)  # 1.5 MiB left: split
    assert fresh_segment_block_bytes(48 * MiB) == 48 * MiB


def test_allocator_rounding_of_qwen25_32b_tp4_weights():
    """Per layer at TP4: qkv [1792, 5120] 17.5 MiB → 18, o [5120, 1280] 12.5 → split (1.5 MiB left),
    gate_up [13824, 5120] 135 → 136, down [5120, 6912] 67.5 → 68: +2 MiB; Llama-3.1-8B's sizes are
    all 2 MiB multiples."""
    from tuner.memory.allocator import weights_rounding_bytes

    MiB = 1 << 20
    dtype = torch.bfloat16
    with torch.device("meta"):
        qwen = L.GatedMLP(5120, 6912, dtype)
        attn = L.Attention(5120, 10, 2, 128, dtype, None, qkv_bias=True)
        llama = L.GatedMLP(4096, 14336, dtype)
    assert weights_rounding_bytes(qwen) == int(1.5 * MiB)
    # qkv weight 17.5 MiB -> 18; o 12.5 MiB is split from its 14 MiB segment; the 3.5 KiB bias is exact
    assert weights_rounding_bytes(attn) == MiB // 2
    assert weights_rounding_bytes(llama) == 0


def test_rope_cache_rows_follow_get_rope():
    from types import SimpleNamespace

    from plugins.generic import rope_cache_rows

    def spec(rp):
        return SimpleNamespace(raw={"rope_scaling": rp} if rp else {}, max_position_embeddings=32768)

    assert rope_cache_rows(spec(None)) == 32768
    assert rope_cache_rows(spec({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})) == 131072
    assert rope_cache_rows(spec({"type": "linear", "factor": 2.0})) == 65536
    assert rope_cache_rows(spec({"rope_type": "llama3", "factor": 8.0})) == 32768


def test_hf_overrides_drop_field_and_config(shared_dir):
    import pytest

    from tuner.question.drop import parse_drop
    from tuner.errors import DropError
    from tuner.model.modelspec import load_model_spec
    from tuner.memory.search import derived_max_model_len

    drop = ("name: d\nmodel: ./m\ndevice: H100-80GB\ncandidates:\n  gpu_memory_utilization: [0.9]\n"
            "hf_overrides: {rope_scaling: {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}}\n")
    d = parse_drop(drop, "x.yaml")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert d.hf_overrides == {"rope_scaling": yarn} and d.to_dict()["hf_overrides"] == {"rope_scaling": yarn}
    with pytest.raises(DropError) as e:
        parse_drop(drop.replace("hf_overrides: {rope_scaling: {", "hf_overrides: {max_position_embeddings: null, x: {"),
                   "x.yaml")
    assert e.value.field == "hf_overrides.max_position_embeddings" and e.value.path == "x.yaml"
    with pytest.raises(DropError) as e:
        parse_drop(drop.split("hf_overrides")[0] + "hf_overrides: [1]\n", "x.yaml")
    assert e.value.field == "hf_overrides"
    path = shared_dir / "models" / "Qwen--Qwen2.5-Coder-32B-Instruct" / "config.json"
    plain, _ = load_model_spec(path)
    spec, _ = load_model_spec(path, overrides={"rope_scaling": yarn})
    assert derived_max_model_len(plain.raw)[0] == 32768
    assert derived_max_model_len(spec.raw)[0] == 131072  # vLLM's factor rule sees the override
    assert spec.config_sha256 != plain.config_sha256


def test_hf_overrides_flag_is_read_from_a_serve_command():
    from tuner.memory.serve_args import parse_serve

    a = parse_serve(["vllm", "serve", "m", "--hf-overrides", '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}'])
    assert a.values["hf_overrides"] == {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert not a.unmodelled and not a.unknown

"""Activation terms of tensor-parallel and eager profiles, each from the vLLM source it cites:
the out-of-place all-reduce of ``RowParallelLinear`` (vllm/distributed/parallel_state.py,
device_communicators/pynccl.py) and the MLP classes that keep ``gate_up`` alive across
``down_proj`` (vllm/model_executor/models/qwen2.py vs llama.py)."""

from __future__ import annotations

import torch

from tuner.eras import tp_all_reduce_out_of_place
from tuner.simulate import layers as L
from tuner.simulate.tracker import MemoryTracker

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
    from tuner.validate import load_cases, predict_cases

    cases = [c for c in load_cases(shared_dir / "cases" / "vllm-observed.jsonl")
             if c["id"] == "vllm-16883-4xl40-tp4-qwen25-coder-32b-ngram-v0-131k"]
    row = predict_cases(cases, shared_dir / "models")[0]
    n, h, i = 131072, 5120 * BF16, 27648 // 4 * BF16
    assert abs(row["predicted_activation_peak_gib"] * (1 << 30) - n * (5 * h + 3 * i)) < 0.02 * (1 << 30)
    assert abs(row["predicted_activation_peak_gib"] - 11.32) < 0.02

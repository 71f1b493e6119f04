"""CUDA-graph capture sizes by release (vllm/config/vllm.py ``VllmConfig._set_cudagraph_sizes``,
read in 0.19.0, 0.20.0, 0.20.1, 0.24.0, 0.28.0, 0.29.0, 0.30.0, 0.31.0 and 0.33.0)."""

from __future__ import annotations

from tuner.memory.budget import cudagraph_capture_sizes, cudagraph_estimate_bytes
from tuner.memory.eras import era_for


def test_max_num_batched_tokens_is_captured_from_0_20_1():
    assert cudagraph_capture_sizes(era_for("0.20.0"), 256, 100)[-1] == 96
    assert cudagraph_capture_sizes(era_for("0.20.1"), 256, 100)[-2:] == [96, 100]


def test_data_centre_blackwell_captures_up_to_1024_from_0_28():
    # max_num_seqs 1024, N 8192: 3 + 31 + len(range(256, 1025, 16)) = 83 sizes on cc 10.x
    assert len(cudagraph_capture_sizes(era_for("0.28.0"), 1024, 8192, compute_capability="10.0")) == 83
    assert len(cudagraph_capture_sizes(era_for("0.28.0"), 1024, 8192, compute_capability="9.0")) == 51
    assert len(cudagraph_capture_sizes(era_for("0.27.0"), 1024, 8192, compute_capability="10.0")) == 51
    assert len(cudagraph_capture_sizes(era_for("0.28.0"), 1024, 8192, compute_capability="12.0")) == 51


def test_uniform_decode_sizes_with_spec_decode_from_0_29():
    # q = 3: max = min(4 · 3 · 2, 512) = 24; request counts 1, 2, 4 → decode sizes 3, 6, 12
    assert cudagraph_capture_sizes(era_for("0.28.0"), 4, 8192, num_speculative_tokens=2) == [1, 2, 4, 8, 16, 24]
    assert cudagraph_capture_sizes(era_for("0.29.0"), 4, 8192, num_speculative_tokens=2) == \
        [1, 2, 3, 4, 6, 8, 12, 16, 24]
    # decode sizes above N are dropped (N = 10)
    assert cudagraph_capture_sizes(era_for("0.29.0"), 4, 10, num_speculative_tokens=2) == [1, 2, 3, 4, 6, 8, 10]
    # an explicit max_cudagraph_capture_size computes no decode sizes
    assert cudagraph_capture_sizes(era_for("0.29.0"), 4, 8192, num_speculative_tokens=2,
                                   max_cudagraph_capture_size=24) == [1, 2, 4, 8, 16, 24]


def test_max_num_seqs_is_captured_without_spec_decode_from_0_31():
    assert 20 not in cudagraph_capture_sizes(era_for("0.30.0"), 20, 8192)
    assert cudagraph_capture_sizes(era_for("0.31.0"), 20, 8192) == [1, 2, 4, 8, 16, 20, 24, 32, 40]


def test_graph_estimate_scales_with_the_release_sizes():
    e28 = era_for("0.28.0")
    hopper = cudagraph_estimate_bytes(e28, num_layers=32, max_num_seqs=1024, max_num_batched_tokens=8192,
                                      compute_capability="9.0")
    blackwell = cudagraph_estimate_bytes(e28, num_layers=32, max_num_seqs=1024, max_num_batched_tokens=8192,
                                         compute_capability="10.0")
    assert blackwell == int(hopper * 83 / 51) or abs(blackwell - hopper * 83 / 51) <= 2

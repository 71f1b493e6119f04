"""Data and expert parallelism (vLLM FusedMoEParallelConfig / determine_expert_map): an EP rank's
experts, the DP-flattened expert TP, and the resulting weights of Mixtral-8x7B on one rank."""

from __future__ import annotations

import pytest

from tuner.memory.budget import moe_rank_shape
from tuner.question.drop import parse_drop
from tuner.errors import DropError
from tuner.model.modelspec import load_model_spec
from tuner.model.plugin import RankSettings, load_registry


@pytest.mark.parametrize("e,i,tp,dp,ep,expected", [
    (8, 14336, 2, 1, False, (8, 7168)),  # TP only: every expert, I / tp
    (8, 14336, 1, 2, False, (8, 7168)),  # DP without EP: experts TP-sharded over dp × tp
    (8, 14336, 2, 4, True, (1, 14336)),  # EP over 8 ranks: one whole expert each
    (256, 2048, 8, 2, True, (16, 2048)),  # DeepSeek-V3, DP2 × TP8 EP: 256 / 16
    (60, 1408, 8, 1, True, (8, 1408)),  # 60 experts over 8 ranks: rank 0 holds 60 // 8 + 1
    (8, 14336, 1, 1, True, (8, 14336)),  # one rank: EP is off (ep needs > 1 rank)
])
def test_ep_rank_expert_count_and_shard(e, i, tp, dp, ep, expected):
    assert moe_rank_shape(e, i, tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep) == expected


def _weights(spec, settings):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tuner.model.simulate.moe import expert_layout

    plugin, _ = load_registry().for_architectures(spec.architectures)
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True), \
            expert_layout(settings.tensor_parallel_size, settings.data_parallel_size, settings.enable_expert_parallel):
        return plugin.weights_bytes(spec, settings, plugin.build_model(spec, settings))


def test_dp_ep_rank_holds_its_experts_and_the_whole_dense_part(shared_dir):
    spec = load_model_spec(shared_dir / "models" / "mistralai--Mixtral-8x7B-Instruct-v0.1" / "config.json")[0]
    base = dict(engine_version="0.19.0", dtype="bfloat16")
    tp1 = _weights(spec, RankSettings(**base))
    tp2 = _weights(spec, RankSettings(**base, tensor_parallel_size=2))
    ep = _weights(spec, RankSettings(**base, data_parallel_size=2, enable_expert_parallel=True))
    dp = _weights(spec, RankSettings(**base, data_parallel_size=2))
    experts = 32 * 8 * 3 * 4096 * 14336 * 2  # layers × E × (w13 + w2) × H × I × bf16
    # DP2 + EP: half the experts, every dense weight (TP1); DP2 without EP: half of every expert
    assert ep == tp1 - experts // 2 == dp
    assert tp2 < ep  # TP2 also halves attention, embeddings and lm_head


def test_dp_and_ep_drop_fields_are_validated():
    text = "name: d\nmodel: ./m\ndevice: H100-80GB\ncandidates: {gpu_memory_utilization: [0.9]}\n"
    d = parse_drop(text + "data_parallel_size: 4\nenable_expert_parallel: true\n", "x.yaml")
    assert (d.data_parallel_size, d.enable_expert_parallel) == (4, True)
    with pytest.raises(DropError) as e:
        parse_drop(text + "data_parallel_size: 0\n", "x.yaml")
    assert e.value.field == "data_parallel_size" and e.value.path == "x.yaml"


def test_explain_names_the_ranks_experts(shared_dir):
    from tuner.reports.explain import explain_point
    from tuner.memory.eras import era_for

    cfg = shared_dir / "models" / "mistralai--Mixtral-8x7B-Instruct-v0.1" / "config.json"
    cand = {"gpu_memory_utilization": 0.9, "max_model_len": 4096, "requested_memory_bytes": 100, "weights_bytes": 40,
            "activation_peak_bytes": 10, "non_torch_bytes": 5, "cuda_graph_bytes": 0, "available_kv_cache_bytes": 45,
            "num_gpu_blocks": 0, "kv_cache_tokens": 0, "max_concurrency": 0.0, "max_num_batched_tokens": 8192,
            "max_num_seqs": 256, "fits": False, "starts": False, "reason": "x"}
    e = explain_point(drop={"tensor_parallel_size": 2, "data_parallel_size": 4, "enable_expert_parallel": True},
                      device={"name": "H100-80GB", "total_memory_bytes": 85030076416}, era=era_for("0.19.0"), cand=cand,
                      model={"path": str(cfg)})
    step = next(s for s in e["steps"] if s["name"] == "data_expert_parallel")
    assert step["op"] == "info" and "1 of 8 experts per MoE layer, whole" in step["text"]

"""The daemon's proposal file prints a ``vllm serve`` command that works from any directory."""

from __future__ import annotations

from tuner.reports.proposals import _serve_model


def test_local_model_path_is_resolved_against_the_drop_file(tmp_path):
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    drops = tmp_path / "conf.d"
    drops.mkdir()
    drop = {"model": "../models/m", "path": str(drops / "a.yaml")}
    assert _serve_model(drop) == str(model.resolve())
    assert _serve_model({"model": "../models/m/config.json", "path": str(drops / "a.yaml")}) == str(model.resolve())


def test_hf_ids_are_kept():
    assert _serve_model({"model": "meta-llama/Llama-3.1-8B-Instruct", "path": "/nonexistent/a.yaml"}) == \
        "meta-llama/Llama-3.1-8B-Instruct"


def test_v0_proposal_file_numbers_are_the_proposed_points_own(tmp_path):
    """The RTX-3090 V0 drop at u 0.87 with the grid [29000, 31000] proposes 34256 tokens, 2141
    blocks, in the chunked-prefill region (N 512). Its proposal file's ``numbers`` were copied
    from the 31000 candidate (``from_candidate_max_model_len: 31000``, N 31000, activation
    3,436,871,680 B, KV 2,120,698,757 B: 1011 blocks' worth). They are the proposed point's own, as
    the search evaluated it: N 512, activation 1,065,484,288 B, KV 4,492,086,149 B = 2141 blocks."""
    import yaml

    from tests._results_db import V0_DROP, cached_worker
    from tests.conftest import REPO
    from tuner.jobs.app import profile
    from tuner.reports.proposals import proposal_document
    from tuner.store.database import open_store

    body = yaml.safe_load(V0_DROP.read_text())
    body.update(model=str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"),
                candidates={"gpu_memory_utilization": [0.87], "max_model_len": [29000, 31000]},
                constraints={**(body.get("constraints") or {}), "risk": "expected"})  # the expected value's point
    drop = tmp_path / "v0.yaml"
    drop.write_text(yaml.safe_dump(body))
    db = tmp_path / "r.sqlite"
    outcome = profile(str(drop), db_url=str(db), worker=cached_worker)
    store = open_store(str(db))
    try:
        doc = proposal_document(store, outcome.drop_id)
    finally:
        store.close()
    (prop,) = doc["proposals"]
    assert (prop["max_model_len"], prop["num_gpu_blocks"]) == (34256, 2141)
    n = prop["numbers"]
    assert "from_candidate_max_model_len" not in n
    assert n["max_num_batched_tokens"] == 512
    assert n["activation_peak_bytes"] == 1_065_484_288
    assert n["available_kv_cache_bytes"] == 4_492_086_149
    assert n["available_kv_cache_bytes"] // (2 << 20) == prop["num_gpu_blocks"]  # 2 MiB V0 blocks
    assert (n["requested_memory_bytes"] - n["weights_bytes"] - n["activation_peak_bytes"] - n["non_torch_bytes"]
            - n["cuda_graph_bytes"]) == n["available_kv_cache_bytes"]
    # what the search computed for that point, and not the 31000 candidate's
    (wire,) = outcome.result["proposals"]
    assert {k: wire[k] for k in n} == n
    c31 = [c for c in outcome.result["candidates"] if c["max_model_len"] == 31000][0]
    assert c31["available_kv_cache_bytes"] == 2_120_698_757 != n["available_kv_cache_bytes"]

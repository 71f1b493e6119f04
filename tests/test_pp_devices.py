"""Pipeline stages on different GPUs (a drop's device list, issue 16): each stage sized on its own
card with its own layers, the engine's minimum blocks over the stages, the limiting stage named;
and the torch symmetric-memory all-reduce buffer by release, capability and world size."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import yaml

from tuner.jobs.app import prepare_job, profile
from tuner.question.drop import load_drop
from tuner.errors import DropError
from tuner.jobs.job import run_job

GiB = 1 << 30
MiB = 1 << 20
LLAMA = "meta-llama--Llama-3.1-8B-Instruct"


def _drop(tmp_path: Path, model_dir: Path, **over) -> Path:
    body = {
        "name": "pp", "model": str(model_dir), "device": ["H100-80GB", "A100-40GB"], "engine_version": "0.19.0",
        "pipeline_parallel_size": 2, "max_num_batched_tokens": 8192, "max_num_seqs": 256,
        "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [8192]},
    }
    body.update(over)
    p = tmp_path / f"{body['name']}.yaml"
    p.write_text(yaml.safe_dump(body))
    return p


def _run(path: Path) -> dict:
    request, _dev = prepare_job(load_drop(path))
    return run_job(request)


# ------------------------------------------------------------------------------------------------
# the drop field
# ------------------------------------------------------------------------------------------------


def test_device_list_length_must_match_pipeline_parallel_size(tmp_path, shared_dir):
    p = _drop(tmp_path, shared_dir / "models" / LLAMA, pipeline_parallel_size=4)
    with pytest.raises(DropError) as exc:
        load_drop(p)
    assert exc.value.field == "device" and exc.value.path == str(p)
    assert "2 entries for pipeline_parallel_size 4" in exc.value.message


def test_device_list_unknown_entry_names_its_index(tmp_path, shared_dir):
    p = _drop(tmp_path, shared_dir / "models" / LLAMA, device=["H100-80GB", "H101-80GB"])
    with pytest.raises(DropError) as exc:
        load_drop(p)
    assert exc.value.field == "device[1]" and exc.value.path == str(p)
    assert "unknown device 'H101-80GB'" in exc.value.message


@pytest.mark.parametrize("entry, field, text", [
    ("auto", "device[1]", "'auto' reads GPU 0 only"),
    ({"name": "x", "total_memory_gib": 40, "colour": "red"}, "device[1].colour", "unknown key 'colour'"),
    ({"name": "x"}, "device[1]", "needs 'total_memory_gib'"),
    (["A100-40GB"], "device[1]", "not a list"),
])
def test_device_list_bad_entry_names_file_and_field(tmp_path, shared_dir, entry, field, text):
    p = _drop(tmp_path, shared_dir / "models" / LLAMA, device=["H100-80GB", entry])
    with pytest.raises(DropError) as exc:
        load_drop(p)
    assert exc.value.field == field and exc.value.path == str(p)
    assert text in exc.value.message


def test_device_list_resolves_one_card_per_stage(tmp_path, shared_dir):
    d = load_drop(_drop(tmp_path, shared_dir / "models" / LLAMA,
                        device=["H100-80GB", {"name": "big A100", "total_memory_gib": 40}]))
    cards = d.resolve_devices()
    assert [c.name for c in cards] == ["H100-80GB", "big A100"]
    assert cards[1].total_memory_bytes == 40 * GiB
    assert d.resolve_device() == cards[0]
    assert d.to_dict()["device"] == ["H100-80GB", {"name": "big A100", "total_memory_gib": 40}]
    # one device: repeated per stage
    one = load_drop(_drop(tmp_path, shared_dir / "models" / LLAMA, name="one", device="A100-40GB"))
    assert [c.name for c in one.resolve_devices()] == [one.resolve_device().name] * 2


# ------------------------------------------------------------------------------------------------
# the job: each stage on its own card, the minimum blocks
# ------------------------------------------------------------------------------------------------


def _stage(result: dict, r: int) -> dict:
    return result["candidates"][0]["stages"][r]


def test_two_stages_on_two_cards_give_the_min_blocks_of_each_cards_own_stage(tmp_path, shared_dir):
    model = shared_dir / "models" / LLAMA
    mixed = _run(_drop(tmp_path, model))
    h100 = _run(_drop(tmp_path, model, name="h", device="H100-80GB"))
    a100 = _run(_drop(tmp_path, model, name="a", device="A100-40GB"))
    # stage 0 on the H100 is the all-H100 run's stage 0, stage 1 on the A100 the all-A100 run's stage 1
    for key in ("total_memory_bytes", "weights_bytes", "activation_peak_bytes", "non_torch_bytes",
                "cuda_graph_bytes", "available_kv_cache_bytes", "num_gpu_blocks"):
        assert _stage(mixed, 0)[key] == _stage(h100, 0)[key], key
        assert _stage(mixed, 1)[key] == _stage(a100, 1)[key], key
    assert _stage(mixed, 0)["total_memory_bytes"] != _stage(mixed, 1)["total_memory_bytes"]
    c = mixed["candidates"][0]
    own = [_stage(mixed, 0)["num_gpu_blocks"], _stage(mixed, 1)["num_gpu_blocks"]]
    # the own blocks are each stage's bytes over its bytes per block (get_kv_cache_configs)
    for r in (0, 1):
        assert own[r] == _stage(mixed, r)["available_kv_cache_bytes"] // mixed["kv_block_bytes"][r]
    assert own[1] < own[0]  # a 40 GB card holds less cache than an 80 GB one
    assert c["num_gpu_blocks"] == min(own) == own[1]
    assert c["limiting_stage"] == 1 and _stage(mixed, 1)["device_name"] == "A100-40GB"
    assert c["available_kv_cache_bytes"] == _stage(mixed, 1)["available_kv_cache_bytes"]
    assert c["requested_memory_bytes"] == _stage(mixed, 1)["requested_memory_bytes"]
    assert c["num_gpu_blocks"] < h100["candidates"][0]["num_gpu_blocks"]
    assert c["run_key"].endswith("@1")  # the stored candidate points at the limiting stage's pass
    # the proposal is limited by the tightest stage: the all-A100 run's answer
    assert mixed["proposals"][0]["num_gpu_blocks"] == a100["proposals"][0]["num_gpu_blocks"]


def test_each_stage_weighs_its_own_layers(tmp_path, shared_dir):
    cfg = yaml.safe_load((shared_dir / "models" / LLAMA / "config.json").read_text())
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    layer = 2 * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)  # bf16: q, o, k, v, gate/up/down, two norms
    rope = 2 * cfg["max_position_embeddings"] * (h // cfg["num_attention_heads"])  # one cos/sin cache per stage
    r = _run(_drop(tmp_path, shared_dir / "models" / LLAMA))
    s0, s1 = _stage(r, 0), _stage(r, 1)
    assert s0["decoder_layers"] == [0, 16] and s1["decoder_layers"] == [16, 32]
    assert s0["kv_layers"] == s1["kv_layers"] == 16
    assert s0["weights_bytes"] == 16 * layer + 2 * v * h + rope  # the embedding on the first stage
    assert s1["weights_bytes"] == 16 * layer + 2 * v * h + 2 * h + rope  # lm_head and the final norm on the last


def test_device_list_is_stored_per_stage(tmp_path, shared_dir):
    db = tmp_path / "t.db"
    p = _drop(tmp_path, shared_dir / "models" / LLAMA)
    out = profile(str(p), db_url=f"sqlite:///{db}", cache=False)
    assert out.device["name"] == "H100-80GB | A100-40GB"
    con = sqlite3.connect(db)
    content, dev_name = con.execute("select content, device_name from drops").fetchone()
    assert yaml.safe_load(content)["device"] == ["H100-80GB", "A100-40GB"]
    assert dev_name == out.device["name"]
    runs = con.execute("select device_name, device_total_memory_bytes, weights_bytes from profile_runs "
                       "order by id").fetchall()
    cards = load_drop(p).resolve_devices()
    stages = out.result["candidates"][0]["stages"]
    # one pass per stage and profile batch (the search adds a batch), each on its stage's card
    assert len(runs) % 2 == 0 and runs
    for k, row in enumerate(runs):
        assert row == (cards[k % 2].name, cards[k % 2].total_memory_bytes, stages[k % 2]["weights_bytes"])
    blocks, avail = con.execute("select num_gpu_blocks, available_kv_cache_bytes from candidates").fetchone()
    c = out.result["candidates"][0]
    assert blocks == c["num_gpu_blocks"] == c["stages"][1]["num_gpu_blocks"]
    assert avail == c["stages"][1]["available_kv_cache_bytes"]
    from tuner.commands.profile import render_table, to_json

    text = render_table(out)
    assert "stage 0 on H100-80GB (79.19 GiB), layers 0-15" in text
    assert f"{c['stages'][1]['num_gpu_blocks']} blocks  <- limiting" in text
    doc = to_json(out)
    assert doc["device"]["stages"][1]["name"] == "A100-40GB"
    assert doc["candidates"][0]["limiting_stage"] == 1
    # explain --run of the limiting stage's pass: the stored candidate, on the A100's own total
    from tuner.reports.explain import explain_stored
    from tuner.store.database import open_store

    run_id = con.execute("select id from profile_runs where device_name = 'A100-40GB' and "
                         "max_num_batched_tokens = 8192").fetchone()[0]
    store = open_store(f"sqlite:///{db}")
    try:
        e = explain_stored(store, run_id, max_model_len=8192)["explanations"][0]
    finally:
        store.close()
    assert e["total_memory_bytes"] == cards[1].total_memory_bytes
    assert e["num_gpu_blocks"] == c["num_gpu_blocks"]


def test_explain_shows_each_stage_and_names_the_limiting_one(tmp_path, shared_dir):
    from tuner.reports.explain import explain_drop, render

    from tuner.seam.worker import run_in_worker

    def worker(request, **kw):
        return run_job(request)

    doc = explain_drop(str(_drop(tmp_path, shared_dir / "models" / LLAMA)), worker=worker, variants=False,
                       cache=False)
    e = doc["explanations"][0]
    steps = {s["name"]: s for s in e["steps"]}
    assert steps["stage_0"]["op"] == steps["stage_1"]["op"] == "info"
    assert steps["stage_1"]["limiting"] and not steps["stage_0"]["limiting"]
    assert "A100-40GB" in steps["stage_1"]["text"] and "limiting stage" in steps["stage_1"]["text"]
    assert "decoder layers 16-31" in steps["stage_1"]["text"]
    # the point's own steps are the A100 stage's: requested = its total x u
    assert e["total_memory_bytes"] == load_drop(tmp_path / "pp.yaml").resolve_devices()[1].total_memory_bytes
    assert steps["requested"]["bytes"] == e["requested_memory_bytes"]
    assert "pipeline stage 0 on H100-80GB" in render(doc)
    del run_in_worker


def test_engine_adapter_skips_a_device_list_with_a_warning(tmp_path, shared_dir, monkeypatch):
    import tuner.releases.installed as engine  # where the probe lives (tuner.engine re-exports it)

    monkeypatch.setattr(engine, "vllm_importable", lambda: True)
    r = _run(_drop(tmp_path, shared_dir / "models" / LLAMA))
    assert "engine cross-check skipped for pipeline stages on different GPUs (a device list)" in r["warnings"]
    assert r["engine_check"] == {"skipped": "engine adapter not used for pipeline stages on different GPUs "
                                            "(a device list)"}


def test_method_cuda_refuses_a_device_list(tmp_path, shared_dir, monkeypatch):
    import tuner.jobs.app as app

    monkeypatch.setattr(app, "resolve_method", lambda drop, nvml=None: "cuda")
    with pytest.raises(DropError) as exc:
        prepare_job(load_drop(_drop(tmp_path, shared_dir / "models" / LLAMA, method="cuda")))
    assert exc.value.field == "method" and "measures GPU 0 only" in exc.value.message


# ------------------------------------------------------------------------------------------------
# torch symmetric memory (vllm/distributed/device_communicators/symm_mem.py)
# ------------------------------------------------------------------------------------------------


def _era(v: str):
    from tuner.memory.eras import era_for

    return era_for(v)


@pytest.mark.parametrize("version, cap, world, mib", [
    ("0.19.0", "9.0", 2, 66),     # 64 MiB + signal pad, rounded to the 2 MiB granularity
    ("0.19.0", "9.0", 4, 34),
    ("0.19.0", "9.0", 8, 66),
    ("0.28.0", "10.0", 8, 130),
    ("0.28.0", "10.7", 2, 6),     # Rubin's row first appears in 0.28
    ("0.26.0", "10.7", 2, 0),
    ("0.24.0", "10.3", 4, 34),
    ("0.19.0", "8.9", 2, 0),      # Ada: no SYMM_MEM_ALL_REDUCE_MAX_SIZES row
    ("0.19.0", "9.0", 1, 0),
    ("0.19.0", "9.0", 3, 0),      # world size outside the table
    ("0.10.2", "9.0", 2, 0),      # VLLM_ALLREDUCE_USE_SYMM_MEM defaulted to 0 in 0.10.2
])
def test_symm_mem_buffer_bytes_from_source(version, cap, world, mib):
    from tuner.memory.budget import Topology, symm_mem_buffer_bytes

    assert symm_mem_buffer_bytes(_era(version), world, Topology(compute_capability=cap)) == mib * MiB


def test_symm_mem_buffer_is_baseline_from_0_11_so_non_torch_is_unchanged():
    from tuner.memory.budget import Topology, custom_all_reduce_buffer_bytes, nccl_profile_bytes, non_torch_bytes

    era, topo = _era("0.19.0"), Topology(compute_capability="9.0")
    # 0.11+: the snapshot follows init_worker_distributed_environment; neither buffer is charged
    assert non_torch_bytes(era, tensor_parallel_size=2, topology=topo) == int(0.25 * GiB) + nccl_profile_bytes(
        era, 2, topo)
    old = _era("0.10.2")  # snapshot before the init: custom all-reduce charged, symmetric memory off by default
    assert non_torch_bytes(old, tensor_parallel_size=2, topology=topo) == (
        int(0.02 * GiB) + nccl_profile_bytes(old, 2, topo) + custom_all_reduce_buffer_bytes(old, 2, topo))


def test_explain_shows_the_symm_mem_buffer_as_not_charged():
    from tuner.reports.explain import _communication_steps

    steps = _communication_steps(_era("0.19.0"), {"tensor_parallel_size": 2},
                                 {"name": "H100-80GB", "total_memory_bytes": 80 * GiB}, 4 * GiB)
    symm = [s for s in steps if s["name"] == "symmetric_memory"]
    assert symm and symm[0]["op"] == "info" and symm[0]["bytes"] == 66 * MiB
    assert "not charged" in symm[0]["text"]


def test_v0_device_list_takes_the_min_blocks_over_workers(tmp_path, shared_dir):
    # V0: executor_base.determine_num_available_blocks takes min over the workers' own blocks
    p = _drop(tmp_path, shared_dir / "models" / LLAMA, engine_version="0.8.4", max_num_seqs=256,
              enable_chunked_prefill=True)
    request, _dev = prepare_job(load_drop(p))
    r = run_job(request.replace(search=False))
    c = r["candidates"][0]
    own = [s["available_kv_cache_bytes"] // b for s, b in zip(c["stages"], r["kv_block_bytes"])]
    assert [s["num_gpu_blocks"] for s in c["stages"]] == own
    assert c["num_gpu_blocks"] == min(own) == own[1] and c["limiting_stage"] == 1
    assert c["stages"][1]["total_memory_bytes"] == load_drop(p).resolve_devices()[1].total_memory_bytes

"""``explain --run ID`` of a hybrid / speculative-decoding model (Qwen3.6-27B, club3090-584's 4x3090
MTP x3 drop and a DFlash drop) against live ``explain`` of the same drop: the stored run's block size
(its hybrid page, not 16), the drafter's weights apart from the target's, no calibration step from a
store without calibrations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._paths import SHARED

from tests._cli_helpers import run_cli as _cli
from tuner.reports.explain import steps_add_up

QWEN36 = SHARED / "models" / "Lorbus--Qwen3.6-27B-int4-AutoRound"
DFLASH = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 5,
          "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 17408,
          "vocab_size": 248320, "dflash_config": {"target_layer_ids": [1, 16, 31, 46, 61]}}




def _mtp_drop(tmp_path: Path) -> Path:
    # club3090-584 (shared/cases/vllm-observed.jsonl): 0.24.0, 4x RTX 3090, TP4, fp16, inc, fp8_e5m2, MTP x3
    p = tmp_path / "mtp.yaml"
    p.write_text(f"name: club3090-584\nmodel: {QWEN36}\ndevice: NVIDIA GeForce RTX 3090\nengine_version: '0.24.0'\n"
                 "dtype: float16\nkv_cache_dtype: fp8_e5m2\nquantization: inc\ntensor_parallel_size: 4\n"
                 "disable_custom_all_reduce: true\nspeculative_config: {method: mtp, num_speculative_tokens: 3}\n"
                 "candidates: {gpu_memory_utilization: [0.9], max_model_len: [262144]}\n")
    return p


def _dflash_drop(tmp_path: Path) -> Path:
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(DFLASH))
    p = tmp_path / "dflash.yaml"
    p.write_text(f"name: dflash\nmodel: {QWEN36}\ndevice: NVIDIA GeForce RTX 4090\nengine_version: '0.20.1'\n"
                 "dtype: bfloat16\nquantization: auto_round\ntensor_parallel_size: 2\ndisable_custom_all_reduce: true\n"
                 "max_num_seqs: 1\nmax_num_batched_tokens: 8192\nenable_prefix_caching: true\n"
                 "speculative_config: {method: dflash, num_speculative_tokens: 5, model: drafter}\n"
                 "candidates: {gpu_memory_utilization: [0.95], max_model_len: [180000]}\n")
    return p


def _live_and_stored(tmp_path: Path, drop: Path, m: int) -> tuple[dict, dict, str]:
    db = tmp_path / "s.db"
    rc, _out, err = _cli("profile", str(drop), "--db", str(db), "--quiet")
    assert rc in (0, 3), err
    rc, out, err = _cli("explain", str(drop), "-m", str(m), "--no-variants", "--quiet", "--json", "--no-cache")
    assert rc in (0, 3), err
    live = json.loads(out)["explanations"][0]
    import sqlite3

    con = sqlite3.connect(db)
    run_id, = con.execute("SELECT profile_run_id FROM candidates WHERE max_model_len = ?", (m,)).fetchone()
    con.close()
    rc, out, err = _cli("explain", "--run", str(run_id), "-m", str(m), "--db", str(db), "--json")
    assert rc in (0, 3), err
    stored = json.loads(out)["explanations"][0]
    rc, text, err = _cli("explain", "--run", str(run_id), "-m", str(m), "--db", str(db))
    return live, stored, text


def _steps(e: dict) -> dict:
    return {s["name"]: s for s in e["steps"]}


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    if not (QWEN36 / "config.json").is_file():
        pytest.skip("shared/models not present")
    tmp = tmp_path_factory.mktemp("mtp")
    return _live_and_stored(tmp, _mtp_drop(tmp), 262144)


def test_explain_run_uses_the_stored_block_size_of_a_hybrid_model(mtp):
    live, stored, text = mtp
    assert live["block_size"] == 1600  # the hybrid page (GDN state + full-attention pages), not 16
    assert stored["block_size"] == live["block_size"]
    # 1076 with FULL graphs counted (§20); 1115 since §24 (1118: the int4 weights' rounding > the smaller reserve)
    assert stored["num_gpu_blocks"] == live["num_gpu_blocks"] == 1115
    assert _steps(stored)["concurrency"]["text"] == _steps(live)["concurrency"]["text"]
    # the divisor is every KV cache group's pages (attention cdiv(262144, 1600) = 164 plus the GDN
    # state groups), not the dense cdiv alone (helper-39: "1076 / 164 = 6.11" did not divide)
    assert "1115 blocks / 176 blocks per full-length request" in _steps(stored)["concurrency"]["text"]
    assert "attention cdiv(262144, 1600) = 164" in _steps(stored)["concurrency"]["text"]
    assert abs(stored["max_concurrency"] - 1115 / 176) < 1e-4
    assert "block_size 1600" in text and "block_size 16\n" not in text and "cdiv(262144, 16)" not in text


def test_explain_run_adds_no_calibration_step_without_calibrations(mtp):
    live, stored, _text = mtp
    names = _steps(stored)
    assert "calibration" not in names and "unattributed" not in names and "rounding" not in names
    assert stored["calibration_bytes"] == 0
    for k in ("requested", "activation_peak", "cublas_workspace", "safety_reserve", "non_torch", "available_kv"):
        assert names[k]["bytes"] == _steps(live)[k]["bytes"], k
    assert steps_add_up(stored["steps"]) == stored["available_kv_cache_bytes"] == live["available_kv_cache_bytes"]


def test_explain_run_keeps_the_drafter_weights_apart_from_the_targets(mtp):
    live, stored, _text = mtp
    s, lv = _steps(stored), _steps(live)
    assert s["weights"]["bytes"] == lv["weights"]["bytes"]  # the target's shard only
    assert s["drafter_weights"]["bytes"] == lv["drafter_weights"]["bytes"] == 212_336_640
    assert s["speculative_decoding"]["text"] == lv["speculative_decoding"]["text"]
    # what the store has no columns for is said, not invented
    assert "not stored" in s["drafter_terms"]["text"] and s["drafter_terms"]["op"] == "info"
    assert s["custom_all_reduce"]["text"] == lv["custom_all_reduce"]["text"]  # the drop's disable_custom_all_reduce


def test_explain_run_uses_the_stored_block_size_of_a_dflash_drop(tmp_path):
    if not (QWEN36 / "config.json").is_file():
        pytest.skip("shared/models not present")
    live, stored, _text = _live_and_stored(tmp_path, _dflash_drop(tmp_path), 180000)
    assert live["block_size"] == 816  # the hybrid page with the drafter's own attention group, not 16
    assert stored["block_size"] == live["block_size"]
    s, lv = _steps(stored), _steps(live)
    assert s["concurrency"]["text"] == lv["concurrency"]["text"]
    # 1262 since §24 (1264 before)
    assert "1262 blocks / 1175 blocks per full-length request" in s["concurrency"]["text"]
    assert abs(stored["max_concurrency"] - 1262 / 1175) < 1e-4
    assert s["drafter_weights"]["bytes"] == lv["drafter_weights"]["bytes"]
    assert s["weights"]["bytes"] == lv["weights"]["bytes"] and s["safety_reserve"]["bytes"] == lv["safety_reserve"]["bytes"]
    assert s["activation_peak"]["bytes"] == lv["activation_peak"]["bytes"]
    # the drafter's aux hidden states have no stored column: shown as unattributed, not as a calibration
    assert "calibration" not in s and s["unattributed"]["bytes"] == lv["drafter_activation"]["bytes"]
    assert "rounding" not in s and steps_add_up(stored["steps"]) == stored["available_kv_cache_bytes"]


def test_explain_run_says_when_a_stored_run_has_no_block_size(tmp_path):
    # a store written before simulate rows kept their block size: said, not assumed to be 16
    import sqlite3

    if not (QWEN36 / "config.json").is_file():
        pytest.skip("shared/models not present")
    db = tmp_path / "s.db"
    rc, _out, err = _cli("profile", str(_mtp_drop(tmp_path)), "--db", str(db), "--quiet")
    assert rc in (0, 3), err
    con = sqlite3.connect(db)
    with con:
        con.execute("UPDATE profile_runs SET block_size = NULL")
    con.close()
    rc, text, err = _cli("explain", "--run", "1", "--db", str(db))
    assert rc == 0, err
    assert "block_size not stored" in text and "cdiv(262144, 16)" not in text
    assert "the run's block size is not stored" in text


def test_explain_run_of_another_pass_names_no_pipeline_stage_at_pp_1(tmp_path):
    # the DFlash drop's job has two passes (N 816 and 8192) at PP 1: the one without candidates is not a stage
    import sqlite3

    if not (QWEN36 / "config.json").is_file():
        pytest.skip("shared/models not present")
    db = tmp_path / "s.db"
    rc, _out, err = _cli("profile", str(_dflash_drop(tmp_path)), "--db", str(db), "--quiet")
    assert rc in (0, 3), err
    con = sqlite3.connect(db)
    runs = [r for (r,) in con.execute("SELECT id FROM profile_runs ORDER BY id")]
    holders = {r for (r,) in con.execute("SELECT DISTINCT profile_run_id FROM candidates")}
    con.close()
    other = next(r for r in runs if r not in holders)
    rc, _out, err = _cli("explain", "--run", str(other), "--db", str(db))
    assert rc == 2 and f"explain --run {min(holders)}" in err
    assert "pipeline stage" not in err and "another pass of the same job" in err


def test_explain_run_of_a_drop_without_a_grid_explains_the_proposal_not_the_probe_points(tmp_path):
    # no max_model_len grid: the stored candidates are the search's probes (16, 20496, ...); live explain
    # explains the proposal's point, and so does --run
    qwen3 = SHARED / "models" / "Qwen--Qwen3-8B"
    if not (qwen3 / "config.json").is_file():
        pytest.skip("shared/models not present")
    drop, db = tmp_path / "nogrid.yaml", tmp_path / "s.db"
    drop.write_text(f"name: nogrid\nmodel: {qwen3}\ndevice: NVIDIA GeForce RTX 3090\nengine_version: '0.10.0'\n"
                    "candidates: {gpu_memory_utilization: [0.9]}\n")
    rc, _out, err = _cli("profile", str(drop), "--db", str(db), "--quiet")
    assert rc == 0, err
    rc, out, err = _cli("explain", str(drop), "--no-variants", "--quiet", "--json", "--no-cache")
    live = json.loads(out)["explanations"]
    rc, out, err = _cli("explain", "--run", "1", "--db", str(db), "--json")
    assert rc == 0, err
    stored = json.loads(out)["explanations"]
    assert [e["max_model_len"] for e in stored] == [e["max_model_len"] for e in live] and len(live) == 1
    assert stored[0]["max_model_len"] > 16 and stored[0]["num_gpu_blocks"] == live[0]["num_gpu_blocks"]

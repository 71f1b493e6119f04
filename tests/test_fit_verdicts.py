"""vLLM's verdict (``starts``) next to the drop's (``fits``), the derived maximum length, the
explanation of stored (imported) start-ups, the safety reserve step and the resolved model path —
on the example drops, the shared model configs and a real vLLM 0.19 start-up log."""

from __future__ import annotations

import json

import pytest

from tests._results_db import H100_DROP, cached_worker, using_cached_worker
from tests.conftest import REPO
from tuner.jobs.app import profile
from tuner.memory.budget import unexplained_bytes
from tuner.commands.profile import render_table, to_json
from tuner.memory.eras import era_for
from tuner.reports.explain import explain_drop, explain_stored, render, steps_add_up
from tuner.jobs.job import run_job
from tuner.logs.logparse import GIB
from tuner.memory.search import derived_max_model_len

MIB = 1 << 20
TP4_DROP = REPO / "configs" / "examples" / "llama-3.1-70b-h100-tp4.yaml"
LLAMA8B_DIR = REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"
LLAMA = "llmd-v019-meta-llama-llama-3-1-8b--tp1pp1dp1--8192"


def _in_process(request, **_kw):
    return run_job(request)


def _step(e, name):
    return next(s for s in e["steps"] if s["name"] == name)


# -- 1. lengths above the model's derived maximum ---------------------------------------------------

def test_derived_max_model_len_follows_vllm(shared_dir):
    def cfg(name):
        c = json.loads((shared_dir / "models" / name / "config.json").read_text())
        return c.get("text_config") or c

    # Llama 3.1: rope_type llama3 is not scaled (vllm _get_and_verify_max_len)
    assert derived_max_model_len(cfg("meta-llama--Llama-3.1-8B-Instruct")) == (131072, "max_position_embeddings")
    # yarn: original_max_position_embeddings (4096) x factor (40)
    assert derived_max_model_len(cfg("deepseek-ai--DeepSeek-V3"))[0] == 4096 * 40
    # linear / dynamic scale max_position_embeddings by the factor; the smallest length key wins
    assert derived_max_model_len({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4}}) \
        == (16384, "max_position_embeddings")
    assert derived_max_model_len({"max_position_embeddings": 32768, "seq_length": 8192}) == (8192, "seq_length")
    assert derived_max_model_len({}) == (2048, "default")


def test_length_above_the_derived_maximum_does_not_start(shared_dir):
    from tuner.question.drop import load_drop

    d = load_drop(H100_DROP).to_dict()
    d["candidates"] = {"gpu_memory_utilization": [0.95], "max_model_len": [131072, 200000]}
    r = run_job({"drop": d, "config_path": str(shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct" / "config.json"),
                 "device": {"name": "H100-80GB", "total_memory_bytes": 85030076416}})
    by_m = {c["max_model_len"]: c for c in r["candidates"]}
    assert by_m[131072]["starts"] and by_m[131072]["fits"]
    c = by_m[200000]
    assert c["starts"] is False and c["fits"] is False
    # vLLM's wording; the KV budget alone would hold 2.37 requests of 200000 tokens
    assert c["reason"].startswith("User-specified max_model_len (200000) is greater than the derived max_model_len "
                                  "(max_position_embeddings=131072 or model_max_length=None in model's config.json).")
    assert c["kv_cache_tokens"] > 200000
    assert r["proposals"][0]["max_model_len"] == 131072


YARN_X4 = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}


def test_hf_overrides_rope_scaling_raises_the_proposal_cap(shared_dir, tmp_path):
    """A yarn x4 ``hf_overrides`` on Qwen2.5-7B (max_position_embeddings 32768): vLLM derives
    131072 after applying it. The candidate rows knew; the proposal was capped at 32768 "by the
    model's max_position_embeddings", its serve line dropped --hf-overrides, and explain without
    -m explained 32768."""
    from tuner.question.drop import parse_drop

    model = shared_dir / "models" / "Qwen--Qwen2.5-7B-Instruct"
    text = (f"name: qwen-yarn\nmodel: {model}\ndevice: H100-80GB\nengine_version: '0.19.0'\n"
            "hf_overrides: {rope_scaling: {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}}\n"
            "candidates: {gpu_memory_utilization: [0.9], max_model_len: [32768, 65536, 131072, 200000]}\n")
    d = parse_drop(text, "qwen-yarn.yaml").to_dict()
    r = run_job({"drop": d, "config_path": str(model / "config.json"),
                 "device": {"name": "H100-80GB", "total_memory_bytes": 85030076416}})
    by_m = {c["max_model_len"]: c for c in r["candidates"]}
    assert by_m[65536]["starts"] and by_m[131072]["starts"]
    assert by_m[200000]["starts"] is False and "(max_position_embeddings=131072 " in by_m[200000]["reason"]
    p = r["proposals"][0]
    assert 32768 < p["max_model_len"] <= 131072
    assert p["max_model_len"] == 131072 and p["num_gpu_blocks"] == by_m[131072]["num_gpu_blocks"]
    assert p["reason"] == "capped by the model's derived max_model_len (max_position_embeddings=131072)"
    assert f"--hf-overrides '{json.dumps(YARN_X4, sort_keys=True)}'" in p["vllm_args"]
    # explain without -m explains the proposal's length, not 32768
    drop_file = tmp_path / "qwen-yarn.yaml"
    drop_file.write_text(text)
    doc = explain_drop(str(drop_file), gpu_memory_utilization=0.9, variants=False, db_url=str(tmp_path / "none.sqlite"),
                       worker=_in_process)
    assert doc["explanations"][0]["max_model_len"] == 131072


def test_explain_of_a_length_above_the_derived_maximum():
    with using_cached_worker():
        doc = explain_drop(str(H100_DROP), gpu_memory_utilization=0.95, max_model_len=200000, variants=False,
                           db_url="/nonexistent/none.sqlite")
    e = doc["explanations"][0]
    assert e["starts"] is False and e["fits"] is False and e["max_len_refused"]
    text = render(doc)
    assert "max_model_len 200000: does NOT start" in text
    assert "vLLM: User-specified max_model_len (200000) is greater than the derived max_model_len" in text
    assert e["remedies"]["gpu_memory_utilization"] is None  # no memory setting helps
    surf = {p["max_model_len"]: p for p in e["surface"]}
    assert surf[200000]["starts"] is False and surf[131072]["starts"] is True


# -- 2. starts, but misses min_concurrency ---------------------------------------------------------

def test_starts_and_fits_are_both_reported(tmp_path):
    out = profile(str(TP4_DROP), db_url=str(tmp_path / "db.sqlite"), worker=cached_worker)
    by = {(c["gpu_memory_utilization"], c["max_model_len"]): c for c in out.result["candidates"]}
    c = by[(0.9, 114688)]
    # 28,067 blocks hold 3.92 requests of 114688 tokens: vLLM starts, min_concurrency 4 is missed
    # (27,963 / 3.90 before §24's reserve refit: 0.1 % of the weights instead of 0.56 %)
    assert c["num_gpu_blocks"] == 28067 and c["max_concurrency"] == pytest.approx(3.92, abs=0.01)
    assert c["starts"] is True and c["fits"] is False and c["reason"].startswith("only 3.92 requests")
    assert by[(0.9, 98304)]["starts"] and by[(0.9, 98304)]["fits"]
    table = render_table(out)
    assert "starts  ok" in table
    row = next(x for x in table.splitlines() if x.startswith(" 0.90        114688"))
    assert row.split()[3:5] == ["yes", "NO"]
    doc = to_json(out)
    jc = next(x for x in doc["candidates"] if (x["gpu_memory_utilization"], x["max_model_len"]) == (0.9, 114688))
    assert (jc["starts"], jc["fits"]) == (True, False)
    assert list(jc)[list(jc).index("fits") + 1] == "starts"


def test_explain_says_starts_but_too_few_requests():
    with using_cached_worker():
        doc = explain_drop(str(TP4_DROP), gpu_memory_utilization=0.9, max_model_len=114688, variants=False,
                           db_url="/nonexistent/none.sqlite")
    e = doc["explanations"][0]
    assert e["starts"] is True and e["fits"] is False
    text = render(doc)
    assert "max_model_len 114688: starts, but fewer than min_concurrency (4) full-length requests fit" in text
    assert "constraint: only 3.92 requests of 114688 tokens fit; min_concurrency is 4" in text  # 3.90 before §24
    assert "what would make max_model_len 114688 meet min_concurrency 4" in text


# -- 3. explain --run of an imported log -----------------------------------------------------------

def test_explain_of_an_imported_log_adds_up(tmp_path, shared_dir, observed_cases):
    from tuner.accuracy.importlog import import_log
    from tuner.store.database import open_store

    case = observed_cases[LLAMA]
    log = tmp_path / "engine.log"
    log.write_text("\n".join(case["raw_lines"]) + "\n")
    store = open_store(str(tmp_path / "db.sqlite"))
    try:
        out = import_log(log, model=case["model"], device="H100-80GB", store=store, engine_version="0.19.0",
                         models_dir=shared_dir / "models", options={"gpu_memory_utilization": 0.95},
                         worker=_in_process)
        run_id = store.runs_for_drop(out.drop_id)[0]["id"]
        doc = explain_stored(store, run_id)
    finally:
        store.close()
    e = doc["explanations"][0]
    obs = case["observed"]
    # 0.19 captures CUDA graphs after sizing the cache: the logged 0.91 GiB is shown, not subtracted
    g = _step(e, "cuda_graphs")
    assert g["op"] == "info" and g["bytes"] == round(obs["cuda_graph_gib"] * GIB)
    # the lines add up to the logged KV bytes (the log's 2-decimal rounding is its own step)
    assert steps_add_up(e["steps"]) == _step(e, "available_kv")["bytes"] == round(obs["kv_cache_gib"] * GIB)
    assert abs(_step(e, "rounding")["bytes"]) < 0.01 * GIB
    # no block count in a 0.19 log: blocks from the KV tokens, bytes per block inferred (approximate)
    b = _step(e, "blocks")
    assert b["value"] == obs["kv_cache_tokens"] // 16 == obs["num_gpu_blocks"] == 29751 and b["approximate"]
    assert abs(b["block_bytes"] - 2 * 32 * 8 * 128 * 2 * 16) / (2 * 32 * 8 * 128 * 2 * 16) < 0.001
    assert _step(e, "concurrency")["value"] == obs["max_concurrency"] == 58.11
    text = render(doc)
    assert "- 0.91 GiB" not in text and "0.91 GiB  (977,105,060 bytes; not subtracted)" in text
    assert "= ~29751" in text and "= 0\n" not in text


# -- 4. the safety reserve, the cuBLAS workspace and the profile run, each its own step -------------

def test_explain_names_the_safety_reserve():
    with using_cached_worker():
        doc = explain_drop(str(H100_DROP), gpu_memory_utilization=0.95, max_model_len=8192, variants=False,
                           db_url="/nonexistent/none.sqlite")
    e = doc["explanations"][0]
    w = e["weights_bytes"]
    reserve = _step(e, "safety_reserve")
    act0 = _step(e, "activation_peak")["bytes"] + 32 * MIB  # simulated passes + the cuBLAS workspace
    assert reserve["bytes"] == e["reserve_bytes"] == unexplained_bytes(era_for("0.19.0"), w, act0)
    # §24: 0.1 % of the weights (0.56 % before the allocator rounding of V1 weights was derived)
    assert reserve["bytes"] == int(0.001 * w + 0.005 * act0) and reserve["bytes"] <= 176 * MIB
    assert _step(e, "cublas_workspace")["bytes"] == 32 * MIB  # Hopper
    assert (_step(e, "activation_peak")["bytes"] + 32 * MIB + reserve["bytes"]) == e["activation_peak_bytes"]
    assert steps_add_up(e["steps"]) == e["available_kv_cache_bytes"]
    assert e["available_kv_cache_bytes"] // e["kv_block_bytes"] == e["num_gpu_blocks"] == 29742  # 29707 before §24
    assert "safety reserve for start-up memory no term explains, see docs/prediction.md" in render(doc)


# -- 5. the vllm serve command names the resolved model directory -----------------------------------

def test_serve_command_uses_the_resolved_model_directory(tmp_path):
    out = profile(str(H100_DROP), db_url=str(tmp_path / "db.sqlite"), worker=cached_worker)
    table = render_table(out)
    assert "vllm serve ../" not in table
    assert f"vllm serve {LLAMA8B_DIR} --max-model-len 131072 --gpu-memory-utilization 0.95" in table
    assert (LLAMA8B_DIR / "config.json").is_file()
    doc = to_json(out)
    assert doc["model_path"] == str(LLAMA8B_DIR)
    assert doc["proposals"][-1]["command"].startswith(f"vllm serve {LLAMA8B_DIR} --max-model-len 131072")
    with using_cached_worker():
        ex = explain_drop(str(H100_DROP), variants=False, db_url="/nonexistent/none.sqlite")
    assert ex["model"] == str(LLAMA8B_DIR)
    text = render(ex)
    assert f"explain llama-3.1-8b-h100: {LLAMA8B_DIR} on H100-80GB" in text
    assert f"  vllm serve {LLAMA8B_DIR} --max-model-len 131072 --gpu-memory-utilization 0.95" in text


def test_serve_model_keeps_hf_ids(tmp_path):
    from tuner.jobs.app import serve_model
    from tuner.question.drop import load_drop

    p = tmp_path / "d.yaml"
    p.write_text("name: d\nmodel: meta-llama/Llama-3.1-8B-Instruct\ndevice: H100-80GB\n"
                 "candidates: {gpu_memory_utilization: [0.9]}\n")
    assert serve_model(load_drop(p)) == "meta-llama/Llama-3.1-8B-Instruct"
    p.write_text(f"name: d\nmodel: {LLAMA8B_DIR / 'config.json'}\ndevice: H100-80GB\n"
                 "candidates: {gpu_memory_utilization: [0.9]}\n")
    assert serve_model(load_drop(p)) == str(LLAMA8B_DIR)


def test_sliding_window_candidate_reserves_the_async_batches_in_flight_from_0_26():
    """0.26+ sliding-window layers hold ``max_in_flight_tokens`` = 2 · N (async scheduling, on by
    default on GPUs, V1 runner, pp 1; pp + 1 under Model Runner V2), not N (found by the engine
    tier's differential test against vLLM 0.32.0, dated 0.26 by the release-by-release audit:
    ``VllmConfig.max_in_flight_tokens`` first appears in 0.26.0): fewer full-length requests fit.
    0.25.1 keeps N."""
    from tuner.memory import kvcache
    from tuner.memory.eras import ProfileBatch
    from tuner.memory.search import Layout, evaluate

    specs = {f"l{i}": (kvcache.SlidingWindowSpec(16, 8, 128, 2, 4096) if i % 2 else kvcache.FullAttentionSpec(16, 8, 128, 2))
             for i in range(8)}
    passes = [{"weights_bytes": 10 * GIB, "activation_peak_bytes": GIB}]
    batch = ProfileBatch(8192, 256, 256, True)

    def candidate(version, runner_v2=False):
        layout = Layout(80 * GIB, 16, 1, 1, 8, 131072, (specs,), model_runner_v2=runner_v2)
        return evaluate(era_for(version), layout, batch, passes, gpu_memory_utilization=0.9, max_model_len=32768)

    for version, runner_v2, batches in (("0.32.0", False, 2), ("0.32.0", True, 2), ("0.30.0", False, 2),
                                        ("0.25.1", False, 1)):
        c = candidate(version, runner_v2)
        sw_pages = -(-(4095 + batches * 8192) // 16) + 1  # cdiv(w − 1 + in-flight, bs) + 1
        assert c.max_concurrency == pytest.approx(c.num_gpu_blocks / (2048 + sw_pages)), (version, runner_v2)


def test_hybrid_proposal_reaches_the_model_maximum_between_block_multiples(shared_dir):
    """Nemotron-H-56B-Base-8K on TP2 H100 (0.19): its attention block is 2080 tokens (hybrid page
    alignment), so the block multiples stop at 6240 below max_position_embeddings 8192. 8192
    starts (same blocks: a length inside a block costs the whole block), yet the proposal was
    6240 "capped by the model's max_position_embeddings"."""
    from tuner.question.drop import parse_drop

    model = shared_dir / "models" / "nvidia--Nemotron-H-56B-Base-8K"
    text = (f"name: nem\nmodel: {model}\ndevice: H100-80GB\nengine_version: '0.19.0'\n"
            "tensor_parallel_size: 2\ncandidates: {gpu_memory_utilization: [0.9], max_model_len: [6240, 8192]}\n")
    d = parse_drop(text, "nem.yaml").to_dict()
    r = run_job({"drop": d, "config_path": str(model / "config.json"),
                 "device": {"name": "H100-80GB", "total_memory_bytes": 85030076416}})
    by_m = {c["max_model_len"]: c for c in r["candidates"]}
    assert by_m[8192]["starts"] and by_m[8192]["num_gpu_blocks"] == by_m[6240]["num_gpu_blocks"] > 0
    p = r["proposals"][0]
    assert p["max_model_len"] == 8192 and p["num_gpu_blocks"] == by_m[8192]["num_gpu_blocks"]
    assert p["reason"] == "capped by the model's max_position_embeddings"
    assert "--max-model-len 8192 " in p["vllm_args"]


def _explain_tp2_h100(model, version: str, tmp_path) -> dict:
    """explain's (first) explanation of ``model`` on two H100s at u 0.9, passes run in-process."""
    drop_file = tmp_path / "tp2.yaml"
    drop_file.write_text(f"name: tp2\nmodel: {model}\ndevice: H100-80GB\nengine_version: '{version}'\n"
                         "tensor_parallel_size: 2\ncandidates: {gpu_memory_utilization: [0.9]}\n")
    doc = explain_drop(str(drop_file), gpu_memory_utilization=0.9, variants=False, db_url=str(tmp_path / "s.sqlite"),
                       worker=_in_process)
    return doc["explanations"][0]


def test_explain_of_a_hybrid_model_printed_a_division_that_did_not_divide(shared_dir, tmp_path):
    """Nemotron-H-56B-8K TP2 H100 0.19 at 8192: explain printed "367 blocks / cdiv(8192, 2080) =
    367 / 4 = 36.7" (the divisor used is 10: every KV cache group's pages) and "KV cache tokens =
    int(concurrency x max_model_len)" for 0.19's num_blocks // groups x block_size."""
    e = _explain_tp2_h100(shared_dir / "models" / "nvidia--Nemotron-H-56B-Base-8K", "0.19.0", tmp_path)
    assert e["max_model_len"] == 8192
    tokens, conc = _step(e, "tokens"), _step(e, "concurrency")
    # 370 blocks since §24's reserve refit (367 before); the texts are the same division
    assert tokens["value"] == 108160 and "370 blocks // 7 KV cache groups x 2080 tokens" in tokens["text"]
    assert 370 // 7 * 2080 == 108160
    assert conc["text"].startswith("full-length requests that fit = 370 blocks / 10 blocks per full-length request")
    assert abs(conc["value"] - 37.0) < 1e-9


def test_explain_tokens_step_printed_a_rounded_concurrency_that_missed_the_value(shared_dir, tmp_path):
    """From 0.22 "GPU KV cache size" is int(max_concurrency x max_model_len) at full precision;
    explain printed "int(4.7574 x 262144) = 1247122" (Qwen3.5-27B TP2 0.24), which evaluates to
    1247123. It prints the division vLLM does, and the text evaluates to the value."""
    import re

    tokens = _step(_explain_tp2_h100(shared_dir / "models" / "Qwen--Qwen3.5-27B", "0.24.0", tmp_path), "tokens")
    m = re.search(r"int\((\d+) / (\d+) blocks per request x (\d+)\)", tokens["text"])
    assert m, tokens["text"]
    blocks, per_req, length = map(int, m.groups())
    assert (blocks, per_req, length) == (1610, 338, 262144)  # 1608 before §24's reserve refit
    assert int(blocks / per_req * length) == tokens["value"] == 1248674

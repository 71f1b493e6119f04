"""``ctx-tuner explain``: the budget step by step, with numbers that add up, on the example drops."""

from __future__ import annotations

import json
import math

import pytest

from tests._results_db import H100_DROP, V0_DROP, profiled_db, using_cached_worker
from tests._cli_helpers import run_cli as _cli
from tuner.memory.eras import era_for
from tuner.reports.explain import blocks_needed, render, render_point, steps_add_up, u_needed, u_needed_safe

GiB = 1 << 30
LLAMA8B_BLOCK_BYTES = 2 * 32 * 8 * 128 * 2 * 16  # K and V x 32 layers x 8 KV heads x head 128 x bf16 x 16 tokens




@pytest.fixture(scope="module", autouse=True)
def _jobs_once():
    """Worker jobs shared with the other result tests (profile first, so explain reuses its job)."""
    profiled_db()
    with using_cached_worker():
        yield


@pytest.fixture(scope="module")
def v0_29k():
    """explain of the seed failure: Llama-3.1-8B, RTX 3090, vLLM 0.6.4, gmu 0.9, max_model_len 29000."""
    rc, out, err = _cli("explain", str(V0_DROP), "--max-model-len", "29000", "--json", "--progress")
    assert rc == 3, err  # does NOT start: check's exit code
    assert "[1/" in err  # progress lines on stderr
    doc = json.loads(out)
    assert len(doc["explanations"]) == 1
    return doc["explanations"][0]


def _step(e, name):
    return next(s for s in e["steps"] if s["name"] == name)


def test_budget_steps_add_up(v0_29k):
    e = v0_29k
    total = e["total_memory_bytes"]
    assert total == 25_318_916_096 and e["gpu_memory_utilization"] == 0.9 and e["max_model_len"] == 29000
    # requested = total x u exactly (V0 0.6.4 truncates to int)
    assert _step(e, "requested")["bytes"] == e["requested_memory_bytes"] == int(total * 0.9)
    terms = {s["name"]: s["bytes"] for s in e["steps"] if "bytes" in s}
    # the activation term is the simulated profile run plus the cuBLAS workspace (8 MiB + 128 KiB
    # before Hopper); V0 keeps no safety reserve and nothing is calibrated here
    assert terms["cublas_workspace"] == 4096 * 2 * 1024 + 16 * 8 * 1024
    assert "safety_reserve" not in terms and "calibration" not in terms and e["reserve_bytes"] == 0
    assert terms["activation_peak"] + terms["cublas_workspace"] == e["activation_peak_bytes"]
    assert terms["available_kv"] == (terms["requested"] - terms["weights"] - terms["activation_peak"]
                                     - terms["cublas_workspace"] - terms["non_torch"])
    assert terms["available_kv"] == steps_add_up(e["steps"]) == e["available_kv_cache_bytes"] > 0
    # this era reserves no graph memory before sizing the cache: shown, not subtracted
    assert terms["cuda_graphs"] == 0 and _step(e, "cuda_graphs")["op"] == "info"
    assert abs(terms["weights"] / GiB - 14.99) < 0.01
    # blocks = KV bytes // bytes per block; tokens = blocks x 16; concurrency = tokens / M
    assert e["kv_block_bytes"] == LLAMA8B_BLOCK_BYTES
    assert _step(e, "blocks")["value"] == e["num_gpu_blocks"] == e["available_kv_cache_bytes"] // LLAMA8B_BLOCK_BYTES
    assert _step(e, "tokens")["value"] == e["kv_cache_tokens"] == e["num_gpu_blocks"] * 16
    assert _step(e, "concurrency")["value"] == pytest.approx(e["kv_cache_tokens"] / 29000, abs=1e-4)
    # the engine refused 29000 with 23,648 tokens (vllm-project/vllm#10517)
    assert abs(e["kv_cache_tokens"] - 23648) / 23648 < 0.05
    assert e["fits"] is False and "larger than the maximum number of tokens" in e["reason"]


def test_activation_peak_is_explained_by_the_profile_batch(v0_29k):
    e = v0_29k
    act = _step(e, "activation_peak")
    # V0 without chunked prefill: N = max(M, 2048) tokens over R = 256 requests
    assert e["max_num_batched_tokens"] == 29000 and e["num_reqs"] == 256 and e["vocab_size"] == 128256
    assert e["forward_peak_bytes"] <= e["activation_peak_bytes"]
    assert act["bytes"] + _step(e, "cublas_workspace")["bytes"] == e["activation_peak_bytes"]
    detail = "\n".join(act["detail"])
    assert "N = max(max_model_len, 2048) = 29000" in detail
    assert "[29000 x 28672]" in detail  # the MLP's fused gate_up output over N tokens
    assert "256 x 128256 fp32 logits" in detail  # the sampler over R x vocab
    # the gate_up output alone is more than half the forward peak
    assert 29000 * 28672 * 2 > e["forward_peak_bytes"] / 2


def test_non_monotone_surface_is_shown(v0_29k):
    e = v0_29k
    by_m = {p["max_model_len"]: p for p in e["surface"]}
    assert [by_m[m]["fits"] for m in (20000, 29000, 35000)] == [True, False, True]
    assert by_m[35000]["max_num_batched_tokens"] == 512  # chunked prefill above 32768 shrinks the batch
    assert e["non_monotone"] is True
    text = render({"explanations": [e], "device": e["device"], "drop": e["drop"], "model": e["model"], "era": e["era"]})
    assert "not monotone" in text and "does NOT start" in text


def test_remedies_for_a_point_that_does_not_start(v0_29k):
    e = v0_29k
    rem = e["remedies"]
    # the largest max_model_len at this u lies above 32768 (the other region of the surface)
    largest = rem["largest_max_model_len"]["max_model_len"]
    assert largest > 35000 and largest % 16 == 0
    # u needed: arithmetic on the budget terms, then checked by a worker job
    un = rem["gpu_memory_utilization"]
    need_blocks = math.ceil(29000 / 16)
    assert un["blocks"] == need_blocks
    fixed = e["weights_bytes"] + e["activation_peak_bytes"] + e["non_torch_bytes"] + e["cuda_graph_bytes"]
    assert un["needed_requested_bytes"] == need_blocks * LLAMA8B_BLOCK_BYTES + fixed
    assert 0.9 < un["value"] < 1.0 and un["possible"]
    total = e["total_memory_bytes"]
    assert int(total * un["value"]) >= un["needed_requested_bytes"] > int(total * (un["value"] - 0.001))
    assert un["verified"]["fits"] is True and un["verified"]["kv_cache_tokens"] >= 29000
    # fp8 KV halves the bytes per token: the same budget holds about twice the blocks
    fp8 = rem["fp8_kv_cache"]
    assert fp8["fits"] is True and fp8["kv_cache_tokens"] >= 29000
    assert fp8["num_gpu_blocks"] >= 2 * e["num_gpu_blocks"] * 0.95
    tp = rem["tensor_parallel"]
    assert tp["tensor_parallel_size"] == 2 and tp["fits"] is True and tp["kv_cache_tokens"] > fp8["kv_cache_tokens"]


def test_explain_u_remedy_was_expected_value_based_at_risk_safe(v0_29k):
    """F4: explain's ``gpu_memory_utilization >= 0.928 … starts`` was the expected value's; at risk safe
    (the default) it leads with the value whose interval's safe end starts (0.94, re-checked)."""
    un = v0_29k["remedies"]["gpu_memory_utilization"]
    assert un["risk"] == "safe" and un["value"] == pytest.approx(0.928)
    safe = un["safe"]
    assert safe["value"] == pytest.approx(0.94) and safe["possible"]
    assert safe["verified"]["fits_low"] is True and safe["verified"]["kv_cache_tokens_low"] == 29056
    line = next(t for t in render_point(v0_29k).splitlines() if "gpu_memory_utilization >=" in t)
    assert line.startswith("    - gpu_memory_utilization >= 0.940 at the interval's safe end (0.928 at the expected "
                           "value)")
    assert line.endswith("checked: starts at the safe end with 29056 KV tokens (31376 at the expected value)")


def test_u_needed_safe_covers_the_bands():
    era = era_for("0.19.0")
    bands = [{"name": "requested", "bytes": 40 * GiB, "low_bytes": 39 * GiB, "high_bytes": 41 * GiB, "op": "="},
             {"name": "weights", "bytes": 20 * GiB, "low_bytes": 19 * GiB, "high_bytes": 21 * GiB, "op": "-"}]
    kw = dict(total_memory_bytes=80 * GiB, fixed_bytes=20 * GiB, block_bytes=2 * 1024 * 1024,
              blocks=blocks_needed(era, 131072, 16))
    out = u_needed_safe(era, **kw, bands=bands, requested_bytes=40 * GiB)
    # low KV = req - 20 GiB - 1 GiB (weights' high end) - req/40 (the request's 2.5 % low end) >= 16 GiB
    req = math.ceil(80 * GiB * out["value"])
    assert req * (1 - 1 / 40) - 21 * GiB >= 16 * GiB
    req_below = math.ceil(80 * GiB * (out["value"] - 0.001))
    assert req_below * (1 - 1 / 40) - 21 * GiB < 16 * GiB
    assert out["value"] > u_needed(era, **kw)["value"]


def test_u_needed_arithmetic_is_exact():
    era = era_for("0.19.0")  # requested rounds up from 0.14
    out = u_needed(era, total_memory_bytes=80 * GiB, fixed_bytes=20 * GiB, block_bytes=2 * 1024 * 1024,
                   blocks=blocks_needed(era, 131072, 16))
    assert out["blocks"] == 8192 and out["needed_available_kv_bytes"] == 16 * GiB
    assert out["value"] == 0.45 and math.ceil(80 * GiB * 0.45) >= 36 * GiB
    assert blocks_needed(era_for("0.30.0"), 131072, 16) == 8193  # 0.30+: the null block is planned out
    assert blocks_needed(era, 4096, 16, min_concurrency=4) == 1024


def test_a_point_that_starts_text_and_json():
    # no -u / -m: each of the drop's u at its proposal (on the drop's grid: no extra job)
    rc, out, err = _cli("explain", str(H100_DROP), "--quiet")
    assert rc == 0, err
    assert "gpu_memory_utilization 0.95, max_model_len 131072: starts" in out
    assert "1. requested = total 79.19 GiB x gpu_memory_utilization 0.95 (ceil, bytes)" in out
    assert "what would make" not in out
    line = [x for x in out.splitlines() if ". blocks = " in x][-1]
    blocks = int(line.rsplit("= ", 1)[1])
    assert abs(blocks - 29751) / 29751 < 0.02  # the engine logged 29,751 blocks at 0.95
    rc, out, _ = _cli("explain", str(H100_DROP), "--quiet", "--json")
    doc = json.loads(out)
    assert [e["gpu_memory_utilization"] for e in doc["explanations"]] == [0.8, 0.9, 0.95]
    for e in doc["explanations"]:
        assert e["fits"] and e["max_model_len"] == 131072 and e["remedies"] is None
        assert e["requested_memory_bytes"] == math.ceil(e["total_memory_bytes"] * e["gpu_memory_utilization"])
        assert e["num_gpu_blocks"] == e["available_kv_cache_bytes"] // e["kv_block_bytes"]
        assert e["kv_block_bytes"] == LLAMA8B_BLOCK_BYTES
    assert doc["explanations"][-1]["num_gpu_blocks"] == blocks


def test_explain_stored_run_without_rerunning(v0_29k):
    import sqlite3

    db = profiled_db()
    con = sqlite3.connect(db)
    run_id, = con.execute("SELECT c.profile_run_id FROM candidates c JOIN drops d ON d.id = c.drop_id "
                          "WHERE d.name = 'llama-3.1-8b-rtx3090-v0' AND c.max_model_len = 29000").fetchone()
    cand = con.execute("SELECT requested_memory_bytes, available_kv_cache_bytes, num_gpu_blocks, kv_cache_tokens "
                       "FROM candidates WHERE profile_run_id = ? AND max_model_len = 29000", (run_id,)).fetchone()
    measured_id, = con.execute("SELECT id FROM profile_runs WHERE method = 'import'").fetchone()
    con.close()
    rc, out, err = _cli("explain", "--run", str(run_id), "-m", "29000", "--db", str(db), "--json")
    assert rc == 3, err
    e = json.loads(out)["explanations"][0]
    assert (e["requested_memory_bytes"], e["available_kv_cache_bytes"], e["num_gpu_blocks"], e["kv_cache_tokens"]) == cand
    assert e["run_id"] == run_id and e["fits"] is False
    assert e["steps"][-3]["block_bytes_exact"] is False  # inferred from the stored rows
    # the stored row's activation term is split as a fresh one is, and the steps still add up
    assert _step(e, "cublas_workspace")["bytes"] == 4096 * 2 * 1024 + 16 * 8 * 1024
    assert steps_add_up(e["steps"]) == e["available_kv_cache_bytes"]
    assert abs(e["kv_block_bytes"] - LLAMA8B_BLOCK_BYTES) / LLAMA8B_BLOCK_BYTES < 0.001
    # a measured (imported) start-up is explained from its own columns
    rc, out, err = _cli("explain", "--run", str(measured_id), "--db", str(db))
    assert rc == 3, err
    assert "does NOT start (stored run" in out and "= 1478" in out and "23648" in out


def test_explain_exited_0_when_its_verdict_was_does_not_start():
    """explain's exit code is check's: 0 every explained point starts, 3 one does not (it was 0)."""
    rc, out, err = _cli("explain", str(V0_DROP), "--max-model-len", "29000", "--no-variants", "--quiet")
    assert rc == 3, err
    assert "max_model_len 29000: does NOT start" in out
    rc, out, err = _cli("explain", str(V0_DROP), "--max-model-len", "20000", "--no-variants", "--quiet")
    assert rc == 0, err
    assert "max_model_len 20000: starts" in out


def test_explain_kv_cache_memory_bytes_showed_a_difference_not_attributed_to_a_term(tmp_path):
    """With kv_cache_memory_bytes the KV cache is the given bytes (gpu_worker.py
    determine_available_memory): explain subtracted a 34 GiB "difference not attributed to a term"
    from total x u and offered a gpu_memory_utilization that changes nothing."""
    from tests.conftest import REPO

    model = REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"
    drop = tmp_path / "kv.yaml"
    drop.write_text(f"name: kv\nmodel: {model}\ndevice: H100-80GB\nkv_cache_memory_bytes: 1G\nengine_version: \"0.19.0\"\n"
                    "candidates: {gpu_memory_utilization: [0.9]}\n")
    rc, out, err = _cli("explain", str(drop), "-m", "32k", "--no-variants", "--quiet", "--json",
                        "--db", str(tmp_path / "r.sqlite"))
    assert rc == 3, err
    e = json.loads(out)["explanations"][0]
    assert e["available_kv_cache_bytes"] == 1 << 30 and e["num_gpu_blocks"] == (1 << 30) // LLAMA8B_BLOCK_BYTES == 512
    assert e["formula_text"].startswith("kv_cache_memory_bytes: the KV cache is the given bytes")
    names = [s["name"] for s in e["steps"]]
    assert "rounding" not in names and "kv_cache_memory_bytes" in names
    assert steps_add_up(e["steps"]) == e["available_kv_cache_bytes"]
    assert e["remedies"]["gpu_memory_utilization"] is None
    text = render(json.loads(out))
    assert "difference not attributed to a term" not in text and "gpu_memory_utilization >=" not in text
    assert "the rest of total x u, not used: kv_cache_memory_bytes fixes the KV cache" in text
    assert "KV cache bytes (kv_cache_memory_bytes, as given)" in text


@pytest.mark.parametrize("argv, code", [
    (["explain"], 2),
    (["explain", "x.yaml", "--run", "1"], 2),
    (["explain", "x.yaml", "-u", "1.5"], 2),
    (["explain", "x.yaml", "-m", "0"], 2),
    (["explain", "x.yaml", "--quiet", "--progress"], 2),
    (["explain", "/nonexistent/drop.yaml"], 2),
])
def test_usage_errors_exit_2(argv, code):
    rc, _, err = _cli(*argv)
    assert rc == code and err


def test_unknown_run_id_exits_2():
    rc, _, err = _cli("explain", "--run", "999999", "--db", str(profiled_db()))
    assert rc == 2 and "no profile run with id 999999" in err



def test_explain_symmetric_memory_info_step_not_subtracted(tmp_path):
    """Llama-3.1-70B, four H100s, vLLM 0.19: the symmetric-memory buffer (allocated before the
    start-up snapshot from 0.11 on) is an ``info`` step, yet explain carved its 34 MiB out of the
    non-torch step (232,783,872 B instead of the 0.25 GiB the budget charges) and showed them again
    as a "difference not attributed to a term"."""
    from tests.conftest import REPO

    drop = REPO / "configs" / "examples" / "llama-3.1-70b-h100-tp4.yaml"
    rc, out, err = _cli("explain", str(drop), "-m", "32k", "-u", "0.9", "--no-variants", "--quiet", "--json",
                        "--db", str(tmp_path / "r.sqlite"))
    assert rc in (0, 3), err
    e = json.loads(out)["explanations"][0]
    comm = {s["name"]: s for s in e["steps"] if s["name"] in ("nccl", "custom_all_reduce", "symmetric_memory")}
    assert comm["symmetric_memory"]["op"] == "info" and comm["symmetric_memory"]["bytes"] == 34 * (1 << 20)
    # non-torch (module loads) + NCCL = the budget's non-torch term; nothing left unattributed
    assert _step(e, "non_torch")["bytes"] == int(0.25 * GiB) == 268_435_456
    assert _step(e, "non_torch")["bytes"] + comm["nccl"]["bytes"] + comm["custom_all_reduce"]["bytes"] == \
        e["non_torch_bytes"]
    assert "rounding" not in [s["name"] for s in e["steps"]]
    assert steps_add_up(e["steps"]) == e["available_kv_cache_bytes"]

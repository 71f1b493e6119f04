"""The main job end to end: drop → worker subprocess → SQLite → proposal, and accuracy on the
real start-ups named in issue 2."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tuner.jobs.app import profile
from tuner.jobs.job import run_job
from tuner.question.drop import load_drop

GiB = 1 << 30


def _drop(tmp_path: Path, model_dir: Path, **over) -> Path:
    body = {
        "name": "t", "model": str(model_dir), "device": "H100-80GB", "engine_version": "0.19.0",
        "max_num_batched_tokens": 8192, "max_num_seqs": 1024,
        "candidates": {"gpu_memory_utilization": [0.95], "max_model_len": [2048, 8192]},
    }
    body.update(over)
    p = tmp_path / f"{body['name']}.yaml"
    import yaml

    p.write_text(yaml.safe_dump(body))
    return p


def _job(path: Path) -> dict:
    d = load_drop(path)
    dev = d.resolve_device()
    cfg = d.model_path() / "config.json"
    return run_job({"drop": d.to_dict(), "config_path": str(cfg),
                    "device": {"name": dev.name, "total_memory_bytes": dev.total_memory_bytes}})


def test_llama31_8b_h100_blocks_within_2pct(tmp_path, shared_dir, observed_cases):
    case = observed_cases["llmd-v019-meta-llama-llama-3-1-8b--tp1pp1dp1--8192"]
    r = _job(_drop(tmp_path, shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct"))
    c = [c for c in r["candidates"] if c["max_model_len"] == 8192][0]
    observed = case["observed"]["num_gpu_blocks"]
    assert observed == 29751
    assert abs(c["num_gpu_blocks"] - observed) / observed < 0.02
    assert abs(c["weights_bytes"] / GiB - case["observed"]["weights_gib"]) / case["observed"]["weights_gib"] < 0.005
    assert c["kv_cache_tokens"] == c["num_gpu_blocks"] * 16
    assert c["fits"]
    # every M up to the model's limit fits at 0.95: the proposal is max_position_embeddings
    assert r["proposals"][0]["max_model_len"] == 131072


def test_seed_failure_v0_rtx3090_is_reproduced(tmp_path, shared_dir, observed_cases):
    case = observed_cases["vllm-10517-rtx3090-llama31-8b-29k"]
    p = _drop(tmp_path, shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct", name="seed",
              device="RTX-3090", engine_version="0.6.4", max_num_batched_tokens=None, max_num_seqs=None,
              candidates={"gpu_memory_utilization": [0.9], "max_model_len": [20000, 29000, 35000]})
    r = _job(p)
    by_m = {c["max_model_len"]: c for c in r["candidates"]}
    assert by_m[20000]["fits"] is True
    assert by_m[29000]["fits"] is False
    assert "larger than the maximum number of tokens" in by_m[29000]["reason"]
    tokens = case["observed"]["kv_cache_tokens"]
    assert tokens == 23648
    assert abs(by_m[29000]["kv_cache_tokens"] - tokens) / tokens < 0.05
    # chunked prefill switches on above 32768 in this era: the profile batch shrinks and 35000 fits
    assert by_m[35000]["max_num_batched_tokens"] == 512
    assert by_m[35000]["fits"] is True
    # the proposal searched both regions and is a block multiple above 32768
    prop = r["proposals"][0]["max_model_len"]
    assert prop > 35000 and prop % 16 == 0


def test_min_concurrency_lowers_the_proposal(tmp_path, shared_dir):
    model = shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct"
    one = _job(_drop(tmp_path, model, name="c1", candidates={"gpu_memory_utilization": [0.5]}))
    four = _job(_drop(tmp_path, model, name="c4", candidates={"gpu_memory_utilization": [0.5]},
                      constraints={"min_concurrency": 4}))
    p1, p4 = one["proposals"][0], four["proposals"][0]
    assert p4["max_model_len"] < p1["max_model_len"]
    assert p4["max_concurrency"] >= 4
    blocks = p4["num_gpu_blocks"]
    # the largest block multiple with 4 full-length requests: 4·cdiv(M, 16) ≤ blocks (the expected
    # value; the proposal itself is taken at the interval's safe end, constraints.risk safe)
    assert p4["max_model_len_expected"] == (blocks // 4) * 16
    assert p4["risk"] == "safe" and p4["max_model_len"] == p4["max_model_len_safe"] <= p4["max_model_len_expected"]


def test_profile_command_end_to_end(tmp_path, tiny_config):
    """The CLI in a subprocess (as a user runs it): JSON out, rows in SQLite."""
    drop = _drop(tmp_path, tiny_config, name="tiny", max_num_batched_tokens=2048, max_num_seqs=64,
                 candidates={"gpu_memory_utilization": [0.1, 0.9], "max_model_len": [1024, 4096]})
    db = tmp_path / "out.sqlite"
    proc = subprocess.run([sys.executable, "-m", "tuner.cli", "profile", str(drop), "--db", f"sqlite:///{db}", "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["candidates"]) == 4
    assert {p["gpu_memory_utilization"] for p in out["proposals"]} == {0.1, 0.9}
    for c in out["candidates"]:
        assert {"gpu_memory_utilization", "max_model_len", "fits", "num_gpu_blocks", "kv_cache_tokens",
                "max_concurrency", "weights_bytes", "activation_peak_bytes", "available_kv_cache_bytes"} <= set(c)
    # the tiny model is limited by max_position_embeddings (4096), not memory
    assert all(p["max_model_len"] == 4096 for p in out["proposals"])
    con = sqlite3.connect(db)
    assert con.execute("select count(*) from drops").fetchone()[0] == 1
    runs = con.execute("select weights_bytes, activation_peak_bytes, method, era, max_num_batched_tokens "
                       "from profile_runs order by max_num_batched_tokens desc").fetchall()
    # one pass per distinct profile batch: N = 2048 for the grid, and smaller N = min(S·M, N)
    # for the tiny lengths the search probed (vLLM 0.12+)
    assert runs[0][2] == "simulate" and runs[0][3].startswith("V1 0.19.0") and runs[0][4] == 2048
    assert len(runs) == len(out["runs"]) >= 1
    assert runs[0][0] == out["runs"][0]["weights_bytes"]
    linked = con.execute("select count(*) from candidates c join profile_runs r on r.id = c.profile_run_id "
                         "where r.max_num_batched_tokens = 2048").fetchone()[0]
    assert linked == 4
    props = con.execute("select max_model_len, vllm_args from proposals order by gpu_memory_utilization").fetchall()
    assert props[0] == (4096, "--max-model-len 4096 --gpu-memory-utilization 0.1 --max-num-seqs 64 --max-num-batched-tokens 2048")
    assert con.execute("select count(*) from candidates").fetchone()[0] == 4


def test_invalid_drop_exits_2_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: nowhere/model\ndevice: H100-80GB\ncandidates: {gpu_memory_utilization: [1.5]}\n")
    db = tmp_path / "db.sqlite"
    proc = subprocess.run([sys.executable, "-m", "tuner.cli", "profile", str(bad), "--db", f"sqlite:///{db}"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert "candidates.gpu_memory_utilization" in proc.stderr and "bad.yaml" in proc.stderr
    assert not db.exists()


def test_missing_model_config_names_file_and_field(tmp_path):
    p = _drop(tmp_path, tmp_path / "no-such-model")
    from tuner.errors import DropError

    with pytest.raises(DropError) as e:
        profile(str(p), db_url=f"sqlite:///{tmp_path / 'x.sqlite'}")
    assert e.value.field == "model" and str(p) in str(e.value)
    assert not (tmp_path / "x.sqlite").exists()


def test_worker_failure_writes_nothing(tmp_path, tiny_config):
    from tuner.errors import WorkerError

    def crashing_worker(request, **kw):
        raise WorkerError("worker crashed (killed by signal 9)", where=kw["job"])

    p = _drop(tmp_path, tiny_config)
    with pytest.raises(WorkerError):
        profile(str(p), db_url=f"sqlite:///{tmp_path / 'y.sqlite'}", worker=crashing_worker)
    assert not (tmp_path / "y.sqlite").exists()


def test_main_process_never_imports_torch(tmp_path, tiny_config):
    drop = _drop(tmp_path, tiny_config, name="notorch")
    code = (
        "import sys; from tuner.jobs.app import profile; "
        f"o = profile({str(drop)!r}, db_url='sqlite:///{tmp_path / 'n.sqlite'}'); "
        "assert o.drop_id == 1; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "print('LOADED', bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _json_of(drop: Path, tmp_path: Path) -> dict:
    """``profile --json``'s document for one drop (the real worker, memoized per request)."""
    from tests._results_db import cached_worker
    from tuner.commands.profile import to_json

    return to_json(profile(str(drop), db_url=str(tmp_path / "r.sqlite"), worker=cached_worker))


def _adds_up(budget: list[dict]) -> int:
    total = 0
    for t in budget:
        total = t["bytes"] if t["op"] == "=" else total - t["bytes"] if t["op"] == "-" else total
    return total


def test_off_grid_proposal_carries_its_ledger(tmp_path):
    """``profile --json`` gave ``"budget": []`` for every proposal not on the grid (the V0 example
    proposes 40064 tokens off its grid 20000 / 29000 / 35000); the README says proposals carry
    the ledger. The proposal's budget is its own point's terms and adds up to its KV bytes."""
    from tests._results_db import V0_DROP

    d = _json_of(V0_DROP, tmp_path)
    (p,) = d["proposals"]
    assert p["max_model_len_expected"] == 40064  # the safe end's answer is the proposal (risk safe)
    assert p["max_model_len"] == p["max_model_len_safe"] < 40064
    assert p["max_model_len"] not in [c["max_model_len"] for c in d["candidates"]]
    names = [t["name"] for t in p["budget"]]
    assert names == ["requested", "weights", "activation_peak", "non_torch", "cuda_graphs", "available_kv"]
    terms = {t["name"]: t["bytes"] for t in p["budget"]}
    assert terms["available_kv"] == p["available_kv_cache_bytes"] == _adds_up(p["budget"])
    assert terms["activation_peak"] == p["activation_peak_bytes"] and p["max_num_batched_tokens"] == 512
    assert terms["available_kv"] // (2 << 20) == p["num_gpu_blocks"]  # 2 MiB V0 blocks
    assert {t["source"] for t in p["budget"]} <= {"catalog", "plugin"}


def test_kv_cache_memory_bytes_ledger_adds_up(tmp_path):
    """With ``kv_cache_memory_bytes: 20G`` the ``profile --json`` terms added up to
    24,036,864,427 B at u 0.5 while available_kv is 21,474,836,480: the ledger carries the
    balancing ``kv_cache_memory_bytes`` term ``explain`` shows, so every ledger adds up."""
    p = _drop(tmp_path, REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct", name="kv20",
              kv_cache_memory_bytes="20G", candidates={"gpu_memory_utilization": [0.5], "max_model_len": [8192]})
    d = _json_of(p, tmp_path)
    for point in d["candidates"] + d["proposals"]:
        terms = {t["name"]: t for t in point["budget"]}
        assert terms["available_kv"]["bytes"] == 20 << 30 == 21_474_836_480
        assert _adds_up(point["budget"]) == 21_474_836_480
        kv = terms["kv_cache_memory_bytes"]
        assert (kv["op"], kv["source"]) == ("-", "drop")
        assert kv["bytes"] == (terms["requested"]["bytes"] - terms["weights"]["bytes"]
                               - terms["activation_peak"]["bytes"] - terms["non_torch"]["bytes"]
                               - terms["cuda_graphs"]["bytes"] - 21_474_836_480)
    (c,) = d["candidates"]
    # 24,036,864,427 before §24 (reserve 0.56 % -> 0.1 % of the weights)
    assert _adds_up([t for t in c["budget"] if t["name"] != "kv_cache_memory_bytes"]) == 24_110_897_181


def test_gpu_memory_utilization_0_705_printed_as_0_70_beside_a_real_0_70():
    """Tables printed gpu_memory_utilization with two decimals: a drop with 0.7 and 0.705 showed
    two rows and two proposals reading "gmu 0.70"."""
    from tuner.question.protocol import gmu_text

    assert [gmu_text(u) for u in (0.7, 0.705, 0.9, 0.95, 1, 0.123456, None)] == [
        "0.70", "0.705", "0.90", "0.95", "1.00", "0.123456", "-"]
    assert gmu_text(0.70512345) == "0.70512345"

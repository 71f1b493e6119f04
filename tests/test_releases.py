"""vLLM 0.34 (the extensible KV cache), releases newer than the modelled ones, and the release a drop
without ``engine_version`` is answered for (issue 29, release half)."""

from __future__ import annotations

import pytest

from tuner.question.drop import parse_drop
from tuner.memory.eras import era_for
from tuner.jobs.job import mamba_cache_mode


def _drop(extra: str = "", *, version: str | None = "0.15.0"):
    text = ("name: t\nmodel: Qwen/Qwen3.6-27B\ndevice: H100-80GB\ncandidates:\n  gpu_memory_utilization: [0.9]\n"
            + (f"engine_version: \"{version}\"\n" if version else "") + extra)
    return parse_drop(text, "t.yaml")


def test_mamba_cache_mode_formats_vllm_version():
    """club3090-294/295/487 crashed validate with TypeError: 'VllmVersion' object is not iterable
    (the warning joined map(str, era.version))."""

    class Plugin:
        mamba_prefix_caching_mode = "align"

    warnings: list[str] = []
    assert mamba_cache_mode(_drop("enable_prefix_caching: true\n"), era_for("0.15.0"), Plugin(), warnings) is None
    assert warnings == ["enable_prefix_caching on a hybrid model: mamba_cache_mode 'align' in vLLM 0.15.0 is not "
                        "modelled (state blocks counted as without it)"]


# --- vLLM 0.34: vllm/v1/worker/extensible_kv_cache.py measure_kv_cache_bytes, bytes for given inputs ----------

GiB = 1 << 30


def test_measure_kv_cache_bytes_headroom_binds_as_in_0_34():
    from tuner.memory.budget import measure_kv_cache_bytes

    # 80 GiB free at start, 60 GiB free after warmup with 1 GiB committed: non-KV used 19 GiB, headroom 61 GiB;
    # transient 2 GiB -> margin max(1 GiB, 1.5 GiB) = 1.5 GiB; requested 80 GiB (u 1.0)
    got = measure_kv_cache_bytes(init_free_memory=80 * GiB, free_memory=60 * GiB, committed_bytes=GiB,
                                 requested_memory=80 * GiB, transient_peak_bytes=2 * GiB)
    assert got == min(80 * GiB - 19 * GiB, 61 * GiB - 3 * GiB // 2) - 2 * GiB == 57 * GiB + GiB // 2


def test_measure_kv_cache_bytes_requested_binds_and_torch_growth_wins():
    from tuner.memory.budget import measure_kv_cache_bytes

    got = measure_kv_cache_bytes(init_free_memory=80 * GiB, free_memory=60 * GiB, committed_bytes=0,
                                 requested_memory=50 * GiB, transient_peak_bytes=GiB // 2,
                                 torch_reserve_growth_bytes=GiB)
    assert got == 50 * GiB - 20 * GiB - GiB  # margin floor 1 GiB does not bind; growth 1 GiB > transient
    assert measure_kv_cache_bytes(init_free_memory=GiB, free_memory=0, committed_bytes=0,
                                  requested_memory=GiB) == 0  # never negative
    # ROCm's 3 GiB floor (KV_CACHE_MARGIN_FLOOR_BYTES = (3 if rocm else 1) << 30)
    from tuner.memory.budget import KV_CACHE_MARGIN_FLOOR_BYTES
    assert KV_CACHE_MARGIN_FLOOR_BYTES == {"cuda": 1 << 30, "rocm": 3 << 30}
    assert measure_kv_cache_bytes(init_free_memory=80 * GiB, free_memory=60 * GiB, committed_bytes=0,
                                  requested_memory=80 * GiB, margin_floor_bytes=3 << 30) == 57 * GiB


def test_extensible_budget_in_the_ledgers_terms():
    from tuner.memory.budget import extensible_kv_budget

    era = era_for("0.34.0")
    b = extensible_kv_budget(era, total_memory_bytes=80 * GiB, gpu_memory_utilization=1.0, weights_bytes=15 * GiB,
                             activation_peak_bytes=3 * GiB, non_torch_bytes=GiB // 4, cuda_graph_bytes=GiB,
                             persistent_bytes=GiB // 2, baseline_bytes=GiB // 2)
    # used = 15 + 0.25 + 0.5 + 1 = 16.75; transient 2.5; init free 79.5; margin max(1, 1.875)
    assert b.transient_bytes == 5 * GiB // 2 and b.margin_bytes == int(2.5 * GiB * 0.75)
    assert b.available_kv_cache_bytes == (79 * GiB + GiB // 2) - (16 * GiB + 3 * GiB // 4) - int(1.875 * GiB) \
        - 5 * GiB // 2
    assert b.capacity_kv_cache_bytes == 80 * GiB - 15 * GiB - 3 * GiB - GiB // 4
    assert b.headroom_bytes == (79 * GiB + GiB // 2) - (16 * GiB + 3 * GiB // 4)


def test_0_34_era_defaults_from_its_source():
    era = era_for("0.34.0")
    assert era.extensible_kv_cache and era.default_gpu_memory_utilization == 1.0  # CacheConfig: None -> 1.0
    assert era_for("0.34.0", kv_cache_memory_bytes=1 << 34).default_gpu_memory_utilization == 0.92
    assert not era_for("0.34.0", extensible_kv_cache=False).extensible_kv_cache
    assert era_for("0.33.0").default_gpu_memory_utilization == 0.92 and not era_for("0.33.0").extensible_kv_cache
    from tuner.memory.eras import uses_model_runner_v2

    # Model Runner V1 removed: every model on V2, a pooling / hybrid one too
    assert uses_model_runner_v2(era, ["BertModel"], is_moe=False, is_hybrid=True, generate=False,
                                speculative_method="suffix")


def test_0_34_hint_texts_as_vllm_prints_them():
    from tuner.memory.kvcache import more_kv_cache_memory_hint

    assert more_kv_cache_memory_hint(extensible=True, gpu_memory_utilization=1.0, after_warmup=True) == (
        "The extensible KV cache already takes all device memory left after the model, its activations, CUDA "
        "graphs and warmup; decrease `max_model_len` or `max_num_seqs`, or the model needs a device with more "
        "memory. CUDA graphs take less with fewer or smaller capture sizes in the compilation config.")
    assert more_kv_cache_memory_hint(extensible=True, gpu_memory_utilization=0.9).startswith(
        "The KV cache gets what is left after the model and its activations within `gpu_memory_utilization`=0.9;")


# --- releases newer than the modelled ones, and drops without engine_version ------------------------------------

def test_newer_release_answered_with_newest_rules_and_marked():
    d = _drop(version="0.35.0")
    assert d.engine_version == "0.34.0"
    assert d.release_assumed["kind"] == "newer_release" and d.release_assumed["requested"] == "0.35.0"
    assert d.to_dict()["release_assumed"]["value"] == "0.34.0"
    from tuner.errors import DropError

    with pytest.raises(DropError, match="strict release mode") as exc:
        _drop("strict_release: true\n", version="0.35.0")
    assert exc.value.field == "engine_version"


def test_drop_without_engine_version_is_not_silently_0_19(monkeypatch):
    """A drop without engine_version was computed as vLLM 0.19.0 with no word said (an RTX 3090 proposal
    that 0.33 would refuse). Now: the installed vLLM's release, else the newest modelled one, marked."""
    import tuner.releases.installed as engine  # where the probe lives (tuner.engine re-exports it)

    monkeypatch.setattr(engine, "installed_release", lambda: (None, None))
    d = _drop(version=None)
    assert d.engine_version == "0.34.0" and d.release_assumed["kind"] == "newest_modelled"
    monkeypatch.setattr(engine, "installed_release", lambda: ("vllm", "0.33.0"))
    d = _drop(version=None)
    assert d.engine_version == "0.33.0" and d.release_assumed == {
        "value": "0.33.0", "requested": None, "kind": "installed",
        "reason": "engine_version not given: vLLM 0.33.0, installed in ctx-tuner's Python (vllm)"}
    assert _drop(version="0.19.0").release_assumed is None


def test_release_assumed_reaches_the_store_and_the_proposal_file(tmp_path, monkeypatch):
    import json

    import tuner.releases.installed as engine  # where the probe lives (tuner.engine re-exports it)
    from tuner.store import records
    from tuner.reports.proposals import proposal_document
    from tuner.store.database import open_store

    monkeypatch.setattr(engine, "installed_release", lambda: (None, None))
    d = _drop(version=None)
    store = open_store(str(tmp_path / "s.sqlite"))
    t = records._table("drops")
    row = {"name": "t", "path": "t.yaml", "content_sha256": "0" * 64, "content": "", "model": d.model,
           "device_name": "H100-80GB", "engine_version": d.engine_version, "method": "simulate",
           "created_at": "2026-12-06 00:00:00", "release_assumed": json.dumps(d.release_assumed)}
    import sqlalchemy as sa

    with store.engine.begin() as conn:
        drop_id = conn.execute(sa.insert(t).values(**{**row, "created_at": __import__("datetime").datetime(
            2026, 12, 6)})).inserted_primary_key[0]
    doc = proposal_document(store, drop_id)
    assert doc["engine_version"] == "0.34.0" and doc["release_assumed"]["kind"] == "newest_modelled"


# --- 0.34's new log lines (import-log / logparse) ------------------------------------------------------------

LOG_034 = [
    "(EngineCore pid=1) INFO 12-06 [gpu_worker.py:795] Available KV cache memory: 61.20 GiB",
    "(EngineCore pid=1) INFO 12-06 [extensible_kv_cache.py:693] Memory after warmup: 60.10 GiB free, 0.00 GiB "
    "committed to the KV cache, 2.31 GiB kept for transient activations (2.31 GiB allocated at peak, 0.12 GiB of "
    "torch reservation growth); 24,512 KV cache blocks (56.25 GiB) fit within the requested 79.19 GiB. Torch may "
    "reserve up to 19.91 GiB.",
    "(EngineCore pid=1) INFO 12-06 [kv_cache_planning.py:1494] --max-model-len auto reduced max_model_len from "
    "262144 to 196352 (56.25 GiB GPU left for the KV cache after CUDA graph capture and warmup).",
    "(EngineCore pid=1) INFO [extensible_kv_cache.py:536] Extended KV cache to 24512 blocks (56.25 GiB).",
]


def test_memory_after_warmup_line_wins_over_the_reservation():
    from tuner.logs.logparse import gib_to_bytes, parse_lines
    from tuner.logs.release_infer import infer_for_log

    p = parse_lines(LOG_034)
    assert p.available_kv_cache_bytes == gib_to_bytes(56.25)  # not the profile's 61.20 GiB reservation
    assert p.num_gpu_blocks == 24512 and p.requested_memory_bytes == gib_to_bytes(79.19)
    assert p.free_after_warmup_bytes == gib_to_bytes(60.10) and p.transient_kept_bytes == gib_to_bytes(2.31)
    assert (p.auto_fit_from_max_model_len, p.max_model_len) == (262144, 196352)
    got = infer_for_log(LOG_034)  # "Memory after warmup" and [gpu_worker.py:795]: 0.34.0 only (release facts)
    assert (got.release, got.engine, got.candidates) == ("0.34.0", "V1", ["0.34.0"])


def test_blocks_within_rounds_each_segment_to_the_granule():
    """ExtensibleKVCache.blocks_within (0.34): every layer's committed prefix is mapped in whole 2 MiB granules."""
    from tuner.memory.budget import blocks_within

    strides = [3 * (1 << 20) // 4] * 4  # 4 layers of 768 KiB per block
    # 10 blocks = 7.5 MiB per layer -> 8 MiB mapped each: 32 MiB; 9 blocks -> 6.75 -> 8 MiB too
    assert blocks_within(31 * (1 << 20), strides) == 8  # 8 x 768 KiB = 6 MiB per layer: 24 MiB fits
    assert blocks_within(32 * (1 << 20), strides) == 10
    assert blocks_within(32 * (1 << 20), strides, capacity=9) == 9
    assert blocks_within(10, []) == 0


def test_default_block_size_is_64_from_0_34():
    """vllm/config/cache.py DEFAULT_BLOCK_SIZE: 16 through 0.33, 64 in 0.34 (a hybrid model's floor; MLA models
    keep their plugin's sizing)."""
    from types import SimpleNamespace

    from tuner.jobs.job import default_block_size

    dense, mla = SimpleNamespace(raw={"num_key_value_heads": 8}), SimpleNamespace(raw={"kv_lora_rank": 512})
    plain, hybrid = SimpleNamespace(), SimpleNamespace(mamba_prefix_caching_mode="align")
    assert default_block_size(era_for("0.34.0"), dense, plain) == 64
    assert default_block_size(era_for("0.33.0"), dense, plain) is None
    assert default_block_size(era_for("0.34.0"), mla, plain) is None
    assert default_block_size(era_for("0.34.0"), dense, hybrid) == 64  # the floor of the aligned block


def test_no_enable_extensible_kv_cache_is_read_and_refused_before_0_34():
    from tuner.reports.check import CheckInputError, equivalent_drop
    from tuner.memory.serve_args import parse_serve

    sa = parse_serve(["vllm", "serve", "org/model", "--no-enable-extensible-kv-cache"], None)
    d, _ = equivalent_drop(sa, device="H100-80GB", engine_version="0.34.0")
    assert d["enable_extensible_kv_cache"] is False
    assert d["candidates"]["gpu_memory_utilization"] == [0.92]  # 0.34's default without the extensible cache
    d, _ = equivalent_drop(parse_serve(["vllm", "serve", "org/model"], None), device="H100-80GB",
                           engine_version="0.34.0")
    assert d["candidates"]["gpu_memory_utilization"] == [1.0]  # CacheConfig.resolved_gpu_memory_utilization
    with pytest.raises(CheckInputError, match=r"unrecognized arguments: --no-enable-extensible-kv-cache"):
        equivalent_drop(sa, device="H100-80GB", engine_version="0.33.0")


def test_rtx3090_drop_without_engine_version_was_0_19s_44064(tmp_path, monkeypatch):
    """Llama-3.1-8B-Instruct on an RTX 3090 at gpu_memory_utilization 0.9, no engine_version: the
    proposal was 0.19.0's max_model_len 44064 (0.33 refuses above 36720), said nowhere. Now the newest
    modelled release answers (0.34.0: 36288, block size 64, the extensible cache's headroom cap) and
    the output, the JSON and the store say so."""
    import json
    import sqlite3

    import tuner.releases.installed as engine  # where the probe lives (tuner.engine re-exports it)
    from tests._cli_helpers import run_cli
    from tests.conftest import REPO

    monkeypatch.setattr(engine, "installed_release", lambda: (None, None))
    model = REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"
    drop = tmp_path / "l.yaml"
    drop.write_text(f"name: l\nmodel: {model}\ndevice: RTX-3090\ncandidates: {{gpu_memory_utilization: [0.9]}}\n")
    db = tmp_path / "r.sqlite"
    rc, out, err = run_cli("profile", str(drop), "--db", str(db), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["engine_version"] == "0.34.0" and doc["release_assumed"]["kind"] == "newest_modelled"
    assert any(w.startswith("release assumed: vLLM 0.34.0") for w in doc["warnings"])
    (prop,) = doc["proposals"]
    # 36288 with the PIECEWISE-only graph count; 37312 since the FULL decode graphs are counted apart
    # (0.71 GiB of graphs on the 3090, issue 28 #2); 37824 since §24's reserve refit (0.1 % of W)
    assert prop["max_model_len_expected"] == 37824 and prop["max_model_len"] != 44064
    # the proposal is the safe end, and the release assumed widens the interval (issue 27)
    assert prop["risk"] == "safe" and prop["max_model_len"] == prop["max_model_len_safe"] < 37824
    row = sqlite3.connect(db).execute("select engine_version, release_assumed from drops").fetchone()
    assert row[0] == "0.34.0" and json.loads(row[1])["value"] == "0.34.0"


def test_explain_shows_0_34_budget_terms(tmp_path):
    """explain on a 0.34 drop: the extensible KV cache's rule, the headroom cap step (it binds at the
    default gpu_memory_utilization 1.0) and the ledger adding up to the KV bytes."""
    import json

    from tests._cli_helpers import run_cli
    from tests.conftest import REPO

    model = REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"
    drop = tmp_path / "e.yaml"
    drop.write_text(f"name: e\nmodel: {model}\ndevice: H100-80GB\nengine_version: \"0.34.0\"\n"
                    "candidates: {gpu_memory_utilization: [1.0]}\n")
    rc, out, err = run_cli("explain", str(drop), "-m", "32k", "--no-variants", "--quiet", "--json",
                           "--db", str(tmp_path / "r.sqlite"))
    assert rc == 0, err
    e = json.loads(out)["explanations"][0]
    assert e["formula_text"].startswith("vLLM V1 0.34 (extensible KV cache")
    step = next(s for s in e["steps"] if s["name"] == "extensible_headroom")
    assert step["op"] == "-" and step["bytes"] == e["extensible_withheld_bytes"] > 0
    assert e["extensible_margin_bytes"] >= 1 << 30 and e["block_size"] == 64
    assert "rounding" not in [s["name"] for s in e["steps"]]  # the steps add up to the KV bytes
    terms = ("weights_bytes", "activation_peak_bytes", "non_torch_bytes", "cuda_graph_bytes")
    assert e["requested_memory_bytes"] - sum(e[k] for k in terms) - step["bytes"] == e["available_kv_cache_bytes"]


def test_drop_without_engine_version_takes_the_worker_pythons_vllm(tmp_path, monkeypatch):
    """The daemon's worker_python (or $CTX_TUNER_WORKER_PYTHON) may be another venv than ctx-tuner's:
    its installed vLLM decides the release, read from its package metadata."""
    import tuner.question.drop as drop_mod

    py = tmp_path / "python"
    py.write_text("#!/bin/sh\necho 'ctx-tuner-vllm vllm 0.30.1'\n")
    py.chmod(0o755)
    monkeypatch.setattr(drop_mod, "_PROBED", {})
    text = "name: t\nmodel: org/x\ndevice: H100-80GB\ncandidates:\n  gpu_memory_utilization: [0.9]\n"
    d = drop_mod.parse_drop(text, "t.yaml", worker_python=str(py))
    assert d.engine_version == "0.30.1" and d.release_assumed["kind"] == "installed"
    assert d.release_assumed["reason"] == f"engine_version not given: vLLM 0.30.1, installed in the worker's Python {py} (vllm)"
    silent = tmp_path / "nothing"
    silent.write_text("#!/bin/sh\nexit 1\n")
    silent.chmod(0o755)
    import tuner.releases.installed as engine  # where the probe lives (tuner.engine re-exports it)

    monkeypatch.setattr(engine, "installed_release", lambda: (None, None))
    monkeypatch.setenv("CTX_TUNER_WORKER_PYTHON", str(silent))
    assert drop_mod.parse_drop(text, "t.yaml").release_assumed["kind"] == "newest_modelled"


def test_extensible_margin_floor_is_3_gib_on_rocm():
    """KV_CACHE_MARGIN_FLOOR_BYTES = (3 if current_platform.is_rocm() else 1) << 30 (0.34)."""
    from tuner.memory.budget import Topology, extensible_kv_budget, platform_of

    assert platform_of(Topology(interconnect="xgmi")) == "rocm" and platform_of(Topology()) == "cuda"
    kw = dict(total_memory_bytes=192 * GiB, gpu_memory_utilization=1.0, weights_bytes=15 * GiB,
              activation_peak_bytes=GiB, non_torch_bytes=0, cuda_graph_bytes=0, baseline_bytes=0)
    cuda = extensible_kv_budget(era_for("0.34.0"), **kw)
    rocm = extensible_kv_budget(era_for("0.34.0"), **kw, platform="rocm")
    assert (cuda.margin_bytes, rocm.margin_bytes) == (GiB, 3 * GiB)
    assert cuda.available_kv_cache_bytes - rocm.available_kv_cache_bytes == 2 * GiB


def test_check_did_not_widen_the_interval_for_the_release_it_assumed():
    """The failure (a new user's check): `check --engine-version 0.35.0` (and a check without
    --engine-version) said "release assumed" but answered STARTS with the interval of a stated 0.34.0
    (KV 5.45-5.80 GiB), where the same question as a drop widened it by the release band and did not
    start at the safe end. The drop check builds now carries the release it assumed."""
    from tests.conftest import REPO
    from tuner.reports.check import run_check

    line = ["vllm", "serve", str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"),
            "--max-model-len", "40000"]
    stated = run_check(line, device="RTX-3090", engine_version="0.34.0", variants=False)
    newer = run_check(line, device="RTX-3090", engine_version="0.35.0", variants=False)
    assert stated.exit_code == 0
    assert newer.exit_code == 4
    assert newer.doc["release_assumed"]["kind"] == "newer_release"
    assert sum(w.count("release assumed") for w in newer.doc["warnings"]) == 1

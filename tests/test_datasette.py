"""The Datasette-ready store: ``configs/datasette/metadata.yml`` describes real tables and columns,
its canned queries are the documented queries (docs/results-sql.md), and (datasette tier) Datasette started on a real
snapshot on 127.0.0.1 serves a canned query page whose rows are the store's proposals."""

from __future__ import annotations

import json
import re
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.test_check import inproc_worker

META = REPO / "configs" / "datasette" / "metadata.yml"


def _norm(sql: str) -> str:
    sql = "\n".join(line for line in sql.splitlines() if not line.strip().startswith("--"))
    return re.sub(r"\s+", " ", sql).strip().rstrip(";").replace("'llama-3.1-8b-rtx3090-v0'", ":drop_name")


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, tiny_config_module):
    from tuner.jobs.app import profile
    from tuner.store.snapshot import write_snapshot

    d = tmp_path_factory.mktemp("ds")
    drop = d / "tiny.yaml"
    drop.write_text(f"name: tiny\nmodel: {tiny_config_module}\ndevice: H100-80GB\n"
                    "candidates: {gpu_memory_utilization: [0.5, 0.9], max_model_len: [1024, 4096]}\n")
    db = d / "ctx-tuner.sqlite"
    profile(str(drop), db_url=str(db), worker=inproc_worker)
    return write_snapshot(db, d / "ctx-tuner-snapshot.sqlite")


@pytest.fixture(scope="module")
def tiny_config_module(tmp_path_factory):
    d = tmp_path_factory.mktemp("model") / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "hidden_act": "silu"}))
    return d


def test_canned_queries_are_the_readme_queries_and_run(snapshot):
    meta = yaml.safe_load(META.read_text())
    db = meta["databases"]["ctx-tuner-snapshot"]
    readme = (REPO / "docs" / "results-sql.md").read_text()
    readme_sql = {_norm(q) for q in re.findall(r"```sql\n(.*?)```", readme, flags=re.S)}
    canned = {_norm(q["sql"]) for q in db["queries"].values()}
    assert canned == readme_sql
    con = sqlite3.connect(f"file:{snapshot}?mode=ro", uri=True)
    try:
        names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
        for table, spec in db["tables"].items():
            assert table in names, table
            cols = {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
            assert set((spec.get("columns") or {})) <= cols, table
        for name, q in db["queries"].items():
            con.execute(q["sql"], {"drop_name": "tiny"}).fetchall()
        model, = con.execute("SELECT model FROM drops").fetchone()
        assert Path(model).is_absolute()  # drops.model: the resolved directory, never relative to the drop
    finally:
        con.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, deadline: float):
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.loads(r.read())
        except OSError as exc:  # not listening yet
            last = exc
            time.sleep(0.25)
    raise AssertionError(f"datasette did not answer {url}: {last}")


def test_datasette_serves_a_canned_query_on_the_snapshot(snapshot):
    import importlib.util
    import os

    if importlib.util.find_spec("datasette") is None:
        if os.environ.get("CTX_TUNER_REQUIRE_DATASETTE") == "1":
            pytest.fail("CTX_TUNER_REQUIRE_DATASETTE=1 but datasette is not installed")
        pytest.skip("the datasette extra is not installed (.ci/run's datasette tier installs it)")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "datasette", "serve", "-i", str(snapshot), "-m", str(META),
                             "-h", "127.0.0.1", "-p", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}/ctx-tuner-snapshot"
        rows = _get_json(f"{base}/latest_proposals_per_drop.json?_shape=array", time.monotonic() + 60)
        con = sqlite3.connect(f"file:{snapshot}?mode=ro", uri=True)
        want = con.execute("SELECT p.gpu_memory_utilization, p.max_model_len, p.kv_cache_tokens FROM proposals p "
                           "ORDER BY p.gpu_memory_utilization").fetchall()
        con.close()
        assert [(r["gpu_memory_utilization"], r["max_model_len"], r["kv_cache_tokens"]) for r in rows] == want
        assert {r["drop_name"] for r in rows} == {"tiny"} and len(rows) == 2 and rows[0]["max_model_len"] == 4096
        cands = _get_json(f"{base}/memory_per_candidate.json?drop_name=tiny&_shape=array", time.monotonic() + 30)
        assert [c["max_model_len"] for c in cands] == [1024, 4096, 1024, 4096]
    finally:
        proc.terminate()
        proc.wait(timeout=30)

"""Daemon metrics over HTTP on 127.0.0.1 (and a Unix socket), parsed with
``prometheus_client.parser``; ``ctx-tuner status`` exit codes."""

from __future__ import annotations

import socket
import sqlite3
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests._daemon_helpers import drop_text, poll, settings_for
from tests.test_daemon import _expected_tokens
from tests._cli_helpers import run_cli as _cli
from tuner.daemon.service import Daemon
from tuner.daemon.metrics import parse_listen, scrape
from tuner.daemon.notify import Notifier


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out




def _settings_file(tmp_path: Path, s) -> Path:
    p = tmp_path / "tuner.yaml"
    p.write_text(yaml.safe_dump({k: getattr(s, k) for k in ("watch_dir", "state_dir", "worker_python",
                                                            "metrics_listen")}))
    return p


def test_metrics_scraped_over_http_parse_and_status_probe(tmp_path, tiny_config):
    listen = f"127.0.0.1:{_free_port()}"
    s = settings_for(tmp_path, metrics_listen=listen)
    conf = Path(s.watch_dir)
    settings_file = _settings_file(tmp_path, s)
    d = Daemon(s, notifier=Notifier({}))
    d.start()
    try:
        (conf / "a.yaml").write_text(drop_text("a", tiny_config, gmu=(0.5, 0.6)))
        (conf / "bad.yaml").write_text("name: bad\n")
        db = Path(s.state_dir) / "ctx-tuner.sqlite"

        def done():
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                return con.execute("SELECT count(*) FROM jobs WHERE status IN ('done', 'failed')").fetchone()[0] == 2
            finally:
                con.close()

        poll(done, 20, step=lambda: d.step(max_wait_s=0.05), what="both jobs finished")
        # one imported start-up with a measured KV size, against a simulated candidate of the same settings
        con = sqlite3.connect(db)
        with con:
            cols = [r[1] for r in con.execute("PRAGMA table_info(profile_runs)")]
            row = dict(zip(cols, con.execute("SELECT * FROM profile_runs LIMIT 1").fetchone()))
            cand = con.execute("SELECT available_kv_cache_bytes FROM candidates WHERE gpu_memory_utilization = 0.5 "
                               "LIMIT 1").fetchone()[0]
            row.update(id=None, method="import", status="ok", gpu_memory_utilization=0.5, max_model_len=1024,
                       available_kv_cache_bytes=cand - (3 << 20), num_gpu_blocks=1, kv_cache_tokens=16,
                       pass_sha256="f" * 64, source="engine.log")
            con.execute(f"INSERT INTO profile_runs ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})",
                        list(row.values()))
        con.close()
        text = scrape(listen)
        m = _samples(text)
        jobs = {x.labels["state"]: x.value for x in m["ctx_tuner_jobs"]}
        assert jobs["done"] == 1 and jobs["failed"] == 1 and jobs["pending"] == 0
        assert m["ctx_tuner_up"][0].value == 1 and m["ctx_tuner_store_up"][0].value == 1
        assert m["ctx_tuner_job_duration_seconds_count"][0].value == 1  # the invalid drop never ran
        tokens = {x.labels["gpu_memory_utilization"]: x.value for x in m["ctx_tuner_proposal_kv_cache_tokens"]
                  if x.labels["drop"] == "a"}
        assert tokens == {"0.5": _expected_tokens(0.5), "0.6": _expected_tokens(0.6)}
        assert {x.labels["drop"] for x in m["ctx_tuner_proposal_max_model_len"]} == {"a"}
        res = m["ctx_tuner_kv_residual_bytes"]
        assert len(res) == 1 and res[0].value == -(3 << 20) and res[0].labels["method"] == "import"
        assert res[0].labels["device"] == "H100-80GB"
        rc, out, _ = _cli("status", "--settings", str(settings_file))
        assert rc == 0 and out.startswith("healthy")
    finally:
        d.shutdown()
    rc, out, _ = _cli("status", "--settings", str(settings_file))  # the endpoint is gone: unhealthy
    assert rc == 1 and "UNHEALTHY" in out and "metrics" in out


def test_metrics_on_a_unix_socket(tmp_path, tiny_config):
    sock = tmp_path / "m.sock"
    s = settings_for(tmp_path, metrics_listen=f"unix:{sock}")
    d = Daemon(s, notifier=Notifier({}))
    d.start()
    try:
        m = _samples(scrape(f"unix:{sock}"))
        assert {x.labels["state"] for x in m["ctx_tuner_jobs"]} >= {"pending", "done", "failed"}
    finally:
        d.shutdown()
    assert not sock.exists()


def test_status_exit_codes_without_metrics(tmp_path):
    s = settings_for(tmp_path)
    p = _settings_file(tmp_path, s)
    rc, out, _ = _cli("status", "--settings", str(p))
    assert rc == 1 and "does not exist" in out  # no daemon ever started here
    d = Daemon(s, notifier=Notifier({}))
    d.start()
    d.shutdown()
    rc, out, _ = _cli("status", "--settings", str(p), "--json")
    assert rc == 0 and '"healthy": true' in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("metrics_listen: 0.0.0.0:9464\n")
    rc, _, err = _cli("status", "--settings", str(bad))
    assert rc == 2 and "metrics_listen" in err and "loopback" in err


def test_listen_addresses():
    assert parse_listen("127.0.0.1:9464") == ("tcp", ("127.0.0.1", 9464))
    assert parse_listen("[::1]:9464") == ("tcp", ("::1", 9464))
    assert parse_listen("unix:/run/ctx-tuner/metrics.sock") == ("unix", "/run/ctx-tuner/metrics.sock")
    for bad in ("10.0.0.1:9464", "0.0.0.0:1", "127.0.0.1", "unix:rel.sock", "127.0.0.1:70000"):
        with pytest.raises(ValueError):
            parse_listen(bad)


def test_metrics_of_a_fleet_database_count_each_daemons_own_jobs_and_proposals(tmp_path):
    """Several daemons on one database (revision 0007): each daemon's scrape holds its own jobs
    and proposals, not the fleet's (every host's scrape summed the whole store, and two hosts'
    drops of one name gave duplicate samples)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from tuner.store.fleet import register_owner
    from tuner.store.jobqueue import JobQueue
    from tuner.daemon.metrics import StoreCollector
    from tuner.store.database import open_store

    store = open_store(str(tmp_path / "fleet.sqlite"))
    try:
        a = register_owner(store, "host-a", str(tmp_path / "a"), lease_s=60).id
        b = register_owner(store, "host-b", str(tmp_path / "b"), lease_s=60).id
        qa, qb = JobQueue(store, a), JobQueue(store, b)
        for i in range(3):
            qa.enqueue(str(tmp_path / "a" / f"x{i}.yaml"), f"{i:064d}", "name: x\n")
        qb.enqueue(str(tmp_path / "b" / "y.yaml"), "f" * 64, "name: y\n")

        def jobs(owner):
            reg = CollectorRegistry(auto_describe=False)
            reg.register(StoreCollector(store.engine.connect, owner))
            fams = _samples(generate_latest(reg).decode())
            return {s.labels["state"]: s.value for s in fams["ctx_tuner_jobs"]}

        assert jobs(lambda: a)["pending"] == 3
        assert jobs(lambda: b)["pending"] == 1
        assert jobs(None)["pending"] == 4  # no owner: the whole store
    finally:
        store.close()


def test_metrics_give_each_proposals_safe_and_expected_max_model_len(tmp_path):
    """``ctx_tuner_proposal_max_model_len_bound{bound=safe|expected}``: both answers of each latest
    proposal as stored (the V0 RTX 3090 example: 37968 at the safe end, 40064 at the expected
    value); a proposal stored without an interval (before revision 0010) gets no bound samples."""
    import shutil

    from prometheus_client import CollectorRegistry, generate_latest

    from tests._results_db import profiled_db
    from tuner.daemon.metrics import StoreCollector
    from tuner.store.database import open_store

    def scrape_bounds(path):
        store = open_store(str(path), readonly=True)
        try:
            reg = CollectorRegistry(auto_describe=False)
            reg.register(StoreCollector(store.engine.connect))
            fams = _samples(generate_latest(reg).decode())
        finally:
            store.close()
        return {(s.labels["drop"], s.labels["gpu_memory_utilization"], s.labels["bound"]): s.value
                for s in fams.get("ctx_tuner_proposal_max_model_len_bound", [])}, fams

    db = tmp_path / "r.sqlite"
    shutil.copy(profiled_db(), db)
    con = sqlite3.connect(db)
    stored = con.execute("SELECT d.name, p.gpu_memory_utilization, p.max_model_len_safe, p.max_model_len_expected "
                         "FROM proposals p JOIN drops d ON d.id = p.drop_id").fetchall()
    con.close()
    bounds, fams = scrape_bounds(db)
    assert bounds == {k: v for n, u, safe, exp in stored
                      for k, v in (((n, f"{u:g}", "safe"), safe), ((n, f"{u:g}", "expected"), exp))}
    assert bounds[("llama-3.1-8b-rtx3090-v0", "0.9", "safe")] == 37968
    assert bounds[("llama-3.1-8b-rtx3090-v0", "0.9", "expected")] == 40064
    mml = {s.labels["drop"]: s.value for s in fams["ctx_tuner_proposal_max_model_len"]}
    assert mml["llama-3.1-8b-rtx3090-v0"] == 37968  # risk safe: the proposal is the safe answer
    con = sqlite3.connect(db)
    with con:
        con.execute("UPDATE proposals SET risk = NULL, max_model_len_safe = NULL, max_model_len_expected = NULL "
                    "WHERE drop_id = (SELECT id FROM drops WHERE name = 'llama-3.1-8b-rtx3090-v0')")
    con.close()
    bounds, fams = scrape_bounds(db)
    assert {k[0] for k in bounds} == {"llama-3.1-8b-h100"} and len(bounds) == 6
    assert fams["ctx_tuner_store_up"][0].value == 1

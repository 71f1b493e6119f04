"""SQL views (migration 0004) and the documented example queries (docs/results-sql.md, docs/fleet.md),
on a profiled store."""

from __future__ import annotations

import re
import sqlite3

import pytest
from alembic import command

from tests._results_db import profiled_db
from tests.conftest import REPO
from tuner.store.database import alembic_config, open_store

VIEWS = ("latest_proposals", "run_breakdown_gib", "candidate_breakdown_gib", "fit_surface", "measured_vs_simulated")
GiB = 1 << 30


@pytest.fixture(scope="module")
def con():
    c = sqlite3.connect(profiled_db())
    c.row_factory = sqlite3.Row
    yield c
    c.close()


def _readme_queries() -> list[str]:
    section = (REPO / "docs" / "results-sql.md").read_text()
    return re.findall(r"```sql\n(.*?)```", section, flags=re.S)


def test_migration_creates_the_views(con):
    names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'view'")}
    assert set(VIEWS) <= names


def test_readme_documents_every_view_and_at_least_five_queries():
    text = (REPO / "docs" / "results-sql.md").read_text() + (REPO / "docs" / "fleet.md").read_text()
    for v in VIEWS:
        assert f"`{v}`" in text
    assert len(_readme_queries()) >= 5


@pytest.mark.parametrize("i", range(7))
def test_readme_query_runs(con, i):
    queries = _readme_queries()
    if i >= len(queries):
        pytest.skip("fewer queries")
    rows = con.execute(queries[i]).fetchall()
    if "unsafe" not in queries[i]:  # the store holds no unsafe prediction
        assert rows, queries[i]


def test_latest_proposals_match_the_tables(con):
    rows = con.execute("SELECT * FROM latest_proposals ORDER BY drop_name, gpu_memory_utilization").fetchall()
    raw = con.execute("SELECT p.max_model_len, p.kv_cache_tokens FROM proposals p JOIN drops d ON d.id = p.drop_id "
                      "ORDER BY d.name, p.gpu_memory_utilization").fetchall()
    assert [(r["max_model_len"], r["kv_cache_tokens"]) for r in rows] == [tuple(r) for r in raw]
    assert [r["drop_name"] for r in rows] == ["llama-3.1-8b-h100"] * 3 + ["llama-3.1-8b-rtx3090-v0"]


def test_breakdowns_are_bytes_over_2_pow_30(con):
    c = con.execute("SELECT * FROM candidates WHERE max_model_len = 29000").fetchone()
    v = con.execute("SELECT * FROM candidate_breakdown_gib WHERE candidate_id = ?", (c["id"],)).fetchone()
    for col in ("requested", "weights", "activation_peak", "non_torch", "available_kv_cache"):
        src = c[f"{col}_memory_bytes" if col == "requested" else f"{col}_bytes"]
        assert v[f"{col}_gib"] == round(src / GiB, 3)
    assert v["fits"] == 0 and v["num_gpu_blocks"] == c["num_gpu_blocks"]
    r = con.execute("SELECT * FROM profile_runs WHERE max_num_batched_tokens = 29000 AND method = 'simulate'").fetchone()
    b = con.execute("SELECT * FROM run_breakdown_gib WHERE run_id = ?", (r["id"],)).fetchone()
    assert b["activation_peak_gib"] == round(r["activation_peak_bytes"] / GiB, 3)
    assert b["sampler_peak_gib"] == round(r["sampler_peak_bytes"] / GiB, 3) and b["drop_name"] == "llama-3.1-8b-rtx3090-v0"


def test_fit_surface_marks_the_non_monotone_point(con):
    rows = con.execute("SELECT max_model_len, fits, fits_above_a_failure FROM fit_surface "
                       "WHERE drop_name = 'llama-3.1-8b-rtx3090-v0' ORDER BY max_model_len").fetchall()
    assert [tuple(r) for r in rows] == [(20000, 1, 0), (29000, 0, 0), (35000, 1, 1)]
    assert con.execute("SELECT COUNT(*) FROM fit_surface WHERE drop_name = 'llama-3.1-8b-h100' "
                       "AND fits_above_a_failure = 1").fetchone()[0] == 0


def test_measured_vs_simulated_residuals(con):
    [row] = con.execute("SELECT * FROM measured_vs_simulated").fetchall()
    sim = con.execute("SELECT * FROM candidates WHERE id = ?", (row["simulated_candidate_id"],)).fetchone()
    assert sim["max_model_len"] == 29000 and sim["gpu_memory_utilization"] == 0.9
    assert row["measured_num_gpu_blocks"] == 1478 and row["simulated_num_gpu_blocks"] == sim["num_gpu_blocks"]
    assert row["num_gpu_blocks_residual"] == sim["num_gpu_blocks"] - 1478
    assert row["num_gpu_blocks_residual_pct"] == round(100.0 * (sim["num_gpu_blocks"] - 1478) / 1478, 2)
    assert row["kv_cache_tokens_residual"] == sim["kv_cache_tokens"] - 23648
    assert row["available_kv_cache_bytes_residual"] == sim["available_kv_cache_bytes"] - 1478 * 2_097_152
    assert row["measured_fits"] == 0 and row["simulated_fits"] == 0  # both refuse 29000 at 0.9
    assert abs(row["num_gpu_blocks_residual_pct"]) < 5


def test_downgrade_drops_the_views_and_upgrade_restores_them(tmp_path):
    url = f"sqlite:///{tmp_path / 'v.sqlite'}"
    open_store(url).close()
    command.downgrade(alembic_config(url), "0003")
    c = sqlite3.connect(tmp_path / "v.sqlite")
    assert c.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'view'").fetchone()[0] == 0
    c.close()
    open_store(url).close()
    c = sqlite3.connect(tmp_path / "v.sqlite")
    names = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'view'")}
    c.close()
    assert set(VIEWS) <= names


# -- the same views and documented queries on PostgreSQL; the fleet views and queries on both ------------


def _copy_store(src_url: str, dst_url: str) -> None:
    """Copy every table of a migrated store into another migrated (empty) store, ids kept."""
    import sqlalchemy as sa

    from tuner.store.database import metadata

    src, dst = sa.create_engine(src_url), sa.create_engine(dst_url)
    try:
        with src.connect() as s, dst.begin() as d:
            for table in metadata.sorted_tables:
                rows = [dict(r) for r in s.execute(sa.select(table).order_by(table.c.id)).mappings()]
                if rows:
                    d.execute(table.insert(), rows)
                if d.dialect.name == "postgresql":
                    d.exec_driver_sql(f"SELECT setval(pg_get_serial_sequence('{table.name}', 'id'), "
                                      f"COALESCE((SELECT MAX(id) FROM {table.name}), 0) + 1, false)")
    finally:
        src.dispose()
        dst.dispose()


@pytest.fixture(scope="module")
def pg_profiled():
    """A PostgreSQL copy of the profiled store (module scope: built once)."""
    import sqlalchemy as sa

    from tests.conftest import make_pg_database

    url, drop = make_pg_database("views")
    open_store(url).close()
    _copy_store(f"sqlite:///{profiled_db()}", url)
    eng = sa.create_engine(url)
    yield eng
    eng.dispose()
    drop()

INTERVAL = ("risk", "max_model_len_safe", "max_model_len_expected", "kv_cache_tokens_low", "kv_cache_tokens_high",
            "available_kv_cache_bytes_low", "available_kv_cache_bytes_high")


def test_latest_proposals_carry_the_interval(con):
    """Migration 0014: the view shows each proposal's risk, both answers and the KV ends as stored."""
    cols = ", ".join(INTERVAL)
    view = con.execute(f"SELECT drop_name, gpu_memory_utilization, {cols} FROM latest_proposals "
                       "ORDER BY drop_name, gpu_memory_utilization").fetchall()
    raw = con.execute(f"SELECT d.name, p.gpu_memory_utilization, {', '.join('p.' + c for c in INTERVAL)} "
                      "FROM proposals p JOIN drops d ON d.id = p.drop_id ORDER BY d.name, p.gpu_memory_utilization")
    assert [tuple(r) for r in view] == [tuple(r) for r in raw.fetchall()]
    v0 = dict(view[-1])
    assert v0["drop_name"] == "llama-3.1-8b-rtx3090-v0" and v0["risk"] == "safe"
    assert (v0["max_model_len_safe"], v0["max_model_len_expected"]) == (37968, 40064)  # docs/uncertainty.md
    assert v0["kv_cache_tokens_low"] <= 40064 <= v0["kv_cache_tokens_high"]  # the expected value's KV tokens
    assert v0["available_kv_cache_bytes_low"] < v0["available_kv_cache_bytes_high"]


def test_downgrade_to_0010_restores_the_views_without_the_interval(tmp_path):
    url = f"sqlite:///{tmp_path / 'v.sqlite'}"
    open_store(url).close()

    def view_columns():
        c = sqlite3.connect(tmp_path / "v.sqlite")
        try:
            return {v: {r[1] for r in c.execute(f"PRAGMA table_info({v})")}
                    for v in ("latest_proposals", "fleet_latest_proposals", "fleet_by_device")}
        finally:
            c.close()

    after = view_columns()
    assert set(INTERVAL) <= after["latest_proposals"]
    assert {"risk", "max_model_len_safe", "max_model_len_expected"} <= after["fleet_latest_proposals"]
    command.downgrade(alembic_config(url), "0010")
    before = view_columns()
    assert not set(INTERVAL) & (before["latest_proposals"] | before["fleet_latest_proposals"])
    assert before["fleet_by_device"] == after["fleet_by_device"] and "max_max_model_len" in before["fleet_by_device"]
    open_store(url).close()
    assert view_columns() == after


@pytest.mark.parametrize("i", range(7))
def test_readme_query_runs_on_postgresql(pg_profiled, con, i):
    queries = _readme_queries()
    if i >= len(queries):
        pytest.skip("fewer queries")
    with pg_profiled.connect() as c:
        pg_rows = [tuple(r) for r in c.exec_driver_sql(queries[i].replace("%", "%%"))]
    sqlite_rows = [tuple(r) for r in con.execute(queries[i]).fetchall()]
    assert len(pg_rows) == len(sqlite_rows), queries[i]
    if "unsafe" not in queries[i]:
        assert pg_rows, queries[i]


def test_views_agree_between_sqlite_and_postgresql(pg_profiled, con):
    sql = (f"SELECT drop_name, gpu_memory_utilization, max_model_len, kv_cache_tokens, {', '.join(INTERVAL)} "
           "FROM latest_proposals ORDER BY drop_name, gpu_memory_utilization")
    with pg_profiled.connect() as c:
        assert [tuple(r) for r in c.exec_driver_sql(sql)] == [tuple(r) for r in con.execute(sql).fetchall()]
    sql = "SELECT measured_run_id, num_gpu_blocks_residual, kv_cache_tokens_residual FROM measured_vs_simulated"
    with pg_profiled.connect() as c:
        assert [tuple(r) for r in c.exec_driver_sql(sql)] == [tuple(r) for r in con.execute(sql).fetchall()]


def _fleet_queries() -> list[str]:
    from tests._docs import section as doc_section

    section = doc_section("fleet.md", "Fleet SQL")
    return re.findall(r"```sql\n(.*?)```", section, flags=re.S)


@pytest.fixture
def fleet_store(db_url):
    """Two hosts of one device kind: host-a computed x (u 0.5, 0.9), host-b's y was answered from it,
    host-b's z is its own; one job of host-a still pending."""
    from tuner.store.fleet import register_owner
    from tuner.store.jobqueue import JobQueue

    store = open_store(db_url)
    qa = JobQueue(store, register_owner(store, "host-a", "/a", lease_s=60, gpus=[{"name": "NVIDIA H100 80GB HBM3"}]).id)
    qb = JobQueue(store, register_owner(store, "host-b", "/b", lease_s=60).id)

    def save(q, path, name, mml, src=None):
        job = q.enqueue(path, "1" * 64, "x")
        q.claim_next()
        drop = {"name": name, "path": path, "content_sha256": "1" * 64, "content": "x", "model": "m",
                "device_name": "H100-80GB", "engine_version": "0.19.0", "method": "simulate",
                "result_sha256": "k" * 64 if src is None or src else None, "answered_from_drop_id": src or None}
        props = [{"gpu_memory_utilization": u, "max_model_len": mml, "num_gpu_blocks": 100, "kv_cache_tokens": 1600,
                  "max_concurrency": 1.0, "vllm_args": f"--max-model-len {mml}", "reason": None} for u in (0.5, 0.9)]
        return store.save_result(drop, [], [], props, also=lambda c, i: q.complete_in(c, job.id, i))

    x = save(qa, "/a/x.yaml", "x", 8192)
    save(qb, "/b/y.yaml", "y", 8192, src=x)
    save(qb, "/b/z.yaml", "z", 4096, src=0)
    qa.enqueue("/a/w.yaml", "2" * 64, "w")
    yield store
    store.close()


def test_fleet_views_and_readme_fleet_queries(fleet_store):
    import sqlalchemy as sa

    queries = _fleet_queries()
    assert len(queries) >= 5
    with fleet_store.engine.connect() as c:
        for q in queries:
            assert c.execute(sa.text(q)).all(), q
        rows = c.execute(sa.text("SELECT host_id, drop_name, max_model_len, from_shared_result FROM "
                                 "fleet_latest_proposals WHERE gpu_memory_utilization = 0.9 ORDER BY host_id, drop_name")).all()
        assert [tuple(r) for r in rows] == [("host-a", "x", 8192, 0), ("host-b", "y", 8192, 1), ("host-b", "z", 4096, 0)]
        rows = c.execute(sa.text("SELECT device_name, gpu_memory_utilization, hosts, drops, min_max_model_len, "
                                 "max_max_model_len FROM fleet_by_device ORDER BY gpu_memory_utilization")).all()
        assert [tuple(r) for r in rows] == [("H100-80GB", 0.5, 2, 3, 4096, 8192), ("H100-80GB", 0.9, 2, 3, 4096, 8192)]
        jobs = c.execute(sa.text(queries[3])).all()
        assert [tuple(r) for r in jobs] == [("host-a", "done", 1), ("host-a", "pending", 1), ("host-b", "done", 2)]
        shared = c.execute(sa.text(queries[4])).all()
        assert [tuple(r) for r in shared] == [("y", "host-b", "x", "host-a")]
        gpus = c.execute(sa.text("SELECT gpus FROM hosts WHERE host_id = 'host-a'")).scalar()
        assert "H100" in gpus

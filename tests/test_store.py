"""tuner.store.database against real SQLite files and a real PostgreSQL server (``db_url`` fixture; the
PostgreSQL cases are skipped without CTX_TUNER_TEST_DATABASE_URL): schema, pragmas, round trips,
rollback, concurrency, migrations racing."""

from __future__ import annotations

import sqlite3
import time
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from tuner.errors import StoreError
from tuner.store.database import alembic_config, make_engine, metadata, open_store

BIG = 62_398_021_632  # > 2**32: must survive as an exact int

EXPECTED = {
    "drops": [
        "id", "name", "path", "content_sha256", "content", "model", "device_name",
        "engine_version", "method", "created_at", "retired_at", "warnings", "owner_id", "result_sha256",
        "answered_from_drop_id", "release_assumed",
    ],
    "profile_runs": [
        "id", "drop_id", "pass_sha256", "status", "error", "method", "engine_version", "era",
        "model", "model_config_sha256", "architecture", "plugin", "device_name",
        "device_total_memory_bytes", "dtype", "kv_cache_dtype", "tensor_parallel_size",
        "pipeline_parallel_size", "max_num_batched_tokens", "max_num_seqs", "num_sampled_rows",
        "weights_bytes", "activation_peak_bytes", "forward_peak_bytes", "sampler_peak_bytes",
        "tool_version", "torch_version", "transformers_version", "started_at", "elapsed_s",
        "gpu_memory_utilization", "max_model_len", "block_size", "non_torch_bytes",
        "cuda_graph_bytes", "available_kv_cache_bytes", "num_gpu_blocks", "kv_cache_tokens",
        "max_concurrency", "error_message", "source", "term_sources", "engine_check",
    ],
    "candidates": [
        "id", "drop_id", "profile_run_id", "gpu_memory_utilization", "max_model_len",
        "max_num_batched_tokens", "fits", "reason", "requested_memory_bytes", "weights_bytes",
        "activation_peak_bytes", "non_torch_bytes", "cuda_graph_bytes",
        "available_kv_cache_bytes", "num_gpu_blocks", "kv_cache_tokens", "max_concurrency",
        # revision 0010: the interval's ends
        "available_kv_cache_bytes_low", "available_kv_cache_bytes_high", "kv_cache_tokens_low",
        "kv_cache_tokens_high", "num_gpu_blocks_low", "num_gpu_blocks_high",
    ],
    "proposals": [
        "id", "drop_id", "gpu_memory_utilization", "max_model_len", "num_gpu_blocks",
        "kv_cache_tokens", "max_concurrency", "vllm_args", "reason", "created_at",
        # revision 0009: the proposed point's own numbers
        "max_num_batched_tokens", "requested_memory_bytes", "weights_bytes", "activation_peak_bytes",
        "non_torch_bytes", "cuda_graph_bytes", "available_kv_cache_bytes",
        # revision 0010: the interval's ends, the risk and both answers
        "available_kv_cache_bytes_low", "available_kv_cache_bytes_high", "kv_cache_tokens_low",
        "kv_cache_tokens_high", "risk", "max_model_len_safe", "max_model_len_expected",
    ],
    "jobs": [
        "id", "path", "content_sha256", "content", "status", "attempts", "error_type", "error",
        "drop_id", "worker_pid", "created_at", "started_at", "finished_at", "retired_at",
        "name", "failure_kind", "retry_at", "interruptions", "history", "owner_id",
    ],
    "hosts": [
        "id", "host_id", "watch_dir", "pid", "tool_version", "gpus", "started_at", "last_seen_at",
        "lease_expires_at",
    ],
    "pass_memo": [
        "id", "memo_key", "kind", "model_config_sha256", "tool_version", "method", "device_name", "era", "value",
        "created_at",
    ],
    "calibrations": [
        "id", "profile_run_id", "model", "model_config_sha256", "device_name", "era",
        "tensor_parallel_size", "pipeline_parallel_size", "dtype", "quantization",
        "predicted_activation_peak_bytes", "predicted_non_torch_bytes", "predicted_cuda_graph_bytes",
        "predicted_available_kv_cache_bytes", "activation_peak_delta_bytes", "non_torch_delta_bytes",
        "cuda_graph_delta_bytes", "total_delta_bytes", "kv_error_bytes", "predicted_num_gpu_blocks",
        "usable", "note",
        "created_at",
    ],
}
TABLES = list(EXPECTED)


def _url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'state' / 'tuner.sqlite'}"


@pytest.fixture
def store(tmp_path):
    s = open_store(_url(tmp_path), busy_timeout_s=0.2)
    yield s
    s.close()


@pytest.fixture
def any_store(db_url):
    """A migrated store on each backend (SQLite file, PostgreSQL database)."""
    s = open_store(db_url, busy_timeout_s=0.2)
    yield s
    s.close()


def _drop(name: str = "llama.yaml", sha: str = "a" * 64) -> dict:
    return {
        "name": name, "path": f"/drops/{name}", "content_sha256": sha,
        "content": "model: meta-llama/Llama-3.1-8B\n", "model": "meta-llama/Llama-3.1-8B",
        "device_name": "H100-80GB", "engine_version": "0.10.1", "method": "simulate",
    }


def _run(key, status: str = "ok", sha: str = "p" * 64) -> dict:
    return {
        "key": key, "pass_sha256": sha, "status": status, "method": "simulate",
        "engine_version": "0.10.1", "era": "v1", "model": "meta-llama/Llama-3.1-8B",
        "model_config_sha256": "c" * 64, "architecture": "LlamaForCausalLM", "plugin": "generic",
        "device_name": "H100-80GB", "device_total_memory_bytes": 85_520_809_984,
        "dtype": "bfloat16", "kv_cache_dtype": "auto", "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1, "max_num_batched_tokens": 8192, "max_num_seqs": 256,
        "num_sampled_rows": 256, "weights_bytes": 16_060_522_496,
        "activation_peak_bytes": 1_234_567_890, "forward_peak_bytes": BIG,
        "sampler_peak_bytes": 4_294_967_297, "tool_version": "0.1.0", "torch_version": None,
        "transformers_version": "4.45.0",
        "started_at": datetime(2025, 3, 1, 14, 0, 0, 250000, tzinfo=timezone(timedelta(hours=2))),
        "elapsed_s": 1.5,
    }


def _cand(run_key, mml: int = 65536, fits: bool = True) -> dict:
    return {
        "run_key": run_key, "gpu_memory_utilization": 0.9, "max_model_len": mml,
        "max_num_batched_tokens": 8192, "fits": fits, "reason": None if fits else "too long",
        "requested_memory_bytes": 76_968_728_985, "weights_bytes": 16_060_522_496,
        "activation_peak_bytes": 1_234_567_890, "non_torch_bytes": 536_870_912,
        "cuda_graph_bytes": 0, "available_kv_cache_bytes": BIG, "num_gpu_blocks": 476_059,
        "kv_cache_tokens": 7_616_944, "max_concurrency": 116.22,
    }


def _prop(mml: int | None = 65536) -> dict:
    return {
        "gpu_memory_utilization": 0.9, "max_model_len": mml, "num_gpu_blocks": 476_059,
        "kv_cache_tokens": 7_616_944, "max_concurrency": 116.22,
        "vllm_args": f"--max-model-len {mml} --gpu-memory-utilization 0.9", "reason": None,
    }


def _counts(url: str) -> dict[str, int]:
    eng = sa.create_engine(url)
    try:
        with eng.connect() as c:
            return {t: c.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar() for t in TABLES}
    finally:
        eng.dispose()


# -- schema --------------------------------------------------------------------------------------


def test_migration_creates_exactly_the_tables_and_columns(any_store, tmp_path):
    store = any_store
    if store.engine.dialect.name == "sqlite":
        assert (tmp_path / "state" / "tuner.sqlite").is_file()  # parent dir created
    insp = sa.inspect(store.engine)
    assert sorted(insp.get_table_names()) == sorted(TABLES + ["alembic_version"])
    for table, cols in EXPECTED.items():
        got = [c["name"] for c in insp.get_columns(table)]
        assert got == cols, table
        types = {c["name"]: c["type"] for c in insp.get_columns(table)}
        for name in cols:
            if name.endswith("_bytes"):
                assert isinstance(types[name], sa.BigInteger), (table, name)
    for table in ("profile_runs", "candidates", "proposals"):
        idx = {i["name"]: i["column_names"] for i in insp.get_indexes(table)}
        assert idx[f"ix_{table}_drop_id"] == ["drop_id"]
        fks = insp.get_foreign_keys(table)
        assert {"drops"} <= {fk["referred_table"] for fk in fks}
    idx = {i["name"]: i["column_names"] for i in insp.get_indexes("drops")}
    assert idx == {"ix_drops_content_sha256": ["content_sha256"], "ix_drops_owner_id": ["owner_id"],
                   "ix_drops_result_sha256": ["result_sha256"]}
    jidx = {i["name"]: (i["column_names"], bool(i["unique"])) for i in insp.get_indexes("jobs")}
    assert jidx["uq_jobs_pending_path"] == (["owner_id", "path"], True)
    with store.engine.connect() as c:
        from alembic.script import ScriptDirectory

        head = ScriptDirectory.from_config(alembic_config(str(store.engine.url))).get_current_head()
        assert head >= "0001"
        assert c.exec_driver_sql("SELECT version_num FROM alembic_version").scalar() == head


def test_migration_matches_store_metadata(any_store):
    with any_store.engine.connect() as c:
        ctx = MigrationContext.configure(c, opts={"compare_type": True})
        diffs = compare_metadata(ctx, metadata)
    assert diffs == []


def test_open_twice_is_idempotent(tmp_path):
    open_store(_url(tmp_path)).close()
    s = open_store(_url(tmp_path))
    try:
        with s.engine.connect() as c:
            assert c.exec_driver_sql("SELECT count(*) FROM alembic_version").scalar() == 1
    finally:
        s.close()


def test_default_path_used_when_url_is_none(tmp_path):
    path = tmp_path / "var" / "deep" / "x.sqlite"
    s = open_store(None, default_path=str(path))
    s.close()
    assert path.is_file()
    assert "drops" in sa.inspect(sa.create_engine(f"sqlite:///{path}")).get_table_names()


def test_downgrade_base_then_upgrade_head(any_store):
    store = any_store
    url = store.engine.url.render_as_string(hide_password=False)
    store.save_result(_drop(), [], [], [])
    store.close()
    command.downgrade(alembic_config(url), "base")
    eng = sa.create_engine(url)
    names = sa.inspect(eng).get_table_names()
    eng.dispose()
    assert [n for n in names if n != "alembic_version"] == []
    command.upgrade(alembic_config(url), "head")
    assert _counts(url) == dict.fromkeys(TABLES, 0)
    s = open_store(url)
    try:
        assert s.save_result(_drop(), [], [], []) == 1
    finally:
        s.close()


def test_migration_is_one_transaction(tmp_path):
    url = f"sqlite:///{tmp_path / 'tx.sqlite'}"
    eng = make_engine(url, foreign_keys=False)
    try:
        with eng.connect() as conn:
            tx = conn.begin()
            command.upgrade(alembic_config(url, connection=conn), "head")
            assert "proposals" in sa.inspect(conn).get_table_names()
            tx.rollback()  # DDL included: SQLite DDL is transactional under BEGIN
        assert sa.inspect(eng).get_table_names() == []
    finally:
        eng.dispose()


def test_unmigratable_url_raises_store_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StoreError) as ei:
        open_store(f"sqlite:///{blocker}/sub/db.sqlite")
    assert str(blocker) in ei.value.where


# -- connection set-up ---------------------------------------------------------------------------


def test_pragmas_in_effect(tmp_path):
    s = open_store(_url(tmp_path))  # default 30 s busy timeout
    try:
        with s.engine.connect() as c:
            pragma = lambda p: c.exec_driver_sql(f"PRAGMA {p}").scalar()  # noqa: E731
            assert pragma("journal_mode") == "wal"
            assert pragma("synchronous") == 2  # FULL
            assert pragma("busy_timeout") == 30000
            assert pragma("foreign_keys") == 1
    finally:
        s.close()


def test_write_transactions_begin_immediate(store, tmp_path):
    raw = sqlite3.connect(tmp_path / "state" / "tuner.sqlite", timeout=0, isolation_level=None)
    try:
        with store.engine.begin():  # no statement yet: BEGIN IMMEDIATE alone takes the lock
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                raw.execute("BEGIN IMMEDIATE")
        raw.execute("BEGIN IMMEDIATE")  # released on commit
        raw.execute("ROLLBACK")
    finally:
        raw.close()


def test_second_writer_waits_then_fails_with_store_error(store, tmp_path):
    raw = sqlite3.connect(tmp_path / "state" / "tuner.sqlite", timeout=0, isolation_level=None)
    try:
        raw.execute("BEGIN IMMEDIATE")
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="locked"):
            store.save_result(_drop(), [], [], [])
        assert time.monotonic() - t0 >= 0.15  # waited ~busy_timeout (0.2 s) first
        raw.execute("ROLLBACK")
    finally:
        raw.close()
    assert store.save_result(_drop(), [], [], []) == 1


def test_open_reader_does_not_block_writer(store, tmp_path):
    reader = sqlite3.connect(tmp_path / "state" / "tuner.sqlite", timeout=0, isolation_level=None)
    try:
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM drops").fetchone() == (0,)  # snapshot taken
        drop_id = store.save_result(_drop(), [_run("r")], [_cand("r")], [_prop()])  # no wait
        assert reader.execute("SELECT count(*) FROM drops").fetchone() == (0,)  # still snapshot
        reader.execute("COMMIT")
        assert reader.execute("SELECT id FROM drops").fetchall() == [(drop_id,)]
    finally:
        reader.close()


def test_readonly_open_cannot_write(store, tmp_path):
    url = _url(tmp_path)
    drop_id = store.save_result(_drop(), [], [], [_prop()])
    ro = open_store(url, readonly=True)
    try:
        assert [p["max_model_len"] for p in ro.latest_proposals()] == [65536]
        with pytest.raises(StoreError, match="readonly"):
            ro.save_result(_drop("other.yaml"), [], [], [])
        with ro.engine.connect() as c:
            with pytest.raises(sa.exc.OperationalError, match="readonly"):
                c.exec_driver_sql("DELETE FROM proposals")
    finally:
        ro.close()
    assert _counts(url) == {"drops": 1, "profile_runs": 0, "candidates": 0, "proposals": 1, "jobs": 0,
                            "calibrations": 0, "hosts": 0, "pass_memo": 0}
    assert store.latest_proposals(drop_id)[0]["drop_id"] == drop_id


def test_readonly_missing_file_raises(tmp_path):
    with pytest.raises(StoreError, match="cannot open"):
        open_store(f"sqlite:///{tmp_path / 'absent.sqlite'}", readonly=True)
    assert not (tmp_path / "absent.sqlite").exists()


# -- save_result and reads -----------------------------------------------------------------------


def test_save_result_round_trips(any_store):
    store = any_store
    runs = [_run("fwd"), _run("bad", status="failed", sha="q" * 64)]
    runs[1].update(error="CUDA OOM", weights_bytes=None, elapsed_s=0.25)
    drop_id = store.save_result(
        _drop(), runs, [_cand("fwd"), _cand(None, mml=131072, fits=False)], [_prop()]
    )
    assert drop_id == 1

    got_runs = store.runs_for_drop(drop_id)
    assert [r["status"] for r in got_runs] == ["ok", "failed"]
    r = got_runs[0]
    assert r["forward_peak_bytes"] == BIG and isinstance(r["forward_peak_bytes"], int)
    assert r["sampler_peak_bytes"] == 4_294_967_297
    assert r["device_total_memory_bytes"] == 85_520_809_984
    assert r["started_at"] == "2025-03-01T12:00:00.250000Z"  # +02:00 normalised to UTC
    assert r["elapsed_s"] == 1.5 and r["torch_version"] is None and r["drop_id"] == drop_id
    assert got_runs[1]["error"] == "CUDA OOM" and got_runs[1]["weights_bytes"] is None

    cands = store.candidates_for_drop(drop_id)
    assert [(c["max_model_len"], c["fits"], c["profile_run_id"]) for c in cands] == [
        (65536, True, r["id"]),
        (131072, False, None),
    ]
    assert cands[0]["available_kv_cache_bytes"] == BIG
    assert cands[0]["requested_memory_bytes"] == 76_968_728_985
    assert cands[1]["reason"] == "too long"

    (p,) = store.latest_proposals(drop_id)
    assert p["vllm_args"] == "--max-model-len 65536 --gpu-memory-utilization 0.9"
    assert p["drop_name"] == "llama.yaml" and p["kv_cache_tokens"] == 7_616_944
    assert len(p["created_at"]) == 27 and p["created_at"].endswith("Z")

    with store.engine.connect() as c:  # what a user's SQL sees: plain integers, typed INTEGER
        typeof = "typeof" if c.dialect.name == "sqlite" else "pg_typeof"
        row = c.exec_driver_sql(
            f"SELECT forward_peak_bytes, {typeof}(forward_peak_bytes)::text FROM profile_runs WHERE id = 1"
            if typeof == "pg_typeof" else
            "SELECT forward_peak_bytes, typeof(forward_peak_bytes) FROM profile_runs WHERE id = 1"
        ).one()
    assert tuple(row) == (BIG, "integer" if typeof == "typeof" else "bigint")


def test_find_run_returns_latest_ok(any_store):
    store = any_store
    assert store.find_run("p" * 64) is None
    store.save_result(_drop(), [_run(1)], [], [])
    second = store.save_result(_drop(), [_run(1)], [], [])
    store.save_result(_drop(), [_run(1, status="failed")], [], [])
    found = store.find_run("p" * 64)
    assert found["drop_id"] == second and found["status"] == "ok"
    assert found["forward_peak_bytes"] == BIG
    assert store.find_run("z" * 64) is None


def test_latest_proposals_newest_unretired_per_name(any_store):
    store = any_store
    store.save_result(_drop("a.yaml"), [], [], [_prop(4096)])
    a2 = store.save_result(_drop("a.yaml", sha="b" * 64), [], [], [_prop(8192)])
    b = store.save_result(_drop("b.yaml"), [], [], [_prop(None)])
    gone = store.save_result(_drop("c.yaml"), [], [], [_prop(2048)])
    with store.engine.begin() as c:
        c.execute(sa.text("UPDATE drops SET retired_at = :t WHERE id = :i"),
                  {"t": "2025-03-01T12:00:00.000000Z", "i": gone})
    got = [(p["drop_name"], p["drop_id"], p["max_model_len"]) for p in store.latest_proposals()]
    assert got == [("a.yaml", a2, 8192), ("b.yaml", b, None)]
    assert [p["max_model_len"] for p in store.latest_proposals(gone)] == [2048]


@pytest.mark.parametrize(
    "bad_last, match",
    [
        ({"proposals": [_prop(), {**_prop(), "max_len": 1}]}, "proposals.*'max_len'"),
        ({"proposals": [_prop(), {**_prop(), "gpu_memory_utilization": None}]}, "NOT NULL"),
        ({"candidates": [_cand("r"), _cand("nope")]}, "run_key 'nope'"),
        ({"runs": [_run("r"), {**_run("s"), "status": "maybe"}]}, "CHECK"),
        ({"runs": [_run("r"), {**_run("s"), "weights_bytes": 1.5e9}]}, "weights_bytes"),
        ({"runs": [_run("r"), _run("r")]}, "duplicate"),
    ],
)
def test_bad_row_rolls_back_everything(any_store, bad_last, match):
    store = any_store
    parts = {"runs": [_run("r")], "candidates": [_cand("r")], "proposals": [_prop()], **bad_last}
    match = {"NOT NULL": "NOT NULL|not-null", "CHECK": "CHECK|check constraint"}.get(match, match)
    with pytest.raises(StoreError, match=match):
        store.save_result(_drop(), parts["runs"], parts["candidates"], parts["proposals"])
    assert _counts(store.engine.url.render_as_string(hide_password=False)) == dict.fromkeys(TABLES, 0)
    # the store stays usable (SQLite reuses ids after a rollback; PostgreSQL sequences do not)
    assert store.save_result(_drop(), [_run("r")], [_cand("r")], [_prop()]) >= 1


def test_unknown_drop_key_names_table(any_store):
    store = any_store
    with pytest.raises(StoreError, match=r"drops: .*'colour'"):
        store.save_result({**_drop(), "colour": "red"}, [], [], [])
    with pytest.raises(StoreError, match=r"drops: .*'id'"):
        store.save_result({**_drop(), "id": 7}, [], [], [])


def test_naive_time_rejected(any_store):
    store = any_store
    run = {**_run("r"), "started_at": datetime(2025, 3, 1, 12, 0)}
    with pytest.raises(StoreError, match="timezone-aware"):
        store.save_result(_drop(), [run], [], [])


def test_db_option_errors_are_store_errors_not_tracebacks(tmp_path):
    """Regression: --db with a bad URL, a missing driver or ':memory:' raised raw SQLAlchemy errors."""
    from tuner.errors import StoreError
    from tuner.store.database import open_store

    for url in ("notaurl://", "postgresql+nosuchdriver://u@127.0.0.1:1/x", "sqlite:///", "sqlite:///:memory:"):
        with pytest.raises(StoreError):
            open_store(url)
    s = open_store(str(tmp_path / "plain.sqlite"))  # a plain path means a SQLite file
    s.close()
    assert (tmp_path / "plain.sqlite").exists()


def test_readonly_open_on_postgresql_reads_and_cannot_write(pg_url):
    """Regression: calibration was silently skipped on PostgreSQL — read-only opens were SQLite-only."""
    s = open_store(pg_url)
    s.save_result(_drop(), [], [], [_prop()])
    s.close()
    ro = open_store(pg_url, readonly=True)
    try:
        assert ro.readonly and [p["max_model_len"] for p in ro.latest_proposals()] == [65536]
        with pytest.raises(StoreError, match="read-only transaction"):
            ro.save_result(_drop("other.yaml"), [], [], [])
    finally:
        ro.close()


def test_readonly_open_of_an_unmigrated_postgresql_database_fails(pg_url):
    with pytest.raises(StoreError, match="cannot open"):
        open_store(pg_url, readonly=True)


def _migrate_in_child(url: str, q) -> None:
    try:
        open_store(url).close()
        q.put("ok")
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        q.put(f"{type(exc).__name__}: {exc}")


def test_five_processes_migrating_an_empty_postgresql_database_at_once_all_succeed(pg_url):
    """Regression: three processes migrating one empty database at once — two failed on a duplicate
    key. The upgrade now runs under a PostgreSQL advisory lock."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_migrate_in_child, args=(pg_url, q)) for _ in range(5)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert results == ["ok"] * 5
    eng = sa.create_engine(pg_url)
    try:
        with eng.connect() as c:
            assert c.exec_driver_sql("SELECT count(*) FROM alembic_version").scalar() == 1
    finally:
        eng.dispose()


def test_server_engines_ping_connections_before_use(pg_url):
    s = open_store(pg_url)
    try:
        assert s.engine.pool._pre_ping is True
    finally:
        s.close()


def test_concurrent_new_stores_in_one_process_migrate_without_alembic_proxy_race(tmp_path):
    """Alembic's ``op``/``context`` are process-global proxies: two threads migrating two new
    stores at once (the test suite's parallel profiles, the daemon's staging thread) once saw
    ``op`` as None mid-upgrade ("cannot migrate store: 'config'"). Upgrades in one process are
    serialised, so every store reaches head."""
    from concurrent.futures import ThreadPoolExecutor

    from tuner.store.storerules import script_head

    urls = [f"sqlite:///{tmp_path / f's{i}.db'}" for i in range(8)]

    def open_and_read(url):
        s = open_store(url)
        try:
            with s.engine.connect() as c:
                return c.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
        finally:
            s.close()

    with ThreadPoolExecutor(max_workers=8) as pool:
        versions = list(pool.map(open_and_read, urls))
    assert versions == [script_head()] * 8

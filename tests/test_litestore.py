"""The standard-library path to a SQLite store (:mod:`tuner.store.litestore`): it stores and reads
exactly what the SQLAlchemy store does, and declines every store it cannot vouch for (the caller
then opens :func:`tuner.store.database.open_store` as before)."""

from __future__ import annotations

import copy
import json
import sqlite3

import pytest

from tuner.store import litestore
from tuner.errors import StoreError
from tuner.store.database import open_store

#: Columns that differ between two runs of the same job by time alone.
_TIMES = {"created_at", "started_at", "elapsed_s"}
_TABLES = ("drops", "profile_runs", "candidates", "proposals", "pass_memo", "calibrations", "jobs")


def _dump(path) -> dict[str, list[dict]]:
    def row(r: sqlite3.Row) -> dict:
        out = {k: r[k] for k in r.keys() if k not in _TIMES}
        if "value" in out:  # a memo entry's JSON: its pass's elapsed_s is a time too
            out["value"] = {k: v for k, v in json.loads(out["value"]).items() if k not in _TIMES}
        return out

    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    try:
        return {t: [row(r) for r in conn.execute(f"SELECT * FROM {t} ORDER BY id")] for t in _TABLES}
    finally:
        conn.close()


def _drop(tmp_path, tiny_config, name: str, gmu=(0.9,)) -> str:
    d = tmp_path / f"{name}.yaml"
    d.write_text(f"name: {name}\nmodel: {tiny_config}\ndevice: H100-80GB\nengine_version: \"0.19.0\"\n"
                 f"max_num_batched_tokens: 2048\nmax_num_seqs: 64\n"
                 f"candidates:\n  gpu_memory_utilization: {list(gmu)}\n  max_model_len: [1024, 4096]\n")
    return str(d)


def _worker(request, **_kw) -> dict:
    """What a worker returns: the job in this process, through JSON as the pipe does."""
    from tuner.jobs.job import run_job

    return json.loads(json.dumps(run_job(copy.deepcopy(request))))


def _new_store(path) -> str:
    open_store(str(path)).close()  # created and migrated to head, as the first `profile` leaves it
    return str(path)


@pytest.fixture
def lite_calls(monkeypatch):
    """How many results went through the standard-library path."""
    calls = []
    real = litestore.LiteStore.save_result

    def spy(self, *a, **kw):
        calls.append(self.where)
        return real(self, *a, **kw)

    monkeypatch.setattr(litestore.LiteStore, "save_result", spy)
    return calls


def test_profile_through_the_lite_store_stores_the_rows_the_sqlalchemy_store_stores(tmp_path, tiny_config,
                                                                                    lite_calls):
    """The same jobs (a worker run, then a memo answer at other u) into two stores: one through
    SQLAlchemy (an explicit ``store_factory``), one through the standard library (the default):
    every row of every table is the same, times aside."""
    from tuner.jobs.app import profile

    a, b = _new_store(tmp_path / "a.sqlite"), _new_store(tmp_path / "b.sqlite")
    first, second = _drop(tmp_path, tiny_config, "tiny"), _drop(tmp_path, tiny_config, "tiny2", gmu=(0.5, 0.7))
    for drop in (first, second):
        via_sa = profile(drop, db_url=a, worker=_worker, store_factory=open_store)
        via_lite = profile(drop, db_url=b, worker=_worker)
        assert via_sa.drop_id == via_lite.drop_id
        assert via_sa.result["pass_source"] == via_lite.result["pass_source"]
    assert lite_calls == [f"sqlite:///{b}"] * 2  # both of b's results, none of a's
    assert via_lite.result["pass_source"]["source"] == "memo"
    got_a, got_b = _dump(a), _dump(b)
    assert got_a == got_b
    assert len(got_b["drops"]) == 2
    # the spec and the two passes (N 1024 for length 1024, 2048 for 4096), each stored once
    assert sorted(r["kind"] for r in got_b["pass_memo"]) == ["pass", "pass", "spec"]
    assert len(got_b["candidates"]) == 2 + 4 and len(got_b["proposals"]) == 1 + 2
    # the memo answer names the run that computed its pass, on both paths
    assert via_lite.result["pass_source"]["first_run_id"] == got_b["profile_runs"][0]["id"]


def test_memo_reads_agree_with_the_sqlalchemy_store(tmp_path, tiny_config):
    from tuner.jobs.app import profile

    db = _new_store(tmp_path / "s.sqlite")
    profile(_drop(tmp_path, tiny_config, "tiny"), db_url=db, worker=_worker)
    store, lite = open_store(db, readonly=True), litestore.open_lite(db, readonly=True)
    try:
        (cfg,), (ver,) = ({r["model_config_sha256"] for r in _dump(db)["pass_memo"]},
                          {r["tool_version"] for r in _dump(db)["pass_memo"]})
        entries = lite.memo_entries(cfg, ver)
        assert entries == store.memo_entries(cfg, ver) and len(entries) == 3  # the spec and two passes
        assert lite.memo_entries(cfg, "0.0.0") == {} == store.memo_entries(cfg, "0.0.0")
        runs = _dump(db)["profile_runs"]
        keys = [r["pass_sha256"] for r in runs] + ["f" * 64, ""]
        assert lite.first_runs(keys) == store.first_runs(keys) == {r["pass_sha256"]: (r["id"], 1) for r in runs}
        assert len(runs) == 2
        assert lite.first_runs([]) == {} and lite.calibration_rows(device_name="H100-80GB") == []
    finally:
        store.close()
        lite.close()


def test_lite_put_memo_keeps_a_stored_key_as_it_is(tmp_path):
    db = _new_store(tmp_path / "s.sqlite")
    entry = {"memo_key": "a" * 64, "kind": "pass", "model_config_sha256": "c" * 64, "tool_version": "9",
             "method": "simulate", "device_name": "H100-80GB", "era": "v1", "value": {"x": 1}}
    lite = litestore.open_lite(db)
    try:
        assert lite.put_memo([entry]) == 1
        assert lite.put_memo([{**entry, "value": {"x": 2}}, {**entry, "memo_key": "b" * 64}]) == 2
        assert lite.put_memo([]) == 0
    finally:
        lite.close()
    store = open_store(db, readonly=True)
    try:
        assert store.memo_entries("c" * 64, "9") == {"a" * 64: {"x": 1}, "b" * 64: {"x": 1}}
    finally:
        store.close()


@pytest.mark.parametrize("rows, message", [
    ({"runs": [{"key": 1, "bogus": 2}]}, "profile_runs: unknown or store-owned column 'bogus'"),
    ({"runs": [{"key": 1, "drop_id": 5}]}, "profile_runs: unknown or store-owned column 'drop_id'"),
    ({"runs": [{"key": 1, "weights_bytes": 1.5}]}, "profile_runs.weights_bytes must be an int of bytes, got 1.5"),
    ({"runs": [{"key": 1}, {"key": 1}]}, "profile_runs: duplicate run key 1"),
    ({"candidates": [{"run_key": 7}]}, "candidates: run_key 7 names no run"),
])
def test_lite_save_result_refuses_what_the_store_refuses_and_writes_nothing(tmp_path, rows, message):
    """Each bad row: the same StoreError text on both paths, and not one row written (the drop row
    before it rolled back too)."""
    from tuner.store.database import open_store as real

    a, b = _new_store(tmp_path / "a.sqlite"), _new_store(tmp_path / "b.sqlite")
    drop = {"name": "d", "content_sha256": "0" * 64, "content": "x", "model": "m", "device_name": "H100-80GB",
            "engine_version": "0.19.0", "method": "simulate"}
    base_run = {"pass_sha256": "1" * 64, "status": "ok", "method": "simulate", "engine_version": "0.19.0",
                "era": "v1", "model": "m", "device_name": "H100-80GB", "dtype": "bfloat16", "kv_cache_dtype": "auto",
                "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "max_num_batched_tokens": 8,
                "max_num_seqs": 1, "tool_version": "9", "started_at": "2026-12-02T00:00:00Z"}
    runs = [{**base_run, **r} for r in rows.get("runs", [])]
    errors = []
    for store in (real(a), litestore.open_lite(b)):
        try:
            with pytest.raises(StoreError) as exc:
                store.save_result(drop, runs, rows.get("candidates", []), [])
            errors.append(exc.value.message)
        finally:
            store.close()
    assert errors == [message, message]
    assert all(not rows for rows in _dump(b).values())


def test_open_lite_declines_every_store_it_cannot_vouch_for(tmp_path):
    db = _new_store(tmp_path / "s.sqlite")
    assert isinstance(litestore.open_lite(db), litestore.LiteStore)
    assert litestore.open_lite(str(tmp_path / "missing.sqlite")) is None
    assert not (tmp_path / "missing.sqlite").exists()  # never created
    assert litestore.open_lite("postgresql+psycopg://u@h/db") is None
    assert litestore.open_lite(f"sqlite:///{db}?timeout=5") is None  # options: SQLAlchemy's to read
    other = tmp_path / "other.sqlite"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    assert litestore.open_lite(str(other)) is None  # someone else's database
    (tmp_path / "text.sqlite").write_text("not a database")
    assert litestore.open_lite(str(tmp_path / "text.sqlite")) is None
    conn = sqlite3.connect(db)
    conn.execute("INSERT INTO calibrations (profile_run_id, model, device_name, era, tensor_parallel_size, "
                 "pipeline_parallel_size, dtype, usable, created_at) VALUES (1, 'm', 'H100-80GB', 'v1', 1, 1, "
                 "'bfloat16', 1, '2026-12-02T00:00:00.000000Z')")
    conn.commit()
    conn.close()
    assert litestore.open_lite(db) is None  # a correction may apply: calibration_for decides, via SQLAlchemy
    lite = litestore.open_lite(db, calibrate=False)
    assert lite is not None
    lite.close()
    conn = sqlite3.connect(db)
    conn.execute("UPDATE alembic_version SET version_num = '0007'")
    conn.commit()
    conn.close()
    assert litestore.open_lite(db, calibrate=False) is None  # not at head: open_store migrates it


@pytest.mark.parametrize("url, path", [
    (None, litestore.DEFAULT_PATH), ("var/x.sqlite", "var/x.sqlite"), ("sqlite:///rel/x.db", "rel/x.db"),
    ("sqlite:////abs/x.db", "/abs/x.db"), ("sqlite://", None), ("sqlite:///:memory:", None),
    ("sqlite+pysqlite:///x.db", None), ("sqlite:///a%20b.db", None), ("postgresql://h/db", None),
])
def test_sqlite_file_reads_a_url_as_open_store_does_or_not_at_all(url, path):
    assert litestore.sqlite_file(url) == path
    if path is not None:  # what SQLAlchemy makes of the same URL
        from tuner.store.database import _resolve_url

        assert _resolve_url(url, litestore.DEFAULT_PATH).database == path


def test_profile_falls_back_to_sqlalchemy_for_a_store_with_calibrations(tmp_path, tiny_config, lite_calls):
    from tuner.jobs.app import profile

    db = _new_store(tmp_path / "s.sqlite")
    conn = sqlite3.connect(db)
    conn.execute("INSERT INTO calibrations (profile_run_id, model, device_name, era, tensor_parallel_size, "
                 "pipeline_parallel_size, dtype, usable, created_at) VALUES (1, 'other', 'A100-80GB', 'v1', 1, 1, "
                 "'bfloat16', 1, '2026-12-02T00:00:00.000000Z')")
    conn.commit()
    conn.close()
    out = profile(_drop(tmp_path, tiny_config, "tiny"), db_url=db, worker=_worker)
    assert lite_calls == [] and out.drop_id == 1 and out.result["calibration"] is None
    out = profile(_drop(tmp_path, tiny_config, "tiny2"), db_url=db, worker=_worker, calibrate=False)
    assert lite_calls == [f"sqlite:///{db}"] and out.drop_id == 2  # no calibration asked for: the lite path


def test_profile_of_a_new_store_waited_for_alembic_after_the_job(tmp_path, tiny_config, monkeypatch):
    """A new store was created and migrated (SQLAlchemy, Alembic: ~0.1 s plus ~0.4 s of imports)
    only after the worker's reply. It is made in a thread started before the worker, under a
    temporary name, and linked into place once the job succeeded; nothing is left beside it. An
    existing store starts no such thread."""
    from tuner.jobs import app

    events = []
    real = app.make_new_store

    def spy(url):
        events.append("new store started")
        return real(url)

    def worker(request, **kw):
        events.append("worker")
        return _worker(request, **kw)

    monkeypatch.setattr(app, "make_new_store", spy)
    db = tmp_path / "new.sqlite"
    out = app.profile(_drop(tmp_path, tiny_config, "tiny"), db_url=str(db), worker=worker)
    assert events == ["new store started", "worker"] and out.drop_id == 1
    assert sorted(p.name for p in tmp_path.iterdir() if "new" in p.name) == ["new.sqlite"]
    assert len(_dump(db)["drops"]) == 1
    events.clear()
    app.profile(_drop(tmp_path, tiny_config, "tiny2", gmu=(0.8,)), db_url=str(db), worker=worker)
    assert events == []  # the store exists (and the memo answers): nothing to make, no worker


def test_failed_job_leaves_no_new_store_behind(tmp_path, tiny_config):
    from tuner.jobs import app
    from tuner.errors import WorkerError

    def worker(request, **kw):
        raise WorkerError("the pass crashed", where="tiny")

    with pytest.raises(WorkerError):
        app.profile(_drop(tmp_path, tiny_config, "tiny"), db_url=str(tmp_path / "new.sqlite"), worker=worker)
    assert [p.name for p in tmp_path.iterdir() if p.suffix in (".sqlite", ".new") or ".sqlite" in p.name] == []


def test_stage_new_store_links_a_migrated_store_into_place_and_never_over_a_file(tmp_path):
    from tuner.store.database import stage_new_store

    target = tmp_path / "s.sqlite"
    staged = stage_new_store(str(target))
    assert staged is not None and staged.tmp.parent == tmp_path and staged.tmp.name.startswith(".s.sqlite.")
    assert not target.exists()  # nothing at the store's path until it is adopted
    assert staged.adopt() is True
    assert [p.name for p in tmp_path.iterdir()] == ["s.sqlite"]
    lite = litestore.open_lite(str(target))  # at the scripts' head
    assert lite is not None
    lite.close()
    other = tmp_path / "o.sqlite"
    staged = stage_new_store(str(other))
    other.write_bytes(b"someone else's")  # appeared while the job ran
    assert staged.adopt() is False and other.read_bytes() == b"someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.sqlite", "s.sqlite"]
    assert stage_new_store(str(target)) is None  # exists already
    assert stage_new_store(str(tmp_path / "no-such-dir" / "x.sqlite")) is None  # its directory is made on success
    assert stage_new_store("postgresql+psycopg://u@h/db") is None


def test_import_all_stops_at_the_first_failure_and_raises_nothing(tmp_path, monkeypatch):
    import sys

    from tuner.jobs.app import import_all

    (tmp_path / "ctx_warm_probe.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ctx_warm_probe", raising=False)
    assert import_all("ctx_no_such_module_xyz", "ctx_warm_probe") is False
    assert "ctx_warm_probe" not in sys.modules  # the failure stopped the list
    assert import_all("ctx_warm_probe") is True
    assert sys.modules["ctx_warm_probe"].VALUE == 42

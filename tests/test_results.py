"""``ctx-tuner results``: latest proposals, fit surfaces and runs, read back as numbers."""

from __future__ import annotations

import csv
import io
import json
import sqlite3

import pytest

from tests._results_db import profiled_db
from tests._cli_helpers import run_cli as _cli




@pytest.fixture(scope="module")
def db():
    return str(profiled_db())


def _sql(db, q, *args):
    con = sqlite3.connect(db)
    try:
        return con.execute(q, args).fetchall()
    finally:
        con.close()


def test_json_matches_the_store(db):
    rc, out, err = _cli("results", "--db", db, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    stored = _sql(db, "SELECT d.name, p.gpu_memory_utilization, p.max_model_len, p.num_gpu_blocks, p.kv_cache_tokens "
                      "FROM proposals p JOIN drops d ON d.id = p.drop_id ORDER BY d.id, p.gpu_memory_utilization")
    got = [(p["drop_name"], p["gpu_memory_utilization"], p["max_model_len"], p["num_gpu_blocks"], p["kv_cache_tokens"])
           for p in doc["proposals"]]
    assert sorted(got) == sorted(stored) and len(got) == 4  # V0: one gmu; H100: three
    h100 = {p["gpu_memory_utilization"]: p for p in doc["proposals"] if p["drop_name"] == "llama-3.1-8b-h100"}
    assert h100[0.95]["max_model_len"] == 131072 and abs(h100[0.95]["num_gpu_blocks"] - 29751) / 29751 < 0.02
    # runs: every pass of the latest drops plus the imported start-up; bytes stay ints
    n_runs, = _sql(db, "SELECT COUNT(*) FROM profile_runs")[0]
    assert len(doc["runs"]) == n_runs
    imported = [r for r in doc["runs"] if r["method"] == "import"]
    assert len(imported) == 1 and imported[0]["num_gpu_blocks"] == 1478 and imported[0]["kv_cache_tokens"] == 23648
    assert all(isinstance(r["weights_bytes"], int) for r in doc["runs"])


def test_non_monotone_surface_is_flagged(db):
    rc, out, _ = _cli("results", "--db", db, "--json", "--device", "3090")
    doc = json.loads(out)
    [surface] = doc["surfaces"]
    assert surface["gpu_memory_utilization"] == 0.9 and surface["non_monotone"] is True
    assert [(p["max_model_len"], p["fits"]) for p in surface["points"]] == [(20000, True), (29000, False), (35000, True)]
    rc, text, _ = _cli("results", "--db", db, "--device", "3090")
    assert rc == 0
    line = next(x for x in text.splitlines() if "gmu 0.90" in x)
    assert "20000:yes 29000:NO 35000:yes" in line and "NOT monotone" in line
    assert "llama-3.1-8b-h100" not in text  # filtered by device


def test_filters_are_case_insensitive_substrings(db):
    rc, out, _ = _cli("results", "--db", db, "--json", "--model", "LLAMA-3.1-8B", "--device", "h100")
    doc = json.loads(out)
    assert {p["drop_name"] for p in doc["proposals"]} == {"llama-3.1-8b-h100"}
    assert all(r["device_name"] == "H100-80GB" for r in doc["runs"])
    rc, out, _ = _cli("results", "--db", db, "--json", "--model", "no-such-model")
    assert json.loads(out)["proposals"] == [] and rc == 0


@pytest.mark.parametrize("table, key", [("proposals", "max_model_len"), ("candidates", "num_gpu_blocks"),
                                        ("runs", "activation_peak_bytes")])
def test_csv_tables(db, table, key):
    rc, out, _ = _cli("results", "--db", db, "--csv", "--table", table)
    assert rc == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    src = {"proposals": "proposals", "candidates": "candidates", "runs": "profile_runs"}[table]
    assert len(rows) == _sql(db, f"SELECT COUNT(*) FROM {src}")[0][0]
    values = sorted(int(r[key]) for r in rows if r[key])
    assert values == sorted(v for (v,) in _sql(db, f"SELECT {key} FROM {src} WHERE {key} IS NOT NULL"))


def test_missing_store_exits_1(tmp_path):
    rc, _, err = _cli("results", "--db", str(tmp_path / "none.sqlite"))
    assert rc == 1 and "no results store" in err


def test_json_and_csv_are_exclusive(db):
    rc, _, _ = _cli("results", "--db", db, "--json", "--csv")
    assert rc == 2


def test_worker_relays_progress_lines_and_still_times_out(tmp_path):
    import os
    import sys

    from tuner.errors import WorkerTimeout
    from tuner.seam.worker import PROGRESS_PREFIX, run_in_worker

    fake = tmp_path / "fakepy"
    code = (f"import sys, time; sys.stdin.read(); print({PROGRESS_PREFIX!r} + 'u 0.9 done', file=sys.stderr, flush=True); "
            "print('other noise', file=sys.stderr, flush=True); time.sleep(60)")
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"{code}\"\n")
    os.chmod(fake, 0o755)
    got = []
    with pytest.raises(WorkerTimeout):
        run_in_worker({}, job="j", timeout_s=1.0, python=str(fake), on_progress=got.append)
    assert got == ["u 0.9 done"]


def test_reading_commands_never_import_torch(db, tmp_path):
    import subprocess
    import sys

    # run 1 depends on which example finished first (they are profiled in two threads): take a
    # V1 simulate run, which has candidates at every length
    run_id = _sql(db, "SELECT r.id FROM profile_runs r JOIN drops d ON d.id = r.drop_id "
                      "WHERE d.name = 'llama-3.1-8b-h100' AND r.method = 'simulate' ORDER BY r.id LIMIT 1")[0][0]
    code = (
        "import sys, io, contextlib\n"
        "from tuner.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['results', '--db', {db!r}, '--json']) == 0\n"
        f"    assert main(['explain', '--run', '{run_id}', '--db', {db!r}, '--json']) == 0\n"
        f"    assert main(['plot', '--model', 'llama', '--db', {db!r}, '-o', {str(tmp_path / 'p.png')!r}]) == 0\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


_INTERVAL = ("risk", "max_model_len_safe", "max_model_len_expected", "kv_cache_tokens_low", "kv_cache_tokens_high",
             "available_kv_cache_bytes_low", "available_kv_cache_bytes_high")


def test_proposals_show_the_interval(db):
    """JSON, CSV and text carry each proposal's risk, both answers and the KV ends as stored (revision 0010)."""
    stored = {(n, u): dict(zip(_INTERVAL, rest)) for n, u, *rest in _sql(
        db, f"SELECT d.name, p.gpu_memory_utilization, {', '.join('p.' + c for c in _INTERVAL)} "
            "FROM proposals p JOIN drops d ON d.id = p.drop_id")}
    v0 = stored[("llama-3.1-8b-rtx3090-v0", 0.9)]
    # the V0 example at the safe end (docs/uncertainty.md): 37968 there, 40064 at the expected value
    assert v0["risk"] == "safe" and v0["max_model_len_safe"] == 37968 and v0["max_model_len_expected"] == 40064
    assert v0["kv_cache_tokens_low"] == 37968 < v0["kv_cache_tokens_high"]
    rc, out, err = _cli("results", "--db", db, "--json")
    assert rc == 0, err
    got = {(p["drop_name"], p["gpu_memory_utilization"]): {k: p[k] for k in _INTERVAL}
           for p in json.loads(out)["proposals"]}
    assert got == stored
    rc, out, _ = _cli("results", "--db", db, "--csv")
    rows = {(r["drop_name"], float(r["gpu_memory_utilization"])): r for r in csv.DictReader(io.StringIO(out))}
    assert {k: rows[("llama-3.1-8b-rtx3090-v0", 0.9)][k] for k in _INTERVAL} == {k: str(v) for k, v in v0.items()}
    rc, text, _ = _cli("results", "--db", db, "--device", "3090")
    head = next(x for x in text.splitlines() if x.strip().startswith("drop "))
    line = next(x for x in text.splitlines() if x.strip().startswith("llama-3.1-8b-rtx3090-v0"))
    assert head.split()[-6:] == ["risk", "safe", "expected", "KV", "tokens", "low-high"]
    assert line.split()[-4:] == ["safe", "37968", "40064", f"37968-{v0['kv_cache_tokens_high']}"]


def test_proposals_stored_before_the_interval_show_blanks(db, tmp_path):
    import shutil

    old = tmp_path / "old.sqlite"
    shutil.copy(db, old)
    con = sqlite3.connect(old)
    with con:
        con.execute(f"UPDATE proposals SET {', '.join(c + ' = NULL' for c in _INTERVAL)}")
    con.close()
    rc, out, _ = _cli("results", "--db", str(old), "--json", "--device", "3090")
    [p] = json.loads(out)["proposals"]
    assert rc == 0 and p["max_model_len"] == 37968 and all(p[k] is None for k in _INTERVAL)
    rc, out, _ = _cli("results", "--db", str(old), "--csv")
    assert all(r[k] == "" for r in csv.DictReader(io.StringIO(out)) for k in _INTERVAL)
    rc, text, _ = _cli("results", "--db", str(old), "--device", "3090")
    line = next(x for x in text.splitlines() if x.strip().startswith("llama-3.1-8b-rtx3090-v0"))
    assert rc == 0 and line.split()[-4:] == ["-", "-", "-", "-"]

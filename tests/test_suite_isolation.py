"""The test suite leaves the checkout as it found it (fresh-user finding F10): during pytest the
README's store, ``var/ctx-tuner.sqlite`` in the checkout, gained pass-memo rows (``explain`` run
by the tests in the checkout's directory), so the README's "store: none" and "drop id 1 (created
now" samples no longer held. And ``explain`` wrote those rows without a word: its report now has
a ``store:`` line as ``check``'s has."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, checkout_state, checkout_writes
from tests._cli_helpers import run_cli


def _drop(tmp_path: Path, model: Path, extra: str = "") -> Path:
    drop = tmp_path / f"d{len(extra)}.yaml"
    drop.write_text(f"name: d\nmodel: {model}\ndevice: H100-80GB\n{extra}"
                    "candidates: {gpu_memory_utilization: [0.5], max_model_len: [1024]}\n")
    return drop


def _memo_rows(db: Path) -> int:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT count(*) FROM pass_memo").fetchone()[0]
    finally:
        con.close()


def _store_line(out: str) -> str:
    [line] = [ln for ln in out.splitlines() if ln.startswith("store: ")]
    return line


@pytest.mark.slow
def test_test_suite_wrote_into_the_checkouts_store(tmp_path, tiny_config):
    """profile and explain without --db, as the README runs them, write their default store under the
    test's own directory (tests/conftest.py), never into the checkout's var/ nor any other file."""
    cwd = Path.cwd().resolve()
    assert REPO.resolve() not in (cwd, *cwd.parents)  # every test runs outside the checkout
    before = checkout_state()
    drop = _drop(tmp_path, tiny_config)
    rc, out, err = run_cli("profile", str(drop))
    assert rc == 0, err
    assert out.splitlines()[-1] == (f"stored as drop id 1 in var/ctx-tuner.sqlite under {Path.cwd()} "
                                    "(created now; --db names another store)")
    rc, out, err = run_cli("explain", str(drop), "-m", "2048", "--no-variants", "--quiet")
    assert rc == 0, err
    assert _store_line(out).startswith(f"store: {Path.cwd() / 'var' / 'ctx-tuner.sqlite'} (its pass memo read; ")
    assert (Path.cwd() / "var" / "ctx-tuner.sqlite").is_file()
    assert checkout_writes(before, checkout_state()) == []


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_checkout_writes_named_a_store_row_and_a_new_file(tmp_path):
    """The session guard (tests/conftest.py ``_checkout_left_as_found``) sees a store written in
    var/ (rows change its size and mtime; a -wal appears) and a file added to the checkout, and not
    a file the developer had changed before the run."""
    repo = tmp_path / "repo"
    (repo / "var").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("var/\n")
    (repo / "mine.txt").write_text("changed before the run\n")
    db = repo / "var" / "ctx-tuner.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE pass_memo (memo_key TEXT)")
    con.commit()
    before = checkout_state(repo)
    assert checkout_writes(before, checkout_state(repo)) == []
    con.execute("INSERT INTO pass_memo VALUES ('k')")
    con.commit()
    con.close()
    (repo / "var" / "ctx-tuner.sqlite-wal").write_bytes(b"")
    (repo / "proposal.yaml").write_text("x\n")
    (repo / "mine.txt").write_text("changed again\n")
    assert checkout_writes(before, checkout_state(repo)) == [
        "var/ctx-tuner.sqlite", "var/ctx-tuner.sqlite-wal", "?? proposal.yaml"]


@pytest.mark.slow
def test_explain_wrote_pass_memo_rows_without_saying_so(tmp_path, tiny_config):
    """explain stores the passes its worker jobs computed in the store's pass memo (where the store
    exists): its report says which store it read and how many entries it wrote, as check's does."""
    drop = _drop(tmp_path, tiny_config)
    other = _drop(tmp_path, tiny_config, "max_num_batched_tokens: 1536\n")  # a profile batch of its own: new passes
    db = Path.cwd() / "var" / "ctx-tuner.sqlite"
    explain = ("explain", str(other), "-m", "2048", "--no-variants", "--quiet")
    rc, out, err = run_cli(*explain)
    assert rc == 0, err
    assert _store_line(out) == "store: none (var/ctx-tuner.sqlite does not exist here; nothing read or written)"
    assert not db.parent.exists()  # the memo never creates a store
    assert run_cli("profile", str(drop))[0] == 0
    stored = _memo_rows(db)
    rc, out, err = run_cli(*explain)
    assert rc == 0, err
    wrote = _memo_rows(db) - stored
    assert wrote > 0
    assert _store_line(out) == f"store: {db} (its pass memo read; {wrote} pass-memo entr{'y' if wrote == 1 else 'ies'} written)"
    rc, out, err = run_cli(*explain, "--json")  # asked again: every pass from the memo, nothing new
    doc = json.loads(out)
    assert doc["store"] == {"path": str(db), "named": "var/ctx-tuner.sqlite", "read": "pass memo",
                            "pass_memo_entries_written": 0}
    assert _memo_rows(db) == stored + wrote
    rc, out, err = run_cli(*explain, "--no-cache")  # passes recomputed, their keys already stored
    assert _store_line(out) == f"store: {db} (its pass memo not read (--no-cache); nothing written)"
    missing = tmp_path / "none.sqlite"
    rc, out, err = run_cli(*explain, "--db", str(missing))
    assert _store_line(out) == f"store: none (--db {missing} does not exist; nothing read or written)"
    assert not missing.exists()
    run_id = sqlite3.connect(db).execute("SELECT min(profile_run_id) FROM candidates").fetchone()[0]
    rc, out, err = run_cli("explain", "--run", str(run_id))
    assert rc == 0, err
    assert _store_line(out) == f"store: {db} (profile run {run_id} read; nothing written)"

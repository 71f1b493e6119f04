"""Drop-directory scanning, name filtering and debounce timing (an injected clock, no sleeps)."""

from __future__ import annotations

import hashlib
import os

import pytest

from tuner.daemon.watch import Debouncer, is_drop_name, is_drop_path, scan


@pytest.mark.parametrize("name, ok", [
    ("a.yaml", True), ("team-b.v2.yaml", True), ("a.yml", True), ("a.yaml~", False), (".a.yaml.swp", False),
    ("a.yaml.swp", False), ("#a.yaml#", False), (".#a.yaml", False), (".a.yaml", False), ("a.yaml.tmp", False),
    ("4913", False), ("a.yaml.dpkg-new", False), (".yaml", False), ("a.YAML", True), ("~a.yaml", False),
])
def test_drop_names(name, ok):
    assert is_drop_name(name) is ok


def test_hidden_directories_are_not_drops(tmp_path):
    assert is_drop_path(str(tmp_path / "team" / "a.yaml"), str(tmp_path))
    assert not is_drop_path(str(tmp_path / ".git" / "a.yaml"), str(tmp_path))
    assert not is_drop_path(str(tmp_path.parent / "a.yaml"), str(tmp_path))


def test_scan_hashes_content_and_reports_path_tricks(tmp_path):
    root = tmp_path / "conf.d"
    (root / "sub").mkdir(parents=True)
    (root / "a.yaml").write_bytes(b"name: a\n")
    (root / "sub" / "b.yaml").write_bytes(b"name: b\n")
    (root / "dir.yaml").mkdir()  # a directory named like a drop is walked, not read
    (root / "dir.yaml" / "c.yaml").write_bytes(b"name: c\n")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.yaml").write_bytes(b"x")
    os.mkfifo(root / "fifo.yaml")
    (tmp_path / "outside.yaml").write_text("secret")
    (root / "out.yaml").symlink_to(tmp_path / "outside.yaml")
    (root / "in.yaml").symlink_to(root / "a.yaml")
    (root / "linkdir").symlink_to(tmp_path)  # symlinked directories are not entered
    sc = scan(str(root))
    assert sc.ok and sc.settling == set()
    got = {os.path.relpath(p, root): st for p, st in sc.files.items()}
    assert sorted(got) == ["a.yaml", "dir.yaml/c.yaml", "fifo.yaml", "in.yaml", "out.yaml", "sub/b.yaml"]
    assert got["a.yaml"].sha256 == hashlib.sha256(b"name: a\n").hexdigest() and got["a.yaml"].raw == b"name: a\n"
    assert got["in.yaml"].raw == b"name: a\n"  # a symlink inside the directory is followed
    assert "not a regular file" in got["fifo.yaml"].error and got["fifo.yaml"].raw is None
    assert "outside the watched directory" in got["out.yaml"].error and got["out.yaml"].raw is None
    # an error state has a stable identity, so a rescan does not record it again
    assert scan(str(root)).files[str(root / "fifo.yaml")].sha256 == got["fifo.yaml"].sha256


def test_files_still_being_written_are_settling_and_a_missing_dir_is_not_ok(tmp_path):
    (tmp_path / "a.yaml").write_text("x")
    mtime = os.stat(tmp_path / "a.yaml").st_mtime
    sc = scan(str(tmp_path), now=mtime + 0.1, settle_s=0.5)
    assert sc.settling == {str(tmp_path / "a.yaml")} and sc.files == {}
    assert list(scan(str(tmp_path), now=mtime + 0.6, settle_s=0.5).files) == [str(tmp_path / "a.yaml")]
    assert list(scan(str(tmp_path), now=mtime - 3600, settle_s=0.5).files)  # a future mtime never settles
    missing = scan(str(tmp_path / "nope"))
    assert not missing.ok and "does not exist" in missing.problem


def test_debouncer_waits_for_quiet_but_not_forever():
    d = Debouncer(quiet_s=0.5, max_delay_s=2.0)
    assert not d.pending and d.deadline() is None and not d.due(100.0)
    d.hint(10.0)
    assert d.deadline() == 10.5 and not d.due(10.4) and d.due(10.5)
    d.hint(10.3)
    assert d.deadline() == 10.8
    for t in (10.6, 11.0, 11.4, 11.8):  # a directory that never goes quiet
        d.hint(t)
    assert d.deadline() == 12.0 and d.due(12.0)
    d.clear()
    assert not d.pending and not d.due(99.0)

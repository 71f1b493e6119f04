"""Small failures found by a fresh-user test (issue 17 follow-up), one regression test each."""

from __future__ import annotations

import pytest

from tests.test_daemon import Harness


@pytest.fixture
def h(tmp_path, tiny_config):
    harness = Harness(tmp_path, tiny_config)
    yield harness
    harness.close()


def test_invalid_drop_job_stored_with_null_name(h):
    d = h.start()
    (h.conf / "bad.yaml").write_text("name: bad-name\nmodel: [1, 2]\n")  # YAML mapping, invalid drop
    (h.conf / "garbage.yaml").write_text("name: [unclosed\n")  # not YAML at all
    (h.conf / "listy.yaml").write_text("- name: x\n")  # YAML, not a mapping
    h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'failed'") == [(3,)], what="3 failed")
    rows = dict(h.rows("SELECT path, name FROM jobs"))
    assert rows == {str(h.conf / "bad.yaml"): "bad-name", str(h.conf / "garbage.yaml"): "garbage",
                    str(h.conf / "listy.yaml"): "listy"}


def test_devices_command_missing_from_readme_commands():
    """Every subcommand of the CLI is named in the README's "Commands" section."""
    import argparse

    from tests.conftest import REPO
    from tuner.cli import build_parser

    text = (REPO / "README.md").read_text()
    section = text.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [name for name in sub.choices if f"`{name}`" not in section and f"ctx-tuner {name}" not in section]
    assert missing == []
    assert "ctx-tuner devices [--json]" in section


def test_profile_db_in_missing_directory_was_created_silently(tmp_path, tiny_config, capsys):
    from tuner.cli import main

    drop = tmp_path / "d.yaml"
    drop.write_text(f"name: d\nmodel: {tiny_config}\ndevice: H100-80GB\n")
    db = tmp_path / "no" / "such" / "dir" / "r.sqlite"
    assert main(["profile", str(drop), "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert f"directory {db.parent} does not exist" in err
    assert not (tmp_path / "no").exists()
    assert main(["profile", str(drop), "--db", f"sqlite:///{db}"]) == 2  # the URL form too
    assert not (tmp_path / "no").exists()

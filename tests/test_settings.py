"""Daemon settings: the one table, the file loader's typed errors, the README table."""

from __future__ import annotations

from dataclasses import fields

import pytest

from tests.conftest import REPO
from tuner.errors import SettingsError
from tuner.settings import SETTINGS, Settings, load_settings, settings_markdown

REQUIRED_BY_ISSUE = ("watch_dir", "database_url", "state_dir", "job_timeout_s", "rescan_interval_s", "log_level",
                     "allow_trust_remote_code", "default_method")


def test_table_declares_every_setting_once_with_default_and_help():
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    assert set(REQUIRED_BY_ISSUE) <= set(names)
    assert names == [f.name for f in fields(Settings) if f.name != "source"]
    for s in SETTINGS:
        assert getattr(Settings(), s.name) == s.default and s.help.strip(), s.name
    assert Settings().allow_trust_remote_code is False


def test_readme_renders_the_settings_table():
    readme = (REPO / "README.md").read_text()
    assert settings_markdown() in readme
    missing = [s.name for s in SETTINGS if f"`{s.name}`" not in readme]
    assert missing == []


def test_example_settings_file_is_valid_and_complete():
    s = load_settings(REPO / "configs" / "tuner.yaml")
    text = (REPO / "configs" / "tuner.yaml").read_text()
    assert [n.name for n in SETTINGS if f"{n.name}:" not in text] == []
    assert s.watch_dir == "/etc/ctx-tuner/conf.d" and s.state_dir == "/var/lib/ctx-tuner"


def test_load_resolves_relative_paths_and_derived_defaults(tmp_path):
    p = tmp_path / "tuner.yaml"
    p.write_text("watch_dir: conf.d\nstate_dir: state\njob_timeout_s: 30\nlog_level: debug\n"
                 "allow_trust_remote_code: true\ndefault_method: AUTO\n")
    s = load_settings(p)
    assert s.watch_dir == str(tmp_path / "conf.d") and s.state_dir == str(tmp_path / "state")
    assert s.db_url == str(tmp_path / "state" / "ctx-tuner.sqlite")
    assert s.snapshot_file == tmp_path / "state" / "ctx-tuner-snapshot.sqlite"
    assert s.proposals_dir == tmp_path / "state" / "proposals"
    assert (s.job_timeout_s, s.log_level, s.log_level_no) == (30.0, "DEBUG", 10)
    assert s.allow_trust_remote_code is True and s.default_method == "auto" and s.source == str(p)
    assert load_settings(None) == Settings()
    (tmp_path / "empty.yaml").write_text("")
    assert load_settings(tmp_path / "empty.yaml").job_timeout_s == 600.0


@pytest.mark.parametrize("text, field, needle", [
    ("colour: red\n", "colour", "unknown setting"),
    ("job_timeout_s: soon\n", "job_timeout_s", "must be a number"),
    ("job_timeout_s: 0\n", "job_timeout_s", "between 1 and 86400"),
    ("rescan_interval_s: .inf\n", "rescan_interval_s", "must be a number"),
    ("allow_trust_remote_code: 'yes'\n", "allow_trust_remote_code", "true or false"),
    ("default_method: magic\n", "default_method", "one of simulate"),
    ("log_level: LOUD\n", "log_level", "one of DEBUG"),
    ("max_attempts: 2.5\n", "max_attempts", "integer"),
    ("watch_dir: ''\n", "watch_dir", "non-empty path"),
    ("- a\n", None, "top level must be a mapping"),
    ("a: [\n", None, "not valid YAML"),
])
def test_bad_settings_name_file_and_key(tmp_path, text, field, needle):
    p = tmp_path / "tuner.yaml"
    p.write_text(text)
    with pytest.raises(SettingsError) as ei:
        load_settings(p)
    assert ei.value.path == str(p) and ei.value.field == field
    assert needle in str(ei.value) and str(ei.value).startswith(f"{p}:{field}:" if field else f"{p}:")


def test_unreadable_and_oversized_settings(tmp_path):
    with pytest.raises(SettingsError, match="cannot read settings"):
        load_settings(tmp_path / "absent.yaml")
    big = tmp_path / "big.yaml"
    big.write_text("#" * 70_000)
    with pytest.raises(SettingsError, match="larger than 64 KiB"):
        load_settings(big)


def test_state_dir_inside_watch_dir_is_refused(tmp_path):
    from tuner.daemon import check_layout

    with pytest.raises(SettingsError) as ei:
        check_layout(Settings(watch_dir=str(tmp_path), state_dir=str(tmp_path / "state")))
    assert ei.value.field == "state_dir"
    check_layout(Settings(watch_dir=str(tmp_path / "conf.d"), state_dir=str(tmp_path / "state")))


def test_daemon_json_log_lines():
    """``daemon --json`` logs one JSON object per record (time, level, logger, message)."""
    import io
    import json
    import logging

    from tuner.cli import build_parser
    from tuner.commands.daemon import JsonLogFormatter

    assert build_parser().parse_args(["daemon", "--json"]).json is True
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLogFormatter())
    log = logging.getLogger("tuner.test.jsonlog")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("drop %s: job %d failed", "a.yaml", 3)
    finally:
        log.removeHandler(handler)
    doc = json.loads(stream.getvalue())
    assert doc["level"] == "WARNING" and doc["logger"] == "tuner.test.jsonlog"
    assert doc["message"] == "drop a.yaml: job 3 failed" and doc["time"].endswith("+00:00")

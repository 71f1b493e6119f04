"""Daemon settings: the one table, the file loader's typed errors, the docs table (docs/daemon.md)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from tests.conftest import REPO
from tuner.errors import SettingsError
from tuner.daemon.settings import SETTINGS, Settings, load_settings, settings_markdown

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
    readme = (REPO / "docs" / "daemon.md").read_text()
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
    from tuner.daemon.service import check_layout

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


# -- the store URL from the environment and systemd credentials (fleet) --------------------------------


def _file(tmp_path, text: str):
    p = tmp_path / "tuner.yaml"
    p.write_text(text)
    return p


def test_database_url_from_the_environment_wins_over_the_file(tmp_path):
    p = _file(tmp_path, "database_url: sqlite:///from-file.sqlite\n")
    assert load_settings(p, environ={}).database_url == "sqlite:///from-file.sqlite"
    env = {"CTX_TUNER_DATABASE_URL": "postgresql+psycopg://tuner:pw@db.example:5432/tuner"}
    assert load_settings(p, environ=env).database_url == env["CTX_TUNER_DATABASE_URL"]
    assert load_settings(None, environ=env).db_url == env["CTX_TUNER_DATABASE_URL"]


def test_database_url_from_a_systemd_credential(tmp_path):
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "database_url").write_text("postgresql+psycopg://tuner:s3cret@db.example/tuner\n")
    p = _file(tmp_path, "watch_dir: conf.d\n")
    s = load_settings(p, environ={"CREDENTIALS_DIRECTORY": str(creds)})
    assert s.database_url == "postgresql+psycopg://tuner:s3cret@db.example/tuner"
    # the environment variable still wins over the credential
    s = load_settings(p, environ={"CREDENTIALS_DIRECTORY": str(creds), "CTX_TUNER_DATABASE_URL": "sqlite:///x.sqlite"})
    assert s.database_url == "sqlite:///x.sqlite"


def test_password_credential_completes_a_url_without_a_secret_in_the_file(tmp_path):
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "database_password").write_text("p@ss/word\n")
    p = _file(tmp_path, "database_url: postgresql+psycopg://tuner@db.example:5432/tuner\n")
    s = load_settings(p, environ={"CREDENTIALS_DIRECTORY": str(creds)})
    from sqlalchemy.engine import make_url

    u = make_url(s.database_url)
    assert (u.username, u.password, u.host, u.port, u.database) == ("tuner", "p@ss/word", "db.example", 5432, "tuner")
    assert "p@ss/word" not in p.read_text()
    # a URL that already has a password keeps it; a SQLite path is left alone
    p2 = _file(tmp_path, "database_url: postgresql+psycopg://tuner:own@db.example/tuner\n")
    assert make_url(load_settings(p2, environ={"CREDENTIALS_DIRECTORY": str(creds)}).database_url).password == "own"
    p3 = _file(tmp_path, "database_url: state.sqlite\n")
    assert load_settings(p3, environ={"CREDENTIALS_DIRECTORY": str(creds)}).database_url == str(tmp_path / "state.sqlite")


def test_empty_credential_is_a_settings_error_naming_the_file(tmp_path):
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "database_url").write_text("\n")
    with pytest.raises(SettingsError, match="credential is empty") as ei:
        load_settings(None, environ={"CREDENTIALS_DIRECTORY": str(creds)})
    assert str(creds / "database_url") in str(ei.value)


@pytest.mark.parametrize("bad", ["two words", "", "x" * 300, 7])
def test_bad_host_id_names_the_key(tmp_path, bad):
    import yaml

    p = _file(tmp_path, yaml.safe_dump({"host_id": bad}))
    with pytest.raises(SettingsError, match="host name") as ei:
        load_settings(p, environ={})
    assert ei.value.field == "host_id"

"""Daemon settings for engine venvs (issue 12): ``engine_pythons`` maps a vLLM release to the
Python of a venv with that release; a drop of that release runs its worker there."""

from __future__ import annotations

import os
import stat

import pytest

from tuner.errors import SettingsError
from tuner.daemon.settings import check_worker_python, load_settings


def _exe(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_engine_pythons_pick_the_drop_release(tmp_path):
    _exe(tmp_path / "v32" / "python")
    _exe(tmp_path / "v19" / "python")
    p = tmp_path / "tuner.yaml"
    p.write_text("worker_python: /usr/bin/python3\nengine_pythons: {'0.32.0': v32/python, 'v0.19': v19/python}\n")
    s = load_settings(p)
    assert s.engine_pythons == {"0.32.0": str(tmp_path / "v32" / "python"), "0.19.0": str(tmp_path / "v19" / "python")}
    check_worker_python(s)
    assert s.python_for("0.32.0") == str(tmp_path / "v32" / "python")
    assert s.python_for("0.19.0.post1") == str(tmp_path / "v19" / "python")
    assert s.python_for("0.20.0") == "/usr/bin/python3"  # no venv of that release: worker_python
    assert s.python_for("not-a-version") == "/usr/bin/python3"


def test_engine_pythons_errors_name_the_key(tmp_path):
    p = tmp_path / "tuner.yaml"
    p.write_text("engine_pythons: {'0.32.0': missing/python}\n")
    with pytest.raises(SettingsError) as ei:
        check_worker_python(load_settings(p))
    assert ei.value.field == "engine_pythons.0.32.0" and "does not exist" in str(ei.value)
    p.write_text("engine_pythons: {'banana': /usr/bin/python3}\n")
    with pytest.raises(SettingsError) as ei:
        load_settings(p)
    assert ei.value.field == "engine_pythons" and "banana" in str(ei.value)
    p.write_text("engine_pythons: [/usr/bin/python3]\n")
    with pytest.raises(SettingsError):
        load_settings(p)

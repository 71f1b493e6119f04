"""configs/ctx-tuner.service: Type=notify, unprivileged, GPU devices by group, hardened, and
clean under `systemd-analyze verify` where systemd-analyze exists (CI runs the same check)."""

from __future__ import annotations

import configparser
import shutil
import subprocess

import pytest

from tests.conftest import REPO

UNIT = REPO / "configs" / "ctx-tuner.service"


def _directives() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_unit_is_a_hardened_notify_service_with_gpu_access():
    d = _directives()
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["ExecStart"][0].split()[1:] == ["daemon", "--settings", "/etc/ctx-tuner/tuner.yaml"]
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"] and "WatchdogSec" in d
    assert d["User"] == ["ctx-tuner"] and d["StateDirectory"] == ["ctx-tuner"]
    assert d["ConfigurationDirectory"] == ["ctx-tuner"]
    assert d["DevicePolicy"] == ["closed"]
    assert all(v.startswith("char-") for v in d["DeviceAllow"])  # path globs would grant nothing
    assert any(v.startswith("char-nvidia") for v in d["DeviceAllow"])
    assert "PrivateDevices" not in d  # it would hide the GPUs
    for key in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "RestrictNamespaces",
                "SystemCallFilter", "CapabilityBoundingSet", "PrivateNetwork"):
        assert key in d, key
    # issue 15: a drop must not be able to take the host down, and an OOM kill must not stop the service
    assert d["MemoryMax"] and d["TasksMax"] and d["OOMPolicy"] == ["continue"]
    configparser.ConfigParser(strict=False, interpolation=None).read_string(
        "\n".join(line for line in UNIT.read_text().splitlines() if not line.startswith("SystemCallFilter")))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_prints_nothing_and_security_scores(tmp_path):
    unit = tmp_path / "ctx-tuner.service"
    unit.write_text(UNIT.read_text().replace("ExecStart=/usr/local/bin/ctx-tuner ",
                                             f"ExecStart={shutil.which('sh')} "))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr
    sec = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True,
                         text=True, timeout=60)
    line = next(x for x in sec.stdout.splitlines() if "Overall exposure level" in x)
    score = float(line.split(":")[1].split()[0])
    assert score <= 2.0, line  # "SAFE" is below 2


DROPIN = REPO / "configs" / "ctx-tuner.service.d" / "network-db.conf"


def _dropin_directives() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in DROPIN.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_network_db_dropin_opens_only_the_database_and_loads_the_url_as_a_credential():
    d = _dropin_directives()
    assert d["PrivateNetwork"] == ["no"]
    assert set(d["RestrictAddressFamilies"][0].split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}
    assert len(d["IPAddressAllow"]) == 1 and d["IPAddressAllow"][0] not in ("any", "")
    assert "IPAddressDeny" not in d  # the unit's IPAddressDeny=any stays in force
    assert d["LoadCredential"] == ["database_url:/etc/ctx-tuner/credentials/database_url"]
    # nothing else of the unit's hardening is relaxed
    assert set(d) == {"Wants", "After", "PrivateNetwork", "RestrictAddressFamilies", "IPAddressAllow", "LoadCredential"}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_with_the_network_db_dropin_verifies_and_stays_hardened(tmp_path):
    unit = tmp_path / "ctx-tuner.service"
    unit.write_text(UNIT.read_text().replace("ExecStart=/usr/local/bin/ctx-tuner ",
                                             f"ExecStart={shutil.which('sh')} "))
    (tmp_path / "ctx-tuner.service.d").mkdir()
    (tmp_path / "ctx-tuner.service.d" / "network-db.conf").write_text(DROPIN.read_text())
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr
    sec = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True,
                         text=True, timeout=60)
    assert "Service has access to the host's network" in sec.stdout  # the drop-in was applied
    line = next(x for x in sec.stdout.splitlines() if "Overall exposure level" in x)
    assert float(line.split(":")[1].split()[0]) <= 2.0, line

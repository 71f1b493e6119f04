"""Invalid drops and stores found by a tester: each is a typed error naming the file and the field."""

from __future__ import annotations

import sqlite3
import types

import pytest
import yaml

from tuner.cli import main
from tuner.question.drop import load_drop
from tuner.errors import DeviceError, DropError, StoreError
from tuner.store.database import error_text, open_store


def _drop(tmp_path, **over):
    body = {"name": "d", "model": "org/m", "device": "H100-80GB", "candidates": {"gpu_memory_utilization": [0.9]}}
    body.update(over)
    p = tmp_path / "d.yaml"
    p.write_text(yaml.safe_dump(body))
    return p


# --- drops and devices ---------------------------------------------------------------------------


@pytest.mark.parametrize("gib", [1.0e300, float("nan"), float("inf"), -1.0e300, 1.0e6])
def test_huge_or_non_finite_device_memory_names_the_field(tmp_path, gib):
    p = _drop(tmp_path, device={"name": "g", "total_memory_gib": gib})
    with pytest.raises(DropError) as e:
        load_drop(p)
    assert e.value.field == "device.total_memory_gib" and str(e.value).startswith(f"{p}:device.total_memory_gib:")


def test_huge_device_memory_is_exit_2(tmp_path, capsys):
    p = tmp_path / "d.yaml"
    p.write_text("name: d\nmodel: org/m\ndevice: {name: g, total_memory_gib: 1.0e+300}\n"
                 "candidates: {gpu_memory_utilization: [0.9]}\n")
    assert main(["profile", str(p), "--db", str(tmp_path / "r.sqlite")]) == 2
    err = capsys.readouterr().err
    assert "device.total_memory_gib" in err and "Traceback" not in err


@pytest.mark.parametrize("values", [["0.9"], [0.5, "0.9"], ["nan"], [True]])
def test_gpu_memory_utilization_rejects_strings_like_other_numeric_fields(tmp_path, values):
    p = _drop(tmp_path, candidates={"gpu_memory_utilization": values})
    with pytest.raises(DropError) as e:
        load_drop(p)
    assert e.value.field.startswith("candidates.gpu_memory_utilization[")


def test_device_auto_without_gpu_names_file_and_field(tmp_path):
    import pynvml

    def no_library():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    nvml = types.SimpleNamespace(NVMLError=pynvml.NVMLError, nvmlInit=no_library, nvmlShutdown=lambda: None)
    p = _drop(tmp_path, device="auto")
    with pytest.raises(DeviceError) as e:
        load_drop(p).resolve_device(nvml=nvml)
    assert str(e.value).startswith(f"{p}:device: auto: no NVIDIA GPU")


# --- store -----------------------------------------------------------------------------------------


def test_store_errors_carry_no_sqlalchemy_background_link(tmp_path):
    foreign = tmp_path / "other.sqlite"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE customers (id INTEGER)")
    con.commit()
    con.close()
    with pytest.raises(StoreError) as e:
        open_store(str(foreign), readonly=True)  # no alembic_version: the query fails in SQLAlchemy
    assert "sqlalche.me" not in str(e.value) and "Background on this error" not in str(e.value)
    assert "alembic_version" in str(e.value)
    text = error_text(Exception("boom\n(Background on this error at: https://sqlalche.me/e/20/e3q8)"))
    assert text == "boom"


def test_profile_refuses_a_sqlite_file_of_something_else(tmp_path, tiny_config, capsys):
    foreign = tmp_path / "app.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE customers (id INTEGER)")
    con.commit()
    con.close()
    with pytest.raises(StoreError) as e:
        open_store(str(foreign))
    assert str(foreign) in str(e.value) and "customers" in str(e.value)
    con = sqlite3.connect(foreign)
    assert [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["customers"]
    con.close()
    drop = _drop(tmp_path, model=str(tiny_config))
    assert main(["profile", str(drop), "--db", str(foreign), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "StoreError" in err and str(foreign) in err


def test_empty_file_and_existing_store_are_accepted(tmp_path):
    empty = tmp_path / "empty.sqlite"
    empty.write_bytes(b"")
    open_store(str(empty)).close()
    open_store(str(empty)).close()  # now a ctx-tuner store: opened again
    con = sqlite3.connect(empty)
    assert con.execute("SELECT count(*) FROM alembic_version").fetchone() == (1,)
    con.close()

"""Importing vLLM logs into a real SQLite store, and the import-log command."""

from __future__ import annotations

import json

import pytest

from tuner.cli import main
from tuner.accuracy.importlog import import_log
from tuner.jobs.job import run_job
from tuner.logs.logparse import GIB
from tuner.store.database import open_store

LLAMA = "llmd-v019-meta-llama-llama-3-1-8b--tp1pp1dp1--8192"


def _in_process(request, **_kw):
    return run_job(request)


def _write(tmp_path, case, name="engine.log", replace=()):
    text = "\n".join(case["raw_lines"]) + "\n"
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.fixture
def store(tmp_path):
    s = open_store(str(tmp_path / "db.sqlite"))
    yield s
    s.close()


def test_import_stores_the_measured_run_and_its_residual(tmp_path, shared_dir, observed_cases, store):
    case = observed_cases[LLAMA]
    log = _write(tmp_path, case)
    out = import_log(log, model=case["model"], device="H100-80GB", store=store, engine_version="0.19.0",
                     models_dir=shared_dir / "models", options={"gpu_memory_utilization": 0.95},
                     worker=_in_process)
    assert not out.already and out.drop_id is not None
    runs = store.runs_for_drop(out.drop_id)
    assert len(runs) == 1
    run = runs[0]
    obs = case["observed"]
    assert run["method"] == "import" and run["status"] == "ok" and run["source"] == str(log)
    assert run["era"] == "V1 0.19.0 (v1_profiling)" and run["device_name"] == "H100-80GB"
    assert run["weights_bytes"] == round(obs["weights_gib"] * GIB)
    assert run["activation_peak_bytes"] == round(obs["activation_peak_gib"] * GIB)
    assert run["non_torch_bytes"] == round(obs["non_torch_gib"] * GIB)
    assert run["available_kv_cache_bytes"] == round(obs["kv_cache_gib"] * GIB)
    assert run["kv_cache_tokens"] == obs["kv_cache_tokens"] and run["max_concurrency"] == obs["max_concurrency"]
    assert run["max_model_len"] == 8192 and run["gpu_memory_utilization"] == 0.95
    assert (run["max_num_batched_tokens"], run["max_num_seqs"]) == (8192, 1024)  # era defaults, H100 serve
    assert run["dtype"] == "bfloat16" and len(run["model_config_sha256"]) == 64
    # the residual against simulate of the same settings is stored
    rows = store.calibration_rows(device_name="H100-80GB", era=run["era"], usable_only=False)
    assert len(rows) == 1 and rows[0]["profile_run_id"] == run["id"] and rows[0]["usable"]
    assert rows[0]["activation_peak_delta_bytes"] == run["activation_peak_bytes"] - out.predicted["activation_peak_bytes"]
    assert rows[0]["kv_error_bytes"] == out.predicted["available_kv_cache_bytes"] - run["available_kv_cache_bytes"]
    assert rows[0]["predicted_available_kv_cache_bytes"] == out.predicted["available_kv_cache_bytes"]
    # the same log again is recognised, nothing new written
    again = import_log(log, model=case["model"], device="H100-80GB", store=store, engine_version="0.19.0",
                       models_dir=shared_dir / "models", options={"gpu_memory_utilization": 0.95},
                       worker=_in_process)
    assert again.already and again.drop_id == out.drop_id
    assert len(store.measured_runs()) == 1


def _case_device(case):
    from tuner.accuracy.validate import _device

    return _device(case)


def test_every_case_log_imports(tmp_path, shared_dir, observed_cases, store):
    """Each visible case's raw_lines import (settings from the case); no prediction here. A model
    with no config here, a card the catalog does not know (the log's total is used) and an engine
    refusal without memory lines are recorded too (issue 34: what the log printed is stored first)."""
    import re

    from tuner.accuracy.validate import infer_version

    from tuner.errors import DeviceError, DropError, LogParseError

    # Cases whose raw_lines are a reporter's table or prose rather than log lines (vLLM PR #51590's
    # table rows, issue #42058's "Capacity" sentence, docs tables, blog summaries) are not logs; they
    # may fail to parse, nothing else. A record whose `model` is a description rather than a name, or
    # whose `gpu` is a list (one card per pipeline stage: import-log takes one --device), cannot be
    # given on the command line either.
    not_logs, not_cli = [], []
    for i, (cid, case) in enumerate(observed_cases.items()):
        log = _write(tmp_path, case, name=f"{i}.log")
        version, engine = infer_version(case)
        s = case["settings"]
        try:
            # the card as validate resolves the record (a gpu list's first stage; a bare "NVIDIA H100" the
            # first of its cards; a printed total kept): a bare ambiguous name is refused on the command line
            card = {k: v for k, v in _case_device(case).items() if k in ("name", "total_memory_bytes")}
            out = import_log(log, model=case["model"], device=card, store=store, engine_version=version,
                             engine=engine, models_dir=shared_dir / "models", predict=False,
                             options={"gpu_memory_utilization": s.get("gpu_memory_utilization"),
                                      "max_model_len": s.get("max_model_len"),
                                      "tensor_parallel_size": case["tensor_parallel_size"] or 1,
                                      "pipeline_parallel_size": case["pipeline_parallel_size"] or 1})
        except LogParseError:
            assert not any(re.search(r"\b(?:INFO|WARNING|DEBUG|ERROR) \d\d-\d\d ", line)
                           for line in case.get("raw_lines") or []), cid
            not_logs.append(cid)
            continue
        except DeviceError:
            assert isinstance(case["gpu"], list), cid
            not_cli.append(cid)
            continue
        except DropError as exc:
            assert exc.field == "model" and " " in case["model"], cid
            not_cli.append(cid)
            continue
        assert out.drop_id is not None, cid
    assert len(not_logs) <= 22 and len(not_cli) <= 2, (not_logs, not_cli)
    observed_cases = {cid: c for cid, c in observed_cases.items() if cid not in not_logs + not_cli}
    runs = store.measured_runs()
    assert len(runs) == len(observed_cases) >= 102
    assert {r["method"] for r in runs} == {"import"}
    figures = ("weights_bytes", "activation_peak_bytes", "non_torch_bytes", "available_kv_cache_bytes",
               "num_gpu_blocks", "kv_cache_tokens", "max_concurrency", "error_message")
    assert [r["source"] for r in runs if all(r[f] is None for f in figures)] == []  # each holds what it printed


def test_log_without_version_gets_one_from_its_log_format(tmp_path, shared_dir, observed_cases, store):
    case = observed_cases[LLAMA]
    log = _write(tmp_path, case)
    out = import_log(log, model=case["model"], device="H100-80GB", store=store, models_dir=shared_dir / "models",
                     predict=False)
    # its [gpu_worker.py:436] "Available KV cache memory" is printed by 0.19.0 and 0.19.1 only (the
    # case ran 0.19.0: same rules); before, such a log was taken as 0.10.0
    assert out.drop.engine_version == "0.19.1" and out.run["era"].startswith("V1")
    assert out.release["release_range"] == ["0.19.0", "0.19.1"] and out.release["release_assumed"] is True
    assert any("does not print the vLLM version; assumed vLLM 0.19.1 (V1)" in w and "0.19.0 – 0.19.1" in w
               and "[gpu_model_runner.py:4820] Model loading took" in w for w in out.warnings), out.warnings


def test_v0_064_log_gives_weights_and_activation_from_its_summary(tmp_path, shared_dir, observed_cases, store):
    """0.6.4 prints no weights line: weights = initial_memory_usage − non_torch, activation =
    peak_torch − weights (15.34 − 0.35 = 14.99 GiB; 17.98 − 14.99 = 2.99 GiB), so a stored-run
    explanation adds up and its advice matches the simulation's."""
    case = observed_cases["vllm-10517-rtx3090-llama31-8b-29k"]
    log = _write(tmp_path, case)
    out = import_log(log, model=case["model"], device="RTX-3090", store=store, models_dir=shared_dir / "models",
                     options={"gpu_memory_utilization": 0.9, "max_model_len": 29000}, predict=False)
    assert out.drop.engine_version == "0.6.4.post1"  # only 0.6.4(.post1) prints initial_memory_usage=
    assert out.run["weights_bytes"] == round(15.34 * GIB) - round(0.35 * GIB)
    assert out.run["activation_peak_bytes"] == round(17.98 * GIB) - out.run["weights_bytes"]
    assert abs(out.run["weights_bytes"] / GIB - case["observed"]["weights_gib"]) < 0.01


_V1_LOG_NO_VERSION = (
    "INFO 05-01 10:00:00 [gpu_model_runner.py:1] Model loading took 0.0100 GiB and 1.0 seconds\n"
    "INFO 05-01 10:00:01 [gpu_worker.py:2] Available KV cache memory: 60.00 GiB\n"
    "INFO 05-01 10:00:01 [kv_cache_utils.py:3] GPU KV cache size: 1,000,000 tokens\n"
)


def test_inferred_version_and_default_gmu_are_reported(tmp_path, tiny_config, store):
    log = tmp_path / "noversion.log"
    log.write_text(_V1_LOG_NO_VERSION)
    out = import_log(log, model=str(tiny_config), device="H100-80GB", store=store, predict=False)
    # made-up line numbers ([gpu_worker.py:2]) are set aside; nothing else narrows it: the newest
    # modelled release, with the range and what was set aside said in the warning
    from tuner.memory.eras import NEWEST
    from tuner.releases.facts import release_key

    newest = out.drop.engine_version
    assert release_key(newest) == NEWEST and out.release["release_range"][1] == newest
    text = "\n".join(out.warnings)
    assert f"assumed vLLM {newest} (V1), the newest of the" in text and "set aside" in text
    assert f"no gpu_memory_utilization line; assumed vLLM {newest}'s default" in text
    assert "--gpu-memory-utilization" in text
    # given on the command line: no gmu warning
    again = import_log(log, model=str(tiny_config), device="H100-80GB", store=store, predict=False, force=True,
                       options={"gpu_memory_utilization": 0.8})
    assert not any("gpu_memory_utilization line" in w for w in again.warnings)
    assert again.drop.candidates.gpu_memory_utilization == (0.8,)


def test_import_log_command_prints_the_assumptions(tmp_path, tiny_config, capsys):
    log = tmp_path / "noversion.log"
    log.write_text(_V1_LOG_NO_VERSION)
    rc = main(["import-log", str(log), "--model", str(tiny_config), "--device", "H100-80GB", "--no-predict",
               "--db", str(tmp_path / "x.sqlite")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "warning: the log does not print the vLLM version; assumed vLLM 0." in out
    assert "vLLM release assumed: 0." in out and "consistent: 0.9.1 – 0." in out
    assert "warning: the log has no gpu_memory_utilization line" in out


def test_import_log_refuses_a_fifo_at_once(tmp_path, capsys):
    import os

    fifo = tmp_path / "engine.log"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    rc = main(["import-log", str(fifo), "--model", "org/none", "--device", "H100-80GB",
               "--db", str(tmp_path / "x.sqlite")])
    err = capsys.readouterr().err
    assert rc == 2 and str(fifo) in err and "FIFO" in err and "regular" in err


def test_version_rule_lives_in_release_infer_only():
    from tuner.logs import logparse
    from tuner.logs import release_infer
    from tuner.accuracy import validate

    assert not hasattr(logparse, "infer_version") and not hasattr(logparse, "VERSION_BY_LOG_FORMAT")
    assert not hasattr(logparse, "DEFAULT_VERSION")
    lines = ["INFO 01-02 03:04:05 worker.py:241] the current vLLM instance can use total_gpu_memory (23.58GiB) x ..."]
    assert validate.infer_version({"raw_lines": lines}) == ("0.6.6.post1", "V0")
    inferred = release_infer.infer_for_log(logparse.parse_text("\n".join(lines)).release_lines)
    assert (inferred.release, inferred.engine) == ("0.6.6.post1", "V0")
    assert inferred.release_range == ("0.6.5", "0.6.6.post1")


def test_import_log_command(tmp_path, shared_dir, observed_cases, capsys):
    case = observed_cases["vllm-10517-rtx3090-llama31-8b-29k"]
    log = _write(tmp_path, case)
    db = tmp_path / "cmd.sqlite"
    rc = main(["import-log", str(log), "--model", case["model"], "--models-dir", str(shared_dir / "models"),
               "--device", "RTX-3090", "--engine-version", "0.6.4", "--engine", "V0", "--no-predict",
               "--db", str(db), "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["run"]["num_gpu_blocks"] == 1478 and doc["run"]["max_model_len"] == 29000
    assert doc["run"]["error_message"].startswith("The model's max seq len (29000)")
    assert doc["run"]["era"].startswith("V0 0.6.4")
    with open_store(str(db)) as s:
        assert [r["num_gpu_blocks"] for r in s.measured_runs()] == [1478]


def test_import_log_command_errors(tmp_path, capsys):
    empty = tmp_path / "empty.log"
    empty.write_text("hello\n")
    rc = main(["import-log", str(empty), "--model", "org/none", "--device", "H100-80GB",
               "--db", str(tmp_path / "x.sqlite")])
    assert rc == 2
    err = capsys.readouterr().err
    assert str(empty) in err and "no vLLM memory lines" in err


def test_run_and_residual_are_one_transaction(tmp_path, shared_dir, observed_cases, store, monkeypatch):
    """If the residual cannot be written, the measured run is not written either (and vice versa)."""
    from tuner.errors import StoreError

    case = observed_cases[LLAMA]
    log = _write(tmp_path, case)
    predicted = {"weights_bytes": round(14.99 * GIB), "activation_peak_bytes": round(1.5 * GIB),
                 "non_torch_bytes": round(0.3 * GIB), "cuda_graph_bytes": 0,
                 "available_kv_cache_bytes": round(58.5 * GIB), "num_gpu_blocks": 29950, "kv_cache_tokens": 479200}

    def canned(request, **_kw):
        return {"candidates": [predicted], "warnings": []}

    def broken(conn, row):
        raise StoreError("disk full", where="test")

    monkeypatch.setattr(store, "insert_calibration", broken)
    with pytest.raises(StoreError, match="disk full"):
        import_log(log, model=case["model"], device="H100-80GB", store=store, engine_version="0.19.0",
                   models_dir=shared_dir / "models", options={"gpu_memory_utilization": 0.95}, worker=canned)
    assert store.measured_runs() == []
    monkeypatch.undo()
    out = import_log(log, model=case["model"], device="H100-80GB", store=store, engine_version="0.19.0",
                     models_dir=shared_dir / "models", options={"gpu_memory_utilization": 0.95}, worker=canned)
    runs = store.measured_runs()
    rows = store.calibration_rows(device_name="H100-80GB", era=runs[0]["era"], usable_only=False)
    assert len(runs) == 1 and [r["profile_run_id"] for r in rows] == [runs[0]["id"]]
    assert rows[0]["id"] == out.calibration["id"]
    assert rows[0]["activation_peak_delta_bytes"] == round(1.89 * GIB) - round(1.5 * GIB)


def test_import_log_json_says_which_release_was_assumed(tmp_path, tiny_config, capsys):
    log = tmp_path / "noversion.log"
    log.write_text(_V1_LOG_NO_VERSION)
    rc = main(["import-log", str(log), "--model", str(tiny_config), "--device", "H100-80GB", "--no-predict",
               "--db", str(tmp_path / "x.sqlite"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["release"]["release_assumed"] is True
    assert doc["release"]["release"] == doc["run"]["engine_version"] == doc["release"]["release_range"][1]
    # made-up line numbers and "1.0 seconds" (vLLM prints %.6f) are set aside, said in the JSON
    assert [e["kind"] for e in doc["release"]["ignored"]] == ["log marker", "log marker", "log marker", "log format"]
    # a version given: nothing assumed
    rc = main(["import-log", str(log), "--model", str(tiny_config), "--device", "H100-80GB", "--no-predict",
               "--db", str(tmp_path / "y.sqlite"), "--json", "--engine-version", "0.19.0"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["release"] is None


def test_log_total_picks_among_a_names_cards(shared_dir):
    """A total the log prints ("total_gpu_memory=39.39GiB") picks the card a bare name may mean
    (``NVIDIA A100``: 80 or 40 GB) and gives a card the catalog lacks its total."""
    from tuner.accuracy.importlog import config_path_for, read_config, resolve_settings
    from tuner.logs.logparse import parse_lines

    lines = ["INFO 11-20 10:00:00 worker.py:232] Memory profiling results: total_gpu_memory=39.39GiB "
             "initial_memory_usage=15.34GiB peak_torch_memory=17.98GiB memory_usage_post_profile=15.50GiB "
             "non_torch_memory=0.35GiB kv_cache_size=17.12GiB gpu_memory_utilization=0.90"]
    parsed = parse_lines(lines, source="t.log")
    config, _sha = read_config(config_path_for("meta-llama/Llama-3.1-8B-Instruct", models_dir=shared_dir / "models"))
    for name, expected in (("NVIDIA A100", "A100-40GB"), ("Quantum Card 9000", "Quantum Card 9000")):
        _drop, extra = resolve_settings(parsed, model="meta-llama/Llama-3.1-8B-Instruct", device=name,
                                        engine_version="0.6.4", engine="V0", options={"max_model_len": 8192},
                                        config=config, source="t.log")
        assert extra["device_name"] == expected
        # the printed 39.39 GiB, or the catalog's total it rounds to
        assert abs(extra["total_memory_bytes"] - parsed.total_memory_bytes) < 0.006 * (1 << 30)


# -- issue 34: import-log records any real log ------------------------------------------------------

_V0_065_WRAPPED = """\
INFO 12-10 10:00:00 api_server.py:585] vLLM API server version 0.6.5
INFO 12-10 10:00:09 model_runner.py:1094] Loading model weights took 14.9888 GB
INFO 12-10 10:00:14 worker.py:241] Memory profiling takes 4.57 seconds
the current vLLM instance can use total_gpu_memory (79.19GiB) x gpu_memory_utilization (0.90) = 71.27GiB
model weights take
14.99GiB; non_torch_memory takes
0.13GiB; PyTorch activation peak memory takes 1.23GiB; the rest of the memory reserved for KV Cache is
54.92GiB.
INFO 12-10 10:00:15 gpu_executor.py:76] # GPU blocks: 28118, # CPU blocks: 2048
"""


def test_065_memory_summary_on_separate_lines_was_not_parsed():
    """vLLM 0.6.5's profiling summary is one message over three lines; a copied log breaks it
    further (a figure on the line after its label, or one clause per line with
    ``available_kv_cache_memory=``). Each multi-line message is matched joined now."""
    from tuner.logs.logparse import parse_text

    p = parse_text(_V0_065_WRAPPED)
    assert (p.vllm_version, p.engine) == ("0.6.5", "V0")
    assert (p.weights_bytes, p.non_torch_bytes, p.activation_peak_bytes, p.available_kv_cache_bytes) == (
        round(14.9888 * GIB), round(0.13 * GIB), round(1.23 * GIB), round(54.92 * GIB))
    assert (p.total_memory_bytes, p.requested_memory_bytes, p.gpu_memory_utilization, p.num_gpu_blocks) == (
        round(79.19 * GIB), round(71.27 * GIB), 0.9, 28118)
    split = parse_text("INFO 12-10 10:00:14 worker.py:241] Memory profiling takes 4.57 seconds\n"
                       "model weights take 14.99GiB\nnon_torch_memory takes 0.13GiB\n"
                       "available_kv_cache_memory=54.92GiB\nINFO 12-10 10:00:15 done\n")
    assert (split.weights_bytes, split.non_torch_bytes, split.available_kv_cache_bytes) == (
        round(14.99 * GIB), round(0.13 * GIB), round(54.92 * GIB))
    # a figure is never taken across two messages the logger started
    assert parse_text("INFO 12-10 model weights take\nINFO 12-10 14.99GiB\n").weights_bytes is None


def test_log_of_model_no_config_serves_was_refused(tmp_path, capsys):
    """A log whose model has no config.json here (no plugin or config serves it) was refused
    outright ("no config.json found", exit 2). What the log printed is stored first now, with
    what that leaves out said; the modelling (prediction, residual) is skipped."""
    log = tmp_path / "engine.log"
    log.write_text(_V0_065_WRAPPED)
    db = tmp_path / "x.sqlite"
    rc = main(["import-log", str(log), "--model", "acme/unknown-model-7b", "--device", "H100-80GB",
               "--max-model-len", "4096", "--db", str(db), "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    run = doc["run"]
    assert (run["weights_bytes"], run["available_kv_cache_bytes"], run["num_gpu_blocks"]) == (
        round(14.9888 * GIB), round(54.92 * GIB), 28118)
    assert run["model_config_sha256"] is None and run["architecture"] is None and run["max_model_len"] == 4096
    assert doc["predicted"] is None and doc["calibration"] is None
    warning, = [w for w in doc["warnings"] if w.startswith("no config.json of acme/unknown-model-7b (")]
    assert "the log is stored as printed" in warning and "dtype float16 assumed" in warning
    with open_store(str(db)) as s:
        assert [r["num_gpu_blocks"] for r in s.measured_runs()] == [28118]
    # without --max-model-len and with no config to read it from: the one setting it cannot assume
    rc = main(["import-log", str(log), "--model", "acme/unknown-model-7b", "--device", "H100-80GB", "--force",
               "--db", str(db)])
    err = capsys.readouterr().err
    assert rc == 2 and "no config.json of the model was found; give --max-model-len" in err

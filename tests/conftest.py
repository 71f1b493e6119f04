"""Shared test set-up: offline hub, the repo root, and the shared cases/models directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("CTX_TUNER_SHARED", REPO.parent / "shared"))


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not (SHARED / "cases").is_dir():
        pytest.skip(f"shared cases not found at {SHARED}")
    return SHARED


@pytest.fixture(scope="session")
def observed_cases(shared_dir) -> dict[str, dict]:
    cases = {}
    for line in (shared_dir / "cases" / "vllm-observed.jsonl").read_text().splitlines():
        if line.strip():
            c = json.loads(line)
            cases[c["id"]] = c
    return cases


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    """A real Llama config with 2 layers and hidden size 64 (written, not downloaded)."""
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu",
    }))
    return d

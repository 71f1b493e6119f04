"""HF ids whose config.json is not cached are fetched through ``huggingface_hub`` from a local
mirror (``HF_ENDPOINT`` on 127.0.0.1, never the real hub): config and small JSON files only;
gated and missing repos are invalid input (exit 2) naming the repo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests._hub_mirror import start_mirror

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "hidden_act": "silu"}
REPOS = {"tiny-org/tiny-llama": {"config.json": json.dumps(TINY).encode(),
                                 "quantize_config.json": b"{}", "model.safetensors": b"\0" * 4096},
         "gated-org/gated-llama": {"config.json": json.dumps(TINY).encode()}}


@pytest.fixture
def mirror():
    server = start_mirror(REPOS, gated={"gated-org/gated-llama"}, token="hf_secret")
    yield server
    server.shutdown()
    server.server_close()


def _ctx(args, mirror, tmp_path, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    e.update(HF_ENDPOINT=mirror.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="1",
             HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    e.update(env)
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], capture_output=True, text=True, env=e,
                          timeout=600, cwd=tmp_path)


@pytest.mark.slow
def test_hf_id_with_empty_cache_resolves_through_a_local_mirror(mirror, tmp_path):
    r = _ctx(["check", "--device", "H100-80GB", "--engine-version", "0.19.0", "--no-variants", "--json", "--",
              "vllm", "serve", "tiny-org/tiny-llama", "--max-model-len", "2k"], mirror, tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "starts" and doc["model"] == "tiny-org/tiny-llama" and doc["max_model_len"] == 2000
    snap = list((tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama" / "snapshots").iterdir())
    assert len(snap) == 1 and sorted(p.name for p in snap[0].iterdir()) == ["config.json", "quantize_config.json"]
    asked = {path.rsplit("/", 1)[1] for _, path in mirror.requests}
    assert "model.safetensors" not in asked and "config.json" in asked  # configs only, never weights
    # cached now: offline works and asks the mirror nothing
    n = len(mirror.requests)
    r = _ctx(["check", "--device", "H100-80GB", "--engine-version", "0.19.0", "--no-variants", "--",
              "vllm", "serve", "tiny-org/tiny-llama", "--max-model-len", "2k"], mirror, tmp_path, HF_HUB_OFFLINE="1")
    assert r.returncode == 0, r.stderr
    assert len(mirror.requests) == n


def test_gated_and_missing_repos_are_exit_2_naming_the_repo(mirror, tmp_path):
    base = ["check", "--device", "H100-80GB", "--engine-version", "0.19.0", "--no-variants", "--", "vllm", "serve"]
    r = _ctx(base + ["gated-org/gated-llama"], mirror, tmp_path)
    assert r.returncode == 2
    assert "gated-org/gated-llama is a gated repository" in r.stderr and "hf auth login" in r.stderr
    r = _ctx(base + ["nobody/nothing"], mirror, tmp_path)
    assert r.returncode == 2 and "repository nobody/nothing not found" in r.stderr
    r = _ctx(base + ["tiny-org/tiny-llama", "--revision", "v9"], mirror, tmp_path)
    assert r.returncode == 2 and "revision 'v9' not found in tiny-org/tiny-llama" in r.stderr
    r = _ctx(base + ["nobody/nothing"], mirror, tmp_path, HF_HUB_OFFLINE="1")
    assert r.returncode == 2 and "HF_HUB_OFFLINE" in r.stderr and "nobody/nothing" in r.stderr


def test_hf_token_opens_a_gated_repo(mirror, tmp_path):
    code = ("from tuner.model.hub import fetch_config; "
            "print(fetch_config('gated-org/gated-llama', revision='v1'))")
    e = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    e.update(HF_ENDPOINT=mirror.url, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="0", HF_TOKEN="hf_secret")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("config.json") and "models--gated-org--gated-llama" in r.stdout

"""docs/plugins.md "Write a plugin": the example is the source of ``tests/thirdparty_plugin/``, and that
package, installed by pip as a real distribution, serves a GLM-4 config end to end."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tuner.model.plugin import load_registry

PACKAGE = REPO / "tests" / "thirdparty_plugin"


def _readme_section(title: str) -> str:
    from tests._docs import section

    return section("plugins.md", title)


def _code_blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", section, flags=re.S | re.M)


def test_readme_example_is_the_thirdparty_package_source():
    section = _readme_section("Write a plugin")
    assert _code_blocks(section, "toml") == [(PACKAGE / "pyproject.toml").read_text()]
    assert _code_blocks(section, "python") == [(PACKAGE / "ctx_tuner_glm4.py").read_text()]


def test_readme_example_imports_only_the_kit():
    source = (PACKAGE / "ctx_tuner_glm4.py").read_text()
    modules = set(re.findall(r"^\s*from (tuner[\w.]*) import", source, flags=re.M))
    modules |= set(re.findall(r"^\s*import (tuner[\w.]*)", source, flags=re.M))
    assert modules == {"tuner.model.kit"}


def _glm4_config(model_dir: Path) -> dict:
    cfg = {
        "architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1000, "max_position_embeddings": 4096, "partial_rotary_factor": 0.5, "attention_bias": True,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_glm4_is_served_only_by_the_thirdparty_plugin():
    plugin, warning = load_registry().for_architectures(["Glm4ForCausalLM"])
    assert plugin.name == "generic" and "generic" in warning  # no built-in serves it


@pytest.mark.slow
def test_thirdparty_plugin_installed_by_pip_profiles_end_to_end(tmp_path):
    src, site = tmp_path / "ctx-tuner-glm4", tmp_path / "site"
    shutil.copytree(PACKAGE, src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-index", "--disable-pip-version-check", "--target", str(site), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    entry_points = (site / "ctx_tuner_glm4-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "[tuner.plugins]" in entry_points and "glm4 = ctx_tuner_glm4:plugin" in entry_points

    cfg = _glm4_config(tmp_path / "glm4-tiny")
    drop = tmp_path / "glm4-tiny.yaml"
    drop.write_text("name: glm4-tiny\nmodel: glm4-tiny\ndevice: H100-80GB\nengine_version: \"0.19.0\"\n"
                    "max_num_batched_tokens: 2048\nmax_num_seqs: 16\n"
                    "candidates:\n  gpu_memory_utilization: [0.9]\n  max_model_len: [4096]\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    cli = Path(sys.executable).with_name("ctx-tuner")
    proc = subprocess.run([str(cli), "profile", str(drop), "--db", str(tmp_path / "t.sqlite"), "--json", "--quiet"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["plugin"] == "glm4"
    assert not [w for w in out["warnings"] if "generic" in w or "glm4" in w], out["warnings"]

    # What one rank holds, from the config by hand (bf16, vocab padded to 64; vLLM glm4.py):
    h, inter, layers, heads, kv, hd = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                          "num_attention_heads", "num_key_value_heads", "head_dim"))
    qkv = (heads + 2 * kv) * hd
    per_layer = h * qkv + qkv + heads * hd * h + h * 2 * inter + inter * h + 4 * h  # qkv+bias, o, gate_up, down, 4 norms
    vocab = -(-cfg["vocab_size"] // 64) * 64
    rotary = cfg["max_position_embeddings"] * int(hd * cfg["partial_rotary_factor"])
    weights = 2 * (layers * per_layer + 2 * vocab * h + h + rotary)  # + embedding, untied LM head, final norm
    (cand,) = out["candidates"]
    assert cand["weights_bytes"] == weights
    block_bytes = layers * 2 * 16 * kv * hd * 2  # K and V, block_size 16, bf16
    assert cand["num_gpu_blocks"] == cand["available_kv_cache_bytes"] // block_bytes > 0
    assert cand["kv_cache_tokens"] == cand["num_gpu_blocks"] * 16

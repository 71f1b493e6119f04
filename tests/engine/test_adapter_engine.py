"""The engine adapter against the real installed vLLM (issue 12). Skipped where ``vllm`` is not
importable; the CI tier runs them in an engine venv: ``VENV/bin/python -m pytest -q tests/engine``.

One process imports vLLM once; each test opens its own engine session (one per job, as a
profile job does)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import REPO
from tuner.engine import vllm_importable

#: CI sets CTX_TUNER_REQUIRE_ENGINE=1 so that a missing vllm fails instead of skipping.
REQUIRED = os.environ.get("CTX_TUNER_REQUIRE_ENGINE") == "1"
if REQUIRED and not vllm_importable():
    raise RuntimeError("CTX_TUNER_REQUIRE_ENGINE=1 but vllm is not importable in this Python")
pytestmark = pytest.mark.skipif(not vllm_importable(), reason="vllm is not importable in this Python")

GiB = 1 << 30


def _session(model_dir: Path, **kw):
    from tuner.engine.adapter import EngineSettings, open_session

    return open_session(str(model_dir), EngineSettings(**kw))


def _plugin_specs(model_dir: Path, version: str, **kw) -> dict:
    from tuner.memory.eras import resolve_dtype
    from tuner.model.modelspec import load_model_spec, read_architectures, read_top, without_nulls
    from tuner.model.plugin import RankSettings, load_registry

    cfg = model_dir / "config.json"
    plugin, _ = load_registry().for_architectures(read_architectures(cfg))
    spec, _ = load_model_spec(cfg, defaults=plugin.config_defaults(without_nulls(read_top(cfg))))
    return plugin.kv_cache_spec(spec, RankSettings(engine_version=version, dtype=resolve_dtype("auto", spec.torch_dtype),
                                                   **kw))


def test_adapter_llama_specs_weights_and_blocks(shared_dir):
    from tuner.memory import kvcache
    from tuner.engine import crosscheck
    from tuner.errors import DropError

    model = shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct"
    s = _session(model, max_num_batched_tokens=8192, max_num_seqs=1024)
    specs = crosscheck.to_tuner_specs(s.kv_cache_specs())
    assert crosscheck.spec_summary(specs) == [
        {"kind": "FullAttentionSpec", "block_size": 16, "page_size_bytes": 16 * 8 * 256 * 2, "layers": 32}]
    # every parameter in bf16 (8,030,261,248) + the rotary cos/sin cache (131072 x 128 bf16) + 128 fp32 inv_freq
    assert s.weights()["bytes"] == 2 * 8_030_261_248 + 131072 * 128 * 2 + 512
    assert s.config_report()["max_model_len"] == 131072  # derived from the config
    avail = 54 * GiB + 12345
    got = s.kv_sizing(avail, 8192)
    mine = kvcache.get_kv_cache_config(s.version, specs, avail, max_model_len=8192, max_num_batched_tokens=8192)
    assert got["starts"] and got["num_gpu_blocks"] == mine.num_blocks == avail // (32 * 65536)
    refused = s.kv_sizing(2 * GiB, 131072)
    assert not refused["starts"] and 0 < refused["estimated_max_model_len"] <= 16 * (2 * GiB // (32 * 65536))
    port = crosscheck.tuner_sizing(s.version, specs, 2 * GiB, 131072, 8192)  # ctx-tuner's port says the same
    assert not port["starts"]
    assert f"estimated maximum model length is {refused['estimated_max_model_len']}" in port["error"]
    # the plugin agrees at the installed release
    chk = crosscheck.compare(_plugin_specs(model, s.version), specs, version=s.version, reference_bytes=40 * GiB,
                             block_size=16, max_num_batched_tokens=8192)
    assert chk["agree"] is True, chk["differences"]
    with pytest.raises(DropError) as ei:
        _session(model, quantization="no-such-method")
    assert ei.value.field == "quantization" and "no-such-method" in str(ei.value)


def test_adapter_fake_tensor_parallel_splits_kv_heads(shared_dir):
    from tuner.engine import crosscheck

    s = _session(shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct", tensor_parallel_size=2)
    specs = crosscheck.to_tuner_specs(s.kv_cache_specs())
    assert {x.num_kv_heads for x in specs.values()} == {4}
    assert s.kv_sizing(40 * GiB, 8192)["num_gpu_blocks"] == 40 * GiB // (32 * 32768)


def test_adapter_nemotron_h_ssm_state_float16_after_0_20(shared_dir):
    """The failure the engine found: from vLLM 0.20 Nemotron-H's SSM state is float32 (blocks of
    4128 tokens), where the plugin kept float16 (2080). The plugin now follows the release."""
    from tuner.engine import crosscheck

    model = shared_dir / "models" / "nvidia--Nemotron-H-56B-Base-8K"
    s = _session(model)
    raw = s.kv_cache_specs()
    mamba = [x for x in raw.values() if type(x).__name__ == "MambaSpec"]
    assert len(mamba) == 54 and [str(d) for d in mamba[0].dtypes] == ["torch.bfloat16", "torch.float32"]
    eng = crosscheck.to_tuner_specs(raw)
    assert {x.block_size for x in eng.values()} == {4128}
    chk = crosscheck.compare(_plugin_specs(model, s.version), eng, version=s.version, reference_bytes=40 * GiB,
                             block_size=16, max_num_batched_tokens=8192)
    assert chk["agree"] is True, chk["differences"]
    assert chk["engine"]["num_gpu_blocks"] == s.kv_sizing(40 * GiB, 4128)["num_gpu_blocks"] == 254


def test_adapter_unserved_architecture_end_to_end(monkeypatch):
    """A drop for an architecture no plugin serves (OLMoE) runs end to end from the engine, and its
    run names its sources."""
    from tuner.question.drop import load_drop
    from tuner.jobs.job import run_job

    monkeypatch.delenv("CTX_TUNER_ENGINE", raising=False)
    d = load_drop(REPO / "configs" / "engine" / "tiny-olmoe-engine.yaml")
    dev = d.resolve_device()
    r = run_job({"drop": d.to_dict(), "config_path": str(d.model_path() / "config.json"),
                 "device": {"name": dev.name, "total_memory_bytes": dev.total_memory_bytes}})
    assert r["plugin"] == "engine"
    ts = r["term_sources"]
    assert (ts["kv_cache_spec"], ts["weights"], ts["activation_peak"]) == ("engine", "engine", "engine-trace")
    assert "fused MoE" in ts["activation_approximate"]  # cpu_fused_moe met: its margin is added
    chk = r["engine_check"]
    (tr,) = chk["trace"]
    # the margin of the fused MoE is the CUDA Triton experts' workspace (vLLM's workspace_shapes):
    # tiny OLMoE, N 8192, top-k 2, w13 2 x 256, hidden 512, bf16: workspace13 [8192, 2, 512] shared with
    # the output [8192, 512] (counted by the trace) + workspace2 [8192, 2, 512]
    assert "_C::cpu_fused_moe" in tr["ops"]
    assert tr["margin_bytes"] == tr["moe_workspace_bytes"] == (8192 * 2 * 512 - 8192 * 512 + 8192 * 2 * 512) * 2
    run = r["runs"][0]
    assert run["forward_peak_bytes"] == tr["forward_peak_bytes"] > 0
    assert run["activation_peak_bytes"] == tr["activation_peak_bytes"] + tr["margin_bytes"] + tr["persistent_bytes"]
    assert chk["decision"] == "engine (no plugin)" and chk["releases_match"] is True
    # 4 layers x 8 KV heads x 64 x 2 (K, V) x bf16 x 16 tokens
    assert chk["check"]["engine"]["specs"] == [
        {"kind": "FullAttentionSpec", "block_size": 16, "page_size_bytes": 16 * 8 * 128 * 2, "layers": 4}]
    assert r["runs"][0]["weights_bytes"] == chk["weights"]["bytes"] > 0
    # the engine's scheduler defaults for an H100 serve (vLLM's get_batch_defaults) equal the era rule's
    dfl = chk["defaults"]
    assert dfl["engine"] == {"max_num_batched_tokens": 8192, "max_num_seqs": 1024, "enable_chunked_prefill": True,
                             "block_size": 16}
    assert dfl["ctx_tuner"]["max_num_batched_tokens"] == 8192 and dfl["differences"] == [] and dfl["applied"] == {}
    assert ts["scheduler_defaults"] == "engine"  # the same release: the engine's values are the ones used
    (p,) = chk["proposals"]
    assert p["agree"] and p["engine"]["num_gpu_blocks"] == r["proposals"][0]["num_gpu_blocks"]

"""Hybrid plugins (Nemotron-H Mamba-2, Qwen3.5/3.6 Gated DeltaNet): hand-computed state pages, the
hybrid attention block size of vLLM 0.19 (attention page >= state page, state padded), groups,
and weights against transformers' parameter counts."""

from __future__ import annotations

import pytest

from tuner.memory import kvcache
from tuner.memory.kvcache import FullAttentionSpec, MambaSpec
from tuner.model.modelspec import load_model_spec
from tuner.model.plugin import RankSettings, load_registry
from tuner.plugins.hybrid import hybrid_attention_block_size


def _settings(**kw):
    return RankSettings(**{"engine_version": "0.19.0", "dtype": "bfloat16", **kw})


def _spec(shared_dir, name):
    return load_model_spec(shared_dir / "models" / name / "config.json")[0]


def _params(plugin, spec, settings):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        module = plugin.build_model(spec, settings)
        module = getattr(module, "text", module)  # the text model of a multimodal wrapper
        return sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values())


def test_block_size_rule():
    # 16 · cdiv(page, 16 · per_token); a larger user block size wins
    assert hybrid_attention_block_size(3_207_168, 4096) == 784
    assert hybrid_attention_block_size(3_207_168, 4096, 1024) == 1024
    assert hybrid_attention_block_size(1000, 4096) == 16


def test_qwen35_deltanet_pages(shared_dir):
    plugin = load_registry().by_name("qwen3_5")
    spec = _spec(shared_dir, "Qwen--Qwen3.5-27B")  # 64 layers: 48 GDN + 16 full (4 KV × 256)
    specs = plugin.kv_cache_spec(spec, _settings())
    states = [s for s in specs.values() if isinstance(s, MambaSpec)]
    attn = [s for s in specs.values() if isinstance(s, FullAttentionSpec)]
    assert len(states) == 48 and len(attn) == 16
    # conv (3, 2·16·128 + 48·128 = 10240) bf16 + recurrent (48, 128, 128) fp32 (mamba_ssm_dtype)
    conv, rec = 3 * 10240 * 2, 48 * 128 * 128 * 4
    assert states[0].shapes == ((3, 10240), (48, 128, 128)) and states[0].unpadded_page_size_bytes == conv + rec
    per_token = 2 * 4 * 256 * 2
    assert attn[0].block_size == 16 * -(-(conv + rec) // (16 * per_token)) == 784
    assert attn[0].page_size_bytes == states[0].page_size_bytes == 784 * per_token
    cfg = kvcache.get_kv_cache_config("0.19.0", specs, 1 << 40, max_model_len=8192, max_num_batched_tokens=8192)
    assert len(cfg.kv_cache_groups) == 4 and cfg.bytes_per_block == 16 * 784 * per_token  # 3 GDN groups + 1
    # TP 4: heads shard, 1 KV head per rank
    tp4 = plugin.kv_cache_spec(spec, _settings(tensor_parallel_size=4))
    st4 = next(s for s in tp4.values() if isinstance(s, MambaSpec))
    assert st4.shapes == ((3, 2560), (12, 128, 128))
    at4 = next(s for s in tp4.values() if isinstance(s, FullAttentionSpec))
    assert at4.block_size == 16 * -(-(3 * 2560 * 2 + 12 * 128 * 128 * 4) // (16 * 2 * 1 * 256 * 2))


def test_nemotron_h_mamba2_pages(shared_dir):
    plugin = load_registry().by_name("nemotron_h")
    spec = _spec(shared_dir, "nvidia--Nemotron-H-56B-Base-8K")  # 118 layers: 54 M, 10 *, 54 -
    specs = plugin.kv_cache_spec(spec, _settings())
    states = [s for s in specs.values() if isinstance(s, MambaSpec)]
    attn = [s for s in specs.values() if isinstance(s, FullAttentionSpec)]
    assert (len(states), len(attn)) == (54, 10)
    # conv (3, 256·64 + 2·8·256) bf16 + SSM (256, 64, 256) float16 (vLLM's default for Nemotron-H)
    conv, ssm = 3 * 20480 * 2, 256 * 64 * 256 * 2
    assert states[0].unpadded_page_size_bytes == conv + ssm
    per_token = 2 * 8 * 128 * 2
    assert attn[0].block_size == 2080 and states[0].page_size_bytes == attn[0].page_size_bytes == 2080 * per_token
    fp8 = plugin.kv_cache_spec(spec, _settings(kv_cache_dtype="fp8"))
    assert next(s for s in fp8.values() if isinstance(s, FullAttentionSpec)).block_size == \
        16 * -(-(conv + ssm) // (16 * per_token // 2))


@pytest.mark.parametrize("name,model,params", [
    ("nemotron_h", "nvidia--Nemotron-H-56B-Base-8K", 56_324_350_464),
    ("qwen3_5", "Qwen--Qwen3.5-27B", 27_356_728_560 - 460_730_096),  # text model (vision tower is vision.py's)
])
def test_text_parameters_match_transformers(shared_dir, name, model, params):
    plugin = load_registry().by_name(name)
    spec = _spec(shared_dir, model)
    p = _params(plugin, spec, _settings())
    # vLLM allocates dt_bias/D in the model dtype like transformers; A / A_log are fp32 (+2 bytes each)
    extra = 0
    if name == "qwen3_5":
        extra = 48 * 48 * 2  # A_log fp32 [48] on 48 GDN layers vs transformers' bf16 count
    else:
        extra = 54 * 256 * 2  # A fp32 [256] on 54 Mamba layers
    assert p == 2 * params + extra


@pytest.mark.parametrize("version,ssm_bytes,blocks", [
    ("0.19.1", 2, 2080),   # NemotronHForCausalLMConfig falls back to float16 (0.19.0, 0.19.1)
    ("0.20.0", 4, 4128),   # DEFAULT_MAMBA_SSM_CACHE_DTYPE = "float32" from 0.20.0
    ("0.32.0", 4, 4128),
])
def test_nemotron_h_ssm_state_float16_after_0_20_doubles_blocks(shared_dir, version, ssm_bytes, blocks):
    """The failure: from vLLM 0.20 the Nemotron-H SSM state defaults to float32, while the plugin
    kept float16 for every release (824 blocks where vLLM 0.32 has 415, engine cross-check)."""
    plugin = load_registry().by_name("nemotron_h")
    spec = _spec(shared_dir, "nvidia--Nemotron-H-56B-Base-8K")
    specs = plugin.kv_cache_spec(spec, _settings(engine_version=version))
    state = next(s for s in specs.values() if isinstance(s, MambaSpec))
    attn = next(s for s in specs.values() if isinstance(s, FullAttentionSpec))
    assert state.dtypes_bytes == (2, ssm_bytes)
    assert state.unpadded_page_size_bytes == 3 * 20480 * 2 + 256 * 64 * 256 * ssm_bytes
    assert attn.block_size == blocks  # 16 · cdiv(state page, 16 · 4096 B per token)
    # a config that names the dtype wins over the release default
    named = _spec(shared_dir, "nvidia--Nemotron-H-56B-Base-8K")
    named.top["mamba_ssm_cache_dtype"] = "float16"
    st = next(s for s in plugin.kv_cache_spec(named, _settings(engine_version=version)).values()
              if isinstance(s, MambaSpec))
    assert st.dtypes_bytes == (2, 2)

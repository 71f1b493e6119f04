"""KV cache dtypes and quantization names by vLLM release (issue 16).

Every expected value here was read in the release's wheel (``pip download vllm==X --no-deps``):
``CacheDType`` in vllm/config/cache.py, ``QuantizationMethods`` in
vllm/model_executor/layers/quantization/__init__.py, the page sizes of
vllm/v1/kv_cache_interface.py (0.20, 0.24, 0.26) and of the 0.28 backends' ``customize_spec``,
and ``get_kv_cache_quant_algo_string`` of vllm/utils/torch_utils.py (0.14, 0.19, 0.20, 0.28).
"""

from __future__ import annotations

import copy
import textwrap

import pytest

from tuner.question.drop import parse_drop
from tuner.memory.engine_checks import check_kv_cache_dtype, check_quantization
from tuner.errors import DropError, ModelConfigError
from tuner.memory.kvcache import (ChunkedLocalAttentionSpec, FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec,
                           UnsupportedKVCacheError, kv_content_bytes, kv_quant_mode_for, resolve_kv_cache_dtype,
                           with_kv_quant_mode)
from tuner.releases.names import (deprecated_quantization_methods, first_release_accepting, kv_cache_dtypes,
                              quantization_methods)

# --- accepted names by release ------------------------------------------------------------------


@pytest.mark.parametrize("release, name, accepted", [
    ("0.4.0", "fp8", False), ("0.4.1", "fp8", True), ("0.4.3", "fp8_e4m3", True),  # arg_utils choices
    ("0.9.2", "fp8_inc", False), ("0.10.0", "fp8_inc", True),
    ("0.10.2", "bfloat16", False), ("0.11.0", "bfloat16", True),
    ("0.11.0", "fp8_ds_mla", False), ("0.11.1", "fp8_ds_mla", True),
    ("0.17.0", "float16", False), ("0.18.0", "float16", True),
    ("0.19.1", "fp8_per_token_head", False), ("0.20.0", "fp8_per_token_head", True),
    ("0.20.0", "int8_per_token_head", True), ("0.20.0", "nvfp4", True),
    ("0.24.0", "int4_per_token_head", False), ("0.25.0", "int4_per_token_head", True),
    ("0.27.0", "nvfp4_4over6", False), ("0.28.0", "nvfp4_4over6", True),
    ("0.29.0", "nvfp4_ds_mla", False), ("0.30.0", "nvfp4_ds_mla", True),
    ("0.32.0", "octave_k3v4", False), ("0.33.0", "octave_k3v4", True),
])
def test_kv_cache_dtype_names_by_release(release, name, accepted):
    assert (name in kv_cache_dtypes(release)) is accepted


def test_quantization_names_by_release_and_their_aliases():
    # auto-round: listed 0.9.0–0.14 (deprecated in 0.14), gone from 0.15; "inc" from 0.10.0
    assert "auto-round" not in quantization_methods("0.8.5")
    assert "auto-round" in quantization_methods("0.9.0") and "auto-round" in quantization_methods("0.14.0")
    assert "auto-round" in deprecated_quantization_methods("0.14.0")
    assert "auto-round" not in quantization_methods("0.15.0")
    assert "inc" not in quantization_methods("0.9.2") and "inc" in quantization_methods("0.10.0")
    assert all("auto_round" not in quantization_methods(v) for v in ("0.9.0", "0.19.0", "0.24.0", "0.33.0"))
    # compressed-tensors spelled with a hyphen in every release that has it (0.5.0+)
    assert "compressed-tensors" in quantization_methods("0.5.0")
    assert "compressed_tensors" not in quantization_methods("0.19.0")
    # other changes: bitsandbytes dropped in 0.28, mxfp4 from 0.10.1(.1), auto_gptq 0.22, auto_awq 0.24
    assert "bitsandbytes" in quantization_methods("0.27.0") and "bitsandbytes" not in quantization_methods("0.28.0")
    assert "mxfp4" not in quantization_methods("0.10.0") and "mxfp4" in quantization_methods("0.10.1.1")
    assert first_release_accepting("quantization", "auto_gptq") == (0, 22, 0)
    assert first_release_accepting("quantization", "auto_awq") == (0, 24, 0)
    assert first_release_accepting("kv_cache_dtype", "nvfp4") == (0, 20, 0)
    assert len(quantization_methods("0.19.0")) == 23 and len(quantization_methods("0.24.0")) == 30


def test_quantization_name_the_release_does_not_know_is_refused_with_its_list():
    with pytest.raises(DropError) as exc:
        check_quantization("mxfp4", None, version=(0, 10, 0), path="/d/x.yaml")
    assert exc.value.field == "quantization" and exc.value.path == "/d/x.yaml"
    assert "first accepted in 0.10.1" in str(exc.value) and "'inc'" in str(exc.value)
    with pytest.raises(DropError):  # auto-round no longer a name in 0.24 (a 16-bit checkpoint)
        check_quantization("auto-round", None, version=(0, 24, 0), path=None)
    # an auto-round checkpoint: vLLM 0.19+ turns any spelling into "inc" before the name check
    assert check_quantization("auto_round", {"quant_method": "auto-round"}, version=(0, 20, 1), path=None) == []


def test_kv_cache_dtype_of_another_release_is_refused_naming_file_and_field():
    with pytest.raises(DropError) as exc:
        check_kv_cache_dtype("nvfp4", version=(0, 19, 0), path="/d/x.yaml")
    assert exc.value.field == "kv_cache_dtype" and exc.value.path == "/d/x.yaml"
    assert "first accepted in vLLM 0.20.0" in str(exc.value)
    check_kv_cache_dtype("nvfp4", version=(0, 20, 0), path=None)  # accepted, modelled
    with pytest.raises(ModelConfigError) as exc2:  # accepted but not modelled
        check_kv_cache_dtype("turboquant_k8v4", version=(0, 24, 0), path="/d/x.yaml")
    assert "kv_cache_dtype" in str(exc2.value)


DROP = """\
name: t
model: meta-llama/Llama-3.1-8B-Instruct
device: H100-80GB
engine_version: "{v}"
kv_cache_dtype: {kv}
candidates:
  gpu_memory_utilization: [0.9]
"""


def test_drop_kv_cache_dtype_checked_against_its_engine_version():
    assert parse_drop(textwrap.dedent(DROP.format(v="0.24.0", kv="int8_per_token_head")), "/d/t.yaml") \
        .kv_cache_dtype == "int8_per_token_head"
    with pytest.raises(DropError) as exc:
        parse_drop(textwrap.dedent(DROP.format(v="0.19.0", kv="int8_per_token_head")), "/d/t.yaml")
    assert exc.value.field == "kv_cache_dtype" and exc.value.path == "/d/t.yaml"
    with pytest.raises(DropError) as exc:
        parse_drop(textwrap.dedent(DROP.format(v="0.24.0", kv="int9")), "/d/t.yaml")
    assert exc.value.field == "kv_cache_dtype"


def test_unknown_kv_cache_dtype_listed_every_releases_names():
    """A name no release accepts was refused with the union of all releases' names (turboquant,
    nvfp4_4over6 … for a 0.19 drop); it is refused with the drop's own release's names."""
    with pytest.raises(DropError) as exc:
        parse_drop(textwrap.dedent(DROP.format(v="0.19.0", kv="fp9")), "/d/t.yaml")
    msg = str(exc.value)
    assert exc.value.field == "kv_cache_dtype" and "for vLLM 0.19.0" in msg
    for name in kv_cache_dtypes((0, 19, 0)):
        assert repr(name) in msg
    assert "nvfp4" not in msg and "turboquant" not in msg
    with pytest.raises(DropError) as exc:
        parse_drop(textwrap.dedent(DROP.format(v="0.19.0", kv="3")), "/d/t.yaml")
    assert exc.value.field == "kv_cache_dtype"


# --- page sizes ---------------------------------------------------------------------------------


def test_quant_mode_names_follow_get_kv_quant_mode():
    assert kv_quant_mode_for("fp8_per_token_head") == "FP8_PER_TOKEN_HEAD"
    assert kv_quant_mode_for("int4_per_token_head") == "INT4_PER_TOKEN_HEAD"
    assert kv_quant_mode_for("nvfp4") == kv_quant_mode_for("nvfp4_4over6") == "NVFP4"
    assert kv_quant_mode_for("fp8_e5m2") == "FP8_PER_TENSOR"
    assert kv_quant_mode_for("auto") is None and kv_quant_mode_for("bfloat16") is None


def test_page_sizes_per_kv_quant_mode():
    # Llama-3.1-8B per rank: 8 KV heads of 128, block 16.
    def page(kv, dt=1):
        return FullAttentionSpec(16, 8, 128, dt, kv_quant_mode=kv_quant_mode_for(kv)).page_size_bytes
    assert page("auto", 2) == 2 * 16 * 8 * 128 * 2 == 65536
    assert page("fp8") == 32768
    # AttentionSpec.page_size_bytes (0.20–0.27): + 2 · block · heads · 4 bytes of fp32 scales
    assert page("fp8_per_token_head") == page("int8_per_token_head") == 32768 + 2 * 16 * 8 * 4 == 33792
    # 0.26 real_page_size_bytes: head_size // 2 for int4, plus the same scales
    assert page("int4_per_token_head") == 2 * 16 * 8 * 64 + 2 * 16 * 8 * 4 == 17408
    # nvfp4_kv_cache_full_dim(128) = 64 + 8 per K and per V
    assert page("nvfp4") == 16 * 8 * (72 + 72) == 18432
    assert kv_content_bytes("NVFP4", 256, 256, 1) == 2 * (128 + 16)
    assert SlidingWindowSpec(16, 8, 128, 1, 4096, kv_quant_mode="NVFP4").page_size_bytes == 18432
    assert ChunkedLocalAttentionSpec(16, 8, 128, 1, 8192, kv_quant_mode="INT8_PER_TOKEN_HEAD").page_size_bytes == 33792


def test_plugin_specs_get_the_quant_mode_and_mla_or_turboquant_are_refused():
    specs = {"a": FullAttentionSpec(16, 8, 128, 1), "b": SlidingWindowSpec(16, 8, 128, 1, 4096)}
    assert with_kv_quant_mode(specs, "fp8") is specs
    out = with_kv_quant_mode(specs, "fp8_per_token_head")
    assert {s.kv_quant_mode for s in out.values()} == {"FP8_PER_TOKEN_HEAD"}
    assert out["a"].page_size_bytes == 33792
    mla = {"m": MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype_bytes=1)}
    with pytest.raises(UnsupportedKVCacheError):
        with_kv_quant_mode(mla, "nvfp4")
    with pytest.raises(UnsupportedKVCacheError):
        with_kv_quant_mode(specs, "turboquant_k8v4")


# --- the checkpoint's own KV scheme ------------------------------------------------------------

MODELOPT_FP8 = {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}


def test_modelopt_checkpoint_kv_algo_resolves_auto():
    assert resolve_kv_cache_dtype("auto", MODELOPT_FP8, "0.13.0") == "auto"  # no resolution before 0.14
    assert resolve_kv_cache_dtype("auto", MODELOPT_FP8, "0.14.0") == "fp8_e4m3"
    assert resolve_kv_cache_dtype("fp8_e5m2", MODELOPT_FP8, "0.19.0") == "fp8_e5m2"  # explicit wins
    nv = {"quant_method": "modelopt_fp4", "kv_cache_scheme": {"num_bits": 4, "type": "float"}}
    assert resolve_kv_cache_dtype("auto", nv, "0.19.0") == "auto"  # nvfp4 mapping from 0.20
    assert resolve_kv_cache_dtype("auto", nv, "0.20.0") == "nvfp4"
    static = {"quant_method": "modelopt", "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": False}}
    assert resolve_kv_cache_dtype("auto", static, "0.19.0") == "fp8_e4m3"
    dyn = copy.deepcopy(static)
    dyn["kv_cache_scheme"]["dynamic"] = True
    assert resolve_kv_cache_dtype("auto", dyn, "0.19.0") == "auto"
    # compressed-tensors: kv_cache_scheme carries scales only, the cache stays in the model dtype
    ct = {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}
    assert resolve_kv_cache_dtype("auto", ct, "0.24.0") == "auto"


# --- end to end: a job sizes the cache with the release's layout --------------------------------


def _llama_case(tmp_path, shared_dir, *, version, kv, quantization_config=None, gpu="NVIDIA H100 80GB"):
    import json

    src = shared_dir / "models" / "meta-llama--Llama-3.1-8B-Instruct" / "config.json"
    cfg = json.loads(src.read_text())
    if quantization_config:
        cfg["quantization_config"] = quantization_config
    d = tmp_path / f"m-{version}-{kv}" / "meta-llama--Llama-3.1-8B-Instruct"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    case = {"id": "t", "vllm_version": version, "engine": "V1", "model": "meta-llama/Llama-3.1-8B-Instruct",
            "dtype": "bfloat16", "kv_cache_dtype": kv, "gpu": gpu, "gpu_total_gib": 79.19,
            "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
            "settings": {"gpu_memory_utilization": 0.9, "max_model_len": 8192, "max_num_seqs": 256,
                         "max_num_batched_tokens": 2048}}
    return case, d.parent


def _run(case, models_dir):
    from tuner.jobs.job import run_job
    from tuner.accuracy.validate import case_request

    res = run_job(case_request(case, models_dir))
    return res["candidates"][0], res.get("warnings") or []


def test_job_sizes_per_token_head_and_nvfp4_caches(tmp_path, shared_dir):
    fp8, _ = _run(*_llama_case(tmp_path, shared_dir, version="0.24.0", kv="fp8"))
    pth, _ = _run(*_llama_case(tmp_path, shared_dir, version="0.24.0", kv="fp8_per_token_head"))
    # nvfp4 KV on 0.24 runs only on compute capability 10.x (test_nvfp4_kv_cache_on_hopper_started_with_no_note)
    nv, _ = _run(*_llama_case(tmp_path, shared_dir, version="0.24.0", kv="nvfp4", gpu="NVIDIA B200"))
    assert fp8["available_kv_cache_bytes"] == pth["available_kv_cache_bytes"] == nv["available_kv_cache_bytes"]
    kv = fp8["available_kv_cache_bytes"]
    layers = 32
    assert fp8["num_gpu_blocks"] == kv // (32768 * layers)
    assert pth["num_gpu_blocks"] == kv // (33792 * layers)
    assert nv["num_gpu_blocks"] == kv // (18432 * layers)


def test_job_resolves_auto_from_a_modelopt_checkpoint(tmp_path, shared_dir):
    qc = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    auto, warns = _run(*_llama_case(tmp_path, shared_dir, version="0.19.0", kv="auto", quantization_config=qc))
    fp8, _ = _run(*_llama_case(tmp_path, shared_dir, version="0.19.0", kv="fp8_e4m3", quantization_config=qc))
    assert auto["num_gpu_blocks"] == fp8["num_gpu_blocks"] > 0
    assert any("kv_cache_dtype auto is fp8_e4m3" in w for w in warns)
    old, _ = _run(*_llama_case(tmp_path, shared_dir, version="0.13.0", kv="auto", quantization_config=qc))
    old8, _ = _run(*_llama_case(tmp_path, shared_dir, version="0.13.0", kv="fp8_e4m3", quantization_config=qc))
    assert old8["num_gpu_blocks"] > 1.9 * old["num_gpu_blocks"]  # 0.13: auto stays 16-bit


def test_local_layers_lost_their_kv_quant_layout_when_promoted_to_full():
    """The failure (found by the KV differential test once int8_per_token_head / nvfp4 were drawn): with
    the hybrid manager off, sliding-window and chunked layers promoted to full attention kept their
    quantized page in ctx-tuner but not in vLLM, or the other way round: 53 of 6,000 cases differed from
    vLLM 0.32 (e.g. 1477 blocks where vLLM has 1447). vLLM's unify_hybrid_kv_cache_specs carries
    head_size_v and kv_quant_mode for sliding layers from 0.21 and, via replace_as, for chunked layers
    from 0.28; 0.20 (and chunked before 0.28) builds the full spec without them."""
    from tuner.memory import kvcache as kc

    full = kc.FullAttentionSpec(16, 8, 128, 1, kv_quant_mode="INT8_PER_TOKEN_HEAD")
    sw = kc.SlidingWindowSpec(16, 8, 128, 1, 1024, kv_quant_mode="INT8_PER_TOKEN_HEAD")
    local = kc.ChunkedLocalAttentionSpec(16, 8, 128, 1, 8192, kv_quant_mode="INT8_PER_TOKEN_HEAD")
    plain, scaled = 16 * 8 * 256, 16 * 8 * (256 + 8)
    assert full.page_size_bytes == sw.page_size_bytes == scaled
    for version, sw_page, local_page in (("0.20.0", plain, plain), ("0.21.0", scaled, plain),
                                         ("0.27.0", scaled, plain), ("0.28.0", scaled, scaled),
                                         ("0.32.0", scaled, scaled)):
        out = kc.unify_hybrid_kv_cache_specs(version, {"a": full, "b": sw})
        assert out["b"].page_size_bytes == sw_page, version
        out = kc.unify_hybrid_kv_cache_specs(version, {"a": full, "c": local})
        assert out["c"].page_size_bytes == local_page, version
    nv = kc.SlidingWindowSpec(16, 8, 128, 1, 1024, kv_quant_mode="NVFP4")
    out = kc.unify_hybrid_kv_cache_specs("0.32.0", {"a": full, "b": nv})
    assert out["b"].page_size_bytes == 16 * 8 * (72 + 72) == nv.page_size_bytes


def test_nvfp4_kv_cache_on_hopper_started_with_no_note():
    """F5: `--kv-cache-dtype nvfp4` on an H100 (0.26, TP4) STARTED with no note. vLLM's FlashInfer (the
    one backend listing nvfp4, vllm/v1/attention/backends/flashinfer.py supports_kv_cache_dtype) takes
    it only on compute capability 10.x in 0.23-0.31 (backend selection: "No valid attention backend
    found"), also on 8.x/9.x/12.x through FA2 from 0.32; 0.21-0.22 accept it unchecked (a note)."""
    from tuner.errors import DropError
    from tuner.memory.engine_checks import nvfp4_kv_cache_check

    with pytest.raises(DropError) as exc:
        nvfp4_kv_cache_check("nvfp4", version=(0, 26, 0), compute_capability="9.0", path="/d/x.yaml")
    assert exc.value.field == "kv_cache_dtype"
    assert "No valid attention backend found for kv_cache_dtype 'nvfp4' on compute capability 9.0" in str(exc.value)
    assert nvfp4_kv_cache_check("nvfp4", version=(0, 26, 0), compute_capability="10.0") is None
    assert nvfp4_kv_cache_check("nvfp4", version=(0, 32, 0), compute_capability="9.0") is None  # FA2
    with pytest.raises(DropError):
        nvfp4_kv_cache_check("nvfp4", version=(0, 32, 0), compute_capability="7.5")
    with pytest.raises(DropError):
        nvfp4_kv_cache_check("nvfp4", version=(0, 20, 0), compute_capability="10.0")  # no backend lists it
    assert "no check of the card" in nvfp4_kv_cache_check("nvfp4", version=(0, 22, 0), compute_capability="9.0")
    assert nvfp4_kv_cache_check("nvfp4", version=(0, 26, 0), compute_capability="9.0", mla=True) is None
    assert nvfp4_kv_cache_check("fp8", version=(0, 26, 0), compute_capability="9.0") is None
    from tests.conftest import REPO
    from tuner.reports.check import CheckInputError, run_check

    model = str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct")
    with pytest.raises((CheckInputError, DropError)) as exc2:
        run_check(["vllm", "serve", model, "--kv-cache-dtype", "nvfp4", "-tp", "4"], device="H100-80GB",
                  engine_version="0.26.0", variants=False)
    assert "compute capability 9.0" in str(exc2.value)

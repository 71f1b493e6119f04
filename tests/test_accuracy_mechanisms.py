"""Accuracy mechanisms of issue 28, each pinned from the vLLM source of the releases it applies to.

Every test states the bytes for a given release, settings and card, and names the file it was
read from; a regression test is named after the failure it pins.
"""

from __future__ import annotations

import torch

from tuner.memory.eras import GiB, era_for, sampler_family, sampler_path
from tuner.logs.logparse import flashinfer_installed
from tuner.model.simulate.sampler import run_dummy_sampler, sort_workspace
from tuner.model.simulate.tracker import MemoryTracker


class _Head(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(vocab, hidden, dtype=torch.bfloat16), requires_grad=False)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.w)


def _sampler_peak(version: str, r: int, v: int, h: int = 64, flashinfer: bool | None = None) -> int:
    e = era_for(version)
    with torch.device("meta"):
        head = _Head(v, h)
        hidden = torch.empty(r, h, dtype=torch.bfloat16)
        with torch.no_grad(), MemoryTracker() as t:
            run_dummy_sampler(sampler_family(e, flashinfer=flashinfer), head, hidden, num_reqs=r,
                              version=e.version.key)
    return t.peak_bytes


# --- 1. the sampler's dummy run by path ----------------------------------------------------------

def test_sampler_path_by_release_and_install():
    """vllm/v1/sample/ops/topk_topp_sampler.py: 0.10.1.1 / 0.11.0 use FlashInfer when it imports
    (``VLLM_USE_FLASHINFER_SAMPLER`` unset or 1), 0.11.1 / 0.16.0 only with the env var = 1; the
    wheel lists flashinfer-python only as an extra before 0.11.1 (METADATA), so a pip install
    samples with PyTorch's sort — the assumption is named."""
    p = sampler_path(era_for("0.10.1.1"))
    assert p.flashinfer is False and p.assumption["name"] == "flashinfer_installed"
    assert p.assumption["value"] is False
    assert sampler_path(era_for("0.10.1.1"), flashinfer_installed=True) == sampler_path(
        era_for("0.11.0"), flashinfer_installed=True)
    assert sampler_path(era_for("0.11.0"), flashinfer_installed=True).flashinfer is True
    assert sampler_path(era_for("0.11.0"), flashinfer_installed=True, use_flashinfer_sampler="0").flashinfer is False
    assert sampler_path(era_for("0.16.0")).flashinfer is False and sampler_path(era_for("0.16.0")).assumption is None
    assert sampler_path(era_for("0.16.0"), use_flashinfer_sampler="1").flashinfer is True
    assert sampler_path(era_for("0.19.0"), use_flashinfer_sampler="1").flashinfer is False  # Triton path


def test_sort_sampler_peak_is_38_bytes_per_logit_at_1024_rows():
    """The PyTorch path (0.10.1.1 and 0.16.0 ``apply_top_k_top_p``) at R = 1024 rows of a 128,256-
    token vocabulary: bf16 logits 2 + fp32 copy 4 + the sort's values 4 and int64 indices 8 + its
    workspace (reverse indices 8, cub's alternate keys 4 and values 8) = 38 B per sampled logit,
    beside the [R, H] random rows; FlashInfer (0.10.1.1): 2 + 4 + two fp32 buffers = 14 B."""
    r, v, h = 1024, 128256, 4096
    rows, greedy = r * h * 2, r * 8  # the random [R, H] rows; the greedy argmax (int64 [R]) stays alive
    assert _sampler_peak("0.10.1.1", r, v, h, flashinfer=False) == rows + 38 * r * v + greedy
    assert _sampler_peak("0.16.0", r, v, h) == rows + 38 * r * v + greedy
    assert _sampler_peak("0.10.1.1", r, v, h, flashinfer=True) == rows + 14 * r * v + greedy
    # 4.65 GiB vs 1.71 GiB: the gap the 0.11.0 H100 logs show (Llama-3.1-8B activation 4.76 GiB)
    assert round(38 * r * v / GiB, 2) == 4.65


def test_sort_workspace_by_segment_count():
    """PyTorch SortStable.cu: one segment → iota + cub alternates of V (20 B per element of a row);
    < 128 segments → full sort over (key, int2) pairs (8 + 8 + 4 + 4 + 8 = 32 B); else segmented
    radix sort (8 + 4 + 8 = 20 B)."""
    def ws(r, v):
        t = torch.empty(r, v, device="meta")
        return sum(x.numel() * x.element_size() for x in sort_workspace(t))
    assert ws(1, 1000) == 20 * 1000
    assert ws(64, 1000) == 32 * 64 * 1000
    assert ws(256, 1000) == 20 * 256 * 1000


def test_flashinfer_missing_line_read_from_log():
    """The log line vLLM 0.8–0.11.0 prints without FlashInfer decides the path; a FlashInfer
    attention backend proves it installed; silence leaves the pip-install assumption."""
    assert flashinfer_installed(["(RayWorkerWrapper pid=1) WARNING [topk_topp_sampler.py:60] FlashInfer is not "
                                 "available. Falling back to the PyTorch-native implementation"]) is False
    assert flashinfer_installed(["INFO [cuda.py:1] Using FlashInfer backend."]) is True
    assert flashinfer_installed(["Model loading took 14.2488 GiB"]) is None


# --- 3. non-torch memory under TP in older eras ------------------------------------------------

def test_v0_whole_gpu_tp_charge_was_flat_regardless_of_interconnect():
    """V0 0.6.4 (vllm/worker/worker.py: non_torch = (T − free) − allocated, whole GPU): the TP
    group's buffers count by topology. 2x RTX 4090 over PCIe without P2P (custom all-reduce off,
    no NVSwitch): 0.35 GiB + the NCCL communicator's 0.12 GiB, where a flat 1.8 GiB was charged
    (the log prints 0.25 GiB); on H100 NVSwitch the NVLink buffers stay (1.82 GiB at TP2)."""
    from tuner.memory.budget import CUSTOM_ALL_REDUCE_META_SIZE, Topology, non_torch_bytes

    pcie = Topology(interconnect="pcie", p2p=False, compute_capability="8.9")
    assert non_torch_bytes(era_for("0.6.4", "V0"), tensor_parallel_size=2, topology=pcie) == (
        int(0.35 * GiB) + int(0.12 * GiB))
    assert non_torch_bytes(era_for("0.6.4", "V0"), tensor_parallel_size=2) == (
        int(0.35 * GiB) + int((1.82 + 0.12) * GiB) + CUSTOM_ALL_REDUCE_META_SIZE + 2 * 8 * 1024 * 1024)
    assert non_torch_bytes(era_for("0.6.5", "V0"), tensor_parallel_size=2, topology=pcie) == (
        int(1.79 * GiB) + int(0.12 * GiB))


# --- 4. MoE activation under data parallelism ---------------------------------------------------

def _moe_peak(version: str, dp: int, n: int = 512, h: int = 256, i: int = 128, e: int = 16, k: int = 2) -> tuple[int, int]:
    from tuner.model.simulate.moe import FusedMoE, expert_layout

    with torch.device("meta"), expert_layout(1, dp, True):
        moe = FusedMoE(h, i, e, k, torch.bfloat16, engine_version=version, global_num_experts=e)
        x = torch.empty(n, h, dtype=torch.bfloat16)
        logits = torch.empty(n, e, dtype=torch.bfloat16)
        with torch.no_grad(), MemoryTracker() as t:
            out = moe(x, logits)
            shape = tuple(out.shape)
            del out
    assert shape == (n, h)  # back to this rank's tokens
    return t.peak_bytes, moe.num_experts


def test_moe_under_data_parallelism_ran_on_one_ranks_tokens():
    """vllm/model_executor/layers/fused_moe/layer.py ``forward_impl`` (0.10.1.1): with dp_size > 1
    ``get_ep_group().dispatch`` hands every rank all DP ranks' tokens — the naive backend
    (all2all.py ``naive_multicast``, default ≤ 0.10.2) into new ``[dp·N, H]`` / ``[dp·N, E]``
    buffers — so the fused experts' caches are sized on dp × N (65,536 tokens for DP 8 at N 8192),
    where a pass sized them on N; combine all-reduces out of place (another ``[dp·N, H]``)."""
    n, h, i, e, k = 512, 256, 128, 16, 2
    one, experts1 = _moe_peak("0.10.1", 1, n, h, i, e, k)
    eight, experts8 = _moe_peak("0.10.1", 8, n, h, i, e, k)
    assert experts1 == e and experts8 == e // 8  # expert parallelism: E / (dp · tp) experts per rank
    # dp 1, m = 512: top-k weights/ids/indices 3 · m·k·4 = 12,288; cache13 m·k·max(2I, H)·2 = 524,288;
    # cache2 m·k·I·2 = 262,144; align buffers 9,216; the output is the input (``inplace=True``,
    # 0.6 – 0.13: tuner.model.simulate.moe.fused_experts_inplace, docs §19a)
    assert one == 12_288 + 524_288 + 262_144 + 9_216 == 807_936
    # dp 8, m = 4096: + the dispatched [m, H] and [m, E] (2,097,152 + 131,072), every buffer on m
    assert eight == (2_097_152 + 131_072) + 98_304 + (4_194_304 + 2_097_152) + 38_400 == 8_656_384


# --- 2. the CUDA-graph estimate from 0.20 --------------------------------------------------------

def test_cudagraph_estimate_counted_piecewise_graphs_only():
    """vllm/v1/worker/gpu_model_runner.py ``profile_cudagraph_memory`` (0.19, 0.20): per mode,
    first capture + (n − 1) × the second capture's growth, modes added; under FULL_AND_PIECEWISE
    (vllm/v1/cudagraph_dispatcher.py ``initialize_cudagraph_keys``) FULL graphs are the capture
    sizes in [q, q · max_num_seqs]. At 256 sequences (vLLM 0.21 on an RTX A5000 prints
    "PIECEWISE=51 (largest=512), FULL=35 (largest=256)") the estimate is 86/102 of the anchor's
    (51 + 51 graphs at 1024 sequences), where it was taken as 51/51."""
    from tuner.memory.budget import cudagraph_capture_sizes, cudagraph_estimate_bytes, full_decode_capture_sizes

    e = era_for("0.21.0")
    sizes = cudagraph_capture_sizes(e, 256, 2048)
    assert len(sizes) == 51 and max(sizes) == 512
    assert len(full_decode_capture_sizes(sizes, 256)) == 35
    anchor = cudagraph_estimate_bytes(e, num_layers=36, max_num_seqs=1024, max_num_batched_tokens=8192,
                                      hidden_size=4096)
    small = cudagraph_estimate_bytes(e, num_layers=36, max_num_seqs=256, max_num_batched_tokens=2048,
                                     hidden_size=4096)
    assert abs(small - anchor * 86 / 102) <= 1  # both truncated from the same float
    # MTP with 3 draft tokens (q = 4) at 2 sequences: FULL graphs only for 4 and 8 tokens
    assert full_decode_capture_sizes([1, 2, 4, 8, 16], 2, 3) == [4, 8]


# --- 7. settings a record carries that were not read ---------------------------------------------

def test_env_estimate_cudagraphs_and_pp_partition_were_not_read():
    """vllm/envs.py: ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` (0.18+, default "0" in 0.18–0.19,
    "1" from 0.20) gates the estimate in gpu_worker.py ``determine_available_memory``;
    ``VLLM_PP_LAYER_PARTITION`` is taken as given by distributed/utils.py ``get_pp_indices``
    (0.19), with vLLM's length / sum errors. A case's ``env_*`` settings reach the drop."""
    import pytest

    from tuner.errors import KVCacheError
    from tuner.jobs.job import era_with_env, pp_layer_partition
    from tuner.memory.kvcache import layers_per_pp_rank
    from tuner.accuracy.validate import case_env

    e20, e19, e17 = era_for("0.20.0"), era_for("0.19.0"), era_for("0.17.0")
    assert e20.subtracts_cudagraph_estimate and not e19.subtracts_cudagraph_estimate
    assert not era_with_env(e20, {"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0"}).subtracts_cudagraph_estimate
    assert era_with_env(e19, {"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "1"}).subtracts_cudagraph_estimate
    assert era_with_env(e17, {"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "1"}) == e17  # no such variable yet
    assert not era_with_env(e19, {"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "1"},
                            enforce_eager=True).subtracts_cudagraph_estimate
    assert layers_per_pp_rank(48, 2) == [24, 24]
    assert layers_per_pp_rank(48, 2, pp_layer_partition({"VLLM_PP_LAYER_PARTITION": "16,32"})) == [16, 32]
    with pytest.raises(KVCacheError, match="sum\\(partitions\\)=47 does not match num_hidden_layers=48"):
        layers_per_pp_rank(48, 2, (16, 31))
    assert case_env({"env_VLLM_PP_LAYER_PARTITION": "16,32", "env_VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": 0,
                     "max_num_seqs": 8}) == {"VLLM_PP_LAYER_PARTITION": "16,32",
                                             "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0"}


def test_drop_env_names_what_it_does_not_model():
    from tuner.question.drop import parse_drop
    from tuner.errors import DropError
    from tuner.jobs.job import drop_env

    text = ("name: d\nmodel: ./m\ndevice: H100-80GB\ncandidates: {gpu_memory_utilization: [0.9]}\n"
            "env: {VLLM_PP_LAYER_PARTITION: '16,32', VLLM_ROCM_USE_AITER: 1}\nflashinfer_installed: true\n")
    d = parse_drop(text, "d.yaml")
    assert d.env == {"VLLM_PP_LAYER_PARTITION": "16,32", "VLLM_ROCM_USE_AITER": "1"} and d.flashinfer_installed is True
    warnings: list[str] = []
    drop_env(d, warnings)
    assert warnings == ["env VLLM_ROCM_USE_AITER='1' is not modelled: no rule reads it"]
    import pytest

    with pytest.raises(DropError, match="env"):
        parse_drop(text.replace("VLLM_ROCM_USE_AITER", "ROCM_AITER"), "d.yaml")


# --- 5. KV page alignment for hybrid models with per-token-head KV caches -------------------------

def test_hybrid_int8_per_token_head_cannot_unify_page_sizes(shared_dir):
    """vllm/platforms/interface.py ``_align_hybrid_block_size`` (0.20, 0.24 read) sizes the
    attention block from ``FullAttentionSpec(block_size=1, …, kv_quant_mode).page_size_bytes`` —
    the per-token-head fp32 scales included — and pads the state page to that attention page. The
    plugin aligned on the scale-less bytes and the scales were added afterwards, so the padded
    state page (1,605,632 B) no longer matched the attention page (1,630,720 B): "cannot unify
    page sizes" on a start-up vLLM 0.24 served (Qwen3.6-27B, TP 2, int8_per_token_head)."""
    from tuner.memory import kvcache
    from tuner.memory.kvcache import FullAttentionSpec, MambaSpec, with_kv_quant_mode
    from tuner.model.modelspec import load_model_spec
    from tuner.model.plugin import RankSettings, load_registry

    spec = load_model_spec(shared_dir / "models" / "Qwen--Qwen3.5-27B" / "config.json")[0]
    plugin = load_registry().by_name("qwen3_5")
    s = RankSettings(engine_version="0.24.0", dtype="bfloat16", kv_cache_dtype="int8_per_token_head",
                     tensor_parallel_size=2)
    specs = with_kv_quant_mode(plugin.kv_cache_spec(spec, s), "int8_per_token_head")
    state = next(x for x in specs.values() if isinstance(x, MambaSpec))
    attn = next(x for x in specs.values() if isinstance(x, FullAttentionSpec))
    per_token = 2 * ((256 + 256) * 1 + 2 * 4)  # 2 KV heads per rank, int8 K and V + two fp32 scales
    conv, rec = 3 * 5120 * 2, 24 * 128 * 128 * 4
    assert state.unpadded_page_size_bytes == conv + rec == 1_603_584
    assert attn.block_size == 16 * -(-(conv + rec) // (16 * per_token)) == 1552
    assert attn.page_size_bytes == state.page_size_bytes == 1552 * per_token == 1_614_080
    cfg = kvcache.get_kv_cache_config("0.24.0", specs, 1 << 33, max_model_len=262144, max_num_batched_tokens=2048)
    assert cfg.bytes_per_block == 16 * 1_614_080


def test_unify_pads_by_release():
    """vllm/v1/core/kv_cache_utils.py ``unify_kv_cache_spec_page_size``: 0.20 refuses a page that
    does not divide the largest; 0.24 pads non-MLA attention (block-stride backends); 0.26 pads
    Mamba pages too (Gemma-4's int8_per_token_head pages on 0.26 start in vLLM)."""
    import pytest

    from tuner.memory import kvcache as kv

    full, sw = kv.FullAttentionSpec(16, 2, 256, 1, kv_quant_mode="INT8_PER_TOKEN_HEAD"), \
        kv.SlidingWindowSpec(16, 4, 128, 1, 1024, kv_quant_mode="INT8_PER_TOKEN_HEAD")
    assert full.page_size_bytes == 16 * 2 * 520 and sw.page_size_bytes == 16 * 4 * 264  # 16,640 vs 16,896
    specs = {"model.layers.0.attn": full, "model.layers.1.attn": sw}
    with pytest.raises(kv.UnsupportedKVCacheError):
        kv.unify_kv_cache_spec_page_size("0.20.0", specs)
    out = kv.unify_kv_cache_spec_page_size("0.26.0", specs)
    assert {x.page_size_bytes for x in out.values()} == {16 * 4 * 264}
    mamba = kv.MambaSpec(16, ((3, 256), (4, 16, 16)), (2, 4))
    with pytest.raises(kv.UnsupportedKVCacheError):
        kv.unify_kv_cache_spec_page_size("0.25.0", {"a": full, "m": mamba})
    assert kv.unify_kv_cache_spec_page_size("0.26.0", {"a": full, "m": mamba})["m"].page_size_bytes == 16_640


# --- 8. weights the product misses: the Mistral-format vision encoder on every TP rank -----------

def test_mistral_format_vision_tower_was_sharded_like_hf(shared_dir, tmp_path):
    """vllm/transformers_utils/config.py ``get_config`` (0.19): ``--config-format auto`` picks the
    Mistral format when the repository has params.json and consolidated*.safetensors; its model,
    PixtralForConditionalGeneration (vllm/model_executor/models/pixtral.py), builds the vision
    encoder from plain ``nn.Linear`` — the whole encoder on every TP rank — where the HF format's
    PixtralHFVisionModel shards it. Mistral-Small-3.1-24B at TP 2: the rank holds half the tower
    more (the llm-d 0.19 logs: 22.80 GiB printed, 22.40 predicted with a sharded tower)."""
    from tuner.question.drop import Drop, Candidates
    from tuner.jobs.job import config_format
    from tuner.model.modelspec import load_model_spec
    from tuner.model.plugin import RankSettings, load_registry
    from tuner.model.simulate.vision import vision_tower_bytes

    src = shared_dir / "models" / "mistralai--Mistral-Small-3.1-24B-Instruct-2503" / "config.json"
    spec = load_model_spec(src)[0]
    plugin = load_registry().by_name("mistral3")

    def weights(fmt: str) -> int:
        s = RankSettings(engine_version="0.19.0", dtype="bfloat16", tensor_parallel_size=2, config_format=fmt)
        with torch.device("meta"):
            module = plugin.build_model(spec, s)
        return plugin.weights_bytes(spec, s, module)

    top = plugin.top_config(spec)
    tower = vision_tower_bytes(top["vision_config"], 2, kind="pixtral", top=top, tp=1)
    tower2 = vision_tower_bytes(top["vision_config"], 2, kind="pixtral", top=top, tp=2)
    # the Pixtral tower is 881,013,760 B in bf16: half of it more per rank (0.40 GiB; TP 4: 0.61 GiB)
    assert tower == 881_013_760 and weights("mistral") - weights("hf") == tower - tower2 == 434_110_464
    d = Drop(name="d", model="m", device="H100-80GB", candidates=Candidates((0.9,)))
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text("{}")
    assert config_format(d, str(repo / "config.json")) == "hf"
    (repo / "params.json").write_text("{}")
    (repo / "consolidated.safetensors").write_bytes(b"")
    assert config_format(d, str(repo / "config.json")) == "mistral"
    from tuner.question.vllm_args import parse_line  # a serve line's --config-format reaches the drop (was "no effect")

    sa = parse_line(["vllm", "serve", "mistralai/Mistral-Small-3.1-24B-Instruct-2503", "--config-format", "mistral"])
    assert sa.values["config_format"] == "mistral" and not sa.unmodelled


def _run_case(shared_dir, model: str, version: str, kv: str, gpu: str, tp: int = 1, **settings) -> dict:
    from tuner.accuracy.validate import run_validate_request

    case = {"id": f"{model}@{version}/{kv}", "model": model, "vllm_version": version, "engine": "V1", "gpu": gpu,
            "tensor_parallel_size": tp, "kv_cache_dtype": kv, "observed": {"kv_cache_gib": 1.0},
            "settings": {"gpu_memory_utilization": 0.9, **settings}}
    return run_validate_request({"cases": [case], "models_dir": str(shared_dir / "models")})["cases"][0]


def test_nvfp4_kv_on_hybrid_exited_cannot_unify_page_sizes(shared_dir):
    """Issue 33: ``kv_cache_dtype nvfp4`` on a hybrid (Gated DeltaNet) model, vLLM 0.29, exited 1
    with "cannot unify page sizes" where vLLM starts: the state page is now padded to the NVFP4
    attention page (packed fp4 + fp8 block scales per token and head) as vLLM aligns it. On a B200:
    vLLM 0.29's FlashInfer takes an nvfp4 KV cache only on compute capability 10.x (an H100 is refused,
    test_nvfp4_kv_cache_on_hopper_started_with_no_note)."""
    row = _run_case(shared_dir, "Qwen/Qwen3.6-35B-A3B-FP8", "0.29.0", "nvfp4", "NVIDIA B200",
                    max_model_len=131072)
    assert row["status"] == "ok", row.get("reason")
    assert row["predicted_num_gpu_blocks"] > 0


def test_int8_per_token_head_on_gemma4_exited_cannot_unify_page_sizes(shared_dir):
    """Issue 33: ``int8_per_token_head`` on Gemma-4 (256- and 512-wide heads: 16·h·520 and
    16·h·1032 B pages, neither dividing the other), vLLM 0.26: vLLM pads the smaller attention
    page (``unify_kv_cache_spec_page_size``, block-stride backends from 0.24); 0.23 refuses."""
    row = _run_case(shared_dir, "google/gemma-4-26B-A4B", "0.26.0", "int8_per_token_head", "NVIDIA A100 80GB",
                    max_model_len=131072, enforce_eager=True)
    assert row["status"] == "ok", row.get("reason")
    assert row["predicted_num_gpu_blocks"] > 0


# --- 8. pipeline parallel: which stage the check and the log use ----------------------------------

def _stage_layers(first: int, n: int, spec) -> dict:
    return {f"model.layers.{i}.self_attn.attn": spec for i in range(first, first + n)}


def test_pp_stage_checked_alone_where_0_15_checks_the_whole_model():
    """vllm/v1/core/kv_cache_utils.py ``get_kv_cache_configs``: 0.14.0 – 0.16.0 check the whole
    model's KV groups against ``min(available_memory)`` (vLLM issue 34076: Qwen3-30B-A3B, 48 layers of
    4 KV heads × 128 in bf16, VLLM_PP_LAYER_PARTITION=16,32); 0.13 and 0.17+ check each stage's own
    layers. One token of 48 layers = 48 · 2 · 4 · 128 · 2 = 98,304 B, so 262,144 tokens need 24 GiB,
    of which stage 0's 16 layers need 8 GiB."""
    import pytest

    from tuner.memory import kvcache as kv
    from tuner.errors import KVCacheError

    spec = kv.FullAttentionSpec(16, 4, 128, 2)
    # stage 0 (RTX 5070 Ti) 3,414,700,000 B ("3.18 GiB"), stage 1 (RTX 5090 D) 7.26 GiB
    workers = [(_stage_layers(0, 16, spec), 3_414_700_000), (_stage_layers(16, 32, spec), int(7.26 * GiB))]
    assert kv.kv_check_scope("0.13.0") == "worker"
    assert kv.kv_check_scope("0.14.0") == kv.kv_check_scope("0.15.2rc1.dev93+g11a4c9d30") == "global"
    assert kv.kv_check_scope("0.16.0") == "global" and kv.kv_check_scope("0.17.0") == "worker"
    # 0.15: 24.0 GiB for all 48 layers against the smallest stage's 3.18 GiB; the estimate is
    # floor(3,414,700,000 / (98,304 · 16 B per block)) · 16 = 2,171 · 16 = 34,736 tokens (the issue's)
    with pytest.raises(KVCacheError, match=r"\(24\.0 GiB KV cache is needed.*\(3\.18 GiB\).*length is 34736"):
        kv.get_kv_cache_configs("0.15.1", workers, max_model_len=262_144)
    # 0.19: stage 0 alone, 16 layers: 8.0 GiB needed, 3,414,700,000 // 524,288 · 16 = 104,208 tokens
    with pytest.raises(KVCacheError, match=r"\(8\.0 GiB KV cache is needed.*\(3\.18 GiB\).*length is 104208"):
        kv.get_kv_cache_configs("0.19.0", workers, max_model_len=262_144)
    # what fits both: min over stages of blocks (stage 0: 6,513 of 16 · 32 KiB; stage 1: 7,434 of 1 MiB)
    cfgs = kv.get_kv_cache_configs("0.15.1", workers, max_model_len=32_768)
    assert [c.num_blocks for c in cfgs] == [6513, 6513]
    # auto-fit (-1) in 0.15 sizes all 48 layers on 3.18 GiB, in 0.19 each stage's own
    assert kv.get_kv_cache_configs("0.15.1", workers, max_model_len=262_144, auto_fit=True)[0].max_model_len == 34_736
    assert kv.get_kv_cache_configs("0.19.0", workers, max_model_len=262_144, auto_fit=True)[0].max_model_len == 104_208


def test_pp_log_compared_with_the_limiting_stage_not_the_printing_one():
    """vllm/v1/worker/gpu_worker.py: 0.11.1 – 0.19.x print "Available KV cache memory" from the
    node's first local rank only (``scope="local"``: pipeline stage 0); 0.14 – 0.16's refusal names
    the smallest stage's memory; 0.11.0 and 0.20+ print every worker's (no stage known). The
    llm-d 0.19 PP4 log prints 69.8 GiB (stage 0's) while its tokens are stage 3's blocks."""
    from tuner.memory import kvcache as kv
    from tuner.accuracy.validate import _logged_stage_candidate

    avail = [5 * GiB, 3 * GiB, 4 * GiB]
    assert kv.logged_kv_stage("0.19.0", avail, refused=False) == 0
    assert kv.logged_kv_stage("0.15.1", avail, refused=True) == 1
    assert kv.logged_kv_stage("0.19.0", avail, refused=True) == 0
    assert kv.logged_kv_stage("0.11.0", avail, refused=False) is None
    assert kv.logged_kv_stage("0.20.0", avail, refused=False) is None
    stages = [{"available_kv_cache_bytes": 3 * GiB, "available_kv_cache_bytes_low": 2 * GiB,
               "available_kv_cache_bytes_high": 4 * GiB},
              {"available_kv_cache_bytes": 7 * GiB, "available_kv_cache_bytes_low": 6 * GiB,
               "available_kv_cache_bytes_high": 8 * GiB}]
    c = {"available_kv_cache_bytes": 7 * GiB, "available_kv_cache_bytes_low": 6 * GiB,
         "available_kv_cache_bytes_high": 8 * GiB, "limiting_stage": 1, "stages": stages}
    got = _logged_stage_candidate(c, "0.15.2rc1.dev93+g11a4c9d30", refused=True)
    assert (got["available_kv_cache_bytes"], got["available_kv_cache_bytes_low"]) == (3 * GiB, 2 * GiB)
    assert _logged_stage_candidate(c, "0.20.0", refused=False) is c


# --- 11. unified memory: host RAM the runner takes after the snapshot -------------------------------

def test_gb10_runner_host_buffers_were_not_counted_as_device_memory():
    """vllm/utils/mem_utils.py ``MemorySnapshot.measure``: on an integrated GPU (GB10) free memory is
    ``psutil.virtual_memory().available`` (0.20+ by ``is_integrated``), so the V1 runner's
    ``InputBatch`` token history built after ``init_device``'s snapshot (vllm/v1/worker/gpu_input_batch.py:
    int32 ``token_ids_cpu_tensor`` + bool ``is_token_ids_tensor``, ``[max_num_seqs, max_model_len]``) is
    consumed device memory. vLLM 0.29 on GB10 (default 1024 sequences on a ≥ 70 GiB card), max_model_len
    196,608 (eugr/spark-vllm-docker issue 396): 5 · 1024 · 196,608 = 1,006,632,960 B, plus the block
    table's pinned host twin (vllm/v1/worker/block_table.py) 4 · 1024 · 12,288 = 50,331,648 B; Model
    Runner V2's pinned ``all_token_ids`` (vllm/v1/worker/gpu/states.py) 4 B per slot-token; nothing on
    a discrete card."""
    from tuner.memory.budget import free_memory_from_host, uma_host_buffer_bytes

    e = era_for("0.29.0")
    assert free_memory_from_host(e, compute_capability="12.1", integrated=True)
    assert not free_memory_from_host(e, compute_capability="9.0", integrated=False)
    kw = dict(max_num_seqs=1024, max_model_len=196_608)
    assert uma_host_buffer_bytes(e, free_from_host=True, model_runner_v2=False, **kw) == 1_056_964_608
    assert uma_host_buffer_bytes(e, free_from_host=True, model_runner_v2=True, **kw) == 805_306_368
    assert uma_host_buffer_bytes(e, free_from_host=False, model_runner_v2=False, **kw) == 0
    assert uma_host_buffer_bytes(era_for("0.34.0"), free_from_host=True, model_runner_v2=True, **kw) == 0


def test_pp_5070ti_5090d_compared_stage1_kv_with_stage0_log(observed_cases, shared_dir):
    """vLLM issue 34076 (0.15.2 dev, RTX 5070 Ti + RTX 5090 D, VLLM_PP_LAYER_PARTITION=16,32): the
    refusal checks all 48 layers (24.0 GiB) against the smaller stage's memory and names it (3.18 GiB);
    the product compared that figure with the 5090 D stage's 7.26 GiB (+128 %, unsafe at the safe
    end). Now: vLLM's reason, stage 0's bytes, the safe end below the log."""
    from tuner.accuracy.validate import predict_cases

    row = predict_cases([observed_cases["vllm-34076-5070ti+5090d-pp2-qwen3-coder-30b-a3b-fp8-262k-fail"]],
                        shared_dir / "models")[0]
    assert "(24.0 GiB KV cache is needed" in row["predicted_reason"]
    assert row["predicted_fits"] is False and row["observed_fits"] is False
    assert 3.5 < row["predicted_kv_cache_gib"] < 3.8  # stage 0 (16 layers + embedding on 15.47 GiB)
    assert row["predicted_kv_cache_gib_low"] < 3.18 and row["unsafe_at_safe_end"] is False


def test_pp_worker_label_names_the_printing_stage():
    """vllm/v1/executor/multiproc_executor.py (0.24 read): a PP worker's process is ``Worker_PP{k}``
    (``Worker_TP{t}_PP{k}`` with TP): the label on the "Available KV cache memory" line names the stage
    whose figure the record holds (the llm-d 0.19 PP4 log: "(Worker_PP0 pid=441) … 69.8 GiB")."""
    from tuner.accuracy.validate import _logged_stage_candidate, printed_kv_stage

    lines = ["(Worker_PP0 pid=441) INFO 04-22 01:44:15 [v1/worker/gpu_worker.py:436] Available KV cache memory: "
             "69.80 GiB", "(Worker_TP1_PP2 pid=9) INFO x Available KV cache memory: 3.00 GiB"]
    assert printed_kv_stage(lines, 69.8) == 0
    assert printed_kv_stage(lines, 3.0) == 2
    assert printed_kv_stage(lines, 5.0) is None and printed_kv_stage(["Available KV cache memory: 3.00 GiB"], 3.0) is None
    stages = [{"available_kv_cache_bytes": i * GiB, "available_kv_cache_bytes_low": i * GiB - 1,
               "available_kv_cache_bytes_high": i * GiB + 1} for i in (5, 6, 3)]
    c = {"available_kv_cache_bytes": 3 * GiB, "limiting_stage": 2, "stages": stages}
    # 0.20+ prints every worker's line: the label decides
    assert _logged_stage_candidate(c, "0.24.0", refused=False, printed_stage=1)["available_kv_cache_bytes"] == 6 * GiB
    assert _logged_stage_candidate(c, "0.24.0", refused=False) is c


# --- 6. backends chosen by the environment: MXFP4 on Hopper before 0.12 ---------------------------

def test_mxfp4_on_hopper_ran_triton_without_triton_kernels():
    """quantization/mxfp4.py ``_should_use_marlin`` (0.10.1.1) / ``get_mxfp4_backend`` (0.10.2 – 0.11.2):
    on a 9.x card, Marlin unless ``has_triton_kernels()`` and torch >= 2.8. The 0.10.1.1 wheel pins
    torch 2.7.1 (Marlin whatever is installed); no wheel before 0.12 requires triton_kernels (0.12
    vendors it). gpt-oss-120b on one H100: Marlin pads H 2880 -> 3072 and I 2880 -> 2944, so each of
    the 36 layers keeps w13 128x5888x1536 + scales 128x5888x96, w2 128x3072x1472 + 128x3072x92
    (uint8) and bf16 biases 128x(5888+3072): 1,847,263,232 bytes, against the Triton strided layout's
    1,692,057,600 + the scale copy 99,532,800 + fp32 biases 4,423,680."""
    from types import SimpleNamespace

    from tuner.logs.logparse import triton_kernels_installed
    from tuner.model.plugin import RankSettings
    from tuner.memory.quant import layout_bytes, mxfp4_hopper_triton, scheme_for

    assert mxfp4_hopper_triton((0, 10, 1), True) == (False, None)  # torch 2.7.1
    ok, why = mxfp4_hopper_triton((0, 11, 0), None)
    assert ok is False and why["name"] == "triton_kernels_installed" and why["value"] is False
    assert mxfp4_hopper_triton((0, 11, 0), True) == (True, None)
    assert mxfp4_hopper_triton((0, 11, 2), None)[0] is False
    assert mxfp4_hopper_triton((0, 12, 0), None) == (True, None)  # vendored

    qc = {"quant_method": "mxfp4"}
    spec = SimpleNamespace(quantization_config=qc, top={}, raw={})

    def bank(version: str, installed):
        s = scheme_for(spec, RankSettings(engine_version=version, dtype="bfloat16", compute_capability="9.0",
                                          triton_kernels_installed=installed))
        return s.expert_format.backend, layout_bytes(s.expert_layout(128, 2880, 2880, "bfloat16", has_bias=True))

    assert bank("0.10.1", True) == ("marlin", 1_847_263_232)
    assert bank("0.11.0", None) == ("marlin", 1_847_263_232)
    assert bank("0.11.0", True) == ("triton_strided", 1_692_057_600 + 99_532_800 + 4_423_680)
    # 36 layers: +1,844,969,472 bytes (1.72 GiB) on Marlin; what the log shows and an official image runs
    assert triton_kernels_installed(["Weight-only FP4 compression will be used leveraging the Marlin kernel. x"]) is False
    assert triton_kernels_installed(["vLLM 0.11.0 per the pod spec (vllm/vllm-openai:v0.11.0)"]) is True
    assert triton_kernels_installed(["vllm serve openai/gpt-oss-120b"]) is None


def test_block_fp8_on_ampere_kept_fp32_block_scales():
    """utils/marlin_utils_fp8.py ``prepare_fp8_layer_for_marlin`` (0.10.1.1, 0.24.0): below compute
    capability 8.9 FP8 runs weight-only through Marlin; a [128, 128] block scale ``[out/128, in/128]``
    fp32 becomes ``[in/128, out]`` in the model dtype, plus an int32 workspace of one int per SM.
    Qwen3.6-27B's MLP gate_up on a TP2 rank (in 5120, out 2 x 17408 / 2 = 17408): weight 89,128,960
    fp8 bytes on both cards; scales 40 x 17408 x 2 = 1,392,640 bytes on an RTX 3090 (8.6) against
    136 x 40 x 4 = 21,760 on an H100; no fp8 input copy on Marlin."""
    from types import SimpleNamespace

    from tuner.model.plugin import RankSettings
    from tuner.memory.quant import MARLIN_SMS, fp8_uses_marlin, layout_bytes, scheme_for

    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    spec = SimpleNamespace(quantization_config=qc, top={}, raw={})

    def linear(cc: str):
        s = scheme_for(spec, RankSettings(engine_version="0.24.0", dtype="bfloat16", compute_capability=cc))
        return s.linear_layout(5120, 17408, "bfloat16", "model.layers.0.mlp.gate_up_proj")

    lay, act = linear("8.6")
    assert layout_bytes(lay) == 89_128_960 + 1_392_640 + 4 * MARLIN_SMS and act is None
    lay, act = linear("9.0")
    assert layout_bytes(lay) == 89_128_960 + 21_760 and act == ("float8_e4m3fn", 40)
    assert fp8_uses_marlin((8, 0)) and fp8_uses_marlin((8, 6)) and not fp8_uses_marlin((8, 9))
    # expert banks: [E, in/128, out] model-dtype scales, a 4-blocks-per-SM workspace
    s = scheme_for(spec, RankSettings(engine_version="0.24.0", dtype="bfloat16", compute_capability="8.0"))
    bank = s.expert_layout(8, 2048, 768, "bfloat16", "model.layers.0.mlp.experts")
    assert ("w13_weight_scale", (8, 16, 1536), "bfloat16") in bank and ("w2_weight_scale", (8, 6, 2048), "bfloat16") in bank


def test_awq_gemm_kernel_dequantized_weight_was_not_charged():
    """awq.py ``AWQLinearMethod.apply`` (0.6.4, 0.10.1.1, 0.19.0): from 256 rows the AWQ kernel
    dequantizes the whole weight to ``[in, out]`` fp16 and multiplies with torch.matmul. Qwen2-7B's
    gate_up (in 3584, out 2 x 18944) at 2048 tokens: the output 2048 x 37888 x 2 = 155,189,248 bytes
    plus the dequantized weight 3584 x 37888 x 2 = 271,581,184; at 128 tokens only the output.
    Marlin (awq_marlin, every card from 7.5) has no such temporary."""
    from types import SimpleNamespace

    from tuner.model.plugin import RankSettings
    from tuner.model.simulate.layers import Linear
    from tuner.memory.quant import scheme_for

    qc = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
    spec = SimpleNamespace(quantization_config=qc, top={}, raw={})

    def peak(quantization, rows: int) -> int:
        s = scheme_for(spec, RankSettings(engine_version="0.10.1.1", dtype="float16", compute_capability="8.6",
                                          quantization=quantization))
        with torch.device("meta"):
            lin = Linear(3584, 37888, torch.float16, quant=s, prefix="model.layers.0.mlp.gate_up_proj")
            x = torch.empty(rows, 3584, dtype=torch.float16)
            with MemoryTracker() as t:
                lin(x)
        return t.peak_bytes

    assert peak("awq", 2048) == 155_189_248 + 271_581_184
    assert peak("awq", 128) == 128 * 37888 * 2
    assert peak(None, 2048) == 155_189_248  # awq_marlin


# --- 7. weights the product missed: Gemma 4's audio tower ------------------------------------------

def test_gemma4_audio_tower_was_not_loaded(shared_dir, tmp_path):
    """vLLM 0.19 gemma4_mm.py ``Gemma4ForConditionalGeneration.__init__``: with an ``audio_config``
    (the E2B / E4B variants) it builds ``AutoModel.from_config(config.audio_config)`` (transformers
    ``Gemma4AudioModel``: 304,824,608 parameters at transformers' defaults, bf16 = 609,649,216 bytes,
    plus 2,008 bytes of buffers from ``post_init``) and ``embed_audio`` (ReplicatedLinear 1536 ->
    text hidden 2816, bf16 = 8,650,752 bytes), on every rank."""
    import json

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tuner.model.modelspec import load_model_spec
    from tuner.model.plugin import RankSettings, load_registry

    cfg = json.loads((shared_dir / "models" / "google--gemma-4-26B-A4B" / "config.json").read_text())
    plugin = load_registry().by_name("gemma")
    settings = RankSettings(engine_version="0.19.0", dtype="bfloat16", compute_capability="9.0")

    def weights(c: dict) -> int:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c))
        spec = load_model_spec(d / "config.json")[0]
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
            return plugin.weights_bytes(spec, settings, plugin.build_model(spec, settings))

    assert cfg.get("audio_config") is None
    with_audio = weights({**cfg, "audio_config": {"model_type": "gemma4_audio"}})
    assert with_audio - weights(cfg) == 609_649_216 + 2_008 + 1536 * 2816 * 2


def test_limit_mm_per_prompt_zero_still_loaded_the_tower(shared_dir):
    """vllm/model_executor/models/interfaces.py ``_mark_tower_model`` (0.15.0+, read in 0.19.0): a
    tower whose modalities are all limited to 0 is not built (``no_init_weights`` ->
    ``StageMissingLayer``); ``--language-model-only`` sets every limit to 0
    (vllm/config/multimodal.py ``get_limit_per_prompt``). Mistral-Small-3.1 (Pixtral tower) on one
    H100: ``{"image": 0}`` takes the tower's weights off at 0.19, not at 0.14; ``{"audio": 0}``
    changes nothing (video stays 999, and the model has no audio tower)."""
    import dataclasses

    from tuner.question.drop import _mm_limits
    from tuner.model.modelspec import load_model_spec
    from tuner.model.plugin import RankSettings, load_registry
    from tuner.model.simulate.profile import ModelCache
    from tuner.model.simulate.vision import mm_limit

    spec = load_model_spec(shared_dir / "models" / "mistralai--Mistral-Small-3.1-24B-Instruct-2503" / "config.json")[0]
    plugin = load_registry().by_name("mistral3")
    base = RankSettings(engine_version="0.19.0", dtype="bfloat16", compute_capability="9.0")

    def weights(**kw) -> int:
        return ModelCache(enabled=False).take(plugin, spec, dataclasses.replace(base, **kw), backend="meta").weights_bytes

    full = weights()
    tower = full - weights(mm_limits=(("image", 0),))
    assert 0.8 * 2**30 < tower < 0.9 * 2**30  # Pixtral-12B's encoder + projector, bf16
    assert weights(mm_limits=(("*", 0),)) == full - tower
    assert weights(mm_limits=(("audio", 0),)) == full
    assert weights(engine_version="0.14.0", mm_limits=(("image", 0),)) == weights(engine_version="0.14.0")
    assert mm_limit(RankSettings("0.19.0", "bfloat16", mm_limits=(("image", 2),)), "video") == 999
    assert _mm_limits('{"image": 0, "video": {"count": 1, "num_frames": 8}}') == {"image": 0, "video": 1}


def test_limit_mm_per_prompt_flag_was_not_modelled():
    """``--limit-mm-per-prompt`` and ``--language-model-only`` reach the drop (they were named as not
    modelled); vLLM before 0.17 has no --language-model-only (vllm/config/multimodal.py)."""
    import shlex

    import pytest

    from tuner.question.vllm_args import ArgsInputError, parse_line, to_drop

    line = """vllm serve m --limit-mm-per-prompt '{"image": 0, "video": 0}' --language-model-only"""
    sa = parse_line(shlex.split(line))
    assert sa.unmodelled == []
    m = to_drop(sa, device={"name": "NVIDIA H100 80GB HBM3"}, engine_version="0.19.0", model="/tmp/m", max_model_len=4096)
    assert m.drop.limit_mm_per_prompt == {"image": 0, "video": 0} and m.drop.language_model_only is True
    with pytest.raises(ArgsInputError, match="0.17"):
        to_drop(sa, device={"name": "NVIDIA H100 80GB HBM3"}, engine_version="0.16.0", model="/tmp/m", max_model_len=4096)


def test_encoder_profile_items_ignored_max_num_seqs_and_the_image_limit(shared_dir):
    """``MultiModalBudget._get_max_items`` (vllm/v1/worker/utils.py 0.11.0; vllm/multimodal/
    encoder_budget.py 0.24.0): items = max(1, min(encoder budget // T, max_num_seqs x max(1,
    min(limit, max_model_len // T)))). Gemma-3 (SigLIP, T = 256) at 8192 batched tokens: 32 images
    by the encoder budget; 4 with max_num_seqs 4 and --limit-mm-per-prompt image 1; 16 with one
    sequence of 4096 tokens."""
    import dataclasses

    from tuner.model.modelspec import load_model_spec
    from tuner.model.plugin import RankSettings, load_registry
    from tuner.model.simulate.profile import ModelCache
    from tuner.model.simulate.vision import encoder_profile_items

    assert encoder_profile_items(8192, 256, "0.19.0") == 32
    assert encoder_profile_items(8192, 256, "0.19.0", max_num_seqs=4, mm_limit=1, max_model_len=131072) == 4
    assert encoder_profile_items(8192, 256, "0.19.0", max_num_seqs=1, max_model_len=4096) == 16
    assert encoder_profile_items(8192, 256, "0.19.0", max_num_seqs=256, max_model_len=131072) == 32
    assert encoder_profile_items(8192, 16384, "0.19.0", max_num_seqs=1, mm_limit=0, max_model_len=4096) == 1

    spec = load_model_spec(shared_dir / "models" / "google--gemma-3-4b-it" / "config.json")[0]
    plugin = load_registry().by_name("gemma")
    s = RankSettings(engine_version="0.19.0", dtype="bfloat16", compute_capability="9.0",
                     max_num_batched_tokens=8192, max_num_seqs=4, max_model_len=131072, mm_limits=(("image", 1),))
    built = ModelCache(enabled=False).take(plugin, spec, s, backend="meta")
    assert built.model.vision.profile_items(8192)[:2] == (4, 256)
    built = ModelCache(enabled=False).take(plugin, spec, dataclasses.replace(s, mm_limits=None, max_num_seqs=256),
                                           backend="meta")
    assert built.model.vision.profile_items(8192)[:2] == (32, 256)


def test_gemma4_per_layer_embeddings_buffer_and_inputs_were_not_charged(shared_dir, tmp_path):
    """vLLM 0.19 gemma4.py / gemma4_mm.py with ``hidden_size_per_layer_input`` (the E2B / E4B
    variants): the weights (``embed_tokens_per_layer [V_ple, L·ple]``, ``per_layer_model_projection
    [L·ple, H]``, per layer ``per_layer_input_gate`` / ``per_layer_projection``) plus the
    multimodal wrapper's persistent PLE buffer ``[max_num_batched_tokens, L, ple]`` (counted in
    "Model loading took"), and in the forward the projected per-layer inputs ``[N, L·ple]`` alive
    through every layer. The 26B-A4B config (L 30, H 2816) given ple 256 and V_ple 262144 at
    8192 tokens: weights +4,026,531,840 + 43,253,760 + 512 + 86,507,520 + 168,960 + 125,829,120
    bytes; the forward peak +8192 x 7680 x 2 = 125,829,120."""
    import json

    from tuner.memory.eras import ProfileBatch, era_for
    from tuner.model.modelspec import load_model_spec
    from tuner.model.plugin import RankSettings, load_registry
    from tuner.model.simulate.profile import run_pass

    cfg = json.loads((shared_dir / "models" / "google--gemma-4-26B-A4B" / "config.json").read_text())
    plugin = load_registry().by_name("gemma")

    def run(c: dict):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c))
        spec = load_model_spec(d / "config.json")[0]
        s = RankSettings(engine_version="0.19.0", dtype="bfloat16", compute_capability="9.0",
                         max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=8192)
        return run_pass(plugin, spec, s, era_for("0.19.0"), ProfileBatch(8192, 256, 256, True))

    ple = json.loads(json.dumps(cfg))
    ple["text_config"].update(hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144)
    base, with_ple = run(cfg), run(ple)
    # + 786,432 B since §24: the 41.25 MiB tensor keeps its whole 42 MiB segment (caching allocator)
    assert with_ple.weights_bytes - base.weights_bytes == (4_026_531_840 + 43_253_760 + 512 + 86_507_520 + 168_960
                                                          + 125_829_120) + 786_432
    assert with_ple.forward_peak_bytes - base.forward_peak_bytes == 8192 * 7680 * 2

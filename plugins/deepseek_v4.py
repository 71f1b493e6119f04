"""DeepSeek-V4 plugin (``DeepseekV4ForCausalLM``: DeepSeek-V4-Flash, DeepSeek-V4-Pro), vLLM 0.20 – 0.29.

Written from vLLM 0.22.0 ``vllm/models/deepseek_v4/nvidia/model.py``, ``attention.py``,
``compressor.py``, ``quant_config.py`` (0.20 – 0.21: ``model_executor/models/deepseek_v4.py``,
``model_executor/layers/deepseek_v4_attention.py`` / ``deepseek_compressor.py``, same modules) and
``vllm/v1/attention/backends/mla/sparse_swa.py``. Per rank (TP ``t``; EP through
:class:`tuner.model.simulate.moe.FusedMoE`'s expert layout):

* weights — vocab-parallel embedding and LM head ``[pad64(V)/t, H]`` (16-bit); per layer
  ``attn_norm`` / ``ffn_norm``; the hyper-connection parameters (fp32: ``hc_{attn,ffn}_fn
  [(2+hc)·hc, hc·H]``, ``_base [(2+hc)·hc]``, ``_scale [3]``; model ``hc_head_fn [hc, hc·H]``,
  ``hc_head_base [hc]``, ``hc_head_scale [1]``); attention: ``attn_sink [max(heads/t, 64)]`` fp32,
  replicated ``fused_wqa_wkv [q_lora + head_dim, H]``, ``q_norm``, ``wq_b [heads·D/t, q_lora]``,
  ``kv_norm``, ``wo_a [o_groups·o_lora/t, heads·D/o_groups]``, ``wo_b [H, o_groups·o_lora/t]``
  (fp8 block-quantized, 128×128 fp32 scales, as ``Fp8Config`` under ``deepseek_v4_fp8``); a
  compressor on layers with ``compress_ratios[i] > 1`` (``ape [r, coff·D]`` fp32, 16-bit
  ``fused_wkv_wgate [2·coff·D, H]`` (``quant_config=None``), ``norm [D]``; ``coff = 2`` when
  ``r = 4``); on ``r = 4`` layers the indexer (replicated fp8 ``wq_b [n·d, q_lora]``, 16-bit
  ``weights_proj [n, H]``, its own compressor with ``D = index_head_dim``); MoE: 16-bit gate
  ``[E, H]``, ``tid2eid [V, k]`` int32 on the first ``num_hash_layers`` layers else fp32
  ``e_score_correction_bias [E]``, fp8 shared expert ``moe_intermediate_size · n_shared / t``, and
  the routed experts in the checkpoint's ``expert_dtype`` (``fp4`` → ``Mxfp4MoEMethod``: MXFP4
  values + e8m0 scales per 32, in the layout of :func:`mxfp4_expert_backend`: Marlin on Hopper;
  ``fp8`` → fp8 block); rotary caches: one fp32 ``[original_max · factor, qk_rope_head_dim]``
  per distinct ``rope_theta`` (``compress_rope_theta`` on compressed layers; ``get_rope`` caches
  by key); persistent buffers ``topk_indices_buffer [max_num_batched_tokens, index_topk]`` int32
  and (last PP rank) ``_mtp_hidden_buffer [max_num_batched_tokens, hc·H]`` 16-bit.
* KV cache (:meth:`DeepseekV4Plugin.kv_cache_spec`, :mod:`tuner.memory.kvcache_dsv4`): per layer a
  sliding-window SWA cache (block 64, window ``sliding_window``, 584 B per token); on compressed
  layers the main cache (``block_size // r`` entries of 584 B per block), its compressor state
  (fp32 ``2·coff·D`` per entry, block 4 for ``r = 4`` / 8 for ``r = 128``, window ``coff·r``); on
  ``r = 4`` layers the indexer cache (``block_size // 4`` entries of ``d + d/128·4`` B) and the
  indexer compressor state; every page rounded up to 576 B (FlashMLA). ``block_size`` defaults to
  256 (``DeepseekSparseSWABackend.get_preferred_block_size``). fp8 KV only (``fp8_ds_mla``).
* profile run: embedding, the ``hc``-stream residual ``[N, hc, H]``, per layer the mHC pre/post
  mixes, attention GEMMs (FlashMLA skipped in the profile run: ``o_padded [N, max(heads/t, 64),
  D]`` is allocated, the kernel does not fire), compressor / indexer scores in fp32, the
  inverse-RoPE fp8 quant of ``o`` and ``wo_a``'s einsum output, the MoE block; final ``hc_head``
  mix and norm.

* CUDA-graph estimate (:meth:`DeepseekV4Plugin.cudagraph_warmup_bytes`): the PIECEWISE warmup's
  dummy indexer logits (512 MiB) measured into the first capture (V1 runner; CUDA 0.20+, ROCm 0.26+).
* ROCm (``models/deepseek_v4/amd``, :mod:`tuner.model.simulate.dsv4`): the AITER indexer's
  decode-logits reservation in the shared workspace (fp32 ``[N, max_model_len // 4]`` on gfx942 /
  gfx950, 0.23 – 0.29), ``rocm_inv_rope_einsum``'s bf16 ``wo_a`` (per call 0.21 – 0.23, cached on
  the module from 0.24), no FlashMLA head padding (``get_padded_num_q_heads``, 0.22+).

Refused as vLLM refuses them (:func:`engine_refusal`, docs/accuracy-mechanisms.md §23): a non-fp8 KV
cache (every default DeepSeek-V4 attention asserts fp8 for its fp8_ds_mla layout) and a card no default
backend runs (CUDA 9.x / 10.x FlashMLA sparse, 12.x FlashInfer SM120 from 0.24, ROCm from 0.21). The
config keys vLLM reads are checked (:func:`checked_config`).

Not modelled (said in :meth:`DeepseekV4Plugin.not_modelled`, each widens the band): vLLM 0.30+
(the SWA cache spec changed; refused), the MTP layer (speculative only), the mHC and
sparse-attention kernels' own workspaces, the rest of ROCm's own DeepSeek-V4 path
(``models/deepseek_v4/amd``: the mHC backend by image, AITER's own workspaces).
"""

from __future__ import annotations

from tuner.errors import DropError, ModelConfigError
from tuner.memory.eras import parse_version
from tuner.memory.kvcache_dsv4 import (DSV4_MODELLED_UNTIL, FP8_DS_MLA_V4_BYTES, DSv4MLASpec,
                                       DSv4SlidingWindowMLASpec)
from tuner.model.plugin import ModelPlugin, RankSettings, stage_layers

#: FlashMLA's page alignment (``alignment=576`` on every DeepSeek-V4 spec, 0.20 – 0.28 fp8_ds_mla).
FLASHMLA_ALIGNMENT = 576
#: ``DeepseekSparseSWABackend.get_preferred_block_size`` (sparse_swa.py 0.20 – 0.28).
DEFAULT_BLOCK_SIZE = 256
#: The SWA cache's block (``DeepseekV4SWACache.block_size = 64``, sparse_swa.py).
SWA_BLOCK = 64
#: Indexer fp8 quant block (``DeepseekV4Indexer.quant_block_size = 128``): 4 scale bytes per block.
INDEXER_QUANT_BLOCK = 128
#: Heads FlashMLA pads to (``padded_heads = max(n_local_heads, 64)``).
FLASHMLA_MIN_HEADS = 64


def config(spec) -> dict:
    """The text config as vLLM's own ``DeepseekV4Config`` reads it: the file's keys
    (``compress_ratios``, ``num_hash_layers``, ``rope_scaling``, which transformers' class renames or
    drops) over transformers' ``to_dict()``."""
    return {**spec.raw, **(getattr(spec, "top", None) or {})}


def _shown(value) -> str:
    from tuner.model.modelspec import shown

    return shown(value)


#: The DeepSeek-V4 keys vLLM reads as plain attributes (``config.<key>`` in models/deepseek_v4,
#: 0.20 – 0.29; model_executor/models/deepseek_v4.py and layers/deepseek_v4_attention.py in 0.20 –
#: 0.21): its own ``DeepseekV4Config`` (transformers_utils/configs/deepseek_v4.py) defaults none of
#: them, so a file without one fails in vLLM (AttributeError). Each must be a positive integer.
REQUIRED_POSITIVE_KEYS = ("hc_mult", "head_dim", "index_head_dim", "index_n_heads", "index_topk",
                          "qk_rope_head_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window")
#: Read the same way, may be 0 (no hash-routed layers, no shared expert).
REQUIRED_NON_NEGATIVE_KEYS = ("num_hash_layers", "n_shared_experts")
#: Keys vLLM reads with a default (``getattr(config, key, default)``, models/deepseek_v4 0.20 – 0.29).
DEFAULTED_KEYS = {"expert_dtype": "fp4", "topk_method": None}


def checked_config(spec) -> dict:
    """:func:`config` with the keys vLLM reads for DeepSeek-V4 checked as vLLM would take them: a
    key of :data:`REQUIRED_POSITIVE_KEYS` / :data:`REQUIRED_NON_NEGATIVE_KEYS` must be in the file
    (vLLM defaults none) and be an integer (not a bool, string or float) above 0 / at least 0; a
    missing key of :data:`DEFAULTED_KEYS` takes vLLM's default (said by
    :meth:`DeepseekV4Plugin.not_modelled`).

    Raises:
        ModelConfigError: ``where`` ``<config.json>:<key>``.
    """
    raw = config(spec)
    own = getattr(spec, "top", None) or raw  # presence is the file's (spec.raw carries transformers' defaults)
    out = dict(raw)
    for key in REQUIRED_POSITIVE_KEYS + REQUIRED_NON_NEGATIVE_KEYS:
        where = f"{spec.path}:{key}"
        if own.get(key) is None:
            raise ModelConfigError(f"{key} is missing: vLLM reads config.{key} for DeepseekV4ForCausalLM "
                                   "(models/deepseek_v4) and its DeepseekV4Config "
                                   "(transformers_utils/configs/deepseek_v4.py) has no default for it", where=where)
        value, low = own[key], (1 if key in REQUIRED_POSITIVE_KEYS else 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            kind = "a positive integer" if low else "a non-negative integer"
            raise ModelConfigError(f"{key} must be {kind}, not {_shown(value)}", where=where)
        out[key] = value
    for key, default in DEFAULTED_KEYS.items():
        if own.get(key) is None:
            out[key] = default
        elif not isinstance(own[key], str):
            raise ModelConfigError(f"{key} must be a string, not {_shown(own[key])}", where=f"{spec.path}:{key}")
    if out["expert_dtype"] not in ("fp4", "fp8"):
        raise ModelConfigError(f"expert_dtype must be 'fp4' or 'fp8' (models/deepseek_v4/quant_config.py), not "
                               f"{_shown(out['expert_dtype'])}", where=f"{spec.path}:expert_dtype")
    return out


def defaulted_keys(spec) -> list[str]:
    """The :data:`DEFAULTED_KEYS` the file leaves out (vLLM's default taken)."""
    own = getattr(spec, "top", None) or config(spec)
    return [k for k in DEFAULTED_KEYS if own.get(k) is None]


#: First release whose DeepSeek-V4 attention takes a ROCm path (AITER sparse MLA; 0.20's
#: model_executor/layers/deepseek_v4_attention.py has only the CUDA FlashMLA sparse one).
ROCM_FROM = (0, 21, 0)
#: First release that runs DeepSeek-V4 on CUDA 12.x by default (models/deepseek_v4/nvidia/model.py
#: ``_select_dsv4_attn_cls``: ``DeepseekV4FlashInferSM120Attention``, fp8_ds_mla layout; read 0.24 – 0.29).
SM120_FROM = (0, 24, 0)


def _kv_refusal_text(version: tuple, kv: str) -> tuple[str, str]:
    """vLLM's own assertion for a non-fp8 cache on the fp8_ds_mla layout, and where it is."""
    if version < (0, 22, 0):
        return (f"DeepseekV4 only supports fp8 kv-cache format for now, got {kv}",
                "model_executor/layers/deepseek_v4_attention.py")
    if version < (0, 23, 0):
        return f"DeepseekV4 only supports fp8 kv-cache format for now, got {kv}", "models/deepseek_v4/attention.py"
    layout = "FlashMLA fp8" if version < (0, 24, 0) else "fp8_ds_mla"
    return (f"DeepseekV4 {layout} layout only supports fp8 kv-cache, got {kv}",
            "models/deepseek_v4/attention.py _resolve_dsv4_kv_cache_dtype")


def engine_refusal(settings: RankSettings, path: str | None = None) -> None:
    """What vLLM 0.20 – 0.29 refuses for DeepSeek-V4 before loading, with vLLM's reason (the
    default attention backend; ``--attention-backend`` is not modelled and refused by ``check``):

    * a KV cache other than fp8: every default DeepSeek-V4 attention — FlashMLA sparse (CUDA 9.x /
      10.x), FlashInfer SM120 (12.x, 0.24+), ROCm's AITER (0.21+) — stores the fp8_ds_mla layout and
      asserts an fp8 ``cache_dtype`` (``auto`` and ``bfloat16`` included). The plain bf16 row is
      FlashInfer's ``FLASHINFER_MLA_SPARSE_DSV4`` (0.23+), only by ``--attention-backend``.
    * a card no default backend runs: CUDA before 0.24 FlashMLA sparse only
      (``FlashMLASparseBackend.supports_compute_capability``: ``capability.major in [9, 10]``,
      v1/attention/backends/mla/flashmla_sparse.py; ``is_flashmla_sparse_supported``: "FlashMLA
      Sparse is only supported on Hopper and Blackwell devices.", v1/attention/ops/flashmla.py); from
      0.24 also 12.x (FlashInfer SM120); ROCm from 0.21.

    Raises:
        DropError: ``field`` ``kv_cache_dtype`` (the cache) or ``device`` (the card), ``path`` the drop.
    """
    v = parse_version(settings.engine_version).key[:3]
    kv = str(settings.kv_cache_dtype or "auto").lower()
    if not _is_fp8(kv):
        said, where = _kv_refusal_text(tuple(v), kv)
        raise DropError(f"vLLM {settings.engine_version} refuses kv_cache_dtype {kv!r} for DeepseekV4ForCausalLM: "
                        f"\"{said}\" ({where}: its default attention backends store the fp8_ds_mla layout only); "
                        "use kv_cache_dtype fp8 (--kv-cache-dtype fp8)", path=path, field="kv_cache_dtype")
    platform = getattr(settings, "platform", "cuda") or "cuda"
    cc = getattr(settings, "compute_capability", None)
    if platform == "rocm":
        if tuple(v) < ROCM_FROM:
            raise DropError(f"No valid attention backend found for DeepseekV4ForCausalLM on ROCm with vLLM "
                            f"{settings.engine_version}: its DeepSeek-V4 attention runs FlashMLA sparse only (CUDA "
                            "kernels; model_executor/layers/deepseek_v4_attention.py); ROCm's AITER path is 0.21+",
                            path=path, field="device")
        return
    if platform != "cuda" or not cc:
        return
    major = int(str(cc).split(".")[0])
    allowed = (9, 10, 12) if tuple(v) >= SM120_FROM else (9, 10)
    if major in allowed:
        return
    runs = ("FlashMLA sparse on compute capability 9.x / 10.x (FlashMLASparseBackend.supports_compute_capability: "
            "capability.major in [9, 10], v1/attention/backends/mla/flashmla_sparse.py)")
    if major != 12 and tuple(v) >= SM120_FROM:
        runs += " and FlashInfer's SM120 sparse MLA on 12.x (models/deepseek_v4/nvidia/model.py _select_dsv4_attn_cls)"
    raise DropError(f"No valid attention backend found for DeepseekV4ForCausalLM on compute capability {cc}: vLLM "
                    f"{settings.engine_version}'s DeepSeek-V4 attention runs {runs} only: \"FlashMLA Sparse is only "
                    "supported on Hopper and Blackwell devices.\" (v1/attention/ops/flashmla.py)",
                    path=path, field="device")


def compress_ratios(spec) -> list[int]:
    """``max(1, compress_ratios[i])`` for the decoder layers (the list carries the MTP layer last), read
    from the file's JSON as vLLM's own config class does (transformers' ``DeepseekV4Config`` renames
    it ``compress_rates``)."""
    raw = config(spec).get("compress_ratios")
    if not isinstance(raw, list) or len(raw) < spec.num_hidden_layers:
        raise ModelConfigError("DeepSeek-V4 config needs compress_ratios with one entry per layer",
                               where=spec.path)
    for r in raw[:spec.num_hidden_layers]:
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ModelConfigError(f"compress_ratios entries must be non-negative integers, not {_shown(r)}",
                                   where=f"{spec.path}:compress_ratios")
    out = [max(1, r) for r in raw[:spec.num_hidden_layers]]
    bad = sorted({r for r in out if r not in (1, 4, 128)})
    if bad:
        raise ModelConfigError(f"compress_ratios {bad}: vLLM's compressor takes 4 or 128 only (compressor.py)",
                               where=spec.path)
    return out


def mxfp4_expert_backend(settings: RankSettings) -> str:
    """The MXFP4 expert layout DeepSeek-V4 gets (fused_moe/oracle/mxfp4.py
    ``select_deepseek_v4_mxfp4_moe_backend`` 0.21 – 0.29, ``select_mxfp4_moe_backend``'s
    ``_get_priority_backends`` in 0.20): CUDA Blackwell 10.x FlashInfer TRT-LLM (MXFP8 activations),
    DeepGEMM FP4 is Blackwell-only too, so every other CUDA GPU (Hopper included) Marlin; ROCm the
    unfused Triton path (AITER before 0.21), both with H and I padded to 256 (the ROCm branch of
    ``mxfp4_round_up_hidden_size_and_intermediate_size``), weights as loaded. Unlike gpt-oss, Hopper
    never gets the swizzled Triton layout here."""
    if getattr(settings, "platform", "cuda") == "rocm":
        return "rocm_triton"
    cc = str(getattr(settings, "compute_capability", None) or "9.0")
    return "flashinfer_trtllm" if cc.split(".")[0] == "10" else "marlin"


def _is_fp8(kv_cache_dtype: str | None) -> bool:
    return (kv_cache_dtype or "auto").lower().startswith("fp8")


class DeepseekV4Plugin(ModelPlugin):
    """DeepSeek-V4 (vLLM ``DeepseekV4ForCausalLM``)."""

    name = "deepseek_v4"
    architectures = ("DeepseekV4ForCausalLM",)
    #: the profile run reads ``settings.max_model_len`` (the indexer's prefill buffer and FlashMLA's
    #: rows, tuner.model.simulate.dsv4): its passes are memoized per length (tuner.jobs.passmemo.pass_key)
    reads_max_model_len = True

    # -- checks ------------------------------------------------------------------------------
    def check_supported(self, spec, settings: RankSettings, path: str | None = None) -> None:
        """ModelConfigError for the releases this plugin does not model; what vLLM refuses
        (:func:`engine_refusal`, DropError naming ``path``'s field)."""
        v = parse_version(settings.engine_version)
        if v < "0.20.0":
            raise ModelConfigError(f"DeepseekV4ForCausalLM is not supported by vLLM {settings.engine_version} (absent "
                                   "from the model registry before 0.20)", where=spec.path)
        if v >= DSV4_MODELLED_UNTIL:
            raise ModelConfigError(
                f"DeepseekV4ForCausalLM on vLLM {settings.engine_version} is not modelled: 0.30 changed the "
                "DeepSeek-V4 sliding-window cache spec (v1/attention/backends/mla/sparse_swa.py); modelled 0.20 – 0.29",
                where=spec.path)
        engine_refusal(settings, path)

    def check_drop(self, spec, settings: RankSettings, path: str | None = None) -> None:
        """What vLLM refuses for this model with these settings (:meth:`check_supported`, naming the
        drop's field) and the config keys it reads (:func:`checked_config`, :func:`compress_ratios`);
        called by :func:`tuner.jobs.job.rank_settings` for every stage, before anything is built."""
        self.check_supported(spec, settings, path)
        checked_config(spec)
        compress_ratios(spec)

    def not_modelled(self, spec, settings: RankSettings) -> list[dict]:
        """What the prediction does not model for this model (each widens the band)."""
        from tuner.memory.platforms import assumption

        out = [assumption("model.deepseek_v4.kernels", "mHC / sparse-attention workspaces", "model",
                          "DeepSeek-V4's hyper-connection (mHC) and sparse MLA kernels' own workspaces in the profile "
                          "run are not modelled (only their outputs)")]
        for key in defaulted_keys(spec):
            out.append(assumption(f"model.deepseek_v4.{key}", str(DEFAULTED_KEYS[key]), "model",
                                  f"config.json has no {key}: vLLM's default taken (getattr(config, {key!r}, "
                                  f"{DEFAULTED_KEYS[key]!r}), models/deepseek_v4)"))
        if getattr(settings, "platform", "cuda") == "rocm":
            out.append(assumption("model.deepseek_v4.rocm", "CUDA layout", "model",
                                  "ROCm's DeepSeek-V4 path (models/deepseek_v4/amd) is modelled as the CUDA one "
                                  "(fp8_ds_mla pages, block 256) apart from the AITER indexer's decode-logits "
                                  "reservation, the bf16 wo_a of rocm_inv_rope_einsum and the unpadded heads; "
                                  "its mHC backend (AITER, TileLang or the torch reference, by what the image has) "
                                  "and AITER's own workspaces are not modelled"))
        return out

    def cudagraph_warmup_bytes(self, spec, settings: RankSettings) -> int:
        """Bytes the first PIECEWISE capture's warmup adds to vLLM's CUDA-graph estimate beyond the
        fit (:func:`tuner.memory.search.cudagraph_warmup_extra_bytes` adds it where the V1 runner's
        estimate is subtracted): ``profile_cudagraph_memory`` (vllm/v1/worker/gpu_model_runner.py
        0.20 – 0.29) calls ``empty_cache()`` and measures the free-memory drop around the first
        capture of each mode, warmup included; ``_warmup_and_capture`` builds attention metadata
        only for FULL (``force_attention = mode == FULL``), so the PIECEWISE warmup's
        ``sparse_attn_indexer`` takes its no-metadata branch and allocates the 512 MiB dummy
        logits anew (``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB``; the cache was emptied; the later
        captures reuse the cached block;
        :func:`tuner.model.simulate.mla.sparse_indexer_graph_warmup_bytes`). The estimate takes the largest first capture over the modes, so
        once per rank whose stage holds a ``compress_ratio`` 4 layer (the indexer); by platform and
        release as that function says (ROCm's AITER indexer allocates the same dummy)."""
        from tuner.model.simulate.mla import sparse_indexer_graph_warmup_bytes

        ratios = compress_ratios(spec)
        if not any(ratios[i] == 4 for i in stage_layers(spec, settings)):
            return 0
        return sparse_indexer_graph_warmup_bytes(getattr(settings, "platform", "cuda"),
                                                 parse_version(settings.engine_version).key)

    # -- KV cache ----------------------------------------------------------------------------
    def kv_cache_spec(self, spec, settings: RankSettings) -> dict:
        """Per layer, in vLLM's registration order: indexer cache and indexer compressor state
        (``r = 4``), SWA cache, main compressed cache and compressor state (``r > 1``)."""
        self.check_supported(spec, settings)
        raw = checked_config(spec)
        bs = settings.block_size or DEFAULT_BLOCK_SIZE
        d, idx_d, window = raw["head_dim"], raw["index_head_dim"], raw["sliding_window"]
        ratios = compress_ratios(spec)
        a = FLASHMLA_ALIGNMENT
        out: dict = {}
        for i in stage_layers(spec, settings):
            r, p = ratios[i], f"model.layers.{i}.attn"
            if r == 4:
                out[f"{p}.indexer.k_cache"] = DSv4MLASpec(bs, idx_d + idx_d // INDEXER_QUANT_BLOCK * 4, 4, a)
                out[f"{p}.indexer.compressor.state_cache"] = self._state_spec(idx_d, r)
            out[f"{p}.swa_cache"] = DSv4SlidingWindowMLASpec(SWA_BLOCK, FP8_DS_MLA_V4_BYTES, window, a)
            if r > 1:
                out[p] = DSv4MLASpec(bs, FP8_DS_MLA_V4_BYTES, r, a)
                out[f"{p}.compressor.state_cache"] = self._state_spec(d, r)
        return out

    @staticmethod
    def _state_spec(head_dim: int, r: int) -> DSv4SlidingWindowMLASpec:
        """``CompressorStateCache``: fp32 ``2·coff·D`` per entry (kv + score state), block 4 (``r = 4``,
        ``coff = 2``) or 8 (``r = 128``), window ``coff · r`` (compressor.py)."""
        coff = 1 + (r == 4)
        return DSv4SlidingWindowMLASpec(4 if r == 4 else 8, 2 * coff * head_dim * 4, coff * r, FLASHMLA_ALIGNMENT)

    # -- module ------------------------------------------------------------------------------
    def quant_scheme(self, spec, settings: RankSettings):
        """``deepseek_v4_fp8`` (quant_config.py): fp8 block linears; experts MXFP4 for
        ``expert_dtype: fp4`` (the default; ``Mxfp4MoEMethod`` in the layout of
        :func:`mxfp4_expert_backend`), fp8 block for ``fp8``."""
        from tuner.memory.quant import Mxfp4ExpertsFormat, _version, mxfp4_alignment, scheme_for

        base = scheme_for(spec, settings)
        if base is None or checked_config(spec)["expert_dtype"] != "fp4":
            return base
        backend = mxfp4_expert_backend(settings)
        base.expert_format = Mxfp4ExpertsFormat(backend=backend, prepad=False,
                                                align=mxfp4_alignment(backend, _version(settings)))
        return base

    def build_model(self, spec, settings: RankSettings):
        self.check_supported(spec, settings)
        from tuner.model.simulate.dsv4 import build_deepseek_v4

        return build_deepseek_v4(spec, settings, checked_config(spec), compress_ratios(spec),
                                 self.quant_scheme(spec, settings))


plugin = DeepseekV4Plugin()

"""DeepSeek-family plugin: multi-head latent attention (MLA) decoders with DeepSeek MoE.

Serves ``DeepseekV2ForCausalLM`` (DeepSeek-V2 / V2-Lite / Coder-V2), ``DeepseekV3ForCausalLM``
(DeepSeek-V3 / R1 / V3.1, Kimi-K2 — ``model_type: kimi_k2`` with the DeepSeek-V3 architecture) and
``DeepseekV32ForCausalLM`` (sparse MLA with the DSA indexer), following vLLM 0.19.0
``vllm/model_executor/models/deepseek_v2.py``. ``DeepseekV4ForCausalLM`` (compressed and
sliding-window caches, hyper-connections) is its own plugin, :mod:`tuner.plugins.deepseek_v4`.

What it models per rank (module: :mod:`tuner.model.simulate.mla`):

* MLA attention per layer (``q_lora_rank`` null → ``q_proj``; else ``fused_qkv_a_proj`` +
  ``q_a_layernorm`` + ``q_b_proj``; ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; heads / tp),
  the absorbed ``W_UK``/``W_UV`` copy when ``kv_b_proj`` is quantized, and the profile-run
  workspace temporary ``[65536, h, P+V]``;
* the first ``first_k_dense_replace`` layers (and layers off ``moe_layer_freq``) with a dense
  gated MLP of ``intermediate_size / tp``; the others with the DeepSeek MoE block: replicated
  gate ``[E, H]`` (never quantized), fp32 ``e_score_correction_bias [E]`` when ``topk_method`` is
  ``noaux_tc``, shared experts ``moe_intermediate_size · n_shared_experts / tp`` and
  ``FusedMoE`` (:mod:`tuner.model.simulate.moe`; ``moe_intermediate_size / tp``, every expert on every
  rank — no expert parallelism). ``n_group`` / ``topk_group`` only change routing, not memory;
* DeepSeek-yarn rotary cache ``[original_max_position · factor, qk_rope_head_dim]`` in the model
  dtype (one shared instance; a second one for the DSA indexer unless ``indexer_rope_interleave``,
  which makes ``get_rope`` return the main one);
* V3.2-style sparse attention (``index_topk`` in the config): per layer an indexer
  (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``) with its own KV layer, and the persistent
  ``topk_indices_buffer [max_num_batched_tokens, index_topk]`` int32 (sized for 8192 tokens,
  the 0.19 serve default on ≥ 70 GiB GPUs; the plugin contract does not pass N);
* quantized checkpoints (fp8 block quant of DeepSeek-V3 / Kimi-K2) through
  :func:`tuner.memory.quant.scheme_for`, with vLLM module prefixes.

KV cache (:func:`kv_cache_spec`): one MLA latent per token and layer, ``head_size =
kv_lora_rank + qk_rope_head_dim`` (576), one "KV head", no separate V; TP does not shard it (every
rank stores the whole latent). fp8 KV: 1 byte per element; sparse MLA with fp8 on FlashMLA-sparse
uses ``fp8_ds_mla`` (656 B per token, 0.11–0.32). The indexer cache of sparse models is an
``MLAAttentionSpec`` of ``index_head_dim + index_head_dim/128·4`` uint8 per token. Before 0.7.1
vLLM had no MLA: DeepSeek-V2 ran as MHA with K/V of ``heads/tp × qk_head_dim`` (v padded).
Block size by era and backend (:func:`mla_block_size`; on ROCm
:func:`tuner.memory.platforms.rocm_mla_block_size`).

Not modelled: the device (``RankSettings`` carries no GPU; a ``compute_capability`` attribute is
read when present, else Hopper is assumed), MTP / ``num_nextn_predict_layers`` (speculative only),
expert parallelism / EPLB, the DSA indexer's ``40·max_model_len`` workspace reservation.

Errors: :class:`~tuner.errors.ModelConfigError` for a DeepSeek-V4 config, missing MLA fields, or heads
not divisible by TP.
"""

from __future__ import annotations

from tuner.errors import ModelConfigError
from tuner.memory.kvcache import (FullAttentionSpec, MLAAttentionSpec, dtype_bytes_for, mla_spec)
from tuner.model.plugin import ModelPlugin, RankSettings, stage_layers
from tuner.memory.eras import parse_version

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}

#: Assumed GPU when the settings carry no ``compute_capability`` (H100/H200: the usual MLA host).
DEFAULT_CAPABILITY = (9, 0)

#: Tokens the DSA ``topk_indices_buffer`` is sized for (``max_num_batched_tokens``; 0.19 serve
#: default on ≥ 70 GiB GPUs).
INDEXER_BUFFER_TOKENS = 8192


def _capability(settings: RankSettings) -> tuple[int, int]:
    """The GPU's compute capability from ``settings.compute_capability`` (``"9.0"`` or a tuple;
    the attribute :mod:`tuner.memory.quant` reads too), else :data:`DEFAULT_CAPABILITY`."""
    cc = getattr(settings, "compute_capability", None) or getattr(settings, "device_capability", None)
    if isinstance(cc, (tuple, list)) and cc:
        return int(cc[0]), int(cc[1]) if len(cc) > 1 else 0
    if cc:
        major, _, minor = str(cc).partition(".")
        try:
            return int(major), int(minor or 0)
        except ValueError:
            pass
    return DEFAULT_CAPABILITY


def mla_block_size(version: str, kv_cache_dtype: str = "auto", *, sparse: bool = False,
                   capability: tuple[int, int] = DEFAULT_CAPABILITY, num_heads: int | None = None,
                   user_block_size: int | None = None) -> int:
    """Tokens per KV block vLLM uses for an MLA model (CUDA).

    * < 0.7.3: 16 (Triton MLA; no MLA at all before 0.7.1);
    * 0.7.3–0.18 (``CudaPlatform.check_and_update_config``): Hopper → FlashMLA forces 64
      (a user size that is not a multiple of 64 is replaced; ≤ 0.12 anything ≠ 64); Blackwell →
      CUTLASS MLA forces 128 (0.10+; sparse models FlashMLA-sparse 64, 0.13+); sparse models 64
      (0.11+); Ampere and older → 16 (FlashMLA unsupported);
    * 0.19+ (``update_block_size_for_backend``): the selected backend's preferred size, the user's
      size kept. Hopper: ``FLASH_ATTN_MLA`` (multiple of 16 → 16) for 16-bit KV, ``FLASHMLA`` (64)
      for fp8 KV, ``FLASHMLA_SPARSE`` (64) for sparse; Blackwell: ``FLASHINFER_MLA`` (32/64 → 32),
      sparse ``FLASHINFER_MLA_SPARSE`` (32) for fp8 KV or ≤ 16 heads else ``FLASHMLA_SPARSE`` (64);
      Ampere: ``TRITON_MLA`` (16).
    """
    v = parse_version(version)
    major = capability[0]
    fp8 = (kv_cache_dtype or "auto").lower().startswith("fp8")
    if v < "0.7.3":
        return user_block_size or 16
    if v < "0.19.0":
        bs = user_block_size or 16
        if major == 10 and v >= "0.10.0" and not (sparse and v >= "0.13.0"):
            return bs if bs % 128 == 0 else 128
        if major in (9, 10) or (sparse and v >= "0.11.0"):
            if v >= "0.13.0":
                return bs if bs % 64 == 0 else 64
            return 64
        return bs
    if user_block_size:
        return user_block_size
    if major == 10:
        if sparse:
            return 32 if (fp8 or (num_heads is not None and num_heads <= 16)) else 64
        return 32
    if major == 9:
        return 64 if (sparse or fp8) else 16
    return 16


def _mla_dims(spec) -> tuple[int, int, int, int, int | None]:
    raw = spec.raw
    try:
        kv_lora = int(raw["kv_lora_rank"])
        rope = int(raw["qk_rope_head_dim"])
        nope = int(raw["qk_nope_head_dim"])
        v = int(raw["v_head_dim"])
    except (KeyError, TypeError) as exc:
        raise ModelConfigError(f"MLA config lacks {exc}: needs kv_lora_rank, qk_rope_head_dim, "
                               "qk_nope_head_dim, v_head_dim", where=spec.path) from exc
    q_lora = raw.get("q_lora_rank")
    return kv_lora, rope, nope, v, (int(q_lora) if q_lora else None)


def _rope_cache_len(spec) -> int:
    """Rows of the rotary cache: ``original_max_position_embeddings · factor`` for (deepseek-)yarn
    (``DeepseekScalingRotaryEmbedding``), else ``max_position_embeddings``."""
    rp = spec.raw.get("rope_parameters") or spec.raw.get("rope_scaling") or {}
    kind = rp.get("rope_type") or rp.get("type") or "default"
    if kind != "default" and rp.get("factor") and rp.get("original_max_position_embeddings"):
        return int(rp["original_max_position_embeddings"] * rp["factor"])
    return spec.max_position_embeddings


class DeepseekPlugin(ModelPlugin):
    """DeepSeek-V2/V3/R1, Kimi-K2 and V3.2-style sparse MLA (vLLM ``deepseek_v2.py``)."""

    name = "deepseek"
    architectures = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")

    # -- checks ------------------------------------------------------------------------------
    def check_supported(self, spec, settings: RankSettings) -> None:
        """Raises ModelConfigError for a DeepSeek-V4 config handed to this plugin (served by
        :mod:`tuner.plugins.deepseek_v4`)."""
        if "DeepseekV4ForCausalLM" in spec.architectures or spec.model_type == "deepseek_v4":
            raise ModelConfigError("DeepseekV4ForCausalLM is served by the deepseek_v4 plugin, not this one",
                                   where=spec.path)

    def is_sparse(self, spec) -> bool:
        return spec.raw.get("index_topk") is not None

    def cudagraph_warmup_bytes(self, spec, settings: RankSettings) -> int:
        """Sparse (DSA) models: the PIECEWISE warmup's dummy indexer logits in vLLM's CUDA-graph
        estimate (:func:`tuner.model.simulate.mla.sparse_indexer_graph_warmup_bytes`); 0 otherwise."""
        if not (self.is_sparse(spec) and self.use_mla(spec, settings)):
            return 0
        from tuner.model.simulate.mla import sparse_indexer_graph_warmup_bytes

        return sparse_indexer_graph_warmup_bytes(getattr(settings, "platform", "cuda"),
                                                 parse_version(settings.engine_version).key)

    def use_mla(self, spec, settings: RankSettings) -> bool:
        raw = spec.raw
        if spec.model_type == "deepseek" or not (raw.get("qk_nope_head_dim") or raw.get("qk_rope_head_dim")):
            return False
        return parse_version(settings.engine_version) >= "0.7.1"

    def heads_per_rank(self, spec, settings: RankSettings) -> int:
        tp = settings.tensor_parallel_size
        if spec.num_attention_heads % tp:
            raise ModelConfigError(f"num_attention_heads ({spec.num_attention_heads}) is not divisible by "
                                   f"tensor_parallel_size ({tp})", where=spec.path)
        return spec.num_attention_heads // tp

    def block_size(self, spec, settings: RankSettings) -> int:
        cap = _capability(settings)
        if not self.use_mla(spec, settings):
            return settings.block_size or 16
        if getattr(settings, "platform", "cuda") == "rocm":  # no FlashMLA / CUTLASS MLA there
            from tuner.memory.platforms import rocm_mla_block_size

            return rocm_mla_block_size(settings.engine_version, sparse=self.is_sparse(spec),
                                       user_block_size=settings.block_size)
        return mla_block_size(settings.engine_version, settings.kv_cache_dtype, sparse=self.is_sparse(spec),
                              capability=cap, num_heads=self.heads_per_rank(spec, settings),
                              user_block_size=settings.block_size)

    # -- KV cache ----------------------------------------------------------------------------
    def kv_cache_spec(self, spec, settings: RankSettings) -> dict:
        """One MLA latent spec per layer (``model.layers.i.self_attn.attn``), plus the indexer
        cache (``model.layers.i.self_attn.indexer.k_cache``) for sparse models; MHA K/V before 0.7.1."""
        self.check_supported(spec, settings)
        kv_lora, rope, nope, _v, _q = _mla_dims(spec)
        bs = self.block_size(spec, settings)
        dt = dtype_bytes_for(settings.kv_cache_dtype, settings.dtype)
        out: dict = {}
        if not self.use_mla(spec, settings):
            heads = self.heads_per_rank(spec, settings)
            for i in stage_layers(spec, settings):
                out[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(block_size=bs, num_kv_heads=heads,
                                                                            head_size=nope + rope, dtype_bytes=dt)
            return out
        sparse = self.is_sparse(spec)
        fp8 = (settings.kv_cache_dtype or "auto").lower().startswith("fp8")
        v = parse_version(settings.engine_version)
        cache_str = settings.kv_cache_dtype or "auto"
        cap = _capability(settings)
        if sparse and fp8 and v >= "0.11.0" and not (v >= "0.19.0" and bs == 32 and cap[0] == 10):
            cache_str = "fp8_ds_mla"  # FLASHMLA_SPARSE converts fp8 to DeepSeek's packed format
        idx_dim = int(spec.raw.get("index_head_dim") or 128)
        for i in stage_layers(spec, settings):
            out[f"model.layers.{i}.self_attn.attn"] = mla_spec(settings.engine_version, bs, kv_lora + rope, dt,
                                                                cache_dtype_str=cache_str)
            if sparse:
                out[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
                    block_size=bs, num_kv_heads=1, head_size=idx_dim + idx_dim // 128 * 4, dtype_bytes=1)
        return out

    # -- module ------------------------------------------------------------------------------
    def is_moe_layer(self, spec, i: int) -> bool:
        raw = spec.raw
        if not raw.get("n_routed_experts"):
            return False
        return i >= int(raw.get("first_k_dense_replace") or 0) and i % int(raw.get("moe_layer_freq") or 1) == 0

    def build_model(self, spec, settings: RankSettings):
        import torch

        from tuner.model.simulate import layers as L
        from tuner.model.simulate import mla as M
        from tuner.memory.quant import scheme_for

        from tuner.model.simulate.moe import FusedMoE

        self.check_supported(spec, settings)
        raw = spec.raw
        dtype = getattr(torch, _DTYPES.get(settings.dtype, "bfloat16"))
        quant = scheme_for(spec, settings)
        tp, pp, rank = settings.tensor_parallel_size, settings.pipeline_parallel_size, settings.pp_rank
        h = spec.hidden_size
        heads = self.heads_per_rank(spec, settings)
        kv_lora, rope_dim, nope, vdim, q_lora = _mla_dims(spec)
        rope = L.RotaryEmbedding(_rope_cache_len(spec), rope_dim, dtype)
        extra = {"rotary_emb": rope}
        sparse = self.is_sparse(spec) and self.use_mla(spec, settings)
        if sparse:
            if not raw.get("indexer_rope_interleave"):
                # get_rope caches by key: an interleaved (non-NeoX) indexer rope is the main one.
                extra["indexer_rotary_emb"] = L.RotaryEmbedding(_rope_cache_len(spec), rope_dim, dtype)
            buf = torch.nn.Module()
            buf.register_buffer("topk_indices_buffer", torch.empty(INDEXER_BUFFER_TOKENS, int(raw["index_topk"]),
                                                                   dtype=torch.int32), persistent=False)
            extra["topk_indices"] = buf
        ws = M.mla_workspace_tokens(None, None, self.block_size(spec, settings))
        layers = []
        for i in stage_layers(spec, settings):
            p = f"model.layers.{i}"
            indexer = None
            if sparse:
                indexer = M.Indexer(h, q_lora or h, int(raw.get("index_n_heads") or 64),
                                    int(raw.get("index_head_dim") or 128), dtype, quant=quant,
                                    prefix=f"{p}.self_attn.indexer", compiled=settings.compiled)
            attn = M.MLAAttention(h, heads, nope, rope_dim, vdim, q_lora, kv_lora, dtype, rope,
                                  compiled=settings.compiled, runs_attention=settings.runs_attention, quant=quant,
                                  prefix=f"{p}.self_attn", workspace_tokens=ws, indexer=indexer)
            if self.is_moe_layer(spec, i):
                moe_i = int(raw["moe_intermediate_size"])
                n_shared = int(raw.get("n_shared_experts") or 0)
                shared = (L.GatedMLP(h, moe_i * n_shared // tp, dtype, compiled=settings.compiled, quant=quant,
                                     prefix=f"{p}.mlp.shared_experts") if n_shared else None)
                experts = FusedMoE(h, moe_i // tp, int(raw["n_routed_experts"]), int(raw["num_experts_per_tok"]),
                                   dtype, quant=quant, prefix=f"{p}.mlp.experts", compiled=settings.compiled,
                                   engine_version=settings.engine_version, tensor_parallel_size=tp,
                                   reduce_results=False)
                mlp = M.DeepseekMoE(experts, shared, h, int(raw["n_routed_experts"]), dtype, tp=tp,
                                    correction_bias=raw.get("topk_method") == "noaux_tc", compiled=settings.compiled)
            else:
                mlp = L.GatedMLP(h, spec.intermediate_size // tp, dtype, compiled=settings.compiled, quant=quant,
                                 prefix=f"{p}.mlp")
            layers.append(L.DecoderLayer(attn, mlp, h, dtype))
        first, last = rank == 0, rank == pp - 1
        embed = L.VocabEmbedding(spec.vocab_size, h, dtype, tp) if (first or (last and spec.tie_word_embeddings)) else None
        lm_head = None
        if last:
            lm_head = L.LMHead(spec.vocab_size, h, dtype, tp, tied_to=embed if spec.tie_word_embeddings else None)
        norm = L.RMSNorm(h, dtype) if last else None
        return L.CausalLM(embed, layers, norm, lm_head, extra=extra)


plugin = DeepseekPlugin()

"""DeepSeek-V4 on one rank (torch): weights and the profile-run allocations.

vLLM 0.22.0 ``vllm/models/deepseek_v4/nvidia/model.py`` (``DeepseekV4Model``,
``DeepseekV4DecoderLayer``, ``DeepseekV4Attention``, ``DeepseekV4MoE``), ``attention.py``
(``DeepseekV4MultiHeadLatentAttentionWrapper``, ``DeepseekV4Indexer``) and ``compressor.py``
(``DeepseekCompressor``). Shapes are per tensor-parallel rank; the plugin
(:mod:`tuner.plugins.deepseek_v4`) documents what is and is not modelled.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.model.plugin import stage_layers
from tuner.model.simulate import layers as L
from tuner.memory.eras import parse_version
from tuner.model.simulate.moe import FusedMoE, current_workspace, torch_dtype

#: ``padded_heads = max(n_local_heads, 64)`` (FlashMLA; attn_sink and o_padded).
MIN_HEADS = 64
#: ``get_max_prefill_buffer_size`` (v1/attention/backends/mla/indexer.py): ``max_model_len · 40``.
PREFILL_BUFFER_PER_TOKEN = 40
#: ``RADIX_TOPK_WORKSPACE_SIZE`` (model_executor/layers/sparse_attn_indexer.py): 1 MiB.
RADIX_TOPK_WORKSPACE = 1 << 20
#: ``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB`` default (vllm/envs.py, 0.20 – 0.29): 512.
INDEXER_MAX_LOGITS_BYTES = 512 << 20
#: ``FlashMLASparse…PREFILL_CHUNK_SIZE`` (models/deepseek_v4/nvidia/flashmla.py): 4 requests per chunk.
FLASHMLA_PREFILL_CHUNK = 4
#: ROCm's ``rocm_inv_rope_einsum`` (v1/attention/ops/rocm_aiter_mla_sparse.py) dequantizes ``wo_a``
#: to bf16 for a plain einsum: on every call in 0.21 – 0.23, once per layer and kept on the module
#: (``_get_cached_wo_a_bf16``, ``wo_a._dsv4_wo_a_bf16``) from 0.24 (read 0.24 – 0.29).
ROCM_WO_A_PER_CALL = "per_call"
ROCM_WO_A_CACHED = "cached"
ROCM_WO_A_CACHED_FROM = (0, 24, 0)
ROCM_WO_A_FROM = (0, 21, 0)


#: First release whose ROCm AITER indexer reserves its decode-logits buffer in the profile run
#: (v1/attention/ops/rocm_aiter_mla_sparse.py ``rocm_aiter_sparse_attn_indexer``'s "Profiling
#: early-exit"; 0.22 returns the fake at once; read 0.23 – 0.29).
ROCM_INDEXER_RESERVE_FROM = (0, 23, 0)


def rocm_indexer_logits_bytes(platform: str, version: tuple, compute_capability: str | None, *, tokens: int,
                              indexer_max_len: int, index_heads: int) -> int:
    """The decode-logits buffer ROCm's AITER sparse indexer reserves in the shared workspace when it
    runs without attention metadata (the profile run), bytes: fp32 ``[N, L]`` on CDNA3/CDNA4
    (``_ON_GFX942 or _ON_GFX950``: capability 9.4 / 9.5), fp32 ``[index_n_heads, N, L]`` on other
    ROCm GPUs, ``N`` the profile's tokens (``hidden_states.shape[0]`` = ``max_num_batched_tokens``),
    ``L`` the indexer's ``max_model_len // compress_ratio`` (models/deepseek_v4/attention.py
    ``DeepseekV4Indexer``). 0 on CUDA (``sparse_attn_indexer`` reserves only its K-gather) and before
    0.23. On ROCm the indexer runs only through AITER (``SparseAttnIndexer.forward_hip`` raises
    without ``VLLM_ROCM_USE_AITER=1``, read in 0.28)."""
    if platform != "rocm" or tuple(version[:3]) < ROCM_INDEXER_RESERVE_FROM:
        return 0
    cdna = str(compute_capability or "9.4") in ("9.4", "9.5")
    return _ws_bytes(tokens * indexer_max_len * 4 * (1 if cdna else index_heads))


#: First release with ROCm's own DeepSeek-V4 attention (models/deepseek_v4/amd/rocm.py, read 0.22 –
#: 0.25, 0.27 – 0.29): its ``get_padded_num_q_heads`` returns ``num_heads`` (no FlashMLA padding).
ROCM_UNPADDED_HEADS_FROM = (0, 22, 0)


def attention_heads(platform: str, version: tuple, local_heads: int) -> int:
    """The head count of ``o_padded`` and of the profile run's padded ``q``: FlashMLA's
    ``max(n_local_heads, 64)`` on CUDA (models/deepseek_v4/nvidia/flashmla.py), the local heads as
    they are on ROCm from 0.22 (models/deepseek_v4/amd/rocm.py ``get_padded_num_q_heads``)."""
    if platform == "rocm" and tuple(version[:3]) >= ROCM_UNPADDED_HEADS_FROM:
        return local_heads
    return max(local_heads, MIN_HEADS)


def rocm_wo_a_mode(platform: str, version: tuple) -> str | None:
    """How the ROCm o-projection holds ``wo_a`` in bf16 (:data:`ROCM_WO_A_CACHED` from 0.24,
    :data:`ROCM_WO_A_PER_CALL` 0.21 – 0.23), None on CUDA (the fp8 einsum) and before 0.21."""
    if platform != "rocm" or tuple(version[:3]) < ROCM_WO_A_FROM:
        return None
    return ROCM_WO_A_CACHED if tuple(version[:3]) >= ROCM_WO_A_CACHED_FROM else ROCM_WO_A_PER_CALL


def _ws_bytes(*sizes: int) -> int:
    """``WorkspaceManager.get_simultaneous`` (v1/worker/workspace.py): each view rounded up to 256 B."""
    return sum(-(-n // 256) * 256 for n in sizes)


def _rope_len(raw: dict, max_pos: int) -> int:
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if (rp.get("rope_type") or rp.get("type") or "default") != "default" and rp.get("factor"):
        return int(int(rp.get("original_max_position_embeddings") or max_pos) * float(rp["factor"]))
    return max_pos


class Compressor(nn.Module):
    """``DeepseekCompressor``: ``ape [r, coff·D]`` fp32, 16-bit ``fused_wkv_wgate [2·coff·D, H]``
    (replicated, unquantized), ``norm [D]``. Forward: the fp32 kv/score GEMM ``[N, 2·coff·D]``
    (``torch.mm(..., out_dtype=float32)``); the compress-and-store kernel writes the cache only."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, dtype: torch.dtype) -> None:
        super().__init__()
        coff = 1 + (ratio == 4)
        self.width = 2 * coff * head_dim
        self.ape = L._param(ratio, coff * head_dim, dtype=torch.float32)
        self.fused_wkv_wgate = L._param(self.width, hidden, dtype=dtype)
        self.norm = L.RMSNorm(head_dim, dtype)

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], self.width, dtype=torch.float32)


class Indexer(nn.Module):
    """``DeepseekV4Indexer``: replicated ``wq_b [n·d, q_lora]`` (quantized), 16-bit
    ``weights_proj [n, H]``, its compressor (``D = d``). Forward: weights ``[N, n]``, the query
    ``[N, n·d]`` and its fp8 copy with per-128 fp32 scales; top-k goes to the persistent buffer."""

    def __init__(self, hidden: int, q_lora: int, n: int, d: int, ratio: int, dtype, quant, prefix: str,
                 max_model_len: int, rocm_logits_bytes: int = 0) -> None:
        super().__init__()
        #: ROCm's decode-logits reservation (:func:`rocm_indexer_logits_bytes`); 0 on CUDA
        self.rocm_logits_bytes = rocm_logits_bytes
        self.wq_b = L.Linear(q_lora, n * d, dtype, quant=quant, prefix=f"{prefix}.wq_b")
        self.weights_proj = L.Linear(hidden, n, dtype)
        self.compressor = Compressor(hidden, d, ratio, dtype)
        self.n, self.d = n, d
        #: ``max_total_seq_len = get_max_prefill_buffer_size // compress_ratio`` (attention.py)
        self.total_seq_lens = max_model_len * PREFILL_BUFFER_PER_TOKEN // ratio

    def forward(self, x: torch.Tensor, qr: torch.Tensor) -> None:
        w = self.weights_proj(x)
        kv_score = self.compressor.score(x)
        q = self.wq_b(qr)
        q8 = q.new_empty(q.shape[0], self.n * self.d, dtype=torch.uint8)
        qs = q.new_empty(q.shape[0], self.n * self.d // 128, dtype=torch.float32)
        # sparse_attn_indexer in the profile run (no metadata): the K-gather workspace
        # ((T, d) fp8 + (T, 4) scales + the radix top-k buffer) reserved in the shared workspace,
        # and a dummy 512 MiB logits tensor, freed at once
        if self.rocm_logits_bytes:
            # rocm_aiter_sparse_attn_indexer: the K-gather (no radix buffer), then the decode logits
            current_workspace().ensure(_ws_bytes(self.total_seq_lens * self.d, self.total_seq_lens * 4), x.device)
            current_workspace().ensure(self.rocm_logits_bytes, x.device)
        else:
            current_workspace().ensure(_ws_bytes(self.total_seq_lens * self.d, self.total_seq_lens * 4,
                                                 RADIX_TOPK_WORKSPACE), x.device)
        logits = x.new_empty(INDEXER_MAX_LOGITS_BYTES, dtype=torch.uint8)
        del w, kv_score, q, q8, qs, logits


class Attention(nn.Module):
    """``DeepseekV4Attention`` + its MLA wrapper on one rank (heads / tp, o_groups / tp)."""

    def __init__(self, raw: dict, hidden: int, heads: int, ratio: int, dtype, quant, prefix: str, tp: int,
                 max_model_len: int, max_num_batched_tokens: int, rocm_wo_a: str | None = None,
                 rocm_logits_bytes: int = 0, padded_heads: int | None = None) -> None:
        super().__init__()
        self.rocm_wo_a = rocm_wo_a
        #: where the ROCm bf16 ``wo_a`` copies are kept (set by :class:`DeepseekV4LM` per forward)
        self.keep: list | None = None
        d, q_lora, o_lora = raw["head_dim"], int(raw["q_lora_rank"]), int(raw["o_lora_rank"])
        groups = int(raw["o_groups"])
        self.heads, self.d, self.groups_r, self.o_lora = heads // tp, d, groups // tp, o_lora
        self.padded = padded_heads or max(self.heads, MIN_HEADS)
        self.attn_sink = L._param(self.padded, dtype=torch.float32)
        self.fused_wqa_wkv = L.Linear(hidden, q_lora + d, dtype, quant=quant, prefix=f"{prefix}.fused_wqa_wkv")
        self.q_norm = L.RMSNorm(q_lora, dtype)
        self.wq_b = L.Linear(q_lora, heads * d // tp, dtype, quant=quant, prefix=f"{prefix}.wq_b")
        self.kv_norm = L.RMSNorm(d, dtype)
        self.wo_a = L.Linear(heads * d // groups, groups * o_lora // tp, dtype, quant=quant, prefix=f"{prefix}.wo_a")
        self.wo_b = L.Linear(groups * o_lora // tp, hidden, dtype, quant=quant, prefix=f"{prefix}.wo_b")
        self.wo_b.all_reduce_out_of_place = tp > 1
        self.compressor = Compressor(hidden, d, ratio, dtype) if ratio > 1 else None
        self.indexer = (Indexer(hidden, q_lora, raw["index_n_heads"], raw["index_head_dim"],
                                ratio, dtype, quant, f"{prefix}.indexer", max_model_len, rocm_logits_bytes)
                        if ratio == 4 else None)
        # FlashMLA's dummy-run reservation: [chunk, N + window + max_num_batched_tokens, D] bf16 with
        # N = cdiv(max_model_len, r) on compressed layers, 0 on SWA-only ones (flashmla.py forward_mqa)
        rows = (-(-max_model_len // ratio) if ratio > 1 else 0) + raw["sliding_window"] \
            + max_num_batched_tokens
        self.mla_workspace = _ws_bytes(FLASHMLA_PREFILL_CHUNK * rows * d * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        o_padded = x.new_empty(n, self.padded, self.d)
        qr_kv = self.fused_wqa_wkv(x)
        kv_score = self.compressor.score(x) if self.compressor is not None else None
        qr = qr_kv.new_empty(n, self.q_norm.weight.shape[0])  # fused_q_kv_rmsnorm outputs
        kv = qr_kv.new_empty(n, self.d)
        del qr_kv
        if self.indexer is not None:
            self.indexer(x, qr)
        q = self.wq_b(qr)
        if self.heads < self.padded:  # profile run: F.pad to the FlashMLA head count
            q = q.new_empty(n, self.padded, self.d)
        current_workspace().ensure(self.mla_workspace, x.device)  # then o_padded.zero_(), no kernel
        del qr, kv, kv_score, q
        if self.rocm_wo_a is not None:
            z = self._rocm_o_proj(o_padded, n)
            del o_padded
            return self.wo_b(z.flatten(1))
        o_fp8 = o_padded.new_empty(n, self.heads * self.d, dtype=torch.uint8)  # fused_inv_rope_fp8_quant
        o_scale = o_padded.new_empty(n, self.heads * self.d // 128, dtype=torch.float32)
        del o_padded
        z = x.new_empty(n, self.groups_r, self.o_lora)  # deepseek_v4_fp8_einsum output
        del o_fp8, o_scale
        out = self.wo_b(z.flatten(1))
        return out

    def _rocm_o_proj(self, o: torch.Tensor, n: int) -> torch.Tensor:
        """``rocm_inv_rope_einsum`` (v1/attention/ops/rocm_aiter_mla_sparse.py): the inverse RoPE
        into a new bf16 ``[N, heads, D]``; ``wo_a`` dequantized (``.to(float32)`` of the fp8 weight,
        the block scales expanded to fp32 ``[G, R, D']`` by ``_expand_2d_block_scales``, their fp32
        product, then ``.to(bfloat16)``: 14 B per element at once), kept on the module from 0.24
        (``_get_cached_wo_a_bf16``: allocated in the profile run's forward, so charged there) or
        dropped after the call (0.21 – 0.23); ``einsum("tgd,grd->tgr")`` into ``[N, G, R]``."""
        o_ref = o.new_empty(n, self.heads, self.d)
        rows, cols = self.groups_r * self.o_lora, self.wo_a.in_features
        w32 = o.new_empty(rows, cols, dtype=torch.float32)
        scale = o.new_empty(rows, cols, dtype=torch.float32)
        prod = o.new_empty(rows, cols, dtype=torch.float32)
        bf16 = o.new_empty(rows, cols)
        del w32, prod, scale
        if self.rocm_wo_a == ROCM_WO_A_CACHED and self.keep is not None:
            self.keep.append(bf16)
        z = o.new_empty(n, self.groups_r, self.o_lora)
        del o_ref, bf16
        return z


#: First release whose DeepSeek-V4 MXFP4 experts run through the modular kernel
#: (quantization/mxfp4.py ``Mxfp4MoEMethod._setup_kernel`` → ``make_mxfp4_moe_kernel``, read 0.22, 0.28).
MODULAR_MXFP4_FROM = (0, 22, 0)


class UnfusedTritonExperts(FusedMoE):
    """ROCm's ``UnfusedOAITritonExperts`` (fused_moe/experts/gpt_oss_triton_kernels_moe.py) under the
    modular kernel (modular_kernel.py ``_allocate_buffers``): one shared-workspace request of
    ``r(max(M·k·I, M·K)·2) + r(M·k·max(2I, K)·2)`` bytes (``workspace_shapes``: ``(M·k, I)``,
    ``(M·k, max(N, K))``, output ``(M, K)`` viewed in the first), every ``matmul_ogs`` output a view
    of it; the layer's output a new ``[M, K]``."""

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        from tuner.model.simulate.moe import WORKSPACE_ALIGN_BYTES

        m, k, i, h = x.shape[0], self.top_k, self.intermediate, self.hidden_padded
        r = lambda b: -(-b // WORKSPACE_ALIGN_BYTES) * WORKSPACE_ALIGN_BYTES  # noqa: E731
        dt = x.element_size()
        topk = self._topk(x)
        current_workspace().ensure(r(max(m * k * i, m * h) * dt) + r(m * k * max(2 * i, h) * dt), x.device)
        out = torch.empty_like(x)
        del topk
        return out[:, : self.hidden]


class MoE(nn.Module):
    """``DeepseekV4MoE``: 16-bit gate ``[E, H]`` (fp32 logits), ``tid2eid [V, k]`` int32 on hash
    layers else fp32 ``e_score_correction_bias [E]``, shared expert, routed FusedMoE."""

    def __init__(self, raw: dict, hidden: int, vocab: int, hash_layer: bool, dtype, quant, prefix: str, tp: int,
                 settings) -> None:
        super().__init__()
        e, k, moe_i = int(raw["n_routed_experts"]), int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"])
        self.gate = L.Linear(hidden, e, dtype)
        if hash_layer:
            self.register_buffer("tid2eid", torch.empty(vocab, k, dtype=torch.int32), persistent=False)
        elif raw.get("topk_method") == "noaux_tc":
            self.e_score_correction_bias = L._param(e, dtype=torch.float32)
        n_shared = raw["n_shared_experts"]
        self.shared_experts = (L.GatedMLP(hidden, moe_i * n_shared // tp, dtype, quant=quant,
                                          prefix=f"{prefix}.shared_experts") if n_shared else None)
        fmt = getattr(quant, "expert_format", None) if quant is not None else None
        kernel = getattr(fmt, "kernel", "triton") if fmt is not None else "triton"
        modular_rocm = (getattr(fmt, "backend", None) == "rocm_triton"
                        and parse_version(settings.engine_version).key >= MODULAR_MXFP4_FROM)
        self.experts = (UnfusedTritonExperts if modular_rocm else FusedMoE)(hidden, moe_i // tp, e, k, dtype, quant=quant, prefix=f"{prefix}.experts",
                                compiled=settings.compiled, engine_version=settings.engine_version,
                                tensor_parallel_size=tp, reduce_results=False, kernel=kernel, global_num_experts=e)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x.new_empty(x.shape[0], self.gate.out_features, dtype=torch.float32)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        out = self.experts(x, logits)
        del logits
        if shared is not None:
            out.add_(shared)
            del shared
        if self.tp > 1:
            reduced = torch.empty_like(out)
            del out
            out = reduced
        return out


class Layer(nn.Module):
    """``DeepseekV4DecoderLayer``: mHC pre-mix → norm → attention → mHC post-mix, same for the FFN."""

    def __init__(self, attn: Attention, ffn: MoE, hidden: int, hc: int, dtype) -> None:
        super().__init__()
        self.attn, self.ffn = attn, ffn
        self.attn_norm, self.ffn_norm = L.RMSNorm(hidden, dtype), L.RMSNorm(hidden, dtype)
        mix = (2 + hc) * hc
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", L._param(mix, hc * hidden, dtype=torch.float32))
            setattr(self, f"hc_{part}_base", L._param(mix, dtype=torch.float32))
            setattr(self, f"hc_{part}_scale", L._param(3, dtype=torch.float32))
        self.hc = hc

    def _block(self, streams: torch.Tensor, norm: nn.Module, block: nn.Module) -> torch.Tensor:
        n = streams.shape[0]
        h = streams.new_empty(n, streams.shape[-1])  # MHCPreOp: the mixed layer input
        post = streams.new_empty(n, self.hc, dtype=torch.float32)
        comb = streams.new_empty(n, self.hc, self.hc, dtype=torch.float32)
        y = norm(h)
        del h
        out = block(y)
        del y
        new = torch.empty_like(streams)  # MHCPostOp: post · out + comb · streams
        del out, post, comb
        return new

    def forward(self, positions, streams, residual):
        streams = self._block(streams, self.attn_norm, self.attn)
        streams = self._block(streams, self.ffn_norm, self.ffn)
        return streams, None


class DeepseekV4LM(L.CausalLM):
    """``DeepseekV4ForCausalLM``: embedding expanded to ``hc`` streams, layers, ``hc_head`` mix,
    norm, LM head; persistent ``topk_indices_buffer`` and ``_mtp_hidden_buffer``."""

    def __init__(self, embed, layers, norm, lm_head, *, hidden: int, hc: int, extra: dict) -> None:
        super().__init__(embed, layers, norm, lm_head, extra=extra)
        self.hc, self.hidden = hc, hidden
        self.hc_head_fn = L._param(hc, hc * hidden, dtype=torch.float32)
        self.hc_head_base = L._param(hc, dtype=torch.float32)
        self.hc_head_scale = L._param(1, dtype=torch.float32)

    def forward(self, input_ids, positions, intermediate: tuple | None = None):
        if intermediate is None:
            h = self.embed_tokens(input_ids)
            streams = h.new_empty(h.shape[0], self.hc, self.hidden)  # unsqueeze(-2).repeat(1, hc, 1)
            del h
        else:
            streams = intermediate[0].new_empty(intermediate[0].shape[0], self.hc, self.hidden)
        if self.layers and self.layers[0].attn.rocm_wo_a == ROCM_WO_A_CACHED:
            # ROCm 0.24+: the bf16 wo_a copies the profile's forward caches stay alive after it (the
            # module changes, so :class:`tuner.model.simulate.profile.ModelCache` builds it anew)
            self.kept = []
            for layer in self.layers:
                layer.attn.keep = self.kept
        for layer in self.layers:
            streams, _ = layer(positions, streams, None)
        if self.norm is None:
            return streams, None
        mixed = streams.new_empty(streams.shape[0], self.hidden)  # hc_head
        del streams
        out = self.norm(mixed)
        return out


def build_deepseek_v4(spec, settings, raw: dict, ratios: list[int], quant) -> nn.Module:
    """The rank's module (see the plugin's docstring for every tensor); ``raw`` is the config as
    vLLM reads it (:func:`tuner.plugins.deepseek_v4.config`)."""
    dtype = torch_dtype(settings.dtype)
    tp, pp, rank = settings.tensor_parallel_size, settings.pipeline_parallel_size, settings.pp_rank
    h, hc = spec.hidden_size, raw["hc_mult"]
    heads = spec.num_attention_heads
    if heads % tp or int(raw["o_groups"]) % tp:
        from tuner.errors import ModelConfigError

        raise ModelConfigError(f"num_attention_heads ({heads}) and o_groups ({raw['o_groups']}) must divide by "
                               f"tensor_parallel_size ({tp})", where=spec.path)
    n_tok = int(settings.max_num_batched_tokens or 8192)
    max_len = int(settings.max_model_len or spec.max_position_embeddings)
    platform, version = getattr(settings, "platform", "cuda"), parse_version(settings.engine_version).key
    wo_a = rocm_wo_a_mode(platform, version)
    logits = rocm_indexer_logits_bytes(platform, version, getattr(settings, "compute_capability", None),
                                       tokens=n_tok, indexer_max_len=max_len // 4,
                                       index_heads=raw["index_n_heads"])
    layers = []
    for i in stage_layers(spec, settings):
        p = f"model.layers.{i}"
        attn = Attention(raw, h, heads, ratios[i], dtype, quant, f"{p}.attn", tp, max_len, n_tok, wo_a, logits,
                         attention_heads(platform, version, heads // tp))
        ffn = MoE(raw, h, spec.vocab_size, i < raw["num_hash_layers"], dtype, quant, f"{p}.ffn", tp,
                  settings)
        layers.append(Layer(attn, ffn, h, hc, dtype))
    rope_len = _rope_len(raw, spec.max_position_embeddings)
    thetas = {raw.get("compress_rope_theta") if r > 1 else raw.get("rope_theta") for r in ratios}
    extra: dict = {f"rotary_emb_{j}": L.RotaryEmbedding(rope_len, raw["qk_rope_head_dim"], torch.float32)
                   for j, _ in enumerate(sorted(thetas, key=str))}
    bufs = nn.Module()
    bufs.register_buffer("topk_indices_buffer", torch.empty(n_tok, raw["index_topk"],
                                                            dtype=torch.int32), persistent=False)
    first, last = rank == 0, rank == pp - 1
    if last:
        bufs.register_buffer("mtp_hidden_buffer", torch.empty(n_tok, hc * h, dtype=dtype), persistent=False)
    extra["persistent_buffers"] = bufs
    embed = L.VocabEmbedding(spec.vocab_size, h, dtype, tp) if first else None
    lm_head = L.LMHead(spec.vocab_size, h, dtype, tp) if last else None
    norm = L.RMSNorm(h, dtype) if last else None
    return DeepseekV4LM(embed, layers, norm, lm_head, hidden=h, hc=hc, extra=extra)

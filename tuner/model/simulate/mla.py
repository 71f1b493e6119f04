"""Memory-equivalent DeepSeek-family layers: multi-head latent attention (MLA), the DSA indexer
and the DeepSeek MoE block (torch).

Follows vLLM 0.19.0: ``vllm/model_executor/models/deepseek_v2.py`` (``DeepseekV2MLAAttention``,
``Indexer``, ``DeepseekV2MoE``, ``DeepseekV2MLP``), ``vllm/model_executor/layers/mla.py``
(``MultiHeadLatentAttentionWrapper.forward``) and
``vllm/model_executor/layers/attention/mla_attention.py`` (``MLAAttention``: profile-run path
and ``process_weights_after_loading``). Shapes are per tensor-parallel rank: N tokens, H hidden
size, ``h = num_attention_heads // tp`` query heads, ``Lkv = kv_lora_rank``, ``R =
qk_rope_head_dim``, ``P = qk_nope_head_dim``, ``V = v_head_dim``; bytes are the model dtype's
unless stated.

Weights of one MLA layer (per rank):

* ``q_lora_rank`` set: ``fused_qkv_a_proj [H → q_lora + Lkv + R]`` (replicated),
  ``q_a_layernorm [q_lora]``, ``q_b_proj [q_lora → h·(P+R)]``; ``q_lora_rank`` null (V2-Lite):
  ``kv_a_proj_with_mqa [H → Lkv + R]`` (replicated) and ``q_proj [H → h·(P+R)]``;
* ``kv_a_layernorm [Lkv]``, ``kv_b_proj [Lkv → h·(P+V)]``, ``o_proj [h·V → H]``;
* ``process_weights_after_loading`` keeps ``W_UK_T``/``W_UV`` as views of
  ``get_and_maybe_dequant_weights(kv_b_proj)``: no new memory for a 16-bit ``kv_b_proj``
  (``weight.to(dtype)`` returns the weight itself), but a quantized ``kv_b_proj`` (fp8 block
  checkpoints such as DeepSeek-V3 / Kimi-K2) is dequantized into a new 16-bit
  ``[Lkv, h·(P+V)]`` tensor that the views keep alive — it is counted in "Model loading took"
  (registered here as the ``w_uk_uv`` buffer).

Profile run (V1, ``attn_metadata is None``): the projections run, then the attention op is
skipped but allocates its output ``[N, h·V]`` and, transiently, ``[W, h, P+V]`` — vLLM's
simulation of the worst-case ``kv_b_proj`` up-projection of the chunked-prefill context, with
``W = max(min(max(8·max_model_len, 4·max_num_seqs·block_size), 65536), max_num_seqs·block_size)``
tokens (``determine_chunked_prefill_workspace_size``; ``workspace_tokens`` here, default the 64Ki
cap that every ``max_model_len ≥ 8192`` reaches). V0 (``runs_attention``) runs MLA prefill:
``kv_b_proj`` output ``[N, h·(P+V)]``, ``k [N, h·(P+R)]``, ``v`` padded to ``P+R`` and the
attention output ``[N, h·(P+R)]`` (approximation of ``_forward_prefill``).

Errors: none raised here; plugins validate configs.
"""

from __future__ import annotations

import torch
from torch import nn

from tuner.model.simulate import layers as L

#: Cap of vLLM's MLA chunked-prefill workspace, tokens (``64 * 1024`` in
#: ``determine_chunked_prefill_workspace_size``, 0.8–0.33).
MLA_WORKSPACE_CAP_TOKENS = 64 * 1024


#: ``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB`` default (vllm/envs.py 0.19), bytes.
INDEXER_MAX_LOGITS_BYTES = 512 * 1024 * 1024


#: Releases whose sparse indexer allocates the :data:`INDEXER_MAX_LOGITS_BYTES` dummy when it runs
#: without attention metadata, by platform: CUDA ``sparse_attn_indexer``
#: (model_executor/layers/sparse_attn_indexer.py, "Dummy allocation to simulate for peak logits
#: tensor memory"; found in 0.19 – 0.33, gone in 0.34), ROCm ``rocm_aiter_sparse_attn_indexer``
#: (v1/attention/ops/rocm_aiter_mla_sparse.py, "Transient logits tensor peak memory"; 0.23 – 0.34 read).
INDEXER_DUMMY_LOGITS_RELEASES = {"cuda": ((0, 19, 0), (0, 34, 0)), "rocm": ((0, 23, 0), (0, 35, 0))}


def sparse_indexer_graph_warmup_bytes(platform: str, version: tuple) -> int:
    """What the DSA / DeepSeek-V4 sparse indexer adds to vLLM's CUDA-graph estimate (bytes per rank
    whose stage holds an indexer layer): ``profile_cudagraph_memory`` (vllm/v1/worker/gpu_model_runner.py
    0.18+) calls ``empty_cache()`` and measures the free-memory drop around the first capture of each
    mode, its warmup included; ``_warmup_and_capture`` builds attention metadata only for FULL
    (``force_attention = mode == FULL``), so the PIECEWISE warmup's ``sparse_attn_indexer`` takes
    its no-metadata branch and allocates the dummy logits anew (the later captures reuse the cached
    block; the estimate takes the largest first capture over the modes, so once). On ROCm the AITER
    indexer's warmup asks its workspace for ``[512, L]`` decode logits, below the profile's
    ``[N, L]``: no growth there. Counted where the estimate is subtracted
    (:func:`tuner.memory.search.cudagraph_warmup_extra_bytes`: V1 runner, CUDA 0.20+, ROCm 0.26+)."""
    lo, hi = INDEXER_DUMMY_LOGITS_RELEASES.get(platform, ((0, 0, 0), (0, 0, 0)))
    if not lo <= tuple(version[:3]) < hi:
        return 0
    return INDEXER_MAX_LOGITS_BYTES


def mla_workspace_tokens(max_model_len: int | None, max_num_seqs: int | None, block_size: int) -> int:
    """Tokens of the MLA chunked-prefill workspace (vLLM ``determine_chunked_prefill_workspace_size``,
    0.19 ``mla_attention.py``): ``max(min(max(8·M, 4·R·bs), 65536), R·bs)``; unknown M/R give the cap."""
    if max_model_len is None or max_num_seqs is None:
        return max(MLA_WORKSPACE_CAP_TOKENS, (max_num_seqs or 0) * block_size)
    w = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), MLA_WORKSPACE_CAP_TOKENS)
    return max(w, max_num_seqs * block_size)


def _quantized(lin: L.Linear, dtype: torch.dtype) -> bool:
    w = getattr(lin, "weight", None)
    return w is None or w.dtype != dtype


class Indexer(nn.Module):
    """DeepSeek sparse-attention (DSA) indexer of one layer (vLLM 0.19 ``Indexer``; V3.2 / GLM-5).

    Weights (replicated): ``wq_b [q_lora → n·d]``, ``wk [H → d]``, ``k_norm`` (LayerNorm, weight +
    bias ``[d]``), ``weights_proj [H → n]`` (never quantized). Its KV cache is a separate
    ``MLAAttentionSpec`` layer (``<prefix>.k_cache``, ``d + d/128·4`` uint8 per token).
    Profile forward: q ``[N, n·d]``, k ``[N, d]``, fp8 q ``[N, n·d]`` (1 B) + fp32 scales
    ``[N, n·d/128]``, weights ``[N, n]``, then the op's transient 512 MiB dummy logits tensor; the
    top-k op writes the persistent ``topk_indices_buffer``. Not modelled: the workspace-manager
    reservation of ``40·max_model_len`` × 132 B (it depends on ``max_model_len``, which the plugin
    contract does not pass).
    """

    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, dtype: torch.dtype, *,
                 quant=None, prefix: str = "", compiled: bool = True) -> None:
        super().__init__()
        self.n, self.d, self.compiled = n_heads, head_dim, compiled
        self.wq_b = L.Linear(q_lora_rank, n_heads * head_dim, dtype, quant=quant, prefix=f"{prefix}.wq_b")
        self.wk = L.Linear(hidden, head_dim, dtype, quant=quant, prefix=f"{prefix}.wk")
        self.k_norm = L.RMSNorm(head_dim, dtype)
        self.k_norm_bias = L._param(head_dim, dtype=dtype)
        self.weights_proj = L.Linear(hidden, n_heads, dtype, prefix=f"{prefix}.weights_proj")

    def forward(self, x: torch.Tensor, q_c: torch.Tensor) -> None:
        q = self.wq_b(q_c)
        k = self.wk(x)
        q_fp8 = q.new_empty(q.shape, dtype=torch.uint8)
        q_scale = q.new_empty(q.shape[0], self.n * max(1, self.d // 128), dtype=torch.float32)
        if self.compiled:
            del q
        w = self.weights_proj(x)
        # sparse_attn_indexer profile path: dummy peak-logits tensor (VLLM_SPARSE_INDEXER_MAX_LOGITS_MB,
        # default 512 MiB of uint8), transient.
        logits = x.new_empty(INDEXER_MAX_LOGITS_BYTES, dtype=torch.uint8)
        del logits, q_fp8, q_scale, w, k


class MLAAttention(nn.Module):
    """One MLA layer per rank (see the module docstring for weights and profile-run memory).

    Args:
        num_heads: query heads on this rank (``num_attention_heads // tp``).
        rope: the shared rotary embedding (its cache is counted once, by the model).
        workspace_tokens: ``W`` of the profile-run up-projection temporary.
        indexer: the DSA :class:`Indexer` (sparse MLA) or ``None``.
    """

    def __init__(self, hidden: int, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 q_lora_rank: int | None, kv_lora_rank: int, dtype: torch.dtype, rope: L.RotaryEmbedding | None, *,
                 compiled: bool = True, runs_attention: bool = False, quant=None, prefix: str = "",
                 workspace_tokens: int = MLA_WORKSPACE_CAP_TOKENS, indexer: Indexer | None = None) -> None:
        super().__init__()
        self.h, self.P, self.R, self.V = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.compiled, self.runs_attention, self.workspace_tokens = compiled, runs_attention, workspace_tokens
        qk = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is not None:
            self.fused_qkv_a_proj = L.Linear(hidden, q_lora_rank + kv_lora_rank + qk_rope_head_dim, dtype, quant=quant,
                                             prefix=f"{prefix}.fused_qkv_a_proj")
            self.q_a_layernorm = L.RMSNorm(q_lora_rank, dtype)
            self.q_b_proj = L.Linear(q_lora_rank, num_heads * qk, dtype, quant=quant, prefix=f"{prefix}.q_b_proj")
        else:
            self.kv_a_proj_with_mqa = L.Linear(hidden, kv_lora_rank + qk_rope_head_dim, dtype, quant=quant,
                                               prefix=f"{prefix}.kv_a_proj_with_mqa")
            self.q_proj = L.Linear(hidden, num_heads * qk, dtype, quant=quant, prefix=f"{prefix}.q_proj")
        self.kv_a_layernorm = L.RMSNorm(kv_lora_rank, dtype)
        self.kv_b_proj = L.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), dtype, quant=quant,
                                  prefix=f"{prefix}.kv_b_proj")
        self.o_proj = L.Linear(num_heads * v_head_dim, hidden, dtype, quant=quant, prefix=f"{prefix}.o_proj")
        if _quantized(self.kv_b_proj, dtype):
            # W_UK_T / W_UV: views of the dequantized 16-bit kv_b_proj weight (persist).
            self.register_buffer("w_uk_uv", torch.empty(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim),
                                                        dtype=dtype), persistent=False)
        self.rotary_emb = [rope]  # shared, not registered here
        self.indexer = indexer
        self.dtype = dtype

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q_c = None
        if self.q_lora_rank is not None:
            qkv_lora = self.fused_qkv_a_proj(x)
            q_c = self.q_a_layernorm(qkv_lora[:, : self.q_lora_rank])
            q = self.q_b_proj(q_c)
            kv_lora = qkv_lora  # kv_c / k_pe are views of it
        else:
            kv_lora = self.kv_a_proj_with_mqa(x)
            q = self.q_proj(x)
        kv_c_normed = self.kv_a_layernorm(kv_lora[:, : self.kv_lora_rank])
        if self.indexer is not None:
            self.indexer(x, q_c)
        if self.compiled and q_c is not None:
            del q_c
        out = x.new_empty(n, self.h * self.V)  # MLAAttention output buffer
        if self.runs_attention:
            kv = self.kv_b_proj(kv_c_normed)
            qk = self.P + self.R
            k = x.new_empty(n, self.h * qk)
            v_pad = x.new_empty(n, self.h * qk)
            attn = x.new_empty(n, self.h * qk)
            del kv, k, v_pad, attn
        else:
            ws = x.new_empty(self.workspace_tokens, self.h, self.P + self.V)  # profile-run simulation
            del ws
        if self.compiled:
            del q, kv_lora, kv_c_normed
        return self.o_proj(out)


class DeepseekMoE(nn.Module):
    """``DeepseekV2MoE`` per rank: ``gate [E, H]`` (+ fp32 ``e_score_correction_bias [E]`` for
    ``topk_method == "noaux_tc"``), shared experts (a gated MLP of ``moe_intermediate_size ·
    n_shared_experts / tp``) and the routed experts (``experts``: :class:`tuner.model.simulate.moe.FusedMoE`
    with ``moe_intermediate_size / tp`` per expert, all experts on every rank without EP).

    Forward: router logits ``[N, E]``, shared output ``[N, H]``, routed output ``[N, H]`` (scaled
    and summed in place); with tp > 1 the all-reduce returns a new ``[N, H]``.
    """

    def __init__(self, experts: nn.Module, shared: nn.Module | None, hidden: int, num_experts: int,
                 dtype: torch.dtype, *, tp: int = 1, correction_bias: bool = False, compiled: bool = True) -> None:
        super().__init__()
        self.gate = L.Linear(hidden, num_experts, dtype)
        if correction_bias:
            self.e_score_correction_bias = L._param(num_experts, dtype=torch.float32)
        self.shared_experts = shared
        self.experts = experts
        self.tp, self.compiled = tp, compiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
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


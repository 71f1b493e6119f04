"""Quantized-checkpoint weights: vLLM's per-rank parameter layout of each quantization method.

:func:`scheme_for` reads the checkpoint's ``quantization_config`` (or the drop's ``quantization``
override) and returns a :class:`QuantScheme`, or ``None`` for 16-bit weights everywhere. Layers
ask the scheme for their parameters' layouts (:mod:`tuner.model.simulate.quant_weights` registers
them on a fake-tensor module, worker side; this module stays pure — no torch):

- ``make_linear_weights(module, in_features, out_features, dtype, prefix) -> bool`` registers the
  parameters a quantized linear (per-rank ``[out, in]``) keeps after
  ``process_weights_after_loading`` and returns True, or returns False (ignored layer: 16-bit);
- ``make_expert_weights(module, num_experts, hidden, intermediate, dtype, prefix, has_bias=False)
  -> bool`` registers a whole MoE expert bank, vLLM's ``FusedMoEMethodBase.create_weights``
  convention: ``w13_*`` = gate+up ``[E, 2I, H]`` and ``w2_*`` = down ``[E, H, I]`` (``I`` the
  per-rank intermediate size before the method's padding). With ``has_bias`` the scheme also
  registers ``w13_bias [E, 2I]`` / ``w2_bias [E, H]`` in the dtype the method keeps them in (the
  caller then registers none). ``expert_sizes(hidden, intermediate, prefix)`` gives the padded
  ``(H, I)`` the method's kernels run with (MXFP4 pads I; others return them unchanged);
- ``is_ignored(prefix) -> bool``: whether the checkpoint keeps module ``prefix`` unquantized
  (for vision towers, embeddings, routers built outside these hooks).

"Model loading took" (reference §2.4) is the torch allocated-memory delta over ``load_model``,
read after ``process_weights_after_loading``: repacks, transposes and scale copies that persist
count, temporaries do not. Each layout below is therefore the one vLLM keeps after processing,
per tensor-parallel rank. Layouts follow vLLM 0.19.0 (vllm/model_executor/layers/quantization/)
unless a branch says otherwise:

- ``fp8`` (fp8.py): per-tensor ``weight fp8 [out, in]`` (+ fp32 scale) or block-wise
  ``weight_scale_inv fp32 [ceil(out/bn), ceil(in/bk)]`` (``weight_block_size``). The drop-level
  override ``quantization: fp8`` on a 16-bit checkpoint is ``Fp8OnlineLinearMethod``: the same
  per-tensor layout (the 16-bit weight is a temporary).
- ``compressed-tensors`` (compressed_tensors/schemes/*): W8A8-FP8 and W8A8-INT8 (8-bit weight +
  fp32 scale per channel / tensor / block), WNA16 ``pack-quantized`` (see GPTQ), NVFP4.
  Only ``LinearBase`` layers and ``FusedMoE`` are quantized: ``lm_head`` / embeddings never are.
- ``gptq`` / ``awq`` / ``auto-round`` (gptq_marlin.py, awq_marlin.py, inc.py): 4/8-bit packed int32
  weights, ``scales [in/g, out]`` in the model dtype, zero points, ``g_idx``. The kernel decides
  what persists (kernels/linear/mixed_precision/): Machete (compute capability 9.0, fp16/bf16,
  group 64/128/-1, in % 64 == 0 and out % 128 == 0) repacks the weight at the same size and keeps
  GPTQ's ``qzeros``/``g_idx`` as loaded, turning AWQ-style zero points into ``[in/g, out]`` model-
  dtype tensors; Marlin (other GPUs) frees unused ``g_idx``/``qzeros`` and keeps a
  ``int32 [num_sms]`` workspace per layer.
- ``mxfp4`` (mxfp4.py + fused_moe/oracle/mxfp4.py): experts only, ``uint8`` blocks (2 values per
  byte) + e8m0 scales per 32, in the layout of the backend the GPU gets (:func:`mxfp4_backend`). On
  Hopper the Triton backend swizzles (vLLM >= 0.11.1, torch >= 2.8.1: values padded to multiples of
  64, a swizzled scale copy padded to 256 rows next to the loaded scales until 0.24) and keeps biases
  in fp32; 0.11.0 (torch 2.8.0) keeps a strided copy of the scales. Blackwell 10.x: FlashInfer
  TRT-LLM (same bytes at H/I padded to 256/256, 256/128 from 0.27, fp32 biases); other GPUs: Marlin
  (same bytes at 256/128, model-dtype biases).
- ``modelopt`` (modelopt.py): NVFP4 ``uint8 [out, in/2]`` + fp8 scale per 16 + fp32 global scales;
  FP8 per-tensor; ``MIXED_PRECISION`` per ``quantized_layers``; ``ignore`` / ``exclude_modules``
  wildcards (ancestor and substring matches as vLLM's ``is_layer_excluded``).

Activations: a quantized linear's output ``[N, out]`` is allocated in the model dtype by
:class:`tuner.model.simulate.layers.Linear`; W8A8 methods (fp8 / int8 dynamic, cutlass ``scaled_mm``)
also quantize the input: ``module.input_quant = (dtype_name, scale_cols)`` asks the layer for an
``[N, in]`` copy in that dtype plus fp32 scales ``[N, scale_cols]`` (per-token: 1; block fp8:
``ceil(in/128)``), both temporaries (kernels/linear/scaled_mm/ScaledMMLinearKernel.py).

Defaults for keys a partial ``quantization_config`` lacks (each is the producing tool's default):
GPTQ ``group_size 128, sym true, desc_act false`` (AutoGPTQ), AWQ ``group_size 128, zero_point
true`` (AutoAWQ), auto-round ``group_size 128, sym true, packing auto_round:auto_gptq`` (vLLM
inc.py), compressed-tensors weights ``type int, symmetric true`` and strategy ``group`` when
``group_size`` is set else ``tensor`` (compressed_tensors ``QuantizationArgs``), targets
``["Linear"]``, format inferred from the args (8-bit weights with input activations:
float-/int-quantized; else pack-quantized).

The GPU matters for GPTQ/AWQ/WNA16 and MXFP4 layouts: :func:`scheme_for` reads
``settings.compute_capability`` when the settings carry one and assumes Hopper (9.0, H100/H200,
the GPU of every visible quantized case) otherwise.

This module imports torch only inside the functions that register parameters.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field
from typing import Any

# Fused vLLM modules and the checkpoint modules they stack (packed_modules_mapping of the
# models; vllm/model_executor/models/*.py).
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "w13": ("w1", "w3"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}

_DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "uint8": 1, "int8": 1,
    "int32": 4, "int64": 8,
}
_WRAPPERS = ("model", "language_model", "text_model", "model_")
MARLIN_SMS = 132  # H100 SXM / H200 streaming multiprocessors: Marlin's int32 workspace per layer


# --------------------------------------------------------------------------------------------
# Names and ignore lists
# --------------------------------------------------------------------------------------------
def canonical(name: str) -> str:
    """A module name without its wrapper segments, so checkpoint names and the plugins' vLLM
    prefixes compare: ``model.language_model.layers.0.mlp`` / ``language_model.model.layers.0.mlp``
    / ``model.layers.0.mlp`` -> ``layers.0.mlp``; ``model.embed_tokens`` -> ``embed_tokens``."""
    parts = [p for p in name.split(".") if p]
    while parts and parts[0] in _WRAPPERS:
        parts = parts[1:]
    return ".".join(parts)


def _match_one(name: str, pattern: str, *, ancestors: bool, substring: bool) -> bool:
    if not pattern:
        return False
    if pattern.startswith("re:"):
        rx = pattern[3:]
        return bool(re.match(rx, name) or re.match(rx, canonical(name)))
    cn = canonical(name)
    if any(c in pattern for c in "*?["):
        pats = [pattern]
        if pattern.endswith("*") and len(pattern) > 1 and pattern[-2] != ".":
            # ModelOpt's "module_path*" = module_path itself or anything under it
            # (ModelOptQuantConfigBase.apply_vllm_mapper): "layers.1*" does not name "layers.10".
            pats = [pattern[:-1], pattern[:-1] + ".*"]
        elif ancestors and not pattern.endswith("*"):
            pats = [pattern, pattern + ".*"]
        return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(cn, canonical(p)) for p in pats)
    cp = canonical(pattern)
    if cn == cp or name == pattern:
        return True
    if ancestors and cp and cn.startswith(cp + "."):
        return True
    if substring and cp and cp in cn:
        return True
    return False


def matches(prefix: str, patterns, *, ancestors: bool = True, substring: bool = False) -> bool:
    """Whether module ``prefix`` is named by ``patterns`` (exact names, ``re:`` regexes,
    ``fnmatch`` wildcards, and with ``ancestors`` any dotted ancestor). A fused vLLM module
    (``qkv_proj``, ``gate_up_proj``...) matches when all its checkpoint shards match."""
    pats = [p for p in (patterns or []) if isinstance(p, str)]
    if not pats or not prefix:
        return False
    if any(_match_one(prefix, p, ancestors=ancestors, substring=substring) for p in pats):
        return True
    head, _, last = prefix.rpartition(".")
    shards = FUSED_MODULES.get(last)
    if shards:
        return all(any(_match_one(f"{head}.{s}" if head else s, p, ancestors=ancestors, substring=substring)
                       for p in pats) for s in shards)
    return False


# --------------------------------------------------------------------------------------------
# Layouts: lists of (name, shape, dtype_name)
# --------------------------------------------------------------------------------------------
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


Layout = list  # list[tuple[str, tuple[int, ...], str]]


def layout_bytes(layout: Layout) -> int:
    """Bytes of a layout (sum of numel x element size)."""
    return sum(math.prod(shape) * _DTYPE_BYTES[dt] for _, shape, dt in layout)


@dataclass(frozen=True)
class Fp8Format:
    """FP8 weights (fp8.py ``Fp8LinearMethod`` / ``Fp8OnlineLinearMethod``, compressed-tensors
    ``CompressedTensorsW8A8Fp8``, ModelOpt FP8). ``strategy``: tensor | channel | block."""

    strategy: str = "tensor"
    block: tuple[int, int] = (128, 128)
    static_input: bool = False
    quantize_activations: bool = True
    scale_dtype: str = "float32"
    #: weight-only FP8 through Marlin on a card without native FP8 (:func:`fp8_uses_marlin`).
    marlin: bool = False

    def _marlin_scales(self, i: int, o: int, dtype: str, e: int | None = None) -> Layout:
        """utils/marlin_utils_fp8.py ``prepare_fp8_layer_for_marlin`` / ``prepare_fp8_moe_layer_for_marlin``
        (0.10.1.1, 0.24.0): the scales go to the model dtype (``.to(layer.orig_dtype)``) and become
        group-wise — a block scale ``[out/bn, in/bk]`` is ``repeat_interleave``-d to ``[in/bk, out]``
        (one per ``bk`` inputs and per output) — or channel-wise ``[1, out]`` (tensor / channel
        scales); the int32-repacked weight keeps the fp8 bytes; an ``int32 [SMs]`` workspace per
        layer (``marlin_make_workspace_new``; 4 blocks per SM for the experts)."""
        rows = _cdiv(i, self.block[1]) if self.strategy == "block" else 1
        lead = () if e is None else (e,)
        return [("weight_scale", lead + (rows, o), dtype),
                ("marlin_workspace", (MARLIN_SMS * (1 if e is None else 4),), "int32")]

    def linear(self, i: int, o: int, dtype: str) -> tuple[Layout, tuple | None]:
        lay: Layout = [("weight", (o, i), "float8_e4m3fn")]
        if self.marlin:  # W8A16: no input quantization, no input scale kept
            return lay + self._marlin_scales(i, o, dtype), None
        if self.strategy == "block":
            bn, bk = self.block
            lay.append(("weight_scale_inv", (_cdiv(o, bn), _cdiv(i, bk)), self.scale_dtype))
            act = ("float8_e4m3fn", _cdiv(i, bk))
        elif self.strategy == "channel":
            lay.append(("weight_scale", (o, 1), "float32"))
            act = ("float8_e4m3fn", 1)
        else:  # per tensor: requantized to one max scale (process_fp8_weight_tensor_strategy)
            lay.append(("weight_scale", (1,), "float32"))
            act = ("float8_e4m3fn", 1)
        if self.static_input:
            lay.append(("input_scale", (1,), "float32"))
        return lay, (act if self.quantize_activations else None)

    def bank(self, e: int, i: int, o: int, dtype: str) -> Layout:
        lay: Layout = [("weight", (e, o, i), "float8_e4m3fn")]
        if self.marlin:
            return lay + self._marlin_scales(i, o, dtype, e)
        if self.strategy == "block":
            bn, bk = self.block
            lay.append(("weight_scale_inv", (e, _cdiv(o, bn), _cdiv(i, bk)), self.scale_dtype))
        elif self.strategy == "channel":
            lay.append(("weight_scale", (e, o, 1), "float32"))
        else:  # one scale per expert after process_fp8_weight_tensor_strategy_moe
            lay.append(("weight_scale", (e,), "float32"))
        if self.static_input:
            lay.append(("input_scale", (e,), "float32"))
        return lay


@dataclass(frozen=True)
class Int8Format:
    """INT8 W8A8 (compressed-tensors ``CompressedTensorsW8A8Int8`` + cutlass kernel): weight int8
    (transposed, same bytes), fp32 scale per channel (fused per-tensor scales become per channel),
    an ``azp_adj int32 [1, out]`` for asymmetric inputs; inputs quantized to int8 per token."""

    strategy: str = "channel"
    static_input: bool = False
    input_symmetric: bool = True

    def linear(self, i: int, o: int, dtype: str, fused: bool = False) -> tuple[Layout, tuple | None]:
        lay: Layout = [("weight", (o, i), "int8")]
        lay.append(("weight_scale", (o, 1) if (self.strategy == "channel" or fused) else (1,), "float32"))
        if self.static_input:
            lay.append(("input_scale", (1,), "float32"))
            if not self.input_symmetric:
                lay.append(("input_zero_point", (1,), "int32"))
        if not self.input_symmetric:
            lay.append(("azp_adj", (1, o), "int32"))
        return lay, ("int8", 1)

    def bank(self, e: int, i: int, o: int, dtype: str) -> Layout:
        return [("weight", (e, o, i), "int8"), ("weight_scale", (e, o, 1), "float32")]


@dataclass(frozen=True)
class WNA16Format:
    """Weight-only int4/int8 (GPTQ, AWQ, compressed-tensors pack-quantized, auto-round).

    ``flavor``: ``gptq`` (qweight ``int32 [in/pack, out]``, ``qzeros [g, out/pack]``, ``g_idx [in]``
    always created), ``awq`` (qweight ``[in, out/pack]``, qzeros, no g_idx), ``ct``
    (``weight_packed [out, in/pack]``, ``weight_shape int64 [2]``, zero point only if asymmetric,
    ``weight_g_idx`` only with activation order). ``kernel``: ``machete`` | ``marlin`` | ``plain``.
    """

    bits: int = 4
    group_size: int = 128
    zero_points: bool = False  # asymmetric (AWQ, sym=false)
    desc_act: bool = False
    flavor: str = "gptq"
    kernel: str = "marlin"

    def _kernel_for(self, i: int, o: int, dtype: str) -> str:
        if self.kernel == "machete":
            ok = (dtype in ("float16", "bfloat16") and self.group_size in (-1, 64, 128) and i % 64 == 0
                  and o % 128 == 0)
            if ok:
                return "machete"
            return "marlin" if self._marlin_ok(i, o) else "plain"
        if self.kernel == "marlin":
            return "marlin" if self._marlin_ok(i, o) else "plain"
        return "plain"

    def _marlin_ok(self, i: int, o: int) -> bool:
        return self.group_size in (-1, 32, 64, 128) and o % 64 == 0 and i % 128 == 0 and self.bits in (4, 8)

    def linear(self, i: int, o: int, dtype: str) -> tuple[Layout, tuple | None]:
        pack = 32 // self.bits
        g = 1 if self.group_size in (-1, 0, None) else max(1, i // self.group_size)
        kern = self._kernel_for(i, o, dtype)
        lay: Layout = [("qweight", (_cdiv(i * o, pack),), "int32"), ("scales", (g, o), dtype)]
        if self.flavor == "ct":
            lay.append(("weight_shape", (2,), "int64"))
        zp_loaded = self.flavor in ("gptq", "awq") or self.zero_points
        gidx_loaded = self.flavor == "gptq" or (self.flavor == "ct" and self.desc_act)
        if kern == "machete":
            if self.zero_points:
                lay.append(("qzeros", (g, o), dtype))  # scales pre-applied, unpacked (machete.py)
            elif zp_loaded:
                lay.append(("qzeros", (g, _cdiv(o, pack)), "int32"))
            if gidx_loaded:
                lay.append(("g_idx", (i,), "int32"))
        elif kern == "marlin":
            if self.zero_points:
                lay.append(("qzeros", (g, _cdiv(o, pack)), "int32"))  # marlin_zero_points: same size
            if self.desc_act:
                lay += [("g_idx", (i,), "int32"), ("g_idx_sort_indices", (i,), "int32")]
            lay.append(("marlin_workspace", (MARLIN_SMS,), "int32"))
        else:
            if zp_loaded:
                lay.append(("qzeros", (g, _cdiv(o, pack)), "int32"))
            if gidx_loaded:
                lay.append(("g_idx", (i,), "int32"))
        return lay, None

    def gemm_temp(self, i: int, o: int, dtype: str) -> tuple[int, tuple[int, int], str] | None:
        """A temporary the profile run's GEMM allocates next to its output, as ``(min_rows, shape,
        dtype)``: AWQ's own kernel (awq.py ``AWQLinearMethod.apply``, 0.6.4, 0.10.1.1, 0.19.0 — the
        forced ``--quantization awq``, or a layer awq_marlin.py hands back to it) dequantizes the
        whole weight (``ops.awq_dequantize`` -> ``[in, out]`` in the scales' dtype) and multiplies
        with ``torch.matmul`` once ``x.shape[:-1].numel() >= 256``. GPTQ's own kernel (gptq.py
        ``GPTQLinearMethod.apply`` → ``ops.gptq_gemm``; csrc/quantization/gptq/q_gemm.cu
        ``gptq_gemm``, read in the 0.3.3, 0.4.1 and 0.10.1.1 sdists) allocates, next to its output
        ``c``, ``temp_dq = torch::empty({b_q_weight.size(0) * 32 / bit, b_q_weight.size(1)})`` —
        the dequantized ``[in, out]`` in the activation dtype — on every call, whatever the rows
        (the kernel reconstructs into it above ``MAX_Q_GEMM_ROWS`` 50, 24 for 8 bits). None for the
        other kernels."""
        kern = self._kernel_for(i, o, dtype)
        if self.flavor == "awq" and kern == "plain":
            return 256, (i, o), dtype
        if self.flavor == "gptq" and kern == "plain":
            return 0, (i, o), dtype
        return None

    def bank(self, e: int, i: int, o: int, dtype: str) -> Layout:
        """Marlin MoE (gptq_marlin.py / awq_marlin.py / compressed_tensors_moe.py): the repacked
        weight keeps its size; zero points only for asymmetric schemes; ``g_idx`` + sort indices
        only with activation order."""
        pack = 32 // self.bits
        g = 1 if self.group_size in (-1, 0, None) else max(1, i // self.group_size)
        lay: Layout = [("qweight", (e, _cdiv(i * o, pack)), "int32"), ("scales", (e, g, o), dtype)]
        if self.zero_points:
            lay.append(("qzeros", (e, g, _cdiv(o, pack)), "int32"))
        if self.desc_act:
            lay += [("g_idx", (e, i), "int32"), ("g_idx_sort_indices", (e, i), "int32")]
        return lay


@dataclass(frozen=True)
class Fp4Format:
    """4-bit float weights, 2 values per ``uint8``: NVFP4 (fp8-e4m3 scale per 16 + fp32 global
    scales; ModelOpt / compressed-tensors ``nvfp4``) or MXFP4 (e8m0 ``uint8`` scale per 32)."""

    group: int = 16
    scale_dtype: str = "float8_e4m3fn"
    globals_fp32: bool = True

    def linear(self, i: int, o: int, dtype: str) -> tuple[Layout, tuple | None]:
        lay: Layout = [("weight", (o, _cdiv(i, 2)), "uint8"), ("weight_scale", (o, _cdiv(i, self.group)), self.scale_dtype)]
        if self.globals_fp32:  # input_global_scale, weight_global_scale, alpha, input_global_scale_inv
            lay.append(("global_scales", (4,), "float32"))
        return lay, None

    def bank(self, e: int, i: int, o: int, dtype: str) -> Layout:
        lay: Layout = [("weight", (e, o, _cdiv(i, 2)), "uint8"), ("weight_scale", (e, o, _cdiv(i, self.group)), self.scale_dtype)]
        if self.globals_fp32:  # weight_scale_2 and input_scale per expert (and shard)
            lay.append(("global_scales", (e, 4), "float32"))
        return lay


#: First release whose Triton MXFP4 path frees the loaded block scales after swizzling
#: (fused_moe/oracle/mxfp4.py ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``: ``del
#: layer.w13_weight_scale`` / ``w2_weight_scale`` in 0.25.0, 0.26.0, 0.27.0, 0.28.0; not in 0.19.0,
#: 0.22.0, 0.24.0, which keep them registered next to the swizzled copy).
MXFP4_TRITON_FREES_SCALES_FROM = (0, 25, 0)
#: First release whose FlashInfer TRT-LLM MXFP4 backend rounds the per-rank intermediate size up to
#: 128 instead of 256 (``mxfp4_round_up_hidden_size_and_intermediate_size``: 256 in 0.19.0, 0.22.0,
#: 0.24.0, 0.25.0, 0.26.0; 128 in 0.27.0, 0.28.0; the hidden size to 256 in all of them).
MXFP4_TRTLLM_I128_FROM = (0, 27, 0)
#: First release that pads the scale groups (K = in/32) to a multiple of 4 before the Hopper swizzle
#: (quantization/utils/mxfp4_utils.py ``_swizzle_mxfp4``, "Patches #47303", on compute capability
#: 9.0: in 0.26.0, 0.27.0, 0.28.0; not in 0.19.0, 0.22.0, 0.24.0, 0.25.0).
MXFP4_HOPPER_SCALE_PAD4_FROM = (0, 26, 0)


#: First release whose wheel ships ``triton_kernels`` (vendored as ``vllm/third_party/triton_kernels``,
#: which ``has_triton_kernels`` accepts from 0.12.0, vllm/utils/import_utils.py); 0.10.1 – 0.11.2
#: import a separately installed ``triton_kernels`` only (no wheel requires it: METADATA of
#: 0.10.1.1, 0.11.1).
TRITON_KERNELS_VENDORED_FROM = (0, 12, 0)
#: The torch each release's CUDA wheel pins (METADATA ``Requires-Dist: torch==``): 2.7.1 through
#: 0.10.1.1 (read), 2.8.0 for 0.10.2 – 0.11.0, 2.9.0 from 0.11.1 (read). Only ``>= 2.8.0`` matters
#: here (the MXFP4 Triton path's ``is_torch_equal_or_newer("2.8.0")``).
TORCH_2_8_FROM = (0, 10, 2)


def mxfp4_hopper_triton(version: tuple[int, ...], triton_kernels_installed: bool | None) -> tuple[bool, dict | None]:
    """Whether gpt-oss's MXFP4 experts can run Triton on a Hopper card, and the assumption made.

    vLLM 0.10.1 – 0.11.2 (quantization/mxfp4.py ``_should_use_marlin`` / ``get_mxfp4_backend``, read
    in 0.10.1.1, 0.10.2, 0.11.0, 0.11.1, 0.11.2): on CUDA below Blackwell, Marlin unless the card is
    9.x **and** ``has_triton_kernels()`` **and** ``is_torch_equal_or_newer("2.8.0")``. The torch is
    the release's pin (:data:`TORCH_2_8_FROM`); ``triton_kernels`` is a separate package until the
    wheel vendors it (:data:`TRITON_KERNELS_VENDORED_FROM`). ``triton_kernels_installed`` None:
    what ``pip install vllm==X`` gets (not installed before 0.12), returned as the named
    assumption ``{"name": "triton_kernels_installed", "value": False, "why": ...}``.
    """
    v = tuple(version[:3])
    if v >= TRITON_KERNELS_VENDORED_FROM:
        return True, None
    if v < TORCH_2_8_FROM:  # torch 2.7.1: Marlin whatever is installed
        return False, None
    if triton_kernels_installed is not None:
        return bool(triton_kernels_installed), None
    return False, {"name": "triton_kernels_installed", "value": False,
                   "why": f"vLLM {'.'.join(map(str, v))} as `pip install` installs it: triton_kernels is not a "
                          "dependency before 0.12, so MXFP4 experts on Hopper run Marlin (hidden padded to 256, "
                          "intermediate to 128) instead of Triton; say triton_kernels_installed: true (check "
                          "--triton-kernels-installed true) where it is installed"}


def mxfp4_backend(cc: tuple[int, int], version: tuple[int, ...], platform: str = "cuda",
                  triton_kernels: bool = True) -> str:
    """The MXFP4 MoE backend vLLM picks for gpt-oss on a CUDA GPU of compute capability ``cc``
    (no ``moe_backend`` / ``VLLM_USE_FLASHINFER_MOE_MXFP4_*`` override).

    vLLM 0.19.0 ``_get_priority_backends`` and 0.22.0–0.28.0 ``_get_priority_backends_for_gpt_oss``
    (fused_moe/oracle/mxfp4.py) try, in order, FlashInfer TRT-LLM BF16, (ROCm AITER / CK), Triton,
    FlashInfer CUTLASS BF16, Marlin, and take the first whose experts class supports the device:

    - TRT-LLM (experts/trtllm_mxfp4_moe.py): ``is_device_capability_family(100)`` with FlashInfer
      (a hard dependency of the CUDA wheels: flashinfer-python 0.6.6 in 0.19, 0.6.16 in 0.28) ->
      ``flashinfer_trtllm`` on 10.x (B200/GB200 10.0, B300 10.3);
    - Triton (experts/gpt_oss_triton_kernels_moe.py): ``(9, 0) <= cc < (11, 0)`` -> Hopper 9.x
      (``triton_strided`` up to 0.11.0, ``triton_swizzle`` after);
    - CUTLASS BF16 (experts/flashinfer_cutlass_moe.py): W-MXFP4 x A-BF16 only on
      ``is_device_capability(90)``, already taken by Triton;
    - Marlin (experts/marlin_moe.py, ``has_device_capability(75)``) -> everything else: Ampere /
      Ada 8.x, Thor 11.0, the RTX Blackwell family 12.x (RTX 50xx, RTX PRO).

    Releases before 0.19 are assumed to pick the same way (their wheels were not read for
    Blackwell; the Hopper branches are the ones checked against the visible H100 start-ups).
    ``triton_kernels`` False (:func:`mxfp4_hopper_triton`: before 0.12 without the package, or
    torch < 2.8): Hopper runs Marlin too.

    On ROCm (``platform="rocm"``; the MI300X's torch capability 9.4 is no Hopper) the AITER
    backends need ``VLLM_ROCM_USE_AITER`` (off by default) and gfx950, so the default is Triton
    (triton_kernels ``StridedLayout`` values and scales on CDNA, mxfp4_utils.py ``_swizzle_mxfp4``,
    0.33): ``rocm_triton``, padded as :func:`mxfp4_alignment` says.
    """
    if platform == "rocm":
        return "rocm_triton"
    if (10, 0) <= cc < (11, 0):
        return "flashinfer_trtllm"
    if (9, 0) <= cc < (10, 0) and triton_kernels:
        return "triton_strided" if version[:3] <= (0, 11, 0) else "triton_swizzle"
    return "marlin"


def mxfp4_alignment(backend: str, version: tuple[int, ...]) -> tuple[int, int]:
    """``(hidden, intermediate)`` multiples the backend pads the per-rank expert sizes to
    (``mxfp4_round_up_hidden_size_and_intermediate_size``, fused_moe/oracle/mxfp4.py, 0.19-0.28):
    Triton I to 64 (H as is: 1); Marlin H to 256 and I to 128; TRT-LLM H to 256 and I to 256
    (128 from :data:`MXFP4_TRTLLM_I128_FROM`). ROCm (``rocm_triton``): I to 128 (0.10,
    quantization/mxfp4.py ``create_weights``), H and I to 256 from 0.11 (the same file, then
    fused_moe/oracle/mxfp4.py ``mxfp4_round_up_hidden_size_and_intermediate_size``'s ROCm branch,
    0.19–0.33: gpt-oss's SwiGLU-OAI activation is not SiLU, so not the 128 of AITER/K3)."""
    if backend == "rocm_triton":
        return (1, 128) if tuple(version[:3]) < (0, 11, 0) else (256, 256)
    if backend == "marlin":
        return 256, 128
    if backend == "flashinfer_trtllm":
        return 256, (128 if tuple(version[:3]) >= MXFP4_TRTLLM_I128_FROM else 256)
    return 1, 64


@dataclass(frozen=True)
class Mxfp4ExpertsFormat:
    """gpt-oss MXFP4 experts (``Mxfp4MoEMethod`` / ``GptOssMxfp4MoEMethod``), one projection
    ``[E, out, in]``: created as ``uint8 [E, out, in/2]`` + e8m0 scales ``uint8 [E, out, in/32]``
    at the backend's padded sizes (``sizes``), biases bf16; then converted in
    ``process_weights_after_loading`` (fused_moe/oracle/mxfp4.py
    ``convert_gpt_oss_weight_to_mxfp4_moe_kernel_format``). ``backend`` (:func:`mxfp4_backend`):

    - ``triton_swizzle`` (Hopper, vLLM >= 0.11.1, torch >= 2.8.1; mxfp4_utils ``_swizzle_mxfp4``):
      the transposed values ``[E, in/2, out]`` go through ``HopperMXValueLayout`` (both dims pre-
      padded to 64 in the triton_kernels vendored by 0.17-0.32, ``prepad``; then ``out`` to 16 and
      ``in/2`` to 32) and the loaded values are freed; a ``HopperMXScaleLayout`` copy of the scales
      ``[E, round_up(out, 256), round_up(in/32, 2)]`` (8 warps); the loaded scales **stay
      registered** (``layer.w13_weight_scale``) unless ``scales_freed`` (0.25+ deletes them);
      the swizzled copy's ``in/32`` is first padded to ``scale_k_pad`` (4 from 0.26); biases fp32.
    - ``triton_strided`` (vLLM 0.11.0, torch 2.8.0: ``StridedLayout``): values as loaded, the
      scales twice (calibrated, not derived: the visible 0.11.0 H100 start-up, 13.47 GiB, is met
      within 0.3 % only with the copy; triton_kernels of that image was not read); biases fp32.
    - ``marlin`` (marlin_utils_fp4.py ``prepare_moe_mxfp4_layer_for_marlin``): values repacked
      per expert at the same size (``gptq_marlin_repack``: ``[in/16, out·2]`` int32), scales
      permuted through the model dtype and back to e8m0 (same size), biases permuted in the model
      dtype; ``replace_parameter`` drops the loaded tensors.
    - ``rocm_triton`` (ROCm, :func:`mxfp4_backend`): values and scales as loaded at the ROCm
      padded sizes (``StridedLayout``), biases fp32.
    - ``flashinfer_trtllm`` (Blackwell 10.x): rows shuffled for the transposed MMA
      (``get_w2_permute_indices_with_cache``), scales interleaved (``nvfp4_block_scale_interleave``,
      reshaped back to ``[E, out, in/32]``), biases fp32; the loaded tensors are replaced.

    ``align``: ``(hidden, intermediate)`` multiples of :func:`mxfp4_alignment`.
    """

    backend: str = "triton_swizzle"
    prepad: bool = True
    scales_freed: bool = False
    align: tuple[int, int] = (1, 64)
    scale_k_pad: int = 1

    @property
    def bias_dtype_fp32(self) -> bool:
        return self.backend != "marlin"

    @property
    def kernel(self) -> str:
        """The fused-MoE profile path (:class:`tuner.model.simulate.moe.FusedMoE` ``kernel``): Triton
        backends run triton_kernels ``matmul_ogs`` (``oai_triton``); ``MarlinExperts`` runs through
        the modular kernel with ``TritonExperts``' workspace shapes (experts/marlin_moe.py
        ``workspace_shapes``: ``(M·k, max(I, H))`` and ``(M·k·max(2I, H),)``, output ``(M, H)``
        sharing the first), i.e. ``triton`` with the persistent workspace; TRT-LLM (monolithic,
        buffers inside FlashInfer) is modelled like ``oai_triton`` (UNVERIFIED: not traced)."""
        return "triton" if self.backend == "marlin" else "oai_triton"

    def sizes(self, h: int, n: int) -> tuple[int, int]:
        ah, an = self.align
        return _round_up(h, ah), _round_up(n, an)

    def bank(self, e: int, i: int, o: int, dtype: str) -> Layout:
        loaded_scale = ("weight_scale", (e, o, _cdiv(i, 32)), "uint8")
        if self.backend == "triton_swizzle":
            m, k = i // 2, o
            if self.prepad:
                m, k = _round_up(m, 64), _round_up(k, 64)
            lay = [("weight", (e, _round_up(k, 16), _round_up(m, 32)), "uint8")]
            if not self.scales_freed:
                lay.append(loaded_scale)
            kg = _round_up(_cdiv(i, 32), self.scale_k_pad)
            return lay + [("weight_scale_swizzled", (e, _round_up(o, 256), _round_up(kg, 2)), "uint8")]
        if self.backend == "triton_strided":
            return [("weight", (e, o, i // 2), "uint8"), loaded_scale,
                    ("weight_scale_copy", (e, o, _cdiv(i, 32)), "uint8")]
        return [("weight", (e, o, i // 2), "uint8"), loaded_scale]


# --------------------------------------------------------------------------------------------
# Schemes
# --------------------------------------------------------------------------------------------
@dataclass
class QuantScheme:
    """One checkpoint's quantization as vLLM applies it to a rank.

    Attributes:
        method: vLLM's method name (``fp8``, ``compressed-tensors``, ``gptq_marlin``, ...).
        linear_format: layout of quantized linears, or ``None`` (linears stay 16-bit).
        expert_format: layout of MoE expert banks, or ``None`` (16-bit experts).
        ignore: module names the checkpoint keeps 16-bit (exact, ``re:``, wildcards).
        per_layer: ``{name: format or None}`` overrides (ModelOpt MIXED_PRECISION, auto-round
            ``extra_config``, compressed-tensors groups targeting named modules); ``None`` =
            unquantized.
        only_under: quantize only modules under these prefixes (auto-round ``block_name_to_quantize``).
        quantizes_lm_head: the method also quantizes ``lm_head`` (GPTQ ``lm_head: true``).
        substring_ignore: ignore entries also match as substrings (ModelOpt ``is_layer_excluded``).
    """

    method: str
    linear_format: Any = None
    expert_format: Any = None
    ignore: list = field(default_factory=list)
    per_layer: dict = field(default_factory=dict)
    only_under: list | None = None
    quantizes_lm_head: bool = False
    substring_ignore: bool = False

    # -- decisions ----------------------------------------------------------------------------
    def is_ignored(self, prefix: str) -> bool:
        """Whether the checkpoint keeps module ``prefix`` (a vLLM or HF module name) unquantized."""
        if self.ignore and matches(prefix, self.ignore, substring=self.substring_ignore):
            return True
        c = canonical(prefix)
        if c.startswith(("vision_tower", "vision_model", "visual", "multi_modal_projector", "mm_projector")):
            if self.method in ("modelopt", "modelopt_mixed", "auto-round"):
                return True  # ModelOpt: hard-coded vision skip (modelopt.py); auto-round: blocks only
        if self.only_under is not None and not any(c == canonical(p) or c.startswith(canonical(p) + ".")
                                                   for p in self.only_under):
            return True
        return False

    def _format_for(self, prefix: str, kind: str):
        if self.per_layer:
            key = self._per_layer_key(prefix)
            if key is not _MISSING:
                return self.per_layer[key]
            if self.method == "modelopt_mixed":
                return None  # not listed: unquantized
        if self.is_ignored(prefix):
            return None
        return self.linear_format if kind == "linear" else self.expert_format

    def _per_layer_key(self, prefix: str):
        c = canonical(prefix)
        table = {canonical(k): k for k in self.per_layer}
        if c in table:
            return table[c]
        head, _, last = c.rpartition(".")
        shards = FUSED_MODULES.get(last)
        if shards:
            keys = [table.get(f"{head}.{s}" if head else s) for s in shards]
            if all(k is not None for k in keys):
                return keys[0]
        for ck, k in table.items():  # experts: any child entry (ModelOpt _resolve_quant_algo)
            if ck.startswith(c + "."):
                return k
        for k in self.per_layer:  # regex keys (auto-round extra_config)
            if any(ch in k for ch in "*+?^$()[]{}|\\") and re.search(k, prefix):
                return k
        return _MISSING

    # -- registration -------------------------------------------------------------------------
    def linear_layout(self, in_features: int, out_features: int, dtype: str, prefix: str = "") -> tuple[Layout, tuple | None] | None:
        """The ``(layout, input_quant)`` of a linear ``[out, in]`` at ``prefix`` (None: 16-bit)."""
        if canonical(prefix).split(".")[-1] == "lm_head" and not self.quantizes_lm_head:
            return None
        fmt = self._format_for(prefix, "linear")
        if fmt is None:
            return None
        if isinstance(fmt, Int8Format):
            return fmt.linear(in_features, out_features, dtype, fused=prefix.rsplit(".", 1)[-1] in FUSED_MODULES)
        return fmt.linear(in_features, out_features, dtype)

    def expert_layout(self, num_experts: int, hidden: int, intermediate: int, dtype: str, prefix: str = "",
                      has_bias: bool = False) -> Layout | None:
        """The layout of an expert bank at ``prefix`` (``w13_*`` for gate+up ``[E, 2I, H]``,
        ``w2_*`` for down ``[E, H, I]``, at the method's padded sizes), or None (16-bit)."""
        fmt = self._format_for(prefix, "experts")
        if fmt is None or not hasattr(fmt, "bank"):
            return None
        h, n = self.expert_sizes(hidden, intermediate, prefix)
        lay = [(f"w13_{name}", shape, dt) for name, shape, dt in fmt.bank(num_experts, h, 2 * n, dtype)]
        lay += [(f"w2_{name}", shape, dt) for name, shape, dt in fmt.bank(num_experts, n, h, dtype)]
        if has_bias:
            bias_dt = "float32" if getattr(fmt, "bias_dtype_fp32", False) else dtype
            lay += [("w13_bias", (num_experts, 2 * n), bias_dt), ("w2_bias", (num_experts, h), bias_dt)]
        return lay

    def expert_sizes(self, hidden: int, intermediate: int, prefix: str = "") -> tuple[int, int]:
        """``(hidden, intermediate)`` per rank as the method's expert kernels run them."""
        fmt = self._format_for(prefix, "experts")
        if isinstance(fmt, Mxfp4ExpertsFormat):
            return fmt.sizes(hidden, intermediate)
        return hidden, intermediate

    def gemm_temp_for(self, in_features: int, out_features: int, dtype: str, prefix: str = ""):
        """The temporary the linear's GEMM allocates next to its output (``WNA16Format.gemm_temp``),
        or None."""
        fmt = self._format_for(prefix, "linear")
        return fmt.gemm_temp(in_features, out_features, dtype) if hasattr(fmt, "gemm_temp") else None


_MISSING = object()


# --------------------------------------------------------------------------------------------
# Config parsing
# --------------------------------------------------------------------------------------------
def _capability(settings) -> tuple[int, int]:
    cc = getattr(settings, "compute_capability", None)
    if cc:
        try:
            major, _, minor = str(cc).partition(".")
            return int(major), int(minor or 0)
        except ValueError:
            pass
    return (9, 0)


def _version(settings) -> tuple[int, ...]:
    out = []
    for p in str(getattr(settings, "engine_version", "0.19.0")).split("."):
        m = re.match(r"\d+", p)
        out.append(int(m.group()) if m else 0)
    return tuple(out)


def fp8_uses_marlin(cc: tuple[int, int]) -> bool:
    """FP8 weights on a card without native FP8 (compute capability below 8.9: Ampere, Turing) run
    weight-only through Marlin: fp8.py ``use_marlin = not has_device_capability(89)`` (0.9 – 0.13),
    ``MarlinFP8ScaledMMLinearKernel.is_supported`` (``compute_capability >= 89`` refuses it,
    0.19 – 0.34); compressed-tensors ``CompressedTensorsW8A16Fp8`` below 8.9 (compressed_tensors.py
    ``_get_scheme_from_parts``). ``VLLM_TEST_FORCE_FP8_MARLIN`` is not modelled."""
    return cc < (8, 9)


def _wna16_kernel(cc: tuple[int, int], override: str | None) -> str:
    if override in ("gptq", "awq"):
        return "plain"  # forced exllama / AWQ GEMM kernels keep the checkpoint layout
    if cc == (9, 0):
        return "machete"
    return "marlin" if cc >= (7, 5) else "plain"


def _ct_args(args: dict | None) -> dict | None:
    """compressed-tensors ``QuantizationArgs`` with its defaults filled in."""
    if not args:
        return None
    a = dict(args)
    a.setdefault("num_bits", 8)
    a.setdefault("type", "int")
    a.setdefault("symmetric", True)
    if not a.get("strategy"):
        gs = a.get("group_size")
        a["strategy"] = "tensor" if gs is None else ("channel" if gs == -1 else "group")
    return a


def _ct_format(w: dict, inp: dict | None, fmt: str | None, cc: tuple[int, int], dtype_override: str | None):
    bits, typ, strategy = int(w["num_bits"]), w["type"], w["strategy"]
    if bits == 4 and typ == "float":
        gs = int(w.get("group_size") or 16)
        if gs == 32:
            return Fp4Format(group=32, scale_dtype="uint8", globals_fp32=False)
        return Fp4Format(group=gs)
    if fmt is None:
        fmt = ("float-quantized" if typ == "float" else "int-quantized") if (inp and bits == 8) else "pack-quantized"
    if fmt in ("pack-quantized", "marlin-24") and strategy in ("group", "channel") and not inp:
        return WNA16Format(bits=bits, group_size=int(w.get("group_size") or -1), zero_points=not w["symmetric"],
                           desc_act=w.get("actorder") == "group", flavor="ct", kernel=_wna16_kernel(cc, dtype_override))
    if bits == 8 and typ == "float":
        if strategy == "block":
            bs = w.get("block_structure") or [128, 128]
            return Fp8Format(strategy="block", block=(int(bs[0]), int(bs[1])), quantize_activations=bool(inp),
                             marlin=fp8_uses_marlin(cc))
        static = bool(inp) and not inp.get("dynamic", False)
        return Fp8Format(strategy="channel" if strategy == "channel" else "tensor", static_input=static,
                         quantize_activations=bool(inp) and cc >= (8, 9), marlin=fp8_uses_marlin(cc))
    if bits == 8 and typ == "int" and inp:
        return Int8Format(strategy="channel" if strategy == "channel" else "tensor",
                          static_input=not inp.get("dynamic", True) if "dynamic" in inp else False,
                          input_symmetric=inp.get("symmetric", True))
    if bits in (4, 8) and not inp:
        return WNA16Format(bits=bits, group_size=int(w.get("group_size") or -1), zero_points=not w["symmetric"],
                           desc_act=w.get("actorder") == "group", flavor="ct", kernel=_wna16_kernel(cc, dtype_override))
    raise ValueError(f"unsupported compressed-tensors weights {w} / inputs {inp}")


_CT_DEFAULT_IGNORE = ("lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*", "re:.*visual.*",
                      "re:.*vision_model.*", "re:.*mlp.gate$")


def _compressed_tensors(qc: dict, cc, override) -> QuantScheme:
    groups = qc.get("config_groups") or {}
    per_target: list[tuple[list, Any]] = []
    for g in groups.values():
        targets = g.get("targets") or ["Linear"]
        if len(targets) == 1 and str(targets[0]).endswith("Attention"):
            continue  # attention-only groups are KV-cache quantization (compressed_tensors.py)
        w = _ct_args(g.get("weights"))
        if w is None:
            continue
        fmt = _ct_format(w, _ct_args(g.get("input_activations")), g.get("format") or qc.get("format"), cc, override)
        per_target.append((targets, fmt))
    # A partial config without an "ignore" key: llm-compressor's recipes keep lm_head and the
    # multimodal towers in 16-bit (their published configs list these); with the key, it is followed.
    ignore = list(qc["ignore"]) if isinstance(qc.get("ignore"), list) else list(_CT_DEFAULT_IGNORE)
    if not per_target:
        return QuantScheme("compressed-tensors", ignore=ignore)
    default = next((f for t, f in per_target if any(x in ("Linear", "FusedMoE") for x in t)), None)
    per_layer = {}
    for targets, fmt in per_target:
        for t in targets:
            if t not in ("Linear", "FusedMoE"):
                per_layer[t] = fmt
    scheme = QuantScheme("compressed-tensors", linear_format=default, expert_format=default,
                         ignore=ignore, per_layer=per_layer)
    if default is None:
        scheme.method = "compressed-tensors-targets"
    return scheme


#: First release whose ModelOpt configs quantize ``ParallelLMHead`` as well as ``LinearBase``
#: (vllm/model_executor/layers/quantization/modelopt.py ``get_quant_method``:
#: ``isinstance(layer, (LinearBase, ParallelLMHead))`` in ``ModelOptQuantConfigBase`` and
#: ``ModelOptMixedPrecisionConfig`` from 0.23.0, read in 0.23.0, 0.24.0, 0.34.0; ``LinearBase`` only
#: in 0.17.0 – 0.22.1). The head is then quantized unless excluded (``exclude_modules`` /
#: ``ignore``), and under ``MIXED_PRECISION`` only when ``quantized_layers`` names it
#: (``_resolve_quant_algo``: ``lm_head`` is a candidate prefix of ``*.lm_head``; not listed ->
#: ``UnquantizedLinearMethod``). The model must pass its quant config to ``ParallelLMHead``
#: (qwen3_5.py does).
MODELOPT_QUANTIZES_LM_HEAD_FROM = (0, 23, 0)


def _modelopt(qc: dict, version: tuple[int, ...] = (0, 19, 0)) -> QuantScheme:
    """ModelOpt (``quant_method: modelopt``) schemes; ``version``: the vLLM release, which decides
    whether ``lm_head`` is quantized (:data:`MODELOPT_QUANTIZES_LM_HEAD_FROM`)."""
    lm_head = tuple(version[:3]) >= MODELOPT_QUANTIZES_LM_HEAD_FROM
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(inner.get("quant_algo") or "").upper()
    ignore = list(inner.get("exclude_modules") or qc.get("ignore") or qc.get("exclude_modules") or [])
    gs = int(inner.get("group_size") or 16)

    def fmt_for(a: str, group: int = 16):
        a = a.upper()
        if "NVFP4" in a:  # NVFP4 and W4A16_NVFP4: same weight layout
            return Fp4Format(group=group)
        if a.startswith("FP8"):
            return Fp8Format(strategy="channel" if "PER_CHANNEL" in a else "tensor", static_input=a == "FP8")
        if a == "MXFP8":  # fp8 values + e8m0 (uint8) scale per 32 inputs
            return Fp8Format(strategy="block", block=(1, 32), scale_dtype="uint8")
        return None

    if algo == "MIXED_PRECISION":
        layers = inner.get("quantized_layers") or {}
        per_layer = {k: fmt_for(str(v.get("quant_algo", "")), int(v.get("group_size") or 16)) for k, v in layers.items()}
        return QuantScheme("modelopt_mixed", ignore=ignore, per_layer=per_layer, substring_ignore=True,
                           quantizes_lm_head=lm_head)
    fmt = fmt_for(algo, gs)
    return QuantScheme("modelopt", linear_format=fmt, expert_format=fmt, ignore=ignore, substring_ignore=True,
                       quantizes_lm_head=lm_head)


def scheme_for(spec, settings) -> QuantScheme | None:
    """The quantization scheme of ``spec`` (its ``quantization_config``) under ``settings``.

    The checkpoint's ``quantization_config`` wins; the drop's ``quantization`` then only selects a
    kernel of the same family (``gptq``/``awq`` force the non-Marlin kernels). On an unquantized
    checkpoint the override quantizes online: ``fp8`` (per-tensor fp8 weights, dynamic per-token
    fp8 activations: ``Fp8OnlineLinearMethod``), ``ptpc_fp8`` (per-channel), ``experts_int8``
    (int8 experts, per-channel fp32 scales); other online methods (``bitsandbytes``, ``mxfp8``,
    ... :data:`tuner.memory.engine_checks.ONLINE_QUANTIZATION_METHODS`) raise ModelConfigError; methods
    that need a quantized checkpoint return None (:func:`tuner.memory.engine_checks.check_quantization`
    refuses them in the job).

    Returns:
        A :class:`QuantScheme`, or ``None`` (16-bit weights).

    Raises:
        tuner.errors.ModelConfigError: a ``quant_method`` (or online override) this module does
            not model.
        ValueError: compressed-tensors arguments no vLLM scheme runs.
    """
    qc = getattr(spec, "quantization_config", None)
    if not qc:
        top = getattr(spec, "top", None) or {}
        raw = getattr(spec, "raw", None) or {}
        qc = top.get("quantization_config") or raw.get("quantization_config")
    override = (getattr(settings, "quantization", None) or None)
    override = override.lower() if isinstance(override, str) else None
    cc = _capability(settings)
    ver = _version(settings)
    if not qc:
        if override in ("fp8", "fbgemm_fp8"):
            f = Fp8Format(strategy="tensor", quantize_activations=cc >= (8, 9), marlin=fp8_uses_marlin(cc))
            return QuantScheme("fp8", linear_format=f, expert_format=f)
        if override == "ptpc_fp8":
            f = Fp8Format(strategy="channel")
            return QuantScheme("ptpc_fp8", linear_format=f, expert_format=f)
        if override == "experts_int8":
            return QuantScheme("experts_int8", expert_format=Int8Format(strategy="channel"))
        from tuner.memory.engine_checks import MODELLED_ONLINE_METHODS, ONLINE_QUANTIZATION_METHODS

        if override in ONLINE_QUANTIZATION_METHODS and override not in MODELLED_ONLINE_METHODS:
            from tuner.errors import ModelConfigError

            raise ModelConfigError(f"online quantization {override!r} of a 16-bit checkpoint is not modelled "
                                   f"(modelled: {', '.join(MODELLED_ONLINE_METHODS)})", where="quantization")
        return None  # methods that need a quantized checkpoint: the job refuses them first
    method = str(qc.get("quant_method") or qc.get("quantization_method") or "").lower().replace("_", "-")
    if method == "fp8":
        wbs = qc.get("weight_block_size")
        static = str(qc.get("activation_scheme", "dynamic")).lower() == "static"
        f = (Fp8Format(strategy="block", block=(int(wbs[0]), int(wbs[1])), marlin=fp8_uses_marlin(cc))
             if wbs else Fp8Format(strategy="tensor", static_input=static, quantize_activations=cc >= (8, 9),
                                   marlin=fp8_uses_marlin(cc)))
        ignore = list(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])
        return QuantScheme("fp8", linear_format=f, expert_format=f, ignore=ignore)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, cc, override)
    if method in ("gptq", "gptq-marlin"):
        bits = int(qc.get("bits", 4))
        sym = bool(qc.get("sym", True))
        f = WNA16Format(bits=bits, group_size=int(qc.get("group_size", 128)), zero_points=not sym,
                        desc_act=bool(qc.get("desc_act", False)), flavor="gptq",
                        kernel=_wna16_kernel(cc, override) if sym else "plain")
        return QuantScheme("gptq_marlin", linear_format=f, expert_format=f, quantizes_lm_head=bool(qc.get("lm_head", False)),
                           ignore=list(qc.get("modules_to_not_convert") or []))
    if method in ("awq", "awq-marlin"):
        f = WNA16Format(bits=int(qc.get("bits", qc.get("w_bit", 4))), group_size=int(qc.get("group_size", qc.get("q_group_size", 128))),
                        zero_points=bool(qc.get("zero_point", True)), flavor="awq", kernel=_wna16_kernel(cc, override))
        return QuantScheme("awq_marlin", linear_format=f, expert_format=f,
                           ignore=list(qc.get("modules_to_not_convert") or []))
    if method in ("auto-round", "autoround", "intel/auto-round", "inc"):
        bits = int(qc.get("bits", 4))
        gs = int(qc.get("group_size", 128))
        sym = bool(qc.get("sym", True))
        packing = str(qc.get("packing_format", "auto_round:auto_gptq")) + str(qc.get("backend", ""))
        flavor = "awq" if "awq" in packing else "gptq"
        f = WNA16Format(bits=bits, group_size=gs, zero_points=(flavor == "awq") or not sym, flavor=flavor,
                        kernel=_wna16_kernel(cc, override))
        per_layer = {}
        for name, cfg in (qc.get("extra_config") or {}).items():
            b = int(cfg.get("bits", bits))
            per_layer[name] = None if b >= 16 else WNA16Format(bits=b, group_size=int(cfg.get("group_size", gs)),
                                                               zero_points=f.zero_points, flavor=flavor, kernel=f.kernel)
        blocks = qc.get("block_name_to_quantize") or qc.get("to_quant_block_names")
        if isinstance(blocks, str):
            blocks = blocks.split(",")
        return QuantScheme("auto-round", linear_format=f, expert_format=f, per_layer=per_layer,
                           only_under=list(blocks) if blocks else None)
    if method == "mxfp4":
        triton, _ = mxfp4_hopper_triton(ver, getattr(settings, "triton_kernels_installed", None))
        backend = mxfp4_backend(cc, ver, str(getattr(settings, "platform", "cuda") or "cuda"), triton)
        # HopperMXValueLayout pre-pad to 64: in the triton_kernels vendored by 0.17.0-0.19.0, not in
        # 0.13.0 / 0.15.0 / 0.33.0 (read by the gpt-oss plugin work); 0.20-0.32 assumed like 0.19.
        prepad = (0, 17, 0) <= ver[:3] < (0, 33, 0)
        swizzle = backend == "triton_swizzle"
        fmt = Mxfp4ExpertsFormat(backend=backend, prepad=prepad, align=mxfp4_alignment(backend, ver),
                                 scales_freed=swizzle and ver[:3] >= MXFP4_TRITON_FREES_SCALES_FROM,
                                 scale_k_pad=4 if swizzle and ver[:3] >= MXFP4_HOPPER_SCALE_PAD4_FROM else 1)
        return QuantScheme("mxfp4", expert_format=fmt, ignore=list(qc.get("modules_to_not_convert") or []))
    if method in ("modelopt", "modelopt-fp4", "modelopt-mixed"):
        return _modelopt(qc, ver)
    if method == "bitsandbytes":
        return QuantScheme("bitsandbytes", linear_format=Fp4Format(group=64, scale_dtype="float32", globals_fp32=False),
                           ignore=list(qc.get("llm_int8_skip_modules") or []))
    if method == "fbgemm-fp8":  # fbgemm_fp8.py: use_marlin = not has_device_capability(89)
        f = Fp8Format(strategy="channel", marlin=fp8_uses_marlin(cc))
        return QuantScheme("fbgemm_fp8", linear_format=f, ignore=list(qc.get("modules_to_not_convert") or []))
    from tuner.errors import ModelConfigError

    raise ModelConfigError(f"quantization method {method!r} is not modelled (known: fp8, compressed-tensors, gptq, awq, "
                           "auto-round, mxfp4, modelopt, bitsandbytes, fbgemm_fp8)", where="quantization_config.quant_method")

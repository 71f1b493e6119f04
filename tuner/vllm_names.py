"""The names each vLLM release accepts for ``--kv-cache-dtype`` and ``--quantization``.

Pure data and lookups (no torch, no I/O). Read from the released wheels (``pip download vllm==X
--no-deps``): ``CacheDType`` in ``vllm/config/cache.py`` (0.8.5+; ``vllm/config.py`` before, and
the ``--kv-cache-dtype`` argparse choices of ``vllm/engine/arg_utils.py`` up to 0.8.0) and
``QuantizationMethods`` / ``DEPRECATED_QUANTIZATION_METHODS`` in
``vllm/model_executor/layers/quantization/__init__.py`` (``QUANTIZATION_METHODS`` keys before
0.6, the ``--quantization`` choices in 0.4.0). Releases read: 0.4.0–0.4.3, 0.5.0, 0.6.0, 0.6.4,
0.7.0, 0.8.0, 0.8.5, 0.9.0–0.9.2, 0.10.0, 0.10.1.1, 0.10.2, 0.11.0–0.11.2, 0.12.0–0.34.0 (every
minor). Each table lists a release where the names changed and holds until the next entry, so
a release that was not read (0.5.x after 0.5.0, 0.6.1–0.6.3, 0.7.1–0.7.3, 0.8.1–0.8.4, patch
releases) takes the names of the nearest read release below it.
"""

from __future__ import annotations

from typing import Any

#: ``--kv-cache-dtype`` names by first release seen.
KV_CACHE_DTYPES_BY_RELEASE = (
    ((0, 4, 0), ("auto", "fp8_e5m2")),
    ((0, 4, 1), ("auto", "fp8")),
    ((0, 4, 3), ("auto", "fp8", "fp8_e5m2", "fp8_e4m3")),
    ((0, 10, 0), ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")),
    ((0, 11, 0), ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")),
    ((0, 11, 1), ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")),
    ((0, 18, 0), ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")),
    ((0, 20, 0), ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                  "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
                  "int8_per_token_head", "fp8_per_token_head", "nvfp4")),
    ((0, 25, 0), ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                  "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
                  "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4")),
    ((0, 28, 0), ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                  "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
                  "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6")),
    ((0, 30, 0), ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                  "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                  "turboquant_3bit_nc", "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4",
                  "nvfp4_4over6")),
    ((0, 32, 0), ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                  "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                  "turboquant_3bit_nc", "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head",
                  "fp8_per_token_head", "nvfp4", "nvfp4_4over6")),
    ((0, 33, 0), ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                  "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                  "turboquant_3bit_nc", "octave_k3v4", "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit",
                  "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6")),
)

#: ``--quantization`` names (in the release's order) and the names its
#: ``DEPRECATED_QUANTIZATION_METHODS`` lists, by first release seen.
QUANTIZATION_METHODS_BY_RELEASE = (
    ((0, 4, 0), ('awq', 'gptq', 'squeezellm'),
     ()),
    ((0, 4, 1), ('aqlm', 'awq', 'fp8', 'gptq', 'squeezellm', 'marlin'),
     ()),
    ((0, 4, 2), ('aqlm', 'awq', 'fp8', 'gptq', 'squeezellm', 'gptq_marlin', 'marlin'),
     ()),
    ((0, 4, 3), ('aqlm', 'awq', 'deepspeedfp', 'fp8', 'marlin', 'gptq_marlin_24', 'gptq_marlin', 'gptq', 'squeezellm', 'sparseml'),
     ()),
    ((0, 5, 0), ('aqlm', 'awq', 'deepspeedfp', 'fp8', 'marlin', 'gptq_marlin_24', 'gptq_marlin', 'gptq', 'squeezellm', 'compressed-tensors', 'bitsandbytes'),
     ()),
    ((0, 6, 0), ('aqlm', 'awq', 'deepspeedfp', 'tpu_int8', 'fp8', 'fbgemm_fp8', 'marlin', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'awq_marlin', 'gptq', 'squeezellm', 'compressed-tensors', 'bitsandbytes', 'qqq', 'experts_int8', 'neuron_quant'),
     ()),
    ((0, 6, 4), ('aqlm', 'awq', 'deepspeedfp', 'tpu_int8', 'fp8', 'fbgemm_fp8', 'modelopt', 'marlin', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'qqq', 'experts_int8', 'neuron_quant', 'ipex'),
     ()),
    ((0, 7, 0), ('aqlm', 'awq', 'deepspeedfp', 'tpu_int8', 'fp8', 'fbgemm_fp8', 'modelopt', 'marlin', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'qqq', 'hqq', 'experts_int8', 'neuron_quant', 'ipex', 'quark'),
     ()),
    ((0, 8, 0), ('aqlm', 'awq', 'deepspeedfp', 'tpu_int8', 'fp8', 'ptpc_fp8', 'fbgemm_fp8', 'modelopt', 'nvfp4', 'marlin', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'qqq', 'hqq', 'experts_int8', 'neuron_quant', 'ipex', 'quark', 'moe_wna16'),
     ()),
    ((0, 8, 5), ('aqlm', 'awq', 'deepspeedfp', 'tpu_int8', 'fp8', 'ptpc_fp8', 'fbgemm_fp8', 'modelopt', 'nvfp4', 'marlin', 'bitblas', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'gptq_bitblas', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'qqq', 'hqq', 'experts_int8', 'neuron_quant', 'ipex', 'quark', 'moe_wna16', 'torchao'),
     ()),
    ((0, 9, 0), ('aqlm', 'awq', 'deepspeedfp', 'tpu_int8', 'fp8', 'ptpc_fp8', 'fbgemm_fp8', 'modelopt', 'modelopt_fp4', 'marlin', 'bitblas', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'gptq_bitblas', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'qqq', 'hqq', 'experts_int8', 'neuron_quant', 'ipex', 'quark', 'moe_wna16', 'torchao', 'auto-round'),
     ()),
    ((0, 9, 2), ('aqlm', 'awq', 'deepspeedfp', 'tpu_int8', 'fp8', 'ptpc_fp8', 'fbgemm_fp8', 'modelopt', 'modelopt_fp4', 'marlin', 'bitblas', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'gptq_bitblas', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'qqq', 'hqq', 'experts_int8', 'neuron_quant', 'ipex', 'quark', 'moe_wna16', 'torchao', 'auto-round', 'rtn'),
     ()),
    ((0, 10, 0), ('aqlm', 'awq', 'deepspeedfp', 'tpu_int8', 'fp8', 'ptpc_fp8', 'fbgemm_fp8', 'modelopt', 'modelopt_fp4', 'marlin', 'bitblas', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'gptq_bitblas', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'qqq', 'hqq', 'experts_int8', 'neuron_quant', 'ipex', 'quark', 'moe_wna16', 'torchao', 'auto-round', 'rtn', 'inc'),
     ()),
    ((0, 10, 1), ('awq', 'deepspeedfp', 'tpu_int8', 'fp8', 'ptpc_fp8', 'fbgemm_fp8', 'modelopt', 'modelopt_fp4', 'marlin', 'bitblas', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'gptq_bitblas', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'qqq', 'hqq', 'experts_int8', 'neuron_quant', 'ipex', 'quark', 'moe_wna16', 'torchao', 'auto-round', 'rtn', 'inc', 'mxfp4'),
     ()),
    ((0, 10, 2), ('awq', 'deepspeedfp', 'tpu_int8', 'fp8', 'ptpc_fp8', 'fbgemm_fp8', 'modelopt', 'modelopt_fp4', 'bitblas', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'gptq_bitblas', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'hqq', 'experts_int8', 'ipex', 'quark', 'moe_wna16', 'torchao', 'auto-round', 'rtn', 'inc', 'mxfp4', 'petit_nvfp4'),
     ()),
    ((0, 11, 1), ('awq', 'deepspeedfp', 'tpu_int8', 'fp8', 'ptpc_fp8', 'fbgemm_fp8', 'fp_quant', 'modelopt', 'modelopt_fp4', 'bitblas', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'gptq_bitblas', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'hqq', 'experts_int8', 'ipex', 'quark', 'moe_wna16', 'torchao', 'auto-round', 'rtn', 'inc', 'mxfp4', 'petit_nvfp4'),
     ()),
    ((0, 12, 0), ('awq', 'deepspeedfp', 'tpu_int8', 'fp8', 'ptpc_fp8', 'fbgemm_fp8', 'fp_quant', 'modelopt', 'modelopt_fp4', 'bitblas', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'gptq_bitblas', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'hqq', 'experts_int8', 'ipex', 'quark', 'moe_wna16', 'torchao', 'auto-round', 'rtn', 'inc', 'mxfp4', 'petit_nvfp4', 'cpu_gptq', 'cpu_awq'),
     ()),
    ((0, 14, 0), ('awq', 'deepspeedfp', 'fp8', 'ptpc_fp8', 'fbgemm_fp8', 'fp_quant', 'modelopt', 'modelopt_fp4', 'bitblas', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'gptq_bitblas', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'hqq', 'experts_int8', 'ipex', 'quark', 'moe_wna16', 'torchao', 'auto-round', 'rtn', 'inc', 'mxfp4', 'petit_nvfp4', 'cpu_awq'),
     ('deepspeedfp', 'tpu_int8', 'ptpc_fp8', 'fbgemm_fp8', 'fp_quant', 'bitblas', 'gptq_marlin_24', 'gptq_bitblas', 'hqq', 'experts_int8', 'ipex', 'auto-round', 'rtn', 'petit_nvfp4')),
    ((0, 15, 0), ('awq', 'fp8', 'ptpc_fp8', 'fbgemm_fp8', 'fp_quant', 'modelopt', 'modelopt_fp4', 'bitblas', 'gguf', 'gptq_marlin_24', 'gptq_marlin', 'gptq_bitblas', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'experts_int8', 'ipex', 'quark', 'moe_wna16', 'torchao', 'inc', 'mxfp4', 'petit_nvfp4', 'cpu_awq'),
     ('tpu_int8', 'ptpc_fp8', 'fbgemm_fp8', 'fp_quant', 'bitblas', 'gptq_marlin_24', 'gptq_bitblas', 'experts_int8', 'ipex', 'petit_nvfp4')),
    ((0, 16, 0), ('awq', 'fp8', 'ptpc_fp8', 'fbgemm_fp8', 'fp_quant', 'modelopt', 'modelopt_fp4', 'modelopt_mxfp8', 'gguf', 'gptq_marlin', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'experts_int8', 'quark', 'moe_wna16', 'torchao', 'inc', 'mxfp4', 'petit_nvfp4', 'cpu_awq'),
     ('tpu_int8', 'ptpc_fp8', 'fbgemm_fp8', 'fp_quant', 'experts_int8', 'petit_nvfp4')),
    ((0, 17, 0), ('awq', 'fp8', 'ptpc_fp8', 'fbgemm_fp8', 'fp_quant', 'modelopt', 'modelopt_fp4', 'modelopt_mxfp8', 'modelopt_mixed', 'gguf', 'gptq_marlin', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'experts_int8', 'quark', 'moe_wna16', 'torchao', 'inc', 'mxfp4', 'petit_nvfp4', 'cpu_awq'),
     ('tpu_int8', 'ptpc_fp8', 'fbgemm_fp8', 'fp_quant', 'experts_int8', 'petit_nvfp4')),
    ((0, 19, 0), ('awq', 'fp8', 'fbgemm_fp8', 'fp_quant', 'modelopt', 'modelopt_fp4', 'modelopt_mxfp8', 'modelopt_mixed', 'gguf', 'gptq_marlin', 'awq_marlin', 'gptq', 'compressed-tensors', 'bitsandbytes', 'experts_int8', 'quark', 'moe_wna16', 'torchao', 'inc', 'mxfp4', 'mxfp8', 'petit_nvfp4', 'cpu_awq'),
     ('tpu_int8', 'fbgemm_fp8', 'fp_quant', 'experts_int8', 'petit_nvfp4')),
    ((0, 20, 0), ('awq', 'fp8', 'fbgemm_fp8', 'fp_quant', 'modelopt', 'modelopt_fp4', 'modelopt_mxfp8', 'modelopt_mixed', 'gguf', 'gptq_marlin', 'awq_marlin', 'gptq', 'humming', 'compressed-tensors', 'bitsandbytes', 'experts_int8', 'quark', 'moe_wna16', 'torchao', 'inc', 'mxfp4', 'gpt_oss_mxfp4', 'deepseek_v4_fp8', 'cpu_awq', 'online', 'fp8_per_tensor', 'fp8_per_block', 'int8_per_channel_weight_only', 'mxfp8'),
     ('tpu_int8', 'fbgemm_fp8', 'fp_quant')),
    ((0, 22, 0), ('awq', 'fp8', 'fbgemm_fp8', 'fp_quant', 'modelopt', 'modelopt_fp4', 'modelopt_mxfp8', 'modelopt_mixed', 'gguf', 'auto_gptq', 'gptq', 'gptq_marlin', 'awq_marlin', 'humming', 'compressed-tensors', 'bitsandbytes', 'experts_int8', 'quark', 'moe_wna16', 'torchao', 'inc', 'mxfp4', 'gpt_oss_mxfp4', 'deepseek_v4_fp8', 'cpu_awq', 'online', 'fp8_per_tensor', 'fp8_per_block', 'int8_per_channel_weight_only', 'mxfp8'),
     ('tpu_int8', 'fbgemm_fp8', 'fp_quant')),
    ((0, 23, 0), ('awq', 'fp8', 'fbgemm_fp8', 'fp_quant', 'modelopt', 'modelopt_fp4', 'modelopt_mxfp8', 'modelopt_mixed', 'gguf', 'auto_gptq', 'gptq', 'gptq_marlin', 'awq_marlin', 'humming', 'compressed-tensors', 'bitsandbytes', 'experts_int8', 'quark', 'moe_wna16', 'torchao', 'inc', 'mxfp4', 'gpt_oss_mxfp4', 'deepseek_v4_fp8', 'online', 'fp8_per_tensor', 'fp8_per_block', 'int8_per_channel_weight_only', 'mxfp8'),
     ('fbgemm_fp8', 'fp_quant')),
    ((0, 24, 0), ('awq', 'auto_awq', 'fp8', 'fbgemm_fp8', 'fp_quant', 'modelopt', 'modelopt_fp4', 'modelopt_mxfp8', 'modelopt_mixed', 'auto_gptq', 'gptq', 'gptq_marlin', 'awq_marlin', 'humming', 'compressed-tensors', 'bitsandbytes', 'experts_int8', 'quark', 'moe_wna16', 'torchao', 'inc', 'mxfp4', 'gpt_oss_mxfp4', 'deepseek_v4_fp8', 'online', 'fp8_per_tensor', 'fp8_per_block', 'fp8_per_channel', 'int8_per_channel_weight_only', 'mxfp8'),
     ('fbgemm_fp8', 'fp_quant')),
    ((0, 26, 0), ('awq', 'auto_awq', 'fp8', 'fbgemm_fp8', 'fp_quant', 'modelopt', 'modelopt_fp4', 'modelopt_mxfp8', 'modelopt_mixed', 'auto_gptq', 'gptq', 'gptq_marlin', 'awq_marlin', 'humming', 'compressed-tensors', 'bitsandbytes', 'experts_int8', 'quark', 'moe_wna16', 'torchao', 'inc', 'mxfp4', 'gpt_oss_mxfp4', 'deepseek_v4_fp8', 'online', 'fp8_per_tensor', 'fp8_per_block', 'fp8_per_channel', 'int8_per_channel_weight_only', 'nvfp4_per_token', 'mxfp8'),
     ('fbgemm_fp8', 'fp_quant')),
    ((0, 28, 0), ('awq', 'auto_awq', 'fp8', 'fbgemm_fp8', 'fp_quant', 'modelopt', 'modelopt_fp4', 'modelopt_mxfp8', 'modelopt_mixed', 'auto_gptq', 'gptq', 'gptq_marlin', 'awq_marlin', 'humming', 'compressed-tensors', 'experts_int8', 'quark', 'moe_wna16', 'torchao', 'inc', 'mxfp4', 'gpt_oss_mxfp4', 'deepseek_v4_fp8', 'online', 'fp8_per_tensor', 'fp8_per_block', 'fp8_per_channel', 'int8_per_channel_weight_only', 'nvfp4_per_token', 'mxfp8'),
     ('fbgemm_fp8', 'fp_quant')),
    # 0.34 (vllm/model_executor/layers/quantization/__init__.py): + w4afp8, lut_b_moe, mxfp4_hadamard32; fp_quant gone
    ((0, 34, 0), ('awq', 'auto_awq', 'fp8', 'w4afp8', 'fbgemm_fp8', 'modelopt', 'modelopt_fp4', 'modelopt_mxfp8', 'modelopt_mixed', 'auto_gptq', 'gptq', 'gptq_marlin', 'awq_marlin', 'humming', 'compressed-tensors', 'experts_int8', 'quark', 'moe_wna16', 'torchao', 'inc', 'mxfp4', 'gpt_oss_mxfp4', 'deepseek_v4_fp8', 'online', 'fp8_per_tensor', 'fp8_per_block', 'fp8_per_channel', 'int8_per_channel_weight_only', 'nvfp4_per_token', 'mxfp8', 'lut_b_moe', 'mxfp4_hadamard32'),
     ('fbgemm_fp8',)),
)


#: Every name any release accepts (what a drop's field accepts before its release is checked).
ALL_KV_CACHE_DTYPES = tuple(dict.fromkeys(n for _, names in KV_CACHE_DTYPES_BY_RELEASE for n in names))
ALL_QUANTIZATION_METHODS = tuple(dict.fromkeys(n for _, names, _d in QUANTIZATION_METHODS_BY_RELEASE for n in names))


def _key(version: Any) -> tuple[int, int, int]:
    key = getattr(version, "key", None)
    if key is not None:
        return tuple(key)
    if isinstance(version, str):
        from tuner.eras import parse_version

        return parse_version(version).key
    return tuple(version)[:3] + (0,) * (3 - len(tuple(version)[:3]))  # type: ignore[return-value]


def _at(table, version: Any):
    key = _key(version)
    chosen = table[0]
    for row in table:
        if row[0] <= key:
            chosen = row
    return chosen


def kv_cache_dtypes(version: Any) -> tuple[str, ...]:
    """The ``--kv-cache-dtype`` names ``version`` (a ``VllmVersion``, tuple or string) accepts."""
    return _at(KV_CACHE_DTYPES_BY_RELEASE, version)[1]


def quantization_methods(version: Any) -> tuple[str, ...]:
    """The ``--quantization`` names ``version`` accepts (its ``QuantizationMethods``)."""
    return _at(QUANTIZATION_METHODS_BY_RELEASE, version)[1]


def deprecated_quantization_methods(version: Any) -> tuple[str, ...]:
    """``DEPRECATED_QUANTIZATION_METHODS`` of ``version`` (0.14+; empty before)."""
    return _at(QUANTIZATION_METHODS_BY_RELEASE, version)[2]


def first_release_accepting(table_name: str, name: str) -> tuple[int, int, int] | None:
    """The first read release whose ``kv_cache_dtype`` or ``quantization`` table has ``name``."""
    table = KV_CACHE_DTYPES_BY_RELEASE if table_name == "kv_cache_dtype" else QUANTIZATION_METHODS_BY_RELEASE
    for row in table:
        if name in row[1]:
            return row[0]
    return None

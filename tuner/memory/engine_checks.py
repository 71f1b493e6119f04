"""Settings vLLM refuses at start-up, checked before any profile pass (worker side, pure Python).

vLLM validates a configuration before it loads anything; a drop it would refuse must not get a
proposal. These functions mirror those checks once the model config and the era's defaults are
known, and raise :class:`~tuner.errors.DropError` with vLLM's own wording, the drop file and the
drop key at fault (``where`` = ``DROP:FIELD``):

- :func:`check_parallel_layout` — ``ModelConfig.verify_with_parallel_config`` (attention heads
  divisible by ``tensor_parallel_size``), ``QKVParallelLinear`` (KV heads split evenly or
  replicated evenly) and ``get_pp_indices`` (every pipeline stage needs a decoder layer);
- :func:`check_batch` — ``SchedulerConfig.verify_max_model_len`` (``max_num_batched_tokens`` ≥
  ``max_num_seqs``; ≥ ``max_model_len`` when chunked prefill is off);
- :func:`check_quantization` — ``ModelConfig._verify_quantization`` (a method name the release
  knows, the checkpoint's own method not contradicted) and ``get_quant_config`` (methods that
  need a quantized checkpoint); a checkpoint whose own ``quant_method`` the release does not
  know is refused the same way;
- :func:`check_draft_vocab` — ``SpeculativeConfig.verify_equal_vocab_size_if_draft_model`` (0.15+);
- :func:`check_chunked_mm_input` — ``compute_mm_encoder_budget`` (vllm/v1/core/encoder_cache_manager.py,
  0.8.4+): with chunked multimodal input off (``--disable-chunked-mm-input``, or forced by
  ``platforms/cuda.py`` for models with multimodal-bidirectional attention, 0.13+) the largest
  multimodal item must fit ``max_num_batched_tokens``;
- :func:`check_architecture` — ``ModelRegistry`` (``vllm/model_executor/models/registry.py``): an
  architecture absent from the release's registry (:mod:`tuner.releases.facts`, read from each
  wheel) is refused with the release's own message;
- :func:`world_size_refusal` — ``ParallelConfig.__post_init__`` (a world size above the GPUs the node
  shows: a pod's GPU limit, ``CUDA_VISIBLE_DEVICES``; :func:`visible_gpu_count`).

No torch, no I/O.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from tuner.releases import facts as _release_facts
from tuner.errors import DropError, ModelConfigError

# ---------------------------------------------------------------------------------------------
# Parallel layout
# ---------------------------------------------------------------------------------------------


def check_parallel_layout(*, num_attention_heads: int, num_hidden_layers: int, kv_heads: Iterable[int],
                          tensor_parallel_size: int, pipeline_parallel_size: int, path: str | None) -> None:
    """Refuse the TP/PP layouts vLLM refuses.

    Args:
        num_attention_heads, num_hidden_layers: the text config's (``ModelSpec``).
        kv_heads: the distinct total KV-head counts of the model's per-head attention layers (empty
            for models whose cache has no per-head KV: MLA latents, Mamba state); the KV rule is
            skipped for those.
        path: the drop file (for the error).

    Raises:
        DropError: ``field`` ``tensor_parallel_size`` or ``pipeline_parallel_size``.
    """
    tp, pp = int(tensor_parallel_size), int(pipeline_parallel_size)
    if num_attention_heads % tp:  # vllm/config/model.py verify_with_parallel_config
        raise DropError(f"Total number of attention heads ({num_attention_heads}) must be divisible by tensor "
                        f"parallel size ({tp}).", path=path, field="tensor_parallel_size")
    for kv in sorted(set(kv_heads)):  # QKVParallelLinear: divide(kv, tp) or divide(tp, kv)
        if kv >= tp and kv % tp:
            raise DropError(f"Total number of KV heads ({kv}) must be divisible by tensor parallel size ({tp}) "
                            f"(vLLM's QKVParallelLinear asserts '{kv} is not divisible by {tp}').",
                            path=path, field="tensor_parallel_size")
        if kv < tp and tp % kv:
            raise DropError(f"Tensor parallel size ({tp}) must be a multiple of the number of KV heads ({kv}) to "
                            f"replicate them (vLLM's QKVParallelLinear asserts '{tp} is not divisible by {kv}').",
                            path=path, field="tensor_parallel_size")
    if pp > num_hidden_layers:  # vllm/distributed/utils.py get_pp_indices
        raise DropError(f"pipeline_parallel_size ({pp}) is larger than num_hidden_layers ({num_hidden_layers}): "
                        f"vLLM's get_pp_indices would leave {pp - num_hidden_layers} pipeline stage(s) without a "
                        "decoder layer.", path=path, field="pipeline_parallel_size")


def check_draft_tensor_parallel_size(speculative_config: dict | None, *, tensor_parallel_size: int, engine: str,
                                     path: str | None) -> None:
    """Refuse the drafter TP sizes vLLM refuses (read in 0.19.0 and 0.32.0):
    ``speculative_config.draft_tensor_parallel_size`` other than 1 or the target's
    (vllm/config/speculative.py ``_verify_and_get_draft_tp``), and for ``draft_model`` on V1 any
    draft TP other than the target's (vllm/v1/spec_decode/draft_model.py
    ``_raise_if_draft_tp_mismatch``: the ranks would share one compile cache).

    Raises:
        DropError: ``field`` ``speculative_config.draft_tensor_parallel_size``.
    """
    sc = speculative_config or {}
    dtp = sc.get("draft_tensor_parallel_size")
    if dtp is None:
        return
    tp, dtp = int(tensor_parallel_size), int(dtp)
    field = "speculative_config.draft_tensor_parallel_size"
    if dtp not in (1, tp):
        raise DropError(f"speculative_draft_tensor_parallel_size={dtp} cannot be other value than 1 or target model "
                        f"tensor_parallel_size ({tp}) (vLLM's SpeculativeConfig).", path=path, field=field)
    if engine == "V1" and sc.get("method") == "draft_model" and dtp != tp:
        raise DropError(f"Currently, 'draft_tensor_parallel_size' and 'tensor_parallel_size' must be the same. Got "
                        f"{dtp} and {tp} (vLLM's draft_model proposer).", path=path, field=field)


#: First release that refuses a ``draft_model`` drafter whose vocabulary differs from the target's
#: (vllm/config/speculative.py ``verify_equal_vocab_size_if_draft_model``: absent from 0.14.0, present
#: from 0.15.0 to 0.34.0; 0.34 asks ``speculator_config.draft_has_own_vocab``, true only for
#: ``draft_model``'s ``StandaloneARSpeculatorConfig``).
DRAFT_VOCAB_CHECK_FROM = (0, 15, 0)


def _vocab_size(config: dict) -> int | None:
    """``ModelConfig.get_vocab_size``: the text config's ``vocab_size`` (a multimodal wrapper's
    ``text_config``)."""
    cfg = config or {}
    for c in (cfg.get("text_config") or {}, cfg):
        v = c.get("vocab_size") if isinstance(c, dict) else None
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def check_draft_vocab(speculative_config: dict | None, *, draft_config: dict | None, target_config: dict | None,
                      version: Any, path: str | None) -> None:
    """A ``draft_model`` drafter with another vocabulary than the target's is refused while
    ``SpeculativeConfig`` is built (before any memory is touched), from 0.15.0.

    Raises:
        DropError: vLLM's message, ``field`` ``speculative_config.model``.
    """
    sc = speculative_config or {}
    if sc.get("method") != "draft_model" or _key(version) < DRAFT_VOCAB_CHECK_FROM:
        return
    target, draft = _vocab_size(target_config), _vocab_size(draft_config)
    if target is None or draft is None or target == draft:
        return
    raise DropError(f"Target and draft model should have the same vocabulary size. Target model vocab_size={target}. "
                    f"Draft model vocab_size={draft}. Using models with different tokenizers can cause out-of-bounds "
                    f"errors during speculative decoding. (vLLM {_release(version)}'s SpeculativeConfig, from 0.15)",
                    path=path, field="speculative_config.model")


# ---------------------------------------------------------------------------------------------
# Scheduler limits
# ---------------------------------------------------------------------------------------------


def check_batch(*, engine: str, max_num_batched_tokens: int, max_num_seqs: int, chunked_prefill: bool,
                user_max_num_batched_tokens: int | None, user_max_num_seqs: int | None, path: str | None) -> None:
    """``max_num_batched_tokens`` (N) ≥ ``max_num_seqs`` (S), after the era's defaults.

    ``max_num_batched_tokens`` / ``max_num_seqs`` are the batch the era sizes
    (:func:`tuner.memory.eras.profile_batch`); ``user_*`` what the drop set. S is the engine's: the
    drop's, else V0's fixed default (256); V1 clamps a defaulted S to N, so only a drop-set S can
    exceed N there. Checked only where N does not depend on ``max_model_len`` (the drop sets N, or
    V1 with chunked prefill), so one verdict holds for every candidate.

    Raises:
        DropError: vLLM's ``SchedulerConfig`` message; ``field`` ``max_num_batched_tokens`` when
            the drop sets it, else ``max_num_seqs``.
    """
    if user_max_num_batched_tokens is None and not (engine == "V1" and chunked_prefill):
        return
    s = user_max_num_seqs if user_max_num_seqs is not None else (max_num_seqs if engine == "V0" else None)
    if s is not None and max_num_batched_tokens < s:
        field = "max_num_batched_tokens" if user_max_num_batched_tokens is not None else "max_num_seqs"
        raise DropError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be greater than or equal to "
                        f"max_num_seqs ({s}).", path=path, field=field)


def check_unchunked_lengths(*, max_num_batched_tokens: int, max_model_lens: Iterable[int], path: str | None) -> None:
    """With chunked prefill off, every ``max_model_len`` asked for must fit one batch.

    Raises:
        DropError: vLLM's ``SchedulerConfig`` message for the largest offending length, ``field``
            ``max_num_batched_tokens``.
    """
    too_long = [m for m in max_model_lens if m > max_num_batched_tokens]
    if too_long:
        m = max(too_long)
        raise DropError(f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than max_model_len ({m}). "
                        "This effectively limits the maximum sequence length to max_num_batched_tokens and makes "
                        "vLLM reject longer sequences. Please increase max_num_batched_tokens or decrease "
                        "max_model_len.", path=path, field="max_num_batched_tokens")


#: First release whose V1 ``compute_encoder_budget`` (vllm/v1/core/encoder_cache_manager.py) refuses
#: a multimodal item larger than ``max_num_batched_tokens`` when chunked multimodal input is off
#: (the ``--disable-chunked-mm-input`` flag and the check: absent from 0.8.3, present from 0.8.4 to
#: 0.34.0, the message identical in every release; ``compute_mm_encoder_budget`` from 0.10.2).
CHUNKED_MM_INPUT_CHECK_FROM = (0, 8, 4)

#: vLLM's ``MM_PREFIX_LM_MODELS`` by release (``model_type`` of the models with multimodal-
#: bidirectional attention: ``ModelConfig.is_mm_prefix_lm``, vllm/config/model.py 0.13–0.19,
#: vllm/transformers_utils/model_arch_config_convertor.py 0.20+), for which
#: vllm/platforms/cuda.py ``check_and_update_config`` (0.13.0+) forces
#: ``disable_chunked_mm_input`` ("Forcing --disable_chunked_mm_input for models with
#: multimodal-bidirectional attention."). Read from each release's source: 0.13 comments
#: ``paligemma`` out (0.14 has it); ``molmo2`` from 0.15, ``bagel`` from 0.18, ``umm`` from 0.20
#: (read in 0.20.1: the unpacked 0.20.0 tree lacks the file), ``moondream3`` from 0.21, ``umm`` gone
#: in 0.29. Absent before 0.13 (only the TPU platform forced it there).
MM_PREFIX_LM_MODEL_TYPES = (
    ((0, 13, 0), ("gemma3",)),
    ((0, 14, 0), ("gemma3", "paligemma")),
    ((0, 15, 0), ("gemma3", "molmo2", "paligemma")),
    ((0, 18, 0), ("bagel", "gemma3", "molmo2", "paligemma")),
    ((0, 20, 0), ("bagel", "gemma3", "molmo2", "paligemma", "umm")),
    ((0, 21, 0), ("bagel", "gemma3", "molmo2", "moondream3", "paligemma", "umm")),
    ((0, 29, 0), ("bagel", "gemma3", "molmo2", "moondream3", "paligemma")),
)


def mm_prefix_lm_forces_unchunked(model_type: str | None, version: Any) -> bool:
    """Whether vLLM ``version`` on CUDA forces ``disable_chunked_mm_input`` for a multimodal model
    of ``model_type`` (:data:`MM_PREFIX_LM_MODEL_TYPES`)."""
    key, types = _key(version), ()
    for since, names in MM_PREFIX_LM_MODEL_TYPES:
        if key >= since:
            types = names
    return bool(model_type) and model_type in types


def check_chunked_mm_input(*, max_tokens_per_item: int | None, max_num_batched_tokens: int,
                           disable_chunked_mm_input: bool, model_type: str | None, engine: str, version: Any,
                           user_max_num_batched_tokens: int | None, path: str | None) -> None:
    """The V1 encoder budget's refusal (vllm/v1/core/encoder_cache_manager.py
    ``compute_mm_encoder_budget``, ``_compute_encoder_budget_multimodal`` before 0.10.2): with chunked
    multimodal input off, the largest item of any enabled modality must fit one batch.

    Args:
        max_tokens_per_item: the largest dummy item's tokens of the model's simulated tower (vLLM's
            ``get_mm_max_tokens_per_item``, reported by the profile pass); 0 / None when no tower
            is profiled (text-only, every modality limited to 0, a tower whose encoder pass is not
            simulated) — vLLM's budget is then (0, 0), nothing to refuse.
        disable_chunked_mm_input: the drop's ``--disable-chunked-mm-input``; a model of an
            ``MM_PREFIX_LM_MODEL_TYPES`` type has it forced on from 0.13
            (:func:`mm_prefix_lm_forces_unchunked`).

    Raises:
        DropError: vLLM's message, ``field`` ``max_num_batched_tokens`` when the drop sets it or the
            flag is forced, else ``disable_chunked_mm_input``.
    """
    t, n = int(max_tokens_per_item or 0), int(max_num_batched_tokens)
    if engine != "V1" or t <= n or _key(version) < CHUNKED_MM_INPUT_CHECK_FROM:
        return
    forced = not disable_chunked_mm_input and mm_prefix_lm_forces_unchunked(model_type, version)
    if not (disable_chunked_mm_input or forced):
        return
    why = (f"forced by vLLM {_release(version)} on CUDA for model_type {model_type!r}: 'Forcing "
           "--disable_chunked_mm_input for models with multimodal-bidirectional attention.' (platforms/cuda.py, 0.13+)"
           if forced else "--disable-chunked-mm-input")
    field = "max_num_batched_tokens" if forced or user_max_num_batched_tokens is not None else "disable_chunked_mm_input"
    raise DropError(f"Chunked MM input disabled but max_tokens_per_mm_item ({t}) is larger than max_num_batched_tokens "
                    f"({n}). Please increase max_num_batched_tokens. ({why}; vLLM's compute_mm_encoder_budget, "
                    "v1/core/encoder_cache_manager.py, 0.8.4+)", path=path, field=field)


# ---------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------

#: vLLM 0.19.0's ``QUANTIZATION_METHODS`` (vllm/model_executor/layers/quantization/__init__.py,
#: ``QuantizationMethods``), in its order: what ``--quantization`` accepts in 0.19.x (generated
#: data, :mod:`tuner.releases.facts`).
VLLM_019_QUANTIZATION_METHODS = _release_facts.quantization_methods("0.19.0")
#: 0.19.0's ``DEPRECATED_QUANTIZATION_METHODS`` present in its list: refused unless the engine is
#: started with ``--allow-deprecated-quantization``.
VLLM_019_DEPRECATED = tuple(q for q in _release_facts.deprecated_quantization_methods("0.19.0")
                            if q in VLLM_019_QUANTIZATION_METHODS)
#: Methods that quantize a 16-bit checkpoint while loading it (their config class reads no
#: config file: ``get_config_filenames() == []`` and a usable default config). Every other method
#: needs a checkpoint quantized with it (vLLM: "Cannot find the config file for ...").
ONLINE_QUANTIZATION_METHODS = (
    "fp8", "fbgemm_fp8", "ptpc_fp8", "experts_int8", "bitsandbytes", "mxfp8", "fp_quant", "rtn", "deepspeedfp",
    "online", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only",
    "nvfp4_per_token",
)
#: Online methods whose weights :func:`tuner.memory.quant.scheme_for` models.
MODELLED_ONLINE_METHODS = ("fp8", "fbgemm_fp8", "ptpc_fp8", "experts_int8")
#: Overrides vLLM accepts for a checkpoint of another method (``override_quantization_method``:
#: the Marlin kernels and MoE-WNA16 for GPTQ/AWQ checkpoints).
_COMPATIBLE = {
    "gptq": ("gptq", "gptq_marlin", "moe_wna16"),
    "awq": ("awq", "awq_marlin", "moe_wna16"),
}


def quantization_methods(version: Any) -> tuple[str, ...]:
    """The ``--quantization`` names a release accepts: its own ``QuantizationMethods`` list
    (:func:`tuner.releases.names.quantization_methods`, read from each release's wheel)."""
    from tuner.releases.names import quantization_methods as by_release

    return by_release(version)


def check_quantization(override: str | None, quantization_config: dict | None, *, version: Any,
                       path: str | None) -> list[str]:
    """The drop's ``quantization`` against the release and the checkpoint.

    - a name the release does not know → vLLM's "Unknown quantization method" (the release's own
      list, :mod:`tuner.releases.names`);
    - a quantized checkpoint whose ``quant_method`` differs → vLLM's mismatch error, except the
      overrides vLLM converts (GPTQ/AWQ → their Marlin kernels or ``moe_wna16``) and ModelOpt /
      auto-round checkpoints (vLLM replaces the argument with the checkpoint's method);
    - a 16-bit checkpoint: a method that needs a quantized checkpoint → DropError; an online
      method ctx-tuner does not model (``bitsandbytes``, ``mxfp8``...) → ModelConfigError.

    Returns:
        Warnings (a method 0.19 deprecates).

    Raises:
        DropError: ``field`` ``quantization``.
        ModelConfigError: a valid online method whose weights are not modelled.
    """
    qc = quantization_config or {}
    ckpt = str(qc.get("quant_method") or qc.get("quantization_method") or "").lower()
    if override is None:
        _check_checkpoint_method(ckpt, version=version, path=path)
        return []
    q = str(override).lower()
    known = quantization_methods(version)
    if ckpt in ("auto-round", "autoround"):
        # vllm/config/model.py ``_verify_quantization`` (0.19–0.33) runs the checkpoint overrides
        # before the name check, and INCConfig.override_quantization_method returns "inc" for an
        # auto-round checkpoint whatever the argument says: any spelling (auto_round, auto-round,
        # inc) becomes "inc" before vLLM looks the name up.
        return []
    if q not in known:
        from tuner.releases.names import first_release_accepting

        first = first_release_accepting("quantization", q)
        hint = (f" (vLLM {_release(version)} does not know it; first accepted in {'.'.join(map(str, first))})"
                if first else "")
        raise DropError(f"Unknown quantization method: {q}. Must be one of {list(known)}.{hint}", path=path,
                        field="quantization")
    warnings = []
    if (0, 19, 0) <= _key(version) < (0, 20, 0) and q in VLLM_019_DEPRECATED:
        warnings.append(f"vLLM 0.19 deprecates quantization {q!r}: the engine refuses it unless started with "
                        "--allow-deprecated-quantization (added to the proposed arguments)")
    if ckpt:
        if ckpt.startswith("modelopt"):
            return warnings  # vLLM's override_quantization_method replaces the argument
        if q == ckpt or q in _COMPATIBLE.get(ckpt, ()):
            return warnings
        raise DropError(f"Quantization method specified in the model config ({ckpt}) does not match the "
                        f"quantization method specified in the `quantization` argument ({q}).",
                        path=path, field="quantization")
    if q not in ONLINE_QUANTIZATION_METHODS:
        raise DropError(f"quantization {q!r} needs a checkpoint quantized with it, but the model's config.json has "
                        f"no quantization_config (vLLM: Cannot find the config file for {q}); use a {q} checkpoint "
                        f"or an online method ({', '.join(MODELLED_ONLINE_METHODS)})", path=path,
                        field="quantization")
    if q not in MODELLED_ONLINE_METHODS:
        raise ModelConfigError(f"online quantization {q!r} of a 16-bit checkpoint is valid for vLLM but not modelled "
                               f"by ctx-tuner (modelled: {', '.join(MODELLED_ONLINE_METHODS)})",
                               where=f"{path}:quantization" if path else "quantization")
    return warnings


def _check_checkpoint_method(ckpt: str, *, version: Any, path: str | None) -> None:
    """A checkpoint's ``quant_method`` the release does not know: vLLM's ``_verify_quantization``
    takes the checkpoint's method as the quantization and refuses it with "Unknown quantization
    method". Only names some release accepts are checked (a checkpoint spelling vLLM maps first —
    auto-round → ``inc`` — or a name of no release is left to the weights model)."""
    from tuner.releases.names import ALL_QUANTIZATION_METHODS, first_release_accepting

    if not ckpt or ckpt in ("auto-round", "autoround", "auto_round") or ckpt not in ALL_QUANTIZATION_METHODS:
        return
    known = quantization_methods(version)
    if ckpt in known:
        return
    first = first_release_accepting("quantization", ckpt)
    later = f"; first accepted in {'.'.join(map(str, first))}" if first and first > _key(version) else ""
    raise DropError(f"Unknown quantization method: {ckpt}. Must be one of {list(known)}. (the checkpoint's "
                    f"quant_method; vLLM {_release(version)} does not know it{later})", path=path,
                    field="quantization")


def check_architecture(architectures: Iterable[str], *, version: Any, path: str | None) -> None:
    """The model's ``architectures`` against the release's model registry (generated from the
    wheels, :func:`tuner.releases.facts.architectures`): vLLM loads a config when its registry has
    any of them, and otherwise raises ``ModelRegistry._raise_for_unsupported``'s error. Checked
    only for names another release registers (added later, or removed): a name no release
    registers is remote code or the Transformers backend, left to the plugin.

    Raises:
        DropError: ``field`` ``engine_version``: the release's message, the release where the
            architecture first appears (or the last that had it).
    """
    from tuner.releases import facts as rf

    archs = [str(a) for a in architectures or () if a]
    known = rf.architectures(version)
    if not archs or not known or any(a in known for a in archs):
        return
    having = frozenset().union(*(rf.with_architecture(a) for a in archs))
    if not having:
        # no release registers it: remote code or vLLM's Transformers backend, which the plugin
        # (generic decoder) answers for; only a name other releases register proves a refusal
        return
    release = _release(version)
    if rf.release_key(rf.first_release(having)) > _key(version):
        hint = f"registered from vLLM {rf.first_release(having)}"
    else:
        hint = f"last registered in vLLM {rf.newest(having)}"
    raise DropError(f"vLLM {release} refuses the model: {rf.architecture_error(version, archs)} ({hint})",
                    path=path, field="engine_version")


def _key(version: Any) -> tuple[int, int, int]:
    from tuner.releases.names import _key as key

    return key(version)


def _release(version: Any) -> str:
    return ".".join(map(str, _key(version)))


#: ``kv_cache_dtype`` names vLLM accepts whose cache layout ctx-tuner does not model: the
#: TurboQuant / Octave / UltraQuant caches (their backends' own packed slots, 0.20+ / 0.32+ /
#: 0.33) and the NVFP4 DeepSeek MLA cache (0.30+).
UNMODELLED_KV_CACHE_DTYPE_PREFIXES = ("turboquant_", "octave_", "ultraquant_", "nvfp4_ds_mla")


#: Compute-capability families FlashInfer runs an nvfp4 KV cache on, by release (non-MLA attention;
#: vllm/v1/attention/backends/flashinfer.py ``supports_kv_cache_dtype``): 0.20 lists no nvfp4 (its
#: builder raises "nvfp4 KV cache is not yet supported"); 0.21–0.22 list it with no capability check;
#: 0.23–0.31 only family 100 (SM100 trtllm-gen); 0.32+ also 8.x, 9.x and 12.x through FA2
#: (``_nvfp4_kv_on_fa2``, plain ``nvfp4`` only).
NVFP4_KV_SM100_ONLY = ((0, 23, 0), (0, 32, 0))
NVFP4_KV_FA2_SINCE = (0, 32, 0)


def nvfp4_kv_cache_check(kv_cache_dtype: str, *, version: Any, compute_capability: str | None,
                         mla: bool = False, path: str | None = None) -> str | None:
    """vLLM's attention-backend selection for an ``nvfp4*`` KV cache on the card (non-MLA models;
    :data:`NVFP4_KV_SM100_ONLY`). Returns a note where vLLM accepts it without checking the card
    (0.21–0.22), else None.

    Raises:
        DropError: no backend of the release runs it on this card (vLLM: "No valid attention backend
            found …", kv_cache_dtype not supported), ``field`` ``kv_cache_dtype``.
    """
    kv = str(kv_cache_dtype or "").lower()
    if not kv.startswith("nvfp4") or mla or not compute_capability:
        return None
    v = tuple(version) if not hasattr(version, "major") else (version.major, version.minor, version.patch)
    major = int(str(compute_capability).split(".")[0])
    where = "vllm/v1/attention/backends/flashinfer.py supports_kv_cache_dtype"
    refused = None
    if v < (0, 21, 0):
        refused = f"no attention backend of vLLM {_release(version)} lists it (FlashInfer: \"nvfp4 KV cache is not yet supported\")"
    elif NVFP4_KV_SM100_ONLY[0] <= v < NVFP4_KV_SM100_ONLY[1] and major != 10:
        refused = (f"vLLM {_release(version)}'s FlashInfer runs it only on compute capability 10.x (SM100 trtllm-gen), "
                   f"not {compute_capability} ({where}; 8.x, 9.x and 12.x from 0.32 through FA2)")
    elif v >= NVFP4_KV_FA2_SINCE and major != 10 and (major not in (8, 9, 12) or kv != "nvfp4"):
        refused = (f"vLLM {_release(version)}'s FlashInfer runs {kv!r} on compute capability 10.x, and plain 'nvfp4' on "
                   f"8.x, 9.x and 12.x through FA2, not on {compute_capability} ({where})")
    if refused:
        raise DropError(f"No valid attention backend found for kv_cache_dtype {kv!r} on compute capability "
                        f"{compute_capability}: {refused}", path=path, field="kv_cache_dtype")
    if v < NVFP4_KV_SM100_ONLY[0] and major != 10:
        return (f"kv_cache_dtype {kv}: vLLM {_release(version)}'s FlashInfer accepts it with no check of the card "
                f"({where} from 0.23 refuses it below compute capability 10.x); start-up memory is modelled, its "
                "kernels are SM100's")
    return None


def check_kv_cache_dtype(kv_cache_dtype: str | None, *, version: Any, path: str | None) -> None:
    """The drop's ``kv_cache_dtype`` against the release's ``CacheDType`` names
    (:func:`tuner.releases.names.kv_cache_dtypes`).

    Raises:
        DropError: a name the release does not accept (vLLM's argparse "invalid choice"), ``field``
            ``kv_cache_dtype``.
        ModelConfigError: a name the release accepts whose layout is not modelled
            (:data:`UNMODELLED_KV_CACHE_DTYPE_PREFIXES`).
    """
    from tuner.releases.names import first_release_accepting, kv_cache_dtypes

    kv = str(kv_cache_dtype or "auto").lower()
    known = kv_cache_dtypes(version)
    if kv not in known:
        first = first_release_accepting("kv_cache_dtype", kv)
        hint = f"; first accepted in vLLM {'.'.join(map(str, first))}" if first else ""
        raise DropError(f"argument --kv-cache-dtype: invalid choice: {kv!r} for vLLM {_release(version)} (choose from "
                        f"{', '.join(repr(k) for k in known)}){hint}", path=path, field="kv_cache_dtype")
    if kv.startswith(UNMODELLED_KV_CACHE_DTYPE_PREFIXES):
        raise ModelConfigError(f"kv_cache_dtype {kv!r} is valid for vLLM {_release(version)} but its cache layout is "
                               "not modelled by ctx-tuner", where=f"{path}:kv_cache_dtype" if path else "kv_cache_dtype")


# ---------------------------------------------------------------------------------------------
# GPUs visible to the engine
# ---------------------------------------------------------------------------------------------

#: The first release whose ``ParallelConfig.__post_init__`` (vllm/config/parallel.py) refuses a
#: world size above the GPUs it sees ("World size (N) is larger than the number of available GPUs
#: (G) in this node", read in 0.13.0, 0.26.0, 0.34.0); 0.10–0.12 switch to the Ray backend there
#: (``cuda_device_count_stateless() < self.world_size``) and refuse without Ray ("Unable to load Ray").
WORLD_SIZE_REFUSAL_FROM = (0, 13, 0)
_CUDA_DEVICE = re.compile(r"^(\d+|GPU-[0-9A-Za-z-]+|MIG-[0-9A-Za-z/-]+)$")


def visible_gpu_count(cuda_visible_devices: str) -> int:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` leaves visible, as the CUDA runtime reads it (and so
    torch's ``cuda.device_count``, which vLLM's ``device_count`` asks): comma-separated indices or
    ``GPU-``/``MIG-`` UUIDs, read up to the first entry that is not one (``-1`` hides the rest);
    ``""`` = none."""
    n = 0
    for item in str(cuda_visible_devices).split(","):
        if not _CUDA_DEVICE.match(item.strip()):
            break
        n += 1
    return n


def spans_nodes(ignored: Iterable[dict]) -> bool:
    """The engine spans nodes (``--distributed-executor-backend ray`` or ``--nnodes`` > 1 among a
    check's ignored flags): this node's GPU count does not bound the world size."""
    for e in ignored:
        if e.get("flag") == "--distributed-executor-backend" and str(e.get("value")) == "ray":
            return True
        if e.get("flag") == "--nnodes" and str(e.get("value") or "1") not in ("1", "None"):
            return True
    return False


def world_size_refusal(world: int, gpus: int, *, version: tuple) -> str | None:
    """vLLM's refusal when the node shows fewer GPUs than the world size (tensor × pipeline
    parallel), None when it shows enough (:data:`WORLD_SIZE_REFUSAL_FROM` for the wording)."""
    if world <= gpus:
        return None
    if gpus <= 0:
        return ("No CUDA GPU is visible (CUDA_VISIBLE_DEVICES hides every GPU): vLLM cannot start on a GPU "
                "(its platform detection finds no CUDA device)")
    if tuple(version) >= WORLD_SIZE_REFUSAL_FROM:
        return (f"World size ({world}) is larger than the number of available GPUs ({gpus}) in this node. If this is "
                "intentional and you are using:\n- ray, set '--distributed-executor-backend ray'.\n"
                "- multiprocessing, set '--nnodes' appropriately.")
    return (f"World size ({world}) needs more GPUs than the {gpus} visible: vLLM {'.'.join(map(str, version))} then "
            "picks the Ray backend (vllm/config/parallel.py: cuda_device_count_stateless() < world_size) and refuses "
            "without Ray (\"Unable to load Ray ... Ray is required for multi-node inference\"); with Ray it waits for "
            "GPUs this node does not have")

"""The plugin kit: everything a model plugin needs, from one module (``from tuner.model.kit import ...``).

A model plugin tells ctx-tuner what one rank of a model family holds in memory: its KV cache
(per-layer KV specs) and a memory-equivalent ``torch.nn.Module`` that the profile pass runs. The
contract, the helpers and the building blocks below are the same ones the built-in plugins in
``plugins/`` use; docs/plugins.md "Write a plugin" has a complete example, installed and run end to end by
``tests/test_thirdparty_plugin.py``.

The contract (:mod:`tuner.model.plugin`)
    :class:`ModelPlugin` — subclass it, set ``name`` (unique; ``generic`` is the fallback plugin's
    name) and ``architectures`` (the HF ``architectures`` names it serves), implement
    ``kv_cache_spec(spec, settings) -> dict[str, KVCacheSpec]`` and
    ``build_model(spec, settings) -> torch.nn.Module``; override ``weights_bytes(spec, settings,
    module)`` (default: every parameter and buffer of the module, each storage once,
    :func:`module_weights_bytes`) and ``config_defaults(top)`` (family defaults for keys a partial
    ``config.json`` lacks) when they differ. ``spec`` is a :class:`ModelSpec` (its attributes are
    documented on the class), ``settings`` a :class:`RankSettings` (one rank's engine settings).
    :func:`validate_plugin` is the check every plugin passes when it loads; :func:`load_registry`
    loads the ``tuner.plugins`` entry-point group (:data:`ENTRY_POINT_GROUP`).

Registration
    A distribution registers a module-level plugin *instance* in the entry-point group
    ``tuner.plugins``: ``[project.entry-points."tuner.plugins"] myfamily = "mypkg.myfamily:plugin"``.
    The plugin is chosen by the config's ``architectures``; a plugin that fails to import or to
    validate is reported (:class:`PluginError`) and skipped, never fatal. The module docstring is
    the plugin's user documentation (say what it models per rank and which vLLM source it follows);
    the class needs a docstring too.

Conventions every plugin follows
    1. **No torch at import time.** Plugin modules are imported wherever the registry loads, so
       the module level imports only the torch-free names of this kit (the contract, the KV spec
       classes, the helpers); ``build_model`` imports the torch-side names (layer blocks, decoder
       builder, quantization) inside the method. This module resolves those lazily, so
       ``import tuner.model.kit`` itself never imports torch.
    2. **vLLM's module names.** KV spec keys are vLLM's attention-layer names
       (``model.layers.<i>.self_attn.attn``), and every ``Linear`` / block gets ``prefix=`` its
       vLLM module path (``model.layers.<i>.mlp.down_proj``): quantization schemes keep the
       checkpoint's ignored layers in 16 bit by matching those names, and the KV manager groups
       layers by them.
    3. **One rank's share.** Build and specify only what the rank holds: attention heads and the
       MLP width divided by ``settings.tensor_parallel_size``, KV heads
       :func:`kv_heads_per_rank` (``max(1, kv // tp)``: replicated below tp), the pipeline stage's
       layers :func:`stage_layers`, the embedding on the first stage (and on the last when tied),
       the final norm and LM head on the last. :func:`build_decoder` applies these rules.
    4. **The drop's dtypes, not the checkpoint's.** Weights are built in
       ``torch_dtype(settings.dtype)`` (the resolved ``dtype``; ``spec.torch_dtype`` is only what
       the checkpoint ships), KV bytes per element are
       ``dtype_bytes_for(settings.kv_cache_dtype, settings.dtype)``, the block size is
       ``settings.block_size or 16`` unless the family's attention backend fixes another; the
       checkpoint's quantization comes from ``scheme_for(spec, settings)`` and is handed to every
       layer as ``quant=``.
    5. **Family keys from the config, with vLLM's defaults.** Keys beyond the standard sizes are
       read from ``spec.raw`` (the text config) or ``spec.top`` (the whole file, e.g. a vision
       config), with the default vLLM's model class uses when absent
       (``int(spec.raw.get("num_local_experts") or 8)``); defaults for standard keys a partial
       config lacks go through ``config_defaults`` (the file wins, each default used is reported).
       Never a per-model or per-checkpoint lookup. A config the family cannot serve raises
       :class:`ModelConfigError` / :class:`PluginError` with ``where=spec.path``.

Building blocks (torch, :mod:`tuner.model.simulate`)
    :func:`build_decoder` (a pre-norm decoder of one rank and stage whose per-layer MLP the plugin
    supplies), :func:`torch_dtype`; layer blocks :class:`Linear`, :class:`RMSNorm`,
    :class:`RotaryEmbedding`, :class:`Attention`, :class:`GatedMLP`, :class:`PlainMLP`,
    :class:`DecoderLayer`, :class:`VocabEmbedding`, :class:`LMHead`, :class:`CausalLM`,
    :func:`pad_vocab`; mixture of experts :class:`FusedMoE`, :class:`SparseMoeBlock`,
    :class:`Fp32Router`; MLA :class:`MLAAttention`, :class:`DeepseekMoE`, :class:`Indexer`;
    state-space :class:`Mamba2Mixer`, :class:`GatedDeltaNet`, :class:`GatedOutputAttention`;
    multimodal :class:`VisionTower` (a built-in tower by ``kind`` name, or a tower module of the
    plugin's own: :mod:`tuner.model.simulate.towers` describes one), :class:`MultimodalCausalLM`; quantization
    :func:`scheme_for`, :class:`QuantScheme`. Each module allocates what vLLM's own layer
    allocates during the profile run (see :mod:`tuner.model.simulate.layers`).

KV specs (:mod:`tuner.memory.kvcache`, torch-free)
    :class:`FullAttentionSpec`, :class:`SlidingWindowSpec`, :class:`ChunkedLocalAttentionSpec`,
    :class:`MLAAttentionSpec` (build it with :func:`mla_spec`), :class:`SlidingWindowMLASpec`,
    :class:`MambaSpec`, :class:`HiddenStateSpec`; helpers :func:`dtype_bytes_for`,
    :func:`kv_heads_per_rank`, :func:`layers_per_pp_rank`, :func:`cdiv`; and
    :func:`decoder_kv_specs`, the standard decoder's KV specs (one full-attention spec per layer,
    or a sliding-window spec when the config slides every layer).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from tuner.errors import ModelConfigError, PluginError
from tuner.memory.kvcache import (ChunkedLocalAttentionSpec, FullAttentionSpec, HiddenStateSpec, MambaSpec, MLAAttentionSpec,
                           SlidingWindowMLASpec, SlidingWindowSpec, cdiv, dtype_bytes_for, kv_heads_per_rank,
                           layers_per_pp_rank, mla_spec)
from tuner.model.modelspec import ModelSpec
from tuner.model.plugin import (ENTRY_POINT_GROUP, ModelPlugin, RankSettings, Registry, load_registry, module_weights_bytes,
                          stage_layers, validate_plugin)

#: Names resolved on first use (PEP 562): torch-side building blocks, and the generic plugin's KV
#: helper (a plugin module; importing it here eagerly would tie the kit to the built-in plugins).
_LAZY = {
    "build_decoder": "tuner.model.simulate.decoder",
    "torch_dtype": "tuner.model.simulate.decoder",
    "Linear": "tuner.model.simulate.layers",
    "RMSNorm": "tuner.model.simulate.layers",
    "RotaryEmbedding": "tuner.model.simulate.layers",
    "Attention": "tuner.model.simulate.layers",
    "GatedMLP": "tuner.model.simulate.layers",
    "PlainMLP": "tuner.model.simulate.layers",
    "DecoderLayer": "tuner.model.simulate.layers",
    "VocabEmbedding": "tuner.model.simulate.layers",
    "LMHead": "tuner.model.simulate.layers",
    "CausalLM": "tuner.model.simulate.layers",
    "pad_vocab": "tuner.model.simulate.layers",
    "FusedMoE": "tuner.model.simulate.moe",
    "SparseMoeBlock": "tuner.model.simulate.moe",
    "Fp32Router": "tuner.model.simulate.moe",
    "MLAAttention": "tuner.model.simulate.mla",
    "DeepseekMoE": "tuner.model.simulate.mla",
    "Indexer": "tuner.model.simulate.mla",
    "Mamba2Mixer": "tuner.model.simulate.ssm",
    "GatedDeltaNet": "tuner.model.simulate.ssm",
    "GatedOutputAttention": "tuner.model.simulate.ssm",
    "VisionTower": "tuner.model.simulate.vision",
    "MultimodalCausalLM": "tuner.model.simulate.vision",
    "scheme_for": "tuner.memory.quant",
    "QuantScheme": "tuner.memory.quant",
    "decoder_kv_specs": "tuner.plugins.generic",
}

__all__ = [
    # contract and registration
    "ModelPlugin", "RankSettings", "ModelSpec", "ENTRY_POINT_GROUP", "Registry", "load_registry", "validate_plugin",
    "module_weights_bytes", "stage_layers", "PluginError", "ModelConfigError",
    # KV specs and helpers
    "FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec", "MLAAttentionSpec", "SlidingWindowMLASpec",
    "MambaSpec", "HiddenStateSpec", "mla_spec", "dtype_bytes_for", "kv_heads_per_rank", "layers_per_pp_rank", "cdiv",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tuner.model.kit' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

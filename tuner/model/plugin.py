"""The model-plugin contract and its registry (entry-point group ``tuner.plugins``).

A plugin is an object (usually a module-level instance of a :class:`ModelPlugin` subclass) that
declares the HF ``architectures`` it serves and provides:

- ``kv_cache_spec(spec, settings) -> dict[str, KVCacheSpec]``: per-layer KV specs of one rank
  (:mod:`tuner.memory.kvcache` classes), TP-aware and dtype-aware;
- ``build_model(spec, settings) -> torch.nn.Module``: a memory-equivalent module of one rank,
  built under whatever tensor mode the caller set (fake or real);
- ``weights_bytes(spec, settings, module) -> int``: bytes "Model loading took" on one rank.

Built-in plugins register through the same entry-point group third parties use. Loading never
fails as a whole: a broken plugin is reported (:class:`tuner.errors.PluginError`) and skipped.
This module imports no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Iterable

from tuner.errors import PluginError
from tuner.memory.kvcache import layers_per_pp_rank

ENTRY_POINT_GROUP = "tuner.plugins"
#: The distribution whose entry points are the built-in plugins.
BUILTIN_DISTRIBUTION = "ctx-tuner"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSettings:
    """Engine settings as one rank sees them (what a plugin builds for).

    Attributes:
        engine_version: vLLM release, e.g. ``"0.19.0"``.
        dtype: resolved model dtype name (``bfloat16``/``float16``/``float32``).
        kv_cache_dtype: ``auto`` or an fp8 variant.
        block_size: tokens per KV block, or ``None`` for the plugin's/era's default.
        tensor_parallel_size, pipeline_parallel_size, pp_rank: the parallel layout and this rank's stage.
        compiled: intermediates die at last use (V1 torch.compile) rather than at function return.
        runs_attention: the profile run executes attention (V0) rather than skipping it (V1).
        quantization: the drop's quantization override, or ``None`` for the checkpoint's.
        compute_capability: the GPU's ``"major.minor"`` (``"9.0"`` for H100), or ``None`` when
            unknown; backends and kernels (MLA block size, Marlin repacking) depend on it.
        max_num_batched_tokens, max_num_seqs, max_model_len: the engine's scheduler limits for
            the candidate being profiled (tokens / sequences), or ``None`` when not known.
        num_speculative_tokens: draft tokens per request of speculative decoding (0 = none); a
            Mamba / DeltaNet conv state keeps ``k − 1 + num_speculative_tokens`` columns.
        mamba_cache_mode: vLLM's ``cache_config.mamba_cache_mode`` for hybrid models (``"none"``,
            ``"align"`` with prefix caching; ``None`` = the release's default, ``"none"``).
        flashinfer_sampler: the dummy sampler runs FlashInfer (see the field).
    """

    engine_version: str
    dtype: str
    kv_cache_dtype: str = "auto"
    block_size: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_rank: int = 0
    compiled: bool = True
    runs_attention: bool = False
    quantization: str | None = None
    compute_capability: str | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    #: data-parallel ranks and expert parallelism (MoE layers only, :func:`tuner.memory.budget.moe_rank_shape`).
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    max_model_len: int | None = None
    num_speculative_tokens: int = 0
    mamba_cache_mode: str | None = None
    #: the V1 dummy sampler's top-k/top-p path, 0.8–0.16 (:func:`tuner.memory.eras.sampler_path`): True
    #: FlashInfer, False PyTorch's sort, None what a ``pip install`` of the release runs.
    flashinfer_sampler: bool | None = None
    #: the ``triton_kernels`` package beside a vLLM older than 0.12 (MXFP4 experts on Hopper run
    #: Triton with it, Marlin without: :func:`tuner.memory.quant.mxfp4_hopper_triton`); None =
    #: what ``pip install`` gets.
    triton_kernels_installed: bool | None = None
    #: ``--limit-mm-per-prompt`` as ``((modality, count), ...)`` (``("*", 0)``: ``--language-model-only``);
    #: None = none given (every modality 999). :func:`tuner.model.simulate.vision.mm_limit` reads it.
    mm_limits: tuple | None = None
    #: ``VLLM_PP_LAYER_PARTITION`` as layer counts per stage (None = vLLM's even split).
    pp_layer_partition: tuple[int, ...] | None = None
    #: vLLM's config format (``"hf"`` / ``"mistral"``, :func:`tuner.jobs.job.config_format`).
    config_format: str = "hf"
    #: vLLM's platform on this rank's card: ``"cuda"`` or ``"rocm"`` (:mod:`tuner.memory.platforms`); the
    #: attention backends, and with them an MLA model's block size, differ.
    platform: str = "cuda"


class ModelPlugin:
    """Base class for model plugins. Subclasses set ``name``/``architectures`` and override
    what differs; the three contract methods must be implemented."""

    name: str = ""
    architectures: tuple[str, ...] = ()

    def config_defaults(self, top: dict) -> dict:
        """Family defaults for text-config keys a partial ``config.json`` lacks (the file wins).

        ``top`` is the top-level config dict. The base class adds nothing.
        """
        return {}

    def kv_cache_spec(self, spec: Any, settings: RankSettings) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def build_model(self, spec: Any, settings: RankSettings):  # pragma: no cover - abstract
        raise NotImplementedError

    def weights_bytes(self, spec: Any, settings: RankSettings, module: Any) -> int:
        """Bytes "Model loading took" on one rank: by default every parameter and buffer of the
        rank's module, each storage once (vLLM measures the allocated-memory increase over
        ``load_model`` incl. ``process_weights_after_loading``, reference §2.4). Override when a
        checkpoint loads something the module does not hold."""
        return module_weights_bytes(module)


def stage_layers(spec: Any, settings: RankSettings, *, num_layers: int | None = None) -> range:
    """Global indices of the decoder layers this rank's pipeline stage holds.

    vLLM's ``get_pp_indices`` split (:func:`tuner.memory.kvcache.layers_per_pp_rank`): ``n // pp`` layers
    per stage, the remainder one each to stages −2, −3, … (never the last); stage
    ``settings.pp_rank`` of ``settings.pipeline_parallel_size`` gets the range after the stages
    before it. ``n`` is ``spec.num_hidden_layers`` unless ``num_layers`` is given (a family whose
    layer list is longer or shorter, e.g. ``hybrid_override_pattern``).
    """
    n = spec.num_hidden_layers if num_layers is None else num_layers
    counts = layers_per_pp_rank(n, settings.pipeline_parallel_size, getattr(settings, "pp_layer_partition", None))
    start = sum(counts[: settings.pp_rank])
    return range(start, start + counts[settings.pp_rank])


def module_weights_bytes(module: Any) -> int:
    """Bytes of every parameter and buffer of a torch module, each underlying storage counted once
    (tied and shared tensors once). Needs no torch import of its own."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = id(t.untyped_storage())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


_REQUIRED = ("kv_cache_spec", "build_model", "weights_bytes")


def validate_plugin(obj: Any, origin: str) -> Any:
    """Check an object against the contract.

    Raises:
        PluginError: naming ``origin`` (the entry point) and what is wrong.
    """
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name:
        raise PluginError("plugin has no 'name' string", where=origin)
    archs = getattr(obj, "architectures", None)
    if not isinstance(archs, (tuple, list)) or not archs or not all(isinstance(a, str) for a in archs):
        raise PluginError("'architectures' must be a non-empty tuple of HF architecture names", where=origin)
    for attr in _REQUIRED:
        if not callable(getattr(obj, attr, None)):
            raise PluginError(f"missing callable '{attr}'", where=origin)
    return obj


@dataclass
class Registry:
    """Loaded plugins plus the errors of those that failed to load."""

    plugins: list
    errors: list[PluginError]

    def for_architectures(self, architectures: Iterable[str]) -> tuple[Any, str | None]:
        """Pick the plugin for a config's ``architectures``.

        Returns:
            ``(plugin, warning)``: a specific plugin and ``None``, or the generic plugin and a
            warning that the architecture is served by the fallback.

        Raises:
            PluginError: no plugin serves the architecture and no generic plugin is installed.
        """
        archs = list(architectures)
        for a in archs:
            for p in self.plugins:
                if a in p.architectures and p.name != "generic":
                    return p, None
        for a in archs:
            for p in self.plugins:
                if a in p.architectures:
                    return p, None
        generic = next((p for p in self.plugins if p.name == "generic"), None)
        if generic is None:
            raise PluginError(f"no plugin serves {archs} and the generic plugin is not installed",
                              where=",".join(archs) or "?")
        return generic, f"no plugin declares {archs}; using the generic decoder plugin"

    def by_name(self, name: str) -> Any:
        for p in self.plugins:
            if p.name == name:
                return p
        raise PluginError("no such plugin", where=name)


def builtin_entry_points(group: str = ENTRY_POINT_GROUP) -> list:
    """The entry points of ``group`` that ctx-tuner's own distribution registers (the built-in
    plugins), without those of any installed third-party distribution; a
    :func:`load_registry` ``loader``."""
    return [ep for ep in entry_points(group=group)
            if ep.dist is not None and ep.dist.name == BUILTIN_DISTRIBUTION]


def _installed_key() -> tuple:
    """What the installed entry points depend on, cheaply: ``sys.path`` and each entry's mtime
    (installing or removing a distribution adds or removes a ``*.dist-info`` directory there)."""
    import os
    import sys

    key = []
    for entry in sys.path:
        try:
            key.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            key.append((entry, None))
    return tuple(key)


#: group → (:func:`_installed_key`, Registry) of the last default load (one process, many jobs:
#: the daemon's memo answers and the warm worker; ``entry_points()`` reads every distribution's
#: metadata, tens of milliseconds a job)
_REGISTRY_CACHE: dict[str, tuple[tuple, Registry]] = {}


def load_registry(group: str = ENTRY_POINT_GROUP, *, loader: Callable[[str], Iterable] | None = None) -> Registry:
    """Load every plugin of the entry-point ``group``; collect, never raise, per-plugin failures.
    Without ``loader`` the result is reused while ``sys.path`` and its directories' mtimes are
    unchanged (a distribution installed or removed since is seen at the next call).

    Args:
        loader: injectable replacement for ``importlib.metadata.entry_points(group=...)``.
    """
    if loader is None:
        key = _installed_key()
        hit = _REGISTRY_CACHE.get(group)
        if hit is not None and hit[0] == key:
            return Registry(list(hit[1].plugins), list(hit[1].errors))
        registry = _load_registry(group, lambda g: entry_points(group=g))
        _REGISTRY_CACHE[group] = (key, registry)
        return Registry(list(registry.plugins), list(registry.errors))
    return _load_registry(group, loader)


def _load_registry(group: str, loader: Callable[[str], Iterable]) -> Registry:
    eps = loader(group)
    plugins, errors = [], []
    for ep in eps:
        origin = f"{group}:{getattr(ep, 'name', ep)}"
        try:
            obj = ep.load()
            plugins.append(validate_plugin(obj, origin))
        except PluginError as exc:
            errors.append(exc)
            log.warning("%s", exc)
        except Exception as exc:  # a broken plugin never hides the others
            err = PluginError(f"failed to load: {type(exc).__name__}: {exc}", where=origin)
            errors.append(err)
            log.warning("%s", err)
    return Registry(plugins, errors)

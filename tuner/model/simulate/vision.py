"""Vision towers + projectors of multimodal wrappers, and the V1 encoder profile pass.

Two things a multimodal checkpoint adds to vLLM's memory budget:

1. **Weights** ("Model loading took"): the vision tower and the projector into the text model,
   built with vLLM's module structure (fused ``qkv_proj``, ``gate_up_proj``, TP-sharded
   column/row linears, replicated norms/convs/position tables, persistent rotary buffers).
2. **The encoder profile** (V1 ``GPUModelRunner.profile_run``, vllm/v1/worker/gpu_model_runner.py
   0.9-0.19): before the text dummy run the engine runs ``embed_multimodal`` on
   ``max_items`` dummy items of the largest size and keeps the outputs in the encoder cache until
   the sampler has run. The torch peak increase is the larger of the encoder pass's peak and the
   text run's peak on top of the cached encoder outputs. The encoder runs eagerly (no
   torch.compile by default), so Python locals keep intermediates alive until their function
   returns; :class:`VisionTower.forward` replays those allocations in order.

``max_items`` (vllm/multimodal/encoder_budget.py ``MultiModalBudget``, 0.10+; the same formula
lived in vllm/v1/worker/utils.py in 0.11): encoder budget ``B = max(N, T)`` with N the
``max_num_batched_tokens`` and T the largest item's token count, ``max_items = max(1, B // T)``
(0.9.x: ``cdiv(B, T)``). The decoder-side limit ``max_num_seqs x max(1, min(999, M // T))`` is
assumed not to bind (it only does with a handful of sequences). V0 (``runs_attention``) runs the
encoder inside the model forward on ``max(1, N // T)`` prompts of one item each.

Towers (``kind=``): one module per tower family in :mod:`tuner.model.simulate.towers`, each following
vLLM 0.19's module structure and documenting its own shapes and encoder pass —
``pixtral`` (Mistral3), ``siglip`` (Gemma 3, LLaVA-NeXT / granite-vision), ``llama4``,
``moonvit`` (Kimi-VL), ``qwen3_5`` (Qwen3.5 / 3.6), ``gemma4`` (weights only). A family
composes a tower by name (:data:`TOWERS`) or passes a tower module of its own as ``kind``.

The V1 profile keeps the dummy pixel batch (``batched_dummy_mm_inputs``) and the encoder outputs
allocated through the text dummy run and the sampler (locals of ``profile_run``).

Defaults for vision-config keys a partial file lacks come from transformers' config classes or
vLLM's own config class (named where used). Sizes: D vision hidden, I vision intermediate,
H text hidden, all per tensor-parallel rank where vLLM shards them.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
from torch import nn

from tuner.model.simulate import layers as L
from tuner.model.simulate.towers import gemma4, llama4, moonvit, pixtral, qwen3_5, siglip
from tuner.model.simulate.towers.base import Geometry, split_config as _split, version_tuple as _ver
# The towers' constants, importable from here as before.
from tuner.model.simulate.towers.llama4 import LLAMA4_MAX_TILES  # noqa: F401
from tuner.model.simulate.towers.moonvit import KIMI_DUMMY_IMAGE, KIMI_IN_TOKEN_LIMIT, MOONVIT_ROPE_GRID  # noqa: F401
from tuner.model.simulate.towers.pixtral import XFORMERS_UNTIL  # noqa: F401
from tuner.model.simulate.towers.qwen3_5 import QWEN3_VL_MAX_PIXELS, QWEN3_VL_VIDEO_MAX_PIXELS  # noqa: F401
from tuner.model.simulate.towers.siglip import LLAVA_NEXT_PINPOINTS  # noqa: F401

#: The built-in towers by ``kind`` name.
TOWERS: dict[str, ModuleType] = {t.KIND: t for t in (pixtral, siglip, llama4, moonvit, qwen3_5, gemma4)}
KINDS = tuple(TOWERS)

__all__ = ["TOWERS", "KINDS", "Geometry", "tower_for", "geometry", "param_list", "vision_tower_bytes",
           "max_tokens_per_item", "encoder_profile_items", "VisionTower", "MultimodalCausalLM"]


def tower_for(kind):
    """The tower module for ``kind``: a built-in name (:data:`TOWERS`) or a tower module itself
    (:mod:`tuner.model.simulate.towers` describes what it holds). Raises ValueError for an unknown name."""
    if isinstance(kind, str):
        try:
            return TOWERS[kind]
        except KeyError:
            raise ValueError(f"unknown vision tower kind {kind!r} (known: {', '.join(KINDS)})") from None
    return kind


def geometry(vision_config: dict, *, kind, top: dict | None = None) -> Geometry:
    """Resolve a tower's sizes. Raises ValueError for an unknown ``kind``."""
    vc, top = _split(vision_config, top)
    return tower_for(kind).geometry(vc, top)


def param_list(vision_config: dict, *, kind, top: dict | None = None) -> list:
    """The tower's and projector's parameters/buffers as vLLM 0.19 allocates them (full,
    un-sharded shapes; :class:`VisionTower` applies TP; entries as in
    :mod:`tuner.model.simulate.towers.base`). Raises ValueError for unknown kinds."""
    vc, top = _split(vision_config, top)
    tower = tower_for(kind)
    return tower.params(vc, top, tower.geometry(vc, top))


_STORE_BYTES = {"f32": 4, "i64": 8, "c64": 8}


def _numel(shape) -> int:
    return math.prod(shape)


def _sharded(spec, tp: int) -> tuple[int, int, int]:
    """(in, out, bias elements) of a linear on one rank."""
    _, in_f, out_f, bias, split, _q = spec
    if split == "col":
        return in_f, out_f // tp, (out_f // tp if bias else 0)
    if split == "row":
        return in_f // tp, out_f, (out_f if bias else 0)
    return in_f, out_f, (out_f if bias else 0)


def vision_tower_bytes(vision_config: dict, dtype_bytes: int, *, kind: str, top: dict | None = None, tp: int = 1) -> int:
    """Bytes of the vision tower + projector on one TP rank, all 16-bit (``dtype_bytes`` per
    element) except float32/int64/complex64 buffers.

    Args:
        vision_config: the ``vision_config`` dict, or the whole top-level config (then the
            projector, which needs the text hidden size and wrapper keys, is included).
        top: the top-level config when ``vision_config`` is only the sub-dict (adds the projector).
        tp: tensor-parallel size (vLLM shards the ViT's column/row linears unless
            ``mm_encoder_tp_mode="data"``).

    Raises:
        ValueError: unknown ``kind``.
    """
    total = 0
    for _name, shape, st in param_list(vision_config, kind=kind, top=top):
        if st == "lin":
            in_f, out_f, b = _sharded(shape, tp)
            total += (in_f * out_f + b) * dtype_bytes
        else:
            total += _numel(shape) * _STORE_BYTES.get(st, dtype_bytes)
    return total


# -- encoder profile: items --------------------------------------------------------------------
def max_tokens_per_item(vision_config: dict, *, kind, top: dict | None = None) -> tuple[int, int, int]:
    """``(T, crops, patches_per_crop)``: embeddings the largest dummy item yields (vLLM's
    ``get_mm_max_tokens_per_item``), the crops/tiles the tower sees per item, and the patches per
    crop. Raises ValueError for kinds whose encoder pass is not simulated."""
    vc, top = _split(vision_config, top)
    tower = tower_for(kind)
    g = tower.geometry(vc, top)
    if getattr(tower, "max_tokens_per_item", None) is None:
        raise ValueError(f"encoder profile of kind {g.kind!r} is not simulated")
    return tower.max_tokens_per_item(vc, top, g)


def encoder_profile_items(num_batched_tokens: int, tokens_per_item: int, engine_version, *, v0: bool = False,
                          max_num_seqs: int | None = None, mm_limit: int = 999,
                          max_model_len: int | None = None) -> int:
    """Dummy items the profile run encodes (see the module docstring).

    From 0.10 the decoder side bounds it too when ``max_num_seqs`` and ``max_model_len`` are given
    (``MultiModalBudget._get_max_items``, vllm/v1/worker/utils.py 0.11.0, vllm/multimodal/
    encoder_budget.py 0.24.0): ``max_num_seqs x max(1, min(limit, max_model_len // T))`` items, the
    limit being ``--limit-mm-per-prompt``'s (999 when not given); chunked prefill assumed on (the
    V1 default; without it vLLM also caps the requests at ``max_num_batched_tokens // T``)."""
    n, t = int(num_batched_tokens), max(1, int(tokens_per_item))
    if v0:
        return max(1, n // t)
    budget = max(n, t)
    if _ver(engine_version) < (0, 10, 0):
        return max(1, -(-budget // t))
    items = budget // t
    if max_num_seqs and max_model_len:
        per_prompt = max(1, min(int(mm_limit), int(max_model_len) // t))
        items = min(items, int(max_num_seqs) * per_prompt)
    return max(1, items)


#: First release whose multimodal models mark their towers (vllm/model_executor/models/interfaces.py
#: ``_mark_tower_model``, 64 models in 0.15.0, 77 in 0.19.0; none in 0.14.0) and skip building one
#: whose modalities are all limited to 0 (``no_init_weights`` -> ``StageMissingLayer``).
TOWER_SKIP_FROM = (0, 15, 0)


def mm_limit(settings, modality: str) -> int:
    """``MultiModalConfig.get_limit_per_prompt`` (vllm/config/multimodal.py 0.19): 0 for every modality
    under ``--language-model-only``, else the given count, else 999."""
    limits = dict(getattr(settings, "mm_limits", None) or ())
    if limits.get("*") == 0:
        return 0
    return int(limits.get(modality, 999))


def drop_unbuilt_towers(model, settings) -> list[str]:
    """Take off ``model`` (a :class:`MultimodalCausalLM`) the towers vLLM does not build: from
    :data:`TOWER_SKIP_FROM`, the vision tower when every modality it serves is limited to 0 (the
    tower module's ``MODALITIES``: ``image``, or ``image`` and ``video`` — as each model marks it),
    the audio tower (an ``audio`` child) when ``audio`` is; without them the weights and the
    encoder profile go too. Returns the names taken off (before 0.15: none, as those releases
    build every tower whatever the limits, except a few models' own checks not modelled here)."""
    if not isinstance(model, MultimodalCausalLM) or _ver(getattr(settings, "engine_version", "0.19.0")) < TOWER_SKIP_FROM:
        return []
    gone = []
    modalities = getattr(getattr(model.vision, "tower", None), "MODALITIES", ("image",))
    if model.vision is not None and all(mm_limit(settings, m) == 0 for m in modalities):
        model.vision = None
        gone.append("vision")
    if getattr(model, "audio", None) is not None and mm_limit(settings, "audio") == 0:
        model.audio = None
        gone.append("audio")
    return gone


def bind_decoder_limits(model, settings) -> None:
    """Give ``model``'s vision tower (a :class:`MultimodalCausalLM`'s) the decoder-side bound of the
    encoder profile's items (:func:`encoder_profile_items`): ``max_num_seqs``, the image limit of
    ``--limit-mm-per-prompt`` and ``max_model_len`` from ``settings`` (read there, so a cached
    module is keyed on the batch)."""
    vision = getattr(model, "vision", None) if isinstance(model, MultimodalCausalLM) else None
    if vision is None:
        return
    seqs, mml = getattr(settings, "max_num_seqs", None), getattr(settings, "max_model_len", None)
    vision.decoder_limits = ({"max_num_seqs": int(seqs), "max_model_len": int(mml),
                              "mm_limit": mm_limit(settings, "image")} if seqs and mml else None)


# -- module ----------------------------------------------------------------------------------
_TORCH = {"f32": torch.float32, "i64": torch.int64, "c64": torch.complex64}


class VisionTower(nn.Module):
    """Memory-equivalent vision tower + projector of one TP rank.

    Parameters are registered with vLLM's names (dots become ``__``); linears go through
    :class:`tuner.model.simulate.layers.Linear` with ``quant``/``prefix`` so a quantized checkpoint's
    scheme decides per layer (Llama-4 and Kimi-VL towers never get a scheme, like vLLM).
    ``forward(num_tokens)`` replays the V1 encoder profile for a ``num_tokens``-token batch and
    returns the encoder outputs the engine keeps in its encoder cache (``[items·T, H]``).

    Args:
        vision_config: vision sub-config, or the whole top-level config (preferred: the
            projector needs text and wrapper keys).
        kind: a built-in tower name (:data:`KINDS`) or a tower module (:mod:`tuner.model.simulate.towers`).
        dtype: model dtype. top: the top-level config when ``vision_config`` is the sub-dict.
        tp: tensor-parallel size. quant: the checkpoint's quantization scheme or None.
        engine_version: vLLM release (decides item counting and the Pixtral mask path).
        v0: V0 engine (encoder runs inside the forward on ``N // T`` one-item prompts).

    Raises:
        ValueError: unknown ``kind``.
    """

    def __init__(self, vision_config: dict, dtype: torch.dtype, *, kind, top: dict | None = None, tp: int = 1,
                 quant=None, engine_version: str = "0.19.0", v0: bool = False) -> None:
        super().__init__()
        self.vc, self.top = _split(vision_config, top)
        self.tower = tower_for(kind)
        self.kind, self.dtype, self.tp = self.tower.KIND, dtype, tp
        self.engine_version, self.v0 = engine_version, v0
        self.geom = self.tower.geometry(self.vc, self.top)
        use_quant = quant if self.tower.QUANTIZABLE else None
        self._dummy_batch: list = []  # V1: the profile's dummy pixel batch (kept through the text run)
        #: the decoder-side bound of the profile's items (:func:`bind_decoder_limits`), or None
        self.decoder_limits: dict | None = None
        self._rope_cache = None  # MoonViT's cached 2-D rotary table (allocated on the first forward)
        self.linears = nn.ModuleDict()
        for name, shape, st in self.tower.params(self.vc, self.top, self.geom):
            key = name.replace(".", "__")
            if st == "lin":
                in_f, out_f, b = _sharded(shape, tp)
                q = use_quant if shape[5] else None
                self.linears[key] = L.Linear(in_f, out_f, dtype, bias=bool(b), quant=q, prefix=name)
            elif st in _TORCH:
                self.register_buffer(key, torch.empty(tuple(shape), dtype=_TORCH[st]), persistent=False)
            else:
                self.register_parameter(key, nn.Parameter(torch.empty(tuple(shape), dtype=dtype), requires_grad=False))

    # -- encoder pass ---------------------------------------------------------------------
    def profile_items(self, num_tokens: int) -> tuple[int, int, int, int]:
        """``(items, T, crops_per_item, patches_per_crop)`` of the encoder profile."""
        t, crops, patches = max_tokens_per_item(self.vc, kind=self.tower, top=self.top)
        lim = self.decoder_limits or {}
        return encoder_profile_items(num_tokens, t, self.engine_version, v0=self.v0, **lim), t, crops, patches

    def forward(self, num_tokens: int):
        """Replay the encoder profile; returns the encoder outputs the engine caches, or None
        for towers whose pass is not simulated (``gemma4``: weights only). The tower module's
        ``encode`` replays the pass.

        V1 (vllm/v1/worker/gpu_model_runner.py ``profile_run``, 0.19) binds the dummy batch
        (``batched_dummy_mm_inputs``) and the outputs to locals of ``profile_run``, so both stay
        allocated through the text dummy run and the sampler: the pixel batch is kept on
        ``self._dummy_batch`` until the next forward. V0 encodes inside the forward and frees both.
        """
        encode = getattr(self.tower, "encode", None)
        if encode is None:
            return None
        self._dummy_batch = []
        items, t, crops, patches = self.profile_items(num_tokens)
        return encode(self, items, t, crops, patches)

    def empty(self, *shape, dtype=None):
        """An uninitialised tensor in the model dtype (or ``dtype``): one allocation of the pass."""
        return torch.empty(*shape, dtype=dtype or self.dtype)

    def pixels(self, *shape):
        """The dummy pixel batch in the model dtype (vLLM's processor casts floating inputs to
        the model dtype, vllm/multimodal/processing/context.py); kept past the encoder in V1."""
        t = self.empty(*shape)
        if not self.v0:
            self._dummy_batch.append(t)
        return t


# -- wrapper ----------------------------------------------------------------------------------
class MultimodalCausalLM(nn.Module):
    """A text model (:class:`tuner.model.simulate.layers.CausalLM` or look-alike) plus an optional
    vision tower, run as vLLM's V1 profile does: encoder pass first (its outputs stay in the
    encoder cache until the module is dropped, i.e. through the sampler), then the text dummy run
    fed with ``inputs_embeds``. V1 multimodal runners pass the persistent ``inputs_embeds`` buffer
    ``[max_num_tokens, H]`` (allocated at runner init, before the profile) instead of looking up
    token embeddings, so the text run allocates no embedding output; the simulation stands the
    buffer in with a view of an existing model-dtype weight of at least ``N·H`` elements (never a
    new allocation), falling back to a counted allocation when none is large enough. V0 embeds the
    tokens (counted) and keeps the encoder outputs only for the forward.
    """

    def __init__(self, text: nn.Module, vision: VisionTower | None, hidden: int, *, v0: bool = False) -> None:
        super().__init__()
        self.text = text
        self.vision = vision
        self.hidden = hidden
        self.v0 = v0
        self._encoder_cache = None

    def _embeds(self, n: int) -> torch.Tensor | None:
        need = n * self.hidden
        dtype = None
        for p in self.text.parameters():
            if dtype is None:
                dtype = p.dtype
            if p.dtype == dtype and p.numel() >= need and p.is_floating_point():
                return p.reshape(-1)[:need].view(n, self.hidden)
        return None

    def forward(self, input_ids, positions, intermediate=None):
        n = input_ids.shape[0]
        enc = self.vision(n) if (self.vision is not None and intermediate is None) else None
        if intermediate is None and not self.v0:
            embeds = self._embeds(n)
            if embeds is None:
                p = next(self.text.parameters())
                embeds = torch.empty(n, self.hidden, dtype=p.dtype)
            self._encoder_cache = enc
            return self.text(input_ids, positions, (embeds, None))
        out = self.text(input_ids, positions, intermediate)
        del enc
        return out

    def compute_logits(self, hidden):
        return self.text.compute_logits(hidden)

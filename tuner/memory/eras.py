"""vLLM eras: version parsing and the per-version rules that size the profile run and the budget.

Pure functions, no I/O, no torch. Every rule cites the vLLM release range and file it follows
(see ``shared/reference/vllm-memory-model.md`` for the paraphrased source).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import total_ordering

from tuner.errors import EraError

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:[.+-]?(?:post|rc|dev|a|b)?\d*.*)?\s*$")

#: Oldest and newest releases whose rules are modelled.
OLDEST = (0, 4, 0)
NEWEST = (0, 34, 0)
#: The newest modelled release as vLLM spells it: what a drop without ``engine_version`` (and no
#: installed vLLM) is answered for, and what a newer release is answered with.
NEWEST_RELEASE = "0.34.0"


@total_ordering
@dataclass(frozen=True)
class VllmVersion:
    """A vLLM release as a comparable (major, minor, patch) triple.

    ``VllmVersion.parse("0.10.1.1")`` → (0, 10, 1); suffixes such as ``.post1`` or ``rc1`` are
    ignored because the memory rules never changed inside a patch series.
    Compare with tuples or strings: ``v >= "0.9.1"``.
    """

    major: int
    minor: int
    patch: int = 0
    raw: str = ""

    @classmethod
    def parse(cls, text: str | "VllmVersion", *, newer: str = "newest") -> "VllmVersion":
        """Parse ``"0.19.0"``, ``"v0.6.4.post1"``, ``"0.10.1.1"``.

        ``newer``: what a release newer than :data:`NEWEST` does — ``"newest"`` (default) answers
        with the newest modelled rules (the version is returned as :data:`NEWEST_RELEASE`; callers
        say so out loud, :func:`release_assumption`), ``"refuse"`` raises (strict mode,
        ``--strict-release`` / the drop's ``strict_release``).

        Raises:
            EraError: the text is not a version, lies before 0.4, or (``newer="refuse"``) after
                the newest modelled release.
        """
        if isinstance(text, VllmVersion):
            return text
        m = _VERSION_RE.match(str(text))
        if not m:
            raise EraError(f"cannot parse vLLM version {text!r} (expected e.g. '0.19.0')")
        v = cls(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), str(text).strip())
        if v.key < OLDEST or (v.key > NEWEST and newer == "refuse"):
            raise EraError(
                f"vLLM version {text!r} is outside the modelled eras "
                f"{'.'.join(map(str, OLDEST))} – {'.'.join(map(str, NEWEST))}"
                + (" (strict release mode: a newer release is refused rather than answered with the newest "
                   "modelled rules)" if v.key > NEWEST else "")
            )
        if v.key > NEWEST:
            return cls(*NEWEST, raw=str(text).strip())
        return v

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.major, self.minor, self.patch)

    @staticmethod
    def _other(other: object) -> tuple[int, int, int]:
        if isinstance(other, VllmVersion):
            return other.key
        if isinstance(other, tuple):
            return tuple(other) + (0,) * (3 - len(other))  # type: ignore[return-value]
        if isinstance(other, str):
            parts = [int(p) for p in other.split(".")[:3]]
            return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]
        return NotImplemented  # type: ignore[return-value]

    def __eq__(self, other: object) -> bool:
        o = self._other(other)
        return o is not NotImplemented and self.key == o

    def __lt__(self, other: object) -> bool:
        return self.key < self._other(other)

    def __hash__(self) -> int:
        return hash(self.key)

    def __str__(self) -> str:
        return ".".join(map(str, self.key))


def parse_version(text: str | VllmVersion, *, newer: str = "newest") -> VllmVersion:
    """Shorthand for :meth:`VllmVersion.parse`."""
    return VllmVersion.parse(text, newer=newer)


def is_newer_than_modelled(text: str) -> bool:
    """The text is a vLLM version newer than the newest modelled release (:data:`NEWEST`)."""
    m = _VERSION_RE.match(str(text or ""))
    return bool(m) and (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) > NEWEST


def resolve_release(requested: str | None, *, installed: str | None = None, installed_from: str = "",
                    strict: bool = False) -> tuple[str, dict | None]:
    """The release whose rules answer, and what was assumed to pick it (None = nothing assumed).

    * ``requested`` within the modelled releases: itself, nothing assumed.
    * ``requested`` newer than :data:`NEWEST`: the newest modelled release's rules, with a
      ``release_assumed`` marker (``strict`` refuses instead: :class:`EraError`).
    * no ``requested``: ``installed`` (the vLLM installed in the worker's Python, ``installed_from``
      says which), else :data:`NEWEST_RELEASE` — marked either way.

    The marker is plain data, ``{"value", "requested", "kind", "reason"}`` (``kind``:
    ``newer_release``, ``installed``, ``newest_modelled``), carried by the drop, the job result, the
    store and the proposal file so that a band can be widened for it (issue 27).
    """
    newest = NEWEST_RELEASE
    if requested:
        if not is_newer_than_modelled(requested):
            parse_version(requested)  # EraError for junk or a release before the oldest
            return requested, None
        if strict:
            parse_version(requested, newer="refuse")  # raises
        return newest, {"value": newest, "requested": requested, "kind": "newer_release",
                        "reason": f"vLLM {requested} is newer than the newest modelled release {newest}: answered "
                                  f"with {newest}'s memory rules, which {requested} may have changed (strict_release "
                                  "refuses instead)"}
    if installed:
        m = _VERSION_RE.match(installed)
        base = ".".join(m.group(i) or "0" for i in (1, 2, 3)) if m else installed
        if is_newer_than_modelled(base):
            return newest, {"value": newest, "requested": None, "kind": "newer_release",
                            "reason": f"engine_version not given; vLLM {installed}, installed in "
                                      f"{installed_from or 'the worker Python'}, is newer than the newest modelled "
                                      f"release {newest}: answered with {newest}'s rules"}
        try:
            parse_version(base)
        except EraError:
            pass
        else:
            return base, {"value": base, "requested": None, "kind": "installed",
                          "reason": f"engine_version not given: vLLM {installed}, installed in "
                                    f"{installed_from or 'the worker Python'}"}
    return newest, {"value": newest, "requested": None, "kind": "newest_modelled",
                    "reason": f"engine_version not given and no vLLM installed in the worker's Python: the newest "
                              f"modelled release {newest}"}


def release_warning(assumed: dict | None) -> str | None:
    """The loud line output, JSON warnings and proposal files carry for a ``release_assumed``."""
    if not assumed:
        return None
    loud = "WARNING: " if assumed.get("kind") == "newer_release" else ""
    return f"{loud}release assumed: vLLM {assumed['value']} ({assumed['reason']})"


GiB = 1 << 30
MiB = 1 << 20

#: Budget formula families (see reference §1 and §3.2 / §4.3).
V0_FREE_DELTA = "v0_free_delta"  # V0 ≤0.6.3: T·u − (init_free − free_after_profile)
V0_WHOLE_GPU = "v0_whole_gpu"  # V0 0.6.4: T·u − (torch peak + everything else on the GPU)
V0_PROFILING = "v0_profiling"  # V0 0.6.5–0.10.2: T·u − (W + torch_peak_increase + non_torch_increase)
V1_WHOLE_GPU = "v1_whole_gpu"  # V1 0.7.0–0.9.0: as V0 0.6.4 (context and other processes count)
V1_PROFILING = "v1_profiling"  # V1 0.9.1–0.26: requested − (W + peak increase + non-torch) [− graphs]
V1_CONSUMED = "v1_consumed"  # V1 0.27+: requested − (total_consumed + transient headroom) − graphs
#: V1 0.34+ with the extensible KV cache (vllm/v1/worker/extensible_kv_cache.py
#: ``measure_kv_cache_bytes``): sized after warmup and CUDA-graph capture,
#: ``min(requested − non-KV used, headroom − margin) − max(transient peak, torch reserve growth)``;
#: the profile (V1_CONSUMED, no graph estimate) only sizes the address-space reservation.
EXTENSIBLE_KV_CACHE_SINCE = (0, 34, 0)


@dataclass(frozen=True)
class Era:
    """The rules of one vLLM release, as far as memory is concerned.

    Attributes:
        version: the release.
        engine: ``"V0"`` or ``"V1"``.
        budget_formula: one of the ``V0_*``/``V1_*`` constants above.
        requested_rounds_up: ``requested = ceil(T·u)`` (vllm/v1/worker/utils.py, 0.14+), else ``T·u``.
        subtracts_cudagraph_estimate: the CUDA-graph estimate is taken off the KV budget by
            default (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` default "1" from 0.20).
        default_gpu_memory_utilization: 0.90, or 0.92 from 0.20 (vllm/config/cache.py).
        null_block: the block pool reserves block 0 (V1 0.8.3+, vllm/v1/core/block_pool.py).
        compiled: the V1 profile runs the torch.compile'd model (buffers freed at last use);
            V0 runs eager code, whose locals keep intermediates alive until a function returns.
        extensible_kv_cache: the KV cache is sized after warmup from measured memory (V1 0.34+ on
            CUDA and ROCm unless ``kv_cache_memory_bytes`` is set or it is turned off: vllm/config/vllm.py
            ``VllmConfig._resolve_extensible_kv_cache``); default ``gpu_memory_utilization`` then 1.0
            (vllm/config/cache.py ``CacheConfig.resolved_gpu_memory_utilization``, 0.34).
    """

    version: VllmVersion
    engine: str
    budget_formula: str
    requested_rounds_up: bool
    subtracts_cudagraph_estimate: bool
    default_gpu_memory_utilization: float
    null_block: bool
    compiled: bool
    extensible_kv_cache: bool = False

    @property
    def name(self) -> str:
        extra = ", extensible KV cache" if self.extensible_kv_cache else ""
        return f"{self.engine} {self.version} ({self.budget_formula}{extra})"


def default_engine(version: VllmVersion) -> str:
    """V1 is the default engine from 0.8.0 (V0 removed in 0.11.0); V0 before."""
    return "V1" if version >= (0, 8, 0) else "V0"


def era_for(version: str | VllmVersion, engine: str | None = None, *, enforce_eager: bool = False,
            extensible_kv_cache: bool | None = None, kv_cache_memory_bytes: int | None = None) -> Era:
    """Return the :class:`Era` for a vLLM release and engine.

    Args:
        version: e.g. ``"0.19.0"``.
        engine: ``"V0"``/``"V1"``/``None`` (= the release's default engine).
        enforce_eager: the user passed ``--enforce-eager`` (no torch.compile, no CUDA graphs).
        extensible_kv_cache: vLLM's ``--[no-]enable-extensible-kv-cache`` (None = the release's
            default: on from 0.34; off where vLLM turns it off — ``kv_cache_memory_bytes`` set, no
            virtual memory management, NIXL without IMEX — which the caller states as False).
        kv_cache_memory_bytes: the drop's ``kv_cache_memory_bytes`` (turns the extensible cache off).

    Raises:
        EraError: unparsable version, or an engine the release does not have (V1 before 0.7,
            V0 from 0.11).
    """
    v = VllmVersion.parse(version)
    eng = (engine or default_engine(v)).upper()
    if eng not in ("V0", "V1"):
        raise EraError(f"unknown engine {engine!r} (expected V0 or V1)")
    if eng == "V1" and v < (0, 7, 0):
        raise EraError(f"vLLM {v} has no V1 engine (V1 starts at 0.7.0)")
    if eng == "V0" and v >= (0, 11, 0):
        raise EraError(f"vLLM {v} has no V0 engine (removed in 0.11.0)")
    if eng == "V0":
        if v <= (0, 6, 3):
            formula = V0_FREE_DELTA
        elif v < (0, 6, 5):
            formula = V0_WHOLE_GPU
        else:
            formula = V0_PROFILING
    else:
        if v < (0, 9, 1):
            formula = V1_WHOLE_GPU
        elif v < (0, 27, 0):
            formula = V1_PROFILING
        else:
            formula = V1_CONSUMED
    extensible = (eng == "V1" and v >= EXTENSIBLE_KV_CACHE_SINCE and extensible_kv_cache is not False
                  and kv_cache_memory_bytes is None)
    if extensible_kv_cache and not extensible:
        raise EraError(f"enable_extensible_kv_cache: vLLM {v} has no extensible KV cache (it came in 0.34.0)"
                       if v < EXTENSIBLE_KV_CACHE_SINCE or eng != "V1" else
                       "enable_extensible_kv_cache: it sizes the KV cache from measured memory, which "
                       "kv_cache_memory_bytes overrides.")
    return Era(
        version=v,
        engine=eng,
        budget_formula=formula,
        requested_rounds_up=eng == "V1" and v >= (0, 14, 0),
        # with the extensible cache vLLM estimates no graphs before sizing
        # (vllm/v1/worker/gpu/model_runner.py ``profile_cudagraph_memory`` returns 0, 0.34): the
        # captured graphs are in the memory measured after warmup, so the budget still loses them
        subtracts_cudagraph_estimate=eng == "V1" and v >= (0, 20, 0) and not enforce_eager,
        default_gpu_memory_utilization=1.0 if extensible else 0.92 if v >= (0, 20, 0) else 0.90,
        null_block=eng == "V1" and v >= (0, 8, 3),
        compiled=eng == "V1" and not enforce_eager,
        extensible_kv_cache=extensible,
    )


@dataclass(frozen=True)
class ProfileBatch:
    """The dummy batch of one profile run.

    Attributes:
        max_num_batched_tokens: N, tokens in the forward.
        max_num_seqs: S after the era's clamps.
        num_reqs: R, requests in the batch = rows of logits sampled.
        chunked_prefill: whether chunked prefill is on (decides whether N depends on M).
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    num_reqs: int
    chunked_prefill: bool


def v0_multimodal_min_batched_tokens(version: VllmVersion) -> int:
    """V0 ``SchedulerConfig`` floor on the default ``max_num_batched_tokens`` of multimodal models
    (vllm/config.py ``_MULTIMODAL_MODEL_MAX_NUM_BATCHED_TOKENS``): 4096 in 0.6.0, 5120 from 0.6.3
    (0.6.1–0.6.2 not read; taken as 0.6.0), none in 0.5.4."""
    if version < (0, 6, 0):
        return 0
    return 4096 if version < (0, 6, 3) else 5120


def v0_uses_sliding_window(sliding_window, use_sliding_window=None) -> bool:
    """V0 ``ModelConfig.get_hf_config_sliding_window`` (vllm/config.py 0.6.4): no window when the
    HF config sets ``use_sliding_window`` false (Qwen2 / Qwen1.5 configs carry a window they do
    not use); a window of 0 or None is none. Decides the V0 chunked-prefill default."""
    if use_sliding_window is False:
        return False
    return bool(sliding_window)


#: First release raising the default ``max_num_batched_tokens`` of a multimodal prefix-LM model to
#: its largest multimodal item (vllm/engine/arg_utils.py ``_get_min_mm_batched_tokens``, 0.22.0).
MM_PREFIX_LM_MIN_TOKENS_SINCE = (0, 22, 0)
#: Gemma-4's video bound (vllm/model_executor/models/gemma4_mm.py ``_VIDEO_MAX_FRAMES``,
#: ``_VIDEO_MAX_SOFT_TOKENS``; the same in 0.21–0.34): each frame ≤ 70 soft tokens + boi + eoi +
#: ~6 timestamp tokens.
GEMMA4_VIDEO_MAX_FRAMES = 32
GEMMA4_VIDEO_MAX_SOFT_TOKENS = 70


#: First release whose ``is_mm_prefix_lm`` is False when every modality is configuration-disabled
#: (``language_model_only``, all ``limit_mm_per_prompt`` 0): vllm/config/model.py
#: ``ModelConfig._supports_multimodal_for_mm_prefix``, 0.27.0.
MM_PREFIX_TEXT_ONLY_OFF_SINCE = (0, 27, 0)


def mm_prefix_lm_item_tokens(top_config: dict | None, *, version: "VllmVersion | str | None" = None,
                             text_only: bool = False) -> int:
    """The largest per-item token count vLLM reserves in one batch for a multimodal prefix-LM model
    (0 when the model is not one, or vLLM does not know the count without dummy inputs).

    ``ModelConfig.is_mm_prefix_lm`` (vllm/transformers_utils/model_arch_config_convertor.py): for
    ``model_type`` ``gemma4``, ``text_config.use_bidirectional_attention == "vision"``; the other
    prefix-LM models (gemma3, paligemma, …) return no ``get_mm_max_tokens_per_item`` except bagel
    and moondream3, not modelled. Gemma-4's ``Gemma4ProcessingInfo.get_mm_max_tokens_per_item``
    (gemma4_mm.py): image ``vision_config.default_output_length``, video
    ``32 × (70 + 2 + 6)`` = 2,496; audio (``processor.audio_seq_length``, a processor setting not
    in config.json) is not modelled. ``text_only`` (every modality disabled): 0 from 0.27
    (:data:`MM_PREFIX_TEXT_ONLY_OFF_SINCE`); 0.22–0.26 raise N all the same."""
    if text_only and version is not None and VllmVersion.parse(version) >= MM_PREFIX_TEXT_ONLY_OFF_SINCE:
        return 0
    top = top_config or {}
    if top.get("model_type") != "gemma4":
        return 0
    if (top.get("text_config") or {}).get("use_bidirectional_attention") != "vision":
        return 0
    image = int((top.get("vision_config") or {}).get("default_output_length") or 0)
    video = GEMMA4_VIDEO_MAX_FRAMES * (GEMMA4_VIDEO_MAX_SOFT_TOKENS + 2 + 6)
    return max(image, video)


def profile_batch(
    era: Era,
    *,
    max_model_len: int,
    entry_point: str = "serve",
    device_name: str = "",
    total_memory_bytes: int = 0,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    enable_chunked_prefill: bool | None = None,
    has_sliding_window: bool = False,
    is_multimodal: bool = False,
    compute_capability: str | None = None,
    mm_prefix_lm_item_tokens: int = 0,
) -> ProfileBatch:
    """Size the profile run's dummy batch the way the era's engine does.

    V0 (vllm/config.py ``SchedulerConfig``/``EngineArgs``, 0.4–0.10): ``max_num_seqs`` 256;
    chunked prefill auto-enabled when ``max_model_len > 32768`` (0.5.4+, no sliding window,
    not multimodal); N = ``max(M, 2048)`` without chunked prefill, else 512 (≤0.6.4) or 2048
    (0.6.5+). V1 (vllm/engine/arg_utils.py, reference §4.10): defaults by GPU tier and entry
    point; chunked prefill always on unless disabled; ``S = min(S, N)``. ``compute_capability``
    (``"12.1"``) picks 0.33+'s GB10 tier; default: the catalog's for ``device_name``.
    ``mm_prefix_lm_item_tokens`` (:func:`mm_prefix_lm_item_tokens`): from 0.22 a default N below it
    is raised to it ("Raising max_num_batched_tokens from … to accommodate … input for prefix-LM
    model", vllm/engine/arg_utils.py ``_set_default_max_num_seqs_and_batched_tokens_args``).

    Returns:
        A :class:`ProfileBatch` (tokens, sequences, requests).

    Raises:
        EraError: a user ``max_num_batched_tokens`` the engine would reject
            (< ``max_model_len`` without chunked prefill, in V0).
    """
    v = era.version
    if era.engine == "V0":
        chunked = enable_chunked_prefill
        if chunked is None:
            # 0.5.4–0.6.0 (arg_utils.py) did not exclude multimodal models; 0.6.3+ does.
            chunked = (
                v >= (0, 5, 4) and max_model_len > 32768 and not has_sliding_window
                and not (is_multimodal and v >= (0, 6, 3))
            )
        s = max_num_seqs or 256
        if max_num_batched_tokens is not None:
            n = max_num_batched_tokens
            if not chunked and n < max_model_len:
                raise EraError(
                    f"max_num_batched_tokens ({n}) is smaller than max_model_len ({max_model_len}): "
                    "vLLM rejects this without chunked prefill"
                )
        elif chunked:
            n = 512 if v < (0, 6, 5) else 2048
        else:
            n = max(max_model_len, 2048)
        if max_num_batched_tokens is None and is_multimodal:
            n = max(n, v0_multimodal_min_batched_tokens(v))
        return ProfileBatch(n, s, min(s, n), bool(chunked))

    # V1
    big = total_memory_bytes >= 70 * GiB and "a100" not in device_name.lower()
    name = device_name.lower()
    if v < (0, 9, 0):
        hopper = "h100" in name or "h200" in name
        serve_n, offline_n = (8192, 16384) if hopper else (2048, 8192)
        s_default = 1024 if (hopper or v < (0, 8, 5)) else 256
    elif v < (0, 28, 0):
        serve_n, offline_n = (8192, 16384) if big else (2048, 8192)
        s_default = 1024 if big else 256
    else:
        # 0.33 (vllm/engine/arg_utils.py get_batch_defaults: ``is_device_capability((12, 1))``)
        # also keeps GB10 in the small tier, by compute capability (any 12.1 card, whatever its
        # name); 0.28–0.32 do not test it. Capability not given: the catalog's for the name.
        if compute_capability is None and device_name:
            from tuner.memory.devices import lookup

            known = lookup(device_name, total_memory_bytes=total_memory_bytes or None)
            compute_capability = known.compute_capability if known is not None else None
        if v >= (0, 33, 0) and str(compute_capability or "") == "12.1":
            big = False
        if total_memory_bytes >= 160 * GiB:
            serve_n, offline_n, s_default = 16384, 16384, 1024
        elif big:
            serve_n, offline_n, s_default = 8192, 16384, 1024
        else:
            serve_n, offline_n, s_default = 2048, 8192, 256
    n = max_num_batched_tokens or (offline_n if entry_point == "offline" else serve_n)
    s = max_num_seqs or s_default
    chunked = True if enable_chunked_prefill is None else bool(enable_chunked_prefill)
    if not chunked and max_num_batched_tokens is None:
        if v >= (0, 12, 0):
            n = max(max_model_len, n)
        elif v >= (0, 11, 0):
            n = max_model_len
        else:
            n = max(max_model_len, n)
    if max_num_batched_tokens is None and v >= MM_PREFIX_LM_MIN_TOKENS_SINCE and mm_prefix_lm_item_tokens > n:
        n = int(mm_prefix_lm_item_tokens)
    if v >= (0, 12, 0):
        n = min(s * max_model_len, n)
    s = min(s, n)
    return ProfileBatch(n, s, min(n, s), chunked)


#: Dummy-sampler families by era (what ``profile_run`` samples, vllm/v1/worker/gpu_model_runner.py
#: ``_dummy_sampler_run`` and vllm/v1/sample/ops/topk_topp_sampler.py; V0
#: vllm/model_executor/layers/sampler.py).
SAMPLER_V0_SORT = "v0_sort"  # V0: fp32 upcast, sort-based top-k/top-p, probs + logprobs
SAMPLER_V1_ALL_LOGITS = "v1_all_logits"  # V1 0.7.0–0.7.2: logits for all N tokens, no sampler
SAMPLER_V1_LOGITS_ONLY = "v1_logits_only"  # V1 0.7.3: logits for R rows, no sampler
SAMPLER_V1_FLASHINFER = "v1_flashinfer"  # V1 0.8–0.16: FlashInfer top-k/top-p (sampler_path decides)
SAMPLER_V1_SORT = "v1_sort"  # V1 0.8–0.16: PyTorch sort path (FlashInfer missing, or opt-in from 0.11.1)
SAMPLER_V1_TRITON = "v1_triton"  # V1 0.17+: Triton top-k/top-p in place for batches ≥ 8
SAMPLER_V2_LOGITS = "v2_logits"  # Model Runner V2 0.22–0.32: default params, model-dtype logits only
SAMPLER_V2_FP32_PASS = "v2_fp32_pass"  # Model Runner V2 0.33: + warm-up pass on fp32 logits (FlashInfer)


#: vLLM's wheel requires ``flashinfer-python`` from 0.11.1 (``Requires-Dist: flashinfer-python==0.5.2``;
#: 0.12.0 0.5.3, 0.16.0 0.6.3, 0.17.0 0.6.4 — read in each wheel's METADATA); before, FlashInfer is
#: only the ``flashinfer`` extra (0.10.1.1 ``flashinfer-python==0.2.11; extra == "flashinfer"``, 0.10.2,
#: 0.11.0) or not named at all (0.8.5, 0.9.2, 0.10.0): ``pip install vllm`` leaves it out.
FLASHINFER_DEPENDENCY_SINCE = (0, 11, 1)


@dataclass(frozen=True)
class SamplerPath:
    """Which top-k/top-p implementation the profile run's dummy sampler runs, and why.

    ``flashinfer``: FlashInfer's kernels (else PyTorch's sort-based ``forward_native``);
    ``assumption``: None where the inputs decide it, else the named assumption made
    (``{"name": "flashinfer_installed", "value": bool, "why": str}``) — the uncertainty band
    and the answer's text read it from there."""

    flashinfer: bool
    assumption: dict | None = None


def _env_flag(value) -> bool | None:
    """``VLLM_USE_FLASHINFER_SAMPLER`` as vllm/envs.py reads it: unset → None, else
    ``bool(int(value))``."""
    if value is None or str(value).strip() == "":
        return None
    try:
        return bool(int(str(value).strip()))
    except ValueError:
        return str(value).strip().lower() in ("true", "yes", "on")


def sampler_path(era: Era, *, flashinfer_installed: bool | None = None,
                 use_flashinfer_sampler: str | int | None = None) -> SamplerPath:
    """Whether the V1 dummy sampler runs FlashInfer's top-k/top-p or PyTorch's sort
    (vllm/v1/sample/ops/topk_topp_sampler.py ``TopKTopPSampler.__init__`` on CUDA).

    * 0.8.0–0.11.0 (0.10.1.1 and 0.11.0 read): FlashInfer when ``import flashinfer.sampling``
      succeeds (version ≥ 0.2.3) and ``VLLM_USE_FLASHINFER_SAMPLER`` is not ``0`` (unset means
      on); else "FlashInfer is not available. Falling back to the PyTorch-native
      implementation" (or "available, but it is not enabled").
    * 0.11.1–0.16 (0.11.1, 0.16.0 read): opt-in: FlashInfer only with
      ``VLLM_USE_FLASHINFER_SAMPLER=1`` (it is installed: a dependency from 0.11.1).
    * 0.17+ and V0: not decided here (Triton / V0 sampler; ``flashinfer`` False).

    ``flashinfer_installed`` None: what ``pip install vllm==X`` gets
    (:data:`FLASHINFER_DEPENDENCY_SINCE`), returned as the named assumption.
    """
    v = era.version
    flag = _env_flag(use_flashinfer_sampler)
    if era.engine != "V1" or v < (0, 8, 0) or v >= (0, 17, 0):
        return SamplerPath(False)
    if v >= FLASHINFER_DEPENDENCY_SINCE:
        # installed with vLLM; the env var alone decides (opt-in)
        return SamplerPath(bool(flag) and flashinfer_installed is not False)
    assumption = None
    installed = flashinfer_installed
    if installed is None and flag is False:  # VLLM_USE_FLASHINFER_SAMPLER=0: the sort, installed or not
        installed = False
    elif installed is None:
        installed = False
        assumption = {"name": "flashinfer_installed", "value": False,
                      "why": f"vLLM {v} as `pip install vllm=={v}` installs it: FlashInfer is not a dependency "
                             "before 0.11.1, so the profile run's sampler sorts with PyTorch (about 38 bytes per "
                             "sampled logit instead of FlashInfer's 14); say flashinfer_installed: true (check "
                             "--flashinfer-installed true) where it is installed, as in the vllm/vllm-openai image"}
    return SamplerPath(bool(installed) and flag is not False, assumption)


def sampler_family(era: Era, *, model_runner_v2: bool = False, flashinfer: bool | None = None) -> str:
    """The dummy-sampler implementation the era's profile run executes (see constants).

    ``flashinfer``: the V1 top-k/top-p path of 0.8–0.16 (:func:`sampler_path`); None = what a
    ``pip install`` of the release runs (:func:`sampler_path` without inputs).

    ``model_runner_v2``: the release runs Model Runner V2 for this model
    (:func:`uses_model_runner_v2`). Its ``_dummy_sampler_run``
    (vllm/v1/worker/gpu/model_runner.py) samples with default parameters (no top-k/top-p, no
    fp32 upcast) in 0.22–0.32; 0.33 adds a second pass with ``SamplingParams.for_sampler_warmup()``
    (fp32 copy of the logits, FlashInfer top-k/top-p).
    """
    v = era.version
    if era.engine == "V0":
        return SAMPLER_V0_SORT
    if model_runner_v2 and v >= (0, 22, 0):
        return SAMPLER_V2_FP32_PASS if v >= (0, 33, 0) else SAMPLER_V2_LOGITS
    if v < (0, 7, 3):
        return SAMPLER_V1_ALL_LOGITS
    if v < (0, 8, 0):
        return SAMPLER_V1_LOGITS_ONLY
    if v < (0, 17, 0):
        if flashinfer is None:
            flashinfer = sampler_path(era).flashinfer
        return SAMPLER_V1_FLASHINFER if flashinfer else SAMPLER_V1_SORT
    return SAMPLER_V1_TRITON


#: Architectures Model Runner V2 is the default for (vllm/config/vllm.py
#: ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES``): 0.22 one, 0.24 six; from 0.25 every non-MoE
#: model also defaults to V2, so the list names MoE models (0.25, 0.27 and 0.28 lists read).
V2_RUNNER_ARCHITECTURES_0_22 = frozenset({"Qwen3ForCausalLM"})
V2_RUNNER_ARCHITECTURES_0_24 = frozenset({"Qwen3ForCausalLM", "DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM",
                                          "GraniteMoeForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"})
V2_RUNNER_ARCHITECTURES_0_25 = frozenset({"DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM"})
V2_RUNNER_ARCHITECTURES_0_27 = V2_RUNNER_ARCHITECTURES_0_25 | {
    "InklingForCausalLM", "InklingForConditionalGeneration", "KimiK3ForConditionalGeneration",
    "LongcatFlashNgramForCausalLM"}
V2_RUNNER_ARCHITECTURES_0_28 = V2_RUNNER_ARCHITECTURES_0_27 | {"DeepseekV4ForCausalLM"}

#: HF config keys vLLM reads for the number of experts (vllm/transformers_utils/config.py
#: ``CONFIG_FIELD_ALIASES["num_experts"]``); ``is_moe`` = that number > 0.
NUM_EXPERTS_KEYS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")


def config_is_moe(text_config: dict) -> bool:
    """vLLM's ``ModelConfig.is_moe`` from the (text) HF config dict (first alias present)."""
    for key in NUM_EXPERTS_KEYS:
        val = (text_config or {}).get(key)
        if val:
            if isinstance(val, list):
                val = val[0]
            try:
                return int(val) > 0
            except (TypeError, ValueError):
                return False
    for block in (text_config or {}).get("block_configs") or []:
        if isinstance(block, dict) and block.get("block_type") == "moe" and block.get("n_routed_experts"):
            return True
    return False


def v2_runner_runs_speculative_method(version: "VllmVersion | str", method: str | None) -> bool:
    """Whether Model Runner V2 runs ``speculative_config.method`` in the release, as
    ``VllmConfig._get_v2_model_runner_unsupported_features`` (vllm/config/vllm.py) decides; a
    method it lacks sends the model to the V1 runner. Model-specific MTP names (``deepseek_mtp``,
    ``qwen3_next_mtp``, …) are ``mtp`` (vllm/config/speculative.py ``MTPModelTypes``).
    0.22: eagle, eagle3, mtp; 0.24: + dflash; 0.25–0.29: + dspark; 0.30: all but ngram, ngram_gpu,
    draft_model, suffix, medusa, mlp_speculator, custom_class; 0.31: draft_model allowed; 0.32:
    ngram / ngram_gpu allowed; 0.33: all but suffix and custom_class (0.22, 0.24, 0.25, 0.26,
    0.27, 0.28, 0.29, 0.30, 0.31, 0.32, 0.33 read)."""
    if not method:
        return True
    m = str(method).lower()
    if m.endswith("_mtp"):
        m = "mtp"
    v = version if isinstance(version, VllmVersion) else VllmVersion.parse(str(version))
    if v < (0, 30, 0):
        allowed = {"eagle", "eagle3", "mtp"} | ({"dflash"} if v >= (0, 24, 0) else set()) \
            | ({"dspark"} if v >= (0, 25, 0) else set())
        return m in allowed
    if v >= (0, 34, 0):  # the only runner: every method it has (suffix included, v1/worker/gpu/spec_decode/)
        return True
    refused = {"suffix", "custom_class"}
    if v < (0, 33, 0):
        refused |= {"medusa", "mlp_speculator"}
    if v < (0, 32, 0):
        refused |= {"ngram", "ngram_gpu"}
    if v < (0, 31, 0):
        refused |= {"draft_model"}
    return m not in refused


#: First release running Model Runner V2 for every model by default (vllm/config/vllm.py
#: ``VllmConfig.use_v2_model_runner`` no longer asks ``_is_default_v2_model_runner_model``: 0.29.0;
#: dated 0.30 before the release-by-release audit).
EVERY_MODEL_V2_SINCE = (0, 29, 0)
#: Architectures ROCm keeps on the V1 runner (``ROCM_DEFAULT_MRV1_ARCHITECTURES``, vllm/config/vllm.py):
#: 0.29 two, 0.30–0.31 three; gone in 0.32.
ROCM_V1_RUNNER_ARCHITECTURES_0_29 = frozenset({"DeepseekV32ForCausalLM", "DeepseekV4ForCausalLM"})
ROCM_V1_RUNNER_ARCHITECTURES_0_30 = ROCM_V1_RUNNER_ARCHITECTURES_0_29 | {"GlmMoeDsaForCausalLM"}


def uses_model_runner_v2(era: Era, architectures, *, is_moe: bool, is_hybrid: bool = False,
                         is_attention_free: bool = False, is_quantized: bool = False,
                         generate: bool = True, speculative_method: str | None = None,
                         platform: str = "cuda") -> bool:
    """Whether the release runs Model Runner V2 (vllm/v1/worker/gpu/model_runner.py) by default.

    ``VllmConfig.use_v2_model_runner`` / ``_is_default_v2_model_runner_model`` (vllm/config/vllm.py):
    * ≤0.21 (0.20 read): opt-in only (``VLLM_USE_V2_MODEL_RUNNER=1``);
    * 0.22–0.23: ``Qwen3ForCausalLM``, not MoE, not quantized;
    * 0.24: architecture in a six-entry list;
    * 0.25–0.27: listed architecture or not MoE; never hybrid (Mamba) or attention-free;
    * 0.28: as 0.25, hybrid allowed when the architecture is listed;
    * 0.29–0.33 (:data:`EVERY_MODEL_V2_SINCE`): every model (unless a feature it lacks is
      configured); on ROCm (``platform``) 0.29–0.31 keep ``ROCM_DEFAULT_MRV1_ARCHITECTURES`` on V1;
    * 0.34+: every model — the V1 runner is removed (vllm/platforms/interface.py
      ``validate_environ``: "Model Runner V1 has been removed").
    Pooling models (``generate=False``) stay on V1 before 0.30. A ``speculative_method`` V2 lacks
    in the release (:func:`v2_runner_runs_speculative_method`) keeps the V1 runner.
    """
    v = era.version
    archs = set(architectures or ())
    if era.engine != "V1" or v < (0, 22, 0):
        return False
    if v >= (0, 34, 0):  # vllm/v1/worker/gpu_model_runner.py is gone: "Model Runner V1 has been removed"
        return True
    if not v2_runner_runs_speculative_method(v, speculative_method):
        return False
    if v >= EVERY_MODEL_V2_SINCE:
        if platform == "rocm" and v < (0, 32, 0):
            rocm_v1 = ROCM_V1_RUNNER_ARCHITECTURES_0_29 if v < (0, 30, 0) else ROCM_V1_RUNNER_ARCHITECTURES_0_30
            return not (archs & rocm_v1)
        return True
    if not generate:
        return False
    if v < (0, 24, 0):
        return bool(archs & V2_RUNNER_ARCHITECTURES_0_22) and not is_moe and not is_quantized
    if v < (0, 25, 0):
        return bool(archs & V2_RUNNER_ARCHITECTURES_0_24)
    listed = bool(archs & (V2_RUNNER_ARCHITECTURES_0_25 if v < (0, 27, 0) else
                           V2_RUNNER_ARCHITECTURES_0_27 if v < (0, 28, 0) else V2_RUNNER_ARCHITECTURES_0_28))
    if is_hybrid and (v < (0, 28, 0) or not listed):
        return False
    if is_attention_free:
        return False
    return listed or not is_moe


def tp_all_reduce_out_of_place(version: str | VllmVersion) -> bool:
    """Whether the release's tensor-parallel all-reduce of an ``[N, H]`` profile activation
    returns a new tensor (vllm/distributed/parallel_state.py ``GroupCoordinator.all_reduce``).

    0.6.5+ (0.6.5, 0.6.6, 0.7.0, 0.7.3, 0.8.0, 0.8.4, 0.19 read): always out of place —
    ``torch.ops.vllm.all_reduce`` → ``_all_reduce_out_place``: custom all-reduce, else pynccl
    ``out_tensor = torch.empty_like(in_tensor)`` (0.7.3+ through ``CudaCommunicator.all_reduce``;
    later also symmetric memory and FlashInfer, all out of place). 0.6.4: out of place only
    through custom all-reduce when ``should_custom_ar`` (inputs under its 8 MiB ``max_size``),
    else ``inplace_all_reduce`` (pynccl / torch.distributed in place), so every profile-sized
    activation is reduced in place."""
    return VllmVersion.parse(version) >= (0, 6, 5)


def resolve_dtype(requested: str, config_dtype: str) -> str:
    """The model dtype vLLM runs (``ModelConfig.dtype``): ``auto`` → bfloat16 for bf16
    checkpoints, float16 for fp16 and fp32 checkpoints; an explicit dtype wins."""
    if requested and requested != "auto":
        return requested
    return "bfloat16" if config_dtype == "bfloat16" else "float16"

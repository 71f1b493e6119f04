"""One simulated (or real-CPU) profile pass: build the rank's module, run vLLM's dummy batch,
track live bytes, return the peaks. Worker side (imports torch).

A simulated pass runs on ``meta`` tensors (shapes, dtypes and storages without memory; torch's
meta kernels, the same ones ``FakeTensorMode`` runs underneath, without its per-op Python layer);
a pass that fails on meta tensors (an op without a meta kernel, a plugin that needs fake-tensor
semantics) is run again under ``FakeTensorMode``, which was the only mode before and gives the
same figures wherever both run (every example drop and visible case, compared in the tests).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tuner.memory.budget import persistent_bytes
from tuner.memory.eras import SAMPLER_V1_FLASHINFER, SAMPLER_V1_SORT, Era, ProfileBatch, sampler_family
from tuner.model.plugin import RankSettings
from tuner.model.simulate.sampler import run_dummy_sampler
from tuner.model.simulate.tracker import MemoryTracker
from tuner.model.torch_lean import lean_symbolic_shapes


@dataclass(frozen=True)
class PassResult:
    """Peaks of one profile pass on one rank (bytes, ints; ``elapsed_s`` in seconds).

    ``activation_peak_bytes`` is vLLM's torch peak increase: the highest live bytes allocated
    during the forward and the dummy sampler run, above what existed before the pass.
    """

    max_num_batched_tokens: int
    num_reqs: int
    pp_rank: int
    weights_bytes: int
    activation_peak_bytes: int
    forward_peak_bytes: int
    sampler_peak_bytes: int
    elapsed_s: float
    #: Model-runner buffers allocated after the start-up snapshot that V1 0.27+ charges through
    #: ``total_consumed`` (:func:`tuner.memory.budget.runner_persistent_bytes`); included in
    #: ``activation_peak_bytes``. 0 in earlier eras.
    persistent_bytes: int = 0
    #: The pass ran Model Runner V2's profile (:func:`tuner.memory.eras.uses_model_runner_v2`).
    model_runner_v2: bool = False
    #: Tokens of the largest multimodal item of the tower the pass built (vLLM's
    #: ``get_mm_max_tokens_per_item``, :func:`tuner.model.simulate.vision.max_tokens_per_item`);
    #: 0 without a profiled tower (text-only, every modality limited to 0, a weights-only tower).
    #: Read by the encoder-budget refusal (:func:`tuner.memory.engine_checks.check_chunked_mm_input`).
    mm_max_tokens_per_item: int = 0
    #: The job's assumptions whose other value was computed, as this pass changes under each
    #: (:meth:`tuner.jobs.job.Passes.alternatives_for`: weights and activation deltas); set by the
    #: job, never by a pass, and left out of the pass's row.
    assumed_alternatives: tuple = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        if not d["assumed_alternatives"]:
            del d["assumed_alternatives"]
        return d


def run_pass(plugin, spec, settings: RankSettings, era: Era, batch: ProfileBatch, *, fake: bool = True,
             num_sms: int = 132, model_runner_v2: bool = False, models: "ModelCache | None" = None) -> PassResult:
    """Run one profile pass of ``plugin``'s module for ``spec`` on one rank.

    Args:
        fake: simulate without memory (``meta`` tensors, ``FakeTensorMode`` where they fail; see
            the module docstring); ``False`` runs real CPU tensors (small models only; used to
            check the simulated pass).
        num_sms: the GPU's streaming multiprocessors (sizes the Triton sampler scratch).
        model_runner_v2: the release profiles with Model Runner V2 (its sampler and buffers).
        models: a :class:`ModelCache` shared by the passes of one job: the module (and its
            weights bytes) is built once and reused by later passes that differ only in the
            batch, where that gives the same figures (see :class:`ModelCache`). None builds a
            fresh module for this pass.
    """
    from tuner.errors import TunerError

    cache = models if models is not None else ModelCache(enabled=False)
    if not fake:
        return _run_pass(cache, plugin, spec, settings, era, batch, REAL, num_sms, model_runner_v2)
    if cache.meta and not cache.meta_failed(plugin, spec, settings):
        try:
            return _run_pass(cache, plugin, spec, settings, era, batch, META, num_sms, model_runner_v2)
        except TunerError:
            raise
        except Exception:  # needs fake-tensor semantics: the FakeTensorMode pass decides
            cache.note_meta_failure(plugin, spec, settings)
    return _run_pass(cache, plugin, spec, settings, era, batch, FAKE, num_sms, model_runner_v2)


def _run_pass(cache: "ModelCache", plugin, spec, settings: RankSettings, era: Era, batch: ProfileBatch, backend: str,
              num_sms: int, model_runner_v2: bool) -> PassResult:
    t0 = time.perf_counter()
    n, r = batch.max_num_batched_tokens, batch.num_reqs
    built = cache.take(plugin, spec, settings, backend=backend)
    with torch.no_grad(), built.context():
        model, weights = built.model, built.weights_bytes
        mm_tokens = mm_max_tokens_per_item(model, settings)
        input_ids = torch.zeros(n, dtype=torch.long)
        positions = torch.zeros(n, dtype=torch.long)
        first = settings.pp_rank == 0
        last = settings.pp_rank == settings.pipeline_parallel_size - 1
        intermediate = None
        with MemoryTracker() as tracker:
            if not first:
                # Non-first stages receive N-token hidden states and residuals; the runner makes
                # this buffer on its first dummy run, i.e. inside the profile
                # (vllm/v1/worker/gpu_model_runner.py _dummy_run, make_empty_intermediate_tensors).
                p = next(model.parameters())
                intermediate = (torch.empty(n, spec.hidden_size, dtype=p.dtype),
                                torch.empty(n, spec.hidden_size, dtype=p.dtype))
            out = model(input_ids, positions, intermediate)
            forward_peak = tracker.peak_bytes
            if settings.dtype in ("float32", "float") and era.engine == "V1" and era.compiled:
                forward_peak += int(forward_peak * FP32_COMPILED_FORWARD_EXTRA)
            before_sampler = tracker.live_bytes
            tracker.reset_peak()
            if last:
                family = sampler_family(era, model_runner_v2=model_runner_v2, flashinfer=settings.flashinfer_sampler)
                if getattr(settings, "platform", "cuda") == "rocm" and family == SAMPLER_V1_FLASHINFER:
                    # FlashInfer's top-k/top-p is CUDA-only (vllm/v1/sample/ops/topk_topp_sampler.py
                    # ``TopKTopPSampler.__init__``: ``current_platform.is_cuda()``, 0.8–0.16): ROCm sorts
                    family = SAMPLER_V1_SORT
                run_dummy_sampler(family, model, out, num_reqs=r, num_sms=num_sms, version=era.version.key)
            sampler_peak = tracker.peak_bytes - before_sampler
            del out
        peak = max(forward_peak, before_sampler + sampler_peak)
    del model, input_ids, positions, intermediate
    cache.give_back(built)
    # the one term that depends on max_model_len; the pass memo recomputes it the same way
    persistent = persistent_bytes(era, spec, settings, batch, model_runner_v2)
    return PassResult(n, r, settings.pp_rank, weights, int(peak) + persistent, int(forward_peak), int(sampler_peak),
                      round(time.perf_counter() - t0, 4), persistent, bool(model_runner_v2), mm_tokens)


def mm_max_tokens_per_item(model, settings) -> int:
    """The largest item's tokens of ``model``'s vision tower (a
    :class:`~tuner.model.simulate.vision.MultimodalCausalLM`'s, after
    :func:`~tuner.model.simulate.vision.drop_unbuilt_towers`), 0 where there is none to profile: no
    tower, a tower whose encoder pass is not simulated, or every modality it serves limited to 0
    (vLLM's budget counts non-zero modalities only, ``get_max_tokens_per_item_by_nonzero_modality``)."""
    from tuner.model.simulate.vision import max_tokens_per_item, mm_limit

    vision = getattr(model, "vision", None)
    tower = getattr(vision, "tower", None)
    if vision is None or tower is None:
        return 0
    modalities = getattr(tower, "MODALITIES", ("image",))
    if all(mm_limit(settings, m) == 0 for m in modalities):
        return 0
    try:
        return int(max_tokens_per_item(vision.vc, kind=tower, top=vision.top)[0])
    except ValueError:  # a weights-only tower (gemma4): no encoder profile, nothing known
        return 0


#: A fit, not derived: a float32 model's compiled V1 forward holds this fraction more than the
#: memory-equivalent module (whose float32 peak is exactly twice its 16-bit one). Fitted on the one
#: visible float32 start-up (vLLM 0.19.0, H100, Llama-3.1-8B, N 8192: torch peak increase 2.21 GiB
#: where the module's forward gives 1.81 + 0.03 cuBLAS workspace; its bf16 / fp16 twins match within
#: 0.01 GiB). Reading 0.19 found no float32-only buffer in the profile run (attention is skipped,
#: TRITON_ATTN being the backend that takes float32; the sampler's ``logits.to(float32)`` is a
#: no-op), so the extra is taken to be the compiled graph's (inductor buffers of the float32 graph)
#: and scaled with the forward. Applies to V1 compiled runs only (not ``enforce_eager``, not V0).
FP32_COMPILED_FORWARD_EXTRA = 0.205

#: The :class:`~tuner.model.plugin.RankSettings` fields that change from one pass of a job to the next
#: (the profile batch); a module whose build never reads them is reused across those passes.
BATCH_FIELDS = ("max_num_batched_tokens", "max_num_seqs")


#: How a pass's tensors exist: ``meta`` tensors, ``FakeTensorMode`` fake tensors, real CPU tensors.
META, FAKE, REAL = "meta", "fake", "real"


@dataclass
class BuiltModel:
    """A rank's module, how its tensors exist (:data:`META` / :data:`FAKE` / :data:`REAL`; the
    ``FakeTensorMode`` its fake tensors belong to) and its weights bytes
    (:meth:`~tuner.model.plugin.ModelPlugin.weights_bytes`)."""

    key: tuple
    backend: str
    mode: Any
    model: Any
    weights_bytes: int
    #: The build read a :data:`BATCH_FIELDS` setting: valid for that batch only.
    batch_dependent: bool
    #: :func:`module_state` right after the build.
    state: tuple
    #: The plugin and spec the key names by ``id`` (kept alive so that no id is reused).
    owner: tuple = ()

    def context(self) -> Any:
        """The context a pass of this module runs in: new tensors on ``meta``, in the fake mode,
        or plain CPU tensors."""
        if self.backend == META:
            return _meta_context()
        return self.mode if self.mode is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _meta_context():
    """New tensors on ``meta``; torch's meta kernels without sympy (:mod:`tuner.model.torch_lean`)."""
    with lean_symbolic_shapes(), torch.device("meta"):
        yield


class ModelCache:
    """The modules one job builds, kept for its later passes (V0 without chunked prefill runs one
    pass per ``max_model_len``; every pass of a job has the same model, layout and release, only
    the batch changes).

    A module is reused only where a fresh build would give the same pass, checked rather than
    assumed: the build must not read a :data:`BATCH_FIELDS` setting (reads are recorded; such a
    module is kept for its own batch only), and the pass must leave the module as it was built
    (:func:`module_state` compared after every pass; a module that keeps something from its
    forward — an encoder cache, a rotary table built on the first call — is dropped and the next
    pass builds afresh). ``enabled=False`` builds for every pass (the behaviour without a cache);
    ``meta=False`` simulates under ``FakeTensorMode`` only (with ``enabled=False``: the passes as
    they ran before meta tensors and reuse, kept for the tests that compare both).
    """

    def __init__(self, *, enabled: bool = True, meta: bool = True) -> None:
        self.enabled = enabled
        self.meta = meta
        self._free: dict[tuple, BuiltModel] = {}
        self._meta_failed: set[tuple] = set()
        self.builds = 0
        self.reuses = 0

    @staticmethod
    def _key(plugin: Any, spec: Any, settings: RankSettings, backend: str, batch: bool) -> tuple:
        fields = dataclasses.asdict(settings) if dataclasses.is_dataclass(settings) else {"settings": id(settings)}
        if not batch:
            fields = {k: v for k, v in fields.items() if k not in BATCH_FIELDS}
        return (id(plugin), id(spec), backend, batch, tuple(sorted(fields.items(), key=lambda kv: kv[0])))

    def meta_failed(self, plugin: Any, spec: Any, settings: RankSettings) -> bool:
        """A pass of this module failed on ``meta`` tensors in this job (later ones go to fake)."""
        return self._key(plugin, spec, settings, META, False) in self._meta_failed

    def note_meta_failure(self, plugin: Any, spec: Any, settings: RankSettings) -> None:
        self._meta_failed.add(self._key(plugin, spec, settings, META, False))
        for key in [k for k in self._free if k[:3] == (id(plugin), id(spec), META)]:
            del self._free[key]

    def take(self, plugin: Any, spec: Any, settings: RankSettings, *, backend: str) -> BuiltModel:
        """The module for this pass: a kept one that fits, else a new build."""
        for batch in (False, True):
            built = self._free.pop(self._key(plugin, spec, settings, backend, batch), None)
            if built is not None and module_state(built.model) == built.state:  # its last pass left it as built
                self.reuses += 1
                return built
        mode = None
        if backend == FAKE:
            from torch._subclasses.fake_tensor import FakeTensorMode

            mode = FakeTensorMode(allow_non_fake_inputs=True)
        recorder = _BatchReads.wrap(settings) if dataclasses.is_dataclass(settings) else settings
        built = BuiltModel((), backend, mode, None, 0, True, ())
        from tuner.memory.allocator import weights_rounding_bytes
        from tuner.memory.eras import tp_all_reduce_out_of_place
        from tuner.model.simulate.layers import mark_tp_all_reduce
        from tuner.model.simulate.moe import expert_layout

        with torch.no_grad(), built.context():
            with expert_layout(settings.tensor_parallel_size, getattr(settings, "data_parallel_size", 1),
                               getattr(settings, "enable_expert_parallel", False)):
                model = plugin.build_model(spec, recorder)
            from tuner.model.simulate.vision import bind_decoder_limits, drop_unbuilt_towers

            drop_unbuilt_towers(model, settings)  # --limit-mm-per-prompt 0 / --language-model-only
            bind_decoder_limits(model, recorder)  # the encoder profile's items, bounded by max_num_seqs
            if settings.tensor_parallel_size > 1 and tp_all_reduce_out_of_place(settings.engine_version):
                mark_tp_all_reduce(model)
            weights = int(plugin.weights_bytes(spec, recorder, model))
            if settings.runs_attention:
                # V0 (no calibrated reserve there): the caching allocator's rounding of the weights
                weights += weights_rounding_bytes(model)
        batch = recorder is settings or _BatchReads.seen()
        self.builds += 1
        return BuiltModel(self._key(plugin, spec, settings, backend, batch), backend, mode, model, weights, batch,
                          module_state(model), (plugin, spec))

    def give_back(self, built: BuiltModel) -> None:
        """Keep ``built`` for a later pass; :meth:`take` reuses it only if its pass left it as
        built (checked there, when a pass asks for it: a job's last pass is never fingerprinted
        twice — nothing touches a kept module in between, so the check gives what it gave here)."""
        if self.enabled:
            self._free[built.key] = built


class _BatchReads:
    """Copies of a :class:`~tuner.model.plugin.RankSettings` that record reads of
    :data:`BATCH_FIELDS` (a subclass, so ``isinstance`` and ``dataclasses.replace`` work as on
    the original; a copy made from a copy records too). One build at a time: :meth:`wrap`
    clears the record."""

    _classes: dict[type, type] = {}
    reads: list[str] = []

    @classmethod
    def wrap(cls, settings: RankSettings) -> RankSettings:
        base = type(settings)
        sub = cls._classes.get(base)
        if sub is None:
            reads = cls.reads

            def __getattribute__(self, name, _get=object.__getattribute__):
                if name in BATCH_FIELDS:
                    reads.append(name)
                return _get(self, name)

            sub = type(base.__name__, (base,), {"__getattribute__": __getattribute__, "__module__": base.__module__,
                                                "__qualname__": base.__qualname__})
            cls._classes[base] = sub
        copy = sub(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)})
        cls.reads.clear()
        return copy

    @classmethod
    def seen(cls) -> bool:
        return bool(cls.reads)


_SCALARS = frozenset({int, float, complex, str, bytes, bool, type(None)})
_SEQUENCES = frozenset({list, tuple})


#: ``dict`` and ``OrderedDict`` exactly (what a module's ``__dict__`` and its hook / parameter
#: tables are): no tensor, module or class is one, so :func:`_ident` takes them first.
_MAPPINGS = frozenset({dict, collections.OrderedDict})
_BY_ID = (torch.Tensor, torch.nn.Module, type)


def _ident(value: Any, depth: int = 0) -> Any:
    """What identifies ``value`` for :func:`module_state`: scalars by value, containers by their
    items, plain objects by their attributes (three levels), everything else (tensors, modules,
    dtypes, functions) by identity. (Scalar items and empty tables are taken in place, without a
    call: the same values in about half the time.)"""
    t = type(value)
    if t in _SCALARS:
        return value
    if depth > 2:
        return id(value)
    if t in _MAPPINGS:
        if not value:
            return id(value)
        d, scalars, mappings, items = depth + 1, _SCALARS, _MAPPINGS, []
        for k, v in value.items():
            tv = type(v)
            if tv in scalars:
                items.append((k, v))
            elif tv in mappings and not v:  # an empty table (a module's hooks): by identity, at any depth
                items.append((k, id(v)))
            else:
                items.append((k, _ident(v, d)))
        return (id(value), tuple(items))
    if isinstance(value, _BY_ID):
        return id(value)
    if t in _SEQUENCES:
        if not value:
            return (id(value), 0)
        d, scalars = depth + 1, _SCALARS
        return (id(value), tuple([v if type(v) in scalars else _ident(v, d) for v in value]))
    if isinstance(value, dict):
        return (id(value), tuple([(k, _ident(v, depth + 1)) for k, v in value.items()])) if value else id(value)
    if isinstance(value, (set, frozenset)):
        return (id(value), frozenset(map(id, value)))
    if hasattr(value, "__dict__") and not callable(value):
        return (id(value), tuple([(k, _ident(v, depth + 1)) for k, v in vars(value).items()]))
    return id(value)


def module_state(model: Any) -> tuple:
    """A fingerprint of every attribute binding of ``model`` and its submodules (parameters,
    buffers, submodules, plain attributes, the items of their containers): equal before and after a
    pass when the pass left nothing behind in the module."""
    return tuple((name, _ident(vars(m))) for name, m in model.named_modules(remove_duplicate=False))

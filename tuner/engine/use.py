"""How a profile job uses the engine adapter (worker side; vLLM imported only through
:mod:`tuner.engine.adapter`, and only when importable).

Three uses, decided per job by :func:`engine_for_job`:

(a) an architecture no plugin serves: KV specs and weights come from the engine (the model built
    on ``meta``), the activation peak from vLLM's own ``_dummy_run`` + ``_dummy_sampler_run``
    traced under fake tensors (:mod:`tuner.engine.trace`, source ``engine-trace``); where the
    trace cannot run, from the generic plugin's simulated decoder, marked
    ``plugin(generic, approximate)``, with a warning naming why;
(b) every architecture: the plugin's KV specs are checked against the engine's — at the drop's
    release when the installed one matches it, else the plugin at the installed release (a
    difference the plugin explains by a version rule is not a disagreement); where they disagree
    the engine's specs are used and the difference is printed;
(c) the drop's settings go through vLLM's own argument checks (``create_engine_config``); a
    refusal is an invalid drop naming the field.

After the search :func:`verify_proposals` sizes each proposal's available KV bytes with vLLM's
``kv_cache_utils`` and records the blocks next to ctx-tuner's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tuner.engine import crosscheck
from pathlib import Path

from tuner.errors import DropError, EngineError, ModelConfigError


@dataclass
class EngineUse:
    """What the engine decided for one job."""

    report: dict = field(default_factory=dict)
    kv_specs: dict | None = None  # tuner.memory.kvcache specs to use instead of the plugin's (one stage)
    plugin: Any = None  # the plugin to run (a wrapper for an unserved architecture)
    weights: bool = False  # weights come from the engine
    approximate_activation: bool = False
    warnings: list = field(default_factory=list)
    session: Any = None
    #: the activation peak is traced from vLLM's own profile run (:meth:`run_pass`)
    trace_activation: bool = False
    #: a trace ran (and gave the activation of at least one pass)
    traced: bool = False
    #: the engine's scheduler defaults a stored cross-check applies (:func:`tuner.engine.stored.use_from_record`)
    stored_defaults: dict = field(default_factory=dict)
    #: ``(build, settings, entry point)`` of a cross-check that ran in this job, to be stored (tuner.jobs.job)
    record_for: Any = None

    @property
    def live(self) -> bool:
        """The engine itself (an open session) takes part in the job, not a stored cross-check."""
        return self.session is not None

    def approximate_parts(self) -> list:
        """The kernel-dependent parts every trace of the job met (sorted, unique)."""
        return sorted({p for t in self.report.get("trace", []) for p in t.get("approximate", [])})

    def run_pass(self, plugin: Any, spec: Any, settings: Any, era: Any, batch: Any, **kw: Any) -> Any:
        """One profile pass with :func:`tuner.model.simulate.profile.run_pass`'s signature and result:
        vLLM's own profile run traced (:func:`tuner.engine.trace.trace_profile_run`) for the
        batch, the engine's weights, the era's persistent runner buffers (as a simulated pass
        adds them) and the margin of the kernel-dependent parts met; where the trace cannot run,
        the plugin's simulated pass, with a warning (once) and ``plugin(generic, approximate)``."""
        from tuner.model.simulate.profile import run_pass

        if not self.trace_activation or self.session is None:
            return run_pass(plugin, spec, settings, era, batch, **kw)
        from tuner.engine.trace import EngineTraceUnavailable

        try:
            return traced_pass(self, spec, settings, era, batch, model_runner_v2=bool(kw.get("model_runner_v2")))
        except EngineTraceUnavailable as exc:
            self.trace_activation = False
            self.approximate_activation = True
            entry = {"error": str(exc)}
            if getattr(exc, "signal_name", None):  # tuner.engine.isolate.EngineTraceCrashed: the crash, named
                entry["crash"] = exc.signal_name
            self.report.setdefault("trace", []).append(entry)
            self.warnings.append(f"engine-trace not run ({exc}); activation peak approximated by the generic "
                                 "decoder's simulated forward (approximate)")
            return run_pass(plugin, spec, settings, era, batch, **kw)


class EnginePlugin:
    """Serves an architecture no plugin declares, from the engine: KV specs and weights of vLLM's
    own model; the module for the activation peak is the generic decoder's (approximate)."""

    def __init__(self, generic: Any, specs: dict, weights_bytes: int, tp: int, architectures: tuple) -> None:
        self.name = "engine"
        self.architectures = architectures
        self._generic, self._specs, self._weights, self._tp = generic, specs, int(weights_bytes), tp

    def config_defaults(self, top: dict) -> dict:
        return self._generic.config_defaults(top)

    def kv_cache_spec(self, spec: Any, settings: Any) -> dict:
        if settings.tensor_parallel_size != self._tp:  # a TP-1 probe of the head layout
            return self._generic.kv_cache_spec(spec, settings)
        return dict(self._specs)

    def build_model(self, spec: Any, settings: Any):
        return self._generic.build_model(spec, settings)

    def weights_bytes(self, spec: Any, settings: Any, module: Any) -> int:
        return self._weights


def engine_settings(d: dict, *, block_size: int, multimodal: bool, trust_remote_code: bool):
    from tuner.engine.adapter import EngineSettings

    from tuner.question.protocol import drop_from_wire

    unchunked = d.get("enable_chunked_prefill") is False
    grid = drop_from_wire(d, strict=False).candidates.max_model_len or []
    return EngineSettings(
        dtype=d.get("dtype", "auto"), kv_cache_dtype=d.get("kv_cache_dtype", "auto"), quantization=d.get("quantization"),
        tensor_parallel_size=int(d.get("tensor_parallel_size", 1)),
        max_model_len=max(grid) if (unchunked and grid) else None,
        max_num_batched_tokens=d.get("max_num_batched_tokens"), max_num_seqs=d.get("max_num_seqs"),
        enable_chunked_prefill=d.get("enable_chunked_prefill"), block_size=int(block_size), multimodal=multimodal,
        trust_remote_code=trust_remote_code, hf_overrides=d.get("hf_overrides") or None)


def gpu_block_size(d: dict, plugin_specs: dict | None) -> int:
    """The block size a GPU engine of the drop's release starts from: the drop's, else the
    plugin's attention block (MLA backends choose theirs), else vLLM's CUDA default 16. Hybrid
    models start from 16 too; ``update_block_size_for_backend`` raises it."""
    from tuner.memory.kvcache import MambaSpec

    if d.get("block_size"):
        return int(d["block_size"])
    if plugin_specs and not any(isinstance(s, MambaSpec) for s in plugin_specs.values()):
        return int(next(iter(plugin_specs.values())).block_size)
    return 16


def engine_for_job(*, d: dict, model_dir: str, spec: Any, plugin: Any, unserved: bool, era: Any,
                   plugin_specs: dict | None, plugin_specs_at: Any, reference_bytes: int,
                   trust_remote_code: bool = False, opener: Any = None) -> EngineUse:
    """Open one engine session and decide its uses (see the module docstring).

    ``plugin_specs_at(version)`` gives the plugin's specs for another release (the cross-check
    when the installed release differs). ``opener`` replaces :func:`tuner.engine.adapter.open_session`
    in tests.

    Raises:
        DropError: vLLM refuses a setting the drop gives (its message, the field); a refusal of a
            setting the drop leaves to the checkpoint (a partial config.json) is a warning, or for
            an unserved architecture a ModelConfigError.
        EngineError: the engine cannot build the model (for a served architecture the job goes on
            with the plugin and a warning instead).
    """
    from tuner.memory.eras import parse_version

    if opener is None:
        from tuner.engine.adapter import open_session as opener
    use = EngineUse(plugin=plugin)
    bs = gpu_block_size(d, None if unserved else plugin_specs)
    es = engine_settings(d, block_size=bs, multimodal="text_config" in spec.top, trust_remote_code=trust_remote_code)
    try:
        session = opener(model_dir, es, path=d.get("path"))
    except DropError as exc:
        if exc.field and exc.field != "model" and d.get(exc.field) is not None:
            raise  # vLLM refuses a setting the drop gives: an invalid drop
        # the refusal concerns the checkpoint's own config (e.g. a partial config.json)
        if unserved:
            raise ModelConfigError(f"vLLM refuses the model config: {exc.message}",
                                   where=str(Path(model_dir) / "config.json")) from exc
        use.warnings.append(f"engine cross-check skipped: vLLM refuses the model config ({exc.message})")
        use.report.update(error=exc.message)
        return use
    use.session = session
    rep = use.report
    rep["release"] = session.version
    rep["drop_release"] = str(d.get("engine_version"))
    same = _same_release(session.version, str(d.get("engine_version")))
    rep["releases_match"] = same
    if not same:
        use.warnings.append(f"installed vLLM {session.version} differs from the drop's engine_version "
                            f"{d.get('engine_version')}: structure, KV specs and weights layout come from "
                            f"{session.version}; defaults and the budget formula follow {d.get('engine_version')}")
    rep["config"] = session.config_report()
    try:
        raw = session.kv_cache_specs()
        weights = session.weights()
    except EngineError as exc:
        if unserved:
            raise
        use.warnings.append(f"engine cross-check skipped: {exc}")
        rep["error"] = str(exc)
        rep["timings"] = dict(session.timings)
        return use
    rep["weights"] = weights
    rep["notes"] = list(session.notes)
    try:
        eng = crosscheck.to_tuner_specs(raw)
    except crosscheck.UnconvertibleSpec as exc:
        rep["error"] = f"engine specs not comparable: {exc}"
        use.warnings.append(f"engine cross-check skipped: {exc}")
        if unserved:
            raise EngineError(f"vLLM {session.version} gives a KV spec ctx-tuner cannot size: {exc}",
                              where=model_dir) from exc
        rep["timings"] = dict(session.timings)
        return use
    version = str(era.version)
    n = int(d.get("max_num_batched_tokens") or 8192)
    if unserved:
        rep["check"] = crosscheck.compare(None, eng, version=version, reference_bytes=reference_bytes,
                                          block_size=bs, max_num_batched_tokens=n)
        use.kv_specs = eng
        use.weights = True
        use.trace_activation = True
        tp = int(d.get("tensor_parallel_size", 1))
        use.plugin = EnginePlugin(plugin, eng, weights["bytes"], tp, tuple(spec.architectures))
        use.warnings.append(f"no plugin serves {', '.join(spec.architectures)}: KV specs and weights from vLLM "
                            f"{session.version}; activation peak traced from vLLM's own profile run (engine-trace)")
        rep["decision"] = "engine (no plugin)"
    else:
        against = plugin_specs if same else plugin_specs_at(session.version)
        chk = crosscheck.compare(against, eng, version=session.version if not same else version,
                                 reference_bytes=reference_bytes, block_size=bs, max_num_batched_tokens=n)
        chk["plugin_release"] = version if same else session.version
        rep["check"] = chk
        if chk["agree"]:
            rep["decision"] = "plugin (engine agrees)" if same else \
                f"plugin at {version} (engine {session.version} agrees with the plugin at {session.version})"
        else:
            use.kv_specs = eng
            rep["decision"] = "engine (plugin disagrees)"
            use.warnings.append(f"engine and plugin {plugin.name} disagree on the KV cache ("
                                + "; ".join(chk["differences"]) + f"); the engine's specs (vLLM {session.version}) "
                                "are used")
    rep["timings"] = dict(session.timings)
    return use


def _same_release(a: str, b: str) -> bool:
    from tuner.memory.eras import VllmVersion

    import re

    def key(text: str):
        m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", str(text).strip())
        return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None

    return key(a) is not None and key(a) == key(b)


def verify_proposals(use: EngineUse, proposals: list[dict], available_at: Any) -> None:
    """vLLM's ``kv_cache_utils`` on each proposal's available KV bytes (``available_at(u, M)``,
    ctx-tuner's budget) and length: ``use.report["proposals"]``, one entry per proposal with the
    engine's and ctx-tuner's blocks (where the job used the plugin's specs at another release
    than the installed one, a difference is that release's rule, not a disagreement)."""
    if use.session is None or "check" not in use.report:
        return
    from tuner.question.protocol import ProposalResult

    out = []
    for p in map(ProposalResult.from_wire, proposals):
        m = p.max_model_len
        if not m:
            continue
        avail = available_at(p.gpu_memory_utilization, int(m))
        if avail is None:
            continue
        e = use.session.kv_sizing(int(avail), int(m))
        out.append({"gpu_memory_utilization": p.gpu_memory_utilization, "max_model_len": int(m),
                    "available_kv_cache_bytes": int(avail), "ctx_tuner_num_gpu_blocks": p.num_gpu_blocks,
                    "engine": e, "agree": e.get("num_gpu_blocks") == p.num_gpu_blocks})
    use.report["proposals"] = out


def traced_pass(use: EngineUse, spec: Any, settings: Any, era: Any, batch: Any, *, model_runner_v2: bool) -> Any:
    """A :class:`tuner.model.simulate.profile.PassResult` from vLLM's traced profile run (see
    :meth:`EngineUse.run_pass`); the trace's details go to ``use.report["trace"]``.

    Raises:
        EngineTraceUnavailable: the trace cannot run here.
    """
    import time

    from tuner.memory.budget import DTYPE_BYTES, runner_persistent_bytes
    from tuner.engine.trace import approximate_margin_bytes, trace_profile_run
    from tuner.model.simulate.profile import PassResult

    from tuner.engine.isolate import run_isolated

    t0 = time.perf_counter()
    n, r = int(batch.max_num_batched_tokens), int(batch.max_num_seqs)
    # in a sacrificial child: a crash of vLLM's code under fake tensors (a SIGSEGV in a compiled
    # kernel) is an EngineTraceCrashed here, and the job falls back (EngineUse.run_pass)
    tr = run_isolated(trace_profile_run, use.session, max_num_batched_tokens=n, max_num_seqs=r,
                      where=getattr(use.session, "model_dir", None) or "engine-trace")
    parts = list(tr["approximate"])
    if model_runner_v2:  # the CPU build has no Model Runner V2 (it needs Triton): V1's sampler traced
        parts.append("Model Runner V2 sampler (the V1 runner's traced)")
    margin = approximate_margin_bytes(tr["forward_peak_bytes"], parts, moe_workspace_bytes=tr.get("moe_workspace_bytes"))
    persistent = runner_persistent_bytes(
        era, model_runner_v2=model_runner_v2, max_num_batched_tokens=n, max_num_seqs=settings.max_num_seqs or r,
        max_model_len=settings.max_model_len or n, hidden_size=int(spec.hidden_size), vocab_size=int(spec.vocab_size),
        dtype_bytes=DTYPE_BYTES.get(settings.dtype, 2), block_size=settings.block_size or 16)
    use.traced = True
    use.report.setdefault("trace", []).append({**tr, "approximate": parts, "margin_bytes": margin,
                                               "persistent_bytes": persistent, "release": use.session.version})
    return PassResult(n, tr["num_reqs"], settings.pp_rank, int(use.plugin.weights_bytes(spec, settings, None)),
                      int(tr["activation_peak_bytes"]) + margin + persistent, int(tr["forward_peak_bytes"]),
                      int(tr["sampler_peak_bytes"]), round(time.perf_counter() - t0, 4), persistent,
                      bool(model_runner_v2))


#: The scheduler defaults compared between the engine and ctx-tuner's era rules.
DEFAULT_KEYS = ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "block_size")
#: Of those, the ones a job takes from the engine when the releases match (the block size is the KV
#: cross-check's; chunked prefill is on in every V1 release unless the drop turns it off).
APPLIED_KEYS = ("max_num_batched_tokens", "max_num_seqs")


def reconcile_defaults(use: EngineUse, *, era_batch: Any, block_size: int, d: dict, device: dict) -> dict:
    """The engine's scheduler defaults for the drop's device (``EngineSession.batch_defaults``)
    next to ctx-tuner's era rules (``era_batch``: :func:`tuner.memory.eras.profile_batch` for the
    drop; ``block_size``: the job's), recorded in ``use.report["defaults"]`` with every
    difference for a key the drop leaves unset (also a warning). When the installed release
    is the drop's, the engine's :data:`APPLIED_KEYS` the drop leaves unset are returned, to be
    used instead of the era rule's; else ``{}`` (the era rules stay: defaults change between
    releases)."""
    if use.session is None or not hasattr(use.session, "batch_defaults"):
        return {}
    try:
        eng = use.session.batch_defaults(device_name=str(device.get("name", "")),
                                         total_memory_bytes=int(device["total_memory_bytes"]),
                                         entry_point=str(d.get("entry_point") or "serve"))
    except Exception as exc:  # a release whose defaults cannot be asked: say so, keep the era rules
        use.report["defaults"] = {"error": f"{type(exc).__name__}: {exc}"}
        return {}
    mine = {"max_num_batched_tokens": int(era_batch.max_num_batched_tokens), "max_num_seqs": int(era_batch.max_num_seqs),
            "enable_chunked_prefill": bool(era_batch.chunked_prefill), "block_size": int(block_size)}
    engine = {k: eng.get(k) for k in DEFAULT_KEYS}
    free = [k for k in DEFAULT_KEYS if d.get(k) is None]
    diffs = [f"{k}: engine {engine[k]}, era rule {mine[k]}" for k in free
             if engine[k] is not None and engine[k] != mine[k]]
    same = bool(use.report.get("releases_match"))
    applied = {k: engine[k] for k in APPLIED_KEYS if k in free and engine[k] is not None and engine[k] != mine[k]} \
        if same and era_batch.chunked_prefill else {}
    use.report["defaults"] = {"engine": engine, "ctx_tuner": mine, "source": eng.get("source"), "differences": diffs,
                              "applied": applied,
                              "rule": "the engine's (same release as the drop)" if same else
                                      f"ctx-tuner's era rules for {d.get('engine_version')} (installed "
                                      f"{use.session.version}: defaults change between releases)"}
    for line in diffs:
        use.warnings.append(f"scheduler default differs from vLLM {use.session.version}'s: {line}; "
                            + ("the engine's is used" if line.split(":")[0] in applied else "the era rule's is used"))
    return applied

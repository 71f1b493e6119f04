"""How a profile job uses the engine adapter (worker side; vLLM imported only through
:mod:`tuner.engine.adapter`, and only when importable).

Three uses, decided per job by :func:`engine_for_job`:

(a) an architecture no plugin serves: KV specs and weights come from the engine (the model built
    on ``meta``), the activation peak from the generic plugin's simulated decoder, marked
    ``plugin(generic, approximate)`` (vLLM's own ``_dummy_run`` is not traced);
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
    kv_specs: dict | None = None  # tuner.kvcache specs to use instead of the plugin's (one stage)
    plugin: Any = None  # the plugin to run (a wrapper for an unserved architecture)
    weights: bool = False  # weights come from the engine
    approximate_activation: bool = False
    warnings: list = field(default_factory=list)
    session: Any = None


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

    from tuner.protocol import drop_from_wire

    unchunked = d.get("enable_chunked_prefill") is False
    grid = drop_from_wire(d, strict=False).candidates.max_model_len or []
    return EngineSettings(
        dtype=d.get("dtype", "auto"), kv_cache_dtype=d.get("kv_cache_dtype", "auto"), quantization=d.get("quantization"),
        tensor_parallel_size=int(d.get("tensor_parallel_size", 1)),
        max_model_len=max(grid) if (unchunked and grid) else None,
        max_num_batched_tokens=d.get("max_num_batched_tokens"), max_num_seqs=d.get("max_num_seqs"),
        enable_chunked_prefill=d.get("enable_chunked_prefill"), block_size=int(block_size), multimodal=multimodal,
        trust_remote_code=trust_remote_code)


def gpu_block_size(d: dict, plugin_specs: dict | None) -> int:
    """The block size a GPU engine of the drop's release starts from: the drop's, else the
    plugin's attention block (MLA backends choose theirs), else vLLM's CUDA default 16. Hybrid
    models start from 16 too; ``update_block_size_for_backend`` raises it."""
    from tuner.kvcache import MambaSpec

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
    from tuner.eras import parse_version

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
        use.approximate_activation = True
        tp = int(d.get("tensor_parallel_size", 1))
        use.plugin = EnginePlugin(plugin, eng, weights["bytes"], tp, tuple(spec.architectures))
        use.warnings.append(f"no plugin serves {', '.join(spec.architectures)}: KV specs and weights from vLLM "
                            f"{session.version}; activation peak approximated by the generic decoder's simulated "
                            "forward (approximate)")
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
    from tuner.eras import VllmVersion

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
    from tuner.protocol import ProposalResult

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

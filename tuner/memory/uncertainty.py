"""What a prediction does not know: a band for every budget term, by its source (DESIGN §5c).

Pure (no torch, no I/O). Every term of a KV budget (:data:`tuner.question.protocol.LEDGER`) carries a lower
and an upper bound in bytes, set by where the term came from:

- **exact** — vLLM's own arithmetic ported (the requested ``T·u`` on a stated device total, the
  KV page sizing, :mod:`tuner.memory.kvcache`) or the installed engine's adapter (``weights`` of the model
  built on ``meta``): no band;
- **simulated** — a plugin's pass of the model under fake tensors (``weights``, ``activation_peak``):
  :data:`WEIGHTS_SIMULATED`, :data:`ACTIVATION_SIMULATED`;
- **traced** — vLLM's own profile run traced with approximate kernels (``engine-trace``) or a
  standard-decoder approximation (``plugin(generic, approximate)``): :data:`ACTIVATION_TRACED`;
- **rule** — a catalog or era rule calibrated on public logs (``non_torch``, ``cuda_graphs``,
  :func:`tuner.memory.budget.non_torch_bytes`, :func:`tuner.memory.budget.cudagraph_estimate_bytes`):
  :data:`CATALOG_RULE`; a device total read from the catalog, not stated: :data:`DEVICE_TOTAL`;
- **fit** — a documented fit: the reserve for unexplained start-up memory
  (:func:`tuner.memory.budget.unexplained_bytes`): :data:`RESERVE_FIT`;
- **not modelled** — an input the product reads but has no rule for (a vLLM argument, case setting
  or environment variable outside the drop, a release that was not stated, a unified-memory
  device whose host use is not stated): :data:`NOT_MODELLED` / :data:`RELEASE_NOT_STATED` of the
  requested memory each, named in the output (:class:`Unmodelled`) with its effect;
- **assumed, alternative computed** — an input neither the record nor the drop states, whose other
  value has a rule (``flashinfer_installed``, ``triton_kernels_installed``: :mod:`tuner.memory.assumed`):
  the point takes what ``pip install`` gets and the band is exactly the other value's effect on the KV,
  one-sided (:class:`Alternative`, :func:`alternative_band`); no not-modelled fraction (both of the
  input's values are computed).

Each band is ``fraction × the term's bytes + floor`` (symmetric); the sizes are fitted by
:func:`tuner.accuracy.uncertainty_fit.fit_bands` — leave-one-out by ``model_family`` over the
high-confidence records of ``shared/cases/vllm-observed.jsonl`` (``python -m tuner.accuracy.uncertainty_fit``
prints them) — never per model, GPU name or case. The bands add linearly (worst case): the
interval on the available KV bytes is ``expected − Σ upward term bands`` … ``expected + Σ downward``
(:func:`kv_interval`); :func:`tuner.memory.search.evaluate` sizes blocks, tokens and concurrency at both
ends with the release's own arithmetic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

GiB = 1 << 30
MiB = 1 << 20

EXACT, SIMULATED, TRACED, RULE, FIT, NOT_MODELLED_SOURCE = ("exact", "simulated", "traced", "rule", "fit",
                                                            "not modelled")
#: The band class of an assumed input whose alternative ctx-tuner computes (:class:`Alternative`): the
#: band is the alternative's exact effect on the KV, one-sided, not a fitted fraction.
ASSUMED_ALTERNATIVE = "assumed (alternative computed)"
#: The risk a proposal is taken at (drop ``constraints.risk``, ``--risk``): ``safe`` — the largest
#: ``max_model_len`` that starts at the interval's safe (low-KV) end; ``expected`` — at the
#: expected value (the point prediction).
RISKS = ("safe", "expected")
DEFAULT_RISK = "safe"


@dataclass(frozen=True)
class SourceBand:
    """The band of one source class: ``fraction`` of the term's bytes plus ``floor_bytes``."""

    source: str
    fraction: float
    floor_bytes: int = 0
    #: where the size comes from (the fit and its data).
    doc: str = ""

    def half_width(self, nbytes: int) -> int:
        if self.fraction == 0 and self.floor_bytes == 0:
            return 0
        return int(self.fraction * abs(int(nbytes))) + int(self.floor_bytes)


# ------------------------------------------------------------------------------------------------
# The fitted band sizes. Output of ``python -m tuner.accuracy.uncertainty_fit`` (tuner/accuracy/uncertainty_fit.py
# ``fit_bands``) on shared/cases/vllm-observed.jsonl, high-confidence records (see FIT_REPORT).
# ------------------------------------------------------------------------------------------------

#: Exact: vLLM's arithmetic or the engine adapter.
EXACT_BAND = SourceBand(EXACT, 0.0, 0, "vLLM's own arithmetic (ported, tuner.memory.kvcache) or the installed engine")
#: A plugin's simulated weights (parameters and buffers of the module built under fake tensors).
WEIGHTS_SIMULATED = SourceBand(SIMULATED, 0.001, 0, "fit: leave-one-family-out, FIT_REPORT")
#: A plugin's simulated activation peak (forward + sampler under fake tensors, the cuBLAS workspace).
ACTIVATION_SIMULATED = SourceBand(SIMULATED, 0.01, 0, "fit: leave-one-family-out, FIT_REPORT")
#: A traced pass with approximate kernels (engine-trace) or the generic approximation: no shared case
#: runs one (validate runs with the engine adapter off), so not fitted: twice the simulated band.
ACTIVATION_TRACED = SourceBand(TRACED, 0.02, 0, "not fitted (no shared case traces): 2 × ACTIVATION_SIMULATED")
#: Non-torch memory and the CUDA-graph estimate: era rules calibrated on public logs (tuner.memory.budget).
CATALOG_RULE = SourceBand(RULE, 0.05, 0, "fit: leave-one-family-out, FIT_REPORT")
#: The reserve for unexplained start-up memory (tuner.memory.budget.unexplained_bytes, its own fit).
RESERVE_FIT = SourceBand(FIT, 1.0, 0, "fit: leave-one-family-out, FIT_REPORT")
#: A device total from the catalog (not stated by the user, a log or NVML): fraction of the request.
DEVICE_TOTAL = SourceBand(RULE, 0.01, 0, "fit: leave-one-family-out, FIT_REPORT (held at 1 %: DEVICE_TOTAL_HELD)")
#: Each input that may change memory and has no rule (a vLLM argument, setting or environment
#: variable outside the drop, a unified-memory device's host use): fraction of the request.
NOT_MODELLED = SourceBand(NOT_MODELLED_SOURCE, 0.03, 0, "fit: leave-one-family-out, FIT_REPORT")
#: The release was not stated (a default, the installed vLLM's, one inferred from log formats, a
#: development build): fraction of the request.
RELEASE_NOT_STATED = SourceBand(NOT_MODELLED_SOURCE, 0.03, 0, "fit: leave-one-family-out, FIT_REPORT")

#: id(band) -> its :data:`PARAMETERS` name (filled below).
_PARAMETER_OF: dict[int, str] = {}

#: What ``python -m tuner.accuracy.uncertainty_fit`` printed when the constants above were set (114
#: high-confidence records of shared/cases/vllm-observed.jsonl as of 2026-12-06 that predict and
#: print a KV figure, 26 model families, refit after round 3 session 3's mechanisms: the V1 weights'
#: allocator rounding and the reserve refit on what it leaves, the FlashInfer workspace, the TP2
#: communicator of 0.11 – 0.17, DeepSeek-V4; target: 93 % of the rows covered, at most 2 % unsafe at
#: the safe end): in sample, coverage 93.9 %, safe end unsafe 1.8 % (2 records: the two GB10
#: MiniMax start-ups, whose host-side growth on unified memory no rule models), median half-width
#: 0.62 %; leave-one-family-out, coverage 93.0 %, unsafe 1.8 % (the same two), median half-width
#: 0.60 %. The fractions: simulated weights 0.1 % and activation 1 %, catalog rules 5 % of non-torch
#: + CUDA graphs, a catalog device total 1 % of the request (the fit finds 0.3 %: held, see
#: DEVICE_TOTAL_HELD), the reserve ± 1 × itself, each not-modelled input or device
#: assumption 3 % of the request, a release not stated 3 % (releases are inferred from the log and
#: the posting day, tuner/logs/release_infer.py). An assumed input whose other value is computed
#: (tuner.memory.assumed) carries that value's exact effect instead, unfitted. The fit is flat in
#: places; rerun it when the cases or the rules change.
FIT_REPORT = {"weights_simulated": 0.001, "activation_simulated": 0.01, "catalog_rule": 0.05, "reserve_fit": 1.0,
              "device_total": 0.01, "not_modelled": 0.03, "release_not_stated": 0.03}

#: Bands held wider than the fit finds, ``{parameter: (fit, held)}``, and why. The catalog device total:
#: the session-3 refit finds 0.3 % of the request (the fit tolerates a safe end up to 1 % above the
#: observation), but at 0.3 % the safe end of vllm-34076's RTX 5070 Ti stage (a "typical" catalog
#: total, 15.47 GiB) comes out at 3.21 GiB where vLLM had 3.18: a proposal above what the card held.
#: At 1 % it is 3.11 GiB; the high-confidence safe ends above their logs are then the GB10 pair and six
#: llm-d 0.19 rows by at most 0.23 % (high-confidence coverage 94.8 %, median half-width 0.99 %). Held
#: until a catalog total's band can tell a measured total from a typical one.
DEVICE_TOTAL_HELD = {"device_total": (0.003, 0.01)}

#: The fitted parameters by name (what :func:`tuner.accuracy.uncertainty_fit.fit_bands` returns).
PARAMETERS = ("weights_simulated", "activation_simulated", "catalog_rule", "reserve_fit", "device_total",
              "not_modelled", "release_not_stated")


_PARAMETER_OF.update({id(WEIGHTS_SIMULATED): "weights_simulated", id(ACTIVATION_SIMULATED): "activation_simulated",
                      id(CATALOG_RULE): "catalog_rule", id(RESERVE_FIT): "reserve_fit",
                      id(DEVICE_TOTAL): "device_total", id(NOT_MODELLED): "not_modelled",
                      id(RELEASE_NOT_STATED): "release_not_stated"})


def fitted() -> dict[str, float]:
    """The fractions in force, by :data:`PARAMETERS` name."""
    return {"weights_simulated": WEIGHTS_SIMULATED.fraction, "activation_simulated": ACTIVATION_SIMULATED.fraction,
            "catalog_rule": CATALOG_RULE.fraction, "reserve_fit": RESERVE_FIT.fraction,
            "device_total": DEVICE_TOTAL.fraction, "not_modelled": NOT_MODELLED.fraction,
            "release_not_stated": RELEASE_NOT_STATED.fraction}


#: vLLM arguments (and case settings) known not to touch GPU memory: listed in the output as
#: "no effect on memory" (serving front-end, logging, tokenizer and naming options; vLLM 0.19
#: vllm/entrypoints/openai/cli_args.py and vllm/engine/arg_utils.py: none of them reaches the
#: worker's memory profile or the KV sizing).
NO_EFFECT_ON_MEMORY = frozenset({
    "model", "model_tag", "served_model_name", "host", "port", "uds", "api_key", "ssl_keyfile", "ssl_certfile",
    "allowed_origins", "allowed_methods", "allowed_headers", "uvicorn_log_level", "disable_uvicorn_access_log",
    "disable_log_stats", "disable_log_requests", "enable_log_requests", "disable_fastapi_docs", "root_path",
    "middleware", "chat_template", "chat_template_content_format", "response_role", "tool_call_parser",
    "enable_auto_tool_choice", "tool_parser_plugin", "reasoning_parser", "enable_reasoning", "trust_remote_code",
    "tokenizer", "tokenizer_mode", "tokenizer_revision", "revision", "code_revision", "download_dir",
    "seed", "max_log_len", "return_tokens_as_token_ids", "enable_request_id_headers", "disable_frontend_multiprocessing",
    "enable_prompt_tokens_details", "enable_server_load_tracking", "lora_modules", "prompt_adapters",
    "generation_config", "override_generation_config", "logits_processors", "hf_token", "allow_credentials",
    "api_server_count", "headless", "config", "non_default_args",
})


@dataclass(frozen=True)
class Unmodelled:
    """One input the product read but does not model: its name as vLLM (or the case) spells it,
    its value, where it was read, its effect (``widens`` the band by ``bytes`` on each side, or
    ``no effect on memory``) and why."""

    name: str
    value: Any = None
    where: str = ""
    effect: str = "widens"
    note: str = ""
    #: the band kind: ``not_modelled`` or ``release_not_stated`` (widening inputs only).
    kind: str = "not_modelled"
    #: which way it can move the KV cache: ``both``, ``low`` for an input that can only make it
    #: smaller (a cold compile cache: its band widens the safe end only), ``high`` for one that can
    #: only make it larger.
    side: str = "both"

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["value"] is not None and not isinstance(d["value"], (str, int, float, bool, list, dict)):
            d["value"] = str(d["value"])
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Unmodelled":
        return cls(str(data.get("name") or ""), data.get("value"), str(data.get("where") or ""),
                   str(data.get("effect") or "widens"), str(data.get("note") or ""),
                   str(data.get("kind") or "not_modelled"), str(data.get("side") or "both"))

    @property
    def widens(self) -> bool:
        return self.effect == "widens"


def classify_setting(name: str, value: Any, *, where: str, note: str = "") -> Unmodelled:
    """An input with no rule, classified: ``no effect on memory`` when :data:`NO_EFFECT_ON_MEMORY`
    lists it, else ``widens`` (by :data:`NOT_MODELLED` of the request)."""
    key = name[len("env_"):] if name.startswith("env_") else name
    if key in NO_EFFECT_ON_MEMORY:
        return Unmodelled(name, value, where, "no effect on memory", note or "documented list (tuner.memory.uncertainty)")
    return Unmodelled(name, value, where, "widens",
                      note or f"no rule for it: ±{NOT_MODELLED.fraction * 100:g} % of the requested memory")


@dataclass(frozen=True)
class Alternative:
    """An assumed input's other value, computed: what the job would have predicted had the input
    been the other way (``flashinfer_installed: true``, ``triton_kernels_installed: true``), as the
    change of one stage's available KV bytes (``kv_delta_bytes``: the alternative's KV less the
    point's; the point stays at the assumption). ``source`` names the release and file of the
    alternative path. Computed from the job's passes (:mod:`tuner.memory.assumed`, :meth:`tuner.jobs.job.Passes.passes_at`,
    :func:`tuner.memory.search.evaluate`) into :func:`term_bands`, where it is a one-sided band of exactly ``kv_delta_bytes``."""

    name: str
    value: Any
    alternative: Any
    kv_delta_bytes: int
    source: str = ""

    @property
    def label(self) -> str:
        """``assumed flashinfer_installed=false``: the band's name."""
        return f"assumed {self.name}={str(self.value).lower()}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Alternative":
        return cls(str(data["name"]), data.get("value"), data.get("alternative"), int(data.get("kv_delta_bytes") or 0),
                   str(data.get("source") or ""))


def alternative_band(alt: Alternative) -> TermBand:
    """The band of an assumption whose alternative is computed: a subtracted term of 0 bytes that the
    alternative moves by exactly ``-kv_delta_bytes`` — the high end alone where the alternative gives
    the KV more (``+``), the low (safe) end alone where it gives less. Unfitted (``parameter`` "")."""
    d = int(alt.kv_delta_bytes)
    note = (f"{alt.source}; {alt.name}={str(alt.alternative).lower()}: KV {'+' if d >= 0 else '-'}"
            f"{abs(d) / GiB:.3f} GiB")
    return TermBand(alt.label, 0, alt.name, ASSUMED_ALTERNATIVE, min(0, -d), max(0, -d), note, "-", "", 0)


@dataclass(frozen=True)
class Context:
    """What a job knows about its own inputs, for the bands: the run's ``term_sources`` (as items),
    whether the device total was stated (a drop, a log, NVML) rather than read from the catalog,
    and the inputs it read but does not model (:class:`Unmodelled`)."""

    sources: tuple = ()
    device_total_stated: bool = True
    unmodelled: tuple = ()

    def to_dict(self) -> dict:
        return {"sources": dict(self.sources), "device_total_stated": self.device_total_stated,
                "unmodelled": [u.to_dict() for u in self.unmodelled]}


@dataclass(frozen=True)
class TermBand:
    """One term's band: the term's bytes, its ledger source, the band's source class, the bounds
    (bytes; ``low_bytes ≤ bytes ≤ high_bytes``) and what set it."""

    name: str
    bytes: int
    source: str
    band_source: str
    low_bytes: int
    high_bytes: int
    widened_by: str = ""
    #: ``=`` the request (a larger request gives more KV), ``-`` a term subtracted from it.
    op: str = "-"
    #: the fitted parameter that sizes the band (:data:`PARAMETERS`; "" for exact and unfitted bands)
    #: and the bytes it scales (the term, or the request for a not-modelled input).
    parameter: str = ""
    basis_bytes: int = 0

    @property
    def half_width(self) -> int:
        return (self.high_bytes - self.low_bytes) // 2

    def to_dict(self) -> dict:
        return asdict(self)


def _band(name: str, nbytes: int, source: str, band: SourceBand, widened_by: str = "", op: str = "-") -> TermBand:
    h = band.half_width(nbytes)
    return TermBand(name, int(nbytes), source, band.source, int(nbytes) - h, int(nbytes) + h, widened_by, op,
                    _PARAMETER_OF.get(id(band), ""), abs(int(nbytes)))


def activation_band(source: str) -> SourceBand:
    """The activation peak's band by its ``term_sources`` source."""
    s = str(source or "")
    if s == "cuda":
        return EXACT_BAND
    if "approximate" in s or s.startswith("engine-trace"):
        return ACTIVATION_TRACED
    return ACTIVATION_SIMULATED


def term_bands(*, requested_memory_bytes: int, weights_bytes: int, activation_peak_bytes: int, reserve_bytes: int,
               non_torch_bytes: int, cuda_graph_bytes: int, sources: Mapping[str, Any] | None = None,
               device_total_stated: bool = True, unmodelled: Iterable[Unmodelled] = (),
               kv_cache_memory_bytes: int | None = None,
               alternatives: Iterable[Alternative] = ()) -> tuple[TermBand, ...]:
    """Every term's band (bytes) for one rank's budget.

    ``activation_peak_bytes`` includes ``reserve_bytes`` (the reserve is banded apart, by its fit);
    ``sources``: the run's ``term_sources`` (:func:`tuner.engine.crosscheck.term_sources`);
    ``device_total_stated``: False when the total memory came from the catalog; ``unmodelled``:
    inputs with no rule (each widening one is a band of its own); ``alternatives``: assumed inputs
    whose other value was computed (:class:`Alternative`), each a one-sided band of exactly its
    effect (:func:`alternative_band`) and no not-modelled fraction: the input has two values, the
    point's and the alternative's, both computed. With ``kv_cache_memory_bytes`` the cache is the user's bytes: every
    term is exact for the KV (no band)."""
    src = dict(sources or {})
    if kv_cache_memory_bytes is not None:
        return (TermBand("kv_cache_memory_bytes", int(kv_cache_memory_bytes), "drop", EXACT,
                         int(kv_cache_memory_bytes), int(kv_cache_memory_bytes), "given as bytes", "="),)
    out = []
    total_src = str(src.get("total_memory") or "drop")
    if device_total_stated and total_src != "catalog":
        out.append(_band("requested", requested_memory_bytes, total_src, EXACT_BAND, op="="))
    else:
        out.append(_band("requested", requested_memory_bytes, "catalog", DEVICE_TOTAL,
                         "device total from the catalog, not stated", op="="))
    w_src = str(src.get("weights") or "plugin")
    out.append(_band("weights", weights_bytes, w_src,
                     EXACT_BAND if w_src in ("engine", "cuda") else WEIGHTS_SIMULATED))
    a_src = str(src.get("activation_peak") or "plugin")
    out.append(_band("activation_peak", int(activation_peak_bytes) - int(reserve_bytes), a_src, activation_band(a_src),
                     "approximate kernels" if activation_band(a_src) is ACTIVATION_TRACED else ""))
    if reserve_bytes:
        out.append(_band("reserve", reserve_bytes, "fit", RESERVE_FIT))
    nt_src = str(src.get("non_torch") or "catalog")
    out.append(_band("non_torch", non_torch_bytes, nt_src, EXACT_BAND if nt_src == "cuda" else CATALOG_RULE))
    if cuda_graph_bytes:
        out.append(_band("cuda_graphs", cuda_graph_bytes, str(src.get("cuda_graphs") or "catalog"), CATALOG_RULE))
    alts = {a.name: a for a in alternatives}
    for u in unmodelled:
        if not u.widens:
            continue
        if u.name in alts:  # both of its values computed: the alternative's band is its whole effect
            continue
        band = RELEASE_NOT_STATED if u.kind == "release_not_stated" else NOT_MODELLED
        h = int(band.fraction * int(requested_memory_bytes)) + band.floor_bytes
        # an input that can only take memory (side "low") moves the KV's low (safe) end alone
        side = u.side
        out.append(TermBand(f"not modelled: {u.name}", 0, u.where or "input", band.source,
                            0 if side == "low" else -h, 0 if side == "high" else h, u.note or "no rule", "-",
                            _PARAMETER_OF[id(band)], int(requested_memory_bytes)))
    out.extend(alternative_band(a) for a in alts.values())
    return tuple(out)


def kv_interval(available_kv_cache_bytes: int, bands: Iterable[TermBand]) -> tuple[int, int]:
    """``(low, high)`` available KV bytes: the bands added linearly — a subtracted term at its high
    end and the request at its low end give the low (safe) end."""
    down = up = 0
    for b in bands:
        if b.op == "=":
            if b.name == "kv_cache_memory_bytes":
                continue
            down += b.bytes - b.low_bytes
            up += b.high_bytes - b.bytes
        else:
            down += b.high_bytes - b.bytes
            up += b.bytes - b.low_bytes
    kv = int(available_kv_cache_bytes)
    return kv - down, kv + up


def band_sides(b: Mapping[str, Any]) -> tuple[int, int]:
    """``(down, up)``: how far a band (a :class:`TermBand` dict) moves the KV below and above the
    expected value (as :func:`kv_interval` adds them)."""
    if b.get("op") == "=":
        return int(b["bytes"]) - int(b["low_bytes"]), int(b["high_bytes"]) - int(b["bytes"])
    return int(b["high_bytes"]) - int(b["bytes"]), int(b["bytes"]) - int(b["low_bytes"])


def band_text(b: Mapping[str, Any]) -> str:
    """A band's width in words (GiB): ``±0.212 GiB``, or ``-1.920 GiB (lowers the KV only)`` for
    one that widens the safe end alone."""
    down, up = band_sides(b)
    if up == 0 and down > 0:
        return f"-{down / (1 << 30):.3f} GiB (lowers the KV only)"
    if down == 0 and up > 0:
        return f"+{up / (1 << 30):.3f} GiB (raises the KV only)"
    return f"±{(int(b['high_bytes']) - int(b['low_bytes'])) / 2 / (1 << 30):.3f} GiB"


def widest_first(bands: Iterable[TermBand]) -> list[TermBand]:
    """The bands that are not exact, the widest first (``explain``, ``check``'s uncertain terms)."""
    return sorted((b for b in bands if b.high_bytes != b.low_bytes), key=lambda b: (-(b.high_bytes - b.low_bytes),
                                                                                      b.name))


def bands_from_candidate(c: Mapping[str, Any], sources: Mapping[str, Any] | None, *, device_total_stated: bool = True,
                         unmodelled: Iterable[Unmodelled] = ()) -> tuple[TermBand, ...]:
    """:func:`term_bands` of a candidate dict (its ledger byte fields and ``reserve_bytes``)."""
    return term_bands(requested_memory_bytes=int(c.get("requested_memory_bytes") or 0),
                      weights_bytes=int(c.get("weights_bytes") or 0),
                      activation_peak_bytes=int(c.get("activation_peak_bytes") or 0),
                      reserve_bytes=int(c.get("reserve_bytes") or 0), non_torch_bytes=int(c.get("non_torch_bytes") or 0),
                      cuda_graph_bytes=int(c.get("cuda_graph_bytes") or 0), sources=sources,
                      device_total_stated=device_total_stated, unmodelled=unmodelled)

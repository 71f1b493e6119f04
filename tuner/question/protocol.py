"""The one contract across the worker seam (DESIGN §5b): what the parent asks, what the worker answers.

The parent (CLI, daemon, ``explain``, ``check``, ``validate``, ``import-log``, ``selftest``) builds
a :class:`JobRequest` holding the validated :class:`~tuner.question.drop.Drop`; the worker
(:mod:`tuner.commands.worker_main` → :func:`tuner.jobs.job.run_job`) reads it back with
:meth:`JobRequest.from_wire` and answers a :class:`JobResult`, whose candidates and proposals
carry their budget as an itemised ledger (:class:`BudgetTerm`: a named term, its bytes and the
source that gave it, :func:`tuner.engine.crosscheck.term_sources`). Both sides import this module
and nothing else to speak to each other.

On the wire every message is a JSON object with ``"protocol": PROTOCOL_VERSION``. A message of
an unknown or newer version (or none, where one is required) is refused with a
:class:`~tuner.errors.ProtocolError` naming both versions, on either side: an engine venv with an
older ctx-tuner behind ``worker_python`` fails loudly instead of mis-reading the request.

No torch, no I/O: pure data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple

from tuner.question.drop import Candidates, Constraints, Drop
from tuner.errors import ProtocolError
from tuner.memory.ledger import (  # noqa: F401 - defined with the search, carried by the contract
    INTERVAL_NUMBERS, LEDGER, POINT_NUMBERS, BudgetTerm, Point, Proposal, gmu_text, ledger, ledger_sum, point_of)

#: The version of the wire format. Bump it when a field changes meaning or shape.
PROTOCOL_VERSION = 1

#: ``kind`` of a profile job request (:func:`tuner.jobs.job.run_job`).
KIND_JOB = "job"
#: ``kind`` of a ``validate`` request (:func:`tuner.accuracy.validate.run_validate_request`).
KIND_VALIDATE = "validate"


def check_version(message: Mapping[str, Any], *, where: str, required: bool = True) -> int:
    """The message's protocol version, refused unless it is :data:`PROTOCOL_VERSION`.

    ``required=False`` accepts a message without one (a request built in this process, e.g. a
    test calling :func:`tuner.jobs.job.run_job` directly) as the current version.

    Raises:
        ProtocolError: another version (an older or newer ctx-tuner on the other side), or none
            when ``required``.
    """
    if not isinstance(message, Mapping):
        raise ProtocolError(f"message is a {type(message).__name__}, not a JSON object", where=where)
    version = message.get("protocol")
    if version is None and not required:
        return PROTOCOL_VERSION
    if version != PROTOCOL_VERSION:
        side = ("no protocol version (an older ctx-tuner)" if version is None
                else f"protocol {version!r}" + (" (a newer ctx-tuner)" if isinstance(version, int)
                                                 and version > PROTOCOL_VERSION else ""))
        raise ProtocolError(f"the other side of the worker seam speaks {side}; this side speaks protocol "
                            f"{PROTOCOL_VERSION}: install the same ctx-tuner in the worker's Python", where=where)
    return version


# ------------------------------------------------------------------------------------------------
# The drop across the seam
# ------------------------------------------------------------------------------------------------


def drop_from_wire(data: Mapping[str, Any], *, strict: bool = True) -> Drop:
    """The :class:`Drop` a :meth:`Drop.to_dict` (or a request's hand-made subset of it) describes.

    The sender validated it (:func:`tuner.question.drop.parse_drop`, or settings read from an engine log or a
    case): values are taken as they are; a key the mapping lacks gets the default ``DROP_FIELDS``
    declares (the dataclass defaults); keys it does not know are refused (``strict``) or ignored
    (a stored ``drops`` row read as a drop).

    Raises:
        ProtocolError: a key that is no drop field (``strict``).
    """
    known = {f.name for f in dataclasses.fields(Drop)}
    unknown = sorted(k for k in data if k not in known and k != "engine")
    if unknown and strict:
        raise ProtocolError(f"request drop has unknown keys {', '.join(unknown)}", where=str(data.get("path") or "drop"))
    values = {k: v for k, v in data.items() if k in known and k not in ("candidates", "constraints")}
    cand = dict(data.get("candidates") or {})
    gmu = cand.get("gpu_memory_utilization")
    mml = cand.get("max_model_len")
    values["candidates"] = Candidates(gpu_memory_utilization=tuple(gmu) if gmu is not None else (),
                                      max_model_len=tuple(mml) if mml is not None else None)
    cons = {k: v for k, v in dict(data.get("constraints") or {}).items() if v is not None}
    values["constraints"] = Constraints(**cons)
    values.setdefault("name", "")
    values.setdefault("model", "")
    values.setdefault("device", "")
    if isinstance(values.get("speculative_config"), Mapping):
        values["speculative_config"] = dict(values["speculative_config"])
    return Drop(**values)


def drop_to_wire(drop: Drop) -> dict[str, Any]:
    """:meth:`Drop.to_dict` (the normalised values as JSON)."""
    return drop.to_dict()


# ------------------------------------------------------------------------------------------------
# Requests
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobRequest:
    """One profile job: the validated drop and what the parent resolved for it.

    ``device`` is ``{name, total_memory_bytes}`` plus what the drop's device mapping states
    (``compute_capability``, ``interconnect``, ``p2p``) and, for ``device: auto``,
    ``other_processes_bytes`` (NVML at job time).
    """

    drop: Drop
    config_path: str
    device: Mapping[str, Any] = field(hash=False)
    #: the method the worker runs (``simulate``, ``cuda``, ``vllm``).
    method: str = "simulate"
    #: what the drop asked (``auto`` lets a ``cuda`` pick fall back to simulate); None = ``method``.
    method_requested: str | None = None
    #: False: evaluate only the drop's ``max_model_len`` grid, no proposal search.
    search: bool = True
    #: build the model with fake tensors (the simulator's default).
    fake: bool = True
    #: byte corrections to apply (:class:`tuner.memory.search.Layout`), or None.
    calibration: Mapping[str, Any] | None = field(default=None, hash=False)
    #: a store URL the worker looks the corrections up in (the daemon), or None.
    calibration_db: str | None = None
    #: the engine adapter: ``auto`` / ``off``; None = env ``CTX_TUNER_ENGINE``, else auto.
    engine: str | None = None
    #: ``V0`` / ``V1`` where a log or a case states the engine (else the release decides).
    engine_kind: str | None = None
    trust_remote_code: bool = False
    #: another checkpoint's drafter (``speculative_config.model``): its config.json, found by the
    #: parent; or why it was not found (:mod:`tuner.memory.specdecode`).
    draft_config_path: str | None = None
    draft_config_error: str | None = None
    #: ``vllm`` method: the limit of one engine start-up (seconds); None = 900.
    engine_timeout_s: float | None = None
    #: write one progress line per ``gpu_memory_utilization`` on stderr (:data:`tuner.seam.worker.PROGRESS_PREFIX`).
    progress: bool = False
    #: warnings the worker gathered before the job ran (a calibration lookup that failed).
    warnings: tuple[str, ...] = ()
    #: profile passes the parent found in the pass memo (``{memo_key: row}``, :mod:`tuner.jobs.passmemo`),
    #: so the worker runs only the ones missing; None = none.
    known_passes: Mapping[str, Any] | None = field(default=None, hash=False)
    #: inputs the parent read but the drop does not model (:class:`tuner.memory.uncertainty.Unmodelled`
    #: as dicts: a serve line's flags, a case's settings, a release not stated): each widens the
    #: interval and is named in the result's ``uncertainty``.
    unmodelled: tuple = field(default=(), hash=False)
    #: the device total was stated (a log, a case, the user) rather than read from the catalog;
    #: None = the worker judges from the device (a total other than the catalog's is stated).
    device_total_stated: bool | None = None
    #: where no current stored engine cross-check exists for a plugin-served model
    #: (:mod:`tuner.engine.stored`): ``stored`` says so without importing vLLM, ``run`` runs it
    #: (None = ``run``).
    cross_check: str | None = None
    #: the stored engine cross-checks of the model config the parent found (records, not keys).
    engine_crosschecks: tuple = field(default=(), hash=False)

    kind = KIND_JOB

    @property
    def name(self) -> str:
        """The drop's name, for errors and logs."""
        return self.drop.name or "worker"

    def replace(self, **changes: Any) -> "JobRequest":
        return dataclasses.replace(self, **changes)

    def with_drop(self, **settings: Any) -> "JobRequest":
        """This request with some drop values replaced (``kv_cache_dtype``, ``candidates``, …)."""
        return dataclasses.replace(self, drop=dataclasses.replace(self.drop, **settings))

    def to_wire(self) -> dict[str, Any]:
        """The request as the JSON object the worker reads (keys absent where they hold the default)."""
        drop = drop_to_wire(self.drop)
        if self.engine_kind is not None:
            drop["engine"] = self.engine_kind
        out: dict[str, Any] = {"protocol": PROTOCOL_VERSION, "kind": KIND_JOB, "drop": drop,
                               "config_path": str(self.config_path), "device": dict(self.device),
                               "method": self.method}
        if self.method_requested is not None:
            out["method_requested"] = self.method_requested
        for key, default in (("search", True), ("fake", True), ("trust_remote_code", False), ("progress", False)):
            if getattr(self, key) != default:
                out[key] = getattr(self, key)
        for key in ("calibration_db", "engine", "engine_timeout_s", "draft_config_path", "draft_config_error",
                    "cross_check"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.calibration:
            out["calibration"] = dict(self.calibration)
        if self.warnings:
            out["_warnings"] = list(self.warnings)
        if self.known_passes:
            out["known_passes"] = dict(self.known_passes)
        if self.unmodelled:
            out["unmodelled"] = [dict(u) for u in self.unmodelled]
        if self.device_total_stated is not None:
            out["device_total_stated"] = bool(self.device_total_stated)
        if self.engine_crosschecks:
            out["engine_crosschecks"] = [dict(r) for r in self.engine_crosschecks]
        return out

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], *, required: bool = True) -> "JobRequest":
        """The request a :meth:`to_wire` object describes.

        Raises:
            ProtocolError: another protocol version (none, when ``required``), another ``kind``,
                or no ``drop`` / ``config_path`` / ``device``.
        """
        where = str((data.get("drop") or {}).get("name") or "worker") if isinstance(data, Mapping) else "worker"
        check_version(data, where=where, required=required)
        if data.get("kind", KIND_JOB) != KIND_JOB:
            raise ProtocolError(f"request kind {data.get('kind')!r} is not a profile job", where=where)
        missing = [k for k in ("drop", "config_path", "device") if k not in data]
        if missing:
            raise ProtocolError(f"request lacks {', '.join(missing)}", where=where)
        d = data["drop"]
        return cls(drop=drop_from_wire(d), config_path=str(data["config_path"]), device=dict(data["device"]),
                   method=str(data.get("method") or "simulate"), method_requested=data.get("method_requested"),
                   search=bool(data.get("search", True)), fake=bool(data.get("fake", True)),
                   calibration=dict(data["calibration"]) if data.get("calibration") else None,
                   calibration_db=data.get("calibration_db"), engine=data.get("engine"),
                   engine_kind=d.get("engine"), trust_remote_code=bool(data.get("trust_remote_code")),
                   draft_config_path=data.get("draft_config_path"), draft_config_error=data.get("draft_config_error"),
                   engine_timeout_s=(float(data["engine_timeout_s"]) if data.get("engine_timeout_s") is not None
                                     else None),
                   progress=bool(data.get("progress")), warnings=tuple(data.get("_warnings") or ()),
                   known_passes=dict(data["known_passes"]) if data.get("known_passes") else None,
                   unmodelled=tuple(dict(u) for u in data.get("unmodelled") or ()),
                   device_total_stated=(None if data.get("device_total_stated") is None
                                        else bool(data["device_total_stated"])),
                   cross_check=data.get("cross_check"),
                   engine_crosschecks=tuple(dict(r) for r in data.get("engine_crosschecks") or ()))


@dataclass(frozen=True)
class ValidateRequest:
    """A ``validate`` run over observed cases (:func:`tuner.accuracy.validate.run_validate_request`)."""

    cases: tuple = field(hash=False)
    models_dir: str
    calibrate: bool = False
    calibrations: Mapping[str, Any] | None = field(default=None, hash=False)

    kind = KIND_VALIDATE

    @property
    def name(self) -> str:
        return "validate"

    def to_wire(self) -> dict[str, Any]:
        out = {"protocol": PROTOCOL_VERSION, "kind": KIND_VALIDATE, "cases": list(self.cases),
               "models_dir": str(self.models_dir), "calibrate": bool(self.calibrate)}
        if self.calibrations is not None:
            out["calibrations"] = dict(self.calibrations)
        return out

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], *, required: bool = True) -> "ValidateRequest":
        check_version(data, where="validate", required=required)
        if data.get("kind") != KIND_VALIDATE or "cases" not in data or "models_dir" not in data:
            raise ProtocolError("a validate request needs kind 'validate', cases and models_dir", where="validate")
        return cls(cases=tuple(data["cases"]), models_dir=str(data["models_dir"]), calibrate=bool(data.get("calibrate")),
                   calibrations=data.get("calibrations"))


def request_from_wire(data: Mapping[str, Any], *, required: bool = True) -> JobRequest | ValidateRequest:
    """Whichever request a wire object is, by its ``kind``."""
    if isinstance(data, Mapping) and data.get("kind") == KIND_VALIDATE:
        return ValidateRequest.from_wire(data, required=required)
    return JobRequest.from_wire(data, required=required)


def as_job_request(request: "JobRequest | Mapping[str, Any]") -> JobRequest:
    """A :class:`JobRequest` for a request given as one or as its wire object (version optional:
    built in this process)."""
    return request if isinstance(request, JobRequest) else JobRequest.from_wire(request, required=False)


def as_wire(request: "JobRequest | ValidateRequest | Mapping[str, Any]") -> dict[str, Any]:
    """The wire object of a request; a plain mapping (built by hand, e.g. in a test) is read as
    the current version and written back through the contract, so every request that crosses the
    seam is versioned and shaped by it."""
    if isinstance(request, (JobRequest, ValidateRequest)):
        return request.to_wire()
    return request_from_wire(request, required=False).to_wire()


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------


class _LedgerWire:
    """The wire side of a result with a ledger (``budget``: :class:`BudgetTerm` s) and its wire
    object (``data``): :class:`CandidateResult` and :class:`ProposalResult`."""

    def to_wire(self) -> dict[str, Any]:
        return {**self.data, "budget": [t.to_wire() for t in self.budget]}  # type: ignore[attr-defined]

    def get(self, key: str, default: Any = None) -> Any:
        """A field of the wire object (for readers of fields this class does not type)."""
        return self.data.get(key, default)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class CandidateResult(_LedgerWire):
    """One evaluated grid point: the typed fields every reader needs, the ledger, and the whole
    wire object (``data``: every field :class:`tuner.memory.search.Candidate` has, plus ``run_key``,
    ``uncalibrated``, ``measured``)."""

    gpu_memory_utilization: float
    max_model_len: int
    fits: bool
    starts: bool
    reason: str | None
    num_gpu_blocks: int
    kv_cache_tokens: int
    max_concurrency: float
    available_kv_cache_bytes: int
    budget: tuple[BudgetTerm, ...]
    data: Mapping[str, Any] = field(hash=False, repr=False)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], sources: Mapping[str, Any] | None = None,
                  kv_cache_memory_bytes: int | None = None) -> "CandidateResult":
        budget = (tuple(BudgetTerm.from_wire(t) for t in data["budget"]) if data.get("budget")
                  else ledger(data, sources, kv_cache_memory_bytes))
        return cls(float(data["gpu_memory_utilization"]), int(data["max_model_len"]), bool(data["fits"]),
                   bool(data.get("starts", data["fits"])), data.get("reason"), int(data.get("num_gpu_blocks") or 0),
                   int(data.get("kv_cache_tokens") or 0), float(data.get("max_concurrency") or 0.0),
                   int(data.get("available_kv_cache_bytes") or 0), budget, dict(data))



@dataclass(frozen=True)
class ProposalResult(_LedgerWire, Proposal):
    """A :class:`Proposal` as the worker answered it: with the ledger of the candidate it proposes
    (empty when nothing fits) and the whole wire object (``data``)."""

    budget: tuple[BudgetTerm, ...] = ()
    data: Mapping[str, Any] = field(default_factory=dict, hash=False, repr=False)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any], budget: Iterable[BudgetTerm] = (),
                  sources: Mapping[str, Any] | None = None,
                  kv_cache_memory_bytes: int | None = None) -> "ProposalResult":
        """``budget``: the ledger when the wire object has none and carries no numbers of its own
        (a proposal stored before its numbers were: its grid candidate's, at the same point)."""
        nums = {k: (None if data.get(k) is None else int(data[k])) for k in POINT_NUMBERS}
        if data.get("budget"):
            budget = [BudgetTerm.from_wire(t) for t in data["budget"]]
        elif nums["available_kv_cache_bytes"] is not None:  # the proposed point's own ledger
            budget = ledger(data, sources, kv_cache_memory_bytes)
        return cls(float(data["gpu_memory_utilization"]), data.get("max_model_len"), data.get("num_gpu_blocks"),
                   data.get("kv_cache_tokens"), data.get("max_concurrency"), data.get("reason"), data.get("vllm_args"),
                   limiting_stage=int(data.get("limiting_stage") or 0), stages=tuple(data.get("stages") or ()),
                   **nums, risk=data.get("risk"), max_model_len_safe=data.get("max_model_len_safe"),
                   max_model_len_expected=data.get("max_model_len_expected"),
                   **{k: (None if data.get(k) is None else int(data[k])) for k in INTERVAL_NUMBERS},
                   budget=tuple(budget), data=dict(data))



@dataclass(frozen=True)
class JobResult:
    """What a profile job answers: the candidates and proposals (typed, with their ledgers) and
    the rest of the worker's result (``data``: ``model``, ``plugin``, ``era``, ``runs``,
    ``versions``, ``term_sources``, ``warnings``, …; see :func:`tuner.jobs.job.run_job`)."""

    candidates: tuple[CandidateResult, ...]
    proposals: tuple[ProposalResult, ...]
    data: Mapping[str, Any] = field(hash=False, repr=False)

    @property
    def term_sources(self) -> Mapping[str, Any]:
        return self.data.get("term_sources") or {}

    @property
    def warnings(self) -> list[str]:
        return list(self.data.get("warnings") or [])

    def candidate(self, gpu_memory_utilization: float, max_model_len: int) -> CandidateResult | None:
        """The candidate at one point (u compared to 1e-9), or None."""
        for c in self.candidates:
            if abs(c.gpu_memory_utilization - gpu_memory_utilization) < 1e-9 and c.max_model_len == max_model_len:
                return c
        return None

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> "JobResult":
        """The result a worker's ``result`` object describes (the reply's version is checked by
        :func:`reply_result`).

        Raises:
            ProtocolError: no ``candidates`` / ``proposals`` list.
        """
        if not isinstance(data, Mapping) or not isinstance(data.get("candidates"), list) \
                or not isinstance(data.get("proposals"), list):
            raise ProtocolError("a job result needs candidates and proposals lists", where="worker")
        sources = data.get("term_sources")
        kv_fixed = data.get("kv_cache_memory_bytes")
        cands = tuple(CandidateResult.from_wire(c, sources, kv_fixed) for c in data["candidates"])
        by_point = {(c.gpu_memory_utilization, c.max_model_len): c.budget for c in cands}
        props = tuple(ProposalResult.from_wire(p, by_point.get((float(p["gpu_memory_utilization"]),
                                                                p.get("max_model_len")), ()), sources, kv_fixed)
                      for p in data["proposals"])
        return cls(cands, props, dict(data))

    def to_wire(self) -> dict[str, Any]:
        return {**self.data, "candidates": [c.to_wire() for c in self.candidates],
                "proposals": [p.to_wire() for p in self.proposals]}


# ------------------------------------------------------------------------------------------------
# Replies
# ------------------------------------------------------------------------------------------------


def ok_reply(result: Mapping[str, Any]) -> dict[str, Any]:
    """The worker's reply for a result (a :meth:`JobResult.to_wire` object or a validate report)."""
    return {"ok": True, "protocol": PROTOCOL_VERSION, "result": dict(result)}


def reply_result(reply: Mapping[str, Any], *, job: str) -> dict[str, Any]:
    """The ``result`` of a successful reply, its version checked.

    Raises:
        ProtocolError: another (or no) protocol version, or no ``result`` object.
    """
    check_version(reply, where=job)
    result = reply.get("result")
    if not isinstance(result, dict):
        raise ProtocolError("the worker's reply has no result object", where=job)
    return result

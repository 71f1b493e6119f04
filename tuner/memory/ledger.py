"""The budget ledger and the proposal: a point's itemised KV budget (:class:`BudgetTerm`,
:data:`LEDGER`, :func:`ledger`) and the largest ``max_model_len`` that starts at one
``gpu_memory_utilization`` (:class:`Proposal`) — what :mod:`tuner.memory.search` answers. The
worker contract (:mod:`tuner.question.protocol`) carries them across the seam and re-exports them.

Pure: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple


class Point(NamedTuple):
    """A (``gpu_memory_utilization``, ``max_model_len``) point as a message states it (values as
    given; None where absent)."""

    gpu_memory_utilization: Any
    max_model_len: Any


def point_of(message: Mapping[str, Any]) -> Point:
    """The point any message of the contract names: a candidate, a proposal, a measured start-up,
    an engine verification, a surface point, a log's or a case's settings. The one place outside
    the drop parser that spells the two keys."""
    return Point(message.get("gpu_memory_utilization"), message.get("max_model_len"))


def gmu_text(u: Any) -> str:
    """A ``gpu_memory_utilization`` as tables print it: two decimals, more where the value has
    them (0.705 stays 0.705, not 0.70 beside a real 0.70); ``-`` for None."""
    if u is None:
        return "-"
    u = float(u)
    return f"{u:.2f}" if abs(u * 100 - round(u * 100)) < 1e-9 else repr(u)


@dataclass(frozen=True)
class BudgetTerm:
    """One line of a candidate's budget: ``op`` ``=`` (the start: requested memory), ``-`` (a term
    subtracted from it) or ``->`` (the result: the KV cache bytes); ``source`` names what gave it
    (``catalog``, ``plugin``, ``engine``, ``calibration``, ``cuda``, ``drop``; see
    :func:`tuner.engine.crosscheck.term_sources`)."""

    name: str
    bytes: int
    source: str
    op: str = "-"

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": int(self.bytes), "source": self.source, "op": self.op}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> "BudgetTerm":
        return cls(str(data["name"]), int(data["bytes"]), str(data.get("source") or ""), str(data.get("op") or "-"))


#: The ledger's terms: (name, the candidate's byte field, the ``term_sources`` key, op).
LEDGER = (("requested", "requested_memory_bytes", "budget_formula", "="),
          ("weights", "weights_bytes", "weights", "-"),
          ("activation_peak", "activation_peak_bytes", "activation_peak", "-"),
          ("non_torch", "non_torch_bytes", "non_torch", "-"),
          ("cuda_graphs", "cuda_graph_bytes", "cuda_graphs", "-"),
          ("available_kv", "available_kv_cache_bytes", "kv_sizing", "->"))


#: A point's own numbers behind its KV bytes (a candidate's fields; a proposal carries its proposed
#: point's, :class:`Proposal`): the profile batch and the ledger's byte fields.
POINT_NUMBERS = ("max_num_batched_tokens",) + tuple(col for _n, col, _s, _o in LEDGER)


#: A proposed point's interval numbers (:class:`Proposal`; absent when none).
INTERVAL_NUMBERS = ("available_kv_cache_bytes_low", "available_kv_cache_bytes_high", "kv_cache_tokens_low",
                    "kv_cache_tokens_high")


def ledger(point: Mapping[str, Any], sources: Mapping[str, Any] | None,
           kv_cache_memory_bytes: int | None = None) -> tuple[BudgetTerm, ...]:
    """The itemised budget of one point (a candidate, a proposal with its numbers, a stored row):
    each term with its bytes (0 where absent) and its source (from the job's ``term_sources``;
    ``unknown`` without them). With ``kv_cache_memory_bytes`` (the drop's) the KV bytes are the
    given ones, not what the terms leave: a balancing ``kv_cache_memory_bytes`` term (signed, source
    ``drop``; as ``ctx-tuner explain``'s step) before ``available_kv`` makes the ledger add up."""
    sources = sources or {}
    terms = [BudgetTerm(name, int(point.get(col) or 0), str(sources.get(src) or "unknown"), op)
             for name, col, src, op in LEDGER]
    withheld = int(point.get("extensible_withheld_bytes") or 0)
    if withheld and kv_cache_memory_bytes is None:  # vLLM 0.34's headroom cap (tuner.memory.budget.extensible_kv_budget)
        terms.insert(len(terms) - 1, BudgetTerm("extensible_headroom", withheld, str(sources.get("budget_formula")
                                                                                    or "unknown"), "-"))
    if kv_cache_memory_bytes is not None:
        gap = ledger_sum(terms) - terms[-1].bytes
        if gap:
            terms.insert(len(terms) - 1, BudgetTerm("kv_cache_memory_bytes", gap, "drop", "-"))
    return tuple(terms)


def ledger_sum(terms: Iterable[BudgetTerm]) -> int:
    """The KV bytes a ledger's terms give: the ``=`` term less the ``-`` ones (equal to its
    ``available_kv`` term when the ledger adds up)."""
    total = 0
    for t in terms:
        if t.op == "=":
            total = t.bytes
        elif t.op == "-":
            total -= t.bytes
    return total


@dataclass(frozen=True)
class Proposal:
    """The largest ``max_model_len`` that starts at one ``gpu_memory_utilization`` (None if none)
    and the ``vllm`` arguments: what :func:`tuner.memory.search.propose` answers (``tuner.memory.search.Proposal``
    is this class) and the wire object's typed fields (:class:`ProposalResult`)."""

    gpu_memory_utilization: float
    max_model_len: int | None
    num_gpu_blocks: int | None
    kv_cache_tokens: int | None
    max_concurrency: float | None
    reason: str | None
    vllm_args: str | None
    #: The proposed candidate's limiting pipeline stage and each stage's figures (PP > 1 only;
    #: :attr:`tuner.memory.search.Candidate.stages`).
    limiting_stage: int = 0
    stages: tuple = ()
    #: The proposed point's own numbers (:data:`POINT_NUMBERS`, bytes), as the search evaluated
    #: that point (its profile batch, activation, KV bytes): None when nothing fits.
    max_num_batched_tokens: int | None = None
    requested_memory_bytes: int | None = None
    weights_bytes: int | None = None
    activation_peak_bytes: int | None = None
    non_torch_bytes: int | None = None
    cuda_graph_bytes: int | None = None
    available_kv_cache_bytes: int | None = None
    #: The risk the proposal was taken at (``safe``: the largest length that starts at the safe end
    #: of the interval, :mod:`tuner.memory.uncertainty`; ``expected``), and both answers: the largest
    #: ``max_model_len`` that starts at the safe end and at the expected value (None: none does).
    risk: str | None = None
    max_model_len_safe: int | None = None
    max_model_len_expected: int | None = None
    #: The proposed point's KV bytes and tokens at the interval's low (safe) and high ends.
    available_kv_cache_bytes_low: int | None = None
    available_kv_cache_bytes_high: int | None = None
    kv_cache_tokens_low: int | None = None
    kv_cache_tokens_high: int | None = None

    def to_dict(self) -> dict:
        """The proposal's own fields (a :class:`ProposalResult`'s ledger and wire object left out;
        ``stages`` and ``limiting_stage`` only where there are stages; the numbers only where a
        point was proposed)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(Proposal)}
        if not d["stages"]:
            d.pop("stages")
            d.pop("limiting_stage")
        else:
            d["stages"] = [dict(x) for x in d["stages"]]
        for k in POINT_NUMBERS + INTERVAL_NUMBERS:
            if d[k] is None:
                d.pop(k)
        if d["risk"] is None:  # a proposal made before the interval (a stored row)
            for k in ("risk", "max_model_len_safe", "max_model_len_expected"):
                d.pop(k)
        return d

    def numbers(self) -> dict[str, int] | None:
        """The proposed point's own numbers (:data:`POINT_NUMBERS`), None when it carries none."""
        if self.available_kv_cache_bytes is None:
            return None
        return {k: getattr(self, k) for k in POINT_NUMBERS}

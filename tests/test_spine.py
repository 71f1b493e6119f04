"""The typed spine (issue 11): the worker-seam contract (tuner.question.protocol), the one result↔rows
mapping (tuner.store.records), and the daemon parsing a drop's bytes once."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO
from tuner.question.drop import load_drop, parse_drop
from tuner.errors import ProtocolError
from tuner.question.protocol import (PROTOCOL_VERSION, BudgetTerm, JobRequest, JobResult, ValidateRequest, as_wire,
                            drop_from_wire, ok_reply, reply_result, request_from_wire)

H100_DROP = REPO / "configs" / "examples" / "llama-3.1-8b-h100.yaml"


def _request() -> JobRequest:
    drop = load_drop(H100_DROP)
    return JobRequest(drop=drop, config_path="/m/config.json", device={"name": "H100-80GB",
                                                                       "total_memory_bytes": 85_520_809_984},
                      method="simulate", method_requested="simulate", calibration={"non_torch_delta_bytes": 5, "runs": 2})


def test_job_request_round_trips_through_its_wire_object_with_the_validated_drop():
    req = _request()
    wire = req.to_wire()
    assert wire["protocol"] == PROTOCOL_VERSION and wire["kind"] == "job"
    assert wire["drop"] == req.drop.to_dict()
    back = JobRequest.from_wire(json.loads(json.dumps(wire)))
    assert back == req and back.drop == req.drop and back.calibration == req.calibration
    assert back.drop.candidates.gpu_memory_utilization == req.drop.candidates.gpu_memory_utilization


def test_request_of_a_newer_protocol_is_a_typed_error_naming_both_versions():
    wire = {**_request().to_wire(), "protocol": PROTOCOL_VERSION + 1}
    with pytest.raises(ProtocolError) as e:
        JobRequest.from_wire(wire)
    assert f"protocol {PROTOCOL_VERSION + 1}" in str(e.value) and "a newer ctx-tuner" in str(e.value)
    assert e.value.where == req_name()
    del wire["protocol"]
    with pytest.raises(ProtocolError, match="no protocol version"):
        JobRequest.from_wire(wire)
    assert JobRequest.from_wire(wire, required=False).drop.name == req_name()  # in-process: the current one


def req_name() -> str:
    return load_drop(H100_DROP).name


def test_reply_of_another_protocol_is_a_typed_error():
    assert reply_result(ok_reply({"candidates": []}), job="j") == {"candidates": []}
    with pytest.raises(ProtocolError) as e:
        reply_result({"ok": True, "result": {}}, job="j")  # an older worker: no version
    assert e.value.where == "j" and "older ctx-tuner" in str(e.value)


def test_worker_answers_an_unknown_protocol_with_a_typed_error(tmp_path):
    """The real worker entry point (tuner.commands.worker_main), fed a request of a newer version, replies
    with a ProtocolError that the parent re-raises as the same class."""
    import subprocess

    wire = {**_request().to_wire(), "protocol": 99}
    out = subprocess.run([sys.executable, "-m", "tuner.commands.worker_main"], input=json.dumps(wire).encode(),
                         capture_output=True, cwd=REPO, timeout=120)
    reply = json.loads(out.stdout)
    assert reply["ok"] is False and reply["error_type"] == "ProtocolError" and "protocol 99" in reply["message"]
    from tuner.seam.worker import error_from_reply

    assert isinstance(error_from_reply(reply, job="j"), ProtocolError)


def test_hand_made_requests_are_stamped_and_shaped_by_the_contract():
    wire = as_wire({"drop": {"name": "x", "engine_version": "0.8.4", "engine": "V0",
                             "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [4096]}},
                    "config_path": "/m/config.json", "device": {"name": "A100-80GB", "total_memory_bytes": 1}})
    assert wire["protocol"] == PROTOCOL_VERSION and wire["drop"]["engine"] == "V0"
    req = request_from_wire(wire)
    assert isinstance(req, JobRequest) and req.engine_kind == "V0" and req.drop.tensor_parallel_size == 1
    assert req.drop.candidates.max_model_len == (4096,)  # the declared defaults fill the rest
    with pytest.raises(ProtocolError, match="unknown keys bogus"):
        drop_from_wire({"bogus": 1})
    v = request_from_wire(ValidateRequest(cases=({"id": "c"},), models_dir="/m", calibrate=True).to_wire())
    assert isinstance(v, ValidateRequest) and v.calibrate and v.cases == ({"id": "c"},)


def _result_wire() -> dict:
    cand = {"gpu_memory_utilization": 0.9, "max_model_len": 8192, "max_num_batched_tokens": 8192, "max_num_seqs": 256,
            "fits": True, "starts": True, "reason": None, "requested_memory_bytes": 1000, "weights_bytes": 400,
            "activation_peak_bytes": 100, "non_torch_bytes": 50, "cuda_graph_bytes": 0,
            "available_kv_cache_bytes": 450, "num_gpu_blocks": 3, "kv_cache_tokens": 48, "max_concurrency": 0.01,
            "run_key": "8192x256@0"}
    prop = {"gpu_memory_utilization": 0.9, "max_model_len": 8192, "num_gpu_blocks": 3, "kv_cache_tokens": 48,
            "max_concurrency": 0.01, "reason": None, "vllm_args": "--max-model-len 8192"}
    return {"candidates": [cand], "proposals": [prop, {**prop, "gpu_memory_utilization": 0.5, "max_model_len": None}],
            "term_sources": {"weights": "engine", "activation_peak": "plugin", "non_torch": "calibration",
                             "cuda_graphs": "catalog", "budget_formula": "catalog", "kv_sizing": "catalog"}}


def test_job_result_itemises_each_budget_with_bytes_and_source():
    res = JobResult.from_wire(_result_wire())
    c = res.candidates[0]
    assert (c.gpu_memory_utilization, c.max_model_len, c.num_gpu_blocks) == (0.9, 8192, 3)
    assert [(t.name, t.bytes, t.source) for t in c.budget] == [
        ("requested", 1000, "catalog"), ("weights", 400, "engine"), ("activation_peak", 100, "plugin"),
        ("non_torch", 50, "calibration"), ("cuda_graphs", 0, "catalog"), ("available_kv", 450, "catalog")]
    assert sum(t.bytes for t in c.budget if t.op == "-") == 1000 - 450  # the ledger adds up
    assert res.proposals[0].budget == c.budget and res.proposals[1].budget == ()  # nothing fits at 0.5
    wire = json.loads(json.dumps(res.to_wire()))
    assert wire["candidates"][0]["budget"][1] == {"name": "weights", "bytes": 400, "source": "engine", "op": "-"}
    again = JobResult.from_wire(wire)
    assert again.candidates[0].budget == c.budget and again.proposals[0].budget == c.budget
    assert BudgetTerm.from_wire(wire["proposals"][0]["budget"][0]).name == "requested"
    with pytest.raises(ProtocolError):
        JobResult.from_wire({"candidates": []})


def test_proposal_fields_were_declared_twice_in_search_and_protocol():
    """search.Proposal and protocol.ProposalResult declared the same seven fields apart; now the
    search's proposal is the protocol's Proposal and a ProposalResult is one, with its ledger."""
    import dataclasses

    from tuner.memory import search
    from tuner.question.protocol import Proposal, ProposalResult

    assert search.Proposal is Proposal and issubclass(ProposalResult, Proposal)
    own = [f.name for f in dataclasses.fields(Proposal)]
    assert own == ["gpu_memory_utilization", "max_model_len", "num_gpu_blocks", "kv_cache_tokens",
                   "max_concurrency", "reason", "vllm_args", "limiting_stage", "stages",
                   # the proposed point's own numbers (None, and left out of to_dict, where unset)
                   "max_num_batched_tokens", "requested_memory_bytes", "weights_bytes", "activation_peak_bytes",
                   "non_torch_bytes", "cuda_graph_bytes", "available_kv_cache_bytes",
                   # the risk it was taken at, both answers and the interval's ends (tuner/memory/uncertainty.py)
                   "risk", "max_model_len_safe", "max_model_len_expected", "available_kv_cache_bytes_low",
                   "available_kv_cache_bytes_high", "kv_cache_tokens_low", "kv_cache_tokens_high"]
    assert [f.name for f in dataclasses.fields(ProposalResult)] == own + ["budget", "data"]
    prop = Proposal(0.9, 8192, 3, 48, 0.0059, None, "--max-model-len 8192 --gpu-memory-utilization 0.9")
    assert prop.to_dict() == dict(zip(own, (0.9, 8192, 3, 48, 0.0059, None,  # one stage: no stage fields
                                            "--max-model-len 8192 --gpu-memory-utilization 0.9")))
    res = ProposalResult.from_wire({**prop.to_dict(), "command": "vllm serve m"})
    assert res.to_dict() == prop.to_dict() and res.get("command") == "vllm serve m"
    assert res.to_wire() == {**prop.to_dict(), "command": "vllm serve m", "budget": []}
    staged = Proposal(0.9, 8192, 3, 48, 0.0059, None, None, limiting_stage=1,
                      stages=({"pp_rank": 0, "num_gpu_blocks": 5}, {"pp_rank": 1, "num_gpu_blocks": 3}))
    wire = staged.to_dict()
    assert wire["limiting_stage"] == 1 and wire["stages"][1] == {"pp_rank": 1, "num_gpu_blocks": 3}
    back = ProposalResult.from_wire(wire)
    assert (back.limiting_stage, back.stages, back.to_dict()) == (1, staged.stages, wire)


def test_stored_result_reads_back_what_was_profiled(tmp_path):
    """records: a profile's rows back as typed records and as a JobResult with the same points."""
    from tests._results_db import profiled_db
    from tuner.store import records
    from tuner.reports.results import open_for_read

    store = open_for_read(str(profiled_db()))
    try:
        props = [p for p in store.latest_proposals() if p["drop_name"] == "llama-3.1-8b-h100"]
        drop_id = props[0]["drop_id"]
        back = records.stored_result(store, drop_id)
        stored = records.proposals_of_drop(store, drop_id)
        assert [(p.gpu_memory_utilization, p.max_model_len) for p in back.proposals] == \
            [(p["gpu_memory_utilization"], p["max_model_len"]) for p in props]
        assert all(isinstance(p, records.StoredProposal) for p in stored)
        c = records.find(back.candidates, stored[0].gpu_memory_utilization, stored[0].max_model_len)
        assert c is not None and c.budget[0].name == "requested" and c.budget[1].source in ("plugin", "engine")
        assert c.budget[-1].bytes == c.available_kv_cache_bytes > 0
        run = records.run(store, back.data["runs"][0]["id"])
        assert run.drop_id == drop_id and run.method == "simulate"
        assert records.drop(store, drop_id).name == "llama-3.1-8b-h100"
    finally:
        store.close()


def test_daemon_parsed_one_drops_bytes_several_times(tmp_path, monkeypatch):
    """The duplicate-name check, the move detection, admission and the job's start once parsed a
    new drop's bytes up to six times; now each (path, content) is parsed once."""
    from tuner.daemon import service as dm
    from tuner.errors import DropError
    from tuner.daemon.settings import Settings

    calls: list[str] = []
    real = dm.parse_drop_keys
    monkeypatch.setattr(dm, "parse_drop_keys", lambda raw, path, **kw: calls.append(path) or real(raw, path, **kw))
    d = dm.Daemon(Settings(watch_dir=str(tmp_path / "conf.d"), state_dir=str(tmp_path / "state")))
    raw = H100_DROP.read_bytes().replace(b"method:", b"# method:")
    path = str(tmp_path / "a.yaml")
    drop = d._parse(path, raw)
    assert d._method_defaulted(raw, path) and d._model_key(path, raw) is not None
    assert d._parse(path, raw) == drop and drop.name == parse_drop(raw, path).name
    assert calls == [path]
    bad = b"name: a\nmodel: m\n"
    for _ in range(3):
        with pytest.raises(DropError, match="device"):
            d._parse(path, bad)
    assert calls == [path, path]

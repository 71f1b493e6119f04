"""Issue 34 on the engine tier (the real vLLM): a crash of the traced profile run falls back instead
of failing the job, and a repeated question is answered from the store without importing vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tuner.engine import vllm_importable

REQUIRED = os.environ.get("CTX_TUNER_REQUIRE_ENGINE") == "1"
if REQUIRED and not vllm_importable():
    raise RuntimeError("CTX_TUNER_REQUIRE_ENGINE=1 but vllm is not importable in this Python")
pytestmark = pytest.mark.skipif(not vllm_importable(), reason="vllm is not importable in this Python")

DROP = REPO / "configs" / "engine" / "tiny-olmoe-engine.yaml"


def test_engine_trace_sigsegv_failed_the_job(monkeypatch):
    """An unserved architecture's traced profile run that dies with SIGSEGV (what Qwen3-Next's did
    inside a compiled kernel fed a fake tensor) failed the job with the worker. The trace's
    process is sacrificial: the job answers from the engine's KV specs and weights with the
    generic decoder's activation (approximate), and the warning names the crash."""
    import signal

    import tuner.engine.trace as trace_mod
    from tuner.question.drop import load_drop
    from tuner.jobs.job import run_job

    def segfault(session, **kw):
        os.kill(os.getpid(), signal.SIGSEGV)

    monkeypatch.setattr(trace_mod, "trace_profile_run", segfault)
    monkeypatch.delenv("CTX_TUNER_ENGINE", raising=False)
    d = load_drop(DROP)
    dev = d.resolve_device()
    r = run_job({"drop": d.to_dict(), "config_path": str(d.model_path() / "config.json"),
                 "device": {"name": dev.name, "total_memory_bytes": dev.total_memory_bytes}})
    assert r["plugin"] == "engine" and r["proposals"][0]["max_model_len"] == 4096
    ts = r["term_sources"]
    assert (ts["kv_cache_spec"], ts["weights"], ts["activation_peak"]) == (
        "engine", "engine", "plugin(generic, approximate)")
    crash = [w for w in r["warnings"] if w.startswith("engine-trace not run (")]
    assert len(crash) == 1 and "killed by signal 11 (SIGSEGV)" in crash[0]
    assert r["engine_check"]["trace"][0]["crash"] == "SIGSEGV"


def test_repeated_question_with_vllm_installed_imports_vllm_again(tmp_path):
    """With vLLM installed a repeated ``profile`` ran a worker and imported vLLM every time (the
    pass memo was off whenever the engine took part). The second ask is the engine's stored
    answer now: no worker, and neither ``vllm`` nor ``torch`` in ``sys.modules``."""
    db = tmp_path / "runs.sqlite"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("CTX_TUNER_ENGINE", None)
    t_first = time.perf_counter()
    first = subprocess.run([sys.executable, "-m", "tuner.cli", "profile", str(DROP), "--db", str(db), "--json"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    first_s = time.perf_counter() - t_first
    assert first.returncode == 0, first.stderr[-2000:]
    doc = json.loads(first.stdout)
    assert doc["pass_source"]["source"] == "worker"
    code = ("import json, sys, time, io, contextlib\n"
            "t0 = time.perf_counter()\n"
            "from tuner.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            f"    rc = main(['profile', {str(DROP)!r}, '--db', {str(db)!r}, '--json'])\n"
            "print(json.dumps({'rc': rc, 's': time.perf_counter() - t0, 'vllm': 'vllm' in sys.modules,\n"
            "                  'torch': 'torch' in sys.modules, 'doc': json.loads(out.getvalue())}))\n")
    t0 = time.perf_counter()
    again = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)
    wall = time.perf_counter() - t0
    assert again.returncode == 0, again.stderr[-2000:]
    got = json.loads(again.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0 and got["doc"]["pass_source"]["engine_answer"] is True
    assert (got["vllm"], got["torch"]) == (False, False)
    assert got["doc"]["proposals"] == doc["proposals"]
    print(f"ENGINE MEMO: first ask {first_s:.2f} s (worker, vLLM); repeated question {wall:.2f} s cold "
          f"({got['s']:.2f} s in-process), no vllm, no torch imported")


TINY_LLAMA = REPO / "tests" / "engine" / "data" / "tiny-llama"
TINY_QWEN3_NEXT = REPO / "tests" / "engine" / "data" / "tiny-qwen3-next"


def _env() -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("CTX_TUNER_ENGINE", None)
    env.pop("CTX_TUNER_WORKER_PYTHON", None)
    return env


def _llama_drop(tmp_path, name: str, gmu: float):
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"name: {name}\nmodel: {TINY_LLAMA}\ndevice: H100-80GB\nengine_version: \"0.32.0\"\n"
                 "max_num_batched_tokens: 2048\nmax_num_seqs: 64\n"
                 f"candidates:\n  gpu_memory_utilization: [{gmu}]\n  max_model_len: [1024, 4096]\n")
    return p


def test_plugin_served_answer_with_vllm_installed_imported_vllm(tmp_path):
    """A plugin-served model (the tiny Llama) on a host with vLLM: the engine cross-check runs once
    (``profile --cross-check``) and is stored; a new question in a fresh process is answered from
    the stored cross-check and the pass memo with neither ``vllm`` nor ``torch`` in ``sys.modules``."""
    db = tmp_path / "runs.sqlite"
    first = subprocess.run([sys.executable, "-m", "tuner.cli", "profile", str(_llama_drop(tmp_path, "a", 0.9)),
                            "--db", str(db), "--json", "--cross-check"], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-2000:]
    doc = json.loads(first.stdout)
    ck = doc["engine_check"]
    assert ck["cross_check"]["state"] == "ran" and ck["release"] == "0.32.0"
    assert ck["decision"] == "plugin (engine agrees)", ck.get("check")
    drop2 = _llama_drop(tmp_path, "b", 0.6)
    code = ("import json, sys, time, io, contextlib\n"
            "t0 = time.perf_counter()\n"
            "from tuner.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            f"    rc = main(['profile', {str(drop2)!r}, '--db', {str(db)!r}, '--json'])\n"
            "print(json.dumps({'rc': rc, 's': time.perf_counter() - t0, 'vllm': 'vllm' in sys.modules,\n"
            "                  'torch': 'torch' in sys.modules, 'doc': json.loads(out.getvalue())}))\n")
    t0 = time.perf_counter()
    again = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                           timeout=300)
    wall = time.perf_counter() - t0
    assert again.returncode == 0, again.stderr[-2000:]
    got = json.loads(again.stdout.strip().splitlines()[-1])
    assert (got["rc"], got["vllm"], got["torch"]) == (0, False, False)
    assert got["doc"]["pass_source"]["source"] == "memo"
    block = got["doc"]["engine_check"]["cross_check"]
    assert (block["state"], block["agree"], block["vllm"]) == ("stored", True, "0.32.0")
    print(f"STORED CROSS-CHECK: new question {wall:.2f} s cold ({got['s']:.2f} s in-process), no vllm, no torch")


def test_qwen3_next_drop_failed_with_sigsegv_in_the_trace(tmp_path):
    """The Qwen3-Next drop on the engine tier (no plugin serves Qwen3NextForCausalLM: the engine
    adapter's traced profile run) died with SIGSEGV and failed the job (exit 1). Now ``profile``
    exits 0 either way: an answer from the engine with its sources named, or the fallback with
    the crash named in the warnings and in ``engine_check.trace``."""
    drop = tmp_path / "qwen3-next.yaml"
    drop.write_text(f"name: qwen3-next\nmodel: {TINY_QWEN3_NEXT}\ndevice: H100-80GB\nengine_version: \"0.32.0\"\n"
                    "max_num_batched_tokens: 2048\nmax_num_seqs: 16\n"
                    "candidates:\n  gpu_memory_utilization: [0.9]\n  max_model_len: [2048, 4096]\n")
    p = subprocess.run([sys.executable, "-m", "tuner.cli", "profile", str(drop), "--db", str(tmp_path / "r.sqlite"),
                        "--json"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    ts = doc["term_sources"]
    assert doc["plugin"] == "engine" and (ts["kv_cache_spec"], ts["weights"]) == ("engine", "engine")
    trace = doc["engine_check"].get("trace") or []
    if ts["activation_peak"] == "engine-trace":  # the trace ran: its sources named
        assert trace and all(t.get("release") == "0.32.0" for t in trace if "error" not in t)
        outcome = "engine-trace"
    else:  # the fallback: the generic decoder's activation, the crash (or why) named
        assert ts["activation_peak"] == "plugin(generic, approximate)"
        named = [w for w in doc["warnings"] if w.startswith("engine-trace not run (")]
        assert len(named) == 1 and trace and trace[-1].get("error")
        outcome = f"fallback ({trace[-1].get('crash') or trace[-1]['error'][:80]})"
    assert doc["proposals"] and doc["proposals"][0]["max_model_len"] in (2048, 4096)
    print(f"QWEN3-NEXT DROP: exit 0, activation {outcome}; proposal max_model_len "
          f"{doc['proposals'][0]['max_model_len']}")

"""Issue 34: a plugin-served model's engine cross-check runs once per (model config, vLLM build,
settings) and is stored (tuner.engine.stored); ``check`` and ``profile`` then answer from it with
no ``import vllm`` — and say when it is missing or stale.

Runs in the main suite: vLLM is a fake ``vllm`` package put on ``sys.path`` (a ``vllm-0.32.0``
dist-info, so the build is found by metadata) whose ``__init__`` records the import in a marker
file and raises; the cross-check itself is a stand-in engine session. The same question against
the real vLLM is ``tests/engine/test_engine_reliability.py``."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tuner.jobs import memoanswer
from tuner.jobs import passmemo
from tuner.engine import stored
from tuner.store.database import open_store

REPO = Path(__file__).resolve().parents[1]


def _fake_vllm(root: Path) -> tuple[Path, Path]:
    """``(sys.path entry, marker file)``: a ``vllm`` package whose import writes the marker and fails."""
    pkg = root / "fake-site" / "vllm"
    pkg.mkdir(parents=True)
    marker = root / "vllm-imported"
    (pkg / "__init__.py").write_text(
        "import os, sys\n"
        f"open({str(marker)!r}, 'a').write(str(os.getpid()) + ' ' + ' '.join(sys.argv[:2]) + '\\n')\n"
        "raise ImportError('fake vllm: imported on a path that must not import it')\n")
    dist = root / "fake-site" / "vllm-0.32.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n\n")
    return root / "fake-site", marker


def _drop(path: Path, config: Path, *, gmu=(0.9,), lens=(1024, 4096), name="tiny") -> Path:
    path.write_text(f"name: {name}\nmodel: {config}\ndevice: H100-80GB\nengine_version: \"0.32.0\"\n"
                    f"max_num_batched_tokens: 2048\nmax_num_seqs: 64\n"
                    f"candidates:\n  gpu_memory_utilization: {list(gmu)}\n  max_model_len: {list(lens)}\n")
    return path


def _spec(cls_name: str, **attrs):
    return type(cls_name, (SimpleNamespace,), {})(**attrs)


class _Session:
    """Stands in for tuner.engine.adapter.EngineSession: the tiny Llama's KV specs as vLLM 0.32 gives them."""

    opened = 0

    def __init__(self, model_dir, settings, path=None):
        type(self).opened += 1
        self.version, self.model_dir, self.timings, self.notes = "0.32.0", model_dir, {"import_s": 7.0}, []

    def config_report(self):
        return {"platform": "cpu", "max_model_len": 4096}

    def kv_cache_specs(self):
        return {f"model.layers.{i}.self_attn.attn": _spec(
            "FullAttentionSpec", block_size=16, num_kv_heads=2, head_size=16, dtype="torch.bfloat16",
            head_size_v=16, sliding_window=None, attention_chunk_size=None, page_size_padded=None) for i in range(2)}

    def weights(self):
        return {"bytes": 300_000, "by_dtype": {"bfloat16": 300_000}, "params": 150_000}

    def kv_sizing(self, available, m):
        return {"starts": True, "num_gpu_blocks": available // (2 * 16 * 2 * 2 * 16 * 2)}


def _request(drop: Path, **changes) -> dict:
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import load_drop

    req = prepare_request(load_drop(drop), download=False)[0]
    req.update(changes)
    return req


def _worker_run(request: dict) -> dict:
    from tuner.jobs.job import run_job

    return json.loads(json.dumps(run_job(copy.deepcopy(request))))


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    import importlib.util

    if "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None:
        pytest.skip("a real vLLM is installed here: the engine tier (tests/engine) asks the same with it")
    site, marker = _fake_vllm(tmp_path)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("CTX_TUNER_ENGINE", raising=False)
    import importlib

    importlib.invalidate_caches()
    import tuner.engine.adapter as adapter

    _Session.opened = 0
    monkeypatch.setattr(adapter, "open_session", _Session)
    yield SimpleNamespace(site=site, marker=marker)
    sys.modules.pop("vllm", None)


def test_plugin_served_answer_with_vllm_installed_imported_vllm(tmp_path, tiny_config, fake_vllm):
    """With vLLM installed every answer for a plugin-served model opened the engine (``import vllm``,
    7.8-23 s for a Llama-3.1-8B check) though only its cross-check needed it. The cross-check now
    runs once (``cross_check: run``) and is stored; a new question is then answered from the stored
    cross-check and the pass memo in this process: no engine session, no ``import vllm``."""
    assert passmemo.engine_takes_part(memoanswer.job_request(_request(_drop(tmp_path / "a.yaml", tiny_config))))
    db = str(tmp_path / "store.sqlite")
    open_store(db).close()
    calls = []

    def inner(req, **_kw):
        calls.append(req)
        return _worker_run(req)

    worker = memoanswer.memo_worker(db, inner)
    first = worker(_request(_drop(tmp_path / "a.yaml", tiny_config), cross_check="run"), job="j")
    ck = first["engine_check"]
    assert (len(calls), _Session.opened) == (1, 1)
    assert ck["cross_check"]["state"] == "ran" and ck["cross_check"]["vllm"] == "0.32.0"
    assert ck["decision"] == "plugin (engine agrees)" and ck["check"]["agree"] is True
    store = open_store(db)
    try:
        rows = stored.records_in(memoanswer.lookup_entries(store, memoanswer.job_request(calls[0])))
    finally:
        store.close()
    assert len(rows) == 1 and rows[0]["build"]["version"] == "0.32.0"
    assert rows[0]["build"]["origin"] == str(fake_vllm.site / "vllm" / "__init__.py")
    assert rows[0]["report"]["check"]["engine"]["specs"] == [
        {"kind": "FullAttentionSpec", "block_size": 16, "page_size_bytes": 2048, "layers": 2}]
    # a new question (other u and lengths), `profile`'s default: the stored cross-check, in this process
    again = worker(_request(_drop(tmp_path / "b.yaml", tiny_config, gmu=(0.5, 0.7), lens=(2048,), name="b"),
                            cross_check="stored"), job="j")
    assert (len(calls), _Session.opened) == (1, 1), "the engine was opened again"
    assert again[memoanswer.PASS_SOURCE]["source"] == "memo"
    block = again["engine_check"]["cross_check"]
    assert (block["state"], block["agree"], block["vllm"]) == ("stored", True, "0.32.0")
    assert block["checked_at"] == rows[0]["checked_at"]
    assert again["term_sources"]["kv_cache_spec"] == "plugin"
    assert not any("engine cross-check" in w and ("missing" in w or "stale" in w) for w in again["warnings"])
    assert "vllm" not in sys.modules and not fake_vllm.marker.exists()
    assert stored.state_line(block).startswith("engine cross-check: stored (vLLM 0.32.0, checked ")


def test_missing_and_stale_cross_check_are_said_without_importing_vllm(tmp_path, tiny_config, fake_vllm):
    """``cross_check: stored`` (check's and profile's default) with no record: the plugin answers,
    the job says ``missing``; with a record of another vLLM build: ``stale``, naming that build.
    Neither opens the engine."""
    db = str(tmp_path / "store.sqlite")
    open_store(db).close()
    worker = memoanswer.memo_worker(db, lambda req, **kw: _worker_run(req))
    drop = _drop(tmp_path / "a.yaml", tiny_config)
    missing = worker(_request(drop, cross_check="stored"), job="j")
    block = missing["engine_check"]["cross_check"]
    assert block["state"] == "missing" and "no stored cross-check of this model config" in block["why"]
    assert any(w.startswith("engine cross-check missing: no stored cross-check") for w in missing["warnings"])
    assert _Session.opened == 0
    worker(_request(drop, cross_check="run"), job="j")
    assert _Session.opened == 1
    # a reinstall (another build of the same version): the stored record is stale
    init = fake_vllm.site / "vllm" / "__init__.py"
    os.utime(init, ns=(init.stat().st_atime_ns, init.stat().st_mtime_ns + 10**9))
    stale = worker(_request(drop, cross_check="stored"), job="j")
    block = stale["engine_check"]["cross_check"]
    assert block["state"] == "stale" and f"vLLM 0.32.0 (vllm, {init})" in block["why"]
    assert any(w.startswith("engine cross-check stale: stored cross-check(s) of this model config are of another "
                            "vLLM build") for w in stale["warnings"])
    assert _Session.opened == 1 and not fake_vllm.marker.exists()


def test_stored_disagreement_keeps_the_engine_specs(tmp_path, tiny_config, fake_vllm, monkeypatch):
    """Where the engine disagreed, the stored record carries its KV specs: a later answer uses them
    (``kv_cache_spec: engine``) without the engine."""
    monkeypatch.setattr(_Session, "kv_cache_specs", lambda self: {f"model.layers.{i}.self_attn.attn": _spec(
        "FullAttentionSpec", block_size=16, num_kv_heads=4, head_size=16, dtype="torch.bfloat16", head_size_v=16,
        sliding_window=None, attention_chunk_size=None, page_size_padded=None) for i in range(2)})
    db = str(tmp_path / "store.sqlite")
    open_store(db).close()
    worker = memoanswer.memo_worker(db, lambda req, **kw: _worker_run(req))
    drop = _drop(tmp_path / "a.yaml", tiny_config)
    first = worker(_request(drop, cross_check="run"), job="j")
    assert first["engine_check"]["decision"] == "engine (plugin disagrees)"
    again = worker(_request(_drop(tmp_path / "b.yaml", tiny_config, gmu=(0.6,), name="b"), cross_check="stored"),
                   job="j")
    assert _Session.opened == 1 and again["engine_check"]["cross_check"]["agree"] is False
    assert again["term_sources"]["kv_cache_spec"] == "engine"
    assert again["kv_block_bytes"] == first["kv_block_bytes"] == [8192]  # 2 layers x 4 heads (the plugin: 2 heads, 4096)


def test_repeated_question_cold_cli_imports_neither_vllm_nor_torch(tmp_path, tiny_config, fake_vllm):
    """A fresh ``ctx-tuner profile`` process on a host with (a fake) vLLM on its path, the
    cross-check stored: answered with ``vllm`` and ``torch`` absent from ``sys.modules``, no worker,
    and the fake's import marker never written (no process tried ``import vllm``)."""
    db = str(tmp_path / "store.sqlite")
    open_store(db).close()
    worker = memoanswer.memo_worker(db, lambda req, **kw: _worker_run(req))
    worker(_request(_drop(tmp_path / "a.yaml", tiny_config), cross_check="run"), job="j")
    drop2 = _drop(tmp_path / "b.yaml", tiny_config, gmu=(0.5,), name="b")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(fake_vllm.site)]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("CTX_TUNER_WORKER_PYTHON", None)
    env.pop("CTX_TUNER_ENGINE", None)
    script = (
        "import json, sys, contextlib, io\n"
        "import tuner.seam.worker\n"
        "def no_worker(*a, **k):\n"
        "    raise SystemExit('a worker was started')\n"
        "tuner.seam.worker.run_in_worker = no_worker\n"
        "from tuner.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    rc = main(['profile', {str(drop2)!r}, '--db', {db!r}, '--json'])\n"
        "print(json.dumps({'rc': rc, 'vllm': 'vllm' in sys.modules, 'torch': 'torch' in sys.modules,\n"
        "                  'doc': json.loads(out.getvalue())}))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (got["rc"], got["vllm"], got["torch"]) == (0, False, False)
    assert got["doc"]["pass_source"]["source"] == "memo"
    assert got["doc"]["engine_check"]["cross_check"]["state"] == "stored"
    assert not fake_vllm.marker.exists()


def test_repeated_check_line_ran_vllm_parser_again(tmp_path, fake_vllm, monkeypatch):
    """``check --parser auto`` on a vLLM host ran vLLM's own parser (a subprocess importing vLLM,
    ~9-13 s) for every check of the same line. Its answer is kept per (line, vLLM build): the second
    parse runs no subprocess and says so; another build (a reinstall) parses again."""
    from tuner.engine import serve_parser as vsp

    monkeypatch.setenv(vsp.CACHE_ENV, str(tmp_path / "cache"))
    calls = []
    answer = {"vllm_version": "0.32.0", "model": "m", "model_given": True, "explicit": {"max_model_len": 4096},
              "options": {"max_model_len": ["--max-model-len"]}, "import_s": 9.5, "parse_s": 0.05}

    def call(self, args, stdin=None):
        calls.append(args)
        return 0, dict(answer)

    monkeypatch.setattr(vsp.VllmServeParser, "_call", call)
    parser = vsp.VllmServeParser(sys.executable)
    first = parser.parse(["m", "--max-model-len", "4096"])
    again = parser.parse(["m", "--max-model-len", "4096"])
    assert len(calls) == 1
    assert first.values == again.values == {"max_model_len": 4096}
    assert first.parser_info["import_s"] == 9.5 and "cached" not in first.parser_info
    assert again.parser_info["cached"] == str(tmp_path / "cache" / "vllm-parse") and again.parser_info["import_s"] is None
    parser.parse(["m", "--max-model-len", "8192"])  # another line
    assert len(calls) == 2
    init = fake_vllm.site / "vllm" / "__init__.py"
    os.utime(init, ns=(init.stat().st_atime_ns, init.stat().st_mtime_ns + 10**9))
    parser.parse(["m", "--max-model-len", "4096"])  # another build
    assert len(calls) == 3
    monkeypatch.setenv(vsp.CACHE_ENV, "off")
    parser.parse(["m", "--max-model-len", "4096"])
    assert len(calls) == 4


def test_daemon_warm_worker_got_no_stored_cross_check(tmp_path, tiny_config, fake_vllm):
    """The daemon's jobs go to its warm worker with the stored cross-checks of their model config
    (read with the memo): a job whose passes are not stored does not open the engine again; one
    with no record runs the cross-check there (a daemon request does not say ``cross_check``:
    ``run``) and returns the record with its memo entries for the daemon to store."""
    from tuner.daemon.service import Daemon

    db = str(tmp_path / "store.sqlite")
    open_store(db).close()
    seen = []

    def inner(req, **kw):
        seen.append(req)
        return _worker_run(req)

    first_req = _request(_drop(tmp_path / "a.yaml", tiny_config))
    first = Daemon._memo_first({}, inner)(first_req, job="j")
    rows = [e for e in first[passmemo.ENTRIES] if e["kind"] == stored.CROSSCHECK]
    assert len(rows) == 1 and first["engine_check"]["cross_check"]["state"] == "ran" and _Session.opened == 1
    entries = {r["memo_key"]: r["value"] for r in rows}  # what _lookups reads back from the store
    req2 = _request(_drop(tmp_path / "b.yaml", tiny_config, gmu=(0.6,), name="b"))
    again = Daemon._memo_first(entries, inner)(req2, job="j")
    assert len(seen[-1][stored.REQUEST_KEY]) == 1  # the worker got the record
    assert again["engine_check"]["cross_check"]["state"] == "stored" and _Session.opened == 1

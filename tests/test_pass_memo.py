"""The pass memo (issue 13): a job whose model spec and passes are stored is answered in the
parent process — no worker, no torch — with the same document a worker returns; anything that
changes a pass (tool version, config, settings) misses; ``--no-cache`` runs the worker."""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from tuner.jobs import memoanswer
from tuner.jobs import passmemo
from tuner.store.database import open_store

REPO = Path(__file__).resolve().parents[1]


def _strip(obj):
    """A job result without its timings (``elapsed_s``) and without where its passes came from
    (``pass_source``: memo or worker) — the only fields a memo answer may change."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in ("elapsed_s", "pass_source")}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _request(name: str) -> dict:
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import load_drop

    return prepare_request(load_drop(REPO / "configs" / "examples" / name), download=False)[0]


def _worker_run(request: dict) -> dict:
    """What a worker returns (run_job in this process, through JSON as the pipe does)."""
    from tuner.jobs.job import run_job

    return json.loads(json.dumps(run_job(copy.deepcopy(request))))


def _entries(result: dict) -> dict:
    return {e["memo_key"]: e["value"] for e in result[passmemo.ENTRIES]}


def _with(request: dict, **cand) -> dict:
    r = copy.deepcopy(request)
    r["drop"]["candidates"] = {**r["drop"]["candidates"], **cand}
    return r


def _fresh(request: dict) -> dict:
    out = _worker_run(request)
    out.pop(passmemo.ENTRIES, None)
    return out


@pytest.mark.parametrize("model,release", [(None, "0.19.0"), ("mistralai--Mixtral-8x7B-Instruct-v0.1", "0.27.0")])
def test_memo_answer_equals_fresh_computation_v1_other_gmu_and_length(model, release, request):
    """V1: one pass serves every max_model_len and gpu_memory_utilization; a new u and a new length
    grid are arithmetic. 0.27 with a MoE model (the V1 runner) charges the runner's block table,
    which depends on max_model_len: the memo recomputes that term, so the answer still equals a
    fresh run."""
    base = _request("llama-3.1-8b-h100.yaml")
    base["drop"]["engine_version"] = release
    if model is not None:
        base["config_path"] = str(request.getfixturevalue("shared_dir") / "models" / model / "config.json")
    first = _worker_run(_with(base, gpu_memory_utilization=[0.9]))
    entries = _entries(first)
    assert sorted(v.get("spec") is not None for v in entries.values()) == [False, True]  # 1 spec, 1 pass
    asked = _with(base, gpu_memory_utilization=[0.8, 0.85], max_model_len=[4096, 16384, 24576])
    answer, hits = memoanswer.answer_from_memo(asked, entries)
    assert answer is not None and len(hits) == 1
    fresh = _fresh(asked)
    assert _strip(answer) == _strip(fresh)
    assert [p["gpu_memory_utilization"] for p in answer["proposals"]] == [0.8, 0.85]
    assert [c["max_model_len"] for c in answer["candidates"]][:3] == [4096, 16384, 24576]
    if model is not None:  # the block table term really moved with the grid's largest length
        assert 0 < fresh["runs"][0]["persistent_bytes"] != first["runs"][0]["persistent_bytes"]


def test_memo_answer_equals_fresh_computation_v0():
    """V0 without chunked prefill: one pass per length probed. The same drop again is all memo;
    another u probes other lengths: the worker gets the passes already known and the answer is
    the same as a fresh run."""
    base = _request("llama-3.1-8b-rtx3090-v0.yaml")
    first = _worker_run(base)
    entries = _entries(first)
    # 15 lengths for the expected value's proposal, 4 more for the interval's safe end (risk safe)
    assert sum(1 for v in entries.values() if "spec" not in v) == 21
    again, _ = memoanswer.answer_from_memo(base, entries)
    assert again is not None and _strip(again) == _strip({k: v for k, v in first.items() if k != passmemo.ENTRIES})

    asked = _with(base, gpu_memory_utilization=[0.85])
    answer, hits = memoanswer.answer_from_memo(asked, entries)
    fresh = _fresh(asked)
    if answer is None:  # some lengths this u probes are new: the worker computes only those
        assert hits
        topped_up = _worker_run({**asked, passmemo.KNOWN_PASSES: hits})
        new = topped_up.pop(passmemo.ENTRIES, [])
        assert len([e for e in new if e["kind"] == "pass"]) == len(fresh["runs"]) - len(
            {k for k in hits if k in {e["memo_key"] for e in first[passmemo.ENTRIES]}})
        answer = topped_up
    assert _strip(answer) == _strip(fresh)
    assert [p["max_model_len"] for p in fresh["proposals"]] != [p["max_model_len"] for p in first["proposals"]]


def test_pass_from_an_older_tool_version_misses(monkeypatch, tmp_path):
    base = _request("llama-3.1-8b-h100.yaml")
    first = _worker_run(base)
    assert memoanswer.answer_from_memo(base, _entries(first))[0] is not None
    monkeypatch.setattr(passmemo, "__version__", "99.0.0")
    assert memoanswer.answer_from_memo(base, _entries(first)) == (None, {})
    # and the store hands out only the entries of the tool version asking
    store = open_store(f"sqlite:///{tmp_path / 's.sqlite'}")
    try:
        store.put_memo(first[passmemo.ENTRIES])
        cfg = first["model"]["config_sha256"]
        assert len(store.memo_entries(cfg, first["versions"]["tool"])) == 2
        assert store.memo_entries(cfg, "99.0.0") == {}
    finally:
        store.close()


def test_pass_of_a_different_config_or_setting_misses(tmp_path):
    base = _request("llama-3.1-8b-h100.yaml")
    entries = _entries(_worker_run(base))
    # another config.json (one layer fewer) in another directory: no spec, no pass
    src = Path(base["config_path"])
    other = tmp_path / "llama-30"
    other.mkdir()
    cfg = json.loads(src.read_text())
    cfg["num_hidden_layers"] = 30
    (other / "config.json").write_text(json.dumps(cfg))
    assert memoanswer.answer_from_memo({**base, "config_path": str(other / "config.json")}, entries) == (None, {})
    # the same model with another max_num_batched_tokens or kv_cache_dtype: the spec hits, the pass misses
    for key, value in (("max_num_batched_tokens", 4096), ("dtype", "float16")):
        changed = copy.deepcopy(base)
        changed["drop"][key] = value
        assert memoanswer.answer_from_memo(changed, entries) == (None, {})


def test_put_memo_twice_keeps_one_row_per_key(db_url):
    entries = [passmemo.entry(passmemo.PASS, "a" * 64, {"weights_bytes": 1}, spec=_Spec(), era="e"),
               passmemo.entry(passmemo.PASS, "a" * 64, {"weights_bytes": 1}, spec=_Spec(), era="e"),
               passmemo.entry(passmemo.SPEC, "b" * 64, {"spec": {"x": [1, 2]}}, spec=_Spec())]
    store = open_store(db_url)
    try:
        store.put_memo(entries)
        store.put_memo(entries[:1])  # a second host storing the same pass
        got = store.memo_entries("c" * 64, passmemo.__version__)
        assert got == {"a" * 64: {"weights_bytes": 1}, "b" * 64: {"spec": {"x": [1, 2]}}}
        import sqlalchemy as sa

        with store.engine.connect() as c:
            assert c.execute(sa.text("SELECT count(*) FROM pass_memo")).scalar() == 2
    finally:
        store.close()


class _Spec:
    config_sha256 = "c" * 64


def _tiny_drop(tmp_path: Path, tiny_config: Path, gmu=(0.9,), name="tiny") -> Path:
    d = tmp_path / f"{name}.yaml"
    d.write_text(f"name: {name}\nmodel: {tiny_config}\ndevice: H100-80GB\nengine_version: \"0.19.0\"\n"
                 f"max_num_batched_tokens: 2048\nmax_num_seqs: 64\n"
                 f"candidates:\n  gpu_memory_utilization: {list(gmu)}\n  max_model_len: [1024, 4096]\n")
    return d


def test_no_cache_runs_the_worker_and_a_repeated_question_does_not(tmp_path, tiny_config):
    from tuner.jobs.app import profile

    calls = []

    def inner(request, **kw):
        calls.append(request)
        return _worker_run(request)

    db = str(tmp_path / "store.sqlite")
    first = profile(str(_tiny_drop(tmp_path, tiny_config)), db_url=db, worker=inner)
    assert len(calls) == 1
    second = profile(str(_tiny_drop(tmp_path, tiny_config, gmu=(0.5, 0.7), name="tiny2")), db_url=db, worker=inner)
    assert len(calls) == 1  # answered from the memo
    forced = profile(str(_tiny_drop(tmp_path, tiny_config, gmu=(0.5, 0.7), name="tiny3")), db_url=db,
                     worker=inner, cache=False)
    assert len(calls) == 2
    assert _strip(second.result) == _strip(forced.result)
    assert [p["gpu_memory_utilization"] for p in second.result["proposals"]] == [0.5, 0.7]
    assert first.result["proposals"][0]["max_model_len"] == 4096
    assert passmemo.ENTRIES not in second.result and passmemo.ENTRIES not in forced.result


#: What a cold memo answer must not import: no worker (torch, transformers), and no Alembic nor
#: SQLAlchemy: a SQLite store at the head revision is read and written through the standard
#: library (tuner.store.litestore).
_HEAVY = ("torch", "transformers", "alembic", "sqlalchemy")


def _cold_cli(tmp_path, tiny_config, gmu, args: list[str]) -> tuple[dict, Path, str, dict]:
    """Store the tiny model's passes with one ``profile`` run, then ask ``args`` (a command and its
    options; the new drop and ``--db`` are appended) in a fresh process whose worker function
    fails if called: ``(got, drop, db, env)`` with ``got`` = ``{rc, loaded, out}`` (``loaded``:
    the :data:`_HEAVY` modules it imported, ``out``: its stdout)."""
    db = str(tmp_path / "store.sqlite")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CTX_TUNER_WORKER_PYTHON", None)
    subprocess.run([sys.executable, "-m", "tuner.cli", "profile", str(_tiny_drop(tmp_path, tiny_config)),
                    "--db", db], check=True, capture_output=True, env=env, cwd=tmp_path, timeout=600)
    drop2 = _tiny_drop(tmp_path, tiny_config, gmu=gmu, name="tiny2")
    argv = [args[0], str(drop2), "--db", db, *args[1:]]
    script = (
        "import json, sys\n"
        "import tuner.seam.worker\n"
        "def no_worker(*a, **k):\n"
        "    raise SystemExit('a worker was started')\n"
        "tuner.seam.worker.run_in_worker = no_worker\n"
        "from tuner.cli import main\n"
        "import contextlib, io\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    rc = main({argv!r})\n"
        f"print(json.dumps({{'rc': rc, 'loaded': [m for m in {_HEAVY!r} if m in sys.modules], "
        "'out': out.getvalue()}))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), drop2, db, env


def test_cold_cli_repeated_question_imports_no_torch(tmp_path, tiny_config):
    """A fresh ``ctx-tuner profile`` process asked a known model at another u: answered from the
    memo with no worker (the worker function is replaced by one that fails) and without torch,
    transformers, Alembic or SQLAlchemy in ``sys.modules``; the printed document is what
    ``--no-cache`` prints."""
    got, drop2, db, env = _cold_cli(tmp_path, tiny_config, (0.5, 0.7), ["profile", "--json"])
    assert (got["rc"], got["loaded"]) == (0, [])
    fresh = subprocess.run([sys.executable, "-m", "tuner.cli", "profile", str(drop2), "--db", db, "--json",
                            "--no-cache"], check=True, capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=600)
    doc, forced = json.loads(got["out"]), json.loads(fresh.stdout)
    # where the passes came from: the memo (naming the run that computed them), or a worker
    n = len(doc["runs"])  # one pass per profile batch the two lengths need
    assert n >= 1
    assert doc["pass_source"] == {"source": "memo", "stored_passes": n, "computed_passes": 0, "first_run_id": 1,
                                  "first_drop_id": 1}
    assert forced["pass_source"] == {"source": "worker", "stored_passes": 0, "computed_passes": n,
                                     "reason": "no-cache"}
    assert doc.pop("drop_id") == forced.pop("drop_id")  # the same drop and results: its row reused (issue 31)
    assert _strip(doc) == _strip(forced)
    assert [p["gpu_memory_utilization"] for p in doc["proposals"]] == [0.5, 0.7]


def test_cold_cli_explain_from_the_memo_imported_sqlalchemy(tmp_path, tiny_config):
    """``explain`` answered from the memo of a SQLite store reads it through the standard library
    (tuner.store.litestore): a fresh process imports neither torch nor SQLAlchemy (≈0.3 s of a cold
    answer) and prints the memo's answer."""
    got, _drop, _db, _env = _cold_cli(tmp_path, tiny_config, (0.5,), ["explain"])
    assert (got["rc"], got["loaded"]) == (0, [])
    assert "passes: memo (2 stored passes; no worker, no torch)" in got["out"].splitlines()


def _code_names(path: Path) -> list[str]:
    """Attribute names used in a module's code (strings and comments left out)."""
    toks = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    return [b.string for a, b in zip(toks, toks[1:]) if a.string == "." and b.type == tokenize.NAME]


def test_builtin_plugins_never_read_settings_max_model_len():
    """The pass key of a built-in plugin leaves ``max_model_len`` out (:func:`tuner.jobs.passmemo.pass_key`):
    no built-in plugin or simulator module reads it (the runner's persistent buffers, the one term
    that depends on it, are recomputed by :func:`tuner.memory.budget.persistent_bytes`)."""
    files = sorted((REPO / "plugins").glob("*.py")) + sorted((REPO / "tuner" / "model" / "simulate").rglob("*.py"))
    assert len(files) > 10
    readers = [f.name for f in files if "max_model_len" in _code_names(f)]
    # the one that does (DeepSeek-V4's indexer buffers) says so, and its passes are keyed per length
    assert readers == ["dsv4.py"]


def test_deepseek_v4_passes_were_shared_across_lengths():
    """DeepSeek-V4's profile run sizes the indexer's prefill buffer on ``max_model_len``: a pass
    memoized at one length must not answer another."""
    import importlib

    from tuner.jobs.passmemo import pass_key
    from tuner.memory.eras import ProfileBatch, era_for
    from tuner.model.plugin import RankSettings

    dsv4 = importlib.import_module("plugins.deepseek_v4").DeepseekV4Plugin()
    generic = importlib.import_module("plugins.generic").GenericDecoderPlugin()
    assert dsv4.reads_max_model_len is True and not getattr(generic, "reads_max_model_len", False)

    class Spec:
        config_sha256 = "0" * 64

    era = era_for("0.22.0")
    batch = ProfileBatch(max_num_batched_tokens=16384, max_num_seqs=256, num_reqs=256, chunked_prefill=True)

    def key(plugin, length):
        return pass_key(spec=Spec(), plugin=plugin, settings=RankSettings(engine_version="0.22.0", dtype="bfloat16",
                                                                            max_model_len=length),
                        era=era, batch=batch, fake=True, model_runner_v2=False, device_name="GH200")

    assert key(dsv4, 30000) != key(dsv4, 13528)
    assert key(generic, 30000) == key(generic, 13528)


def test_daemon_answers_a_new_drop_with_memoized_passes_without_a_worker(tmp_path, tiny_config):
    """A second drop file (another name and u: another result key) of a model whose passes the
    daemon stored is answered in the daemon's process: the worker is not called, the proposal file
    is written and holds what a fresh computation proposes."""
    import yaml

    from tests._daemon_helpers import drop_text, poll, settings_for
    from tuner.daemon.service import Daemon
    from tuner.daemon.notify import Notifier

    calls = []

    def inner(request, **kw):
        calls.append(request["drop"]["name"])
        return _worker_run(request)

    s = settings_for(tmp_path, worker_python=None)
    conf, proposals = Path(s.watch_dir), Path(s.state_dir) / "proposals"
    d = Daemon(s, notifier=Notifier({}), worker=inner)
    d.start()
    try:
        (conf / "a.yaml").write_text(drop_text("a", tiny_config, gmu=(0.5,)))
        poll(lambda: (proposals / "a.yaml").exists(), 120, step=lambda: d.step(max_wait_s=0.05), what="a's proposal")
        assert calls == ["a"]
        (conf / "b.yaml").write_text(drop_text("b", tiny_config, gmu=(0.3, 0.7)))
        poll(lambda: (proposals / "b.yaml").exists(), 60, step=lambda: d.step(max_wait_s=0.05), what="b's proposal")
        assert calls == ["a"]  # no worker for b
        doc = yaml.safe_load((proposals / "b.yaml").read_text())
    finally:
        d.shutdown()
    from tuner.jobs.app import prepare_request
    from tuner.question.drop import load_drop

    fresh = _fresh(prepare_request(load_drop(conf / "b.yaml"), download=False)[0])
    text = json.dumps(doc)
    for p in fresh["proposals"]:
        assert p["vllm_args"] in text
    assert [p["gpu_memory_utilization"] for p in fresh["proposals"]] == [0.3, 0.7]


def test_env_versions_are_what_importlib_metadata_reports():
    """The versions in every memo key are read from the packages' metadata headers only (no email
    parse of transformers' README): the same strings ``importlib.metadata.version`` gives."""
    from importlib import metadata

    passmemo.env_versions.cache_clear()
    got = passmemo.env_versions()
    for name in ("torch", "transformers"):
        try:
            want = metadata.version(name)
        except metadata.PackageNotFoundError:
            want = None
        assert got[name] == want
    assert passmemo._version_header("Metadata-Version: 2.1\nName: x\nVersion: 1.2.3\n\nVersion: 9\n") == "1.2.3"
    assert passmemo._version_header("Name: x\n\nVersion: 9\n") is None  # a body line is not a header


def test_pass_source_line_names_the_memo_or_the_worker():
    from tuner.jobs.memoanswer import pass_source_line

    assert pass_source_line({"source": "memo", "stored_passes": 2, "computed_passes": 0, "first_run_id": 7,
                             "first_drop_id": 3}) == \
        "passes: memo (2 stored passes, first computed in profile run 7 of drop 3; no worker, no torch)"
    assert pass_source_line({"source": "memo", "stored_passes": 1, "computed_passes": 0}) == \
        "passes: memo (1 stored pass; no worker, no torch)"
    assert pass_source_line({"source": "worker", "stored_passes": 0, "computed_passes": 13, "reason": "no-cache"}) == \
        "passes: worker (13 computed, 0 from the memo; --no-cache)"
    assert pass_source_line(None) is None and pass_source_line({"source": "?"}) is None


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports (top level or inside functions)."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_import_circle_passmemo_job_simulate_stays_cut():
    """The memo's vocabulary (tuner.jobs.passmemo) is used by tuner.jobs.job, so it never imports the job
    (the parent side that runs jobs is tuner.jobs.memoanswer); the simulator takes the runner's buffers
    from tuner.memory.budget, not from the memo. Either import back would close the circle
    job -> engine.use -> simulate.profile -> passmemo -> job again."""
    assert not {m for m in _imported_modules(REPO / "tuner" / "jobs" / "passmemo.py") if m.startswith("tuner.jobs.job")
                or m.startswith("tuner.jobs.memoanswer") or m.startswith("tuner.model.simulate")}
    assert not {m for m in _imported_modules(REPO / "tuner" / "model" / "simulate" / "profile.py") if "passmemo" in m}
    from tuner.memory.budget import DTYPE_BYTES, persistent_bytes  # where the two names live now

    assert DTYPE_BYTES["bfloat16"] == 2 and callable(persistent_bytes)


def test_runner_block_table_sized_at_the_proposed_length_not_the_grid_max(shared_dir, monkeypatch):
    """V1 runner on 0.27–0.29 (Qwen3-30B-A3B, a MoE model): the runner's persistent buffers hold
    the placeholder block table ``[S, cdiv(max_model_len, 16)]`` int32, charged through
    ``total_consumed``. The passes were run with ``max_model_len = max(grid)`` and that one figure
    served every length: a drop with grid [4096] proposed 40960 with the block table of 4096
    (34,906,112 B of buffers, 7261 blocks, 11,421,430,498 B of KV cache) where the [40960] grid
    answers 7255 blocks, 11,411,993,314 B (44,343,296 B of buffers; 0.27 has no ``is_padding``
    buffer, 8,192 B more KV than before the release audit) — 6 blocks too many. Each
    point is now charged at its own length: grid points, the search's off-grid points and answers
    from the pass memo alike."""
    import tuner.jobs.job

    base = _request("llama-3.1-8b-h100.yaml")
    base["drop"]["engine_version"] = "0.27.0"
    base["config_path"] = str(shared_dir / "models" / "Qwen--Qwen3-30B-A3B" / "config.json")
    base["search"] = True
    searched: list = []
    real_propose = tuner.jobs.job.propose

    def spy(*a, **kw):
        prop, seen = real_propose(*a, **kw)
        searched.extend(seen)
        return prop, seen

    monkeypatch.setattr(tuner.jobs.job, "propose", spy)
    small = _worker_run(_with(base, gpu_memory_utilization=[0.9], max_model_len=[4096]))
    at_small = {c.max_model_len: c for c in searched}[40960]
    searched.clear()
    large = _worker_run(_with(base, gpu_memory_utilization=[0.9], max_model_len=[40960]))
    [c40960] = large["candidates"]
    assert (c40960["num_gpu_blocks"], c40960["available_kv_cache_bytes"]) == (7324, 11_519_839_223)
    assert large["runs"][0]["persistent_bytes"] == 44_343_296
    assert small["runs"][0]["persistent_bytes"] == 34_906_112  # the pass as run, at the grid's 4096
    # the proposal above the grid: the figures of the [40960] grid (was 7261 blocks, 11,421,430,498 B);
    # since §24's reserve refit 7324 / 7330 blocks where 7255 / 7261 were
    [prop] = small["proposals"]
    assert prop["max_model_len"] == 40960 and prop["num_gpu_blocks"] == large["proposals"][0]["num_gpu_blocks"] == 7324
    assert (at_small.num_gpu_blocks, at_small.available_kv_cache_bytes) == (7324, 11_519_839_223)
    # a grid point below the grid's largest length is charged its own block table, not 40960's
    [c4096] = small["candidates"]
    assert (c4096["num_gpu_blocks"], c4096["available_kv_cache_bytes"]) == (7330, 11_529_323_593)
    both = _worker_run(_with(base, gpu_memory_utilization=[0.9], max_model_len=[4096, 40960]))
    assert [(c["num_gpu_blocks"], c["available_kv_cache_bytes"]) for c in both["candidates"]] == [
        (7330, 11_529_323_593), (7324, 11_519_839_223)]
    # the memo: one stored pass (persistent at the storing job's length) answers the other grid
    for stored, asked, fresh in ((small, [40960], large), (large, [4096], small)):
        answer, _ = memoanswer.answer_from_memo(_with(base, gpu_memory_utilization=[0.9], max_model_len=asked),
                                                _entries(stored))
        assert answer is not None
        assert _strip(answer["candidates"]) == _strip(fresh["candidates"])
        assert _strip(answer["proposals"]) == _strip(fresh["proposals"])


# -- issue 34: the engine's answers memoized ---------------------------------------------------------

def test_repeated_question_with_vllm_installed_was_not_memoizable(tmp_path, monkeypatch):
    """With vLLM installed every answer was "not memoizable: … an engine adapter" — a repeated
    question paid the worker, torch and ``import vllm`` every time. The worker now returns the
    engine's whole answer as a memo entry keyed by the request and the vLLM build, and a repeat is
    answered in this process (no worker, no ``import vllm``); another build, or other settings,
    miss. (Here the engine takes part without vLLM being imported at all: a V0 release, where the
    adapter only records that it skipped the cross-check.)"""
    import tuner.releases.installed as engine_pkg  # where the probe lives (tuner.engine re-exports it)

    build = {"dist": "vllm", "version": "0.32.0", "origin": "/venv/vllm/__init__.py", "mtime_ns": 1}
    monkeypatch.setattr(engine_pkg, "vllm_importable", lambda: True)
    monkeypatch.setattr(passmemo, "engine_build", lambda: dict(build))
    request = _request("llama-3.1-8b-h100.yaml")
    request["drop"]["engine_version"] = "0.6.5"  # V0: the adapter takes part without importing vLLM
    request["drop"]["candidates"]["max_model_len"] = [4096, 8192]  # V0 without chunked prefill
    db = tmp_path / "memo.sqlite"
    open_store(str(db)).close()
    calls = []

    def inner(req, **_kw):
        calls.append(1)
        return _worker_run(req)

    worker = memoanswer.memo_worker(str(db), inner)
    first = worker(copy.deepcopy(request), job="j")
    assert len(calls) == 1 and first[memoanswer.PASS_SOURCE]["source"] == "worker"
    assert any("engine cross-check skipped" in w for w in first["warnings"])
    again = worker(copy.deepcopy(request), job="j")
    assert len(calls) == 1, "answered by a worker again"
    # no engine took part (a V0 release: the adapter only records that it skipped), so the plain
    # pass memo answers, as on a host without vLLM (tuner.engine.stored: memoizable unless the
    # engine itself serves the model)
    n = len(first["runs"])
    assert again[memoanswer.PASS_SOURCE] == {"source": "memo", "stored_passes": n, "computed_passes": 0}
    assert _strip(again) == _strip(first)
    assert "vllm" not in sys.modules
    # another drop name, same question: the same answer
    renamed = copy.deepcopy(request)
    renamed["drop"]["name"] = "other-name"
    worker(renamed, job="j")
    assert len(calls) == 1
    # another vLLM build: nothing of the engine is in this answer, the memo still answers
    build["mtime_ns"] = 2
    worker(copy.deepcopy(request), job="j")
    assert len(calls) == 1
    # another setting whose pass is not stored: a worker
    other = copy.deepcopy(request)
    other["drop"]["max_num_seqs"] = 128
    worker(other, job="j")
    assert len(calls) == 2
    # the engine off: no engine answer is looked for (the plain pass memo, as without vLLM)
    key = passmemo.engine_answer_key(memoanswer.job_request(request))
    monkeypatch.setenv("CTX_TUNER_ENGINE", "off")
    assert memoanswer.answer_from_memo(request, {key: first}) == (None, {})


def test_memo_answer_missed_the_encoder_budget_refusal(shared_dir):
    """The failure it guards: the encoder-budget refusal (--disable-chunked-mm-input, vLLM's
    compute_mm_encoder_budget) needs the largest multimodal item's tokens, which only the torch pass
    knows; an answer from the memo (no torch) must refuse what the worker refuses. The pass row
    carries ``mm_max_tokens_per_item`` (Gemma 3: 256): the memo answers the drop whose batch holds the
    item and leaves the refused one to the worker, which raises vLLM's message (0.12.0: the flag given,
    not forced)."""
    from tuner.errors import DropError

    base = _request("llama-3.1-8b-h100.yaml")
    base["drop"]["engine_version"] = "0.12.0"  # before vLLM forces the flag for Gemma 3 (0.13)
    base["config_path"] = str(shared_dir / "models" / "google--gemma-3-4b-it" / "config.json")
    base["drop"].update(max_num_batched_tokens=512, max_num_seqs=128)
    first = _worker_run(_with(base, gpu_memory_utilization=[0.9], max_model_len=[8192]))
    rows = [v for v in _entries(first).values() if v.get("spec") is None]
    assert [r["mm_max_tokens_per_item"] for r in rows] == [256]
    assert first["runs"][0]["mm_max_tokens_per_item"] == 256
    asked = copy.deepcopy(base)
    asked["drop"].update(disable_chunked_mm_input=True, max_num_batched_tokens=512)
    answer, _ = memoanswer.answer_from_memo(_with(asked, gpu_memory_utilization=[0.9], max_model_len=[8192]),
                                            _entries(first))
    assert answer is not None and answer["proposals"]  # 256 tokens fit 512: the memo answers, no refusal
    small = copy.deepcopy(base)
    small["drop"]["max_num_batched_tokens"] = 200
    entries = _entries(_worker_run(_with(small, gpu_memory_utilization=[0.9], max_model_len=[8192])))
    small["drop"]["disable_chunked_mm_input"] = True
    asked = _with(small, gpu_memory_utilization=[0.9], max_model_len=[8192])
    # the memo does not answer a refused drop (any error goes to the worker, which reports it as always)
    assert memoanswer.answer_from_memo(asked, entries) == (None, {})
    with pytest.raises(DropError, match=r"max_tokens_per_mm_item \(256\) is larger than max_num_batched_tokens \(200\)"):
        _worker_run(asked)

"""What a new user met (issue 31): wrong answers and statements outside the memory model, one
regression test each, named after the failure. No test uses the network: an unreachable Hub is
a closed port on 127.0.0.1 or a fake that raises."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest


# -- (a) no network and an HF id -------------------------------------------------------------------

def _env(**extra):
    e = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    e.update(TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    e.update(extra)
    return e


def test_unreachable_hub_said_the_repo_has_no_config_json(tmp_path):
    """Port 9 on 127.0.0.1 refuses: the user gets the offline message (places searched, the cache,
    how to fill it) with why the Hub was not asked, at once — not "has no config.json"."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tuner.cli", "check", "--device", "H100-80GB", "--engine-version",
                        "0.19.0", "--no-variants", "--", "vllm", "serve", "some-org/some-model"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=_env(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE="0"))
    took = time.monotonic() - t0
    assert r.returncode == 2
    assert "has no config.json" not in r.stderr
    assert ("no config.json found (searched: " in r.stderr
            and "not fetched: the Hub at http://127.0.0.1:9 cannot be reached (127.0.0.1:9: Connection refused)"
            in r.stderr and "`hf download some-org/some-model config.json`" in r.stderr), r.stderr
    assert "Retrying" not in r.stderr
    assert took < 20  # huggingface_hub alone retries for 23 s


def test_local_entry_not_found_was_caught_as_entry_not_found(monkeypatch, tmp_path):
    """huggingface_hub's LocalEntryNotFoundError (not cached, Hub did not answer) subclasses
    EntryNotFoundError: it read "has no config.json"."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from tuner.model import hub
    from tuner.errors import ModelConfigError
    from tuner.model.modelspec import resolve_model_path

    def down(*a, **k):
        try:
            raise ConnectionError("[Errno 101] Network is unreachable")
        except ConnectionError as exc:
            raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub") from exc

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", down)
    monkeypatch.setattr(hub, "hub_unreachable", lambda *a, **k: None)  # the probe passed, the request failed
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(hub.HubUnreachable) as e:
        hub.fetch_config("some-org/some-model")
    assert "has no config.json" not in str(e.value)
    assert "did not answer: ConnectionError: [Errno 101] Network is unreachable" in e.value.why
    with pytest.raises(ModelConfigError) as e:
        resolve_model_path("some-org/some-model", download=True)
    assert "no config.json found (searched: " in str(e.value) and "not fetched: the Hub at" in str(e.value)
    assert "hf download some-org/some-model config.json" in str(e.value)


def test_hub_retry_lines_were_printed_twice():
    """huggingface_hub logs through its own handler and propagated to the CLI's root handler."""
    from tuner.model.hub import log_once

    lib = logging.getLogger("huggingface_hub")
    saved = lib.propagate
    try:
        import huggingface_hub.file_download  # noqa: F401  (the library installs its handler)

        lib.propagate = True
        log_once()
        assert lib.handlers and lib.propagate is False
    finally:
        lib.propagate = saved


# -- (e) status said "healthy" while drops failed ---------------------------------------------------

@pytest.fixture
def failed_daemon(tmp_path, tiny_config):
    """A daemon with three failed drops (invalid input) and its settings file."""
    import yaml

    from tests.test_daemon import Harness

    h = Harness(tmp_path, tiny_config)
    d = h.start()
    (h.conf / "bad.yaml").write_text("name: bad-name\nmodel: [1, 2]\n")
    (h.conf / "typo.yaml").write_text(f"name: typo\nmodel: {tiny_config}\ndevice: H100-80GB\n"
                                      "gpu_memory_utilisation: 0.9\n")
    (h.conf / "garbage.yaml").write_text("name: [unclosed\n")
    h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'failed'") == [(3,)], what="3 failed")
    d.step(max_wait_s=0.05)
    p = tmp_path / "tuner.yaml"
    p.write_text(yaml.safe_dump({"watch_dir": str(h.conf), "state_dir": h.settings.state_dir}))
    yield h, d, p
    h.close()


def test_status_said_healthy_printing_a_dict_and_naming_no_failed_drop(failed_daemon, capsys):
    from tuner.cli import main

    h, _, p = failed_daemon
    assert main(["status", "--settings", str(p)]) == 0  # the daemon is healthy; its failed drops are named
    out = capsys.readouterr().out
    assert "{'failed': 3}" not in out
    assert "  jobs (host " in out and "): 3 failed\n" in out
    assert "  3 drops failed (`ctx-tuner status --failed` for the full reasons" in out
    assert f"    bad-name ({h.conf / 'bad.yaml'} on " in out
    assert "): invalid input, DropError: " in out and "not list [1, 2]" in out


def test_failed_drops_had_no_read_only_list(failed_daemon, capsys):
    """``status --failed`` lists them with their full reasons and re-queues nothing (``retry
    --failed`` was the only list, and it re-queued)."""
    import json

    from tuner.cli import main

    h, _, p = failed_daemon
    assert main(["status", "--settings", str(p), "--failed"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[0].startswith(f"bad-name ({h.conf / 'bad.yaml'} on ")
    typo = next(line for line in out if line.startswith("typo "))
    assert typo.endswith("kv_cache_dtype, quantization, tensor_parallel_size, pipeline_parallel_size, max_num_seqs, "
                         "max_num_batched_tokens, kv_cache_memory_bytes, block_size, enable_chunked_prefill, "
                         "enable_prefix_caching, data_parallel_size, enable_expert_parallel, "
                         "other_processes_memory_gib, disable_custom_all_reduce, speculative_config, hf_overrides, "
                         "enforce_eager, entry_point, candidates, constraints") or "did you mean" in typo
    assert h.rows("SELECT count(*) FROM jobs WHERE status = 'failed'") == [(3,)]  # read-only
    assert main(["status", "--settings", str(p), "--failed", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert sorted(f["name"] for f in doc["failed"]) == ["bad-name", "garbage", "typo"]
    assert {f["kind"] for f in doc["failed"]} == {"drop"}


def test_failed_drop_had_no_file_beside_the_proposals(failed_daemon):
    import yaml

    h, d, _ = failed_daemon
    failed = h.settings.proposals_dir / "failed"
    assert sorted(p.name for p in failed.iterdir()) == ["bad-name.yaml", "garbage.yaml", "typo.yaml"]
    doc = yaml.safe_load((failed / "bad-name.yaml").read_text())
    assert doc["drop"] == "bad-name" and doc["file"] == str(h.conf / "bad.yaml") and doc["kind"] == "drop"
    assert doc["error_type"] == "DropError" and "not list [1, 2]" in doc["reason"]
    assert doc["run_again"] == "ctx-tuner retry bad-name"
    (h.conf / "bad.yaml").unlink()  # retired: its failure file goes
    h.until(d, lambda: not (failed / "bad-name.yaml").exists(), what="failure file removed")
    d.reconcile()
    assert sorted(p.name for p in failed.iterdir()) == ["garbage.yaml", "typo.yaml"]


def test_failed_drops_had_no_metric(failed_daemon):
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tuner.daemon.metrics import StoreCollector

    h, d, _ = failed_daemon
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(d.store.engine.connect, lambda: d.queue.owner_id))
    samples = [s for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples
               if s.name == "ctx_tuner_drop_failed"]
    assert sorted((s.labels["drop"], s.labels["kind"], s.labels["error_type"], s.value) for s in samples) == [
        ("bad-name", "drop", "DropError", 1.0), ("garbage", "drop", "DropError", 1.0),
        ("typo", "drop", "DropError", 1.0)]


def test_retry_message_was_cut_mid_word():
    from tuner.daemon.failures import short

    reason = ("worker failed: the model config weights are " + "compressed " * 20 + "(ratio 4.2)")
    text = short(reason, 120)
    assert len(text) <= 122 and text.endswith(" …") and "(ratio )" not in text
    assert text[:-2].split()[-1] == "compressed"  # a whole word before the ellipsis
    assert short("short reason (ratio 4.2)", 120) == "short reason (ratio 4.2)"


# -- (d) proposals for old releases said "use: vllm serve --config THIS_FILE" -----------------------

def _docs(version, prop=None):
    from tests.test_vllm_forms import MODEL, PROP
    from tuner.question.vllm_forms import proposal_configs, proposal_documents

    prop = prop or PROP
    f = proposal_configs(MODEL, prop, engine_version=version, kv_cache_bytes=3_101_450_240)
    e = dict(prop, vllm_config=f["gpu_memory_utilization"], vllm_config_kv_cache_memory_bytes=f["kv_cache_memory_bytes"])
    return dict(proposal_documents(MODEL, version, [e]))


def test_old_release_proposal_said_vllm_serve_config_with_the_model_inside():
    import yaml

    # 0.5.x: no --config at all (vllm/utils.py FlexibleArgumentParser reads it from 0.6.0)
    docs = _docs("0.5.4")
    assert list(docs) == ["gpu-memory-utilization-0.9.sh"]
    assert docs["gpu-memory-utilization-0.9.sh"].splitlines()[-1] == (
        'exec vllm serve /models/llama --max-model-len 40064 --gpu-memory-utilization 0.9 --tensor-parallel-size 2 '
        '--kv-cache-dtype fp8 --enable-chunked-prefill False --enforce-eager "$@"')
    # 0.6.0-0.6.3: the model positional, `key: true` would load as `--key True`
    text = _docs("0.6.2")["gpu-memory-utilization-0.9.yaml"]
    assert "# use: vllm serve /models/llama --config THIS_FILE --enforce-eager\n" in text
    assert yaml.safe_load(text) == {"max-model-len": 40064, "gpu-memory-utilization": 0.9, "tensor-parallel-size": 2,
                                    "kv-cache-dtype": "fp8", "enable-chunked-prefill": "False"}
    # 0.6.4-0.8.2: booleans load, the model is still positional
    text = _docs("0.8.2")["gpu-memory-utilization-0.9.yaml"]
    assert "# use: vllm serve /models/llama --config THIS_FILE\n" in text and "model" not in yaml.safe_load(text)
    assert yaml.safe_load(text)["enforce-eager"] is True
    # 0.8.3+: the model in the file; 0.8.5+: --no-enable-chunked-prefill
    text = _docs("0.8.3")["gpu-memory-utilization-0.9.yaml"]
    assert "# use: vllm serve --config THIS_FILE\n" in text and yaml.safe_load(text)["model"] == "/models/llama"
    assert yaml.safe_load(_docs("0.19.0")["gpu-memory-utilization-0.9.yaml"])["no-enable-chunked-prefill"] is True


def test_old_release_config_held_a_mapping_its_loader_writes_as_a_python_repr():
    import yaml

    from tests.test_vllm_forms import PROP

    prop = dict(PROP, vllm_args=PROP["vllm_args"] + """ --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'""")
    text = _docs("0.15.0", prop)["gpu-memory-utilization-0.9.yaml"]
    assert """# use: vllm serve --config THIS_FILE --speculative-config '{"method":"ngram","num_speculative_tokens":3,""" in text
    assert "speculative-config" not in yaml.safe_load(text)
    assert yaml.safe_load(_docs("0.16.0", prop)["gpu-memory-utilization-0.9.yaml"])["speculative-config"]["method"] == "ngram"


# -- (b) plot --model drew the frontier from the search's sparse points -----------------------------

def test_plot_model_drew_concurrency_lines_from_the_searchs_sparse_points(tmp_path, shared_dir, capsys):
    """Qwen2.5-7B on an L4 at 0.85 (4226 blocks of 16), drop min_concurrency 2.3: the stored grid
    had 30736 as the longest start for one request (32768 starts) and 16400 for four (16896 =
    4226 // 4 blocks x 16), and drew the points refused only for min_concurrency as "does not start"."""
    import json

    from tuner.cli import main

    drop = tmp_path / "q.yaml"
    drop.write_text(f"name: qwen-l4\nmodel: {shared_dir / 'models' / 'Qwen--Qwen2.5-7B-Instruct'}\ndevice: L4\n"
                    "engine_version: '0.19.0'\ncandidates:\n  gpu_memory_utilization: [0.85]\n"
                    "constraints:\n  min_concurrency: 2.3\n")
    db = tmp_path / "r.sqlite"
    assert main(["profile", str(drop), "--db", str(db)]) == 0
    capsys.readouterr()
    assert main(["plot", "--model", "Qwen2.5", "--db", str(db), "-o", str(tmp_path / "f.png"), "--json"]) == 0
    series = json.loads(capsys.readouterr().out)["series"]
    # the stored proposal is the interval's safe end (constraints.risk safe, issue 27); 29392 expected
    assert series["qwen-l4: proposals (>= 2.3 requests)"] == [[0.85, 27536.0]]  # 26928 before §24
    assert series["qwen-l4: largest max_model_len, >= 1 full-length request"] == [[0.85, 32768.0]]
    # searched again at the safe end too (16896 = 4226 // 4 blocks x 16 at the expected value)
    assert series["qwen-l4: largest max_model_len, >= 4 full-length requests"] == [[0.85, 15824.0]]  # 15472 before §24
    assert "qwen-l4: grid, >= 4 requests" not in series
    assert [m for _, m in series["simulated grid point: starts, below min_concurrency"]] == [
        29488.0, 29520.0, 29584.0, 29712.0, 30736.0]  # since §24 (29408, 29424, 29456, 29712, 30736 before)
    assert "simulated grid point: does not start" not in series


# -- (c) weights larger than the card -------------------------------------------------------------

def _phi4(shared_dir):
    return str(shared_dir / "models" / "microsoft--phi-4")


def test_weights_larger_than_the_card_said_try_increasing_gpu_memory_utilization(shared_dir, capsys):
    """Phi-4 (27.31 GiB of bf16 weights) on an RTX 4090 (23.53 GiB): vLLM fails loading the
    weights; it never reaches the profile's "Try increasing `gpu_memory_utilization`"."""
    from tuner.cli import main

    rc = main(["check", "--device", "RTX 4090", "--engine-version", "0.19.0", "--", "vllm", "serve", _phi4(shared_dir)])
    out = capsys.readouterr().out
    assert rc == 3
    assert ("  the weights do not fit the GPU: vLLM fails loading them (CUDA out of memory in load_model, before the "
            "memory profile; no gpu_memory_utilization helps): the weights are 29,407,094,784 bytes (27.39 GiB) and "
            "with the non-torch memory (268,435,456 bytes) need 29,675,530,240 bytes, more than the GPU's "
            "25,265,438,720 bytes (23.53 GiB); what would let them load (the KV cache and activations still need "
            "room beyond): --tensor-parallel-size 2 (about 13.69 GiB of weights per GPU), a quantized checkpoint") in out
    # §24: the weights carry the allocator's rounding (27.39 GiB, the 0.19 log's "Model loading took"; 27.31 before)
    assert "Try increasing" not in out and "bytes per block = 0 blocks" not in out and "KV cache -6.95" not in out
    assert "  --tensor-parallel-size 2 (70480 KV tokens):" in out  # 71056 before §24


def test_negative_kv_budget_printed_as_zero_blocks(shared_dir, capsys):
    """Phi-4 on an RTX 5090 at 0.8: the weights load (27.31 of 31.36 GiB) but exceed the request."""
    from tuner.cli import main

    rc = main(["check", "--device", "RTX 5090", "--engine-version", "0.19.0", "--no-variants", "--", "vllm", "serve",
               _phi4(shared_dir), "--gpu-memory-utilization", "0.8"])
    out = capsys.readouterr().out
    assert rc == 3 and "  vLLM: No available memory for the cache blocks." in out
    assert "  a KV budget of -3,239,585,173 bytes holds no block (3,276,800 bytes per block of 16 tokens)" in out  # §24
    assert "// 3,276,800 bytes per block = 0 blocks" not in out


def test_explain_analysed_max_model_len_16_where_nothing_starts(tmp_path, shared_dir, capsys):
    from tuner.cli import main

    drop = tmp_path / "phi4.yaml"
    drop.write_text(f"name: phi4-4090\nmodel: {_phi4(shared_dir)}\ndevice: RTX 4090\nengine_version: '0.19.0'\n"
                    "candidates:\n  gpu_memory_utilization: [0.9]\n")
    assert main(["explain", str(drop), "--db", str(tmp_path / "r.sqlite")]) == 3
    out = capsys.readouterr().out
    assert "gpu_memory_utilization 0.9, max_model_len 16384: does NOT start" in out
    assert "max_model_len 16:" not in out and "max_model_len 16 " not in out
    assert "  the weights do not fit the GPU: vLLM fails loading them" in out
    assert "KV cache bytes" not in out  # the budget past the weights is never computed
    assert "largest max_model_len at 0.9: None" not in out
    assert "(largest max_model_len at 0.9: none starts)" in out


def test_daemon_log_said_max_model_len_none():
    from tuner.daemon.service import _proposal_summary

    text = _proposal_summary([{"gpu_memory_utilization": 0.9, "max_model_len": None, "reason": "the weights do not "
                               "fit the GPU: …"}, {"gpu_memory_utilization": 0.95, "max_model_len": 4096,
                                                   "num_gpu_blocks": 256, "kv_cache_tokens": 4096}])
    assert text == ("gmu 0.90 → nothing starts: the weights do not fit the GPU: …; "
                    "gmu 0.95 → max_model_len 4096 (256 blocks, 4096 KV tokens)")


def test_daemon_log_said_retired_no_results_yet_results_kept(tmp_path, tiny_config, caplog):
    from tests.test_daemon import Harness

    h = Harness(tmp_path, tiny_config)
    try:
        d = h.start()
        (h.conf / "bad.yaml").write_text("name: bad\nmodel: [1]\n")
        h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'failed'") == [(1,)], what="failed")
        with caplog.at_level(logging.INFO, logger="tuner.daemon.service"):
            (h.conf / "bad.yaml").unlink()
            d.reconcile()
        lines = [r.getMessage() for r in caplog.records if "deleted" in r.getMessage()]
        assert lines == [f"drop file {h.conf / 'bad.yaml'} deleted: its job retired (it had no results)"]
    finally:
        h.close()


# -- input errors ----------------------------------------------------------------------------------

def test_top_level_typo_had_no_did_you_mean(tmp_path):
    from tuner.question.drop import load_drop
    from tuner.errors import DropError

    p = tmp_path / "typo.yaml"
    p.write_text("name: t\nmodel: m\ndevice: H100-80GB\ngpu_memory_utilisation: 0.9\n")
    with pytest.raises(DropError) as e:
        load_drop(p)
    assert str(e.value).startswith(f"{p}:gpu_memory_utilisation: unknown key 'gpu_memory_utilisation' (did you mean "
                                   "candidates.gpu_memory_utilization?); allowed here: name, model,")


def test_yaml_error_named_unicode_string_not_the_file(tmp_path):
    from tuner.question.drop import load_drop
    from tuner.errors import DropError

    p = tmp_path / "bad.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(DropError) as e:
        load_drop(p)
    assert "<unicode string>" not in str(e.value) and f'in "{p}", line 1, column 7' in str(e.value)


def test_scalar_where_a_list_is_expected_was_refused(tmp_path, caplog):
    from tuner.question.drop import load_drop

    p = tmp_path / "s.yaml"
    p.write_text("name: s\nmodel: m\ndevice: H100-80GB\ncandidates:\n  gpu_memory_utilization: 0.9\n"
                 "  max_model_len: 4096\n")
    with caplog.at_level(logging.WARNING, logger="tuner.question.drop"):
        d = load_drop(p)
    assert d.candidates.gpu_memory_utilization == (0.9,) and d.candidates.max_model_len == (4096,)
    assert [r.getMessage() for r in caplog.records] == [
        f"{p}:candidates.gpu_memory_utilization: 0.9 taken as the one-element list [0.9] (the field is a list)",
        f"{p}:candidates.max_model_len: 4096 taken as the one-element list [4096] (the field is a list)"]


def test_mistyped_vllm_flag_had_no_did_you_mean(tiny_config, capsys):
    from tuner.cli import main

    assert main(["check", "--device", "H100-80GB", "--engine-version", "0.19.0", "--no-variants", "--", "vllm", "serve",
                 str(tiny_config), "--max-modle-len", "2048"]) == 2
    assert ("unrecognized arguments: --max-modle-len 2048 (did you mean --max-model-len? vLLM refuses flags it does "
            "not know") in capsys.readouterr().err


def test_unknown_option_before_the_dashes_printed_the_top_level_usage(capsys):
    from tuner.cli import main

    with pytest.raises(SystemExit) as e:
        main(["check", "--max-modle-len", "5", "--device", "H100-80GB", "--", "vllm", "serve", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("usage: ctx-tuner check ")
    assert err.rstrip().endswith("ctx-tuner check: error: unrecognized arguments: --max-modle-len (did you mean "
                                 "--max-model-len in the vllm serve line after `--`?)")
    with pytest.raises(SystemExit):
        main(["profile", "--jsn", "x.yaml"])
    assert capsys.readouterr().err.rstrip().endswith("unrecognized arguments: --jsn (did you mean --json?)")


# -- check: the store it read, the variants that do not help ---------------------------------------

def test_check_read_and_wrote_the_store_silently(tmp_path, tiny_config, monkeypatch, capsys):
    import sqlite3

    from tuner.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["check", "--device", "H100-80GB", "--engine-version", "0.19.0", "--no-variants", "--", "vllm", "serve",
            str(tiny_config), "--max-model-len", "2048"]
    assert main(argv) == 0
    assert "store: none (var/ctx-tuner.sqlite does not exist here; nothing read or written)" in capsys.readouterr().out
    assert not (tmp_path / "var").exists()
    drop = tmp_path / "d.yaml"
    drop.write_text(f"name: d\nmodel: {tiny_config}\ndevice: H100-80GB\ncandidates: {{gpu_memory_utilization: [0.5]}}\n")
    assert main(["profile", str(drop)]) == 0
    db = tmp_path / "var" / "ctx-tuner.sqlite"
    before = sqlite3.connect(db).execute("SELECT count(*) FROM pass_memo").fetchone()[0]
    capsys.readouterr()
    assert main(argv[:-2] + ["--max-model-len", "3000", "--max-num-batched-tokens", "1536"]) == 0
    out = capsys.readouterr().out
    assert f"store: {db} (its pass memo read; nothing written)" in out
    assert sqlite3.connect(db).execute("SELECT count(*) FROM pass_memo").fetchone()[0] == before


def test_check_hid_the_variants_that_do_not_help(capsys):
    """Llama-3.1-8B on an RTX 3090, vLLM 0.6.4, its derived 131072: explain knew that no
    gpu_memory_utilization <= 1 is enough and that fp8 KV still does not start (largest 80128)."""
    from tests.conftest import REPO
    from tuner.cli import main

    rc = main(["check", "--device", "RTX-3090", "--engine-version", "0.6.4", "--", "vllm", "serve",
               str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct")])
    out = capsys.readouterr().out
    assert rc == 3
    assert out.split("settings that do not help:\n", 1)[1].splitlines() == [
        "  --gpu-memory-utilization: no value <= 1 is enough (it would take 1.371 of total, 32.33 GiB)",
        "  --kv-cache-dtype fp8: still does not start (5008 blocks, 80128 KV tokens; largest max_model_len at 0.9: "
        "80128)"]


def test_results_and_plot_ignored_the_daemon_settings(tmp_path, tiny_config, capsys, monkeypatch):
    import yaml

    from tuner.cli import main

    monkeypatch.chdir(tmp_path)  # no var/ here
    state = tmp_path / "state"
    state.mkdir()
    drop = tmp_path / "d.yaml"
    drop.write_text(f"name: d\nmodel: {tiny_config}\ndevice: H100-80GB\ncandidates: {{gpu_memory_utilization: [0.5]}}\n")
    assert main(["profile", str(drop), "--db", str(state / "ctx-tuner.sqlite")]) == 0
    settings = tmp_path / "tuner.yaml"
    settings.write_text(yaml.safe_dump({"watch_dir": str(tmp_path), "state_dir": str(state)}))
    capsys.readouterr()
    assert main(["results", "--settings", str(settings), "--json"]) == 0
    assert "\"drop_name\": \"d\"" in capsys.readouterr().out
    assert main(["plot", "--model", "tiny", "--settings", str(settings), "-o", str(tmp_path / "p.png")]) == 0
    assert "wrote " in capsys.readouterr().out
    assert main(["results"]) == 1  # without it: the default var/ store, which is not here


def test_daemon_help_said_nothing_of_signals_logs_or_paths(capsys):
    from tuner.cli import main

    with pytest.raises(SystemExit):
        main(["daemon", "--help"])
    out = capsys.readouterr().out
    assert "  SIGHUP           reload the settings file" in out
    assert "  SIGTERM, SIGINT  stop: the running job's worker is killed and the job queued again; exit 0" in out
    assert "  drops        watch_dir  /etc/ctx-tuner/conf.d" in out and "state_dir  /var/lib/ctx-tuner" in out
    assert "logs:\n  stderr only (journald under systemd)" in out and "proposals/failed/NAME.yaml" in out


def test_migration_log_named_internal_issue_numbers(tmp_path, caplog):
    from tuner.store.database import open_store

    with caplog.at_level(logging.INFO, logger="alembic.runtime.migration"):
        open_store(str(tmp_path / "m.sqlite")).close()
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Running upgrade")]
    assert len(steps) >= 9 and not [s for s in steps if "issue" in s or "\n" in s]
    assert "Running upgrade 0001 -> 0002, Daemon job queue and drop retirement." in steps
    assert ("Running upgrade 0004 -> 0005, Term sources and the engine cross-check on profile runs." in steps)


# -- columns and repeated refusals ----------------------------------------------------------------

def test_act_peak_column_included_the_workspace_explain_shows_apart(tmp_path, shared_dir, capsys):
    from tuner.cli import main

    drop = tmp_path / "phi4.yaml"
    drop.write_text(f"name: phi4-4090\nmodel: {_phi4(shared_dir)}\ndevice: RTX 4090\nengine_version: '0.19.0'\n"
                    "candidates:\n  gpu_memory_utilization: [0.9, 0.95]\n")
    assert main(["profile", str(drop), "--db", str(tmp_path / "r.sqlite")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(ln for ln in lines if ln.lstrip().startswith("gmu max_model_len"))
    assert " activ. " in head and "act.peak" not in head
    assert ("activ. = the profile run's activation peak + cuBLAS workspace + start-up reserve, one budget term "
            "(explain lists them apart)") in lines


def test_refused_rows_repeated_the_long_engine_message(tmp_path, shared_dir, capsys):
    from tuner.cli import main

    drop = tmp_path / "phi4.yaml"
    drop.write_text(f"name: phi4-4090\nmodel: {_phi4(shared_dir)}\ndevice: RTX 4090\nengine_version: '0.19.0'\n"
                    "candidates:\n  gpu_memory_utilization: [0.9, 0.95]\n")
    assert main(["profile", str(drop), "--db", str(tmp_path / "r.sqlite")]) == 0
    out = capsys.readouterr().out
    assert out.count("the weights do not fit the GPU") == 1
    assert [ln for ln in out.splitlines() if ln.startswith(" 0.95 ")][0].endswith("  as above")
    assert "  gmu 0.90: nothing fits: as in the table above" in out and "  gmu 0.95: nothing fits: as in the table above" in out


# -- profile: where it wrote, and no copy of an unchanged drop ------------------------------------

def test_profile_from_any_directory_created_var_without_saying_so(tmp_path, tiny_config, monkeypatch, capsys):
    from tuner.cli import main

    monkeypatch.chdir(tmp_path)
    drop = tmp_path / "d.yaml"
    drop.write_text(f"name: d\nmodel: {tiny_config}\ndevice: H100-80GB\ncandidates: {{gpu_memory_utilization: [0.5]}}\n")
    assert main(["profile", str(drop)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"stored as drop id 1 in var/ctx-tuner.sqlite under {tmp_path} (created now; --db names another store)")


def test_repeated_profile_stored_a_new_drop_row_each_time(tmp_path, tiny_config, capsys):
    import sqlite3

    from tuner.cli import main

    drop = tmp_path / "d.yaml"
    drop.write_text(f"name: d\nmodel: {tiny_config}\ndevice: H100-80GB\ncandidates: {{gpu_memory_utilization: [0.5]}}\n")
    db = tmp_path / "r.sqlite"
    for _ in range(3):
        assert main(["profile", str(drop), "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert out.count("\nstored as drop id 1\n") == 1
    assert out.count("\nalready stored as drop id 1 (the same drop and results: nothing new written)\n") == 2
    con = sqlite3.connect(db)
    assert con.execute("SELECT count(*) FROM drops").fetchone() == (1,)
    assert con.execute("SELECT count(*) FROM profile_runs").fetchone() == (1,)
    drop.write_text(drop.read_text().replace("[0.5]", "[0.6]"))  # changed content: a new row
    assert main(["profile", str(drop), "--db", str(db)]) == 0
    assert "\nstored as drop id 2\n" in capsys.readouterr().out + "\n"


# -- issue 33: what a fresh user met in round 3 -------------------------------------------------------

def _llama():
    from tests.conftest import REPO

    return str(REPO / "configs" / "models" / "meta-llama--Llama-3.1-8B-Instruct")


def test_co_tenant_weights_refusal_gave_contradictory_advice_and_a_negative_interval(capsys):
    """70 GiB held by other processes on an H100, vLLM 0.34: the weights do not load. Before: 'what
    would fit: --tensor-parallel-size 2' beside '--tensor-parallel-size 2: still does not start',
    '--gpu-memory-utilization: no value <= 1 is enough (it would take 0.246 of total, 19.47 GiB)' and
    'interval: KV -0.27 GiB to 0.27 GiB, 0-34 blocks'."""
    from tuner.cli import main

    rc = main(["check", "--device", "H100-80GB", "--engine-version", "0.34.0", "--other-processes-memory-gib", "70",
               "--", "vllm", "serve", _llama(), "--max-model-len", "8192"])
    out = capsys.readouterr().out
    assert rc == 3
    assert ("more than the GPU's 9,868,148,736 bytes (9.19 GiB) left by other processes; what would let them load "
            "(the KV cache and activations still need room beyond): --tensor-parallel-size 2 (about 7.49 GiB of "
            "weights per GPU)") in out
    assert "or a GPU with more than 15.24 GiB free plus the KV cache" in out
    assert "what would fit" not in out and "interval: KV -" not in out and "0.246 of total" not in out
    assert ("  --gpu-memory-utilization: no value helps (the weights do not load; vLLM fails before it sizes "
            "anything from gpu_memory_utilization)") in out


def test_co_tenant_gmu_remedy_ignored_the_free_memory_check(capsys):
    """60 GiB held by others, 0.32, gmu 0.2: a larger gpu_memory_utilization is suggested only where
    total x u stays within what the co-tenants leave free (vLLM's init_device check)."""
    from tuner.cli import main

    rc = main(["check", "--device", "H100-80GB", "--engine-version", "0.32.0", "--other-processes-memory-gib", "60",
               "--", "vllm", "serve", _llama(), "--max-model-len", "8192", "--gpu-memory-utilization", "0.2"])
    out = capsys.readouterr().out
    assert rc == 3
    # at the interval's safe end (fresh-user F4): 0.238 x 79.19 = 18.8 GiB < the 19.19 GiB left free
    # (0.24 / 8416 tokens / 0.236 before §24's reserve refit)
    assert "--gpu-memory-utilization 0.238 (the interval's safe end, 8256 KV tokens; 0.235 at the expected value):" in out
    # 62 GiB held: the weights load into the 17.19 GiB left, but the budget the cache needs does not fit
    # it (before: '--gpu-memory-utilization 0.236: checked, still does not start')
    rc = main(["check", "--device", "H100-80GB", "--engine-version", "0.32.0", "--other-processes-memory-gib", "62",
               "--", "vllm", "serve", _llama(), "--max-model-len", "8192", "--gpu-memory-utilization", "0.2"])
    out = capsys.readouterr().out
    assert rc == 3
    assert ("  --gpu-memory-utilization: no value is enough (it would take 18.55 GiB, 0.234 of total, more than the "
            "17.19 GiB other processes leave free: vLLM refuses a budget above the free memory)") in out


def test_device_name_without_its_blank_got_no_did_you_mean(capsys):
    """--device RTX4090:23.53 was taken as an unknown card (compute capability assumed 9.0) without
    saying that the catalog's 'RTX 4090' is meant."""
    from tuner.cli import main

    rc = main(["check", "--device", "RTX4090:23.53", "--engine-version", "0.34.0", "--no-variants", "--", "vllm",
               "serve", _llama(), "--max-model-len", "8192"])
    out = capsys.readouterr().out
    assert rc == 0
    assert ("note: assumed device.compute_capability: 9.0 or newer (RTX4090 is not in the catalog (did you mean "
            "'RTX-4090'? named so, e.g. --device 'RTX-4090:23.53', the catalog's compute capability and interconnect "
            "are used) and no compute_capability was stated") in out


def test_h200_nvl_was_not_in_the_device_catalog():
    from tuner.memory.devices import lookup, resolve_device

    for name in ("NVIDIA H200 NVL", "H200 NVL", "H200-NVL"):
        dev = lookup(name)
        assert dev is not None and dev.name == "H200-NVL"
        assert dev.total_memory_bytes == 150108897280 and dev.interconnect == "nvlink"
        assert dev.compute_capability == "9.0"
    assert resolve_device("NVIDIA H200").name == "H200"  # the SXM card keeps its name
    assert resolve_device("H200").interconnect == "nvswitch"


def test_vllm_use_v1_reported_not_modelled_on_a_v1_only_release(tmp_path, capsys):
    """A deploy file's VLLM_USE_V1=1 on vLLM 0.34 was 'does not model VLLM_USE_V1=1', exit 2; V1 is the
    only engine from 0.11 (vllm/envs.py drops the variable), so it is a no-op, said."""
    from tests.conftest import REPO
    from tuner.cli import main

    src = (REPO / "tests" / "fixtures" / "deploy" / "k8s-deployment.yaml").read_text()
    # (gpu_memory_utilization 0.3, not the fixture's 0.25: at 0.25 the verdict flips inside the interval)
    src = src.replace("v0.19.0", "v0.34.0").replace('"131072"', '"8192"').replace('- "0.25"', '- "0.3"').replace(
        "value: INFO", 'value: INFO\n            - name: VLLM_USE_V1\n              value: "1"')
    f = tmp_path / "dep.yaml"
    f.write_text(src)
    rc = main(["check", str(f), "--models-dir", str(REPO / "configs" / "models"), "--no-variants"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert ("note: env VLLM_USE_V1='1': modelled as a no-op on vLLM 0.34.0: the V0 engine was removed in 0.11, V1 "
            "is the only engine and vLLM does not read the variable (it logs 'Unknown vLLM environment variable "
            "detected: VLLM_USE_V1')") in out


def test_vllm_use_v1_0_selects_v0_before_0_11():
    from tuner.jobs.job import drop_era

    base = {"name": "x", "model": _llama(), "device": "H100-80GB", "engine_version": "0.10.1.1",
            "candidates": {"gpu_memory_utilization": [0.9], "max_model_len": [4096]}}
    assert drop_era({**base, "env": {"VLLM_USE_V1": "0"}}).engine == "V0"
    assert drop_era({**base, "env": {"VLLM_USE_V1": "1"}}).engine == "V1"
    assert drop_era({**base, "engine_version": "0.34.0", "env": {"VLLM_USE_V1": "0"}}).engine == "V1"


def test_kv_tokens_not_blocks_times_block_size_unexplained(capsys):
    """0.34 printed '712 blocks, 45567 KV tokens' (712 x 64 = 45568): vLLM logs
    int(max_concurrency x max_model_len) (get_kv_cache_capacity); check now says so."""
    from tuner.cli import main

    rc = main(["check", "--device", "RTX 3090", "--engine-version", "0.34.0", "--no-variants", "--risk", "expected",
               "--", "vllm", "serve", _llama(), "--max-model-len", "46500"])  # 728 blocks: the expected value
    out = capsys.readouterr().out
    assert rc == 0
    # since §24 (reserve refit) the expected value is 728 blocks: 46500 tokens (44480 / 712 blocks before)
    assert "STARTS: max_model_len 46500 at gpu_memory_utilization 1: 728 blocks, 46563 KV tokens, 1.00x" in out
    assert ("  KV tokens as vLLM 0.34.0 logs 'GPU KV cache size: N tokens': int(concurrency x max_model_len) = "
            "int(728 / 727 blocks per request x 46500) (not 728 x 64 = 46592)") in out
    main(["check", "--device", "RTX 3090", "--engine-version", "0.34.0", "--no-variants", "--", "vllm", "serve",
          _llama(), "--max-model-len", "32768"])
    assert "KV tokens as vLLM" not in capsys.readouterr().out  # 45568 = 712 x 64: nothing to explain

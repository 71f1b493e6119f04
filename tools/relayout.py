"""Issue 32's move of every ``tuner/`` module into packages by concept, as one table.

``python tools/relayout.py --move`` moves the files (``git mv``) and then rewrites; ``--rewrite``
only rewrites old import paths, dotted names and file paths to the new ones in every tracked text
file (idempotent: run it again after merging a branch written against the old layout).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys

#: old module (dotted, under ``tuner``) -> new module. The one table of the move.
MOVES: dict[str, str] = {
    # releases: what each vLLM release is (facts, names, diffs, the installed build) — bottom layer
    "release_facts": "releases.facts",
    "vllm_names": "releases.names",
    "release_diff": "releases.diff",
    # memory: vLLM's memory model — eras, budget, KV arithmetic, quantized weights, spec decode,
    # devices, serve arguments, start-up checks, the search; pure: no torch, no I/O beyond package data
    "devices": "memory.devices",
    "eras": "memory.eras",
    "budget": "memory.budget",
    "kvcache": "memory.kvcache",
    "allocator": "memory.allocator",
    "uncertainty": "memory.uncertainty",
    "simulate.quant": "memory.quant",
    "specdecode": "memory.specdecode",
    "platforms": "memory.platforms",
    "engine_checks": "memory.engine_checks",
    "serve_args": "memory.serve_args",
    "search": "memory.search",
    # question: the question as asked (drop, serve-line fields) and the answer's typed contract
    "drop": "question.drop",
    "protocol": "question.protocol",
    "vllm_args": "question.vllm_args",
    "vllm_forms": "question.vllm_forms",
    # logs: vLLM's start-up logs read back (grammar, release inference)
    "logparse": "logs.logparse",
    "release_infer": "logs.release_infer",
    # model: the model side — spec, plugin contract and kit, hub, lean imports, simulation
    "modelspec": "model.modelspec",
    "plugin": "model.plugin",
    "kit": "model.kit",
    "hub": "model.hub",
    "modelroots": "model.modelroots",
    "torch_lean": "model.torch_lean",
    "transformers_lean": "model.transformers_lean",
    "simulate": "model.simulate",
    # seam: the worker process boundary — spawn, guard, warm worker
    "worker": "seam.worker",
    "worker_guard": "seam.worker_guard",
    "warmworker": "seam.warmworker",
    # engine: the installed vLLM as source of truth (adds vLLM's own serve-line parser)
    "vllm_serve_parser": "engine.serve_parser",
    "vllm_parse_main": "engine.parse_main",
    # store: SQLite/PostgreSQL schema, records, queue, fleet
    "store": "store.database",
    "litestore": "store.litestore",
    "storerules": "store.storerules",
    "records": "store.records",
    "jobqueue": "store.jobqueue",
    "fleet": "store.fleet",
    "snapshot": "store.snapshot",
    # jobs: a job's passes, the pass memo, answers from the memo, calibration, the composition root
    "job": "jobs.job",
    "passmemo": "jobs.passmemo",
    "memoanswer": "jobs.memoanswer",
    "calibrate": "jobs.calibrate",
    "app": "jobs.app",
    # reports: explain, check, plot, results, proposal files
    "explain": "reports.explain",
    "check": "reports.check",
    "plot": "reports.plot",
    "results": "reports.results",
    "proposals": "reports.proposals",
    # accuracy: validate on real start-ups, log import, the uncertainty fit
    "validate": "accuracy.validate",
    "importlog": "accuracy.importlog",
    "uncertainty_fit": "accuracy.uncertainty_fit",
    # daemon: watch, settings, notify, metrics, failures, the service loop
    "daemon": "daemon.service",
    "watch": "daemon.watch",
    "settings": "daemon.settings",
    "notify": "daemon.notify",
    "metrics": "daemon.metrics",
    "failures": "daemon.failures",
    # the worker process's entry (the other CLI entry)
    "worker_main": "commands.worker_main",
}

#: new packages whose name was an old module's (``tuner.daemon``, ``tuner.store``): their modules,
#: so a rewritten ``tuner.daemon.service`` is not rewritten again.
NEW_PACKAGES = sorted({new.split(".")[0] for new in MOVES.values()})

TEXT_SUFFIXES = {".py", ".md", ".toml", ".ini", ".cfg", ".yaml", ".yml", ".txt", ".service", ".sh",
                 ".json", ".mako", ".j2", ""}
SKIP = ("tools/relayout.py", "docs/accuracy/", "docs/api/", "tuner/data/")


def _submodules(package: str) -> set[str]:
    return {new.split(".", 1)[1].split(".")[0] for new in MOVES.values()
            if new.startswith(package + ".")}


def _dotted_pattern(old: str) -> re.Pattern[str]:
    # tuner.OLD not followed by more identifier; when OLD is now a package, not followed by one of
    # its new submodules (idempotence).
    if old in NEW_PACKAGES:
        # now a package's name too: only old uses are rewritten — ``tuner.OLD.attr`` and ``from
        # tuner.OLD import name`` where attr/name is none of the new package's modules, and ``import
        # tuner.OLD`` alone; a bare ``tuner.OLD`` is the package (left alone)
        subs = "|".join(sorted(_submodules(old)))
        return re.compile(rf"(?:(?<![\w.])tuner\.{re.escape(old)}(?=\.(?!(?:{subs})\b)[A-Za-z_]| import (?!(?:{subs})\b)"
                          rf"[A-Za-z_(])|(?<=^import )tuner\.{re.escape(old)}(?=[ \t]*$|[ \t]+as[ \t]))", re.M)
    return re.compile(rf"(?<![\w.])tuner\.{re.escape(old)}(?![\w])")


def _path_pattern(old: str) -> tuple[re.Pattern[str], str]:
    parts = old.split(".")
    if old in ("simulate",):
        return re.compile(r"(?<![\w/])tuner/simulate/"), "tuner/model/simulate/"
    return (re.compile(rf"(?<![\w/])tuner/{'/'.join(parts)}\.py\b"),
            "tuner/" + MOVES[old].replace(".", "/") + ".py")


def _from_tuner_import(text: str) -> str:
    """``from tuner import a, b as c`` naming moved modules -> one import per moved module."""
    def fix(m: re.Match[str]) -> str:
        indent, names = m.group(1), m.group(2)
        keep, lines = [], []
        for item in (s.strip() for s in names.split(",")):
            name, _, alias = item.partition(" as ")
            name, alias = name.strip(), alias.strip()
            if name in MOVES:
                pkg, _, base = ("tuner." + MOVES[name]).rpartition(".")
                local = alias or name
                lines.append(f"{indent}from {pkg} import {base}" + ("" if base == local else f" as {local}"))
            else:
                keep.append(item)
        if not lines:
            return m.group(0)
        if keep:
            lines.insert(0, f"{indent}from tuner import {', '.join(keep)}")
        return "\n".join(lines)
    return re.sub(r"^([ \t]*)from tuner import ([\w ,]+?)(?=[ \t]*(?:$|#))", fix, text, flags=re.M)


def rewrite_text(text: str) -> str:
    text = _from_tuner_import(text)
    for old in sorted(MOVES, key=len, reverse=True):
        text = _dotted_pattern(old).sub("tuner." + MOVES[old], text)
        pat, repl = _path_pattern(old)
        text = pat.sub(repl, text)
    return text


def tracked_files(root: pathlib.Path) -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files"], cwd=root, check=True, capture_output=True, text=True).stdout
    files = []
    for rel in out.splitlines():
        if rel.startswith(SKIP) or "/stubs/" in rel:
            continue
        p = root / rel
        if p.is_file() and not p.is_symlink() and (p.suffix in TEXT_SUFFIXES or rel.startswith(".ci/")):
            files.append(p)
    return files


def rewrite(root: pathlib.Path) -> int:
    changed = 0
    for p in tracked_files(root):
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        new = rewrite_text(text)
        if new != text:
            p.write_text(new)
            changed += 1
    return changed


def move(root: pathlib.Path) -> None:
    tuner = root / "tuner"
    # modules whose name becomes a package's (daemon, store) step aside before anything moves in
    for old, new in sorted(MOVES.items(), key=lambda kv: (kv[0] not in NEW_PACKAGES, -kv[0].count("."), kv[0])):
        src = tuner / (old.replace(".", "/"))
        src = src if src.is_dir() and "." in old or old == "simulate" else src.with_suffix(".py")
        if not src.exists():
            continue
        dst = tuner / new.replace(".", "/")
        dst = dst if src.is_dir() else dst.with_suffix(".py")
        staged = dst
        if old in NEW_PACKAGES:  # tuner/daemon.py -> tuner/daemon/service.py: step aside first
            tmp = src.with_name(src.stem + "_relayout_tmp.py")
            subprocess.run(["git", "mv", str(src), str(tmp)], cwd=root, check=True)
            src = tmp
        dst.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "mv", str(src), str(staged)], cwd=root, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--move", action="store_true")
    ap.add_argument("--rewrite", action="store_true")
    ap.add_argument("--root", default=str(pathlib.Path(__file__).resolve().parent.parent))
    args = ap.parse_args(argv)
    root = pathlib.Path(args.root)
    if args.move:
        move(root)
    if args.move or args.rewrite:
        print(f"rewrote {rewrite(root)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())

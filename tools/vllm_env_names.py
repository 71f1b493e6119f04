#!/usr/bin/env python3
"""Generate ``tuner/data/vllm_env_names.json``: the ``VLLM_*`` environment variables each vLLM release reads.

Maintainer's tool (not imported by ctx-tuner). For every release directory under ``--src``
(``/work/vllm-src/<release>/vllm``, the release's extracted wheel), the keys of the
``environment_variables`` mapping of ``vllm/envs.py`` that start with ``VLLM_`` (releases without
``vllm/envs.py``, 0.4.0–0.4.1, read their few variables ad hoc and are left out). Each name's
releases are compressed as index intervals into the sorted ``releases`` list, as
``tuner/data/release_facts.json`` does.

Usage::

    python tools/vllm_env_names.py --src /work/vllm-src --out tuner/data/vllm_env_names.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

_KEY = re.compile(r'^\s+"(VLLM_[A-Z0-9_]+)"\s*:', re.M)
_RELEASE = re.compile(r"^\d+\.\d+\.\d+(\.\d+|\.post\d+)?$")


def _key(release: str) -> tuple:
    parts = re.split(r"[.]", release.replace("post", ""))
    return tuple(int(p) for p in parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default="/work/vllm-src")
    ap.add_argument("--out", default="tuner/data/vllm_env_names.json")
    args = ap.parse_args()
    releases = sorted((p.name for p in Path(args.src).iterdir()
                       if _RELEASE.match(p.name) and (p / "vllm" / "envs.py").is_file()), key=_key)
    names: dict[str, list[int]] = {}
    for i, rel in enumerate(releases):
        text = (Path(args.src) / rel / "vllm" / "envs.py").read_text(encoding="utf-8")
        body = text[text.index("environment_variables"):]
        for name in set(_KEY.findall(body)):
            names.setdefault(name, []).append(i)
    table = {}
    for name, idx in sorted(names.items()):
        intervals: list[list[int]] = []
        for i in idx:
            if intervals and intervals[-1][1] == i - 1:
                intervals[-1][1] = i
            else:
                intervals.append([i, i])
        table[name] = intervals
    doc = {"generated_by": "tools/vllm_env_names.py",
           "source": "vllm/envs.py environment_variables of each release's wheel", "releases": releases,
           "names": table}
    Path(args.out).write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"{len(table)} names over {len(releases)} releases -> {args.out}")


if __name__ == "__main__":
    main()

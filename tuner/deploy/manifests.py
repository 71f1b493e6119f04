"""A file of Kubernetes resources (multi-document YAML, ``kind: List``, ``helm template`` output) →
its vLLM workloads: each resource goes to the reader of its kind (:mod:`tuner.deploy.k8s` for pod
templates, :mod:`tuner.deploy.kserve`, :mod:`tuner.deploy.llmd`). Kept apart from the readers so
that they depend on the pod-template reader and nothing depends back on them."""

from __future__ import annotations

from typing import Any, Mapping

from tuner.deploy import Workload, kserve, llmd
from tuner.deploy.k8s import KSERVE_KINDS, LLMD_KINDS, POD_PATHS, _get, config_maps, pod_workloads


def workloads(docs: list[Any], file: str) -> list[Workload]:
    """Every vLLM workload of a file's Kubernetes documents, in order."""
    maps = config_maps(docs)
    flat: list[Any] = []
    for d in docs:  # kind: List (kubectl get -o yaml) holds its resources under items
        if isinstance(d, Mapping) and d.get("kind") == "List" and isinstance(d.get("items"), list):
            flat += [x for x in d["items"] if isinstance(x, Mapping)]
        else:
            flat.append(d)
    out: list[Workload] = []
    for d in flat:
        kind = str(d.get("kind"))
        name = str(_get(d, "metadata", "name") or "?")
        prefix = f"{kind}/{name}"
        if kind in KSERVE_KINDS:
            out += kserve.resource_workloads(d, flat, file=file, maps=maps)
        elif kind in LLMD_KINDS:
            out += llmd.resource_workloads(d, file=file)
        elif kind in POD_PATHS:
            out += pod_workloads(_get(d, *POD_PATHS[kind]), file=file, prefix=prefix, kind=kind, maps=maps)
        elif kind == "LeaderWorkerSet":
            lwt = _get(d, "spec", "leaderWorkerTemplate") or {}
            for part in ("leaderTemplate", "workerTemplate"):
                out += pod_workloads(_get(lwt, part, "spec"), file=file, prefix=f"{prefix}:{part}", kind=kind,
                                     maps=maps)
    return out

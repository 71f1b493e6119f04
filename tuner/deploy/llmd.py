"""llm-d manifests → vLLM workloads.

llm-d's ModelService (the ``llm-d-modelservice`` Helm chart's values, or a ``ModelService``
resource with the same fields under ``spec``): ``modelArtifacts.uri`` (``hf://org/name``) is the
model; ``decode`` and ``prefill`` are pools, each with ``parallelism`` (``tensor``, ``data``) and
``containers``. A container with ``modelCommand: vllmServe`` runs ``vllm serve MODEL --port 8000``
with ``--tensor-parallel-size`` from the pool's ``parallelism.tensor`` (and
``--data-parallel-size`` from ``parallelism.data``) followed by its ``args``; ``imageDefault``
runs the image's entrypoint with ``args``; ``custom`` (or none) runs its own ``command``/``args``.
GPUs per pod: the container's ``resources``; the GPU product: the pool's ``nodeSelector`` /
``affinity`` (GPU feature discovery labels). The Deployments ``helm template`` renders from it are
plain Kubernetes (:mod:`tuner.deploy.k8s`).
"""

from __future__ import annotations

from typing import Any, Mapping

from tuner.deploy import Workload
from tuner.deploy.k8s import _get, pod_workloads
from tuner.deploy.kserve import model_from_uri


def _pool(values: Mapping[str, Any], pool: str, *, file: str, prefix: str, kind: str) -> list[Workload]:
    spec = values.get(pool)
    if not isinstance(spec, Mapping):
        return []
    model, why = model_from_uri(_get(values, "modelArtifacts", "uri"), _get(values, "modelArtifacts", "name"))
    par = spec.get("parallelism") or {}
    containers = []
    notes_by: dict[int, str] = {}
    for i, c in enumerate(spec.get("containers") or []):
        if not isinstance(c, Mapping):
            continue
        c = dict(c)
        mode = c.get("modelCommand")
        if mode == "vllmServe":
            cmd = ["vllm", "serve", model or str(_get(values, "modelArtifacts", "uri") or "?"), "--port", "8000"]
            if isinstance(par, Mapping) and par.get("tensor"):
                cmd += ["--tensor-parallel-size", str(par["tensor"])]
            if isinstance(par, Mapping) and par.get("data") and int(par["data"]) > 1:
                cmd += ["--data-parallel-size", str(par["data"])]
            c["command"] = cmd
            notes_by[i] = (f"modelCommand: vllmServe: the chart runs `vllm serve` on {why}, with "
                           "--tensor-parallel-size from parallelism.tensor, then the container's args")
        elif mode == "imageDefault":
            c.pop("command", None)
            c["image"] = c.get("image") or "vllm/vllm-openai"
        containers.append(c)
    pod = {k: v for k, v in spec.items() if k in ("nodeSelector", "affinity")}
    pod["containers"] = containers
    found = pod_workloads(pod, file=file, prefix=f"{prefix}{pool}", kind=kind, maps={}, fmt="llm-d")
    for w in found:
        idx = int(w.path.rsplit("containers[", 1)[1].split("]")[0])
        if idx in notes_by:
            w.notes.insert(0, notes_by[idx])
    return found


def values_workloads(values: Mapping[str, Any], file: str) -> list[Workload]:
    """The ``decode`` and ``prefill`` pools of llm-d ModelService Helm values."""
    return (_pool(values, "decode", file=file, prefix="", kind="llm-d ModelService values")
            + _pool(values, "prefill", file=file, prefix="", kind="llm-d ModelService values"))


def resource_workloads(d: Mapping[str, Any], *, file: str) -> list[Workload]:
    """A ``ModelService`` resource: the same fields under ``spec``."""
    spec = d.get("spec") or {}
    name = str(_get(d, "metadata", "name") or "?")
    return (_pool(spec, "decode", file=file, prefix=f"ModelService/{name}:", kind="ModelService")
            + _pool(spec, "prefill", file=file, prefix=f"ModelService/{name}:", kind="ModelService"))

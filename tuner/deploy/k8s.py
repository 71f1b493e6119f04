"""Kubernetes manifests (multi-document YAML, ``kind: List``, ``helm template`` output) → vLLM workloads.

Pod templates are found where each kind keeps them (Kubernetes API reference): ``Pod`` ``spec``;
``Deployment`` / ``StatefulSet`` / ``DaemonSet`` / ``ReplicaSet`` / ``Job`` ``spec.template.spec``;
``CronJob`` ``spec.jobTemplate.spec.template.spec``; LeaderWorkerSet
``spec.leaderWorkerTemplate.{leaderTemplate,workerTemplate}.spec``. Each container's ``command`` +
``args`` (``$(VAR)`` expanded from its ``env``) is a vLLM workload when it runs ``vllm serve`` (see
:mod:`tuner.deploy.commandline`). GPUs per pod: the container's ``resources.limits`` (else
``requests``) ``nvidia.com/gpu`` / ``amd.com/gpu``; the GPU product: the pod's ``nodeSelector`` or
required node affinity on ``nvidia.com/gpu.product`` (GPU feature discovery's label) or
``cloud.google.com/gke-accelerator``. A ``--config FILE`` whose file a ConfigMap of the same file
holds (by key) is read from that ConfigMap. KServe and llm-d resources go to their own modules;
:mod:`tuner.deploy.manifests` sends each resource of a file to its reader.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from typing import Any, Mapping

from tuner.deploy import Workload
from tuner.deploy.commandline import k8s_env, k8s_expand, vllm_argv

POD_PATHS = {
    "Pod": ("spec",),
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
}
#: Node labels that name the GPU product (NVIDIA GPU feature discovery; GKE).
PRODUCT_LABELS = ("nvidia.com/gpu.product", "cloud.google.com/gke-accelerator")
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")
KSERVE_KINDS = ("LLMInferenceService", "ServingRuntime", "ClusterServingRuntime", "InferenceService")
LLMD_KINDS = ("ModelService",)


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, Mapping):
            return None
        d = d.get(k)
    return d


def gpu_count(resources: Any) -> int | None:
    """GPUs a container's ``resources`` ask for (limits, else requests); None when not said."""
    for part in ("limits", "requests"):
        res = _get(resources, part)
        if isinstance(res, Mapping):
            for key in GPU_RESOURCES:
                if key in res:
                    try:
                        return int(str(res[key]))
                    except ValueError:
                        return None
    return None


def gpu_product(pod_spec: Any) -> str | None:
    """The GPU product a pod is scheduled on: ``nodeSelector``, else the first value of a required
    node-affinity ``In`` expression, on :data:`PRODUCT_LABELS`."""
    sel = _get(pod_spec, "nodeSelector")
    if isinstance(sel, Mapping):
        for label in PRODUCT_LABELS:
            if sel.get(label):
                return str(sel[label])
    terms = _get(pod_spec, "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution",
                 "nodeSelectorTerms")
    return product_from_terms(terms)


def product_from_terms(terms: Any) -> str | None:
    """The first ``In`` value on a GPU-product label in node selector terms."""
    for term in terms or []:
        for expr in _get(term, "matchExpressions") or []:
            if isinstance(expr, Mapping) and expr.get("key") in PRODUCT_LABELS and expr.get("operator") == "In":
                values = expr.get("values") or []
                if values:
                    return str(values[0])
    return None


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def config_maps(docs: list[Any]) -> dict[str, dict[str, str]]:
    """``{ConfigMap name: data}`` of a file's ConfigMaps."""
    out = {}
    for d in docs:
        if isinstance(d, Mapping) and d.get("kind") == "ConfigMap" and isinstance(d.get("data"), Mapping):
            out[str(_get(d, "metadata", "name"))] = {str(k): str(v) for k, v in d["data"].items()}
    return out


def _config_from_maps(argv: list[str], maps: dict[str, dict[str, str]], notes: list[str]) -> tuple[list[str], str | None]:
    """``--config /etc/vllm/x.yaml`` whose ``x.yaml`` a ConfigMap of the file holds: that content,
    written to a temporary file the parser reads (the argument taken out of the line)."""
    if "--config" not in argv:
        return argv, None
    i = argv.index("--config")
    if i + 1 >= len(argv):
        return argv, None
    name = os.path.basename(argv[i + 1])
    for cm, data in maps.items():
        if name in data:
            fd, tmp = tempfile.mkstemp(prefix="ctx-tuner-cm-", suffix="-" + name)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(data[name])
            atexit.register(_remove, tmp)
            notes.append(f"--config {argv[i + 1]}: read from ConfigMap/{cm} key {name} in the same file")
            return argv[:i] + argv[i + 2:], tmp
    notes.append(f"--config {argv[i + 1]}: no ConfigMap in the file holds {name}; the container's file is not "
                 "readable from here")
    return argv, None


def pod_workloads(pod_spec: Any, *, file: str, prefix: str, kind: str, maps: dict[str, dict[str, str]],
                  fmt: str = "k8s", model_for: Any = None, extra_args_env: bool = False,
                  gpus_default: int | None = None) -> list[Workload]:
    """The vLLM containers of one pod spec. ``prefix``: the resource's path (``Deployment/llama``).
    ``model_for``: a function ``argv → (argv, note)`` that substitutes the model a template mounts
    (KServe's ``/mnt/models``). ``extra_args_env``: append ``VLLM_ADDITIONAL_ARGS`` when the
    command does not use it (KServe's templates do)."""
    from tuner.deploy.commandline import split_words

    out: list[Workload] = []
    product = gpu_product(pod_spec)
    for i, c in enumerate(_get(pod_spec, "containers") or []):
        if not isinstance(c, Mapping):
            continue
        where = f"{prefix}:containers[{i}]"
        env, notes = k8s_env(c.get("env"), where)
        command = [k8s_expand(str(x), env) for x in (c.get("command") or [])]
        args = [k8s_expand(str(x), env) for x in (c.get("args") or [])]
        argv, how = vllm_argv(command, args, image=c.get("image"), env=env)
        if argv is None:
            continue
        notes += how
        extra = env.get("VLLM_ADDITIONAL_ARGS")
        raw = " ".join(str(x) for x in (c.get("command") or []) + (c.get("args") or []))
        if extra and extra_args_env and "VLLM_ADDITIONAL_ARGS" not in raw:
            argv = argv + split_words(extra)
            notes.append(f"VLLM_ADDITIONAL_ARGS appended, as the template's `vllm serve … ${{VLLM_ADDITIONAL_ARGS}}` "
                         f"does: {extra}")
        if model_for is not None:
            argv, note = model_for(argv)
            if note:
                notes.append(note)
        argv, cfg = _config_from_maps(argv, maps, notes)
        field = "args" if c.get("args") else "command" if c.get("command") else "image"
        out.append(Workload(file=file, path=f"{where}.{field}", argv=argv, kind=kind, env=env,
                            gpus=gpu_count(c.get("resources")) if gpu_count(c.get("resources")) is not None
                            else gpus_default, gpu_product=product, config_file=cfg, notes=notes, format=fmt,
                            image=str(c["image"]) if c.get("image") else None))
    return out

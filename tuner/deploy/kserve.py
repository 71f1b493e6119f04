"""KServe resources → vLLM workloads.

- ``LLMInferenceService`` (``serving.kserve.io/v1alpha1``): the model is ``spec.model.uri``
  (``hf://org/name`` → ``org/name``), mounted at ``/mnt/models``. The main container of
  ``spec.template`` (and of ``spec.prefill.template`` for a disaggregated prefill pool) runs its own
  ``command``/``args`` when they start vLLM; otherwise KServe's preset template runs
  ``vllm serve /mnt/models --served-model-name NAME --port 8000``, with
  ``--tensor-parallel-size`` / ``--pipeline-parallel-size`` / ``--data-parallel-size`` from
  ``spec.parallelism``, followed by ``$VLLM_ADDITIONAL_ARGS`` from the container's environment.
- ``ServingRuntime`` / ``ClusterServingRuntime``: each container that runs vLLM, with the
  ``InferenceService`` of the same file whose ``predictor.model.runtime`` names it: its
  ``storageUri`` is the model at ``/mnt/models``, its ``args`` follow the runtime's (KServe merges
  the predictor's container over the runtime's), its ``resources`` win. ``VLLM_ADDITIONAL_ARGS``
  is appended when the command does not already expand it.
- ``InferenceService`` with ``predictor.containers``: a pod spec (:mod:`tuner.deploy.k8s`).
"""

from __future__ import annotations

from typing import Any, Mapping

from tuner.deploy import Workload
from tuner.deploy.k8s import _get, gpu_count, pod_workloads

MOUNT = "/mnt/models"


def model_from_uri(uri: str | None, name: str | None = None) -> tuple[str | None, str]:
    """A storage URI as the model ctx-tuner reads: ``hf://org/name`` → ``org/name``; another
    scheme → ``spec.model.name`` when it is an HF id, else None."""
    uri = str(uri or "")
    if uri.startswith("hf://"):
        return uri[len("hf://"):].split("@")[0].rstrip("/"), f"model {uri} (mounted at {MOUNT})"
    if name and str(name).count("/") == 1:
        return str(name), f"model {name} (spec.model.name; {uri or 'no uri'} is not an hf:// URI)"
    return None, f"model {uri or '?'} is not an hf:// URI: ctx-tuner cannot read its config.json"


def _substitute(model: str | None, why: str):
    def sub(argv: list[str]) -> tuple[list[str], str | None]:
        if model is None:
            return argv, why
        out, hit = [], False
        for a in argv:
            if a == MOUNT or a.rstrip("/") == MOUNT:
                out.append(model)
                hit = True
            elif a.startswith("--model=") and a.split("=", 1)[1].rstrip("/") == MOUNT:
                out.append("--model=" + model)
                hit = True
            else:
                out.append(a)
        return out, (f"{MOUNT} read as {why}" if hit else None)
    return sub


def _llmisvc(d: Mapping[str, Any], file: str, maps: dict) -> list[Workload]:
    name = str(_get(d, "metadata", "name") or "?")
    spec = d.get("spec") or {}
    model, why = model_from_uri(_get(spec, "model", "uri"), _get(spec, "model", "name"))
    out: list[Workload] = []
    for part, base in (("template", spec), ("prefill.template", spec.get("prefill") or {})):
        tmpl = base.get("template") if isinstance(base, Mapping) else None
        if not isinstance(tmpl, Mapping):
            continue
        par = (base.get("parallelism") or spec.get("parallelism") or {}) if isinstance(base, Mapping) else {}
        served = str(_get(spec, "model", "name") or name)
        preset = ["vllm", "serve", MOUNT, "--served-model-name", served, "--port", "8000"]
        for key, opt in (("tensor", "--tensor-parallel-size"), ("pipeline", "--pipeline-parallel-size"),
                         ("data", "--data-parallel-size")):
            if isinstance(par, Mapping) and par.get(key):
                preset += [opt, str(par[key])]
        containers, preset_used = [], set()
        for i, c in enumerate(tmpl.get("containers") or []):
            if not isinstance(c, Mapping):
                continue
            c = dict(c)
            if not c.get("command") and not c.get("args") and c.get("name", "main") == "main":
                # KServe's preset template: the main container runs vllm serve; $VLLM_ADDITIONAL_ARGS follows
                c["command"] = preset
                preset_used.add(f"containers[{i}]")
            containers.append(c)
        pod = {**tmpl, "containers": containers}
        found = pod_workloads(pod, file=file, prefix=f"LLMInferenceService/{name}:{part}", kind="LLMInferenceService",
                              maps=maps, fmt="kserve", model_for=_substitute(model, why), extra_args_env=True)
        for w in found:
            if w.path.rsplit(":", 1)[-1].split(".")[0] in preset_used:
                w.notes.insert(0, "no command or args: KServe's preset template `vllm serve /mnt/models "
                                  "--served-model-name … --port 8000` (+ spec.parallelism, then "
                                  "$VLLM_ADDITIONAL_ARGS) is assumed")
        out += found
    return out


def _runtime(rt: Mapping[str, Any], isvcs: list[Mapping[str, Any]], file: str, maps: dict) -> list[Workload]:
    rname = str(_get(rt, "metadata", "name") or "?")
    users = [s for s in isvcs if _get(s, "spec", "predictor", "model", "runtime") == rname] or [None]
    out: list[Workload] = []
    for isvc in users:
        containers = []
        model, why = (None, f"{MOUNT}: no InferenceService in the file uses runtime {rname}")
        prefix = f"{rt.get('kind')}/{rname}"
        pod_extra: dict = {}
        for c in _get(rt, "spec", "containers") or []:
            if not isinstance(c, Mapping):
                continue
            c = dict(c)
            if isvc is not None:
                m = _get(isvc, "spec", "predictor", "model") or {}
                c["args"] = list(c.get("args") or []) + list(m.get("args") or [])
                if m.get("env"):
                    c["env"] = list(c.get("env") or []) + list(m["env"])
                if gpu_count(m.get("resources")) is not None:
                    c["resources"] = m["resources"]
            containers.append(c)
        if isvc is not None:
            m = _get(isvc, "spec", "predictor", "model") or {}
            model, why = model_from_uri(m.get("storageUri"))
            prefix = f"InferenceService/{_get(isvc, 'metadata', 'name')}+{prefix}"
            pred = _get(isvc, "spec", "predictor") or {}
            pod_extra = {k: pred[k] for k in ("nodeSelector", "affinity") if k in pred}
        pod = {**(rt.get("spec") or {}), **pod_extra, "containers": containers}
        out += pod_workloads(pod, file=file, prefix=prefix, kind=str(rt.get("kind")), maps=maps, fmt="kserve",
                             model_for=_substitute(model, why), extra_args_env=True)
    return out


def resource_workloads(d: Mapping[str, Any], docs: list[Any], *, file: str, maps: dict) -> list[Workload]:
    """The vLLM workloads of one KServe resource (``docs``: the file's other resources)."""
    kind = d.get("kind")
    if kind == "LLMInferenceService":
        return _llmisvc(d, file, maps)
    if kind in ("ServingRuntime", "ClusterServingRuntime"):
        isvcs = [x for x in docs if isinstance(x, Mapping) and x.get("kind") == "InferenceService"]
        return _runtime(d, isvcs, file, maps)
    if kind == "InferenceService":
        pred = _get(d, "spec", "predictor") or {}
        if pred.get("containers"):
            name = str(_get(d, "metadata", "name") or "?")
            model, why = model_from_uri(_get(pred, "model", "storageUri") or _get(d, "spec", "storageUri"))
            return pod_workloads(pred, file=file, prefix=f"InferenceService/{name}:predictor", kind="InferenceService",
                                 maps=maps, fmt="kserve", model_for=_substitute(model, why), extra_args_env=True)
    return []

"""Deploy files → the vLLM containers in them, each as the ``vllm serve`` arguments it runs.

One entry function, :func:`read_deploy_file`: a file (any of the formats below) → a list of
:class:`Workload`, each with the file and the path inside it
(``deploy.yaml:Deployment/llama:containers[0].args``), the argument list the container runs
(``vllm serve MODEL …``, for :func:`tuner.question.vllm_args.parse_line`: vLLM's own parser when importable,
the built-in one otherwise, so the later argument wins as vLLM parses it), its environment, the
GPUs the manifest gives it and the GPU product it asks for. One module per format:

- :mod:`tuner.deploy.manifests` (each resource to its reader), :mod:`tuner.deploy.k8s`: Kubernetes Deployment / StatefulSet / DaemonSet / ReplicaSet / Pod /
  Job / CronJob / LeaderWorkerSet, ``kind: List``, multi-document YAML and ``helm template`` output;
- :mod:`tuner.deploy.helm`: vLLM production-stack Helm values (``servingEngineSpec.modelSpec[]``);
- :mod:`tuner.deploy.kserve`: KServe ``LLMInferenceService``, ``ServingRuntime`` /
  ``ClusterServingRuntime`` with the ``InferenceService`` that uses it;
- :mod:`tuner.deploy.llmd`: llm-d ModelService Helm values and ``ModelService`` resources;
- :mod:`tuner.deploy.compose`: docker compose files (``${VAR}`` from the ``.env`` beside them);
- a ``vllm serve --config`` YAML (a flat mapping of vLLM options) is returned as one workload with
  ``config_file`` set.

Pure: YAML is read with PyYAML's safe loader (size- and depth-limited), no network.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from tuner.errors import TunerError

#: Largest deploy file read (``helm template`` output of a big chart fits easily).
MAX_DEPLOY_BYTES = 4 * 1024 * 1024
#: Most alias references (``*name``) a deploy file may use (compose's ``<<: *common`` needs a few;
#: a "billion laughs" document needs many).
MAX_ALIASES = 256


class DeployFileError(TunerError):
    """A deploy file that cannot be read as any supported format, or a vLLM container in it whose
    arguments cannot be determined (``where`` = the file and the path inside it)."""


@dataclass
class Workload:
    """One vLLM container of a deploy file.

    ``argv``: the program and its arguments as the container runs them (``vllm serve MODEL …``);
    ``config_file``: a ``vllm serve --config`` file to read with them; ``env``: its environment
    (after ``$(VAR)`` / ``${VAR}`` expansion); ``gpus``: GPUs per pod/container the manifest
    gives it (None = not said); ``gpu_product``: the GPU product it is scheduled on
    (``nvidia.com/gpu.product`` node selector or affinity; None = not said); ``notes``: how the
    arguments were read (what a template adds, what was substituted); ``ignored``: settings of the
    file that never reach vLLM (a Helm value the chart does not read)."""

    file: str
    path: str
    argv: list[str]
    kind: str
    env: dict[str, str] = field(default_factory=dict)
    gpus: int | None = None
    gpu_product: str | None = None
    config_file: str | None = None
    notes: list[str] = field(default_factory=list)
    ignored: list[dict] = field(default_factory=list)
    #: the format reader that found it (``k8s``, ``helm``, ``kserve``, ``llm-d``, ``compose``, ``vllm-config``)
    format: str = ""
    #: the container image (``vllm/vllm-openai:v0.19.0``; None = not said): its tag names the release
    image: str | None = None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.path}"

    def to_dict(self) -> dict:
        return {"file": self.file, "path": self.path, "where": self.where, "format": self.format, "kind": self.kind,
                "argv": list(self.argv), "config_file": self.config_file, "env": dict(self.env), "gpus": self.gpus,
                "gpu_product": self.gpu_product, "notes": list(self.notes), "ignored": list(self.ignored),
                "image": self.image}


def load_documents(path: str) -> list[Any]:
    """Every YAML document of a file (``---`` separated; empty ones dropped).

    Raises:
        DeployFileError: unreadable, too large, not YAML.
    """
    import yaml

    try:
        size = os.path.getsize(path)
        if size > MAX_DEPLOY_BYTES:
            raise DeployFileError(f"larger than {MAX_DEPLOY_BYTES // (1024 * 1024)} MiB", where=path)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise DeployFileError(f"cannot read: {exc.strerror or exc}", where=path) from None
    except UnicodeDecodeError as exc:
        raise DeployFileError(f"not UTF-8 text: {exc}", where=path) from None
    class _Loader(yaml.SafeLoader):
        aliases = 0

        def compose_node(self, parent, index):  # noqa: D401 - PyYAML hook: count alias references
            if self.check_event(yaml.AliasEvent):
                _Loader.aliases += 1
                if _Loader.aliases > MAX_ALIASES:
                    raise DeployFileError(f"more than {MAX_ALIASES} alias references (*name): refused as a possible "
                                          "YAML bomb", where=path)
            return super().compose_node(parent, index)

    try:
        loader = _Loader(text)
        docs = []
        try:
            while loader.check_node():
                node = loader.get_node()
                _check_size(node, path)
                docs.append(loader.construct_document(node))
        finally:
            loader.dispose()
        return [d for d in docs if d is not None]
    except yaml.YAMLError as exc:
        raise DeployFileError(f"not valid YAML: {exc}", where=path) from None
    except RecursionError:
        raise DeployFileError("nesting too deep", where=path) from None


#: Most values one document may hold after alias expansion, and its deepest nesting.
MAX_NODES, MAX_DEPTH = 1_000_000, 64


def _check_size(root: Any, path: str) -> None:
    """Refuse a document whose alias expansion is huge (a "billion laughs") or nests too deep."""
    import yaml

    sizes: dict[int, int] = {}

    def size(node: Any, depth: int) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if depth > MAX_DEPTH:
            raise DeployFileError(f"nesting deeper than {MAX_DEPTH} levels", where=path)
        total = 1
        children = (node.value if isinstance(node, yaml.SequenceNode) else
                    [x for kv in node.value for x in kv] if isinstance(node, yaml.MappingNode) else [])
        for child in children:
            total += size(child, depth + 1)
            if total > MAX_NODES:
                raise DeployFileError(f"more than {MAX_NODES:,} values after alias expansion: refused as a possible "
                                      "YAML bomb", where=path)
        sizes[id(node)] = total
        return total

    size(root, 0)


def detect_format(docs: list[Any]) -> str:
    """Which reader a file's documents are for: ``k8s`` (documents with ``apiVersion`` and
    ``kind``; KServe and llm-d resources included), ``helm`` (production-stack values),
    ``llm-d`` (ModelService values), ``compose``, ``vllm-config`` (a flat mapping of vLLM
    options), else ``unknown``."""
    if not docs or not all(isinstance(d, dict) for d in docs):
        return "unknown"
    if all("apiVersion" in d and "kind" in d for d in docs):
        return "k8s"
    if len(docs) == 1:
        d = docs[0]
        if isinstance(d.get("servingEngineSpec"), dict):
            return "helm"
        if isinstance(d.get("modelArtifacts"), dict) and ("decode" in d or "prefill" in d):
            return "llm-d"
        if isinstance(d.get("services"), dict):
            return "compose"
        if d and all(isinstance(k, str) and (not isinstance(v, dict) or k.replace("_", "-") in _DICT_OPTIONS)
                     for k, v in d.items()) and _names_vllm_options(d):
            return "vllm-config"
    return "unknown"


#: vLLM options whose value is a mapping (JSON on the command line), so a config file may hold one.
_DICT_OPTIONS = {"speculative-config", "compilation-config", "hf-overrides", "kv-transfer-config", "rope-scaling",
                 "limit-mm-per-prompt", "mm-processor-kwargs", "override-generation-config", "kv-events-config",
                 "model-loader-extra-config", "override-pooler-config", "pooler-config", "structured-outputs-config",
                 "additional-config", "attention-config", "override-attention-dtype", "lora-extra-vocab-size",
                 "default-mm-loras", "ep-config", "eplb-config", "logits-processors", "reasoning-config"}


def _names_vllm_options(d: dict) -> bool:
    """A flat mapping is a ``vllm serve --config`` file when it names the model or an option the
    built-in parser knows (``max-model-len``, ``max_model_len``, ``tensor-parallel-size`` …)."""
    from tuner.memory.serve_args import flag_for

    return any(k == "model" or flag_for(k.replace("-", "_")) is not None for k in d)


def is_deploy_file(path: str) -> bool:
    """True when ``path`` holds a deploy format other than a plain ``vllm serve --config`` YAML
    (what ``check --config`` reads as a deploy file)."""
    try:
        return detect_format(load_documents(path)) not in ("vllm-config", "unknown")
    except DeployFileError:
        return False


def _is_drop(docs: list[Any]) -> bool:
    """A ctx-tuner drop file (docs/drops.md): one mapping with ``model``, ``device`` and a ``name`` or
    ``candidates``."""
    d = docs[0] if len(docs) == 1 else None
    return isinstance(d, dict) and "model" in d and "device" in d and ("candidates" in d or "name" in d)


def read_deploy_file(path: str, *, environ: dict[str, str] | None = None) -> list[Workload]:
    """Every vLLM workload of a deploy file, in file order.

    ``environ``: the environment compose interpolation sees before the ``.env`` file (default
    ``os.environ``, as ``docker compose`` does).

    Raises:
        DeployFileError: not a supported format, or no vLLM container in it (a file with none
            names the resources it read).
    """
    docs = load_documents(path)
    fmt = detect_format(docs)
    if fmt == "k8s":
        from tuner.deploy import manifests

        found = manifests.workloads(docs, path)
    elif fmt == "helm":
        from tuner.deploy import helm

        found = helm.workloads(docs[0], path)
    elif fmt == "llm-d":
        from tuner.deploy import llmd

        found = llmd.values_workloads(docs[0], path)
    elif fmt == "compose":
        from tuner.deploy import compose

        found = compose.workloads(docs[0], path, environ=environ)
    elif fmt == "vllm-config":
        found = [Workload(file=path, path="(vllm serve --config)", argv=["vllm", "serve"], kind="vLLM config",
                          config_file=path, format="vllm-config")]
    else:
        if _is_drop(docs):
            raise DeployFileError(f"a ctx-tuner drop file (model, device, candidates: docs/drops.md), not a deploy "
                                  f"file: profile it with `ctx-tuner profile {path}`, or explain one point with "
                                  f"`ctx-tuner explain {path}`", where=path)
        raise DeployFileError("not a deploy file ctx-tuner reads: expected Kubernetes resources (apiVersion + kind, "
                              "helm template output), vLLM production-stack Helm values (servingEngineSpec), "
                              "llm-d ModelService values (modelArtifacts + decode), a docker compose file "
                              "(services) or a `vllm serve --config` YAML", where=path)
    if not found:
        raise DeployFileError("no vLLM container found (a container running `vllm serve`, "
                              "`python -m vllm.entrypoints.openai.api_server` or a vllm-openai image)", where=path)
    return found


__all__ = ["DeployFileError", "Workload", "detect_format", "is_deploy_file", "load_documents", "read_deploy_file"]

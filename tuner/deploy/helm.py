"""vLLM production-stack Helm values (``servingEngineSpec.modelSpec[]``) → vLLM workloads.

The chart (vllm-project/production-stack, ``helm/templates/deployment-vllm-multi.yaml``) runs,
per ``modelSpec`` entry, ``vllm serve <modelURL> --host 0.0.0.0 --port 8000`` followed by the
options its ``vllmConfig`` keys name, in the template's order (:data:`VLLM_CONFIG`), then
``vllmConfig.extraArgs`` verbatim — so an ``extraArgs`` option that repeats one wins, as vLLM's
parser keeps the last. ``requestGPU`` is the GPUs per pod; ``nodeSelectorTerms`` may name the GPU
product; ``env`` is the container's environment. A ``vllmConfig`` key the template does not read
never reaches vLLM: it is listed as ignored. ``helm template`` output of the chart is plain
Kubernetes (:mod:`tuner.deploy.k8s`).
"""

from __future__ import annotations

from typing import Any, Mapping

from tuner.deploy import Workload
from tuner.deploy.commandline import k8s_env
from tuner.deploy.k8s import product_from_terms

#: ``vllmConfig`` key → (option, kind): ``value`` (option and value), ``flag`` (option when true),
#: ``bool`` (option / ``--no-`` option, when the key is present), in the template's order.
VLLM_CONFIG: tuple[tuple[str, str, str], ...] = (
    ("enableChunkedPrefill", "--enable-chunked-prefill", "bool"),
    ("enablePrefixCaching", "--enable-prefix-caching", "flag"),
    ("maxModelLen", "--max-model-len", "value"),
    ("dtype", "--dtype", "value"),
    ("tensorParallelSize", "--tensor-parallel-size", "value"),
    ("pipelineParallelSize", "--pipeline-parallel-size", "value"),
    ("maxNumSeqs", "--max-num-seqs", "value"),
    ("gpuMemoryUtilization", "--gpu-memory-utilization", "value"),
    ("maxLoras", "--max-loras", "value"),
)
#: Keys of vllmConfig read elsewhere in the template (not options, or handled below).
_OTHER_KEYS = ("extraArgs", "v0", "v1", "host", "port")


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def model_spec_argv(spec: Mapping[str, Any], where: str) -> tuple[list[str], list[str], list[dict]]:
    """One ``modelSpec`` entry's ``vllm serve`` arguments, notes and ignored keys."""
    notes: list[str] = []
    ignored: list[dict] = []
    argv = ["vllm", "serve", str(spec.get("modelURL") or ""), "--host", "0.0.0.0", "--port", "8000"]
    if spec.get("enableLoRA"):
        argv.append("--enable-lora")
    if spec.get("enableTool"):
        argv.append("--enable-auto-tool-choice")
        if spec.get("toolCallParser"):
            argv += ["--tool-call-parser", str(spec["toolCallParser"])]
    if spec.get("chatTemplate"):
        argv += ["--chat-template", str(spec["chatTemplate"])]
    cfg = spec.get("vllmConfig") or {}
    if not isinstance(cfg, Mapping):
        cfg = {}
    for key, option, kind in VLLM_CONFIG:
        if key not in cfg:
            continue
        value = cfg[key]
        if kind == "bool":
            argv.append(option if value else "--no-" + option[2:])
        elif kind == "flag":
            if value:
                argv.append(option)
        else:
            argv += [option, _scalar(value)]
    known = {k for k, _, _ in VLLM_CONFIG} | set(_OTHER_KEYS)
    for key, value in cfg.items():
        if key not in known:
            ignored.append({"flag": f"vllmConfig.{key}", "value": value, "source": where,
                            "as_written": f"vllmConfig.{key}: {value!r}",
                            "note": "the chart's template does not read this key: it never reaches vLLM "
                                    "(put the option in vllmConfig.extraArgs)"})
    extra = cfg.get("extraArgs") or []
    if extra:
        argv += [_scalar(x) for x in extra]
        notes.append(f"vllmConfig.extraArgs appended after the vllmConfig options (the later one wins): "
                     f"{' '.join(_scalar(x) for x in extra)}")
    if spec.get("lmcacheConfig"):
        argv += ["--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}']
        notes.append("lmcacheConfig: the chart adds an LMCache --kv-transfer-config")
    return argv, notes, ignored


def workloads(values: Mapping[str, Any], file: str) -> list[Workload]:
    """Every ``servingEngineSpec.modelSpec`` entry of a production-stack values file."""
    out: list[Workload] = []
    specs = (values.get("servingEngineSpec") or {}).get("modelSpec") or []
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping):
            continue
        where = f"servingEngineSpec.modelSpec[{i}]"
        label = f"{where}({spec.get('name')})" if spec.get("name") else where
        argv, notes, ignored = model_spec_argv(spec, f"{file}:{label}")
        env, env_notes = k8s_env(spec.get("env"), label)
        cfg = spec.get("vllmConfig") or {}
        if isinstance(cfg, Mapping) and "v0" in cfg and str(cfg["v0"]) in ("1", "True", "true"):
            env["VLLM_USE_V1"] = "0"
            notes.append("vllmConfig.v0: the chart sets VLLM_USE_V1=0")
        gpus = spec.get("requestGPU")
        out.append(Workload(file=file, path=f"{label}.vllmConfig", argv=argv, kind="production-stack modelSpec",
                            env=env, gpus=int(gpus) if isinstance(gpus, (int, float)) or str(gpus or "").isdigit()
                            else None,
                            gpu_product=product_from_terms(spec.get("nodeSelectorTerms")), notes=notes + env_notes,
                            ignored=ignored, format="helm"))
    return out

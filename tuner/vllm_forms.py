"""Proposals and checked settings in vLLM's own forms: ``vllm serve`` arguments and the YAML file
``vllm serve --config`` reads (keys are vLLM's long option names with dashes; ``true`` → ``--key``; a
boolean turned off is written ``no-key: true`` because ``vllm serve --config`` drops ``key: false``;
loaded unchanged by vLLM 0.32's ``FlexibleArgumentParser``). Pure.

A proposal has two forms per ``gpu_memory_utilization``:

- ``--max-model-len M --gpu-memory-utilization U`` (the fraction of total memory, as predicted);
- ``--max-model-len M --kv-cache-memory-bytes B`` (V1 0.10.2+): B = the KV cache bytes the same
  start-up is predicted to get at U. With it vLLM skips the memory profile and ignores
  ``gpu_memory_utilization`` (vllm/v1/worker/gpu_worker.py ``determine_available_memory``), so
  the engine gets the same cache without depending on how much of the GPU others use.
"""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from tuner.serve_args import KV_CACHE_MEMORY_BYTES_SINCE, parse_serve

#: libyaml's emitter where PyYAML has it (the same text as ``yaml.safe_dump``, several times faster:
#: the daemon writes these files for every finished drop)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

#: The order options are written in (vLLM destinations); others follow alphabetically.
ORDER = ("max_model_len", "gpu_memory_utilization", "kv_cache_memory_bytes", "tensor_parallel_size",
         "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel", "dtype", "kv_cache_dtype",
         "quantization", "max_num_seqs", "max_num_batched_tokens", "block_size", "enable_chunked_prefill",
         "enforce_eager", "speculative_config")


def _ordered(values: dict[str, Any]) -> list[tuple[str, Any]]:
    keys = [k for k in ORDER if k in values] + sorted(k for k in values if k not in ORDER)
    return [(k, values[k]) for k in keys if values[k] is not None]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (dict, list)):
        import json

        return json.dumps(v, separators=(",", ":"))
    return str(v)


def serve_args_text(values: dict[str, Any]) -> str:
    """vLLM destinations → ``--long-option value`` text (booleans as ``--x`` / ``--no-x``; defaults
    left out: TP/PP 1, dtype/kv_cache_dtype auto, enforce_eager false)."""
    from tuner.serve_args import option_for

    parts = []
    for k, v in _ordered(_without_defaults(values)):
        opt = option_for(k)
        if isinstance(v, bool):
            parts.append(opt if v else "--no-" + opt[2:])
        else:
            parts.append(f"{opt} {shlex.quote(_fmt(v))}")
    return " ".join(parts)


def _without_defaults(values: dict[str, Any]) -> dict[str, Any]:
    out = dict(values)
    for k, default in (("tensor_parallel_size", 1), ("pipeline_parallel_size", 1), ("data_parallel_size", 1),
                       ("dtype", "auto"), ("kv_cache_dtype", "auto"), ("enforce_eager", False),
                       ("enable_expert_parallel", False)):
        if out.get(k) == default:
            out.pop(k)
    return out


def config_dict(model: str, values: dict[str, Any]) -> dict[str, Any]:
    """The ``vllm serve --config`` mapping: ``model`` first, then dashed long option names."""
    doc: dict[str, Any] = {"model": model}
    for k, v in _ordered(_without_defaults(values)):
        if v is False:  # `vllm serve --config` drops `key: false`; `no-key: true` becomes --no-key
            doc["no-" + k.replace("_", "-")] = True
        else:
            doc[k.replace("_", "-")] = v
    return doc


def values_from_args(model: str, vllm_args: str) -> dict[str, Any]:
    """A stored ``vllm_args`` string read back with the built-in ``vllm serve`` parser."""
    return dict(parse_serve([model, *shlex.split(vllm_args or "")]).values)


def proposal_configs(model: str, proposal: dict, *, engine_version: str, kv_cache_bytes: int | None) -> dict:
    """Both forms of one proposal: ``{"gpu_memory_utilization": {...}, "kv_cache_memory_bytes":
    {...} | None, "vllm_args_kv_cache_memory_bytes": str | None}``; None where nothing starts or
    the release has no ``--kv-cache-memory-bytes``."""
    from tuner.eras import parse_version

    if not proposal.get("vllm_args"):
        return {"gpu_memory_utilization": None, "kv_cache_memory_bytes": None, "vllm_args_kv_cache_memory_bytes": None}
    values = values_from_args(model, proposal["vllm_args"])
    by_u = config_dict(model, values)
    kv = kv_args = None
    v = parse_version(engine_version)
    if kv_cache_bytes and (v.major, v.minor, v.patch) >= KV_CACHE_MEMORY_BYTES_SINCE:
        v2 = {k: v for k, v in values.items() if k != "gpu_memory_utilization"}
        v2["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        kv, kv_args = config_dict(model, v2), serve_args_text(v2)
    return {"gpu_memory_utilization": by_u, "kv_cache_memory_bytes": kv, "vllm_args_kv_cache_memory_bytes": kv_args}


def config_yaml(doc: dict[str, Any], *, header: str = "") -> str:
    """A config mapping as YAML text (``header`` lines become comments)."""
    text = yaml.dump(doc, Dumper=_DUMPER, sort_keys=False, default_flow_style=False)
    head = "".join(f"# {line}\n" for line in header.splitlines() if line.strip())
    return head + text


def config_file_names(gpu_memory_utilization: float) -> tuple[str, str]:
    """File names of one proposal's two config forms (inside ``proposals/NAME.vllm/``)."""
    u = f"{gpu_memory_utilization:g}"
    return f"gpu-memory-utilization-{u}.yaml", f"kv-cache-memory-bytes-{u}.yaml"


def proposal_documents(model: str, engine_version: str, entries: list[dict]) -> list[tuple[str, str]]:
    """``(file name, YAML text)`` of every config form of a drop's proposals; ``entries`` are
    proposal-file entries carrying ``vllm_config`` / ``vllm_config_kv_cache_memory_bytes``."""
    out = []
    from tuner.protocol import ProposalResult

    for e in entries:
        p = ProposalResult.from_wire(e)
        u = p.gpu_memory_utilization
        by_u, by_kv = config_file_names(u)
        head = (f"ctx-tuner proposal for {model}: max_model_len {p.max_model_len} at gpu_memory_utilization {u:g}, "
                f"{e.get('num_gpu_blocks')} blocks, {e.get('kv_cache_tokens')} KV tokens (vLLM {engine_version})\n"
                "use: vllm serve --config THIS_FILE")
        if e.get("vllm_config"):
            out.append((by_u, config_yaml(e["vllm_config"], header=head)))
        if e.get("vllm_config_kv_cache_memory_bytes"):
            kv = e["vllm_config_kv_cache_memory_bytes"]["kv-cache-memory-bytes"]
            out.append((by_kv, config_yaml(e["vllm_config_kv_cache_memory_bytes"],
                                           header=head + f"\nthe same KV cache as an absolute budget: {kv} bytes "
                                                         "(vLLM then ignores gpu_memory_utilization)")))
    return out

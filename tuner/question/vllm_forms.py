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

from tuner.memory.serve_args import KV_CACHE_MEMORY_BYTES_SINCE, parse_serve

#: The first release whose ``vllm serve`` reads ``--config FILE`` (vllm/utils.py
#: ``FlexibleArgumentParser.parse_args`` → ``_pull_args_from_config``, 0.6.0; absent in 0.5.5).
CONFIG_FILE_SINCE = (0, 6, 0)
#: The first release that takes the model from the config file (vllm/utils.py
#: ``_pull_args_from_config``: ``model_in_config``; vllm/entrypoints/cli/serve.py: ``model_tag``
#: optional, 0.8.3). Before it the model is the positional argument and a ``model`` key in the file
#: becomes ``--model``, which ``vllm serve`` refuses ("you should provide the model as a positional
#: argument instead of via the `--model` option"; 0.7.3–0.8.2 also "No model_tag specified!").
MODEL_IN_CONFIG_SINCE = (0, 8, 3)
#: The first release whose config loader turns ``key: true`` into ``--key`` (vllm/utils.py
#: ``_load_config_file``: ``isinstance(value, bool)``, 0.6.4); 0.6.0–0.6.3 pass ``--key True``,
#: which a ``store_true`` flag refuses.
CONFIG_BOOLEANS_SINCE = (0, 6, 4)
#: The first release whose config loader writes a mapping as JSON (vllm/utils/argparse_utils.py
#: ``load_config_file``: ``json.dumps(value)``, 0.16.0); before it ``str(value)`` is a Python
#: repr that ``json.loads`` (``--speculative-config``) refuses.
CONFIG_MAPPINGS_SINCE = (0, 16, 0)
#: The first release where ``--enable-chunked-prefill`` is a ``BooleanOptionalAction`` (``--no-…``;
#: vllm/engine/arg_utils.py ``scheduler_kwargs``, 0.8.5); 0.6.0–0.8.4 declare it ``StoreBoolean``
#: (``--enable-chunked-prefill False``, no ``--no-`` form).
NO_ENABLE_CHUNKED_PREFILL_SINCE = (0, 8, 5)

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
    from tuner.memory.serve_args import option_for

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


def _version(engine_version: str) -> tuple[int, int, int]:
    from tuner.memory.eras import parse_version

    v = parse_version(engine_version)
    return (v.major, v.minor, v.patch)


def release_form(doc: dict[str, Any], engine_version: str) -> tuple[dict[str, Any] | None, str]:
    """What release ``engine_version`` accepts for a full config mapping ``doc`` (``model`` first,
    as :func:`config_dict` writes it): ``(file mapping or None, the command to run)``. The file
    keeps what that release's ``--config`` loader reads; the rest goes on the command line:

    - before :data:`CONFIG_FILE_SINCE` no file at all: ``vllm serve MODEL --opt …``;
    - before :data:`MODEL_IN_CONFIG_SINCE` the model is positional: ``vllm serve MODEL --config THIS_FILE``;
    - ``true`` booleans before :data:`CONFIG_BOOLEANS_SINCE` and mappings before
      :data:`CONFIG_MAPPINGS_SINCE` are command-line options after the file;
    - ``no-enable-chunked-prefill`` before :data:`NO_ENABLE_CHUNKED_PREFILL_SINCE` is
      ``enable-chunked-prefill: 'False'`` (text: loaded as ``--enable-chunked-prefill False``).
    """
    v = _version(engine_version)
    model = str(doc.get("model", ""))
    rest = {}
    for k, val in doc.items():
        if k == "no-enable-chunked-prefill" and v < NO_ENABLE_CHUNKED_PREFILL_SINCE:
            # StoreBoolean: `--enable-chunked-prefill False`. As text: the 0.6.4+ loader drops a YAML
            # `false` (it looks for the key among the top-level parser's StoreBoolean dests, never there)
            rest["enable-chunked-prefill"] = "False"
        elif k != "model":
            rest[k] = val

    def opt(k: str, val: Any) -> str:
        return f"--{k}" if val is True else f"--{k} {shlex.quote(_fmt(val))}"

    if v < CONFIG_FILE_SINCE:
        return None, " ".join(["vllm serve", shlex.quote(model), *(opt(k, val) for k, val in rest.items())])
    cli = {k: val for k, val in rest.items()
           if (val is True and v < CONFIG_BOOLEANS_SINCE) or (isinstance(val, dict) and v < CONFIG_MAPPINGS_SINCE)}
    file_doc = ({"model": model} if v >= MODEL_IN_CONFIG_SINCE else {}) | {k: val for k, val in rest.items()
                                                                          if k not in cli}
    head = "vllm serve --config THIS_FILE" if v >= MODEL_IN_CONFIG_SINCE else \
        f"vllm serve {shlex.quote(model)} --config THIS_FILE"
    return file_doc, " ".join([head, *(opt(k, val) for k, val in cli.items())])


def values_from_args(model: str, vllm_args: str) -> dict[str, Any]:
    """A stored ``vllm_args`` string read back with the built-in ``vllm serve`` parser."""
    return dict(parse_serve([model, *shlex.split(vllm_args or "")]).values)


def proposal_configs(model: str, proposal: dict, *, engine_version: str, kv_cache_bytes: int | None) -> dict:
    """Both forms of one proposal: ``{"gpu_memory_utilization": {...}, "kv_cache_memory_bytes":
    {...} | None, "vllm_args_kv_cache_memory_bytes": str | None}``; None where nothing starts or
    the release has no ``--kv-cache-memory-bytes``."""
    from tuner.memory.eras import parse_version

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


def config_file_names(gpu_memory_utilization: float, suffix: str = ".yaml") -> tuple[str, str]:
    """File names of one proposal's two config forms (inside ``proposals/NAME.vllm/``); ``.sh`` for
    a release without ``--config`` (the command line itself)."""
    u = f"{gpu_memory_utilization:g}"
    return f"gpu-memory-utilization-{u}{suffix}", f"kv-cache-memory-bytes-{u}{suffix}"


def _document(full: dict[str, Any], engine_version: str, head: str, extra: str = "") -> tuple[str, str]:
    """``(suffix, text)`` of one form for the release: a ``--config`` YAML with the command that
    uses it, or (no ``--config`` in that release) a shell script with the command line."""
    file_doc, use = release_form(full, engine_version)
    if file_doc is None:
        lines = "".join(f"# {line}\n" for line in (head + extra).splitlines() if line.strip())
        return ".sh", (f"#!/bin/sh\n{lines}# vLLM {engine_version} has no --config (it came in "
                       f"{'.'.join(map(str, CONFIG_FILE_SINCE))}): the command line\nexec {use} \"$@\"\n")
    return ".yaml", config_yaml(file_doc, header=f"{head}\nuse: {use}{extra}")


def proposal_documents(model: str, engine_version: str, entries: list[dict]) -> list[tuple[str, str]]:
    """``(file name, YAML text)`` of every config form of a drop's proposals; ``entries`` are
    proposal-file entries carrying ``vllm_config`` / ``vllm_config_kv_cache_memory_bytes``."""
    out = []
    from tuner.question.protocol import ProposalResult

    for e in entries:
        p = ProposalResult.from_wire(e)
        u = p.gpu_memory_utilization
        head = (f"ctx-tuner proposal for {model}: max_model_len {p.max_model_len} at gpu_memory_utilization {u:g}, "
                f"{e.get('num_gpu_blocks')} blocks, {e.get('kv_cache_tokens')} KV tokens (vLLM {engine_version})")
        if e.get("vllm_config"):
            suffix, text = _document({"model": model, **e["vllm_config"]}, engine_version, head)
            out.append((config_file_names(u, suffix)[0], text))
        if e.get("vllm_config_kv_cache_memory_bytes"):
            kv = e["vllm_config_kv_cache_memory_bytes"]["kv-cache-memory-bytes"]
            suffix, text = _document({"model": model, **e["vllm_config_kv_cache_memory_bytes"]}, engine_version, head,
                                     f"\nthe same KV cache as an absolute budget: {kv} bytes "
                                     "(vLLM then ignores gpu_memory_utilization)")
            out.append((config_file_names(u, suffix)[1], text))
    return out

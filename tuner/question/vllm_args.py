"""One path from vLLM arguments to a validated :class:`~tuner.question.drop.Drop`.

Every source of vLLM arguments goes through here: a ``vllm serve`` line and its ``--config`` YAML
(:func:`parse_line`: vLLM's own parser when it is importable in the worker Python, the built-in one
otherwise, :mod:`tuner.memory.serve_args`), a deploy file's container (:mod:`tuner.deploy` gives the same
argument list), a case's or a log's settings (:func:`from_settings`: keys are vLLM destination
names, as ``shared/cases/README.md`` and vLLM's ``non_default_args`` spell them) and a drop's own
fields (:func:`from_drop_file`). :func:`to_drop` turns the read arguments into the drop that asks
the same question, validated by :func:`tuner.question.drop.parse_drop` (every rule a drop file obeys
applies), and returns what it could not model as a named list, never dropped:

``MappedArgs.not_modelled``: one :class:`NotModelled` (``argument``, ``value``, ``why``, ``source``)
per argument that changes start-up memory in a way ctx-tuner does not model (``--cpu-offload-gb``,
``--compilation-config``, an unknown flag, a ``VLLM_*`` environment variable the tables do not
know). ``check`` refuses such input unless ``--allow-unmodelled`` and prints the list either way
(text and JSON); ``validate`` reports it per case; the uncertainty bands widen from it.

Pure: no torch, no vLLM import (vLLM's parser runs in a subprocess, :mod:`tuner.engine.serve_parser`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from tuner.errors import DropError, TunerError
from tuner.releases.envnames import close_names, is_vllm_env, span
from tuner.memory.serve_args import (AUTO, AUTO_FIT_SINCE, IGNORED, KV_CACHE_MEMORY_BYTES_SINCE, MODELLED, UNMODELLED,
                              ServeArgs, ServeArgsError, ServeParser, flag_for, option_for, parse_serve)

#: Destinations ``check`` itself turns into the candidate point (not drop keys).
POINT_KEYS = ("max_model_len", "gpu_memory_utilization")


class ArgsInputError(TunerError):
    """vLLM arguments that cannot become a drop (exit 2 in ``check``): a flag vLLM would reject, a
    flag ctx-tuner cannot model (unless allowed), a setting the release does not have; ``where``
    names the flag or file."""


@dataclass(frozen=True)
class NotModelled:
    """One argument ctx-tuner does not model: ``argument`` as vLLM spells it (``--cpu-offload-gb``,
    ``env VLLM_ATTENTION_BACKEND``), its ``value``, ``why`` it matters, ``source`` (``command
    line``, a file, a file:path) and ``as_written`` (the tokens as given)."""

    argument: str
    value: Any
    why: str
    source: str = "command line"
    as_written: str | None = None

    def to_dict(self) -> dict:
        # ``flag``/``note``: the names check's JSON used before this list had its own type
        return {"argument": self.argument, "value": self.value, "why": self.why, "source": self.source,
                "as_written": self.as_written, "flag": self.argument, "note": self.why}

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> "NotModelled":
        """From a parser's dict entry (``flag``, ``value``, ``note``, ``source``, ``as_written``)."""
        return cls(str(entry.get("argument") or entry.get("flag")), entry.get("value"),
                   str(entry.get("why") or entry.get("note") or "changes start-up memory in a way ctx-tuner does not "
                                                                   "model"),
                   str(entry.get("source") or "command line"), entry.get("as_written"))


@dataclass
class MappedArgs:
    """The result of :func:`to_drop`: the validated ``drop``, the drop document it came from
    (``doc``), the :class:`NotModelled` list and the read arguments (``args``)."""

    drop: Any
    doc: dict
    not_modelled: list[NotModelled] = field(default_factory=list)
    args: ServeArgs | None = None

    def not_modelled_dicts(self) -> list[dict]:
        return [n.to_dict() for n in self.not_modelled]


# ------------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------------


def parse_line(argv: Sequence[str], config_file: str | None = None, *, parser: ServeParser | None = None) -> ServeArgs:
    """A ``vllm serve`` line (with or without ``vllm serve``) and an optional ``--config`` file,
    read by ``parser`` (vLLM's own or the built-in one; default built-in)."""
    return parse_serve(argv, config_file, parser=parser)


#: Environment variables known to leave start-up memory alone (logging, ports, caches, tokens).
_ENV_NO_EFFECT = re.compile(r"^(VLLM_(LOGGING_LEVEL|LOGGING_PREFIX|LOG_STATS_INTERVAL|CONFIGURE_LOGGING|PORT|HOST_IP|"
                            r"RPC_BASE_PATH|CACHE_ROOT|CONFIG_ROOT|ASSETS_CACHE|NO_USAGE_STATS|DO_NOT_TRACK|"
                            r"USAGE_SOURCE|API_KEY|SERVER_DEV_MODE|ENGINE_ITERATION_TIMEOUT_S|RPC_TIMEOUT|"
                            r"HTTP_TIMEOUT_KEEP_ALIVE|WORKER_MULTIPROC_METHOD|NIXL_SIDE_CHANNEL_HOST|"
                            r"NIXL_SIDE_CHANNEL_PORT|USE_MODELSCOPE|DEBUG_LOG_API_SERVER_RESPONSE)|"
                            r"HF_.*|HUGGING_FACE_.*|TRANSFORMERS_.*|NCCL_.*|CUDA_DEVICE_ORDER|PYTHON.*)$")
#: ``VLLM_ADDITIONAL_ARGS``: KServe's templates append it to the serve line (read as arguments).
ADDITIONAL_ARGS_ENV = "VLLM_ADDITIONAL_ARGS"


_ENV_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)


def split_env_prefix(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """The environment a shell line sets before the program, as operators write it
    (``VLLM_USE_V2_MODEL_RUNNER=1 vllm serve …``, ``env VAR=1 vllm serve …``): ``(the line without
    it, {name: value})``. A single string is split like a shell first."""
    import shlex

    args = list(argv)
    if len(args) == 1 and " " in args[0].strip():
        args = shlex.split(args[0])
    i = 1 if args and args[0] == "env" else 0
    env: dict[str, str] = {}
    while i < len(args) and _ENV_ASSIGN.match(args[i]):
        name, value = _ENV_ASSIGN.match(args[i]).groups()
        env[name] = value
        i += 1
    if not env:
        return list(argv), {}
    return args[i:], env


def env_not_modelled(env: Mapping[str, Any], *, source: str) -> tuple[list[NotModelled], list[dict]]:
    """A container's environment: ``VLLM_*`` variables that may change start-up memory are
    :class:`NotModelled` (vLLM reads them in ``vllm/envs.py``; ctx-tuner's rules do not), those
    known not to are listed as ignored. Other variables are not vLLM's and are not listed."""
    out: list[NotModelled] = []
    ignored: list[dict] = []
    for name, value in env.items():
        if name == ADDITIONAL_ARGS_ENV:  # read as arguments where a template expands it (the reader's notes say so)
            ignored.append({"flag": f"env {name}", "value": value, "source": source, "as_written": f"{name}={value}",
                            "note": "vLLM itself does not read it; KServe's and llm-d's templates append it to the "
                                    "serve line (read so for their resources, see the notes)"})
            continue
        if _ENV_NO_EFFECT.match(name):
            if name.startswith("VLLM_"):
                ignored.append({"flag": f"env {name}", "value": value, "source": source,
                                "as_written": f"{name}={value}", "note": "no effect on start-up memory"})
            continue
        if name in _modelled_env_names():  # read by the rules through the drop's env (modelled_env)
            continue
        if name.startswith("VLLM_") and not is_vllm_env(name):  # VLLM_FOO_BAR: no release reads it
            hint = close_names(name)
            ignored.append({"flag": f"env {name}", "value": value, "source": source, "as_written": f"{name}={value}",
                            "note": f"not a vLLM environment variable: no release's vllm/envs.py ({span()}) defines "
                                    "it, so vLLM ignores it (0.17+ warns \"Unknown vLLM environment variable "
                                    f"detected: {name}\", vllm/envs.py validate_environ)"
                                    + (f"; did you mean {hint[0]}?" if hint else "")})
        elif name.startswith("VLLM_"):
            out.append(NotModelled(f"env {name}", value, "a vLLM environment variable (vllm/envs.py) ctx-tuner "
                                                         "does not model; it may change start-up memory",
                                   source, f"{name}={value}"))
    return out, ignored


def _modelled_env_names() -> tuple[str, ...]:
    from tuner.question.drop import MODELLED_ENV

    return MODELLED_ENV


def modelled_env(env: Mapping[str, Any]) -> dict[str, str]:
    """The variables of a container's environment the rules read (:data:`tuner.question.drop.MODELLED_ENV`:
    the sampler path, the CUDA-graph estimate, the pipeline layer split, the model runner), for the
    drop's ``env``."""
    names = _modelled_env_names()
    return {k: str(v) for k, v in env.items() if k in names}


def from_settings(settings: Mapping[str, Any], *, model: str, source: str) -> ServeArgs:
    """A case's or a log's settings (keys are vLLM destination names; ``None`` = not given;
    ``env_NAME`` = an environment variable) as :class:`ServeArgs`, by the same flag table the
    built-in parser uses: a modelled key is a value (a string in vLLM's form is parsed by the
    flag's own rule: ``32k``, ``auto``), a key that does not change memory is ignored, every other
    key is named as not modelled."""
    out = ServeArgs(model=model, parser="settings")
    out.parser_info = {"name": "settings", "source": source}
    for key, value in settings.items():
        if value is None or key == "non_default_args":
            continue
        if key.startswith("env_"):
            from tuner.question.drop import MODELLED_ENV

            if key[4:] in MODELLED_ENV:  # read by a rule: the drop's env carries it
                env = dict(out.values.get("env") or {})
                env[key[4:]] = "1" if value is True else "0" if value is False else str(value)
                out.values["env"] = env
                out.spelled.setdefault("env", f"{key}: {value!r} (from {source})")
                continue
            nm, ig = env_not_modelled({key[4:]: value}, source=source)
            out.unmodelled += [n.to_dict() for n in nm]
            out.ignored += ig
            continue
        flag = flag_for(key)
        written = f"{key}: {value!r} (from {source})"
        if flag is None:
            out.unmodelled.append({"flag": option_for(key), "value": value, "source": source, "as_written": written,
                                   "note": "a vLLM engine argument ctx-tuner does not model"})
            continue
        if flag.role == MODELLED:
            v = value
            if isinstance(value, str) and flag.parse is not None and flag.kind == "value":
                try:
                    v = flag.parse(value)
                except ValueError as exc:
                    raise ArgsInputError(str(exc), where=f"{source}: {key}") from None
            if key == "model":
                continue
            out.values[key] = v
            out.spelled[key] = written
            continue
        entry = {"flag": flag.options[0], "value": value, "source": source, "as_written": written, "note": flag.note}
        (out.ignored if flag.role == IGNORED else out.unmodelled).append(entry)
    return out


def from_drop_file(path: str) -> MappedArgs:
    """A drop file: its fields are already the drop's (every key modelled, nothing to name)."""
    from tuner.question.drop import load_drop

    d = load_drop(path)
    return MappedArgs(d, d.to_dict(), [], None)


# ------------------------------------------------------------------------------------------------
# To a drop
# ------------------------------------------------------------------------------------------------


def _version_tuple(text: str) -> tuple:
    from tuner.memory.eras import parse_version

    v = parse_version(text)
    return (v.major, v.minor, v.patch)


def model_value(model: str, cwd: str) -> str:
    """``vllm serve``'s model argument as a drop's ``model``: an existing local path made absolute
    (vLLM reads it relative to where it runs), an HF id unchanged."""
    p = os.path.expanduser(model)
    full = p if os.path.isabs(p) else os.path.join(cwd, p)
    if os.path.exists(full):
        return os.path.normpath(os.path.abspath(full))
    return model


def drop_name(model: str, prefix: str = "check") -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", os.path.basename(model.rstrip("/")) or "model").strip(".-") or "model"
    return f"{prefix}-{base}"[:128]


def equivalent_drop(sa: ServeArgs, *, device: Any, engine_version: str, cwd: str | None = None,
                    allow_unmodelled: bool = False, extra_not_modelled: Sequence[NotModelled] = (),
                    name: str | None = None, model: str | None = None) -> tuple[dict, list[NotModelled]]:
    """The drop (as a dict) that asks what ``sa`` asks, and what it could not model: ``sa``'s
    not-modelled flags, modelled flags this build's drop schema has no key for, and
    ``extra_not_modelled`` (a container's environment).

    Raises:
        ArgsInputError: an unknown flag or one ctx-tuner does not model (unless
            ``allow_unmodelled``), a setting the release does not have, a length that is not positive.
    """
    from tuner.question.drop import _FIELDS_BY_NAME

    cwd = cwd or os.getcwd()
    extra: list[NotModelled] = []
    d: dict[str, Any] = {"name": name or drop_name(sa.model or "model"),
                         "model": model or model_value(sa.model or "", cwd),
                         "device": device, "engine_version": engine_version}
    version = _version_tuple(engine_version)
    for dest, value in sa.values.items():
        if dest in POINT_KEYS:
            continue
        if dest == "kv_cache_memory_bytes" and version < KV_CACHE_MEMORY_BYTES_SINCE:
            raise ArgsInputError("unrecognized arguments: --kv-cache-memory-bytes (vLLM "
                                 f"{'.'.join(map(str, KV_CACHE_MEMORY_BYTES_SINCE))}+)", where=sa.spelled[dest])
        if dest == "language_model_only" and version < (0, 17, 0):  # vllm/config/multimodal.py: 0.17.0+
            raise ArgsInputError(f"unrecognized arguments: {sa.spelled.get(dest) or '--language-model-only'} "
                                 "(vLLM 0.17+)", where=sa.spelled[dest])
        if dest == "disable_chunked_mm_input" and version < (0, 8, 4):  # vllm/engine/arg_utils.py: 0.8.4+
            raise ArgsInputError(f"unrecognized arguments: {sa.spelled.get(dest) or '--disable-chunked-mm-input'} "
                                 "(vLLM 0.8.4+)", where=sa.spelled[dest])
        if dest == "enable_extensible_kv_cache" and version < (0, 34, 0):
            raise ArgsInputError(f"unrecognized arguments: {sa.spelled.get(dest) or '--enable-extensible-kv-cache'} "
                                 "(vLLM 0.34+)", where=sa.spelled[dest])
        if dest not in _FIELDS_BY_NAME:
            if not ((dest == "data_parallel_size" and value == 1) or (dest == "enable_expert_parallel" and value is False)):
                extra.append(NotModelled(option_for(dest), value, "this build's drops do not model it",
                                         "command line", sa.spelled.get(dest)))
            continue
        if dest == "speculative_config":
            value = with_speculative_method(value, sa, version=version, cwd=cwd)
        d[dest] = value
    unmodelled = [NotModelled.of(e) for e in sa.unmodelled] + extra + list(extra_not_modelled)
    if sa.unknown and not allow_unmodelled:
        # vLLM's parser exits on a flag it does not know ("unrecognized arguments"): a misspelled
        # --max-model-len must never pass a deploy gate with the model's derived maximum instead.
        import difflib

        from tuner.memory.serve_args import _BY_OPTION

        names = " ".join(e["flag"] + (f" {e['value']}" if e.get("value") else "") for e in sa.unknown)
        close = [m for e in sa.unknown if str(e["flag"]).startswith("--")
                 for m in difflib.get_close_matches(e["flag"], list(_BY_OPTION), n=1, cutoff=0.8)]
        hint = f"did you mean {' / '.join(close)}? " if close else ""  # --max-modle-len -> --max-model-len
        raise ArgsInputError(f"unrecognized arguments: {names} ({hint}vLLM refuses flags it does not know: check the "
                             "spelling; --allow-unmodelled checks without them)", where=_where(sa.unknown))
    if unmodelled and not allow_unmodelled:
        names = ", ".join(f"{n.as_written or n.argument} ({n.why})" for n in unmodelled)
        raise ArgsInputError(f"ctx-tuner does not model {names}: the verdict would be a guess "
                             "(--allow-unmodelled checks without them)", where=_where([n.to_dict() for n in unmodelled]))
    # unknown flags go on the list too when allowed: named, never dropped
    unmodelled += [NotModelled(e["flag"], e.get("value"), "not a flag ctx-tuner knows (vLLM refuses flags it does "
                                                          "not know)", e.get("source") or "command line",
                               e["flag"] + (f" {e['value']}" if e.get("value") else "")) for e in sa.unknown]
    from tuner.question.protocol import point_of

    u, m = point_of(sa.values)
    if u is None:
        from tuner.memory.eras import era_for

        # the release's default: 0.34 resolves None to 1.0 with the extensible KV cache
        u = era_for(engine_version, extensible_kv_cache=sa.values.get("enable_extensible_kv_cache"),
                    kv_cache_memory_bytes=sa.values.get("kv_cache_memory_bytes")).default_gpu_memory_utilization
    d["candidates"] = {"gpu_memory_utilization": [u]}
    if m == AUTO and version < AUTO_FIT_SINCE:
        raise ArgsInputError(f"invalid int value: 'auto' (vLLM {engine_version} has no auto-fit; it came in "
                             f"{'.'.join(map(str, AUTO_FIT_SINCE))})", where=point_of(sa.spelled).max_model_len)
    if isinstance(m, int) and m != AUTO:
        if m <= 0:
            raise ArgsInputError(f"max_model_len must be positive, not {m}", where=point_of(sa.spelled).max_model_len)
        d["candidates"].update(max_model_len=[m])
    return d, unmodelled


def _draft_model_type(model: str, cwd: str) -> str | None:
    """The ``model_type`` of a drafter given as a local directory (its config.json), else None."""
    import json

    path = os.path.join(model_value(model, cwd), "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        return None
    mt = cfg.get("model_type") if isinstance(cfg, dict) else None
    return mt if isinstance(mt, str) else None


def with_speculative_method(value: Any, sa: ServeArgs, *, version: tuple, cwd: str) -> Any:
    """A ``--speculative-config`` without ``method`` gets the one vLLM infers from its ``model``
    (:func:`tuner.memory.specdecode.inferred_speculative_method`), said in ``sa.notes``; a mapping that
    has one, or anything else, is returned as is (the drop's rules judge it).

    Raises:
        ArgsInputError: vLLM's refusal of a config without a method in this release.
    """
    from tuner.memory.specdecode import inferred_speculative_method

    if not isinstance(value, Mapping) or value.get("method") is not None:
        return value
    model = value.get("model")
    model = model if isinstance(model, str) and model.strip() else None
    mt = _draft_model_type(model, cwd) if model else None
    release = ".".join(map(str, version))
    try:
        method = inferred_speculative_method(model, draft_model_type=mt, version=version)
    except ValueError as exc:
        raise ArgsInputError(f"{exc} (vLLM {release}'s SpeculativeConfig: no method given)",
                             where=sa.spelled.get("speculative_config") or "--speculative-config") from None
    seen = f"its config.json's model_type {mt!r}" if mt else "its name (no local config.json read)"
    sa.notes.append(f"speculative_config.method not given: {method}, as vLLM {release} infers it from the model "
                    f"{model!r} ({seen}; vllm/config/speculative.py SpeculativeConfig.__post_init__)")
    return {**value, "method": method}


def _where(entries: Sequence[Mapping[str, Any]]) -> str:
    sources = sorted({str(e.get("source") or "command line") for e in entries})
    return ", ".join(sources) or "command line"


def spelled_for_field(sa: ServeArgs, fld: str | None) -> str | None:
    """How the line wrote the argument behind a drop field (``tensor_parallel_size`` → ``-tp 3``)."""
    if not fld:
        return None
    key = fld.split(".")[-1].split("[")[0]
    return sa.spelled.get(key) or (f"model {sa.model}" if key == "model" else None)


def build_drop(sa: ServeArgs, d: dict, *, label: str):
    """Validate the equivalent drop; a drop error names the flag as it was written."""
    import yaml

    from tuner.question.drop import parse_drop

    try:
        return parse_drop(yaml.safe_dump(d, sort_keys=False), label)
    except DropError as exc:
        raise ArgsInputError(exc.message, where=spelled_for_field(sa, exc.field) or exc.field or label) from None


def to_drop(sa: ServeArgs, *, device: Any, engine_version: str, cwd: str | None = None,
            allow_unmodelled: bool = False, extra_not_modelled: Sequence[NotModelled] = (), label: str = "vllm serve",
            name: str | None = None, model: str | None = None, max_model_len: int | None = None) -> MappedArgs:
    """:func:`equivalent_drop` validated: the :class:`MappedArgs` of ``sa``. ``max_model_len``
    fills the candidate when the arguments give none (the model's derived maximum)."""
    d, nm = equivalent_drop(sa, device=device, engine_version=engine_version, cwd=cwd,
                            allow_unmodelled=allow_unmodelled, extra_not_modelled=extra_not_modelled, name=name,
                            model=model)
    if max_model_len is not None and "max_model_len" not in d["candidates"]:
        d["candidates"]["max_model_len"] = [int(max_model_len)]
    return MappedArgs(build_drop(sa, d, label=label), d, nm, sa)


__all__ = ["ArgsInputError", "MappedArgs", "NotModelled", "ServeArgsError", "UNMODELLED", "build_drop",
           "env_not_modelled", "split_env_prefix", "equivalent_drop", "from_drop_file", "from_settings", "parse_line", "to_drop"]

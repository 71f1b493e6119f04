"""ModelSpec: the facts of a model's HF ``config.json`` that memory depends on.

``resolve_model_path`` is pure Python (no torch) and runs anywhere. ``load_model_spec`` reads the
config through ``transformers.AutoConfig`` (which imports torch), so it runs only in the worker.
Never touches the network: ``HF_HUB_OFFLINE=1`` is forced and ids resolve only through the local
HF cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tuner.errors import ModelConfigError


def resolve_model_path(model: str, base_dir: str | os.PathLike | None = None, *, download: bool = False,
                       revision: str | None = None) -> Path:
    """Find the ``config.json`` for a drop's ``model`` value (no network unless ``download``).

    Order: a path (absolute, or relative to ``base_dir``) to a directory holding ``config.json``
    or to a ``.json`` file; then an HF id (``org/name``) in the local HF cache
    (``huggingface_hub.try_to_load_from_cache``, honouring ``HF_HOME``/``HF_HUB_CACHE``) at
    ``revision``; then, with ``download``, fetched from the Hub (:func:`tuner.model.hub.fetch_config`).

    Returns:
        The path of the config file.

    Raises:
        ModelConfigError: nothing found (the message names the places searched).
    """
    searched = []
    candidates = [Path(model)]
    if base_dir is not None and not Path(model).is_absolute():
        candidates.insert(0, Path(base_dir) / model)
    for c in candidates:
        searched.append(str(c))
        if c.is_dir() and (c / "config.json").is_file():
            return (c / "config.json").resolve()
        if c.is_file() and c.suffix == ".json":
            return c.resolve()
        # there, but no regular file (a FIFO, a socket, a link to /dev/zero): say so; never open it
        for odd in ([c / "config.json"] if c.is_dir() else [c] if c.suffix == ".json" else []):
            if os.path.lexists(odd):
                raise ModelConfigError(f"{_not_regular(odd)}; a model config must be a regular file",
                                       where=str(odd))
    if model.count("/") == 1 and ".." not in model and not model.startswith(("/", ".")):
        try:
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(repo_id=model, filename="config.json", revision=revision)
            if isinstance(hit, str) and os.path.isfile(hit):
                return Path(hit)
            searched.append(f"HF cache for {model}")
        except Exception as exc:  # pragma: no cover - depends on the local hub install
            searched.append(f"HF cache for {model} ({exc})")
        from tuner.model.hub import HubUnreachable, fetch_config, offline

        if download and not offline():
            try:
                return fetch_config(model, revision=revision)
            except HubUnreachable as exc:  # the same message as offline, with what failed
                searched.append(f"not fetched: {exc.why}")
        else:
            searched.append("not fetched from the Hub: " + ("HF_HUB_OFFLINE is set" if offline() else
                                                             "hub downloads are off (daemon setting allow_hub_download)"))
    hint = ""
    if model.count("/") == 1 and not model.startswith(("/", ".")):
        cli = "hf"  # huggingface_hub 0.34+; `huggingface-cli` before (removed in 1.0)
        try:
            import huggingface_hub
            from huggingface_hub import constants

            cache = constants.HF_HUB_CACHE
            if tuple(int(x) for x in huggingface_hub.__version__.split(".")[:2]) < (0, 34):
                cli = "huggingface-cli"
        except Exception:  # pragma: no cover - depends on the local hub install
            cache = os.environ.get("HF_HUB_CACHE") or "~/.cache/huggingface/hub"
        hint = (f"; the HF cache is {cache} (HF_HOME / HF_HUB_CACHE move it): fill it on a host with network "
                f"with `{cli} download {model} config.json`, or give a local directory holding config.json")
    raise ModelConfigError(f"no config.json found (searched: {', '.join(searched)}){hint}", where=model)


def _not_regular(path: Path) -> str:
    """Why ``path`` (which exists as a name) is not read as a config: "not a regular file (a FIFO)"
    and the like, "a dangling symbolic link" for a link to nothing."""
    import stat as _stat

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "a dangling symbolic link" if os.path.islink(path) else "not readable"
    kind = ("a FIFO" if _stat.S_ISFIFO(mode) else "a socket" if _stat.S_ISSOCK(mode)
            else "a character device" if _stat.S_ISCHR(mode) else "a block device" if _stat.S_ISBLK(mode)
            else "a directory" if _stat.S_ISDIR(mode) else "a special file")
    return f"not a regular file ({kind}{', through a symbolic link' if os.path.islink(path) else ''})"


#: Deepest nesting of objects and lists accepted in a model config (real ``config.json`` files nest
#: 3–5 levels; the readers and hashes walk the tree recursively).
MAX_CONFIG_DEPTH = 64


def parse_config_json(raw: bytes | str, where: str) -> Any:
    """``json.loads`` of a model config's bytes, with its nesting bounded by
    :data:`MAX_CONFIG_DEPTH` (a 100,000-level file is a :class:`ModelConfigError` naming the file,
    not a ``RecursionError`` in whatever walks it next).

    Raises:
        ModelConfigError: invalid JSON or nested too deeply (``where`` = the file).
    """
    depth = _max_depth(raw)
    if depth > MAX_CONFIG_DEPTH:
        raise ModelConfigError(f"config nests objects/lists {depth if depth < 10**6 else 'over a million'} levels deep; "
                               f"model configs are read up to {MAX_CONFIG_DEPTH} levels (MAX_CONFIG_DEPTH)", where=where)
    try:
        return json.loads(raw)
    except RecursionError:  # pragma: no cover - bounded above
        raise ModelConfigError("config nests too deeply to be read", where=where) from None
    except ValueError as exc:
        raise ModelConfigError(f"cannot read config: {exc}", where=where) from exc


def _max_depth(raw: bytes | str) -> int:
    """Deepest ``[``/``{`` nesting of JSON text, outside strings (a linear scan, no recursion)."""
    import re

    text = raw.decode("utf-8", "replace") if isinstance(raw, (bytes, bytearray)) else raw
    if "[" not in text and "{" not in text:
        return 0
    depth = deepest = 0
    # strings (with their escapes) are skipped whole; only brackets outside them count
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]', text):
        tok = m.group()
        if tok == "[" or tok == "{":
            depth += 1
            if depth > deepest:
                deepest = depth
        elif tok == "]" or tok == "}":
            depth -= 1
    return deepest


def shown(value: Any) -> str:
    """A config value as an error may show it: numbers, booleans, null and short name-like strings
    (``'int8'``, ``'llama'``) as written; anything else only by its kind and size (``a string of
    64 characters``, ``a list of 3 items``). ``model:`` may name any readable JSON file, and errors
    go to logs, the jobs table and the world-readable snapshot: no raw value of a file that is not
    a model config is echoed there."""
    import re

    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        if len(value) <= 40 and re.fullmatch(r"[A-Za-z0-9_.:+/-]*", value):
            return repr(value)
        return f"a string of {len(value)} characters"
    if isinstance(value, dict):
        return f"a JSON object of {len(value)} keys"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} items"
    return f"a {type(value).__name__}"


def require_model_config(top: dict, where: str) -> None:
    """Refuse a JSON object that is no model config — neither ``architectures`` nor ``model_type``
    (every HF ``config.json`` has one) — before any of its values is read or shown.

    Raises:
        ModelConfigError: naming the file, none of its values.
    """
    if "architectures" not in top and "model_type" not in top:
        raise ModelConfigError("not a model config: the JSON object has neither `architectures` nor `model_type` "
                               "(its values are not shown)", where=where)


def _first(obj: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        try:
            v = getattr(obj, n, None)
        except Exception:  # e.g. transformers' per-layer attributes (Gemma-4) refuse global access
            v = None
        if v is not None:
            return v
    return default


class _JsonConfig:
    """Attribute view of a raw ``config.json`` dict, for configs transformers cannot parse
    without remote code (``auto_map`` models such as Kimi-K2) or does not know yet."""

    def __init__(self, data: dict, top: dict) -> None:
        self._data, self._top = data, top
        self.model_type = top.get("model_type") or data.get("model_type") or ""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self._data.get(name)

    def to_dict(self) -> dict:
        return dict(self._data)


#: Keys that do not change the model a ``config.json`` describes, left out of
#: :func:`config_hash`: provenance (``transformers_version``, ``_name_or_path``, ``_commit_hash``),
#: generation and tokenizer ids (``bos``/``eos``/``pad_token_id``, ``use_cache``), training-time
#: init (``initializer_range``) and ``auto_map`` (remote-code class names: ctx-tuner never runs
#: remote code, the plugin is chosen by ``architectures``). Kept: everything else, including
#: ``architectures`` (picks the plugin) and ``torch_dtype`` (changes the weights).
HASH_IGNORED_KEYS = frozenset({
    "transformers_version", "_name_or_path", "_commit_hash", "use_cache", "bos_token_id", "eos_token_id",
    "pad_token_id", "initializer_range", "auto_map",
})


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        out = {k: _canonical(v) for k, v in value.items() if k not in HASH_IGNORED_KEYS}
        if "torch_dtype" in out and "dtype" not in out:  # transformers >= 4.56 writes ``dtype``
            out["dtype"] = out.pop("torch_dtype")
        return out
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def config_hash(top: dict) -> str:
    """SHA-256 of a ``config.json``'s canonical JSON: keys sorted, compact separators, without
    :data:`HASH_IGNORED_KEYS` (at any depth) and with ``torch_dtype`` spelled ``dtype``. Two copies
    of one model that differ only in those keys, key order or whitespace hash the same; any size
    that changes memory changes the hash. Pure Python (no torch)."""
    text = json.dumps(_canonical(top), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def config_file_sha256(config_path: str | os.PathLike) -> str:
    """:func:`config_hash` of a ``config.json`` file (what ``ModelSpec.config_sha256`` holds).

    Raises:
        ModelConfigError: as :func:`read_top`.
    """
    return config_hash(read_top(config_path))


#: Largest value accepted per config size key: sanity bounds far above every published model
#: (largest seen: hidden 25,600, 126 layers, 128 heads, intermediate 73,728, vocab 262,144,
#: 10M positions), so an absurd value (``hidden_size: 2**40``, ``num_hidden_layers: 10**6``) is
#: refused before anything is built instead of crashing the allocator or running to the timeout.
#: They also bound the work one simulated pass may do (layers × modules built).
MAX_CONFIG_SIZES = {
    "hidden_size": 1 << 18, "n_embd": 1 << 18, "d_model": 1 << 18,
    "num_hidden_layers": 4096, "n_layer": 4096, "num_layers": 4096,
    "num_attention_heads": 1 << 14, "n_head": 1 << 14,
    "num_key_value_heads": 1 << 14, "n_head_kv": 1 << 14, "num_kv_heads": 1 << 14, "multi_query_group_num": 1 << 14,
    "head_dim": 1 << 14,
    "intermediate_size": 1 << 22, "n_inner": 1 << 22, "ffn_hidden_size": 1 << 22,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 30, "n_positions": 1 << 30, "seq_length": 1 << 30,
}


def _positive_int(value: Any, field_name: str, path: str) -> int:
    """``value`` if it is a positive int (bools, strings, floats, NaN rejected) no larger than its
    :data:`MAX_CONFIG_SIZES` bound, else ``ModelConfigError`` naming ``path:field``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"{field_name} must be a positive integer, not {shown(value)}", where=f"{path}:{field_name}")
    limit = MAX_CONFIG_SIZES.get(field_name.rsplit(".", 1)[-1])
    if limit is not None and value > limit:
        raise ModelConfigError(f"{field_name} is {value:,}, more than {limit:,}, the largest this tool accepts "
                               "(far above any published model; MAX_CONFIG_SIZES)", where=f"{path}:{field_name}")
    return value


#: The floating-point weight dtypes a ``torch_dtype`` / ``dtype`` key may name (after
#: normalisation: ``bf16``, ``half``, ``float`` ... are accepted spellings).
FLOAT_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class ModelSpec:
    """Memory-relevant facts of a model config (the text model for multimodal wrappers).

    Attributes are HF names; sizes in elements, lengths in tokens (every size a positive int,
    checked by :func:`load_model_spec`). Sizes are the whole model's: a plugin divides them by
    ``tensor_parallel_size`` itself (:mod:`tuner.model.kit` convention 3). A key a file lacks gets the
    plugin's ``config_defaults`` first, then the fallback named below.

    Attributes:
        path: the ``config.json`` read (what errors name as ``where``).
        config_sha256: :func:`config_hash` of the file (canonical JSON, not its bytes).
        architectures: the top-level ``architectures`` (the plugin is chosen by them); ``()``
            when absent.
        model_type: transformers' ``model_type`` of the top-level config (for a multimodal
            wrapper the wrapper's, e.g. ``mistral3``; the text model's is ``raw["model_type"]``).
        hidden_size: ``hidden_size`` (also ``n_embd``, ``d_model``).
        num_hidden_layers: ``num_hidden_layers`` (also ``n_layer``, ``num_layers``): all layers,
            not this pipeline stage's (:func:`tuner.model.plugin.stage_layers`).
        num_attention_heads: ``num_attention_heads`` (also ``n_head``).
        num_key_value_heads: ``num_key_value_heads`` (also ``n_head_kv``, ``num_kv_heads``,
            ``multi_query_group_num``); ``num_attention_heads`` when absent (MHA). All KV heads,
            not one rank's (:func:`tuner.memory.kvcache.kv_heads_per_rank`).
        head_dim: the config's ``head_dim``, else ``hidden_size // num_attention_heads``.
        intermediate_size: ``intermediate_size`` (also ``n_inner``, ``ffn_hidden_size``);
            ``4 · hidden_size`` when absent. The dense MLP's width (MoE families read their
            expert width from ``raw``).
        vocab_size: ``vocab_size`` as the config gives it (unpadded; vLLM pads to 64,
            :func:`tuner.model.simulate.layers.pad_vocab`).
        max_position_embeddings: ``max_position_embeddings`` (also ``n_positions``,
            ``seq_length``); 2048 when absent. Sizes rotary caches; vLLM's derived maximum
            ``max_model_len`` also applies the RoPE scaling factor (not done here).
        torch_dtype: the checkpoint's weight dtype (``torch_dtype`` or ``dtype``, top level
            before ``text_config``; else the plugin default, else transformers', else ``float16``),
            normalised to ``bfloat16`` / ``float16`` / ``float32``.
            Build in ``settings.dtype`` (the drop's resolved dtype), not in this.
        tie_word_embeddings: the file's key (top level, then ``text_config``), else the plugin
            default, else transformers' class default: the LM head shares the embedding.
        rotary_dim: ``int(head_dim · partial_rotary_factor)`` (the factor from the config or its
            ``rope_parameters`` / ``rope_scaling``, 1.0 when absent): the rotary cache's width.
        sliding_window: the config's ``sliding_window`` (``None`` when absent or null; 0 is
            possible). Whether it applies to every layer (``use_sliding_window``,
            ``layer_types``) is the plugin's decision.
        quantization_config: the checkpoint's ``quantization_config`` dict (top level, else the
            text config), or ``None``: what :func:`tuner.memory.quant.scheme_for` reads.
        raw: the whole text config as a dict (transformers' ``to_dict()``, class defaults and
            plugin defaults included) for family keys the attributes above do not cover.
        top: the top-level ``config.json`` dict as the file has it (``vision_config``,
            ``text_config``, wrapper keys).
    """

    path: str
    config_sha256: str
    architectures: tuple[str, ...]
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str
    tie_word_embeddings: bool
    rotary_dim: int
    sliding_window: int | None
    quantization_config: dict | None
    raw: dict = field(default_factory=dict, repr=False)
    top: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("raw")
        d.pop("top")
        return d


def _dtype_name(value: Any) -> str:
    s = str(value or "float16").replace("torch.", "")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32", "fp32": "float32"}.get(s, s)


def overrides_applied(text_config: dict, overrides: dict | None) -> dict:
    """A text config dict with the drop's ``hf_overrides`` (vLLM ``--hf-overrides``) merged in,
    as vLLM merges them before it derives ``max_model_len``: the override keys win; with
    transformers ≥ 5 RoPE lives in ``rope_parameters`` (rope_theta inside), so an overridden
    ``rope_scaling`` is what that dict then holds, as vLLM reads it. Pure (a new dict)."""
    d = {**text_config, **(overrides or {})}
    if overrides and isinstance(overrides.get("rope_scaling"), dict) and isinstance(d.get("rope_parameters"), dict) \
            and "rope_parameters" not in overrides:
        d["rope_parameters"] = {**d["rope_parameters"], **overrides["rope_scaling"]}
    return d


def load_model_spec(config_path: str | os.PathLike, defaults: dict | None = None,
                    overrides: dict | None = None) -> tuple[ModelSpec, Any]:
    """Read ``config_path`` with ``transformers.AutoConfig`` (offline, no remote code).

    Args:
        defaults: values for text-config keys the file lacks (a plugin's family defaults for
            partial configs, :meth:`tuner.model.plugin.ModelPlugin.config_defaults`); the file wins.
        overrides: the drop's ``hf_overrides`` (vLLM ``--hf-overrides``): text-config keys that win
            over the file and the defaults; ``config_sha256`` hashes the config with them applied.

    Returns:
        ``(spec, hf_config)``: the :class:`ModelSpec` and the transformers config object.

    Raises:
        ModelConfigError: unreadable JSON, not a JSON object, a missing field, or a value vLLM
            could not use: every size (``hidden_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
            ``vocab_size``, ``max_position_embeddings``) must be a positive int (bools, strings,
            floats rejected), ``hidden_size`` divisible by the heads unless ``head_dim`` is set,
            ``torch_dtype`` a floating-point dtype, ``architectures`` a list of names (a single
            string is taken as one). A null value counts as missing. ``where`` is
            ``FILE:FIELD`` (``text_config.FIELD`` for a key of the text config).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(config_path)
    top, hf, text_cfg = _read_config(path)
    defaults = dict(defaults or {})
    text_json = top.get("text_config") if isinstance(top.get("text_config"), dict) else None
    fields = _Fields(text_cfg, "text_config." if text_json is not None else "", str(path))
    if defaults:
        # Keys the file sets (a null value counts as missing, like an absent key).
        file_keys = {k for k, v in (text_json if text_json is not None else top).items() if v is not None}
        fields.cfg = _WithDefaults(fields.cfg, defaults, file_keys)
    overrides = dict(overrides or {})
    if overrides:
        fields.cfg = _WithOverrides(fields.cfg, overrides)
        top, text_json = _top_with_overrides(top, text_json, overrides)
    sizes = _sizes(fields, top, text_json, hf, defaults, path)
    raw = fields.cfg.to_dict()
    text_json = text_json or {}
    partial = _partial_rotary_factor(raw, fields)
    dtype = _torch_dtype(top, text_json, defaults, hf, fields.where)
    tie = _tie_word_embeddings(top, text_json, defaults, fields.cfg)
    window = _sliding_window(fields)
    qc = _quantization_config(top, raw, fields.where)
    spec = ModelSpec(
        path=str(path),
        config_sha256=config_hash(top),
        architectures=_architectures(top, fields.where),
        model_type=str(_first(hf, "model_type", default="")),
        **sizes,
        torch_dtype=dtype,
        tie_word_embeddings=tie,
        rotary_dim=int(sizes["head_dim"] * partial),
        sliding_window=window,
        quantization_config=qc,
        raw=raw,
        top=top,
    )
    return spec, hf


def _read_config(path: Path) -> tuple[dict, Any, Any]:
    """Step 1 of :func:`load_model_spec`: the file's JSON object (checked) and transformers'
    config of it with its text config — or, where transformers cannot read it (it never runs
    remote code), the JSON itself."""
    try:
        text = read_config_bytes(path)
    except OSError as exc:
        raise ModelConfigError(f"cannot read config: {exc}", where=str(path)) from exc
    top = parse_config_json(text, str(path))
    from tuner.model.transformers_lean import import_transformers  # worker side only: imports torch

    transformers = import_transformers()  # without the scan of every model's source
    from transformers.models.auto.configuration_auto import AutoConfig

    transformers.logging.set_verbosity_error()
    if not isinstance(top, dict):
        raise ModelConfigError("config.json is not a JSON object", where=str(path))
    require_model_config(top, str(path))
    try:
        hf = AutoConfig.from_pretrained(str(path.parent) if path.name == "config.json" else str(path),
                                        trust_remote_code=False, local_files_only=True)
        text_cfg = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        text_cfg.to_dict()
    except Exception:
        # Never runs remote code: read the JSON itself (text_config when present), which is all a
        # memory model needs; plugins read ``spec.raw`` / ``spec.top`` for anything else.
        text_json = top.get("text_config") if isinstance(top.get("text_config"), dict) else top
        hf = text_cfg = _JsonConfig(text_json, top)
    return top, hf, text_cfg


class _WithDefaults:
    """The file's own keys win; a plugin default beats a transformers class default for a
    key the file lacks (partial configs, ``shared/models`` status "partial")."""

    def __init__(self, base: Any, defaults: dict, file_keys: set) -> None:
        self._base, self._defaults, self._file_keys = base, defaults, file_keys

    def __getattr__(self, name: str) -> Any:
        if name in self._defaults and name not in self._file_keys:
            return self._defaults[name]
        v = _first(self._base, name)
        return self._defaults.get(name) if v is None else v

    def to_dict(self) -> dict:
        d = self._base.to_dict()
        d.update({k: v for k, v in self._defaults.items() if k not in self._file_keys or d.get(k) is None})
        return d


class _WithOverrides:
    """vLLM's ``--hf-overrides``: the drop's keys win over the file and every default."""

    def __init__(self, inner: Any, overrides: dict) -> None:
        self._inner, self._overrides = inner, overrides

    def __getattr__(self, name: str) -> Any:
        return self._overrides[name] if name in self._overrides else _first(self._inner, name)

    def to_dict(self) -> dict:
        return overrides_applied(self._inner.to_dict(), self._overrides)


def _top_with_overrides(top: dict, text_json: dict | None, overrides: dict) -> tuple[dict, dict | None]:
    """The file's top object with ``hf_overrides`` applied (to its text config where it has one),
    so ``config_sha256`` hashes the config as vLLM sees it."""
    top = dict(top)
    if text_json is not None:
        text_json = {**text_json, **overrides}
        top["text_config"] = text_json
    else:
        top.update(overrides)
    return top, text_json


class _Fields:
    """Reads the text config's fields by their aliases, naming the field that supplied a value
    (``where`` = ``FILE:FIELD``, ``text_config.FIELD`` for a key of the text config)."""

    def __init__(self, cfg: Any, prefix: str, where: str) -> None:
        self.cfg, self.prefix, self.where = cfg, prefix, where

    def pick(self, *names: str) -> tuple[str, Any]:
        """(the dotted field name that supplied a value, the value); the first name and None
        when none did."""
        for n in names:
            v = _first(self.cfg, n)
            if v is not None:
                return self.prefix + n, v
        return self.prefix + names[0], None

    def required(self, *names: str) -> int:
        name, value = self.pick(*names)
        if value is None:
            raise ModelConfigError(f"missing {names[0]}", where=f"{self.where}:{self.prefix + names[0]}")
        return _positive_int(value, name, self.where)

    def optional(self, default: int, *names: str) -> int:
        name, value = self.pick(*names)
        return default if value is None else _positive_int(value, name, self.where)


def _sizes(fields: _Fields, top: dict, text_json: dict | None, hf: Any, defaults: dict, path: Path) -> dict:
    """The model's sizes (:class:`ModelSpec` fields), each a positive int, ``hidden_size``
    divisible by the heads unless ``head_dim`` is set."""
    where, prefix = fields.where, fields.prefix
    hidden = fields.required("hidden_size", "n_embd", "d_model")
    layers = fields.required("num_hidden_layers", "n_layer", "num_layers")
    heads = fields.required("num_attention_heads", "n_head")
    kv = fields.optional(heads, "num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num")
    hd_name, hd_value = fields.pick("head_dim")
    file_text = text_json if text_json is not None else top
    if file_text.get("head_dim") is None and hidden % heads:  # transformers may derive a head_dim itself
        raise ModelConfigError(f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) and "
                               "the config sets no head_dim", where=f"{where}:{prefix}num_attention_heads")
    if hd_value is None:
        if hidden % heads:
            raise ModelConfigError(f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads}) and "
                                   "the config sets no head_dim", where=f"{where}:{prefix}num_attention_heads")
        head_dim = hidden // heads
    else:
        # Any positive width is accepted: vLLM picks an attention backend that supports it.
        head_dim = _positive_int(hd_value, hd_name, where)
    inter = fields.optional(4 * hidden, "intermediate_size", "n_inner", "ffn_hidden_size")
    vocab_name, vocab = fields.pick("vocab_size")
    if vocab is None:
        vocab_name, vocab = "vocab_size", _first(hf, "vocab_size") or defaults.get("vocab_size")
    if vocab is None:
        raise ModelConfigError("missing vocab_size", where=f"{path}:vocab_size")
    vocab = _positive_int(vocab, vocab_name, where)
    maxpos = fields.optional(2048, "max_position_embeddings", "n_positions", "seq_length")
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=head_dim, intermediate_size=inter, vocab_size=vocab, max_position_embeddings=maxpos)


def _partial_rotary_factor(raw: dict, fields: _Fields) -> float:
    """``partial_rotary_factor`` (top-level or in the rope parameters), a number in (0, 1]."""
    rope_params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope_params, dict):
        rope_params = {}
    partial_value = raw.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0
    if isinstance(partial_value, bool) or not isinstance(partial_value, (int, float)) or not 0 < partial_value <= 1:
        raise ModelConfigError(f"partial_rotary_factor must be a number in (0, 1], not {shown(partial_value)}",
                               where=f"{fields.where}:{fields.prefix}partial_rotary_factor")
    return float(partial_value)


def _torch_dtype(top: dict, text_json: dict, defaults: dict, hf: Any, where: str) -> str:
    """The checkpoint's floating-point dtype (``torch_dtype`` or ``dtype``, top level first)."""
    dtype_field, dtype_value = "torch_dtype", None
    for key_prefix, source in (("", top), ("text_config.", text_json)):
        for key in ("torch_dtype", "dtype"):
            if dtype_value is None and source.get(key) is not None:
                dtype_field, dtype_value = key_prefix + key, source[key]
    if dtype_value is None:
        dtype_value = defaults.get("torch_dtype") or _first(hf, "dtype", default=None)
    if dtype_value is not None and not isinstance(dtype_value, str) and "torch." not in str(dtype_value):
        raise ModelConfigError(f"{dtype_field} must be a floating-point dtype name ({', '.join(FLOAT_DTYPES)}), "
                               f"not {shown(dtype_value)}", where=f"{where}:{dtype_field}")
    dtype = _dtype_name(dtype_value)
    if dtype not in FLOAT_DTYPES:
        raise ModelConfigError(f"{dtype_field} must be a floating-point dtype ({', '.join(FLOAT_DTYPES)}), "
                               f"not {shown(dtype_value)}", where=f"{where}:{dtype_field}")
    return dtype


def _tie_word_embeddings(top: dict, text_json: dict, defaults: dict, text_cfg: Any) -> bool:
    """The checkpoint's own key wins over a transformers class default."""
    if "tie_word_embeddings" in top:
        return bool(top["tie_word_embeddings"])
    if "tie_word_embeddings" in text_json:
        return bool(text_json["tie_word_embeddings"])
    if "tie_word_embeddings" in defaults:
        return bool(defaults["tie_word_embeddings"])
    return bool(getattr(text_cfg, "tie_word_embeddings", False))


def _sliding_window(fields: _Fields) -> int | None:
    sw_name, window = fields.pick("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ModelConfigError(f"sliding_window must be null or a non-negative integer, not {shown(window)}",
                               where=f"{fields.where}:{sw_name}")
    return window


def _quantization_config(top: dict, raw: dict, where: str) -> dict | None:
    qc = top.get("quantization_config") or raw.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ModelConfigError(f"quantization_config must be a JSON object, not {shown(qc)}",
                               where=f"{where}:quantization_config")
    return qc


def _architectures(top: dict, where: str) -> tuple[str, ...]:
    """``architectures`` as a tuple: absent/null → ``()``; a single string is taken as a
    one-element list; anything else but a list of strings is a ModelConfigError."""
    archs = top.get("architectures")
    if archs is None:
        return ()
    if isinstance(archs, str):
        return (archs,)
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelConfigError(f"architectures must be a list of class names, not {shown(archs)}",
                               where=f"{where}:architectures")
    return tuple(archs)


def without_nulls(top: dict) -> dict:
    """``top`` without null values at the top level and in ``text_config``: what plugins'
    ``config_defaults`` read, so a key set to null gets the same default as a missing one."""
    out = {k: v for k, v in top.items() if v is not None}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = {k: v for k, v in out["text_config"].items() if v is not None}
    return out


def defaults_applied(top: dict, defaults: dict) -> dict:
    """The plugin defaults (:meth:`tuner.model.plugin.ModelPlugin.config_defaults`) that
    :func:`load_model_spec` uses because the file lacks the key (absent or null) in its text
    config (``torch_dtype`` also counts as set when the top level or ``dtype`` sets it)."""
    text = top.get("text_config") if isinstance(top.get("text_config"), dict) else top
    out = {}
    for k, v in (defaults or {}).items():
        if text.get(k) is not None:
            continue
        if k in ("torch_dtype", "dtype") and any(src.get(n) is not None for src in (top, text)
                                                 for n in ("torch_dtype", "dtype")):
            continue
        out[k] = v
    return out


#: Largest model config file read, bytes (the largest real ``config.json`` files are tens of KiB;
#: a bigger file is refused before it is read, so a drop cannot make any process read gigabytes).
MAX_CONFIG_BYTES = 16 * 1024 * 1024


def read_config_bytes(config_path: str | os.PathLike, max_bytes: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a model config file: a regular file (never a FIFO or device) of at most
    ``max_bytes`` bytes, checked before and while reading.

    Raises:
        ModelConfigError: not a regular file, too large, or unreadable (names the file).
    """
    import stat as _stat

    path = str(config_path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ModelConfigError(f"cannot read config: {exc.strerror or exc}", where=path) from exc
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise ModelConfigError("not a regular file (a FIFO, socket or device is never read)", where=path)
        if st.st_size > max_bytes:
            raise ModelConfigError(f"config file is {st.st_size:,} bytes; model configs are read up to "
                                   f"{max_bytes:,} bytes (MAX_CONFIG_BYTES)", where=path)
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise ModelConfigError(f"cannot read config: {exc.strerror or exc}", where=path) from exc
    finally:
        os.close(fd)
    if left <= 0:
        raise ModelConfigError(f"config file grew past {max_bytes:,} bytes while being read (MAX_CONFIG_BYTES)",
                               where=path)
    return b"".join(chunks)


def read_top(config_path: str | os.PathLike) -> dict:
    """The top-level dict of a ``config.json`` (no transformers, no torch).

    Raises:
        ModelConfigError: unreadable file, invalid JSON, or not a JSON object (names the file).
    """
    path = Path(config_path)
    try:
        raw = read_config_bytes(path)
    except OSError as exc:
        raise ModelConfigError(f"cannot read config: {exc}", where=str(path)) from exc
    top = parse_config_json(raw, str(path))
    if not isinstance(top, dict):
        raise ModelConfigError("config.json is not a JSON object", where=str(path))
    return top


def read_architectures(config_path: str | os.PathLike) -> tuple[str, ...]:
    """The ``architectures`` list of a ``config.json`` (empty when absent; a single string is a
    one-element list).

    Raises:
        ModelConfigError: as :func:`read_top`, or ``architectures`` is neither a string nor a list
            of strings (names the file and the field).
    """
    return _architectures(read_top(config_path), str(config_path))


def derived_max(config_path: str, hf_overrides: dict | None = None) -> tuple[int, str]:
    """vLLM's derived ``max_model_len`` of a config (text config of a multimodal wrapper), with
    ``--hf-overrides`` applied first as vLLM applies them (a RoPE scaling override raises it)."""
    from tuner.memory.search import derived_max_model_len

    top = read_top(config_path)
    text = top.get("text_config") if isinstance(top.get("text_config"), dict) else top
    text = overrides_applied(text, hf_overrides)
    return derived_max_model_len(text, model_type=str(text.get("model_type") or top.get("model_type") or ""))

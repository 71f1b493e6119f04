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


def resolve_model_path(model: str, base_dir: str | os.PathLike | None = None) -> Path:
    """Find the ``config.json`` for a drop's ``model`` value without network access.

    Order: a path (absolute, or relative to ``base_dir``) to a directory holding ``config.json``
    or to a ``.json`` file; then an HF id (``org/name``) in the local HF cache
    (``huggingface_hub.try_to_load_from_cache``, honouring ``HF_HOME``/``HF_HUB_CACHE``).

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
    if model.count("/") == 1 and ".." not in model and not model.startswith(("/", ".")):
        try:
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(repo_id=model, filename="config.json")
            if isinstance(hit, str) and os.path.isfile(hit):
                return Path(hit)
            searched.append(f"HF cache for {model}")
        except Exception as exc:  # pragma: no cover - depends on the local hub install
            searched.append(f"HF cache for {model} ({exc})")
    raise ModelConfigError(f"no config.json found (searched: {', '.join(searched)})", where=model)


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


@dataclass(frozen=True)
class ModelSpec:
    """Memory-relevant facts of a model config (the text model for multimodal wrappers).

    Attributes are HF names; sizes in elements, lengths in tokens. ``raw`` holds the whole text
    config as a dict for plugins that need more; ``top`` the top-level config dict.
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


def load_model_spec(config_path: str | os.PathLike, defaults: dict | None = None) -> tuple[ModelSpec, Any]:
    """Read ``config_path`` with ``transformers.AutoConfig`` (offline, no remote code).

    Args:
        defaults: values for text-config keys the file lacks (a plugin's family defaults for
            partial configs, :meth:`tuner.plugin.ModelPlugin.config_defaults`); the file wins.

    Returns:
        ``(spec, hf_config)``: the :class:`ModelSpec` and the transformers config object.

    Raises:
        ModelConfigError: unreadable JSON, an unknown ``model_type``, or a missing field; the
            message names the file and the field.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(config_path)
    try:
        text = path.read_bytes()
        top = json.loads(text)
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read config: {exc}", where=str(path)) from exc
    from transformers import AutoConfig  # worker side only: imports torch

    import transformers

    transformers.logging.set_verbosity_error()
    if not isinstance(top, dict):
        raise ModelConfigError("config.json is not a JSON object", where=str(path))
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
    defaults = dict(defaults or {})
    if defaults:
        base = text_cfg

        file_keys = set(top.get("text_config") or {}) if isinstance(top.get("text_config"), dict) else set(top)

        class _WithDefaults:
            """The file's own keys win; a plugin default beats a transformers class default for a
            key the file lacks (partial configs, ``shared/models`` status "partial")."""

            def __getattr__(self, name: str) -> Any:
                if name in defaults and name not in file_keys:
                    return defaults[name]
                v = _first(base, name)
                return defaults.get(name) if v is None else v

            def to_dict(self) -> dict:
                d = base.to_dict()
                d.update({k: v for k, v in defaults.items() if k not in file_keys or d.get(k) is None})
                return d

        text_cfg = _WithDefaults()
    try:
        hidden = int(_first(text_cfg, "hidden_size", "n_embd", "d_model"))
        layers = int(_first(text_cfg, "num_hidden_layers", "n_layer", "num_layers"))
        heads = int(_first(text_cfg, "num_attention_heads", "n_head"))
    except TypeError as exc:
        raise ModelConfigError("missing hidden_size / num_hidden_layers / num_attention_heads", where=str(path)) from exc
    kv = _first(text_cfg, "num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num", default=heads)
    head_dim = _first(text_cfg, "head_dim", default=None) or hidden // heads
    inter = _first(text_cfg, "intermediate_size", "n_inner", "ffn_hidden_size", default=4 * hidden)
    vocab = _first(text_cfg, "vocab_size", default=None) or _first(hf, "vocab_size") or defaults.get("vocab_size")
    if vocab is None:
        raise ModelConfigError("missing vocab_size", where=f"{path}:vocab_size")
    maxpos = _first(text_cfg, "max_position_embeddings", "n_positions", "seq_length", default=2048)
    raw = text_cfg.to_dict()
    text_json = top.get("text_config") or {}
    rope_params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    partial = float(raw.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor") or 1.0)
    dtype = _dtype_name(top.get("torch_dtype") or top.get("dtype") or text_json.get("torch_dtype")
                        or text_json.get("dtype") or defaults.get("torch_dtype") or _first(hf, "dtype", default=None))
    # The checkpoint's own key wins over a transformers class default.
    if "tie_word_embeddings" in top:
        tie = bool(top["tie_word_embeddings"])
    elif "tie_word_embeddings" in text_json:
        tie = bool(text_json["tie_word_embeddings"])
    elif "tie_word_embeddings" in defaults:
        tie = bool(defaults["tie_word_embeddings"])
    else:
        tie = bool(getattr(text_cfg, "tie_word_embeddings", False))
    spec = ModelSpec(
        path=str(path),
        config_sha256=hashlib.sha256(text).hexdigest(),
        architectures=tuple(top.get("architectures") or ()),
        model_type=str(_first(hf, "model_type", default="")),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(kv),
        head_dim=int(head_dim),
        intermediate_size=int(inter),
        vocab_size=int(vocab),
        max_position_embeddings=int(maxpos),
        torch_dtype=dtype,
        tie_word_embeddings=tie,
        rotary_dim=int(int(head_dim) * partial),
        sliding_window=_first(text_cfg, "sliding_window", default=None),
        quantization_config=top.get("quantization_config") or raw.get("quantization_config"),
        raw=raw,
        top=top,
    )
    return spec, hf


def read_top(config_path: str | os.PathLike) -> dict:
    """The top-level dict of a ``config.json`` (no transformers, no torch).

    Raises:
        ModelConfigError: unreadable file, invalid JSON, or not a JSON object (names the file).
    """
    path = Path(config_path)
    try:
        top = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read config: {exc}", where=str(path)) from exc
    if not isinstance(top, dict):
        raise ModelConfigError("config.json is not a JSON object", where=str(path))
    return top


def read_architectures(config_path: str | os.PathLike) -> tuple[str, ...]:
    """The ``architectures`` list of a ``config.json`` (empty when absent)."""
    archs = read_top(config_path).get("architectures") or ()
    return tuple(a for a in archs if isinstance(a, str))

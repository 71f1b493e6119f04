"""The daemon's ``model_roots`` setting: where a drop's local model may lie (parent side; stdlib).

A drop's ``model`` may name any path, and the daemon (a service user with its own read rights)
reads what it names and reports errors about it into logs, the jobs table and the world-readable
snapshot. With ``model_roots`` set, a local model path — the target's and a speculative draft
model's ``config.json`` as resolved (:func:`tuner.model.modelspec.resolve_model_path`), after following
symbolic links — must lie inside one of those directories; HF ids found in the HF cache are always
allowed (the cache holds only what the hub serves). A path outside is a :class:`DropError` on the
drop's ``model`` field that names the roots, checked before the file is opened. ``model_roots``
unset (null): any readable path, as the CLI always allows.
"""

from __future__ import annotations

import os
from typing import Iterable

from tuner.errors import DropError


def _inside(path: str, root: str) -> bool:
    root = os.path.realpath(os.path.expanduser(root))
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def hf_cache_dir() -> str | None:
    """The HF hub cache directory (``HF_HUB_CACHE`` / ``HF_HOME``), real path; None when unknown."""
    try:
        from huggingface_hub import constants

        return os.path.realpath(constants.HF_HUB_CACHE)
    except Exception:  # pragma: no cover - depends on the local hub install
        return None


def check_model_roots(paths: Iterable[tuple[str, str | None]], roots: Iterable[str] | None, *, drop_path: str,
                      cache_dir: str | None = None) -> None:
    """Refuse a model file outside ``roots``.

    Args:
        paths: (field, resolved config path or None) pairs: ``("model", …)``,
            ``("speculative_config.model", …)``.
        roots: the ``model_roots`` setting; None or empty: every path is allowed.
        drop_path: the drop file (what the error names).
        cache_dir: the HF cache (default :func:`hf_cache_dir`): a path inside it is allowed.

    Raises:
        DropError: ``path=drop_path``, ``field`` the field; the message names the roots and the
            resolved path (a path, never a value read from the file).
    """
    roots = tuple(roots or ())
    if not roots:
        return
    cache = cache_dir if cache_dir is not None else hf_cache_dir()
    for field, path in paths:
        if not path:
            continue
        real = os.path.realpath(path)
        if any(_inside(real, r) for r in roots) or (cache and _inside(real, cache)):
            continue
        shown = real if real == os.path.abspath(path) else f"{path} (→ {real})"
        raise DropError(f"{shown} is outside the allowed model roots ({', '.join(roots)}: setting model_roots); "
                        "put the model under one of them or ask the operator to add its directory",
                        path=drop_path, field=field)


__all__ = ["check_model_roots", "hf_cache_dir"]

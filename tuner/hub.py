"""Model configs from the Hugging Face Hub: ``config.json`` and the small JSON files that describe
quantization or a multimodal wrapper — never weights — through ``huggingface_hub`` into the
standard HF cache (``HF_HOME`` / ``HF_HUB_CACHE``).

``huggingface_hub`` itself honours ``HF_HUB_OFFLINE`` (no request at all), ``HF_TOKEN`` (gated
and private repos), ``HF_ENDPOINT`` (a mirror) and the ``revision`` (branch, tag or commit). The
CLI fetches when a config is missing from the cache; the daemon only with its
``allow_hub_download`` setting. Errors are :class:`~tuner.errors.ModelConfigError` naming the repo.
No torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from tuner.errors import ModelConfigError

#: Files fetched besides config.json when the repo has them (each a few KiB at most): GPTQ/AWQ
#: ``quantize_config.json`` / ``quant_config.json``, ModelOpt ``hf_quant_config.json``, multimodal
#: ``preprocessor_config.json`` / ``processor_config.json``, Mistral-format ``params.json``.
SMALL_FILES = ("quantize_config.json", "quant_config.json", "hf_quant_config.json", "preprocessor_config.json",
               "processor_config.json", "params.json")


def offline() -> bool:
    """``HF_HUB_OFFLINE`` is set to a true value (as huggingface_hub reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def fetch_config(repo_id: str, *, revision: str | None = None) -> Path:
    """Download ``config.json`` (and :data:`SMALL_FILES` that exist) of ``repo_id`` at ``revision``
    into the HF cache; the local path of ``config.json``.

    Raises:
        ModelConfigError: offline, gated (how to log in), not found, no config.json, or a network error.
    """
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError as exc:  # pragma: no cover - a dependency
        raise ModelConfigError(f"huggingface_hub is not installed: {exc}", where=repo_id) from None
    if offline():
        raise ModelConfigError("config.json is not in the local HF cache and HF_HUB_OFFLINE is set (unset it, or "
                               "download it with `hf download " + repo_id + " config.json`)", where=repo_id)
    at = f" at revision {revision}" if revision else ""
    try:
        path = hf_hub_download(repo_id, "config.json", revision=revision)
    except GatedRepoError:
        raise ModelConfigError(f"{repo_id} is a gated repository{at}: accept its terms on the Hub, then log in "
                               "with `hf auth login` (or set HF_TOKEN to a token with access)", where=repo_id) from None
    except RevisionNotFoundError:
        raise ModelConfigError(f"revision {revision!r} not found in {repo_id}", where=repo_id) from None
    except RepositoryNotFoundError:
        raise ModelConfigError(f"repository {repo_id} not found on the Hub (or private: log in with "
                               "`hf auth login` or set HF_TOKEN)", where=repo_id) from None
    except EntryNotFoundError:
        raise ModelConfigError(f"{repo_id}{at} has no config.json", where=repo_id) from None
    except LocalEntryNotFoundError as exc:
        raise ModelConfigError(f"cannot fetch config.json{at}: {exc}", where=repo_id) from None
    except OSError as exc:  # network errors are OSErrors in huggingface_hub / httpx
        raise ModelConfigError(f"cannot fetch config.json{at}: {exc}", where=repo_id) from None
    for name in SMALL_FILES:
        try:
            hf_hub_download(repo_id, name, revision=revision)
        except (EntryNotFoundError, LocalEntryNotFoundError, OSError):
            continue
    return Path(path)

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


#: Seconds :func:`hub_unreachable` waits for a TCP connection to the Hub before it says the Hub
#: cannot be reached (huggingface_hub itself retries a failed connection 5 times with a 1-8 s
#: backoff: 23 s before its error).
PROBE_TIMEOUT_S = 3.0


def endpoint() -> str:
    """The Hub URL huggingface_hub uses (``HF_ENDPOINT``, default ``https://huggingface.co``)."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _proxied(scheme: str, host: str) -> bool:
    """A proxy is configured for ``scheme`` and ``host`` is not in ``NO_PROXY`` (then a direct
    connection says nothing about whether the Hub is reachable)."""
    import urllib.request

    proxies = urllib.request.getproxies()
    return bool(proxies.get(scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(host)


def hub_unreachable(url: str | None = None, *, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why no TCP connection to the Hub at ``url`` (default :func:`endpoint`) opens within
    ``timeout_s`` (no network, the name does not resolve, the port refuses), or None when one opens
    or a proxy stands between (then huggingface_hub's own request decides)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url or endpoint())
    host = parts.hostname
    if not host:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if _proxied(parts.scheme or "https", host):
        return None
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.gaierror as exc:
        return f"the name {host} does not resolve ({exc.strerror or exc})"
    except TimeoutError:
        return f"no answer from {host}:{port} within {timeout_s:g} s"
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or exc}"


class HubUnreachable(ModelConfigError):
    """config.json is not cached and the Hub cannot be reached (no network, a refused or silent
    endpoint); ``why`` says what failed. :func:`tuner.model.modelspec.resolve_model_path` turns it into
    the same message as with ``HF_HUB_OFFLINE`` (places searched, where the cache is, how to fill it)."""

    def __init__(self, why: str, *, where: str) -> None:
        self.why = why
        super().__init__(f"config.json is not in the local HF cache and {why}", where=where)


def log_once() -> None:
    """Let huggingface_hub's warnings (its retry lines) print once: the library logs through a
    handler of its own *and* propagates to the root logger the CLI configures, so each line
    appeared twice. Propagation is turned off while the library has its own handler."""
    import logging

    lib = logging.getLogger("huggingface_hub")
    if lib.handlers:
        lib.propagate = False


def fetch_config(repo_id: str, *, revision: str | None = None) -> Path:
    """Download ``config.json`` (and :data:`SMALL_FILES` that exist) of ``repo_id`` at ``revision``
    into the HF cache; the local path of ``config.json``.

    Raises:
        HubUnreachable: the Hub cannot be reached (checked first with a :data:`PROBE_TIMEOUT_S`
            connection, or huggingface_hub's ``LocalEntryNotFoundError`` after its retries).
        ModelConfigError: offline, gated (how to log in), not found, no config.json, or a network error.
    """
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError as exc:  # pragma: no cover - a dependency
        raise ModelConfigError(f"huggingface_hub is not installed: {exc}", where=repo_id) from None
    log_once()
    if offline():
        raise ModelConfigError("config.json is not in the local HF cache and HF_HUB_OFFLINE is set (unset it, or "
                               "download it with `hf download " + repo_id + " config.json`)", where=repo_id)
    at = f" at revision {revision}" if revision else ""
    why = hub_unreachable()
    if why is not None:  # before huggingface_hub's 23 s of retries, each logged
        raise HubUnreachable(f"the Hub at {endpoint()} cannot be reached ({why})", where=repo_id)
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
    except LocalEntryNotFoundError as exc:
        # before EntryNotFoundError, its base class: not cached and the Hub did not answer (a
        # connection problem), not a repo without config.json
        cause = exc.__cause__ or exc.__context__
        detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        raise HubUnreachable(f"the Hub at {endpoint()} did not answer{detail}", where=repo_id) from None
    except EntryNotFoundError:
        raise ModelConfigError(f"{repo_id}{at} has no config.json", where=repo_id) from None
    except OSError as exc:  # network errors are OSErrors in huggingface_hub / httpx
        raise ModelConfigError(f"cannot fetch config.json{at}: {exc}", where=repo_id) from None
    for name in SMALL_FILES:
        try:
            hf_hub_download(repo_id, name, revision=revision)
        except (EntryNotFoundError, LocalEntryNotFoundError, OSError):
            continue
    return Path(path)

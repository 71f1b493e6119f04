"""docker compose files → vLLM workloads.

Interpolation follows the Compose specification ("Interpolation"): ``$VAR``, ``${VAR}``,
``${VAR:-default}`` (unset or empty), ``${VAR-default}`` (unset), ``${VAR:?message}`` /
``${VAR?message}`` (an error), ``${VAR:+alternative}`` / ``${VAR+alternative}``, ``$$`` for a
literal ``$``, a default may itself hold ``${…}``. Values come from the environment ``docker
compose`` runs in (``environ``, default ``os.environ``), then the ``.env`` file beside the compose
file, read with python-dotenv (``dotenv_values``: its quoting, ``export`` and ``${VAR}`` rules).

Each service whose command runs vLLM is a workload: ``entrypoint`` + ``command`` (a string is
split as a shell would), or the vLLM image's entrypoint (``vllm serve``) + ``command``; its
``environment`` (and ``env_file``) is the container's environment. GPUs: the service's
``deploy.resources.reservations.devices`` entries with the ``gpu`` capability (``count``, or the
number of ``device_ids``; ``count: all`` = not said). Compose names no GPU product: ``--device``.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

from tuner.deploy import DeployFileError, Workload
from tuner.deploy.commandline import split_words, vllm_argv

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BRACED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?\Z", re.S)


class _Missing(Exception):
    pass


def interpolate(text: str, env: Mapping[str, str], *, where: str, unset: list[str] | None = None) -> str:
    """Compose interpolation of one string (see the module docstring).

    Raises:
        DeployFileError: ``${VAR?message}`` with VAR unset, or a malformed ``${…}``.
    """
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c != "$":
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1:i + 2]
        if nxt == "$":
            out.append("$")
            i += 2
            continue
        if nxt == "{":
            depth, j = 1, i + 2
            while j < n and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            if depth:
                raise DeployFileError(f"invalid interpolation format: {text[i:]!r} (no closing brace)", where=where)
            body = text[i + 2:j - 1]
            m = _BRACED.match(body)
            if not m:
                raise DeployFileError(f"invalid interpolation format: ${{{body}}}", where=where)
            name, op, arg = m.group(1), m.group(2), m.group(3) or ""
            val = env.get(name)
            if op in (":-", "-"):
                use_default = (not val) if op == ":-" else val is None
                out.append(interpolate(arg, env, where=where, unset=unset) if use_default else val)
            elif op in (":?", "?"):
                if (not val) if op == ":?" else val is None:
                    raise DeployFileError(f"required variable {name} is missing a value: {arg}", where=where)
                out.append(val)
            elif op in (":+", "+"):
                present = bool(val) if op == ":+" else val is not None
                out.append(interpolate(arg, env, where=where, unset=unset) if present else "")
            else:
                if val is None and unset is not None:
                    unset.append(name)
                out.append(val or "")
            i = j
            continue
        m = _NAME.match(text, i + 1)
        if m:
            val = env.get(m.group(0))
            if val is None and unset is not None:
                unset.append(m.group(0))
            out.append(val or "")
            i = m.end()
            continue
        out.append("$")
        i += 1
    return "".join(out)


def _walk(value: Any, env: Mapping[str, str], where: str, unset: list[str]) -> Any:
    if isinstance(value, str):
        return interpolate(value, env, where=where, unset=unset)
    if isinstance(value, list):
        return [_walk(v, env, where, unset) for v in value]
    if isinstance(value, dict):
        return {k: _walk(v, env, where, unset) for k, v in value.items()}
    return value


def dotenv(path: str) -> dict[str, str]:
    """A ``.env`` file as python-dotenv reads it (``dotenv_values``); {} when there is none."""
    if not os.path.isfile(path):
        return {}
    from dotenv import dotenv_values

    return {k: v for k, v in dotenv_values(path).items() if v is not None}


def _environment(value: Any, environ: Mapping[str, str]) -> dict[str, str]:
    """A service's ``environment`` (a list of ``K=V`` or a mapping; a bare key takes the shell's)."""
    out: dict[str, str] = {}
    if isinstance(value, Mapping):
        items = list(value.items())
    else:
        items = [(str(e).split("=", 1)[0], str(e).split("=", 1)[1] if "=" in str(e) else None) for e in value or []]
    for k, v in items:
        if v is None:
            if k in environ:
                out[str(k)] = environ[k]
            continue
        out[str(k)] = str(v).lower() if isinstance(v, bool) else str(v)
    return out


def _gpus(service: Mapping[str, Any]) -> int | None:
    devs = (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    total, said = 0, False
    for d in devs:
        if not isinstance(d, Mapping) or "gpu" not in [str(c) for c in d.get("capabilities") or []]:
            continue
        if d.get("device_ids"):
            total += len(d["device_ids"])
            said = True
        elif isinstance(d.get("count"), int) or str(d.get("count") or "").isdigit():
            total += int(d["count"])
            said = True
    return total if said else None


def workloads(doc: Mapping[str, Any], file: str, *, environ: Mapping[str, str] | None = None) -> list[Workload]:
    """Every service of a compose file that runs vLLM, with the file interpolated first."""
    environ = dict(os.environ if environ is None else environ)
    env_path = os.path.join(os.path.dirname(os.path.abspath(file)), ".env")
    values = {**dotenv(env_path), **environ}
    unset: list[str] = []
    doc = _walk(doc, values, file, unset)
    out: list[Workload] = []
    for name, svc in (doc.get("services") or {}).items():
        if not isinstance(svc, Mapping):
            continue
        env: dict[str, str] = {}
        for ef in ([svc["env_file"]] if isinstance(svc.get("env_file"), str) else svc.get("env_file") or []):
            ef_path = ef.get("path") if isinstance(ef, Mapping) else ef
            env.update(dotenv(os.path.join(os.path.dirname(os.path.abspath(file)), str(ef_path))))
        env.update(_environment(svc.get("environment"), environ))
        command, entrypoint = svc.get("command"), svc.get("entrypoint")
        command = split_words(command) if isinstance(command, str) else [str(x) for x in command or []]
        entrypoint = split_words(entrypoint) if isinstance(entrypoint, str) else [str(x) for x in entrypoint or []]
        argv, notes = vllm_argv(entrypoint, command, image=svc.get("image"), env=env)
        if argv is None:
            continue
        if os.path.isfile(env_path):
            notes.insert(0, f"interpolated with {env_path} (python-dotenv) under the environment")
        for var in sorted(set(unset)):
            notes.append(f"${{{var}}} is not set (environment or .env): compose uses an empty string")
        field = "command" if svc.get("command") else "entrypoint"
        out.append(Workload(file=file, path=f"services.{name}.{field}", argv=argv, kind="compose service", env=env,
                            gpus=_gpus(svc), notes=notes, format="compose",
                            image=str(svc["image"]) if svc.get("image") else None))
    return out

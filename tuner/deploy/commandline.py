"""A container's command line → the ``vllm serve`` arguments it runs (shared by every format).

- Kubernetes ``$(VAR)`` expansion in ``command``/``args`` and in later ``env`` values
  (``$$(VAR)`` is a literal ``$(VAR)``; an undefined variable is left as written), as the kubelet
  does (``k8s.io/kubernetes/third_party/forked/golang/expansion``).
- The image's entrypoint when ``command`` is not given: the vLLM images (``vllm/vllm-openai``,
  ``vllm-cpu``, llm-d's and KServe's vLLM images) run ``vllm serve`` (their Dockerfile's
  ``ENTRYPOINT ["vllm", "serve"]``), so ``args`` are what follows it.
- A shell (``sh -c`` / ``bash -c`` script): ``$VAR`` / ``${VAR}`` / ``${VAR:-default}`` expanded from
  the container's environment, then the words of the ``vllm serve`` command up to the next shell
  operator (``&&``, ``;``, ``|``, a newline), with ``exec`` dropped.
"""

from __future__ import annotations

import re
import shlex
from typing import Mapping, Sequence

_K8S_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_SHELL_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-=+?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_SHELLS = ("sh", "bash", "dash", "ash", "zsh")
_API_SERVER = "vllm.entrypoints.openai.api_server"
#: Image names whose entrypoint is ``vllm serve``.
_VLLM_IMAGE = re.compile(r"(^|/)(vllm-openai|vllm-cpu|vllm-cpu-release-repo|vllm|llm-d|llm-d-cuda|vllm-tpu|"
                         r"vllm-openai-rocm)(:|@|$)")


def k8s_expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (``$$`` → ``$``; undefined references stay as written)."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)
    return _K8S_VAR.sub(sub, text)


def k8s_env(entries: Sequence[Mapping] | None, where: str) -> tuple[dict[str, str], list[str]]:
    """A container's ``env`` list → ``{name: value}`` (``$(VAR)`` of earlier entries expanded), and
    notes on entries whose value comes from elsewhere (``valueFrom``: a Secret, a ConfigMap, the
    downward API), which cannot be read from the file."""
    env: dict[str, str] = {}
    notes: list[str] = []
    for e in entries or []:
        if not isinstance(e, Mapping) or "name" not in e:
            continue
        name = str(e["name"])
        if "value" in e:
            env[name] = k8s_expand(str(e["value"] if e["value"] is not None else ""), env)
        elif "valueFrom" in e:
            notes.append(f"{where}: env {name} comes from valueFrom (not in the file): $({name}) stays unexpanded")
    return env, notes


def shell_expand(text: str, env: Mapping[str, str], notes: list[str] | None = None) -> str:
    """POSIX-shell parameter expansion of ``$VAR``, ``${VAR}``, ``${VAR:-d}``, ``${VAR-d}``,
    ``${VAR:+a}``, ``${VAR+a}`` from ``env`` (an unset variable is empty, as in the shell)."""
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        val = env.get(name)
        if op in (":-", ":="):
            return val if val else arg
        if op in ("-", "="):
            return val if val is not None else arg
        if op == ":+":
            return arg if val else ""
        if op == "+":
            return arg if val is not None else ""
        if val is None and notes is not None:
            notes.append(f"${name} is not set in the container's environment: expanded to nothing")
        return val or ""
    return _SHELL_VAR.sub(sub, text)


def is_vllm_image(image: str | None) -> bool:
    return bool(image) and bool(_VLLM_IMAGE.search(str(image).split("@")[0].lower()))


def _serve_words(words: Sequence[str]) -> list[str] | None:
    """The ``vllm serve …`` / ``python -m vllm.entrypoints.openai.api_server …`` part of a word list."""
    for i, w in enumerate(words):
        base = w.rsplit("/", 1)[-1]
        if base == "vllm" and i + 1 < len(words) and words[i + 1] == "serve":
            return ["vllm", "serve", *words[i + 2:]]
        if w == _API_SERVER and i >= 2 and words[i - 1] == "-m" and words[i - 2].rsplit("/", 1)[-1].startswith("python"):
            return ["python", "-m", _API_SERVER, *words[i + 1:]]
    return None


def _script_command(script: str, env: Mapping[str, str], notes: list[str]) -> list[str] | None:
    """The ``vllm serve`` command of a shell script (expanded, up to the next operator)."""
    expanded = shell_expand(script, env, notes)
    lex = shlex.shlex(expanded, posix=True, punctuation_chars=";&|\n")
    lex.whitespace = " \t\r"
    lex.whitespace_split = True
    try:
        words = list(lex)
    except ValueError as exc:
        notes.append(f"the shell script could not be split: {exc}")
        return None
    commands: list[list[str]] = [[]]
    for w in words:
        if w and set(w) <= set(";&|\n"):
            commands.append([])
        elif w == "\\":
            continue
        else:
            commands[-1].append(w)
    for cmd in commands:
        while cmd and cmd[0] in ("exec", "nohup", "time"):
            cmd = cmd[1:]
        found = _serve_words(cmd)
        if found is not None:
            return found
    return None


def vllm_argv(command: Sequence[str] | None, args: Sequence[str] | None, *, image: str | None,
              env: Mapping[str, str]) -> tuple[list[str] | None, list[str]]:
    """The vLLM argument list a container runs (program words included), or None when it does not
    run vLLM; and notes on how it was read. ``command``/``args`` are already ``$(VAR)``-expanded."""
    notes: list[str] = []
    command = [str(c) for c in (command or [])]
    args = [str(a) for a in (args or [])]
    if not command:
        if is_vllm_image(image):
            notes.append(f"the image {image}'s entrypoint `vllm serve` runs the given arguments (no command or entrypoint given)")
            if args[:2] == ["vllm", "serve"]:
                return args, notes
            return ["vllm", "serve", *args], notes
        command, args = args, []
        if not command:
            return None, notes
    words = command + args
    exe = words[0].rsplit("/", 1)[-1]
    if exe in _SHELLS and "-c" in words[1:3]:
        i = words.index("-c")
        script = " ".join(words[i + 1:i + 2]) if i + 1 < len(words) else ""
        found = _script_command(script, env, notes)
        if found is not None:
            notes.append(f"read from the `{exe} -c` script: {shlex.join(found)}")
        return found, notes
    found = _serve_words(words)
    return found, notes


def split_words(text: str) -> list[str]:
    """A command given as one string (compose ``command: "…"``, ``VLLM_ADDITIONAL_ARGS``), split
    as a shell would (quotes honoured, no expansion)."""
    return shlex.split(text)

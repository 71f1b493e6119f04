"""A :class:`tuner.memory.serve_args.ServeParser` backed by the installed vLLM's own ``vllm serve`` parser.

vLLM is never imported here: :mod:`tuner.engine.parse_main` runs in the worker Python (the engine
adapter's interpreter: ``--worker-python``, ``CTX_TUNER_WORKER_PYTHON``, the ``engine_pythons`` /
``worker_python`` settings) and prints what vLLM's ``FlexibleArgumentParser`` + the serve
subcommand's parser made of the line (its ``--config`` YAML handling, ``-tp``/``-O3`` forms, every
``type=``/``choices=`` check and ``validate_parsed_serve_args``). This module turns that into the
same :class:`~tuner.memory.serve_args.ServeArgs` the built-in parser gives: settings ctx-tuner models as
typed values, flags it lists as ignored or not modelled by the built-in table, every other flag
vLLM accepted reported as ignored and named; what vLLM refuses raises
:class:`~tuner.memory.serve_args.ServeArgsError` with vLLM's own message.

:class:`AutoServeParser` uses it when vLLM is importable in that interpreter and falls back to the
built-in parser otherwise, saying so in the result (``parser``, ``parser_info``, ``notes``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable, Sequence

from tuner.errors import TunerError
from tuner.memory.serve_args import (BUILTIN, IGNORED, MODELLED, UNMODELLED, ServeArgs, ServeArgsError, flag_for)

#: The script run in the worker Python (a file path: it imports nothing from ctx-tuner, so it runs
#: in a vLLM venv without ctx-tuner installed).
PARSE_MAIN = str(Path(__file__).with_name("parse_main.py"))
EXIT_REFUSED, EXIT_UNAVAILABLE = 2, 3


class VllmParserUnavailable(TunerError):
    """No vLLM importable in the interpreter (``where``), or its parser could not be run."""


def _dashed(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _norm(token: str) -> str:
    """A command-line token's option name as vLLM reads it: underscores → dashes up to the first
    ``.`` or ``=``; ``-O3`` → ``--optimization-level``."""
    if token.startswith("--"):
        name = token.partition("=")[0]
        head, dot, tail = name[2:].partition(".")
        return "--" + head.replace("_", "-") + dot + tail
    if token.startswith("-O"):
        return "--optimization-level"
    return token.partition("=")[0]


def _spelling(argv: Sequence[str], options: Sequence[str], *, bare: bool = False) -> str | None:
    """How the command line wrote an option (the last occurrence wins, as in argparse)."""
    opts = set(options) | {"--no-" + o[2:] for o in options if o.startswith("--")}
    found = None
    for i, tok in enumerate(argv):
        if tok.startswith("-") and _norm(tok) in opts:
            j = i + 1
            if not bare and "=" not in tok and not (tok.startswith("-O") and len(tok) > 2):
                while j < len(argv) and not (argv[j].startswith("-") and not argv[j].lstrip("-").replace(".", "")
                                             .isdigit()):
                    j += 1
            found = " ".join(argv[i:j])
    return found


def _config_of(argv: Sequence[str], config_file: str | None) -> str | None:
    if config_file:
        return config_file
    args = list(argv)
    if "--config" in args and args.index("--config") + 1 < len(args):
        return args[args.index("--config") + 1]
    return None


def to_serve_args(res: dict, argv: Sequence[str], config_file: str | None, *, python: str) -> ServeArgs:
    """vllm_parse_main's result for ``argv`` → :class:`ServeArgs` (the built-in parser's shape)."""
    version = res.get("vllm_version") or "?"
    cfg = _config_of(argv, config_file)
    out = ServeArgs(parser=f"vllm {version}", config_file=cfg)
    out.parser_info = {"name": "vllm", "vllm_version": version, "python": python,
                       "import_s": None if res.get("cached") else res.get("import_s"),
                       "parse_s": None if res.get("cached") else res.get("parse_s"),
                       **({"cached": str(cache_dir())} if res.get("cached") else {})}
    explicit: dict[str, Any] = dict(res.get("explicit") or {})
    options: dict[str, list] = dict(res.get("options") or {})
    out.model = res.get("model")
    if not res.get("model_given"):
        out.notes.append(f"no model given: vLLM {version} serves its default model {out.model!r}")
    for dest, value in explicit.items():
        if dest == "model":
            continue
        written = _spelling(argv, options.get(dest) or [_dashed(dest)], bare=isinstance(value, bool))
        if written is None:
            shown = value if not isinstance(value, (dict, list)) else json.dumps(value)
            written = f"{dest.replace('_', '-')}: {shown} (from {cfg})" if cfg else f"{_dashed(dest)} {shown}"
        src = "command line" if cfg is None or not written.endswith(f"(from {cfg})") else cfg
        flag = flag_for(dest)
        if flag is not None and flag.role == MODELLED:
            out.values[dest] = value
            out.spelled[dest] = written
            continue
        if flag is None:
            note = (f"a vLLM {version} option ctx-tuner does not model: vLLM accepts it; checked as if it had no "
                    "effect on start-up memory")
            role = IGNORED
        else:
            note, role = flag.note, flag.role
        entry = {"flag": (options.get(dest) or [_dashed(dest)])[0] if not (value is False and flag and flag.kind == "bool")
                 else "--no-" + flag.options[0][2:],
                 "value": None if isinstance(value, bool) else value, "source": src, "as_written": written,
                 "note": note}
        (out.unmodelled if role == UNMODELLED else out.ignored).append(entry)
    out.notes += list(res.get("config_notes") or [])
    return out


class VllmServeParser:
    """:class:`ServeParser` that runs vLLM's own parser in ``python`` (a subprocess per call, or one
    for many lines with :meth:`parse_many`). ``run``: :func:`subprocess.run` (injectable)."""

    def __init__(self, python: str, *, timeout_s: float = 300.0, run: Callable[..., Any] = subprocess.run,
                 env: dict | None = None) -> None:
        self.python = python
        self.timeout_s = timeout_s
        self._run = run
        self._env = env
        self.name = "vllm"

    def _argv(self, argv: Sequence[str], config_file: str | None) -> list[str]:
        return ["serve", *argv, *(["--config", config_file] if config_file else [])]

    def _call(self, args: list[str], stdin: str | None = None) -> tuple[int, Any]:
        env = {**(self._env if self._env is not None else os.environ), "VLLM_LOGGING_LEVEL": "ERROR"}
        try:
            r = self._run([self.python, PARSE_MAIN, *args], input=stdin, capture_output=True, text=True,
                          timeout=self.timeout_s, env=env)
        except FileNotFoundError:
            raise VllmParserUnavailable("not an executable Python", where=self.python) from None
        except subprocess.TimeoutExpired:
            raise VllmParserUnavailable(f"vLLM's parser did not answer within {self.timeout_s:g} s",
                                        where=self.python) from None
        lines = (r.stdout or "").strip().splitlines()
        try:
            doc = json.loads(lines[-1]) if lines else None
        except ValueError:
            doc = None
        if doc is None:
            tail = (r.stderr or "").strip().splitlines()[-1:] or ["no output"]
            raise VllmParserUnavailable(f"vLLM's parser gave no answer (exit {r.returncode}): {tail[0]}",
                                        where=self.python)
        if r.returncode == EXIT_UNAVAILABLE or (isinstance(doc, dict) and "unavailable" in doc):
            raise VllmParserUnavailable(str(doc.get("unavailable") if isinstance(doc, dict) else doc),
                                        where=self.python)
        return r.returncode, doc

    def _result(self, res: dict, argv: Sequence[str], config_file: str | None) -> ServeArgs:
        if "error" in res:
            msg = "; ".join(res["error"]) if isinstance(res["error"], list) else str(res["error"])
            raise ServeArgsError(msg, where=f"vLLM {res.get('vllm_version') or ''} parser".replace("  ", " "))
        self.name = f"vllm {res.get('vllm_version')}"
        return to_serve_args(res, argv, config_file, python=self.python)

    def parse(self, argv: Sequence[str], config_file: str | None = None) -> ServeArgs:
        # the cache only behind the real subprocess (an injected ``run`` is a test's stand-in)
        key = parse_cache_key(self.python, argv, config_file, self._env) if self._run is subprocess.run else None
        res = read_cached_parse(key) if key else None
        if res is None:
            _, res = self._call(self._argv(argv, config_file))
            if key:
                write_cached_parse(key, res)
        return self._result(res, argv, config_file)

    def parse_many(self, items: Sequence[tuple[Sequence[str], str | None]]) -> list[ServeArgs | ServeArgsError]:
        """Many ``(argv, config_file)`` in one subprocess (one vLLM import); a refusal is returned
        as its :class:`ServeArgsError`, in order."""
        _, docs = self._call(["--batch"], stdin=json.dumps([self._argv(a, c) for a, c in items]))
        out: list[ServeArgs | ServeArgsError] = []
        for (argv, cfg), res in zip(items, docs):
            try:
                out.append(self._result(res, argv, cfg))
            except ServeArgsError as exc:
                out.append(exc)
        return out


#: Where vLLM's parser answers are kept (:func:`parse_cache_key`): ``$CTX_TUNER_CACHE_DIR``, else
#: ``$XDG_CACHE_HOME/ctx-tuner``, else ``~/.cache/ctx-tuner``; subdirectory ``vllm-parse``.
CACHE_ENV = "CTX_TUNER_CACHE_DIR"


def cache_dir() -> Path:
    """The directory of the parse cache (see :data:`CACHE_ENV`)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                     "ctx-tuner")
    return Path(root) / "vllm-parse"


def parse_cache_key(python: str, argv: Sequence[str], config_file: str | None, env: dict | None = None) -> str | None:
    """The key of vLLM's parser's answer to a line (issue 34: a repeated ``check`` on a host with vLLM
    does not import it again): the tokens, the ``--config`` YAML's bytes, the ``VLLM_*`` environment
    and the vLLM build (:func:`tuner.releases.installed.vllm_build`: version, location and modification time
    of its ``__init__.py``). Only where ``python`` is this interpreter (another one's build is not
    known without running it) and a build is found; else None (no cache)."""
    import sys

    if os.path.abspath(python) != os.path.abspath(sys.executable) or os.environ.get(CACHE_ENV) == "off":
        return None
    import hashlib

    from tuner.releases.installed import vllm_build

    build = vllm_build()
    if build is None:
        return None
    cfg = _config_of(argv, config_file)
    try:
        cfg_bytes = Path(cfg).read_bytes().hex() if cfg else None
    except OSError:
        return None  # vLLM's parser names the unreadable file
    source = env if env is not None else os.environ
    key = {"v": 1, "argv": list(argv), "config_file": config_file, "config": cfg_bytes, "build": build,
           "cwd": os.getcwd() if cfg else None, "env": {k: v for k, v in source.items() if k.startswith("VLLM_")}}
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def read_cached_parse(key: str) -> dict | None:
    """The stored answer for ``key`` (marked ``cached``), or None."""
    try:
        res = json.loads((cache_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(res, dict):
        return None
    return {**res, "cached": True}


def write_cached_parse(key: str, res: Any) -> None:
    """Keep vLLM's answer (written whole or not at all; a failure only loses the optimisation)."""
    if not isinstance(res, dict):
        return
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(res))
        os.replace(tmp, d / f"{key}.json")
    except OSError:
        pass


class AutoServeParser:
    """vLLM's own parser when vLLM is importable in ``python``, else the built-in one; the result
    says which (``parser``, ``parser_info``, and a note with why the built-in one was used)."""

    def __init__(self, python: str, **kw: Any) -> None:
        self.vllm = VllmServeParser(python, **kw)
        self.name = "auto"

    def parse(self, argv: Sequence[str], config_file: str | None = None) -> ServeArgs:
        try:
            sa = self.vllm.parse(argv, config_file)
        except VllmParserUnavailable as exc:
            sa = BUILTIN.parse(argv, config_file)
            sa.parser_info = {"name": "built-in", "fallback_reason": str(exc), "python": self.vllm.python}
            self.name = BUILTIN.name
            return sa
        self.name = self.vllm.name
        return sa


def make_parser(mode: str, python: str | None) -> Any:
    """``--parser``: ``auto`` (vLLM's when importable in the worker Python, else built-in),
    ``vllm`` (vLLM's or an error), ``built-in``."""
    from tuner.seam.worker import worker_python

    if mode == "built-in":
        return BUILTIN
    py = worker_python(python)
    if mode == "vllm":
        return VllmServeParser(py)
    if mode == "auto":
        return AutoServeParser(py)
    raise ValueError(f"unknown parser {mode!r}")



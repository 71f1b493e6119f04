"""Parse a ``vllm serve`` invocation with the installed vLLM's own parser; print JSON.

Run with the interpreter that has vLLM (a worker or engine venv), never imported by the CLI or the
daemon (no vLLM in the parent): ``PYTHON tuner/engine/parse_main.py serve [MODEL] [--config FILE] …``.
It imports nothing from ctx-tuner, so it runs in a vLLM venv without ctx-tuner installed.

The parser is the one ``vllm serve`` builds (``vllm/entrypoints/cli/main.py``): a top-level
``FlexibleArgumentParser`` with the serve subcommand's parser (``ServeSubcommand.subparser_init`` →
``make_arg_parser``: the frontend's options and ``AsyncEngineArgs.add_cli_args``), so the
``--config`` YAML handling, ``--model`` moving, underscore/dash spelling, ``-tp``/``-O3`` forms and
every ``type=`` / ``choices=`` check are that release's own; then ``ServeSubcommand.validate``
(``validate_parsed_serve_args``) as ``vllm serve`` runs it before loading anything.

Output (one JSON object, exit 0): the destinations ctx-tuner models at top level (``model``
resolved from ``model_tag`` as ``vllm serve`` does), ``explicit`` (every destination the line or
the config file set, by a second parse with unset defaults), ``options`` (each explicit
destination's option strings), ``config_notes`` (config keys vLLM drops), ``vllm_version``,
``import_s`` / ``parse_s`` (seconds). What vLLM refuses: ``{"error": [message], "error_type": …}``
with exit 2. No vLLM importable here: ``{"unavailable": why}`` with exit 3.
``--batch``: a JSON list of argument lists on stdin (each starting with ``serve``), a JSON list of
results on stdout (one import for many lines); exit 0 unless vLLM is unavailable.
"""

import contextlib
import io
import json
import sys
import time

DESTS = ("model", "max_model_len", "gpu_memory_utilization", "kv_cache_memory_bytes", "tensor_parallel_size",
         "pipeline_parallel_size", "data_parallel_size", "dtype", "kv_cache_dtype", "quantization", "max_num_seqs",
         "max_num_batched_tokens", "block_size", "enable_chunked_prefill", "enforce_eager")

#: Destinations that are argparse's or the CLI's plumbing, not settings.
_PLUMBING = ("help", "subparser", "dispatch_function", "config", "model_tag")

EXIT_OK, EXIT_REFUSED, EXIT_UNAVAILABLE = 0, 2, 3


class _Unset:
    def __repr__(self):
        return "<unset>"


_UNSET = _Unset()


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, dict):
            return {str(k): _jsonable(v) for k, v in value.items()}
        if isinstance(value, (list, tuple, set)):
            return [_jsonable(v) for v in value]
        return str(value)


def _build():
    """vLLM's own ``vllm serve`` parser: (top-level parser, serve subparser, the subcommand)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    cmd = ServeSubcommand()
    serve = cmd.subparser_init(parser.add_subparsers(dest="subparser"))
    return parser, serve, cmd


def _error_text(stderr: str) -> str:
    """argparse's ``usage: … \\n vllm serve: error: MESSAGE`` → MESSAGE."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ": error: " in ln:
            return ln.split(": error: ", 1)[1].strip()
    return lines[-1].strip() if lines else "rejected"


def _config_notes(parser, argv):
    """Config keys ``load_config_file`` drops: ``key: false`` where the top-level parser has no
    ``--no-key`` (it never has: the serve options live on the subparser)."""
    if "--config" not in argv:
        return []
    i = argv.index("--config")
    if i + 1 >= len(argv):
        return []
    path = argv[i + 1]
    try:
        import yaml

        with open(path) as fh:
            data = yaml.safe_load(fh)
    except Exception:  # noqa: BLE001 - the parse itself reports an unreadable file
        return []
    if not isinstance(data, dict):
        return []
    return [f"{path}: `{k}: false` is dropped by vLLM's load_config_file (no --no-{k} among the top-level "
            f"parser's options); write `no-{str(k).replace('_', '-')}: true` to turn it off"
            for k, v in data.items() if v is False and f"--no-{k}" not in parser._option_string_actions]


def parse_one(argv):
    """One ``serve …`` argument list → (exit code, result dict)."""
    t0 = time.perf_counter()
    parser, serve, cmd = _build()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = parser.parse_args(list(argv))
            if getattr(ns, "subparser", None) == "serve":
                cmd.validate(ns)
    except SystemExit as exc:
        if exc.code in (0, None):
            return EXIT_REFUSED, {"error": ["vLLM's parser exited (help or version asked)"], "error_type": "SystemExit"}
        return EXIT_REFUSED, {"error": [_error_text(err.getvalue())], "error_type": "ArgumentError"}
    except Exception as exc:  # noqa: BLE001 - whatever vLLM raises is its refusal, reported as such
        return EXIT_REFUSED, {"error": [str(exc) or type(exc).__name__], "error_type": type(exc).__name__}
    # the same line again with every default unset: what is set now was given (line or config file).
    # Actions that build on their default (append, count, extend) keep it: set = differs from it.
    import argparse

    parser2, serve2, _ = _build()
    accumulating = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction,
                    getattr(argparse, "_ExtendAction", argparse._AppendAction))
    kept = {a.dest: a.default for a in serve2._actions if isinstance(a, accumulating)}
    serve2.set_defaults(**{a.dest: _UNSET for a in serve2._actions if a.dest not in ("help",) and a.dest not in kept})
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            ns2 = parser2.parse_args(list(argv))
    except (Exception, SystemExit):  # noqa: BLE001 - a custom action that needs its default: compare instead
        defaults = {a.dest: a.default for a in serve._actions}
        ns2 = argparse.Namespace(**{k: (v if k not in defaults or v != defaults[k] else _UNSET)
                                    for k, v in vars(ns).items()})
        kept = {}
    explicit = {k: _jsonable(v) for k, v in vars(ns2).items()
                if v is not _UNSET and k not in _PLUMBING and not (k in kept and v == kept[k])}
    options = {a.dest: list(a.option_strings) for a in serve2._actions if a.dest in explicit}
    out = {k: _jsonable(getattr(ns, k, None)) for k in DESTS}
    if getattr(ns, "model_tag", None):
        out["model"] = ns.model_tag
    explicit_model = getattr(ns2, "model_tag", _UNSET)
    if explicit_model is _UNSET or explicit_model is None:
        explicit_model = explicit.get("model")
    notes = _config_notes(parser, list(argv))
    if getattr(ns2, "config", _UNSET) not in (_UNSET, None):
        notes.append(f"--config={ns2.config}: vLLM reads a config file only as `--config FILE` (two words); this "
                     "spelling is stored and the file is NOT read")
    out.update(explicit=explicit, options=options, model_given=explicit_model is not None,
               config_notes=notes, parse_s=round(time.perf_counter() - t0, 4))
    return EXIT_OK, out


def main(argv):
    import importlib.util

    t0 = time.perf_counter()
    try:
        if importlib.util.find_spec("vllm") is None:
            print(json.dumps({"unavailable": "no vllm package importable"}))
            return EXIT_UNAVAILABLE
        with contextlib.redirect_stdout(sys.stderr):
            import vllm  # noqa: F401 - its version, and the import cost measured once
            from vllm.entrypoints.cli.serve import ServeSubcommand  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken install: the caller falls back and says why
        print(json.dumps({"unavailable": f"import vllm failed: {type(exc).__name__}: {exc}"}))
        return EXIT_UNAVAILABLE
    import_s = round(time.perf_counter() - t0, 3)
    version = getattr(vllm, "__version__", None)
    if argv[:1] == ["--batch"]:
        results = []
        for item in json.load(sys.stdin):
            rc, res = parse_one(item)
            results.append({**res, "exit_code": rc, "vllm_version": version, "import_s": import_s})
        print(json.dumps(results, default=str))
        return EXIT_OK
    rc, res = parse_one(argv)
    print(json.dumps({**res, "vllm_version": version, "import_s": import_s}, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

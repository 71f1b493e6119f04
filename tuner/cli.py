"""Command line entry point: ``ctx-tuner <command> ...``.

Each sub-command lives in its own module under :mod:`tuner.commands` (``NAME``, ``add_parser``,
``run``); this module only lists them and dispatches. Exit codes shared by every command:
``0`` success; ``1`` the job or command failed (worker crash or timeout, database); ``2`` usage
error or invalid input (bad option, invalid drop or model config; the message names the file and
the field);
``130`` interrupted (SIGINT, Ctrl-C) and ``143`` terminated (SIGTERM), after killing any running
worker's process group (one line on stderr, no traceback). A closed stdout (``ctx-tuner results
--json | head``) ends quietly with ``0``: the reader stopped reading on purpose.
Never imports torch (profile passes run in worker subprocesses).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import signal
import sys
import threading
from typing import Callable

from tuner import __version__

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 128 + signal.SIGTERM

#: ``--log-level`` choices (case-insensitive).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class Terminated(SystemExit):
    """Raised in the main thread by the SIGTERM handler; unwinds like ``SystemExit`` (a running
    worker's process group is killed by :func:`tuner.seam.worker.run_in_worker` on the way)."""

    def __init__(self) -> None:
        super().__init__(EXIT_TERMINATED)


def _kill_workers() -> None:
    """Kill every worker group now (also those waited for in other threads: ``explain`` and
    ``plot`` run jobs in a thread pool, whose shutdown would otherwise wait for them)."""
    worker = sys.modules.get("tuner.seam.worker")
    if worker is not None:
        worker.kill_running_workers()


def _on_sigterm(_signum, _frame) -> None:
    _kill_workers()
    raise Terminated()


def _on_sigint(_signum, _frame) -> None:
    _kill_workers()
    raise KeyboardInterrupt


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(LOG_LEVELS)})")
    return level

#: Sub-command modules, in ``--help`` order.
COMMANDS: tuple[str, ...] = (
    "tuner.commands.profile",
    "tuner.commands.check",
    "tuner.commands.explain",
    "tuner.commands.results",
    "tuner.commands.plot",
    "tuner.commands.daemon",
    "tuner.commands.retry",
    "tuner.commands.status",
    "tuner.commands.validate",
    "tuner.commands.import_log",
    "tuner.commands.devices",
    "tuner.commands.selftest",
)


def _modules(only: str | None = None):
    return [importlib.import_module(name) for name in COMMANDS if only is None or name == only]


def _command_module(argv: list[str]) -> str | None:
    """The module of the sub-command ``argv`` names (the first word after the global options),
    or None (no command, ``--help``, a typo: then every command's parser is built, so help and
    errors list them all). Building only the one parser keeps a cold ``ctx-tuner profile`` from
    importing every other command's modules."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--log-level":
            i += 2
            continue
        if a.startswith("--log-level="):
            i += 1
            continue
        if a.startswith("-"):
            return None
        name = "tuner.commands." + a.replace("-", "_")
        return name if name in COMMANDS else None
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``argv``, only the parser of the command it names (see
    :func:`_command_module`)."""
    p = argparse.ArgumentParser(prog="ctx-tuner", description="Predict the largest vLLM max_model_len that fits.")
    p.add_argument("--version", action="version", version=f"ctx-tuner {__version__}")
    p.add_argument("--log-level", type=_log_level, default="WARNING", metavar="LEVEL",
                   help=f"logging level: {', '.join(LOG_LEVELS)} (case-insensitive; default WARNING)")
    # every command in the usage line, also when only one command's parser is built
    sub = p.add_subparsers(dest="command", required=True, metavar="{%s}" % ",".join(
        name.rsplit(".", 1)[1].replace("_", "-") for name in COMMANDS))
    for mod in _modules(_command_module(argv) if argv is not None else None):
        mod.add_parser(sub).set_defaults(_run=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # bare ``ctx-tuner``: the help with every command, not argparse's "required" error
        build_parser().print_help()
        return EXIT_USAGE
    parser = build_parser(argv)
    args, extras = parser.parse_known_args(argv)
    if extras:  # the command's usage, not the top-level one, and a close spelling when there is one
        _unrecognized(parser, args, extras)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    in_main_thread = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _on_sigterm) if in_main_thread else None
    # SIGINT: only where Python's own Ctrl-C handler is in place (an ignored SIGINT stays ignored)
    old_int = signal.signal(signal.SIGINT, _on_sigint) \
        if in_main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler else None
    try:
        code = int(args._run(args))
        if sys.stdout is not None:  # None: started with stdout closed (``>&-``); print() wrote nothing
            sys.stdout.flush()  # a closed pipe shows here, not as "Exception ignored" at exit
        return code
    except KeyboardInterrupt:
        print("ctx-tuner: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("ctx-tuner: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED
    except BrokenPipeError:
        # the reader of stdout went away (``| head``): no traceback, and no second error when
        # Python flushes stdout at exit
        _drop_stdout()
        return EXIT_OK
    except OSError as exc:
        if exc.errno not in _OUTPUT_ERRNOS:
            raise
        # the output could not be written (``> /dev/full``, a full disk, a closed descriptor)
        _drop_stdout()
        if sys.stderr is not None:
            print(f"ctx-tuner: cannot write the output: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, old_term if old_term is not None else signal.SIG_DFL)
            if old_int is not None:
                signal.signal(signal.SIGINT, old_int)


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """Exit 2 for arguments the command does not know, with that command's usage (``ctx-tuner check
    --max-modle-len …`` printed the top-level usage) and "did you mean" for a misspelled option."""
    import difflib

    sub = next((a.choices.get(args.command) for a in parser._actions if isinstance(a, argparse._SubParsersAction)),
               None) or parser
    options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    vllm_options: list[str] = []
    if args.command == "check":  # a vLLM flag before `--` belongs to the serve line after it
        from tuner.memory.serve_args import _BY_OPTION

        vllm_options = [o for o in _BY_OPTION if o.startswith("--")]
    hints = []
    for x in extras:
        if x.startswith("--"):
            name = x.split("=", 1)[0]
            close = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
            if close:
                hints.append(close[0])
                continue
            close = difflib.get_close_matches(name, vllm_options, n=1, cutoff=0.75)
            if close:
                hints.append(f"{close[0]} in the vllm serve line after `--`")
    sub.error(f"unrecognized arguments: {' '.join(extras)}" + (f" (did you mean {', '.join(hints)}?)" if hints else ""))


#: ``OSError`` numbers that mean the output could not be written (no space, I/O error, a bad or
#: closed descriptor, quota): reported in one line, exit 1, instead of a traceback.
_OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EBADF, errno.EDQUOT})


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so what is still buffered for it is not written (and fails
    again) at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def run(argv: list[str] | None = None, *, exit_: Callable[[int], None] = os._exit) -> None:
    """The ``ctx-tuner`` console script: :func:`main`, then the end of the process without the
    interpreter's teardown — finalizing SQLAlchemy's, Alembic's and our ~500 modules costs a cold
    CLI about 0.1 s after its answer is printed. Everything is done by then: the store closed,
    workers reaped, files written and closed; stdout and stderr are flushed and logging shut down
    first (a reader gone from stdout is ignored, as :func:`main` does). ``exit_`` is injectable
    for tests."""
    code = main(argv)
    logging.shutdown()
    from tuner.seam.worker_guard import end_now

    end_now(code, exit_=exit_)


if __name__ == "__main__":  # pragma: no cover
    run()

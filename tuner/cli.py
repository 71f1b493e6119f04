"""Command line entry point: ``ctx-tuner <command> ...``.

Each sub-command lives in its own module under :mod:`tuner.commands` (``NAME``, ``add_parser``,
``run``); this module only lists them and dispatches. Exit codes shared by every command:
``0`` success; ``1`` the job or command failed (bad model config, worker crash or timeout,
database); ``2`` usage error or invalid input (the message names the file and the field).
Never imports torch (profile passes run in worker subprocesses).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from tuner import __version__

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

#: Sub-command modules, in ``--help`` order.
COMMANDS: tuple[str, ...] = (
    "tuner.commands.profile",
    "tuner.commands.explain",
    "tuner.commands.results",
    "tuner.commands.plot",
    "tuner.commands.daemon",
    "tuner.commands.validate",
    "tuner.commands.import_log",
    "tuner.commands.devices",
    "tuner.commands.selftest",
)


def _modules():
    return [importlib.import_module(name) for name in COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ctx-tuner", description="Predict the largest vLLM max_model_len that fits.")
    p.add_argument("--version", action="version", version=f"ctx-tuner {__version__}")
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True)
    for mod in _modules():
        mod.add_parser(sub).set_defaults(_run=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    return int(args._run(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""One module per ``ctx-tuner`` sub-command: each defines ``NAME``, ``add_parser(subparsers)``
and ``run(args) -> int`` (the exit code). :mod:`tuner.cli` lists them in ``COMMANDS``."""

import argparse
import math

#: The largest ``--timeout`` any command accepts (one day, in seconds).
MAX_TIMEOUT_S = 86400.0


def timeout_seconds(text: str) -> float:
    """``--timeout`` of every command that runs a worker: a finite number of seconds in
    (0, :data:`MAX_TIMEOUT_S`]; anything else is an argparse error (exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}], not {text}")
    return value

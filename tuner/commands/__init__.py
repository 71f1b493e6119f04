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


def job_error_exit(exc: Exception) -> int:
    """Print the one-line message of an error from a drop's job and return the exit code every
    drop-running command uses: ``2`` for an invalid drop (DropError, DeviceError, EraError) or an
    invalid model config (ModelConfigError), ``1`` for any other TunerError (the job failed)."""
    import sys

    from tuner.errors import DeviceError, DropError, EraError, ModelConfigError

    if isinstance(exc, (DropError, DeviceError, EraError)):
        print(f"ctx-tuner: invalid drop: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, ModelConfigError):
        print(f"ctx-tuner: invalid model config: {exc}", file=sys.stderr)
        return 2
    print(f"ctx-tuner: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1


def add_cache_option(p: argparse.ArgumentParser) -> None:
    """``--no-cache``: run every pass in a worker even where the store's pass memo holds it."""
    p.add_argument("--no-cache", action="store_true",
                   help="run the profile passes in a worker even where the store's pass memo already holds them")


def add_settings_option(p: argparse.ArgumentParser) -> None:
    """``--settings FILE``: read the store of a daemon's settings (as ``status`` and ``retry`` do);
    ``--db`` overrides it."""
    p.add_argument("--settings", default=None, metavar="FILE",
                   help="daemon settings whose store to read (as status and retry); --db overrides it")


def store_from_args(args) -> str | None:
    """The store a reading command uses: ``--db``, else the ``--settings`` file's store, else None
    (the default ``var/ctx-tuner.sqlite``).

    Raises:
        SettingsError: the settings file is invalid.
    """
    if getattr(args, "db", None):
        return args.db
    if getattr(args, "settings", None):
        from tuner.daemon.settings import load_settings

        return load_settings(args.settings).db_url
    return None

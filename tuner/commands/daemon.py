"""``ctx-tuner daemon [--settings /etc/ctx-tuner/tuner.yaml]``: the unattended service.

Runs in the foreground (systemd ``Type=notify``), logs to stderr. Exit codes: 0 stopped by
SIGTERM/SIGINT; 1 start-up failed (store cannot be opened or migrated); 2 invalid settings (the
message names the file and the key).
"""

from __future__ import annotations

import argparse
import logging
import sys

from tuner.errors import SettingsError, TunerError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
NAME = "daemon"


def add_parser(sub) -> argparse.ArgumentParser:
    from tuner.settings import DEFAULT_SETTINGS_PATH

    p = sub.add_parser("daemon", help="watch a directory of drops and profile each one (systemd service)")
    p.add_argument("--settings", default=None,
                   help=f"settings YAML (default {DEFAULT_SETTINGS_PATH} if it exists, else built-in defaults)")
    return p


def run(args) -> int:
    import os

    from tuner.daemon import Daemon
    from tuner.settings import DEFAULT_SETTINGS_PATH, load_settings

    path = args.settings
    if path is None and os.path.exists(DEFAULT_SETTINGS_PATH):
        path = DEFAULT_SETTINGS_PATH
    try:
        settings = load_settings(path)
    except SettingsError as exc:
        print(f"ctx-tuner: invalid settings: {exc}", file=sys.stderr)
        return EXIT_USAGE
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    root.setLevel(settings.log_level_no)
    logging.getLogger("watchdog").setLevel(max(settings.log_level_no, logging.INFO))  # per-event chatter
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    try:
        return Daemon(settings).run()
    except SettingsError as exc:
        print(f"ctx-tuner: invalid settings: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TunerError as exc:
        print(f"ctx-tuner: daemon failed to start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED

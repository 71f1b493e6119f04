"""``ctx-tuner daemon [--settings /etc/ctx-tuner/tuner.yaml] [--json]``: the unattended service.

Runs in the foreground (systemd ``Type=notify``), logs to stderr (one JSON object per line with
``--json``). Exit codes: 0 stopped by
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
#: Text log line: local time with milliseconds, level, logger, message.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_parser(sub) -> argparse.ArgumentParser:
    from tuner.daemon.settings import DEFAULT_SETTINGS_PATH

    p = sub.add_parser(
        "daemon", help="watch a directory of drops and profile each one (systemd service)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Watch a directory of drop files and profile each new or changed one; runs in the foreground "
                    "(systemd Type=notify).",
        epilog=f"""default paths (settings keys; --settings {DEFAULT_SETTINGS_PATH}):
  drops        watch_dir  /etc/ctx-tuner/conf.d (every *.yaml / *.yml below it)
  state        state_dir  /var/lib/ctx-tuner: ctx-tuner.sqlite (the store, unless database_url),
                          proposals/NAME.yaml and NAME.vllm/ (one per drop), proposals/failed/NAME.yaml
                          (one per failed drop, with its reason), ctx-tuner-snapshot.sqlite (read-only copy)

signals:
  SIGTERM, SIGINT  stop: the running job's worker is killed and the job queued again; exit 0
  SIGHUP           reload the settings file (a new watch_dir is scanned, drops outside it retired)

logs:
  stderr only (journald under systemd), at the settings' log_level (default INFO); --json writes one
  JSON object per line. Each drop found, queued, started, finished (its proposals) or failed (its
  reason) is one line; `ctx-tuner status` reports health and names failed drops,
  `ctx-tuner status --failed` lists them, `ctx-tuner retry NAME` runs one again.

exit codes: 0 stopped by a signal; 1 start-up failed (store cannot be opened or migrated);
  2 invalid settings (the message names the file and the key)""")
    p.add_argument("--settings", default=None,
                   help=f"settings YAML (default {DEFAULT_SETTINGS_PATH} if it exists, else built-in defaults)")
    p.add_argument("--json", action="store_true",
                   help="log one JSON object per line (time, level, logger, message) instead of text")
    return p


class JsonLogFormatter(logging.Formatter):
    """One JSON object per log record: ``time`` (UTC ISO-8601), ``level``, ``logger``, ``message``
    and, with a traceback, ``exception`` — for journald/log shippers (``daemon --json``)."""

    def format(self, record: logging.LogRecord) -> str:
        import json
        from datetime import datetime, timezone

        doc = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure_logging(level: int, *, json_lines: bool = False) -> None:
    """Root logger on stderr at ``level``; JSON lines with ``json_lines``."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(stream=sys.stderr, format=TEXT_FORMAT)
    for h in root.handlers:  # text lines carry a timestamp too (foreground use has no journald)
        h.setFormatter(JsonLogFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    root.setLevel(level)


def run(args) -> int:
    import os

    from tuner.daemon.service import Daemon
    from tuner.daemon.settings import DEFAULT_SETTINGS_PATH, load_settings

    path = args.settings
    if path is None and os.path.exists(DEFAULT_SETTINGS_PATH):
        path = DEFAULT_SETTINGS_PATH
    try:
        settings = load_settings(path)
    except SettingsError as exc:
        print(f"ctx-tuner: invalid settings: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(settings.log_level_no, json_lines=getattr(args, "json", False))
    logging.getLogger("watchdog").setLevel(max(settings.log_level_no, logging.INFO))  # per-event chatter
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    try:
        daemon = Daemon(settings)
        code = daemon.run()
        if daemon.work_stuck:  # its work thread is blocked on another writer's lock: do not wait for it
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    except SettingsError as exc:
        print(f"ctx-tuner: invalid settings: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TunerError as exc:
        print(f"ctx-tuner: daemon failed to start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED

"""systemd ``sd_notify`` over ``$NOTIFY_SOCKET`` (a Unix datagram socket), without libsystemd.

Messages used by the daemon: ``READY=1`` (after migrations and the first scan), ``STATUS=…``
(progress), ``WATCHDOG=1`` (from the healthy main loop, every half ``$WATCHDOG_USEC``),
``RELOADING=1`` with ``MONOTONIC_USEC=…`` (SIGHUP), ``STOPPING=1``. Without ``$NOTIFY_SOCKET``
(not started by systemd) every call is a no-op. A failed send is logged, never raised: the
service manager being away must not stop the daemon.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Callable, Mapping

log = logging.getLogger(__name__)

#: Environment variables that belong to the service manager's protocol; workers must not see them.
NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def _address(path: str) -> str | bytes:
    """``@name`` is the abstract namespace (leading NUL), anything else a filesystem path."""
    if path.startswith("@"):
        return b"\0" + path[1:].encode()
    return path


class Notifier:
    """Sends ``KEY=VALUE`` lines to the service manager.

    Args:
        env: the environment to read ``NOTIFY_SOCKET``/``WATCHDOG_USEC``/``WATCHDOG_PID`` from
            (default ``os.environ``).
        monotonic_ns: clock for ``MONOTONIC_USEC`` (CLOCK_MONOTONIC, as systemd expects).
        pid: this process's id (``WATCHDOG_PID`` must match it for the watchdog to apply).
    """

    def __init__(self, env: Mapping[str, str] | None = None, *,
                 monotonic_ns: Callable[[], int] = time.monotonic_ns, pid: int | None = None) -> None:
        env = os.environ if env is None else env
        self.socket_path = env.get("NOTIFY_SOCKET") or None
        self._monotonic_ns = monotonic_ns
        self._sock: socket.socket | None = None
        self.watchdog_interval_s: float | None = None
        usec = env.get("WATCHDOG_USEC")
        wpid = env.get("WATCHDOG_PID")
        if usec and (not wpid or wpid == str(pid if pid is not None else os.getpid())):
            try:
                value = int(usec)
                if value > 0:
                    self.watchdog_interval_s = value / 1e6
            except ValueError:
                log.warning("ignoring WATCHDOG_USEC=%r (not an integer)", usec)

    @property
    def enabled(self) -> bool:
        """True when ``$NOTIFY_SOCKET`` was set."""
        return self.socket_path is not None

    def send(self, *lines: str) -> bool:
        """Send one datagram of ``KEY=VALUE`` lines. Returns True if it was sent.

        Never raises: an unreachable socket is logged at WARNING and reported as False.
        """
        if not self.socket_path or not lines:
            return False
        payload = "\n".join(line.replace("\n", " ") for line in lines).encode("utf-8", "replace")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, _address(self.socket_path))
            return True
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self.socket_path, exc)
            return False

    def ready(self, status: str | None = None) -> bool:
        """``READY=1`` (plus ``STATUS=``)."""
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        """``STATUS=text`` (one line, shown by ``systemctl status``)."""
        return self.send(f"STATUS={text}")

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the main loop is healthy."""
        return self.send("WATCHDOG=1")

    def reloading(self) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC`` (CLOCK_MONOTONIC in µs), as systemd ≥ 253 requires."""
        return self.send("RELOADING=1", f"MONOTONIC_USEC={self._monotonic_ns() // 1000}")

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1`` (plus ``STATUS=``)."""
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def close(self) -> None:
        """Close the socket (further sends reopen it)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

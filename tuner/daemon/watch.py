"""Watching the drop directory: filesystem events are hints, content hashes decide.

* :func:`is_drop_name` — which names are drops (``*.yaml``, ``*.yml``, any case; never hidden files, editor swap,
  backup or lock files, atomic-save temporaries).
* :func:`scan` — one full pass over ``watch_dir``: path → :class:`FileState` (the SHA-256 of the
  bytes, or a typed error for a path trick such as a FIFO or a symlink leaving the directory).
  Files modified less than ``settle_s`` ago are reported as *settling* (a writer may be mid-way).
* :class:`Debouncer` — pure timing logic on an injected clock: reconcile once events go quiet.
* :class:`DropWatcher` — a watchdog observer that turns events into hints; it notices when the
  observer thread died or the directory was deleted and recreated, and restarts.

No torch, no database here.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Callable

from tuner.question.drop import MAX_DROP_BYTES

log = logging.getLogger(__name__)

#: Suffixes of editor and package-manager leftovers that are never drops, even if they end in
#: ``.yaml`` after something else (``x.yaml`` itself is a drop; ``x.yaml.swp`` is not).
_IGNORED_SUFFIXES = (".swp", ".swx", ".swo", "~", ".tmp", ".bak", ".orig", ".rej", ".dpkg-new", ".dpkg-old",
                     ".dpkg-dist", ".rpmnew", ".rpmsave", ".part")
#: Watchdog event types that can change what a reconcile would find (opening or reading a file,
#: which the daemon itself does, is not one of them).
_CHANGE_EVENTS = frozenset({"created", "modified", "moved", "deleted", "closed"})


#: File name endings of drops, compared case-insensitively (``x.yaml``, ``x.yml``, ``X.YAML``).
DROP_SUFFIXES = (".yaml", ".yml")


def is_drop_name(name: str) -> bool:
    """True for a file name the daemon treats as a drop: ``*.yaml`` or ``*.yml`` in any case, not hidden (``.x.yaml``,
    Emacs lock ``.#x.yaml``), not an editor/atomic-save leftover (``#x.yaml#``, ``x.yaml~``,
    ``x.yaml.swp``, ``x.yaml.tmp``)."""
    low = name.lower()
    if not low.endswith(DROP_SUFFIXES) or low in DROP_SUFFIXES:
        return False
    if name.startswith((".", "#", "~")):
        return False
    return not name.endswith(_IGNORED_SUFFIXES)


def is_drop_path(path: str, root: str) -> bool:
    """:func:`is_drop_name` for the file, and no hidden directory between ``root`` and it."""
    rel = os.path.relpath(path, root)
    if rel.startswith(".."):
        return False
    parts = rel.split(os.sep)
    return all(not p.startswith(".") for p in parts[:-1]) and is_drop_name(parts[-1])


@dataclass(frozen=True)
class FileState:
    """What a scan saw at one path. ``sha256`` identifies the state: the hash of the bytes read
    (at most ``MAX_DROP_BYTES + 1``), or of the error text when the file could not be used."""

    sha256: str
    raw: bytes | None = None
    error: str | None = None


@dataclass
class Scan:
    """Result of :func:`scan`. ``files``: absolute path → state; ``settling``: paths modified
    within the settle time (neither new nor gone yet); ``ok``: False when ``watch_dir`` itself
    is missing or unreadable (then nothing may be treated as deleted)."""

    files: dict[str, FileState] = field(default_factory=dict)
    settling: set[str] = field(default_factory=set)
    ok: bool = True
    problem: str | None = None


def _error_state(message: str) -> FileState:
    return FileState(hashlib.sha256(f"error\0{message}".encode()).hexdigest(), None, message)


def _inside(path: str, root_real: str) -> bool:
    return path == root_real or path.startswith(root_real.rstrip(os.sep) + os.sep)


def read_drop_file(path: str, root_real: str, *, now: float | None = None, settle_s: float = 0.0,
                   max_bytes: int = MAX_DROP_BYTES) -> FileState | None:
    """Read one candidate drop safely; ``None`` means it is settling (modified < ``settle_s`` ago,
    by the wall clock ``now`` in seconds since the epoch).

    Never blocks (FIFOs and devices are refused before and after opening) and never reads more
    than ``max_bytes + 1`` bytes. A symlink is followed only to a regular file inside the watched
    directory. Problems come back as an error :class:`FileState`, never raised.
    """
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        return _error_state("vanished while scanning")
    except OSError as exc:
        return _error_state(f"cannot stat: {exc.strerror}")
    if stat.S_ISLNK(lst.st_mode):
        target = os.path.realpath(path)
        if not _inside(target, root_real):
            return _error_state(f"symlink points outside the watched directory (to {target})")
        try:
            st = os.stat(path)
        except OSError as exc:
            what = "a symlink loop" if exc.errno == errno.ELOOP else f"a dangling symlink ({exc.strerror})"
            return _error_state(f"{what}")
    else:
        st = lst
    if not stat.S_ISREG(st.st_mode):
        return _error_state("not a regular file (a FIFO, socket or device is never read)")
    if now is not None and settle_s > 0 and -1.0 < now - st.st_mtime < settle_s:  # a future mtime never settles
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return _error_state(f"cannot open: {exc.strerror}")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between stat and open
            return _error_state("not a regular file (a FIFO, socket or device is never read)")
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 65536))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        raw = b"".join(chunks)
    except OSError as exc:
        return _error_state(f"cannot read: {exc.strerror}")
    finally:
        os.close(fd)
    return FileState(hashlib.sha256(raw).hexdigest(), raw, None)


def scan(root: str, *, now: float | None = None, settle_s: float = 0.0) -> Scan:
    """Walk ``root`` (symlinked directories and hidden directories are not entered) and read
    every drop. ``now`` is the wall clock (seconds since the epoch) for the settle check.

    Never raises for filesystem problems: a missing or unreadable ``root`` gives ``ok=False``.
    """
    out = Scan()
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        out.ok, out.problem = False, "watch_dir does not exist or is not a directory"
        return out
    root_real = os.path.realpath(root)
    errors: list[OSError] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=errors.append):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not is_drop_name(name):
                continue
            path = os.path.join(dirpath, name)
            state = read_drop_file(path, root_real, now=now, settle_s=settle_s)
            if state is None:
                out.settling.add(path)
            else:
                out.files[path] = state
    root_errors = [e for e in errors if os.path.abspath(getattr(e, "filename", "") or "") == root]
    if root_errors:
        out.ok, out.problem = False, f"cannot list watch_dir: {root_errors[0].strerror}"
    elif errors:
        # an unreadable subdirectory: its drops are unknown, not deleted
        out.ok, out.problem = False, f"cannot list {errors[0].filename}: {errors[0].strerror}"
    return out


class Debouncer:
    """When to reconcile after a burst of hints (all times in seconds on one monotonic clock).

    Due ``quiet_s`` after the last hint, but never later than ``max_delay_s`` after the first one
    (a directory that never goes quiet is still reconciled).
    """

    def __init__(self, quiet_s: float, max_delay_s: float | None = None) -> None:
        self.quiet_s = quiet_s
        self.max_delay_s = max_delay_s if max_delay_s is not None else max(5.0, 10 * quiet_s)
        self.first: float | None = None
        self.last: float | None = None

    def hint(self, now: float) -> None:
        """Record an event at ``now``."""
        if self.first is None:
            self.first = now
        self.last = now

    @property
    def pending(self) -> bool:
        """True when hints arrived since the last :meth:`clear`."""
        return self.first is not None

    def deadline(self) -> float | None:
        """The time the reconcile is due, or None without pending hints."""
        if self.first is None or self.last is None:
            return None
        return min(self.last + self.quiet_s, self.first + self.max_delay_s)

    def due(self, now: float) -> bool:
        """True when pending hints have gone quiet (or waited too long) at ``now``."""
        d = self.deadline()
        return d is not None and now >= d

    def clear(self) -> None:
        """Forget the hints (a reconcile is starting)."""
        self.first = self.last = None


class _Handler:
    """watchdog handler: every relevant event becomes one call of ``on_hint(path)``."""

    def __init__(self, root: str, on_hint: Callable[[str], None]) -> None:
        self.root = root
        self.on_hint = on_hint

    def dispatch(self, event: Any) -> None:
        if event.event_type not in _CHANGE_EVENTS:
            return
        paths = [p for p in (getattr(event, "src_path", ""), getattr(event, "dest_path", "")) if p]
        paths = [os.fsdecode(p) for p in paths]
        if event.is_directory or any(is_drop_path(p, self.root) for p in paths):
            try:
                self.on_hint(paths[0] if paths else self.root)
            except Exception:  # pragma: no cover - a hint must never kill the observer thread
                log.exception("hint callback failed")


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


class DropWatcher:
    """A watchdog observer on ``root`` (recursive) that calls ``on_hint(path)`` for changes.

    :meth:`ensure` restarts it when the observer thread died or the directory was replaced
    (a deleted and recreated directory keeps no inotify watch); the caller should then reconcile.
    ``observer_factory`` is injectable (default: watchdog's platform observer, inotify on Linux).
    """

    def __init__(self, root: str, on_hint: Callable[[str], None], *,
                 observer_factory: Callable[[], Any] | None = None) -> None:
        self.root = os.path.abspath(root)
        self.on_hint = on_hint
        self._factory = observer_factory
        self._observer: Any = None
        self._identity: tuple[int, int] | None = None

    def _new_observer(self) -> Any:
        if self._factory is not None:
            return self._factory()
        from watchdog.observers import Observer

        return Observer()

    def start(self) -> bool:
        """Start observing; False (and a warning) when ``root`` is missing or cannot be watched."""
        self.stop()
        ident = _identity(self.root)
        if ident is None:
            log.warning("watch_dir %s does not exist; polling until it does", self.root)
            return False
        obs = self._new_observer()
        try:
            obs.schedule(_Handler(self.root, self.on_hint), self.root, recursive=True)
            obs.start()
        except Exception as exc:  # inotify limits, permissions, a race with deletion
            log.warning("cannot watch %s (%s); relying on periodic rescans", self.root, exc)
            try:
                obs.stop()
            except Exception:
                pass
            return False
        self._observer, self._identity = obs, ident
        return True

    def healthy(self) -> bool:
        """True when the observer thread is alive and ``root`` is still the directory it watches."""
        obs = self._observer
        return obs is not None and obs.is_alive() and _identity(self.root) == self._identity

    def ensure(self) -> bool:
        """Restart a dead or stale observer. Returns True if it (re)started one just now."""
        if self.healthy():
            return False
        was = self._observer is not None
        started = self.start()
        if started and was:
            log.warning("filesystem observer on %s was dead or stale; restarted", self.root)
        return started

    def stop(self) -> None:
        """Stop and join the observer thread (idempotent)."""
        obs, self._observer = self._observer, None
        if obs is not None:
            try:
                obs.stop()
                obs.join(timeout=5)
            except Exception:  # pragma: no cover
                log.exception("stopping the observer failed")

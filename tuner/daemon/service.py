"""The daemon: composition root and main loop of ``ctx-tuner daemon``.

:class:`Daemon` builds every collaborator from :class:`~tuner.daemon.settings.Settings` (store with
migrations, :class:`~tuner.store.jobqueue.JobQueue`, :class:`~tuner.daemon.watch.DropWatcher`,
:class:`~tuner.daemon.notify.Notifier`) and runs one loop in the main thread:

* filesystem events are hints: they only arm a :class:`~tuner.daemon.watch.Debouncer`; when it is due,
  or every ``rescan_interval_s``, :meth:`Daemon.reconcile` scans ``watch_dir`` and compares content
  hashes with the jobs table (new or changed content → a job; invalid content → a failed job with
  the typed error; a deleted file → its drops retired, results kept);
* one job at a time runs in a helper thread that only waits on the worker subprocess (own process
  group, killed on timeout); every database write happens in the main thread;
* results and the job's ``done`` mark are one transaction, then the proposal file is written and a
  log line printed; a read-only snapshot is refreshed;
* fleet (:mod:`tuner.store.fleet`): the daemon registers as owner ``host_id`` + ``watch_dir`` with a
  lease it renews every ``lease_s / 3``; it claims, completes and retires only its own jobs and
  drops, returns an expired owner's running jobs to the queue, and answers a drop whose result
  key some host already stored without a worker. While the database is down it keeps watching;
  a failed scan is retried every few seconds and finished results are kept until they are saved;
* signals only set flags (``signal.set_wakeup_fd`` wakes the loop): SIGTERM/SIGINT stop gracefully
  (the running job's worker group is killed and the job goes back to ``pending``), SIGHUP reloads
  the settings. sd_notify: READY after migrations and the first scan, STATUS, WATCHDOG while the
  loop is healthy, RELOADING/READY around a reload, STOPPING;
* under :meth:`Daemon.run` the work loop above runs in its own thread and the main thread only
  handles signals and sends the watchdog pings (every ``WatchdogSec/4`` while the work loop has
  made progress within :data:`LOOP_STALL_S`): a database locked by another writer delays the
  work, never the pings or SIGTERM (which kills the worker and exits within :data:`STOP_GRACE_S`;
  a job whose requeue could not be written is requeued, uncounted, at the next start);
* outputs are derived from the store: at start and on every reconcile a missing or stale proposal
  file is rewritten from the committed rows, a file of a retired drop removed, and a missing
  snapshot rewritten — a kill between the commit and the file write loses nothing;
* failures are of the drop (final until its bytes change) or of the run (retried with backoff,
  :mod:`tuner.store.jobqueue`); a daemon crash costs a job no attempt;
* drops are identified by content and name: a file moved or renamed keeps its results (a move,
  not a deletion and a new drop).

Nothing here imports torch or transformers. Clocks, the worker call, ``Popen``, ``killpg`` and
the observer are injectable; one bad drop, broken worker or database hiccup is logged and the
loop goes on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import queue
import select
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import sqlalchemy as sa
import yaml

from tuner.store import records
from tuner.jobs.app import ProfileOutcome, prepare_request
from tuner.store.records import rows_for_store
from tuner.question.drop import Drop, parse_drop, parse_drop_keys  # noqa: F401  (parse_drop: the daemon's name, kept)
from tuner.store import fleet
from tuner.errors import DropError, SettingsError, StoreError, TunerError, WorkerError
from tuner.store.jobqueue import Job, JobNotRunning, JobQueue, failure_kind
from tuner.daemon.notify import NOTIFY_ENV, Notifier
from tuner.reports.proposals import proposal_document, proposal_path, remove_proposal_file, write_proposal_file
from tuner.question.protocol import gmu_text
from tuner.daemon.settings import Settings, check_worker_python, load_settings
from tuner.store.snapshot import write_snapshot
from tuner.store.database import Store, open_store, utc_text
from tuner.daemon.watch import Debouncer, DropWatcher, FileState, scan
from tuner.jobs import memoanswer
from tuner.jobs import passmemo
from tuner.seam.warmworker import WarmWorker
from tuner.seam.worker import run_in_worker

log = logging.getLogger("tuner.daemon.service")

#: Test hook: called as ``hook(job, drop_id)`` right after a job's results are committed and
#: before its proposal file is written (aims kill -9 at the commit window). None in production.
_AFTER_COMMIT_HOOK: Callable[[Job, int], None] | None = None
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

#: Snapshots are refreshed at most this often while jobs keep finishing (seconds).
SNAPSHOT_MIN_INTERVAL_S = 5.0
#: After this many consecutive failing loop iterations the loop stops sending WATCHDOG=1.
UNHEALTHY_AFTER_ERRORS = 5
#: Wait before retrying a failed write of finished results (seconds).
SAVE_RETRY_S = 1.0
#: Longest the loop sleeps without a deadline (seconds).
MAX_WAIT_S = 30.0
#: Wait before retrying a scan that failed on the database (seconds): the drops are still on
#: disk, so once the database answers again the next scan queues whatever changed meanwhile.
DB_RETRY_S = 2.0
#: How often an idle loop looks for jobs queued by others (``ctx-tuner retry``), seconds.
JOB_POLL_S = 5.0
#: The work loop counts as stuck (no more watchdog pings) when one step has run this long
#: (seconds): longer than any wait on another writer's lock (busy_timeout) a step may do.
LOOP_STALL_S = 300.0
#: After SIGTERM the daemon exits within this many seconds even if the database is locked.
STOP_GRACE_S = 1.5
#: Largest proposal file read back when checking it against the store (bytes).
MAX_PROPOSAL_FILE_BYTES = 1 << 20


class Waker:
    """A self-pipe (socket pair): threads and signals wake the main loop's :meth:`wait`."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def write_fd(self) -> int:
        """File descriptor for ``signal.set_wakeup_fd``."""
        return self._w.fileno()

    def wake(self) -> None:
        """Make the current or next :meth:`wait` return (safe from any thread)."""
        try:
            self._w.send(b"\0")
        except OSError:  # buffer full: a wake-up is already pending; or closed at shutdown
            pass

    def wait(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s`` seconds or until woken; drains pending wake-ups."""
        try:
            select.select([self._r], [], [], max(0.0, timeout_s))
            while self._r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # closed
            pass

    def close(self) -> None:
        self._r.close()
        self._w.close()


@dataclass
class SharedResult:
    """A job answered from a result another job (any host) stored under the same
    :func:`tuner.store.fleet.result_key`: no worker ran."""

    drop: Drop
    device: dict
    source_drop_id: int
    result_sha256: str
    content: str | None
    drop_id: int | None = None
    result: dict | None = None
    warnings: list | None = None


@dataclass
class _Running:
    job: Job
    drop: Drop
    thread: threading.Thread
    started: float
    proc: subprocess.Popen | None = None
    killed: bool = False


def _one_line(exc: BaseException, limit: int = 600) -> str:
    """An error as one log line (YAML errors span several); the full text stays in the jobs row."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _connection_error(exc: BaseException) -> bool:
    """True for a StoreError caused by the database being unreachable or busy (SQLAlchemy
    ``OperationalError`` / ``InterfaceError``: refused, restarted, locked), not by bad data."""
    cause = exc.__cause__
    return isinstance(cause, (sa.exc.OperationalError, sa.exc.InterfaceError))


def _inside(child: str, parent: str) -> bool:
    c, p = os.path.realpath(child), os.path.realpath(parent)
    return c == p or c.startswith(p.rstrip(os.sep) + os.sep)


def check_layout(settings: Settings) -> None:
    """Refuse a state directory inside ``watch_dir`` (proposal files would be read back as drops)
    and a ``worker_python`` that is not an executable (:func:`tuner.daemon.settings.check_worker_python`).

    Raises:
        SettingsError: naming the settings file and ``state_dir``.
    """
    if _inside(settings.state_dir, settings.watch_dir):
        raise SettingsError(f"state_dir {settings.state_dir} is inside watch_dir {settings.watch_dir}; "
                            "proposal files would be read as drops", path=settings.source, field="state_dir")
    check_worker_python(settings)


def make_state_dir(settings: Settings) -> None:
    """Create ``state_dir`` (and parents) and check that it is a writable directory.

    Raises:
        SettingsError: naming the settings file and ``state_dir`` (one line, the OS reason).
    """
    d = settings.state_dir
    try:
        Path(d).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SettingsError(f"state_dir {d} cannot be created: {exc.strerror or exc}", path=settings.source,
                            field="state_dir") from None
    if not os.access(d, os.W_OK | os.X_OK):
        try:  # a read-only mount refuses every user: say that, not "this user"
            readonly = bool(os.statvfs(d).f_flag & os.ST_RDONLY)
        except (OSError, AttributeError):
            readonly = False
        if readonly:
            raise SettingsError(f"state_dir {d} is on a read-only filesystem (mounted read-only; systemd's "
                                "ProtectSystem= / ReadWritePaths= decide that for the unit)", path=settings.source,
                                field="state_dir")
        raise SettingsError(f"state_dir {d} is not writable by this user", path=settings.source, field="state_dir")


def clean_temporaries(settings: Settings) -> list[str]:
    """Remove what a crash can leave in the state directory: atomic-write temporaries of the
    snapshot, of proposal files and of their ``vllm serve --config`` files in
    ``proposals/NAME.vllm/`` (``.NAME.XXXX.tmp``) and their SQLite ``-journal``. Returns the paths
    removed. Only names this daemon creates are touched."""
    removed = []
    dirs = {Path(settings.state_dir), settings.proposals_dir, settings.snapshot_file.parent}
    try:  # the per-proposal config directories (tuner.reports.proposals.vllm_config_dir)
        dirs |= {Path(e.path) for e in os.scandir(settings.proposals_dir)
                 if e.name.endswith(".vllm") and e.is_dir(follow_symlinks=False)}
    except OSError:
        pass
    for d in dirs:
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            n = e.name
            if n.startswith(".") and (n.endswith(".tmp") or n.endswith(".tmp-journal")) and e.is_file(follow_symlinks=False):
                try:
                    os.unlink(e.path)
                    removed.append(e.path)
                except OSError:
                    pass
    return sorted(removed)


def state_dir_condition(exc: BaseException) -> str | None:
    """What a failed write under ``state_dir`` says about the directory — "full (no space left on
    the device)", "over its disk quota", "on a read-only filesystem", "not writable by this user"
    — from the OS error (or SQLite's text for the snapshot copy) in ``exc`` or its causes; None for
    another failure."""
    import errno

    seen: BaseException | None = exc
    texts = []
    while seen is not None:
        code = getattr(seen, "errno", None)
        if code in (errno.ENOSPC,):
            return "full (no space left on the device)"
        if code == errno.EDQUOT:
            return "over its disk quota"
        if code == errno.EROFS:
            return "on a read-only filesystem"
        if code in (errno.EACCES, errno.EPERM):
            return "not writable by this user"
        texts.append(str(seen).lower())
        seen = seen.__cause__ or seen.__context__
    text = " ".join(texts)
    if "disk is full" in text or "no space left" in text:
        return "full (no space left on the device)"
    if "read-only file system" in text or "readonly database" in text:
        return "on a read-only filesystem"
    return None


def _proposal_summary(props: list[dict]) -> str:
    from tuner.question.protocol import ProposalResult

    # "gmu 0.9 → nothing starts: …", never "max_model_len None"
    return "; ".join(
        f"gmu {gmu_text(p.gpu_memory_utilization)} → "
        + (f"max_model_len {p.max_model_len} ({p.num_gpu_blocks} blocks, {p.kv_cache_tokens} KV tokens)"
           if p.max_model_len else f"nothing starts: {p.reason}")
        for p in map(ProposalResult.from_wire, props)) or "no proposals"


class Daemon:
    """The service. ``run()`` for production; tests may call :meth:`start`, :meth:`step` and
    :meth:`shutdown` themselves (``step(block=False)`` with an injected ``clock`` needs no sleeps).

    Args:
        settings: validated settings.
        notifier: sd_notify sender (default: from ``$NOTIFY_SOCKET``).
        clock: monotonic seconds (debounce, rescans, watchdog pings); wall_clock: seconds since the
            epoch (compared with file mtimes).
        worker: ``worker(request, job=, timeout_s=, python=, popen=) -> result`` (default
            :func:`tuner.seam.worker.run_in_worker`).
        store_factory: ``store_factory(url) -> Store`` (opens and migrates).
        observer_factory: watchdog observer factory (default: inotify on Linux).
        popen, killpg: process control, injectable.
    """

    def __init__(self, settings: Settings, *, notifier: Notifier | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 worker: Callable[..., dict] = run_in_worker, store_factory: Callable[[str], Store] = open_store,
                 observer_factory: Callable[[], Any] | None = None,
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen,
                 killpg: Callable[[int, int], None] = os.killpg, nvml: Any = None) -> None:
        self.settings = settings
        self.notifier = notifier if notifier is not None else Notifier()
        self.clock = clock
        self.wall_clock = wall_clock
        self.worker = worker
        self.store_factory = store_factory
        self.observer_factory = observer_factory
        self._popen_fn = popen
        self.killpg = killpg
        #: the warm worker (tuner.seam.warmworker): one worker process for successive simulate jobs
        self.warm = WarmWorker(killpg=killpg)
        self.nvml = nvml
        self.store: Store | None = None
        self.queue: JobQueue | None = None
        self.owner: fleet.Owner | None = None
        self._next_beat = 0.0
        self._db_down_logged = False
        self.waker = Waker()
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.debouncer = Debouncer(settings.debounce_s)
        self.watcher = self._make_watcher(settings.watch_dir)
        self._lock = threading.Lock()
        self._running: _Running | None = None
        self._unsaved: tuple[Job, ProfileOutcome, str] | None = None
        #: a finished job's failure not yet written (the database was down): retried like _unsaved
        self._unsaved_failure: tuple[Job, BaseException, str] | None = None
        self._ro_store: Store | None = None  # the job thread's read-only store (_reader)
        self._retry_at = 0.0
        self._next_rescan = 0.0
        self._next_ping = 0.0
        self._errors = 0
        self._step_failed = False
        self._snapshot_dirty = False
        self._last_snapshot = -math.inf
        self._status_dirty = True
        self._last_status: str | None = None
        self.stop_requested = False
        self.reload_requested = False
        self.started = False
        #: number of reconcile passes so far (tests and the status line use it)
        self.reconciles = 0
        self._closed = False
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup_fd: int | None = None
        #: path → (content sha256, drop name or None) from the last reconcile; duplicate names warned
        self._names: dict[str, tuple[str, str | None]] = {}
        self._parsed_drops: dict[tuple[str, str], Any] = {}  # see _parsed
        self._dup_warned: dict[str, tuple[str, ...]] = {}
        #: name → (drop id, inode, mtime_ns, size) of the proposal file last written or checked
        self._written: dict[str, tuple[int, int, int, int]] = {}
        self._next_job_poll = 0.0
        self._next_retry: float | None = None
        #: monotonic time the work loop last began or ended a step (the watchdog's health signal)
        self._beat = clock()
        self._in_step = False
        self._work_thread: threading.Thread | None = None
        #: set by :meth:`shutdown` when the work thread was still blocked (a locked database): the
        #: caller should end the process at once (``os._exit``) rather than wait on it at exit
        self.work_stuck = False
        self.control = Waker()
        #: what :meth:`run` returns: 0, or 1 once the daemon stopped on an error of its own
        #: (the store file replaced under it: systemd's Restart= then starts it on the new file)
        self.exit_status = 0
        #: (path, st_dev, st_ino) of the SQLite file the store opened (None: a server database)
        self._store_file: tuple[str, int, int] | None = None
        self._store_replaced: str | None = None
        #: the condition of ``state_dir`` logged once (full, read-only, …; :meth:`_state_dir_failed`)
        self._state_problem: str | None = None

    # -- composition -----------------------------------------------------------------------------

    def _make_watcher(self, root: str) -> DropWatcher:
        return DropWatcher(root, self._on_hint, observer_factory=self.observer_factory)

    def _on_hint(self, path: str) -> None:  # observer thread
        self.events.put(("hint", path))
        self.waker.wake()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Open and migrate the store, recover interrupted jobs, start watching, run the first
        scan, write a snapshot, then send ``READY=1``.

        Raises:
            SettingsError: bad directory layout, a ``state_dir`` that cannot be created, a
                ``worker_python`` that is not an executable. StoreError: the store cannot be
                opened/migrated.
        """
        s = self.settings
        check_layout(s)
        make_state_dir(s)
        for path in clean_temporaries(s):
            log.info("removed %s (a temporary file left by a crash)", path)
        self.notifier.status("migrating the database")
        self.store = self.store_factory(s.db_url)
        self._store_file = self._sqlite_identity()
        self._register(s)
        stopped = self._stopped_jobs_noted()
        requeued, failed = self.queue.recover(backoff_base_s=s.retry_backoff_s, backoff_max_s=s.retry_backoff_max_s,
                                              now=self._utc_now(), stopped=stopped)
        self._forget_stopped_jobs()
        for job in requeued + failed:
            if job.owner_id == self.owner.id:
                self._kill_orphan(job)
        for job in requeued:
            how = ("was stopped with the daemon (SIGTERM) before it could be returned to the queue"
                   if job.id in stopped and job.owner_id == self.owner.id else "was interrupted by a daemon crash")
            log.warning("job %d (%s) %s; queued again (not counted: %d of %d attempts used; interrupted %d time(s))",
                        job.id, job.path, how, max(job.attempts - 1, 0), s.max_attempts, (job.interruptions or 0) + 1)
        self._note_retry()
        self._start_metrics()
        self.watcher.start()
        try:
            self.reconcile()
        except StoreError as exc:  # the database went away right after the migration: keep going
            if not _connection_error(exc):
                raise
            self._database_down(exc)
        self._snapshot(force=True)
        self.started = True
        self.waker.wake()  # the first step starts a queued job at once
        self.notifier.ready(self._status_text())
        log.info("ready: watching %s as host %s (hosts.id %d), store %s", s.watch_dir, self.owner.host_id,
                 self.owner.id, self.store.where)

    #: The file (in ``state_dir``) where a daemon stopped by SIGTERM notes the jobs it could not
    #: return to the queue (the store failing or locked): the next start requeues them as stopped,
    #: not as interrupted by a crash.
    STOPPED_JOBS_FILE = "stopped-jobs.json"

    def _stopped_path(self) -> Path:
        return Path(self.settings.state_dir) / self.STOPPED_JOBS_FILE

    def _note_stopped_jobs(self, ids: set[int]) -> None:
        """Note ``ids`` as stopped by SIGTERM (:data:`STOPPED_JOBS_FILE`); best effort."""
        if not ids:
            return
        path = self._stopped_path()
        try:
            old = set(self._stopped_jobs_noted())
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps({"jobs": sorted(old | ids), "at": utc_text()}))
            os.replace(tmp, path)
        except OSError as exc:
            log.debug("cannot note the stopped jobs in %s: %s", path, exc)

    def _stopped_jobs_noted(self) -> set[int]:
        try:
            doc = json.loads(self._stopped_path().read_text())
            return {int(i) for i in doc.get("jobs", [])}
        except (OSError, ValueError, TypeError, AttributeError):
            return set()

    def _forget_stopped_jobs(self) -> None:
        try:
            self._stopped_path().unlink()
        except OSError:
            pass

    def _sqlite_identity(self) -> tuple[str, int, int] | None:
        """(path, device, inode) of the store's SQLite file as opened now; None for a server
        database (or a store without an engine URL, in tests)."""
        url = getattr(getattr(self.store, "engine", None), "url", None)
        if url is None or url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
            return None
        path = os.path.abspath(url.database)
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (path, st.st_dev, st.st_ino)

    def _store_file_intact(self) -> bool:
        """False once the SQLite file at the store's path is no longer the file this daemon opened
        (deleted, or replaced — say by an older backup): every later commit would go into the
        unlinked file and be lost at the next start. The first time, it logs one ERROR naming the
        file and both identities, and stops the daemon with exit status 1 (systemd's ``Restart=``
        starts it again on the file now at that path). One ``stat`` a loop step."""
        if self._store_replaced is not None:
            return False
        ident = self._store_file
        if ident is None:
            return True
        path, dev, ino = ident
        try:
            st = os.stat(path)
            now = f"device {st.st_dev}, inode {st.st_ino}"
            if (st.st_dev, st.st_ino) == (dev, ino):
                return True
            what = f"replaced by another file ({now})"
        except FileNotFoundError:
            what = "deleted"
        except OSError as exc:  # unreadable for a moment (a remount): not proof of a swap
            log.warning("store file %s cannot be checked: %s", path, exc.strerror or exc)
            return True
        self._store_replaced = what
        self.exit_status = 1
        log.error("store file %s was %s under the running daemon (it opened device %d, inode %d); stopping so "
                  "that no result is committed into a file that is no longer there; the next start opens the "
                  "file now at that path (jobs not in it run again)", path, what, dev, ino)
        self.request_stop()
        return False

    def _gpus(self) -> list[dict]:
        from tuner.memory.devices import list_gpus

        try:
            return [{"name": g.name, "total_memory_bytes": g.total_memory_bytes, "uuid": g.uuid}
                    for g in list_gpus(self.nvml)]
        except TunerError:
            return []

    def _register(self, s: Settings) -> None:
        """Register (or take over) this daemon's owner row, start its lease, adopt ownerless
        rows of its watch directory; make the job queue for it.

        Raises:
            OwnerBusy: a live daemon already owns this host id and watch directory.
        """
        self.owner = fleet.register_owner(self.store, s.host, s.watch_dir, lease_s=s.lease_s,
                                          gpus=self._gpus(), wall_clock=self.wall_clock)
        self.queue = JobQueue(self.store, self.owner.id, lease_s=s.lease_s)
        adopted = self.queue.adopt(s.watch_dir)
        if adopted:
            log.info("adopted %d job(s) stored before ownership existed", adopted)
        self._next_beat = self.clock() + s.lease_s / 3

    def _start_metrics(self) -> None:
        """Serve Prometheus metrics (:mod:`tuner.daemon.metrics`) when ``metrics_listen`` is set; a port
        or socket that cannot be opened is logged, never fatal."""
        listen = getattr(self.settings, "metrics_listen", None)
        if not listen or getattr(self, "_metrics", None) is not None:
            return
        from tuner.daemon.metrics import MetricsError, MetricsServer

        # this daemon's jobs and proposals (a fleet database holds every host's)
        server = MetricsServer(listen, self.store.engine.connect,
                               owner=lambda: self.owner.id if self.owner is not None else None)
        try:
            server.start()
        except MetricsError as exc:
            log.error("%s", exc)
            return
        self._metrics = server
        log.info("metrics on %s", server.address)

    def run(self) -> int:
        """Start, loop until SIGTERM/SIGINT, shut down. Returns the exit status (0).

        Raises:
            SettingsError, StoreError: start-up failed (nothing is left running).
        """
        self._install_signals()
        try:
            self.start()
            self._work_thread = threading.Thread(target=self._work_loop, name="ctx-tuner-work", daemon=True)
            self._work_thread.start()
            self._control_loop()
        finally:
            self.shutdown()
        return self.exit_status

    def _work_loop(self) -> None:  # work thread: every database write of a running daemon
        try:
            while not self.stop_requested:
                self.step(ping=False)
        except BaseException:  # pragma: no cover - step() guards each part; this is the last net
            log.exception("the work loop died")
            self.stop_requested = True
            self.control.wake()
        finally:
            self._stop_work()

    def _control_loop(self) -> None:  # main thread: signals and watchdog pings only, no database
        while not self.stop_requested:
            interval = self.notifier.watchdog_interval_s
            self.control.wait(min(interval / 4, 1.0) if interval else 1.0)
            if self.reload_requested:
                self.waker.wake()  # the work loop reloads
            self._ping(quarter=True)
            t = self._work_thread
            if t is not None and not t.is_alive():
                break

    def healthy(self) -> bool:
        """True when the work loop is alive and making progress: no run of
        ``UNHEALTHY_AFTER_ERRORS`` failing iterations, and the current step (if any) has run less
        than :data:`LOOP_STALL_S`."""
        if self._errors >= UNHEALTHY_AFTER_ERRORS:
            return False
        if self._in_step and self.clock() - self._beat > LOOP_STALL_S:
            return False
        t = self._work_thread
        return t is None or t.is_alive()

    def request_stop(self) -> None:
        """Ask the loop to stop (what SIGTERM does); safe from any thread."""
        self.stop_requested = True
        self.waker.wake()
        self.control.wake()

    def request_reload(self) -> None:
        """Ask the loop to reload the settings (what SIGHUP does)."""
        self.reload_requested = True
        self.waker.wake()

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum: int, _frame: Any) -> None:  # only flags: the loop does the work
            if signum == signal.SIGHUP:
                self.reload_requested = True
            else:
                self.stop_requested = True
            self.waker.wake()
            self.control.wake()

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, on_signal)
        self._old_wakeup_fd = signal.set_wakeup_fd(self.control.write_fd(), warn_on_full_buffer=False)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        if self._old_wakeup_fd is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd)
            self._old_wakeup_fd = None

    # -- the loop --------------------------------------------------------------------------------

    def step(self, *, block: bool = True, max_wait_s: float | None = None, ping: bool = True) -> None:
        """One loop iteration: wait for a wake-up or the next deadline (``block``; at most
        ``max_wait_s`` seconds if given), then handle finished jobs and hints, a reload, a due
        reconcile, the next job, the snapshot, the status and (``ping``; :meth:`run` pings from the
        main thread instead) the watchdog ping. Never raises for one failing part (logged, counted;
        a database another process keeps locked is not counted against the loop's health)."""
        wait = self._timeout() if block else 0.0
        if max_wait_s is not None:
            wait = min(wait, max_wait_s)
        self.waker.wait(wait)
        self._beat = self.clock()
        self._in_step = True
        try:
            self._step()
        finally:
            self._beat = self.clock()
            self._in_step = False
        if ping:
            self._ping()

    def _step(self) -> None:
        self._step_failed = False
        if not self._store_file_intact():
            return
        self._guard(self._drain_events)
        if self.stop_requested:
            return
        if self.reload_requested:
            self._guard(self._reload)
        now = self.clock()
        if self.debouncer.due(now) or now >= self._next_rescan:
            self._guard(self.reconcile)
        if self._unsaved is not None and self.clock() >= self._retry_at:
            self._guard(self._save_unsaved)
        if self._unsaved_failure is not None and self.clock() >= self._retry_at:
            self._guard(self._save_failure)
        if self.clock() >= self._next_beat:
            self._guard(self._renew_lease)
        self._guard(self._start_next)
        self._guard(self._maybe_snapshot)
        self._guard(self._send_status)
        self._errors = self._errors + 1 if self._step_failed else 0

    def _guard(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except StoreError as exc:
            if _connection_error(exc):  # an outage is not a broken loop: logged once, not counted
                self._database_down(exc)
                return
            self._step_failed = True
            log.error("%s: %s", type(exc).__name__, exc)
        except Exception as exc:
            self._step_failed = True
            if isinstance(exc, TunerError):
                log.error("%s: %s", type(exc).__name__, exc)
            else:
                log.exception("unexpected error in the main loop (continuing)")

    def _timeout(self) -> float:
        now = self.clock()
        deadlines = [self._next_rescan, now + MAX_WAIT_S, self._next_beat]
        d = self.debouncer.deadline()
        if d is not None:
            deadlines.append(d)
        if self._unsaved is not None or self._unsaved_failure is not None:
            deadlines.append(self._retry_at)
        if self.notifier.watchdog_interval_s:
            deadlines.append(self._next_ping)
        if self._snapshot_dirty:
            deadlines.append(self._last_snapshot + SNAPSHOT_MIN_INTERVAL_S)
        if self._running is None:
            deadlines.append(self._next_job_poll)
            if self._next_retry is not None:
                deadlines.append(self._next_retry)
        return max(0.0, min(deadlines) - now)

    def _ping(self, *, quarter: bool = False) -> None:
        interval = self.notifier.watchdog_interval_s
        if not interval or not self.healthy():
            return
        now = self.clock()
        if now >= self._next_ping:
            self.notifier.watchdog()
            self._next_ping = now + interval / (4 if quarter else 2)

    def _note_retry(self) -> None:
        """Remember (on the monotonic clock) when the next backed-off job becomes due."""
        at = self.queue.next_retry_at() if self.queue is not None else None
        if at is None:
            self._next_retry = None
            return
        from datetime import datetime

        delta = datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp() - self.wall_clock()
        self._next_retry = self.clock() + max(0.0, delta)

    def _drain_events(self) -> None:
        now = self.clock()
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return
            kind = ev[0]
            if kind == "hint":
                self.debouncer.hint(now)
            elif kind == "pid":
                self.queue.set_worker_pid(ev[1], ev[2])
            elif kind == "done":
                self._finish(*ev[1:])

    # -- reconcile -------------------------------------------------------------------------------

    def _renew_lease(self) -> None:  # work thread (``_beat`` is the loop's progress time)
        """Renew this daemon's lease and return expired owners' running jobs to the queue (the
        attempt their crash cost not counted, retried with backoff)."""
        s = self.settings
        self._next_beat = self.clock() + s.lease_s / 3
        fleet.renew_lease(self.store, self.owner.id, lease_s=s.lease_s, wall_clock=self.wall_clock)
        requeued, failed = self.queue.recover(backoff_base_s=s.retry_backoff_s, backoff_max_s=s.retry_backoff_max_s,
                                              now=self._utc_now(), include_own=False, keep=self._held_job_ids())
        for job in requeued + failed:
            if job.owner_id == self.owner.id:
                log.warning("job %d (%s) was claimed but never started (the database connection was lost as the "
                            "claim committed); queued again (not counted)", job.id, job.path)
                self._next_job_poll = self.clock()
                continue
            log.warning("job %d (%s) of host id %d was running when its lease expired: %s", job.id, job.path,
                        job.owner_id, "queued again for its successor" if job in requeued else "failed")

    def _held_job_ids(self) -> set[int]:
        """Ids of the jobs this daemon holds: the one running, the finished ones whose result or
        failure waits to be written. Any other ``running`` job of this owner is stranded."""
        held = {r.job.id for r in (self._running,) if r is not None}
        held |= {u[0].id for u in (self._unsaved, self._unsaved_failure) if u is not None}
        return held

    def reconcile(self) -> None:
        """Scan ``watch_dir`` and bring the jobs table in line with it by content hash.

        Files still being written (modified less than ``debounce_s`` ago) are left for the next
        pass; when the directory itself cannot be listed nothing is retired. When the database
        cannot be reached the scan is tried again after :data:`DB_RETRY_S` seconds (the files are
        the queue meanwhile: whatever changed is queued once it answers).
        """
        try:
            self._reconcile()
        except StoreError:
            self._next_rescan = self.clock() + DB_RETRY_S
            raise
        if self._db_down_logged:
            self._db_down_logged = False
            log.info("database reachable again; caught up with %s", self.settings.watch_dir)

    def _database_down(self, exc: StoreError) -> None:
        """The database cannot be reached (or is locked past ``busy_timeout``): say so once per
        outage, keep watching, scan again in :data:`DB_RETRY_S` seconds. Finished results stay in
        memory meanwhile (:meth:`_save_unsaved` retries); the watchdog keeps being fed."""
        self._next_rescan = min(self._next_rescan, self.clock() + DB_RETRY_S)
        if not self._db_down_logged:
            self._db_down_logged = True
            log.error("database unavailable (%s); still watching %s, drops are queued once it is back",
                      _one_line(exc, 300), self.settings.watch_dir)

    def _reconcile(self) -> None:
        s = self.settings
        now = self.clock()
        self.reconciles += 1
        self.debouncer.clear()
        self._next_rescan = now + s.rescan_interval_s
        self.watcher.ensure()
        sc = scan(s.watch_dir, now=self.wall_clock(), settle_s=s.debounce_s)
        if sc.settling:
            self.debouncer.hint(now)
        current = self.queue.current()
        root = os.path.abspath(s.watch_dir)
        # paths outside watch_dir (it changed on SIGHUP) are gone even while the new one cannot be listed
        outside = {p for p in current if not _inside(p, root)}
        gone = (set(current) - set(sc.files) - sc.settling) if sc.ok else outside
        moved = self._find_moves(current, sc.files, gone)
        for old, new in sorted(moved.items()):
            names = self.queue.move_path(old, new)
            log.info("drop file %s moved to %s: %s kept (same content and name; nothing profiled again)",
                     old, new, ", ".join(names) or "its job")
            self._sync_proposals(names)
            self._snapshot_dirty = self._status_dirty = True
            current[new] = current.pop(old)
            gone.discard(old)
        for path, state in sc.files.items():
            cur = current.get(path)
            if cur is not None and cur.content_sha256 == state.sha256:
                continue
            self._admit(path, state, changed=cur is not None)
        self._warn_duplicate_names(sc.files, sc.settling)
        if not sc.ok:
            log.warning("%s: %s; no drop is retired until it can be listed", s.watch_dir, sc.problem)
        for path in sorted(gone):
            names = self.queue.retire_path(path)
            what = (f"retired {', '.join(names)} (results kept)" if names else
                    "its job retired (it had no results)")  # not "retired no results yet (results kept)"
            if path in outside:
                log.info("drop file %s is no longer under watch_dir %s: %s", path, root, what)
            else:
                log.info("drop file %s deleted: %s", path, what)
            self._sync_proposals(names)
            self._snapshot_dirty = self._status_dirty = True
        self._sync_outputs()

    def _find_moves(self, current: dict[str, Job], files: dict[str, FileState], gone: set[str]) -> dict[str, str]:
        """Old path → new path for drops that moved: a file gone from its path whose exact bytes
        (hence its ``name``) appear at a path with no job yet, and whose ``model`` resolves to the
        same place from there (a relative model path moved to another directory is a new drop)."""
        by_sha: dict[str, list[str]] = {}
        for path in sorted(gone):
            job = current[path]
            if job.status != "cancelled":
                by_sha.setdefault(job.content_sha256, []).append(path)
        moves: dict[str, str] = {}
        for path, state in sorted(files.items()):
            if path in current or state.raw is None or state.error is not None:
                continue
            olds = by_sha.get(state.sha256)
            if not olds:
                continue
            for old in olds:
                if self._model_key(old, state.raw) == self._model_key(path, state.raw):
                    moves[old] = path
                    olds.remove(old)
                    break
        return moves

    def _model_key(self, path: str, raw: bytes) -> str | None:
        try:
            model = str(self._parsed(path, raw)[0].model)
        except DropError:
            return None
        if os.path.isabs(model):
            return os.path.realpath(model)
        local = os.path.join(os.path.dirname(path), model)
        return os.path.realpath(local) if os.path.exists(local) else model

    def _sync_outputs(self) -> None:
        """Derive the outputs from the committed rows: (re)write each active drop's proposal
        file that is missing or does not hold its newest drop row, remove files of names with no
        active drop, and schedule a snapshot when it is missing. Unchanged files cost one stat."""
        directory = self.settings.proposals_dir
        active = self.queue.active_drops()
        for name, drop_id in sorted(active.items()):
            dest = proposal_path(directory, name)
            key = self._file_key(dest, drop_id)
            if key is not None and self._written.get(name) == key:
                continue
            why = "missing" if key is None else self._proposal_file_problem(dest, drop_id)
            if why is None:
                self._written[name] = key  # type: ignore[assignment]
                continue
            try:
                doc = proposal_document(self.store, drop_id)
                written = write_proposal_file(directory, doc)
            except OSError as exc:
                self._state_dir_failed(f"proposal file of {name}", exc)
                continue
            self._state_dir_ok()
            self._written[name] = self._file_key(written, drop_id)  # type: ignore[assignment]
            log.info("drop %s: proposal file %s re-derived from the store (it was %s; drop id %d): %s", name,
                     written, why, drop_id, _proposal_summary(doc["proposals"]))
        try:
            leftovers = [e for e in os.scandir(directory) if e.name.endswith(".yaml") and not e.name.startswith(".")
                         and e.is_file(follow_symlinks=False) and e.name[:-5] not in active]
        except OSError:
            leftovers = []
        for e in leftovers:
            try:
                os.unlink(e.path)
                self._written.pop(e.name[:-5], None)
                log.info("proposal file %s removed: no active drop has that name", e.path)
            except OSError:
                pass
        db = self.store.engine.url
        if db.get_backend_name() == "sqlite" and db.database and not self.settings.snapshot_file.exists():
            self._snapshot_dirty = True
        self._sync_failures()

    def _sync_failures(self) -> None:
        """``proposals/failed/NAME.yaml`` per failed drop (its reason; read-only for operators),
        removed once the drop succeeds, is retried or deleted (:mod:`tuner.daemon.failures`)."""
        from tuner.daemon.failures import failed_drops, sync_failure_files

        try:
            with self.store.reader.connect() as conn:
                failures = failed_drops(conn, self.queue.owner_id)
            written, removed = sync_failure_files(self.settings.proposals_dir, failures)
        except OSError as exc:
            log.error("%s: cannot write failed-drop files: %s", self.settings.proposals_dir, exc.strerror or exc)
            return
        for path in written:
            log.info("failed drop written to %s", path)
        for path in removed:
            log.info("failed-drop file %s removed (the drop no longer fails)", path)

    @staticmethod
    def _file_key(path: Path, drop_id: int) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (drop_id, st.st_ino, st.st_mtime_ns, st.st_size)

    @staticmethod
    def _proposal_file_problem(path: Path, drop_id: int) -> str | None:
        """None when the file at ``path`` is a proposal of drop row ``drop_id``; else why not."""
        try:
            with open(path, "rb") as fh:
                raw = fh.read(MAX_PROPOSAL_FILE_BYTES + 1)
            if len(raw) > MAX_PROPOSAL_FILE_BYTES:
                return "oversized"
            doc = yaml.load(raw, Loader=_LOADER)
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            return "unreadable"
        if not isinstance(doc, dict) or doc.get("drop_id") != drop_id or "proposals" not in doc:
            return "stale"
        return None

    def _warn_duplicate_names(self, files: dict[str, FileState], settling: set[str]) -> None:
        """Log a WARNING (once per set of files) when drops in different files share a ``name``:
        their results are keyed by name, so the files overwrite each other's proposal."""
        names = {p: v for p, v in self._names.items() if p in settling}  # unchanged until they settle
        for path, state in files.items():
            if state.raw is None or state.error is not None:
                continue
            cached = self._names.get(path)
            if cached is not None and cached[0] == state.sha256:
                names[path] = cached
                continue
            try:
                name: str | None = self._parsed(path, state.raw)[0].name
            except DropError:
                name = None
            names[path] = (state.sha256, name)
        self._names = names
        by_name: dict[str, list[str]] = {}
        for path, (_sha, name) in names.items():
            if name is not None:
                by_name.setdefault(name, []).append(path)
        dups = {name: tuple(sorted(paths)) for name, paths in by_name.items() if len(paths) > 1}
        for name, paths in sorted(dups.items()):
            if self._dup_warned.get(name) != paths:
                log.warning("drops %s all have name %r: they share one result history and one proposal file "
                            "(the last job to finish wins); give each a distinct name", " and ".join(paths), name)
        self._dup_warned = dups

    #: Parsed drops kept (path and content hash → the drop and its stated keys, or its error).
    _PARSED_MAX = 4096

    def _parsed(self, path: str, raw: bytes) -> tuple[Drop, frozenset]:
        """:func:`tuner.question.drop.parse_drop_keys` of one file's bytes, once per (path, content): the
        duplicate-name check, the move detection, admission and the job's start all read the
        same parse (a new drop's bytes are parsed once).

        Raises:
            DropError: the drop is invalid (the same error each time it is asked).
        """
        key = (path, hashlib.sha256(raw).hexdigest())
        cache = self._parsed_drops
        hit = cache.get(key)
        if hit is None:
            try:
                hit = parse_drop_keys(raw, path, worker_python=self.settings.worker_python)
            except DropError as exc:
                hit = exc
            if len(cache) >= self._PARSED_MAX:
                cache.clear()
            cache[key] = hit
        if isinstance(hit, DropError):
            raise hit
        return hit

    def _parse(self, path: str, raw: bytes) -> Drop:
        drop, keys = self._parsed(path, raw)
        if "method" not in keys:
            drop = replace(drop, method=self.settings.default_method)
        return drop

    def _method_defaulted(self, raw: bytes, path: str = "") -> bool:
        """True when the drop sets no ``method`` (the settings' ``default_method`` applies).
        Only called on bytes :func:`parse_drop` accepted (bounded, safe YAML mapping)."""
        try:
            return "method" not in self._parsed(path, raw)[1]
        except DropError:
            return True

    @staticmethod
    def _invalid_drop_name(path: str, raw: bytes | None) -> str:
        """The name an invalid drop's job is stored under (``jobs.name``, what ``retry`` and
        ``results`` find it by): the YAML mapping's ``name`` when the bytes load as one with a
        string name, else the file stem."""
        stem = os.path.splitext(os.path.basename(path))[0] or path
        if raw is None:
            return stem
        try:
            data = yaml.load(raw, Loader=_LOADER)
        except (yaml.YAMLError, ValueError, RecursionError):
            return stem
        name = data.get("name") if isinstance(data, dict) else None
        return name.strip()[:128] if isinstance(name, str) and name.strip() else stem

    def _admit(self, path: str, state: FileState, *, changed: bool) -> None:
        self._status_dirty = self._snapshot_dirty = True
        if state.error is not None:
            err = DropError(state.error, path=path)
            job = self.queue.record_invalid(path, state.sha256, None, err, name=self._invalid_drop_name(path, None))
            log.error("invalid drop %s (job %d failed)", _one_line(err), job.id)
            self._sync_failures()
            return
        assert state.raw is not None
        text = state.raw.decode("utf-8", "replace")
        try:
            drop = self._parse(path, state.raw)
        except DropError as err:
            job = self.queue.record_invalid(path, state.sha256, text, err,
                                            name=self._invalid_drop_name(path, state.raw))
            log.error("invalid drop %s (job %d failed)", _one_line(err), job.id)
            self._sync_failures()
            return
        job = self.queue.enqueue(path, state.sha256, text, name=drop.name)
        log.info("drop %s %s: job %d queued", path, "changed" if changed else "found", job.id)

    # -- jobs ------------------------------------------------------------------------------------

    def _start_next(self) -> None:
        if (self._running is not None or self._unsaved is not None or self._unsaved_failure is not None
                or self.stop_requested):
            return
        now = self.clock()
        self._next_job_poll = now + JOB_POLL_S
        if not self.queue.has_due(self._utc_now()):  # a read: an idle loop takes no write lock
            return
        job = self.queue.claim_next(now=self._utc_now())
        if job is None:
            return
        self._status_dirty = True
        try:
            drop = self._parse(job.path, (job.content or "").encode("utf-8"))
        except DropError as err:  # cannot happen for a job admitted by reconcile; kept for old rows
            self.queue.fail(job.id, err)
            log.error("invalid drop %s (job %d failed)", err, job.id)
            return
        defaulted = self._method_defaulted((job.content or "").encode("utf-8"), job.path)
        thread = threading.Thread(target=self._execute, args=(job, drop, self.settings, defaulted),
                                  name=f"ctx-tuner-job-{job.id}", daemon=True)
        self._running = _Running(job, drop, thread, self.clock())
        log.info("drop %s: job %d started (attempt %d)", job.path, job.id, job.attempts)
        thread.start()

    def _utc_now(self):
        from datetime import datetime, timezone

        return datetime.fromtimestamp(self.wall_clock(), timezone.utc)

    def _popen(self, args: Any, **kw: Any) -> subprocess.Popen:  # job thread
        """Start a worker (one-shot or warm) for the running job: without systemd's notify
        variables, in the working directory ``/`` (every path a daemon's request names is
        absolute: nothing of the directory the daemon was started from is read or imported; the
        environment has ``PYTHONSAFEPATH``, :func:`tuner.seam.worker.worker_env`)."""
        env = {k: v for k, v in (kw.pop("env", None) or os.environ).items() if k not in NOTIFY_ENV}
        kw.setdefault("cwd", "/")
        if isinstance(args, (list, tuple)) and args and os.sep in str(args[0]) and not os.path.isabs(str(args[0])):
            args = [os.path.abspath(str(args[0])), *args[1:]]  # a relative worker_python, from here
        with self._lock:
            r = self._running
            if self.stop_requested or r is None:
                raise WorkerError("daemon is stopping; worker not started")
            proc = self._popen_fn(args, env=env, **kw)
            r.proc = proc
        self.events.put(("pid", r.job.id, proc.pid))
        self.waker.wake()
        return proc

    def _attach(self, proc: subprocess.Popen) -> None:  # job thread: the warm worker takes this job
        with self._lock:
            r = self._running
            if self.stop_requested or r is None:
                raise WorkerError("daemon is stopping; worker not started")
            r.proc = proc
        self.events.put(("pid", r.job.id, proc.pid))
        self.waker.wake()

    def _reader(self, s: Settings) -> Store:  # job thread
        """The job thread's read-only store (SQLite ``mode=ro`` or read-only server sessions; the
        main loop owns every write), opened at the first job and kept for the next ones (an open
        costs an engine, a connection and a schema check: tens of ms a job). A daemon that was
        not started (a tool, a test) opens one per call; the caller closes it then.

        Raises:
            StoreError: the store cannot be opened (tried again at the next job).
        """
        if not self.started:
            return open_store(s.db_url, readonly=True)
        with self._lock:
            store = self._ro_store
        if store is None:
            store = open_store(s.db_url, readonly=True)
            with self._lock:
                if self._closed:
                    store.close()
                    raise StoreError("daemon is stopping", where=store.where)
                self._ro_store = store
        return store

    def _close_reader(self) -> None:
        with self._lock:
            store, self._ro_store = self._ro_store, None
        if store is not None:
            store.close()

    def _lookups(self, request: dict, s: Settings, memo: dict | None = None,
                 python: str | None = None) -> tuple[dict | None, str | None, int | None]:  # job thread
        """Read-only look-ups before a pass, through the job thread's read-only store
        (:meth:`_reader`): the corrections from
        measured runs of the same model, device kind and era, whichever host stored them
        (:func:`tuner.jobs.app.lookup_calibration`; simulate only), then the shared result key
        (:func:`tuner.store.fleet.result_key`) and the drop that already holds that result, if any.
        With a ``memo`` dict (setting ``pass_memo``) it is filled with the pass memo's entries for
        the request (:func:`tuner.jobs.memoanswer.lookup_entries`, where :func:`~tuner.jobs.memoanswer.memo_applies`
        for ``python``) from the same store.
        Returns (calibration, result key, source drop id); a store that cannot be read gives
        (None, key, None) — the pass runs."""
        from tuner.jobs.app import lookup_calibration

        cal = key = None
        try:
            store = self._reader(s)
        except TunerError as exc:
            log.warning("calibration and shared results skipped for %s: %s", request.get("config_path"), exc)
            store = None
        try:
            if store is not None and request.get("method") == "simulate":
                try:
                    cal = lookup_calibration(request, store)
                except TunerError as exc:
                    log.warning("calibration skipped for %s: %s", request.get("config_path"), exc)
            if cal is not None:
                request["calibration"] = cal
            try:
                key = fleet.result_key(request)
            except TunerError as exc:
                log.warning("no shared result key for %s: %s", request.get("config_path"), exc)
                return cal, None, None
            if store is None:
                return cal, key, None
            try:
                source = fleet.find_shared_result(store, key)
            except TunerError as exc:
                log.warning("shared results skipped for %s: %s", request.get("config_path"), exc)
                return cal, key, None
            if source is None and memo is not None and memoanswer.memo_applies(request, python):
                try:
                    memo.update(memoanswer.lookup_entries(store, request))
                except TunerError:
                    pass  # no memo answer: the worker runs the job (and reports a bad config itself)
            return cal, key, source
        finally:
            if store is not None and not self.started:
                store.close()

    @staticmethod
    def _memo_first(entries: dict, inner: Callable[..., dict]) -> Callable[..., dict]:
        """The worker call behind the pass memo (as :func:`tuner.jobs.memoanswer.memo_worker` without
        ``write``, from ``entries`` already read): a job whose passes are all in ``entries`` is
        answered here, with no worker and no torch; else ``inner`` runs it, handed the passes found."""

        def worker(request: dict, **kw: Any) -> dict:
            hits: dict = {}
            if entries:
                result, hits = memoanswer.answer_from_memo(request, entries, kw.get("on_progress"))
                if result is not None:
                    result[memoanswer.PASS_SOURCE] = {"source": "memo", "stored_passes": len(hits),
                                                      "computed_passes": 0,
                                                      **(result.get(memoanswer.PASS_SOURCE) or {})}
                    return result
                if hits:
                    request = {**request, passmemo.KNOWN_PASSES: hits}
            # the stored engine cross-checks (tuner.engine.stored): the warm worker runs one only where none is current
            request = memoanswer.with_crosschecks(request, entries)
            result = inner(request, **kw)
            if isinstance(result, dict):
                new = result.get(passmemo.ENTRIES)
                computed = (sum(1 for e in new if e.get("kind") == passmemo.PASS)
                            if isinstance(new, list) else None)
                result[memoanswer.PASS_SOURCE] = {"source": "worker", "stored_passes": len(hits),
                                                  "computed_passes": computed,
                                                  "reason": "missing"}
            return result

        return worker

    def _execute(self, job: Job, drop: Drop, s: Settings,
                 method_defaulted: bool = False) -> None:  # job thread: writes nothing
        started = utc_text()
        try:
            try:
                request, dev = prepare_request(drop, nvml=self.nvml, trust_remote_code=s.allow_trust_remote_code,
                                               download=bool(getattr(s, "allow_hub_download", False)))
            except DropError as exc:
                if method_defaulted and exc.field == "method":
                    # the drop has no `method` key: say where the method really came from
                    raise SettingsError(
                        f"default_method {drop.method!r} applies to {drop.path} (the drop sets no `method`), "
                        f"but {exc.message}; set `method` in the drop or change default_method",
                        path=s.source or "settings", field="default_method") from exc
                raise
            if getattr(s, "model_roots", None):  # before anything of the model file is read (tuner.model.modelroots)
                from tuner.model.modelroots import check_model_roots

                check_model_roots([("model", request.get("config_path")),
                                   ("speculative_config.model", request.get("draft_config_path"))],
                                  s.model_roots, drop_path=drop.path)
            python = s.python_for(drop.engine_version)
            memo: dict | None = {} if getattr(s, "pass_memo", True) else None
            # calibration, shared result and pass memo entries (the job thread's read-only store)
            _cal, key, source = self._lookups(request, s, memo, python)
            if source is not None:
                outcome: Any = SharedResult(drop, dev, source, key, job.content)
            else:
                # the memory limit covers simulate passes (CPU only); a cuda/vllm worker maps device
                # memory and is bounded by the unit's MemoryMax= and its oom_score_adj instead
                limit = s.worker_memory_limit if request.get("method") == "simulate" else None
                # the pass memo first (answered here, no worker, no torch: tuner.jobs.passmemo), else the worker
                inner = self.worker
                if (inner is run_in_worker and request.get("method") == "simulate" and s.worker_max_jobs > 1
                        and s.python_for(drop.engine_version) == s.worker_python):
                    # one warm worker for successive simulate jobs (cuda/vllm measure from a fresh process;
                    # an engine_pythons venv gets a fresh worker per job)
                    inner = functools.partial(self.warm.run, max_jobs=s.worker_max_jobs,
                                              max_rss_bytes=s.worker_max_rss_bytes, attach=self._attach)
                run = self._memo_first(memo or {}, inner)
                result = run(request, job=f"{drop.name} (job {job.id})", timeout_s=s.job_timeout_s,
                             python=python, popen=self._popen, memory_max_bytes=limit)
                memo_entries = result.pop(passmemo.ENTRIES, None) or []
                outcome = ProfileOutcome(drop, dev, result, warnings=list(result.get("warnings", [])),
                                         content=job.content)
                outcome.result_sha256 = key
                outcome.memo_entries = memo_entries
        except TunerError as exc:
            outcome = exc
        except Exception as exc:  # a bug or a broken injected worker: the job fails, the daemon lives
            outcome = TunerError(f"unexpected {type(exc).__name__}: {exc}", where=drop.name)
        self.events.put(("done", job, outcome, started))
        self.waker.wake()

    def _finish(self, job: Job, outcome: Any, started: str) -> None:
        r = self._running
        if r is not None and r.job.id == job.id:
            r.thread.join(timeout=5)
            self._running = None
        self._status_dirty = self._snapshot_dirty = True
        if isinstance(outcome, BaseException):
            if r is not None and r.killed:
                return  # killed by shutdown(): requeued there
            self._unsaved_failure = (job, outcome, started)
            self._save_failure()
            return
        self._unsaved = (job, outcome, started)
        self._save_unsaved()

    def _save_failure(self) -> None:
        """Write a finished job's failure (kept in ``_unsaved_failure`` until it is written: with
        the database down it is tried again every :data:`SAVE_RETRY_S`, as results are)."""
        assert self._unsaved_failure is not None
        job, outcome, _started = self._unsaved_failure
        s = self.settings
        if not self._store_file_intact():
            return
        try:
            row = self.queue.fail(job.id, outcome, max_attempts=s.max_attempts, backoff_base_s=s.retry_backoff_s,
                                  backoff_max_s=s.retry_backoff_max_s, now=self._utc_now())
        except StoreError:
            self._retry_at = self.clock() + SAVE_RETRY_S
            raise
        self._unsaved_failure = None
        self._sync_failures()
        what = f"{type(outcome).__name__}: {_one_line(outcome)}"
        if row is not None and row.status == "pending":
            log.warning("drop %s: job %d run failed (attempt %d of %d), retried at %s: %s", job.path, job.id,
                        row.attempts, s.max_attempts, row.retry_at, what)
            self._note_retry()
        elif failure_kind(outcome) == "run":
            log.error("drop %s: job %d failed: %s (run failure: gave up after %d attempts; "
                      "`ctx-tuner retry %s` runs it again)", job.path, job.id, what,
                      row.attempts if row else job.attempts, job.name or Path(job.path).stem)
        else:
            log.error("drop %s: job %d failed: %s (invalid input: final until the file changes)", job.path,
                      job.id, what)

    def _save_unsaved(self) -> None:
        assert self._unsaved is not None
        job, outcome, started = self._unsaved
        if not self._store_file_intact():
            return  # kept in memory: the daemon stops; the job runs again after the restart
        try:
            drop_row, runs, cands, props = self._rows(outcome, started)
            memo_entries = getattr(outcome, "memo_entries", None) or []

            def also(conn, did: int) -> None:
                self.queue.complete_in(conn, job.id, did)
                self.store.put_memo(memo_entries, conn)  # the worker's new passes, for every later drop

            drop_id = self.store.save_result(drop_row, runs, cands, props, also=also)
        except JobNotRunning as exc:
            self._unsaved = None
            log.warning("drop %s: %s", job.path, exc)
            return
        except StoreError:
            self._retry_at = self.clock() + SAVE_RETRY_S
            raise
        self._unsaved = None
        outcome.drop_id = drop_id
        self._snapshot_dirty = self._status_dirty = True
        names = {outcome.drop.name} | set(self.queue.drop_names_for_path(job.path))
        if _AFTER_COMMIT_HOOK is not None:
            _AFTER_COMMIT_HOOK(job, drop_id)
        written = self._sync_proposals(names)
        props = _proposal_summary(outcome.result.get("proposals", []))
        where = written.get(outcome.drop.name)
        shared = (f" (shared result of drop id {outcome.source_drop_id}, no worker)"
                  if isinstance(outcome, SharedResult) else "")
        warns = getattr(outcome, "warnings", None) or []
        log.info("drop %s (%s): job %d done, drop id %d%s: %s%s%s", outcome.drop.name, job.path, job.id, drop_id,
                 shared, props or "no proposals", f"; proposal file {where}" if where else "",
                 f"; {len(warns)} warning(s): " + "; ".join(_one_line(Exception(w), 300) for w in warns) if warns else "")

    def _rows(self, outcome: Any, started: str) -> tuple[dict, list, list, list]:
        """The rows to store for a finished job: the worker's result, or a copy of the shared
        result's rows under this drop (``answered_from_drop_id`` naming the original, its
        warnings kept)."""
        if isinstance(outcome, SharedResult):
            shell = ProfileOutcome(outcome.drop, outcome.device, {"runs": [], "candidates": [], "proposals": []},
                                   content=outcome.content)
            drop_row = rows_for_store(shell, started_at=started)[0]
            runs, cands, props = fleet.shared_rows(self.store, outcome.source_drop_id)
            runs = [{**r, "model": outcome.drop.model} for r in runs]  # this drop's model spelling
            outcome.result = {"proposals": props}
            warnings = records.drop_warnings(self.store, outcome.source_drop_id)
            try:
                outcome.warnings = [str(w) for w in json.loads(warnings)] if warnings else []
            except (ValueError, TypeError):
                outcome.warnings = []
            return ({**drop_row, "result_sha256": outcome.result_sha256, "warnings": warnings,
                     "answered_from_drop_id": outcome.source_drop_id}, runs, cands, props)
        drop_row, runs, cands, props = rows_for_store(outcome, started_at=started)
        key = getattr(outcome, "result_sha256", None)
        return ({**drop_row, "result_sha256": key} if key else drop_row), runs, cands, props

    def _sync_proposals(self, names: Any) -> dict[str, Path]:
        """Write the proposal file of each name's active drop; remove those with none."""
        active = self.queue.active_drop_ids(names)
        written = {}
        for name in sorted(set(names)):
            try:
                if name in active:
                    written[name] = write_proposal_file(self.settings.proposals_dir,
                                                        proposal_document(self.store, active[name]))
                    self._state_dir_ok()
                    key = self._file_key(written[name], active[name])
                    if key is not None:
                        self._written[name] = key
                else:
                    self._written.pop(name, None)
                    if remove_proposal_file(self.settings.proposals_dir, name):
                        log.info("proposal file for %s removed (drop retired)", name)
            except OSError as exc:
                self._state_dir_failed(f"proposal file of {name}", exc)
        return written

    # -- orphans, snapshot, status, reload -------------------------------------------------------

    def _kill_orphan(self, job: Job) -> None:
        """Kill the worker group a crashed daemon left behind (checked to be a ctx-tuner worker)."""
        pid = job.worker_pid
        if not pid:
            return
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"tuner.commands.worker_main" not in cmdline or os.getpgid(pid) != pid:
                return
            self.killpg(pid, signal.SIGKILL)
            log.warning("killed orphaned worker process group %d of job %d", pid, job.id)
        except (OSError, ProcessLookupError):
            pass

    def _maybe_snapshot(self) -> None:
        if self._snapshot_dirty and self.clock() - self._last_snapshot >= SNAPSHOT_MIN_INTERVAL_S:
            self._snapshot()

    def _snapshot(self, *, force: bool = False) -> None:
        db = self.store.engine.url
        self._last_snapshot = self.clock()
        self._snapshot_dirty = False
        if db.get_backend_name() != "sqlite" or not db.database:
            return  # a server database has no snapshot (and must not leave a past deadline armed)
        try:
            write_snapshot(db.database, self.settings.snapshot_file)
        except StoreError as exc:
            if state_dir_condition(exc) is None:
                raise
            self._snapshot_dirty = True  # tried again every SNAPSHOT_MIN_INTERVAL_S: the end is noticed
            self._state_dir_failed("snapshot", exc)
            return
        self._state_dir_ok()

    def _state_dir_failed(self, what: str, exc: BaseException) -> None:
        """A write under ``state_dir`` failed (a proposal file, the snapshot). A full or read-only
        filesystem, or a directory this user may not write, is a condition, not an event: one
        ERROR when it begins (naming it, and what could not be written) and one INFO when it ends
        (:meth:`_state_dir_ok`), as the database outage is; meanwhile DEBUG only, and the loop's
        health (the watchdog) is not charged. Another error is logged each time."""
        cond = state_dir_condition(exc)
        reason = _one_line(Exception(getattr(exc, "strerror", None) or exc), 300)
        if cond is None:
            log.error("%s: cannot write %s: %s", self.settings.state_dir, what, reason)
            return
        if self._state_problem == cond:
            log.debug("%s still %s: %s not written", self.settings.state_dir, cond, what)
            return
        self._state_problem = cond
        log.error("state_dir %s is %s (%s: %s); proposal files and the snapshot are not written until it is "
                  "fixed (results are kept in the store and the files written then)", self.settings.state_dir,
                  cond, what, reason)

    def _state_dir_ok(self) -> None:
        """A write under ``state_dir`` succeeded: the end of a condition :meth:`_state_dir_failed` logged."""
        if self._state_problem is not None:
            log.info("state_dir %s is writable again (it was %s); proposal files and the snapshot are written",
                     self.settings.state_dir, self._state_problem)
            self._state_problem = None

    def _status_text(self) -> str:
        r = self._running
        now = f"running {r.drop.name}" if r is not None else "idle"
        try:
            c = self.queue.counts()
        except StoreError as exc:
            if not _connection_error(exc):
                raise
            return f"{now}; database unavailable; watching {self.settings.watch_dir}"
        return (f"{now}; jobs: {c['pending']} pending, {c['done']} done, {c['failed']} failed; "
                f"watching {self.settings.watch_dir}")

    def _send_status(self) -> None:
        if not self._status_dirty:
            return
        self._status_dirty = False
        text = self._status_text()
        if text != self._last_status:
            self._last_status = text
            self.notifier.status(text)

    def _reload(self) -> None:
        self.reload_requested = False
        self.notifier.reloading()
        old = self.settings
        try:
            new = load_settings(old.source) if old.source else old
            for key in ("state_dir", "database_url", "snapshot_path"):
                if getattr(new, key) != getattr(old, key):
                    log.warning("setting %s changed: it takes effect after a restart", key)
                    new = replace(new, **{key: getattr(old, key)})
            check_layout(new)
        except SettingsError as exc:
            log.error("reload failed, keeping the current settings: %s", exc)
            self.notifier.ready(self._status_text())
            return
        logging.getLogger().setLevel(new.log_level_no)
        self.settings = new
        self.debouncer.quiet_s = new.debounce_s
        if new.watch_dir != old.watch_dir or new.host != old.host:  # a new owner identity
            if new.watch_dir != old.watch_dir:
                self.watcher.stop()
                self.watcher = self._make_watcher(new.watch_dir)
                self.watcher.start()
            old_owner = self.owner.id
            fleet.end_lease(self.store, self.owner.id, wall_clock=self.wall_clock)
            self._register(new)
            # the same daemon under its new identity: its unretired jobs and drops go with it, so
            # the scan below sees moves as moves and files outside the new watch_dir as retired
            taken = self.queue.take_over(old_owner)
            if taken:
                log.info("took over %d job(s) of the previous identity (hosts.id %d)", taken, old_owner)
        log.info("settings reloaded from %s", old.source or "defaults")
        self._status_dirty = True
        self.reconcile()
        self.notifier.ready(self._status_text())

    # -- shutdown --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop gracefully: STOPPING=1, kill the running worker group, put its job back to
        ``pending``, stop watching, final snapshot, close the store. Idempotent. Under
        :meth:`run` the database part happens in the work thread and is waited for at most
        :data:`STOP_GRACE_S`: with the database locked by another writer the daemon still exits
        at once, and the job left ``running`` is requeued (not counted) at the next start."""
        if self._closed:
            return
        self._closed = True
        self.stop_requested = True
        self.waker.wake()
        self.notifier.stopping("stopping")
        work = self._work_thread
        try:
            self._kill_running()
            self.warm.kill()  # the warm worker between jobs, too
            if work is None:
                self._stop_work()
            else:
                work.join(timeout=STOP_GRACE_S)
                self.work_stuck = work.is_alive()
                if work.is_alive():
                    self._note_stopped_jobs(self._held_job_ids())
                    self.watcher.stop()
                    log.warning("the database is busy (another writer holds its lock): stopping without waiting; "
                                "an interrupted job is requeued at the next start (not counted)")
        except Exception:
            log.exception("error while stopping")
        finally:
            if getattr(self, "_metrics", None) is not None:
                self._metrics.stop()
                self._metrics = None
            if self.store is not None and (work is None or not work.is_alive()):
                self.store.close()
            self._restore_signals()
            if work is None or not work.is_alive():
                self.waker.close()
            self.control.close()
            self.notifier.close()
            if self.started:  # a start-up that failed was never running: its error says it all
                log.info("stopped")

    def _kill_running(self) -> None:
        r = self._running
        if r is None:
            return
        with self._lock:
            r.killed = True
            proc = r.proc
        if proc is not None:
            try:
                self.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _stop_work(self) -> None:
        """The database part of stopping (work thread under :meth:`run`): wait for the killed
        job's thread, keep results that finished before the kill, requeue running jobs, snapshot."""
        try:
            self.watcher.stop()
            self._kill_running()
            r = self._running
            if r is not None:
                r.thread.join(timeout=30)
            held = self._held_job_ids()
            self._close_reader()
            self._drain_finished_at_stop()
            if self.queue is not None and self._store_replaced is None:
                try:
                    for job in self.queue.jobs("running"):  # this owner's only
                        self.queue.requeue(job.id)
                        log.info("job %d (%s) returned to the queue", job.id, job.path)
                        held.discard(job.id)
                    held.clear()
                    if self.owner is not None:
                        fleet.end_lease(self.store, self.owner.id, wall_clock=self.wall_clock)
                    if self._snapshot_dirty:
                        self._snapshot()
                except TunerError as exc:  # the store failing as we stop: one line, no traceback
                    self._note_stopped_jobs(held)
                    log.error("stopping without finishing the store's bookkeeping: %s: %s%s", type(exc).__name__,
                              _one_line(exc, 300),
                              f"; job(s) {', '.join(map(str, sorted(held)))} go back to the queue at the next start "
                              "(not counted)" if held else "")
        except Exception:
            log.exception("error while stopping")

    def _drain_finished_at_stop(self) -> None:
        while True:
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                break
            if ev[0] == "done" and not isinstance(ev[2], BaseException):
                self._running = None
                self._unsaved = (ev[1], ev[2], ev[3])  # finished before the kill: keep the results
        if self._unsaved is not None and self.queue is not None:
            try:
                self._save_unsaved()
            except Exception as exc:
                log.error("results of job %d not saved at stop (it will run again): %s", self._unsaved[0].id, exc)

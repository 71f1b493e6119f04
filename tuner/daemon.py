"""The daemon: composition root and main loop of ``ctx-tuner daemon``.

:class:`Daemon` builds every collaborator from :class:`~tuner.settings.Settings` (store with
migrations, :class:`~tuner.jobqueue.JobQueue`, :class:`~tuner.watch.DropWatcher`,
:class:`~tuner.notify.Notifier`) and runs one loop in the main thread:

* filesystem events are hints: they only arm a :class:`~tuner.watch.Debouncer`; when it is due,
  or every ``rescan_interval_s``, :meth:`Daemon.reconcile` scans ``watch_dir`` and compares content
  hashes with the jobs table (new or changed content → a job; invalid content → a failed job with
  the typed error; a deleted file → its drops retired, results kept);
* one job at a time runs in a helper thread that only waits on the worker subprocess (own process
  group, killed on timeout); every database write happens in the main thread;
* results and the job's ``done`` mark are one transaction, then the proposal file is written and a
  log line printed; a read-only snapshot is refreshed;
* signals only set flags (``signal.set_wakeup_fd`` wakes the loop): SIGTERM/SIGINT stop gracefully
  (the running job's worker group is killed and the job goes back to ``pending``), SIGHUP reloads
  the settings. sd_notify: READY after migrations and the first scan, STATUS, WATCHDOG from the
  loop while healthy, RELOADING/READY around a reload, STOPPING.

Nothing here imports torch or transformers. Clocks, the worker call, ``Popen``, ``killpg`` and
the observer are injectable; one bad drop, broken worker or database hiccup is logged and the
loop goes on.
"""

from __future__ import annotations

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

import yaml

from tuner.app import ProfileOutcome, prepare_request, rows_for_store
from tuner.drop import Drop, parse_drop
from tuner.errors import DropError, SettingsError, StoreError, TunerError, WorkerError
from tuner.jobqueue import Job, JobNotRunning, JobQueue
from tuner.notify import NOTIFY_ENV, Notifier
from tuner.proposals import proposal_document, remove_proposal_file, write_proposal_file
from tuner.settings import Settings, check_worker_python, load_settings
from tuner.snapshot import write_snapshot
from tuner.store import Store, open_store, utc_text
from tuner.watch import Debouncer, DropWatcher, FileState, scan
from tuner.worker import run_in_worker

log = logging.getLogger("tuner.daemon")
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

#: Snapshots are refreshed at most this often while jobs keep finishing (seconds).
SNAPSHOT_MIN_INTERVAL_S = 5.0
#: After this many consecutive failing loop iterations the loop stops sending WATCHDOG=1.
UNHEALTHY_AFTER_ERRORS = 5
#: Wait before retrying a failed write of finished results (seconds).
SAVE_RETRY_S = 1.0
#: Longest the loop sleeps without a deadline (seconds).
MAX_WAIT_S = 30.0


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


def _inside(child: str, parent: str) -> bool:
    c, p = os.path.realpath(child), os.path.realpath(parent)
    return c == p or c.startswith(p.rstrip(os.sep) + os.sep)


def check_layout(settings: Settings) -> None:
    """Refuse a state directory inside ``watch_dir`` (proposal files would be read back as drops)
    and a ``worker_python`` that is not an executable (:func:`tuner.settings.check_worker_python`).

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
        raise SettingsError(f"state_dir {d} is not writable by this user", path=settings.source, field="state_dir")


class Daemon:
    """The service. ``run()`` for production; tests may call :meth:`start`, :meth:`step` and
    :meth:`shutdown` themselves (``step(block=False)`` with an injected ``clock`` needs no sleeps).

    Args:
        settings: validated settings.
        notifier: sd_notify sender (default: from ``$NOTIFY_SOCKET``).
        clock: monotonic seconds (debounce, rescans, watchdog pings); wall_clock: seconds since the
            epoch (compared with file mtimes).
        worker: ``worker(request, job=, timeout_s=, python=, popen=) -> result`` (default
            :func:`tuner.worker.run_in_worker`).
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
        self.nvml = nvml
        self.store: Store | None = None
        self.queue: JobQueue | None = None
        self.waker = Waker()
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.debouncer = Debouncer(settings.debounce_s)
        self.watcher = self._make_watcher(settings.watch_dir)
        self._lock = threading.Lock()
        self._running: _Running | None = None
        self._unsaved: tuple[Job, ProfileOutcome, str] | None = None
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
        self._dup_warned: dict[str, tuple[str, ...]] = {}

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
        self.notifier.status("migrating the database")
        self.store = self.store_factory(s.db_url)
        self.queue = JobQueue(self.store)
        requeued, failed = self.queue.recover(s.max_attempts)
        for job in requeued + failed:
            self._kill_orphan(job)
        for job in requeued:
            log.warning("job %d (%s) was interrupted by a daemon crash; queued again (attempt %d of %d next)",
                        job.id, job.path, job.attempts + 1, s.max_attempts)
        for job in failed:
            log.error("drop %s: job %d failed: interrupted %d times by daemon crashes; gave up",
                      job.path, job.id, job.attempts)
        self.watcher.start()
        self.reconcile()
        self._snapshot(force=True)
        self.started = True
        self.waker.wake()  # the first step starts a queued job at once
        self.notifier.ready(self._status_text())
        log.info("ready: watching %s, store %s", s.watch_dir, self.store.where)

    def run(self) -> int:
        """Start, loop until SIGTERM/SIGINT, shut down. Returns the exit status (0).

        Raises:
            SettingsError, StoreError: start-up failed (nothing is left running).
        """
        self._install_signals()
        try:
            self.start()
            while not self.stop_requested:
                self.step()
        finally:
            self.shutdown()
        return 0

    def request_stop(self) -> None:
        """Ask the loop to stop (what SIGTERM does); safe from any thread."""
        self.stop_requested = True
        self.waker.wake()

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

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, on_signal)
        self._old_wakeup_fd = signal.set_wakeup_fd(self.waker.write_fd(), warn_on_full_buffer=False)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()
        if self._old_wakeup_fd is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd)
            self._old_wakeup_fd = None

    # -- the loop --------------------------------------------------------------------------------

    def step(self, *, block: bool = True, max_wait_s: float | None = None) -> None:
        """One loop iteration: wait for a wake-up or the next deadline (``block``; at most
        ``max_wait_s`` seconds if given), then handle finished jobs and hints, a reload, a due
        reconcile, the next job, the snapshot, the status and the watchdog ping. Never raises for
        one failing part (logged, counted)."""
        wait = self._timeout() if block else 0.0
        if max_wait_s is not None:
            wait = min(wait, max_wait_s)
        self.waker.wait(wait)
        self._step_failed = False
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
        self._guard(self._start_next)
        self._guard(self._maybe_snapshot)
        self._guard(self._send_status)
        self._errors = self._errors + 1 if self._step_failed else 0
        self._ping()

    def _guard(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as exc:
            self._step_failed = True
            if isinstance(exc, TunerError):
                log.error("%s: %s", type(exc).__name__, exc)
            else:
                log.exception("unexpected error in the main loop (continuing)")

    def _timeout(self) -> float:
        now = self.clock()
        deadlines = [self._next_rescan, now + MAX_WAIT_S]
        d = self.debouncer.deadline()
        if d is not None:
            deadlines.append(d)
        if self._unsaved is not None:
            deadlines.append(self._retry_at)
        if self.notifier.watchdog_interval_s:
            deadlines.append(self._next_ping)
        if self._snapshot_dirty:
            deadlines.append(self._last_snapshot + SNAPSHOT_MIN_INTERVAL_S)
        return max(0.0, min(deadlines) - now)

    def _ping(self) -> None:
        interval = self.notifier.watchdog_interval_s
        if not interval or self._errors >= UNHEALTHY_AFTER_ERRORS:
            return
        now = self.clock()
        if now >= self._next_ping:
            self.notifier.watchdog()
            self._next_ping = now + interval / 2

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

    def reconcile(self) -> None:
        """Scan ``watch_dir`` and bring the jobs table in line with it by content hash.

        Files still being written (modified less than ``debounce_s`` ago) are left for the next
        pass; when the directory itself cannot be listed nothing is retired.
        """
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
        for path, state in sc.files.items():
            cur = current.get(path)
            if cur is not None and cur.content_sha256 == state.sha256:
                continue
            self._admit(path, state, changed=cur is not None)
        self._warn_duplicate_names(sc.files, sc.settling)
        if not sc.ok:
            log.warning("%s: %s; no drop is retired until it can be listed", s.watch_dir, sc.problem)
            return
        for path in sorted(set(current) - set(sc.files) - sc.settling):
            names = self.queue.retire_path(path)
            log.info("drop file %s deleted: retired %s (results kept)", path, ", ".join(names) or "no results yet")
            self._sync_proposals(names)
            self._snapshot_dirty = self._status_dirty = True

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
                name: str | None = parse_drop(state.raw, path).name
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

    def _parse(self, path: str, raw: bytes) -> Drop:
        drop = parse_drop(raw, path)
        if self._method_defaulted(raw):
            drop = replace(drop, method=self.settings.default_method)
        return drop

    @staticmethod
    def _method_defaulted(raw: bytes) -> bool:
        """True when the drop sets no ``method`` (the settings' ``default_method`` applies).
        Only called on bytes :func:`parse_drop` accepted (bounded, safe YAML mapping)."""
        data = yaml.load(raw, Loader=_LOADER)
        return not isinstance(data, dict) or "method" not in data

    def _admit(self, path: str, state: FileState, *, changed: bool) -> None:
        self._status_dirty = self._snapshot_dirty = True
        if state.error is not None:
            err = DropError(state.error, path=path)
            job = self.queue.record_invalid(path, state.sha256, None, err)
            log.error("invalid drop %s (job %d failed)", _one_line(err), job.id)
            return
        assert state.raw is not None
        text = state.raw.decode("utf-8", "replace")
        try:
            self._parse(path, state.raw)
        except DropError as err:
            job = self.queue.record_invalid(path, state.sha256, text, err)
            log.error("invalid drop %s (job %d failed)", _one_line(err), job.id)
            return
        job = self.queue.enqueue(path, state.sha256, text)
        log.info("drop %s %s: job %d queued", path, "changed" if changed else "found", job.id)

    # -- jobs ------------------------------------------------------------------------------------

    def _start_next(self) -> None:
        if self._running is not None or self._unsaved is not None or self.stop_requested:
            return
        job = self.queue.claim_next()
        if job is None:
            return
        self._status_dirty = True
        try:
            drop = self._parse(job.path, (job.content or "").encode("utf-8"))
        except DropError as err:  # cannot happen for a job admitted by reconcile; kept for old rows
            self.queue.fail(job.id, err)
            log.error("invalid drop %s (job %d failed)", err, job.id)
            return
        defaulted = self._method_defaulted((job.content or "").encode("utf-8"))
        thread = threading.Thread(target=self._execute, args=(job, drop, self.settings, defaulted),
                                  name=f"ctx-tuner-job-{job.id}", daemon=True)
        self._running = _Running(job, drop, thread, self.clock())
        log.info("drop %s: job %d started (attempt %d)", job.path, job.id, job.attempts)
        thread.start()

    def _popen(self, args: Any, **kw: Any) -> subprocess.Popen:  # job thread
        env = {k: v for k, v in (kw.pop("env", None) or os.environ).items() if k not in NOTIFY_ENV}
        with self._lock:
            r = self._running
            if self.stop_requested or r is None:
                raise WorkerError("daemon is stopping; worker not started")
            proc = self._popen_fn(args, env=env, **kw)
            r.proc = proc
        self.events.put(("pid", r.job.id, proc.pid))
        self.waker.wake()
        return proc

    def _calibration(self, request: dict, s: Settings) -> dict | None:  # job thread: read-only
        """Corrections from measured runs of the same model, device kind and era
        (:func:`tuner.app.lookup_calibration`), read through a read-only connection of its own (the
        main loop owns every write); None when there are none or the store cannot be read."""
        from tuner.app import lookup_calibration

        try:
            store = open_store(s.db_url, readonly=True)
            try:
                return lookup_calibration(request, store)
            finally:
                store.close()
        except TunerError as exc:
            log.warning("calibration skipped for %s: %s", request.get("config_path"), exc)
            return None

    def _execute(self, job: Job, drop: Drop, s: Settings,
                 method_defaulted: bool = False) -> None:  # job thread: writes nothing
        started = utc_text()
        try:
            try:
                request, dev = prepare_request(drop, nvml=self.nvml, trust_remote_code=s.allow_trust_remote_code)
            except DropError as exc:
                if method_defaulted and exc.field == "method":
                    # the drop has no `method` key: say where the method really came from
                    raise SettingsError(
                        f"default_method {drop.method!r} applies to {drop.path} (the drop sets no `method`), "
                        f"but {exc.message}; set `method` in the drop or change default_method",
                        path=s.source or "settings", field="default_method") from exc
                raise
            if request.get("method") == "simulate":
                cal = self._calibration(request, s)
                if cal is not None:
                    request["calibration"] = cal
            result = self.worker(request, job=f"{drop.name} (job {job.id})", timeout_s=s.job_timeout_s,
                                 python=s.python_for(drop.engine_version), popen=self._popen)
            outcome: Any = ProfileOutcome(drop, dev, result, warnings=list(result.get("warnings", [])),
                                          content=job.content)
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
            self.queue.fail(job.id, outcome)
            log.error("drop %s: job %d failed: %s: %s", job.path, job.id, type(outcome).__name__, _one_line(outcome))
            return
        self._unsaved = (job, outcome, started)
        self._save_unsaved()

    def _save_unsaved(self) -> None:
        assert self._unsaved is not None
        job, outcome, started = self._unsaved
        try:
            drop_id = self.store.save_result(
                *rows_for_store(outcome, started_at=started),
                also=lambda conn, did: self.queue.complete_in(conn, job.id, did))
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
        written = self._sync_proposals(names)
        props = "; ".join(
            f"gmu {p['gpu_memory_utilization']:.2f} → max_model_len {p['max_model_len']}"
            + (f" ({p['num_gpu_blocks']} blocks, {p['kv_cache_tokens']} KV tokens)" if p["max_model_len"] else
               f" (nothing fits: {p['reason']})")
            for p in outcome.result.get("proposals", []))
        where = written.get(outcome.drop.name)
        log.info("drop %s (%s): job %d done, drop id %d: %s%s", outcome.drop.name, job.path, job.id, drop_id,
                 props or "no proposals", f"; proposal file {where}" if where else "")

    def _sync_proposals(self, names: Any) -> dict[str, Path]:
        """Write the proposal file of each name's active drop; remove those with none."""
        active = self.queue.active_drop_ids(names)
        written = {}
        for name in sorted(set(names)):
            try:
                if name in active:
                    written[name] = write_proposal_file(self.settings.proposals_dir,
                                                        proposal_document(self.store, active[name]))
                elif remove_proposal_file(self.settings.proposals_dir, name):
                    log.info("proposal file for %s removed (drop retired)", name)
            except OSError as exc:
                log.error("%s: cannot write proposal file: %s", self.settings.proposals_dir, exc.strerror or exc)
        return written

    # -- orphans, snapshot, status, reload -------------------------------------------------------

    def _kill_orphan(self, job: Job) -> None:
        """Kill the worker group a crashed daemon left behind (checked to be a ctx-tuner worker)."""
        pid = job.worker_pid
        if not pid:
            return
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"tuner.worker_main" not in cmdline or os.getpgid(pid) != pid:
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
        if db.get_backend_name() != "sqlite" or not db.database:
            return
        self._last_snapshot = self.clock()
        self._snapshot_dirty = False
        write_snapshot(db.database, self.settings.snapshot_file)

    def _status_text(self) -> str:
        c = self.queue.counts()
        r = self._running
        now = f"running {r.drop.name}" if r is not None else "idle"
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
        if new.watch_dir != old.watch_dir:
            self.watcher.stop()
            self.watcher = self._make_watcher(new.watch_dir)
            self.watcher.start()
        log.info("settings reloaded from %s", old.source or "defaults")
        self._status_dirty = True
        self.reconcile()
        self.notifier.ready(self._status_text())

    # -- shutdown --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop gracefully: STOPPING=1, kill the running worker group and put its job back to
        ``pending``, stop watching, final snapshot, close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.stop_requested = True
        self.notifier.stopping("stopping")
        try:
            self.watcher.stop()
            r = self._running
            if r is not None:
                with self._lock:
                    r.killed = True
                    proc = r.proc
                if proc is not None:
                    try:
                        self.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                r.thread.join(timeout=30)
            self._drain_finished_at_stop()
            if self.queue is not None:
                for job in self.queue.jobs("running"):
                    self.queue.requeue(job.id)
                    log.info("job %d (%s) returned to the queue", job.id, job.path)
                if self._snapshot_dirty:
                    self._snapshot()
        except Exception:
            log.exception("error while stopping")
        finally:
            if self.store is not None:
                self.store.close()
            self._restore_signals()
            self.waker.close()
            self.notifier.close()
            if self.started:  # a start-up that failed was never running: its error says it all
                log.info("stopped")

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

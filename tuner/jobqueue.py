"""The daemon's durable job queue: the ``jobs`` table (revision 0002) on the results store.

One row per drop file version (path, content SHA-256). States::

    pending ──claim──▶ running ──▶ done     (results saved in the same transaction)
       │                  │   └──▶ failed   (typed error kept: invalid drop, crash, timeout)
       │                  └─stop/crash──▶ pending   (requeued; after max_attempts claims: failed)
       └─superseded / file deleted──▶ cancelled

Failure kinds (revision 0006, ``failure_kind``): a **drop** failure (invalid input: the drop, its
model config, its plugin — :func:`failure_kind`) is final until the file's bytes change (or
``ctx-tuner retry``); a **run** failure (worker crash or OOM kill, timeout, measurement or store
trouble) goes back to ``pending`` with ``retry_at`` pushed out by an exponential backoff, until
``max_attempts`` runs failed. An attempt lost to a daemon crash is an *interruption*: requeued
with backoff and never counted in ``attempts``. ``history`` keeps one JSON entry per failed or
interrupted attempt (time, attempt, kind, error type, reason).

Invalid drops are inserted directly as ``failed`` (attempts 0). Every write is one
``BEGIN IMMEDIATE`` transaction on the store's engine, so a second writer (another tool, a
reader's stray write) waits on ``busy_timeout`` instead of failing half-way. ``current`` is, per
path, the newest job not retired: the content the daemon last saw there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from tuner.errors import MeasureError, StoreError, TunerError, WorkerError
from tuner.store import Store, drops_table, jobs_table, utc_text

J, D = jobs_table, drops_table

#: Entries kept in ``jobs.history`` (the oldest are dropped).
HISTORY_LIMIT = 20
#: Error classes that are failures of the run, not of the drop: retried with backoff.
RUN_FAILURES: tuple[type[BaseException], ...] = (WorkerError, MeasureError, StoreError)


def failure_kind(error: BaseException) -> str:
    """``"run"`` for a failure of the run (a worker crash, signal or OOM kill, a timeout, a
    measurement or store problem, an unexpected non-typed error), ``"drop"`` for a failure of the
    input (every other :class:`~tuner.errors.TunerError`: invalid drop, model config, plugin,
    device, era): final until the drop changes."""
    if isinstance(error, RUN_FAILURES):
        return "run"
    if type(error) is TunerError and error.message.startswith("unexpected "):
        return "run"  # a bug or a broken injected worker: worth another try
    return "drop" if isinstance(error, TunerError) else "run"


def backoff_s(n: int, base_s: float, max_s: float) -> float:
    """Delay before retry ``n`` (1 = the first retry): ``base_s × 2^(n-1)``, at most ``max_s``."""
    if base_s <= 0 or n <= 0:
        return 0.0
    return min(max_s, base_s * 2 ** min(n - 1, 30))


def _utc(now: datetime | None) -> datetime:
    return now if now is not None else datetime.now(timezone.utc)


def _history(old: str | None, entry: dict) -> str:
    try:
        items = json.loads(old) if old else []
        if not isinstance(items, list):
            items = []
    except ValueError:
        items = []
    items.append(entry)
    return json.dumps(items[-HISTORY_LIMIT:])


class JobNotRunning(StoreError):
    """A finished job's row is no longer ``running`` (cancelled or finished elsewhere); the
    transaction that would store its results is rolled back."""


@dataclass(frozen=True)
class Job:
    """One ``jobs`` row."""

    id: int
    path: str
    content_sha256: str
    content: str | None
    status: str
    attempts: int
    error_type: str | None
    error: str | None
    drop_id: int | None
    worker_pid: int | None
    created_at: str
    started_at: str | None
    finished_at: str | None
    retired_at: str | None
    name: str | None = None
    failure_kind: str | None = None
    retry_at: str | None = None
    interruptions: int | None = None
    history: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> "Job":
        return cls(**{k: row[k] for k in cls.__dataclass_fields__ if k in row})

    @property
    def failures(self) -> list[dict]:
        """``history`` decoded: one dict per failed or interrupted attempt."""
        try:
            items = json.loads(self.history) if self.history else []
        except ValueError:
            return []
        return items if isinstance(items, list) else []


class JobQueue:
    """Job operations on an open :class:`~tuner.store.Store`.

    Every method raises :class:`~tuner.errors.StoreError` (``where`` = the store) on database
    errors; nothing is half-written.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.engine = store.engine

    # -- helpers ---------------------------------------------------------------------------------

    def _write(self, fn, *args: Any) -> Any:
        try:
            with self.engine.begin() as conn:  # BEGIN IMMEDIATE
                return fn(conn, *args)
        except StoreError:
            raise
        except sa.exc.SQLAlchemyError as e:
            raise StoreError(f"job queue write failed: {e.orig or e}", where=self.store.where) from e

    def _read(self, stmt: sa.Executable) -> list[Job]:
        return [Job.from_row(r) for r in self.store._rows(stmt)]

    def get(self, job_id: int) -> Job | None:
        """The job with id ``job_id``, or None."""
        rows = self._read(sa.select(J).where(J.c.id == job_id))
        return rows[0] if rows else None

    def jobs(self, status: str | None = None) -> list[Job]:
        """All jobs (or those in ``status``), oldest first."""
        stmt = sa.select(J).order_by(J.c.id)
        if status is not None:
            stmt = stmt.where(J.c.status == status)
        return self._read(stmt)

    def counts(self) -> dict[str, int]:
        """Number of jobs per status (every status present, zero included)."""
        out = dict.fromkeys(("pending", "running", "done", "failed", "cancelled"), 0)
        try:
            with self.store._reader.connect() as conn:
                for status, n in conn.execute(sa.select(J.c.status, sa.func.count()).group_by(J.c.status)):
                    out[status] = n
        except sa.exc.SQLAlchemyError as e:
            raise StoreError(f"query failed: {e.orig or e}", where=self.store.where) from e
        return out

    def current(self) -> dict[str, Job]:
        """Per path, the newest job whose file has not been retired: what the daemon last saw."""
        newest = sa.select(sa.func.max(J.c.id)).where(J.c.retired_at.is_(None)).group_by(J.c.path)
        return {j.path: j for j in self._read(sa.select(J).where(J.c.id.in_(newest)))}

    # -- enqueue ---------------------------------------------------------------------------------

    @staticmethod
    def _cancel_pending(conn: Connection, path: str, why: str, now: str) -> int:
        res = conn.execute(J.update().where(J.c.path == path, J.c.status == "pending")
                           .values(status="cancelled", error=why, finished_at=now))
        return res.rowcount

    def enqueue(self, path: str, sha256: str, content: str, *, name: str | None = None) -> Job:
        """Add a pending job for a new version of the drop at ``path`` (``name``: the drop's name);
        a pending job for an older version of the same path is cancelled in the same transaction."""
        def fn(conn: Connection) -> int:
            now = utc_text()
            self._cancel_pending(conn, path, "superseded by newer content before it ran", now)
            return conn.execute(J.insert().values(path=path, content_sha256=sha256, content=content, status="pending",
                                                  attempts=0, created_at=now, name=name)).inserted_primary_key[0]
        job_id = self._write(fn)
        return self.get(job_id)  # type: ignore[return-value]

    def record_invalid(self, path: str, sha256: str, content: str | None, error: TunerError, *,
                       name: str | None = None) -> Job:
        """Record a drop version that cannot run (invalid drop, path trick) as a ``failed`` job with
        its typed error (``failure_kind`` ``drop``); a pending job for the same path is cancelled."""
        def fn(conn: Connection) -> int:
            now = utc_text()
            self._cancel_pending(conn, path, "superseded by newer content before it ran", now)
            return conn.execute(J.insert().values(
                path=path, content_sha256=sha256, content=content, status="failed", attempts=0, name=name,
                failure_kind="drop", error_type=type(error).__name__, error=str(error), created_at=now,
                finished_at=now)
            ).inserted_primary_key[0]
        job_id = self._write(fn)
        return self.get(job_id)  # type: ignore[return-value]

    # -- running ---------------------------------------------------------------------------------

    def claim_next(self, now: datetime | None = None) -> Job | None:
        """Move the oldest pending job whose ``retry_at`` has come (by ``now``, UTC) to ``running``
        (attempts + 1) and return it; None if idle."""
        due = utc_text(_utc(now))

        def fn(conn: Connection) -> int | None:
            job_id = conn.execute(sa.select(J.c.id).where(J.c.status == "pending",
                                                          sa.or_(J.c.retry_at.is_(None), J.c.retry_at <= due))
                                  .order_by(J.c.id).limit(1)).scalar()
            if job_id is None:
                return None
            conn.execute(J.update().where(J.c.id == job_id, J.c.status == "pending").values(
                status="running", attempts=J.c.attempts + 1, started_at=utc_text(), worker_pid=None))
            return job_id
        job_id = self._write(fn)
        return None if job_id is None else self.get(job_id)

    def set_worker_pid(self, job_id: int, pid: int) -> None:
        """Remember the worker process (group leader) of a running job, for orphan clean-up."""
        self._write(lambda conn: conn.execute(
            J.update().where(J.c.id == job_id, J.c.status == "running").values(worker_pid=pid)))

    def complete_in(self, conn: Connection, job_id: int, drop_id: int) -> None:
        """Inside :meth:`Store.save_result`'s transaction: mark ``job_id`` done with ``drop_id`` and
        retire older drop rows of the same path (a deleted file retires the new row too).

        Raises:
            JobNotRunning: the job is not running any more (rolls the results back: no duplicates).
        """
        now = utc_text()
        job = conn.execute(sa.select(J.c.path, J.c.retired_at).where(J.c.id == job_id, J.c.status == "running")).first()
        if job is None:
            raise JobNotRunning(f"job {job_id} is not running; its results are discarded", where=self.store.where)
        conn.execute(J.update().where(J.c.id == job_id).values(
            status="done", drop_id=drop_id, finished_at=now, error=None, error_type=None))
        conn.execute(D.update().where(D.c.path == job.path, D.c.id < drop_id, D.c.retired_at.is_(None))
                     .values(retired_at=now))
        if job.retired_at is not None:
            conn.execute(D.update().where(D.c.id == drop_id).values(retired_at=now))

    def fail(self, job_id: int, error: BaseException, *, max_attempts: int = 1, backoff_base_s: float = 0.0,
             backoff_max_s: float = 3600.0, now: datetime | None = None) -> Job | None:
        """A running job failed with ``error``. A failure of the drop (:func:`failure_kind`) marks
        it ``failed`` for good; a failure of the run goes back to ``pending`` with ``retry_at`` =
        ``now`` + :func:`backoff_s` while fewer than ``max_attempts`` runs have failed, else
        ``failed``. Either way the error's class and text are kept and ``history`` gains an entry.
        A newer version of the same file already queued cancels the retry. Returns the row."""
        kind, etype, text = failure_kind(error), type(error).__name__, str(error)
        t = _utc(now)

        def fn(conn: Connection) -> None:
            row = conn.execute(sa.select(J.c.path, J.c.attempts, J.c.history)
                               .where(J.c.id == job_id, J.c.status == "running")).first()
            if row is None:
                return
            entry = {"at": utc_text(t), "attempt": row.attempts, "kind": kind, "error_type": etype,
                     "reason": text[:1000]}
            values: dict[str, Any] = dict(error_type=etype, error=text, failure_kind=kind, worker_pid=None,
                                          history=_history(row.history, entry))
            newer = conn.execute(sa.select(J.c.id).where(J.c.path == row.path, J.c.status == "pending")).first()
            if kind == "run" and row.attempts < max_attempts and newer is None:
                values.update(status="pending",
                              retry_at=utc_text(t + timedelta(seconds=backoff_s(row.attempts, backoff_base_s,
                                                                                 backoff_max_s))))
            else:
                values.update(status="failed", finished_at=utc_text(t), retry_at=None)
            conn.execute(J.update().where(J.c.id == job_id, J.c.status == "running").values(**values))
        self._write(fn)
        return self.get(job_id)

    def requeue(self, job_id: int) -> None:
        """A running job interrupted by a graceful stop goes back to ``pending``; the interrupted
        attempt is not counted."""
        def fn(conn: Connection) -> None:
            newer = conn.execute(sa.select(J.c.id).where(J.c.path == sa.select(J.c.path).where(J.c.id == job_id)
                                                        .scalar_subquery(), J.c.status == "pending")).first()
            if newer is not None:  # a newer version is already queued: this one is obsolete
                conn.execute(J.update().where(J.c.id == job_id, J.c.status == "running").values(
                    status="cancelled", error="superseded by newer content", finished_at=utc_text()))
                return
            conn.execute(J.update().where(J.c.id == job_id, J.c.status == "running").values(
                status="pending", attempts=sa.case((J.c.attempts > 0, J.c.attempts - 1), else_=0),
                worker_pid=None))
        self._write(fn)

    def recover(self, max_attempts: int = 0, *, backoff_base_s: float = 0.0, backoff_max_s: float = 3600.0,
                now: datetime | None = None) -> tuple[list[Job], list[Job]]:
        """At start: jobs left ``running`` by a daemon crash go back to ``pending``. The attempt
        the crash cost is not counted against the drop (``attempts`` - 1, ``interruptions`` + 1,
        a ``history`` entry); ``retry_at`` is pushed out by :func:`backoff_s` of the number of
        interruptions, so a drop that keeps killing the daemon is retried ever more slowly but
        never stranded as failed. A newer queued version of the file cancels it instead.
        ``max_attempts`` is accepted for compatibility and ignored. Returns (requeued, failed) as
        they were before the change (``failed`` is always empty; ``worker_pid`` tells the caller
        which orphaned worker group to kill)."""
        del max_attempts
        stale = self.jobs("running")
        requeued: list[Job] = []
        t = _utc(now)

        def fn(conn: Connection) -> None:
            at = utc_text(t)
            for j in stale:
                newer = conn.execute(sa.select(J.c.id).where(J.c.path == j.path, J.c.status == "pending")).first()
                n = (j.interruptions or 0) + 1
                entry = {"at": at, "attempt": j.attempts, "kind": "interrupted", "error_type": None,
                         "reason": "the daemon stopped during the job (crash, kill -9, power loss); not counted"}
                if newer is not None:
                    conn.execute(J.update().where(J.c.id == j.id).values(
                        status="cancelled", error="superseded by newer content", finished_at=at))
                else:
                    conn.execute(J.update().where(J.c.id == j.id).values(
                        status="pending", worker_pid=None, interruptions=n, history=_history(j.history, entry),
                        attempts=sa.case((J.c.attempts > 0, J.c.attempts - 1), else_=0),
                        retry_at=utc_text(t + timedelta(seconds=backoff_s(n, backoff_base_s, backoff_max_s)))))
                    requeued.append(j)
        if stale:
            self._write(fn)
        return requeued, []

    def retry(self, names: Iterable[str] = (), *, all_failed: bool = False) -> list[Job]:
        """``ctx-tuner retry``: put the current (not retired, newest per path) ``failed`` jobs of
        the drops named ``names`` (the drop ``name``, or the file name without ``.yaml``) — or,
        with ``all_failed``, every such job — back to ``pending`` now, with a fresh attempt count
        (``history`` is kept). Returns the jobs as they were before."""
        wanted = set(names)
        todo = []
        for job in self.current().values():
            if job.status != "failed":
                continue
            stem = job.path.rsplit("/", 1)[-1].rsplit(".", 1)[0]
            if all_failed or job.name in wanted or stem in wanted:
                todo.append(job)

        def fn(conn: Connection) -> None:
            for j in todo:
                conn.execute(J.update().where(J.c.id == j.id, J.c.status == "failed").values(
                    status="pending", attempts=0, retry_at=None, finished_at=None, worker_pid=None))
        if todo:
            self._write(fn)
        return todo

    def next_retry_at(self) -> str | None:
        """The earliest ``retry_at`` of a pending job (UTC text), or None."""
        rows = self.store._rows(sa.select(sa.func.min(J.c.retry_at).label("t")).where(J.c.status == "pending"))
        return rows[0]["t"] if rows else None

    # -- retirement ------------------------------------------------------------------------------

    def retire_path(self, path: str) -> list[str]:
        """The drop file at ``path`` was deleted: cancel its pending job, retire its jobs and its
        drop rows (results are kept). Returns the names of the drops retired."""
        def fn(conn: Connection) -> list[str]:
            now = utc_text()
            self._cancel_pending(conn, path, "drop file deleted before it ran", now)
            conn.execute(J.update().where(J.c.path == path, J.c.retired_at.is_(None)).values(retired_at=now))
            names = [r[0] for r in conn.execute(sa.select(D.c.name).where(D.c.path == path, D.c.retired_at.is_(None)))]
            conn.execute(D.update().where(D.c.path == path, D.c.retired_at.is_(None)).values(retired_at=now))
            return names
        return self._write(fn)

    def drop_names_for_path(self, path: str) -> list[str]:
        """Names of every drop row ever stored for the file at ``path``."""
        rows = self.store._rows(sa.select(D.c.name).where(D.c.path == path).distinct())
        return [r["name"] for r in rows]

    def active_drop_ids(self, names: Iterable[str]) -> dict[str, int]:
        """For each drop name, the newest drop row that is not retired (names without one are absent)."""
        names = list(names)
        if not names:
            return {}
        stmt = (sa.select(D.c.name, sa.func.max(D.c.id)).where(D.c.name.in_(names), D.c.retired_at.is_(None))
                .group_by(D.c.name))
        try:
            with self.store._reader.connect() as conn:
                return {n: i for n, i in conn.execute(stmt)}
        except sa.exc.SQLAlchemyError as e:
            raise StoreError(f"query failed: {e.orig or e}", where=self.store.where) from e

    def active_drops(self) -> dict[str, int]:
        """Every drop name with a drop row that is not retired → its newest such row's id."""
        stmt = sa.select(D.c.name, sa.func.max(D.c.id)).where(D.c.retired_at.is_(None)).group_by(D.c.name)
        try:
            with self.store._reader.connect() as conn:
                return {n: i for n, i in conn.execute(stmt)}
        except sa.exc.SQLAlchemyError as e:
            raise StoreError(f"query failed: {e.orig or e}", where=self.store.where) from e

    def has_due(self, now: datetime | None = None) -> bool:
        """True when a pending job may be claimed at ``now`` (a read: takes no write lock)."""
        due = utc_text(_utc(now))
        stmt = sa.select(J.c.id).where(J.c.status == "pending",
                                       sa.or_(J.c.retry_at.is_(None), J.c.retry_at <= due)).limit(1)
        return bool(self.store._rows(stmt))

    def move_path(self, old: str, new: str) -> list[str]:
        """The drop file at ``old`` moved to ``new`` with the same bytes: its jobs and unretired
        drop rows now name ``new`` (results, attempts and history kept). Returns the drop names."""
        def fn(conn: Connection) -> list[str]:
            conn.execute(J.update().where(J.c.path == old, J.c.retired_at.is_(None)).values(path=new))
            names = [r[0] for r in conn.execute(sa.select(D.c.name).where(D.c.path == old, D.c.retired_at.is_(None))
                                                .distinct())]
            conn.execute(D.update().where(D.c.path == old, D.c.retired_at.is_(None)).values(path=new))
            return names
        return self._write(fn)

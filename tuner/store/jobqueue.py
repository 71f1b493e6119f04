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

Ownership (revision 0007, :mod:`tuner.store.fleet`): a queue belongs to one owner (``hosts.id``: host id
+ watch directory). It inserts, lists, claims, completes, requeues and retires only its owner's
jobs and drops; :meth:`JobQueue.recover` also returns to ``pending`` the ``running`` jobs of owners
whose lease expired (never a live owner's). :meth:`JobQueue.claim_next` is safe with several
claimers on one database: PostgreSQL locks the chosen row with ``FOR UPDATE SKIP LOCKED``, and on
every backend the state change is a conditional update whose row count is checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from tuner.errors import MeasureError, StoreError, TunerError, WorkerError
from tuner.store.database import Store, drops_table, hosts_table, jobs_table, utc_text

J, D, H = jobs_table, drops_table, hosts_table
#: Claim attempts before :meth:`JobQueue.claim_next` gives up for this step (another claimer won
#: each race); the next step tries again.
CLAIM_TRIES = 5


def _text(value: str | None) -> str | None:
    """Text as every backend stores it: PostgreSQL text cannot hold NUL, so a NUL (a binary drop
    file's bytes, an error quoting them) is kept visibly as ``\\x00``."""
    return None if value is None else value.replace("\x00", "\\x00")

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


def _utc(now: datetime | str | None) -> datetime:
    """``now`` as an aware UTC datetime: the current time for None; UTC text (:func:`utc_text`,
    as :func:`tuner.store.fleet.lease_cutoff` gives it) is parsed."""
    if now is None:
        return datetime.now(timezone.utc)
    if isinstance(now, str):
        return datetime.fromisoformat(utc_text(now).replace("Z", "+00:00"))
    return now


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
    owner_id: int | None = None
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
    """Job operations on an open :class:`~tuner.store.database.Store`.

    Every method raises :class:`~tuner.errors.StoreError` (``where`` = the store) on database
    errors; nothing is half-written.
    """

    def __init__(self, store: Store, owner_id: int | None = None, *, lease_s: float = 60.0) -> None:
        """``owner_id``: the ``hosts.id`` this queue acts for; None registers this host with an
        empty watch directory (:func:`tuner.store.fleet.register_owner`; tools and tests)."""
        self.store = store
        self.engine = store.engine
        if owner_id is None:
            from tuner.store.fleet import default_host_id, register_owner

            owner_id = register_owner(store, default_host_id(), "", lease_s=lease_s).id
        self.owner_id = owner_id

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
        return [Job.from_row(r) for r in self.store.select(stmt)]

    def get(self, job_id: int) -> Job | None:
        """The job with id ``job_id``, or None."""
        rows = self._read(sa.select(J).where(J.c.id == job_id))
        return rows[0] if rows else None

    def jobs(self, status: str | None = None, *, all_owners: bool = False) -> list[Job]:
        """This owner's jobs (every owner's with ``all_owners``), or those in ``status``, oldest first."""
        stmt = sa.select(J).order_by(J.c.id)
        if not all_owners:
            stmt = stmt.where(J.c.owner_id == self.owner_id)
        if status is not None:
            stmt = stmt.where(J.c.status == status)
        return self._read(stmt)

    def counts(self) -> dict[str, int]:
        """Number of this owner's jobs per status (every status present, zero included)."""
        out = dict.fromkeys(("pending", "running", "done", "failed", "cancelled"), 0)
        try:
            with self.store.reader.connect() as conn:
                for status, n in conn.execute(sa.select(J.c.status, sa.func.count())
                                              .where(J.c.owner_id == self.owner_id).group_by(J.c.status)):
                    out[status] = n
        except sa.exc.SQLAlchemyError as e:
            raise StoreError(f"query failed: {e.orig or e}", where=self.store.where) from e
        return out

    def current(self) -> dict[str, Job]:
        """Per path, the newest job whose file has not been retired: what the daemon last saw."""
        newest = (sa.select(sa.func.max(J.c.id)).where(J.c.retired_at.is_(None), J.c.owner_id == self.owner_id)
                  .group_by(J.c.path))
        return {j.path: j for j in self._read(sa.select(J).where(J.c.id.in_(newest)))}

    def current_all_owners(self) -> list[Job]:
        """:meth:`current` of every owner (and of rows without one): per owner and path, the
        newest job not retired."""
        newest = sa.select(sa.func.max(J.c.id)).where(J.c.retired_at.is_(None)).group_by(J.c.owner_id, J.c.path)
        return self._read(sa.select(J).where(J.c.id.in_(newest)).order_by(J.c.id))

    # -- enqueue ---------------------------------------------------------------------------------

    def _cancel_pending(self, conn: Connection, path: str, why: str, now: str) -> int:
        res = conn.execute(J.update().where(J.c.path == path, J.c.status == "pending", J.c.owner_id == self.owner_id)
                           .values(status="cancelled", error=why, finished_at=now))
        return res.rowcount

    def enqueue(self, path: str, sha256: str, content: str, *, name: str | None = None) -> Job:
        """Add a pending job for a new version of the drop at ``path`` (``name``: the drop's name);
        a pending job for an older version of the same path is cancelled in the same transaction."""
        def fn(conn: Connection) -> int:
            now = utc_text()
            self._cancel_pending(conn, path, "superseded by newer content before it ran", now)
            return conn.execute(J.insert().values(path=path, content_sha256=sha256, content=_text(content), status="pending",
                                                  attempts=0, created_at=now, name=_text(name), owner_id=self.owner_id)
                                ).inserted_primary_key[0]
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
                path=path, content_sha256=sha256, content=_text(content), status="failed", attempts=0,
                name=_text(name), failure_kind="drop", error_type=type(error).__name__, error=_text(str(error)),
                created_at=now, finished_at=now, owner_id=self.owner_id)
            ).inserted_primary_key[0]
        job_id = self._write(fn)
        return self.get(job_id)  # type: ignore[return-value]

    # -- running ---------------------------------------------------------------------------------

    def claim_next(self, now: datetime | None = None) -> Job | None:
        """Move this owner's oldest pending job whose ``retry_at`` has come (by ``now``, UTC) to
        ``running`` (attempts + 1) and return it; None if idle. Exactly one claimer wins a job: the
        chosen row is locked ``FOR UPDATE SKIP LOCKED`` on PostgreSQL (a concurrent claimer takes
        the next row instead of waiting), and the update only applies while the row is still
        ``pending`` — its row count says who won; a lost race tries the next job. The claimed row
        is read back in the claim's own transaction: a connection lost after the commit cannot
        leave a job ``running`` that its claimer never heard of (a lost COMMIT reply still can:
        :meth:`recover` with ``keep`` returns such a job to the queue)."""
        due = utc_text(_utc(now))

        def fn(conn: Connection) -> Job | None | bool:
            stmt = (sa.select(J.c.id).where(J.c.status == "pending", J.c.owner_id == self.owner_id,
                                            sa.or_(J.c.retry_at.is_(None), J.c.retry_at <= due))
                    .order_by(J.c.id).limit(1))
            if conn.dialect.name == "postgresql":
                stmt = stmt.with_for_update(skip_locked=True)
            job_id = conn.execute(stmt).scalar()
            if job_id is None:
                return None
            res = conn.execute(J.update().where(J.c.id == job_id, J.c.status == "pending").values(
                status="running", attempts=J.c.attempts + 1, started_at=utc_text(), worker_pid=None))
            if res.rowcount != 1:
                return False
            return Job.from_row(conn.execute(sa.select(J).where(J.c.id == job_id)).mappings().one())
        for _ in range(CLAIM_TRIES):
            job = self._write(fn)
            if job is None:
                return None
            if job is not False:
                return job
        return None

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
        job = conn.execute(sa.select(J.c.path, J.c.retired_at, J.c.owner_id).where(
            J.c.id == job_id, J.c.status == "running")).first()
        if job is None:
            raise JobNotRunning(f"job {job_id} is not running; its results are discarded", where=self.store.where)
        res = conn.execute(J.update().where(J.c.id == job_id, J.c.status == "running").values(
            status="done", drop_id=drop_id, finished_at=now, error=None, error_type=None))
        if res.rowcount != 1:  # finished elsewhere between the read and the update
            raise JobNotRunning(f"job {job_id} is not running; its results are discarded", where=self.store.where)
        conn.execute(D.update().where(D.c.id == drop_id).values(owner_id=job.owner_id))
        conn.execute(D.update().where(D.c.path == job.path, D.c.id < drop_id, D.c.retired_at.is_(None),
                                      D.c.owner_id == job.owner_id).values(retired_at=now))
        if job.retired_at is not None:
            conn.execute(D.update().where(D.c.id == drop_id).values(retired_at=now))

    def fail(self, job_id: int, error: BaseException, *, max_attempts: int = 1, backoff_base_s: float = 0.0,
             backoff_max_s: float = 3600.0, now: datetime | None = None) -> Job | None:
        """A running job failed with ``error``. A failure of the drop (:func:`failure_kind`) marks
        it ``failed`` for good; a failure of the run goes back to ``pending`` with ``retry_at`` =
        ``now`` + :func:`backoff_s` while fewer than ``max_attempts`` runs have failed, else
        ``failed``. Either way the error's class and text are kept and ``history`` gains an entry.
        A newer version of the same file already queued (by the same owner) cancels the retry.
        Returns the row."""
        kind, etype, text = failure_kind(error), type(error).__name__, _text(str(error))
        t = _utc(now)

        def fn(conn: Connection) -> None:
            row = conn.execute(sa.select(J.c.path, J.c.attempts, J.c.history, J.c.owner_id)
                               .where(J.c.id == job_id, J.c.status == "running")).first()
            if row is None:
                return
            entry = {"at": utc_text(t), "attempt": row.attempts, "kind": kind, "error_type": etype,
                     "reason": text[:1000]}
            values: dict[str, Any] = dict(error_type=etype, error=text, failure_kind=kind, worker_pid=None,
                                          history=_history(row.history, entry))
            newer = conn.execute(sa.select(J.c.id).where(J.c.path == row.path, J.c.status == "pending",
                                                         J.c.owner_id == row.owner_id)).first()
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
                                                        .scalar_subquery(), J.c.status == "pending",
                                                        J.c.owner_id == self.owner_id)).first()
            if newer is not None:  # a newer version is already queued: this one is obsolete
                conn.execute(J.update().where(J.c.id == job_id, J.c.status == "running").values(
                    status="cancelled", error="superseded by newer content", finished_at=utc_text()))
                return
            conn.execute(J.update().where(J.c.id == job_id, J.c.status == "running").values(
                status="pending", attempts=sa.case((J.c.attempts > 0, J.c.attempts - 1), else_=0),
                worker_pid=None))
        self._write(fn)

    def adopt(self, watch_dir: str) -> int:
        """Take ownership of the jobs and drops without an owner (stored before revision 0007)
        whose path lies inside ``watch_dir``. Returns the number of jobs adopted."""
        prefix = watch_dir.rstrip("/") + "/"

        def inside(col: Any) -> Any:
            return sa.func.substr(col, 1, len(prefix)) == prefix

        def fn(conn: Connection) -> int:
            n = conn.execute(J.update().where(J.c.owner_id.is_(None), inside(J.c.path))
                             .values(owner_id=self.owner_id)).rowcount
            conn.execute(D.update().where(D.c.owner_id.is_(None), inside(D.c.path)).values(owner_id=self.owner_id))
            return n
        return self._write(fn)

    def take_over(self, old_owner_id: int) -> int:
        """This daemon changed identity (``watch_dir`` or ``host_id`` reloaded): move the not
        retired jobs and drops of its previous owner row ``old_owner_id`` to this owner. Returns
        the number of jobs moved."""
        if old_owner_id == self.owner_id:
            return 0

        def fn(conn: Connection) -> int:
            n = conn.execute(J.update().where(J.c.owner_id == old_owner_id, J.c.retired_at.is_(None))
                             .values(owner_id=self.owner_id)).rowcount
            conn.execute(D.update().where(D.c.owner_id == old_owner_id, D.c.retired_at.is_(None))
                         .values(owner_id=self.owner_id))
            return n
        return self._write(fn)

    def _expired_owner_ids(self, now: str) -> list[int]:
        rows = self.store.select(sa.select(H.c.id).where(H.c.lease_expires_at < now, H.c.id != self.owner_id))
        return [r["id"] for r in rows]

    def recover(self, max_attempts: int = 0, *, backoff_base_s: float = 0.0, backoff_max_s: float = 3600.0,
                now: datetime | str | None = None, include_own: bool = True,
                keep: Iterable[int] | None = None, stopped: Iterable[int] = ()) -> tuple[list[Job], list[Job]]:
        """Jobs left ``running`` by a daemon crash — this owner's (unless ``include_own`` is false:
        the periodic check of a running daemon), and those of owners whose lease expired before
        ``now`` (UTC ``datetime`` or UTC text; default: the current time), never a live owner's —
        go back to ``pending``, still owned by their owner, whose successor runs them. The attempt
        the crash cost is not counted against the drop (``attempts`` - 1, ``interruptions`` + 1,
        a ``history`` entry); ``retry_at`` is pushed out by :func:`backoff_s` of the number of
        interruptions, so a drop that keeps killing the daemon is retried ever more slowly but
        never stranded as failed. A newer queued version of the file cancels it instead.
        ``max_attempts`` is accepted for compatibility and ignored. Returns (requeued, failed) as
        they were before the change (``failed`` is always empty; ``worker_pid`` of this owner's
        jobs tells the caller which orphaned worker group to kill).

        ``keep`` (the ids of the jobs this owner's live daemon holds): this owner's other
        ``running`` jobs are stranded — claimed by a transaction whose COMMIT reply the connection
        lost (a database restart), so no job thread runs them — and go back to ``pending`` too,
        uncounted, without backoff (the drop did nothing wrong).

        ``stopped`` (ids the previous daemon noted as stopped by SIGTERM while the store could not
        be written, :meth:`tuner.daemon.service.Daemon.shutdown`): requeued the same way, uncounted and
        without backoff, their history saying so instead of "crash"."""
        del max_attempts
        stopped = set(stopped)
        t = _utc(now)
        sweep = keep is not None
        owners = ([self.owner_id] if include_own or sweep else []) + self._expired_owner_ids(utc_text(t))
        if not owners:
            return [], []
        held = set(keep or ())
        stale = [j for j in self._read(sa.select(J).where(J.c.status == "running", J.c.owner_id.in_(owners))
                                       .order_by(J.c.id)) if j.id not in held]
        requeued: list[Job] = []

        def fn(conn: Connection) -> None:
            at = utc_text(t)
            for j in stale:
                newer = conn.execute(sa.select(J.c.id).where(J.c.path == j.path, J.c.status == "pending",
                                                             J.c.owner_id == j.owner_id)).first()
                n = (j.interruptions or 0) + 1
                stranded = sweep and not include_own and j.owner_id == self.owner_id
                by_stop = j.id in stopped and j.owner_id == self.owner_id
                entry = {"at": at, "attempt": j.attempts, "kind": "interrupted", "error_type": None,
                         "reason": ("claimed but never started: the database connection was lost as the claim "
                                    "committed; not counted") if stranded else
                         ("the daemon was stopped (SIGTERM) during the job and could not return it to the queue "
                          "(the store could not be written); not counted") if by_stop else
                         "the daemon stopped during the job (crash, kill -9, power loss); not counted"}
                retry = (at if stranded or by_stop
                         else utc_text(t + timedelta(seconds=backoff_s(n, backoff_base_s, backoff_max_s))))
                if newer is not None:
                    conn.execute(J.update().where(J.c.id == j.id, J.c.status == "running").values(
                        status="cancelled", error="superseded by newer content", finished_at=at))
                else:
                    conn.execute(J.update().where(J.c.id == j.id, J.c.status == "running").values(
                        status="pending", worker_pid=None, interruptions=n, history=_history(j.history, entry),
                        attempts=sa.case((J.c.attempts > 0, J.c.attempts - 1), else_=0), retry_at=retry))
                    requeued.append(j)
        if stale:
            self._write(fn)
        return requeued, []

    def retry(self, names: Iterable[str] = (), *, all_failed: bool = False, all_owners: bool = False) -> list[Job]:
        """``ctx-tuner retry``: put the current (not retired, newest per path) ``failed`` jobs of
        the drops named ``names`` (the drop ``name``, or the file name without ``.yaml``) — or,
        with ``all_failed``, every such job — back to ``pending`` now, with a fresh attempt count
        (``history`` is kept). This owner's jobs, or every owner's with ``all_owners`` (each job
        stays with its owner, whose daemon runs it). Returns the jobs as they were before."""
        wanted = set(names)
        todo = []
        for job in (self.current_all_owners() if all_owners else self.current().values()):
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
        """The earliest ``retry_at`` of this owner's pending jobs (UTC text), or None."""
        rows = self.store.select(sa.select(sa.func.min(J.c.retry_at).label("t"))
                                .where(J.c.status == "pending", J.c.owner_id == self.owner_id))
        return rows[0]["t"] if rows else None

    # -- retirement ------------------------------------------------------------------------------

    def retire_path(self, path: str) -> list[str]:
        """The drop file at ``path`` was deleted: cancel its pending job, retire its jobs and its
        drop rows (results are kept). Returns the names of the drops retired."""
        def fn(conn: Connection) -> list[str]:
            now = utc_text()
            self._cancel_pending(conn, path, "drop file deleted before it ran", now)
            mine_j, mine_d = J.c.owner_id == self.owner_id, D.c.owner_id == self.owner_id
            conn.execute(J.update().where(J.c.path == path, J.c.retired_at.is_(None), mine_j).values(retired_at=now))
            names = [r[0] for r in conn.execute(sa.select(D.c.name).where(D.c.path == path, D.c.retired_at.is_(None),
                                                                          mine_d))]
            conn.execute(D.update().where(D.c.path == path, D.c.retired_at.is_(None), mine_d).values(retired_at=now))
            return names
        return self._write(fn)

    def drop_names_for_path(self, path: str) -> list[str]:
        """Names of every drop row this owner ever stored for the file at ``path``."""
        rows = self.store.select(sa.select(D.c.name).where(D.c.path == path, D.c.owner_id == self.owner_id).distinct())
        return [r["name"] for r in rows]

    def active_drop_ids(self, names: Iterable[str]) -> dict[str, int]:
        """For each drop name, this owner's newest drop row that is not retired (names without one
        are absent)."""
        names = list(names)
        if not names:
            return {}
        stmt = (sa.select(D.c.name, sa.func.max(D.c.id)).where(D.c.name.in_(names), D.c.retired_at.is_(None),
                                                               D.c.owner_id == self.owner_id).group_by(D.c.name))
        try:
            with self.store.reader.connect() as conn:
                return {n: i for n, i in conn.execute(stmt)}
        except sa.exc.SQLAlchemyError as e:
            raise StoreError(f"query failed: {e.orig or e}", where=self.store.where) from e

    def active_drops(self) -> dict[str, int]:
        """Every drop name with a drop row of this owner that is not retired → its newest such
        row's id."""
        stmt = (sa.select(D.c.name, sa.func.max(D.c.id)).where(D.c.retired_at.is_(None), D.c.owner_id == self.owner_id)
                .group_by(D.c.name))
        try:
            with self.store.reader.connect() as conn:
                return {n: i for n, i in conn.execute(stmt)}
        except sa.exc.SQLAlchemyError as e:
            raise StoreError(f"query failed: {e.orig or e}", where=self.store.where) from e

    def has_due(self, now: datetime | None = None) -> bool:
        """True when a pending job of this owner may be claimed at ``now`` (a read: takes no
        write lock)."""
        due = utc_text(_utc(now))
        stmt = sa.select(J.c.id).where(J.c.status == "pending", J.c.owner_id == self.owner_id,
                                       sa.or_(J.c.retry_at.is_(None), J.c.retry_at <= due)).limit(1)
        return bool(self.store.select(stmt))

    def move_path(self, old: str, new: str) -> list[str]:
        """The drop file at ``old`` moved to ``new`` with the same bytes: its jobs and unretired
        drop rows (this owner's) now name ``new`` (results, attempts and history kept). Returns
        the drop names."""
        def fn(conn: Connection) -> list[str]:
            mine_j, mine_d = J.c.owner_id == self.owner_id, D.c.owner_id == self.owner_id
            conn.execute(J.update().where(J.c.path == old, J.c.retired_at.is_(None), mine_j).values(path=_text(new)))
            names = [r[0] for r in conn.execute(sa.select(D.c.name).where(D.c.path == old, D.c.retired_at.is_(None),
                                                                          mine_d).distinct())]
            conn.execute(D.update().where(D.c.path == old, D.c.retired_at.is_(None), mine_d).values(path=_text(new)))
            return names
        return self._write(fn)

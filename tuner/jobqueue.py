"""The daemon's durable job queue: the ``jobs`` table (revision 0002) on the results store.

One row per drop file version (path, content SHA-256). States::

    pending ──claim──▶ running ──▶ done     (results saved in the same transaction)
       │                  │   └──▶ failed   (typed error kept: invalid drop, crash, timeout)
       │                  └─stop/crash──▶ pending   (requeued; after max_attempts claims: failed)
       └─superseded / file deleted──▶ cancelled

Invalid drops are inserted directly as ``failed`` (attempts 0). Every write is one
``BEGIN IMMEDIATE`` transaction on the store's engine, so a second writer (another tool, a
reader's stray write) waits on ``busy_timeout`` instead of failing half-way. ``current`` is, per
path, the newest job not retired: the content the daemon last saw there.

Ownership (revision 0007, :mod:`tuner.fleet`): a queue belongs to one owner (``hosts.id``: host id
+ watch directory). It inserts, lists, claims, completes, requeues and retires only its owner's
jobs and drops; :meth:`JobQueue.recover` also returns to ``pending`` the ``running`` jobs of owners
whose lease expired (never a live owner's). :meth:`JobQueue.claim_next` is safe with several
claimers on one database: PostgreSQL locks the chosen row with ``FOR UPDATE SKIP LOCKED``, and on
every backend the state change is a conditional update whose row count is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from tuner.errors import StoreError, TunerError
from tuner.store import Store, drops_table, hosts_table, jobs_table, utc_text

J, D, H = jobs_table, drops_table, hosts_table
#: Claim attempts before :meth:`JobQueue.claim_next` gives up for this step (another claimer won
#: each race); the next step tries again.
CLAIM_TRIES = 5


def _text(value: str | None) -> str | None:
    """Text as every backend stores it: PostgreSQL text cannot hold NUL, so a NUL (a binary drop
    file's bytes, an error quoting them) is kept visibly as ``\\x00``."""
    return None if value is None else value.replace("\x00", "\\x00")


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

    @classmethod
    def from_row(cls, row: Any) -> "Job":
        return cls(**{k: row[k] for k in cls.__dataclass_fields__})


class JobQueue:
    """Job operations on an open :class:`~tuner.store.Store`.

    Every method raises :class:`~tuner.errors.StoreError` (``where`` = the store) on database
    errors; nothing is half-written.
    """

    def __init__(self, store: Store, owner_id: int | None = None, *, lease_s: float = 60.0) -> None:
        """``owner_id``: the ``hosts.id`` this queue acts for; None registers this host with an
        empty watch directory (:func:`tuner.fleet.register_owner`; tools and tests)."""
        self.store = store
        self.engine = store.engine
        if owner_id is None:
            from tuner.fleet import default_host_id, register_owner

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
        return [Job.from_row(r) for r in self.store._rows(stmt)]

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
            with self.store._reader.connect() as conn:
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

    # -- enqueue ---------------------------------------------------------------------------------

    def _cancel_pending(self, conn: Connection, path: str, why: str, now: str) -> int:
        res = conn.execute(J.update().where(J.c.path == path, J.c.status == "pending", J.c.owner_id == self.owner_id)
                           .values(status="cancelled", error=why, finished_at=now))
        return res.rowcount

    def enqueue(self, path: str, sha256: str, content: str) -> Job:
        """Add a pending job for a new version of the drop at ``path``; a pending job for an older
        version of the same path is cancelled in the same transaction."""
        def fn(conn: Connection) -> int:
            now = utc_text()
            self._cancel_pending(conn, path, "superseded by newer content before it ran", now)
            return conn.execute(J.insert().values(path=path, content_sha256=sha256, content=_text(content), status="pending",
                                                  attempts=0, created_at=now, owner_id=self.owner_id)
                                ).inserted_primary_key[0]
        job_id = self._write(fn)
        return self.get(job_id)  # type: ignore[return-value]

    def record_invalid(self, path: str, sha256: str, content: str | None, error: TunerError) -> Job:
        """Record a drop version that cannot run (invalid drop, path trick) as a ``failed`` job with
        its typed error; a pending job for the same path is cancelled."""
        def fn(conn: Connection) -> int:
            now = utc_text()
            self._cancel_pending(conn, path, "superseded by newer content before it ran", now)
            return conn.execute(J.insert().values(
                path=path, content_sha256=sha256, content=_text(content), status="failed", attempts=0,
                error_type=type(error).__name__, error=_text(str(error)), created_at=now, finished_at=now,
                owner_id=self.owner_id)
            ).inserted_primary_key[0]
        job_id = self._write(fn)
        return self.get(job_id)  # type: ignore[return-value]

    # -- running ---------------------------------------------------------------------------------

    def claim_next(self) -> Job | None:
        """Move this owner's oldest pending job to ``running`` (attempts + 1) and return it; None if
        idle. Exactly one claimer wins a job: the chosen row is locked ``FOR UPDATE SKIP LOCKED`` on
        PostgreSQL (a concurrent claimer takes the next row instead of waiting), and the update
        only applies while the row is still ``pending`` — its row count says who won; a lost race
        tries the next job."""
        def fn(conn: Connection) -> int | None | bool:
            stmt = (sa.select(J.c.id).where(J.c.status == "pending", J.c.owner_id == self.owner_id)
                    .order_by(J.c.id).limit(1))
            if conn.dialect.name == "postgresql":
                stmt = stmt.with_for_update(skip_locked=True)
            job_id = conn.execute(stmt).scalar()
            if job_id is None:
                return None
            res = conn.execute(J.update().where(J.c.id == job_id, J.c.status == "pending").values(
                status="running", attempts=J.c.attempts + 1, started_at=utc_text(), worker_pid=None))
            return job_id if res.rowcount == 1 else False
        for _ in range(CLAIM_TRIES):
            job_id = self._write(fn)
            if job_id is None:
                return None
            if job_id is not False:
                return self.get(job_id)
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

    def fail(self, job_id: int, error: BaseException) -> Job | None:
        """Mark a running job ``failed`` with the error's class name and text."""
        kind = type(error).__name__
        self._write(lambda conn: conn.execute(J.update().where(J.c.id == job_id, J.c.status == "running").values(
            status="failed", error_type=kind, error=_text(str(error)), finished_at=utc_text())))
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

    def _expired_owner_ids(self, now: str) -> list[int]:
        rows = self.store._rows(sa.select(H.c.id).where(H.c.lease_expires_at < now, H.c.id != self.owner_id))
        return [r["id"] for r in rows]

    def recover(self, max_attempts: int, *, now: str | None = None,
                include_own: bool = True) -> tuple[list[Job], list[Job]]:
        """Jobs left ``running`` by a crash — this owner's (unless ``include_own`` is false: the
        periodic check of a running daemon), and those of owners whose lease expired before
        ``now`` (default: the current time), never a live owner's — go back to ``pending``
        (still owned by their owner, whose successor runs them), or become ``failed`` once they
        have been started ``max_attempts`` times (a drop that kills the daemon cannot loop
        forever). Returns (requeued, failed) as they were before the change; ``worker_pid`` of
        this owner's jobs tells the caller which orphaned worker group to kill."""
        now = now or utc_text()
        owners = ([self.owner_id] if include_own else []) + self._expired_owner_ids(now)
        if not owners:
            return [], []
        stale = self._read(sa.select(J).where(J.c.status == "running", J.c.owner_id.in_(owners)).order_by(J.c.id))
        requeued, failed = [], []

        def fn(conn: Connection) -> None:
            now = utc_text()
            for j in stale:
                newer = conn.execute(sa.select(J.c.id).where(J.c.path == j.path, J.c.status == "pending",
                                                             J.c.owner_id == j.owner_id)).first()
                if j.attempts >= max_attempts:
                    conn.execute(J.update().where(J.c.id == j.id, J.c.status == "running").values(
                        status="failed", error_type="WorkerError", finished_at=now,
                        error=f"interrupted {j.attempts} times (daemon crashed or was killed during the job); gave up"))
                    failed.append(j)
                elif newer is not None:
                    conn.execute(J.update().where(J.c.id == j.id, J.c.status == "running").values(
                        status="cancelled", error="superseded by newer content", finished_at=now))
                else:
                    conn.execute(J.update().where(J.c.id == j.id, J.c.status == "running")
                                 .values(status="pending", worker_pid=None))
                    requeued.append(j)
        if stale:
            self._write(fn)
        return requeued, failed

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
        rows = self.store._rows(sa.select(D.c.name).where(D.c.path == path, D.c.owner_id == self.owner_id).distinct())
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
            with self.store._reader.connect() as conn:
                return {n: i for n, i in conn.execute(stmt)}
        except sa.exc.SQLAlchemyError as e:
            raise StoreError(f"query failed: {e.orig or e}", where=self.store.where) from e

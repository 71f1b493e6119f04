"""Fleet: many daemons on one store — owners with leases, and results shared by content hash.

**Owners.** A daemon is identified by ``host_id`` (setting; default the host name) and its
``watch_dir``; it has one ``hosts`` row (revision 0007) holding its process id, tool version,
GPUs, last heartbeat and ``lease_expires_at``. The daemon renews its lease every
``lease_s / 3`` seconds. Jobs and drops carry the owner's ``hosts.id``; only the owner claims,
completes and retires them (:class:`tuner.store.jobqueue.JobQueue`). A second daemon with the same
identity while the first one lives is refused (:class:`OwnerBusy`); after a crash the restarted
daemon (its successor) takes the identity over at once when the recorded process is gone, and
any daemon may return an *expired* owner's ``running`` jobs to ``pending`` for its successor.
Lease times are compared as UTC text written from each host's clock: hosts need synchronised
clocks (NTP), with drift well below ``lease_s``.

**Shared results.** :func:`result_key` is the one definition of the content hash a profile
result is keyed by across the fleet: model config hash (canonical, :func:`tuner.model.modelspec.config_hash`),
device kind and memory, vLLM release, parallel layout and every other setting of the drop
(the drop's name, file path and raw text excluded), the method, the calibration applied and the
tool version. A drop whose key some host already stored (``drops.result_sha256``) is answered
from the store without a worker: :func:`shared_rows` copies the original's runs, candidates and
proposals under the new drop row (``drops.answered_from_drop_id`` names the original). This is the
minimal store-side lookup; a general per-pass memo (issue 13) may later replace the lookup, keeping
:func:`result_key` as the key. Measured runs and calibrations are shared the same way by what they
are keyed on (model config hash, device kind, era, layout), whatever host stored them.

No torch here: the daemon's main process imports this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import sqlalchemy as sa

from tuner import __version__
from tuner.errors import StoreError
from tuner.store.database import (Store, candidates_table, drops_table, error_text, hosts_table, profile_runs_table,
                         proposals_table, utc_text)

H = hosts_table

#: Bump when the meaning of a stored result changes in a way the tool version does not capture.
RESULT_KEY_VERSION = 1
#: Drop keys that identify the file rather than what is computed (left out of :func:`result_key`).
_IDENTITY_KEYS = ("name", "path", "content_sha256", "model")


class OwnerBusy(StoreError):
    """Another live daemon holds this host id and watch directory (its lease has not expired and its
    process still runs)."""


@dataclass(frozen=True)
class Owner:
    """A daemon identity: its ``hosts.id``, ``host_id`` and ``watch_dir``."""

    id: int
    host_id: str
    watch_dir: str


def default_host_id() -> str:
    """The host name (``socket.gethostname()``), the default ``host_id``."""
    return socket.gethostname() or "localhost"


def _at(wall_s: float) -> str:
    return utc_text(datetime.fromtimestamp(wall_s, tz=timezone.utc))


def _ctx_tuner_alive(pid: int) -> bool:
    """True when process ``pid`` runs here and looks like ctx-tuner (its command line names tuner)."""
    try:
        return b"tuner" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def register_owner(store: Store, host_id: str, watch_dir: str, *, lease_s: float, pid: int | None = None,
                   gpus: list[dict] | None = None, wall_clock: Callable[[], float] | None = None,
                   pid_alive: Callable[[int], bool] = _ctx_tuner_alive) -> Owner:
    """Insert or take over the ``hosts`` row of (``host_id``, ``watch_dir``) and start its lease.

    Raises:
        OwnerBusy: the row's lease is live and its process (another pid, on this host) still runs.
        StoreError: a database error.
    """
    import time

    now_s = (wall_clock or time.time)()
    now, until = _at(now_s), _at(now_s + lease_s)
    pid = os.getpid() if pid is None else pid
    values = {"pid": pid, "tool_version": __version__, "gpus": json.dumps(gpus or []), "started_at": now,
              "last_seen_at": now, "lease_expires_at": until}
    for _attempt in range(3):
        try:
            with store.engine.begin() as conn:
                stmt = sa.select(H).where(H.c.host_id == host_id, H.c.watch_dir == watch_dir)
                if conn.dialect.name == "postgresql":
                    stmt = stmt.with_for_update()
                row = conn.execute(stmt).mappings().first()
                if row is None:
                    new_id = conn.execute(H.insert().values(host_id=host_id, watch_dir=watch_dir, **values)
                                          ).inserted_primary_key[0]
                    return Owner(new_id, host_id, watch_dir)
                if (row["lease_expires_at"] > now and row["pid"] not in (None, pid)
                        and pid_alive(int(row["pid"]))):
                    raise OwnerBusy(f"host {host_id!r} watch_dir {watch_dir} is held by a live daemon (pid "
                                    f"{row['pid']}, lease until {row['lease_expires_at']}); give each daemon its "
                                    "own host_id or watch_dir", where=store.where)
                conn.execute(H.update().where(H.c.id == row["id"]).values(**values))
                return Owner(row["id"], host_id, watch_dir)
        except sa.exc.IntegrityError:  # two starts inserted the same identity at once: read it again
            continue
        except sa.exc.SQLAlchemyError as e:
            raise StoreError(f"cannot register host: {error_text(e.orig or e)}", where=store.where) from e
    raise StoreError(f"cannot register host {host_id!r} {watch_dir}: concurrent starts", where=store.where)


def renew_lease(store: Store, owner_id: int, *, lease_s: float, wall_clock: Callable[[], float] | None = None,
                pid: int | None = None) -> None:
    """Heartbeat: set ``last_seen_at`` to now and extend the lease by ``lease_s`` seconds.

    Raises:
        StoreError: a database error (the daemon logs it and tries again at the next beat).
    """
    import time

    now_s = (wall_clock or time.time)()
    try:
        with store.engine.begin() as conn:
            conn.execute(H.update().where(H.c.id == owner_id).values(
                last_seen_at=_at(now_s), lease_expires_at=_at(now_s + lease_s),
                **({"pid": pid} if pid is not None else {})))
    except sa.exc.SQLAlchemyError as e:
        raise StoreError(f"lease renewal failed: {error_text(e.orig or e)}", where=store.where) from e


def end_lease(store: Store, owner_id: int, *, wall_clock: Callable[[], float] | None = None) -> None:
    """At a graceful stop: the lease ends now (the row stays, ``last_seen_at`` is the stop time)."""
    import time

    now = _at((wall_clock or time.time)())
    try:
        with store.engine.begin() as conn:
            conn.execute(H.update().where(H.c.id == owner_id).values(last_seen_at=now, lease_expires_at=now))
    except sa.exc.SQLAlchemyError as e:
        raise StoreError(f"cannot end the lease: {error_text(e.orig or e)}", where=store.where) from e


def hosts(store: Store) -> list[dict]:
    """All ``hosts`` rows, ``gpus`` decoded, ordered by host id and watch dir."""
    rows = store.select(sa.select(H).order_by(H.c.host_id, H.c.watch_dir))
    for r in rows:
        try:
            r["gpus"] = json.loads(r["gpus"] or "[]")
        except ValueError:
            r["gpus"] = []
    return rows


def lease_cutoff(wall_s: float) -> str:
    """UTC text of ``wall_s``: owners whose ``lease_expires_at`` is below it have expired."""
    return _at(wall_s)


# ---------------------------------------------------------------------------------------------
# Shared results
# ---------------------------------------------------------------------------------------------


def result_key(request: dict) -> str:
    """The fleet-wide content hash of what a worker request computes (see the module docstring).

    Raises:
        ModelConfigError: the model's config.json cannot be read.
    """
    from tuner.model.modelspec import config_hash, read_top

    d = request["drop"]
    settings = {k: v for k, v in d.items() if k not in _IDENTITY_KEYS}
    key = {
        "v": RESULT_KEY_VERSION,
        "tool": __version__,
        "model_config_sha256": config_hash(read_top(request["config_path"])),
        "device": {"name": request["device"]["name"], "total_memory_bytes": int(request["device"]["total_memory_bytes"])},
        "method": request.get("method"),
        "settings": settings,  # engine_version (release), TP/PP layout, dtypes, candidates, constraints, …
        "calibration": request.get("calibration"),
        "trust_remote_code": bool(request.get("trust_remote_code")),
    }
    text = json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def find_shared_result(store: Store, key: str) -> int | None:
    """The newest drop (any owner, retired or not) that a worker computed with result key ``key``,
    or None. Drops that were themselves answered from the store are not sources."""
    d = drops_table
    rows = store.select(sa.select(d.c.id).where(d.c.result_sha256 == key, d.c.answered_from_drop_id.is_(None))
                       .order_by(d.c.id.desc()).limit(1))
    return rows[0]["id"] if rows else None


_RUN_SKIP = {"id", "drop_id"}
_CAND_SKIP = {"id", "drop_id", "profile_run_id"}
_PROP_SKIP = {"id", "drop_id", "created_at"}


def shared_rows(store: Store, source_drop_id: int) -> tuple[list[dict], list[dict], list[dict]]:
    """Runs, candidates and proposals of drop ``source_drop_id`` in :meth:`Store.save_result`'s input
    form (run ``key`` = the original run id, candidates' ``run_key`` pointing at it), to be stored
    under a new drop row."""
    runs = [{**{k: v for k, v in r.items() if k not in _RUN_SKIP}, "key": r["id"]}
            for r in store.select(sa.select(profile_runs_table).where(profile_runs_table.c.drop_id == source_drop_id)
                                 .order_by(profile_runs_table.c.id))]
    cands = [{**{k: v for k, v in c.items() if k not in _CAND_SKIP}, "run_key": c["profile_run_id"]}
             for c in store.select(sa.select(candidates_table).where(candidates_table.c.drop_id == source_drop_id)
                                  .order_by(candidates_table.c.id))]
    props = [{k: v for k, v in p.items() if k not in _PROP_SKIP}
             for p in store.select(sa.select(proposals_table).where(proposals_table.c.drop_id == source_drop_id)
                                  .order_by(proposals_table.c.id))]
    return runs, cands, props


__all__ = ["Owner", "OwnerBusy", "RESULT_KEY_VERSION", "default_host_id", "end_lease", "find_shared_result",
           "hosts", "lease_cutoff", "register_owner", "renew_lease", "result_key", "shared_rows"]

"""Fleet: hosts with leases, job and drop ownership, the shared result key, views with the host
(issue 14).

* ``hosts`` — one row per daemon identity (``host_id`` + ``watch_dir``): its process id, tool
  version, GPUs (JSON), when it started, when it was last seen and until when its lease runs
  (``lease_expires_at``; the daemon renews it while it lives). Unique (host_id, watch_dir).
* ``jobs.owner_id`` → ``hosts.id``: the daemon whose watch directory holds the file. Only the owner
  claims its jobs; recovery touches only its own jobs or those of an owner whose lease expired.
  The one-pending-job-per-path index becomes one per (owner, path).
* ``drops.owner_id`` → ``hosts.id`` (null for drops stored by ``ctx-tuner profile`` or
  ``import-log``): reconciliation retires only its own drops.
* ``drops.result_sha256``: the shared result key of the drop (:func:`tuner.store.fleet.result_key`);
  ``drops.answered_from_drop_id``: the drop whose stored result answered this one without a
  worker (null when a worker ran).
* Views: ``latest_proposals`` is per drop name *per owner* and names the host; new
  ``fleet_latest_proposals`` (one row per host, drop name and gpu_memory_utilization, with the
  host's last-seen time) and ``fleet_by_device`` (per device kind, model, release and
  gpu_memory_utilization: how many hosts and drops, the smallest and largest proposed
  max_model_len).

Rows from before this revision have no owner; a daemon adopts the jobs and drops whose path lies
inside its own watch directory at start (:meth:`tuner.store.jobqueue.JobQueue.adopt`).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: Union[str, Sequence[str], None] = "0006"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

TS = sa.String(32)
PENDING = sa.text("status = 'pending'")

_v4 = importlib.import_module(__name__.rsplit(".", 1)[0] + ".0004_views") if "." in __name__ else None


def _views_0004() -> dict[str, str]:
    if _v4 is not None:
        return dict(_v4.VIEWS)
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("_v4", pathlib.Path(__file__).with_name("0004_views.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return dict(mod.VIEWS)


#: The newest proposals per drop name and owner: the proposals of each owner's highest-id drop row
#: of that name that is not retired (drops without an owner — `profile`, `import-log` — form one
#: group of their own). ``host_id``/``watch_dir`` are null for them.
LATEST_PROPOSALS = """
CREATE VIEW latest_proposals AS
SELECT d.id AS drop_id, d.name AS drop_name, d.model, d.device_name, d.engine_version, d.method,
       p.gpu_memory_utilization, p.max_model_len, p.num_gpu_blocks, p.kv_cache_tokens, p.max_concurrency,
       p.vllm_args, p.reason, p.created_at, h.host_id, h.watch_dir, d.owner_id, d.answered_from_drop_id
FROM proposals p
JOIN drops d ON d.id = p.drop_id
LEFT JOIN hosts h ON h.id = d.owner_id
WHERE d.retired_at IS NULL
  AND d.id = (SELECT MAX(d2.id) FROM drops d2
              WHERE d2.name = d.name AND d2.retired_at IS NULL
                AND (d2.owner_id = d.owner_id OR (d2.owner_id IS NULL AND d.owner_id IS NULL)))
"""

#: Every daemon's current proposals, one row per host, drop name and gpu_memory_utilization, with
#: the host's last heartbeat and whether its lease is still running (``lease_live``: 1/0, compared
#: as UTC text with the database's clock).
FLEET_LATEST_PROPOSALS = """
CREATE VIEW fleet_latest_proposals AS
SELECT l.host_id, l.watch_dir, l.drop_name, l.device_name, l.model, l.engine_version, l.gpu_memory_utilization,
       l.max_model_len, l.num_gpu_blocks, l.kv_cache_tokens, l.max_concurrency, l.vllm_args,
       CASE WHEN l.answered_from_drop_id IS NULL THEN 0 ELSE 1 END AS from_shared_result,
       l.created_at, h.last_seen_at
FROM latest_proposals l
JOIN hosts h ON h.id = l.owner_id
"""

#: The fleet per device kind: for each device, model, vLLM release and gpu_memory_utilization, how
#: many hosts and drops propose something and the smallest / largest proposed max_model_len.
FLEET_BY_DEVICE = """
CREATE VIEW fleet_by_device AS
SELECT l.device_name, l.model, l.engine_version, l.gpu_memory_utilization,
       COUNT(DISTINCT l.owner_id) AS hosts, COUNT(*) AS drops,
       MIN(l.max_model_len) AS min_max_model_len, MAX(l.max_model_len) AS max_max_model_len,
       MAX(l.created_at) AS newest_created_at
FROM latest_proposals l
WHERE l.owner_id IS NOT NULL
GROUP BY l.device_name, l.model, l.engine_version, l.gpu_memory_utilization
"""


def views() -> dict[str, str]:
    """name → CREATE VIEW statement after this revision, in creation order."""
    out = _views_0004()
    out["latest_proposals"] = LATEST_PROPOSALS
    out["fleet_latest_proposals"] = FLEET_LATEST_PROPOSALS
    out["fleet_by_device"] = FLEET_BY_DEVICE
    return out


#: Views as of this revision (a later migration rebuilding a table imports these).
VIEWS = views()


def create_views(operations=op, which: dict[str, str] | None = None) -> None:
    for sql in (which or VIEWS).values():
        operations.execute(sql.strip())


def drop_views(operations=op, which: dict[str, str] | None = None) -> None:
    for name in reversed(list(which or VIEWS)):
        operations.execute(f"DROP VIEW IF EXISTS {name}")


def upgrade() -> None:
    drop_views(which=_views_0004())
    op.create_table(
        "hosts",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("host_id", sa.Text, nullable=False),
        sa.Column("watch_dir", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=True),
        sa.Column("tool_version", sa.Text, nullable=True),
        sa.Column("gpus", sa.Text, nullable=True),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("last_seen_at", TS, nullable=False),
        sa.Column("lease_expires_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_hosts"),
        sa.UniqueConstraint("host_id", "watch_dir", name="uq_hosts_host_id"),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("uq_jobs_pending_path")
        batch.add_column(sa.Column("owner_id", sa.Integer, nullable=True))
        batch.create_foreign_key("fk_jobs_owner_id_hosts", "hosts", ["owner_id"], ["id"])
        batch.create_index("ix_jobs_owner_id", ["owner_id"])
    op.create_index("uq_jobs_pending_path", "jobs", ["owner_id", "path"], unique=True,
                    sqlite_where=PENDING, postgresql_where=PENDING)
    with op.batch_alter_table("drops") as batch:
        batch.add_column(sa.Column("owner_id", sa.Integer, nullable=True))
        batch.add_column(sa.Column("result_sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("answered_from_drop_id", sa.Integer, nullable=True))
        batch.create_foreign_key("fk_drops_owner_id_hosts", "hosts", ["owner_id"], ["id"])
        batch.create_foreign_key("fk_drops_answered_from_drop_id_drops", "drops", ["answered_from_drop_id"], ["id"])
        batch.create_index("ix_drops_owner_id", ["owner_id"])
        batch.create_index("ix_drops_result_sha256", ["result_sha256"])
    create_views()


def downgrade() -> None:
    drop_views()
    with op.batch_alter_table("drops") as batch:
        batch.drop_index("ix_drops_result_sha256")
        batch.drop_index("ix_drops_owner_id")
        batch.drop_constraint("fk_drops_answered_from_drop_id_drops", type_="foreignkey")
        batch.drop_constraint("fk_drops_owner_id_hosts", type_="foreignkey")
        batch.drop_column("answered_from_drop_id")
        batch.drop_column("result_sha256")
        batch.drop_column("owner_id")
    op.drop_index("uq_jobs_pending_path", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_owner_id")
        batch.drop_constraint("fk_jobs_owner_id_hosts", type_="foreignkey")
        batch.drop_column("owner_id")
    op.create_index("uq_jobs_pending_path", "jobs", ["path"], unique=True,
                    sqlite_where=PENDING, postgresql_where=PENDING)
    op.drop_table("hosts")
    create_views(which=_views_0004())

"""Daemon job queue and drop retirement (issue 3).

``jobs``: one row per (drop file path, content) the daemon has seen. ``status`` moves
``pending → running → done | failed``; ``cancelled`` is a pending job whose file changed again or
was deleted before it ran. ``attempts`` counts claims; ``error_type``/``error`` keep the typed error
(the drop file and field for invalid drops, the worker's stderr tail for crashes). ``retired_at``
is set when the drop file is deleted (the drop's results are kept). At most one ``pending`` job
per path (partial unique index). ``drops.retired_at`` already exists (revision 0001).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: Union[str, Sequence[str], None] = "0001"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

TS = sa.String(32)
PENDING = sa.text("status = 'pending'")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("content_sha256", sa.String(64), nullable=False),
        sa.Column("content", sa.Text, nullable=True),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("error_type", sa.Text, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("drop_id", sa.Integer, nullable=True),
        sa.Column("worker_pid", sa.Integer, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.Column("retired_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
        sa.ForeignKeyConstraint(["drop_id"], ["drops.id"], name="fk_jobs_drop_id_drops"),
        sa.CheckConstraint(
            "status IN ('pending', 'running', 'done', 'failed', 'cancelled')", name="ck_jobs_status"
        ),
    )
    op.create_index("ix_jobs_path", "jobs", ["path"])
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_index(
        "uq_jobs_pending_path", "jobs", ["path"], unique=True,
        sqlite_where=PENDING, postgresql_where=PENDING,
    )


def downgrade() -> None:
    op.drop_index("uq_jobs_pending_path", table_name="jobs")
    op.drop_index("ix_jobs_status", table_name="jobs")
    op.drop_index("ix_jobs_path", table_name="jobs")
    op.drop_table("jobs")

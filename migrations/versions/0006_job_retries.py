"""Job failure kinds, retries with backoff, drop identity by name, stored warnings (issue 15).

``jobs`` gains:

* ``name`` — the drop's ``name`` when its content parsed (drops are identified by content and
  name, so a moved file keeps its history; ``ctx-tuner retry NAME`` finds its jobs);
* ``failure_kind`` — ``drop`` (invalid input: final until the file changes) or ``run`` (crash,
  OOM kill, timeout, daemon death: retried with backoff);
* ``retry_at`` — a pending job is not claimed before this UTC time (backoff after a run failure);
* ``interruptions`` — attempts lost to daemon crashes (not counted in ``attempts``);
* ``history`` — JSON list, one entry per failed or interrupted attempt: ``at``, ``attempt``,
  ``kind``, ``error_type``, ``reason``.

``drops`` gains ``warnings``: a JSON list of the run's warnings (plugin fallbacks, assumed config
defaults), shown in the proposal file and the daemon's log line.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: Union[str, Sequence[str], None] = "0005"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

JOB_COLUMNS = (
    ("name", sa.Text),
    ("failure_kind", sa.Text),
    ("retry_at", sa.String(32)),
    ("interruptions", sa.Integer),
    ("history", sa.Text),
)


def upgrade() -> None:
    # plain ADD COLUMN (nullable, no default): no table copy, so the 0004 views stay valid
    for name, type_ in JOB_COLUMNS:
        op.add_column("jobs", sa.Column(name, type_, nullable=True))
    op.create_index("ix_jobs_name", "jobs", ["name"])
    op.add_column("drops", sa.Column("warnings", sa.Text, nullable=True))


def downgrade() -> None:
    op.drop_column("drops", "warnings")  # SQLite >= 3.35 drops a column in place
    op.drop_index("ix_jobs_name", table_name="jobs")
    for name, _type in reversed(JOB_COLUMNS):
        op.drop_column("jobs", name)

"""Pass memo (issue 13): profile passes and the model specs they were built from, by content hash.

* ``pass_memo`` — one row per memo entry: ``memo_key`` (SHA-256 of what the entry was computed
  from, :mod:`tuner.jobs.passmemo`; unique), ``kind`` (``spec``: the model spec read from a
  ``config.json`` with transformers; ``pass``: one rank's profile pass), the model config hash,
  tool version, method, device kind and era it belongs to (for queries and clean-up), ``value``
  (the entry as JSON text) and ``created_at``.

A job whose spec and passes are all here is answered without a worker (and without torch); a row
is never updated, a new tool version or config simply computes new keys.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: Union[str, Sequence[str], None] = "0007"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table(
        "pass_memo",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("memo_key", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("model_config_sha256", sa.String(64), nullable=False),
        sa.Column("tool_version", sa.Text, nullable=False),
        sa.Column("method", sa.Text, nullable=False),
        sa.Column("device_name", sa.Text, nullable=True),
        sa.Column("era", sa.Text, nullable=True),
        sa.Column("value", sa.Text, nullable=False),
        sa.Column("created_at", sa.String(32), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_pass_memo"),
        sa.UniqueConstraint("memo_key", name="uq_pass_memo_memo_key"),
    )
    op.create_index("ix_pass_memo_model_config_sha256", "pass_memo", ["model_config_sha256"])


def downgrade() -> None:
    op.drop_index("ix_pass_memo_model_config_sha256", table_name="pass_memo")
    op.drop_table("pass_memo")

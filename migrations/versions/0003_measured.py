"""Measured and imported runs, calibration (issue 4).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: Union[str, Sequence[str], None] = "0002"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


#: Columns a measured (``cuda`` / ``vllm``) or imported (``import``) run fills; null for
#: ``simulate`` runs. ``source`` is the log file path or the engine command that produced the run;
#: ``error_message`` the engine's own refusal text (e.g. the max-seq-len error).
COLUMNS = (
    ("gpu_memory_utilization", sa.Float),
    ("max_model_len", sa.Integer),
    ("block_size", sa.Integer),
    ("non_torch_bytes", sa.BigInteger),
    ("cuda_graph_bytes", sa.BigInteger),
    ("available_kv_cache_bytes", sa.BigInteger),
    ("num_gpu_blocks", sa.Integer),
    ("kv_cache_tokens", sa.BigInteger),
    ("max_concurrency", sa.Float),
    ("error_message", sa.Text),
    ("source", sa.Text),
)


def upgrade() -> None:
    with op.batch_alter_table("profile_runs") as batch:
        for name, type_ in COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("profile_runs") as batch:
        for name, _type in reversed(COLUMNS):
            batch.drop_column(name)

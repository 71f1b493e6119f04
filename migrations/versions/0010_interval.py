"""The interval of a prediction (tuner/memory/uncertainty.py): each point's low (safe) and high ends.

``candidates`` gains ``available_kv_cache_bytes_low``/``_high``, ``kv_cache_tokens_low``/``_high``
and ``num_gpu_blocks_low``/``_high``; ``proposals`` gains the same KV bytes and tokens, the
``risk`` the proposal was taken at (``safe`` | ``expected``) and both answers,
``max_model_len_safe`` and ``max_model_len_expected``. Null for rows stored before this revision.

Revision ID: 0010
Revises: 0012 (chained after main's 0012 at the merge; the lead may re-number)
Create Date: 2026-12-06
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: Union[str, Sequence[str], None] = "0012"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

INTERVAL = (
    ("available_kv_cache_bytes_low", sa.BigInteger),
    ("available_kv_cache_bytes_high", sa.BigInteger),
    ("kv_cache_tokens_low", sa.BigInteger),
    ("kv_cache_tokens_high", sa.BigInteger),
)
COLUMNS = {
    "candidates": INTERVAL + (("num_gpu_blocks_low", sa.Integer), ("num_gpu_blocks_high", sa.Integer)),
    "proposals": INTERVAL + (("risk", sa.Text), ("max_model_len_safe", sa.Integer),
                             ("max_model_len_expected", sa.Integer)),
}


def upgrade() -> None:
    # plain ADD COLUMN (nullable, no default): no table copy, so the views on these tables stay valid
    for table, cols in COLUMNS.items():
        for name, type_ in cols:
            op.add_column(table, sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    for table, cols in COLUMNS.items():
        for name, _type in reversed(cols):  # SQLite >= 3.35 drops a column in place
            op.drop_column(table, name)

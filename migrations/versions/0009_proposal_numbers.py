"""A proposal's own numbers: the proposed point's profile batch and budget terms.

``proposals`` gains ``max_num_batched_tokens`` and the byte columns of its point's ledger
(``requested_memory_bytes``, ``weights_bytes``, ``activation_peak_bytes``, ``non_torch_bytes``,
``cuda_graph_bytes``, ``available_kv_cache_bytes``), as the search evaluated that point (a proposal
is mostly off the drop's grid, so no ``candidates`` row holds them). Null when nothing fits, and
for proposals stored before this revision.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: Union[str, Sequence[str], None] = "0008"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

COLUMNS = (
    ("max_num_batched_tokens", sa.Integer),
    ("requested_memory_bytes", sa.BigInteger),
    ("weights_bytes", sa.BigInteger),
    ("activation_peak_bytes", sa.BigInteger),
    ("non_torch_bytes", sa.BigInteger),
    ("cuda_graph_bytes", sa.BigInteger),
    ("available_kv_cache_bytes", sa.BigInteger),
)


def upgrade() -> None:
    # plain ADD COLUMN (nullable, no default): no table copy, so the views on proposals stay valid
    for name, type_ in COLUMNS:
        op.add_column("proposals", sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    for name, _type in reversed(COLUMNS):  # SQLite >= 3.35 drops a column in place
        op.drop_column("proposals", name)

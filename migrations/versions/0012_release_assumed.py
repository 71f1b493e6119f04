"""The release a drop was answered for when it named none, or one newer than the modelled ones.

``drops`` gains ``release_assumed``: JSON ``{value, requested, kind, reason}``
(:func:`tuner.memory.eras.resolve_release`; ``kind`` ``installed``, ``newest_modelled`` or
``newer_release``). Null when the drop named a modelled release, and for drops stored before this
revision.

Revision ID: 0012
Revises: 0009
Create Date: 2026-12-06
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: Union[str, Sequence[str], None] = "0009"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    # plain ADD COLUMN (nullable, no default): no table copy, so the views on drops stay valid
    op.add_column("drops", sa.Column("release_assumed", sa.Text, nullable=True))


def downgrade() -> None:
    op.drop_column("drops", "release_assumed")

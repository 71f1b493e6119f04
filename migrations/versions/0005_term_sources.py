"""Term sources and the engine cross-check on profile runs (issue 12, engine adapter).

``profile_runs`` gains two JSON text columns (null for runs stored before this revision):

* ``term_sources``: which source gave each term of the run — ``plugin``, ``engine``,
  ``engine-trace``, ``catalog``, ``calibration`` (see :mod:`tuner.engine.crosscheck`), e.g.
  ``{"kv_cache_spec": "engine", "weights": "engine", "activation_peak": "plugin(generic, approximate)", …}``;
* ``engine_check``: what the installed vLLM said (release, engine-config defaults, KV specs, the
  plugin vs engine comparison and vLLM's blocks at each proposal), or null when no engine ran.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: Union[str, Sequence[str], None] = "0004"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

COLUMNS = ("term_sources", "engine_check")


def upgrade() -> None:
    with op.batch_alter_table("profile_runs") as batch:
        for name in COLUMNS:
            batch.add_column(sa.Column(name, sa.Text, nullable=True))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # native DROP COLUMN (SQLite 3.35+): a batch copy of the table would break the 0004 views
        for name in reversed(COLUMNS):
            op.execute(f"ALTER TABLE profile_runs DROP COLUMN {name}")
        return
    for name in reversed(COLUMNS):
        op.drop_column("profile_runs", name)

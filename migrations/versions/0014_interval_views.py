"""The interval in the views (issue 27): ``latest_proposals`` and ``fleet_latest_proposals`` gain
the risk the proposal was taken at and both answers (``risk``, ``max_model_len_safe``,
``max_model_len_expected``) and the interval's ends of the KV cache (``kv_cache_tokens_low`` /
``_high``, ``available_kv_cache_bytes_low`` / ``_high``), all stored by revision 0010. Null for
proposals stored before it.

``fleet_latest_proposals`` and ``fleet_by_device`` read ``latest_proposals`` (PostgreSQL refuses to
drop a view others depend on), so the three are dropped and created again, in 0007's order. The
other views are unchanged.

Revision ID: 0014
Revises: 0010
Create Date: 2026-12-06
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
from typing import Sequence, Union

import sqlalchemy as sa  # noqa: F401
from alembic import op

revision: str = "0014"
down_revision: Union[str, Sequence[str], None] = "0010"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def _v7():
    if "." in __name__:
        return importlib.import_module(__name__.rsplit(".", 1)[0] + ".0007_fleet")
    spec = importlib.util.spec_from_file_location("_v7", pathlib.Path(__file__).with_name("0007_fleet.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


#: The interval columns of a proposal (revision 0010), in the views' column order.
INTERVAL_COLUMNS = ("risk", "max_model_len_safe", "max_model_len_expected", "kv_cache_tokens_low",
                    "kv_cache_tokens_high", "available_kv_cache_bytes_low", "available_kv_cache_bytes_high")

#: Revision 0007's latest_proposals plus the interval columns.
LATEST_PROPOSALS = f"""
CREATE VIEW latest_proposals AS
SELECT d.id AS drop_id, d.name AS drop_name, d.model, d.device_name, d.engine_version, d.method,
       p.gpu_memory_utilization, p.max_model_len, p.num_gpu_blocks, p.kv_cache_tokens, p.max_concurrency,
       p.vllm_args, p.reason, p.created_at, h.host_id, h.watch_dir, d.owner_id, d.answered_from_drop_id,
       {', '.join('p.' + c for c in INTERVAL_COLUMNS)}
FROM proposals p
JOIN drops d ON d.id = p.drop_id
LEFT JOIN hosts h ON h.id = d.owner_id
WHERE d.retired_at IS NULL
  AND d.id = (SELECT MAX(d2.id) FROM drops d2
              WHERE d2.name = d.name AND d2.retired_at IS NULL
                AND (d2.owner_id = d.owner_id OR (d2.owner_id IS NULL AND d.owner_id IS NULL)))
"""

#: Revision 0007's fleet_latest_proposals plus the risk and both answers.
FLEET_LATEST_PROPOSALS = """
CREATE VIEW fleet_latest_proposals AS
SELECT l.host_id, l.watch_dir, l.drop_name, l.device_name, l.model, l.engine_version, l.gpu_memory_utilization,
       l.max_model_len, l.num_gpu_blocks, l.kv_cache_tokens, l.max_concurrency, l.vllm_args,
       CASE WHEN l.answered_from_drop_id IS NULL THEN 0 ELSE 1 END AS from_shared_result,
       l.created_at, h.last_seen_at, l.risk, l.max_model_len_safe, l.max_model_len_expected
FROM latest_proposals l
JOIN hosts h ON h.id = l.owner_id
"""

_REBUILT = ("latest_proposals", "fleet_latest_proposals", "fleet_by_device")


def views() -> dict[str, str]:
    """name → CREATE VIEW statement after this revision, in creation order."""
    out = dict(_v7().VIEWS)
    out["latest_proposals"] = LATEST_PROPOSALS
    out["fleet_latest_proposals"] = FLEET_LATEST_PROPOSALS
    return out


#: Views as of this revision (a later migration rebuilding a table imports these).
VIEWS = views()


def _rebuild(which: dict[str, str]) -> None:
    for name in reversed(_REBUILT):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    for name in _REBUILT:
        op.execute(which[name].strip())


def upgrade() -> None:
    _rebuild(VIEWS)


def downgrade() -> None:
    _rebuild(dict(_v7().VIEWS))

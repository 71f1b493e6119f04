"""Initial schema: drops, profile_runs, candidates, proposals.

Byte columns are BigInteger and end in ``_bytes``; times are UTC ISO-8601 text
(``YYYY-MM-DDTHH:MM:SS.ffffffZ``); ``elapsed_s`` is seconds. Frozen copy of the schema in
``tuner/store/database.py`` at this revision — later changes go in new revisions, not here.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: Union[str, Sequence[str], None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

TS = sa.String(32)


def _bytes(name: str) -> sa.Column:
    return sa.Column(name, sa.BigInteger, nullable=True)


def upgrade() -> None:
    op.create_table(
        "drops",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("path", sa.Text, nullable=True),
        sa.Column("content_sha256", sa.String(64), nullable=False),
        sa.Column("content", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("device_name", sa.Text, nullable=False),
        sa.Column("engine_version", sa.Text, nullable=False),
        sa.Column("method", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("retired_at", TS, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_drops"),
    )
    op.create_index("ix_drops_content_sha256", "drops", ["content_sha256"])

    op.create_table(
        "profile_runs",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("drop_id", sa.Integer, nullable=False),
        sa.Column("pass_sha256", sa.String(64), nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("method", sa.Text, nullable=False),
        sa.Column("engine_version", sa.Text, nullable=False),
        sa.Column("era", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("model_config_sha256", sa.String(64), nullable=True),
        sa.Column("architecture", sa.Text, nullable=True),
        sa.Column("plugin", sa.Text, nullable=True),
        sa.Column("device_name", sa.Text, nullable=False),
        _bytes("device_total_memory_bytes"),
        sa.Column("dtype", sa.Text, nullable=False),
        sa.Column("kv_cache_dtype", sa.Text, nullable=False),
        sa.Column("tensor_parallel_size", sa.Integer, nullable=False),
        sa.Column("pipeline_parallel_size", sa.Integer, nullable=False),
        sa.Column("max_num_batched_tokens", sa.Integer, nullable=False),
        sa.Column("max_num_seqs", sa.Integer, nullable=False),
        sa.Column("num_sampled_rows", sa.Integer, nullable=True),
        _bytes("weights_bytes"),
        _bytes("activation_peak_bytes"),
        _bytes("forward_peak_bytes"),
        _bytes("sampler_peak_bytes"),
        sa.Column("tool_version", sa.Text, nullable=False),
        sa.Column("torch_version", sa.Text, nullable=True),
        sa.Column("transformers_version", sa.Text, nullable=True),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("elapsed_s", sa.Float, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_profile_runs"),
        sa.ForeignKeyConstraint(["drop_id"], ["drops.id"], name="fk_profile_runs_drop_id_drops"),
        sa.CheckConstraint("status IN ('ok', 'failed')", name="ck_profile_runs_status"),
        sa.CheckConstraint(
            "method IN ('simulate', 'cuda', 'vllm', 'import')", name="ck_profile_runs_method"
        ),
    )
    op.create_index("ix_profile_runs_drop_id", "profile_runs", ["drop_id"])
    op.create_index("ix_profile_runs_pass_sha256", "profile_runs", ["pass_sha256"])

    op.create_table(
        "candidates",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("drop_id", sa.Integer, nullable=False),
        sa.Column("profile_run_id", sa.Integer, nullable=True),
        sa.Column("gpu_memory_utilization", sa.Float, nullable=False),
        sa.Column("max_model_len", sa.Integer, nullable=False),
        sa.Column("max_num_batched_tokens", sa.Integer, nullable=False),
        sa.Column("fits", sa.Boolean, nullable=False),
        sa.Column("reason", sa.Text, nullable=True),
        _bytes("requested_memory_bytes"),
        _bytes("weights_bytes"),
        _bytes("activation_peak_bytes"),
        _bytes("non_torch_bytes"),
        _bytes("cuda_graph_bytes"),
        _bytes("available_kv_cache_bytes"),
        sa.Column("num_gpu_blocks", sa.Integer, nullable=True),
        sa.Column("kv_cache_tokens", sa.BigInteger, nullable=True),
        sa.Column("max_concurrency", sa.Float, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_candidates"),
        sa.ForeignKeyConstraint(["drop_id"], ["drops.id"], name="fk_candidates_drop_id_drops"),
        sa.ForeignKeyConstraint(
            ["profile_run_id"],
            ["profile_runs.id"],
            name="fk_candidates_profile_run_id_profile_runs",
        ),
    )
    op.create_index("ix_candidates_drop_id", "candidates", ["drop_id"])
    op.create_index("ix_candidates_profile_run_id", "candidates", ["profile_run_id"])

    op.create_table(
        "proposals",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("drop_id", sa.Integer, nullable=False),
        sa.Column("gpu_memory_utilization", sa.Float, nullable=False),
        sa.Column("max_model_len", sa.Integer, nullable=True),
        sa.Column("num_gpu_blocks", sa.Integer, nullable=True),
        sa.Column("kv_cache_tokens", sa.BigInteger, nullable=True),
        sa.Column("max_concurrency", sa.Float, nullable=True),
        sa.Column("vllm_args", sa.Text, nullable=True),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_proposals"),
        sa.ForeignKeyConstraint(["drop_id"], ["drops.id"], name="fk_proposals_drop_id_drops"),
    )
    op.create_index("ix_proposals_drop_id", "proposals", ["drop_id"])


def downgrade() -> None:
    op.drop_index("ix_proposals_drop_id", table_name="proposals")
    op.drop_table("proposals")
    op.drop_index("ix_candidates_profile_run_id", table_name="candidates")
    op.drop_index("ix_candidates_drop_id", table_name="candidates")
    op.drop_table("candidates")
    op.drop_index("ix_profile_runs_pass_sha256", table_name="profile_runs")
    op.drop_index("ix_profile_runs_drop_id", table_name="profile_runs")
    op.drop_table("profile_runs")
    op.drop_index("ix_drops_content_sha256", table_name="drops")
    op.drop_table("drops")

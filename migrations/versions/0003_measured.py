"""Measured and imported runs, calibration (issue 4).

``profile_runs`` gains the columns a measured (``cuda``/``vllm``) or imported run fills.
``calibrations``: one row per measured run that has a simulate prediction of the same settings:
the predicted terms and the residual (measured − predicted, bytes) of the activation peak, the
non-torch memory and the CUDA-graph estimate, plus ``total_delta_bytes`` (the part of the
available-KV error not explained by weights). ``tuner.jobs.calibrate`` aggregates these per model,
device kind, era, dtype, quantization and parallel layout; ``usable`` is False (with a ``note``)
when the prediction disagrees with the run on more than these terms (weights, KV bytes per
token), so the run must not calibrate.

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


TS = sa.String(32)

#: Byte columns of ``calibrations`` (all nullable: a log may lack a term).
CALIBRATION_BYTES = (
    "predicted_activation_peak_bytes", "predicted_non_torch_bytes", "predicted_cuda_graph_bytes",
    "predicted_available_kv_cache_bytes", "activation_peak_delta_bytes", "non_torch_delta_bytes",
    "cuda_graph_delta_bytes", "total_delta_bytes", "kv_error_bytes",
)


def upgrade() -> None:
    with op.batch_alter_table("profile_runs") as batch:
        for name, type_ in COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))
    op.create_table(
        "calibrations",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("profile_run_id", sa.Integer, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("model_config_sha256", sa.String(64), nullable=True),
        sa.Column("device_name", sa.Text, nullable=False),
        sa.Column("era", sa.Text, nullable=False),
        sa.Column("tensor_parallel_size", sa.Integer, nullable=False),
        sa.Column("pipeline_parallel_size", sa.Integer, nullable=False),
        sa.Column("dtype", sa.Text, nullable=False),
        sa.Column("quantization", sa.Text, nullable=True),
        *[sa.Column(name, sa.BigInteger, nullable=True) for name in CALIBRATION_BYTES],
        sa.Column("predicted_num_gpu_blocks", sa.Integer, nullable=True),
        sa.Column("usable", sa.Boolean, nullable=False),
        sa.Column("note", sa.Text, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_calibrations"),
        sa.ForeignKeyConstraint(["profile_run_id"], ["profile_runs.id"],
                                name="fk_calibrations_profile_run_id_profile_runs"),
    )
    op.create_index("ix_calibrations_profile_run_id", "calibrations", ["profile_run_id"])
    op.create_index("ix_calibrations_model_config_sha256", "calibrations", ["model_config_sha256"])


def downgrade() -> None:
    op.drop_index("ix_calibrations_model_config_sha256", table_name="calibrations")
    op.drop_index("ix_calibrations_profile_run_id", table_name="calibrations")
    op.drop_table("calibrations")
    with op.batch_alter_table("profile_runs") as batch:
        for name, _type in reversed(COLUMNS):
            batch.drop_column(name)

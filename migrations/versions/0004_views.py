"""SQL views for readers (issue 5): latest proposals, breakdowns in GiB, the fit surface, and
measured vs simulated residuals.

Views hold no data; they read the tables. Sizes in ``*_gib`` columns are GiB (2^30 bytes) rounded
to 3 decimals; residuals are simulated − measured (bytes, blocks, tokens) and a percentage of
the measured value. The SQL is plain (``ROUND``, ``CASE``, ``NULLIF``, ``ROW_NUMBER() OVER``) and
runs on SQLite ≥ 3.25 and PostgreSQL.

A later migration that rebuilds a table these views read (SQLite batch mode copies, drops and
renames it) must drop the views first and create them again afterwards: import ``VIEWS`` from this
module (``drop_views(op)`` / ``create_views(op)``) rather than copying the SQL.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from __future__ import annotations

from typing import Sequence, Union

import sqlalchemy as sa  # noqa: F401
from alembic import op

revision: str = "0004"
down_revision: Union[str, Sequence[str], None] = "0003"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def _gib(expr: str, name: str) -> str:
    return f"ROUND({expr} / 1073741824.0, 3) AS {name}"


_MEASURED = "('cuda', 'vllm', 'import')"

#: The newest proposals per drop name: the proposals of the highest-id drop row of each name
#: that is not retired (one row per gpu_memory_utilization).
LATEST_PROPOSALS = """
CREATE VIEW latest_proposals AS
SELECT d.id AS drop_id, d.name AS drop_name, d.model, d.device_name, d.engine_version, d.method,
       p.gpu_memory_utilization, p.max_model_len, p.num_gpu_blocks, p.kv_cache_tokens, p.max_concurrency,
       p.vllm_args, p.reason, p.created_at
FROM proposals p
JOIN drops d ON d.id = p.drop_id
WHERE d.retired_at IS NULL
  AND d.id = (SELECT MAX(d2.id) FROM drops d2 WHERE d2.name = d.name AND d2.retired_at IS NULL)
"""

#: One row per profile run (simulated pass or measured/imported start-up), sizes in GiB.
RUN_BREAKDOWN_GIB = f"""
CREATE VIEW run_breakdown_gib AS
SELECT r.id AS run_id, r.drop_id, d.name AS drop_name, r.method, r.status, r.model, r.device_name,
       r.engine_version, r.era, r.dtype, r.kv_cache_dtype, r.tensor_parallel_size, r.pipeline_parallel_size,
       r.max_num_batched_tokens, r.max_num_seqs, r.num_sampled_rows, r.gpu_memory_utilization, r.max_model_len,
       {_gib('r.device_total_memory_bytes', 'device_total_gib')},
       {_gib('r.weights_bytes', 'weights_gib')},
       {_gib('r.activation_peak_bytes', 'activation_peak_gib')},
       {_gib('r.forward_peak_bytes', 'forward_peak_gib')},
       {_gib('r.sampler_peak_bytes', 'sampler_peak_gib')},
       {_gib('r.non_torch_bytes', 'non_torch_gib')},
       {_gib('r.cuda_graph_bytes', 'cuda_graph_gib')},
       {_gib('r.available_kv_cache_bytes', 'available_kv_cache_gib')},
       r.num_gpu_blocks, r.kv_cache_tokens, r.max_concurrency, r.error_message, r.source, r.started_at, r.elapsed_s
FROM profile_runs r
LEFT JOIN drops d ON d.id = r.drop_id
"""

#: One row per simulated candidate (gpu_memory_utilization × max_model_len): the budget in GiB.
CANDIDATE_BREAKDOWN_GIB = f"""
CREATE VIEW candidate_breakdown_gib AS
SELECT c.id AS candidate_id, c.drop_id, d.name AS drop_name, d.model, d.device_name, d.engine_version,
       c.profile_run_id, c.gpu_memory_utilization, c.max_model_len, c.max_num_batched_tokens,
       CASE WHEN c.fits THEN 1 ELSE 0 END AS fits,
       {_gib('c.requested_memory_bytes', 'requested_gib')},
       {_gib('c.weights_bytes', 'weights_gib')},
       {_gib('c.activation_peak_bytes', 'activation_peak_gib')},
       {_gib('c.non_torch_bytes', 'non_torch_gib')},
       {_gib('c.cuda_graph_bytes', 'cuda_graph_gib')},
       {_gib('c.available_kv_cache_bytes', 'available_kv_cache_gib')},
       c.num_gpu_blocks, c.kv_cache_tokens, c.max_concurrency, c.reason
FROM candidates c
JOIN drops d ON d.id = c.drop_id
"""

#: The fit surface per drop and gpu_memory_utilization; ``fits_above_a_failure`` = 1 marks a
#: length that starts although a shorter one at the same u does not (a non-monotone surface).
FIT_SURFACE = """
CREATE VIEW fit_surface AS
SELECT c.drop_id, d.name AS drop_name, c.gpu_memory_utilization, c.max_model_len, c.max_num_batched_tokens,
       CASE WHEN c.fits THEN 1 ELSE 0 END AS fits, c.num_gpu_blocks, c.kv_cache_tokens, c.max_concurrency,
       CASE WHEN c.fits AND EXISTS (
              SELECT 1 FROM candidates c2
              WHERE c2.drop_id = c.drop_id AND c2.gpu_memory_utilization = c.gpu_memory_utilization
                AND c2.max_model_len < c.max_model_len AND NOT c2.fits)
            THEN 1 ELSE 0 END AS fits_above_a_failure
FROM candidates c
JOIN drops d ON d.id = c.drop_id
"""


def _pair(col: str, *, residual: bool = True, gib: bool = False) -> list[str]:
    out = [f"m.{col} AS measured_{col}", f"c.{col} AS simulated_{col}"]
    if residual:
        out.append(f"c.{col} - m.{col} AS {col}_residual")
    if gib:
        base = col[: -len("_bytes")]
        out.append(f"ROUND((c.{col} - m.{col}) / 1073741824.0, 3) AS {base}_residual_gib")
    return out


_MVS_COLUMNS = [
    "m.id AS measured_run_id", "m.method AS measured_method", "m.source AS measured_source",
    "CASE WHEN m.status = 'ok' AND m.error_message IS NULL THEN 1 ELSE 0 END AS measured_fits",
    "m.error_message AS measured_error",
    "s.id AS simulated_run_id", "c.id AS simulated_candidate_id", "c.drop_id AS simulated_drop_id",
    "CASE WHEN c.fits THEN 1 ELSE 0 END AS simulated_fits",
    "m.model", "m.device_name", "m.era", "m.engine_version", "m.tensor_parallel_size", "m.pipeline_parallel_size",
    "m.dtype", "m.kv_cache_dtype", "m.gpu_memory_utilization", "c.max_model_len",
    "m.max_num_batched_tokens AS measured_max_num_batched_tokens",
    "c.max_num_batched_tokens AS simulated_max_num_batched_tokens",
    *_pair("num_gpu_blocks"),
    "ROUND(100.0 * (c.num_gpu_blocks - m.num_gpu_blocks) / NULLIF(m.num_gpu_blocks, 0), 2) "
    "AS num_gpu_blocks_residual_pct",
    *_pair("kv_cache_tokens"),
    *_pair("available_kv_cache_bytes", gib=True),
    *_pair("weights_bytes", gib=True),
    *_pair("activation_peak_bytes", gib=True),
    *_pair("non_torch_bytes", gib=True),
]


def _alias(col: str) -> str:
    return col.rsplit(" AS ", 1)[-1].split(".")[-1]


#: Each measured run (method cuda / vllm / import) next to the newest simulated candidate for the
#: same model (name or config hash), device, vLLM era or version, TP, PP, dtype, KV dtype and
#: gpu_memory_utilization, and max_model_len when the measured run has one. Residual = simulated −
#: measured: a positive blocks residual means the prediction promised more than the engine had.
MEASURED_VS_SIMULATED = f"""
CREATE VIEW measured_vs_simulated AS
SELECT {', '.join(_alias(c) for c in _MVS_COLUMNS)}
FROM (
  SELECT {', '.join(_MVS_COLUMNS)},
         ROW_NUMBER() OVER (PARTITION BY m.id ORDER BY c.id DESC) AS match_rank
  FROM profile_runs m
  JOIN profile_runs s
    ON s.method = 'simulate' AND s.status = 'ok'
   AND s.device_name = m.device_name
   AND (s.era = m.era OR s.engine_version = m.engine_version)
   AND s.tensor_parallel_size = m.tensor_parallel_size AND s.pipeline_parallel_size = m.pipeline_parallel_size
   AND s.dtype = m.dtype AND s.kv_cache_dtype = m.kv_cache_dtype
   AND (s.model = m.model OR s.model_config_sha256 = m.model_config_sha256)
  JOIN candidates c
    ON c.profile_run_id = s.id
   AND ABS(c.gpu_memory_utilization - m.gpu_memory_utilization) < 0.000001
   AND (m.max_model_len IS NULL OR c.max_model_len = m.max_model_len)
  WHERE m.method IN {_MEASURED} AND m.gpu_memory_utilization IS NOT NULL
) matched
WHERE match_rank = 1
"""

#: name → CREATE VIEW statement, in creation order.
VIEWS: dict[str, str] = {
    "latest_proposals": LATEST_PROPOSALS,
    "run_breakdown_gib": RUN_BREAKDOWN_GIB,
    "candidate_breakdown_gib": CANDIDATE_BREAKDOWN_GIB,
    "fit_surface": FIT_SURFACE,
    "measured_vs_simulated": MEASURED_VS_SIMULATED,
}


def create_views(operations=op) -> None:
    for sql in VIEWS.values():
        operations.execute(sql.strip())


def drop_views(operations=op) -> None:
    for name in reversed(list(VIEWS)):
        operations.execute(f"DROP VIEW IF EXISTS {name}")


def upgrade() -> None:
    create_views()


def downgrade() -> None:
    drop_views()

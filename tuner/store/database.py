"""Results store: SQLite (default) or any SQLAlchemy URL, schema owned by Alembic.

Tables (a public interface — users write SQL against them):

* ``drops`` — one row per config drop version (its YAML text and identity).
* ``profile_runs`` — one row per profile pass (one dummy forward over
  ``max_num_batched_tokens`` tokens), with full provenance; ``pass_sha256`` is the memo key.
* ``candidates`` — one row per grid point ``gpu_memory_utilization`` × ``max_model_len``.
* ``proposals`` — the recommended settings for a drop.
* ``calibrations`` — per measured run, the simulate prediction's residual per memory term.
* ``jobs`` — the daemon's durable queue: one row per drop file version it has seen (status,
  attempts, typed error, the resulting ``drops.id``).
* ``pass_memo`` — revision 0008: profile passes and model specs by content hash
  (:mod:`tuner.jobs.passmemo`), so a repeated question is answered without a worker.
* ``hosts`` — revision 0007 (fleet): one row per daemon identity (host id + watch directory) with
  its lease; ``jobs.owner_id`` / ``drops.owner_id`` refer to it (:mod:`tuner.store.fleet`).

Views for readers (migration 0004, SQL in ``migrations/versions/0004_views.py``, not declared
here so metadata comparisons see tables only): ``latest_proposals``, ``run_breakdown_gib``,
``candidate_breakdown_gib``, ``fit_surface``, ``measured_vs_simulated``; revision 0007 makes
``latest_proposals`` per owner and adds ``fleet_latest_proposals`` and ``fleet_by_device``;
revision 0014 adds the proposals' interval (risk, both answers, KV ends) to the first two.

Conventions: byte columns are integers (BigInteger) and end in ``_bytes``; times are UTC
ISO-8601 text, ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (fixed width, so text order is time order);
``elapsed_s`` is seconds as a float.

SQLite connections run with ``journal_mode=WAL``, ``synchronous=FULL``, ``foreign_keys=ON`` and a
``busy_timeout``; write transactions start with ``BEGIN IMMEDIATE`` so two writers queue on the
busy timeout instead of failing half-way. Readers use a deferred ``BEGIN`` and never block a writer.

No torch here: the daemon's main process imports this module.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url

from tuner.errors import StoreError
from tuner.store.storerules import DEFAULT_PATH, memo_rows, memo_values, row_values, script_head, utc_text

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = [
    "DEFAULT_PATH",
    "Store",
    "alembic_config",
    "make_engine",
    "metadata",
    "open_store",
    "stage_new_store",
    "store_exists",
    "utc_text",
]

#: Alembic script directory, in package-resource form (``package:path``). The directory
#: ``migrations/`` is installed as the package ``tuner.migrations``, so it is addressed as that
#: package's own root; ``"tuner:migrations"`` would miss it under an editable install.
SCRIPT_LOCATION = "tuner.migrations:."

# ---------------------------------------------------------------------------------------------
# Schema (mirrors migrations/versions/0001_initial.py; tests check the two agree).
# ---------------------------------------------------------------------------------------------

#: The schema's tables; public as :data:`metadata` (see :func:`__getattr__`: the partial index of
#: ``jobs`` joins it on first use).
_metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

_TS = sa.String(32)  # utc_text() output: 27 characters
# One type object per kind, shared by the columns: SQLAlchemy adapts each type object to the
# dialect once per process (type_api.TypeEngine.dialect_impl, constructor_copy); a type class per
# column (sa.Column("x", sa.Integer)) is a new object each, and the first insert of a cold CLI
# paid ~95 such adaptations (about 0.05–0.1 CPU s).
_INT, _BIGINT, _TEXT, _FLOAT = sa.Integer(), sa.BigInteger(), sa.Text(), sa.Float()
_SHA, _KIND = sa.String(64), sa.String(16)


def _bytes(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, _BIGINT, nullable=nullable)


def _budget_columns() -> list[sa.Column]:
    """A point's budget terms (bytes per rank): the candidates' and, from revision 0009, the
    proposals' columns (fresh Column objects per table)."""
    return [_bytes(n) for n in ("requested_memory_bytes", "weights_bytes", "activation_peak_bytes",
                                "non_torch_bytes", "cuda_graph_bytes", "available_kv_cache_bytes")]


def _interval_columns() -> list[sa.Column]:
    """Revision 0010: a point's interval ends (tuner/memory/uncertainty.py), candidates' and proposals'."""
    return [_bytes("available_kv_cache_bytes_low"), _bytes("available_kv_cache_bytes_high"),
            sa.Column("kv_cache_tokens_low", _BIGINT, nullable=True),
            sa.Column("kv_cache_tokens_high", _BIGINT, nullable=True)]


#: Revision 0007 (fleet): one row per daemon identity (host id + watch directory) with its lease.
#: ``gpus`` is JSON text (a list of ``{name, total_memory_bytes}``); times are UTC text.
hosts_table = sa.Table(
    "hosts",
    _metadata,
    sa.Column("id", _INT, primary_key=True),
    sa.Column("host_id", _TEXT, nullable=False),
    sa.Column("watch_dir", _TEXT, nullable=False),
    sa.Column("pid", _INT, nullable=True),
    sa.Column("tool_version", _TEXT, nullable=True),
    sa.Column("gpus", _TEXT, nullable=True),
    sa.Column("started_at", _TS, nullable=False),
    sa.Column("last_seen_at", _TS, nullable=False),
    sa.Column("lease_expires_at", _TS, nullable=False),
    sa.UniqueConstraint("host_id", "watch_dir", name="uq_hosts_host_id"),
)

drops_table = sa.Table(
    "drops",
    _metadata,
    sa.Column("id", _INT, primary_key=True),
    sa.Column("name", _TEXT, nullable=False),
    sa.Column("path", _TEXT, nullable=True),
    sa.Column("content_sha256", _SHA, nullable=False, index=True),
    sa.Column("content", _TEXT, nullable=False),
    sa.Column("model", _TEXT, nullable=False),
    sa.Column("device_name", _TEXT, nullable=False),
    sa.Column("engine_version", _TEXT, nullable=False),
    sa.Column("method", _TEXT, nullable=False),
    sa.Column("created_at", _TS, nullable=False),
    sa.Column("retired_at", _TS, nullable=True),
    # revision 0007 (fleet): the daemon that owns the drop (null: `profile` / `import-log`), the
    # shared result key (tuner.store.fleet.result_key) and the drop whose stored result answered it.
    sa.Column("owner_id", _INT, sa.ForeignKey("hosts.id"), nullable=True, index=True),
    sa.Column("result_sha256", _SHA, nullable=True, index=True),
    sa.Column("answered_from_drop_id", _INT, sa.ForeignKey("drops.id"), nullable=True),
    sa.Column("warnings", _TEXT, nullable=True),  # revision 0006: JSON list of the run's warnings
    # revision 0012: the release assumed for the drop (JSON {value, requested, kind, reason}; null = the
    # drop named a modelled release; tuner.memory.eras.resolve_release)
    sa.Column("release_assumed", _TEXT, nullable=True),
)

profile_runs_table = sa.Table(
    "profile_runs",
    _metadata,
    sa.Column("id", _INT, primary_key=True),
    sa.Column("drop_id", _INT, sa.ForeignKey("drops.id"), nullable=False, index=True),
    sa.Column("pass_sha256", _SHA, nullable=False, index=True),
    sa.Column("status", _TEXT, nullable=False),
    sa.Column("error", _TEXT, nullable=True),
    sa.Column("method", _TEXT, nullable=False),
    sa.Column("engine_version", _TEXT, nullable=False),
    sa.Column("era", _TEXT, nullable=False),
    sa.Column("model", _TEXT, nullable=False),
    sa.Column("model_config_sha256", _SHA, nullable=True),
    sa.Column("architecture", _TEXT, nullable=True),
    sa.Column("plugin", _TEXT, nullable=True),
    sa.Column("device_name", _TEXT, nullable=False),
    _bytes("device_total_memory_bytes"),
    sa.Column("dtype", _TEXT, nullable=False),
    sa.Column("kv_cache_dtype", _TEXT, nullable=False),
    sa.Column("tensor_parallel_size", _INT, nullable=False),
    sa.Column("pipeline_parallel_size", _INT, nullable=False),
    sa.Column("max_num_batched_tokens", _INT, nullable=False),
    sa.Column("max_num_seqs", _INT, nullable=False),
    sa.Column("num_sampled_rows", _INT, nullable=True),
    _bytes("weights_bytes"),
    _bytes("activation_peak_bytes"),
    _bytes("forward_peak_bytes"),
    _bytes("sampler_peak_bytes"),
    sa.Column("tool_version", _TEXT, nullable=False),
    sa.Column("torch_version", _TEXT, nullable=True),
    sa.Column("transformers_version", _TEXT, nullable=True),
    sa.Column("started_at", _TS, nullable=False),
    sa.Column("elapsed_s", _FLOAT, nullable=True),
    # revision 0003: what a measured (cuda / vllm) or imported run observed; null for simulate.
    sa.Column("gpu_memory_utilization", _FLOAT, nullable=True),
    sa.Column("max_model_len", _INT, nullable=True),
    sa.Column("block_size", _INT, nullable=True),
    _bytes("non_torch_bytes"),
    _bytes("cuda_graph_bytes"),
    _bytes("available_kv_cache_bytes"),
    sa.Column("num_gpu_blocks", _INT, nullable=True),
    sa.Column("kv_cache_tokens", _BIGINT, nullable=True),
    sa.Column("max_concurrency", _FLOAT, nullable=True),
    sa.Column("error_message", _TEXT, nullable=True),
    sa.Column("source", _TEXT, nullable=True),
    # revision 0005: JSON text — which source gave each term; the engine adapter's cross-check.
    sa.Column("term_sources", _TEXT, nullable=True),
    sa.Column("engine_check", _TEXT, nullable=True),
    sa.CheckConstraint("status IN ('ok', 'failed')", name="status"),
    sa.CheckConstraint("method IN ('simulate', 'cuda', 'vllm', 'import')", name="method"),
)

candidates_table = sa.Table(
    "candidates",
    _metadata,
    sa.Column("id", _INT, primary_key=True),
    sa.Column("drop_id", _INT, sa.ForeignKey("drops.id"), nullable=False, index=True),
    sa.Column(
        "profile_run_id", _INT, sa.ForeignKey("profile_runs.id"), nullable=True, index=True
    ),
    sa.Column("gpu_memory_utilization", _FLOAT, nullable=False),
    sa.Column("max_model_len", _INT, nullable=False),
    sa.Column("max_num_batched_tokens", _INT, nullable=False),
    sa.Column("fits", sa.Boolean, nullable=False),
    sa.Column("reason", _TEXT, nullable=True),
    *_budget_columns(),
    sa.Column("num_gpu_blocks", _INT, nullable=True),
    sa.Column("kv_cache_tokens", _BIGINT, nullable=True),
    sa.Column("max_concurrency", _FLOAT, nullable=True),
    # revision 0010: the interval's ends (tuner/memory/uncertainty.py); null for rows stored before it.
    *_interval_columns(),
    sa.Column("num_gpu_blocks_low", _INT, nullable=True),
    sa.Column("num_gpu_blocks_high", _INT, nullable=True),
)

proposals_table = sa.Table(
    "proposals",
    _metadata,
    sa.Column("id", _INT, primary_key=True),
    sa.Column("drop_id", _INT, sa.ForeignKey("drops.id"), nullable=False, index=True),
    sa.Column("gpu_memory_utilization", _FLOAT, nullable=False),
    sa.Column("max_model_len", _INT, nullable=True),
    sa.Column("num_gpu_blocks", _INT, nullable=True),
    sa.Column("kv_cache_tokens", _BIGINT, nullable=True),
    sa.Column("max_concurrency", _FLOAT, nullable=True),
    sa.Column("vllm_args", _TEXT, nullable=True),
    sa.Column("reason", _TEXT, nullable=True),
    sa.Column("created_at", _TS, nullable=False),
    # revision 0009: the proposed point's own numbers (its profile batch and budget terms; null
    # when nothing fits, and for proposals stored before this revision).
    sa.Column("max_num_batched_tokens", _INT, nullable=True),
    *_budget_columns(),
    # revision 0010: the risk the proposal was taken at, both answers, the interval's ends
    *_interval_columns(),
    sa.Column("risk", _TEXT, nullable=True),
    sa.Column("max_model_len_safe", _INT, nullable=True),
    sa.Column("max_model_len_expected", _INT, nullable=True),
)

#: Revision 0002: the daemon's durable job queue (see :mod:`tuner.store.jobqueue`). One row per
#: (drop file path, content); ``status`` pending → running → done | failed, or cancelled.
JOB_STATES = ("pending", "running", "done", "failed", "cancelled")
jobs_table = sa.Table(
    "jobs",
    _metadata,
    sa.Column("id", _INT, primary_key=True),
    sa.Column("path", _TEXT, nullable=False, index=True),
    sa.Column("content_sha256", _SHA, nullable=False),
    sa.Column("content", _TEXT, nullable=True),
    sa.Column("status", _TEXT, nullable=False, index=True),
    sa.Column("attempts", _INT, nullable=False),
    sa.Column("error_type", _TEXT, nullable=True),
    sa.Column("error", _TEXT, nullable=True),
    sa.Column("drop_id", _INT, sa.ForeignKey("drops.id"), nullable=True),
    sa.Column("worker_pid", _INT, nullable=True),
    sa.Column("created_at", _TS, nullable=False),
    sa.Column("started_at", _TS, nullable=True),
    sa.Column("finished_at", _TS, nullable=True),
    sa.Column("retired_at", _TS, nullable=True),
    # revision 0007: the daemon (hosts.id) whose watch directory holds the file; only it claims the job.
    sa.Column("owner_id", _INT, sa.ForeignKey("hosts.id"), nullable=True, index=True),
    # revision 0006 (issue 15): drop identity, failure kinds, retries with backoff
    sa.Column("name", _TEXT, nullable=True, index=True),
    sa.Column("failure_kind", _TEXT, nullable=True),
    sa.Column("retry_at", _TS, nullable=True),
    sa.Column("interruptions", _INT, nullable=True),
    sa.Column("history", _TEXT, nullable=True),
    sa.CheckConstraint("status IN ('pending', 'running', 'done', 'failed', 'cancelled')", name="status"),
)


def _jobs_pending_index() -> sa.Index:
    """``uq_jobs_pending_path`` (revision 0007): one pending job per (owner, path), a partial
    unique index. Built on first use of :data:`metadata`, not at import: its ``sqlite_where`` /
    ``postgresql_where`` make SQLAlchemy import both dialects to check those keywords, and the
    PostgreSQL dialect (with its asyncpg driver module) costs a cold SQLite CLI about 0.1 CPU s;
    no query needs the index declared (the database has it from the migration)."""
    return sa.Index("uq_jobs_pending_path", jobs_table.c.owner_id, jobs_table.c.path, unique=True,
                    sqlite_where=sa.text("status = 'pending'"), postgresql_where=sa.text("status = 'pending'"))

#: Revision 0003: one row per measured/imported run that has a simulate prediction of the same
#: settings — the predicted terms and the residual (measured − predicted, bytes) per term that
#: :mod:`tuner.jobs.calibrate` aggregates per model, device kind, era and parallel layout.
calibrations_table = sa.Table(
    "calibrations",
    _metadata,
    sa.Column("id", _INT, primary_key=True),
    sa.Column("profile_run_id", _INT, sa.ForeignKey("profile_runs.id"), nullable=False, index=True),
    sa.Column("model", _TEXT, nullable=False),
    sa.Column("model_config_sha256", _SHA, nullable=True, index=True),
    sa.Column("device_name", _TEXT, nullable=False),
    sa.Column("era", _TEXT, nullable=False),
    sa.Column("tensor_parallel_size", _INT, nullable=False),
    sa.Column("pipeline_parallel_size", _INT, nullable=False),
    sa.Column("dtype", _TEXT, nullable=False),
    sa.Column("quantization", _TEXT, nullable=True),
    _bytes("predicted_activation_peak_bytes"),
    _bytes("predicted_non_torch_bytes"),
    _bytes("predicted_cuda_graph_bytes"),
    _bytes("predicted_available_kv_cache_bytes"),
    _bytes("activation_peak_delta_bytes"),
    _bytes("non_torch_delta_bytes"),
    _bytes("cuda_graph_delta_bytes"),
    _bytes("total_delta_bytes"),
    _bytes("kv_error_bytes"),
    sa.Column("predicted_num_gpu_blocks", _INT, nullable=True),
    sa.Column("usable", sa.Boolean, nullable=False),
    sa.Column("note", _TEXT, nullable=True),
    sa.Column("created_at", _TS, nullable=False),
)

#: Revision 0008 (issue 13): the pass memo (:mod:`tuner.jobs.passmemo`). One row per entry, keyed by
#: the SHA-256 of what it was computed from; ``kind`` ``spec`` (a model spec) or ``pass`` (one
#: rank's profile pass); ``value`` is the entry as JSON text. Rows are only ever inserted.
pass_memo_table = sa.Table(
    "pass_memo",
    _metadata,
    sa.Column("id", _INT, primary_key=True),
    sa.Column("memo_key", _SHA, nullable=False, unique=True),
    sa.Column("kind", _KIND, nullable=False),
    sa.Column("model_config_sha256", _SHA, nullable=False, index=True),
    sa.Column("tool_version", _TEXT, nullable=False),
    sa.Column("method", _TEXT, nullable=False),
    sa.Column("device_name", _TEXT, nullable=True),
    sa.Column("era", _TEXT, nullable=True),
    sa.Column("value", _TEXT, nullable=False),
    sa.Column("created_at", _TS, nullable=False),
)

_complete = False


def __getattr__(name: str) -> Any:
    """``tuner.store.database.metadata``: every table with every index (for Alembic's ``env.py``, metadata
    comparisons, ``create_all``), the partial ``jobs`` index (:func:`_jobs_pending_index`) added
    the first time it is asked for."""
    global _complete
    if name == "metadata":
        if not _complete:
            _jobs_pending_index()  # an Index on a table's columns joins that table (and its MetaData)
            _complete = True
        return _metadata
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------


def _resolve_url(url: str | None, default_path: str) -> URL:
    """A SQLAlchemy URL; a plain path (no ``://``) means a SQLite file there.

    Raises:
        StoreError: unparsable URL, or an in-memory SQLite URL (results would vanish at exit).
    """
    if not url:
        return URL.create("sqlite", database=str(default_path))
    if "://" not in url:
        return URL.create("sqlite", database=url)
    try:
        u = make_url(url)
    except Exception as e:  # sqlalchemy.exc.ArgumentError
        raise StoreError(f"not a SQLAlchemy URL (expected e.g. sqlite:///var/ctx-tuner.sqlite): {error_text(e)}",
                         where=url) from e
    if u.get_backend_name() == "sqlite" and u.database in (None, "", ":memory:"):
        raise StoreError("an in-memory SQLite database would lose the results; give a file path", where=url)
    return u


def _is_file_sqlite(u: URL) -> bool:
    return u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:")


def make_engine(
    url: str | URL,
    *,
    readonly: bool = False,
    foreign_keys: bool = True,
    busy_timeout_s: float = 30.0,
) -> Engine:
    """Create an engine; for SQLite install the WAL/busy/BEGIN IMMEDIATE connection set-up.

    ``readonly`` opens a SQLite file through a ``file:...?mode=ro`` URI (the file must exist;
    ``journal_mode`` is then left as the file has it); on PostgreSQL it opens read-only sessions
    (``SET SESSION CHARACTERISTICS … READ ONLY`` through psycopg). Server engines use
    ``pool_pre_ping`` so a restarted server is reconnected. ``foreign_keys=False`` is for migrations
    (SQLite batch mode copies tables). ``busy_timeout_s`` is seconds. Writes on a read-only engine
    fail in SQLite itself ("attempt to write a readonly database").
    """
    u = make_url(url)
    if u.get_backend_name() != "sqlite":
        # A server database: check each pooled connection before use (a restarted server is
        # reconnected instead of failing the next query), give up connecting after 10 s by
        # default, and open read-only sessions for readers.
        kw: dict[str, Any] = {"pool_pre_ping": True}
        if u.get_backend_name() == "postgresql" and "connect_timeout" not in u.query:
            kw["connect_args"] = {"connect_timeout": 10}
        if readonly and u.get_backend_name() == "postgresql":
            kw["execution_options"] = {"postgresql_readonly": True}
        return sa.create_engine(u, **kw)
    if readonly:
        if not _is_file_sqlite(u):
            raise StoreError("read-only open needs a SQLite file", where=_show(u))
        path = Path(u.database).resolve()
        # pysqlite passes unknown query keys through to the SQLite URI when uri=true.
        u = u.set(database=path.as_uri(), query={**u.query, "mode": "ro", "uri": "true"})
    engine = sa.create_engine(u)
    begin = "BEGIN" if readonly else "BEGIN IMMEDIATE"
    busy_ms = int(busy_timeout_s * 1000)

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {busy_ms}")
            if not readonly:
                cur.execute("PRAGMA journal_mode = WAL").fetchall()
            cur.execute("PRAGMA synchronous = FULL")
            cur.execute(f"PRAGMA foreign_keys = {'ON' if foreign_keys else 'OFF'}")
        finally:
            cur.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql(conn.get_execution_options().get("tuner_begin", begin))

    return engine


def _show(u: URL | str) -> str:
    return make_url(u).render_as_string(hide_password=True)


def alembic_config(url: str | URL, *, connection: Connection | None = None) -> Config:
    """Alembic ``Config`` for the packaged migrations, pointed at ``url``.

    With ``connection``, ``migrations/env.py`` runs on it (inside its transaction) instead of
    opening its own engine. Use with ``alembic.command``: ``command.downgrade(cfg, "base")``.
    """
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    # ConfigParser interpolation: a literal % in a URL (encoded password) must be doubled.
    cfg.set_main_option("sqlalchemy.url", _url_text(url).replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def _url_text(url: str | URL) -> str:
    return make_url(url).render_as_string(hide_password=False)


# ---------------------------------------------------------------------------------------------
# Store
# ---------------------------------------------------------------------------------------------


_BACKGROUND_RE = re.compile(r"\s*\(Background on this error at: [^)]*\)")


def error_text(e: BaseException) -> str:
    """An exception as StoreError text: without SQLAlchemy's "(Background on this error at:
    https://sqlalche.me/…)" trailer (a link, not information)."""
    return _BACKGROUND_RE.sub("", str(e)).strip()


def _check_foreign_sqlite(u: URL, where: str) -> None:
    """Refuse to migrate an existing SQLite file that holds other tables but not ctx-tuner's
    schema (no ``alembic_version``): ctx-tuner would silently add its tables to someone else's
    database. An empty file (or a new one) and an existing ctx-tuner store pass.

    Raises:
        StoreError: naming the file and a few of its tables.
    """
    import sqlite3

    path = Path(u.database)
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except (OSError, sqlite3.Error):
        return  # let the normal open report it
    try:
        names = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') AND name NOT LIKE 'sqlite_%' "
            "ORDER BY name")]
    except sqlite3.Error:
        return  # not a database, locked, …: the normal open reports it
    finally:
        conn.close()
    if names and "alembic_version" not in names:
        shown = ", ".join(names[:5]) + (f", … ({len(names)} in all)" if len(names) > 5 else "")
        raise StoreError(f"{path} is an SQLite database of something else (tables: {shown}) and not a ctx-tuner "
                         "store; refusing to add ctx-tuner's tables to it (give a new or empty file)", where=where)


def open_store(
    url: str | None = None,
    *,
    default_path: str = DEFAULT_PATH,
    readonly: bool = False,
    busy_timeout_s: float = 30.0,
) -> "Store":
    """Open the results store at SQLAlchemy ``url`` and bring its schema to the latest revision.

    ``url=None`` means the SQLite file ``default_path`` (parent directories are created).
    Unless ``readonly``, runs Alembic ``upgrade head`` in one transaction (SQLite: batch mode,
    foreign keys off while migrating; PostgreSQL: under an advisory lock, so concurrent starts
    never race). ``readonly=True`` opens an existing SQLite file with ``mode=ro`` (a server
    database with read-only sessions) and does not migrate; it fails if the file is missing or
    was never migrated.
    ``busy_timeout_s`` is how long (seconds) SQLite waits for another writer's lock.

    Raises ``StoreError(msg, where=url)`` if the database cannot be opened or migrated.
    """
    u = _resolve_url(url, default_path)
    where = _show(u)
    try:
        if _is_file_sqlite(u) and not readonly:
            _check_foreign_sqlite(u, where)
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        engine = make_engine(u, readonly=readonly, busy_timeout_s=busy_timeout_s)
    except StoreError:
        raise
    except (OSError, sa.exc.SQLAlchemyError, ValueError, ImportError) as e:  # ImportError: DB driver missing
        raise StoreError(f"cannot open store: {error_text(e)}", where=where) from e

    try:
        if readonly:
            with engine.connect() as conn:
                version = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()
            if version is None:
                raise StoreError("store has no schema (never migrated)", where=where)
        else:
            _upgrade(u, busy_timeout_s, engine)
    except StoreError:
        engine.dispose()
        raise
    except Exception as e:  # alembic CommandError, SQLAlchemy errors, sqlite3 errors
        engine.dispose()
        action = "open" if readonly else "migrate"
        raise StoreError(f"cannot {action} store: {error_text(e)}", where=where) from e
    return Store(engine, where=where, readonly=readonly)


class StagedStore:
    """A new SQLite store made and migrated under a temporary name beside its path
    (:func:`stage_new_store`), so that a job's result does not wait for Alembic once the job is
    done, and yet no store appears for a job that fails. :meth:`adopt` links it into place
    (never over a file that appeared meanwhile: that one is then used as it is) and removes the
    temporary name; :meth:`discard` removes it without adopting."""

    def __init__(self, path: Path, tmp: Path) -> None:
        self.path, self.tmp = path, tmp

    def adopt(self) -> bool:
        """Link the staged store to its path; True when it is now the store there. False when a
        file is there already (another process made it, or an empty file ``open_store`` will
        migrate) or the file system has no hard links: :func:`open_store` then does as before."""
        import os

        try:
            os.link(self.tmp, self.path)
            return True
        except OSError:  # FileExistsError included
            return False
        finally:
            self.discard()

    def discard(self) -> None:
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{self.tmp}{suffix}").unlink(missing_ok=True)


def stage_new_store(url: str | None, *, default_path: str = DEFAULT_PATH) -> StagedStore | None:
    """A :class:`StagedStore` for ``url`` when it names a SQLite file that does not exist yet in
    a directory that does (``.NAME.PID.new`` beside it, created and migrated by
    :func:`open_store`); None otherwise (a server URL, an existing or empty file, a directory
    still to be made, any failure — ``open_store`` then makes the store as before)."""
    import os

    from tuner.store.litestore import sqlite_file

    path = sqlite_file(url, default_path)
    if path is None:
        return None
    p = Path(path)
    if p.exists() or not p.parent.is_dir():
        return None
    staged = StagedStore(p, p.with_name(f".{p.name}.{os.getpid()}.new"))
    try:
        open_store(str(staged.tmp)).close()
    except (StoreError, OSError):
        staged.discard()
        return None
    if any(Path(f"{staged.tmp}{s}").exists() for s in ("-wal", "-shm", "-journal")):
        staged.discard()  # not closed cleanly: a linked copy would lack its log
        return None
    return staged


def store_exists(url: str | None = None, *, default_path: str = DEFAULT_PATH) -> bool:
    """False only for a SQLite file store whose file does not exist yet (opening it would create
    it); True for an existing file and for every server URL. Never opens anything.

    Raises ``StoreError`` for an unparsable URL (as :func:`open_store`)."""
    u = _resolve_url(url, default_path)
    return not _is_file_sqlite(u) or Path(u.database).exists()


def _at_head(engine: Engine) -> bool:
    """The store's ``alembic_version`` is the scripts' head already (:func:`script_head`; one
    query on the store's own engine, whose connection the store then reuses): opening it needs no
    Alembic (which costs a cold CLI about 0.1–0.2 s to import)."""
    head = script_head()
    if head is None:
        return False
    try:
        with engine.execution_options(tuner_begin="BEGIN").connect() as conn:  # deferred: takes no lock
            rows = conn.execute(sa.text("SELECT version_num FROM alembic_version")).all()
    except sa.exc.SQLAlchemyError:
        return False
    return [r[0] for r in rows] == [head]


#: Alembic's ``op`` and ``context`` are process-global proxies (alembic.operations / alembic.context):
#: two threads upgrading two stores at once swap them under each other ("This Connection is
#: closed", ``op`` None). One upgrade per process at a time; across processes the database's own
#: lock serialises (BEGIN IMMEDIATE on SQLite, the advisory lock on PostgreSQL).
_UPGRADE_LOCK = threading.Lock()


def _upgrade(u: URL, busy_timeout_s: float, engine: Engine) -> None:
    if _at_head(engine):
        return
    from alembic import command

    with _UPGRADE_LOCK:
        _upgrade_locked(u, busy_timeout_s, command)


class _MigrationLogFilter:
    """Alembic logs each step with its script's docstring ("Running upgrade 0001 -> 0002, Daemon job
    queue and drop retirement (issue 3)."): the project's internal issue numbers are dropped, and
    the text is one line."""

    _ISSUE = re.compile(r"\s*\((?:[^()]*?;\s*)?issues? \d+[^()]*\)")

    def filter(self, record: Any) -> bool:
        msg = record.getMessage()
        if msg.startswith("Running upgrade"):
            record.msg, record.args = " ".join(self._ISSUE.sub("", msg).split()), ()
        return True


_MIGRATION_LOG_FILTER = _MigrationLogFilter()


def _upgrade_locked(u: URL, busy_timeout_s: float, command: Any) -> None:
    import logging

    mig_log = logging.getLogger("alembic.runtime.migration")
    if _MIGRATION_LOG_FILTER not in mig_log.filters:
        mig_log.addFilter(_MIGRATION_LOG_FILTER)
    mig = make_engine(u, foreign_keys=False, busy_timeout_s=busy_timeout_s)
    try:
        with mig.begin() as conn:  # one transaction: every step plus alembic_version
            if conn.dialect.name == "postgresql":
                # Several daemons starting at once on one server: one migrates, the others wait
                # here and then find the schema at head (SQLite serialises on BEGIN IMMEDIATE).
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
            command.upgrade(alembic_config(u, connection=conn), "head")
    finally:
        mig.dispose()


#: PostgreSQL advisory lock key held (for the transaction) around Alembic's upgrade: the bytes
#: "ctx-tune" as a signed 64-bit integer.
MIGRATION_LOCK_KEY = int.from_bytes(b"ctx-tune", "big", signed=True)



class Store:
    """Handle on an open results store. Create with :func:`open_store`; call :meth:`close`.

    Every method raises ``StoreError`` (``where`` = the URL, password hidden) on database errors.
    ``engine`` is the underlying SQLAlchemy engine, for ad-hoc SQL against the public tables.
    """

    def __init__(self, engine: Engine, *, where: str, readonly: bool = False) -> None:
        self.engine = engine
        self.where = where
        self.readonly = readonly
        self._reader = engine.execution_options(tuner_begin="BEGIN")  # deferred: takes no lock

    # -- writes ---------------------------------------------------------------------------------

    def save_result(
        self,
        drop: dict,
        runs: list[dict],
        candidates: list[dict],
        proposals: list[dict],
        *,
        also: Callable[[Connection, int], None] | None = None,
    ) -> int:
        """Insert a drop with its runs, candidates and proposals in one transaction.

        ``also(conn, drop_id)``, if given, runs inside the same transaction after the inserts (the
        daemon marks its job done there, so a crash never leaves results without a finished job);
        whatever it raises rolls everything back.

        Dicts are keyed by column name; ``id``, ``drop_id``, ``profile_run_id`` and ``created_at``
        are set here. Each run carries an extra ``"key"`` (any hashable, not stored); each
        candidate an extra ``"run_key"`` naming its run's key, or None. Byte columns take ints;
        time columns take aware datetimes or ISO-8601 text (stored as UTC text).

        Returns the new ``drops.id``. Raises ``StoreError`` for an unknown key (naming table and
        key), a ``run_key`` with no run, a duplicate run key, a non-integer byte value, or any
        database error; on any failure the transaction is rolled back and nothing is written.
        """
        now = utc_text()
        try:
            with self.engine.begin() as conn:
                drop_id = self._insert(conn, drops_table, drop, created_at=now)
                run_ids: dict[Any, int] = {}
                for run in runs:
                    key = run.get("key")
                    if key is not None and key in run_ids:
                        raise StoreError(
                            f"profile_runs: duplicate run key {key!r}", where=self.where
                        )
                    run_id = self._insert(conn, profile_runs_table, run, drop_id=drop_id)
                    if key is not None:
                        run_ids[key] = run_id
                for cand in candidates:
                    rk = cand.get("run_key")
                    if rk is not None and rk not in run_ids:
                        raise StoreError(
                            f"candidates: run_key {rk!r} names no run", where=self.where
                        )
                    self._insert(
                        conn,
                        candidates_table,
                        cand,
                        drop_id=drop_id,
                        profile_run_id=run_ids.get(rk) if rk is not None else None,
                    )
                for prop in proposals:
                    self._insert(conn, proposals_table, prop, drop_id=drop_id, created_at=now)
                if also is not None:
                    also(conn, drop_id)
                return drop_id
        except StoreError:
            raise
        except sa.exc.SQLAlchemyError as e:
            msg = f"save_result failed, nothing written: {error_text(e.orig or e)}"
            raise StoreError(msg, where=self.where) from e

    def _insert(self, conn: Connection, table: sa.Table, row: dict, **fixed: Any) -> int:
        values = row_values(table.name, row, table.c, where=self.where)  # tuner.store.storerules: both paths' rules
        values.update(fixed)
        return conn.execute(table.insert().values(**values)).inserted_primary_key[0]

    # -- reads ----------------------------------------------------------------------------------

    @property
    def reader(self) -> Engine:
        """The engine for reads: a deferred ``BEGIN`` that takes no lock (``connect()`` it for
        several reads in one connection)."""
        return self._reader

    def select(self, stmt: sa.Executable) -> list[dict]:
        """Run a read query; each row as a dict of its column labels.

        Raises:
            StoreError: the query failed (``where`` = the URL).
        """
        try:
            with self._reader.connect() as conn:
                return [dict(r) for r in conn.execute(stmt).mappings()]
        except sa.exc.SQLAlchemyError as e:
            raise StoreError(f"query failed: {error_text(e.orig or e)}", where=self.where) from e

    _rows = select  # the name the store's own methods use

    def latest_proposals(self, drop_id: int | None = None) -> list[dict]:
        """Proposals as dicts (proposal columns plus ``drop_name``), ordered by drop name, id.

        With ``drop_id``: that drop's proposals. Without: for each drop name, the proposals of its
        newest (highest id) drop row that is not retired.
        """
        p, d = proposals_table, drops_table
        stmt = sa.select(p, d.c.name.label("drop_name")).join(d, p.c.drop_id == d.c.id)
        if drop_id is not None:
            stmt = stmt.where(p.c.drop_id == drop_id)
        else:
            newest = (
                sa.select(sa.func.max(d.c.id)).where(d.c.retired_at.is_(None)).group_by(d.c.name)
            )
            stmt = stmt.where(p.c.drop_id.in_(newest))
        return self._rows(stmt.order_by(d.c.name, p.c.id))

    def runs_for_drop(self, drop_id: int) -> list[dict]:
        """The drop's ``profile_runs`` rows as dicts, in insertion order."""
        t = profile_runs_table
        return self._rows(sa.select(t).where(t.c.drop_id == drop_id).order_by(t.c.id))

    def candidates_for_drop(self, drop_id: int) -> list[dict]:
        """The drop's ``candidates`` rows as dicts (``fits`` as bool), in insertion order."""
        t = candidates_table
        return self._rows(sa.select(t).where(t.c.drop_id == drop_id).order_by(t.c.id))

    def find_run(self, pass_sha256: str) -> dict | None:
        """The latest ``status='ok'`` profile run with memo key ``pass_sha256``, or None."""
        t = profile_runs_table
        stmt = (
            sa.select(t)
            .where(t.c.pass_sha256 == pass_sha256, t.c.status == "ok")
            .order_by(t.c.id.desc())
            .limit(1)
        )
        rows = self._rows(stmt)
        return rows[0] if rows else None

    def first_runs(self, pass_sha256s: list[str]) -> dict[str, tuple[int, int]]:
        """For each ``pass_sha256`` that has one, the first ``status='ok'`` simulate run stored
        with it: ``{pass_sha256: (profile_runs.id, drops.id)}`` (one query; ``profile`` names the
        run that first computed a memo answer's passes)."""
        keys = sorted({k for k in pass_sha256s if k})
        if not keys:
            return {}
        t = profile_runs_table
        first = (sa.select(sa.func.min(t.c.id))
                 .where(t.c.pass_sha256.in_(keys), t.c.status == "ok", t.c.method == "simulate")
                 .group_by(t.c.pass_sha256))
        rows = self._rows(sa.select(t.c.pass_sha256, t.c.id, t.c.drop_id).where(t.c.id.in_(first)))
        return {r["pass_sha256"]: (r["id"], r["drop_id"]) for r in rows}

    def memo_entries(self, model_config_sha256: str, tool_version: str) -> dict[str, dict]:
        """The pass memo's entries (:mod:`tuner.jobs.passmemo`) of one model config hash and tool
        version: ``{memo_key: value}`` (the value parsed from its JSON text). A store without
        the ``pass_memo`` table (a read-only store not yet migrated to 0008) has none."""
        t = pass_memo_table
        stmt = sa.select(t.c.memo_key, t.c.value).where(t.c.model_config_sha256 == model_config_sha256,
                                                         t.c.tool_version == tool_version)
        try:
            with self._reader.connect() as conn:
                rows = conn.execute(stmt).all()
        except sa.exc.OperationalError as e:
            if "pass_memo" in str(e.orig or e):  # no such table (SQLite) / undefined table (PostgreSQL)
                return {}
            raise StoreError(f"query failed: {error_text(e.orig or e)}", where=self.where) from e
        except sa.exc.ProgrammingError as e:
            if "pass_memo" in str(e.orig or e):
                return {}
            raise StoreError(f"query failed: {error_text(e.orig or e)}", where=self.where) from e
        except sa.exc.SQLAlchemyError as e:
            raise StoreError(f"query failed: {error_text(e.orig or e)}", where=self.where) from e
        return memo_values(rows)  # a damaged row is a miss, never an answer

    def put_memo(self, entries: list[dict], conn: Connection | None = None) -> int:
        """Insert pass-memo entries (dicts with ``memo_key``, ``kind``, ``model_config_sha256``,
        ``tool_version``, ``method``, ``device_name``, ``era``, ``value``); a key already stored
        is left as it is (``ON CONFLICT DO NOTHING`` on SQLite and PostgreSQL, so two hosts
        storing the same pass never fail). ``conn``: insert inside the caller's transaction.
        Returns how many entries were given."""
        if not entries:
            return 0
        if conn is None:
            try:
                with self.engine.begin() as c:
                    return self.put_memo(entries, c)
            except StoreError:
                raise
            except sa.exc.SQLAlchemyError as e:
                raise StoreError(f"storing the pass memo failed: {error_text(e.orig or e)}", where=self.where) from e
        rows = memo_rows(entries, utc_text())  # one row per key
        name = conn.dialect.name
        if name in ("sqlite", "postgresql"):
            from importlib import import_module

            insert = import_module(f"sqlalchemy.dialects.{name}").insert
            conn.execute(insert(pass_memo_table).on_conflict_do_nothing(index_elements=["memo_key"]), rows)
        else:  # other backends: skip the keys already there
            have = {r[0] for r in conn.execute(sa.select(pass_memo_table.c.memo_key).where(
                pass_memo_table.c.memo_key.in_([r["memo_key"] for r in rows])))}
            fresh = [r for r in rows if r["memo_key"] not in have]
            if fresh:
                conn.execute(sa.insert(pass_memo_table), fresh)
        return len(rows)

    def save_calibration(self, row: dict) -> int:
        """Insert one ``calibrations`` row (column names as keys; ``created_at`` set here).

        Returns the new id. Raises ``StoreError`` for an unknown column, a non-integer byte value
        or a database error (nothing written).
        """
        try:
            with self.engine.begin() as conn:
                values = {k: v for k, v in row.items() if k != "profile_run_id"}
                return self._insert(conn, calibrations_table, values, created_at=utc_text(),
                                    profile_run_id=row["profile_run_id"])
        except StoreError:
            raise
        except sa.exc.SQLAlchemyError as e:
            raise StoreError(f"save_calibration failed, nothing written: {error_text(e.orig or e)}", where=self.where) from e

    def insert_calibration(self, conn: Connection, row: dict) -> int:
        """Insert one ``calibrations`` row on ``conn`` — inside another write transaction, e.g. the
        ``also`` hook of :meth:`save_result`, so a run and its residual are stored together.
        Returns the new id. Raises ``StoreError`` for an unknown column or a non-integer byte value."""
        values = {k: v for k, v in row.items() if k not in ("profile_run_id", "id")}
        return self._insert(conn, calibrations_table, values, created_at=utc_text(), profile_run_id=row["profile_run_id"])

    def run_ids(self, conn: Connection, drop_id: int) -> list[int]:
        """``profile_runs.id`` of a drop on ``conn`` (inside a transaction), in insertion order."""
        t = profile_runs_table
        return [r[0] for r in conn.execute(sa.select(t.c.id).where(t.c.drop_id == drop_id).order_by(t.c.id))]

    def calibration_rows(self, *, device_name: str, era: str, model_config_sha256: str | None = None,
                         model: str | None = None, tensor_parallel_size: int | None = None,
                         pipeline_parallel_size: int | None = None, dtype: str | None = None,
                         quantization: str | None = None, usable_only: bool = True,
                         exclude_profile_run_ids: tuple[int, ...] = ()) -> list[dict]:
        """``calibrations`` rows for one model (by config SHA-256 when given, else by name), device
        kind and era (and parallel layout / dtype when given; ``quantization`` always, None
        matching only rows without one), oldest first; only ``usable`` rows unless
        ``usable_only=False``."""
        t = calibrations_table
        stmt = sa.select(t).where(t.c.device_name == device_name, t.c.era == era)
        stmt = stmt.where(t.c.quantization.is_(None) if quantization is None else t.c.quantization == quantization)
        if dtype is not None:
            stmt = stmt.where(t.c.dtype == dtype)
        if usable_only:
            stmt = stmt.where(t.c.usable.is_(True))
        if model_config_sha256 is not None:
            stmt = stmt.where(t.c.model_config_sha256 == model_config_sha256)
        elif model is not None:
            stmt = stmt.where(t.c.model == model)
        if tensor_parallel_size is not None:
            stmt = stmt.where(t.c.tensor_parallel_size == tensor_parallel_size)
        if pipeline_parallel_size is not None:
            stmt = stmt.where(t.c.pipeline_parallel_size == pipeline_parallel_size)
        if exclude_profile_run_ids:
            stmt = stmt.where(t.c.profile_run_id.not_in(exclude_profile_run_ids))
        return self._rows(stmt.order_by(t.c.id))

    def measured_runs(self, *, device_name: str | None = None, era: str | None = None,
                      model_config_sha256: str | None = None) -> list[dict]:
        """``profile_runs`` rows of measured methods (``cuda``, ``vllm``, ``import``), oldest first,
        optionally for one device kind, era and model config."""
        t = profile_runs_table
        stmt = sa.select(t).where(t.c.method.in_(("cuda", "vllm", "import")))
        if device_name is not None:
            stmt = stmt.where(t.c.device_name == device_name)
        if era is not None:
            stmt = stmt.where(t.c.era == era)
        if model_config_sha256 is not None:
            stmt = stmt.where(t.c.model_config_sha256 == model_config_sha256)
        return self._rows(stmt.order_by(t.c.id))

    def close(self) -> None:
        """Release all connections. The store is unusable afterwards."""
        self.engine.dispose()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Alembic environment for ctx-tuner.

Run programmatically through ``tuner.store.database`` (``open_store`` upgrades at start;
``tuner.store.database.alembic_config(url)`` gives a ``Config`` for ``alembic.command``). If the caller put
a connection in ``config.attributes["connection"]`` the migrations run on it, inside the caller's
transaction; otherwise an engine is made from ``sqlalchemy.url`` with the store's SQLite set-up
(foreign keys off while migrating) and everything runs in one transaction.

SQLite uses batch mode (``render_as_batch``) since it cannot ALTER most things in place; DDL is
transactional there because the store's engine emits BEGIN itself.
"""

from __future__ import annotations

from alembic import context

from tuner.store.database import make_engine, metadata

config = context.config
target_metadata = metadata


def _configure(connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=sqlite,
        transactional_ddl=True if sqlite else None,
        compare_type=True,
    )


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        if connection.in_transaction():
            context.run_migrations()
        else:
            with connection.begin():
                context.run_migrations()
        return
    engine = make_engine(config.get_main_option("sqlalchemy.url"), foreign_keys=False)
    try:
        with engine.begin() as conn:
            _configure(conn)
            context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()

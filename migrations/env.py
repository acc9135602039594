"""Alembic environment for Postbox.

Online: the connection comes from ``config.attributes["connection"]`` (set by ``postbox.schema.migrate``)
or from the ``sqlalchemy.url`` option. Offline (``--sql``): DDL is printed for a DBA to apply.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from postbox.schema.declared import metadata

config = context.config
VERSION_TABLE = "alembic_version"
VERSION_SCHEMA = "postbox"


COMMON = {
    "target_metadata": metadata,
    "version_table": VERSION_TABLE,
    "version_table_schema": VERSION_SCHEMA,
    "transactional_ddl": True,
}


def _migrate() -> None:
    with context.begin_transaction():
        # The version table lives in schema postbox, so the schema must exist before Alembic's
        # first write.
        context.execute("CREATE SCHEMA IF NOT EXISTS postbox")
        context.run_migrations()


def run_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url") or "postgresql+psycopg://",
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        **COMMON,
    )
    _migrate()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
        with engine.begin() as conn:
            context.configure(connection=conn, **COMMON)
            _migrate()
        engine.dispose()
    else:
        context.configure(connection=connection, **COMMON)
        _migrate()


if context.is_offline_mode():
    run_offline()
else:
    run_online()

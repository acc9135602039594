"""Schema management with Alembic: upgrade, downgrade, and the DDL as text for a DBA."""

from __future__ import annotations

import io

import psycopg
import psycopg.sql
from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine

from postbox.config.urls import libpq_url, sqlalchemy_url
from postbox.db.paths import migrations_dir
from postbox.schema.locks import LockPolicy, LocksUnavailable, retry_on_locks

__all__ = [
    "LockPolicy",
    "LocksUnavailable",
    "SchemaNotReady",
    "alembic_config",
    "check_schema",
    "current_revision",
    "data_at_risk",
    "downgrade",
    "head_revision",
    "libpq_url",
    "schema_problem",
    "upgrade",
    "upgrade_sql",
]


DEFAULT_LOCKS = LockPolicy()


class SchemaNotReady(Exception):
    """The database's Postbox schema is missing or older than this Postbox needs; says what to do."""


def alembic_config(url: str | None = None, output: io.StringIO | None = None) -> Config:
    cfg = Config(output_buffer=output) if output is not None else Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head", *, locks: LockPolicy = DEFAULT_LOCKS) -> None:
    """Upgrade the database at ``url`` to ``revision`` (default: the newest), in one transaction.
    While Postbox runs, it waits for table locks as ``locks`` says (see :mod:`postbox.schema.locks`)
    and raises :class:`LocksUnavailable` if it cannot take them in time, nothing changed."""
    _online(url, lambda cfg: command.upgrade(cfg, revision), locks)


def downgrade(url: str, revision: str, *, locks: LockPolicy = DEFAULT_LOCKS) -> None:
    """Downgrade the database at ``url`` to ``revision`` (``base`` removes everything)."""
    _online(url, lambda cfg: command.downgrade(cfg, revision), locks)


def upgrade_sql(revision: str = "head", start: str | None = None) -> str:
    """The DDL of an upgrade to ``revision``, without connecting to any database."""
    out = io.StringIO()
    cfg = alembic_config("postgresql+psycopg://", output=out)
    target = f"{start}:{revision}" if start else revision
    command.upgrade(cfg, target, sql=True)
    return out.getvalue()


def current_revision(url: str) -> str | None:
    """The revision the database is at, or ``None`` before the first migration."""
    from alembic.runtime.migration import MigrationContext

    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table_schema": "postbox"})
            return ctx.get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str:
    """The newest revision this Postbox ships."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def known_revisions() -> list[str]:
    """Every revision this Postbox ships, oldest first."""
    from alembic.script import ScriptDirectory

    return [
        s.revision for s in reversed(list(ScriptDirectory.from_config(alembic_config()).walk_revisions()))
    ]


def _database_revision(url: str) -> str | None:
    """The revision recorded in the database, or None if Postbox was never migrated there."""
    with psycopg.connect(libpq_url(url), autocommit=True, connect_timeout=10) as conn:
        row = conn.execute("SELECT to_regclass('postbox.alembic_version') IS NOT NULL").fetchone()
        if not row or not row[0]:
            return None
        found = conn.execute("SELECT version_num FROM postbox.alembic_version LIMIT 1").fetchone()
        return str(found[0]) if found else None


def schema_problem(url: str) -> str | None:
    """One line saying what to do if the schema is not usable by this Postbox, else None. A schema
    newer than this Postbox is usable (its versioned functions stay until a later release drops them)."""
    current = _database_revision(url)
    if current is None:
        return "database not migrated: run 'postbox migrate'"
    known = known_revisions()
    head = known[-1]
    if current == head or current not in known:
        return None
    return f"schema at {current}, this postbox needs {head}: run 'postbox migrate'"


def newer_revision(url: str) -> str | None:
    """The database's revision if this Postbox does not know it (a newer release migrated it),
    else None."""
    current = _database_revision(url)
    return current if current is not None and current not in known_revisions() else None


def check_schema(url: str) -> str | None:
    """Raise :class:`SchemaNotReady` if the schema must be migrated first; return a warning line if
    the schema is newer than this Postbox (it keeps working), else None."""
    problem = schema_problem(url)
    if problem is not None:
        raise SchemaNotReady(problem)
    newer = newer_revision(url)
    if newer is not None:
        return (
            f"schema at {newer} is newer than this postbox ({head_revision()}): it keeps working with "
            "the versioned functions of its release; upgrade postbox when you can"
        )
    return None


# Tables whose rows are lost by downgrading past the first revision, and what they hold.
_DATA_TABLES = {
    "inbox": "live inbox messages",
    "outbox": "outbox rows not yet relayed",
    "dead_letters": "dead letters",
    "audit_log": "audit log entries",
    "replay_jobs": "replay jobs",
    "inbox_dedup": "deduplication ledger entries",
}


def data_at_risk(url: str) -> dict[str, int]:
    """Rows a downgrade to ``base`` would delete, by what they are (only non-empty tables)."""
    out: dict[str, int] = {}
    with psycopg.connect(libpq_url(url), autocommit=True, connect_timeout=10) as conn:
        for table, what in _DATA_TABLES.items():
            exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", [f"postbox.{table}"]).fetchone()
            if exists and exists[0]:
                row = conn.execute(
                    psycopg.sql.SQL("SELECT count(*) FROM postbox.{}").format(psycopg.sql.Identifier(table))
                ).fetchone()
                if row and row[0]:
                    out[what] = int(row[0])
    return out


def drop_schema_if_empty(url: str) -> bool:
    """After a downgrade to ``base``: remove Alembic's version table and schema postbox itself,
    unless something else lives there. True if the schema is gone."""
    with psycopg.connect(libpq_url(url), autocommit=True, connect_timeout=10) as conn:
        conn.execute("DROP TABLE IF EXISTS postbox.alembic_version")
        try:
            conn.execute("DROP SCHEMA IF EXISTS postbox")
        except psycopg.errors.DependentObjectsStillExist:
            return False
    return True


def _online(url: str, action: object, locks: LockPolicy) -> None:
    engine = create_engine(sqlalchemy_url(url), connect_args={"application_name": "postbox-migrate"})

    def attempt(policy: LockPolicy) -> None:
        with engine.begin() as conn:
            conn.exec_driver_sql(policy.set_local())
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            action(cfg)  # type: ignore[operator]

    try:
        retry_on_locks(libpq_url(url), attempt, locks)
    finally:
        engine.dispose()

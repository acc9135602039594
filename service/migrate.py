"""Schema management with Alembic: upgrade, downgrade, and the DDL as text for a DBA."""

from __future__ import annotations

import io

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine

from service.paths import migrations_dir
from service.settings import sqlalchemy_url

__all__ = ["alembic_config", "current_revision", "downgrade", "upgrade", "upgrade_sql"]


def alembic_config(url: str | None = None, output: io.StringIO | None = None) -> Config:
    cfg = Config(output_buffer=output) if output is not None else Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision`` (default: the newest)."""
    _online(url, lambda cfg: command.upgrade(cfg, revision))


def downgrade(url: str, revision: str) -> None:
    """Downgrade the database at ``url`` to ``revision`` (``base`` removes everything)."""
    _online(url, lambda cfg: command.downgrade(cfg, revision))


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


def _online(url: str, action: object) -> None:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.begin() as conn:
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            action(cfg)  # type: ignore[operator]
    finally:
        engine.dispose()

"""What every ``postbox`` command takes from the root command: its settings and database URL."""

from __future__ import annotations

import click

from service.embedded import resolve_database_url
from service.errors import ConfigError
from service.settings import Settings, load_settings

__all__ = ["database_url", "settings"]


def settings(ctx: click.Context) -> Settings:
    """The settings from the environment, ``--config`` and ``--database-url`` (loaded once)."""
    obj = ctx.ensure_object(dict)
    if "settings" not in obj:
        try:
            obj["settings"] = load_settings(obj.get("config"), database_url=obj.get("database_url"))
        except ConfigError as error:
            raise click.ClickException(str(error)) from None
    loaded: Settings = obj["settings"]
    return loaded


def database_url(ctx: click.Context) -> str:
    """The configured database, or the embedded PostgreSQL when none is configured."""
    s = settings(ctx)
    configured = s.database_url.get_secret_value() if s.database_url else None
    return resolve_database_url(configured, s.embedded_data_dir)

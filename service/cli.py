"""The ``postbox`` command."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from service import migrate as migrations
from service.embedded import resolve_database_url
from service.errors import ConfigError
from service.settings import Settings, load_settings, mask_url

__all__ = ["main"]


def _settings(ctx: click.Context) -> Settings:
    obj = ctx.ensure_object(dict)
    if "settings" not in obj:
        try:
            obj["settings"] = load_settings(obj.get("config"), database_url=obj.get("database_url"))
        except ConfigError as error:
            raise click.ClickException(str(error)) from None
    settings: Settings = obj["settings"]
    return settings


def _url(ctx: click.Context) -> str:
    s = _settings(ctx)
    configured = s.database_url.get_secret_value() if s.database_url else None
    return resolve_database_url(configured, s.embedded_data_dir)


@click.group()
@click.option("--config", type=click.Path(path_type=Path), help="TOML configuration file.")
@click.option("--database-url", envvar="POSTBOX_DATABASE_URL", help="PostgreSQL URL (default: embedded).")
@click.pass_context
def cli(ctx: click.Context, config: Path | None, database_url: str | None) -> None:
    """Postbox: transactional inbox and outbox on PostgreSQL."""
    ctx.ensure_object(dict).update(config=config, database_url=database_url)


@cli.command()
@click.option("--sql", "as_sql", is_flag=True, help="Print the DDL instead of applying it (no connection).")
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.pass_context
def migrate(ctx: click.Context, as_sql: bool, revision: str) -> None:
    """Upgrade the database schema (or print its DDL with --sql)."""
    if as_sql:
        click.echo(migrations.upgrade_sql(revision), nl=False)
        return
    url = _url(ctx)
    migrations.upgrade(url, revision)
    click.echo(f"postbox: {mask_url(url)} is at revision {migrations.current_revision(url)}", err=True)


@cli.command()
@click.argument("revision")
@click.pass_context
def downgrade(ctx: click.Context, revision: str) -> None:
    """Downgrade the database schema to REVISION (``base`` removes Postbox entirely)."""
    url = _url(ctx)
    migrations.downgrade(url, revision)
    click.echo(f"postbox: {mask_url(url)} is at revision {migrations.current_revision(url)}", err=True)


def main() -> None:
    try:
        cli(obj={})
    except ConfigError as error:
        click.echo(f"postbox: {error}", err=True)
        sys.exit(2)

"""What every ``postbox`` command takes from the root command: its settings and database URL."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

import click

from postbox.config.settings import Settings, load_settings
from postbox.demo.embedded import resolve_database_url
from postbox.errors import ConfigError
from postbox.operations.runtime import DatabaseUnreachable, wait_for_database

__all__ = ["await_database", "connect_timeout_option", "database_url", "settings"]


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
    url = resolve_database_url(configured, s.embedded_data_dir)
    ctx.ensure_object(dict)["url"] = url  # for the one-line diagnosis of a schema that is missing
    return url


def connect_timeout_option(f: Callable[..., None]) -> Callable[..., None]:
    """``--connect-timeout``: how long a long-running process waits at start for its database."""
    return click.option(
        "--connect-timeout",
        type=click.FloatRange(min=0),
        default=None,
        envvar="POSTBOX_CONNECT_TIMEOUT",
        help="Seconds to wait at start for an unreachable database, retrying with backoff, before "
        "giving up (default: wait as long as it takes). [env: POSTBOX_CONNECT_TIMEOUT]",
    )(f)


def await_database(
    url: str, what: str, timeout: float | None, stopping: threading.Event | None = None
) -> None:
    """Wait for the database before a long-running process starts; SIGTERM/SIGINT meanwhile exit 0."""
    early = stopping or threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum: int, frame: object) -> None:
        early.set()

    if stopping is None:
        for sig in previous:
            signal.signal(sig, on_signal)
    try:
        reached = wait_for_database(url, what=what, timeout=timeout, stopping=early)
    except DatabaseUnreachable as error:
        raise click.ClickException(f"{what}: cannot reach the database: {error}") from None
    finally:
        if stopping is None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if not reached:
        click.echo(f"postbox: {what} stopped while waiting for the database", err=True)
        sys.exit(0)
    from postbox.schema.migrate import SchemaNotReady, check_schema

    try:
        warning = check_schema(url)
    except SchemaNotReady as error:
        raise click.ClickException(f"{what}: {error}") from None
    if warning is not None:
        click.echo(f"postbox: {warning}", err=True)

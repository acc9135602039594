"""What every ``postbox`` command takes from the root command: its settings and database URL."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import click

from postbox.config.settings import Settings, load_settings
from postbox.config.urls import libpq_url
from postbox.errors import ConfigError
from postbox.operations.process import ProcessSpec, Service, StartupFailed, await_database, run_process

__all__ = [
    "checked_database_url",
    "connect_timeout_option",
    "database_url",
    "run_service",
    "serve_metrics",
    "settings",
    "wait_for_database",
]


def settings(ctx: click.Context) -> Settings:
    """The settings from the environment, ``--config`` and ``--database-url`` (loaded once)."""
    obj = ctx.ensure_object(dict)
    if "settings" not in obj:
        # A ConfigError goes up to main: "postbox: <what is wrong, where>", exit 2.
        obj["settings"] = load_settings(obj.get("config"), database_url=obj.get("database_url"))
    loaded: Settings = obj["settings"]
    return loaded


def apply_config_file(ctx: click.Context, log_format: str, log_level: str) -> tuple[str, str]:
    """What the configuration file sets for the command about to run, below its flags and
    environment variables: ``log_format`` and ``log_level`` of ``[postbox]`` (returned, for the
    group's options left at their defaults), and the tables ``[postbox.worker]``, ``[postbox.relay]``,
    ``[postbox.bridge]``, ``[postbox.maintain]`` and ``[postbox.replay_run]`` as the defaults of
    those commands' options. A file that does not load changes nothing here: the command reports
    it when it reads its settings."""
    try:
        s = settings(ctx)
    except ConfigError:
        return log_format, log_level
    from_default = (click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP)
    if ctx.get_parameter_source("log_format") in from_default:
        log_format = s.log_format
    if ctx.get_parameter_source("log_level") in from_default:
        log_level = s.log_level
    ctx.default_map = {**command_defaults(s), **(ctx.default_map or {})}
    return log_format, log_level


def command_defaults(s: Settings) -> dict[str, Any]:
    """The option defaults the settings' command tables set, as click's ``default_map`` of the
    ``postbox`` group (only what the file or the environment set: the rest keeps each option's own)."""
    return {
        "worker": s.worker.model_dump(exclude_unset=True),
        "relay": s.relay.model_dump(exclude_unset=True),
        "bridge": s.bridge.model_dump(exclude_unset=True),
        "maintain": s.maintain.model_dump(exclude_unset=True),
        "replay": {"run": s.replay_run.model_dump(exclude_unset=True)},
    }


NO_DATABASE = (
    "no database given: set POSTBOX_DATABASE_URL, pass --database-url, or set database_url in [postbox] "
    "of the configuration file (postgresql://USER@HOST:PORT/DATABASE); only 'postbox demo' "
    "starts an embedded PostgreSQL"
)


def database_url(ctx: click.Context) -> str:
    """The configured database, as a libpq URL; a one-line error when none is configured."""
    s = settings(ctx)
    if s.database_url is None:
        raise ConfigError(NO_DATABASE)
    url = libpq_url(s.database_url.get_secret_value())
    ctx.ensure_object(dict)["url"] = url  # for the one-line diagnosis of a schema that is missing
    return url


def checked_database_url(ctx: click.Context) -> str:
    """:func:`database_url` for a command that runs once and needs the schema: checked first, so that
    a database never migrated, or one a release behind, is one line saying what to do (exit 1). A
    schema newer than this Postbox works (its versioned functions stay); that is said on stderr."""
    from postbox.schema.migrate import check_schema

    url = database_url(ctx)
    obj = ctx.find_root().ensure_object(dict)
    if not obj.get("schema_checked"):
        warning = check_schema(url)  # SchemaNotReady goes up to main: "postbox: <what to do>", exit 1
        if warning:
            click.echo(f"postbox: {warning}", err=True)
        obj["schema_checked"] = True
    return url


def connect_timeout_option(f: Callable[..., None]) -> Callable[..., None]:
    """``--connect-timeout``: how long a long-running process waits at start for its database."""
    return click.option(
        "--connect-timeout",
        type=click.FloatRange(min=0),
        default=None,
        envvar="POSTBOX_CONNECT_TIMEOUT",
        help="Seconds to wait at start for an unreachable database, retrying with backoff, before "
        "giving up (default: wait as long as it takes).",
    )(f)


def serve_metrics(ctx: click.Context, settings: Settings, url: str, ready: Callable[[], bool]) -> Any:
    """Start the metrics endpoint of this process if a port is configured."""
    from postbox.operations.metrics import start_observability

    obj = ctx.find_root().ensure_object(dict)
    port = obj.get("metrics_port")
    host = obj.get("metrics_host")
    return start_observability(
        url,
        port=settings.metrics_port if port is None else port,
        host=settings.metrics_host if host is None else host,
        ready=ready,
        db_interval=settings.db_metrics_interval_seconds,
    )


def _check_schema(what: str) -> Callable[[str], str | None]:
    def check(url: str) -> str | None:
        from postbox.schema.migrate import SchemaNotReady, check_schema

        try:
            return check_schema(url)
        except SchemaNotReady as error:
            raise StartupFailed(f"{what}: {error}") from None

    return check


def _spec(ctx: click.Context, what: str, url: str, connect_timeout: float | None, **kw: Any) -> ProcessSpec:
    source = "--connect-timeout {:g}"
    if connect_timeout is None:  # no --connect-timeout: [postbox] connect_timeout, else no limit
        connect_timeout = settings(ctx).connect_timeout
        source = "connect_timeout = {:g} in the configuration file"
    return ProcessSpec(
        what=what,
        url=url,
        connect_timeout=connect_timeout,
        connect_timeout_source=source,
        serve=lambda ready: serve_metrics(ctx, settings(ctx), url, ready),
        check_schema=_check_schema(what),
        **kw,
    )


class _Stopped(Exception):
    """SIGTERM or SIGINT while a command that runs once waits for its database."""


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped  # out of the wait, wherever it is (as SIGINT's KeyboardInterrupt would)


def wait_for_database(ctx: click.Context, what: str, url: str, connect_timeout: float | None) -> None:
    """Wait for the database before a command that runs once (``maintain --once``). A signal
    meanwhile exits 0 at once, as for the long-running commands; giving up exits 1, in one line."""
    spec = _spec(ctx, what, url, connect_timeout)
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        await_database(spec, threading.Event())
    except _Stopped:
        spec.say(f"{what} stopped while waiting for the database")
        sys.exit(0)
    except StartupFailed as error:
        spec.say(str(error), logging.ERROR)  # one line, in the log format (JSON stays JSON)
        sys.exit(1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_service(
    ctx: click.Context,
    service: Service,
    what: str,
    url: str,
    connect_timeout: float | None,
    *,
    stop_message: str,
    grace: float | None = None,
    before_start: Callable[[], None] | None = None,
) -> None:
    """Run ``service`` as this process (see :func:`postbox.operations.process.run_process`): wait
    for the database, serve metrics, stop on the first signal, abort on the second; exit with the
    process's status."""
    spec = _spec(
        ctx, what, url, connect_timeout, grace=grace, stop_message=stop_message, before_start=before_start
    )
    try:
        code = run_process(service, spec)
    except StartupFailed as error:
        spec.say(str(error), logging.ERROR)  # one line, in the log format (JSON stays JSON)
        sys.exit(1)
    if code:
        sys.exit(code)

"""The ``postbox`` command."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import click
import psycopg
import sqlalchemy.exc

from postbox import __version__
from postbox.cli import context as cli_context
from postbox.cli.context import await_database, connect_timeout_option
from postbox.cli.deadletters import register as register_deadletter_commands
from postbox.cli.operations import (
    observability_options,
    register_ops_commands,
    serve_metrics,
    setup_observability,
)
from postbox.config.policies import (
    apply_policies,
    check_retention,
    configured_handlers,
    load_policies,
    sql_functions,
)
from postbox.config.settings import mask_text, mask_url
from postbox.errors import ConfigError
from postbox.failures.breaker import BreakerSettings
from postbox.failures.policy import RetryPolicy
from postbox.inbox.consumers import declare_consumer
from postbox.inbox.handlers import Registry
from postbox.inbox.sql_handlers import check_function_exists
from postbox.inbox.worker import Worker, WorkerSettings
from postbox.schema import migrate as migrations

__all__ = ["main"]


_settings = cli_context.settings
_url = cli_context.database_url


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "POSTBOX"})
@click.version_option(__version__, "-V", "--version", prog_name="postbox", message="%(prog)s %(version)s")
@click.option("--config", type=click.Path(path_type=Path), help="TOML configuration file.")
@click.option("--database-url", envvar="POSTBOX_DATABASE_URL", help="PostgreSQL URL (default: embedded).")
@observability_options
@click.pass_context
def cli(
    ctx: click.Context,
    config: Path | None,
    database_url: str | None,
    log_format: str,
    log_level: str,
    metrics_port: int | None,
) -> None:
    """Postbox: transactional inbox and outbox on PostgreSQL."""
    ctx.ensure_object(dict).update(config=config, database_url=database_url)
    setup_observability(ctx, log_format, log_level, metrics_port)


@cli.command()
@click.option("--sql", "as_sql", is_flag=True, help="Print the DDL instead of applying it (no connection).")
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.option(
    "--check",
    is_flag=True,
    help="Only report: exit 0 if the schema is up to date, 1 if an upgrade is pending.",
)
@click.pass_context
def migrate(ctx: click.Context, as_sql: bool, revision: str, check: bool) -> None:
    """Upgrade the database schema (or print its DDL with --sql)."""
    known = migrations.known_revisions()
    if revision not in ("head", "base", *known):
        raise click.ClickException(
            f"unknown revision {revision!r}: this postbox ships {', '.join(known)} (head {known[-1]})"
        )
    if as_sql:
        click.echo(migrations.upgrade_sql(revision), nl=False)
        return
    url = _url(ctx)
    if check:
        problem = migrations.schema_problem(url)
        if problem is not None:
            click.echo(f"postbox: {problem}", err=True)
            sys.exit(1)
        click.echo(
            f"postbox: {mask_url(url)} is up to date (revision {migrations.current_revision(url)})", err=True
        )
        return
    migrations.upgrade(url, revision)
    click.echo(f"postbox: {mask_url(url)} is at revision {migrations.current_revision(url)}", err=True)


@cli.command()
@click.argument("revision")
@click.option(
    "--force", is_flag=True, help="Downgrade even if it deletes messages, dead letters or the audit log."
)
@click.pass_context
def downgrade(ctx: click.Context, revision: str, force: bool) -> None:
    """Downgrade the database schema to REVISION (``base`` removes Postbox entirely, schema included).

    Refused while the tables it would drop hold rows (live messages, dead letters, the audit log),
    unless --force.
    """
    known = migrations.known_revisions()
    if revision not in ("base", *known):
        raise click.ClickException(f"unknown revision {revision!r}: this postbox ships {', '.join(known)}")
    url = _url(ctx)
    if revision == "base":
        at_risk = migrations.data_at_risk(url)
        if at_risk and not force:
            lost = ", ".join(f"{what} ({n:,})" for what, n in at_risk.items())
            raise click.ClickException(
                f"downgrading to base would delete {lost}; run again with --force to delete them"
            )
    migrations.downgrade(url, revision)
    if revision == "base":
        gone = migrations.drop_schema_if_empty(url)
        where = (
            "schema postbox dropped" if gone else "schema postbox kept: it holds objects Postbox did not make"
        )
        click.echo(
            f"postbox: removed from {mask_url(url)} ({where}); the roles postbox_* are cluster-wide and stay "
            "(DROP ROLE them when no other database uses them)",
            err=True,
        )
        return
    click.echo(f"postbox: {mask_url(url)} is at revision {migrations.current_revision(url)}", err=True)


def _stop_on_signals(stop: Callable[[], None], what: str) -> None:
    """SIGTERM and SIGINT call ``stop`` (the process then finishes what it has in flight)."""

    def on_signal(signum: int, frame: object) -> None:
        click.echo(f"postbox: {what} (signal {signum})", err=True)
        stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _load_registry(app: str) -> Registry:
    module_name, _, attr = app.partition(":")
    if not module_name or not attr:
        raise click.BadParameter(
            "expected module:attribute, for example myapp.handlers:registry", param_hint="--app"
        )
    # Like uvicorn and celery: modules next to where the command runs come first.
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        searched = ", ".join(p or "." for p in sys.path[:4])
        raise click.BadParameter(
            f"cannot import {module_name}: {error} (searched the current directory {cwd}, then {searched}, ...)",
            param_hint="--app",
        ) from None
    obj = getattr(module, attr, None)
    if callable(obj) and not isinstance(obj, Registry):
        obj = obj()
    if not isinstance(obj, Registry):
        raise click.BadParameter(f"{app} is not a postbox.inbox.handlers.Registry", param_hint="--app")
    return obj


@cli.command()
@click.option("--consumer", required=True, help="The consumer whose inbox this worker processes.")
@click.option(
    "--app",
    "app",
    default=None,
    help="module:attribute of the handler Registry (optional with handlers in --config).",
)
@click.option("--concurrency", default=2, show_default=True, type=click.IntRange(1, 256))
@click.option("--batch-size", default=20, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--poll-interval", default=1.0, show_default=True, type=click.FloatRange(min=0.001))
@click.option("--listen/--no-listen", default=True, show_default=True, help="Wake on LISTEN/NOTIFY.")
@click.option("--handler-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0.001))
@click.option("--grace-period", default=30.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--heartbeat-interval", default=5.0, show_default=True, type=click.FloatRange(min=0.01))
@click.option("--stale-after", default=30.0, show_default=True, type=click.FloatRange(min=0.02))
@click.option(
    "--lease",
    default=None,
    type=click.FloatRange(min=0.01),
    help="Seconds a claim is held before another worker may take it (default: timeout x batch + 30).",
)
@click.option(
    "--max-stuck-handlers",
    default=None,
    type=click.IntRange(min=0),
    help="Handler threads left running past their time limit before the process exits with status 70 "
    "for its supervisor to restart it (default: --concurrency).",
)
@connect_timeout_option
@click.pass_context
def worker(
    ctx: click.Context,
    consumer: str,
    app: str | None,
    concurrency: int,
    batch_size: int,
    poll_interval: float,
    listen: bool,
    handler_timeout: float,
    grace_period: float,
    heartbeat_interval: float,
    stale_after: float,
    lease: float | None,
    max_stuck_handlers: int | None,
    connect_timeout: float | None,
) -> None:
    """Process the inbox of CONSUMER with the handlers of APP until SIGTERM or SIGINT.

    The first signal stops claiming and lets in-flight messages finish (up to --grace-period; then
    what still runs is given back and the process exits); a second one exits at once, giving
    unfinished messages back. A handler past its time limit fails its attempt; if it does not
    return, its slot is replaced (see --max-stuck-handlers).
    """
    settings_ = _settings(ctx)
    policies = load_policies(ctx.ensure_object(dict).get("config") or settings_.config).model_copy(
        update={
            "dedup_retention_seconds": settings_.dedup_retention_seconds,
            "replay_window_seconds": settings_.replay_window_seconds,
        }
    )
    consumer_policy = policies.consumers.get(consumer)
    registry = configured_handlers(_load_registry(app) if app else Registry(), policies, consumer)
    if consumer not in registry.consumers():
        raise click.UsageError(
            f"no handler for consumer {consumer!r}: give --app, or declare handlers in --config"
        )
    registry = apply_policies(registry, policies)
    check_retention(policies, registry, RetryPolicy())
    url = _url(ctx)
    try:
        settings = WorkerSettings(
            consumer=consumer,
            concurrency=concurrency,
            batch_size=batch_size,
            poll_interval=poll_interval,
            listen=listen,
            handler_timeout=handler_timeout,
            grace_period=grace_period,
            heartbeat_interval=heartbeat_interval,
            stale_after=stale_after,
            lease=lease,
            max_stuck_handlers=max_stuck_handlers,
            retry=consumer_policy.retry_policy() if consumer_policy else RetryPolicy(),
            breaker=consumer_policy.breaker if consumer_policy else BreakerSettings(),
        )
        w = Worker(url, registry, settings)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    serve_metrics(ctx, _settings(ctx), url, w.ready)
    stopping = threading.Event()
    signals = {"count": 0}

    def on_signal(signum: int, frame: object) -> None:
        signals["count"] += 1
        stopping.set()
        if signals["count"] == 1:
            click.echo(f"postbox: stopping (signal {signum}); in-flight messages finish", err=True)
            w.stop()
        else:
            click.echo("postbox: aborting", err=True)
            w.abort()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    await_database(url, "worker", connect_timeout, stopping)
    if consumer_policy is not None:
        with psycopg.connect(url) as conn:
            declare_consumer(
                conn,
                consumer,
                sequence_mode=consumer_policy.sequence_mode,
                first_sequence=consumer_policy.first_sequence,
                late_policy=consumer_policy.late_policy,
                on_dead_letter=consumer_policy.on_dead_letter,
                gap_timeout_seconds=consumer_policy.gap_timeout_seconds,
            )
            conn.commit()
    if sql_functions(policies, consumer):
        with psycopg.connect(url) as conn:
            for function in sql_functions(policies, consumer):
                check_function_exists(conn, function)
    w.run()
    if w.fatal is not None:
        click.echo(f"postbox: {w.fatal}", err=True)
    if w.fatal is not None or w.stuck_threads:
        # Handler threads may still be stuck in user code: do not wait for them.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(70 if w.fatal is not None else 0)


@cli.command()
@click.option(
    "--destination",
    "destinations",
    multiple=True,
    help="Destination to relay (repeatable; default: all configured).",
)
@click.option(
    "--concurrency", default=1, show_default=True, type=click.IntRange(1, 64), help="Loops per destination."
)
@click.option("--batch-size", default=100, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--poll-interval", default=1.0, show_default=True, type=click.FloatRange(min=0.001))
@click.option("--listen/--no-listen", default=True, show_default=True, help="Wake on LISTEN/NOTIFY.")
@click.option("--lease", default=60.0, show_default=True, type=click.FloatRange(min=0.01))
@click.option("--heartbeat-interval", default=5.0, show_default=True, type=click.FloatRange(min=0.01))
@click.option("--stale-after", default=30.0, show_default=True, type=click.FloatRange(min=0.02))
@click.option("--grace-period", default=30.0, show_default=True, type=click.FloatRange(min=0))
@connect_timeout_option
@click.pass_context
def relay(
    ctx: click.Context,
    destinations: tuple[str, ...],
    concurrency: int,
    batch_size: int,
    poll_interval: float,
    listen: bool,
    lease: float,
    heartbeat_interval: float,
    stale_after: float,
    grace_period: float,
    connect_timeout: float | None,
) -> None:
    """Publish committed outbox rows to their destinations, per key in order, until SIGTERM/SIGINT."""
    from postbox.config.policies import build_transports
    from postbox.outbox.relay import Relay, RelaySettings

    settings_ = _settings(ctx)
    policies = load_policies(ctx.ensure_object(dict).get("config") or settings_.config)
    url = _url(ctx)
    await_database(url, "relay", connect_timeout)
    transports = build_transports(policies, list(destinations), url)
    retry = {name: policies.destinations[name].retry_policy() for name in transports}
    on_dead = {name: policies.destinations[name].on_dead_letter for name in transports}
    try:
        settings = RelaySettings(
            concurrency=concurrency,
            batch_size=batch_size,
            poll_interval=poll_interval,
            listen=listen,
            lease=lease,
            heartbeat_interval=heartbeat_interval,
            stale_after=stale_after,
            grace_period=grace_period,
        )
        r = Relay(url, transports, settings, policies=retry, dead_letter_policies=on_dead)
    except ValueError as error:
        raise click.ClickException(str(error)) from None

    serve_metrics(ctx, settings_, url, r.ready)
    _stop_on_signals(r.stop, "relay stopping; the batch in flight finishes")
    r.run()


@cli.command()
@click.option("--from", "source_url", required=True, help="Broker URL: amqp://..., redis://... or nats://...")
@click.option(
    "--name", required=True, help="RabbitMQ queue, Redis stream, or NATS STREAM:SUBJECT to consume."
)
@click.option("--consumer", required=True, help="The inbox consumer the messages are received for.")
@click.option("--batch-size", default=100, show_default=True, type=click.IntRange(1, 10_000))
@connect_timeout_option
@click.pass_context
def bridge(
    ctx: click.Context,
    source_url: str,
    name: str,
    consumer: str,
    batch_size: int,
    connect_timeout: float | None,
) -> None:
    """Consume from a broker into the inbox: insert, commit, then acknowledge."""
    from postbox.outbox.bridge import Bridge, source_for

    url = _url(ctx)
    await_database(url, "bridge", connect_timeout)
    try:
        source = source_for(source_url, name)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--from") from None
    b = Bridge(url, source, consumer, batch_size=batch_size, origin=name)

    serve_metrics(ctx, _settings(ctx), url, lambda: not b.stopping)
    _stop_on_signals(b.stop, "bridge stopping")
    b.run()


@cli.command()
@click.option(
    "--database",
    "database",
    default="postbox_demo",
    show_default=True,
    help="Name of the database the demo creates on the server (replaced on the next run only if a "
    "demo created it).",
)
@click.pass_context
def demo(ctx: click.Context, database: str) -> None:
    """Run the order scenario end to end in a database of its own, on the server of the database URL
    (an embedded PostgreSQL when none is given)."""
    from postbox.demo.scenario import DemoError, run_demo

    s = _settings(ctx)
    try:
        run_demo(
            s.database_url.get_secret_value() if s.database_url else None,
            s.embedded_data_dir,
            database=database,
        )
    except DemoError as error:
        raise click.ClickException(str(error)) from None


register_deadletter_commands(cli)
register_ops_commands(cli)


def _show_envvars(command: click.Command, prefix: str) -> None:
    """Every option can also come from an environment variable (POSTBOX_<COMMAND>_<OPTION> unless
    it names its own): say which one in --help."""
    for param in command.params:
        if isinstance(param, click.Option) and param.name not in ("help", "version"):
            param.show_envvar = True
            if param.envvar is None:
                param.envvar = f"{prefix}_{param.name.upper()}" if param.name else None
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            _show_envvars(sub, f"{prefix}_{name.upper().replace('-', '_')}")


_show_envvars(cli, "POSTBOX")


def main() -> None:
    obj: dict[str, object] = {}
    try:
        cli(obj=obj)
    except ConfigError as error:
        click.echo(f"postbox: {mask_text(str(error))}", err=True)
        sys.exit(2)
    except migrations.SchemaNotReady as error:
        click.echo(f"postbox: {error}", err=True)
        sys.exit(1)
    except (psycopg.OperationalError, sqlalchemy.exc.OperationalError) as error:
        orig = getattr(error, "orig", None) or error
        detail = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
        click.echo(f"postbox: cannot reach the database: {mask_text(detail)}", err=True)
        sys.exit(1)
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction, psycopg.errors.InvalidSchemaName,
            sqlalchemy.exc.ProgrammingError):  # fmt: skip
        # A command that needs the schema met a database without it (or with an older one).
        url = obj.get("url")
        problem = migrations.schema_problem(str(url)) if isinstance(url, str) else None
        if problem is None:
            raise
        click.echo(f"postbox: {problem}", err=True)
        sys.exit(1)

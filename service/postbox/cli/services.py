"""The long-running commands: ``postbox worker``, ``postbox relay``, ``postbox bridge``. Each builds
its service and runs it through :func:`postbox.cli.context.run_service` (one process runtime)."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any, Protocol

import click
import psycopg

from postbox.cli.context import connect_timeout_option, database_url, run_service, settings
from postbox.config.policies import (
    PoliciesConfig,
    apply_policies,
    check_retention,
    configured_handlers,
    load_policies,
    retention_needed,
    sql_functions,
)
from postbox.db import query
from postbox.db.connector import run
from postbox.failures.breaker import BreakerSettings
from postbox.failures.policy import RetryPolicy
from postbox.inbox.consumers import declare_consumer
from postbox.inbox.handlers import Registry
from postbox.inbox.sql_handlers import check_function_exists
from postbox.inbox.worker import Worker, WorkerSettings

__all__ = ["bridge", "relay", "worker"]

log = logging.getLogger("postbox.worker")


def _policies(ctx: click.Context) -> PoliciesConfig:
    """The per-consumer and per-destination policies of the configuration file (loaded once)."""
    s = settings(ctx)
    return load_policies(ctx.ensure_object(dict).get("config") or s.config).model_copy(
        update={
            "dedup_retention_seconds": s.dedup_retention_seconds,
            "replay_window_seconds": s.replay_window_seconds,
        }
    )


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
        others = [p for p in dict.fromkeys(p or "." for p in sys.path) if p not in (cwd, ".")]
        searched = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise click.BadParameter(
            f"cannot import {module_name}: {error} (searched the current directory {cwd}, then {searched})",
            param_hint="--app",
        ) from None
    if not hasattr(module, attr):
        raise click.BadParameter(
            f"{module_name} has no attribute {attr!r}: name the Registry your handlers are registered on",
            param_hint="--app",
        )
    obj = getattr(module, attr)
    if callable(obj) and not isinstance(obj, Registry):
        if not _takes_no_arguments(obj):
            raise click.BadParameter(
                f"{app} is a function that takes arguments (a handler?), not a postbox.Registry or a "
                "function returning one without arguments: name the Registry your handlers are registered on",
                param_hint="--app",
            )
        obj = obj()
    if not isinstance(obj, Registry):
        raise click.BadParameter(
            f"{app} is a {type(obj).__name__}, not a postbox.Registry (or a function returning one)",
            param_hint="--app",
        )
    return obj


def _takes_no_arguments(func: Any) -> bool:
    """Whether ``func`` can be called without arguments (an app factory), as far as its signature says."""
    import inspect

    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # no signature to read: let the call say
        return True
    try:
        signature.bind()
    except TypeError:
        return False
    return True


# --- postbox worker -------------------------------------------------------------------------------


def _registry(policies: PoliciesConfig, consumer: str, app: str | None) -> Registry:
    """The handlers of ``--app`` and the file, with the file's policies applied and checked."""
    registry = configured_handlers(_load_registry(app) if app else Registry(), policies, consumer)
    if consumer not in registry.consumers():
        if app is None:
            raise click.UsageError(
                f"no handler for consumer {consumer!r}: give --app, or declare handlers in --config"
            )
        known = ", ".join(repr(c) for c in sorted(registry.consumers())) or "none"
        raise click.UsageError(
            f"no handler for consumer {consumer!r} in {app} (it has handlers for: {known}): register one "
            "for it there, or declare handlers in --config"
        )
    registry = apply_policies(registry, policies)
    check_retention(policies, registry, RetryPolicy())
    return registry


def _prepare(url: str, policies: PoliciesConfig, consumer: str, registry: Registry) -> None:
    """Before a worker starts, on one connection: its consumer declared (see :func:`_declare`), its
    SQL-function handlers checked, and the deduplication window in force checked against its
    handlers' retries."""
    with psycopg.connect(url, autocommit=True) as conn:
        _declare(conn, policies, consumer)
        for function in sql_functions(policies, consumer):
            check_function_exists(conn, function)
        _check_window(conn, policies, registry)


def _declare(conn: psycopg.Connection[Any], policies: PoliciesConfig, consumer: str) -> None:
    """Declare the consumer as the file describes it. A consumer the file does not describe is left
    as it is (declaring it would make the database refuse every other undeclared consumer's
    messages), with a warning if producers' messages for it are refused: it is not declared, and
    others are."""
    policy = policies.consumers.get(consumer)
    if policy is not None:
        declare_consumer(
            conn,
            consumer,
            sequence_mode=policy.sequence_mode,
            first_sequence=policy.first_sequence,
            late_policy=policy.late_policy,
            on_dead_letter=policy.on_dead_letter,
            gap_timeout_seconds=policy.gap_timeout_seconds,
        )
        return
    ((declared, others),) = run(conn, query("consumer_declaration"), {"consumer": consumer})
    if declared or not others:
        return
    names = ", ".join(repr(n) for n in others[:3]) + (", ..." if len(others) > 3 else "")
    log.warning(
        "consumer %r is not declared while others are (%s): the database refuses producers' messages "
        "for it; declare it ([consumers.%s] in the configuration file, or postbox.declare_consumer)",
        consumer, names, consumer,
    )  # fmt: skip


def _check_window(conn: psycopg.Connection[Any], policies: PoliciesConfig, registry: Registry) -> None:
    """Warn if the deduplication window in force, which ``maintain`` sets from its own settings, is
    shorter than this worker's handlers' retries plus the replay window need."""
    horizon, needed = retention_needed(policies, registry, RetryPolicy())
    try:
        rows = run(conn, query("dedup_window_seconds"), {})
    except psycopg.errors.InsufficientPrivilege:  # a schema before 0.16.0 gave workers no SELECT on it
        log.info("the deduplication window in force is not readable by this login: not checked")
        return
    in_force = rows[0][0] if rows else None
    if in_force is not None and in_force < needed:
        log.warning(
            "the deduplication window in force (%g s, set by postbox maintain) is shorter than this "
            "worker's longest retry horizon (%g s) plus replay_window_seconds (%g s): a redelivery "
            "later than the window would be processed twice; run postbox maintain with "
            "POSTBOX_DEDUP_RETENTION_SECONDS of at least %g (or the same configuration file)",
            in_force, horizon, policies.replay_window_seconds, needed,
        )  # fmt: skip


@click.command()
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
    ctx: click.Context, /, consumer: str, app: str | None, connect_timeout: float | None, **options: Any
) -> None:
    """Process the inbox of CONSUMER with the handlers of APP until SIGTERM or SIGINT.

    The first signal stops claiming and lets in-flight messages finish (up to --grace-period; then
    what still runs is given back and the process exits); a second one exits at once, giving
    unfinished messages back. A handler past its time limit fails its attempt; if it does not
    return, its slot is replaced (see --max-stuck-handlers).
    """
    policies = _policies(ctx)
    policy = policies.consumers.get(consumer)
    registry = _registry(policies, consumer, app)
    url = database_url(ctx)
    try:
        worker_settings = WorkerSettings(
            consumer=consumer,
            retry=policy.retry_policy() if policy else RetryPolicy(),
            breaker=policy.breaker if policy else BreakerSettings(),
            **options,
        )
        service = Worker(url, registry, worker_settings)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    run_service(
        ctx,
        service,
        "worker",
        url,
        connect_timeout,
        stop_message="stopping; in-flight messages finish",
        before_start=lambda: _prepare(url, policies, consumer, registry),
    )


# --- postbox relay --------------------------------------------------------------------------------


@click.command()
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
    ctx: click.Context, /, destinations: tuple[str, ...], connect_timeout: float | None, **options: Any
) -> None:
    """Publish committed outbox rows to their destinations, per key in order, until SIGTERM/SIGINT."""
    from postbox.config.policies import build_transports, check_kafka_settings
    from postbox.outbox.relay import Relay, RelaySettings

    policies = _policies(ctx)
    url = database_url(ctx)
    transports = build_transports(policies, list(destinations), url)
    check_kafka_settings(policies, transports)  # at start, not as a failure of every row
    retry = {name: policies.destinations[name].retry_policy() for name in transports}
    on_dead = {name: policies.destinations[name].on_dead_letter for name in transports}
    try:
        relay_settings = RelaySettings(**options)
        service = Relay(url, transports, relay_settings, policies=retry, dead_letter_policies=on_dead)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    run_service(
        ctx, _Stoppable(service), "relay", url, connect_timeout,
        stop_message="relay stopping; the batch in flight finishes",
    )  # fmt: skip


class _Basic(Protocol):
    def start(self) -> None: ...
    def run(self) -> None: ...
    def stop(self) -> None: ...
    def join(self, grace: float | None = None) -> None: ...
    def ready(self) -> bool: ...
    @property
    def stopping(self) -> bool: ...


class _Stoppable:
    """A service without ``abort`` or ``fatal`` (the relay): a second signal stops it too."""

    fatal: str | None = None

    def __init__(self, service: _Basic) -> None:
        self._service = service

    def start(self) -> None:
        self._service.start()

    def run(self) -> None:
        self._service.run()

    def stop(self) -> None:
        self._service.stop()

    def abort(self) -> None:
        self._service.stop()

    def join(self, grace: float | None = None) -> None:
        self._service.join(grace)

    def ready(self) -> bool:
        return self._service.ready()

    @property
    def stopping(self) -> bool:
        return self._service.stopping


# --- postbox bridge -------------------------------------------------------------------------------


@click.command()
@click.option(
    "--from",
    "source_url",
    required=True,
    help="Broker URL: amqp://..., redis://..., nats://... or kafka://host:port?group=GROUP.",
)
@click.option(
    "--name",
    required=True,
    help="RabbitMQ queue, Redis stream, NATS STREAM:SUBJECT or Kafka topic to consume.",
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
    from postbox.outbox.bridge import Bridge
    from postbox.outbox.transports import source_maker

    url = database_url(ctx)
    try:
        connect = source_maker(source_url, name)  # checked now, connected once the bridge runs
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--from") from None
    service = Bridge(url, connect, consumer, batch_size=batch_size, origin=name)
    run_service(ctx, service, "bridge", url, connect_timeout, stop_message="bridge stopping")

"""Operations commands (``postbox maintain``, ``postbox status``, ``postbox config check``) and the
observability options every command shares (``--log-format``, ``--log-level``, ``--metrics-port``,
``--metrics-host``).

Registered on the ``postbox`` group by :func:`register_ops_commands`.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import click
import psycopg

from postbox.cli import context as cli_context
from postbox.cli.context import connect_timeout_option, run_service, wait_for_database
from postbox.cli.output import emit, json_option
from postbox.cli.progress import progress_bar
from postbox.cli.status_view import show_status
from postbox.config.settings import load_settings, mask_secrets, mask_text, mask_url
from postbox.errors import ConfigError
from postbox.operations.logs import configure_logging

__all__ = [
    "mask_secrets",
    "observability_options",
    "register_ops_commands",
    "setup_observability",
]

_LEVELS = click.Choice(["debug", "info", "warning", "error"], case_sensitive=False)


def observability_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The group's options for logs and metrics (also settable as POSTBOX_… variables).
    ``--metrics-host`` is kept in the context object for :func:`serve_metrics` (the group's own
    callback does not receive it)."""

    callback = f

    @functools.wraps(callback)
    def keep_metrics_host(*args: Any, metrics_host: str | None = None, **kwargs: Any) -> Any:
        click.get_current_context().ensure_object(dict)["metrics_host"] = metrics_host
        return callback(*args, **kwargs)

    f = click.option(
        "--metrics-host",
        default=None,
        help="Address the metrics endpoint listens on (env POSTBOX_METRICS_HOST; default 127.0.0.1, "
        "this host only; 0.0.0.0 for every interface).",
    )(keep_metrics_host)
    f = click.option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=None,
        help="Serve /metrics, /healthz, /readyz on this port (env POSTBOX_METRICS_PORT; 0: off, the default).",
    )(f)
    f = click.option(
        "--log-level",
        type=_LEVELS,
        envvar="POSTBOX_LOG_LEVEL",
        default="info",
        show_default=True,
        help="debug adds a line per processed message.",
    )(f)
    f = click.option(
        "--log-format",
        type=click.Choice(["auto", "json", "text"]),
        envvar="POSTBOX_LOG_FORMAT",
        default="auto",
        show_default=True,
        help="JSON lines, text, or auto (text on a terminal, JSON otherwise).",
    )(f)
    return f


def setup_observability(
    ctx: click.Context, log_format: str, log_level: str, metrics_port: int | None
) -> None:
    configure_logging(log_format, log_level.lower())
    ctx.ensure_object(dict)["metrics_port"] = metrics_port


_settings = cli_context.settings
_url = cli_context.database_url


# --- postbox maintain -------------------------------------------------------------------------


@click.command()
@click.option("--job", "jobs", multiple=True, help="Run only this job (repeatable; default: all).")
@click.option(
    "--period",
    type=click.FloatRange(min=0.01),
    default=None,
    help="Seconds between runs of every job (default: each job's own period).",
)
@click.option("--once", is_flag=True, help="Run each due job once, then exit (for cron).")
@click.option("--stale-after", default=30.0, show_default=True, type=click.FloatRange(min=0.02))
@connect_timeout_option
@json_option
@click.pass_context
def maintain(
    ctx: click.Context,
    jobs: tuple[str, ...],
    period: float | None,
    once: bool,
    stale_after: float,
    connect_timeout: float | None,
    as_json: bool,
) -> None:
    """Run the maintenance jobs (retention, dedup pruning, stale workers, key repairs, gap timeouts,
    queue vacuums) on their schedule until SIGTERM/SIGINT. Safe to run in several processes: each job
    runs once per period across all of them."""
    from postbox.cli.services import _policies
    from postbox.config.policies import check_file_retention
    from postbox.operations.maintenance import JOBS, Maintenance, MaintenanceSettings

    s = _settings(ctx)
    url = _url(ctx)
    # The window maintenance sets is the one every receive judges by: refuse one the file's retries
    # (or the default policy's) outlast, as a worker refuses it, rather than let a late redelivery
    # be taken for a new message.
    check_file_retention(_policies(ctx))
    settings = MaintenanceSettings(
        dedup_retention_seconds=s.dedup_retention_seconds,
        attempts_retention_seconds=s.attempts_retention_seconds,
        dead_letter_retention_seconds=s.dead_letter_retention_seconds,
        batch_size=s.maintenance_batch_size,
        stale_after=stale_after,
        periods=(
            dict.fromkeys(JOBS, period)
            if period is not None
            else {"dedup_prune": s.maintenance_interval_seconds}
        ),
    )
    try:
        m = Maintenance(url, settings, jobs=list(jobs) or None)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--job") from None
    if not once:
        if as_json:
            raise click.UsageError("--json goes with --once")
        run_service(ctx, m, "maintenance", url, connect_timeout, stop_message="maintenance stopping")
        return
    wait_for_database(ctx, "maintenance", url, connect_timeout)
    m.register()
    rows = []
    with progress_bar("maintenance", total=len(m.jobs), enabled=not as_json) as bar:
        for job in m.jobs:  # what Maintenance.run_once does, a job at a time for the bar
            bar.update(detail=job)
            did = m.run_due(job)
            rows.append(
                {"job": job, "ran": did, "result": "ran" if did else "not due (or running elsewhere)"}
            )
            bar.advance()
    emit(rows, ["job", "result"], as_json, "no jobs")


# --- postbox status ---------------------------------------------------------------------------


@click.command()
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until interrupted.")
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.1))
@click.option(
    "--json", "as_json", is_flag=True, help="Print the status as JSON (one object a line with --watch)."
)
@click.pass_context
def status(ctx: click.Context, watch: bool, interval: float, as_json: bool) -> None:
    """Consumers, live workers, lag, retries in flight, blocked keys, dead letters, relay backlog
    and running replays, at a glance."""
    from postbox.operations.status import collect_status

    url = cli_context.checked_database_url(ctx)
    with psycopg.connect(url, connect_timeout=10, application_name="postbox-status") as conn:
        while True:
            try:
                data = mask_secrets(collect_status(conn))
                if as_json:
                    click.echo(json.dumps(data, default=str))
                else:
                    if watch and sys.stdout.isatty():
                        click.clear()
                    show_status(data)
                if not watch:
                    return
                time.sleep(interval)  # a refresh period for a human, not synchronisation
            except KeyboardInterrupt:
                if not watch:
                    raise
                return  # watching ends with Ctrl-C, wherever it lands: exit 0


# --- postbox config check ---------------------------------------------------------------------


@click.group()
def config() -> None:
    """Inspect the configuration."""


@config.command("check")
@click.pass_context
def config_check(ctx: click.Context) -> None:
    """Print the effective configuration (environment, file, defaults; secrets masked) and exit
    non-zero with the validation errors, if any."""
    from postbox.config.policies import (
        check_file_retention,
        kafka_settings_problems,
        load_policies,
        missing_secrets,
    )

    obj = ctx.find_root().ensure_object(dict)
    errors: list[str] = []
    unset: list[str] = []
    refused: list[str] = []
    effective: dict[str, Any] = {}
    try:
        s = load_settings(obj.get("config"), database_url=obj.get("database_url"))
        dumped = s.model_dump(mode="json")
        dumped["database_url"] = mask_url(s.database_url.get_secret_value()) if s.database_url else None
        effective["postbox"] = dumped
        path = obj.get("config") or s.config
        if path is not None:
            policies = load_policies(path)
            effective.update(policies.model_dump(mode="json", exclude_defaults=False))
            check_file_retention(policies)  # as a worker does at start, with the file's policies
            # Said, not refused: the file is valid, and a check (in CI, say) may run without the
            # secrets, which only the process that needs one must have.
            unset = missing_secrets(policies)
            # The same for what librdkafka refuses here (a CA file elsewhere): the relay refuses it.
            refused = kafka_settings_problems(policies)
    except ConfigError as error:
        errors.append(str(error))
    if effective:
        click.echo(json.dumps(mask_secrets(effective), indent=2, default=str))
    for line in unset:
        click.echo(
            f"postbox: warning: {line} here: the process that needs it refuses to start without it", err=True
        )
    for line in refused:
        click.echo(f"postbox: warning: {line}; a relay refuses to start with them", err=True)
    if errors:
        for e in errors:
            click.echo(f"postbox: {mask_text(e)}", err=True)
        sys.exit(1)
    click.echo("postbox: configuration is valid", err=True)


def register_ops_commands(group: click.Group) -> None:
    group.add_command(maintain)
    group.add_command(status)
    group.add_command(config)

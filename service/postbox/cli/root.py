"""The ``postbox`` command."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
import psycopg
import sqlalchemy.exc

from postbox._version import __version__
from postbox.cli import context as cli_context
from postbox.cli.console import console
from postbox.cli.consumers import consumer
from postbox.cli.dead_letters import dlq
from postbox.cli.keys import keys
from postbox.cli.operations import observability_options, register_ops_commands, setup_observability
from postbox.cli.progress import alembic_steps, progress_bar
from postbox.cli.replay import replay_group
from postbox.cli.services import bridge, relay, worker
from postbox.config.settings import mask_text, mask_url
from postbox.errors import ConfigError
from postbox.schema import migrate as migrations
from postbox.schema.apply_sql import FrozenRevisionChanged

__all__ = ["main"]


_settings = cli_context.settings
_url = cli_context.database_url


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "POSTBOX"})
@click.version_option(__version__, "-V", "--version", prog_name="postbox", message="%(prog)s %(version)s")
@click.option("--config", type=click.Path(path_type=Path), help="TOML configuration file.")
@click.option(
    "--database-url",
    envvar="POSTBOX_DATABASE_URL",
    help="PostgreSQL URL, e.g. postgresql://USER@HOST:5432/DATABASE (every command needs one but the demo, which starts an embedded PostgreSQL without it); better from the environment than on the command line, where ps shows a password.",
)
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
    ctx.ensure_object(dict).update(config=config, database_url=database_url, command=ctx.invoked_subcommand)
    if config is not None:
        log_format, log_level = cli_context.apply_config_file(ctx, log_format, log_level)
    setup_observability(ctx, log_format, log_level, metrics_port)


@cli.command()
@click.option("--sql", "as_sql", is_flag=True, help="Print the DDL instead of applying it (no connection).")
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.option(
    "--check",
    is_flag=True,
    help="Only report: exit 0 if the schema is up to date, 1 if an upgrade is pending.",
)
@click.option(
    "--from",
    "start",
    metavar="REVISION",
    help="With --sql: the revision the database is at; print only the DDL from there (default: all).",
)
@click.option(
    "--lock-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=2.0,
    show_default=True,
    metavar="SECONDS",
    help="How long one attempt waits for a table lock; receives and claims queue behind it meanwhile.",
)
@click.option(
    "--give-up-after",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    metavar="SECONDS",
    help="Try again after a lock timeout or a deadlock with running processes until then.",
)
@click.pass_context
def migrate(
    ctx: click.Context,
    as_sql: bool,
    revision: str,
    check: bool,
    start: str | None,
    lock_timeout: float,
    give_up_after: float,
) -> None:
    """Upgrade the database schema (or print its DDL with --sql).

    Safe while Postbox runs: the upgrade is one transaction; if it cannot take a table lock in time,
    or deadlocks with a running process, it is rolled back and tried again.
    """
    known = migrations.known_revisions()
    for given in (revision, start):
        if given is not None and given not in ("head", "base", *known):
            raise click.ClickException(
                f"unknown revision {given!r}: this postbox ships {', '.join(known)} (head {known[-1]})"
            )
    if start is not None and not as_sql:
        raise click.UsageError("--from goes with --sql (online, the database knows its revision)")
    order = ["base", *known]
    if start is not None and revision != "head" and order.index(start) > order.index(revision):
        raise click.UsageError(f"--from {start} is past --revision {revision}: an upgrade goes forward")
    if as_sql:
        click.echo(migrations.upgrade_sql(revision, start=None if start == "base" else start), nl=False)
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
    newer = migrations.newer_revision(url)
    if newer is not None:  # a previous release's migrate in a rolling deploy: nothing to do, no error
        click.echo(
            f"postbox: schema at {newer} is newer than this postbox ({known[-1]}): nothing to migrate; "
            "it keeps working with the versioned functions of its release",
            err=True,
        )
        return
    with progress_bar("migrate") as bar:
        if bar.live:
            bar.update(total=_pending(url, revision, known))
        try:
            with alembic_steps(bar):
                migrations.upgrade(url, revision, locks=migrations.LockPolicy(lock_timeout, give_up_after))
        except (FrozenRevisionChanged, migrations.LocksUnavailable) as error:
            raise click.ClickException(str(error)) from None
    click.echo(f"postbox: {mask_url(url)} is at revision {migrations.current_revision(url)}", err=True)


def _pending(url: str, revision: str, known: list[str]) -> int:
    """How many revisions an upgrade to ``revision`` applies (for the progress bar)."""
    current = migrations.current_revision(url)
    start = known.index(current) + 1 if current in known else 0
    end = len(known) if revision == "head" else known.index(revision) + 1 if revision in known else 0
    return max(end - start, 0)


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
    if migrations.current_revision(url) is None:
        click.echo(f"postbox: {mask_url(url)} has no Postbox schema: nothing to downgrade", err=True)
        return
    newer = migrations.newer_revision(url)
    if newer is not None:
        raise click.ClickException(
            f"schema at {newer} is newer than this postbox ({known[-1]}), which cannot undo it: downgrade to "
            f"{known[-1]} with the release that made {newer} (its `postbox downgrade {known[-1]}`), then with this one"
        )
    if revision == "base":
        at_risk = migrations.data_at_risk(url)
        if at_risk and not force:
            lost = ", ".join(f"{what} ({n:,})" for what, n in at_risk.items())
            raise click.ClickException(
                f"downgrading to base would delete {lost}; run again with --force to delete them"
            )
    try:
        migrations.downgrade(url, revision)
    except migrations.LocksUnavailable as error:
        raise click.ClickException(str(error)) from None
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


for command in (worker, relay, bridge, dlq, replay_group, keys, consumer, console):
    cli.add_command(command)
register_ops_commands(cli)


# Variables named after an option's name in the code rather than its flag (POSTBOX_MIGRATE_AS_SQL for
# --sql), as --help showed them until 0.14.0: still read, as the flag's variable (see main), unshown.
_LEGACY_ENVVARS: dict[str, str] = {}


def _show_envvars(command: click.Command, prefix: str) -> None:
    """Every option can also come from an environment variable, POSTBOX_<COMMAND>_<OPTION> after
    its long flag (``--sql`` of ``migrate``: POSTBOX_MIGRATE_SQL), unless it names its own: say
    which in --help."""
    for param in command.params:
        if isinstance(param, click.Option) and param.name not in ("help", "version"):
            param.show_envvar = True
            if param.envvar is None and param.name:
                param.envvar = f"{prefix}_{_flag_name(param)}"
                legacy = f"{prefix}_{param.name.upper()}"
                if legacy != param.envvar:
                    _LEGACY_ENVVARS[legacy] = param.envvar
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            _show_envvars(sub, f"{prefix}_{name.upper().replace('-', '_')}")


def _flag_name(option: click.Option) -> str:
    """The option's longest long flag, as an environment variable's suffix (``--grace-period``:
    GRACE_PERIOD); its name in the code if it has none."""
    flags = [o for o in option.opts if o.startswith("--")]
    if not flags:
        return (option.name or "").upper()
    return max(flags, key=len)[2:].upper().replace("-", "_")


_show_envvars(cli, "POSTBOX")


def _read_legacy_envvars() -> None:
    """An option's variable under its former name (see _LEGACY_ENVVARS), unless its own is set."""
    for legacy, current in _LEGACY_ENVVARS.items():
        if legacy in os.environ and current not in os.environ:
            os.environ[current] = os.environ[legacy]


# The role each command's login needs (docs/operations.md, Roles), for a refusal to name it.
_ROLE_OF = {
    "worker": "a login granted postbox_worker", "relay": "a login granted postbox_worker",
    "bridge": "a login granted postbox_worker", "maintain": "a login granted postbox_maintainer",
    "status": "a login granted postbox_reader or postbox_operator",
    "dlq": "a login granted postbox_operator", "replay": "a login granted postbox_operator",
    "keys": "a login granted postbox_operator", "consumers": "a login granted postbox_operator",
    "console": "a login granted postbox_operator",
    "migrate": "the schema's owner (the role that first migrated it) or a superuser (to check it, any "
    "Postbox role but postbox_producer)",
    "downgrade": "the schema's owner (the role that first migrated it) or a superuser",
}  # fmt: skip


def main() -> None:
    _read_legacy_envvars()
    obj: dict[str, object] = {}
    try:
        _main(obj)
    except (psycopg.errors.InsufficientPrivilege, sqlalchemy.exc.DBAPIError) as error:
        orig = getattr(error, "orig", None) or error
        if not isinstance(orig, psycopg.errors.InsufficientPrivilege):
            raise
        detail = (getattr(orig.diag, "message_primary", None) or str(orig)).strip().splitlines()[0]
        role = _ROLE_OF.get(str(obj.get("command")))
        need = f"this command needs {role}" if role else "this login lacks a grant the command needs"
        click.echo(
            f"postbox: {mask_text(detail)}: {need} (the roles are in docs/operations.md, Roles)", err=True
        )
        sys.exit(1)


def _main(obj: dict[str, object]) -> None:
    try:
        cli(obj=obj)
    except ConfigError as error:
        click.echo(f"postbox: {mask_text(str(error))}", err=True)
        sys.exit(error.exit_code)
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

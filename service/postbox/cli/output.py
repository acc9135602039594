"""What the operator commands share: a connection with clean errors, tables for people and JSON for
scripts, the dead-letter filter options, and the ``--reason``/``--actor``/``--json`` options."""

from __future__ import annotations

import getpass
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import click
import psycopg

from postbox.cli.context import database_url
from postbox.deadletters.ops import DeadLetterFilter
from postbox.errors import InvalidRequest

__all__ = [
    "actor_option",
    "connection",
    "dead_letter_filter",
    "emit",
    "filter_options",
    "human",
    "json_option",
    "plain",
    "reason_option",
    "require_selection",
]


@contextmanager
def connection(ctx: click.Context) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to the configured database; bad input becomes a clean error."""
    try:
        with psycopg.connect(database_url(ctx), autocommit=True, application_name="postbox cli") as conn:
            yield conn
    except InvalidRequest as error:
        raise click.ClickException(str(error)) from None
    except (LookupError, psycopg.errors.InsufficientPrivilege) as error:
        raise click.ClickException(str(error).strip().splitlines()[0]) from None


def default_actor() -> str:
    try:
        return os.environ.get("POSTBOX_ACTOR") or getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        return "unknown"


def plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


def human(value: Any, full: bool = False) -> str:
    """A value as a table cell: times and ages short, long text cut at 60 characters unless ``full``."""
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, timedelta):
        seconds = int(value.total_seconds())
        if seconds >= 86_400:
            return f"{seconds // 86_400}d{(seconds % 86_400) // 3600}h"
        if seconds >= 3600:
            return f"{seconds // 3600}h{(seconds % 3600) // 60}m"
        return f"{seconds // 60}m{seconds % 60}s" if seconds >= 60 else f"{seconds}s"
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    text = str(value)
    return text if full or len(text) <= 60 else text[:57] + "..."


def emit(
    rows: Sequence[dict[str, Any]], columns: Sequence[str], as_json: bool, empty: str, full: bool = False
) -> None:
    """Rows as a table (cells cut at 60 characters unless ``full``), or as JSON."""
    if as_json:
        click.echo(json.dumps([{k: plain(v) for k, v in r.items()} for r in rows], indent=2, default=str))
        return
    if not rows:
        click.echo(empty)
        return
    cells = [[human(r.get(c), full) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    click.echo("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def full_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--full``: long cells (errors, details) whole instead of cut at 60 characters."""
    return click.option("--full", is_flag=True, help="Show long values whole (not cut at 60 characters).")(
        func
    )


def filter_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The dead-letter filter as options (all optional, combined with AND)."""
    options = [
        click.option("--id", "ids", type=int, multiple=True, help="Dead letter id (repeatable)."),
        click.option("--origin", type=click.Choice(["inbox", "outbox"])),
        click.option("--queue", help="Consumer or destination."),
        click.option("--consumer"),
        click.option("--destination"),
        click.option("--type", "type_", help="Message type."),
        click.option("--cause", help="Dead-letter reason: attempts_exhausted, permanent, deadline, late…"),
        click.option("--fingerprint", help="Error group (see `postbox dlq groups`)."),
        click.option("--key"),
        click.option("--message-id"),
        click.option("--since", type=click.DateTime(), help="Dead-lettered at or after."),
        click.option("--until", type=click.DateTime(), help="Dead-lettered before."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def dead_letter_filter(kw: dict[str, Any], status: str | None = None) -> DeadLetterFilter:
    return DeadLetterFilter(
        ids=list(kw.pop("ids")) or None,
        origin=kw.pop("origin"),
        queue=kw.pop("queue"),
        consumer=kw.pop("consumer"),
        destination=kw.pop("destination"),
        type=kw.pop("type_"),
        reason=kw.pop("cause"),
        fingerprint=kw.pop("fingerprint"),
        key=kw.pop("key"),
        message_id=kw.pop("message_id"),
        since=kw.pop("since"),
        until=kw.pop("until"),
        status=status,
    )


def require_selection(flt: DeadLetterFilter, everything: bool) -> None:
    if flt.is_empty() and not everything:
        raise click.UsageError(
            "give a filter (--id, --queue, --type, --fingerprint, …) or --all to act on every open dead letter"
        )


actor_option = click.option(
    "--actor",
    default=default_actor,
    show_default="$POSTBOX_ACTOR or the OS user",
    help="Who you are, for the audit trail.",
)
reason_option = click.option("--reason", required=True, help="Why (recorded in the audit trail).")
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")

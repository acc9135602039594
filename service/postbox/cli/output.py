"""What the operator commands share: a connection with clean errors, tables for people and JSON for
scripts (every listing goes through :func:`emit`), the dead-letter filter options, and the
``--reason``/``--actor``/``--json``/``--full`` options."""

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
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from postbox.cli.context import checked_database_url
from postbox.deadletters.ops import DeadLetterFilter
from postbox.errors import InvalidRequest

__all__ = [
    "Columns",
    "actor_option",
    "connection",
    "dead_letter_filter",
    "emit",
    "emit_json",
    "filter_options",
    "human",
    "json_option",
    "plain",
    "reason_option",
    "record",
    "require_selection",
    "table",
    "terminal",
]


@contextmanager
def connection(ctx: click.Context) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to the configured database; bad input becomes a clean error."""
    try:
        with psycopg.connect(
            checked_database_url(ctx), autocommit=True, application_name="postbox cli"
        ) as conn:
            yield conn
    except InvalidRequest as error:
        label = _OBJECTS.get(error.field)  # "dead letter 9 does not exist", not "dead_letter: 9 ..."
        raise click.ClickException(f"{label} {error.problem}" if label else str(error)) from None
    except LookupError as error:  # (a refusal for want of a grant is main's: it names the role)
        line = str(error).strip().splitlines()[0]
        raise click.ClickException(line.removeprefix("postbox: ")) from None  # click says "Error: "


# The fields of refusals that name an object by its id first ("9 does not exist"), as the CLI names it.
_OBJECTS = {"dead_letter": "dead letter", "replay_job": "replay job", "key": "key"}


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
        return _age(value.total_seconds())
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    text = str(value)
    return text if full or len(text) <= 60 else text[:57] + "..."


def _age(seconds: float) -> str:
    if seconds < 10:
        return f"{max(seconds, 0):.1f}s"
    whole = int(seconds)
    if whole >= 86_400:
        return f"{whole // 86_400}d{(whole % 86_400) // 3600}h"
    if whole >= 3600:
        return f"{whole // 3600}h{(whole % 3600) // 60}m"
    return f"{whole // 60}m{whole % 60}s" if whole >= 60 else f"{whole}s"


# --- the one table style: rich on a terminal, plain aligned text otherwise ----------------------

Columns = Sequence[str | tuple[str, str]]
"""Table columns: a row key (its header is the key in upper case, ``_`` as spaces), or (key, header)."""


def terminal(stderr: bool = False) -> Console | None:
    """A rich console when the stream is a terminal, ``None`` for plain text (a pipe, a file,
    ``TERM=dumb``). Rich's conventions decide: ``FORCE_COLOR`` or ``TTY_COMPATIBLE=1`` make any
    stream a terminal, ``TTY_COMPATIBLE=0`` none; ``NO_COLOR`` keeps the tables but writes no
    escape code at all; ``COLUMNS`` sets the width."""
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal or console.is_dumb_terminal:
        return None
    if console.no_color:
        return Console(stderr=stderr, highlight=False, color_system=None)
    return console


_STATES = {
    "HALTED": "bold red", "aborted": "bold red", "replay_failed": "bold red", "cancelled": "red",
    "open": "yellow", "paused": "yellow", "pending": "yellow", "running": "cyan", "replaying": "cyan",
    "ok": "green", "done": "green", "ran": "green", "replayed": "green", "resolved": "green",
    "succeeded": "green", "failed": "red", "discarded": "dim", "skipped": "dim",
}  # fmt: skip
_ALARMS = {"failed": "bold red", "open": "bold red", "blocked_keys": "yellow", "held_messages": "yellow",
           "blocked": "yellow", "retrying": "yellow", "attempt": "yellow"}  # fmt: skip
_ERRORS = {"error", "latest_error", "last_error", "state_reason", "fingerprint"}


def _style(key: str, value: Any, row: dict[str, Any]) -> str:
    """How a cell is highlighted: states by their meaning, failures and dead letters in red, counts
    that need attention in yellow, missing values dim."""
    if value is None or value == "":
        return "dim"
    if key in ("state", "status", "result") and isinstance(value, str):
        return _STATES.get(value.split(" ", 1)[0], "")
    if key in _ALARMS and isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return "" if key == "attempt" and value <= 1 else _ALARMS[key]
    if key in _ERRORS:
        return "red"
    if key == "reason" and "status" in row:  # a dead letter's cause
        return "yellow"
    if key == "event" and isinstance(value, str):
        if value.startswith("dead-lettered") or "failed" in value:
            return "red"
        return "cyan" if value.startswith("replay") else ""
    return ""


def _columns(columns: Columns) -> list[tuple[str, str]]:
    return [(c, c.replace("_", " ").upper()) if isinstance(c, str) else c for c in columns]


def table(
    rows: Sequence[dict[str, Any]],
    columns: Columns,
    *,
    empty: str = "",
    full: bool = False,
    wrap: bool = False,
    title: str | None = None,
) -> None:
    """Rows as a table on stdout: a rich table with colour on a terminal, plain aligned text
    (same headers, no escape codes) otherwise; ``empty`` when there are no rows. Under a
    ``title``, the plain table is indented."""
    cols = _columns(columns)
    console = terminal()
    if console is None:
        _plain_table(rows, cols, empty, full, title)
        return
    if not rows:
        if title:
            console.print(Text(title, style="bold"))
        if empty:
            console.print(Text(f"  {empty}" if title else empty, style="dim"))
        return
    grid = Table(
        box=box.ROUNDED,
        header_style="bold",
        title=Text(title, style="bold") if title else None,  # a Text: no markup in titles or cells
        title_justify="left",
    )
    for _, header in cols:
        grid.add_column(header, overflow="fold")
    for r in rows:
        grid.add_row(
            *(Text(human(r.get(k), full or wrap), style=_style(k, r.get(k), r)) for k, _ in cols),
            style="red" if r.get("halted") is True else None,
        )
    console.print(grid)


def _plain_table(
    rows: Sequence[dict[str, Any]], cols: list[tuple[str, str]], empty: str, full: bool, title: str | None
) -> None:
    indent = "  " if title else ""
    if title:
        click.echo(title)
    if not rows:
        if empty:
            click.echo(indent + empty)
        return
    cells = [[human(r.get(k), full) for k, _ in cols] for r in rows]
    headers = [h for _, h in cols]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    for line in (headers, *cells):
        click.echo(indent + "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())


def record(row: dict[str, Any], skip: Sequence[str] = ()) -> None:
    """One item's fields, one a line (``name  value``): a two-column table on a terminal."""
    items = [(k, v) for k, v in row.items() if k not in skip]
    console = terminal()
    if console is None:
        for name, value in items:
            shown = json.dumps(value, ensure_ascii=False) if isinstance(value, dict | list) else plain(value)
            click.echo(f"{name:>18}  {shown}")
        return
    grid = Table(box=box.ROUNDED, header_style="bold")
    grid.add_column("FIELD", style="bold", no_wrap=True)
    grid.add_column("VALUE", overflow="fold")
    for name, value in items:
        grid.add_row(name, Text(human(value, full=True), style=_style(name, value, row)))
    console.print(grid)


def emit_json(value: Any, indent: int | None = 2) -> None:
    """``value`` (rows, or one row) as JSON on stdout: datetimes ISO-8601 at every depth (a dead
    letter's edits too), no colour."""
    click.echo(json.dumps(value, indent=indent, default=_json_default, ensure_ascii=False))


def _json_default(value: Any) -> Any:
    """What JSON has no type for: :func:`plain`'s form, else its text."""
    converted = plain(value)
    return str(value) if converted is value else converted


def emit(
    rows: Sequence[dict[str, Any]],
    columns: Columns,
    as_json: bool,
    empty: str,
    full: bool = False,
    *,
    wrap: bool = False,
) -> None:
    """Rows as JSON, or as the one table style (see :func:`table`): cells cut at 60 characters
    unless ``full``; ``wrap``: whole (and wrapped) on a terminal."""
    if as_json:
        emit_json(list(rows))
        return
    table(rows, columns, empty=empty, full=full, wrap=wrap)


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
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Machine-readable output: JSON on stdout, nothing else."
)

"""``postbox consumer …``: halt and resume consumers."""

from __future__ import annotations

import difflib
from typing import Any

import click
import psycopg

from postbox.cli.output import actor_option, connection, reason_option
from postbox.deadletters import ops as deadletter

__all__ = ["consumer"]


@click.group()
def consumer() -> None:
    """Halt and resume consumers."""


def _known(conn: psycopg.Connection[Any], name: str) -> None:
    """Refuse a consumer Postbox has never seen, naming the close ones."""
    names = deadletter.consumer_names(conn, name)
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    known = ", ".join(names[:20]) or "none yet"
    raise click.ClickException(
        f"unknown consumer {name!r}: no messages, workers, dead letters or declaration by that name; "
        f"{hint}known consumers: {known}"
    )


@consumer.command("halt")
@click.argument("name")
@reason_option
@actor_option
@click.pass_context
def consumer_halt(ctx: click.Context, name: str, reason: str, actor: str) -> None:
    """Halt a consumer: its workers claim nothing until it is resumed."""
    with connection(ctx) as conn:
        _known(conn, name)
        already = deadletter.consumer_halted(conn, name)
        if already is None:
            deadletter.halt_consumer(conn, name, reason, actor)
    if already is not None:  # the first halt's time and reason stand; nothing is audited
        since = f"{already['halted_at']:%Y-%m-%d %H:%M:%S %Z}".rstrip()
        why = f", reason: {already['halted_reason']}" if already["halted_reason"] else ""
        click.echo(f"consumer {name} was already halted (since {since}{why}); nothing changed")
        return
    click.echo(f"consumer {name} halted")


@consumer.command("resume")
@click.argument("name")
@reason_option
@actor_option
@click.pass_context
def consumer_resume(ctx: click.Context, name: str, reason: str, actor: str) -> None:
    """Resume a halted consumer."""
    with connection(ctx) as conn:
        _known(conn, name)
        was = deadletter.resume_consumer(conn, name, reason, actor)
    click.echo(f"consumer {name} resumed" if was else f"consumer {name} was not halted")

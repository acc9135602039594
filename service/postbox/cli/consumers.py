"""``postbox consumer …``: halt and resume consumers."""

from __future__ import annotations

import click

from postbox.cli.output import actor_option, connection, reason_option
from postbox.deadletters import ops as deadletter

__all__ = ["consumer"]


@click.group()
def consumer() -> None:
    """Halt and resume consumers."""


@consumer.command("halt")
@click.argument("name")
@reason_option
@actor_option
@click.pass_context
def consumer_halt(ctx: click.Context, name: str, reason: str, actor: str) -> None:
    """Halt a consumer: its workers claim nothing until it is resumed."""
    with connection(ctx) as conn:
        deadletter.halt_consumer(conn, name, reason, actor)
    click.echo(f"consumer {name} halted")


@consumer.command("resume")
@click.argument("name")
@reason_option
@actor_option
@click.pass_context
def consumer_resume(ctx: click.Context, name: str, reason: str, actor: str) -> None:
    """Resume a halted consumer."""
    with connection(ctx) as conn:
        was = deadletter.resume_consumer(conn, name, reason, actor)
    click.echo(f"consumer {name} resumed" if was else f"consumer {name} was not halted")

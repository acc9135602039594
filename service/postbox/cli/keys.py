"""``postbox keys …``: keys held behind a dead-lettered head."""

from __future__ import annotations

import click

from postbox.cli.output import actor_option, connection, emit, json_option, reason_option
from postbox.deadletters import ops as deadletter

__all__ = ["keys"]


@click.group()
def keys() -> None:
    """Keys held behind a dead-lettered head."""


@keys.command("blocked")
@json_option
@click.pass_context
def keys_blocked(ctx: click.Context, as_json: bool) -> None:
    """Blocked keys, oldest first, with the dead letter holding each and how many messages wait."""
    with connection(ctx) as conn:
        rows = deadletter.blocked_keys(conn)
    emit(
        rows,
        ["origin", "queue", "key", "dead_letter_id", "reason", "blocked_for", "held_messages"],
        as_json,
        "no blocked keys",
    )


@keys.command("unblock")
@click.argument("queue")
@click.argument("key")
@click.option("--origin", type=click.Choice(["inbox", "outbox"]), default="inbox", show_default=True)
@click.option(
    "--replay", "do_replay", is_flag=True, help="Replay the head in place instead of discarding it."
)
@reason_option
@actor_option
@click.pass_context
def keys_unblock(
    ctx: click.Context, queue: str, key: str, origin: str, do_replay: bool, reason: str, actor: str
) -> None:
    """Unblock KEY of QUEUE: discard its dead-lettered head (held messages follow), or --replay it."""
    with connection(ctx) as conn:
        click.echo(deadletter.unblock_key(conn, origin, queue, key, reason, actor, do_replay))  # type: ignore[arg-type]

"""Handlers the benchmark's worker processes run: the minimum real work per message."""

from __future__ import annotations

from postbox.inbox.handlers import BatchContext, Context, Message, Registry

registry = Registry()


@registry.handler("bench", database_only=True)
def effect(message: Message, ctx: Context) -> None:
    """One effect row per message, in the message's transaction (exactly-once effect). Nothing
    outside the database: declared so, the messages of a batch share one savepoint. Its parameters
    go in binary (``%b``), as docs/handlers.md advises: psycopg's text form of a timestamp is built
    in Python."""
    ctx.conn.execute(
        "INSERT INTO bench_effects (message_id, key, seq, latency_ms) VALUES (%b, %b, %b,"
        " extract(epoch FROM clock_timestamp() - %b) * 1000)",
        (message.message_id, message.key, message.sequence, message.received_at),
    )


# The same handler as its users would declare it without thinking of it: a savepoint per message.
each_registry = Registry()
each_registry.add(effect, "bench")

batch_registry = Registry()


@batch_registry.batch_handler("bench")
def effects(messages: list[Message], ctx: BatchContext) -> None:
    """The same effect rows for a whole claimed batch, in one statement (a batch handler). Its lists
    go in binary (``%b``), as docs/handlers.md advises: psycopg builds a list's text form element by
    element in Python."""
    ctx.conn.execute(
        "INSERT INTO bench_effects (message_id, key, seq, latency_ms) SELECT m, k, s,"
        " extract(epoch FROM clock_timestamp() - r) * 1000"
        " FROM unnest(%b::text[], %b::text[], %b::bigint[], %b::timestamptz[]) AS u(m, k, s, r)",
        (
            [m.message_id for m in messages],
            [m.key for m in messages],
            [m.sequence for m in messages],
            [m.received_at for m in messages],
        ),
    )

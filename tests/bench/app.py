"""Handlers the benchmark's worker processes run: the minimum real work per message."""

from __future__ import annotations

from postbox.inbox.handlers import Context, Message, Registry

registry = Registry()


@registry.handler("bench")
def effect(message: Message, ctx: Context) -> None:
    """One effect row per message, in the message's transaction (exactly-once effect)."""
    ctx.conn.execute(
        "INSERT INTO bench_effects (message_id, key, seq, latency_ms) VALUES (%s, %s, %s,"
        " extract(epoch FROM clock_timestamp() - %s) * 1000)",
        (message.message_id, message.key, message.sequence, message.received_at),
    )

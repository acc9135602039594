"""A registry whose consumer, types and outbox destination have hostile names (quotes, semicolons,
dollar quotes, backslashes, Unicode), for the security tests: names are data, never SQL."""

from __future__ import annotations

from postbox.inbox.handlers import Context, Message, Registry

CONSUMER = "o'rders\"; DROP TABLE canary; --$$\\ü"
DESTINATION = "dest'); DROP TABLE canary; --\"$x$\\ñ"
TYPE = "type'; SELECT pg_sleep(30); --$$\\é"

registry = Registry()


@registry.handler(CONSUMER)
def handle(message: Message, ctx: Context) -> None:
    ctx.conn.execute(
        "INSERT INTO hostile_effects (consumer, message_id, key, type) VALUES (%s, %s, %s, %s)",
        (message.consumer, message.message_id, message.key, message.type),
    )
    ctx.publish(DESTINATION, {"from": message.message_id}, key=message.key, type=message.type)

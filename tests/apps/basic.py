"""A small handler registry for process-level tests: records effects; payload flags slow it down."""

from __future__ import annotations

import time

from postbox.inbox.handlers import Context, Message, Registry
from tests.helpers import record_effect

registry = Registry()


@registry.handler("basic")
def handle(message: Message, ctx: Context) -> None:
    if isinstance(message.payload, dict) and message.payload.get("sleep"):
        # Sleep in Python (not in the database) so a stopped process holds no server-side work.
        time.sleep(float(message.payload["sleep"]))
    record_effect(ctx.conn, message.message_id, message.key, message.sequence, message.attempt)

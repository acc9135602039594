"""A handler that always fails with a ValueError naming what was wrong (for the log tests)."""

from __future__ import annotations

from postbox.inbox.handlers import Context, Message, Registry

registry = Registry()


@registry.handler("failing")
def handle(message: Message, ctx: Context) -> None:
    raise ValueError(f"amount must be a number, got {message.payload!r}")

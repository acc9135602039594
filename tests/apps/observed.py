"""Handlers for the observability tests: payload flags make an attempt fail or publish an event."""

from __future__ import annotations

from postbox.inbox.handlers import Context, Message, Registry

registry = Registry()


@registry.handler("obs")
def handle(message: Message, ctx: Context) -> None:
    payload = message.payload if isinstance(message.payload, dict) else {}
    if message.attempt < int(payload.get("succeed_at", 1)):
        raise ConnectionError("the dependency is down")  # transient: retried
    if payload.get("invalid"):
        raise ValueError("amount is missing")  # permanent: dead-lettered at once
    if payload.get("publish"):
        ctx.publish("out", {"from": message.message_id}, key=message.key, type="obs.done")

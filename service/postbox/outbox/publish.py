"""The producer API, outbox side: publish events inside the caller's own transaction.

Like :mod:`postbox.inbox.receive`: the caller's connection or session, never opened or committed
here; the events are relayed once the caller commits. Sync and async share the same validation and
the same SQL; only the final call is awaited.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from postbox import limits
from postbox.db import AnyAsyncConnection, AnySyncConnection
from postbox.db.connector import first
from postbox.limits import Large, run_checked, run_checked_async
from postbox.messages import OutboxMessage, batch_items, checked
from postbox.operations import tracing
from postbox.values import to_sql_json

__all__ = ["publish", "publish_async", "publish_many", "publish_many_async"]


def _one(message: OutboxMessage | None, fields: dict[str, Any]) -> list[dict[str, Any]]:
    """The checked event, as the one item of a batch (its span may add a ``traceparent``)."""
    return [checked(OutboxMessage, message, fields).batch_item()]


def _batch(items: list[dict[str, Any]]) -> tuple[str, dict[str, Any], list[Large]]:
    """A checked batch's query, its bind parameters (the JSON array the batch function takes) and
    what to check against the limits (each payload and headers, measured only if the whole array is
    long)."""
    text = to_sql_json(items)
    found: list[Large] = []
    if limits.large("messages", limits.PAYLOAD, text, []):
        limits.large_items([m["payload"] for m in items], "payload", limits.PAYLOAD, found)
        limits.large_items([m.get("headers") or {} for m in items], "headers", limits.HEADERS, found)
    return "outbox_publish_batch", {"messages": text}, found


def publish(conn: AnySyncConnection, message: OutboxMessage | None = None, /, **fields: Any) -> int:
    """Write one outbox event in ``conn``'s transaction; returns its outbox id.

    Fields: ``destination``, ``payload``, ``key``, ``type``, ``message_id`` (default: a UUID),
    ``headers``, ``correlation_id``, ``causation_id``.
    """
    with tracing.producing("publish", _one(message, fields), "destination") as items:
        return int(first(run_checked(conn, "outbox_publish", *limits.single_params(items)))[0])


def publish_many(conn: AnySyncConnection, messages: Iterable[OutboxMessage | dict[str, Any]]) -> list[int]:
    """Write several outbox events in one round trip; ids in the same order."""
    items = batch_items(OutboxMessage, messages)
    if not items:
        return []
    with tracing.producing("publish", items, "destination") as items:
        return [int(r[1]) for r in run_checked(conn, *_batch(items))]


async def publish_async(
    conn: AnyAsyncConnection, message: OutboxMessage | None = None, /, **fields: Any
) -> int:
    """:func:`publish` for async connections."""
    with tracing.producing("publish", _one(message, fields), "destination") as items:
        return int(first(await run_checked_async(conn, "outbox_publish", *limits.single_params(items)))[0])


async def publish_many_async(
    conn: AnyAsyncConnection, messages: Iterable[OutboxMessage | dict[str, Any]]
) -> list[int]:
    """:func:`publish_many` for async connections."""
    items = batch_items(OutboxMessage, messages)
    if not items:
        return []
    with tracing.producing("publish", items, "destination") as items:
        return [int(r[1]) for r in await run_checked_async(conn, *_batch(items))]

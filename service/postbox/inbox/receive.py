"""The producer API, inbox side: receive messages inside the caller's own transaction.

Every function takes the caller's connection or session (psycopg or SQLAlchemy, sync or async),
never opens one and never commits: the message becomes visible when the caller commits, and
disappears with a rollback. Sync and async share the same validation and the same SQL; only the
final call is awaited.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import psycopg

from postbox import limits
from postbox.db import AnyAsyncConnection, AnySyncConnection
from postbox.db.connector import first, int_array, text_array
from postbox.limits import Large, run_checked, run_checked_async
from postbox.messages import (
    INBOX_DEFAULTS,
    InboxMessage,
    ReceiveResult,
    ReceiveStatus,
    batch_items,
    checked,
    plain_inbox_item,
)
from postbox.operations import tracing
from postbox.values import to_sql_json

__all__ = ["receive", "receive_async", "receive_many", "receive_many_async"]

# A batch to one consumer (payloads and headers as one JSON array each: the fastest form), and the
# same batch mixing consumers (one array per field); both go through the one batch path in SQL.
_COLUMNS = "inbox_receive_columns"
_ARRAYS = "inbox_receive_arrays"

# The optional columns of a batch, with the field each holds.
_OPTIONAL_COLUMNS = (
    ("keys", "key"),
    ("types", "type"),
    ("sequences", "sequence"),
    ("schema_versions", "schema_version"),
    ("correlation_ids", "correlation_id"),
    ("causation_ids", "causation_id"),
    ("sources", "source"),
)


def _batch_call(items: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The query and bind parameters that receive ``items`` in one statement, column by column.
    A field no message has (absent or its default) travels as NULL."""
    present = set().union(*items)  # the fields some item has: the others need no scan
    columns: dict[str, Any] = {"message_ids": [m["message_id"] for m in items]}
    for column, name in _OPTIONAL_COLUMNS:
        values = None
        if name in present:
            default = INBOX_DEFAULTS[name]
            values = [m.get(name, default) for m in items]
            if all(v == default for v in values):
                values = None
        columns[column] = values
    headers = [m.get("headers") or {} for m in items] if "headers" in present else None
    if headers is not None and not any(headers):
        headers = None
    consumers = [m["consumer"] for m in items]
    if consumers.count(consumers[0]) == len(consumers):
        return _COLUMNS, columns | {
            "consumer": consumers[0],
            "payloads": to_sql_json([m["payload"] for m in items]),
            "headers": None if headers is None else to_sql_json(headers),
        }
    return _ARRAYS, columns | {
        "consumers": consumers,
        "payloads": [to_sql_json(m["payload"]) for m in items],
        "headers": None if headers is None else [to_sql_json(h) for h in headers],
    }


def _batch_large(items: list[dict[str, Any]], name: str, params: dict[str, Any]) -> list[Large]:
    """The payloads and headers of a batch that must be checked against the server's limits.
    The columns form sends each as one JSON array: no element is longer than the array, so only
    a long array has its elements measured one by one."""
    found: list[Large] = []
    if name == _COLUMNS:
        if limits.large("payloads", limits.PAYLOAD, params["payloads"], []):
            limits.large_items([m["payload"] for m in items], "payload", limits.PAYLOAD, found)
        if limits.large("headers", limits.HEADERS, params["headers"], []):
            limits.large_items([m.get("headers") or {} for m in items], "headers", limits.HEADERS, found)
        return found
    for i, text in enumerate(params["payloads"]):
        limits.large(f"messages[{i}].payload", limits.PAYLOAD, text, found)
    for i, text in enumerate(params["headers"] or ()):
        limits.large(f"messages[{i}].headers", limits.HEADERS, text, found)
    return found


# The batch's integer columns; every other list it binds is text (jsonb[] from JSON texts).
_INTEGER_COLUMNS = frozenset({"sequences", "schema_versions"})


def _batch(items: list[dict[str, Any]], conn: object) -> tuple[str, dict[str, Any], list[Large]]:
    """A checked batch's query, bind parameters and what to check against the limits. On a psycopg
    connection its lists are bound as array literals, which the query casts: psycopg would adapt
    them element by element in Python. Through SQLAlchemy, whose driver may be any, they stay lists."""
    name, params = _batch_call(items)
    found = _batch_large(items, name, params)
    if isinstance(conn, psycopg.Connection | psycopg.AsyncConnection):
        for column, values in params.items():
            if type(values) is list:
                params[column] = int_array(values) if column in _INTEGER_COLUMNS else text_array(values)
    return name, params, found


def _one(message: InboxMessage | None, fields: dict[str, Any]) -> list[dict[str, Any]]:
    """The checked message, as the one item of a batch (its span may add a ``traceparent``).
    Fields that are plainly valid skip building the model (as a batch's do), with its defaults."""
    if message is None:
        item = plain_inbox_item(fields)
        if item is not None:
            return [INBOX_DEFAULTS | item]
    return [checked(InboxMessage, message, fields).batch_item()]


_STATUSES = {s.value: s for s in ReceiveStatus}
_new_result = object.__new__
_set_field = object.__setattr__


def _receive_result(row: Sequence[Any]) -> ReceiveResult:
    return ReceiveResult(status=_STATUSES[row[0]], inbox_id=row[1])


def _receive_results(rows: Iterable[Sequence[Any]]) -> list[ReceiveResult]:
    """One result per (status, inbox_id) row: built field by field, since a batch builds one per
    message and the checked constructor costs twice as much."""
    results = []
    for status, inbox_id in rows:
        r = _new_result(ReceiveResult)
        _set_field(r, "status", _STATUSES[status])
        _set_field(r, "inbox_id", inbox_id)
        results.append(r)
    return results


def receive(conn: AnySyncConnection, message: InboxMessage | None = None, /, **fields: Any) -> ReceiveResult:
    """Receive one message into the inbox in ``conn``'s transaction.

    Pass an :class:`InboxMessage` or its fields as keywords (``consumer``, ``message_id``,
    ``payload``, ``key``, ``type``, ``sequence``, ``headers``, ...). Returns whether the message is
    new, a duplicate, or a conflict (same id, other payload: nothing written). Raises
    :class:`InvalidMessage` naming the field for bad input, before anything is written: before
    the round trip (the caller's transaction goes on), except what only the database knows (an
    undeclared consumer, a sequenced consumer without ``sequence``, a size limit set below
    ``postbox.limits.CHECKED_ABOVE_BYTES``), which the server refuses, aborting the caller's
    transaction.
    """
    with tracing.producing("send", _one(message, fields), "consumer") as items:
        return _receive_result(first(run_checked(conn, "inbox_receive", *limits.single_params(items))))


def receive_many(
    conn: AnySyncConnection, messages: Iterable[InboxMessage | dict[str, Any]]
) -> list[ReceiveResult]:
    """Receive several messages in one round trip; results are in the same order."""
    items = batch_items(InboxMessage, messages)
    if not items:
        return []
    with tracing.producing("send", items, "consumer") as items:
        return _receive_results(run_checked(conn, *_batch(items, conn)))


async def receive_async(
    conn: AnyAsyncConnection, message: InboxMessage | None = None, /, **fields: Any
) -> ReceiveResult:
    """:func:`receive` for psycopg ``AsyncConnection`` and SQLAlchemy async sessions/connections."""
    with tracing.producing("send", _one(message, fields), "consumer") as items:
        return _receive_result(
            first(await run_checked_async(conn, "inbox_receive", *limits.single_params(items)))
        )


async def receive_many_async(
    conn: AnyAsyncConnection, messages: Iterable[InboxMessage | dict[str, Any]]
) -> list[ReceiveResult]:
    """:func:`receive_many` for async connections."""
    items = batch_items(InboxMessage, messages)
    if not items:
        return []
    with tracing.producing("send", items, "consumer") as items:
        return _receive_results(await run_checked_async(conn, *_batch(items, conn)))

"""The producer API: write to the inbox and outbox inside the caller's own transaction.

Every function takes the caller's connection or session (psycopg or SQLAlchemy, sync or async),
never opens one and never commits: the message becomes visible when the caller commits, and
disappears with a rollback. Sync and async share the same validation and the same SQL; only the
final call is awaited.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import ValidationError

from service.db import AnyAsyncConnection, AnySyncConnection, query, run, run_async
from service.db.connector import first
from service.errors import InvalidMessage
from service.messages import (
    INBOX_DEFAULTS,
    InboxMessage,
    OutboxMessage,
    ReceiveResult,
    ReceiveStatus,
    invalid_message_from,
    plain_inbox_item,
    to_json,
)

__all__ = [
    "declare_consumer",
    "publish",
    "publish_async",
    "publish_many",
    "publish_many_async",
    "receive",
    "receive_async",
    "receive_many",
    "receive_many_async",
]


def _inbox(message: InboxMessage | None, fields: dict[str, Any], prefix: str = "") -> InboxMessage:
    if message is not None:
        if fields:
            raise TypeError("postbox: pass either a message or its fields, not both")
        return message
    try:
        return InboxMessage(**fields)
    except ValidationError as error:
        raise invalid_message_from(error, prefix) from None


def _outbox(message: OutboxMessage | None, fields: dict[str, Any], prefix: str = "") -> OutboxMessage:
    if message is not None:
        if fields:
            raise TypeError("postbox: pass either a message or its fields, not both")
        return message
    try:
        return OutboxMessage(**fields)
    except ValidationError as error:
        raise invalid_message_from(error, prefix) from None


def _inbox_items(messages: Iterable[InboxMessage | dict[str, Any]]) -> list[dict[str, Any]]:
    """Each message checked, as the batch function's fields (plain dicts skip pydantic when they
    are plainly valid; anything else goes through the model, which names the bad field)."""
    items = []
    for i, m in enumerate(messages):
        if isinstance(m, InboxMessage):
            items.append(m.batch_item())
            continue
        item = plain_inbox_item(m) if isinstance(m, dict) else None
        items.append(item if item is not None else _inbox(None, m, f"messages[{i}].").batch_item())
    return items


def _outbox_batch(messages: Iterable[OutboxMessage | dict[str, Any]]) -> list[OutboxMessage]:
    checked = []
    for i, m in enumerate(messages):
        checked.append(m if isinstance(m, OutboxMessage) else _outbox(None, m, f"messages[{i}]."))
    return checked


# The optional columns of a batch, with what an absent field stands for.
_OPTIONAL_COLUMNS = (
    ("keys", "key"),
    ("types", "type"),
    ("sequences", "sequence"),
    ("schema_versions", "schema_version"),
    ("correlation_ids", "correlation_id"),
    ("causation_ids", "causation_id"),
    ("sources", "source"),
)


def _inbox_call(items: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The query and bind parameters that receive ``items`` in one statement: column by column
    for a batch to one consumer (payloads and headers as one JSON array each), one array per field
    when it mixes consumers. A field no message has (absent or its default) travels as NULL."""
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
        return "inbox_receive_columns", columns | {
            "consumer": consumers[0],
            "payloads": to_json([m["payload"] for m in items]),
            "headers": None if headers is None else to_json(headers),
        }
    return "inbox_receive_arrays", columns | {
        "consumers": consumers,
        "payloads": [to_json(m["payload"]) for m in items],
        "headers": None if headers is None else [to_json(h) for h in headers],
    }


_STATUSES = {s.value: s for s in ReceiveStatus}
_new_result = object.__new__
_set_field = object.__setattr__


def _receive_result(row: Sequence[Any]) -> ReceiveResult:
    return ReceiveResult(status=_STATUSES[row[0]], inbox_id=row[1])


def _receive_results(rows: Iterable[Sequence[Any]]) -> list[ReceiveResult]:
    """One result per (ordinality, status, inbox_id) row: built field by field, since a batch
    builds one per message and the checked constructor costs twice as much."""
    results = []
    for _, status, inbox_id in rows:
        r = _new_result(ReceiveResult)
        _set_field(r, "status", _STATUSES[status])
        _set_field(r, "inbox_id", inbox_id)
        results.append(r)
    return results


# --- inbox -----------------------------------------------------------------------------------


def receive(conn: AnySyncConnection, message: InboxMessage | None = None, /, **fields: Any) -> ReceiveResult:
    """Receive one message into the inbox in ``conn``'s transaction.

    Pass an :class:`InboxMessage` or its fields as keywords (``consumer``, ``message_id``,
    ``payload``, ``key``, ``type``, ``sequence``, ``headers``, ...). Returns whether the message is
    new, a duplicate, or a conflict (same id, other payload: nothing written). Raises
    :class:`InvalidMessage` naming the field for bad input, before anything is written.
    """
    m = _inbox(message, fields)
    return _receive_result(first(run(conn, query("inbox_receive"), m.params())))


def receive_many(
    conn: AnySyncConnection, messages: Iterable[InboxMessage | dict[str, Any]]
) -> list[ReceiveResult]:
    """Receive several messages in one round trip; results are in the same order."""
    items = _inbox_items(messages)
    if not items:
        return []
    name, params = _inbox_call(items)
    return _receive_results(run(conn, query(name), params))


async def receive_async(
    conn: AnyAsyncConnection, message: InboxMessage | None = None, /, **fields: Any
) -> ReceiveResult:
    """:func:`receive` for psycopg ``AsyncConnection`` and SQLAlchemy async sessions/connections."""
    m = _inbox(message, fields)
    return _receive_result(first(await run_async(conn, query("inbox_receive"), m.params())))


async def receive_many_async(
    conn: AnyAsyncConnection, messages: Iterable[InboxMessage | dict[str, Any]]
) -> list[ReceiveResult]:
    """:func:`receive_many` for async connections."""
    items = _inbox_items(messages)
    if not items:
        return []
    name, params = _inbox_call(items)
    return _receive_results(await run_async(conn, query(name), params))


# --- outbox ----------------------------------------------------------------------------------


def publish(conn: AnySyncConnection, message: OutboxMessage | None = None, /, **fields: Any) -> int:
    """Write one outbox event in ``conn``'s transaction; returns its outbox id.

    Fields: ``destination``, ``payload``, ``key``, ``type``, ``message_id`` (default: a UUID),
    ``headers``, ``correlation_id``, ``causation_id``.
    """
    m = _outbox(message, fields)
    return int(first(run(conn, query("outbox_publish"), m.params()))[0])


def publish_many(conn: AnySyncConnection, messages: Iterable[OutboxMessage | dict[str, Any]]) -> list[int]:
    """Write several outbox events in one round trip; ids in the same order."""
    batch = _outbox_batch(messages)
    if not batch:
        return []
    rows = run(conn, query("outbox_publish_batch"), {"messages": to_json([m.batch_item() for m in batch])})
    return [int(r[1]) for r in rows]


async def publish_async(
    conn: AnyAsyncConnection, message: OutboxMessage | None = None, /, **fields: Any
) -> int:
    """:func:`publish` for async connections."""
    m = _outbox(message, fields)
    return int(first(await run_async(conn, query("outbox_publish"), m.params()))[0])


async def publish_many_async(
    conn: AnyAsyncConnection, messages: Iterable[OutboxMessage | dict[str, Any]]
) -> list[int]:
    """:func:`publish_many` for async connections."""
    batch = _outbox_batch(messages)
    if not batch:
        return []
    rows = await run_async(
        conn, query("outbox_publish_batch"), {"messages": to_json([m.batch_item() for m in batch])}
    )
    return [int(r[1]) for r in rows]


# --- consumers -------------------------------------------------------------------------------

SEQUENCE_MODES = ("arrival", "monotonic", "gapless")


def declare_consumer(
    conn: AnySyncConnection,
    name: str,
    *,
    sequence_mode: str = "arrival",
    first_sequence: int = 1,
    late_policy: str = "dead_letter",
    on_dead_letter: str = "block",
    gap_timeout_seconds: float | None = None,
) -> None:
    """Declare (or update) a consumer and its ordering policies, in ``conn``'s transaction.

    Once any consumer is declared, receiving for an undeclared one is refused.
    """
    if sequence_mode not in SEQUENCE_MODES:
        raise InvalidMessage("sequence_mode", f"must be one of {', '.join(SEQUENCE_MODES)}")
    run(
        conn,
        query("declare_consumer"),
        {
            "name": name,
            "sequence_mode": sequence_mode,
            "first_sequence": first_sequence,
            "late_policy": late_policy,
            "on_dead_letter": on_dead_letter,
            "gap_timeout": None if gap_timeout_seconds is None else f"{gap_timeout_seconds} seconds",
        },
    )

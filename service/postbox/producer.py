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

from postbox.db import AnyAsyncConnection, AnySyncConnection, query, run, run_async
from postbox.db.connector import first
from postbox.errors import InvalidMessage
from postbox.messages import (
    INBOX_DEFAULTS,
    InboxMessage,
    OutboxMessage,
    ReceiveResult,
    ReceiveStatus,
    invalid_message_from,
    plain_inbox_item,
    to_sql_json,
    utf8_size,
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


# --- size limits, before the round trip -------------------------------------------------------
# The size limits are PostgreSQL settings (postbox.max_payload_bytes, postbox.max_headers_bytes),
# which the database, the role or the session may set: only the server knows the values in force.
# A payload or headers text over CHECKED_ABOVE_BYTES is checked against them before it is sent,
# with one extra query (a read that cannot fail), so that the refusal leaves the caller's
# transaction usable; a smaller one (over a limit set lower than that) is refused by the server.
CHECKED_ABOVE_BYTES = 65_536

# (field as the caller named it, which limit: 0 payload / 1 headers, bytes of JSON text)
_Large = tuple[str, int, int]
_LIMIT_NAMES = ("postbox.max_payload_bytes", "postbox.max_headers_bytes")


def _large(field: str, which: int, text: str | None, found: list[_Large]) -> bool:
    """Add ``text`` to ``found`` if it is over CHECKED_ABOVE_BYTES; whether it was."""
    # A character is at most 4 bytes of UTF-8: most texts are told apart by their length alone.
    if text is None or len(text) <= CHECKED_ABOVE_BYTES // 4:
        return False
    size = utf8_size(text)
    if size <= CHECKED_ABOVE_BYTES:
        return False
    found.append((field, which, size))
    return True


def _large_params(params: dict[str, Any]) -> list[_Large]:
    found: list[_Large] = []
    _large("payload", 0, params["payload"], found)
    _large("headers", 1, params["headers"], found)
    return found


def _large_items(values: list[Any], field: str, which: int, found: list[_Large]) -> None:
    """The large ones among a batch's payloads (or headers), each measured alone."""
    for i, value in enumerate(values):
        _large(f"messages[{i}].{field}", which, to_sql_json(value), found)


def _refuse_over_limits(large: list[_Large], limits: Sequence[Any]) -> None:
    for field, which, size in large:
        limit = int(limits[which])
        if size > limit:
            raise InvalidMessage(field, f"is {size} bytes, over the limit of {limit} ({_LIMIT_NAMES[which]})")


def _check_limits(conn: AnySyncConnection, large: list[_Large]) -> None:
    if large:
        _refuse_over_limits(large, first(run(conn, query("input_limits"), {})))


async def _check_limits_async(conn: AnyAsyncConnection, large: list[_Large]) -> None:
    if large:
        _refuse_over_limits(large, first(await run_async(conn, query("input_limits"), {})))


def _inbox_large(items: list[dict[str, Any]], name: str, params: dict[str, Any]) -> list[_Large]:
    """The payloads and headers of a batch that must be checked against the server's limits.
    The columns form sends each as one JSON array: no element is longer than the array, so only
    a long array has its elements measured one by one."""
    found: list[_Large] = []
    if name == "inbox_receive_columns":
        if _large("payloads", 0, params["payloads"], []):
            _large_items([m["payload"] for m in items], "payload", 0, found)
        if _large("headers", 1, params["headers"], []):
            _large_items([m.get("headers") or {} for m in items], "headers", 1, found)
        return found
    for i, text in enumerate(params["payloads"]):
        _large(f"messages[{i}].payload", 0, text, found)
    for i, text in enumerate(params["headers"] or ()):
        _large(f"messages[{i}].headers", 1, text, found)
    return found


def _outbox_large(batch: list[OutboxMessage], text: str) -> list[_Large]:
    found: list[_Large] = []
    if _large("messages", 0, text, []):
        _large_items([m.payload for m in batch], "payload", 0, found)
        _large_items([m.headers for m in batch], "headers", 1, found)
    return found


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
            "payloads": to_sql_json([m["payload"] for m in items]),
            "headers": None if headers is None else to_sql_json(headers),
        }
    return "inbox_receive_arrays", columns | {
        "consumers": consumers,
        "payloads": [to_sql_json(m["payload"]) for m in items],
        "headers": None if headers is None else [to_sql_json(h) for h in headers],
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
    :class:`InvalidMessage` naming the field for bad input, before anything is written: before
    the round trip (the caller's transaction goes on), except what only the database knows (an
    undeclared consumer, a sequenced consumer without ``sequence``, a size limit set below
    ``CHECKED_ABOVE_BYTES``), which the server refuses, aborting the caller's transaction.
    """
    params = _inbox(message, fields).params()
    _check_limits(conn, _large_params(params))
    return _receive_result(first(run(conn, query("inbox_receive"), params)))


def receive_many(
    conn: AnySyncConnection, messages: Iterable[InboxMessage | dict[str, Any]]
) -> list[ReceiveResult]:
    """Receive several messages in one round trip; results are in the same order."""
    items = _inbox_items(messages)
    if not items:
        return []
    name, params = _inbox_call(items)
    _check_limits(conn, _inbox_large(items, name, params))
    return _receive_results(run(conn, query(name), params))


async def receive_async(
    conn: AnyAsyncConnection, message: InboxMessage | None = None, /, **fields: Any
) -> ReceiveResult:
    """:func:`receive` for psycopg ``AsyncConnection`` and SQLAlchemy async sessions/connections."""
    params = _inbox(message, fields).params()
    await _check_limits_async(conn, _large_params(params))
    return _receive_result(first(await run_async(conn, query("inbox_receive"), params)))


async def receive_many_async(
    conn: AnyAsyncConnection, messages: Iterable[InboxMessage | dict[str, Any]]
) -> list[ReceiveResult]:
    """:func:`receive_many` for async connections."""
    items = _inbox_items(messages)
    if not items:
        return []
    name, params = _inbox_call(items)
    await _check_limits_async(conn, _inbox_large(items, name, params))
    return _receive_results(await run_async(conn, query(name), params))


# --- outbox ----------------------------------------------------------------------------------


def publish(conn: AnySyncConnection, message: OutboxMessage | None = None, /, **fields: Any) -> int:
    """Write one outbox event in ``conn``'s transaction; returns its outbox id.

    Fields: ``destination``, ``payload``, ``key``, ``type``, ``message_id`` (default: a UUID),
    ``headers``, ``correlation_id``, ``causation_id``.
    """
    params = _outbox(message, fields).params()
    _check_limits(conn, _large_params(params))
    return int(first(run(conn, query("outbox_publish"), params))[0])


def publish_many(conn: AnySyncConnection, messages: Iterable[OutboxMessage | dict[str, Any]]) -> list[int]:
    """Write several outbox events in one round trip; ids in the same order."""
    batch = _outbox_batch(messages)
    if not batch:
        return []
    text = to_sql_json([m.batch_item() for m in batch])
    _check_limits(conn, _outbox_large(batch, text))
    rows = run(conn, query("outbox_publish_batch"), {"messages": text})
    return [int(r[1]) for r in rows]


async def publish_async(
    conn: AnyAsyncConnection, message: OutboxMessage | None = None, /, **fields: Any
) -> int:
    """:func:`publish` for async connections."""
    params = _outbox(message, fields).params()
    await _check_limits_async(conn, _large_params(params))
    return int(first(await run_async(conn, query("outbox_publish"), params))[0])


async def publish_many_async(
    conn: AnyAsyncConnection, messages: Iterable[OutboxMessage | dict[str, Any]]
) -> list[int]:
    """:func:`publish_many` for async connections."""
    batch = _outbox_batch(messages)
    if not batch:
        return []
    text = to_sql_json([m.batch_item() for m in batch])
    await _check_limits_async(conn, _outbox_large(batch, text))
    rows = await run_async(conn, query("outbox_publish_batch"), {"messages": text})
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

"""The server's size limits, checked before the round trip.

The size limits are PostgreSQL settings (postbox.max_payload_bytes, postbox.max_headers_bytes),
which the database, the role or the session may set: only the server knows the values in force.
A payload or headers text over CHECKED_ABOVE_BYTES is checked against them before it is sent, with
one extra query (a read that cannot fail), so that the refusal leaves the caller's transaction
usable; a smaller one (over a limit set lower than that) is refused by the server.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from postbox.db import AnyAsyncConnection, AnySyncConnection, query, run, run_async
from postbox.db.connector import Rows, first
from postbox.errors import InvalidMessage
from postbox.values import to_sql_json, utf8_size

__all__ = [
    "CHECKED_ABOVE_BYTES",
    "HEADERS",
    "PAYLOAD",
    "Large",
    "check_limits",
    "check_limits_async",
    "large",
    "large_items",
    "large_params",
    "run_checked",
    "run_checked_async",
]

CHECKED_ABOVE_BYTES = 65_536

# (field as the caller named it, which limit: 0 payload / 1 headers, bytes of JSON text)
Large = tuple[str, int, int]
PAYLOAD, HEADERS = 0, 1
_LIMIT_NAMES = ("postbox.max_payload_bytes", "postbox.max_headers_bytes")


def large(field: str, which: int, text: str | None, found: list[Large]) -> bool:
    """Add ``text`` to ``found`` if it is over CHECKED_ABOVE_BYTES; whether it was."""
    # A character is at most 4 bytes of UTF-8: most texts are told apart by their length alone.
    if text is None or len(text) <= CHECKED_ABOVE_BYTES // 4:
        return False
    size = utf8_size(text)
    if size <= CHECKED_ABOVE_BYTES:
        return False
    found.append((field, which, size))
    return True


def large_params(params: dict[str, Any]) -> list[Large]:
    """The large ones among one message's payload and headers (bind parameters, as JSON text)."""
    found: list[Large] = []
    large("payload", PAYLOAD, params["payload"], found)
    large("headers", HEADERS, params["headers"], found)
    return found


def single_params(items: list[dict[str, Any]]) -> tuple[dict[str, Any], list[Large]]:
    """A one-message call's bind parameters (its one batch item, payload and headers as JSON text)
    and what to check against the limits: receive and publish alike."""
    (item,) = items
    params = item | {"payload": to_sql_json(item["payload"]), "headers": to_sql_json(item["headers"])}
    return params, large_params(params)


def large_items(values: Iterable[Any], field: str, which: int, found: list[Large]) -> None:
    """The large ones among a batch's payloads (or headers), each measured alone."""
    for i, value in enumerate(values):
        large(f"messages[{i}].{field}", which, to_sql_json(value), found)


def _refuse_over_limits(found: list[Large], limits: Sequence[Any]) -> None:
    for field, which, size in found:
        limit = int(limits[which])
        if size > limit:
            raise InvalidMessage(field, f"is {size} bytes, over the limit of {limit} ({_LIMIT_NAMES[which]})")


def check_limits(conn: AnySyncConnection, found: list[Large]) -> None:
    """Refuse what ``found`` holds over the limits in force (one read, only if it holds anything)."""
    if found:
        _refuse_over_limits(found, first(run(conn, query("input_limits"), {})))


async def check_limits_async(conn: AnyAsyncConnection, found: list[Large]) -> None:
    """:func:`check_limits` for async connections."""
    if found:
        _refuse_over_limits(found, first(await run_async(conn, query("input_limits"), {})))


def run_checked(conn: AnySyncConnection, name: str, params: dict[str, Any], found: list[Large]) -> Rows:
    """The rows of named query ``name``, run once what ``found`` holds is within the limits."""
    check_limits(conn, found)
    return run(conn, query(name), params)


async def run_checked_async(
    conn: AnyAsyncConnection, name: str, params: dict[str, Any], found: list[Large]
) -> Rows:
    """:func:`run_checked` for async connections."""
    await check_limits_async(conn, found)
    return await run_async(conn, query(name), params)

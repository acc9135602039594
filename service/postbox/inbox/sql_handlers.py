"""Handlers that are PostgreSQL functions: ``schema.function(message jsonb, context jsonb)``.

The function runs in the worker's transaction, inside the message's savepoint, so its writes are
exactly-once like a Python handler's. It reports failures by raising:

- ``RAISE EXCEPTION '...' USING ERRCODE = 'PB001'``: transient (retried with backoff); add
  ``DETAIL = 'retry_after=30'`` to ask for a delay in seconds;
- ``ERRCODE = 'PB002'``: permanent (dead-lettered at once);
- ``ERRCODE = 'PB003'``: outcome unknown (retried only if the handler is declared idempotent);
- any other error is classified by its SQLSTATE like any database error (for example a unique
  violation is permanent, a serialization failure transient).

As a batch handler (``batch = true``), ``schema.function(messages jsonb, contexts jsonb)`` is called
once for the messages of a claimed batch: two JSON arrays, element ``i`` of each being what the
per-message function would get for message ``i``. If it raises, its writes are rolled back and
each message is run again alone (one-element arrays), so only the one that fails is retried or
dead-lettered, with its own error.
"""

from __future__ import annotations

import re
from typing import Any

import psycopg
from psycopg import sql

from postbox.errors import ConfigError
from postbox.failures.outcomes import Outcome, Permanent, Retry, Transient, UnknownOutcome
from postbox.inbox.handlers import BatchContext, BatchHandlerFunc, Context, HandlerFunc, Message
from postbox.messages import to_json

__all__ = [
    "PERMANENT",
    "TRANSIENT",
    "UNKNOWN",
    "message_context",
    "message_document",
    "sql_batch_function_handler",
    "sql_function_handler",
]

TRANSIENT, PERMANENT, UNKNOWN = "PB001", "PB002", "PB003"
_RETRY_AFTER = re.compile(r"retry_after\s*=\s*([0-9]+(?:\.[0-9]+)?)")


def message_document(message: Message) -> dict[str, Any]:
    """The message as the JSON document non-Python handlers receive."""
    return {
        "inbox_id": message.id,
        "consumer": message.consumer,
        "message_id": message.message_id,
        "key": message.key,
        "sequence": message.sequence,
        "type": message.type,
        "schema_version": message.schema_version,
        "payload": message.payload,
        "headers": message.headers,
        "correlation_id": message.correlation_id,
        "causation_id": message.causation_id,
        "source": message.source,
        "received_at": message.received_at.isoformat(),
    }


def _parse_name(function: str) -> sql.Composed:
    parts = function.split(".")
    if len(parts) not in (1, 2) or not all(0 < len(p.encode()) <= 63 for p in parts):
        raise ConfigError(f"handler function {function!r}: expected schema.function (each at most 63 bytes)")
    return sql.SQL(".").join(sql.Identifier(p) for p in parts)


def _outcome(error: psycopg.Error) -> Outcome | None:
    code = error.sqlstate
    if code not in (TRANSIENT, PERMANENT, UNKNOWN):
        return None
    text = (error.diag.message_primary or code).strip()
    if code == PERMANENT:
        return Permanent(text)
    if code == UNKNOWN:
        return UnknownOutcome(text)
    match = _RETRY_AFTER.search(error.diag.message_detail or "")
    return Retry(after=float(match.group(1)), reason=text) if match else Transient(text)


def message_context(message: Message, idempotency_key: str) -> dict[str, Any]:
    """What a SQL-function handler gets as the context of ``message``'s attempt."""
    return {"attempt": message.attempt, "idempotency_key": idempotency_key,
            "first_failed_at": message.first_failed_at.isoformat() if message.first_failed_at else None,
            "last_error": message.last_error}  # fmt: skip


def _call(conn: psycopg.Connection[Any], statement: sql.Composed, messages: Any, contexts: Any) -> None:
    """Run the function; its PB00x errors become the outcomes they stand for."""
    try:
        conn.execute(statement, (to_json(messages), to_json(contexts)))
    except psycopg.Error as error:
        outcome = _outcome(error)
        if outcome is None:
            raise
        raise outcome from error


def _statement(function: str) -> sql.Composed:
    return sql.SQL("SELECT {}(%s::jsonb, %s::jsonb)").format(_parse_name(function))


def sql_function_handler(function: str) -> HandlerFunc:
    """A handler that calls ``function(message jsonb, context jsonb)`` in the message's transaction."""
    statement = _statement(function)

    def handle(message: Message, ctx: Context) -> None:
        _call(ctx.conn, statement, message_document(message), message_context(message, ctx.idempotency_key))

    handle.__name__ = handle.__qualname__ = f"sql:{function}"
    return handle


def sql_batch_function_handler(function: str) -> BatchHandlerFunc:
    """A batch handler that calls ``function(messages jsonb, contexts jsonb)`` once for a call's
    messages (two arrays, an element per message, in the call's order)."""
    statement = _statement(function)

    def handle(messages: list[Message], ctx: BatchContext) -> None:
        _call(
            ctx.conn,
            statement,
            [message_document(m) for m in messages],
            [message_context(m, ctx.idempotency_key(m)) for m in messages],
        )

    handle.__name__ = handle.__qualname__ = f"sql-batch:{function}"
    return handle


def check_function_exists(conn: psycopg.Connection[Any], function: str) -> None:
    """Refuse to start with a handler function that does not exist with the expected signature."""
    name = _parse_name(function).as_string(conn)
    row = conn.execute("SELECT to_regprocedure(%s)", (f"{name}(jsonb, jsonb)",)).fetchone()
    if row is None or row[0] is None:
        raise ConfigError(f"handler function {function}(message jsonb, context jsonb) does not exist")

"""Run a named query on whatever connection the caller holds, inside the caller's transaction.

Supported: psycopg ``Connection`` / ``AsyncConnection``, SQLAlchemy ``Session`` / ``AsyncSession``
and ``Connection`` / ``AsyncConnection`` (any PostgreSQL driver). Postbox never opens, commits or
rolls back the caller's transaction here. Database errors that report bad input (SQLSTATE 22PB1
with a column) become :class:`postbox.errors.InvalidMessage`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import Any

import psycopg
from psycopg.rows import dict_row, tuple_row
from sqlalchemy import text
from sqlalchemy.engine import Connection as SAConnection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from postbox.db.queries import Query
from postbox.errors import InvalidMessage, InvalidRequest

__all__ = [
    "AnyAsyncConnection",
    "AnySyncConnection",
    "int_array",
    "run",
    "run_async",
    "run_dicts",
    "send_raw",
    "text_array",
]

AnySyncConnection = psycopg.Connection[Any] | Session | SAConnection
AnyAsyncConnection = psycopg.AsyncConnection[Any] | AsyncSession | SAAsyncConnection

Rows = list[tuple[Any, ...]]


def _diag(error: BaseException) -> tuple[str | None, str | None, str]:
    """(sqlstate, column, message) of a database error from psycopg, psycopg2 or SQLAlchemy."""
    orig: Any = error.orig if isinstance(error, DBAPIError) else error
    diag = getattr(orig, "diag", None)
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    column = getattr(diag, "column_name", None) if diag is not None else None
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    if diag is None:  # asyncpg through SQLAlchemy: the driver's own error has the fields
        driver = getattr(orig, "driver_exception", None) or orig.__cause__
        column = getattr(driver, "column_name", None)
        primary = getattr(driver, "message", None)
    return sqlstate, column, primary or str(orig)


@contextmanager
def _translated(error_class: type[InvalidRequest] = InvalidMessage) -> Iterator[None]:
    try:
        yield
    except (psycopg.Error, DBAPIError) as error:
        sqlstate, column, message = _diag(error)
        if sqlstate == "22PB1" and column:
            problem = message.removeprefix("postbox: ").removeprefix(column).strip()
            raise error_class(column, problem) from error
        raise


def run(conn: AnySyncConnection, q: Query, params: dict[str, Any]) -> Rows:
    """Execute ``q`` (a query that returns rows) with ``params`` on ``conn``; all its rows."""
    with _translated():
        if isinstance(conn, psycopg.Connection):
            if conn.row_factory is tuple_row:
                cur = conn.execute(q.psycopg, params)
            else:  # rows as tuples, whatever the caller's connection makes of its own
                cur = conn.cursor(row_factory=tuple_row).execute(q.psycopg, params)
            if cur.pgresult is None and conn.info.pipeline_status is not _PIPELINE_OFF:
                return cur.fetchall()  # in the caller's pipeline: the results come with a sync
            # The result's status, not cur.description (which builds a Column per column each call).
            return cur.fetchall() if _has_rows(cur.pgresult) else []
        if isinstance(conn, Session | SAConnection):
            result = conn.execute(text(q.text), params)
            return [tuple(r) for r in result.all()]
    raise TypeError(f"postbox: unsupported connection type {type(conn).__name__}")


_TUPLES_OK = psycopg.pq.ExecStatus.TUPLES_OK
_PIPELINE_OFF = psycopg.pq.PipelineStatus.OFF


def int_array(values: Sequence[int | None]) -> str:
    """``values`` as a PostgreSQL array literal (``{1,2,3}``, None as ``NULL``), for a parameter
    cast to an integer array: psycopg adapts a list element by element in Python, which costs a
    batch's completion more than its round trip."""
    if None in values:
        return "{" + ",".join("NULL" if v is None else str(v) for v in values) + "}"
    return "{" + ",".join(map(str, values)) + "}"


def text_array(values: Sequence[str | None]) -> str:
    """``values`` as a PostgreSQL array literal, each element quoted (``{"a","b"}``, None as
    ``NULL``), for a parameter cast to ``text[]`` (or ``jsonb[]``, from JSON texts). psycopg adapts a
    list element by element in Python: about 0.4 ms for a batch's 500 message ids (one-off
    timings). The texts must hold no NUL (no PostgreSQL text can)."""
    if not values:
        return "{}"
    if None in values:
        return "{" + ",".join("NULL" if v is None else f'"{_array_escaped(v)}"' for v in values) + "}"
    whole = "".join(values)  # type: ignore[arg-type]  # no None, checked above
    if '"' in whole or "\\" in whole:  # quoted, only these two need a backslash
        return '{"' + '","'.join(map(_array_escaped, values)) + '"}'  # type: ignore[arg-type]
    return '{"' + '","'.join(values) + '"}'  # type: ignore[arg-type]


def _array_escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _has_rows(result: psycopg.pq.abc.PGresult | None) -> bool:
    return result is not None and result.status == _TUPLES_OK


async def run_async(conn: AnyAsyncConnection, q: Query, params: dict[str, Any]) -> Rows:
    """Async twin of :func:`run`: the same query text, awaited."""
    with _translated():
        if isinstance(conn, psycopg.AsyncConnection):
            if conn.row_factory is tuple_row:
                acur = await conn.execute(q.psycopg, params)
            else:
                acur = await conn.cursor(row_factory=tuple_row).execute(q.psycopg, params)
            if acur.pgresult is None and conn.info.pipeline_status is not _PIPELINE_OFF:
                return await acur.fetchall()
            return await acur.fetchall() if _has_rows(acur.pgresult) else []
        if isinstance(conn, AsyncSession | SAAsyncConnection):
            result = await conn.execute(text(q.text), params)
            return [tuple(r) for r in result.all()]
    raise TypeError(f"postbox: unsupported connection type {type(conn).__name__}")


def run_dicts(conn: psycopg.Connection[Any], q: Query, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Execute ``q`` on a psycopg connection; its rows as dicts. Bad input raises InvalidRequest."""
    with _translated(InvalidRequest):
        cur = conn.cursor(row_factory=dict_row)
        cur.execute(q.psycopg, params)
        return cur.fetchall() if cur.description else []


def first(rows: Sequence[tuple[Any, ...]]) -> tuple[Any, ...]:
    if not rows:
        raise RuntimeError("postbox: the query returned no row")
    return rows[0]


@cache
def _encoded(q: Query) -> bytes:
    return q.text.encode()


def send_raw(conn: psycopg.Connection[Any], q: Query) -> psycopg.pq.abc.PGresult:
    """Send ``q`` (a query without parameters) straight through libpq (``Connection.pgconn``),
    bypassing psycopg's cursors: for the commands run around every handler (savepoints), where the
    cursor machinery costs more than the command. The caller reads the result (status, errors):
    nothing is raised or translated here, and the transaction is never begun (psycopg's
    transaction state is the server's, read from the connection)."""
    return conn.pgconn.exec_(_encoded(q))

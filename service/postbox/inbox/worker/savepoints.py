"""The savepoint around every handler, in the batch's transaction.

The batch's transaction and first savepoint begin in one command; the other savepoints, and their
release or rollback, are named queries sent straight through libpq
(:func:`postbox.db.connector.send_raw`): they run around every handler, and psycopg's cursor
machinery costs more than the command itself. A transaction found gone means the last handler
ended it (``COMMIT``/``ROLLBACK`` as SQL): :class:`TransactionEnded` names it.
"""

from __future__ import annotations

from typing import Any

import psycopg

from postbox.db import query
from postbox.db.connector import send_raw
from postbox.inbox.handlers import Message
from postbox.inbox.worker.batch import Batch
from postbox.inbox.worker.settings import TransactionEnded

__all__ = ["begin", "next_savepoint", "roll_back"]

# SQLSTATEs of a savepoint command that finds the batch's transaction gone: the handler ended it.
_ENDED = {"3B001", "25P01"}


def begin(conn: psycopg.Connection[Any], batch: Batch) -> None:
    """Begin the batch's transaction and its first savepoint, in one round trip (psycopg would
    send its ``BEGIN`` on its own first), and note the transaction's id in ``batch.xid``: if a
    handler ends the transaction, the id tells whether what ran before it was committed or rolled
    back. psycopg reads the transaction's state from the server's connection, so it sees the
    transaction as open, as if it had begun it."""
    result = send_raw(conn, query("worker_savepoint"))
    _checked(conn, result)
    value = result.get_value(0, 0) if result.ntuples else None
    batch.xid = value.decode() if value is not None else None


def next_savepoint(conn: psycopg.Connection[Any], batch: Batch) -> None:
    """The next message's savepoint, in the batch's open transaction (one round trip)."""
    assert batch.last_run is not None
    _command(conn, "worker_savepoint_next", batch.last_run)


def roll_back(conn: psycopg.Connection[Any], culprit: Message) -> None:
    """Undo the failed handler's effects (back to its savepoint)."""
    _command(conn, "worker_savepoint_rollback", culprit)


def _command(conn: psycopg.Connection[Any], name: str, culprit: Message) -> None:
    """Send the named command. A transaction found gone raises ``TransactionEnded``; any other
    failure is raised as psycopg would raise it."""
    if conn.info.transaction_status is psycopg.pq.TransactionStatus.IDLE:
        raise TransactionEnded(culprit)
    _checked(conn, send_raw(conn, query(name)), culprit)


def _checked(
    conn: psycopg.Connection[Any], result: psycopg.pq.abc.PGresult, culprit: Message | None = None
) -> None:
    """Raise what a failed savepoint command means: a lost connection, ``TransactionEnded`` for a
    transaction found gone (when there is a ``culprit``), else the error as psycopg would raise it."""
    if result.status in (psycopg.pq.ExecStatus.COMMAND_OK, psycopg.pq.ExecStatus.TUPLES_OK):
        return
    if conn.pgconn.status != psycopg.pq.ConnStatus.OK:
        raise psycopg.OperationalError(conn.pgconn.error_message.decode(errors="replace"))
    sqlstate = result.error_field(psycopg.pq.DiagnosticField.SQLSTATE)
    code = sqlstate.decode() if sqlstate else ""
    if culprit is not None and code in _ENDED:
        raise TransactionEnded(culprit)
    message = (result.error_message or b"savepoint failed").decode(errors="replace")
    raise psycopg.errors.lookup(code)(message) if code else psycopg.DatabaseError(message)

"""The worker slot's connection, as handlers see it through ``ctx.conn``.

The worker owns the batch's transaction: every message runs in a savepoint of it, and its effects
commit with its done mark. While a handler runs, the calls that would end or change that
transaction (``commit``, ``rollback``, ``close``, the ``autocommit``/``isolation_level``/
``read_only``/``deferrable`` setters, two-phase commit) are refused before anything reaches the
server: the handler gets :class:`HandlerEndedTransaction`, its attempt is dead-lettered, and the
other messages of the batch are untouched. Once a handler has run past its time limit and been
abandoned, every operation on the connection is refused (its transaction is gone).

Ending the transaction with SQL (``ctx.conn.execute("COMMIT")``) cannot be refused beforehand;
it is noted as it happens: a statement that finds the worker's transaction gone (the server
session idle) is the handler's, since the worker's transaction is open whenever a handler runs.
The worker then settles the handler as one that ended the transaction, even if that statement
began another (see ``postbox.inbox.worker``).

An ``async def`` handler gets :class:`AsyncHandlerConnection`, a ``psycopg.AsyncConnection`` over
the same server session (the same libpq connection) as the slot's: the same transaction and
savepoint, with the same refusals.
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from typing import Any, TypeVar

import psycopg
from psycopg.abc import PQGen

from postbox.failures.outcomes import Permanent

__all__ = ["AsyncHandlerConnection", "HandlerConnection", "HandlerEndedTransaction"]

RV = TypeVar("RV")
_IDLE = psycopg.pq.TransactionStatus.IDLE


class HandlerEndedTransaction(Permanent):
    """A handler committed, rolled back, closed or reconfigured the worker's transaction.

    A bug in the handler: retrying would repeat it, so the message is dead-lettered at once with
    reason ``handler_ended_transaction``. Handlers leave the transaction to the worker; use
    ``with ctx.conn.transaction():`` (a savepoint) for a part that may fail on its own.
    """


class _Guard:
    """The refusals shared by the sync and async handler connections."""

    _postbox_guarded: bool = False
    _postbox_misuse: str | None = None
    _postbox_fence: str | None = None
    _postbox_ended: bool = False
    _postbox_owner: int | None = None
    pgconn: psycopg.pq.abc.PGconn

    def owned_by(self, thread: int) -> None:
        """While no handler runs, only ``thread`` (the slot's) may use the connection: a handler's
        ``ctx`` kept and used later, from another thread, would write into the next batch."""
        self._postbox_owner = thread

    def _check_thread(self, gen: PQGen[Any] | None = None) -> None:
        if self._postbox_guarded or self._postbox_owner in (None, threading.get_ident()):
            return
        if isinstance(gen, Generator):
            gen.close()
        raise psycopg.ProgrammingError(
            "postbox: ctx.conn was used after its handler returned (from another thread): a handler's "
            "context is valid only while the handler runs, so nothing was sent. Finish the handler's "
            "work (join its threads, await its tasks) before it returns"
        )

    def guard(self, on: bool) -> None:
        """Refuse (on) or allow (off) the calls that end or change the transaction."""
        self._postbox_guarded = on
        if on:
            self._postbox_misuse = None
            self._postbox_ended = False

    @property
    def ended(self) -> bool:
        """Whether the running handler sent a statement after the worker's transaction had ended
        (its own ``COMMIT`` or ``ROLLBACK`` as SQL): that statement ran outside it."""
        return self._postbox_ended

    @property
    def misuse(self) -> str | None:
        """Why the running handler's last attempt to end or change the transaction was refused, if it made one."""
        return self._postbox_misuse

    def fence(self, reason: str) -> None:
        """From now on refuse every operation (the handler was abandoned; its transaction is gone)."""
        self._postbox_fence = reason

    def _refuse(self, what: str) -> None:
        if self._postbox_fence is not None:
            raise psycopg.OperationalError(self._postbox_fence)
        if self._postbox_guarded:
            self._postbox_misuse = (
                f"the handler called ctx.conn.{what}: handlers must leave the transaction to the worker (a "
                "message's effects commit with its done mark), never commit, roll back, close or reconfigure "
                "it. Raise an exception to fail the attempt, or use `with ctx.conn.transaction():` for a "
                "savepoint"
            )
            raise HandlerEndedTransaction(self._postbox_misuse)

    def _fenced(self, gen: PQGen[Any]) -> None:
        self._check_thread(gen)
        if self._postbox_fence is not None:
            if isinstance(gen, Generator):
                gen.close()
            raise psycopg.OperationalError(self._postbox_fence)
        if self._postbox_guarded and self.pgconn.transaction_status == _IDLE:
            # The worker's transaction is open whenever a handler runs: the session is idle only
            # if the handler ended it, and what it sends now (psycopg begins another transaction
            # first) runs outside it.
            self._postbox_ended = True


class HandlerConnection(_Guard, psycopg.Connection[Any]):
    """A psycopg connection whose transaction a running handler cannot end."""

    def wait(self, gen: PQGen[RV], interval: float = 0.1, timeout: float | None = None) -> RV:
        self._fenced(gen)
        return super().wait(gen, interval, timeout)

    def commit(self) -> None:
        self._refuse("commit()")
        super().commit()

    def rollback(self) -> None:
        self._refuse("rollback()")
        super().rollback()

    def close(self) -> None:
        self._check_thread()
        if self._postbox_guarded and self._postbox_fence is None:
            self._refuse("close()")
        super().close()

    def set_autocommit(self, value: bool) -> None:
        self._refuse("autocommit")
        super().set_autocommit(value)

    def set_isolation_level(self, value: psycopg.IsolationLevel | None) -> None:
        self._refuse("isolation_level")
        super().set_isolation_level(value)

    def set_read_only(self, value: bool | None) -> None:
        self._refuse("read_only")
        super().set_read_only(value)

    def set_deferrable(self, value: bool | None) -> None:
        self._refuse("deferrable")
        super().set_deferrable(value)

    def tpc_begin(self, xid: psycopg.Xid | str) -> None:
        self._refuse("tpc_begin()")
        super().tpc_begin(xid)

    def tpc_prepare(self) -> None:
        self._refuse("tpc_prepare()")
        super().tpc_prepare()

    def tpc_commit(self, xid: psycopg.Xid | str | None = None) -> None:
        self._refuse("tpc_commit()")
        super().tpc_commit(xid)

    def tpc_rollback(self, xid: psycopg.Xid | str | None = None) -> None:
        self._refuse("tpc_rollback()")
        super().tpc_rollback(xid)


class AsyncHandlerConnection(_Guard, psycopg.AsyncConnection[Any]):
    """An async psycopg connection over a slot's libpq connection, for ``async def`` handlers.

    It shares the server session (so the transaction and savepoint) with the slot's
    :class:`HandlerConnection`; it never prepares statements (their names would collide with the
    sync connection's) and never closes the shared connection (the slot does)."""

    @classmethod
    def over(cls, conn: HandlerConnection) -> AsyncHandlerConnection:
        shared = cls(conn.pgconn)
        shared.prepare_threshold = None
        return shared

    async def wait(self, gen: PQGen[RV], interval: float = 0.1, timeout: float | None = None) -> RV:
        self._fenced(gen)
        return await super().wait(gen, interval, timeout)

    async def commit(self) -> None:
        self._refuse("commit()")
        await super().commit()

    async def rollback(self) -> None:
        self._refuse("rollback()")
        await super().rollback()

    async def close(self) -> None:
        if self._postbox_guarded and self._postbox_fence is None:
            self._refuse("close()")
        # Otherwise nothing: the shared libpq connection is the slot's to close.

    async def set_autocommit(self, value: bool) -> None:
        self._refuse("autocommit")
        await super().set_autocommit(value)

    async def set_isolation_level(self, value: psycopg.IsolationLevel | None) -> None:
        self._refuse("isolation_level")
        await super().set_isolation_level(value)

    async def set_read_only(self, value: bool | None) -> None:
        self._refuse("read_only")
        await super().set_read_only(value)

    async def set_deferrable(self, value: bool | None) -> None:
        self._refuse("deferrable")
        await super().set_deferrable(value)

    async def tpc_begin(self, xid: psycopg.Xid | str) -> None:
        self._refuse("tpc_begin()")
        await super().tpc_begin(xid)

    async def tpc_prepare(self) -> None:
        self._refuse("tpc_prepare()")
        await super().tpc_prepare()

    async def tpc_commit(self, xid: psycopg.Xid | str | None = None) -> None:
        self._refuse("tpc_commit()")
        await super().tpc_commit(xid)

    async def tpc_rollback(self, xid: psycopg.Xid | str | None = None) -> None:
        self._refuse("tpc_rollback()")
        await super().tpc_rollback(xid)

"""The worker slot's connection, as handlers see it through ``ctx.conn``.

The worker owns the batch's transaction: every message runs in a savepoint of it, and its effects
commit with its done mark. While a handler runs, the calls that would end or change that
transaction (``commit``, ``rollback``, ``close``, the ``autocommit``/``isolation_level``/
``read_only``/``deferrable`` setters, two-phase commit) are refused before anything reaches the
server: the handler gets :class:`HandlerEndedTransaction`, its attempt is dead-lettered, and the
other messages of the batch are untouched. Once a handler has run past its time limit and been
abandoned, every operation on the connection is refused (its transaction is gone).

Ending the transaction with SQL (``ctx.conn.execute("COMMIT")``) cannot be refused beforehand;
the worker detects it right after the handler returns (see ``postbox.inbox.worker``).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, TypeVar

import psycopg
from psycopg.abc import PQGen

from postbox.failures.outcomes import Permanent

__all__ = ["HandlerConnection", "HandlerEndedTransaction"]

RV = TypeVar("RV")


class HandlerEndedTransaction(Permanent):
    """A handler committed, rolled back, closed or reconfigured the worker's transaction.

    A bug in the handler: retrying would repeat it, so the message is dead-lettered at once with
    reason ``handler_ended_transaction``. Handlers leave the transaction to the worker; use
    ``with ctx.conn.transaction():`` (a savepoint) for a part that may fail on its own.
    """


class HandlerConnection(psycopg.Connection[Any]):
    """A psycopg connection whose transaction a running handler cannot end."""

    _postbox_guarded: bool = False
    _postbox_misuse: str | None = None
    _postbox_fence: str | None = None

    # --- set by the worker ---------------------------------------------------------------------

    def guard(self, on: bool) -> None:
        """Refuse (on) or allow (off) the calls that end or change the transaction."""
        self._postbox_guarded = on
        if on:
            self._postbox_misuse = None

    @property
    def misuse(self) -> str | None:
        """Why the running handler's last attempt to end or change the transaction was refused, if it made one."""
        return self._postbox_misuse

    def fence(self, reason: str) -> None:
        """From now on refuse every operation (the handler was abandoned; its transaction is gone)."""
        self._postbox_fence = reason

    # --- psycopg ------------------------------------------------------------------------------

    def wait(self, gen: PQGen[RV], interval: float = 0.1, timeout: float | None = None) -> RV:
        if self._postbox_fence is not None:
            if isinstance(gen, Generator):
                gen.close()
            raise psycopg.OperationalError(self._postbox_fence)
        return super().wait(gen, interval, timeout)

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

    def commit(self) -> None:
        self._refuse("commit()")
        super().commit()

    def rollback(self) -> None:
        self._refuse("rollback()")
        super().rollback()

    def close(self) -> None:
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

"""A slot's state and its connection: one psycopg connection (with SQLAlchemy over it, and for
async handlers an async psycopg connection and an async SQLAlchemy engine over the same server
session), and how the batch's transaction ends (commit or roll back, SQLAlchemy included)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.types.json import set_json_loads
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection as SAConnection
from sqlalchemy.engine import Engine, RootTransaction
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, AsyncTransaction, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool

from postbox.inbox.connection import AsyncHandlerConnection, HandlerConnection
from postbox.inbox.handlers import Message
from postbox.inbox.worker.batch import Batch, Inheritance
from postbox.inbox.worker.settings import Abandoned, SlotStop
from postbox.values import from_json

if TYPE_CHECKING:
    from postbox.inbox.worker.worker import Worker

__all__ = ["JoinedAsyncSession", "JoinedSession", "SlotBase", "is_async"]

log = logging.getLogger("postbox.worker")


def is_async(func: Any) -> bool:
    """Whether a handler is run as async, with an async context: an ``async def`` (or a partial of
    one), or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


class JoinedSession(Session):
    """``ctx.session``: a Session joined to the message's transaction, in a savepoint of its own.
    Closed by the handler (``with ctx.session as s:`` closes it too), it keeps its work, as the end
    of the handler does: a Session's own close rolls its savepoint back, and the message would be
    marked done without its effects. The worker discards one with ``Session.close``."""

    def close(self) -> None:
        if self.in_transaction():
            self.commit()  # a savepoint released: the work joins the message's transaction
        super().close()


class JoinedAsyncSession(AsyncSession):
    """:class:`JoinedSession` for an async handler's ``ctx.session``."""

    async def close(self) -> None:
        if self.in_transaction():
            await self.commit()
        await super().close()


class SlotBase:
    """What every part of a slot (claiming, running handlers, completing) shares."""

    def __init__(self, worker: Worker, index: int, inheritance: Inheritance | None = None) -> None:
        self.worker = worker
        self.index = index
        self.settings = worker.settings
        self.conn: HandlerConnection | None = None
        self.aconn: AsyncHandlerConnection | None = None
        self.thread: threading.Thread | None = None
        self.started = False
        self.busy = False
        self.abandoned = False
        self.died: BaseException | None = None
        self.batch: Batch | None = None
        self._inheritance = inheritance
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._timeout = 0.0
        self._timed_out = False
        self._backend_pid: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: Engine | None = None
        self._async_engine: AsyncEngine | None = None
        self._sa: tuple[SAConnection, RootTransaction] | None = None
        self._asa: tuple[SAAsyncConnection, AsyncTransaction] | None = None
        self._durations: dict[int, float] = {}
        # Claims still to make one message at a time, after a batch that could not be completed
        # (Slot._process): each then answers for itself.
        self._solo = 0
        # This consumer's handlers that run as async, decided once (ids: a spec holds its function).
        self._async_funcs = frozenset(
            id(spec.func)
            for (consumer, _), spec in worker.registry.handlers.items()
            if consumer == worker.settings.consumer and is_async(spec.func)
        )
        self._has_async = bool(self._async_funcs)

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and not self.abandoned

    # --- provided by the slot's parts (the claim loop, the executor, the completer) ---------

    def _process(self, messages: list[Message]) -> None:
        raise NotImplementedError

    def _settle_inheritance(self) -> None:
        raise NotImplementedError

    def _check_abandoned(self) -> None:
        if self.abandoned:
            raise Abandoned

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop

    # --- connecting ------------------------------------------------------------------------

    def _connect(self, *, for_handlers: bool = True) -> HandlerConnection:
        """A connection for this slot (retried with backoff until the worker stops); with what
        handlers use over it (SQLAlchemy engines, the async connection) unless ``for_handlers``
        is false (a slot that only settles an abandoned batch)."""
        backoff = 0.05
        while True:
            conn: HandlerConnection | None = None
            try:
                conn = HandlerConnection.connect(
                    self.worker.url,
                    autocommit=False,
                    application_name=f"postbox-worker:{self.settings.consumer}",
                    options=f"-c idle_in_transaction_session_timeout={int(self.settings.lease_seconds * 1000)}",
                )
                self._backend_pid = conn.info.backend_pid
                conn.owned_by(threading.get_ident())
                set_json_loads(from_json, conn)  # json.loads's results, faster (every claim parses)
                if for_handlers:
                    self._engine = self._sqlalchemy_engine(conn)
                if for_handlers and self._has_async:
                    self._connect_async(conn)
                return conn
            except (psycopg.OperationalError, DBAPIError) as error:
                # SQLAlchemy's first connect (engines over the new connection) runs queries too: a
                # connection lost there is the same lost connection.
                if isinstance(error, DBAPIError) and not isinstance(error.orig, psycopg.OperationalError):
                    raise
                if conn is not None:
                    conn.close()
                if self.worker.stopping:
                    raise SlotStop from error
                log.warning("slot %s cannot connect: %s", self.index, error)
                time.sleep(backoff + self.worker.rng.uniform(0, backoff))
                backoff = min(backoff * 2, 5.0)

    def _reconnect(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self._sa = None
        self._asa = None
        self.conn = self._connect()

    @staticmethod
    def _sqlalchemy_engine(conn: HandlerConnection) -> Engine:
        """An engine over this one connection, initialised now: SQLAlchemy's first connect ends
        with a rollback, which must never happen inside a batch."""
        engine = create_engine(
            "postgresql+psycopg://",
            creator=lambda: conn,
            poolclass=StaticPool,
            pool_reset_on_return=None,
        )
        with engine.connect():
            pass
        return engine

    def _connect_async(self, conn: HandlerConnection) -> None:
        """For async handlers: an async connection over the same server session, and an async
        engine over it, initialised now (outside any batch, like the sync one)."""
        aconn = AsyncHandlerConnection.over(conn)
        aconn.owned_by(threading.get_ident())

        async def creator() -> AsyncHandlerConnection:
            return aconn

        engine = create_async_engine(
            "postgresql+psycopg://", async_creator=creator, poolclass=StaticPool, pool_reset_on_return=None
        )

        async def initialise() -> None:
            async with engine.connect():
                pass

        self._event_loop().run_until_complete(initialise())
        self.aconn = aconn
        self._async_engine = engine

    # --- sessions joined to the batch's transaction ------------------------------------------

    def _session_factory(self) -> Session:
        """A SQLAlchemy Session joined to this slot's open transaction (savepoints for its commits)."""
        assert self._engine is not None
        if self._sa is None:
            sa_conn = self._engine.connect()
            self._sa = (sa_conn, sa_conn.begin())
        return JoinedSession(bind=self._sa[0], join_transaction_mode="create_savepoint")

    async def _async_session_factory(self) -> AsyncSession:
        """An AsyncSession joined to this slot's open transaction (savepoints for its commits)."""
        assert self._async_engine is not None
        if self._asa is None:
            sa_conn = await self._async_engine.connect()
            self._asa = (sa_conn, await sa_conn.begin())
        return JoinedAsyncSession(bind=self._asa[0], join_transaction_mode="create_savepoint")

    # --- ending the batch's transaction ------------------------------------------------------

    def _commit(self) -> None:
        assert self.conn is not None
        if self._asa is not None:
            asa_conn, atx = self._asa
            self._asa = None
            loop = self._event_loop()
            loop.run_until_complete(atx.commit())
            loop.run_until_complete(asa_conn.close())
        if self._sa is not None:
            sa_conn, tx = self._sa
            self._sa = None
            tx.commit()
            sa_conn.close()
        else:
            self.conn.commit()

    def _rollback(self) -> None:
        assert self.conn is not None
        if self._asa is not None:
            asa_conn, atx = self._asa
            self._asa = None
            try:
                loop = self._event_loop()
                loop.run_until_complete(atx.rollback())
                loop.run_until_complete(asa_conn.close())
            except Exception:
                log.debug("SQLAlchemy async rollback failed", exc_info=True)
        if self._sa is not None:
            sa_conn, tx = self._sa
            self._sa = None
            try:
                tx.rollback()
                sa_conn.close()
            except Exception:
                log.debug("SQLAlchemy rollback failed", exc_info=True)
        if not self.conn.closed:
            self.conn.rollback()

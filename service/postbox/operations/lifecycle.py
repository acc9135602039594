"""What a worker and a relay share: connecting with backoff, claiming in a transaction of its own,
their helper threads (heartbeat, LISTEN), and running them embedded in another program.

:class:`Embeddable` gives both the same lifecycle: ``start()`` returns at once (the work runs in
threads), ``stop()`` asks them to finish, ``join(grace)`` waits; ``run()`` is the three for a
process of its own. Embedded, they are a context manager (``with worker: ...``) or, in asyncio,
``async with worker.running(): ...`` / ``await worker.start_async()`` and
``await worker.stop_async()``, which never block the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Self, TypeVar

import psycopg

from postbox.db.connector import Rows, run
from postbox.db.queries import Query
from postbox.operations.runtime import Presence, Wakeup

__all__ = ["Embeddable", "claim", "connect_with_backoff", "helper_threads"]

log = logging.getLogger("postbox.runtime")

C = TypeVar("C")


def connect_with_backoff(
    connect: Callable[[], C], *, stopping: Callable[[], bool], rng: random.Random, what: str
) -> C:
    """``connect()`` until it succeeds, with jittered exponential backoff (up to 5 s); once
    ``stopping()`` the connection error is raised instead of retried."""
    backoff = 0.05
    while True:
        try:
            return connect()
        except psycopg.OperationalError as error:
            if stopping():
                raise
            log.warning("%s cannot connect: %s", what, error)
            time.sleep(backoff + rng.uniform(0, backoff))
            backoff = min(backoff * 2, 5.0)


def claim(conn: psycopg.Connection[Any], q: Query, params: dict[str, Any]) -> Rows:
    """Run a claim query as a transaction of its own: one statement in autocommit, one round trip."""
    conn.autocommit = True
    try:
        return run(conn, q, params)
    finally:
        if not conn.closed:
            conn.autocommit = False


def helper_threads(presence: Presence, wakeup: Wakeup, *, listen: bool) -> list[threading.Thread]:
    """The heartbeat thread, and the LISTEN thread if ``listen`` (not started)."""
    threads = [threading.Thread(target=presence.beat_forever, name="postbox-heartbeat", daemon=True)]
    if listen:
        threads.append(threading.Thread(target=wakeup.listen_forever, name="postbox-listen", daemon=True))
    return threads


class Embeddable:
    """The lifecycle of a worker or relay, in its own process or embedded in another program.

    Subclasses provide ``start``, ``stop``, ``join``, ``ready`` and ``_stopping``."""

    _stopping: threading.Event
    _started = False

    def start(self) -> None:
        raise NotImplementedError

    def _starting(self) -> None:
        """Called first by ``start``: refuse a second start, which would run every thread twice,
        or, after ``stop``, nothing. (A stop before the first start, a signal during start-up, is
        fine: the service starts and stops at once.)"""
        if self._started:
            raise RuntimeError(
                f"postbox: this {type(self).__name__} was stopped and cannot start again: make a new one"
                if self.stopping
                else f"postbox: this {type(self).__name__} is started already"
            )
        self._started = True

    def stop(self) -> None:
        raise NotImplementedError

    def join(self, grace: float | None = None) -> None:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def run(self) -> None:
        """Start, block until ``stop()`` (from another thread or a signal handler), then join."""
        self.start()
        try:
            while not self._stopping.wait(0.5):
                pass
        finally:
            self.join()

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """Wait until :meth:`ready` (at most ``timeout`` seconds); whether it is."""
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.stopping or time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    # --- in a thread: ``with worker: ...`` -------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self.join()

    # --- in asyncio ------------------------------------------------------------------------

    async def start_async(self) -> None:
        """:meth:`start` without blocking the event loop (it registers in the database)."""
        await asyncio.to_thread(self.start)

    async def stop_async(self, grace: float | None = None) -> None:
        """:meth:`stop`, then :meth:`join` without blocking the event loop."""
        self.stop()
        await asyncio.to_thread(self.join, grace)

    @asynccontextmanager
    async def running(self, grace: float | None = None) -> AsyncIterator[Self]:
        """``async with worker.running():`` runs it for the block (e.g. an ASGI app's lifespan)."""
        await self.start_async()
        try:
            yield self
        finally:
            await self.stop_async(grace)

"""Pieces every Postbox process shares: wake-ups (LISTEN/NOTIFY with polling as the fallback) and
presence (registration, heartbeat, recovery of what dead processes held, clean unregistration)."""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from postbox.clock import Clock
from postbox.db import query

__all__ = ["DatabaseUnreachable", "Presence", "Wakeup", "process_id", "wait_for_database"]

log = logging.getLogger("postbox.runtime")


def process_id() -> str:
    """A unique id for one process's registration: host, pid and a random suffix."""
    import uuid

    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class DatabaseUnreachable(Exception):
    """The database could not be reached within the connect timeout."""


def wait_for_database(
    url: str,
    *,
    what: str,
    timeout: float | None = None,
    timeout_source: str = "--connect-timeout {:g}",
    stopping: threading.Event | None = None,
    rng: random.Random | None = None,
) -> bool:
    """Wait until the database answers, retrying with jittered backoff (0.5 s doubling up to 10 s)
    and logging each failed try: a process started while its database is down or still starting
    waits for it instead of exiting. Returns False if ``stopping`` was set meanwhile; raises
    :class:`DatabaseUnreachable` once ``timeout`` seconds (None: no limit) have passed, naming
    the setting as ``timeout_source`` formats it with the timeout (a flag, or the file's setting)."""
    from postbox.config.settings import mask_url

    rng = rng or random.Random()
    started = time.monotonic()
    backoff = 0.5
    tries = 0
    while True:
        tries += 1
        try:
            with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
                conn.execute("SELECT 1")
            if tries > 1:
                log.info(
                    "database reachable after %s tries; %s starting",
                    tries,
                    what,
                    extra={"event": "database_reachable", "tries": tries},
                )
            return True
        except psycopg.OperationalError as error:
            detail = (str(error).strip().splitlines() or [type(error).__name__])[0]
            waited = time.monotonic() - started
            if timeout is not None and waited >= timeout:
                raise DatabaseUnreachable(
                    f"gave up after {waited:.0f} s and {tries} tries ({timeout_source.format(timeout)}): {detail}"
                ) from None
            pause = backoff + rng.uniform(0, backoff / 2)
            if timeout is not None:
                pause = min(pause, max(0.0, timeout - waited))
            log.warning(
                "%s: cannot reach the database %s (try %s): %s; retrying in %.1f s",
                what,
                mask_url(url),
                tries,
                detail,
                pause,
                extra={"event": "database_unreachable", "tries": tries},
            )
            backoff = min(backoff * 2, 10.0)
            if stopping is not None:
                if stopping.wait(pause):
                    return False
            else:
                time.sleep(pause)


def _version() -> tuple[str, str]:
    from postbox._version import SCHEMA_REVISION, __version__

    return __version__, SCHEMA_REVISION


class Wakeup:
    """Lets idle loops sleep until there may be work: a notification on ``channel`` whose payload
    is one of ``payloads``, a local ``notify()``, or ``poll_interval`` at the latest."""

    def __init__(
        self, url: str, channel: str, payloads: set[str], poll_interval: float, stopping: threading.Event
    ):
        self.url = url
        self.channel = channel
        self.payloads = payloads
        self.poll_interval = poll_interval
        self._stopping = stopping
        self._cond = threading.Condition()
        self.generation = 0
        self._rng = random.Random()

    def notify(self) -> None:
        with self._cond:
            self.generation += 1
            self._cond.notify_all()

    def wait(self, seen_generation: int) -> None:
        """Sleep unless something happened since ``seen_generation`` was read."""
        with self._cond:
            if self.generation == seen_generation and not self._stopping.is_set():
                self._cond.wait(self.poll_interval)

    def listen_forever(self) -> None:
        """Run in a thread: LISTEN, reconnecting with jittered backoff, until stopping."""
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True) as conn:
                    conn.execute(f"LISTEN {self.channel}")
                    backoff = 0.1
                    self.notify()  # anything sent while we were not listening
                    while not self._stopping.is_set():
                        for n in conn.notifies(timeout=0.5):
                            if n.payload in self.payloads:
                                self.notify()
            except psycopg.Error as error:
                log.warning("listen connection lost: %s", error)
                self._stopping.wait(backoff + self._rng.uniform(0, backoff))
                backoff = min(backoff * 2, 5.0)


class Presence:
    """A process's row in postbox.workers: written at start, beaten every ``interval``, deleted at
    a clean stop. Each beat also recovers the claims of processes whose heartbeat went stale."""

    def __init__(
        self,
        url: str,
        *,
        id: str,
        kind: str,
        queue: str | None,
        concurrency: int,
        interval: float,
        stale_after: float,
        clock: Clock,
        stopping: threading.Event,
        on_reaped: Callable[[int], None] | None = None,
    ) -> None:
        self.url = url
        self.id = id
        self.kind = kind
        self.queue = queue
        self.concurrency = concurrency
        self.interval = interval
        self.stale_after = stale_after
        self.clock = clock
        self._stopping = stopping
        self._finished = threading.Event()
        self._on_reaped = on_reaped
        self._last_ok: float | None = None

    def beat(self, conn: psycopg.Connection[Any] | None = None) -> None:
        if conn is None:
            with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as own:
                self.beat(own)
                return
        now = self.clock.now()
        version, revision = _version()
        conn.execute(
            query("worker_heartbeat").psycopg,
            {"id": self.id, "kind": self.kind, "queue": self.queue, "host": socket.gethostname(),
             "pid": os.getpid(), "concurrency": self.concurrency, "version": version,
             "schema_revision": revision, "stopping": self._stopping.is_set(), "now": now},
        )  # fmt: skip
        self._last_ok = time.monotonic()
        row = conn.execute(
            query("reap_stale_workers").psycopg, {"stale_after": self.stale_after, "now": now}
        ).fetchone()
        if row and row[0]:
            log.warning("released %s messages of stale processes", row[0])
            if self._on_reaped is not None:
                self._on_reaped(int(row[0]))

    def healthy(self) -> bool:
        """The last heartbeat reached the database less than ``stale_after`` seconds ago."""
        return self._last_ok is not None and time.monotonic() - self._last_ok < self.stale_after

    def beat_forever(self) -> None:
        """Run in a thread until :meth:`finish`: also while the process drains (its row then says
        stopping), so that no other process takes it for dead and re-runs its in-flight messages."""
        while not self._finished.wait(self.interval):
            try:
                self.beat()
            except psycopg.Error as error:
                log.warning("heartbeat failed: %s", error)

    def finish(self) -> None:
        """The process has finished its work: stop beating (then :meth:`unregister`)."""
        self._finished.set()

    def unregister(self) -> None:
        self._finished.set()
        try:
            with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
                conn.execute(query("worker_unregister").psycopg, {"id": self.id})
        except psycopg.Error:
            log.warning("could not unregister %s %s", self.kind, self.id)

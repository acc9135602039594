"""The inbox worker (the process, its slots and their watchdog): claims heads of keys, runs handlers, commits effects with the "done" mark.

One process runs ``concurrency`` slots (threads), each with its own connection. A slot claims a
batch (one short transaction that counts a delivery on each message), then processes the batch in
one transaction: every message in its own savepoint, its handler's effects and its done mark (or
its failure record) committed together. Retries are rows with a later ``available_at``; nothing
waits in memory. LISTEN/NOTIFY wakes idle slots; polling is the fallback.

A handler harms only its own message:

- it cannot end the batch's transaction: ``ctx.conn`` refuses commit, rollback, close and
  reconfiguration (:mod:`postbox.inbox.connection`); ending it with SQL is detected right after
  the handler returns, and the batch is settled by what really happened to it;
- its time limit holds for any code: at the limit its query is cancelled; if it still has not
  returned a moment later (Python that does not return), the slot is abandoned: its connection is
  fenced and its server session terminated (the stuck code can no longer write), the batch is
  settled, and a new slot takes its place. A process whose abandoned threads pass
  ``max_stuck_handlers`` stops for its supervisor to start a fresh one;
- any exception, ``SystemExit`` and ``KeyboardInterrupt`` included, fails only its attempt.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from postbox.clock import Clock, SystemClock
from postbox.config.urls import libpq_url
from postbox.failures.breaker import CircuitBreaker
from postbox.failures.classify import Classifier
from postbox.inbox.handlers import Registry
from postbox.inbox.worker.settings import WorkerSettings, WorkerShutdown
from postbox.inbox.worker.slot import Slot
from postbox.operations import metrics
from postbox.operations.lifecycle import Embeddable, helper_threads
from postbox.operations.runtime import Presence, Wakeup, process_id

__all__ = ["Worker"]

log = logging.getLogger("postbox.worker")


class Worker(Embeddable):
    """The inbox worker: ``Worker(database_url, registry, consumer="orders", concurrency=4)`` (any
    :class:`WorkerSettings` field as a keyword), or ``Worker(url, registry, settings)``.

    ``run()`` blocks until ``stop()``. Embedded in a program: ``start()``/``stop()``/``join()`` (or
    ``with worker:``) runs it in threads; ``async with worker.running():`` (or ``await
    worker.start_async()`` / ``await worker.stop_async()``) in an asyncio program. ``ready()``
    says whether it is working.

    ``fatal`` says why the worker stopped by itself (too many handlers stuck past their time
    limit), or is None: a supervisor should then start a fresh process (the CLI exits with 70).
    """

    def __init__(
        self,
        url: str,
        registry: Registry,
        settings: WorkerSettings | None = None,
        *,
        consumer: str | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        **options: Any,
    ) -> None:
        settings = WorkerSettings.build(settings, consumer, options)
        self.url = libpq_url(url)
        self.registry = registry
        self.settings = settings
        self.clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.on_event = on_event
        self.id = process_id()
        self.classifier: Classifier = registry.classifier()
        self.breaker = CircuitBreaker(settings.breaker)
        self.fatal: str | None = None
        self._stopping = threading.Event()
        self._aborting = threading.Event()
        self._abort_now = threading.Event()
        self._lock = threading.Lock()
        self.wakeup = Wakeup(
            url, "postbox_inbox", {settings.consumer}, settings.poll_interval, self._stopping
        )
        self.presence = Presence(
            url,
            id=self.id,
            kind="worker",
            queue=settings.consumer,
            concurrency=settings.concurrency,
            interval=settings.heartbeat_interval,
            stale_after=settings.stale_after,
            clock=self.clock,
            stopping=self._stopping,
            on_reaped=self._reaped,
        )
        self._aux: list[threading.Thread] = []
        self._slots: list[Slot] = []
        self._stuck: list[threading.Thread] = []
        if settings.batch_size > 60:
            log.warning(
                "batch size %s: each message's savepoint stays a subtransaction until the batch commits, "
                "and PostgreSQL caches 64 per backend (past that every snapshot in the cluster slows down); "
                "keep it under 64",
                settings.batch_size,
            )
        if not any(c == settings.consumer for c in registry.consumers()):
            raise ValueError(f"postbox: the registry has no handler for consumer {settings.consumer!r}")

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._starting()
        self.presence.beat()
        self._slots = [Slot(self, i) for i in range(self.settings.concurrency)]
        for slot in self._slots:
            slot.start()
        self._aux = [
            *helper_threads(self.presence, self.wakeup, listen=self.settings.listen),
            threading.Thread(target=self._watchdog, name="postbox-watchdog", daemon=True),
        ]
        for t in self._aux:
            t.start()
        metrics.record_breaker(self.settings.consumer, self.breaker.state.value)
        self._emit("started", worker=self.id)
        log.info(
            "worker started",
            extra={"event": "worker_started", "worker": self.id, "consumer": self.settings.consumer},
        )

    def stop(self) -> None:
        """Stop claiming; in-flight batches finish (``join`` enforces the grace period)."""
        self._stopping.set()
        self.wakeup.notify()

    def abort(self) -> None:
        """Stop at once (a second signal): running handlers are abandoned, their messages settled."""
        self._abort_now.set()
        self._aborting.set()
        self.stop()
        for slot in list(self._slots):
            slot.cancel()

    def join(self, grace: float | None = None) -> None:
        """Wait for the slots to finish; after ``grace`` seconds (or at once after ``abort``), give
        back what is still in flight and leave whatever handler code still runs behind."""
        deadline = time.monotonic() + (self.settings.grace_period if grace is None else grace)
        while self._alive_slots() and time.monotonic() < deadline and not self._abort_now.is_set():
            self._abort_now.wait(0.02)
        if self._alive_slots():
            # Between messages and in SQL a slot gives its batch back within moments of the cancel.
            self._aborting.set()
            for slot in self._alive_slots():
                slot.cancel()
            settle_by = time.monotonic() + (0.2 if self._abort_now.is_set() else 2.0)
            while self._alive_slots() and time.monotonic() < settle_by:
                time.sleep(0.02)
            for slot in self._alive_slots():
                self._abandon(slot, WorkerShutdown("the worker stopped while the handler was still running"))
        self.presence.finish()  # beat until here: a draining process is alive
        for t in self._aux:
            t.join(5)
        self.presence.unregister()
        self._emit("stopped", worker=self.id)

    def _alive_slots(self) -> list[Slot]:
        return [s for s in list(self._slots) if s.alive]

    @property
    def stuck_threads(self) -> int:
        """Handler threads abandoned past their time limit that are still running user code."""
        with self._lock:
            return sum(1 for t in self._stuck if t.is_alive())

    def ready(self) -> bool:
        """For ``/readyz``: running, a slot able to work, and the last heartbeat reached the database."""
        return (
            not self.stopping
            and self.fatal is None
            and any(s.alive for s in list(self._slots))
            and self.presence.healthy()
        )

    def _reaped(self, released: int) -> None:
        self._emit("reaped", released=released)
        self.wakeup.notify()

    # --- supervision -----------------------------------------------------------------------

    def _watchdog(self) -> None:
        """Enforce time limits, replace slots that died, until stopped and every slot is gone."""
        while True:
            now = time.monotonic()
            for slot in list(self._slots):
                if slot.check_deadline(now):
                    self._abandon(slot, None)
                elif not slot.alive and not slot.abandoned and not self.stopping and slot.started:
                    self._restart(slot)
            if self._stopping.is_set() and not self._alive_slots():
                return
            time.sleep(0.05)

    def _abandon(self, slot: Slot, shutdown: WorkerShutdown | None) -> None:
        """Leave ``slot``'s thread to its handler: fence its connection, end its server session,
        settle its batch, and (unless stopping) put a new slot in its place."""
        inheritance = slot.abandon(shutdown)
        if inheritance is None:
            return
        thread = slot.thread
        if thread is not None:
            with self._lock:
                self._stuck = [t for t in self._stuck if t.is_alive()] + [thread]
                stuck = len(self._stuck)
        else:
            stuck = 0
        replacement = Slot(self, slot.index, inheritance)
        with self._lock:
            self._slots = [replacement if s is slot else s for s in self._slots]
        if shutdown is not None:
            replacement.settle_only()
            return
        self._emit(
            "abandoned", slot=slot.index, id=inheritance.in_flight.id if inheritance.in_flight else None
        )
        if stuck > self.settings.stuck_limit:
            self.fatal = (
                f"{stuck} handler threads are stuck past their time limit (limit {self.settings.stuck_limit}): "
                "stopping so that a fresh process takes over"
            )
            log.critical(self.fatal, extra={"event": "worker_fatal", "worker": self.id})
            replacement.settle_only()
            self.stop()
            return
        replacement.start()

    def _restart(self, slot: Slot) -> None:
        """A slot's thread ended without being asked to (a bug): settle its batch, start a new one."""
        log.error(
            "slot %s stopped unexpectedly (%r); starting a new one",
            slot.index,
            slot.died,
            extra={"event": "slot_restarted", "worker": self.id},
        )
        inheritance = slot.abandon(None, died=True)
        replacement = Slot(self, slot.index, inheritance)
        with self._lock:
            self._slots = [replacement if s is slot else s for s in self._slots]
        replacement.start()

    def _emit(self, event: str, **data: Any) -> None:
        if self.on_event is not None:
            self.on_event(event, data)
        for listener in self.registry.listeners:
            listener(event, data)

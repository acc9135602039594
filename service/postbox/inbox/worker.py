"""The inbox worker: claims heads of keys, runs handlers, commits effects with the "done" mark.

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

import asyncio
import inspect
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection as SAConnection
from sqlalchemy.engine import Engine, RootTransaction
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool

from postbox.clock import Clock, SystemClock
from postbox.db import query
from postbox.failures.breaker import BreakerSettings, BreakerState, CircuitBreaker
from postbox.failures.classify import Classification, Classifier, fingerprint
from postbox.failures.outcomes import Permanent
from postbox.failures.policy import DeadLetter, FailureKind, RetryAt, RetryPolicy, decide
from postbox.inbox.connection import HandlerConnection, HandlerEndedTransaction
from postbox.inbox.handlers import Context, Message, Registry
from postbox.operations import metrics
from postbox.operations.logs import message_fields
from postbox.operations.runtime import Presence, Wakeup, process_id

__all__ = ["HandlerTimeout", "Worker", "WorkerSettings"]

log = logging.getLogger("postbox.worker")

_MESSAGE_FIELDS = (
    "id", "consumer", "message_id", "key", "sequence", "type", "schema_version", "payload", "headers",
    "correlation_id", "causation_id", "source", "received_at", "attempt", "first_failed_at", "last_error",
    "last_error_type",
)  # fmt: skip

# How long a handler may go on past its time limit, after its query was cancelled, before its slot
# is abandoned (SQL stops at the cancel; only Python that does not return gets this far).
ABANDON_AFTER = 1.0

# SQLSTATEs of a savepoint command that finds the batch's transaction gone: the handler ended it.
_ENDED = {"3B001", "25P01"}


@dataclass(frozen=True)
class WorkerSettings:
    """How a worker process runs. Times are seconds."""

    consumer: str
    concurrency: int = 2
    batch_size: int = 20
    poll_interval: float = 1.0
    listen: bool = True
    handler_timeout: float = 30.0
    lease: float | None = None  # default: handler_timeout * batch_size + 30
    heartbeat_interval: float = 5.0
    stale_after: float = 30.0
    grace_period: float = 30.0
    max_stuck_handlers: int | None = None  # default: concurrency
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)

    def __post_init__(self) -> None:
        for name in ("concurrency", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"postbox: {name} must be at least 1")
        for name in ("poll_interval", "handler_timeout", "heartbeat_interval", "stale_after"):
            if getattr(self, name) <= 0:
                raise ValueError(f"postbox: {name} must be positive")
        if self.stale_after <= self.heartbeat_interval:
            raise ValueError("postbox: stale_after must be longer than heartbeat_interval")
        if self.max_stuck_handlers is not None and self.max_stuck_handlers < 0:
            raise ValueError("postbox: max_stuck_handlers must not be negative")

    @property
    def lease_seconds(self) -> float:
        return self.lease if self.lease is not None else self.handler_timeout * self.batch_size + 30.0

    @property
    def stuck_limit(self) -> int:
        return self.max_stuck_handlers if self.max_stuck_handlers is not None else self.concurrency


class HandlerTimeout(TimeoutError):
    """A handler ran past its time limit; the attempt failed (transient, kind ``timeout``)."""


class WorkerShutdown(Exception):
    """The worker stopped (grace period over, or a second signal) while the handler still ran."""


class HandlerLeftTransactionInError(Exception):
    """The handler returned, but a database error inside it left its transaction failed."""


class _Stop(Exception):
    """Raised inside a slot when the worker stops while it waits for a connection."""


class _Abandoned(Exception):
    """Raised in an abandoned slot's thread once its handler returns: it must stop at once."""


class _TransactionEnded(Exception):
    """The batch's transaction is gone: ``culprit``'s handler committed or rolled it back with SQL."""

    def __init__(self, culprit: Message) -> None:
        self.culprit = culprit
        super().__init__(culprit.message_id)


class Worker:
    """A worker process's machinery. ``run()`` blocks until ``stop()``; tests use ``start()``.

    ``fatal`` says why the worker stopped by itself (too many handlers stuck past their time
    limit), or is None: a supervisor should then start a fresh process (the CLI exits with 70).
    """

    def __init__(
        self,
        url: str,
        registry: Registry,
        settings: WorkerSettings,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.url = url
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
        self._slots: list[_Slot] = []
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
        self.presence.beat()
        self._slots = [_Slot(self, i) for i in range(self.settings.concurrency)]
        for slot in self._slots:
            slot.start()
        self._aux = [
            threading.Thread(target=self.presence.beat_forever, name="postbox-heartbeat", daemon=True),
            threading.Thread(target=self._watchdog, name="postbox-watchdog", daemon=True),
        ]
        if self.settings.listen:
            self._aux.append(
                threading.Thread(target=self.wakeup.listen_forever, name="postbox-listen", daemon=True)
            )
        for t in self._aux:
            t.start()
        metrics.record_breaker(self.settings.consumer, self.breaker.state.value)
        self._emit("started", worker=self.id)
        log.info(
            "worker started",
            extra={"event": "worker_started", "worker": self.id, "consumer": self.settings.consumer},
        )

    def run(self) -> None:
        self.start()
        try:
            while not self._stopping.wait(0.5):
                pass
        finally:
            self.join()

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
        for t in self._aux:
            t.join(5)
        self.presence.unregister()
        self._emit("stopped", worker=self.id)

    def _alive_slots(self) -> list[_Slot]:
        return [s for s in list(self._slots) if s.alive]

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

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

    def _abandon(self, slot: _Slot, shutdown: WorkerShutdown | None) -> None:
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
        replacement = _Slot(self, slot.index, inheritance)
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

    def _restart(self, slot: _Slot) -> None:
        """A slot's thread ended without being asked to (a bug): settle its batch, start a new one."""
        log.error(
            "slot %s stopped unexpectedly (%r); starting a new one",
            slot.index,
            slot.died,
            extra={"event": "slot_restarted", "worker": self.id},
        )
        inheritance = slot.abandon(None, died=True)
        replacement = _Slot(self, slot.index, inheritance)
        with self._lock:
            self._slots = [replacement if s is slot else s for s in self._slots]
        replacement.start()

    def _emit(self, event: str, **data: Any) -> None:
        if self.on_event is not None:
            self.on_event(event, data)
        for listener in self.registry.listeners:
            listener(event, data)


@dataclass
class _Failure:
    message: Message
    decision: RetryAt | DeadLetter
    classification: Classification
    policy: str | None
    duration_ms: float | None = None
    kind: str = ""
    max_attempts: int | None = None  # set for a claim past max_attempts (no handler ran)


@dataclass
class _Batch:
    """What a slot knows of the batch it is processing (read by the watchdog if it abandons it)."""

    messages: list[Message]
    done: list[Message] = field(default_factory=list)
    failures: list[_Failure] = field(default_factory=list)
    unrun: list[Message] = field(default_factory=list)
    in_flight: Message | None = None
    last_run: Message | None = None
    position: int = 0  # index of the message being (or last) run
    xid: str | None = None  # the transaction's id once assigned, as of before the last handler ran

    def after(self, message: Message) -> list[Message]:
        """The messages after ``message`` that have not run."""
        i = next(i for i, m in enumerate(self.messages) if m is message)
        ran = {id(m) for m in self.done} | {id(f.message) for f in self.failures}
        return [m for m in self.messages[i + 1 :] if id(m) not in ran]


@dataclass
class _Inheritance:
    """What an abandoned or dead slot leaves to the slot that replaces it."""

    batch: _Batch | None
    in_flight: Message | None
    error: BaseException | None
    backend_pid: int | None


class _Slot:
    """One claim-and-process loop with its own connection."""

    def __init__(self, worker: Worker, index: int, inheritance: _Inheritance | None = None) -> None:
        self.worker = worker
        self.index = index
        self.settings = worker.settings
        self.conn: HandlerConnection | None = None
        self.thread: threading.Thread | None = None
        self.started = False
        self.busy = False
        self.abandoned = False
        self.died: BaseException | None = None
        self.batch: _Batch | None = None
        self._inheritance = inheritance
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._timeout = 0.0
        self._timed_out = False
        self._backend_pid: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: Engine | None = None
        self._sa: tuple[SAConnection, RootTransaction] | None = None
        self._durations: dict[int, float] = {}

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and not self.abandoned

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name=f"postbox-slot-{self.index}", daemon=True)
        self.started = True
        self.thread.start()

    # --- connection ------------------------------------------------------------------------

    def _connect(self) -> HandlerConnection:
        backoff = 0.05
        while True:
            try:
                conn = HandlerConnection.connect(
                    self.worker.url,
                    autocommit=False,
                    application_name=f"postbox-worker:{self.settings.consumer}",
                    options=f"-c idle_in_transaction_session_timeout={int(self.settings.lease_seconds * 1000)}",
                )
                self._backend_pid = conn.info.backend_pid
                self._engine = self._sqlalchemy_engine(conn)
                return conn
            except psycopg.OperationalError as error:
                if self.worker.stopping:
                    raise _Stop from error
                log.warning("slot %s cannot connect: %s", self.index, error)
                time.sleep(backoff + self.worker.rng.uniform(0, backoff))
                backoff = min(backoff * 2, 5.0)

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

    def _session_factory(self) -> Session:
        """A SQLAlchemy Session joined to this slot's open transaction (savepoints for its commits)."""
        assert self._engine is not None
        if self._sa is None:
            sa_conn = self._engine.connect()
            self._sa = (sa_conn, sa_conn.begin())
        return Session(bind=self._sa[0], join_transaction_mode="create_savepoint")

    def _commit(self) -> None:
        assert self.conn is not None
        if self._sa is not None:
            sa_conn, tx = self._sa
            self._sa = None
            tx.commit()
            sa_conn.close()
        else:
            self.conn.commit()

    def _rollback(self) -> None:
        assert self.conn is not None
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

    # --- main loop -------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self.conn = self._connect()
            if self._inheritance is not None:
                self._settle_inheritance()
            while not self.worker.stopping:
                generation = self.worker.wakeup.generation
                try:
                    limit = self.worker.breaker.claim_limit(self.settings.batch_size)
                    if limit == 0:  # circuit open: wait for the next probe
                        self.worker._stopping.wait(min(self.settings.poll_interval, 0.5))
                        continue
                    batch = self._claim(limit)
                    if not batch:
                        if limit == 1 and self.worker.breaker.state is BreakerState.HALF_OPEN:
                            self.worker.breaker.release_probe()
                        self.worker._emit("idle", slot=self.index)
                        self.worker.wakeup.wait(generation)
                        continue
                    self._process(batch)
                except (_Stop, _Abandoned):
                    raise
                except psycopg.OperationalError as error:
                    self._check_abandoned()
                    log.warning("slot %s lost its connection: %s", self.index, error)
                    self._reconnect()
                except Exception:  # a slot must never die: log, reset the connection, go on
                    self._check_abandoned()
                    log.exception("slot %s failed; resetting its connection", self.index)
                    self._reconnect()
        except (_Stop, _Abandoned):
            pass
        except BaseException as error:  # recorded; the watchdog starts a new slot
            self.died = error
            log.critical("slot %s died: %r", self.index, error, exc_info=True)
        finally:
            if self._loop is not None and not self.abandoned:
                self._loop.close()
            if self.conn is not None:
                try:
                    self.conn.close()
                except Exception:
                    log.debug("closing the slot's connection failed", exc_info=True)

    def _reconnect(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self._sa = None
        self.conn = self._connect()

    def _check_abandoned(self) -> None:
        if self.abandoned:
            raise _Abandoned

    def _claim(self, limit: int) -> list[Message]:
        assert self.conn is not None
        now = self.worker.clock.now()
        # The claim is a transaction of its own: one statement in autocommit, one round trip.
        self.conn.autocommit = True
        started = time.monotonic()
        try:
            rows = self.conn.execute(
                query("inbox_claim").psycopg,
                {"consumer": self.settings.consumer, "worker": self.worker.id, "limit": limit,
                 "lease": self.settings.lease_seconds, "now": now},
            ).fetchall()  # fmt: skip
        finally:
            if not self.conn.closed:
                self.conn.autocommit = False
        batch = [Message.model_construct(**dict(zip(_MESSAGE_FIELDS, r, strict=True))) for r in rows]
        metrics.record_claim(self.settings.consumer, batch, time.monotonic() - started)
        if batch:
            self.worker._emit("claimed", ids=[m.id for m in batch])
        return batch

    # --- processing ------------------------------------------------------------------------

    def _process(self, messages: list[Message]) -> None:
        assert self.conn is not None
        conn = self.conn
        batch = _Batch(messages)
        self.batch = batch
        self._durations = {}
        try:
            savepoint = False
            for i, message in enumerate(messages):
                if self.worker._aborting.is_set() or (
                    i > 0 and self.worker.breaker.state is not BreakerState.CLOSED
                ):
                    batch.unrun = messages[i:]  # given back untouched: not an attempt
                    break
                policy = self._policy(message)
                if message.attempt > policy.max_attempts:
                    # Every delivery is counted at claim: a message that kept killing its worker ends here.
                    batch.failures.append(self._exhausted(message, policy))
                    continue
                if savepoint:
                    self._next_savepoint(batch)
                else:
                    conn.execute("SAVEPOINT postbox_m")  # psycopg begins the batch's transaction
                savepoint = True
                batch.position = i
                batch.in_flight = message
                metrics.record_start(message, self.worker.clock.now())
                started = time.monotonic()
                error = self._run_handler(message)
                duration_ms = (time.monotonic() - started) * 1000.0
                batch.last_run = message
                error = self._after_handler(message, error)
                batch.in_flight = None
                metrics.record_handler(message, duration_ms / 1000.0)
                self._durations[message.id] = duration_ms
                if error is None:
                    batch.done.append(message)
                    self._breaker_record(False)
                    continue
                self._savepoint_command(b"ROLLBACK TO SAVEPOINT postbox_m", message)
                failure = self._failure(message, error, duration_ms)
                self._breaker_record(failure.classification.kind is FailureKind.TRANSIENT)
                batch.failures.append(failure)
            if batch.done and batch.last_run is batch.done[-1]:
                self._savepoint_command(b"RELEASE SAVEPOINT postbox_m", batch.last_run)
            self._finish(batch.done, batch.failures, batch.unrun)
        except _TransactionEnded as ended:
            self._settle_ended(batch, ended.culprit)
        except psycopg.OperationalError:
            self._check_abandoned()
            self._recover(batch)
            raise
        except psycopg.Error as error:
            self._check_abandoned()
            # The batch's transaction failed as a whole (a serialization failure, a constraint
            # checked at commit): nothing of it committed. Give every message back untouched;
            # they are claimed again at once.
            log.warning("slot %s: batch rolled back (%s); releasing it", self.index, error)
            self._rollback()
            self._release(messages)
            self.worker._emit("batch_failed", ids=[m.id for m in messages], error=str(error))
        finally:
            self.batch = None

    def _after_handler(self, message: Message, error: BaseException | None) -> BaseException | None:
        """Check what the handler left: the attempt's error (possibly replaced), or raise
        ``_TransactionEnded`` if it ended the batch's transaction."""
        assert self.conn is not None
        conn = self.conn
        if conn.misuse is not None:
            # Refused before it reached the server: the transaction is intact, the culprit fails.
            return (
                error if isinstance(error, HandlerEndedTransaction) else HandlerEndedTransaction(conn.misuse)
            )
        if conn.closed or conn.broken:
            raise psycopg.OperationalError("connection lost during the handler") from error
        status = conn.info.transaction_status
        if status is psycopg.pq.TransactionStatus.IDLE:
            raise _TransactionEnded(message)
        if error is None and status is psycopg.pq.TransactionStatus.INERROR:
            return HandlerLeftTransactionInError(
                "the handler returned, but a database error inside it left its transaction failed "
                "(an error caught without re-raising it); the attempt fails"
            )
        return error

    def _savepoint_command(self, command: bytes, culprit: Message) -> None:
        """Run a savepoint command straight through libpq; a transaction found gone means the
        last handler ended it."""
        assert self.conn is not None
        _exec(self.conn, command, culprit)

    def _next_savepoint(self, batch: _Batch) -> None:
        """The next message's savepoint, in the batch's open transaction (one round trip). Until
        the transaction has an id, the same round trip asks for it: if a handler later ends the
        transaction, the id tells whether what ran before it was committed or rolled back."""
        assert self.conn is not None
        assert batch.last_run is not None
        if batch.xid is None:
            batch.xid = _exec(
                self.conn,
                b"RELEASE SAVEPOINT postbox_m; SAVEPOINT postbox_m; SELECT pg_current_xact_id_if_assigned()",
                batch.last_run,
            )
        else:
            _exec(self.conn, b"RELEASE SAVEPOINT postbox_m; SAVEPOINT postbox_m", batch.last_run)

    def _settle_ended(self, batch: _Batch, culprit: Message) -> None:
        """A handler committed or rolled back the batch's transaction with SQL. Whatever it left open
        is rolled back; what ran before it is settled by what happened to it: committed effects
        are marked done now (never run again), rolled-back ones are given back with their attempt
        intact. The culprit is dead-lettered."""
        assert self.conn is not None
        conn = self.conn
        self._rollback()
        committed = False
        if batch.xid is not None:
            row = conn.execute("SELECT pg_xact_status(CAST(%s AS xid8))", [batch.xid]).fetchone()
            committed = row is not None and row[0] == "committed"
        how = "committed" if committed else "rolled back"
        error = HandlerEndedTransaction(
            f"the handler ended the worker's transaction with SQL (COMMIT or ROLLBACK): handlers must "
            f"leave it to the worker. The messages before it in its batch were {how} by it"
            + (" and are marked done" if committed else " and are given back")
            + "; its own effects up to that point may have been committed"
        )
        log.error(
            "slot %s: %s",
            self.index,
            error,
            extra=_log_fields(culprit, "HandlerEndedTransaction", event="handler_ended_transaction"),
        )
        before = [m for m in batch.done if m is not culprit]
        done = before if committed else []
        give_back = ([] if committed else before) + batch.after(culprit) + batch.unrun
        failures = [*batch.failures, self._failure(culprit, error)]
        self._finish(done, failures, give_back)

    def _breaker_record(self, transient_failure: bool) -> None:
        before = self.worker.breaker.state
        after = self.worker.breaker.record(transient_failure)
        if after is not before:
            metrics.record_breaker(self.settings.consumer, after.value)
            level = logging.WARNING if after is BreakerState.OPEN else logging.INFO
            log.log(level, "circuit %s for consumer %s", after.value, self.settings.consumer)
            self.worker._emit(f"breaker_{after.value}", consumer=self.settings.consumer)

    def _policy(self, message: Message) -> RetryPolicy:
        spec = self.worker.registry.lookup(message.consumer, message.type)
        if spec is not None and spec.retry is not None:
            return spec.retry
        return self.worker.registry.retry_policies.get(message.consumer, self.settings.retry)

    def _run_handler(self, message: Message) -> BaseException | None:
        """Run the message's handler; the error it raised (or returned), or None on success."""
        assert self.conn is not None
        spec = self.worker.registry.lookup(message.consumer, message.type)
        if spec is None:
            return Permanent(f"no handler for consumer {message.consumer!r} and type {message.type!r}")
        if spec.schema_versions is not None and message.schema_version not in spec.schema_versions:
            return Permanent(
                f"unsupported schema_version {message.schema_version} (handler accepts "
                f"{', '.join(map(str, sorted(spec.schema_versions)))})"
            )
        ctx = Context(message, self.conn, self._session_factory)
        timeout = spec.timeout or self.settings.handler_timeout
        conn = self.conn
        with self._lock:
            self._timed_out = False
            self._timeout = timeout
            self._deadline = time.monotonic() + timeout
            self.busy = True
        conn.guard(True)
        outcome: BaseException | None = None
        try:
            result = spec.func(message, ctx)
            if inspect.isawaitable(result):
                result = self._event_loop().run_until_complete(asyncio.wait_for(_awaitable(result), timeout))
            ctx._close_session()
            if isinstance(result, BaseException):
                outcome = result
            elif self._timed_out:
                outcome = HandlerTimeout(f"handler exceeded its time limit of {timeout:g} s")
        except _Stop:
            raise
        except BaseException as error:  # SystemExit, KeyboardInterrupt...: only this attempt fails
            if self._timed_out or isinstance(error, asyncio.TimeoutError):
                outcome = HandlerTimeout(f"handler exceeded its time limit of {timeout:g} s")
            else:
                outcome = error
        finally:
            self._finish_tasks()
            conn.guard(False)
            with self._lock:
                self.busy = False
                self._deadline = None
                abandoned = self.abandoned
            if not abandoned and ctx._session is not None:
                try:
                    ctx._session.close()
                except Exception:
                    log.debug("closing the handler's session failed", exc_info=True)
        if abandoned:
            raise _Abandoned
        return outcome

    def _finish_tasks(self) -> None:
        """Cancel what an async handler left running on the slot's loop (fire-and-forget tasks):
        run later, it would write into another message's transaction."""
        loop = self._loop
        if loop is None or loop.is_running() or loop.is_closed():
            return
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if not pending:
            return
        for task in pending:
            task.cancel()
        try:
            loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
        except BaseException:  # a task that misbehaves while cancelled: never the slot's problem
            log.warning(
                "slot %s: a task left by an async handler failed while cancelled", self.index, exc_info=True
            )
        log.warning(
            "slot %s: cancelled %s task(s) an async handler left running (they must finish before it returns)",
            self.index,
            len(pending),
        )

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop

    def check_deadline(self, now: float) -> bool:
        """Called by the watchdog: cancel a handler's query at its time limit; True once the handler
        is still running ``ABANDON_AFTER`` seconds later (the slot must then be abandoned)."""
        with self._lock:
            if not self.busy or self._deadline is None or self.abandoned:
                return False
            if now <= self._deadline:
                return False
            if not self._timed_out:
                self._timed_out = True
                cancel = True
            else:
                return now > self._deadline + ABANDON_AFTER
        if cancel:
            self.cancel()
        return False

    def cancel(self) -> None:
        conn = self.conn
        if conn is not None and not conn.closed and self.busy and not self.abandoned:
            try:
                conn.cancel_safe(timeout=2.0)
            except Exception:
                log.debug("cancel failed", exc_info=True)

    def abandon(self, shutdown: WorkerShutdown | None, *, died: bool = False) -> _Inheritance | None:
        """Mark this slot abandoned (its thread may go on in handler code, but will never touch the
        database or the batch again) and return what the slot replacing it must settle."""
        with self._lock:
            if self.abandoned:
                return None
            if not died and shutdown is None and not self.busy:
                return None  # the handler returned in the meantime
            self.abandoned = True
            batch = self.batch
            in_flight = batch.in_flight if batch is not None else None
            timeout = self._timeout
        if died:
            error: BaseException | None = self.died or RuntimeError("the slot stopped unexpectedly")
            reason = f"postbox: slot {self.index} stopped"
        elif shutdown is not None:
            error = shutdown
            reason = "postbox: the worker stopped; this handler's transaction was ended"
        else:
            error = HandlerTimeout(
                f"handler exceeded its time limit of {timeout:g} s and did not return; it was abandoned "
                "and its transaction ended"
            )
            reason = (
                f"postbox: this handler ran past its time limit of {timeout:g} s; its transaction was ended "
                "and its connection may no longer be used"
            )
        if self.conn is not None:
            self.conn.fence(reason)
        if in_flight is not None and not died:
            log.error(
                "slot %s abandoned: %s",
                self.index,
                error,
                extra=_log_fields(in_flight, type(error).__name__, event="handler_abandoned"),
            )
        return _Inheritance(batch, in_flight, error, self._backend_pid)

    # --- settling --------------------------------------------------------------------------

    def settle_only(self) -> None:
        """Settle the inheritance on a connection of this slot's own, then close it (no claiming)."""
        try:
            self.conn = self._connect()
            self._settle_inheritance()
        except (_Stop, psycopg.Error) as error:
            log.warning(
                "slot %s could not settle an abandoned batch (its leases will): %s", self.index, error
            )
        finally:
            if self.conn is not None:
                self.conn.close()

    def _settle_inheritance(self) -> None:
        """End the previous slot's server session (its transaction is rolled back, its stuck code
        can no longer write), then record the attempt it was running and give the rest back."""
        assert self.conn is not None
        inheritance, self._inheritance = self._inheritance, None
        if inheritance is None:
            return
        conn = self.conn
        if inheritance.backend_pid is not None and inheritance.backend_pid != conn.info.backend_pid:
            conn.execute("SELECT pg_terminate_backend(%s, 5000)", [inheritance.backend_pid])
            conn.commit()
        batch = inheritance.batch
        if batch is None:
            return
        failures = list(batch.failures)
        give_back = [*batch.done, *batch.unrun]
        in_flight = inheritance.in_flight
        if in_flight is not None:
            error = inheritance.error or RuntimeError("the slot stopped")
            now_retry = 0.0 if isinstance(error, WorkerShutdown) else None
            failures.append(self._failure(in_flight, error, None, explicit_delay=now_retry))
            give_back += batch.after(in_flight)
        else:
            ran = {id(m) for m in batch.done} | {id(f.message) for f in batch.failures}
            give_back += [m for m in batch.messages if id(m) not in ran and m not in batch.unrun]
        self._finish([], failures, give_back)

    def _failure(
        self,
        message: Message,
        error: BaseException,
        duration_ms: float | None = None,
        *,
        explicit_delay: float | None = None,
    ) -> _Failure:
        spec = self.worker.registry.lookup(message.consumer, message.type)
        classification = self.worker.classifier.classify(error)
        now = self.worker.clock.now()
        if isinstance(error, HandlerEndedTransaction):
            decision: RetryAt | DeadLetter = DeadLetter(
                "handler_ended_transaction",
                f"the handler ended the worker's transaction on attempt {message.attempt}",
            )
            classification = Classification(
                FailureKind.PERMANENT, classification.error_type, classification.message,
                classification.traceback, None, "handler ended the transaction",
            )  # fmt: skip
        else:
            decision = decide(
                self._policy(message),
                classification.kind,
                attempt=message.attempt,
                now=now,
                first_failed_at=message.first_failed_at,
                received_at=message.received_at,
                rng=self.worker.rng,
                explicit_delay=classification.retry_after if explicit_delay is None else explicit_delay,
                idempotent=spec.idempotent if spec else False,
            )
        kind = "timeout" if isinstance(error, HandlerTimeout) else classification.kind.value
        log.info(
            "attempt failed: %s: %s (%s)",
            classification.error_type,
            classification.message,
            decision.explanation,
            extra=_log_fields(
                message,
                classification.error_type,
                event="attempt_failed",
                worker=self.worker.id,
                decision="retry" if isinstance(decision, RetryAt) else "dead_letter",
                duration_ms=None if duration_ms is None else round(duration_ms, 3),
            ),
        )
        return _Failure(
            message, decision, classification, spec.on_dead_letter if spec else None, duration_ms, kind
        )

    def _exhausted(self, message: Message, policy: RetryPolicy) -> _Failure:
        text = message.last_error or "worker died during the attempt"
        error_type = message.last_error_type or "LeaseExpired"
        classification = Classification(FailureKind.TRANSIENT, error_type, text, "", None, "delivery count")
        decision = DeadLetter(
            "attempts_exhausted",
            f"attempt {message.attempt - 1} of {policy.max_attempts} was the last: {text}",
        )
        spec = self.worker.registry.lookup(message.consumer, message.type)
        return _Failure(
            message,
            decision,
            classification,
            spec.on_dead_letter if spec else None,
            None,
            "lease_expired",
            policy.max_attempts,
        )

    def _finish(self, done: list[Message], failures: list[_Failure], unrun: list[Message]) -> None:
        """Write the batch's outcomes in its transaction and commit; roll back if a claim was lost."""
        assert self.conn is not None
        conn = self.conn
        now = self.worker.clock.now()
        lost: set[int] = set()
        if done:
            row = conn.execute(
                query("inbox_complete").psycopg,
                {"ids": [m.id for m in done], "attempts": [m.attempt for m in done], "now": now},
            ).fetchone()
            lost = set(row[0]) if row else set()
        if lost:
            # Some messages were re-claimed by another worker after our lease ran out: their effects
            # must not commit. Undo the whole batch and give the rest back untouched.
            log.warning("claims lost for %s; rolling the batch back", sorted(lost))
            self._rollback()
            keep = [m for m in done if m.id not in lost] + [f.message for f in failures] + unrun
            self._release(keep)
            self.worker._emit("lost", ids=sorted(lost))
            return
        for f in failures:
            self._write_failure(f, now)
        if unrun:
            conn.execute(
                query("inbox_release").psycopg,
                {"ids": [m.id for m in unrun], "attempts": [m.attempt for m in unrun], "now": now},
            )
        self._commit()
        self._observe(done, failures, now)
        if done:
            self.worker._emit("completed", ids=[m.id for m in done])
        for f in failures:
            self.worker._emit(f.decision.kind, id=f.message.id, reason=f.decision.explanation)

    def _observe(self, done: list[Message], failures: list[_Failure], now: datetime) -> None:
        """Metrics and log lines of a committed batch."""
        durations, self._durations = self._durations, {}
        debug = log.isEnabledFor(logging.DEBUG)
        for m in done:
            metrics.record_success(m, now)
            if debug:
                duration = durations.get(m.id)
                log.debug(
                    "message processed",
                    extra=_log_fields(
                        m,
                        event="message_processed",
                        worker=self.worker.id,
                        duration_ms=None if duration is None else round(duration, 3),
                    ),
                )
        for f in failures:
            reason = f.decision.reason if isinstance(f.decision, DeadLetter) else None
            metrics.record_failure(f.message, f.kind, f.classification.error_type, reason)
            if reason is not None:
                log.warning(
                    "message dead-lettered (%s): %s",
                    reason,
                    f.decision.explanation,
                    extra=_log_fields(
                        f.message,
                        f.classification.error_type,
                        event="message_dead_lettered",
                        worker=self.worker.id,
                        reason=reason,
                    ),
                )

    def _write_failure(self, f: _Failure, now: datetime) -> None:
        assert self.conn is not None
        m, d, c = f.message, f.decision, f.classification
        if f.max_attempts is not None:
            self.conn.execute(
                query("inbox_exhaust").psycopg,
                {"id": m.id, "attempt": m.attempt, "now": now, "max_attempts": f.max_attempts,
                 "fingerprint": fingerprint(c.error_type, c.message), "policy": f.policy,
                 "worker": self.worker.id},
            )  # fmt: skip
            return
        common = {
            "id": m.id, "attempt": m.attempt, "now": now, "error_type": c.error_type, "kind": f.kind,
            "traceback": c.traceback or None, "worker": self.worker.id, "duration_ms": f.duration_ms,
            "explanation": d.explanation,
        }  # fmt: skip
        if isinstance(d, RetryAt):
            self.conn.execute(query("inbox_retry").psycopg, {**common, "retry_at": d.at, "error": c.message})
        else:
            self.conn.execute(
                query("inbox_dead_letter").psycopg,
                {**common, "reason": d.reason, "error": c.message,
                 "fingerprint": fingerprint(c.error_type, c.message), "policy": f.policy},
            )  # fmt: skip

    def _release(self, messages: list[Message]) -> None:
        if not messages:
            return
        assert self.conn is not None
        self.conn.execute(
            query("inbox_release").psycopg,
            {"ids": [m.id for m in messages], "attempts": [m.attempt for m in messages],
             "now": self.worker.clock.now()},
        )  # fmt: skip
        self.conn.commit()

    def _recover(self, batch: _Batch) -> None:
        """The connection died mid-batch: nothing of the batch committed. On a new connection,
        record the attempt that was running as a transient failure and give the others back."""
        in_flight = batch.in_flight
        try:
            self._reconnect()
            assert self.conn is not None
            failures = []
            if in_flight is not None:
                error = ConnectionError("database connection lost during the handler")
                failures.append(self._failure(in_flight, error))
            self._finish([], failures, [m for m in batch.messages if m is not in_flight])
        except psycopg.Error as error:
            # Still no database: the leases run out and the messages are claimed again.
            log.warning("slot %s could not recover its batch: %s", self.index, error)


def _exec(conn: psycopg.Connection[Any], command: bytes, culprit: Message) -> str | None:
    """Run ``command`` straight through libpq (``Connection.pgconn``): it runs around every handler,
    and psycopg's cursor machinery cost more than the command itself. Returns the first value of a
    result with rows. A transaction found gone raises ``_TransactionEnded``; any other failure is
    raised as psycopg would raise it."""
    if conn.info.transaction_status is psycopg.pq.TransactionStatus.IDLE:
        raise _TransactionEnded(culprit)
    result = conn.pgconn.exec_(command)
    if result.status == psycopg.pq.ExecStatus.TUPLES_OK:
        value = result.get_value(0, 0) if result.ntuples else None
        return value.decode() if value is not None else None
    if result.status != psycopg.pq.ExecStatus.COMMAND_OK:
        if conn.pgconn.status != psycopg.pq.ConnStatus.OK:
            raise psycopg.OperationalError(conn.pgconn.error_message.decode(errors="replace"))
        sqlstate = result.error_field(psycopg.pq.DiagnosticField.SQLSTATE)
        code = sqlstate.decode() if sqlstate else ""
        if code in _ENDED:
            raise _TransactionEnded(culprit)
        message = (result.error_message or b"savepoint failed").decode(errors="replace")
        raise psycopg.errors.lookup(code)(message) if code else psycopg.DatabaseError(message)
    return None


async def _awaitable(value: Any) -> Any:
    try:
        return await value
    except (SystemExit, KeyboardInterrupt) as error:
        # Escaping a task, these two stop the event loop and leave its tasks pending, to run in a
        # later handler's transaction: returned, they fail this attempt only.
        return error


def _log_fields(message: Message, error_type: str | None = None, **more: Any) -> dict[str, Any]:
    return message_fields(message, error_type=error_type, **more)

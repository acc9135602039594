"""The inbox worker: claims heads of keys, runs handlers, commits effects with the "done" mark.

One process runs ``concurrency`` slots (threads), each with its own connection. A slot claims a
batch (one short transaction that counts a delivery on each message), then processes the batch in
one transaction: every message in its own savepoint, its handler's effects and its done mark (or
its failure record) committed together. Retries are rows with a later ``available_at``; nothing
waits in memory. LISTEN/NOTIFY wakes idle slots; polling is the fallback.
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

from service import metrics
from service.breaker import BreakerSettings, BreakerState, CircuitBreaker
from service.classify import Classification, Classifier, fingerprint
from service.clock import Clock, SystemClock
from service.db import query
from service.handlers import Context, Message, Registry
from service.logs import message_fields
from service.outcomes import Permanent
from service.policy import DeadLetter, FailureKind, RetryAt, RetryPolicy, decide
from service.runtime import Presence, Wakeup, process_id

__all__ = ["Worker", "WorkerSettings"]

log = logging.getLogger("postbox.worker")

_MESSAGE_FIELDS = (
    "id", "consumer", "message_id", "key", "sequence", "type", "schema_version", "payload", "headers",
    "correlation_id", "causation_id", "source", "received_at", "attempt", "first_failed_at", "last_error",
)  # fmt: skip


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

    @property
    def lease_seconds(self) -> float:
        return self.lease if self.lease is not None else self.handler_timeout * self.batch_size + 30.0


class _Stop(Exception):
    """Raised inside a slot when the worker aborts after its grace period."""


class _HandlerEndedTransaction(Permanent):
    """A handler committed or rolled back the worker's transaction: a bug in the handler."""

    def __init__(self, message: Message) -> None:
        self.message = message
        super().__init__(
            f"the handler of {message.message_id} committed or rolled back ctx.conn; handlers must leave the "
            "transaction to the worker (its effects may now repeat)"
        )


class Worker:
    """A worker process's machinery. ``run()`` blocks until ``stop()``; tests use ``start()``."""

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
        self._stopping = threading.Event()
        self._aborting = threading.Event()
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
        self._threads: list[threading.Thread] = []
        self._slots: list[_Slot] = []
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
        self._threads = [
            threading.Thread(target=s.run, name=f"postbox-slot-{s.index}", daemon=True) for s in self._slots
        ]
        self._threads.append(
            threading.Thread(target=self.presence.beat_forever, name="postbox-heartbeat", daemon=True)
        )
        self._threads.append(threading.Thread(target=self._watchdog, name="postbox-watchdog", daemon=True))
        if self.settings.listen:
            self._threads.append(
                threading.Thread(target=self.wakeup.listen_forever, name="postbox-listen", daemon=True)
            )
        for t in self._threads:
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
        """Stop at once: running handlers' queries are cancelled and their messages released."""
        self._aborting.set()
        self.stop()
        for slot in self._slots:
            slot.cancel()

    def join(self, grace: float | None = None) -> None:
        """Wait for the slots to finish; after ``grace`` seconds abort what is still running."""
        deadline = time.monotonic() + (self.settings.grace_period if grace is None else grace)
        for t in self._threads:
            if t.name.startswith("postbox-slot"):
                t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads if t.name.startswith("postbox-slot")):
            self.abort()
            for t in self._threads:
                if t.name.startswith("postbox-slot"):
                    t.join(10)
        for t in self._threads:
            if not t.name.startswith("postbox-slot"):
                t.join(5)
        self.presence.unregister()
        self._emit("stopped", worker=self.id)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def ready(self) -> bool:
        """For ``/readyz``: running, and the last heartbeat reached the database in time."""
        return not self.stopping and self.presence.healthy()

    def _reaped(self, released: int) -> None:
        self._emit("reaped", released=released)
        self.wakeup.notify()

    def _watchdog(self) -> None:
        while not self._stopping.wait(0.05) or any(s.busy for s in self._slots):
            now = time.monotonic()
            for slot in self._slots:
                slot.check_deadline(now)
            if self._stopping.is_set() and not any(
                t.is_alive() for t in self._threads if t.name.startswith("postbox-slot")
            ):
                return

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


class _Slot:
    """One claim-and-process loop with its own connection."""

    def __init__(self, worker: Worker, index: int) -> None:
        self.worker = worker
        self.index = index
        self.settings = worker.settings
        self.conn: psycopg.Connection[Any] | None = None
        self.busy = False
        self._deadline: float | None = None
        self._timed_out = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: Engine | None = None
        self._sa: tuple[SAConnection, RootTransaction] | None = None
        self._durations: dict[int, float] = {}

    # --- connection ------------------------------------------------------------------------

    def _connect(self) -> psycopg.Connection[Any]:
        backoff = 0.05
        while True:
            try:
                conn = psycopg.connect(
                    self.worker.url,
                    autocommit=False,
                    application_name=f"postbox-worker:{self.settings.consumer}",
                    options=f"-c idle_in_transaction_session_timeout={int(self.settings.lease_seconds * 1000)}",
                )
                self._engine = None
                return conn
            except psycopg.OperationalError as error:
                if self.worker.stopping:
                    raise _Stop from error
                log.warning("slot %s cannot connect: %s", self.index, error)
                time.sleep(backoff + self.worker.rng.uniform(0, backoff))
                backoff = min(backoff * 2, 5.0)

    def _session_factory(self) -> Session:
        """A SQLAlchemy Session joined to this slot's open transaction (savepoints for its commits)."""
        assert self.conn is not None
        if self._engine is None:
            raw = self.conn
            self._engine = create_engine(
                "postgresql+psycopg://",
                creator=lambda: raw,
                poolclass=StaticPool,
                pool_reset_on_return=None,
            )
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
                except psycopg.OperationalError as error:
                    log.warning("slot %s lost its connection: %s", self.index, error)
                    self._reconnect()
                except _Stop:
                    raise
                except Exception:  # a slot must never die: log, reset the connection, go on
                    log.exception("slot %s failed; resetting its connection", self.index)
                    self._reconnect()
        except _Stop:
            pass
        finally:
            if self._loop is not None:
                self._loop.close()
            if self.conn is not None:
                self.conn.close()

    def _reconnect(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self._sa = None
        self.conn = self._connect()

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

    def _process(self, batch: list[Message]) -> None:
        assert self.conn is not None
        conn = self.conn
        done: list[Message] = []
        failures: list[_Failure] = []
        unrun: list[Message] = []
        in_flight: Message | None = None
        self._durations = {}
        try:
            savepoint = False
            for i, message in enumerate(batch):
                if self.worker._aborting.is_set() or (
                    i > 0 and self.worker.breaker.state is not BreakerState.CLOSED
                ):
                    unrun = batch[i:]  # given back untouched: not an attempt
                    break
                policy = self._policy(message)
                if message.attempt > policy.max_attempts:
                    # Every delivery counted at claim: a message that kept killing its worker ends here.
                    failures.append(self._exhausted(message, policy))
                    continue
                if savepoint:
                    _next_savepoint(conn)
                else:
                    conn.execute("SAVEPOINT m")  # psycopg begins the batch's transaction
                savepoint = True
                in_flight = message
                metrics.record_start(message, self.worker.clock.now())
                started = time.monotonic()
                error = self._run_handler(message)
                duration_ms = (time.monotonic() - started) * 1000.0
                metrics.record_handler(message, duration_ms / 1000.0)
                self._durations[message.id] = duration_ms
                in_flight = None
                if conn.info.transaction_status is psycopg.pq.TransactionStatus.IDLE:
                    raise _HandlerEndedTransaction(message)
                if error is None:
                    done.append(message)
                    self._breaker_record(False)
                    continue
                if conn.closed or conn.broken:
                    raise psycopg.OperationalError("connection lost during the handler") from error
                conn.execute("ROLLBACK TO SAVEPOINT m")
                failure = self._failure(message, error, duration_ms)
                self._breaker_record(failure.classification.kind is FailureKind.TRANSIENT)
                failures.append(failure)
            self._finish(done, failures, unrun)
        except psycopg.OperationalError:
            self._recover(batch, in_flight, done, failures)
            raise
        except _HandlerEndedTransaction as error:
            # Dead-letter the culprit (retrying would repeat the damage) and give the rest back.
            log.error("slot %s: %s", self.index, error)
            self._rollback()
            self._write_failure(self._failure(error.message, error), self.worker.clock.now())
            self._release([m for m in batch if m is not error.message])
            conn.commit()
            self.worker._emit("batch_failed", ids=[m.id for m in batch], error=str(error))
        except psycopg.Error as error:
            # The batch's transaction failed as a whole (a serialization failure, a constraint
            # checked at commit): nothing of it committed. Give every message back untouched;
            # they are claimed again at once.
            log.warning("slot %s: batch rolled back (%s); releasing it", self.index, error)
            self._rollback()
            self._release(batch)
            self.worker._emit("batch_failed", ids=[m.id for m in batch], error=str(error))

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
        self._timed_out = False
        self._deadline = time.monotonic() + timeout
        self.busy = True
        try:
            result = spec.func(message, ctx)
            if inspect.isawaitable(result):
                result = self._event_loop().run_until_complete(asyncio.wait_for(_awaitable(result), timeout))
            ctx._close_session()
            if isinstance(result, BaseException):
                return result
            if self._timed_out:
                return TimeoutError(f"handler exceeded its time limit of {timeout:g} s")
            return None
        except _Stop:
            raise
        except BaseException as error:
            if isinstance(error, KeyboardInterrupt | SystemExit):
                raise
            if self._timed_out or isinstance(error, asyncio.TimeoutError):
                return TimeoutError(f"handler exceeded its time limit of {timeout:g} s")
            return error
        finally:
            self.busy = False
            self._deadline = None
            if ctx._session is not None:
                try:
                    ctx._session.close()
                except Exception:
                    log.debug("closing the handler's session failed", exc_info=True)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop

    def check_deadline(self, now: float) -> None:
        if self.busy and self._deadline is not None and now > self._deadline and not self._timed_out:
            self._timed_out = True
            self.cancel()

    def cancel(self) -> None:
        conn = self.conn
        if conn is not None and not conn.closed and self.busy:
            try:
                conn.cancel_safe(timeout=2.0)
            except Exception:
                log.debug("cancel failed", exc_info=True)

    def _failure(self, message: Message, error: BaseException, duration_ms: float | None = None) -> _Failure:
        spec = self.worker.registry.lookup(message.consumer, message.type)
        classification = self.worker.classifier.classify(error)
        now = self.worker.clock.now()
        decision = decide(
            self._policy(message),
            classification.kind,
            attempt=message.attempt,
            now=now,
            first_failed_at=message.first_failed_at,
            received_at=message.received_at,
            rng=self.worker.rng,
            explicit_delay=classification.retry_after,
            idempotent=spec.idempotent if spec else False,
        )
        log.info(
            "attempt failed: %s",
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
            message,
            decision,
            classification,
            spec.on_dead_letter if spec else None,
            duration_ms,
            classification.kind.value,
        )

    def _exhausted(self, message: Message, policy: RetryPolicy) -> _Failure:
        text = message.last_error or "worker died during the attempt"
        classification = Classification(
            FailureKind.TRANSIENT, "LeaseExpired", text, "", None, "delivery count"
        )
        decision = DeadLetter(
            "attempts_exhausted",
            f"delivered {message.attempt} times, over max_attempts {policy.max_attempts}: {text}",
        )
        spec = self.worker.registry.lookup(message.consumer, message.type)
        return _Failure(
            message, decision, classification, spec.on_dead_letter if spec else None, None, "lease_expired"
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

    def _recover(
        self,
        batch: list[Message],
        in_flight: Message | None,
        done: list[Message],
        failures: list[_Failure],
    ) -> None:
        """The connection died mid-batch: nothing of the batch committed. On a new connection,
        record the attempt that was running as a transient failure and give the others back."""
        try:
            self._reconnect()
            assert self.conn is not None
            if in_flight is not None:
                error = ConnectionError("database connection lost during the handler")
                self._write_failure(self._failure(in_flight, error), self.worker.clock.now())
            self._release([m for m in batch if m is not in_flight])
        except psycopg.Error as error:
            # Still no database: the leases run out and the messages are claimed again.
            log.warning("slot %s could not recover its batch: %s", self.index, error)


def _next_savepoint(conn: psycopg.Connection[Any]) -> None:
    """The next message's savepoint, in the batch's open transaction, sent through libpq directly
    (``Connection.pgconn``): it runs before every handler, and psycopg's cursor machinery cost more
    than the command itself. A failure is raised as psycopg would raise it."""
    result = conn.pgconn.exec_(b"RELEASE SAVEPOINT m; SAVEPOINT m")
    if result.status != psycopg.pq.ExecStatus.COMMAND_OK:
        if conn.pgconn.status != psycopg.pq.ConnStatus.OK:
            raise psycopg.OperationalError(conn.pgconn.error_message.decode(errors="replace"))
        sqlstate = result.error_field(psycopg.pq.DiagnosticField.SQLSTATE)
        message = (result.error_message or b"savepoint failed").decode(errors="replace")
        raise (
            psycopg.errors.lookup(sqlstate.decode())(message) if sqlstate else psycopg.DatabaseError(message)
        )


async def _awaitable(value: Any) -> Any:
    return await value


def _log_fields(message: Message, error_type: str | None = None, **more: Any) -> dict[str, Any]:
    return message_fields(message, error_type=error_type, **more)

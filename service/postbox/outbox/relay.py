"""The outbox relay: publishes committed outbox rows to their destinations, per key in order.

For each destination, ``concurrency`` loops claim a batch of heads (one short transaction that
counts an attempt on each), publish it through the destination's transport, and record the
outcome in one transaction: confirmed rows leave the outbox and the next row of each key becomes
its head; failed ones are retried with backoff (their key waits) or dead-lettered (their key is
blocked, or skipped). A row is never lost; it may be published twice (a confirmation lost to a
crash), which the receiver absorbs by ``message_id``.

``Relay(database_url, transports, concurrency=2, ...)`` (any :class:`RelaySettings` field as a
keyword) runs as the ``postbox relay`` command does, or embedded in a program like a worker
(:class:`postbox.operations.lifecycle.Embeddable`: threads, ``with relay:``, or
``async with relay.running():``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import set_json_loads

from postbox.clock import Clock, SystemClock
from postbox.config.urls import libpq_url
from postbox.db import query
from postbox.db.connector import int_array, run
from postbox.failures.classify import Classifier, fingerprint
from postbox.failures.policy import DeadLetter, RetryAt, RetryPolicy, decide
from postbox.operations import metrics, tracing
from postbox.operations.lifecycle import Embeddable, claim, connect_with_backoff, helper_threads
from postbox.operations.runtime import Presence, Wakeup, process_id
from postbox.operations.tracing import trace_id
from postbox.outbox.transports import OutboxRow, Transport
from postbox.values import from_json

__all__ = ["Relay", "RelaySettings"]

log = logging.getLogger("postbox.relay")

_ROW_FIELDS = (
    "id", "destination", "message_id", "key", "type", "payload", "headers", "correlation_id", "causation_id",
    "created_at", "attempt", "first_failed_at",
)  # fmt: skip


@dataclass(frozen=True)
class RelaySettings:
    """How a relay process runs. Times are seconds."""

    concurrency: int = 1
    batch_size: int = 100
    poll_interval: float = 1.0
    listen: bool = True
    lease: float = 60.0
    heartbeat_interval: float = 5.0
    stale_after: float = 30.0
    grace_period: float = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    on_dead_letter: str = "block"

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.batch_size < 1:
            raise ValueError("postbox: concurrency and batch_size must be at least 1")
        if self.on_dead_letter not in ("block", "skip"):
            raise ValueError("postbox: a destination's on_dead_letter is block or skip")
        if self.stale_after <= self.heartbeat_interval:
            raise ValueError("postbox: stale_after must be longer than heartbeat_interval")

    @classmethod
    def build(cls, settings: RelaySettings | None, options: dict[str, Any]) -> RelaySettings:
        """Settings given whole, or built from keyword options (field names)."""
        if settings is not None and options:
            raise TypeError("postbox: give either settings or options, not both")
        unknown = set(options) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"postbox: unknown relay options: {', '.join(sorted(unknown))}")
        return settings if settings is not None else cls(**options)


class Relay(Embeddable):
    """Relays the outbox rows of the given destinations. ``run()`` blocks until ``stop()``;
    ``start()``/``stop()``/``join()``, ``with relay:`` or ``async with relay.running():`` run it
    embedded in a program."""

    def __init__(
        self,
        url: str,
        transports: Mapping[str, Transport | Callable[[], Transport]],
        settings: RelaySettings | None = None,
        *,
        policies: Mapping[str, RetryPolicy] | None = None,
        dead_letter_policies: Mapping[str, str] | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        on_event: Callable[[str, dict[str, Any]], None] | None = None,
        **options: Any,
    ) -> None:
        settings = RelaySettings.build(settings, options)
        if not transports:
            raise ValueError("postbox: a relay needs at least one destination")
        self.url = libpq_url(url)
        # A factory gives every loop its own transport (broker clients are not thread-safe); a
        # shared instance is used by one loop at a time.
        self.transports = dict(transports)
        self._locks = {name: threading.Lock() for name in self.transports}
        self.settings = settings
        self.policies = dict(policies or {})
        self.dead_letter_policies = dict(dead_letter_policies or {})
        self.clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.on_event = on_event
        self.classifier = Classifier()
        self.id = process_id()
        self._stopping = threading.Event()
        self.wakeup = Wakeup(
            url, "postbox_outbox", set(self.transports), settings.poll_interval, self._stopping
        )
        self.presence = Presence(
            url,
            id=self.id,
            kind="relay",
            queue=",".join(sorted(self.transports))[:200],
            concurrency=settings.concurrency * len(self.transports),
            interval=settings.heartbeat_interval,
            stale_after=settings.stale_after,
            clock=self.clock,
            stopping=self._stopping,
            on_reaped=lambda n: self.wakeup.notify(),
        )
        self._loops: list[threading.Thread] = []
        self._helpers: list[threading.Thread] = []

    def start(self) -> None:
        self._starting()
        self.presence.beat()
        for destination in self.transports:
            for i in range(self.settings.concurrency):
                loop = _Loop(self, destination)
                self._loops.append(
                    threading.Thread(target=loop.run, name=f"postbox-relay-{destination}-{i}", daemon=True)
                )
        self._helpers = helper_threads(self.presence, self.wakeup, listen=self.settings.listen)
        for t in [*self._loops, *self._helpers]:
            t.start()
        log.info(
            "relay started",
            extra={"event": "relay_started", "worker": self.id, "destinations": sorted(self.transports)},
        )

    def stop(self) -> None:
        self._stopping.set()
        self.wakeup.notify()

    def ready(self) -> bool:
        """For ``/readyz``: running, and the last heartbeat reached the database in time."""
        return not self.stopping and self.presence.healthy()

    def join(self, grace: float | None = None) -> None:
        """Wait for the loops to finish their batch (publishing and recording it)."""
        deadline = time.monotonic() + (self.settings.grace_period if grace is None else grace)
        for t in self._loops:
            t.join(max(0.0, deadline - time.monotonic()))
        self.presence.finish()  # beat until here: a draining process is alive
        for t in self._helpers:
            t.join(5)
        for transport in self.transports.values():
            if not callable(transport):
                transport.close()
        self.presence.unregister()
        self._emit("stopped", relay=self.id)

    def _emit(self, event: str, **data: Any) -> None:
        if self.on_event is not None:
            self.on_event(event, data)


class _Loop:
    """One claim-publish-record loop for one destination, with its own connection."""

    def __init__(self, relay: Relay, destination: str) -> None:
        self.relay = relay
        self.destination = destination
        made = relay.transports[destination]
        self.transport: Transport = made() if callable(made) else made
        self._shared = not callable(made)
        self._lock = relay._locks[destination]
        self.policy = relay.policies.get(destination, relay.settings.retry)
        self.on_dead_letter = relay.dead_letter_policies.get(destination, relay.settings.on_dead_letter)
        self.conn: psycopg.Connection[Any] | None = None
        self._in_flight: list[OutboxRow] = []  # claimed, not yet recorded

    def _connect(self) -> psycopg.Connection[Any]:
        conn = connect_with_backoff(
            lambda: psycopg.connect(self.relay.url, application_name=f"postbox-relay:{self.destination}"),
            stopping=lambda: self.relay.stopping,
            rng=self.relay.rng,
            what="relay",
        )
        set_json_loads(from_json, conn)  # json.loads's results, faster (every claimed row parses)
        return conn

    def run(self) -> None:
        try:
            self.conn = self._connect()
        except psycopg.OperationalError:
            return
        while not self.relay.stopping:
            generation = self.relay.wakeup.generation
            try:
                rows = self._claim()
                if not rows:
                    self.relay.wakeup.wait(generation)
                    continue
                self._in_flight = rows
                self._relay(rows)
                self._in_flight = []
            except Exception:  # a loop must never die: log, reset the connection, go on
                log.exception("relay loop for %s failed; reconnecting", self.destination)
                if self.conn is not None:
                    self.conn.close()
                try:
                    self.conn = self._connect()
                except psycopg.OperationalError:
                    return
                self._give_back()
        if self.conn is not None:
            self.conn.close()
        if not self._shared:
            self.transport.close()

    def _claim(self) -> list[OutboxRow]:
        assert self.conn is not None
        rows = claim(
            self.conn,
            query("outbox_claim"),
            {"destination": self.destination, "worker": self.relay.id, "limit": self.relay.settings.batch_size,
             "lease": self.relay.settings.lease, "now": self.relay.clock.now()},
        )  # fmt: skip
        return [OutboxRow(**dict(zip(_ROW_FIELDS, r, strict=True))) for r in rows]

    def _give_back(self) -> None:
        """After a lost connection, release the batch that was not recorded (fenced by attempt), so
        its keys go on now instead of after the lease; a row already published goes out again."""
        rows, self._in_flight = self._in_flight, []
        if not rows or self.conn is None:
            return
        try:
            run(
                self.conn,
                query("outbox_release"),
                {
                    "ids": [r.id for r in rows],
                    "attempts": [r.attempt for r in rows],
                    "now": self.relay.clock.now(),
                },
            )
            self.conn.commit()
        except psycopg.Error as error:  # still no database: the lease runs out instead
            log.warning("relay could not give back its batch: %s", error)

    def _relay(self, rows: list[OutboxRow]) -> None:
        with tracing.relaying(self.transport, self.destination, rows) as span:
            self._relay_batch(rows, span)

    def _relay_batch(self, rows: list[OutboxRow], span: tracing.SpanHandle) -> None:
        assert self.conn is not None
        started = time.monotonic()
        try:
            if self._shared:
                with self._lock:
                    results = self.transport.publish(rows)
            else:
                results = self.transport.publish(rows)
        except Exception as bug:  # a transport bug fails the batch, transiently
            log.exception("transport %s raised", self.destination)
            results = [bug] * len(rows)
        if len(results) != len(rows):
            results = [RuntimeError("transport returned a wrong number of results")] * len(rows)
        duration_ms = (time.monotonic() - started) * 1000.0
        metrics.RELAY_SECONDS.labels(self.destination).observe(duration_ms / 1000.0)
        now = self.relay.clock.now()
        published = [r for r, e in zip(rows, results, strict=True) if e is None]
        if published:
            lost = run(
                self.conn,
                query("outbox_complete"),
                {
                    "ids": int_array([r.id for r in published]),
                    "attempts": int_array([r.attempt for r in published]),
                    "now": now,
                },
            )
            if lost and lost[0][0]:
                # Another relay took these over after our lease ran out: they were published
                # twice, which receivers absorb by message_id.
                log.warning("relay claims lost for %s", lost[0][0])
        for row, error in zip(rows, results, strict=True):
            if error is not None:
                self._record_failure(row, error, now, duration_ms, span)
        self.conn.commit()
        metrics.RELAY_PUBLISHED.labels(self.destination).inc(len(published))
        self.relay._emit("published", destination=self.destination, ids=[r.id for r in published])

    def _record_failure(
        self,
        row: OutboxRow,
        error: BaseException,
        now: datetime,
        duration_ms: float,
        span: tracing.SpanHandle,
    ) -> None:
        assert self.conn is not None
        c = self.relay.classifier.classify(error)
        d = decide(
            self.policy, c.kind, attempt=row.attempt, now=now, first_failed_at=row.first_failed_at,
            received_at=row.created_at, rng=self.relay.rng, explicit_delay=c.retry_after,
            idempotent=True,  # destinations deduplicate by message_id: the relay is at-least-once
        )  # fmt: skip
        tracing.relay_failed(span, row.message_id, error, c.error_type, d.kind)
        common = {
            "id": row.id, "attempt": row.attempt, "now": now, "error": c.message, "error_type": c.error_type,
            "kind": c.kind.value, "traceback": c.traceback or None, "worker": self.relay.id,
            "duration_ms": duration_ms, "explanation": d.explanation,
        }  # fmt: skip
        log.info(
            "publish failed: %s",
            d.explanation,
            extra={
                "event": "publish_failed",
                "destination": self.destination,
                "message_id": row.message_id,
                "key": row.key,
                "type": row.type,
                "attempt": row.attempt,
                "error_type": c.error_type,
                "correlation_id": row.correlation_id,
                "causation_id": row.causation_id,
                "trace_id": trace_id(row.headers),
                "worker": self.relay.id,
                "decision": d.kind,
            },
        )
        metrics.RELAY_FAILED.labels(self.destination, c.kind.value, c.error_type or "").inc()
        if isinstance(d, DeadLetter):
            metrics.RELAY_DEAD_LETTERED.labels(self.destination, d.reason).inc()
        if isinstance(d, RetryAt):
            run(self.conn, query("outbox_retry"), {**common, "retry_at": d.at})
        else:
            assert isinstance(d, DeadLetter)
            run(
                self.conn,
                query("outbox_dead_letter"),
                {**common, "reason": d.reason, "fingerprint": fingerprint(c.error_type, c.message),
                 "policy": self.on_dead_letter},
            )  # fmt: skip

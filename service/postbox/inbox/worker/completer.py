"""The completer: writes a batch's outcomes in its transaction and commits them. Done marks,
retries (rows with a later ``available_at``), dead letters, messages given back untouched; and
the settling of batches whose transaction a handler ended, whose connection died, or whose slot
was abandoned."""

from __future__ import annotations

import logging
from datetime import datetime

import psycopg

from postbox.db import query
from postbox.db.connector import int_array, run
from postbox.failures.breaker import BreakerState
from postbox.failures.classify import Classification, fingerprint
from postbox.failures.policy import DeadLetter, FailureKind, RetryAt, RetryPolicy, decide
from postbox.inbox.connection import HandlerEndedTransaction
from postbox.inbox.handlers import Message
from postbox.inbox.worker.base import SlotBase
from postbox.inbox.worker.batch import Batch, Failure, log_fields
from postbox.inbox.worker.settings import HandlerTimeout, SlotStop, WorkerShutdown
from postbox.operations import metrics
from postbox.operations.logs import error_text

__all__ = ["Completer"]

log = logging.getLogger("postbox.worker")

RECOVER_TRIES = 5
"""Connections a slot tries, one after the other, to settle a batch whose connection was lost."""


class Completer(SlotBase):
    """A slot's part that records outcomes and ends the batch's transaction."""

    def _settle_ended(self, batch: Batch, culprit: Message) -> None:
        """A handler committed or rolled back the batch's transaction with SQL. Whatever it left open
        is rolled back; what ran before it is settled by what happened to it: committed effects
        are marked done now (never run again), rolled-back ones are given back with their attempt
        intact. The culprit is dead-lettered: with a batch handler, every message of the call, whose
        effects it may have committed with its own (run again, they would be doubled)."""
        self._rollback()
        self._charge_ended(batch, culprit, self._committed(batch))

    def _committed(self, batch: Batch) -> bool:
        """Whether the batch's transaction committed (a handler's ``COMMIT``: the worker commits
        only once every handler has returned)."""
        assert self.conn is not None
        if batch.xid is None:
            return False
        rows = run(self.conn, query("worker_transaction_status"), {"xid": batch.xid})
        return bool(rows) and rows[0][0] == "committed"

    def _charge_ended(self, batch: Batch, culprit: Message, committed: bool) -> None:
        """Settle a batch whose transaction ``culprit``'s handler ended: what ran before it by what
        happened to it, the culprit (every message of its call, for a batch handler) dead-lettered."""
        how = "committed" if committed else "rolled back"
        culprits = batch.calls.get(culprit.id, [culprit])
        own = (
            "its own effects up to that point may have been committed"
            if len(culprits) == 1
            else f"it was a batch handler's call of {len(culprits)} messages, whose effects up to that point "
            "may have been committed: each of them is dead-lettered, never run again"
        )
        error = HandlerEndedTransaction(
            f"the handler ended the worker's transaction with SQL (COMMIT or ROLLBACK): handlers must "
            f"leave it to the worker. The messages before it in its batch were {how} by it"
            + (" and are marked done" if committed else " and are given back")
            + f"; {own}"
        )
        log.error(
            "slot %s: %s",
            self.index,
            error,
            extra=log_fields(culprit, "HandlerEndedTransaction", event="handler_ended_transaction"),
        )
        charged = {id(m) for m in culprits}
        before = [m for m in batch.done if id(m) not in charged]
        done = before if committed else []
        after = [m for m in batch.after(culprit) if id(m) not in charged]
        give_back = ([] if committed else before) + after + batch.unrun
        failures = [*batch.failures, *(self._failure(m, error) for m in culprits)]
        self._finish(done, failures, give_back)

    def _breaker_record(self, transient_failure: bool, key: str, successes: int = 1) -> None:
        """Record an attempt's outcome in the breaker (or ``successes`` attempts that succeeded, a
        batch handler's call) and log a change of its state."""
        breaker = self.worker.breaker
        before = breaker.state
        after = breaker.record(transient_failure, key, 1 if transient_failure else successes)
        if after is not before:
            metrics.record_breaker(self.settings.consumer, after.value)
            level = logging.WARNING if after is BreakerState.OPEN else logging.INFO
            why = f": {breaker.describe()}" if after is BreakerState.OPEN else ""
            log.log(
                level,
                "circuit %s for consumer %s%s",
                after.value,
                self.settings.consumer,
                why,
                extra={"event": f"breaker_{after.value}", "consumer": self.settings.consumer},
            )
            self.worker._emit(f"breaker_{after.value}", consumer=self.settings.consumer)

    def _policy(self, message: Message) -> RetryPolicy:
        spec = self.worker.registry.lookup(message.consumer, message.type)
        if spec is not None and spec.retry is not None:
            return spec.retry
        return self.worker.registry.retry_policies.get(message.consumer, self.settings.retry)

    def settle_only(self) -> None:
        """Settle the inheritance on a connection of this slot's own, then close it (no claiming)."""
        try:
            self.conn = self._connect(for_handlers=False)
            self._settle_inheritance()
        except (SlotStop, psycopg.Error) as error:
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
        inheritance = self._inheritance
        if inheritance is None:
            return
        conn = self.conn
        if inheritance.backend_pid is not None and inheritance.backend_pid != conn.info.backend_pid:
            run(conn, query("worker_terminate_backend"), {"pid": inheritance.backend_pid})
            conn.commit()
            inheritance.backend_pid = None  # done: a later try must not hit a reused pid
        batch = inheritance.batch
        if batch is None:
            self._inheritance = None
            return
        in_flight = inheritance.in_flight
        if in_flight is not None and self._committed(batch):
            # The handler in flight had ended the batch's transaction with a COMMIT before it hung
            # or died: what ran before it is durable (and so may be its own effects).
            self._charge_ended(batch, in_flight, committed=True)
            self._inheritance = None
            return
        failures = list(batch.failures)
        give_back = [*batch.done, *batch.unrun]
        if in_flight is not None:
            error = inheritance.error or RuntimeError("the slot stopped")
            now_retry = 0.0 if isinstance(error, WorkerShutdown) else None
            failures.append(self._failure(in_flight, error, None, explicit_delay=now_retry))
            give_back += batch.after(in_flight)
        else:
            ran = {id(m) for m in batch.done} | {id(f.message) for f in batch.failures}
            give_back += [m for m in batch.messages if id(m) not in ran and m not in batch.unrun]
        self._finish([], failures, give_back)
        self._inheritance = None  # settled: a slot that dies before this passes it on (abandon)

    def _failure(
        self,
        message: Message,
        error: BaseException,
        duration_ms: float | None = None,
        *,
        explicit_delay: float | None = None,
    ) -> Failure:
        spec = self.worker.registry.lookup(message.consumer, message.type)
        classification = self._classified(error)
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
            extra=log_fields(
                message,
                classification.error_type,
                event="attempt_failed",
                error=error_text(classification.message),
                worker=self.worker.id,
                decision="retry" if isinstance(decision, RetryAt) else "dead_letter",
                duration_ms=None if duration_ms is None else round(duration_ms, 3),
            ),
        )
        return Failure(
            message, decision, classification, spec.on_dead_letter if spec else None, duration_ms, kind
        )

    def _classified(self, error: BaseException) -> Classification:
        """The error's classification; if classifying it fails (a bug, in a rule or here), a
        transient failure that says so: the attempt is recorded against its own message either
        way, rather than the slot failing with the batch claimed."""
        try:
            return self.worker.classifier.classify(error)
        except Exception as bug:
            log.exception("slot %s: classifying a handler's %s failed", self.index, type(error).__name__)
            return Classification(
                FailureKind.TRANSIENT, type(error).__name__,
                f"postbox could not classify this error ({type(bug).__name__}: {bug})", "", None, "unclassifiable",
            )  # fmt: skip

    def _exhausted(self, message: Message, policy: RetryPolicy) -> Failure:
        text = message.last_error or "worker died during the attempt"
        error_type = message.last_error_type or "LeaseExpired"
        classification = Classification(FailureKind.TRANSIENT, error_type, text, "", None, "delivery count")
        decision = DeadLetter(
            "attempts_exhausted",
            f"attempt {message.attempt - 1} of {policy.max_attempts} was the last: {text}",
        )
        spec = self.worker.registry.lookup(message.consumer, message.type)
        return Failure(
            message,
            decision,
            classification,
            spec.on_dead_letter if spec else None,
            None,
            "lease_expired",
            policy.max_attempts,
        )

    def _finish(self, done: list[Message], failures: list[Failure], unrun: list[Message]) -> None:
        """Write the batch's outcomes in its transaction and commit; roll back if a claim was lost."""
        assert self.conn is not None
        conn = self.conn
        now = self.worker.clock.now()
        lost: set[int] = set()
        if done:
            rows = run(
                conn,
                query("inbox_complete"),
                {
                    "ids": int_array([m.id for m in done]),
                    "attempts": int_array([m.attempt for m in done]),
                    "now": now,
                },
            )
            lost = set(rows[0][0]) if rows and rows[0][0] else set()
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
            run(
                conn,
                query("inbox_release"),
                {"ids": [m.id for m in unrun], "attempts": [m.attempt for m in unrun], "now": now},
            )
        self._commit()
        self._observe(done, failures, now)
        if done:
            self.worker._emit("completed", ids=[m.id for m in done])
        for f in failures:
            self.worker._emit(f.decision.kind, id=f.message.id, reason=f.decision.explanation)

    def _observe(self, done: list[Message], failures: list[Failure], now: datetime) -> None:
        """Metrics and log lines of a committed batch."""
        durations, self._durations = self._durations, {}
        metrics.record_successes(done, now)
        debug = log.isEnabledFor(logging.DEBUG)
        for m in done:
            if debug:
                duration = durations.get(m.id)
                log.debug(
                    "message processed",
                    extra=log_fields(
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
                    extra=log_fields(
                        f.message,
                        f.classification.error_type,
                        event="message_dead_lettered",
                        error=error_text(f.classification.message),
                        decision="dead_letter",
                        worker=self.worker.id,
                        reason=reason,
                    ),
                )

    def _write_failure(self, f: Failure, now: datetime) -> None:
        assert self.conn is not None
        m, d, c = f.message, f.decision, f.classification
        if f.max_attempts is not None:
            run(
                self.conn,
                query("inbox_exhaust"),
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
            run(self.conn, query("inbox_retry"), {**common, "retry_at": d.at, "error": c.message})
        else:
            run(
                self.conn,
                query("inbox_dead_letter"),
                {**common, "reason": d.reason, "error": c.message,
                 "fingerprint": fingerprint(c.error_type, c.message), "policy": f.policy},
            )  # fmt: skip

    def _release(self, messages: list[Message]) -> None:
        if not messages:
            return
        assert self.conn is not None
        run(
            self.conn,
            query("inbox_release"),
            {"ids": [m.id for m in messages], "attempts": [m.attempt for m in messages],
             "now": self.worker.clock.now()},
        )  # fmt: skip
        self.conn.commit()

    def _recover(self, batch: Batch) -> None:
        """The connection died mid-batch: nothing of the batch committed. On a new connection,
        record the attempt that was running as a transient failure and give the others back."""
        in_flight = batch.in_flight
        failures = []
        if in_flight is not None:
            error = ConnectionError("database connection lost during the handler")
            failures.append(self._failure(in_flight, error))
        give_back = [m for m in batch.messages if m is not in_flight]
        tries = 0
        while tries < RECOVER_TRIES:
            tries += 1
            try:
                self._reconnect()
                assert self.conn is not None
                # Fenced by attempt: a try whose commit did reach the server makes the next a no-op.
                self._finish([], failures, give_back)
                return
            except psycopg.OperationalError as error:  # lost again: a new connection, again
                last: psycopg.Error = error
            except psycopg.Error as error:
                last = error
                break
        # Still no database: the leases run out and the messages are claimed again.
        log.warning("slot %s could not recover its batch after %s tries: %s", self.index, tries, last)

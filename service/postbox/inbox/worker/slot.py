"""A slot: one claim-and-process loop with its own connection, in a thread of its own.

It is made of three parts: the claim loop (:mod:`.claim`), the handler executor
(:mod:`.executor`) and the completer (:mod:`.completer`); this module processes a claimed batch
with them (one transaction, a savepoint per message) and lets the worker abandon a slot whose
handler does not return.
"""

from __future__ import annotations

import logging
import threading
import time

import psycopg

from postbox.failures.breaker import BreakerState
from postbox.failures.policy import FailureKind
from postbox.inbox.handlers import HandlerSpec, Message
from postbox.inbox.worker import savepoints
from postbox.inbox.worker.batch import Batch, Inheritance, log_fields
from postbox.inbox.worker.claim import ClaimLoop
from postbox.inbox.worker.completer import Completer
from postbox.inbox.worker.executor import Executor
from postbox.inbox.worker.settings import HandlerTimeout, TransactionEnded, WorkerShutdown
from postbox.operations import metrics, tracing

__all__ = ["Slot"]

log = logging.getLogger("postbox.worker")

# A batch whose transaction fails with an error of these SQLSTATEs (classes, or their first three
# characters) is given back as it is: nothing a handler did, and a retry may well succeed (a
# serialization failure or deadlock, a lost connection, the server short of resources or shutting
# down, a lock not available in time). A cancelled statement (57014) is not among them: a
# handler's SET LOCAL statement_timeout would repeat it without end.
_RETRY_AS_IS = ("40", "08", "53", "55", "57P", "58", "XX")


def _as_is(error: psycopg.Error) -> bool:
    return not error.sqlstate or error.sqlstate.startswith(_RETRY_AS_IS)


class Slot(ClaimLoop, Executor, Completer):
    """One claim-and-process loop with its own connection."""

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name=f"postbox-slot-{self.index}", daemon=True)
        self.started = True
        self.thread.start()

    def _process(self, messages: list[Message]) -> None:
        """Run the batch's handlers in one transaction, each in its savepoint; commit the outcomes."""
        assert self.conn is not None
        batch = Batch(messages)
        self.batch = batch
        self._durations = {}
        try:
            self._run_batch(batch)
            # The last savepoint is released by the commit: a handler that ended the transaction
            # was found when it returned, or at its next statement if it began another.
            self._finish(batch.done, batch.failures, batch.unrun)
        except TransactionEnded as ended:
            self._settle_ended(batch, ended.culprit)
        except psycopg.OperationalError as error:
            self._check_abandoned()
            conn = self.conn
            if conn is not None and not conn.closed and not conn.broken:
                # Refused by the server on a live connection (a cancelled statement, 57014): the
                # batch's transaction failed as a whole, as below.
                self._rollback()
                self._settle_refused(batch, error)
                return
            self._recover(batch)
            raise
        except psycopg.Error as error:
            self._check_abandoned()
            self._rollback()
            self._settle_refused(batch, error)
        finally:
            self.batch = None

    def _settle_refused(self, batch: Batch, error: psycopg.Error) -> None:
        """The batch's transaction failed as a whole and is rolled back: nothing of it committed.
        A serialization failure or a deadlock gives every message back untouched, claimed again at
        once, as does one of the server's (see _RETRY_AS_IS). Anything else may be a handler's doing
        that a retry would repeat without end (a ``SET LOCAL ROLE`` the completion then trips on, a
        row that breaks a constraint checked at commit): the messages are given back untouched too,
        and this slot's next claims take them one at a time; a message whose own transaction fails
        so, after its handler ran, fails its attempt with that error (retried, then dead-lettered),
        and the others are done."""
        messages = batch.messages
        ran = any(m is messages[0] for m in (*batch.done, *(f.message for f in batch.failures)))
        if len(messages) == 1 and ran and not _as_is(error):
            log.warning(
                "slot %s: the transaction of message %s could not be completed after its handler ran "
                "(%s: %s; did the handler change its role or a setting with SET?); the attempt fails",
                self.index, messages[0].message_id, type(error).__name__, error,
                extra=log_fields(messages[0], type(error).__name__, event="completion_refused"),
            )  # fmt: skip
            self._finish([], [self._failure(messages[0], error)], [])
            return
        log.warning("slot %s: batch rolled back (%s); releasing it", self.index, error)
        self._release(messages)
        if len(messages) > 1 and not _as_is(error):
            self._solo = max(self._solo, len(messages))
        self.worker._emit("batch_failed", ids=[m.id for m in messages], error=str(error))

    def _run_batch(self, batch: Batch) -> None:
        """Run the batch's messages in order, each in its savepoint; the messages of a batch
        handler run together in one call, at the first of them (they are heads of distinct keys,
        so no message of the batch waits for another). Their runs reach the metrics when they are
        over, before the batch is settled."""
        try:
            self._run_messages(batch)
        finally:
            metrics.record_runs(batch.runs)
            batch.runs.clear()

    def _run_messages(self, batch: Batch) -> None:
        assert self.conn is not None
        taken: set[int] = set()  # ids of messages already run as part of a batch handler's call
        for i, message in enumerate(batch.messages):
            if message.id in taken:
                continue
            if self.worker._aborting.is_set() or (
                i > 0 and self.worker.breaker.state is not BreakerState.CLOSED
            ):
                batch.unrun += [m for m in batch.messages[i:] if m.id not in taken]  # given back untouched
                return
            policy = self._policy(message)
            if message.attempt > policy.max_attempts:
                # Every delivery is counted at claim: a message that kept killing its worker ends here.
                batch.failures.append(self._exhausted(message, policy))
                continue
            spec = self.worker.registry.lookup(message.consumer, message.type)
            if spec is not None and spec.batch and _supports(spec, message):
                group = [message, *self._group_after(batch, i, spec, taken)]
                if len(group) > 1:
                    taken.update(m.id for m in group)
                    self._run_group(batch, spec, group)
                    continue
            if spec is not None and spec.database_only and not batch.failures:
                run = self._database_only_run(batch, i, taken)
                if len(run) > 1:
                    taken.update(m.id for m in run)
                    self._run_shared(batch, run)
                    continue
            self._open_savepoint(batch)
            self._run_one(batch, message)

    def _database_only_run(self, batch: Batch, i: int, taken: set[int]) -> list[Message]:
        """The messages from position ``i`` on, one after the other, whose handlers are declared
        database-only (not batch handlers): they may share a savepoint. Only neighbours, so that
        what follows the one running is what has not run."""
        lookup = self.worker.registry.lookup
        run: list[Message] = []
        for m in batch.messages[i:]:
            spec = lookup(m.consumer, m.type)
            if spec is None or spec.batch or not spec.database_only or not self._runs_with(spec, m, taken):
                break
            run.append(m)
        return run

    def _run_shared(self, batch: Batch, run: list[Message]) -> None:
        """Neighbours whose handlers are database-only, under one savepoint: a round trip less for
        each. A failure rolls back to that savepoint, undoing the effects of those before it with
        its own; they run again, each in its own savepoint, as does everything after it in the batch
        (nothing they did left the database, so nobody else sees it)."""
        self._open_savepoint(batch)
        for k, message in enumerate(run):
            if self._stopping():
                batch.unrun.extend(run[k:])  # given back untouched, as in _run_batch
                return
            if self._run_one(batch, message):
                continue
            undone = {id(m) for m in run[:k]}
            batch.done = [m for m in batch.done if id(m) not in undone]
            if k:
                log.info(
                    "slot %s: a database-only handler failed; the %s before it in its savepoint run again",
                    self.index,
                    k,
                    extra={"event": "shared_savepoint_split", "consumer": message.consumer, "messages": k},
                )
            self._run_each(batch, [*run[:k], *run[k + 1 :]])
            return

    def _group_after(self, batch: Batch, i: int, spec: HandlerSpec, taken: set[int]) -> list[Message]:
        """The messages after position ``i`` that ``spec`` (a batch handler) runs with it."""
        lookup = self.worker.registry.lookup
        return [
            m
            for m in batch.messages[i + 1 :]
            if lookup(m.consumer, m.type) is spec and self._runs_with(spec, m, taken)
        ]

    def _runs_with(self, spec: HandlerSpec, m: Message, taken: set[int]) -> bool:
        """Whether ``m`` may run with others (in a batch handler's call or a shared savepoint): not
        run yet, supported by its handler, not past its attempts (such messages run alone)."""
        return m.id not in taken and _supports(spec, m) and m.attempt <= self._policy(m).max_attempts

    def _stopping(self) -> bool:
        """The worker is aborting or its circuit is no longer closed: run nothing more of the batch."""
        return self.worker._aborting.is_set() or self.worker.breaker.state is not BreakerState.CLOSED

    def _run_each(self, batch: Batch, messages: list[Message]) -> None:
        """``messages`` one at a time, each in its own savepoint; what is left when the worker stops
        running the batch is given back untouched, as in _run_batch."""
        for k, m in enumerate(messages):
            if self._stopping():
                batch.unrun.extend(messages[k:])
                return
            self._open_savepoint(batch)
            self._run_one(batch, m)

    def _open_savepoint(self, batch: Batch) -> None:
        assert self.conn is not None
        if batch.savepoint:
            savepoints.next_savepoint(self.conn, batch)
        else:
            savepoints.begin(self.conn, batch)
            batch.savepoint = True

    def _run_group(self, batch: Batch, spec: HandlerSpec, group: list[Message]) -> None:
        """Several messages in one call of their batch handler, in one savepoint: all done, or
        their effects undone and each run again alone (only the one that fails fails)."""
        assert self.conn is not None
        self._open_savepoint(batch)
        first = group[0]
        batch.in_flight = first
        batch.calls.update(dict.fromkeys([m.id for m in group], group))
        with tracing.processing_batch(group) as span:
            now = self.worker.clock.now()
            started = time.monotonic()
            error = self._run_batch_handler(spec, group)
            duration_ms = (time.monotonic() - started) * 1000.0
            batch.last_run = group[-1]
            error = self._after_handler(first, error)
            batch.in_flight = None
            share = duration_ms / len(group)
            batch.runs.extend((m, now, share / 1000.0) for m in group)
            self._durations.update(dict.fromkeys([m.id for m in group], share))
            if error is None:
                batch.done.extend(group)
                self._breaker_record(False, first.key, successes=len(group))
                tracing.decided(span, "done")
                return
            savepoints.roll_back(self.conn, first)
            for m in group:  # the call's effects are undone: from here on each message answers for itself
                del batch.calls[m.id]
            tracing.decided(span, "split", error)
        log.info(
            "slot %s: the batch handler failed for %s messages (%s: %s); running them one at a time",
            self.index,
            len(group),
            type(error).__name__,
            error,
            extra={"event": "batch_split", "consumer": first.consumer, "messages": len(group)},
        )
        self._run_each(batch, group)

    def _run_one(self, batch: Batch, message: Message) -> bool:
        """One message in its savepoint: run its handler, keep or undo its effects (back to the
        savepoint: those of any message that shares it too). True if it succeeded."""
        assert self.conn is not None
        batch.in_flight = message
        with tracing.processing(message) as span:
            now = self.worker.clock.now()
            started = time.monotonic()
            error = self._run_handler(message)
            duration_ms = (time.monotonic() - started) * 1000.0
            batch.last_run = message
            error = self._after_handler(message, error)
            batch.in_flight = None
            batch.runs.append((message, now, duration_ms / 1000.0))
            self._durations[message.id] = duration_ms
            if error is None:
                batch.done.append(message)
                self._breaker_record(False, message.key)
                tracing.decided(span, "done")
                return True
            savepoints.roll_back(self.conn, message)
            failure = self._failure(message, error, duration_ms)
            tracing.decided(span, failure.decision.kind, error, failure.classification.error_type)
        self._breaker_record(failure.classification.kind is FailureKind.TRANSIENT, message.key)
        batch.failures.append(failure)
        return False

    def abandon(self, shutdown: WorkerShutdown | None, *, died: bool = False) -> Inheritance | None:
        """Mark this slot abandoned (its thread may go on in handler code, but will never touch the
        database or the batch again) and return what the slot replacing it must settle."""
        with self._lock:
            if self.abandoned:
                return None
            if not died and shutdown is None and not self.busy:
                return None  # the handler returned in the meantime
            self.abandoned = True
            if self._inheritance is not None and self.batch is None:
                # It died settling what an earlier slot left: that passes on, unsettled.
                return self._inheritance
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
        if self.aconn is not None:
            self.aconn.fence(reason)
        if in_flight is not None and not died:
            log.error(
                "slot %s abandoned: %s",
                self.index,
                error,
                extra=log_fields(in_flight, type(error).__name__, event="handler_abandoned"),
            )
        return Inheritance(batch, in_flight, error, self._backend_pid)

    # --- settling --------------------------------------------------------------------------


def _supports(spec: HandlerSpec, message: Message) -> bool:
    return spec.schema_versions is None or message.schema_version in spec.schema_versions

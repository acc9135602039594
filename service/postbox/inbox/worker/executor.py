"""The handler executor: runs one handler in its message's savepoint, under its time limit, with
the transaction guarded, and classifies what it left (success, its error, a refused or performed
end of the transaction, a transaction left in error).

A sync handler gets a :class:`Context` over the slot's connection; a batch handler, called with
several messages, a :class:`BatchContext` over it. An ``async def`` handler runs
on the slot's own event loop with an :class:`AsyncContext`: an async connection over the same
server session, so the same transaction, savepoint and refusals. The watchdog calls
:meth:`Executor.check_deadline`: at the limit the handler's query is cancelled (an async handler
is cancelled by its ``wait_for``); still running ``ABANDON_AFTER`` seconds later, the slot is
abandoned.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from postbox.failures.outcomes import Permanent
from postbox.inbox.connection import AsyncHandlerConnection, HandlerConnection, HandlerEndedTransaction
from postbox.inbox.handlers import (
    AsyncBatchContext,
    AsyncContext,
    BatchContext,
    Context,
    HandlerSpec,
    Message,
)
from postbox.inbox.worker.base import SlotBase
from postbox.inbox.worker.settings import (
    ABANDON_AFTER,
    Abandoned,
    HandlerLeftTransactionInError,
    HandlerTimeout,
    SlotStop,
    TransactionEnded,
)

__all__ = ["Executor"]

log = logging.getLogger("postbox.worker")

_Guarded = HandlerConnection | AsyncHandlerConnection


class Executor(SlotBase):
    """A slot's part that runs handlers."""

    def _run_handler(self, message: Message) -> BaseException | None:
        """Run the message's handler; the error it raised (or returned), or None on success."""
        spec = self.worker.registry.lookup(message.consumer, message.type)
        if spec is None:
            return Permanent(f"no handler for consumer {message.consumer!r} and type {message.type!r}")
        if spec.schema_versions is not None and message.schema_version not in spec.schema_versions:
            return Permanent(
                f"unsupported schema_version {message.schema_version} (handler accepts "
                f"{', '.join(map(str, sorted(spec.schema_versions)))})"
            )
        if spec.batch:
            return self._run_batch_handler(spec, [message])
        timeout = self._arm(spec)
        if self.aconn is not None and id(spec.func) in self._async_funcs:
            outcome = self._run_async(spec, message, timeout)
        else:
            outcome = self._run_sync(spec, message, timeout)
        if self.abandoned:
            raise Abandoned
        return outcome

    def _run_batch_handler(self, spec: HandlerSpec, messages: list[Message]) -> BaseException | None:
        """One call of a batch handler with ``messages`` (supported by it, checked by the caller);
        the error it raised (or returned), or None on success."""
        assert self.conn is not None
        timeout = self._arm(spec)
        func = spec.func
        if self.aconn is not None and id(func) in self._async_funcs:
            actx = AsyncBatchContext(messages, self.aconn, self._async_session_factory)
            outcome = self._call_async(lambda: func(list(messages), actx), actx, timeout)  # type: ignore[arg-type]
        else:
            ctx = BatchContext(messages, self.conn, self._session_factory)
            outcome = self._call_sync(lambda: func(list(messages), ctx), ctx, timeout)  # type: ignore[arg-type]
        if self.abandoned:
            raise Abandoned
        return outcome

    def _arm(self, spec: HandlerSpec) -> float:
        """The handler's time limit, from now on (the watchdog reads it); returns it."""
        timeout = spec.timeout or self.settings.handler_timeout
        with self._lock:
            self._timed_out = False
            self._timeout = timeout
            self._deadline = time.monotonic() + timeout
            self.busy = True
        return timeout

    def _run_sync(self, spec: HandlerSpec, message: Message, timeout: float) -> BaseException | None:
        assert self.conn is not None
        ctx = Context(message, self.conn, self._session_factory)
        return self._call_sync(lambda: spec.func(message, ctx), ctx, timeout)

    def _call_sync(
        self, invoke: Callable[[], Any], ctx: Context | BatchContext, timeout: float
    ) -> BaseException | None:
        """Run a sync handler (``invoke`` calls it with its context ``ctx``), guarded; its outcome."""
        assert self.conn is not None

        def call() -> Any:
            result = invoke()
            if inspect.isawaitable(result):  # a sync function returning an awaitable
                result = self._event_loop().run_until_complete(asyncio.wait_for(_awaitable(result), timeout))
            ctx._close_session()
            return result

        def close() -> None:  # its work undone (the handler failed): not the session's own close
            if ctx._session is not None:
                Session.close(ctx._session)

        return self._guarded(call, close, [self.conn], timeout)

    def _run_async(self, spec: HandlerSpec, message: Message, timeout: float) -> BaseException | None:
        assert self.aconn is not None
        ctx = AsyncContext(message, self.aconn, self._async_session_factory)
        return self._call_async(lambda: spec.func(message, ctx), ctx, timeout)

    def _call_async(
        self, invoke: Callable[[], Any], ctx: AsyncContext | AsyncBatchContext, timeout: float
    ) -> BaseException | None:
        """Run an async handler (``invoke`` makes its coroutine, with its context ``ctx``) on the
        slot's loop, guarded; its outcome."""
        assert self.conn is not None
        assert self.aconn is not None
        loop = self._event_loop()

        def call() -> Any:
            return loop.run_until_complete(asyncio.wait_for(_attempt(invoke, ctx), timeout))

        def close() -> None:
            if ctx._session is not None:
                loop.run_until_complete(AsyncSession.close(ctx._session))

        return self._guarded(call, close, [self.conn, self.aconn], timeout)

    def _guarded(
        self, call: Callable[[], Any], close: Callable[[], None], conns: list[_Guarded], timeout: float
    ) -> BaseException | None:
        """Run ``call`` (the handler) with the transaction guarded on ``conns``; its outcome. Then
        cancel what it left running and, unless the slot was abandoned meanwhile, ``close`` its
        session."""
        for conn in conns:
            conn.guard(True)
        try:
            return self._returned(call(), timeout)
        except SlotStop:
            raise
        except BaseException as error:  # SystemExit, KeyboardInterrupt...: only this attempt fails
            return self._raised(error, timeout)
        finally:
            self._finish_tasks()
            for conn in conns:
                conn.guard(False)
            if not self._end_run():
                try:
                    close()
                except Exception:
                    log.debug("closing the handler's session failed", exc_info=True)

    def _returned(self, result: Any, timeout: float) -> BaseException | None:
        if isinstance(result, BaseException):
            return result
        if self._timed_out:
            return HandlerTimeout(f"handler exceeded its time limit of {timeout:g} s")
        return None

    def _raised(self, error: BaseException, timeout: float) -> BaseException:
        if self._timed_out or isinstance(error, asyncio.TimeoutError):
            return HandlerTimeout(f"handler exceeded its time limit of {timeout:g} s")
        return error

    def _end_run(self) -> bool:
        """The handler is over: no deadline any more. True if the slot was abandoned meanwhile."""
        with self._lock:
            self.busy = False
            self._deadline = None
            return self.abandoned

    def _after_handler(self, message: Message, error: BaseException | None) -> BaseException | None:
        """Check what the handler left: the attempt's error (possibly replaced), or raise
        ``TransactionEnded`` if it ended the batch's transaction."""
        assert self.conn is not None
        conn = self.conn
        misuse = conn.misuse or (self.aconn.misuse if self.aconn is not None else None)
        if misuse is not None:
            # Refused before it reached the server: the transaction is intact, the culprit fails.
            return error if isinstance(error, HandlerEndedTransaction) else HandlerEndedTransaction(misuse)
        if conn.closed or conn.broken:
            raise psycopg.OperationalError("connection lost during the handler") from error
        status = conn.info.transaction_status
        if (
            status is psycopg.pq.TransactionStatus.IDLE
            or conn.ended
            or (self.aconn is not None and self.aconn.ended)
        ):
            # It ended the transaction with SQL (and may have begun another since).
            raise TransactionEnded(message)
        if error is None and status is psycopg.pq.TransactionStatus.INERROR:
            return HandlerLeftTransactionInError(
                "the handler returned, but a database error inside it left its transaction failed "
                "(an error caught without re-raising it); the attempt fails"
            )
        return error

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

    # --- time limits (called by the watchdog's thread) ----------------------------------------

    def check_deadline(self, now: float) -> bool:
        """Cancel a handler's query at its time limit; True once the handler is still running
        ``ABANDON_AFTER`` seconds later (the slot must then be abandoned)."""
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


async def _awaitable(value: Any) -> Any:
    try:
        return await value
    except (SystemExit, KeyboardInterrupt) as error:
        # Escaping a task, these two stop the event loop and leave its tasks pending, to run in a
        # later handler's transaction: returned, they fail this attempt only.
        return error


async def _attempt(invoke: Callable[[], Any], ctx: AsyncContext | AsyncBatchContext) -> Any:
    """An async handler's attempt: its session opened before and flushed after it, in its time."""
    try:
        await ctx._open_session()
        result = await invoke()
        unawaited = ctx._unawaited()
        if unawaited:  # its events were never written: the message must not be done without them
            return Permanent(
                f"the handler called ctx.publish(...) {unawaited} time(s) without awaiting it: nothing was "
                "published; write 'await ctx.publish(...)'"
            )
        await ctx._close_session()
        return result
    except (SystemExit, KeyboardInterrupt) as error:  # see _awaitable
        return error

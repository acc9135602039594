"""Handlers: plain Python functions (sync or async) registered per consumer and message type.

A handler is called as ``handler(message, ctx)``. It succeeds by returning; it fails by raising (or
returning) an outcome from :mod:`postbox.failures.outcomes` or any exception, which is classified. Its
database work goes through ``ctx.conn`` (psycopg) or ``ctx.session`` (SQLAlchemy), and commits in
one transaction with the message's "done" mark and any ``ctx.publish(...)`` outbox rows. An
``async def`` handler gets an :class:`AsyncContext`: ``ctx.conn`` is a ``psycopg.AsyncConnection``,
``ctx.session`` an SQLAlchemy ``AsyncSession`` and ``await ctx.publish(...)``, in that same
transaction.

A *batch* handler (:meth:`Registry.batch_handler`) is called as ``handler(messages, ctx)`` with
the messages of a claimed batch that it handles (heads of distinct keys) and a :class:`BatchContext`
(:class:`AsyncBatchContext` for an ``async def``); a failed call runs them again one at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from inspect import CORO_CREATED, getcoroutinestate
from typing import Any

import psycopg
from pydantic import BaseModel, ConfigDict
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from postbox.failures.classify import Classifier, Rule
from postbox.failures.policy import RetryPolicy
from postbox.messages import OutboxMessage
from postbox.operations.tracing import child_headers

__all__ = [
    "AsyncBatchContext",
    "AsyncContext",
    "BatchContext",
    "BatchHandlerFunc",
    "Context",
    "HandlerFunc",
    "HandlerSpec",
    "Message",
    "Registry",
]


class Message(BaseModel):
    """An inbox message as a handler sees it."""

    model_config = ConfigDict(frozen=True)

    id: int
    consumer: str
    message_id: str
    key: str
    sequence: int | None
    type: str | None
    schema_version: int
    payload: Any
    headers: dict[str, Any]
    correlation_id: str | None
    causation_id: str | None
    source: str | None
    received_at: datetime
    attempt: int
    first_failed_at: datetime | None = None
    last_error: str | None = None
    last_error_type: str | None = None


# Called as handler(message, ctx): ctx is a Context, or an AsyncContext for an ``async def`` handler.
HandlerFunc = Callable[[Message, Any], Any | Awaitable[Any]]
# Called as handler(messages, ctx): a batch handler, with a BatchContext (an AsyncBatchContext for
# an ``async def`` one).
BatchHandlerFunc = Callable[[list[Message], Any], Any | Awaitable[Any]]


def idempotency_key_for(message: Message, operation: str = "") -> str:
    """A key stable across every attempt and replay of ``message``, one per logical operation.

    A replay as a new message keeps the original's key (its ``postbox_replay_of`` header names the
    original message), so a replay never repeats an external effect that did happen."""
    original = message.headers.get("postbox_replay_of") if isinstance(message.headers, dict) else None
    message_id = original.get("message_id") if isinstance(original, dict) else None
    raw = f"{message.consumer}\x1f{message_id or message.message_id}\x1f{operation}"
    return "pbx-" + hashlib.sha256(raw.encode()).hexdigest()[:32]


def _derived(message: Message, destination: str, payload: Any, fields: dict[str, Any]) -> OutboxMessage:
    """An outbox message published while handling ``message``: correlation and causation follow it."""
    fields.setdefault("correlation_id", message.correlation_id or message.message_id)
    fields.setdefault("causation_id", message.message_id)
    fields["headers"] = child_headers(message.headers, fields.get("headers"))
    return OutboxMessage(destination=destination, payload=payload, **fields)


class _AttemptContext:
    """What every handler's context has: the message, its attempt and its idempotency keys."""

    def __init__(self, message: Message) -> None:
        self.message = message
        self.attempt = message.attempt

    @property
    def idempotency_key(self) -> str:
        """Stable across every attempt and replay of this message: pass it to external systems."""
        return self.idempotency_key_for("")

    def idempotency_key_for(self, operation: str) -> str:
        """A stable key per logical operation of this message (several external calls, one each),
        kept by its replays (see :func:`idempotency_key_for`)."""
        return idempotency_key_for(self.message, operation)

    def _outbox_message(self, destination: str, payload: Any, fields: dict[str, Any]) -> OutboxMessage:
        return _derived(self.message, destination, payload, fields)


class _SyncSession:
    """The SQLAlchemy ``Session`` of a sync handler's context: opened on first use, on the same
    connection and transaction as ``conn``."""

    _session_factory: Callable[[], Session]
    _session: Session | None

    @property
    def session(self) -> Session:
        """A SQLAlchemy ``Session`` on the same connection and transaction as ``conn``."""
        if self._session is None:
            self._session = self._session_factory()
        return self._session

    def _close_session(self) -> None:
        """After the handler returned: its session's work joins the transaction (its commit releases
        its savepoint; its close, after a commit, has nothing to undo)."""
        if self._session is not None:
            self._session.close()  # a JoinedSession's close commits first (postbox.inbox.worker.base)
            self._session = None


class _AsyncSession:
    """An async handler's context's ``AsyncSession`` (on ``conn``, opened before the handler runs)."""

    _session_factory: Callable[[], Awaitable[AsyncSession]]
    _session: AsyncSession | None

    @property
    def session(self) -> AsyncSession:
        """An SQLAlchemy ``AsyncSession`` on the same connection and transaction as ``conn``."""
        if self._session is None:
            raise RuntimeError("postbox: the async session is opened by the worker before the handler runs")
        return self._session

    async def _open_session(self) -> None:
        self._session = await self._session_factory()

    def _track(self, publishing: Coroutine[Any, Any, int]) -> Coroutine[Any, Any, int]:
        """A ``publish`` coroutine, noted: one the handler never awaits wrote nothing."""
        self.__dict__.setdefault("_publishes", []).append(publishing)
        return publishing

    def _unawaited(self) -> int:
        """How many of its ``publish`` calls the handler never awaited (closed now, unrun)."""
        left = [c for c in self.__dict__.get("_publishes", ()) if getcoroutinestate(c) == CORO_CREATED]
        for c in left:
            c.close()
        return len(left)

    async def _close_session(self) -> None:
        """After the handler returned: its session's work joins the transaction."""
        if self._session is not None:
            await self._session.close()  # a JoinedAsyncSession's close commits first
            self._session = None


class Context(_AttemptContext, _SyncSession):
    """What a handler may use during one attempt. Valid only while the handler runs."""

    def __init__(
        self,
        message: Message,
        conn: psycopg.Connection[Any],
        session_factory: Callable[[], Session],
    ):
        super().__init__(message)
        self.conn = conn
        self._session_factory = session_factory
        self._session = None

    def publish(self, destination: str, payload: Any, **fields: Any) -> int:
        """Write an outbox event in this transaction; correlation and causation follow this message."""
        from postbox.outbox.publish import publish

        return publish(self.conn, self._outbox_message(destination, payload, fields))


class _BatchAttempt:
    """What every batch handler's context has: the messages and their idempotency keys."""

    def __init__(self, messages: list[Message]) -> None:
        self.messages = messages

    def idempotency_key(self, message: Message, operation: str = "") -> str:
        """``message``'s idempotency key (per ``operation``), as :attr:`Context.idempotency_key`."""
        return idempotency_key_for(message, operation)


class BatchContext(_BatchAttempt, _SyncSession):
    """What a batch handler may use during one call: the messages, the connection and session of
    their transaction, and a publish that derives from one of them. Valid only while it runs."""

    def __init__(
        self,
        messages: list[Message],
        conn: psycopg.Connection[Any],
        session_factory: Callable[[], Session],
    ):
        super().__init__(messages)
        self.conn = conn
        self._session_factory = session_factory
        self._session = None

    def publish(self, message: Message, destination: str, payload: Any, **fields: Any) -> int:
        """Write an outbox event in this transaction, derived from ``message`` (one of this call's):
        its correlation and causation follow that message."""
        from postbox.outbox.publish import publish

        return publish(self.conn, _derived(message, destination, payload, fields))


class AsyncContext(_AttemptContext, _AsyncSession):
    """An ``async def`` handler's context: ``conn`` is a ``psycopg.AsyncConnection`` and ``session``
    an SQLAlchemy ``AsyncSession``, both in the message's transaction (its savepoint), under the same
    rules as a sync handler's. Valid only while the handler runs."""

    def __init__(
        self,
        message: Message,
        conn: psycopg.AsyncConnection[Any],
        session_factory: Callable[[], Awaitable[AsyncSession]],
    ):
        super().__init__(message)
        self.conn = conn
        self._session_factory = session_factory
        self._session = None

    def publish(self, destination: str, payload: Any, **fields: Any) -> Coroutine[Any, Any, int]:
        """Write an outbox event in this transaction (awaited); correlation and causation follow this message."""
        from postbox.outbox.publish import publish_async

        return self._track(publish_async(self.conn, self._outbox_message(destination, payload, fields)))


class AsyncBatchContext(_BatchAttempt, _AsyncSession):
    """An ``async def`` batch handler's context: :class:`BatchContext` with a
    ``psycopg.AsyncConnection``, an SQLAlchemy ``AsyncSession`` and an awaited ``publish``, in the
    call's transaction. Valid only while the handler runs."""

    def __init__(
        self,
        messages: list[Message],
        conn: psycopg.AsyncConnection[Any],
        session_factory: Callable[[], Awaitable[AsyncSession]],
    ):
        super().__init__(messages)
        self.conn = conn
        self._session_factory = session_factory
        self._session = None

    def publish(
        self, message: Message, destination: str, payload: Any, **fields: Any
    ) -> Coroutine[Any, Any, int]:
        """Write an outbox event in this transaction (awaited), derived from ``message`` (one of this call's)."""
        from postbox.outbox.publish import publish_async

        return self._track(publish_async(self.conn, _derived(message, destination, payload, fields)))


@dataclass(frozen=True)
class HandlerSpec:
    func: HandlerFunc
    consumer: str
    type: str | None
    idempotent: bool = False
    timeout: float | None = None
    retry: RetryPolicy | None = None
    on_dead_letter: str | None = None
    schema_versions: frozenset[int] | None = None
    batch: bool = False  # called as func(messages, BatchContext)
    database_only: bool = False  # its effects are all in the transaction: may share a savepoint


@dataclass
class Registry:
    """Handlers by consumer and message type (``type=None`` handles every type without its own)."""

    handlers: dict[tuple[str, str | None], HandlerSpec] = field(default_factory=dict)
    retry_policies: dict[str, RetryPolicy] = field(default_factory=dict)
    rules: list[Rule] = field(default_factory=list)
    listeners: list[Callable[[str, dict[str, Any]], None]] = field(default_factory=list)

    def handler(
        self,
        consumer: str,
        type: str | None = None,
        *,
        idempotent: bool = False,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        on_dead_letter: str | None = None,
        schema_versions: Iterable[int] | None = None,
        database_only: bool = False,
    ) -> Callable[[HandlerFunc], HandlerFunc]:
        """Decorator: register ``func`` for ``consumer`` and ``type``.

        ``idempotent`` lets unknown outcomes be retried; ``timeout`` (seconds) bounds an attempt;
        ``retry`` and ``on_dead_letter`` override the consumer's policies for this type;
        ``schema_versions`` lists the versions it understands (others are dead-lettered at once).

        ``database_only`` declares that it does everything in the database (nothing outside):
        neighbours in a batch then share one savepoint, a round trip less each, and run again, each
        in its own, if one of them fails (a second run only the handler itself can notice).
        """

        options = {"idempotent": idempotent, "timeout": timeout, "retry": retry,
                   "on_dead_letter": on_dead_letter, "schema_versions": schema_versions,
                   "database_only": database_only}  # fmt: skip

        def register(func: HandlerFunc) -> HandlerFunc:
            self.add(func, consumer, type, **options)  # type: ignore[arg-type]
            return func

        return register

    def batch_handler(
        self,
        consumer: str,
        type: str | None = None,
        *,
        idempotent: bool = False,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        on_dead_letter: str | None = None,
        schema_versions: Iterable[int] | None = None,
    ) -> Callable[[BatchHandlerFunc], BatchHandlerFunc]:
        """Decorator: register a batch handler, ``func(messages, ctx)``, for ``consumer`` and ``type``.

        It is called with the messages of a claimed batch that it handles and a :class:`BatchContext`
        (:class:`AsyncBatchContext` for an ``async def``). If it fails, its effects are rolled back
        and each message runs again alone (``func([message], ctx)``): what it does outside the
        database must be idempotent (``ctx.idempotency_key(message)``). ``timeout`` bounds a call.
        """

        options = {"idempotent": idempotent, "timeout": timeout, "retry": retry,
                   "on_dead_letter": on_dead_letter, "schema_versions": schema_versions}  # fmt: skip

        def register(func: BatchHandlerFunc) -> BatchHandlerFunc:
            self.add(func, consumer, type, batch=True, **options)  # type: ignore[arg-type]
            return func

        return register

    def add(
        self,
        func: HandlerFunc,
        consumer: str,
        type: str | None = None,
        *,
        idempotent: bool = False,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        on_dead_letter: str | None = None,
        schema_versions: Iterable[int] | None = None,
        batch: bool = False,
        database_only: bool = False,
    ) -> None:
        if (consumer, type) in self.handlers:
            raise ValueError(f"postbox: a handler for consumer {consumer!r} type {type!r} exists already")
        if on_dead_letter not in (None, "block", "skip", "halt"):
            raise ValueError("postbox: on_dead_letter must be block, skip or halt")
        if timeout is not None and timeout <= 0:
            raise ValueError("postbox: timeout must be positive")
        if batch and database_only:
            raise ValueError(
                "postbox: database_only is for handlers of one message; a batch handler's call runs "
                "in one savepoint already"
            )
        versions = frozenset(schema_versions) if schema_versions is not None else None
        self.handlers[(consumer, type)] = HandlerSpec(
            func, consumer, type, idempotent, timeout, retry, on_dead_letter, versions, batch, database_only
        )

    def lookup(self, consumer: str, type: str | None) -> HandlerSpec | None:
        return self.handlers.get((consumer, type)) or self.handlers.get((consumer, None))

    def consumers(self) -> set[str]:
        return {c for c, _ in self.handlers}

    def classifier(self) -> Classifier:
        return Classifier(tuple(self.rules))

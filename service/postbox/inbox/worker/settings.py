"""How a worker runs (its settings) and the errors that end a handler's attempt or a slot's loop."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from postbox.failures.breaker import BreakerSettings
from postbox.failures.policy import RetryPolicy
from postbox.inbox.handlers import Message

__all__ = [
    "ABANDON_AFTER",
    "Abandoned",
    "HandlerLeftTransactionInError",
    "HandlerTimeout",
    "SlotStop",
    "TransactionEnded",
    "WorkerSettings",
    "WorkerShutdown",
]

# How long a handler may go on past its time limit, after its query was cancelled, before its slot
# is abandoned (SQL stops at the cancel; only Python that does not return gets this far).
ABANDON_AFTER = 1.0


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

    @classmethod
    def build(
        cls, settings: WorkerSettings | None, consumer: str | None, options: dict[str, Any]
    ) -> WorkerSettings:
        """Settings given whole, or built from ``consumer`` and keyword options (field names)."""
        if settings is not None:
            if consumer is not None or options:
                raise TypeError("postbox: give either settings or consumer= and options, not both")
            return settings
        if consumer is None:
            raise TypeError("postbox: a worker needs a consumer (consumer=...) or settings")
        unknown = set(options) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"postbox: unknown worker options: {', '.join(sorted(unknown))}")
        return cls(consumer=consumer, **options)

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


class SlotStop(Exception):
    """Raised inside a slot when the worker stops while it waits for a connection."""


class Abandoned(Exception):
    """Raised in an abandoned slot's thread once its handler returns: it must stop at once."""


class TransactionEnded(Exception):
    """The batch's transaction is gone: ``culprit``'s handler committed or rolled it back with SQL."""

    def __init__(self, culprit: Message) -> None:
        self.culprit = culprit
        super().__init__(culprit.message_id)

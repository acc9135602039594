"""What a slot knows of the batch it processes, and what it leaves to the slot replacing it."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from postbox.failures.classify import Classification
from postbox.failures.policy import DeadLetter, RetryAt
from postbox.inbox.handlers import Message
from postbox.operations.logs import message_fields

__all__ = ["MESSAGE_FIELDS", "Batch", "Failure", "Inheritance", "log_fields", "message_from_row"]

MESSAGE_FIELDS = (
    "id", "consumer", "message_id", "key", "sequence", "type", "schema_version", "payload", "headers",
    "correlation_id", "causation_id", "source", "received_at", "attempt", "first_failed_at", "last_error",
    "last_error_type",
)  # fmt: skip

_FIELDS_SET = frozenset(MESSAGE_FIELDS)
_setattr = object.__setattr__


def message_from_row(row: tuple[Any, ...]) -> Message:
    """A claimed row (columns in ``MESSAGE_FIELDS`` order) as a :class:`Message`: what
    ``Message.model_construct`` makes (every field set, nothing validated: the database typed them),
    without its loop over the fields, which costs every claimed message several microseconds.
    tests/test_claimed_messages.py checks that the two are the same, so a pydantic that changes how
    a model is laid out fails there rather than here."""
    if len(row) != len(MESSAGE_FIELDS):
        raise ValueError(f"postbox: a claimed row has {len(row)} columns, expected {len(MESSAGE_FIELDS)}")
    message = Message.__new__(Message)
    _setattr(message, "__dict__", dict(zip(MESSAGE_FIELDS, row, strict=True)))
    _setattr(message, "__pydantic_fields_set__", set(_FIELDS_SET))  # its own: model_copy updates it
    _setattr(message, "__pydantic_extra__", None)
    _setattr(message, "__pydantic_private__", None)
    return message


@dataclass
class Failure:
    """A failed attempt, classified and decided (retry or dead letter), not yet written."""

    message: Message
    decision: RetryAt | DeadLetter
    classification: Classification
    policy: str | None
    duration_ms: float | None = None
    kind: str = ""
    max_attempts: int | None = None  # set for a claim past max_attempts (no handler ran)


@dataclass
class Batch:
    """What a slot knows of the batch it is processing (read by the watchdog if it abandons it)."""

    messages: list[Message]
    done: list[Message] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    unrun: list[Message] = field(default_factory=list)
    in_flight: Message | None = None
    last_run: Message | None = None
    xid: str | None = None  # the batch transaction's id, assigned as it begins
    savepoint: bool = False  # the batch's transaction and first savepoint are open
    # Message id -> the messages of the batch handler's call it ran in, while that call's effects
    # stand (a handler that ends the transaction may have committed them all).
    calls: dict[int, list[Message]] = field(default_factory=dict)
    # The handler runs not yet in the metrics: (message, when its handler started, seconds it took).
    runs: list[tuple[Message, datetime, float]] = field(default_factory=list)

    def after(self, message: Message) -> list[Message]:
        """The messages after ``message`` that have not run."""
        i = next(i for i, m in enumerate(self.messages) if m is message)
        ran = {id(m) for m in self.done} | {id(f.message) for f in self.failures}
        return [m for m in self.messages[i + 1 :] if id(m) not in ran]


@dataclass
class Inheritance:
    """What an abandoned or dead slot leaves to the slot that replaces it."""

    batch: Batch | None
    in_flight: Message | None
    error: BaseException | None
    backend_pid: int | None


def log_fields(message: Message, error_type: str | None = None, **more: Any) -> dict[str, Any]:
    return message_fields(message, error_type=error_type, **more)

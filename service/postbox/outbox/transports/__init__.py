"""Destinations the relay publishes outbox rows to, behind one small interface.

A transport publishes a batch and says, per row, whether the destination confirmed it (``None``)
or why not (an exception, classified like a handler's: transient, permanent, unknown outcome).
Every transport sends the row's ``message_id`` so that the receiver can deduplicate: the relay
delivers at least once, and a row is published again if its confirmation was lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

__all__ = ["OutboxRow", "Transport"]


@dataclass(frozen=True)
class OutboxRow:
    """An outbox row as the relay hands it to a transport."""

    id: int
    destination: str
    message_id: str
    key: str
    type: str | None
    payload: Any
    headers: dict[str, Any]
    correlation_id: str | None
    causation_id: str | None
    created_at: datetime
    attempt: int
    first_failed_at: datetime | None = None


class Transport(Protocol):
    def publish(self, rows: Sequence[OutboxRow]) -> list[BaseException | None]:
        """Publish ``rows`` (at most one per key); one result per row, in order."""
        ...

    def close(self) -> None: ...

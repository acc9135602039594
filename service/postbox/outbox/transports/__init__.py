"""Brokers, one module each: the relay's transport to it (outbound) and, where there is one, the
bridge's source from it (inbound). ``rabbitmq``, ``nats``, ``redis``, ``kafka``, ``http`` and
``postgres``.

A transport publishes a batch and says, per row, whether the destination confirmed it (``None``)
or why not (an exception, classified like a handler's: transient, permanent, unknown outcome).
Every transport sends the row's ``message_id`` so that the receiver can deduplicate: the relay
delivers at least once, and a row is published again if its confirmation was lost.

A source hands the bridge broker messages (:class:`Incoming`) and acknowledges them once they are
committed to the inbox. The broker clients are extras: a module imports its client only when a
transport or source is made, after checking it is installed (:func:`postbox.extras.require`).
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from postbox.extras import require

__all__ = [
    "Incoming",
    "OutboxRow",
    "Source",
    "Transport",
    "envelope_headers",
    "source_for",
    "text",
    "transport_class",
]


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


@dataclass
class Incoming:
    """A broker message on its way in; ``token`` is what the source needs to ack it, ``refused`` why
    the bridge refused it (set before :meth:`Source.reject`, for a source that dead-letters it)."""

    token: Any
    message_id: str | None
    key: str | None
    type: str | None
    body: bytes
    headers: dict[str, Any] = field(default_factory=dict)
    correlation_id: str | None = None
    causation_id: str | None = None
    refused: str | None = None


class Source(Protocol):
    def fetch(self, limit: int, timeout: float) -> list[Incoming]: ...
    def ack(self, items: Sequence[Incoming]) -> None: ...
    def reject(self, item: Incoming) -> None: ...
    def close(self) -> None: ...


def envelope_headers(row: OutboxRow) -> dict[str, str]:
    """What travels next to the payload: ids for deduplication and tracing, and the row's headers."""
    headers = {str(k): (v if isinstance(v, str) else json.dumps(v)) for k, v in row.headers.items()}
    headers.update(
        {
            "postbox-message-id": row.message_id,
            "postbox-key": row.key,
            "postbox-destination": row.destination,
            "postbox-created-at": row.created_at.isoformat(),
        }
    )
    for name, value in (
        ("postbox-type", row.type),
        ("postbox-correlation-id", row.correlation_id),
        ("postbox-causation-id", row.causation_id),
    ):
        if value is not None:
            headers[name] = value
    return headers


def text(value: Any) -> str | None:
    """A header or field value as text (brokers hand over bytes or str)."""
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


# Destination kinds (the ``kind`` of a [destinations.NAME] table), and URL schemes, by module.
KINDS = ("postgres", "rabbitmq", "nats", "redis", "kafka", "http")
SCHEMES = {
    "amqp": "rabbitmq",
    "amqps": "rabbitmq",
    "nats": "nats",
    "tls": "nats",
    "redis": "redis",
    "rediss": "redis",
    "kafka": "kafka",
    "http": "http",
    "https": "http",
    "postgresql": "postgres",
    "postgres": "postgres",
}


def _module(kind: str) -> Any:
    if kind not in KINDS:
        raise ValueError(f"postbox: no transport of kind {kind!r} ({', '.join(KINDS)})")
    return importlib.import_module(f"postbox.outbox.transports.{kind}")


def transport_class(kind: str) -> Callable[..., Transport]:
    """The transport of a destination kind (or a URL scheme), its client checked now: a relay to
    a broker whose extra is not installed fails at start with one line naming it."""
    module = _module(SCHEMES.get(kind, kind))
    if module.EXTRA is not None:
        require(module.EXTRA, f"the {module.NAME} transport")
    made: Callable[..., Transport] = module.TRANSPORT
    return made


def source_for(url: str, name: str) -> Source:
    """The bridge source for a broker URL: amqp:// (queue ``name``), redis:// (stream ``name``),
    nats:// (``name`` is STREAM:SUBJECT) or kafka:// (topic ``name``), connected."""
    return source_maker(url, name)()


def source_maker(url: str, name: str) -> Callable[[], Source]:
    """What connects the bridge source for a broker URL (see :func:`source_for`), the URL and its
    client checked now (ValueError, or :class:`MissingExtra`) without connecting: the bridge connects
    when it starts, and waits for a broker that is not reachable yet."""
    scheme = url.split(":", 1)[0]
    module = _module(SCHEMES[scheme.lower()]) if scheme.lower() in SCHEMES else None
    if module is None or getattr(module, "source", None) is None:
        raise ValueError(f"postbox: no bridge source for {scheme!r} (amqp, redis, nats or kafka)")
    if module.EXTRA is not None:
        require(module.EXTRA, f"the {module.NAME} bridge source")
    check = getattr(module, "check_source", None)
    if check is not None:
        check(url, name)
    made: Callable[[], Source] = functools.partial(module.source, url, name)
    return made

"""W3C trace context (``traceparent``/``tracestate`` headers) and, with the ``otel`` extra,
OpenTelemetry spans for what happens to a message.

The trace context of a message lives in its ``headers`` (a JSON column of the inbox and the outbox):
``traceparent`` and ``tracestate``. Without OpenTelemetry, Postbox only carries them: a message's
``traceparent`` reaches its handler unchanged, and an event a handler publishes gets a child of it.

With ``opentelemetry-api`` importable, Postbox also makes spans, following the messaging semantic
conventions, through ``trace.get_tracer("postbox", version)`` (the application's SDK decides where
they go; without an SDK, Postbox makes none):

- ``send <consumer>`` (PRODUCER) around :func:`postbox.receive` and ``receive_many``;
- ``publish <destination>`` (PRODUCER, operation type ``create``) around :func:`postbox.publish`
  and ``publish_many``;
- ``process <consumer>`` (CONSUMER) per attempt in the worker, child of the message's
  ``traceparent``, with the exception and the decision (``done``, ``retry``, ``dead_letter``);
- ``send <destination>`` (CLIENT) per batch the relay sends, linked to each row's ``traceparent``
  (its child when the batch is one row).

Receive and publish write the span's context into the ``traceparent`` of every message that has
none of its own (one the caller gave is kept as it is).
"""

from __future__ import annotations

import re
import secrets
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from postbox._version import __version__

try:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    OTEL = True
except ImportError:  # the otel extra is not installed: trace context is carried, no spans
    OTEL = False

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer, TracerProvider

# What the hooks hand their callers to pass back (None without the extra or an SDK); a string, so
# that nothing of OpenTelemetry is needed at run time.
SpanHandle: TypeAlias = "Span | None"

__all__ = [
    "OTEL",
    "SpanHandle",
    "child_headers",
    "child_traceparent",
    "decided",
    "processing",
    "processing_batch",
    "producing",
    "relay_failed",
    "relaying",
    "trace_id",
    "use_tracer_provider",
]

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def _parse(value: Any) -> tuple[str, str, str, str] | None:
    if not isinstance(value, str):
        return None
    match = _TRACEPARENT.match(value.strip().lower())
    if match is None or match.group(2) == "0" * 32 or match.group(1) == "ff":
        return None
    version, trace_, span, flags = match.groups()
    return version, trace_, span, flags


def trace_id(headers: Any) -> str | None:
    """The trace id of the ``traceparent`` in ``headers`` (``00-<trace id>-<span id>-<flags>``)."""
    if not isinstance(headers, dict):
        return None
    parsed = _parse(headers.get("traceparent"))
    return parsed[1] if parsed else None


def child_traceparent(parent: str) -> str | None:
    """The same trace with a new span id (the handler's work is the parent of the new event)."""
    parsed = _parse(parent)
    if parsed is None:
        return None
    _, trace_, _, flags = parsed
    return f"00-{trace_}-{secrets.token_hex(8)}-{flags}"


def child_headers(incoming: Any, outgoing: dict[str, Any] | None) -> dict[str, Any]:
    """``outgoing`` headers with the trace context of ``incoming`` added (explicit values win).

    While a recording span is current (the handler's ``process`` span, or one of the
    application's inside it), nothing is added here: the ``publish`` span, its child, writes its
    own context into the event."""
    headers = dict(outgoing or {})
    if not isinstance(incoming, dict) or "traceparent" in headers:
        return headers
    if OTEL and trace.get_current_span().is_recording():
        return headers
    child = child_traceparent(incoming.get("traceparent"))  # type: ignore[arg-type]
    if child is None:
        return headers
    headers["traceparent"] = child
    if isinstance(incoming.get("tracestate"), str):
        headers.setdefault("tracestate", incoming["tracestate"])
    return headers


# --- OpenTelemetry -------------------------------------------------------------------------------

SYSTEM = "postbox"
_BROKERS = frozenset({"rabbitmq", "kafka", "nats", "redis"})  # transports named by their broker


class _Tracers:
    """Postbox's tracer: from the provider given to :func:`use_tracer_provider`, or the global one."""

    own: Tracer | None = None
    provider: TracerProvider | None = None  # the global provider ``tracer`` comes from
    tracer: Tracer | None = None


_tracers = _Tracers()


def use_tracer_provider(provider: TracerProvider | None) -> None:
    """Make Postbox's spans with ``provider`` instead of the global one (``None``: the global one
    again), for an application that keeps several providers, or a test."""
    _tracers.own = None if provider is None else provider.get_tracer("postbox", __version__)


def _tracer() -> Tracer | None:
    """Postbox's tracer, or None while no SDK is configured (every span would be a no-op: the
    hooks then do nothing at all). The global provider is looked up each time: one that the
    application sets after importing Postbox is used from then on."""
    if _tracers.own is not None:
        return _tracers.own
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    if _tracers.provider is not provider:
        _tracers.tracer = provider.get_tracer("postbox", __version__)
        _tracers.provider = provider
    return _tracers.tracer


def _context_of(headers: Any) -> Context | None:
    """The trace context a message's headers carry, or None (no valid ``traceparent``)."""
    if not isinstance(headers, dict):
        return None
    parent = headers.get("traceparent")
    if not isinstance(parent, str):
        return None
    carrier = {"traceparent": parent}
    state = headers.get("tracestate")
    if isinstance(state, str):
        carrier["tracestate"] = state
    context = TraceContextTextMapPropagator().extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def _stamped(items: list[dict[str, Any]], span: Span) -> list[dict[str, Any]]:
    """``items`` (messages as dicts) with the span's trace context in the headers of those that
    have no ``traceparent``; the caller's dicts are left untouched."""
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    stamped = []
    for item in items:
        headers = item.get("headers") or {}
        stamped.append(item if "traceparent" in headers else {**item, "headers": {**headers, **carrier}})
    return stamped


def _message_attributes(attributes: dict[str, Any], item: dict[str, Any]) -> dict[str, Any]:
    """``attributes`` with those of the one message a span is about."""
    for attribute, value in (
        ("messaging.message.id", item.get("message_id")),
        ("messaging.message.conversation_id", item.get("correlation_id")),
        ("postbox.message.key", item.get("key")),
        ("postbox.message.type", item.get("type")),
    ):
        if value is not None:
            attributes[attribute] = value
    return attributes


@contextmanager
def producing(operation: str, items: list[dict[str, Any]], field: str) -> Iterator[list[dict[str, Any]]]:
    """A PRODUCER span around writing ``items`` (messages as dicts, their queue in ``field``):
    ``send`` (the inbox) or ``publish`` (the outbox, operation type ``create``). Yields the items to
    write: with the span's trace context where they have no ``traceparent`` of their own."""
    tracer = _tracer() if OTEL and items else None
    if tracer is None:
        yield items
        return
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": operation,
        "messaging.operation.type": "create" if operation == "publish" else "send",
    }
    name = operation
    destinations = {item[field] for item in items}
    if len(destinations) == 1:  # a batch to several queues is named by its operation alone
        (destination,) = destinations
        name = f"{operation} {destination}"
        attributes["messaging.destination.name"] = destination
    if len(items) == 1:
        if operation == "publish" and not items[0].get("message_id"):
            # The random UUID the database would choose, chosen here so that the span can name it.
            items = [{**items[0], "message_id": str(uuid.uuid4())}]
        _message_attributes(attributes, items[0])
    else:
        attributes["messaging.batch.message_count"] = len(items)
    span = tracer.start_span(name, kind=trace.SpanKind.PRODUCER, attributes=attributes)
    with trace.use_span(span, end_on_exit=True):
        yield _stamped(items, span)


class _Delivered(Protocol):
    """What the worker's ``process`` span reads of a message."""

    consumer: str
    message_id: str
    key: str
    type: str | None
    attempt: int
    headers: dict[str, Any]
    correlation_id: str | None


# What processing() gives while no SDK is configured: no span, and nothing made per message.
_NO_SPAN: AbstractContextManager[SpanHandle] = nullcontext(None)


def processing(message: _Delivered) -> AbstractContextManager[SpanHandle]:
    """The CONSUMER span of one attempt at ``message`` in the worker, current while its handler
    runs, a child of the message's ``traceparent``. Give it its outcome with :func:`decided`."""
    tracer = _tracer() if OTEL else None
    return _NO_SPAN if tracer is None else _processing(tracer, message)


@contextmanager
def _processing(tracer: Tracer, message: _Delivered) -> Iterator[SpanHandle]:
    attributes = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": message.consumer,
        "messaging.consumer.group.name": message.consumer,
        "postbox.attempt": message.attempt,
    }
    span = tracer.start_span(
        f"process {message.consumer}",
        _context_of(message.headers),
        kind=trace.SpanKind.CONSUMER,
        attributes=_message_attributes(attributes, message.__dict__),
    )
    with trace.use_span(span, end_on_exit=True):
        yield span


@contextmanager
def processing_batch(messages: Sequence[_Delivered]) -> Iterator[SpanHandle]:
    """The CONSUMER span of one call of a batch handler: a root span with a link to each
    message's ``traceparent`` (the messaging conventions' batch process span). Its outcome is
    given with :func:`decided`; a failed call's messages then get a span each, run alone."""
    tracer = _tracer() if OTEL else None
    if tracer is None:
        yield None
        return
    first = messages[0]
    links = []
    for message in messages:
        context = _context_of(message.headers)
        if context is not None:
            links.append(trace.Link(trace.get_current_span(context).get_span_context()))
    span = tracer.start_span(
        f"process {first.consumer}",
        kind=trace.SpanKind.CONSUMER,
        links=links,
        attributes={
            "messaging.system": SYSTEM,
            "messaging.operation.name": "process",
            "messaging.operation.type": "process",
            "messaging.destination.name": first.consumer,
            "messaging.consumer.group.name": first.consumer,
            "messaging.batch.message_count": len(messages),
        },
    )
    with trace.use_span(span, end_on_exit=True):
        yield span


def decided(
    span: SpanHandle, decision: str, error: BaseException | None = None, error_type: str | None = None
) -> None:
    """The outcome of an attempt on its span: ``done``, ``retry`` or ``dead_letter`` (or ``split``:
    a batch handler's call that failed, its messages run again alone), and the exception of a
    failed one."""
    if span is None or not span.is_recording():
        return
    span.set_attribute("postbox.decision", decision)
    if error is not None:
        _failed(span, error, error_type)


def _failed(span: Span, error: BaseException, error_type: str | None, **attributes: str) -> None:
    """The exception on ``span`` (an event, with ``attributes``), its type and the ERROR status."""
    error_type = error_type or type(error).__qualname__
    span.record_exception(error, attributes=attributes)
    span.set_attribute("error.type", error_type)
    span.set_status(trace.Status(trace.StatusCode.ERROR, f"{error_type}: {error}"[:500]))


def _system(transport: object) -> str:
    """``messaging.system`` of a transport: its broker's name, or postbox (PostgreSQL, HTTP, ...)."""
    kind = type(transport).__module__.rpartition(".")[2]
    return kind if kind in _BROKERS else SYSTEM


class _Row(Protocol):
    """What the relay's ``send`` span reads of an outbox row."""

    @property
    def message_id(self) -> str: ...
    @property
    def headers(self) -> dict[str, Any]: ...


@contextmanager
def relaying(transport: object, destination: str, rows: Sequence[_Row]) -> Iterator[SpanHandle]:
    """The CLIENT span of the relay sending ``rows`` to ``destination``: linked to the trace
    context of each row (written when it was published), or its child when it is the only row."""
    tracer = _tracer() if OTEL and rows else None
    if tracer is None:
        yield None
        return
    attributes: dict[str, Any] = {
        "messaging.system": _system(transport),
        "messaging.destination.name": destination,
        "messaging.operation.name": "send",
        "messaging.operation.type": "send",
    }
    if len(rows) == 1:
        attributes["messaging.message.id"] = rows[0].message_id
        parent = _context_of(rows[0].headers)
    else:
        attributes["messaging.batch.message_count"] = len(rows)
        parent = None
    span = tracer.start_span(f"send {destination}", parent, kind=trace.SpanKind.CLIENT, attributes=attributes)
    with trace.use_span(span, end_on_exit=True):
        if parent is None and span.is_recording():
            for row in rows:
                context = _context_of(row.headers)
                if context is not None:
                    linked = trace.get_current_span(context).get_span_context()
                    span.add_link(linked, {"messaging.message.id": row.message_id})
        yield span


def relay_failed(
    span: SpanHandle, message_id: str, error: BaseException, error_type: str | None, decision: str
) -> None:
    """A row the relay could not send: its exception and decision (``retry``, ``dead_letter``)."""
    if span is None or not span.is_recording():
        return
    _failed(span, error, error_type, **{"messaging.message.id": message_id, "postbox.decision": decision})

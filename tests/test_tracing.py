"""OpenTelemetry spans (the ``otel`` extra) with the real SDK and its in-memory exporter: receive,
publish, the worker's attempts and the relay's sends, joined through the messages' ``traceparent``;
and without an SDK, or without OpenTelemetry at all, ``traceparent`` carried unchanged."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import postbox
from postbox.failures.policy import Backoff, RetryPolicy
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from postbox.operations import tracing
from postbox.outbox.relay import Relay, RelaySettings
from postbox.outbox.transports.postgres import PostgresTransport
from tests.helpers import FAST_WORKER, eventually, scalar

GIVEN = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # a caller's own traceparent
QUICK = RetryPolicy(strategy=Backoff.FIXED, base_delay=0.01, max_attempts=5, max_total_seconds=None)
DRAINED = "SELECT count(*) = 0 FROM postbox.inbox WHERE consumer = 'c' AND state <> 'blocked'"
RELAYED = "SELECT count(*) = 0 FROM postbox.outbox WHERE state <> 'blocked'"
RELAY = {"poll_interval": 0.05, "heartbeat_interval": 0.3, "stale_after": 1.5, "grace_period": 5.0}


@pytest.fixture
def provider() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """Postbox's spans go to an SDK provider of the test's own (the global one is left alone)."""
    exporter = InMemorySpanExporter()
    sdk = TracerProvider()
    sdk.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(sdk)
    try:
        yield sdk, exporter
    finally:
        tracing.use_tracer_provider(None)
        sdk.shutdown()


def _traceparent(span: ReadableSpan) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def _named(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def _headers(url: str, table: str, message_id: str) -> dict[str, object]:
    headers = scalar(url, f"SELECT headers FROM postbox.{table} WHERE message_id = %s", (message_id,))
    assert isinstance(headers, dict), f"{message_id} not in {table}"
    return headers


def _run_worker(url: str, registry: Registry, until: str, **settings: int) -> None:
    worker = Worker(url, registry, WorkerSettings(consumer="c", **FAST_WORKER, **settings))
    worker.start()
    try:
        eventually(lambda: scalar(url, until), what=until)
    finally:
        worker.stop()
        worker.join()


def _receive_and_handle(url: str, provider: TracerProvider) -> None:
    """Inside an application span: one message received alone, two in a batch, one with its own
    traceparent; the handler fails m1's first attempt transiently, dead-letters m2, publishes an
    event for m3."""
    with provider.get_tracer("app").start_as_current_span("checkout"), psycopg.connect(url) as conn:
        postbox.receive(conn, consumer="c", message_id="m1", key="k1", payload={}, correlation_id="order-7")
        postbox.receive_many(
            conn,
            [
                {"consumer": "c", "message_id": "m2", "key": "k2", "payload": {}},
                {"consumer": "c", "message_id": "m3", "key": "k3", "payload": {}},
            ],
        )
        postbox.receive(
            conn, consumer="c", message_id="m4", key="k4", payload={}, headers={"traceparent": GIVEN}
        )
        conn.commit()
    registry = Registry()

    @registry.handler("c", retry=QUICK)
    def handle(message, ctx):
        if message.message_id == "m1" and message.attempt == 1:
            raise ConnectionError("stock service down")
        if message.message_id == "m2":
            raise ValueError("no such product")
        if message.message_id == "m3":
            ctx.publish("next", {"from": "m3"}, message_id="e3")

    _run_worker(url, registry, DRAINED)


def test_receive_and_handling_spans_join_through_the_stored_traceparent(database, provider):
    """receive writes its span's context into the message's traceparent (not over a caller's own);
    every attempt is a CONSUMER span, child of it, with its decision, the exception of a failed
    one, and the publish of the handler's event as its child."""
    sdk, exporter = provider
    _receive_and_handle(database.url, sdk)
    spans = exporter.get_finished_spans()
    (app,) = _named(spans, "checkout")
    sends = _named(spans, "send c")
    assert [s.kind for s in sends] == [SpanKind.PRODUCER] * 3
    assert all(s.parent is not None and s.parent.span_id == app.context.span_id for s in sends)
    one, batch, _given = sends
    assert one.attributes is not None and dict(one.attributes) == {
        "messaging.system": "postbox", "messaging.destination.name": "c", "messaging.operation.name": "send",
        "messaging.operation.type": "send", "messaging.message.id": "m1",
        "messaging.message.conversation_id": "order-7", "postbox.message.key": "k1",
    }  # fmt: skip
    assert batch.attributes is not None and batch.attributes["messaging.batch.message_count"] == 2
    assert "messaging.message.id" not in batch.attributes
    stored = {m: _headers(database.url, "dead_letters", m) for m in ("m2",)}
    assert stored["m2"]["traceparent"] == _traceparent(batch)

    process = _named(spans, "process c")
    assert all(s.kind is SpanKind.CONSUMER for s in process)
    by_message: dict[str, list[ReadableSpan]] = {}
    for s in process:
        assert s.attributes is not None
        by_message.setdefault(str(s.attributes["messaging.message.id"]), []).append(s)
    assert {m: len(v) for m, v in by_message.items()} == {"m1": 2, "m2": 1, "m3": 1, "m4": 1}
    parents = {"m1": one, "m2": batch, "m3": batch}
    for message, parent in parents.items():
        for attempt in by_message[message]:
            assert attempt.parent is not None and attempt.parent.span_id == parent.context.span_id
            assert attempt.context.trace_id == app.context.trace_id
    (m4,) = by_message["m4"]  # the caller's traceparent was kept: the attempt is its child
    assert m4.parent is not None and f"{m4.parent.trace_id:032x}-{m4.parent.span_id:016x}" in GIVEN
    assert m4.parent.is_remote

    first, second = sorted(by_message["m1"], key=lambda s: s.attributes["postbox.attempt"])  # type: ignore[index]
    assert first.attributes is not None and first.attributes["postbox.decision"] == "retry"
    assert first.attributes["error.type"] == "ConnectionError"
    assert first.status.status_code is StatusCode.ERROR
    (event,) = first.events
    assert event.name == "exception" and event.attributes is not None
    assert event.attributes["exception.type"] == "ConnectionError"
    assert event.attributes["exception.message"] == "stock service down"
    assert second.attributes is not None and second.attributes["postbox.decision"] == "done"
    assert second.status.status_code is StatusCode.UNSET and not second.events
    (dead,) = by_message["m2"]
    assert dead.attributes is not None and dead.attributes["postbox.decision"] == "dead_letter"
    assert (
        dead.events[0].attributes is not None and dead.events[0].attributes["exception.type"] == "ValueError"
    )

    (publish,) = _named(spans, "publish next")
    (m3,) = by_message["m3"]
    assert publish.kind is SpanKind.PRODUCER
    assert publish.parent is not None and publish.parent.span_id == m3.context.span_id
    assert publish.attributes is not None and publish.attributes["messaging.operation.type"] == "create"
    assert _headers(database.url, "outbox", "e3")["traceparent"] == _traceparent(publish)


def test_an_async_handler_runs_in_its_attempt_span(database, provider):
    """receive_async writes the context; an ``async def`` handler runs with its attempt's span
    current, so the event it publishes (publish_async) is that span's child."""
    _, exporter = provider
    url = database.url

    async def produce() -> None:
        async with await psycopg.AsyncConnection.connect(url) as conn:
            await postbox.receive_async(conn, consumer="c", message_id="a1", key="k", payload={})
            await conn.commit()

    asyncio.run(produce())
    registry = Registry()

    @registry.handler("c")
    async def handle(message, ctx):
        await ctx.publish("next", {}, message_id="ea1")

    _run_worker(url, registry, DRAINED)
    spans = exporter.get_finished_spans()
    (send,) = _named(spans, "send c")
    (process,) = _named(spans, "process c")
    (publish,) = _named(spans, "publish next")
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert publish.parent is not None and publish.parent.span_id == process.context.span_id
    assert _headers(url, "outbox", "ea1")["traceparent"] == _traceparent(publish)


def test_a_batch_handlers_call_is_one_span_linked_to_each_message_and_a_failed_call_splits(
    database, provider
):
    """A batch handler's call with three messages is one ``process`` span linked to each message's
    ``traceparent``; a call that fails is marked ``split`` and its messages get a span each."""
    sdk, exporter = provider
    url = database.url
    with sdk.get_tracer("app").start_as_current_span("checkout"), psycopg.connect(url) as conn:
        for i in range(3):
            postbox.receive(conn, consumer="c", message_id=f"b{i}", key=f"k{i}", payload={}, headers={
                "traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"})  # fmt: skip
        conn.commit()
    registry = Registry()
    calls: list[int] = []

    @registry.batch_handler("c", retry=QUICK)
    def handle(messages, ctx):
        calls.append(len(messages))
        if len(calls) == 1:
            raise ConnectionError("the first call fails")

    _run_worker(url, registry, DRAINED, batch_size=10, concurrency=1)  # one claim takes all three
    assert calls == [3, 1, 1, 1]
    process = _named(exporter.get_finished_spans(), "process c")
    batch = [s for s in process if s.attributes.get("messaging.batch.message_count") == 3]
    assert len(batch) == 1 and batch[0].attributes["postbox.decision"] == "split"
    assert batch[0].parent is None
    assert sorted(link.context.trace_id for link in batch[0].links) == [1, 2, 3]
    alone = [s for s in process if s is not batch[0]]
    assert sorted(s.context.trace_id for s in alone) == [1, 2, 3]
    assert all(s.attributes["postbox.decision"] == "done" for s in alone)


def _publish_one(url: str, provider: TracerProvider, message_id: str, key: str, payload: object) -> None:
    with (
        provider.get_tracer("app").start_as_current_span(f"order {message_id}"),
        psycopg.connect(url) as conn,
    ):
        postbox.publish(conn, destination="next", message_id=message_id, key=key, payload=payload)
        conn.commit()


def test_relay_send_spans_link_the_published_rows(database, provider):
    """Each publish is a PRODUCER span whose context the row keeps; the relay's CLIENT span for a
    batch links every row's context (a batch of one is its child); a row the destination refused
    is recorded on it as an exception with its message id and decision; the target inbox gets the
    row's traceparent."""
    sdk, exporter = provider
    url = database.url
    with psycopg.connect(url) as conn:  # the target inbox already holds e3 with another payload
        postbox.receive(conn, consumer="next", message_id="e3", key="x", payload={"other": True})
        conn.commit()
    for i in (1, 2, 3):
        _publish_one(url, sdk, f"e{i}", f"k{i}", {"n": i})
    relay = Relay(url, {"next": PostgresTransport(url, "next")}, RelaySettings(**RELAY, batch_size=10))
    relay.start()
    try:
        eventually(lambda: scalar(url, RELAYED), what="relayed")
        _publish_one(url, sdk, "e4", "k4", {"n": 4})
        eventually(lambda: scalar(url, RELAYED), what="e4 relayed")
    finally:
        relay.stop()
        relay.join()
    spans = exporter.get_finished_spans()
    publishes = {s.attributes["messaging.message.id"]: s for s in _named(spans, "publish next")}  # type: ignore[index]
    assert sorted(publishes) == ["e1", "e2", "e3", "e4"]
    assert all(s.kind is SpanKind.PRODUCER for s in publishes.values())
    for message_id in ("e1", "e2"):
        assert _headers(url, "inbox", message_id)["traceparent"] == _traceparent(publishes[message_id])

    sends = [s for s in _named(spans, "send next") if s.kind is SpanKind.CLIENT]
    reached: dict[str, int] = {}  # message id -> the span id of its publish, by link or parent
    for send in sends:
        assert send.attributes is not None and send.attributes["messaging.system"] == "postbox"
        assert send.attributes["messaging.operation.type"] == "send"
        for link in send.links:
            assert link.attributes is not None
            reached[str(link.attributes["messaging.message.id"])] = link.context.span_id
        if not send.links:
            assert send.parent is not None
            reached[str(send.attributes["messaging.message.id"])] = send.parent.span_id
    assert reached == {m: s.context.span_id for m, s in publishes.items()}
    (last,) = [s for s in sends if not s.links and s.attributes["messaging.message.id"] == "e4"]  # type: ignore[index]
    assert last.parent is not None and last.parent.span_id == publishes["e4"].context.span_id

    (refused,) = [s for s in sends if s.status.status_code is StatusCode.ERROR]
    (event,) = [e for e in refused.events if e.name == "exception"]
    assert event.attributes is not None
    assert event.attributes["messaging.message.id"] == "e3"
    assert event.attributes["postbox.decision"] == "dead_letter"


def test_without_an_sdk_traceparent_flows_through_unchanged(database):
    """No SDK configured: no spans; a caller's traceparent is stored and reaches the handler as it
    was given, a message without one gets none, and the handler's event gets a child of it."""
    assert tracing._tracer() is None  # no SDK: the hooks do nothing
    url = database.url
    with psycopg.connect(url) as conn:
        postbox.receive(
            conn, consumer="c", message_id="m1", key="k1", payload={}, headers={"traceparent": GIVEN}
        )
        postbox.receive_many(conn, [{"consumer": "c", "message_id": "m2", "key": "k2", "payload": {}}])
        conn.commit()
    assert _headers(url, "inbox", "m1") == {"traceparent": GIVEN}
    assert _headers(url, "inbox", "m2") == {}
    seen: dict[str, object] = {}
    registry = Registry()

    @registry.handler("c")
    def handle(message, ctx):
        seen[message.message_id] = message.headers.get("traceparent")
        ctx.publish("next", {}, message_id=f"e-{message.message_id}")

    _run_worker(url, registry, DRAINED)
    assert seen == {"m1": GIVEN, "m2": None}
    child = _headers(url, "outbox", "e-m1")["traceparent"]
    assert isinstance(child, str) and child[:36] == GIVEN[:36] and child != GIVEN
    assert "traceparent" not in _headers(url, "outbox", "e-m2")


def test_without_opentelemetry_installed_nothing_breaks(database):
    """With OpenTelemetry not importable (the extra not installed), Postbox imports, its hooks are
    inert and a caller's traceparent is stored as given."""
    script = f"""
import sys
sys.modules["opentelemetry"] = None  # as if not installed: any import of it fails
import psycopg, postbox
from postbox.operations import tracing
assert tracing.OTEL is False
with psycopg.connect({database.url!r}) as conn:
    postbox.receive(conn, consumer="c", message_id="m1", payload={{}}, headers={{"traceparent": {GIVEN!r}}})
    postbox.publish(conn, destination="next", message_id="e1", payload={{}})
    conn.commit()
with tracing.processing(None) as span, tracing.relaying(None, "next", []) as sent:
    assert span is None and sent is None
print(tracing.child_headers({{"traceparent": {GIVEN!r}}}, None)["traceparent"][:36])
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == GIVEN[:36]
    assert _headers(database.url, "inbox", "m1") == {"traceparent": GIVEN}
    assert "traceparent" not in _headers(database.url, "outbox", "e1")


def test_a_publish_without_a_message_id_names_the_id_its_row_gets_on_its_span(database, provider):
    """``messaging.message.id`` on the span of a publish that left the id to its default: the
    random UUID the row is stored with (the span had no id)."""
    _, exporter = provider
    with psycopg.connect(database.url) as conn:
        postbox.publish(conn, destination="next", key="k", payload={"n": 1})
        conn.commit()
    (span,) = _named(exporter.get_finished_spans(), "publish next")
    assert span.attributes is not None
    stored = scalar(database.url, "SELECT message_id FROM postbox.outbox")
    assert span.attributes["messaging.message.id"] == stored and len(stored) == 36

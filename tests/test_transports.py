"""Transport contract suite, run against the real servers on this machine: every transport
publishes a batch that the broker's own client reads back with payload, headers, message_id and
per-key order; survives the broker going away (rows stay, retried, drained in order when it is
back); and a duplicate publish carries the same message_id for the receiver to drop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
import pytest

import postbox
from postbox.failures.policy import Backoff, RetryPolicy
from postbox.outbox.relay import Relay, RelaySettings
from postbox.outbox.transports import OutboxRow, Transport
from postbox.outbox.transports.http import HttpTransport
from postbox.outbox.transports.nats import NatsTransport
from postbox.outbox.transports.rabbitmq import RabbitMQTransport
from postbox.outbox.transports.redis import RedisStreamsTransport
from tests.helpers import eventually, scalar
from tests.proxy import Proxy

QUICK = RetryPolicy(
    strategy=Backoff.EXPONENTIAL_FULL_JITTER,
    base_delay=0.05,
    max_delay=0.5,
    max_attempts=1000,
    max_total_seconds=None,
)


@dataclass
class Kind:
    """One transport under test: how to make it (to a host:port), and how to read what arrived."""

    name: str
    port: int
    make: Callable[[str, int], Transport]
    read: Callable[[], list[dict]]  # [{"message_id", "key", "payload", "headers"}] in arrival order
    cleanup: Callable[[], None]


def rabbitmq_kind() -> Kind:
    import pika

    queue = f"postbox-test-{uuid.uuid4().hex[:8]}"

    def read() -> list[dict]:
        conn = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1:5672/%2F"))
        ch = conn.channel()
        out = []
        while True:
            method, props, body = ch.basic_get(queue, auto_ack=False)
            if method is None:
                break
            out.append(
                {
                    "message_id": props.message_id,
                    "key": props.headers["postbox-key"],
                    "payload": json.loads(body),
                    "headers": props.headers,
                    "correlation_id": props.correlation_id,
                }
            )
        conn.close()  # unacked: they stay for the next read
        return out

    def cleanup() -> None:
        conn = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1:5672/%2F"))
        conn.channel().queue_delete(queue)
        conn.close()

    return Kind(
        "rabbitmq",
        5672,
        lambda h, p: RabbitMQTransport(f"amqp://guest:guest@{h}:{p}/%2F", queue),
        read,
        cleanup,
    )


def redis_kind() -> Kind:
    import redis

    stream = f"postbox-test:{uuid.uuid4().hex[:8]}"
    client = redis.Redis(host="127.0.0.1", port=6379)

    def read() -> list[dict]:
        out = []
        for _, f in client.xrange(stream):
            fields = {k.decode(): v.decode() for k, v in f.items()}
            out.append(
                {
                    "message_id": fields["message_id"],
                    "key": fields["key"],
                    "payload": json.loads(fields["payload"]),
                    "headers": json.loads(fields["headers"]),
                    "correlation_id": fields["correlation_id"] or None,
                }
            )
        return out

    return Kind(
        "redis",
        6379,
        lambda h, p: RedisStreamsTransport(f"redis://{h}:{p}/0", stream),
        read,
        lambda: client.delete(stream),
    )


def nats_kind() -> Kind:
    import nats

    suffix = uuid.uuid4().hex[:8]
    subject, stream = f"postbox.test.{suffix}", f"POSTBOX_TEST_{suffix.upper()}"

    async def _read() -> list[dict]:
        nc = await nats.connect("nats://127.0.0.1:4222")
        js = nc.jetstream()
        out = []
        try:
            info = await js.stream_info(stream)
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                m = await js.get_msg(stream, seq)
                h = m.headers or {}
                out.append(
                    {
                        "message_id": h.get("Nats-Msg-Id"),
                        "key": h.get("postbox-key"),
                        "payload": json.loads(m.data),
                        "headers": h,
                        "correlation_id": h.get("postbox-correlation-id"),
                    }
                )
        except Exception:
            pass
        await nc.close()
        return out

    async def _cleanup() -> None:
        nc = await nats.connect("nats://127.0.0.1:4222")
        with contextlib.suppress(Exception):
            await nc.jetstream().delete_stream(stream)
        await nc.close()

    return Kind(
        "nats",
        4222,
        lambda h, p: NatsTransport(f"nats://{h}:{p}", subject, stream),
        lambda: asyncio.run(_read()),
        lambda: asyncio.run(_cleanup()),
    )


def http_kind() -> Kind:
    received: list[dict] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                received.append(
                    {
                        "message_id": self.headers["Idempotency-Key"],
                        "key": doc["key"],
                        "payload": doc["payload"],
                        "headers": dict(self.headers),
                        "correlation_id": doc["correlation_id"],
                    }
                )
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def read() -> list[dict]:
        with lock:
            return list(received)

    def cleanup() -> None:
        server.shutdown()
        server.server_close()

    return Kind(
        "http",
        server.server_address[1],
        lambda h, p: HttpTransport(f"http://{h}:{p}/events", timeout=2),
        read,
        cleanup,
    )


def kafka_kind() -> Kind:
    """Kafka on a Tansu broker of its own, started at the first make(): it advertises the address
    the transport is given, so that a test's proxy in front of it carries all the traffic (a Kafka
    client otherwise connects to the advertised address, around the proxy). read() goes through that
    address too, reopened if the test has closed its proxy."""
    from tests.kafka_broker import Tansu, read_topic

    topic = f"postbox-test-{uuid.uuid4().hex[:8]}"
    broker = Tansu()

    def make(h: str, p: int) -> Transport:
        from postbox.outbox.transports.kafka import KafkaTransport

        if broker.proc is None:
            broker.advertised_port = p
            broker.start()
        return KafkaTransport(f"{h}:{p}", topic, {"message.timeout.ms": 1500})

    def read() -> list[dict]:
        reopened = None
        if broker.advertised_port != broker.port:
            reopened = Proxy("127.0.0.1", broker.port)
            reopened.down()
            reopened.port = broker.advertised_port
            reopened.up()
        try:
            return [
                {
                    "message_id": r["headers"]["postbox-message-id"],
                    "key": r["key"],
                    "payload": r["payload"],
                    "headers": r["headers"],
                    "correlation_id": r["headers"].get("postbox-correlation-id"),
                }
                for r in read_topic(f"127.0.0.1:{broker.advertised_port}", topic)
            ]
        finally:
            if reopened is not None:
                reopened.down()

    return Kind("kafka", broker.port, make, read, broker.close)


KINDS = {
    "rabbitmq": rabbitmq_kind,
    "redis": redis_kind,
    "nats": nats_kind,
    "http": http_kind,
    "kafka": kafka_kind,
}


@pytest.fixture(params=sorted(KINDS))
def kind(request):
    k = KINDS[request.param]()
    yield k
    k.cleanup()


def rows_for(n: int, keys: int) -> list[tuple[str, str]]:
    return [(f"m{i}-{uuid.uuid4().hex[:6]}", f"k{i % keys}") for i in range(n)]


def write(url: str, rows: list[tuple[str, str]]) -> None:
    with psycopg.connect(url) as c:
        for i in range(0, len(rows), 10):
            postbox.publish_many(
                c,
                [
                    {
                        "destination": "d",
                        "message_id": m,
                        "key": k,
                        "payload": {"m": m, "n": [1, "é"]},
                        "headers": {"traceparent": "00-abc-def-01"},
                        "correlation_id": "corr",
                    }
                    for m, k in rows[i : i + 10]
                ],
            )
            c.commit()


def by_key(rows: list[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for m, k in rows:
        out.setdefault(k, []).append(m)
    return out


def arrived_by_key(messages: list[dict]) -> dict[str, list[str]]:
    """Per key, message ids in arrival order, a redelivery right after itself folded in."""
    out: dict[str, list[str]] = {}
    for m in messages:
        seq = out.setdefault(m["key"], [])
        if not seq or seq[-1] != m["message_id"]:
            seq.append(m["message_id"])
    return out


def relay(url: str, transport: Transport, **kw) -> Relay:
    r = Relay(
        url,
        {"d": transport},
        RelaySettings(
            poll_interval=0.05, heartbeat_interval=0.3, stale_after=1.5, batch_size=8, retry=QUICK, **kw
        ),
    )
    r.start()
    return r


def test_publish_batch_arrives_with_ids_headers_and_key_order(database, kind):
    """Rows published through the relay arrive once each, in key order, with payload, message_id,
    key, correlation id and the row's headers."""
    rows = rows_for(60, 6)
    write(database.url, rows)
    # Three loops, each with its own client (broker clients are not thread-safe).
    r = relay(database.url, lambda: kind.make("127.0.0.1", kind.port), concurrency=3)
    try:
        eventually(lambda: scalar(database.url, "SELECT count(*) = 0 FROM postbox.outbox"))
    finally:
        r.stop()
        r.join()
    got = kind.read()
    assert len(got) == 60
    assert arrived_by_key(got) == by_key(rows)
    first = got[0]
    assert first["payload"] == {"m": first["message_id"], "n": [1, "é"]}
    assert first["correlation_id"] == "corr"
    assert first["headers"].get("traceparent") == "00-abc-def-01"


def test_broker_outage_rows_stay_and_drain_in_order(database, kind):
    """The broker goes away mid-run (a proxy cuts it): rows stay in the outbox, failures are retried
    with backoff, and when it is back everything arrives, each key in order."""
    proxy = Proxy("127.0.0.1", kind.port)
    rows = rows_for(80, 5)
    write(database.url, rows[:20])
    r = relay(database.url, kind.make("127.0.0.1", proxy.port))
    try:
        eventually(lambda: scalar(database.url, "SELECT count(*) = 0 FROM postbox.outbox"))
        proxy.down()
        write(database.url, rows[20:])
        eventually(
            lambda: scalar(database.url, "SELECT count(*) FROM postbox.attempts WHERE origin = 'outbox'") >= 3
        )
        assert scalar(database.url, "SELECT count(*) FROM postbox.outbox") == 60
        proxy.up()
        eventually(lambda: scalar(database.url, "SELECT count(*) = 0 FROM postbox.outbox"), timeout=60)
    finally:
        r.stop()
        r.join()
        proxy.down()
    got = kind.read()
    assert arrived_by_key(got) == by_key(rows)
    assert {m["message_id"] for m in got} == {m for m, _ in rows}
    assert scalar(database.url, "SELECT count(*) FROM postbox.dead_letters") == 0


def test_duplicate_publish_carries_the_same_message_id(database, kind):
    """Publishing a row again (a confirmation lost) is recognisable: the copy has the same message_id
    (NATS JetStream even drops it within its deduplication window)."""
    from datetime import UTC, datetime

    row = OutboxRow(
        1, "d", f"dup-{uuid.uuid4().hex[:6]}", "k", "t", {"x": 1}, {}, None, None, datetime.now(UTC), 1
    )
    t = kind.make("127.0.0.1", kind.port)
    try:
        assert t.publish([row]) == [None]
        assert t.publish([row]) == [None]
    finally:
        t.close()
    got = kind.read()
    assert {m["message_id"] for m in got} == {row.message_id}
    assert len(got) == (1 if kind.name == "nats" else 2)


def test_rabbitmq_unroutable_message_is_a_permanent_failure():
    """A message RabbitMQ cannot route (no queue bound) comes back and fails permanently instead of
    vanishing; the rest of the batch is published."""
    from datetime import UTC, datetime

    from postbox.failures.outcomes import Permanent

    t = RabbitMQTransport(
        "amqp://guest:guest@127.0.0.1:5672/%2F",
        f"nobody-{uuid.uuid4().hex[:6]}",
        exchange="amq.direct",
        declare_queue=False,
    )
    row = OutboxRow(
        1, "d", f"lost-{uuid.uuid4().hex[:6]}", "k", None, {}, {}, None, None, datetime.now(UTC), 1
    )
    try:
        (result,) = t.publish([row])
    finally:
        t.close()
    assert isinstance(result, Permanent) and "could not route" in str(result)


# --- the HTTP transport: redirects, the outbound policy, masked failures ---------------------------


class _Webhook:
    """A local webhook: answers each POST with ``status`` (a 3xx points back at itself, and is
    seen as a second request if followed) and ``body``; counts what it receives."""

    def __init__(self, status: int = 200, body: str = "") -> None:
        self.paths: list[str] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # where a followed 301, 302 or 303 would go
                hook.paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                hook.paths.append(self.path)
                reply = body.encode()
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", f"http://127.0.0.1:{hook.port}/again")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _row() -> OutboxRow:
    from datetime import UTC, datetime

    return OutboxRow(1, "d", f"m-{uuid.uuid4().hex[:6]}", "k", None, {}, {}, None, None, datetime.now(UTC), 1)


def _publish_once(transport: Transport) -> BaseException | None:
    try:
        (result,) = transport.publish([_row()])
    finally:
        transport.close()
    return result


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_http_transport_never_follows_a_redirect(status):
    """A 3xx is a permanent failure of the row; its Location is never requested."""
    from postbox.failures.outcomes import Permanent

    hook = _Webhook(status)
    try:
        result = _publish_once(HttpTransport(f"http://127.0.0.1:{hook.port}/events", timeout=2))
    finally:
        hook.close()
    assert isinstance(result, Permanent) and f"HTTP {status}" in str(result)
    assert hook.paths == ["/events"]


def _configured(postbox: dict, url: str) -> Transport:
    """The transport ``postbox relay`` builds for an HTTP destination under these settings."""
    from postbox.config.policies import build_transports, load_policies

    config = load_policies({"postbox": postbox, "destinations": {"hook": {"kind": "http", "url": url}}})
    factory = build_transports(config, ["hook"], "postgresql://unused")["hook"]
    transport: Transport = factory()
    return transport


@pytest.mark.parametrize(
    ("postbox", "host", "setting"),
    [
        ({"http_allowed_hosts": ["partner.example", "*.hooks.example"]}, "127.0.0.1", "http_allowed_hosts"),
        ({"http_deny_private_networks": True}, "localhost", "http_deny_private_networks"),
        ({"http_deny_private_networks": True}, "127.0.0.1", "http_deny_private_networks"),
    ],
    ids=["not-allowed", "private-behind-a-name", "private-address"],
)
def test_http_destination_refused_by_the_outbound_settings_fails_permanently(postbox, host, setting):
    """A destination whose host the outbound settings refuse fails each row permanently, with an
    error naming the host and the setting; the webhook receives nothing."""
    from postbox.failures.outcomes import Permanent

    hook = _Webhook()
    try:
        result = _publish_once(_configured(postbox, f"http://{host}:{hook.port}/events"))
    finally:
        hook.close()
    assert isinstance(result, Permanent), result
    assert host in str(result) and setting in str(result)
    assert hook.paths == []


def test_http_destination_in_the_allow_list_is_delivered():
    hook = _Webhook()
    try:
        result = _publish_once(
            _configured({"http_allowed_hosts": ["127.0.0.1"]}, f"http://127.0.0.1:{hook.port}/e")
        )
    finally:
        hook.close()
    assert result is None and hook.paths == ["/e"]


def test_http_transport_failure_quoting_its_url_is_masked():
    """A webhook error that quotes the caller's URL (password, token) and its bearer token ends in
    the failure without any of them."""
    password, token, bearer = (f"{k}{uuid.uuid4().hex[:12]}" for k in ("pw", "tok", "bearer"))
    url_shown = f"http://svc:{password}@partner.example/events?token={token}"
    hook = _Webhook(500, f"upstream {url_shown} said no (Authorization: Bearer {bearer})")
    try:
        result = _publish_once(HttpTransport(f"http://127.0.0.1:{hook.port}/events", timeout=2))
    finally:
        hook.close()
    text = str(result)
    assert "HTTP 500" in text and "svc:***@partner.example" in text
    assert password not in text and token not in text and bearer not in text

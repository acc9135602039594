"""The bridge (broker → inbox) and the whole loop broker → bridge → inbox → handler → outbox →
relay → broker, on the real brokers of this machine."""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from postbox.failures.outcomes import Transient
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from postbox.outbox.bridge import Bridge
from postbox.outbox.transports import OutboxRow, source_for
from postbox.outbox.transports.nats import NatsTransport
from postbox.outbox.transports.rabbitmq import RabbitMQTransport
from postbox.outbox.transports.redis import RedisStreamsTransport
from tests.checker import terminate_backends
from tests.helpers import FAST_WORKER, eventually, scalar, spawn_postbox
from tests.proxy import Proxy
from tests.test_transports import arrived_by_key


def rows(n: int, keys: int) -> list[OutboxRow]:
    now = datetime.now(UTC)
    return [
        OutboxRow(
            i,
            "in",
            f"in-{i}-{uuid.uuid4().hex[:6]}",
            f"k{i % keys}",
            "order.event",
            {"i": i},
            {"traceparent": "00-aa-bb-01"},
            "corr",
            None,
            now,
            1,
        )
        for i in range(n)
    ]


def sources():
    suffix = uuid.uuid4().hex[:8]
    return {
        "rabbitmq": (
            lambda: RabbitMQTransport("amqp://guest:guest@127.0.0.1:5672/%2F", f"bridge-{suffix}"),
            lambda: source_for("amqp://guest:guest@127.0.0.1:5672/%2F", f"bridge-{suffix}"),
        ),
        "redis": (
            lambda: RedisStreamsTransport("redis://127.0.0.1:6379/0", f"bridge:{suffix}"),
            lambda: source_for("redis://127.0.0.1:6379/0", f"bridge:{suffix}"),
        ),
        "nats": (
            lambda: NatsTransport("nats://127.0.0.1:4222", f"bridge.{suffix}", f"BRIDGE_{suffix.upper()}"),
            lambda: source_for("nats://127.0.0.1:4222", f"BRIDGE_{suffix.upper()}:bridge.{suffix}"),
        ),
    }


@pytest.mark.parametrize("broker", ["rabbitmq", "redis", "nats"])
def test_bridge_receives_once_and_acknowledges(database, broker):
    """Every broker message lands in the inbox once with its id, key, type and headers; a message
    delivered twice (published twice) is absorbed as a duplicate; everything is acknowledged."""
    make_transport, make_source = sources()[broker]
    batch = rows(40, 4)
    t = make_transport()
    try:
        assert t.publish(batch) == [None] * 40
        assert t.publish(batch[:5]) == [None] * 5  # redelivered
    finally:
        t.close()
    b = Bridge(database.url, make_source(), "orders", batch_size=16, wait=0.2, origin=broker)
    thread = threading.Thread(target=b.run)
    thread.start()
    try:
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM postbox.inbox") == 40)
        expected_dups = 0 if broker == "nats" else 5  # JetStream drops the copies itself
        eventually(lambda: b.duplicates == expected_dups)
    finally:
        b.stop()
        thread.join(30)
    assert scalar(database.url, "SELECT count(DISTINCT message_id) FROM postbox.inbox") == 40
    row = scalar(
        database.url,
        "SELECT row(key, type, correlation_id, source, headers->>'traceparent')::text"
        " FROM postbox.inbox WHERE message_id = %s",
        (batch[1].message_id,),
    )
    assert row == f"(k1,order.event,corr,{broker},00-aa-bb-01)"
    # Acknowledged: a second bridge on the same source finds nothing left to receive.
    b2 = Bridge(database.url, make_source(), "orders", batch_size=16, wait=0.2)
    assert b2.source.fetch(100, 0.5) == []
    b2.source.close()


def test_full_loop_with_failures_and_a_killed_relay(database, tmp_path):
    """RabbitMQ → bridge → inbox → handler (business row + outbox event, one transaction, random
    transient failures) → relay (killed with kill -9 and restarted) → RabbitMQ: every event arrives
    at least once, each key in order."""
    import pika

    url = database.url
    suffix = uuid.uuid4().hex[:8]
    inq, outq = f"loop-in-{suffix}", f"loop-out-{suffix}"
    with database.connect(autocommit=True) as c:
        c.execute(
            "CREATE TABLE business (message_id text PRIMARY KEY, key text, at timestamptz DEFAULT clock_timestamp())"
        )
    reg = Registry()
    rng = random.Random(3)

    @reg.handler("orders")
    def handle(m, ctx):
        if rng.random() < 0.2:
            raise Transient("flaky dependency")
        ctx.conn.execute("INSERT INTO business (message_id, key) VALUES (%s, %s)", (m.message_id, m.key))
        ctx.publish("events", {"done": m.message_id}, key=m.key, message_id=f"evt-{m.message_id}")

    from postbox.failures.policy import Backoff, RetryPolicy

    worker = Worker(
        url,
        reg,
        WorkerSettings(
            consumer="orders",
            concurrency=2,
            retry=RetryPolicy(strategy=Backoff.FIXED, base_delay=0.02, max_attempts=100),
            **FAST_WORKER,
        ),
    )
    worker.start()
    bridge = Bridge(
        url, source_for("amqp://guest:guest@127.0.0.1:5672/%2F", inq), "orders", batch_size=20, wait=0.2
    )
    bt = threading.Thread(target=bridge.run)
    bt.start()
    config = tmp_path / "postbox.toml"
    config.write_text(
        f'[destinations.events]\nkind = "rabbitmq"\nrouting_key = "{outq}"\n'
        'retry = { strategy = "fixed", base_delay = 0.05 }\n'
    )
    args = (
        "--config",
        str(config),
        "--database-url",
        url,
        "relay",
        "--batch-size",
        "10",
        "--poll-interval",
        "0.05",
        "--heartbeat-interval",
        "0.3",
        "--stale-after",
        "1",
        "--lease",
        "2",
    )
    relay = spawn_postbox(*args)
    source_rows = rows(300, 12)
    try:
        t = RabbitMQTransport("amqp://guest:guest@127.0.0.1:5672/%2F", inq)
        assert t.publish(source_rows) == [None] * 300
        t.close()
        eventually(lambda: scalar(url, "SELECT count(*) FROM business") > 100, timeout=60)
        relay.send_signal(signal.SIGKILL)
        relay.wait()
        relay = spawn_postbox(*args)
        eventually(
            lambda: (
                scalar(url, "SELECT count(*) FROM business") == 300
                and scalar(url, "SELECT count(*) FROM postbox.outbox") == 0
            ),
            timeout=90,
        )
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
        bridge.stop()
        bt.join(30)
        worker.stop()
        worker.join()
    conn = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1:5672/%2F"))
    ch = conn.channel()
    got = []
    while True:
        method, props, _body = ch.basic_get(outq, auto_ack=True)
        if method is None:
            break
        got.append({"message_id": props.message_id, "key": props.headers["postbox-key"]})
    ch.queue_delete(outq)
    ch.queue_delete(inq)
    conn.close()
    expected: dict[str, list[str]] = {}
    for r in source_rows:
        expected.setdefault(r.key, []).append(f"evt-{r.message_id}")
    # Per key, in order; a row republished after the kill shows up as a repeat right after itself.
    assert arrived_by_key(got) == expected
    duplicates = len(got) - 300
    assert duplicates >= 0
    assert scalar(url, "SELECT count(*) FROM business") == 300  # exactly-once effects in the database


def test_bridge_waits_for_its_consumer_to_be_declared(database):
    """Once any consumer is declared, an undeclared one cannot receive: a bridge started before its
    consumer's worker waits (nothing consumed, nothing lost) and starts bridging once it is declared."""
    make_transport, make_source = sources()["redis"]
    scalar(database.url, "SELECT postbox.declare_consumer_v1('orders')")
    t = make_transport()
    try:
        t.publish(rows(3, 1))
    finally:
        t.close()
    b = Bridge(database.url, make_source(), "shipping", batch_size=16, wait=0.2, origin="redis")
    thread = threading.Thread(target=b.run)
    thread.start()
    try:
        assert thread.is_alive() and b.received == 0
        scalar(database.url, "SELECT postbox.declare_consumer_v1('shipping')")
        eventually(
            lambda: (
                scalar(database.url, "SELECT count(*) FROM postbox.inbox WHERE consumer = 'shipping'") == 3
            )
        )
    finally:
        b.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_bridge_keeps_going_when_its_database_connections_are_terminated(database):
    """pg_terminate_backend on the bridge's connections while it bridges: it reconnects and retries
    the batch (committed first, acknowledged after), so every message lands exactly once."""
    make_transport, make_source = sources()["redis"]
    t = make_transport()
    b = Bridge(database.url, make_source(), "orders", batch_size=8, wait=0.1, origin="redis")
    thread = threading.Thread(target=b.run)
    thread.start()
    try:
        batch = rows(200, 10)
        for i in range(0, 200, 20):
            t.publish(batch[i : i + 20])
            terminate_backends(database.url, "postbox-bridge")
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM postbox.inbox") == 200, timeout=60)
    finally:
        t.close()
        b.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert scalar(database.url, "SELECT count(DISTINCT message_id) FROM postbox.inbox") == 200


def test_bridge_started_while_its_database_refuses_connections_waits_and_then_bridges(database, caplog):
    """A bridge that starts before its database accepts connections (a restart, a compose start
    order) waits for it, saying so, instead of stopping; then it bridges as usual."""
    make_transport, make_source = sources()["redis"]
    t = make_transport()
    with psycopg.connect(database.server.url("postgres"), autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{database.name}" ALLOW_CONNECTIONS false')
    b = Bridge(database.url, make_source(), "orders", batch_size=8, wait=0.1, origin="redis")
    thread = threading.Thread(target=b.run)
    try:
        with caplog.at_level("WARNING", logger="postbox.bridge"):
            thread.start()
            eventually(
                lambda: any("database unavailable" in r.getMessage() for r in caplog.records),
                what="the bridge says the database is unavailable",
            )
        assert thread.is_alive() and b.fatal is None
        with psycopg.connect(database.server.url("postgres"), autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{database.name}" ALLOW_CONNECTIONS true')
        t.publish(rows(5, 5))
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM postbox.inbox") == 5, timeout=30)
    finally:
        with psycopg.connect(database.server.url("postgres"), autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{database.name}" ALLOW_CONNECTIONS true')
        t.close()
        b.stop()
        if thread.ident is not None:  # started
            thread.join(timeout=30)
    assert not thread.is_alive()


def queue_of_one(prefix: str) -> str:
    """A new RabbitMQ queue holding one message (an outbox row's)."""
    queue = f"{prefix}-{uuid.uuid4().hex[:8]}"
    t = RabbitMQTransport("amqp://guest:guest@127.0.0.1:5672/%2F", queue)
    try:
        t.publish(rows(1, 1))
    finally:
        t.close()
    return queue


def spawn_bridge(url: str, source: str, name: str, log: Path, *options: str) -> subprocess.Popen[bytes]:
    """`postbox bridge` from ``source`` into the inbox of consumer ``orders``, its log in ``log``."""
    with open(log, "wb") as out:
        return spawn_postbox(
            *options, "--database-url", url, "bridge", "--from", source, "--name", name, "--consumer", "orders",
            stderr=out.fileno(),
        )  # fmt: skip


@contextmanager
def reaped(p: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    """``p``, killed on the way out if it still runs."""
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_bridge_whose_broker_goes_away_exits_70_for_its_supervisor(database, tmp_path):
    """The broker's connection cut under a running `postbox bridge`: the process stops, fatal, with
    exit status 70 (for its supervisor to start it again) and one line saying why, no traceback."""
    proxy = Proxy("127.0.0.1", 5672)
    log = tmp_path / "bridge.log"
    queue = queue_of_one("bridge-fatal")
    source = f"amqp://guest:guest@127.0.0.1:{proxy.port}/%2F"
    try:
        with reaped(spawn_bridge(database.url, source, queue, log)) as p:
            eventually(
                lambda: (
                    scalar(database.url, "SELECT count(*) FROM postbox.inbox WHERE consumer = 'orders'") == 1
                ),
                what="the bridge bridging",
            )
            proxy.down()
            assert p.wait(60) == 70, log.read_text()
    finally:
        proxy.down()
    text = log.read_text()
    assert "bridge stopped:" in text and "Traceback" not in text


def _closed_port() -> int:
    """A local port nothing listens on."""
    from tests.kafka_broker import free_port

    return free_port()


@pytest.mark.parametrize(
    ("scheme", "name"),
    [
        ("amqp://guest:bridge-pw@127.0.0.1:{port}/%2F", "q"),
        ("redis://127.0.0.1:{port}/0", "s"),
        ("nats://127.0.0.1:{port}", "ORDERS:orders.in"),
    ],
    ids=["rabbitmq", "redis", "nats"],
)
def test_a_bridge_waits_for_a_broker_it_cannot_reach_and_stops_at_once_on_sigterm(
    database, tmp_path, monkeypatch, scheme, name
):
    """Started before its broker (the usual race in a compose file): a line a try, saying so, no
    traceback, no password; SIGTERM exits 0 within a try (it died with the client's traceback,
    and NATS's client ignored the signal for half a minute)."""
    monkeypatch.setenv("POSTBOX_LOG_LEVEL", "info")
    log = tmp_path / "bridge.log"
    source = scheme.format(port=_closed_port())
    with reaped(spawn_bridge(database.url, source, name, log, "--log-format", "text")) as p:
        eventually(
            lambda: log.read_text().count("cannot reach the broker") >= 2, timeout=30, what="two tries"
        )
        assert p.poll() is None
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
    text = log.read_text()
    assert "Traceback" not in text and "bridge-pw" not in text, text


def test_a_bridge_started_before_its_broker_bridges_once_the_broker_is_up(database, tmp_path):
    """RabbitMQ unreachable at start (a proxy down in front of it), then up: the bridge connects at
    its next try and the queued message reaches the inbox."""
    proxy = Proxy("127.0.0.1", 5672)
    proxy.down()
    queue = queue_of_one("bridge-late")
    log = tmp_path / "bridge.log"
    source = f"amqp://guest:guest@127.0.0.1:{proxy.port}/%2F"
    try:
        with reaped(spawn_bridge(database.url, source, queue, log)) as p:
            eventually(lambda: "cannot reach the broker" in log.read_text(), timeout=30, what="a failed try")
            proxy.up()
            eventually(
                lambda: (
                    scalar(database.url, "SELECT count(*) FROM postbox.inbox WHERE consumer = 'orders'") == 1
                ),
                timeout=60,
                what="the message bridged once the broker is up",
            )
            p.send_signal(signal.SIGTERM)
            assert p.wait(20) == 0
    finally:
        proxy.down()
    assert "Traceback" not in log.read_text()

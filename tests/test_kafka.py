"""Kafka, against a real Kafka-protocol broker (Tansu, tests/kafka_broker.py): the relay's transport
(key order on one partition, headers, oversize records, the broker killed and restarted) and the
bridge's source (once into the inbox, poison records dead-lettered with their coordinates, a bridge
killed between the inbox commit and the offset commit)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime

import psycopg
import pytest

import postbox
from postbox.failures.outcomes import Permanent
from postbox.failures.policy import Backoff, RetryPolicy
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from postbox.outbox.bridge import Bridge
from postbox.outbox.relay import Relay, RelaySettings
from postbox.outbox.transports import OutboxRow, source_for
from postbox.outbox.transports.kafka import KafkaTransport
from tests.helpers import FAST_WORKER, REPO, eventually, scalar, spawn_postbox
from tests.kafka_broker import FAST_GROUP, Tansu, read_topic

pytest.importorskip("confluent_kafka")

QUICK = RetryPolicy(strategy=Backoff.FIXED, base_delay=0.05, max_attempts=1000, max_total_seconds=None)


def row(i: int, key: str, **kw) -> OutboxRow:
    fields = {"type": "order.event", "payload": {"i": i}, "headers": {}, "correlation_id": None}
    fields.update(kw)
    return OutboxRow(
        i, "d", f"m{i}-{uuid.uuid4().hex[:6]}", key, fields["type"], fields["payload"], fields["headers"],
        fields["correlation_id"], None, datetime.now(UTC), 1,
    )  # fmt: skip


def write(url: str, messages: list[dict], destination: str = "d") -> None:
    with psycopg.connect(url) as c:
        postbox.publish_many(c, [{"destination": destination, **m} for m in messages])
        c.commit()


def relay(url: str, transport, **kw) -> Relay:
    r = Relay(url, {"d": transport}, RelaySettings(poll_interval=0.05, batch_size=8, retry=QUICK, **kw))
    r.start()
    return r


# --- the relay's transport -------------------------------------------------------------------------


def test_a_key_goes_to_one_partition_in_order_with_its_headers(database, kafka_broker):
    """Through the relay to a topic of 3 partitions: each key's rows on one partition, in the order
    written; the envelope (ids, type, correlation, causation, traceparent, the row's headers) as
    record headers, the key as the record key."""
    topic = kafka_broker.create_topic(f"keys-{uuid.uuid4().hex[:8]}", partitions=3)
    messages = [
        {"message_id": f"m{i}-{uuid.uuid4().hex[:4]}", "key": f"k{i % 5}", "type": "order.event",
         "payload": {"i": i}, "headers": {"traceparent": "00-abc-def-01", "tenant": "t1"},
         "correlation_id": "corr", "causation_id": "cause"}
        for i in range(50)
    ]  # fmt: skip
    write(database.url, messages)
    r = relay(database.url, lambda: KafkaTransport(kafka_broker.bootstrap, topic), concurrency=2)
    try:
        eventually(lambda: scalar(database.url, "SELECT count(*) = 0 FROM postbox.outbox"))
    finally:
        r.stop()
        r.join()
    records = read_topic(kafka_broker.bootstrap, topic)
    partitions: dict[str, set[int]] = {}
    order: dict[str, list[str]] = {}
    for rec in records:
        partitions.setdefault(rec["key"], set()).add(rec["partition"])
        seq = order.setdefault(rec["key"], [])
        if not seq or seq[-1] != rec["headers"]["postbox-message-id"]:
            seq.append(rec["headers"]["postbox-message-id"])
    assert all(len(p) == 1 for p in partitions.values()), partitions
    assert len({p for ps in partitions.values() for p in ps}) > 1  # the keys spread over partitions
    assert order == {k: [m["message_id"] for m in messages if m["key"] == k] for k in order}
    assert len(order) == 5
    h = records[0]["headers"]
    assert h["postbox-type"] == "order.event" and h["postbox-correlation-id"] == "corr"
    assert (
        h["postbox-causation-id"] == "cause" and h["traceparent"] == "00-abc-def-01" and h["tenant"] == "t1"
    )
    assert records[0]["payload"] == {"i": int(h["postbox-message-id"][1:].split("-")[0])}


def test_topic_from_the_message_type(kafka_broker):
    t = KafkaTransport(kafka_broker.bootstrap, "events.{type}")
    try:
        ok, untyped = t.publish([row(1, "k", type="order.paid"), row(2, "k2", type=None)])
    finally:
        t.close()
    assert ok is None
    assert isinstance(untyped, Permanent) and "needs the message type" in str(untyped)
    assert [r["payload"] for r in read_topic(kafka_broker.bootstrap, "events.order.paid")] == [{"i": 1}]


def test_oversize_record_is_a_permanent_failure_dead_lettered_with_the_reason(database, kafka_broker):
    """A record over message.max.bytes fails permanently with librdkafka's reason (Tansu itself does not
    enforce a size limit; a Kafka broker's refusal has the same code): the relay dead-letters it at
    once (its key blocked behind it, as the destination's on_dead_letter says); other keys go on."""
    topic = f"big-{uuid.uuid4().hex[:8]}"
    write(database.url, [
        {"message_id": "big", "key": "k", "payload": {"blob": "x" * 20_000}},
        {"message_id": "small", "key": "k2", "payload": {"i": 1}},
    ])  # fmt: skip
    r = relay(
        database.url,
        KafkaTransport(kafka_broker.bootstrap, topic, {"message.max.bytes": 10_000}),
    )
    try:
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM postbox.dead_letters") == 1)
        eventually(lambda: scalar(database.url, "SELECT count(*) = 1 FROM postbox.outbox"))
    finally:
        r.stop()
        r.join()
    dead = scalar(
        database.url, "SELECT row(message_id, reason, attempt, last_error)::text FROM postbox.dead_letters"
    )
    assert dead.startswith("(big,permanent,1,") and "MSG_SIZE_TOO_LARGE" in dead, dead
    assert [r["headers"]["postbox-message-id"] for r in read_topic(kafka_broker.bootstrap, topic)] == [
        "small"
    ]


def test_broker_killed_is_retried_and_delivered_after_restart(database):
    """The broker process is killed (SIGKILL) under the relay: sends fail transiently, rows stay
    and are retried; once a broker is back on the port everything written meanwhile arrives, each
    key in order (the broker keeps nothing across the kill: its storage is in memory)."""
    broker = Tansu().start()
    topic = f"outage-{uuid.uuid4().hex[:8]}"
    transport = KafkaTransport(broker.bootstrap, topic, {"message.timeout.ms": 1000})
    r = relay(database.url, transport)
    try:
        write(database.url, [{"message_id": "before", "key": "k0", "payload": {}}])
        eventually(lambda: scalar(database.url, "SELECT count(*) = 0 FROM postbox.outbox"))
        broker.kill()
        later = [{"message_id": f"m{i}", "key": f"k{i % 3}", "payload": {"i": i}} for i in range(12)]
        write(database.url, later)
        eventually(
            lambda: scalar(database.url, "SELECT count(*) FROM postbox.attempts WHERE origin = 'outbox'") >= 2
        )
        last_error = scalar(
            database.url, "SELECT last_error FROM postbox.outbox WHERE last_error IS NOT NULL LIMIT 1"
        )
        assert "Kafka" in last_error, last_error
        assert scalar(database.url, "SELECT count(*) FROM postbox.outbox") == 12
        broker.start()
        eventually(lambda: scalar(database.url, "SELECT count(*) = 0 FROM postbox.outbox"), timeout=60)
        records = read_topic(broker.bootstrap, topic)
    finally:
        r.stop()
        r.join()
        broker.close()
    assert scalar(database.url, "SELECT count(*) FROM postbox.dead_letters") == 0
    arrived: dict[str, list[str]] = {}
    for rec in records:
        seq = arrived.setdefault(rec["key"], [])
        if not seq or seq[-1] != rec["headers"]["postbox-message-id"]:
            seq.append(rec["headers"]["postbox-message-id"])
    assert arrived == {f"k{j}": [f"m{i}" for i in range(12) if i % 3 == j] for j in range(3)}


def test_secret_settings_are_never_shown(kafka_broker):
    """A failure of a producer configured with SASL quotes no password (librdkafka settings named
    like secrets are registered for masking)."""
    from postbox.config.settings import mask_text

    password = f"pw-{uuid.uuid4().hex}"
    t = KafkaTransport(kafka_broker.bootstrap, "t", {"sasl.password": password, "bogus.setting": password})
    try:
        (result,) = t.publish([row(1, "k")])
    finally:
        t.close()
    assert isinstance(result, Permanent) and password not in str(result)
    assert mask_text(f"echo {password}") == "echo ***"


# --- the bridge's source ---------------------------------------------------------------------------


def kafka_url(broker: Tansu, group: str, **extra: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in {"group": group, **FAST_GROUP, **extra}.items())
    return f"kafka://{broker.bootstrap}/?{query}"


def run_bridge(url: str, source, consumer: str = "orders") -> tuple[Bridge, threading.Thread]:
    b = Bridge(url, source, consumer, batch_size=16, wait=0.2, origin="kafka")
    thread = threading.Thread(target=b.run, daemon=True)
    thread.start()
    return b, thread


def stop(b: Bridge, thread: threading.Thread) -> None:
    b.stop()
    thread.join(30)


def test_bridge_receives_once_and_commits(database, kafka_broker):
    """Records land in the inbox once with id, key, type, correlation and headers; records produced
    twice are absorbed as duplicates; a record without an id header gets its coordinates as id; the
    offsets are committed: the group's next member finds nothing left."""
    from confluent_kafka import Producer

    topic = kafka_broker.create_topic(f"in-{uuid.uuid4().hex[:8]}", partitions=3)
    batch = [
        row(i, f"k{i % 4}", headers={"traceparent": "00-aa-bb-01"}, correlation_id="corr") for i in range(40)
    ]
    t = KafkaTransport(kafka_broker.bootstrap, topic)
    try:
        assert t.publish(batch) == [None] * 40
        assert t.publish(batch[:5]) == [None] * 5  # produced again: the inbox drops them
    finally:
        t.close()
    p = Producer({"bootstrap.servers": kafka_broker.bootstrap})
    p.produce(topic, b'{"bare": true}', b"k0", partition=0)
    p.flush(10)
    url = kafka_url(kafka_broker, f"g-{uuid.uuid4().hex[:6]}")
    b, thread = run_bridge(database.url, source_for(url, topic))
    try:
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM postbox.inbox") == 41)
        eventually(lambda: b.duplicates == 5)
    finally:
        stop(b, thread)
    assert scalar(database.url, "SELECT count(DISTINCT message_id) FROM postbox.inbox") == 41
    got = scalar(
        database.url,
        "SELECT row(key, type, correlation_id, source, headers->>'traceparent')::text FROM postbox.inbox"
        " WHERE message_id = %s",
        (batch[1].message_id,),
    )
    assert got == "(k1,order.event,corr,kafka,00-aa-bb-01)"
    bare = scalar(database.url, "SELECT message_id || ' ' || key FROM postbox.inbox WHERE payload ? 'bare'")
    assert bare.startswith(f"kafka:{topic}:0:") and bare.endswith(" k0")
    again = source_for(url, topic)
    seen: list = []
    try:  # once it has joined the group and has its partitions, nothing is left to read
        eventually(lambda: seen.extend(again.fetch(100, 0.2)) or again._assigned, 15)
        seen.extend(again.fetch(100, 0.5))
        assert seen == []
    finally:
        again.close()


def test_a_fetch_returns_the_records_there_without_waiting_out_its_timeout(kafka_broker):
    """The bridge's fetch waits for a first record, then takes what has arrived with it: records
    already there come back at once, not after the fetch's whole timeout (which consume(limit,
    timeout) would wait for a batch of ``limit``: the latency of every quiet moment)."""
    topic = kafka_broker.create_topic(f"quick-{uuid.uuid4().hex[:8]}")
    source = source_for(kafka_url(kafka_broker, f"g-{uuid.uuid4().hex[:6]}"), topic)
    t = KafkaTransport(kafka_broker.bootstrap, topic)
    try:
        eventually(lambda: source.fetch(100, 0.2) == [] and source._assigned, 15, what="partitions")
        assert t.publish([row(i, "k") for i in range(3)]) == [None] * 3
        started = time.monotonic()
        got = source.fetch(100, 10.0)
        took = time.monotonic() - started
    finally:
        t.close()
        source.close()
    assert len(got) == 3 and [g.key for g in got] == ["k"] * 3
    assert took < 5.0, f"the fetch took {took:.1f} s for records already there"


@pytest.mark.parametrize(
    ("limit", "big"),
    [(100_000, 200_000), (200, 300)],
    ids=["limit checked by the client", "limit only the database checks"],
)
def test_poison_records_are_dead_lettered_with_their_coordinates(database, kafka_broker, limit, big):
    """A record that is not JSON, and one over the database's payload limit, go to the dead-letter
    topic with their topic, partition, offset and the reason; the records around them are received
    and the partition goes on. A limit set below what the client checks is refused by the database,
    which does not say which message of the batch: each is then received in a savepoint of its own
    (the bridge stopped, exit 70, and met the record again at every start)."""
    from confluent_kafka import Producer

    with database.connect(autocommit=True) as c:
        c.execute(f"ALTER DATABASE {database.name} SET postbox.max_payload_bytes = {limit}")
    topic = kafka_broker.create_topic(f"poison-{uuid.uuid4().hex[:8]}")
    p = Producer({"bootstrap.servers": kafka_broker.bootstrap})
    for i, value in enumerate(
        [b'{"n": 0}', b"not json", b'{"n": 2}', json.dumps({"big": "y" * big}).encode(), b'{"n": 4}']
    ):
        p.produce(topic, value, b"k", headers=[("message_id", f"p{i}".encode())])
    p.flush(10)
    b, thread = run_bridge(
        database.url, source_for(kafka_url(kafka_broker, f"g-{uuid.uuid4().hex[:6]}"), topic)
    )
    try:
        eventually(
            lambda: (
                scalar(database.url, "SELECT string_agg(message_id, ',' ORDER BY id) FROM postbox.inbox")
                == "p0,p2,p4"
            )
        )
        eventually(lambda: b.rejected == 2)
    finally:
        stop(b, thread)
    dead = read_topic(kafka_broker.bootstrap, f"{topic}.dead-letters")
    assert [(d["headers"]["postbox-dead-letter-topic"], d["headers"]["postbox-dead-letter-partition"],
             d["headers"]["postbox-dead-letter-offset"], d["headers"]["message_id"]) for d in dead] == [
        (topic, "0", "1", "p1"), (topic, "0", "3", "p3")]  # fmt: skip
    assert "not JSON" in dead[0]["headers"]["postbox-dead-letter-reason"]
    assert "over the limit" in dead[1]["headers"]["postbox-dead-letter-reason"]
    assert dead[0]["payload"] == b"not json" and dead[1]["payload"] == {"big": "y" * big}


CRASHING_BRIDGE = """
import os, sys
from postbox.outbox.bridge import Bridge
from postbox.outbox.transports import source_for

source = source_for(sys.argv[2], sys.argv[3])
ack = source.ack

def ack_after_a_pause(items):
    if items:  # the inbox transaction has committed: say so, and wait to be killed
        print(len(items), flush=True)
        sys.stdin.readline()
    ack(items)

source.ack = ack_after_a_pause
Bridge(sys.argv[1], source, "orders", batch_size=10, wait=0.2).run()
"""


def test_bridge_killed_between_inbox_commit_and_offset_commit(database, kafka_broker):
    """kill -9 of the bridge after its inbox transaction committed and before it committed the
    offsets: a new bridge reads the batch again, the inbox drops it as duplicates; every record is
    in the inbox once and the handler's effect happened once per record."""
    topic = kafka_broker.create_topic(f"crash-{uuid.uuid4().hex[:8]}")
    records = [row(i, f"k{i % 3}") for i in range(30)]
    t = KafkaTransport(kafka_broker.bootstrap, topic)
    assert t.publish(records) == [None] * 30
    t.close()
    url = kafka_url(kafka_broker, f"g-{uuid.uuid4().hex[:6]}")
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_BRIDGE, database.url, url, topic],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        first = int(child.stdout.readline())
        assert first > 0
        assert scalar(database.url, "SELECT count(*) FROM postbox.inbox") == first  # committed
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    with database.connect(autocommit=True) as c:
        c.execute("CREATE TABLE effects (message_id text NOT NULL)")
    reg = Registry()

    @reg.handler("orders")
    def handle(m, ctx):
        ctx.conn.execute("INSERT INTO effects VALUES (%s)", (m.message_id,))

    w = Worker(database.url, reg, WorkerSettings(consumer="orders", **FAST_WORKER))
    w.start()
    b, thread = run_bridge(database.url, source_for(url, topic))
    try:
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM effects") == 30)
        eventually(lambda: b.duplicates >= first, what="the uncommitted batch read again")
        eventually(lambda: scalar(database.url, "SELECT count(*) = 0 FROM postbox.inbox"))
    finally:
        stop(b, thread)
        w.stop()
        w.join()
    assert scalar(database.url, "SELECT count(DISTINCT message_id) FROM effects") == 30
    assert scalar(database.url, "SELECT count(*) FROM effects") == 30


# --- configuration ---------------------------------------------------------------------------------


def test_a_kafka_destination_from_the_config_file(monkeypatch):
    """[destinations.NAME] kind = "kafka": librdkafka settings pass through, the SASL password comes
    from the environment variable the file names and is masked from then on; settings that would
    weaken delivery are refused with the setting named."""
    from postbox.config.policies import build_transports, load_policies
    from postbox.config.settings import mask_text
    from postbox.errors import ConfigError

    password = f"kafka-{uuid.uuid4().hex}"
    monkeypatch.setenv("TEST_KAFKA_PASSWORD", password)
    dest = {
        "kind": "kafka", "bootstrap_servers": "k1:9093", "topic": "orders.{type}",
        "sasl_password_env": "TEST_KAFKA_PASSWORD",
        "settings": {"security.protocol": "SASL_SSL", "linger.ms": 5},
    }  # fmt: skip
    config = load_policies({"destinations": {"stream": dest}})
    transport = build_transports(config, ["stream"], "postgresql://unused")["stream"]()
    try:
        assert transport.topic == "orders.{type}"
        assert transport._config["sasl.password"] == password and transport._config["linger.ms"] == 5
        assert transport._config["enable.idempotence"] is True and transport._config["acks"] == "all"
    finally:
        transport.close()
    assert password not in mask_text(f"auth failed for {password}")
    for weaker in ({"acks": 1}, {"enable.idempotence": False}):
        with pytest.raises(ConfigError, match=next(iter(weaker))):
            load_policies({"destinations": {"stream": {**dest, "settings": weaker}}})


# --- the commands, and a group that rebalances (without the extra: tests/test_packaging.py) -----------------------------------------------------


def test_relay_and_bridge_commands_through_kafka(database, tmp_path, kafka_broker):
    """`postbox relay` with a kind = "kafka" destination and `postbox bridge --from kafka://...`, as
    processes: what the outbox holds arrives in the inbox (here the same database), each once."""
    topic = kafka_broker.create_topic(f"cli-{uuid.uuid4().hex[:8]}", partitions=2)
    config = tmp_path / "postbox.toml"
    config.write_text(
        f'[destinations.d]\nkind = "kafka"\nbootstrap_servers = "{kafka_broker.bootstrap}"\ntopic = "{topic}"\n'
    )
    write(database.url, [{"message_id": f"c{i}", "key": f"k{i % 3}", "payload": {"i": i}} for i in range(20)])
    common = ("--database-url", database.url)
    relay_proc = spawn_postbox("--config", str(config), *common, "relay", "--poll-interval", "0.05")
    bridge_proc = spawn_postbox(
        *common, "bridge", "--from", kafka_url(kafka_broker, f"g-{uuid.uuid4().hex[:6]}"),
        "--name", topic, "--consumer", "orders",
    )  # fmt: skip
    try:
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM postbox.inbox") == 20, timeout=60)
        assert scalar(database.url, "SELECT count(*) FROM postbox.outbox") == 0
    finally:
        for proc in (relay_proc, bridge_proc):
            proc.send_signal(signal.SIGTERM)
        for proc in (relay_proc, bridge_proc):
            assert proc.wait(30) == 0
    assert scalar(database.url, "SELECT string_agg(DISTINCT source, ',') FROM postbox.inbox") == topic


def test_bridges_joining_and_leaving_a_group_lose_nothing_and_keep_key_order(database, kafka_broker):
    """Records produced while a second bridge joins the group and the first one leaves (two
    rebalances): every record is in the inbox once, and each key's records in the order produced."""
    topic = kafka_broker.create_topic(f"rebalance-{uuid.uuid4().hex[:8]}", partitions=4)
    url = kafka_url(kafka_broker, f"g-{uuid.uuid4().hex[:6]}")
    records = [row(i, f"k{i % 16}") for i in range(240)]
    t = KafkaTransport(kafka_broker.bootstrap, topic)

    def produce(part: list[OutboxRow]) -> None:
        assert t.publish(part) == [None] * len(part)

    def received() -> int:
        return scalar(database.url, "SELECT count(*) FROM postbox.inbox")

    first = run_bridge(database.url, source_for(url, topic))
    second = None
    try:
        produce(records[:80])
        eventually(lambda: received() >= 40)
        second = run_bridge(database.url, source_for(url, topic))
        produce(records[80:160])
        first_source, second_source = first[0].source, second[0].source
        eventually(lambda: second_source._assigned, what="the second bridge given partitions")
        eventually(lambda: len(first_source._assigned) < 4, what="the first bridge giving some up")
        stop(*first)
        produce(records[160:])
        eventually(lambda: received() == 240, timeout=60)
    finally:
        t.close()
        stop(*first)
        if second is not None:
            stop(*second)
    with psycopg.connect(database.url) as c:
        rows_in = c.execute("SELECT key, message_id FROM postbox.inbox ORDER BY id").fetchall()
    assert len({m for _, m in rows_in}) == 240
    order: dict[str, list[str]] = {}
    for key, message_id in rows_in:
        order.setdefault(key, []).append(message_id)
    assert order == {k: [r.message_id for r in records if r.key == k] for k in order}


def test_a_relay_whose_kafka_settings_librdkafka_refuses_does_not_start(database, kafka_broker, tmp_path):
    """A CA file that is not there: the relay exits 2 at start naming the destination's settings and
    librdkafka's reason, and no row is touched (each row was dead-lettered, a key blocked each)."""
    config = tmp_path / "postbox.toml"
    config.write_text(
        f'[destinations.stream]\nkind = "kafka"\nbootstrap_servers = "{kafka_broker.bootstrap}"\n'
        f'settings = {{ "security.protocol" = "SSL", "ssl.ca.location" = "{tmp_path}/missing-ca.pem" }}\n'
    )
    with database.connect() as c:
        postbox.publish(c, destination="stream", payload={"n": 1}, key="k")
        c.commit()
    r = subprocess.run(
        [sys.executable, "-m", "postbox", "--config", str(config), "--database-url", database.url, "relay"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert (
        "destinations.stream.settings: librdkafka refuses them" in r.stderr and "ssl.ca.location" in r.stderr
    )
    assert "Traceback" not in r.stderr
    assert scalar(database.url, "SELECT count(*) FROM postbox.dead_letters") == 0
    assert scalar(database.url, "SELECT attempt FROM postbox.outbox") == 0

"""The four error-handling patterns of Kafka consumers, end to end through Kafka: service A writes
order events to its outbox (its own database), A's relay produces them to a Kafka topic (Tansu),
a bridge feeds them into service B's inbox (another database), and B's consumer runs with each
ordering policy. The effects, dead letters and blocked keys are those of tests/test_failure_handling
(the same patterns over one database), which these mirror."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import psycopg
import pytest

import postbox
from postbox.failures.outcomes import Transient
from postbox.failures.policy import Backoff, RetryPolicy
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from postbox.outbox.bridge import Bridge
from postbox.outbox.relay import Relay, RelaySettings
from postbox.outbox.transports import source_for
from postbox.outbox.transports.kafka import KafkaTransport
from tests.conftest import Database, _cloned
from tests.helpers import FAST_WORKER, eventually, scalar
from tests.kafka_broker import FAST_GROUP, Tansu
from tests.test_failure_handling import ORDERS_DDL, Events, log, stock_registry

pytest.importorskip("confluent_kafka")


@pytest.fixture
def service_b(pg_server, template_db) -> Iterator[Database]:
    """Service B's database (service A has the test's ``database``)."""
    for db in _cloned(pg_server, "postbox_b", template_db):
        with db.connect(autocommit=True) as c:
            c.execute(ORDERS_DDL)
        yield db


class Services:
    """A's relay → a topic of two partitions → the bridge → B's inbox → B's worker (consumer "stock")."""

    def __init__(self, a: Database, b: Database, broker: Tansu) -> None:
        self.a, self.b = a, b
        topic = broker.create_topic(f"stock-{uuid.uuid4().hex[:8]}", partitions=2)
        quick = RetryPolicy(
            strategy=Backoff.FIXED, base_delay=0.05, max_attempts=1000, max_total_seconds=None
        )
        self.relay = Relay(
            a.url,
            {"stock": lambda: KafkaTransport(broker.bootstrap, topic)},
            RelaySettings(poll_interval=0.05, retry=quick),
        )
        query = "&".join(f"{k}={v}" for k, v in {"group": f"b-{topic}", **FAST_GROUP}.items())
        source = source_for(f"kafka://{broker.bootstrap}/?{query}", topic)
        self.bridge = Bridge(b.url, source, "stock", batch_size=50, wait=0.1, origin=topic)
        self.worker: Worker | None = None

    def publish(self, *mids_keys: tuple[str, str]) -> None:
        """Service A: one transaction writes the events to its outbox."""
        with psycopg.connect(self.a.url) as c:
            postbox.publish_many(
                c, [{"destination": "stock", "message_id": m, "key": k, "payload": {}} for m, k in mids_keys]
            )
            c.commit()

    def arrived(self, *mids: str) -> None:
        """Wait until the events are in B's inbox or done with (passed through Kafka)."""
        eventually(
            lambda: (
                scalar(
                    self.b.url,
                    "SELECT count(*) FROM postbox.inbox_dedup WHERE consumer = 'stock' AND message_id = ANY(%s)",
                    (list(mids),),
                )
                == len(mids)
            ),
            what=f"{mids} in B's inbox",
        )

    @contextlib.contextmanager
    def running(self, registry: Registry, events: Events | None = None) -> Iterator[Services]:
        self.worker = Worker(
            self.b.url, registry, WorkerSettings(consumer="stock", **FAST_WORKER), on_event=events
        )
        self.worker.start()
        self.relay.start()
        self.bridge.start()
        try:
            yield self
        finally:
            self.bridge.stop()
            self.relay.stop()
            self.worker.stop()
            self.bridge.join(30)
            self.relay.join()
            self.worker.join()


@pytest.fixture
def services(database, service_b, kafka_broker) -> Services:
    return Services(database, service_b, kafka_broker)


def test_pattern_1_stop_on_error_halts_the_consumer(services):
    """Pattern 1 (halt): a dead letter stops B's whole consumer; events that keep arriving through
    Kafka are received but not processed until an operator resumes it."""
    b = services.b.url
    events = Events()
    with services.running(stock_registry("halt", {"a1"}), events):
        services.publish(("a1", "A"))
        eventually(
            lambda: scalar(b, "SELECT halted_at IS NOT NULL FROM postbox.consumers WHERE name = 'stock'")
        )
        services.publish(("b1", "B"), ("a2", "A"))
        services.arrived("b1", "a2")
        idle = events.count("idle")
        events.wait_for("idle", idle + 4)  # several claim rounds while halted
        assert log(b) is None
        assert scalar(b, "SELECT halted_reason FROM postbox.consumers").startswith("dead letter")
        assert scalar(b, "SELECT postbox.consumer_resume_v1('stock')") is True
        eventually(lambda: log(b) == "b1")
        assert scalar(b, "SELECT state FROM postbox.inbox WHERE message_id = 'a2'") == "pending"  # A blocked
    assert scalar(b, "SELECT key FROM postbox.blocked_keys") == "A"


def test_pattern_2_dead_letter_without_retries(services):
    """Pattern 2: a permanent error dead-letters the event at once (one attempt); the other key's
    event is processed."""
    b = services.b.url
    with services.running(stock_registry("block", {"bad"})):
        services.publish(("bad", "A"), ("good", "B"))
        eventually(lambda: scalar(b, "SELECT count(*) FROM postbox.dead_letters") == 1)
        eventually(lambda: log(b) == "good")
    assert (
        scalar(b, "SELECT row(message_id, reason, attempt)::text FROM postbox.dead_letters")
        == "(bad,permanent,1)"
    )
    assert scalar(b, "SELECT count(*) FROM postbox.attempts") == 1


def test_pattern_3_retry_where_order_does_not_matter_skips(services):
    """Pattern 3 (skip): an event that exhausts its retries is dead-lettered and its key goes on
    with the next event; the other key never waits."""
    b = services.b.url
    with services.running(stock_registry("skip", {"a1"}, kind=Transient)):
        services.publish(("a1", "A"), ("a2", "A"), ("b1", "B"))
        services.arrived("a1", "a2", "b1")
        eventually(lambda: scalar(b, "SELECT count(*) = 0 FROM postbox.inbox"))
    assert sorted(log(b).split(",")) == ["a2", "b1"]
    dead = scalar(
        b, "SELECT row(message_id, reason, attempt, ordering_policy)::text FROM postbox.dead_letters"
    )
    assert dead == "(a1,attempts_exhausted,4,skip)"
    assert scalar(b, "SELECT count(*) FROM postbox.blocked_keys") == 0


def test_pattern_4_retry_keeps_later_events_of_the_key_behind_it(services):
    """Pattern 4: while the head of a key retries, its later events wait behind it (in B's inbox)
    and follow it in order once it succeeds; the other key is not held."""
    b = services.b.url
    reg = Registry()

    @reg.handler("stock", retry=RetryPolicy(strategy=Backoff.FIXED, base_delay=0.3, max_attempts=10))
    def handle(m, ctx):
        if m.message_id == "inc" and m.attempt < 3:
            raise Transient("no price yet")
        ctx.conn.execute(
            "INSERT INTO order_log (key, type, attempt) VALUES (%s, %s, %s)", (m.key, m.message_id, m.attempt)
        )

    with services.running(reg):
        services.publish(("inc", "item-1"), ("dec", "item-1"), ("other", "item-2"))
        services.arrived("inc", "dec", "other")
        eventually(lambda: scalar(b, "SELECT count(*) = 0 FROM postbox.inbox"))
    item_1 = "SELECT string_agg(type || ':' || attempt, ',' ORDER BY id) FROM order_log WHERE key = 'item-1'"
    assert scalar(b, item_1) == "inc:3,dec:1"
    first_other = scalar(b, "SELECT min(id) FROM order_log WHERE key = 'item-2'")
    assert first_other < scalar(b, "SELECT min(id) FROM order_log WHERE key = 'item-1'")
    assert scalar(b, "SELECT count(*) FROM postbox.dead_letters") == 0

"""Past one database: three services, each on its own database with its own Postbox schema, linked
through Kafka (docs/scaling.md). A's outbox → relay → topic → bridge → B's inbox; B's handler makes
its effect and publishes to B's outbox in the same transaction → relay → topic → bridge → C's inbox;
C's handler makes its effect. Every process is a real ``postbox relay`` / ``bridge`` / ``worker``
(tests/bench/topology.py); a bridge and a relay are killed with SIGKILL while messages flow."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tests.bench import topology
from tests.bench.topology import Topology, violations
from tests.conftest import Database, _cloned
from tests.helpers import eventually

pytest.importorskip("confluent_kafka")

KEYS = 12


@pytest.fixture
def services(database, pg_server, template_db) -> Iterator[tuple[Database, Database, Database]]:
    """A (the test's database), B and C: three databases on the server, each migrated."""
    for b in _cloned(pg_server, "postbox_b", template_db):
        for c in _cloned(pg_server, "postbox_c", template_db):
            yield database, b, c


def test_every_message_once_in_order_from_a_to_c_with_a_bridge_and_a_relay_killed(
    services, kafka_broker, tmp_path
):
    """The relays start first and A's first message goes out (Tansu answers a producer's first
    request slowly while consumer groups join); then the bridges and workers. A publishes 29 more,
    and once they have reached C, 270 more at 60 a second over 12 keys; in the middle of that flow
    B's bridge (from topic 1) is killed with SIGKILL and started again once A has committed 50 more,
    then B's relay (to topic 2) likewise. Every message of A is made once in B's effects and once in
    C's, each key's effects in A's order, and nothing stays in an inbox or outbox."""
    a, b, c = services
    t = Topology((a.url, b.url, c.url), kafka_broker.bootstrap, tmp_path)
    n, first = 300, 30
    done: list[int] = []
    producer = threading.Thread(
        target=topology.publish, args=(a.url, first, n - first, KEYS, 60.0, done), daemon=True
    )
    try:
        t.start("relay-a", "relay-b")
        topology.publish(a.url, 0, 1, KEYS)
        eventually(lambda: db_empty(a.url), timeout=60, what="A's first message sent")
        t.start("bridge-b", "worker-b", "bridge-c", "worker-c")
        topology.publish(a.url, 1, first - 1, KEYS)
        eventually(lambda: t.count(c.url) >= first, timeout=60, what="the first messages through to C")
        producer.start()
        for victim, at in (("bridge-b", 60), ("relay-b", 160)):
            eventually(lambda at=at: len(done) >= at, timeout=30, what="A publishing")
            t.kill(victim)
            eventually(lambda at=at: len(done) >= at + 50, timeout=30, what=f"A going on without {victim}")
            t.start(victim)
        producer.join(60)
        assert not producer.is_alive()
        eventually(lambda: t.count(c.url) >= n, timeout=90, what=f"{n} effects in C")
        for db in (a, b, c):  # nothing left behind: every inbox and outbox empty
            eventually(
                lambda db=db: db_empty(db.url), timeout=30, what=f"{db.name}'s inbox and outbox drained"
            )
    finally:
        statuses = t.stop()
    assert violations(t.effects(b.url), n, KEYS) == []
    assert violations(t.effects(c.url), n, KEYS) == []
    assert all(s == 0 for s in statuses.values()), statuses


def db_empty(url: str) -> bool:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM postbox.inbox) + (SELECT count(*) FROM postbox.outbox)"
        ).fetchone()
    return row is not None and row[0] == 0

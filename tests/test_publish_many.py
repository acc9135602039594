"""publish_many writes a batch in one statement (since 0.11.0) and writes exactly what the row-by-row
loop of earlier releases wrote: the same rows, states, per-key order, repairs, notifications and
errors, whatever the keys already hold; two batches starting the same keys in opposite orders never
deadlock."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

import postbox
from postbox.schema import migrate
from tests.conftest import _cloned
from tests.helpers import eventually

# The revision whose outbox_publish_batch_v1 is the loop.
LOOP_REVISION = "0012"


def _nested(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


DEEP = _nested(70)  # past the 64 levels a payload may have


@contextmanager
def _database(pg_server, revision: str | None) -> Iterator[str]:
    with contextmanager(_cloned)(pg_server, "postbox_pub", None) as db:
        migrate.upgrade(db.url, revision or "head")
        yield db.url


def _prepare(url: str) -> None:
    """Keys in every state a batch can meet: ``held`` has a head another transaction committed,
    ``stuck`` has queued rows and no head (its head finished while they were being written), and
    ``making`` has a head and rows queued behind it."""
    with psycopg.connect(url) as c:
        postbox.publish(c, destination="d", key="held", payload={"old": 1})
        postbox.publish_many(
            c, [{"destination": "d", "key": "making", "payload": {"old": i}} for i in range(3)]
        )
        c.execute(
            "INSERT INTO postbox.outbox (destination, message_id, key, position, payload, state)"
            " VALUES ('d', 'stuck-1', 'stuck', 1, '{}', 'pending')"
        )
        c.commit()


def _publish(url: str, batch: Any) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]], set[str]]:
    """``batch`` (a JSON array) through outbox_publish_batch_v1 in its own transaction: the rows it
    wrote (by element, with each row's rank in its key), the repairs filed, the notifications."""
    with psycopg.connect(url, autocommit=True) as listener, psycopg.connect(url) as c:
        listener.execute("LISTEN postbox_outbox")
        ids = dict(c.execute("SELECT * FROM postbox.outbox_publish_batch_v1(%s)", (Jsonb(batch),)).fetchall())
        c.commit()
        rows = c.execute(
            """
            SELECT o.id, o.destination, o.key, o.state, o.type, o.payload, o.headers, o.correlation_id,
                   o.causation_id, o.message_id,
                   rank() OVER (PARTITION BY o.destination, o.key ORDER BY o.position, o.id)
              FROM postbox.outbox o
            """
        ).fetchall()
        by_id = {r[0]: r[1:] for r in rows}
        written = []
        for n in sorted(ids):
            row = by_id[ids[n]]
            given_id = isinstance(batch[n - 1], dict) and batch[n - 1].get("message_id") is not None
            key_given = isinstance(batch[n - 1], dict) and batch[n - 1].get("key") is not None
            # A generated message_id (and the key it becomes) is a new UUID each time.
            message_id = row[8] if given_id else len(row[8])
            key = row[1] if (key_given or given_id) else row[1] == row[8]
            written.append((n, row[0], key, *row[2:8], message_id, row[9]))
        repairs = c.execute("SELECT origin, queue, key FROM postbox.key_repairs ORDER BY 1, 2, 3").fetchall()
        notified = {n.payload for n in listener.notifies(timeout=0.5, stop_after=10)}
    return written, repairs, notified


BATCHES = {
    "new keys, repeated": [
        {"destination": "d", "key": k, "payload": {"i": i}} for i, k in enumerate("abcabcaab")
    ],
    "keys in every state": [
        {"destination": "d", "key": k, "payload": {"i": i}, "type": "t", "headers": {"h": str(i)}}
        for i, k in enumerate(["held", "new", "stuck", "making", "held", "stuck", "new", "making"])
    ],
    "without keys": [
        {"destination": "d", "payload": {"i": 1}},
        {"destination": "d", "payload": {"i": 2}, "message_id": "m-2"},
        {"destination": "d", "payload": {"i": 3}, "message_id": "held"},  # its key: an id with a head
        {"destination": "d", "payload": {"i": 4}},
    ],
    "several destinations": [
        {"destination": dest, "key": key, "payload": {"i": i}, "correlation_id": "c", "causation_id": "x"}
        for i, (dest, key) in enumerate([("z", "k"), ("a", "k"), ("d", "held"), ("z", "k"), ("a", "j")])
    ],
    "large payloads": [
        {"destination": "d", "key": f"k{i % 2}", "payload": {"text": "x" * 5000, "i": i}} for i in range(4)
    ],
    "one message": [{"destination": "d", "key": "held", "payload": 1}],
}


@pytest.mark.parametrize("name", list(BATCHES))
def test_a_batch_writes_what_the_row_by_row_loop_wrote(pg_server, name):
    batch = BATCHES[name]
    outcomes = []
    for revision in (LOOP_REVISION, None):
        with _database(pg_server, revision) as url:
            _prepare(url)
            outcomes.append(_publish(url, batch))
    (loop_rows, loop_repairs, loop_notified), (rows, repairs, notified) = outcomes
    assert rows == loop_rows
    assert repairs == loop_repairs
    assert notified == loop_notified
    assert len(rows) == len(batch)


def test_a_key_keeps_the_order_given_and_starts_with_its_first_message(database):
    batch = [{"destination": "d", "key": k, "payload": i} for i, k in enumerate("babcab")]
    with database.connect() as c:
        ids = postbox.publish_many(c, batch)
        c.commit()
        read = "SELECT id, key, position, state, payload FROM postbox.outbox"
        rows = {r[0]: r[1:] for r in c.execute(read).fetchall()}
    assert len(set(ids)) == len(batch)
    for key in "abc":
        mine = [ids[i] for i, m in enumerate(batch) if m["key"] == key]
        positions = [rows[i][1] for i in mine]
        assert positions == sorted(positions), key
        assert [rows[i][2] for i in mine] == ["ready"] + ["pending"] * (len(mine) - 1)
    assert [rows[i][3] for i in ids] == list(range(len(batch)))


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"payload": {"deep": DEEP, "text": "y" * 300}}, "payload"),
        ({"key": 7}, "messages[3].key"),
        ({"destination": ""}, "destination"),
    ],
    ids=["deep-json", "number-key", "empty-destination"],
)
def test_a_bad_message_is_refused_as_the_loop_refused_it_and_nothing_is_written(pg_server, bad, error):
    batch = [{"destination": "d", "key": "k", "payload": {"text": "y" * 300}} for _ in range(4)]
    batch[2] = batch[2] | bad
    errors = []
    for revision in (LOOP_REVISION, None):
        with _database(pg_server, revision) as url, psycopg.connect(url) as c:
            with pytest.raises(psycopg.Error) as info:
                c.execute("SELECT * FROM postbox.outbox_publish_batch_v1(%s)", (Jsonb(batch),))
            # (The context, the functions' stack, differs: the message does not.)
            errors.append((info.value.sqlstate, info.value.diag.message_primary))
            c.rollback()
            assert c.execute("SELECT count(*) FROM postbox.outbox").fetchone()[0] == 0
    assert errors[0] == errors[1]
    assert error in errors[1][1]


def test_two_batches_starting_the_same_keys_in_opposite_orders_never_deadlock(database):
    """Each batch makes its keys' heads in one global order: the second waits for the first's heads
    (ON CONFLICT), then queues behind them; neither is chosen as a deadlock victim."""
    keys = [f"k{i:03}" for i in range(200)]
    start = threading.Barrier(2)
    failures: list[Exception] = []

    def publish(order: list[str]) -> None:
        try:
            with database.connect() as c:
                start.wait(10)
                postbox.publish_many(c, [{"destination": "d", "key": k, "payload": {"k": k}} for k in order])
                c.commit()
        except Exception as error:  # reported below
            failures.append(error)

    for _ in range(5):
        threads = [threading.Thread(target=publish, args=(o,)) for o in (keys, keys[::-1])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not failures, failures
    with database.connect() as c:
        heads, queued, repairs = c.execute(
            "SELECT count(*) FILTER (WHERE state = 'ready'), count(*) FILTER (WHERE state = 'pending'),"
            " (SELECT count(*) FROM postbox.key_repairs) FROM postbox.outbox"
        ).fetchone()
    assert (heads, queued, repairs) == (200, 9 * 200, 0)


OUTBOX_KEY_LOCK = 1349471042  # the first half of an outbox key's advisory lock


def _drain(url: str) -> list[str]:
    """Claim and complete until nothing is left (a claim makes the repairs filed): the payloads in the
    order they were claimed."""
    order: list[str] = []
    with psycopg.connect(url) as r:
        for _ in range(20):
            rows = r.execute(
                "SELECT id, attempt, payload FROM postbox.outbox_claim_v1('d', 'w', 10, '1 minute', now())"
            ).fetchall()
            r.commit()
            if not rows and not r.execute("SELECT count(*) FROM postbox.outbox").fetchone()[0]:
                return order
            order += [row[2] for row in rows]
            if rows:
                r.execute(
                    "SELECT postbox.outbox_complete_v1(%s, %s, now())",
                    ([row[0] for row in rows], [row[1] for row in rows]),
                )
                r.commit()
    raise AssertionError(f"the outbox did not drain: {order}")


@pytest.mark.parametrize("other_head", ["commits", "rolls back"])
def test_a_row_committed_while_the_batch_waits_stays_ahead_of_the_batchs_head(database, other_head):
    """Under READ COMMITTED: a batch [k2, k1] waits for another transaction's head of k1. Meanwhile a
    row P2, queued behind k2's head H2, commits, and H2 finishes without handing over (a producer's
    check held k2's lock): k2 has P2 queued, no head, and a repair. The batch's message under k2,
    written after P2 committed, goes after it: it queues behind P2 instead of becoming k2's head."""
    url = database.url
    with psycopg.connect(url, autocommit=True) as c:
        postbox.publish(c, destination="d", key="k2", payload="H2")
    with (
        psycopg.connect(url) as t3,
        psycopg.connect(url) as t2,
        psycopg.connect(url) as checker,
        psycopg.connect(url) as batch_conn,
        psycopg.connect(url, autocommit=True) as observer,
    ):
        postbox.publish(t3, destination="d", key="k1", payload="T3-k1")  # a head of k1, not committed
        postbox.publish(t2, destination="d", key="k2", payload="P2")  # queued behind H2
        pid = batch_conn.info.backend_pid
        failures: list[Exception] = []

        def batch() -> None:
            try:
                postbox.publish_many(
                    batch_conn,
                    [
                        {"destination": "d", "key": "k2", "payload": "B-k2"},
                        {"destination": "d", "key": "k1", "payload": "B-k1"},
                    ],
                )
                batch_conn.commit()
            except Exception as error:  # reported below
                failures.append(error)

        thread = threading.Thread(target=batch)
        thread.start()
        eventually(
            lambda: observer.execute(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()[0]
        )
        checker.execute("SELECT pg_advisory_xact_lock_shared(%s, hashtext('d/k2'))", (OUTBOX_KEY_LOCK,))
        t2.commit()
        with psycopg.connect(url) as relay:
            claimed = relay.execute(
                "SELECT id, attempt, payload FROM postbox.outbox_claim_v1('d', 'w', 10, '1 minute', now())"
            ).fetchall()
            assert [row[2] for row in claimed] == ["H2"]
            relay.execute(
                "SELECT postbox.outbox_complete_v1(%s, %s, now())", ([claimed[0][0]], [claimed[0][1]])
            )
            relay.commit()
        checker.rollback()
        if other_head == "commits":
            t3.commit()
        else:
            t3.rollback()
        thread.join(30)
        assert not thread.is_alive() and not failures, failures
    order = _drain(url)
    k2 = [p for p in order if p in ("P2", "B-k2")]
    assert k2 == ["P2", "B-k2"], order
    assert sorted(order) == sorted(["P2", "B-k2", "B-k1"] + (["T3-k1"] if other_head == "commits" else []))

"""publish_many keeps each key's messages in the order given, starting with its first; two batches
starting the same keys in opposite orders never deadlock; and under READ COMMITTED a row committed
while a batch waits for another transaction's head stays ahead of the batch's message under its key
(the guard for any batch publish that decides its heads in fewer statements than one per event)."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

import postbox
from tests.helpers import eventually


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


def test_a_key_waiting_for_its_repair_keeps_its_queued_events_ahead_of_the_batch(database):
    """A key whose head finished without handing over (its lock was held) has an event queued, no
    head and a repair. A batch's first event under that key does not become its head: it steps back
    behind the queued event (the batch filing the key's repair too), and the key drains in the order
    published."""
    url = database.url
    with psycopg.connect(url, autocommit=True) as c:
        postbox.publish(c, destination="d", key="k", payload="H")
        postbox.publish(c, destination="d", key="k", payload="P")
    with psycopg.connect(url) as checker, psycopg.connect(url) as relay:
        checker.execute("SELECT pg_advisory_xact_lock_shared(%s, hashtext('d/k'))", (OUTBOX_KEY_LOCK,))
        claimed = relay.execute(
            "SELECT id, attempt, payload FROM postbox.outbox_claim_v1('d', 'w', 10, '1 minute', now())"
        ).fetchall()
        assert [row[2] for row in claimed] == ["H"]
        relay.execute("SELECT postbox.outbox_complete_v1(%s, %s, now())", ([claimed[0][0]], [claimed[0][1]]))
        relay.commit()
        checker.rollback()
    with psycopg.connect(url) as c:
        assert c.execute("SELECT payload, state FROM postbox.outbox").fetchall() == [("P", "pending")]
        ids = postbox.publish_many(
            c,
            [
                {"destination": "d", "key": "k", "payload": "B1"},
                {"destination": "d", "key": "other", "payload": "X"},
                {"destination": "d", "key": "k", "payload": "B2"},
            ],
        )
        c.commit()
        assert ids == sorted(ids)
        states = dict(c.execute("SELECT payload, state FROM postbox.outbox").fetchall())
        assert states == {"P": "pending", "B1": "pending", "B2": "pending", "X": "ready"}
    order = _drain(url)
    assert [p for p in order if p != "X"] == ["P", "B1", "B2"], order


def test_a_batch_makes_its_keys_heads_and_queues_the_rest_as_single_publishes_would(database):
    """The same batch through publish_many and through one publish per event (each in its own
    database state: same keys, some with a head already): every event gets the same state, and each
    key's events the same relative order."""
    events = [{"destination": d, "key": k, "payload": i} for i, (d, k) in enumerate(
        [("a", "x"), ("b", "x"), ("a", "y"), ("a", "x"), ("b", "z"), ("a", "y"), ("a", "w")])]  # fmt: skip
    results = []
    for many in (True, False):
        with psycopg.connect(database.url) as c:
            c.execute("DELETE FROM postbox.outbox")
            postbox.publish(c, destination="a", key="y", payload="old head")
            c.commit()
            if many:
                postbox.publish_many(c, events)
            else:
                for e in events:
                    postbox.publish(c, **e)
            c.commit()
            rows = c.execute(
                "SELECT destination, key, payload, state FROM postbox.outbox ORDER BY destination, key, position"
            ).fetchall()
            results.append(rows)
    assert results[0] == results[1]


def _key_locks_held(observer: psycopg.Connection, pid: int) -> set[int]:
    """The outbox key locks (shared) ``pid`` holds, as the hashtext('destination/key') of each key."""
    rows = observer.execute(
        "SELECT l.objid::int FROM pg_locks l WHERE l.pid = %s AND l.locktype = 'advisory'"
        " AND l.classid::bigint = %s AND l.mode = 'ShareLock' AND l.granted",
        (pid, OUTBOX_KEY_LOCK),
    ).fetchall()
    return {r[0] for r in rows}


def _hash(observer: psycopg.Connection, name: str) -> int:
    return observer.execute("SELECT hashtext(%s)", (name,)).fetchone()[0]


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_a_batch_queued_behind_another_transactions_head_that_finishes_meanwhile_is_relayed(
    database, isolation: str
):
    """A batch queues events behind heads other transactions made (k1, k2), behind a head it makes
    itself (k3, two events) and under a new key. Under READ COMMITTED it holds the keys it queued
    behind others' heads, and only those, from the publish to its commit: the heads' completion
    meanwhile cannot hand over to events it cannot see and files the keys' repairs, and every event
    is relayed in order. Under REPEATABLE READ the check is each queued row's at commit, which finds
    its head finished since the snapshot: the commit fails with a serialization error, to be
    retried, and the retry is relayed in order."""
    url = database.url
    with psycopg.connect(url, autocommit=True) as c:
        postbox.publish(c, destination="d", key="k1", payload="H1")
        postbox.publish(c, destination="d", key="k2", payload="H2")
    batch = [
        {"destination": "d", "key": "k1", "payload": "B1"},
        {"destination": "d", "key": "k3", "payload": "B3a"},
        {"destination": "d", "key": "k2", "payload": "B2"},
        {"destination": "d", "key": "k3", "payload": "B3b"},
        {"destination": "d", "payload": "fresh"},
    ]
    level = psycopg.IsolationLevel.READ_COMMITTED
    if isolation == "repeatable read":
        level = psycopg.IsolationLevel.REPEATABLE_READ
    with psycopg.connect(url) as producer, psycopg.connect(url, autocommit=True) as observer:
        producer.isolation_level = level
        postbox.publish_many(producer, batch)
        held = _key_locks_held(observer, producer.info.backend_pid)
        if isolation == "read committed":
            assert held == {_hash(observer, "d/k1"), _hash(observer, "d/k2")}
        else:
            assert held == set()
        with psycopg.connect(url) as relay:
            claimed = relay.execute(
                "SELECT id, attempt, payload FROM postbox.outbox_claim_v1('d', 'w', 10, '1 minute', now())"
            ).fetchall()
            assert sorted(row[2] for row in claimed) == ["H1", "H2"]
            relay.execute(
                "SELECT postbox.outbox_complete_v1(%s, %s, now())",
                ([row[0] for row in claimed], [row[1] for row in claimed]),
            )
            relay.commit()
        if isolation == "read committed":
            producer.commit()
        else:
            with pytest.raises(psycopg.errors.SerializationFailure):
                producer.commit()
            postbox.publish_many(producer, batch)
            producer.commit()
    order = _drain(url)
    assert sorted(order) == sorted(m["payload"] for m in batch)
    assert [p for p in order if p.startswith("B3")] == ["B3a", "B3b"]


PRODUCERS, BATCHES, BATCH, KEYS = 4, 25, 40, 12


def _produce(url: str, p: int) -> int:
    """A producer process: BATCHES batches of BATCH events over KEYS shared keys, payload (p, n), n in
    the order published; every other batch under REPEATABLE READ, retried whole (for up to a minute) on a
    serialization failure or deadlock. Returns the events committed."""
    import random

    rng = random.Random(p)
    n = 0
    with psycopg.connect(url) as c:
        for b in range(BATCHES):
            c.isolation_level = (
                psycopg.IsolationLevel.REPEATABLE_READ if b % 2 else psycopg.IsolationLevel.READ_COMMITTED
            )
            batch = [
                {"destination": "d", "key": f"k{rng.randrange(KEYS)}", "payload": {"p": p, "n": n + i}}
                for i in range(BATCH)
            ]
            deadline = time.monotonic() + 60
            while True:
                try:
                    postbox.publish_many(c, batch)
                    c.commit()
                    break
                except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected):
                    c.rollback()
                    if time.monotonic() > deadline:
                        raise
            n += BATCH
    return n


def _relay(url: str, r: int, stop: Any) -> None:
    """A relay process: claims up to 7 rows, records each in ``relayed`` and completes them in one
    transaction, until told to stop and the outbox is empty."""
    with psycopg.connect(url) as c:
        while True:
            rows = c.execute(
                "SELECT id, attempt, payload, key FROM postbox.outbox_claim_v1('d', %s, 7, '1 minute', now())",
                (f"r{r}",),
            ).fetchall()
            if rows:
                c.execute(
                    "INSERT INTO relayed (p, n, key) SELECT (x->>'p')::int, (x->>'n')::int, k"
                    " FROM unnest(%s::jsonb[], %s::text[]) AS u(x, k)",
                    ([psycopg.types.json.Jsonb(row[2]) for row in rows], [row[3] for row in rows]),
                )
                c.execute(
                    "SELECT postbox.outbox_complete_v1(%s, %s, now())",
                    ([row[0] for row in rows], [row[1] for row in rows]),
                )
            c.commit()
            if not rows:
                if (
                    stop.is_set()
                    and not c.execute("SELECT EXISTS (SELECT 1 FROM postbox.outbox)").fetchone()[0]
                ):
                    return
                time.sleep(0.005)


def test_concurrent_batches_and_relays_lose_nothing_and_keep_each_producers_order_per_key(database):
    """Producer processes publish batches over a few shared keys (under READ COMMITTED and REPEATABLE
    READ in turn) while relay processes claim and complete heads: every event is relayed exactly
    once, and each producer's events of a key in the order it published them."""
    import multiprocessing

    url = database.url
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("CREATE TABLE relayed (seq bigserial PRIMARY KEY, p int, n int, key text)")
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    relays = [ctx.Process(target=_relay, args=(url, r, stop)) for r in range(2)]
    for proc in relays:
        proc.start()
    try:
        with ctx.Pool(PRODUCERS) as pool:
            produced = pool.starmap(_produce, [(url, p) for p in range(PRODUCERS)])
        assert produced == [BATCHES * BATCH] * PRODUCERS
        with psycopg.connect(url, autocommit=True) as c:
            eventually(
                lambda: c.execute("SELECT count(*) FROM relayed").fetchone()[0] >= sum(produced),
                timeout=60,
                what="every event relayed (a key left with queued events and no head never is)",
            )
    finally:
        stop.set()
        for proc in relays:
            proc.join(30)
            if proc.exitcode is None:
                proc.terminate()
    assert [proc.exitcode for proc in relays] == [0, 0]
    with psycopg.connect(url) as c:
        total, distinct = c.execute("SELECT count(*), count(DISTINCT (p, n)) FROM relayed").fetchone()
        assert (total, distinct) == (PRODUCERS * BATCHES * BATCH,) * 2
        reordered = c.execute(
            "SELECT count(*) FROM (SELECT n, lag(n) OVER (PARTITION BY p, key ORDER BY seq) AS prev"
            " FROM relayed) x WHERE n < prev"
        ).fetchone()[0]
        assert reordered == 0

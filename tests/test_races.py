"""The known traps of a per-key ordered queue on PostgreSQL, each with a test that would catch it."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable

import psycopg
import pytest

import postbox
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from tests.helpers import EFFECTS_DDL, eventually, record_effect, scalar
from tests.helpers import FAST_WORKER as FAST


@pytest.fixture
def db(database):
    with database.connect(autocommit=True) as c:
        c.execute(EFFECTS_DDL)
    return database


def _recording_worker(url: str, batch_size: int) -> Worker:
    """A started worker for consumer c whose handler records each message as an effect row."""
    reg = Registry()

    @reg.handler("c")
    def handle(m, ctx):
        record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)

    w = Worker(url, reg, WorkerSettings(consumer="c", concurrency=4, batch_size=batch_size, **FAST))
    w.start()
    return w


def _race(url: str, producer: Callable[[int], None], producers: int, messages: int, timeout: float) -> None:
    """Run ``producers`` threads of ``producer`` to the end, then wait until every message has its effect."""
    threads = [threading.Thread(target=producer, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    eventually(
        lambda: scalar(url, "SELECT count(*) FROM effects") == messages,
        timeout=timeout,
        what="every message processed",
    )


def test_producer_worker_race_never_orphans_a_message(db):
    """One key hammered by concurrent producers while workers finish heads as fast as they can:
    every message is processed (none left without a head), each producer's messages in its order."""
    url = db.url
    w = _recording_worker(url, batch_size=1)
    per_producer = 150

    def producer(p: int) -> None:
        with psycopg.connect(url) as c:
            for i in range(per_producer):
                postbox.receive(c, consumer="c", message_id=f"p{p}-{i}", key="hot", payload={"p": p, "i": i})
                c.commit()

    try:
        _race(url, producer, producers=4, messages=4 * per_producer, timeout=60)
        assert scalar(url, "SELECT count(*) FROM postbox.inbox") == 0
    finally:
        w.stop()
        w.join()
    with psycopg.connect(url) as c:
        rows = c.execute("SELECT message_id FROM effects ORDER BY id").fetchall()
    seen: dict[str, int] = {}
    for (mid,) in rows:
        p, i = mid.split("-")
        assert int(i) == seen.get(p, -1) + 1, f"{mid} out of order"
        seen[p] = int(i)


def test_concurrent_batches_with_overlapping_ids_are_received_once(db):
    """Four producers send the same ids (a broker redelivering) in batches of varying size, over a
    few hot keys, while workers drain: each id is new exactly once across all producers, processed
    exactly once, none is left behind, and batches taking their ids and keys in order never
    deadlock each other."""
    url = db.url
    w = _recording_worker(url, batch_size=10)
    total = 600
    news: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def producer(p: int) -> None:
        rng = random.Random(p)
        ids = [j for j in range(total) if rng.random() < 0.8 or p == 0]  # producer 0 sends every id
        try:
            with psycopg.connect(url) as c:
                start = 0
                while start < len(ids):
                    size = rng.randint(1, 60)
                    batch = [
                        {"consumer": "c", "message_id": f"m{j}", "key": f"k{j % 5}", "payload": {"j": j}}
                        for j in ids[start : start + size]
                    ]
                    results = postbox.receive_many(c, batch)
                    c.commit()
                    with lock:
                        news.extend(m["message_id"] for m, r in zip(batch, results, strict=True) if r.is_new)
                    assert all(r.is_new or r.is_duplicate for r in results)
                    start += size
        except BaseException as error:  # surfaced below, with the thread's failure
            errors.append(error)

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        eventually(
            lambda: scalar(url, "SELECT count(*) FROM effects") == total,
            timeout=60,
            what="every message processed",
        )
        assert scalar(url, "SELECT count(*) FROM postbox.inbox") == 0
    finally:
        w.stop()
        w.join()
    assert sorted(news) == sorted(f"m{j}" for j in range(total))  # new exactly once
    assert scalar(url, "SELECT count(DISTINCT message_id) FROM effects") == total


def test_batches_with_the_same_ids_in_opposite_orders_never_deadlock(db):
    """Two producers receive the same ids at the same moment, one in reverse order (a broker
    redelivering in another order): the ledger takes ids in one global order, so one waits for
    the other instead of deadlocking, and each id is new exactly once."""
    url = db.url
    rounds, size = 12, 300
    barrier = threading.Barrier(2)
    news: list[list[str]] = [[], []]
    errors: list[BaseException] = []

    def producer(p: int) -> None:
        try:
            with psycopg.connect(url) as c:
                for r in range(rounds):
                    ids = [f"r{r}-{j}" for j in range(size)]
                    batch = [
                        {"consumer": "c", "message_id": m, "payload": {}} for m in (ids[::-1] if p else ids)
                    ]
                    barrier.wait(timeout=30)
                    results = postbox.receive_many(c, batch)
                    c.commit()
                    news[p].extend(m["message_id"] for m, x in zip(batch, results, strict=True) if x.is_new)
        except BaseException as error:
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=producer, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(news[0] + news[1]) == sorted(f"r{r}-{j}" for r in range(rounds) for j in range(size))


def test_repeatable_read_producer_gets_a_retryable_error_not_an_orphan(db):
    """Under REPEATABLE READ the producer cannot see the head finish; its commit fails with a
    serialization error (retryable) rather than leaving its message without a head."""
    url = db.url
    with psycopg.connect(url) as p, psycopg.connect(url) as w:
        postbox.receive(p, consumer="c", message_id="1", key="k", payload={})
        p.commit()
        p.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        postbox.receive(p, consumer="c", message_id="2", key="k", payload={})
        ((mid, att),) = w.execute(
            "SELECT id, attempt FROM postbox.inbox_claim_v1('c', 'w', 10, '1 minute', now())"
        ).fetchall()
        w.commit()
        w.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", ([mid], [att]))
        w.commit()
        with pytest.raises(psycopg.errors.SerializationFailure):
            p.commit()
    assert scalar(url, "SELECT count(*) FROM postbox.inbox") == 0


def test_producers_never_wait_for_a_running_handler(db):
    """While a handler of key k runs (blocked on purpose), producers receive and commit more
    messages of key k without waiting for it."""
    url = db.url
    reg = Registry()
    running, release = threading.Event(), threading.Event()

    @reg.handler("c")
    def handle(m, ctx):
        if m.message_id == "first":
            running.set()
            assert release.wait(30)
        record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)

    with psycopg.connect(url) as c:
        postbox.receive(c, consumer="c", message_id="first", key="k", payload={})
        c.commit()
    w = Worker(url, reg, WorkerSettings(consumer="c", concurrency=2, batch_size=1, **FAST))
    w.start()
    try:
        assert running.wait(10)
        with psycopg.connect(url) as c:
            for i in range(20):
                postbox.receive(c, consumer="c", message_id=f"next-{i}", key="k", payload={})
                c.commit()
        assert not release.is_set()  # every commit above returned while the handler was still held
        assert scalar(url, "SELECT count(*) FROM postbox.inbox WHERE state = 'pending'") == 20
        release.set()
        eventually(lambda: scalar(url, "SELECT count(*) FROM effects") == 21)
    finally:
        release.set()
        w.stop()
        w.join()


def _plan(conn: psycopg.Connection, sql: str, params: tuple = ()) -> str:
    rows = conn.execute("EXPLAIN (FORMAT JSON) " + sql, params).fetchone()[0]
    return json.dumps(rows)


def test_claim_and_promote_use_their_indexes_with_a_large_backlog(db):
    """EXPLAIN guard: with 100k pending messages on a hot key, 1,000 blocked keys and many ready
    heads, the claim and the promotion read their partial indexes, never a sequential scan."""
    url = db.url
    with psycopg.connect(url) as c:
        c.execute(
            """
            INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)
            SELECT 'c', 'hot-' || g, 'hot', g, '{}', CASE WHEN g = 1 THEN 'ready' ELSE 'pending' END
              FROM generate_series(1, 100000) g;
            INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)
            SELECT 'c', 'blocked-' || g, 'b' || g, g, '{}', 'blocked' FROM generate_series(1, 1000) g;
            INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)
            SELECT 'c', 'ready-' || g, 'r' || g, g, '{}', 'ready' FROM generate_series(1, 5000) g;
            INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)
            SELECT 'other', 'o-' || g, 'o' || g, g, '{}', 'ready' FROM generate_series(1, 20000) g;
            ANALYZE postbox.inbox;
            """
        )
        c.commit()
        claim = _plan(
            c,
            "SELECT q.id FROM postbox.inbox q WHERE q.consumer = 'c' AND q.state IN ('ready', 'running')"
            " AND q.available_at <= now() ORDER BY q.available_at, q.id LIMIT 20 FOR UPDATE SKIP LOCKED",
        )
        assert "inbox_claim_idx" in claim and "Seq Scan" not in claim, claim
        promote = _plan(
            c,
            "SELECT i.id, i.position FROM postbox.inbox i WHERE i.consumer = 'c' AND i.key = 'hot'"
            " AND i.state = 'pending' ORDER BY i.position, i.id LIMIT 1",
        )
        assert "inbox_pending_idx" in promote and "Seq Scan" not in promote, promote
        head = _plan(
            c, "SELECT 1 FROM postbox.inbox WHERE consumer = 'c' AND key = 'hot' AND state <> 'pending'"
        )
        assert "inbox_head_uq" in head and "Seq Scan" not in head, head
        # The SQL text the function really runs is the one guarded above.
        body = c.execute("SELECT prosrc FROM pg_proc WHERE proname = 'inbox_claim_v1'").fetchone()[0]
        assert "q.state IN ('ready', 'running')" in body and "ORDER BY q.available_at, q.id" in body
        # And the claim works on that backlog: only ready heads of consumer c come back.
        rows = c.execute(
            "SELECT message_id FROM postbox.inbox_claim_v1('c', 'w', 50, '1 minute', now())"
        ).fetchall()
        assert len(rows) == 50 and all(r[0].startswith(("hot-1", "ready-")) for r in rows)


@pytest.mark.parametrize(
    "past_first_keys", [False, True], ids=["first-messages", "past-the-first-1000-messages"]
)
def test_keyed_batches_racing_workers_never_orphan_a_message(db, past_first_keys: bool):
    """Batches queue messages behind three hot keys while workers finish heads as fast as they can
    (each completion races a batch that holds the key, or looks for its head): every message is
    processed, in each producer's order, and no commit check is left behind. Both ways a batch
    works: among its transaction's first 1,000 messages (locked before it looks), and past them (it
    looks, queues, then locks the keys held by others' heads and looks again; the transaction's
    count is set as if it had locked 1,000 keys already)."""
    url = db.url
    w = _recording_worker(url, batch_size=1)
    rounds, size = 30, 12

    def producer(p: int) -> None:
        with psycopg.connect(url) as c:
            for r in range(rounds):
                if past_first_keys:
                    c.execute("SELECT set_config('postbox.batch_key_locks', '1000', true)")
                postbox.receive_many(
                    c,
                    [
                        {
                            "consumer": "c",
                            "message_id": f"p{p}-{r * size + j}",
                            "key": f"hot{j % 3}",
                            "payload": {},
                        }
                        for j in range(size)
                    ],
                )
                c.commit()

    try:
        _race(url, producer, producers=3, messages=3 * rounds * size, timeout=90)
        assert scalar(url, "SELECT count(*) FROM postbox.inbox") == 0
        assert scalar(url, "SELECT count(*) FROM postbox.inbox_commit_checks") == 0
    finally:
        w.stop()
        w.join()
    with psycopg.connect(url) as c:
        rows = c.execute("SELECT message_id, key FROM effects ORDER BY id").fetchall()
    seen: dict[tuple[str, str], int] = {}
    for mid, key in rows:
        p, i = mid.split("-")
        assert int(i) > seen.get((p, key), -1), f"{mid} out of order on {key}"
        seen[(p, key)] = int(i)


def test_a_repeatable_read_batch_gets_a_retryable_error_not_an_orphan(db):
    url = db.url
    with psycopg.connect(url) as p, psycopg.connect(url) as w:
        postbox.receive(p, consumer="c", message_id="1", key="k", payload={})
        p.commit()
        p.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        postbox.receive_many(
            p, [{"consumer": "c", "message_id": str(i), "key": "k", "payload": {}} for i in (2, 3)]
        )
        ((mid, att),) = w.execute(
            "SELECT id, attempt FROM postbox.inbox_claim_v1('c', 'w', 10, '1 minute', now())"
        ).fetchall()
        w.commit()
        w.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", ([mid], [att]))
        w.commit()
        with pytest.raises(psycopg.errors.SerializationFailure):
            p.commit()
    assert scalar(url, "SELECT count(*) FROM postbox.inbox") == 0

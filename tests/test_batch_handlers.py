"""Batch handlers: one call for the messages of a claimed batch, effects and done marks committed
together, and a failing call undone and run again one message at a time, so that only the message
that fails is retried or dead-lettered."""

from __future__ import annotations

import asyncio
import threading

import psycopg
import pytest

import postbox
from postbox.failures.outcomes import Permanent, Retry
from postbox.failures.policy import Backoff, RetryPolicy
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from tests.helpers import EFFECTS_DDL, eventually, record_effect, scalar
from tests.helpers import FAST_WORKER as FAST

CALLS_DDL = "CREATE TABLE calls (id bigserial PRIMARY KEY, size integer NOT NULL, ids text[] NOT NULL)"


@pytest.fixture
def db(database):
    with database.connect(autocommit=True) as c:
        c.execute(EFFECTS_DDL)
        c.execute(CALLS_DDL)
    return database


def start(url, registry, **kw):
    w = Worker(url, registry, WorkerSettings(consumer="c", **{**FAST, **kw}))
    w.start()
    return w


def run_until_settled(url, registry, **kw):
    """Run a worker until the inbox is settled; one slot unless ``concurrency`` is given (two slots
    would split the messages of a call between their claims)."""
    w = start(url, registry, **{"concurrency": 1, **kw})
    try:
        eventually(
            lambda: scalar(url, "SELECT count(*) = 0 FROM postbox.inbox WHERE state <> 'blocked'"),
            what="inbox settled",
        )
    finally:
        w.stop()
        w.join()


def produce(url, messages):
    with psycopg.connect(url) as c:
        postbox.receive_many(c, [{"consumer": "c", "payload": {}, **m} for m in messages])
        c.commit()


def effects(url):
    with psycopg.connect(url) as c:
        rows = c.execute("SELECT message_id, attempt FROM effects ORDER BY id").fetchall()
    found: dict[str, list[int]] = {}
    for message_id, attempt in rows:
        found.setdefault(message_id, []).append(attempt)
    return found


def calls(url):
    with psycopg.connect(url) as c:
        return c.execute("SELECT size, ids FROM calls ORDER BY id").fetchall()


def dead(url):
    with psycopg.connect(url) as c:
        rows = c.execute(
            "SELECT message_id, reason, last_error_type, attempt FROM postbox.dead_letters"
        ).fetchall()
    return {m: (reason, error_type, attempt) for m, reason, error_type, attempt in rows}


def record_call(ctx, messages):
    ctx.conn.execute(
        "INSERT INTO calls (size, ids) VALUES (%s, %s)", (len(messages), [m.message_id for m in messages])
    )


def test_a_batch_handler_gets_a_claimed_batch_in_one_call_and_keeps_every_keys_order(db):
    """200 messages over 10 keys, 4 slots: every effect exactly once, each key's in sequence order,
    and the handler called with several messages at a time, never more than the batch size."""
    reg = Registry()

    @reg.batch_handler("c")
    def handle(messages, ctx):
        record_call(ctx, messages)
        for m in messages:
            record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)

    produce(
        db.url,
        [{"message_id": f"{k}-{s}", "key": f"k{k}", "sequence": s} for s in range(20) for k in range(10)],
    )
    run_until_settled(db.url, reg, concurrency=4, batch_size=5)
    found = effects(db.url)
    assert len(found) == 200 and all(a == [1] for a in found.values())
    with psycopg.connect(db.url) as c:
        out_of_order = c.execute(
            "SELECT count(*) FROM effects"
            " WHERE prev_seq IS DISTINCT FROM CASE WHEN sequence = 0 THEN NULL ELSE sequence - 1 END"
        ).fetchone()[0]
    assert out_of_order == 0
    sizes = [size for size, _ in calls(db.url)]
    assert sum(sizes) == 200 and max(sizes) <= 5 and max(sizes) > 1


def test_a_batch_handlers_messages_are_counted_in_the_metrics_one_by_one(db):
    """A call counts each of its messages: claimed (by attempt), started, timed and processed; a
    retried message's second delivery counts as a redelivery."""
    from postbox.operations.metrics import REGISTRY

    def sample(name, **labels):
        return REGISTRY.get_sample_value(name, {"consumer": "metered", **labels}) or 0.0

    names = [
        ("postbox_deliveries_total", {"attempt": "1"}),
        ("postbox_deliveries_total", {"attempt": "2"}),
        ("postbox_redeliveries_total", {}),
        ("postbox_messages_processed_total", {"type": "t"}),
        ("postbox_handler_duration_seconds_count", {"type": "t"}),
        ("postbox_receive_to_start_seconds_count", {}),
    ]
    before = [sample(n, **labels) for n, labels in names]
    reg = Registry()
    failures = []

    @reg.batch_handler(
        "metered", "t", retry=RetryPolicy(strategy=Backoff.FIXED, base_delay=0.01, max_attempts=3)
    )
    def handle(messages, ctx):
        record_call(ctx, messages)
        for m in messages:
            if m.message_id == "m3" and len(failures) < 2:  # in the call, then alone
                failures.append(m.attempt)
                raise Retry(after=0.01, reason="twice")

    with psycopg.connect(db.url) as c:
        postbox.receive_many(
            c, [{"consumer": "metered", "type": "t", "message_id": f"m{i}", "payload": {}} for i in range(8)]
        )
        c.commit()
    w = Worker(db.url, reg, WorkerSettings(consumer="metered", **{**FAST, "concurrency": 1}))
    w.start()
    try:
        eventually(lambda: scalar(db.url, "SELECT count(*) = 0 FROM postbox.inbox"), what="inbox settled")
    finally:
        w.stop()
        w.join()
    after = [sample(n, **labels) for n, labels in names]
    deltas = [a - b for a, b in zip(after, before, strict=True)]
    # 8 first deliveries, m3 delivered again, 8 processed; handler time: the call of 8, then each
    # of them alone in the split, then m3's retry; a start for each first attempt, in the call and
    # alone.
    assert failures == [1, 1]
    assert deltas[:4] == [8, 1, 1, 8]
    assert deltas[4] == 8 + 8 + 1
    assert deltas[5] == 8 + 8


def test_a_failing_message_is_run_alone_and_only_it_is_dead_lettered(db):
    """The call with the poisoned message fails: its effects are undone, and each of its messages is
    run again alone. The others are done at attempt 1, once each; the poisoned one is dead-lettered
    with its own error."""
    reg = Registry()

    @reg.batch_handler("c")
    def handle(messages, ctx):
        record_call(ctx, messages)
        for m in messages:
            record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)
            if m.payload.get("poison"):
                raise Permanent(f"{m.message_id} cannot be handled")

    produce(db.url, [{"message_id": "a"}, {"message_id": "b"}, {"message_id": "bad", "payload": {"poison": 1}},
                     {"message_id": "c"}])  # fmt: skip
    run_until_settled(db.url, reg, batch_size=10)
    assert effects(db.url) == {"a": [1], "b": [1], "c": [1]}
    assert dead(db.url) == {"bad": ("permanent", "Permanent", 1)}
    assert calls(db.url) == [(1, ["a"]), (1, ["b"]), (1, ["c"])]  # the failed call's row was undone too
    assert scalar(db.url, "SELECT count(*) FROM postbox.attempts WHERE message_id <> 'bad'") == 0


def test_a_transient_failure_retries_only_its_message(db):
    """One message asks for a retry on its first attempt: it alone is retried (and then done at
    attempt 2); the others of its call are done once, at attempt 1."""
    reg = Registry()

    @reg.batch_handler("c", retry=RetryPolicy(strategy=Backoff.FIXED, base_delay=0.05, max_attempts=3))
    def handle(messages, ctx):
        for m in messages:
            if m.message_id == "flaky" and m.attempt == 1:
                raise Retry(after=0.05, reason="not yet")
            record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)

    produce(db.url, [{"message_id": m} for m in ("a", "flaky", "b")])
    run_until_settled(db.url, reg, batch_size=10)
    assert effects(db.url) == {"a": [1], "flaky": [2], "b": [1]}
    assert dead(db.url) == {}


def test_a_batch_handler_that_tries_to_commit_harms_only_the_message_that_makes_it(db):
    """ctx.conn refuses to commit while a batch handler runs: the call fails, its messages run
    alone, and only the one that makes it commit is dead-lettered; nothing of it committed."""
    reg = Registry()

    @reg.batch_handler("c")
    def handle(messages, ctx):
        for m in messages:
            record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)
        if any(m.payload.get("commit") for m in messages):
            ctx.conn.commit()

    produce(
        db.url, [{"message_id": "a"}, {"message_id": "bad", "payload": {"commit": 1}}, {"message_id": "b"}]
    )
    run_until_settled(db.url, reg, batch_size=10)
    assert effects(db.url) == {"a": [1], "b": [1]}
    assert dead(db.url) == {"bad": ("handler_ended_transaction", "HandlerEndedTransaction", 1)}


def test_a_call_past_its_time_limit_is_cancelled_and_only_the_slow_message_fails(db):
    """A call that runs past the handler's time limit is cancelled; run alone, the fast messages
    are done and the slow one fails with the time limit."""
    reg = Registry()

    @reg.batch_handler("c", timeout=0.5, retry=RetryPolicy(max_attempts=1))
    def handle(messages, ctx):
        for m in messages:
            if m.payload.get("slow"):
                ctx.conn.execute("SELECT pg_sleep(30)")
            record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)

    produce(
        db.url, [{"message_id": "a"}, {"message_id": "slow", "payload": {"slow": 1}}, {"message_id": "b"}]
    )
    run_until_settled(db.url, reg, batch_size=10)
    assert effects(db.url) == {"a": [1], "b": [1]}
    assert dead(db.url) == {"slow": ("attempts_exhausted", "HandlerTimeout", 1)}


def test_messages_of_other_types_and_unsupported_versions_run_on_their_own(db):
    """A batch handler takes the messages it handles and supports; a per-message handler of the
    same consumer runs its own, and an unsupported schema version is dead-lettered alone."""
    reg = Registry()

    @reg.batch_handler("c", "order", schema_versions=[1])
    def orders(messages, ctx):
        record_call(ctx, messages)
        for m in messages:
            record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)
            ctx.publish(m, "shipping", {"for": m.message_id})

    @reg.handler("c", "note")
    def note(m, ctx):
        record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)

    produce(db.url, [{"message_id": "o1", "type": "order"}, {"message_id": "n1", "type": "note"},
                     {"message_id": "o2", "type": "order"}, {"message_id": "o3", "type": "order", "schema_version": 2},
                     {"message_id": "o4", "type": "order"}])  # fmt: skip
    run_until_settled(db.url, reg, batch_size=10)
    assert effects(db.url) == {"o1": [1], "n1": [1], "o2": [1], "o4": [1]}
    assert calls(db.url) == [(3, ["o1", "o2", "o4"])]
    assert dead(db.url) == {"o3": ("permanent", "Permanent", 1)}
    with psycopg.connect(db.url) as c:
        published = c.execute(
            "SELECT payload->>'for', causation_id FROM postbox.outbox ORDER BY id"
        ).fetchall()
    assert published == [("o1", "o1"), ("o2", "o2"), ("o4", "o4")]


def test_an_async_batch_handler_writes_and_publishes_in_the_calls_transaction(db):
    """An ``async def`` batch handler gets an AsyncBatchContext: its writes through the async
    connection and its awaited publishes commit with the done marks; a failing call splits."""
    reg = Registry()

    @reg.batch_handler("c")
    async def handle(messages, ctx):
        await ctx.conn.execute(
            "INSERT INTO calls (size, ids) VALUES (%s, %s)", (len(messages), [m.message_id for m in messages])
        )
        for m in messages:
            if m.payload.get("poison"):
                raise Permanent(f"{m.message_id} cannot be handled")
            await ctx.publish(m, "shipping", {"for": m.message_id})

    produce(db.url, [{"message_id": "a"}, {"message_id": "b"}, {"message_id": "c"}])
    run_until_settled(db.url, reg, batch_size=10)
    assert calls(db.url) == [(3, ["a", "b", "c"])]
    produce(db.url, [{"message_id": "d"}, {"message_id": "bad", "payload": {"poison": 1}}])
    run_until_settled(db.url, reg, batch_size=10)
    assert calls(db.url) == [(3, ["a", "b", "c"]), (1, ["d"])]  # the failed calls' rows were undone
    with psycopg.connect(db.url) as c:
        published = c.execute(
            "SELECT payload->>'for', causation_id FROM postbox.outbox ORDER BY id"
        ).fetchall()
    assert published == [("a", "a"), ("b", "b"), ("c", "c"), ("d", "d")]
    assert dead(db.url) == {"bad": ("permanent", "Permanent", 1)}


def test_an_async_batch_call_past_its_time_limit_is_cancelled_and_only_the_slow_message_fails(db):
    reg = Registry()

    @reg.batch_handler("c", timeout=0.5, retry=RetryPolicy(max_attempts=1))
    async def handle(messages, ctx):
        for m in messages:
            if m.payload.get("slow"):
                await asyncio.sleep(30)
            await ctx.conn.execute("INSERT INTO calls (size, ids) VALUES (1, %s)", ([m.message_id],))

    produce(
        db.url, [{"message_id": "a"}, {"message_id": "slow", "payload": {"slow": 1}}, {"message_id": "b"}]
    )
    run_until_settled(db.url, reg, batch_size=10)
    assert sorted(ids[0] for _, ids in calls(db.url)) == ["a", "b"]
    assert dead(db.url) == {"slow": ("attempts_exhausted", "HandlerTimeout", 1)}


@pytest.mark.parametrize("then", [None, "SELECT 1"], ids=["commit", "commit-then-query"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_batch_handler_that_commits_with_sql_never_has_its_messages_run_again(db, then, kind):
    """A batch handler that runs COMMIT as SQL commits its call's effects with it (and a query after
    it begins another transaction): none of the call's messages is run again, which would double
    those effects; they are dead-lettered with the misuse named. A message of another handler,
    done before the call in the same batch, was committed by it and is done."""
    reg = Registry()

    @reg.handler("c", "single")
    def single(message, ctx):
        record_effect(ctx.conn, message.message_id, message.key, message.sequence, message.attempt)

    if kind == "sync":

        @reg.batch_handler("c", "many")
        def handle(messages, ctx):
            for m in messages:
                record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)
            ctx.conn.execute("COMMIT")
            if then:
                ctx.conn.execute(then)

    else:

        @reg.batch_handler("c", "many")
        async def handle_async(messages, ctx):
            for m in messages:
                await ctx.conn.execute(
                    "INSERT INTO effects (message_id, key, sequence, attempt) VALUES (%s, %s, %s, %s)",
                    (m.message_id, m.key, m.sequence, m.attempt),
                )
            await ctx.conn.execute("COMMIT")
            if then:
                await ctx.conn.execute(then)

    produce(
        db.url,
        [{"message_id": "first", "type": "single"}, {"message_id": "second", "type": "single"}]
        + [{"message_id": f"commit-{i}", "type": "many"} for i in range(4)],
    )
    run_until_settled(db.url, reg, batch_size=10)
    found = effects(db.url)
    assert found == {"first": [1], "second": [1]} | {f"commit-{i}": [1] for i in range(4)}  # none twice
    assert set(dead(db.url)) == {f"commit-{i}" for i in range(4)}
    assert {error for _, error, _ in dead(db.url).values()} == {"HandlerEndedTransaction"}
    assert scalar(db.url, "SELECT count(*) FROM postbox.inbox WHERE state <> 'blocked'") == 0


def test_a_batch_call_that_commits_with_sql_then_hangs_never_has_its_messages_run_again(db):
    """A call that runs COMMIT as SQL, then hangs past its time limit: its slot is abandoned, and
    the slot that settles the batch finds the transaction committed, so every message of the call
    is dead-lettered, none run again (their effects are durable)."""
    reg = Registry()
    release = threading.Event()

    @reg.batch_handler("c", timeout=0.5)
    def handle(messages, ctx):
        for m in messages:
            record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)
        if not release.is_set():
            ctx.conn.execute("COMMIT")
            release.wait(30)  # stuck past its time limit until the test ends

    produce(db.url, [{"message_id": f"m{i}"} for i in range(4)])
    try:
        run_until_settled(db.url, reg, batch_size=10)
    finally:
        release.set()
    assert effects(db.url) == {f"m{i}": [1] for i in range(4)}
    assert {m: (reason, error) for m, (reason, error, _) in dead(db.url).items()} == {
        f"m{i}": ("handler_ended_transaction", "HandlerEndedTransaction") for i in range(4)
    }

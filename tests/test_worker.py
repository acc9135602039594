"""The ordered worker in one process: order per key, exactly-once effects, retries that hold the key."""

from __future__ import annotations

import threading

import psycopg
import pytest

import postbox
from postbox.clock import FakeClock
from postbox.failures.outcomes import Permanent, Retry
from postbox.failures.policy import Backoff, RetryPolicy
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from tests.helpers import EFFECTS_DDL, eventually, record_effect, scalar
from tests.helpers import FAST_WORKER as FAST


@pytest.fixture
def effects_db(database):
    with database.connect(autocommit=True) as c:
        c.execute(EFFECTS_DDL)
    return database


def start(url, registry, consumer="c", clock=None, **kw):
    settings = WorkerSettings(consumer=consumer, **{**FAST, **kw})
    w = Worker(url, registry, settings, clock=clock)
    w.start()
    return w


def produce(url, messages):
    with psycopg.connect(url) as c:
        postbox.receive_many(c, messages)
        c.commit()


def run_until_drained(url, registry, **kw):
    """A worker with ``registry`` until the inbox is drained; stopped and joined."""
    w = start(url, registry, **kw)
    try:
        eventually(lambda: drained(url))
    finally:
        w.stop()
        w.join()


def drained(url, consumer="c"):
    return scalar(
        url, "SELECT count(*) = 0 FROM postbox.inbox WHERE consumer = %s AND state <> 'blocked'", (consumer,)
    )


def test_processes_every_message_once_in_key_order(effects_db):
    """Many keys, several slots: every message's effect exactly once, each key's in sequence order."""
    url = effects_db.url
    reg = Registry()

    @reg.handler("c")
    def handle(m, ctx):
        record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)

    produce(
        url,
        [
            {"consumer": "c", "message_id": f"{k}-{s}", "key": f"k{k}", "sequence": s, "payload": {}}
            for s in range(20)
            for k in range(10)
        ],
    )
    w = start(url, reg, concurrency=4, batch_size=5)
    try:
        eventually(lambda: drained(url), what="inbox drained")
    finally:
        w.stop()
        w.join()
    with psycopg.connect(url) as c:
        assert c.execute("SELECT count(*), count(DISTINCT message_id) FROM effects").fetchone() == (200, 200)
        bad = c.execute(
            "SELECT key FROM (SELECT key, sequence, lag(sequence) OVER (PARTITION BY key ORDER BY id) AS before"
            " FROM effects) e WHERE sequence <> coalesce(before + 1, 0)"
        ).fetchall()
        assert bad == []
        assert (
            c.execute(
                "SELECT count(*) FROM effects WHERE prev_seq IS DISTINCT FROM CASE WHEN sequence = 0 THEN NULL ELSE sequence - 1 END"
            ).fetchone()[0]
            == 0
        )
        assert c.execute("SELECT count(*) FROM postbox.workers").fetchone()[0] == 0


def test_transient_failure_holds_the_key_until_the_retry_succeeds(effects_db):
    """A retrying head keeps its key: later messages of the key wait; other keys flow meanwhile."""
    url = effects_db.url
    clock = FakeClock()
    reg = Registry()
    fails = {"a-0": 2}

    @reg.handler("c", retry=RetryPolicy(strategy=Backoff.FIXED, base_delay=60, max_attempts=5))
    def handle(m, ctx):
        if fails.get(m.message_id, 0) >= m.attempt:
            raise ConnectionError("dependency down")
        record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)

    produce(
        url,
        [
            {"consumer": "c", "message_id": f"{k}-{s}", "key": k, "sequence": s, "payload": {}}
            for k in ("a", "b")
            for s in range(3)
        ],
    )
    w = start(url, reg, clock=clock)
    try:
        eventually(lambda: scalar(url, "SELECT count(*) = 3 FROM effects WHERE key = 'b'"))
        row = eventually(
            lambda: scalar(
                url,
                "SELECT row(state, attempt, last_error_type, next_retry_at IS NOT NULL)::text FROM postbox.inbox WHERE message_id = 'a-0' AND attempt = 1 AND state = 'ready'",
            )
        )
        assert row == "(ready,1,ConnectionError,t)"
        assert scalar(url, "SELECT count(*) FROM effects WHERE key = 'a'") == 0
        assert (
            scalar(url, "SELECT string_agg(state, ',' ORDER BY id) FROM postbox.inbox WHERE key = 'a'")
            == "ready,pending,pending"
        )
        clock.advance(61)
        eventually(
            lambda: (
                scalar(url, "SELECT attempt FROM postbox.inbox WHERE message_id = 'a-0' AND state = 'ready'")
                == 2
            )
        )
        clock.advance(61)
        eventually(lambda: drained(url))
    finally:
        w.stop()
        w.join()
    assert (
        scalar(
            url,
            "SELECT string_agg(message_id || ':' || attempt, ',' ORDER BY id) FROM effects WHERE key = 'a'",
        )
        == "a-0:3,a-1:1,a-2:1"
    )


def test_permanent_failure_dead_letters_and_blocks_the_key(effects_db):
    """A permanent failure dead-letters at once (attempt 1) and blocks its key; other keys go on."""
    url = effects_db.url
    reg = Registry()

    @reg.handler("c")
    def handle(m, ctx):
        if m.message_id == "a-1":
            raise Permanent("amount missing")
        record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)

    produce(
        url,
        [
            {"consumer": "c", "message_id": f"{k}-{s}", "key": k, "sequence": s, "payload": {"s": s}}
            for k in ("a", "b")
            for s in range(3)
        ],
    )
    w = start(url, reg)
    try:
        eventually(lambda: scalar(url, "SELECT count(*) = 4 FROM effects"))
        eventually(lambda: scalar(url, "SELECT count(*) FROM postbox.blocked_keys") == 1)
    finally:
        w.stop()
        w.join()
    dl = scalar(
        url,
        "SELECT row(message_id, reason, attempt, ordering_policy, last_error_type, payload::text)::text FROM postbox.dead_letters",
    )
    assert dl == '(a-1,permanent,1,block,Permanent,"{""s"": 1}")'
    assert (
        scalar(url, "SELECT row(key, blocking_message_id, held_messages)::text FROM postbox.blocked_keys")
        == "(a,a-1,1)"
    )
    assert scalar(url, "SELECT string_agg(message_id, ',' ORDER BY id) FROM effects") is not None
    assert scalar(url, "SELECT count(*) FROM effects WHERE message_id = 'a-2'") == 0


def test_explicit_retry_after_is_honoured(effects_db):
    """Retry(after=...) schedules the next attempt exactly that far ahead (injected clock)."""
    url = effects_db.url
    clock = FakeClock()
    reg = Registry()

    @reg.handler("c")
    def handle(m, ctx):
        if m.attempt == 1:
            return Retry(after=42)
        record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)

    produce(url, [{"consumer": "c", "message_id": "x", "payload": {}}])
    t0 = clock.now()
    w = start(url, reg, clock=clock)
    try:
        eventually(
            lambda: scalar(
                url, "SELECT attempt = 1 AND state = 'ready' FROM postbox.inbox WHERE message_id = 'x'"
            )
        )
        delay = scalar(
            url,
            "SELECT extract(epoch FROM next_retry_at - %s) FROM postbox.inbox WHERE message_id = 'x'",
            (t0,),
        )
        assert float(delay) == pytest.approx(42, abs=0.5)
        clock.advance(43)
        eventually(lambda: drained(url))
    finally:
        w.stop()
        w.join()


def test_handler_time_limit_is_a_transient_failure(effects_db):
    """A handler past its time limit is cancelled and retried; its effects roll back."""
    url = effects_db.url
    reg = Registry()

    @reg.handler("c", timeout=0.5)
    def handle(m, ctx):
        record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)
        if m.attempt == 1:
            ctx.conn.execute("SELECT pg_sleep(30)")

    produce(url, [{"consumer": "c", "message_id": "slow", "payload": {}}])
    w = start(url, reg, retry=RetryPolicy(strategy=Backoff.FIXED, base_delay=0.01))
    try:
        eventually(lambda: drained(url), timeout=20)
    finally:
        w.stop()
        w.join()
    assert scalar(url, "SELECT string_agg(attempt::text, ',') FROM effects") == "2"


def test_async_handlers_and_sqlalchemy_session_commit_with_the_message(effects_db):
    """An async handler (through its async connection) and ORM-style writes through ctx.session commit
    in the message's transaction."""
    from sqlalchemy import text

    url = effects_db.url
    reg = Registry()

    @reg.handler("c", "sync-sa")
    def with_session(m, ctx):
        ctx.session.execute(
            text("INSERT INTO effects (message_id, key, attempt) VALUES (:m, :k, :a)"),
            {"m": m.message_id, "k": m.key, "a": m.attempt},
        )
        ctx.session.commit()  # only a savepoint: the outer transaction is the worker's

    @reg.handler("c", "async")
    async def asynchronous(m, ctx):  # an async handler's ctx.conn is a psycopg AsyncConnection
        await ctx.conn.execute(
            "INSERT INTO effects (message_id, key, attempt) VALUES (%s, %s, %s)",
            (m.message_id, m.key, m.attempt),
        )
        await ctx.publish("next", {"from": m.message_id}, key=m.key)

    produce(
        url,
        [
            {"consumer": "c", "message_id": "s", "type": "sync-sa", "payload": {}},
            {"consumer": "c", "message_id": "a", "type": "async", "payload": {}, "correlation_id": "corr"},
        ],
    )
    run_until_drained(url, reg)
    assert scalar(url, "SELECT string_agg(message_id, ',' ORDER BY message_id) FROM effects") == "a,s"
    assert (
        scalar(url, "SELECT row(destination, correlation_id, causation_id)::text FROM postbox.outbox")
        == "(next,corr,a)"
    )


def test_a_handler_closing_ctx_session_keeps_its_writes_with_the_message(effects_db):
    """``with ctx.session as s:`` (which closes the session), ``ctx.session.close()`` and an async
    ``async with ctx.session``: the writes commit with the message. A session's own close rolled
    its savepoint back, and the message was marked done without its effects. A handler that fails
    after closing its session still leaves nothing."""
    from sqlalchemy import text

    url = effects_db.url
    reg = Registry()
    insert = text("INSERT INTO effects (message_id, key, attempt) VALUES (:m, :k, :a)")

    def row(m):
        return {"m": m.message_id, "k": m.key, "a": m.attempt}

    @reg.handler("c", "with")
    def with_block(m, ctx):
        with ctx.session as s:
            s.execute(insert, row(m))

    @reg.handler("c", "close")
    def closes(m, ctx):
        ctx.session.execute(insert, row(m))
        ctx.session.close()
        ctx.session.execute(insert, {**row(m), "m": m.message_id + "-again"})  # usable again

    @reg.handler("c", "async")
    async def async_with(m, ctx):
        async with ctx.session as s:
            await s.execute(insert, row(m))

    @reg.handler("c", "fails", retry=RetryPolicy(max_attempts=1))
    def fails_after(m, ctx):
        with ctx.session as s:
            s.execute(insert, row(m))
        raise Permanent("after its session closed")

    produce(
        url,
        [
            {"consumer": "c", "message_id": t, "type": t, "payload": {}}
            for t in ("with", "close", "async", "fails")
        ],
    )
    run_until_drained(url, reg)
    assert (
        scalar(url, "SELECT string_agg(message_id, ',' ORDER BY message_id) FROM effects")
        == "async,close,close-again,with"
    )
    assert scalar(url, "SELECT string_agg(message_id, ',') FROM postbox.dead_letters") == "fails"


def test_an_async_handler_that_forgets_to_await_ctx_publish_is_dead_lettered_not_done(effects_db):
    """``ctx.publish(...)`` without ``await`` in an async handler (and in an async batch handler):
    the event was never written, and the message was marked done with only a RuntimeWarning. Now the
    attempt fails permanently, saying what to write; its effects are undone, and nothing is published."""
    url = effects_db.url
    reg = Registry()

    @reg.handler("c", "one")
    async def forgets(m, ctx):
        await ctx.conn.execute("INSERT INTO effects (message_id, key, attempt) VALUES (%s, %s, %s)",
                               (m.message_id, m.key, m.attempt))  # fmt: skip
        ctx.publish("next", {"from": m.message_id})  # the mistake under test: no await

    @reg.batch_handler("c", "many")
    async def forgets_in_a_batch(messages, ctx):
        for m in messages:
            ctx.publish(m, "next", {"from": m.message_id})  # no await

    @reg.handler("c", "fine")
    async def awaits(m, ctx):
        await ctx.publish("next", {"from": m.message_id})

    produce(
        url, [{"consumer": "c", "message_id": t, "type": t, "payload": {}} for t in ("one", "many", "fine")]
    )
    run_until_drained(url, reg)
    assert scalar(url, "SELECT count(*) FROM effects") == 0
    assert scalar(url, "SELECT string_agg(payload->>'from', ',') FROM postbox.outbox") == "fine"
    with psycopg.connect(url) as c:
        rows = c.execute(
            "SELECT message_id, reason, last_error FROM postbox.dead_letters ORDER BY message_id"
        ).fetchall()
    assert [(r[0], r[1]) for r in rows] == [("many", "permanent"), ("one", "permanent")]
    assert all(
        "without awaiting it: nothing was published; write 'await ctx.publish(...)'" in r[2] for r in rows
    )


def test_a_context_kept_and_used_after_its_handler_returned_is_refused(effects_db):
    """A handler keeps its ctx; another thread uses ctx.conn (and ctx.session) after the handler
    returned. The write went into the slot's idle connection, then the slot failed with an
    unrelated error and the write was silently rolled back. Now the call is refused with an error
    that says why, nothing is sent, and the slot goes on working."""
    from sqlalchemy import text

    url = effects_db.url
    reg = Registry()
    kept = []

    @reg.handler("c")
    def keeps(m, ctx):
        record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)
        ctx.session.execute(text("SELECT 1"))
        kept.append(ctx)

    produce(url, [{"consumer": "c", "message_id": "first", "payload": {}}])
    w = start(url, reg)
    try:
        eventually(lambda: drained(url))
        late = kept[0]
        with pytest.raises(psycopg.ProgrammingError, match=r"ctx\.conn was used after its handler returned"):
            late.conn.execute("INSERT INTO effects (message_id, key, attempt) VALUES ('late', 'k', 1)")
        with pytest.raises(Exception, match=r"ctx\.conn was used after its handler returned"):
            late.session.execute(
                text("INSERT INTO effects (message_id, key, attempt) VALUES ('late', 'k', 1)")
            )
        with pytest.raises(psycopg.ProgrammingError, match="used after its handler returned"):
            late.conn.close()
        produce(url, [{"consumer": "c", "message_id": "second", "payload": {}}])
        eventually(lambda: drained(url) and scalar(url, "SELECT count(*) FROM effects") == 2)
    finally:
        w.stop()
        w.join()
    assert scalar(url, "SELECT string_agg(message_id, ',' ORDER BY id) FROM effects") == "first,second"


def test_stop_finishes_in_flight_work_and_releases_nothing_claimed(effects_db):
    """stop() during a long handler: it finishes within the grace period; nothing stays claimed."""
    url = effects_db.url
    reg = Registry()
    started = threading.Event()

    @reg.handler("c")
    def handle(m, ctx):
        started.set()
        ctx.conn.execute("SELECT pg_sleep(0.5)")
        record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)

    produce(url, [{"consumer": "c", "message_id": f"m{i}", "key": "k", "payload": {}} for i in range(5)])
    w = start(url, reg, batch_size=1)
    assert started.wait(10)
    w.stop()
    w.join()
    assert scalar(url, "SELECT count(*) FROM postbox.inbox WHERE state = 'running'") == 0
    assert scalar(url, "SELECT count(*) FROM effects") >= 1
    assert scalar(url, "SELECT count(*) FROM postbox.workers") == 0


def test_abort_after_grace_releases_the_running_message(effects_db):
    """If a handler outlives the grace period, its query is cancelled and the message given back."""
    url = effects_db.url
    reg = Registry()
    started = threading.Event()

    @reg.handler("c")
    def handle(m, ctx):
        started.set()
        ctx.conn.execute("SELECT pg_sleep(60)")

    produce(url, [{"consumer": "c", "message_id": "long", "payload": {}}])
    w = start(url, reg, grace_period=0.5, handler_timeout=120)
    assert started.wait(10)
    w.stop()
    w.join()
    row = scalar(url, "SELECT row(state, attempt)::text FROM postbox.inbox WHERE message_id = 'long'")
    assert row in ("(ready,0)", "(ready,1)")
    assert scalar(url, "SELECT count(*) FROM postbox.inbox WHERE state = 'running'") == 0


def test_a_handler_that_commits_the_workers_transaction_is_dead_lettered(effects_db):
    """Handlers must leave the transaction to the worker: one that commits is detected, its message
    dead-lettered (retrying would repeat the damage) and the rest of the batch given back."""
    url = effects_db.url
    reg = Registry()

    @reg.handler("c")
    def handle(m, ctx):
        record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)
        if m.message_id == "rogue":
            ctx.conn.commit()

    produce(url, [{"consumer": "c", "message_id": mid, "payload": {}} for mid in ("a", "rogue", "b")])
    w = start(url, reg, batch_size=10)
    try:
        eventually(lambda: scalar(url, "SELECT count(*) = 0 FROM postbox.inbox WHERE state <> 'blocked'"))
    finally:
        w.stop()
        w.join()
    assert "must leave the transaction to the worker" in scalar(
        url, "SELECT last_error FROM postbox.dead_letters WHERE message_id = 'rogue'"
    )
    assert scalar(url, "SELECT count(*) FROM effects WHERE message_id = 'b'") == 1


@pytest.mark.parametrize(
    "isolation", [psycopg.IsolationLevel.READ_COMMITTED, psycopg.IsolationLevel.REPEATABLE_READ]
)
def test_complete_takes_out_promotes_and_files_repairs(database, isolation):
    """inbox_complete_v1 is set-based under READ COMMITTED and one message at a time under
    REPEATABLE READ; both give the same outcome: done messages leave, each key's next message
    becomes its head, a key locked by someone else gets a repair instead, and ids that are no
    longer ours (gone, or claimed again since) come back as lost."""
    with database.connect() as c, database.connect() as other:
        for key, ids in {"k1": ["m1", "m2"], "k2": ["m3", "m4"], "k3": ["m5"]}.items():
            for m in ids:
                postbox.receive(c, consumer="c", message_id=m, key=key, payload={})
        c.commit()
        claimed = {
            m: (i, a)
            for i, m, a in c.execute(
                "SELECT id, message_id, attempt FROM postbox.inbox_claim_v1('c', 'w', 10, '1 minute', now())"
            )
        }
        c.commit()
        assert set(claimed) == {"m1", "m3", "m5"}
        other.execute("SELECT pg_advisory_xact_lock(1349471040 + 1, hashtext('c/k2'))")  # k2's key lock
        c.isolation_level = isolation
        ids = [claimed[m][0] for m in ("m1", "m3", "m5")] + [10**9]
        attempts = [claimed["m1"][1], claimed["m3"][1], claimed["m5"][1] + 1, 1]  # m5: a later attempt's
        (lost,) = c.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", (ids, attempts)).fetchone()
        c.commit()
        other.rollback()
        assert sorted(lost) == sorted([claimed["m5"][0], 10**9])
        states = dict(c.execute("SELECT message_id, state FROM postbox.inbox").fetchall())
        assert states == {"m2": "ready", "m4": "pending", "m5": "running"}
        assert c.execute("SELECT queue, key FROM postbox.key_repairs").fetchall() == [("c", "k2")]

"""Replay jobs: the seed case end to end, pacing with the injected clock, pause/resume/cancel from
another session, canary and auto-abort, concurrent replays, a killed runner, both modes, late keys."""

from __future__ import annotations

import os
import re
import signal
import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation

import psycopg
import pytest

import postbox
from postbox.clock import FakeClock
from postbox.deadletters import ops as deadletter
from postbox.deadletters import replay
from postbox.deadletters.ops import DeadLetterFilter
from postbox.deadletters.replay import ReplayOptions, ReplayRunner
from postbox.failures.outcomes import Permanent, UnknownOutcome
from postbox.failures.policy import Backoff, RetryPolicy
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from tests.helpers import FAST_WORKER, eventually, scalar, spawn_postbox

QUICK = RetryPolicy(strategy=Backoff.EXPONENTIAL_FULL_JITTER, base_delay=0.01, max_delay=0.05, max_attempts=3)

SHOP_DDL = """
CREATE TABLE orders (key text PRIMARY KEY, state text NOT NULL, amount numeric);
CREATE TABLE order_log (id bigserial PRIMARY KEY, key text, type text, message_id text, attempt int);
CREATE TABLE external_calls (idempotency_key text PRIMARY KEY, message_id text, calls int NOT NULL DEFAULT 1);
"""


@pytest.fixture
def db(database):
    with database.connect(autocommit=True) as c:
        c.execute(SHOP_DDL)
        c.execute("SELECT postbox.declare_consumer_v1('orders', 'monotonic')")
    return database


def shop_registry(version: int, seen: list[dict] | None = None) -> Registry:
    """Order events. Version 1 has the seed's bug: ``amount`` must be a JSON number, so a producer
    that sends it as a string ("12.50") gets a permanent schema error. Version 2 is the fix."""
    reg = Registry()

    @reg.handler("orders", retry=QUICK)
    def handle(m, ctx):
        if seen is not None:
            seen.append(
                {
                    "id": m.message_id,
                    "causation": m.causation_id,
                    "headers": m.headers,
                    "idem": ctx.idempotency_key,
                }
            )
        amount = None
        if m.type == "paid":
            raw = m.payload.get("amount")
            if version == 1 and not isinstance(raw, int | float):
                raise Permanent(f"schema: field amount must be a number, got {type(raw).__name__}")
            try:
                amount = Decimal(str(raw))
            except InvalidOperation:
                raise Permanent(f"schema: field amount is not a number: {raw!r}") from None
        state = ctx.conn.execute("SELECT state FROM orders WHERE key = %s", (m.key,)).fetchone()
        if m.type == "shipped" and (state is None or state[0] != "paid"):
            raise Permanent("order is not paid")
        ctx.conn.execute(
            "INSERT INTO orders (key, state, amount) VALUES (%s, %s, %s) ON CONFLICT (key) DO UPDATE"
            " SET state = excluded.state, amount = coalesce(excluded.amount, orders.amount)",
            (m.key, m.type, amount),
        )
        ctx.conn.execute(
            "INSERT INTO order_log (key, type, message_id, attempt) VALUES (%s, %s, %s, %s)",
            (m.key, m.type, m.message_id, m.attempt),
        )

    return reg


def receive_orders(url: str, orders: list[str], bad_amount: bool = True) -> None:
    """For each order: created (1), paid (2, amount as a string when bad_amount), shipped (3)."""
    with psycopg.connect(url) as c:
        msgs = []
        for o in orders:
            amount: object = "12.50" if bad_amount else 12.5
            for seq, typ, payload in (
                (1, "created", {}),
                (2, "paid", {"amount": amount}),
                (3, "shipped", {}),
            ):
                msgs.append(
                    {
                        "consumer": "orders",
                        "message_id": f"{o}-{seq}",
                        "key": o,
                        "sequence": seq,
                        "type": typ,
                        "payload": {"order": o, **payload},
                        "headers": {"traceparent": f"00-{o}-01"},
                        "source": "shop",
                    }
                )
        postbox.receive_many(c, msgs)
        c.commit()


def start_worker(url: str, registry: Registry, clock=None) -> Worker:
    w = Worker(url, registry, WorkerSettings(consumer="orders", **FAST_WORKER), clock=clock)
    w.start()
    return w


def stop(w: Worker) -> None:
    w.stop()
    w.join()


def dead_letter_all_paid(db, orders: list[str]) -> None:
    """Run the buggy handler until every order's paid is dead-lettered and its key blocked."""
    receive_orders(db.url, orders)
    w = start_worker(db.url, shop_registry(1))
    try:
        eventually(
            lambda: scalar(db.url, "SELECT count(*) FROM postbox.blocked_keys") == len(orders), timeout=60
        )
    finally:
        stop(w)


def fake_sleep(clock: FakeClock):
    """The runner's wait: move the injected clock (a short real pause lets the worker thread run)."""
    pause = threading.Event()

    def sleep(seconds: float) -> bool:
        clock.advance(seconds)
        pause.wait(0.002)
        return False

    return sleep


def log_of(url: str, key: str) -> str:
    return scalar(url, "SELECT string_agg(type, ',' ORDER BY id) FROM order_log WHERE key = %s", (key,))


def test_seed_case_schema_mismatch_then_fixed_handler_rate_limited_replay(db):
    """The seed case: paid carries amount as a string; the handler rejects it (permanent schema error),
    it is dead-lettered with its full context and blocks only its order, and the DLQ views show it
    with its age. After the handler is fixed, a rate-limited replay of that error group sends each
    back once, in key order; each paid succeeds exactly once and its held shipped follows."""
    orders = [f"order-{i}" for i in range(6)]
    dead_letter_all_paid(db, orders)

    with db.connect() as c:
        c.row_factory = psycopg.rows.dict_row
        dl = c.execute("SELECT * FROM postbox.dead_letters WHERE key = 'order-0'").fetchone()
        summary = c.execute("SELECT * FROM postbox.dead_letter_summary").fetchone()
        groups = deadletter.groups(c)
    assert dl["message_id"] == "order-0-2" and dl["type"] == "paid" and dl["sequence"] == 2
    assert dl["payload"] == {"order": "order-0", "amount": "12.50"} and dl["headers"] == {
        "traceparent": "00-order-0-01"
    }
    assert (
        dl["reason"] == "permanent"
        and dl["attempt"] == 1
        and "field amount must be a number" in dl["last_error"]
    )
    assert dl["source"] == "shop" and dl["ordering_policy"] == "block" and dl["status"] == "open"
    assert summary["open"] == 6 and summary["oldest_age"] >= timedelta(0)
    assert len(groups) == 1 and groups[0]["open"] == 6 and groups[0]["keys"] == 6
    for o in orders:
        assert log_of(db.url, o) == "created"

    clock = FakeClock()
    w = start_worker(db.url, shop_registry(2), clock=clock)
    try:
        with db.connect(autocommit=True) as c:
            job_id = replay.start(
                c,
                DeadLetterFilter(queue="orders", fingerprint=groups[0]["fingerprint"]),
                reason="amount parsing fixed in v2",
                actor="alice",
                options=ReplayOptions(rate=2, batch_size=2),
            )
        progress: list[tuple[datetime, int]] = []
        runner = ReplayRunner(db.url, clock=clock, poll_interval=0.2, sleep=fake_sleep(clock))
        t0 = clock.now()
        job = runner.run_job(job_id, lambda j: progress.append((clock.now(), j.replayed)))
    finally:
        stop(w)

    assert job.state == "done" and (job.succeeded, job.failed, job.skipped) == (6, 0, 0)
    # The pace: never more than the first batch plus `rate` per second of (injected) time.
    for at, sent in progress:
        assert sent <= 2 + 2 * (at - t0).total_seconds() + 1e-6, (at - t0, sent)
    assert progress[-1][0] - t0 >= timedelta(seconds=(6 - 2) / 2)
    for o in orders:
        assert log_of(db.url, o) == "created,paid,shipped"
    assert scalar(db.url, "SELECT count(*) FROM order_log WHERE type = 'paid'") == 6
    assert scalar(db.url, "SELECT count(*) FROM postbox.dead_letters WHERE status = 'replayed'") == 6
    assert scalar(db.url, "SELECT count(*) FROM postbox.blocked_keys") == 0
    assert scalar(db.url, "SELECT count(*) FROM postbox.inbox") == 0
    assert scalar(db.url, "SELECT sum(amount) FROM orders") == Decimal("75.00")
    with db.connect() as c:
        history = [(e.event, e.detail) for e in deadletter.explain(c, dl["id"])]
    events = [e for e, _ in history]
    assert events[0] == "received" and "attempt 1 failed" in events
    assert any(e.startswith("dead-lettered as #") for e in events)
    assert "operator: replay" in events and any(e.startswith("replayed #") for e in events)
    assert events[-1] == f"#{dl['id']} is replayed"


def test_rate_limit_with_the_injected_clock(db):
    """Steps at chosen instants of the injected clock send back at most the burst (one batch) plus
    rate x elapsed; nothing accrues while the clock stands still; the bucket never exceeds a batch."""
    dead_letter_all_paid(db, [f"o{i}" for i in range(20)])
    clock = FakeClock()
    with db.connect(autocommit=True) as c:
        job_id = replay.start(
            c, DeadLetterFilter(type="paid"), "fixed", options=ReplayOptions(rate=4, batch_size=3)
        )
        t0 = clock.now()
        sent = [replay.step(c, job_id, t0).replayed]
        sent.append(replay.step(c, job_id, t0).replayed)  # same instant: nothing more
        sent.append(replay.step(c, job_id, t0 + timedelta(seconds=0.5)).replayed)  # +2
        sent.append(replay.step(c, job_id, t0 + timedelta(seconds=0.6)).replayed)  # 0.4 token: +0
        sent.append(replay.step(c, job_id, t0 + timedelta(seconds=10)).replayed)  # bucket caps at 3
        sent.append(replay.step(c, job_id, t0 + timedelta(seconds=11)).replayed)  # +3 (4 tokens, batch 3)
    assert sent == [3, 3, 5, 5, 8, 11]


def test_pause_resume_cancel_from_another_session_while_a_replay_runs(db):
    """A runner drives a slow job; a second connection pauses it (nothing more is sent while paused,
    however much time passes), resumes it, then cancels it: unsent items are cancelled, sent ones settle,
    and every action is in the audit trail."""
    orders = [f"p{i}" for i in range(12)]
    dead_letter_all_paid(db, orders)
    clock = FakeClock()
    w = start_worker(db.url, shop_registry(2), clock=clock)
    with db.connect(autocommit=True) as c:
        job_id = replay.start(
            c, DeadLetterFilter(type="paid"), "fixed", "bob", ReplayOptions(rate=1, batch_size=1)
        )
    runner = ReplayRunner(db.url, clock=clock, poll_interval=0.2, sleep=fake_sleep(clock))
    result: list[replay.ReplayJob] = []
    t = threading.Thread(target=lambda: result.append(runner.run_job(job_id)))
    t.start()
    try:
        with db.connect(autocommit=True) as other:
            eventually(lambda: replay.get(other, job_id).succeeded >= 2)
            paused = replay.pause(other, job_id, "checking the first results", "carol")
            assert paused.state == "paused"
            before = replay.get(other, job_id).replayed
            clock.advance(30)  # plenty of tokens would have accrued
            eventually(lambda: replay.get(other, job_id).in_flight == 0)
            assert replay.get(other, job_id).replayed == before
            resumed = replay.resume(other, job_id, "looks good", "carol", now=clock.now())
            assert resumed.state == "running"
            eventually(lambda: replay.get(other, job_id).replayed >= before + 2)
            cancelled = replay.cancel(other, job_id, "enough for today", "carol")
            assert cancelled.state == "cancelled"
        t.join(timeout=30)
        assert not t.is_alive() and result[0].state == "cancelled"
        # What was already sent back settles after the cancel.
        eventually(
            lambda: (
                scalar(db.url, "SELECT count(*) FROM postbox.dead_letters WHERE status = 'replaying'") == 0
            )
        )
    finally:
        runner.stop()
        stop(w)
    with db.connect() as c:
        job = replay.get(c, job_id)
        states = [i["state"] for i in replay.items(c, job_id)]
        audit = [(r["action"], r["actor"]) for r in reversed(deadletter.audit_trail(c))]
    assert "cancelled" in states and "pending" not in states
    assert job.replayed == states.count("succeeded") + states.count("replaying")
    assert audit == [
        ("replay", "bob"),
        ("replay_pause", "carol"),
        ("replay_resume", "carol"),
        ("replay_cancel", "carol"),
    ]
    # What was cancelled stays open, its key still blocked; nothing was processed twice.
    assert scalar(db.url, "SELECT count(*) FROM postbox.dead_letters WHERE status = 'open'") == states.count(
        "cancelled"
    )
    assert scalar(db.url, "SELECT count(*) FROM order_log WHERE type = 'paid'") == job.replayed
    assert (
        scalar(db.url, "SELECT count(*) FROM postbox.dead_letters WHERE status = 'replayed'") == job.replayed
    )


def test_canary_failure_aborts_the_job_and_says_why(db):
    """With a canary of 2 and the handler still broken, the job aborts by itself at the first
    failure with the reason; the rest of the canary, already sent, still settles into its counters;
    the other dead letters stay open and untouched."""
    dead_letter_all_paid(db, [f"c{i}" for i in range(6)])
    clock = FakeClock()
    w = start_worker(db.url, shop_registry(1), clock=clock)
    try:
        with db.connect(autocommit=True) as c:
            job_id = replay.start(
                c, DeadLetterFilter(type="paid"), "try again", options=ReplayOptions(rate=100, canary=2)
            )
        job = ReplayRunner(db.url, clock=clock, poll_interval=0.1, sleep=fake_sleep(clock)).run_job(job_id)
        assert job.state == "aborted"
        eventually(
            lambda: (
                scalar(db.url, "SELECT count(*) FROM postbox.dead_letters WHERE status = 'replay_failed'")
                == 2
            ),
            what="both canary messages failed again",
        )
        with db.connect(autocommit=True) as c:
            job = replay.step(c, job_id, clock.now())  # an aborted job sends nothing, but settles
    finally:
        stop(w)
    assert job.state == "aborted"
    assert re.fullmatch(
        r"canary failed: [12] of the first 2 replayed messages failed again", job.state_reason or ""
    )
    assert (job.replayed, job.failed) == (2, 2)
    assert scalar(db.url, "SELECT count(*) FROM postbox.dead_letters WHERE status = 'replay_failed'") == 2
    assert (
        scalar(db.url, "SELECT count(*) FROM postbox.dead_letters WHERE status = 'open'") == 6
    )  # 4 untouched + 2 new
    assert scalar(db.url, "SELECT count(*) FROM postbox.dead_letters WHERE replay_of IS NOT NULL") == 2
    assert scalar(db.url, "SELECT count(*) FROM postbox.audit_log WHERE action = 'replay_abort'") == 1


def test_failure_ratio_aborts_the_job(db):
    """Without a canary, the job aborts once failed/finished passes the ratio (after enough finished)."""
    dead_letter_all_paid(db, [f"r{i}" for i in range(12)])
    clock = FakeClock()
    w = start_worker(db.url, shop_registry(1), clock=clock)
    try:
        with db.connect(autocommit=True) as c:
            job_id = replay.start(
                c,
                DeadLetterFilter(type="paid"),
                "retry",
                options=ReplayOptions(rate=5, batch_size=2, abort_failure_ratio=0.3),
            )
        job = ReplayRunner(db.url, clock=clock, poll_interval=0.1, sleep=fake_sleep(clock)).run_job(job_id)
    finally:
        stop(w)
    assert job.state == "aborted" and job.state_reason.startswith("failure ratio")
    assert job.replayed < 12 and job.failed >= 5


def test_concurrent_replays_of_the_same_dead_letters_send_each_back_once(db):
    """Four jobs over the same dead letters, stepped at once from four threads: each dead letter is
    sent back by exactly one job; the other jobs skip it; each paid takes effect once."""
    orders = [f"k{i}" for i in range(10)]
    dead_letter_all_paid(db, orders)
    with db.connect(autocommit=True) as c:
        jobs = [
            replay.start(
                c, DeadLetterFilter(type="paid"), f"job {i}", options=ReplayOptions(rate=1000, batch_size=100)
            )
            for i in range(4)
        ]
    barrier = threading.Barrier(len(jobs))

    def go(job_id: int) -> None:
        with psycopg.connect(db.url, autocommit=True) as c:
            barrier.wait()
            replay.step(c, job_id, datetime.now(UTC))

    threads = [threading.Thread(target=go, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w = start_worker(db.url, shop_registry(2))
    try:
        clock = FakeClock()
        for j in jobs:
            ReplayRunner(db.url, clock=clock, poll_interval=0.05, sleep=fake_sleep(clock)).run_job(j)
    finally:
        stop(w)
    assert scalar(db.url, "SELECT count(*) FROM postbox.replay_items WHERE state = 'succeeded'") == 10
    assert scalar(db.url, "SELECT count(*) FROM postbox.replay_items WHERE state = 'skipped'") == 30
    assert scalar(db.url, "SELECT count(*) FROM order_log WHERE type = 'paid'") == 10
    for o in orders:
        assert log_of(db.url, o) == "created,paid,shipped"


def test_killed_runner_process_restarted_replays_nothing_twice(db):
    """`postbox replay run` is killed (-9) in the middle of a job and started again: the job goes on
    where it stopped, every dead letter is sent back exactly once, every paid takes effect once."""
    orders = [f"x{i}" for i in range(40)]
    dead_letter_all_paid(db, orders)
    with db.connect(autocommit=True) as c:
        job_id = replay.start(
            c, DeadLetterFilter(type="paid"), "fixed", options=ReplayOptions(rate=25, batch_size=5)
        )
    w = start_worker(db.url, shop_registry(2))
    runner = spawn_postbox("--database-url", db.url, "replay", "run", "--poll-interval", "0.05")
    try:
        with db.connect(autocommit=True) as c:
            eventually(lambda: replay.get(c, job_id).replayed >= 10, timeout=60)
            os.kill(runner.pid, signal.SIGKILL)
            runner.wait(timeout=10)
            stalled = replay.get(c, job_id)
            assert stalled.state == "running" and stalled.replayed < 40
            runner = spawn_postbox("--database-url", db.url, "replay", "run", "--poll-interval", "0.05")
            job = eventually(lambda: (j := replay.get(c, job_id)).finished and j, timeout=90)
    finally:
        runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=30)
        stop(w)
    assert job.state == "done" and (job.total, job.replayed, job.succeeded) == (40, 40, 40)
    assert scalar(db.url, "SELECT count(*) FROM order_log WHERE type = 'paid'") == 40
    assert scalar(db.url, "SELECT count(DISTINCT message_id) FROM order_log WHERE type = 'paid'") == 40
    assert scalar(db.url, "SELECT count(*) FROM postbox.replay_items WHERE replayed_at IS NOT NULL") == 40
    for o in orders:
        assert log_of(db.url, o) == "created,paid,shipped"


def test_new_message_mode_references_the_original(db):
    """new_message mode: a new message '<id>:replay:<dead letter>' takes the blocked head's place, with
    causation_id and a header naming the original; it is in the dedup ledger; the key's held message
    follows; the original dead letter becomes replayed."""
    dead_letter_all_paid(db, ["n1"])
    seen: list[dict] = []
    reg = shop_registry(2, seen)
    with db.connect(autocommit=True) as c:
        dl_id = scalar(db.url, "SELECT id FROM postbox.dead_letters")
        job_id = replay.start(
            c, DeadLetterFilter(ids=[dl_id]), "fixed", options=ReplayOptions(mode="new_message")
        )
    clock = FakeClock()
    w = start_worker(db.url, reg, clock=clock)
    try:
        job = ReplayRunner(db.url, clock=clock, poll_interval=0.05, sleep=fake_sleep(clock)).run_job(job_id)
    finally:
        stop(w)
    assert job.state == "done" and job.succeeded == 1
    paid = next(s for s in seen if s["id"].startswith("n1-2"))
    assert paid["id"] == f"n1-2:replay:{dl_id}" and paid["causation"] == "n1-2"
    assert paid["headers"]["postbox_replay_of"] == {"message_id": "n1-2", "dead_letter_id": dl_id}
    assert paid["headers"]["traceparent"] == "00-n1-01"
    assert log_of(db.url, "n1") == "created,paid,shipped"
    assert (
        scalar(db.url, "SELECT count(*) FROM postbox.inbox_dedup WHERE message_id = %s", (paid["id"],)) == 1
    )
    assert scalar(db.url, "SELECT status FROM postbox.dead_letters WHERE id = %s", (dl_id,)) == "replayed"


def test_replay_never_repeats_an_external_effect_that_did_happen(db):
    """A handler calls an external system with its idempotency key, then the outcome is unknown (the
    call did happen): the message is dead-lettered as unknown_outcome. Replaying it, in place and then
    again as a new message, reaches the external system with the same key each time, so the effect
    happens once; and replaying an already-replayed dead letter is refused (it is no longer open)."""
    with db.connect(autocommit=True) as c:
        c.execute("SELECT postbox.declare_consumer_v1('calls', 'arrival', on_dead_letter => 'skip')")
    state = {"fail": True}
    reg = Registry()

    @reg.handler("calls", retry=QUICK, idempotent=False)
    def call(m, ctx):
        with psycopg.connect(db.url, autocommit=True) as external:  # another system: its own commit
            external.execute(
                "INSERT INTO external_calls (idempotency_key, message_id) VALUES (%s, %s)"
                " ON CONFLICT (idempotency_key) DO UPDATE SET calls = external_calls.calls + 0",
                (ctx.idempotency_key, m.message_id),
            )
        if state["fail"]:
            raise UnknownOutcome("timeout after the request was sent")

    with db.connect() as c:
        postbox.receive(c, postbox.InboxMessage(consumer="calls", message_id="pay-1", payload={"n": 1}))
        c.commit()
    clock = FakeClock()
    w = Worker(db.url, reg, WorkerSettings(consumer="calls", **FAST_WORKER), clock=clock)
    w.start()
    try:
        eventually(
            lambda: scalar(db.url, "SELECT count(*) FROM postbox.dead_letters WHERE status = 'open'") == 1
        )
        dl = scalar(db.url, "SELECT row(id, reason)::text FROM postbox.dead_letters")
        assert dl.endswith(",unknown_outcome)")
        # In place, the call is made again (same key) and the outcome is unknown again; then as a new
        # message, the call succeeds (same key again).
        for mode, fails in (("in_place", True), ("new_message", False)):
            state["fail"] = fails
            with db.connect(autocommit=True) as c:
                job_id = replay.start(
                    c, DeadLetterFilter(queue="calls"), f"replay {mode}", options=ReplayOptions(mode=mode)
                )
            job = ReplayRunner(db.url, clock=clock, poll_interval=0.05, sleep=fake_sleep(clock)).run_job(
                job_id
            )
            assert (job.failed, job.succeeded) == ((1, 0) if fails else (0, 1))
        with (
            db.connect(autocommit=True) as c,
            pytest.raises(postbox.InvalidRequest, match="matches no open dead letter"),
        ):
            replay.start(c, DeadLetterFilter(queue="calls"), "again")
    finally:
        w.stop()
        w.join()
    assert scalar(db.url, "SELECT count(*) FROM external_calls") == 1
    assert scalar(db.url, "SELECT count(*) FROM postbox.inbox") == 0


def test_replay_of_a_message_whose_key_moved_on_follows_the_late_policy(db):
    """A monotonic consumer that skips past dead letters: paid (2) is dead-lettered and shipped (3) is
    processed. Replaying paid finds the key at 3: with late_policy dead_letter it is dead-lettered again
    as late (replay_failed); after switching the consumer to late_policy process, a replay processes it."""
    with db.connect(autocommit=True) as c:
        c.execute("SELECT postbox.declare_consumer_v1('orders', 'monotonic', on_dead_letter => 'skip')")
    receive_orders(db.url, ["m1"])
    reg = shop_registry(1)
    w = start_worker(db.url, reg)
    try:
        eventually(lambda: scalar(db.url, "SELECT count(*) FROM postbox.inbox") == 0)
    finally:
        stop(w)
    assert (
        scalar(db.url, "SELECT count(*) FROM order_log WHERE key = 'm1' AND type = 'shipped'") == 0
    )  # not paid
    clock = FakeClock()
    w = start_worker(db.url, shop_registry(2), clock=clock)
    try:
        with db.connect(autocommit=True) as c:
            dry = replay.start(
                c, DeadLetterFilter(type="paid"), "what would happen", options=ReplayOptions(dry_run=True)
            )
            replay.step(c, dry, clock.now())
            plan = replay.items(c, dry)[0]["action"]
            assert "late policy dead_letter applies" in plan and replay.get(c, dry).state == "done"
            job1 = replay.start(c, DeadLetterFilter(type="paid"), "try")
        first = ReplayRunner(db.url, clock=clock, poll_interval=0.05, sleep=fake_sleep(clock)).run_job(job1)
        assert first.failed == 1
        assert (
            scalar(db.url, "SELECT reason FROM postbox.dead_letters WHERE status = 'open' AND type = 'paid'")
            == "late"
        )
        with db.connect(autocommit=True) as c:
            c.execute(
                "SELECT postbox.declare_consumer_v1('orders', 'monotonic', late_policy => 'process', on_dead_letter => 'skip')"
            )
            job2 = replay.start(c, DeadLetterFilter(type="paid"), "process late")
        second = ReplayRunner(db.url, clock=clock, poll_interval=0.05, sleep=fake_sleep(clock)).run_job(job2)
    finally:
        stop(w)
    assert second.succeeded == 1
    assert log_of(db.url, "m1") == "created,paid"  # shipped was dead-lettered (not paid yet) and skipped
    assert (
        scalar(
            db.url,
            "SELECT string_agg(type || ':' || reason, ',') FROM postbox.dead_letters WHERE status = 'open'",
        )
        == "shipped:permanent"
    )


def test_dead_letter_retention_keeps_what_a_replay_job_has_not_settled(db):
    """A dead letter sent back by a replay job and processed is closed (replayed) before the job's
    next step settles its item. The retention deleted it then, and the job waited for it for ever,
    in flight in `postbox status`. Now it stays until the item is settled; then it goes."""
    from postbox.operations.maintenance import Maintenance, MaintenanceSettings

    dead_letter_all_paid(db, ["r1"])
    w = start_worker(db.url, shop_registry(2))
    try:
        with db.connect(autocommit=True) as c:
            job_id = replay.start(
                c, DeadLetterFilter(type="paid"), "fixed", "bob", ReplayOptions(batch_size=1)
            )
            replay.step(c, job_id, datetime.now(UTC))  # sends it back
            eventually(lambda: scalar(db.url, "SELECT status FROM postbox.dead_letters") == "replayed")
            assert [i["state"] for i in replay.items(c, job_id)] == ["replaying"]
            later = FakeClock()
            later.advance(86400)  # a day on: far past the retention below
            m = Maintenance(db.url, MaintenanceSettings(dead_letter_retention_seconds=60), clock=later)
            assert m.run_job("dead_letter_retention") == 0
            assert scalar(db.url, "SELECT count(*) FROM postbox.dead_letters") == 1
            job = replay.step(c, job_id, datetime.now(UTC))  # settles the item: the job is done
            assert job.finished and [i["state"] for i in replay.items(c, job_id)] == ["succeeded"]
            assert m.run_job("dead_letter_retention") == 1
            assert scalar(db.url, "SELECT count(*) FROM postbox.dead_letters") == 0
    finally:
        stop(w)


def test_a_replay_runner_that_cannot_step_exits_70_instead_of_staying_ready(db):
    """`postbox replay run` as a login that may not step a job (a reader): its thread died with a
    traceback, and the process stayed up and ready with no job advancing. Now it says why in one
    line, naming the role it needs, and exits 70 for its supervisor."""
    import subprocess
    from contextlib import contextmanager

    from tests.helpers import role_login

    dead_letter_all_paid(db, ["z1"])
    with db.connect(autocommit=True) as c:
        replay.start(c, DeadLetterFilter(type="paid"), "fixed", "bob", ReplayOptions(batch_size=1))
    with contextmanager(role_login)(db, "postbox_reader", "replayrun") as url:
        p = spawn_postbox(
            "--database-url", url, "replay", "run", "--poll-interval", "0.05", stderr=subprocess.PIPE
        )
        try:
            assert p.wait(30) == 70
        finally:
            if p.poll() is None:
                p.kill()
        err = p.stderr.read().decode() if p.stderr else ""
    assert (
        "the replay runner stopped: InsufficientPrivilege: permission denied for function replay_step_v1"
        in err
    )
    assert "needs a login granted postbox_operator" in err

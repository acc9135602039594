"""Failure handling end to end: the seeds' scenarios, the four error-handling patterns, policies."""

from __future__ import annotations

import threading
from pathlib import Path

import psycopg
import pytest

import postbox
from postbox.config.policies import apply_policies, check_retention, load_policies
from postbox.errors import ConfigError
from postbox.failures.breaker import BreakerSettings
from postbox.failures.outcomes import Permanent, Transient, UnknownOutcome
from postbox.failures.policy import Backoff, RetryPolicy
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from tests.helpers import FAST_WORKER, eventually, scalar

QUICK = RetryPolicy(strategy=Backoff.EXPONENTIAL_FULL_JITTER, base_delay=0.01, max_delay=0.05, max_attempts=4)

ORDERS_DDL = """
CREATE TABLE orders (key text PRIMARY KEY, state text NOT NULL);
CREATE TABLE order_log (id bigserial PRIMARY KEY, key text, type text, attempt int);
"""


@pytest.fixture
def db(database):
    with database.connect(autocommit=True) as c:
        c.execute(ORDERS_DDL)
    return database


class Events:
    """Collects worker events; lets a test wait for one without sleeping."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []
        self.cond = threading.Condition()

    def __call__(self, event: str, data: dict) -> None:
        with self.cond:
            self.seen.append((event, data))
            self.cond.notify_all()

    def count(self, event: str) -> int:
        with self.cond:
            return sum(1 for e, _ in self.seen if e == event)

    def wait_for(self, event: str, at_least: int, timeout: float = 30) -> None:
        with self.cond:
            ok = self.cond.wait_for(lambda: sum(1 for e, _ in self.seen if e == event) >= at_least, timeout)
        assert ok, f"event {event} x{at_least} not seen"


def orders_registry(paid_failures: int, retry: RetryPolicy = QUICK) -> Registry:
    """The seed's order handler: 'paid' fails transiently `paid_failures` times; 'shipped' needs 'paid'."""
    reg = Registry()

    @reg.handler("orders", retry=retry)
    def handle(m, ctx):
        if m.type == "paid" and m.attempt <= paid_failures:
            raise Transient("payment system temporarily unavailable")
        state = ctx.conn.execute("SELECT state FROM orders WHERE key = %s", (m.key,)).fetchone()
        if m.type == "shipped" and (state is None or state[0] != "paid"):
            raise Permanent("order is not in state paid")
        ctx.conn.execute(
            "INSERT INTO orders (key, state) VALUES (%s, %s) ON CONFLICT (key) DO UPDATE SET state = excluded.state",
            (m.key, m.type),
        )
        ctx.conn.execute(
            "INSERT INTO order_log (key, type, attempt) VALUES (%s, %s, %s)", (m.key, m.type, m.attempt)
        )

    return reg


SEED_MESSAGES = [
    {"message_id": "order-1-1", "key": "order-1", "sequence": 1, "type": "created"},
    {"message_id": "order-1-2", "key": "order-1", "sequence": 2, "type": "paid"},
    {"message_id": "order-1-3", "key": "order-1", "sequence": 3, "type": "shipped"},
    {"message_id": "order-2-1", "key": "order-2", "sequence": 1, "type": "created"},
]


def receive_seed(url: str) -> None:
    with psycopg.connect(url) as c:
        postbox.receive_many(
            c,
            [
                {
                    "consumer": "orders",
                    "payload": {"order": m["key"]},
                    "headers": {"traceparent": "00-abc-def-01"},
                    "correlation_id": f"corr-{m['key']}",
                    "source": "orders-topic",
                    "schema_version": 2,
                    **m,
                }
                for m in SEED_MESSAGES
            ],
        )
        c.commit()


def run(url, registry, consumer="orders", events=None, **kw):
    w = Worker(url, registry, WorkerSettings(consumer=consumer, **{**FAST_WORKER, **kw}), on_event=events)
    w.start()
    return w


def test_seed_example_paid_fails_twice_then_succeeds(db):
    """The seed's JavaScript example: paid fails transiently twice then succeeds; shipped runs after
    paid; order-2 is independent. Final state order-1=shipped, order-2=created, no dead letter."""
    receive_seed(db.url)
    w = run(db.url, orders_registry(paid_failures=2))
    try:
        eventually(lambda: scalar(db.url, "SELECT count(*) = 0 FROM postbox.inbox"))
    finally:
        w.stop()
        w.join()
    assert (
        scalar(db.url, "SELECT string_agg(key || '=' || state, ',' ORDER BY key) FROM orders")
        == "order-1=shipped,order-2=created"
    )
    assert (
        scalar(
            db.url,
            "SELECT string_agg(type || ':' || attempt, ',' ORDER BY id) FROM order_log WHERE key = 'order-1'",
        )
        == "created:1,paid:3,shipped:1"
    )
    assert scalar(db.url, "SELECT count(*) FROM postbox.dead_letters") == 0
    explained = scalar(
        db.url,
        "SELECT string_agg(explanation, ' | ' ORDER BY attempt) FROM postbox.attempts WHERE message_id = 'order-1-2'",
    )
    assert explained.startswith("transient, attempt 1 of 4, next in") and "attempt 2 of 4" in explained


def test_seed_example_when_paid_exhausts_its_attempts(db):
    """paid never succeeds: after 4 attempts it is dead-lettered with every DLQ-2 field; order-1 is
    blocked with shipped held behind it; order-2 is done."""
    receive_seed(db.url)
    w = run(db.url, orders_registry(paid_failures=99))
    try:
        eventually(lambda: scalar(db.url, "SELECT count(*) FROM postbox.blocked_keys") == 1)
        eventually(lambda: scalar(db.url, "SELECT state FROM orders WHERE key = 'order-2'") == "created")
    finally:
        w.stop()
        w.join()
    with psycopg.connect(db.url) as c:
        c.row_factory = psycopg.rows.dict_row
        dl = c.execute("SELECT * FROM postbox.dead_letters").fetchone()
        blocked = c.execute("SELECT * FROM postbox.blocked_keys").fetchone()
        held = c.execute(
            "SELECT message_id, state FROM postbox.inbox WHERE key = 'order-1' ORDER BY position"
        ).fetchall()
    assert dl["message_id"] == "order-1-2" and dl["key"] == "order-1" and dl["sequence"] == 2
    assert (
        dl["type"] == "paid"
        and dl["payload"] == {"order": "order-1"}
        and dl["headers"] == {"traceparent": "00-abc-def-01"}
    )
    assert dl["attempt"] == 4 and dl["reason"] == "attempts_exhausted" and dl["status"] == "open"
    assert dl["first_failed_at"] < dl["last_failed_at"] <= dl["dead_lettered_at"]
    assert (
        "payment system temporarily unavailable" in dl["last_error"] and dl["last_error_type"] == "Transient"
    )
    assert "Transient: payment system" in dl["last_traceback"]
    assert dl["consumer"] == "orders" and dl["source"] == "orders-topic" and dl["schema_version"] == 2
    assert dl["correlation_id"] == "corr-order-1" and dl["fingerprint"].startswith("Transient:")
    assert dl["ordering_policy"] == "block" and dl["received_at"] is not None
    assert (
        blocked["key"] == "order-1"
        and blocked["dead_letter_id"] == dl["id"]
        and blocked["held_messages"] == 1
    )
    assert held == [
        {"message_id": "order-1-2", "state": "blocked"},
        {"message_id": "order-1-3", "state": "pending"},
    ]
    assert (
        scalar(db.url, "SELECT string_agg(key || '=' || state, ',' ORDER BY key) FROM orders")
        == "order-1=created,order-2=created"
    )
    assert scalar(db.url, "SELECT count(*) FROM postbox.attempts WHERE message_id = 'order-1-2'") == 4
    summary = scalar(
        db.url, "SELECT row(queue, open, oldest_age IS NOT NULL)::text FROM postbox.dead_letter_summary"
    )
    assert summary == "(orders,1,t)"
    group = scalar(db.url, "SELECT row(type, reason, open, keys)::text FROM postbox.dead_letter_groups")
    assert group == "(paid,attempts_exhausted,1,1)"


def stock_registry(on_dead_letter: str, fail: set[str], kind=Permanent) -> Registry:
    reg = Registry()

    @reg.handler("stock", retry=QUICK, on_dead_letter=on_dead_letter)
    def handle(m, ctx):
        if m.message_id in fail:
            raise kind("no price for this item")
        ctx.conn.execute(
            "INSERT INTO order_log (key, type, attempt) VALUES (%s, %s, %s)", (m.key, m.message_id, m.attempt)
        )

    return reg


def receive_stock(url, *mids_keys):
    with psycopg.connect(url) as c:
        postbox.receive_many(
            c, [{"consumer": "stock", "message_id": mid, "key": key, "payload": {}} for mid, key in mids_keys]
        )
        c.commit()


def log(url):
    return scalar(url, "SELECT string_agg(type, ',' ORDER BY id) FROM order_log")


def test_pattern_1_stop_on_error_halts_the_consumer(db):
    """Kafka pattern 1 (halt): a dead letter stops the whole consumer; nothing else is claimed until
    an operator resumes it, then processing continues."""
    events = Events()
    receive_stock(db.url, ("a1", "A"))
    w = run(db.url, stock_registry("halt", {"a1"}), consumer="stock", events=events)
    try:
        eventually(
            lambda: scalar(db.url, "SELECT halted_at IS NOT NULL FROM postbox.consumers WHERE name = 'stock'")
        )
        receive_stock(db.url, ("b1", "B"), ("a2", "A"))
        idle = events.count("idle")
        events.wait_for("idle", idle + 4)  # several claim rounds while halted
        assert log(db.url) is None
        assert scalar(db.url, "SELECT halted_reason FROM postbox.consumers").startswith("dead letter")
        assert scalar(db.url, "SELECT postbox.consumer_resume_v1('stock')") is True
        eventually(lambda: log(db.url) == "b1")
        assert (
            scalar(db.url, "SELECT state FROM postbox.inbox WHERE message_id = 'a2'") == "pending"
        )  # A still blocked
    finally:
        w.stop()
        w.join()


def test_pattern_2_dead_letter_without_retries(db):
    """Kafka pattern 2: a permanent error goes to the dead-letter table at once (one attempt)."""
    receive_stock(db.url, ("bad", "A"), ("good", "B"))
    w = run(db.url, stock_registry("block", {"bad"}), consumer="stock")
    try:
        eventually(lambda: scalar(db.url, "SELECT count(*) FROM postbox.dead_letters") == 1)
        eventually(lambda: log(db.url) == "good")
    finally:
        w.stop()
        w.join()
    assert scalar(db.url, "SELECT row(reason, attempt)::text FROM postbox.dead_letters") == "(permanent,1)"
    assert scalar(db.url, "SELECT count(*) FROM postbox.attempts") == 1


def test_pattern_3_retry_where_order_does_not_matter_skips(db):
    """Kafka pattern 3 (skip): a message that exhausts its retries is dead-lettered (recorded) and
    its key goes on with the next message; other keys never wait."""
    receive_stock(db.url, ("a1", "A"), ("a2", "A"), ("b1", "B"))
    w = run(db.url, stock_registry("skip", {"a1"}, kind=Transient), consumer="stock")
    try:
        eventually(lambda: scalar(db.url, "SELECT count(*) = 0 FROM postbox.inbox"))
    finally:
        w.stop()
        w.join()
    assert sorted(log(db.url).split(",")) == ["a2", "b1"]
    assert (
        scalar(
            db.url, "SELECT row(message_id, reason, attempt, ordering_policy)::text FROM postbox.dead_letters"
        )
        == "(a1,attempts_exhausted,4,skip)"
    )


def test_pattern_4_retry_keeps_later_events_of_the_key_behind_it(db):
    """Kafka pattern 4: while the head of a key retries, its later events are held in order (in the
    table, not in memory) and follow it once it succeeds; other keys are not held."""
    reg = Registry()
    fail_until = {"inc": 3}

    @reg.handler("stock", retry=RetryPolicy(strategy=Backoff.FIXED, base_delay=0.05, max_attempts=10))
    def handle(m, ctx):
        if m.attempt < fail_until.get(m.message_id, 0):
            raise Transient("no price yet")
        ctx.conn.execute(
            "INSERT INTO order_log (key, type, attempt) VALUES (%s, %s, %s)", (m.key, m.message_id, m.attempt)
        )

    receive_stock(db.url, ("inc", "item-1"), ("dec", "item-1"), ("other", "item-2"))
    w = run(db.url, reg, consumer="stock")
    try:
        eventually(lambda: scalar(db.url, "SELECT count(*) = 0 FROM postbox.inbox"))
    finally:
        w.stop()
        w.join()
    assert (
        scalar(
            db.url,
            "SELECT string_agg(type || ':' || attempt, ',' ORDER BY id) FROM order_log WHERE key = 'item-1'",
        )
        == "inc:3,dec:1"
    )
    first_other = scalar(db.url, "SELECT min(id) FROM order_log WHERE key = 'item-2'")
    assert first_other < scalar(db.url, "SELECT min(id) FROM order_log WHERE key = 'item-1'")


@pytest.mark.parametrize("idempotent", [False, True])
def test_unknown_outcome_is_retried_only_for_idempotent_handlers(db, idempotent):
    """An unknown outcome dead-letters (reason unknown_outcome) unless the handler is idempotent."""
    reg = Registry()

    @reg.handler("stock", retry=QUICK, idempotent=idempotent)
    def handle(m, ctx):
        if m.attempt == 1:
            raise UnknownOutcome("response lost after the request was sent")
        ctx.conn.execute(
            "INSERT INTO order_log (key, type, attempt) VALUES (%s, %s, %s)",
            (m.key, ctx.idempotency_key, m.attempt),
        )

    receive_stock(db.url, ("m", "k"))
    w = run(db.url, reg, consumer="stock")
    try:
        eventually(lambda: scalar(db.url, "SELECT count(*) = 0 FROM postbox.inbox WHERE state <> 'blocked'"))
    finally:
        w.stop()
        w.join()
    if idempotent:
        assert scalar(db.url, "SELECT count(*) FROM order_log") == 1
        assert scalar(db.url, "SELECT count(*) FROM postbox.dead_letters") == 0
    else:
        assert (
            scalar(db.url, "SELECT row(reason, attempt)::text FROM postbox.dead_letters")
            == "(unknown_outcome,1)"
        )


def test_unsupported_schema_version_is_permanent(db):
    """A message whose schema_version the handler does not accept is dead-lettered at once."""
    reg = Registry()

    @reg.handler("stock", schema_versions={1})
    def handle(m, ctx):
        pass

    with psycopg.connect(db.url) as c:
        postbox.receive(c, consumer="stock", message_id="v2", payload={}, schema_version=2)
        c.commit()
    w = run(db.url, reg, consumer="stock")
    try:
        eventually(lambda: scalar(db.url, "SELECT count(*) FROM postbox.dead_letters") == 1)
    finally:
        w.stop()
        w.join()
    assert "unsupported schema_version 2" in scalar(db.url, "SELECT last_error FROM postbox.dead_letters")


def test_circuit_breaker_stops_burning_attempts_while_a_dependency_is_down(db):
    """With every attempt failing transiently, the breaker opens and the worker only probes; once
    the dependency is back, a probe succeeds, the breaker closes and the backlog drains."""
    down = threading.Event()
    down.set()
    reg = Registry()

    @reg.handler(
        "stock",
        retry=RetryPolicy(strategy=Backoff.FIXED, base_delay=0.01, max_attempts=1000, max_total_seconds=None),
    )
    def handle(m, ctx):
        if down.is_set():
            raise ConnectionError("dependency down")

    receive_stock(db.url, *((f"m{i}", f"k{i}") for i in range(60)))
    events = Events()
    w = run(
        db.url,
        reg,
        consumer="stock",
        events=events,
        concurrency=2,
        batch_size=5,
        breaker=BreakerSettings(window_seconds=60, min_attempts=10, failure_ratio=0.8, probe_interval=0.2),
    )
    try:
        events.wait_for("breaker_open", 1)
        at_open = scalar(db.url, "SELECT count(*) FROM postbox.attempts")
        events.wait_for("breaker_open", 4)  # three probes, each failing, reopened it
        during = scalar(db.url, "SELECT count(*) FROM postbox.attempts") - at_open
        assert during <= 15, f"{during} attempts burnt while open"
        down.clear()
        events.wait_for("breaker_closed", 1)
        eventually(lambda: scalar(db.url, "SELECT count(*) = 0 FROM postbox.inbox"))
    finally:
        w.stop()
        w.join()
    assert scalar(db.url, "SELECT count(*) FROM postbox.dead_letters") == 0


def test_policies_from_a_config_file(tmp_path: Path):
    """Per-consumer and per-type policies load from TOML, merge over each other, and errors name the setting."""
    good = tmp_path / "postbox.toml"
    good.write_text(
        """
[consumers.billing]
on_dead_letter = "skip"
retry = { strategy = "fixed", base_delay = 2, max_attempts = 7 }

[consumers.billing.types."order.paid"]
retry = { max_attempts = 3 }
idempotent = true
"""
    )
    cfg = load_policies(good)
    assert cfg.consumers["billing"].retry_policy().max_attempts == 7
    paid = cfg.consumers["billing"].retry_policy("order.paid")
    assert (paid.max_attempts, paid.base_delay, paid.strategy) == (3, 2, Backoff.FIXED)
    reg = Registry()
    reg.add(lambda m, c: None, "billing")
    applied = apply_policies(reg, cfg)
    spec = applied.lookup("billing", "order.paid")
    assert (
        spec is not None
        and spec.idempotent
        and spec.retry.max_attempts == 3
        and spec.on_dead_letter == "skip"
    )

    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[consumers.billing]\nretry = { base_delay = 10, max_delay = 1 }\non_dead_letter = "explode"\n'
    )
    with pytest.raises(ConfigError, match="on_dead_letter"):
        load_policies(bad)
    bad.write_text("[consumers.billing]\nretry = { base_delay = 10, max_delay = 1 }\n")
    with pytest.raises(ConfigError, match=r"consumers\.billing\.retry: max_delay"):
        load_policies(bad)
    bad.write_text('[consumers.billing.types."x"]\nretry = { max_attempts = 0 }\n')
    with pytest.raises(ConfigError, match=r"consumers\.billing\.types\.x\.retry\.max_attempts"):
        load_policies(bad)


def test_dedup_retention_must_cover_retries_and_replay():
    """Start-up refuses a deduplication window shorter than the retry horizon plus the replay window."""
    cfg = load_policies({"postbox": {"dedup_retention_seconds": 3600, "replay_window_seconds": 3600}})
    with pytest.raises(ConfigError, match="dedup_retention_seconds"):
        check_retention(cfg, Registry(), RetryPolicy())
    ok = load_policies({"postbox": {"dedup_retention_seconds": 86400 * 7}})
    check_retention(ok, Registry(), RetryPolicy())

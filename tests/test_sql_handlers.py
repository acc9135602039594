"""PostgreSQL functions as handlers: same transaction as the done mark, same guarantees."""

from __future__ import annotations

import random
from types import SimpleNamespace

import psycopg
import pytest

import postbox
from postbox.clock import FakeClock
from postbox.config.policies import configured_handlers, load_policies
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from tests.checker import Produced, WorkerPool, check, produce, run_until, terminate_backends
from tests.helpers import EFFECTS_DDL, FAST_WORKER, eventually, scalar

CHECKER_FUNCTION = """
CREATE SCHEMA IF NOT EXISTS chk;
-- The checker's handler in PL/pgSQL: one effect per message with the previous sequence it saw,
-- and about 10% of attempts failing transiently (decided by a hash of id and attempt).
CREATE OR REPLACE FUNCTION chk.handle(message jsonb, context jsonb) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    k    text   := message ->> 'key';
    seq  bigint := (message ->> 'sequence')::bigint;
    att  int    := (context ->> 'attempt')::int;
    prev bigint;
BEGIN
    IF ('x' || substr(md5((message ->> 'message_id') || '/' || att), 1, 7))::bit(28)::int % 10 = 0 THEN
        RAISE EXCEPTION 'injected transient failure' USING ERRCODE = 'PB001';
    END IF;
    SELECT last_seq INTO prev FROM key_state WHERE key = k FOR UPDATE;
    INSERT INTO effects (message_id, key, sequence, prev_seq, attempt) VALUES (message ->> 'message_id', k, seq, prev, att);
    INSERT INTO key_state (key, last_seq) VALUES (k, seq) ON CONFLICT (key) DO UPDATE SET last_seq = excluded.last_seq;
END
$$;
"""

# The same handler as a batch function: each message in the call's order, as the one above would
# handle it; an injected failure fails the whole call (then each message runs alone).
CHECKER_BATCH_FUNCTION = """
CREATE OR REPLACE FUNCTION chk.handle_batch(messages jsonb, contexts jsonb) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    message jsonb;
    context jsonb;
BEGIN
    FOR message, context IN
        SELECT m.value, c.value
          FROM jsonb_array_elements(messages) WITH ORDINALITY AS m(value, n)
          JOIN jsonb_array_elements(contexts) WITH ORDINALITY AS c(value, n) USING (n)
         ORDER BY n
    LOOP
        PERFORM chk.handle(message, context);
    END LOOP;
END
$$;
"""

# A batch function that records its calls (a failed call's row rolls back with it).
BATCH_OUTCOMES_FUNCTION = """
CREATE OR REPLACE FUNCTION public.batch_outcomes(messages jsonb, contexts jsonb) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO calls (size, ids)
    VALUES (jsonb_array_length(messages), ARRAY(SELECT m ->> 'message_id' FROM jsonb_array_elements(messages) m));
    IF EXISTS (SELECT 1 FROM jsonb_array_elements(messages) m WHERE m -> 'payload' ->> 'mode' = 'permanent') THEN
        RAISE EXCEPTION 'amount is missing' USING ERRCODE = 'PB002';
    END IF;
    INSERT INTO effects (message_id, key, attempt)
    SELECT m ->> 'message_id', c ->> 'idempotency_key', (c ->> 'attempt')::int
      FROM jsonb_array_elements(messages) WITH ORDINALITY AS e(m, n)
      JOIN jsonb_array_elements(contexts) WITH ORDINALITY AS f(c, n) USING (n);
END
$$;
"""

OUTCOMES_FUNCTION = """
CREATE OR REPLACE FUNCTION public.outcomes(message jsonb, context jsonb) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    mode text := message -> 'payload' ->> 'mode';
    att int := (context ->> 'attempt')::int;
BEGIN
    INSERT INTO effects (message_id, key, attempt) VALUES (message ->> 'message_id', context ->> 'idempotency_key', att);
    IF mode = 'permanent' THEN
        RAISE EXCEPTION 'amount is missing' USING ERRCODE = 'PB002';
    ELSIF mode = 'retry_after' AND att = 1 THEN
        RAISE EXCEPTION 'ledger locked' USING ERRCODE = 'PB001', DETAIL = 'retry_after=30';
    ELSIF mode = 'unknown' AND att = 1 THEN
        RAISE EXCEPTION 'maybe posted' USING ERRCODE = 'PB003';
    ELSIF mode = 'unique' THEN
        INSERT INTO effects (id, message_id, key, attempt) VALUES (1, 'dup', 'dup', 0), (1, 'dup', 'dup', 0);
    END IF;
END
$$;
"""


@pytest.fixture
def db(database):
    with database.connect(autocommit=True) as c:
        c.execute(EFFECTS_DDL)
        c.execute(CHECKER_FUNCTION)
        c.execute(CHECKER_BATCH_FUNCTION)
        c.execute(OUTCOMES_FUNCTION)
        c.execute("CREATE TABLE calls (id bigserial PRIMARY KEY, size integer NOT NULL, ids text[] NOT NULL)")
        c.execute(BATCH_OUTCOMES_FUNCTION)
    return database


@pytest.mark.parametrize(
    "handler",
    ['function = "chk.handle"', 'function = "chk.handle_batch"\nbatch = true'],
    ids=["per-message", "batch"],
)
def test_sql_function_handlers_pass_the_invariant_checker(db, tmp_path, handler):
    """3 worker processes x 4 slots running a PL/pgSQL handler (per message, or a batch function),
    10% transient failures, workers killed with kill -9 and their connections terminated: nothing
    lost, no duplicate effect, per-key order kept."""
    config = tmp_path / "postbox.toml"
    config.write_text(
        '[consumers.chk]\nretry = { strategy = "fixed", base_delay = 0.01, max_attempts = 1000, max_total_seconds = 3600 }\n'
        f'[consumers.chk.handlers."*"]\nkind = "sql"\n{handler}\n'
    )
    produced = Produced()
    pool = WorkerPool(db.url, "chk", None, 3, 4, config=str(config))
    rng = random.Random(5)
    import threading
    import time

    producers = [
        threading.Thread(target=produce, args=(db.url, "chk", 600, 200, produced, 70 + i)) for i in range(2)
    ]
    for t in producers:
        t.start()
    last = [time.monotonic()]

    def tick() -> None:
        pool.keep_alive()
        if time.monotonic() - last[0] > 0.7:
            last[0] = time.monotonic()
            if rng.random() < 0.5:
                pool.kill_random(rng)
            else:
                terminate_backends(db.url, "postbox-worker%")

    try:
        run_until(
            120,
            lambda: (
                not any(t.is_alive() for t in producers)
                and scalar(db.url, "SELECT count(*) FROM postbox.inbox") == 0
            ),
            tick,
        )
    finally:
        pool.stop()
        for t in producers:
            t.join()
    report = check(db.url, produced, "chk")
    report.assert_ok()
    assert report.done == report.produced == 1200
    assert (
        scalar(db.url, "SELECT count(*) FROM postbox.attempts WHERE error = 'injected transient failure'") > 0
    )


def start(db, clock=None, idempotent=False) -> Worker:
    config = load_policies(
        {
            "consumers": {
                "fn": {
                    "retry": {"strategy": "fixed", "base_delay": 0.05, "max_attempts": 5},
                    "handlers": {
                        "*": {"kind": "sql", "function": "public.outcomes", "idempotent": idempotent}
                    },
                }
            }
        }
    )
    registry = configured_handlers(Registry(), config, "fn")
    w = Worker(
        db.url,
        registry,
        WorkerSettings(consumer="fn", retry=config.consumers["fn"].retry_policy(), **FAST_WORKER),
        clock=clock,
    )
    w.start()
    return w


def send(db, mid: str, mode: str) -> None:
    with psycopg.connect(db.url) as c:
        postbox.receive(c, consumer="fn", message_id=mid, payload={"mode": mode})
        c.commit()


def settled(db) -> bool:
    return bool(scalar(db.url, "SELECT count(*) = 0 FROM postbox.inbox WHERE state <> 'blocked'"))


def test_sqlstate_outcomes(db):
    """PB002 is permanent, PB003 unknown (dead-lettered when not idempotent), a unique violation
    permanent; the failed attempt's writes roll back with it."""
    w = start(db)
    try:
        for mid, mode in (("ok", "none"), ("perm", "permanent"), ("unk", "unknown"), ("uniq", "unique")):
            send(db, mid, mode)
        eventually(lambda: settled(db) and scalar(db.url, "SELECT count(*) FROM postbox.dead_letters") == 3)
    finally:
        w.stop()
        w.join()
    rows = dict(
        psycopg.connect(db.url)
        .execute("SELECT message_id, reason || ':' || last_error_type FROM postbox.dead_letters")
        .fetchall()
    )
    assert rows == {
        "perm": "permanent:Permanent",
        "unk": "unknown_outcome:UnknownOutcome",
        "uniq": "permanent:UniqueViolation",
    }
    assert scalar(db.url, "SELECT string_agg(message_id, ',') FROM effects") == "ok"


def test_retry_after_detail_and_idempotency_key(db):
    """PB001 with DETAIL 'retry_after=30' retries 30 s later; the function gets the same
    idempotency key on every attempt."""
    clock = FakeClock()
    w = start(db, clock=clock)
    try:
        send(db, "r", "retry_after")
        eventually(lambda: scalar(db.url, "SELECT attempt = 1 AND state = 'ready' FROM postbox.inbox"))
        delay = scalar(db.url, "SELECT extract(epoch FROM next_retry_at - last_failed_at) FROM postbox.inbox")
        assert float(delay) == pytest.approx(30, abs=1)
        clock.advance(31)
        eventually(lambda: settled(db))
    finally:
        w.stop()
        w.join()
    assert scalar(db.url, "SELECT count(*) FROM effects WHERE message_id = 'r'") == 1
    assert scalar(db.url, "SELECT key FROM effects WHERE message_id = 'r'").startswith("pbx-")


def test_unknown_outcome_retried_when_idempotent(db):
    w = start(db, idempotent=True)
    try:
        send(db, "u", "unknown")
        eventually(lambda: settled(db))
    finally:
        w.stop()
        w.join()
    assert scalar(db.url, "SELECT count(*) FROM postbox.dead_letters") == 0
    assert scalar(db.url, "SELECT attempt FROM effects WHERE message_id = 'u'") == 2


def test_missing_function_refuses_to_start(db, tmp_path):
    """A configured function that does not exist (with that signature) stops the worker at start."""
    from tests.test_cli import postbox

    config = tmp_path / "p.toml"
    config.write_text('[consumers.fn.handlers."*"]\nkind = "sql"\nfunction = "public.nope"\n')
    r = postbox("--config", str(config), "--database-url", db.url, "worker", "--consumer", "fn")
    assert r.returncode == 2 and "public.nope" in r.stderr and "does not exist" in r.stderr


def test_a_batch_function_handles_a_claim_in_one_call_and_only_a_failing_message_fails(db):
    """batch = true: one call for the messages of a claim, with a context per message (the same
    idempotency key on every attempt); a call that raises PB002 is rolled back and each of its
    messages runs alone, so only the permanent one is dead-lettered."""
    from postbox.inbox.handlers import idempotency_key_for

    config = load_policies(
        {
            "consumers": {
                "fnb": {
                    "handlers": {"*": {"kind": "sql", "function": "public.batch_outcomes", "batch": True}}
                }
            }
        }
    )
    registry = configured_handlers(Registry(), config, "fnb")
    with psycopg.connect(db.url) as c:
        postbox.receive_many(
            c,
            [
                {
                    "consumer": "fnb",
                    "message_id": f"m{i}",
                    "payload": {"mode": "permanent" if i == 4 else "none"},
                }
                for i in range(30)
            ],
        )
        c.commit()
    w = Worker(
        db.url,
        registry,
        WorkerSettings(consumer="fnb", **{**FAST_WORKER, "concurrency": 1, "batch_size": 10}),
    )
    w.start()
    try:
        eventually(lambda: settled(db))
    finally:
        w.stop()
        w.join()
    with psycopg.connect(db.url) as c:
        dead = c.execute(
            "SELECT message_id, reason || ':' || last_error_type FROM postbox.dead_letters"
        ).fetchall()
        effects = c.execute("SELECT message_id, key, attempt FROM effects ORDER BY id").fetchall()
        sizes = [r[0] for r in c.execute("SELECT size FROM calls ORDER BY id")]
    assert dead == [("m4", "permanent:Permanent")]
    assert sorted(m for m, _, _ in effects) == sorted(f"m{i}" for i in range(30) if i != 4)
    # Each message's own idempotency key, the one the per-message function gets.
    assert all(
        key == idempotency_key_for(SimpleNamespace(consumer="fnb", message_id=m, headers={})) and attempt == 1
        for m, key, attempt in effects
    )
    # The first claim's call failed (its row rolled back) and its 9 good messages ran alone; the
    # other two claims were one call each.
    assert sorted(sizes) == [1] * 9 + [10, 10]


def test_a_function_handler_is_database_only_unless_the_file_says_not():
    """A per-message function shares its neighbours' savepoint by default; ``database_only = false``
    (a function that reaches outside the database) gives each message its own."""
    doc = {
        "consumers": {
            "fn": {
                "handlers": {
                    "a": {"kind": "sql", "function": "public.outcomes"},
                    "b": {"kind": "sql", "function": "public.outcomes", "database_only": False},
                    "c": {"kind": "sql", "function": "public.batch_outcomes", "batch": True},
                }
            }
        }
    }
    handlers = configured_handlers(Registry(), load_policies(doc), "fn").handlers
    assert handlers[("fn", "a")].database_only is True
    assert handlers[("fn", "b")].database_only is False
    assert handlers[("fn", "c")].batch and not handlers[("fn", "c")].database_only

"""Every message's handler runs in a savepoint of the batch's transaction, whatever it does first on
the connection (or if it runs no SQL at all): its effects commit exactly once, a failure undoes only
its own, and a handler that ends the transaction with SQL is found, at its next statement or when
it returns, and settled by what happened."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

import postbox
from postbox.failures.outcomes import Retry
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from tests.helpers import EFFECTS_DDL, eventually, record_effect, scalar
from tests.helpers import FAST_WORKER as FAST

# A statement that fails as a serialization failure would (transient: retried).
FAIL = "DO $$ BEGIN RAISE EXCEPTION 'failed on purpose' USING ERRCODE = '40001'; END $$"


@pytest.fixture
def url(database):
    with database.connect(autocommit=True) as c:
        c.execute(EFFECTS_DDL)
    return database.url


def produce(url: str, *messages: tuple[str, dict[str, Any]]) -> None:
    """One transaction, so that the worker claims them as one batch; each on its own key."""
    with psycopg.connect(url) as c:
        postbox.receive_many(
            c, [{"consumer": "c", "message_id": mid, "key": mid, "payload": p} for mid, p in messages]
        )
        c.commit()


def run(url: str, registry: Registry, **settings: Any) -> None:
    """Run a worker until the inbox is settled: one slot, so that one claim takes every message
    produced (two slots claiming at once could split them between their batches)."""
    settings = {**FAST, "concurrency": 1, "batch_size": 10, **settings}
    w = Worker(url, registry, WorkerSettings(consumer="c", **settings))
    w.start()
    try:
        eventually(
            lambda: scalar(url, "SELECT count(*) FROM postbox.inbox WHERE state <> 'blocked'") == 0,
            what="inbox drained",
        )
    finally:
        w.stop()
        w.join()


def effects(url: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    with psycopg.connect(url) as c:
        for mid, attempt in c.execute("SELECT message_id, attempt FROM effects ORDER BY id"):
            out.setdefault(mid, []).append(attempt)
    return out


def dead(url: str) -> dict[str, str]:
    with psycopg.connect(url) as c:
        return dict(c.execute("SELECT message_id, reason FROM postbox.dead_letters").fetchall())


def _effect(conn: psycopg.Connection[Any], m: Any) -> None:
    record_effect(conn, m.message_id, m.key, m.sequence, m.attempt)


def _first_operation(how: str, conn: psycopg.Connection[Any], ctx: Any, m: Any) -> None:
    """The handler's effect, written by its first operation on the connection."""
    row = (m.message_id, m.key, m.sequence, m.attempt)
    insert = "INSERT INTO effects (message_id, key, sequence, attempt) VALUES (%s, %s, %s, %s)"
    if how == "execute":
        conn.execute(insert, row)
    elif how == "cursor_execute":
        with conn.cursor() as cur:
            cur.execute(insert, row)
    elif how == "executemany":
        with conn.cursor() as cur:
            cur.executemany(insert, [row])
    elif how == "transaction":
        with conn.transaction():
            conn.execute(insert, row)
    elif how == "copy":
        with (
            conn.cursor() as cur,
            cur.copy("COPY effects (message_id, key, sequence, attempt) FROM STDIN") as copy,
        ):
            copy.write_row(row)
    elif how == "server_cursor":
        with conn.cursor(name="postbox_test") as cur:
            cur.execute("SELECT 1 FROM (SELECT 1) s")
            cur.fetchall()
        conn.execute(insert, row)
    elif how == "pipeline":
        with conn.pipeline():
            conn.execute(insert, row)
    elif how == "sqlalchemy":
        ctx.session.execute(
            text("INSERT INTO effects (message_id, key, sequence, attempt) VALUES (:m, :k, :s, :a)"),
            {"m": m.message_id, "k": m.key, "s": m.sequence, "a": m.attempt},
        )
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_handler_that_fails_before_any_statement_leaves_the_earlier_effects_in_place(url, kind):
    """A handler that fails before any statement of its own: undoing it must not undo the earlier
    messages' effects. Each effect once, the failed one retried, every handler run once per attempt."""
    calls: Counter[str] = Counter()
    reg = Registry()

    if kind == "sync":

        @reg.handler("c")
        def handle(m, ctx):
            calls[m.message_id] += 1
            if m.payload.get("sql"):
                _effect(ctx.conn, m)
            if m.payload.get("fail") and m.attempt == 1:
                raise Retry(0, "no statement ran")

    else:

        @reg.handler("c")
        async def handle(m, ctx):
            calls[m.message_id] += 1
            if m.payload.get("sql"):
                await ctx.conn.execute(
                    "INSERT INTO effects (message_id, key, sequence, attempt) VALUES (%s, %s, %s, %s)",
                    (m.message_id, m.key, m.sequence, m.attempt),
                )
            if m.payload.get("fail") and m.attempt == 1:
                await asyncio.sleep(0)
                raise Retry(0, "no statement ran")

    produce(
        url,
        ("a", {"sql": True}),
        ("n1", {"fail": True}),
        ("b", {"sql": True}),
        ("n2", {}),
        ("c", {"sql": True}),
        ("n3", {"fail": True}),
    )
    run(url, reg)
    assert effects(url) == {"a": [1], "b": [1], "c": [1]}
    assert calls == {"a": 1, "n1": 2, "b": 1, "n2": 1, "c": 1, "n3": 2}


def test_a_failing_statement_undoes_only_its_own_handler(url):
    """The first statement fails (its savepoint went with it) or a later one does: only that
    handler's effects are undone, the earlier and later messages' stay, once each."""
    reg = Registry()

    @reg.handler("c")
    def handle(m, ctx):
        first = m.payload.get("first")
        if first and m.attempt == 1:
            ctx.conn.execute(FAIL)
        _effect(ctx.conn, m)
        if m.payload.get("later") and m.attempt == 1:
            ctx.conn.execute(FAIL)

    produce(url, ("a", {}), ("f", {"first": True}), ("b", {}), ("l", {"later": True}), ("c", {}))
    run(url, reg)
    assert effects(url) == {"a": [1], "f": [2], "b": [1], "l": [2], "c": [1]}


@pytest.mark.parametrize("database_only", [False, True], ids=["own_savepoints", "shared_savepoint"])
@pytest.mark.parametrize(
    "how",
    [
        "execute",
        "cursor_execute",
        "executemany",
        "transaction",
        "copy",
        "server_cursor",
        pytest.param(
            "pipeline",
            marks=pytest.mark.skipif(
                not psycopg.capabilities.has_pipeline(), reason="this libpq (before 14) has no pipeline mode"
            ),
        ),
        "sqlalchemy",
    ],
)
def test_any_first_operation_runs_in_the_messages_savepoint(url, how, database_only):
    """Whatever a handler does first on the connection (a plain execute, executemany, a nested
    transaction, COPY, a server-side cursor, a pipeline, an SQLAlchemy session): a failure after it
    undoes exactly that handler's effects."""
    reg = Registry()

    @reg.handler("c", database_only=database_only)
    def handle(m, ctx):
        _first_operation(how, ctx.conn, ctx, m)
        if m.payload.get("fail") and m.attempt == 1:
            raise Retry(0, "after the effect")

    produce(url, ("a", {}), ("bad", {"fail": True}), ("b", {}), ("bad2", {"fail": True}))
    run(url, reg)
    assert effects(url) == {"a": [1], "bad": [2], "b": [1], "bad2": [2]}


@pytest.mark.parametrize("database_only", [False, True], ids=["own_savepoints", "shared_savepoint"])
@pytest.mark.parametrize("then", ["sql", "no_sql", "end"])
def test_a_commit_with_sql_is_found_by_the_next_statement_or_at_the_end_of_the_batch(
    url, then, database_only
):
    """A handler that runs COMMIT then a statement (which begins another transaction), followed by a
    handler with SQL, one without, or nothing: the culprit is dead-lettered, what it committed is
    never run again, and every message after it runs once. The same when the handlers are declared
    database-only (no savepoint command between them to find the transaction gone)."""
    calls: Counter[str] = Counter()
    reg = Registry()

    @reg.handler("c", database_only=database_only)
    def handle(m, ctx):
        calls[m.message_id] += 1
        if m.payload.get("sql", True):
            _effect(ctx.conn, m)
        if m.payload.get("commit"):
            ctx.conn.execute("COMMIT")
            ctx.conn.execute("SELECT 1")

    after = {"sql": [("c", {})], "no_sql": [("n", {"sql": False}), ("c", {})], "end": [("n", {"sql": False})]}
    produce(url, ("a", {}), ("bad", {"commit": True}), *after[then])
    run(url, reg)
    assert dead(url) == {"bad": "handler_ended_transaction"}
    got = effects(url)
    assert {k: v for k, v in got.items() if k != "c"} == {"a": [1], "bad": [1]}
    if then != "end":
        assert got["c"] == [1]
    assert calls["a"] == 1 and calls["bad"] == 1
    assert calls["n"] == (0 if then == "sql" else 1)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_database_only_handlers_share_a_savepoint_and_a_failure_runs_the_ones_before_it_again(url, kind):
    """Handlers declared database-only share one savepoint per batch: a failure undoes the effects
    of the messages before it with its own, and they run again, each in its own savepoint, as does
    every message after it. Each effect still commits exactly once."""
    calls: Counter[str] = Counter()
    reg = Registry()

    if kind == "sync":

        @reg.handler("c", database_only=True)
        def handle(m, ctx):
            calls[m.message_id] += 1
            _effect(ctx.conn, m)
            if m.payload.get("fail") and m.attempt == 1:
                raise Retry(0, "after the effect")

    else:

        @reg.handler("c", database_only=True)
        async def handle(m, ctx):
            calls[m.message_id] += 1
            await ctx.conn.execute(
                "INSERT INTO effects (message_id, key, sequence, attempt) VALUES (%s, %s, %s, %s)",
                (m.message_id, m.key, m.sequence, m.attempt),
            )
            if m.payload.get("fail") and m.attempt == 1:
                raise Retry(0, "after the effect")

    produce(
        url, ("a", {}), ("b", {}), ("bad", {"fail": True}), ("c", {}), ("bad2", {"fail": True}), ("d", {})
    )
    run(url, reg)
    assert effects(url) == {"a": [1], "b": [1], "bad": [2], "c": [1], "bad2": [2], "d": [1]}
    # a and b ran, were undone with bad's failure and ran again; after it, one savepoint each.
    assert calls == {"a": 2, "b": 2, "bad": 2, "c": 1, "bad2": 2, "d": 1}


def test_a_handler_not_declared_database_only_keeps_its_own_savepoint_between_shared_ones(url):
    """Only neighbours share a savepoint: a message whose handler is not declared database-only
    runs in its own, and its failure never runs the database-only messages before it again."""
    calls: Counter[str] = Counter()
    reg = Registry()

    def handle(m, ctx):
        calls[m.message_id] += 1
        _effect(ctx.conn, m)
        if m.payload.get("fail") and m.attempt == 1:
            raise Retry(0, "after the effect")

    reg.add(handle, "c", "db", database_only=True)
    reg.add(handle, "c", "ext")
    with psycopg.connect(url) as c:
        postbox.receive_many(
            c,
            [
                {"consumer": "c", "message_id": mid, "key": mid, "type": t, "payload": p}
                for mid, t, p in [
                    ("a", "db", {}),
                    ("b", "db", {}),
                    ("x", "ext", {"fail": True}),
                    ("c", "db", {}),
                ]
            ],
        )
        c.commit()
    run(url, reg)
    assert effects(url) == {"a": [1], "b": [1], "x": [2], "c": [1]}
    assert calls == {"a": 1, "b": 1, "x": 2, "c": 1}


def test_database_only_is_refused_for_a_batch_handler():
    reg = Registry()
    with pytest.raises(ValueError, match="database_only is for handlers of one message"):
        reg.add(lambda ms, ctx: None, "c", batch=True, database_only=True)

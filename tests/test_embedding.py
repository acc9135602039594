"""Workers and relays embedded in a program: an ASGI app's lifespan (asyncio), a thread with the
context manager; async handlers with their async context (AsyncConnection, AsyncSession)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

import postbox
from postbox.failures.policy import RetryPolicy
from postbox.outbox.transports.postgres import PostgresTransport
from tests.helpers import EFFECTS_DDL, FAST_WORKER, eventually, scalar

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:starlette")

FAST_RELAY = {"poll_interval": 0.05, "heartbeat_interval": 0.3, "stale_after": 1.5, "grace_period": 5.0}


@pytest.fixture
def effects_db(database):
    with database.connect(autocommit=True) as c:
        c.execute(EFFECTS_DDL)
    return database


def orders_registry() -> postbox.Registry:
    """An async handler writing one effect through ctx.conn and one through ctx.session."""
    registry = postbox.Registry()

    @registry.handler("orders")
    async def handle(message: postbox.Message, ctx: postbox.AsyncContext) -> None:
        assert isinstance(ctx.conn, psycopg.AsyncConnection)
        await ctx.conn.execute(
            "INSERT INTO effects (message_id, key, attempt) VALUES (%s, %s, %s)",
            (message.message_id, message.key, message.attempt),
        )
        await ctx.session.execute(
            text("INSERT INTO effects (message_id, key, attempt) VALUES (:m, 'session', :a)"),
            {"m": message.message_id, "a": message.attempt},
        )
        await asyncio.sleep(0)  # a real await between the two writes and the done mark

    return registry


def effects(url: str, key: str) -> dict[str, list[int]]:
    with psycopg.connect(url) as c:
        rows = c.execute(
            "SELECT message_id, attempt FROM effects WHERE key = %s ORDER BY id", (key,)
        ).fetchall()
    found: dict[str, list[int]] = {}
    for message_id, attempt in rows:
        found.setdefault(message_id, []).append(attempt)
    return found


def live_workers(url: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM postbox.live_workers"))  # type: ignore[arg-type]


def postbox_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("postbox-")]


def make_app(url: str, worker: postbox.Worker) -> Starlette:
    """An app that receives orders into the inbox and runs the worker for its lifespan."""

    async def receive_order(request: Request) -> JSONResponse:
        body = await request.json()
        async with await psycopg.AsyncConnection.connect(url) as conn:
            result = await postbox.receive_async(
                conn, consumer="orders", message_id=body["id"], key=body["id"], payload=body
            )
        return JSONResponse({"status": result.status.value})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with worker.running():
            yield

    return Starlette(routes=[Route("/orders", receive_order, methods=["POST"])], lifespan=lifespan)


def test_a_worker_in_an_asgi_lifespan_commits_each_async_effect_once_and_stops_on_shutdown(effects_db):
    """A Starlette app runs a worker in its lifespan: orders received through the app are handled by
    an async handler (ctx.conn and ctx.session in the message's transaction), each effect committed
    exactly once (a duplicate request changes nothing); the worker stops when the app shuts down."""
    url = effects_db.url
    worker = postbox.Worker(url, orders_registry(), consumer="orders", concurrency=2, **FAST_WORKER)
    ids = [f"order-{i}" for i in range(20)]
    with TestClient(make_app(url, worker)) as client:
        assert worker.wait_ready(10)
        for order in ids:
            assert client.post("/orders", json={"id": order}).json() == {"status": "new"}
        assert client.post("/orders", json={"id": ids[0]}).json() == {"status": "duplicate"}
        eventually(lambda: len(effects(url, "session")) == len(ids), what="every order handled")
        assert live_workers(url) == 1
    assert worker.stopping
    assert not worker.ready()
    assert live_workers(url) == 0
    assert not [name for name in postbox_threads() if name.startswith("postbox-slot")]
    expected = {order: [1] for order in ids}
    assert effects(url, "session") == expected
    assert {m: a for k in ids for m, a in effects(url, k).items()} == expected
    assert scalar(url, "SELECT count(*) FROM postbox.inbox") == 0


def test_an_async_handlers_effects_roll_back_with_its_failed_attempt(effects_db):
    """An async handler writes through ctx.conn and ctx.session, then fails: neither write survives
    its attempt. The retry's writes commit with the done mark."""
    url = effects_db.url
    registry = postbox.Registry()

    @registry.handler("orders", retry=RetryPolicy(base_delay=0.01, max_attempts=3))
    async def handle(message: postbox.Message, ctx: postbox.AsyncContext) -> None:
        await ctx.conn.execute(
            "INSERT INTO effects (message_id, key, attempt) VALUES (%s, 'conn', %s)",
            (message.message_id, message.attempt),
        )
        await ctx.session.execute(
            text("INSERT INTO effects (message_id, key, attempt) VALUES (:m, 'session', :a)"),
            {"m": message.message_id, "a": message.attempt},
        )
        await ctx.publish("next", {"from": message.message_id})
        if message.attempt == 1:
            raise postbox.Retry(0, "first attempt fails after its writes")

    with psycopg.connect(url) as c:
        postbox.receive(c, consumer="orders", message_id="m1", key="k", payload={})
    with postbox.Worker(url, registry, consumer="orders", **FAST_WORKER):
        eventually(lambda: effects(url, "conn") == {"m1": [2]}, what="the retry handled")
        eventually(lambda: scalar(url, "SELECT count(*) FROM postbox.inbox") == 0, what="done")
    assert effects(url, "conn") == {"m1": [2]}
    assert effects(url, "session") == {"m1": [2]}
    assert scalar(url, "SELECT count(*) FROM postbox.outbox") == 1
    assert scalar(url, "SELECT count(*) FROM postbox.attempts WHERE message_id = 'm1'") == 1


def test_an_async_handler_cannot_commit_the_workers_transaction(effects_db):
    """ctx.conn.commit() in an async handler is refused like a sync handler's: the message is
    dead-lettered, its write rolled back, and the other message of the batch is handled."""
    url = effects_db.url
    registry = postbox.Registry()

    @registry.handler("orders")
    async def handle(message: postbox.Message, ctx: postbox.AsyncContext) -> None:
        await ctx.conn.execute(
            "INSERT INTO effects (message_id, key, attempt) VALUES (%s, 'conn', %s)",
            (message.message_id, message.attempt),
        )
        if message.message_id == "bad":
            await ctx.conn.commit()

    with psycopg.connect(url) as c:
        postbox.receive(c, consumer="orders", message_id="bad", key="a", payload={})
        postbox.receive(c, consumer="orders", message_id="good", key="b", payload={})
    with postbox.Worker(url, registry, consumer="orders", **FAST_WORKER):
        eventually(
            lambda: scalar(url, "SELECT count(*) FROM postbox.dead_letters") == 1, what="dead-lettered"
        )
        eventually(lambda: effects(url, "conn") == {"good": [1]}, what="the other message handled")
    assert effects(url, "conn") == {"good": [1]}
    assert scalar(url, "SELECT reason FROM postbox.dead_letters") == "handler_ended_transaction"


@pytest.mark.parametrize("batch", [False, True], ids=["handler", "batch_handler"])
def test_an_object_whose_call_is_async_is_run_as_an_async_handler(effects_db, batch):
    """A handler object whose ``__call__`` is ``async def`` gets the async context, as an ``async
    def`` function does (it was called with the sync one, and its ``await ctx.conn.execute`` failed
    every attempt); its effect commits once."""
    url = effects_db.url

    class Handler:
        async def __call__(self, message: Any, ctx: Any) -> None:
            assert isinstance(ctx, postbox.AsyncBatchContext if batch else postbox.AsyncContext)
            for m in message if batch else [message]:
                await ctx.conn.execute(
                    "INSERT INTO effects (message_id, key, attempt) VALUES (%s, 'object', %s)",
                    (m.message_id, m.attempt),
                )

    registry = postbox.Registry()
    registry.add(Handler(), "orders", batch=batch)
    with psycopg.connect(url) as c:
        postbox.receive(c, consumer="orders", message_id="m1", key="k", payload={})
    with postbox.Worker(url, registry, consumer="orders", **FAST_WORKER):
        eventually(lambda: scalar(url, "SELECT count(*) FROM postbox.inbox") == 0, what="done")
    assert effects(url, "object") == {"m1": [1]}
    assert scalar(url, "SELECT count(*) FROM postbox.dead_letters") == 0


def test_a_worker_in_a_thread_with_the_context_manager_handles_and_stops(effects_db):
    """``with Worker(...)`` starts the worker's threads and stops them (unregistered) at the end."""
    url = effects_db.url
    registry = postbox.Registry()

    @registry.handler("orders")
    def handle(message: postbox.Message, ctx: postbox.Context) -> None:
        ctx.conn.execute(
            "INSERT INTO effects (message_id, key, attempt) VALUES (%s, 'sync', %s)",
            (message.message_id, message.attempt),
        )

    with postbox.Worker(url, registry, consumer="orders", **FAST_WORKER) as worker:
        assert worker.wait_ready(10)
        with psycopg.connect(url) as c:
            postbox.receive(c, consumer="orders", message_id="m1", key="k", payload={})
        eventually(lambda: effects(url, "sync") == {"m1": [1]}, what="handled")
    assert worker.stopping
    assert live_workers(url) == 0
    assert not [name for name in postbox_threads() if name.startswith("postbox-slot")]


def test_a_relay_embedded_in_asyncio_delivers_and_stops(database):
    """``async with relay.running()`` relays outbox rows while the block runs (the event loop stays
    free meanwhile), then stops and unregisters."""
    url = database.url
    relay = postbox.Relay(url, {"next": PostgresTransport(url, "next")}, **FAST_RELAY)

    async def program() -> list[int]:
        ticks: list[int] = []
        async with relay.running():
            assert await asyncio.to_thread(relay.wait_ready, 10)
            async with await psycopg.AsyncConnection.connect(url) as conn:
                for i in range(10):
                    await postbox.publish_async(
                        conn, destination="next", message_id=f"e{i}", key="k", payload={"i": i}
                    )
                await conn.commit()
            while scalar(url, "SELECT count(*) FROM postbox.outbox") != 0:
                ticks.append(1)
                await asyncio.sleep(0.02)
                assert len(ticks) < 1000, "the outbox was not relayed in time"
        return ticks

    asyncio.run(program())
    assert relay.stopping
    assert scalar(url, "SELECT count(*) FROM postbox.inbox WHERE consumer = 'next'") == 10
    assert live_workers(url) == 0


def test_a_worker_or_relay_started_twice_or_restarted_after_stop_refuses_it(database):
    """A second start() ran every thread twice (two sets of slots, heartbeats, listeners); start()
    after stop() ran nothing and said nothing. Both now raise, saying what to do."""
    reg = postbox.Registry()
    reg.add(lambda m, ctx: None, "c")
    w = postbox.Worker(database.url, reg, consumer="c", poll_interval=0.05)
    w.start()
    try:
        with pytest.raises(RuntimeError, match="this Worker is started already"):
            w.start()
    finally:
        w.stop()
        w.join()
    with pytest.raises(RuntimeError, match="this Worker was stopped and cannot start again: make a new one"):
        w.start()
    relay = postbox.Relay(
        database.url, {"d": lambda: PostgresTransport(database.url, "c")}, poll_interval=0.05
    )
    relay.start()
    relay.stop()
    relay.join()
    with pytest.raises(RuntimeError, match="this Relay was stopped and cannot start again"):
        relay.start()


def test_worker_options_are_the_settings_fields(database):
    """Keyword options build the settings; unknown ones, or both settings and options, are refused."""
    registry = postbox.Registry()
    registry.add(lambda m, ctx: None, "orders")
    worker = postbox.Worker(database.url, registry, consumer="orders", concurrency=3, batch_size=5)
    assert (worker.settings.concurrency, worker.settings.batch_size) == (3, 5)
    assert (
        postbox.Worker(database.url, registry, postbox.WorkerSettings(consumer="orders")).settings.concurrency
        == 2
    )
    with pytest.raises(TypeError, match="unknown worker options: concurency"):
        postbox.Worker(database.url, registry, consumer="orders", concurency=3)
    with pytest.raises(TypeError, match="either settings"):
        postbox.Worker(database.url, registry, postbox.WorkerSettings(consumer="orders"), consumer="orders")
    options: dict[str, Any] = {"batch_size": 7}
    relay = postbox.Relay(database.url, {"next": PostgresTransport(database.url, "next")}, **options)
    assert relay.settings.batch_size == 7

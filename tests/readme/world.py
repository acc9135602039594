"""The README's world: a database holding what the snippets name (consumers, messages, dead letters
42 to 46, blocked keys, replay job 7, roles), seeded through the real API and a real worker; and
how a snippet's SQL runs in it."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest

import postbox
from postbox import Permanent, Registry, Worker, WorkerSettings
from postbox.examples import orders as orders_example
from tests.conftest import Database
from tests.helpers import FAST_WORKER, REPO, eventually, scalar

# --- the README's world: the data its snippets refer to ---------------------------------------

# Roles the roles section grants to (per cluster: created inside the block's transaction, rolled back).
WORLD_ROLES = ("orders_app", "postbox_runtime", "alice")

# Dead letters of consumer "billing", dead-lettered in this order so they get these ids, as the
# README's snippets name them: (id, message_id, key, payload). Key order-9 also has a held message.
WORLD_DEAD_LETTERS = (
    (42, "evt-8f2c", "order-42", {"amount": "12.5"}),  # explained, edited
    (43, "evt-43", "order-43", {"amount": "42"}),  # discarded as a duplicate
    (44, "evt-7", "order-7", {"amount": "7"}),  # resolved by key
    (45, "evt-9", "order-9", {"amount": "9"}),  # its key unblocked
    (46, "evt-5", "order-5", {"amount": "5"}),  # covered by replay job 7
)
WORLD_REPLAY_JOB = 7


def world_registry() -> Registry:
    """Consumer billing: ``order.paid`` records the payment and asks for a receipt through the outbox;
    an amount that is not a number is a permanent failure."""
    registry = Registry()

    @registry.handler("billing", "order.paid")
    def paid(message: Any, ctx: Any) -> None:
        amount = message.payload.get("amount")
        if not isinstance(amount, int | float):
            raise Permanent(f"amount is not a number: {amount!r}")
        ctx.conn.execute(
            "INSERT INTO billing.payments (order_id, amount, idempotency_key) VALUES (%s, %s, %s)",
            (message.key, amount, ctx.idempotency_key),
        )
        ctx.publish("emails", {"template": "receipt"}, key=message.key)

    return registry


def seed_world(url: str) -> None:
    """Fill a migrated database with what the README's snippets refer to, through the real API and a
    real worker (so dead letters, attempts and blocked keys are what Postbox itself records)."""
    _tables_and_consumers(url)
    _billing_dead_letters(url)
    _compose_example(url)
    job = scalar(url, "SELECT postbox.dlq_replay('{\"ids\": [46]}', reason => 'amounts are parsed now')")
    assert job == WORLD_REPLAY_JOB


def _tables_and_consumers(url: str) -> None:
    """The snippets' own tables, the consumers, and the id sequences set so that the dead letters and
    the replay job get the ids the snippets name."""
    with psycopg.connect(url, autocommit=True) as c:
        for script in sorted((REPO / "deploy" / "initdb").glob("*.sql")):  # the compose example's tables
            c.execute(script.read_text(encoding="utf-8"))
        c.execute(
            "CREATE SCHEMA billing;"
            " CREATE TABLE billing.payments (order_id text, amount numeric, idempotency_key text);"
            " CREATE TABLE accounts (id bigint PRIMARY KEY, balance numeric NOT NULL);"
            " INSERT INTO accounts VALUES (7, 100)"
        )
        for consumer in ("billing", "orders", "shipping"):
            c.execute("SELECT postbox.declare_consumer_v1(name => %s)", (consumer,))
        c.execute("SELECT setval(pg_get_serial_sequence('postbox.dead_letters', 'id'), %s)", (41,))
        c.execute("SELECT setval(pg_get_serial_sequence('postbox.replay_jobs', 'id'), %s)", (6,))


def _receive(
    url: str, consumer: str, message_id: str, key: str, type_: str, payload: Any, **fields: Any
) -> None:
    with psycopg.connect(url) as c:
        postbox.receive(
            c, consumer=consumer, message_id=message_id, key=key, type=type_, payload=payload, **fields
        )
        c.commit()


def _billing_dead_letters(url: str) -> None:
    """One payment processed, then the dead letters 42 to 46 (one at a time, so they get their ids),
    each blocking its key, and a message held behind order-9's."""
    worker = Worker(url, world_registry(), WorkerSettings(consumer="billing", **FAST_WORKER))
    worker.start()
    try:
        _receive(url, "billing", "evt-1", "order-1", "order.paid", {"amount": 10})
        for dead_letter_id, message_id, key, payload in WORLD_DEAD_LETTERS:
            _receive(url, "billing", message_id, key, "order.paid", payload, correlation_id=f"checkout-{key}")
            eventually(
                lambda d=dead_letter_id: scalar(url, "SELECT max(id) FROM postbox.dead_letters") == d,
                what=f"dead letter {dead_letter_id}",
            )
        eventually(lambda: scalar(url, "SELECT count(*) FROM billing.payments") == 1)
        _receive(
            url, "billing", "evt-9b", "order-9", "order.paid", {"amount": 9}
        )  # held behind order-9's head
    finally:
        worker.stop()
        worker.join()
    assert scalar(url, "SELECT count(*) FROM postbox.blocked_keys") == len(WORLD_DEAD_LETTERS)


def _compose_example(url: str) -> None:
    """The compose example (docs/operations.md): an order paid, its shipment request delivered to the
    shipping inbox (as the bridge does), both processed by the example app."""
    with psycopg.connect(url) as c:
        postbox.receive(
            c,
            consumer="orders",
            message_id="order-0-paid",
            key="order-0",
            type="order.paid",
            payload={"amount": 42},
        )
        postbox.receive(
            c,
            consumer="shipping",
            message_id="order-0-paid:shipment",
            key="order-0",
            type="shipment.requested",
            payload={"order_id": "order-0", "amount": 42},
        )
        c.commit()
    for consumer, table in (("orders", "example_orders"), ("shipping", "example_shipments")):
        worker = Worker(url, orders_example.registry, WorkerSettings(consumer=consumer, **FAST_WORKER))
        worker.start()
        try:
            eventually(lambda t=table: scalar(url, f"SELECT count(*) FROM {t}") == 1, what=table)
        finally:
            worker.stop()
            worker.join()


# --- SQL --------------------------------------------------------------------------------------


def split_sql(text: str) -> list[str]:
    """Statements of a SQL text, split at top-level semicolons (quotes, quoted identifiers, dollar
    quotes and comments respected); statements that are only comments are dropped."""
    statements: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if text.startswith("--", i):
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            i = end
            continue
        if text.startswith("/*", i):
            end = text.index("*/", i + 2) + 2
            i = end
            continue
        if ch in ("'", '"'):
            end = i + 1
            while True:
                end = text.index(ch, end)
                if text.startswith(ch * 2, end):
                    end += 2
                    continue
                break
            current.append(text[i : end + 1])
            i = end + 1
            continue
        dollar = re.match(r"\$([A-Za-z_]\w*)?\$", text[i:])
        if dollar:
            tag = dollar.group(0)
            end = text.index(tag, i + len(tag)) + len(tag)
            current.append(text[i:end])
            i = end
            continue
        if ch == ";":
            statements.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
        i += 1
    statements.append("".join(current).strip())
    return [s for s in statements if s]


# A query of the README that finds nothing means the world lacks what the snippet names (or the
# snippet names what does not exist). These may rightly be empty there, and why:
MAY_BE_EMPTY = {
    r"postbox\.live_workers": "no worker process runs while the snippets do",
}


# The README's own transaction control runs as a savepoint inside the block's transaction, which is
# rolled back in the end (so the roles it needs never outlive it).
TRANSACTION_CONTROL = {
    r"(BEGIN|START TRANSACTION)( TRANSACTION| WORK)?": "SAVEPOINT readme",
    r"(COMMIT|END)( TRANSACTION| WORK)?": "RELEASE SAVEPOINT readme",
    r"ROLLBACK( TRANSACTION| WORK)?": "ROLLBACK TO SAVEPOINT readme",
}
# Statements PostgreSQL refuses inside a transaction block: run on their own connection, in autocommit.
OUTSIDE_TRANSACTION = re.compile(
    r"^(VACUUM|CREATE INDEX CONCURRENTLY|REINDEX\b.*\bCONCURRENTLY|CHECKPOINT)\b", re.I
)


def run_sql(db: Database, text: str, where: str) -> None:
    """Run every statement of ``text`` in one transaction (rolled back, as the README's roles exist
    only there) in the README's world; the first failing statement fails with its text, and so does
    a query that finds nothing (unless it is one of ``MAY_BE_EMPTY``)."""
    with db.connect() as c:
        for role in WORLD_ROLES:
            c.execute(
                f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN"
                f" CREATE ROLE {role} NOLOGIN; END IF; END $$"
            )
        # "app" stands for the reader's own database (ALTER DATABASE app SET ...)
        text = re.sub(r"\bDATABASE app\b", f'DATABASE "{db.name}"', text)
        statements = split_sql(text)
        assert statements, f"{where}: no SQL statement"
        assert not re.search(r"^ALTER SYSTEM\b", text, re.I | re.M), f"{where}: ALTER SYSTEM is not run here"
        for statement in statements:
            for pattern, replacement in TRANSACTION_CONTROL.items():
                if re.fullmatch(pattern, statement, re.I):
                    statement = replacement
            try:
                if OUTSIDE_TRANSACTION.match(statement):
                    with db.connect(autocommit=True) as other:
                        cursor = other.execute(statement.encode())
                        rows = cursor.fetchall() if cursor.description is not None else None
                else:
                    cursor = c.execute(statement.encode())
                    rows = cursor.fetchall() if cursor.description is not None else None
            except psycopg.Error as error:
                pytest.fail(
                    f"{where}: the README's SQL fails:\n{statement}\n-> {type(error).__name__}: {error}"
                )
            if rows == [] and not any(re.search(p, statement) for p in MAY_BE_EMPTY):
                pytest.fail(f"{where}: the README's query finds nothing in the README's world:\n{statement}")
        c.rollback()

"""`postbox demo`: the seeds' order scenario, end to end, with real worker processes.

Producers write order events in their own transactions; `paid` fails transiently twice then
succeeds; a malformed event is dead-lettered at once; `shipped` waits for `paid`; one order's
payment keeps failing until its retries run out, which blocks that order only. The demo narrates
what happens, prints a summary and the SQL a DBA would run to see the same, and stops everything.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import psycopg.sql
from psycopg.conninfo import conninfo_to_dict

from service import migrate as migrations
from service.handlers import Context, Message, Registry
from service.outcomes import Permanent, Transient
from service.producer import receive_many

__all__ = ["registry", "run_demo"]

CONSUMER = "orders"
DEMO_DB = "postbox_demo"

# --- the handlers the worker processes run (`--app service.demo:registry`) --------------------

registry = Registry()

BUSINESS_DDL = """
CREATE TABLE IF NOT EXISTS demo_orders (
    order_id  text PRIMARY KEY,
    state     text NOT NULL,
    amount    numeric,
    updated   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS demo_log (
    id        bigserial PRIMARY KEY,
    order_id  text NOT NULL,
    event     text NOT NULL,
    attempt   integer NOT NULL,
    at        timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


@registry.handler(CONSUMER)
def handle_order_event(message: Message, ctx: Context) -> None:
    """Apply one order event; the business write and the done mark commit together."""
    order = message.key
    payload = message.payload if isinstance(message.payload, dict) else {}
    row = ctx.conn.execute("SELECT state FROM demo_orders WHERE order_id = %s", (order,)).fetchone()
    state = row[0] if row else None
    if message.type == "created":
        ctx.conn.execute(
            "INSERT INTO demo_orders (order_id, state) VALUES (%s, 'created') ON CONFLICT DO NOTHING",
            (order,),
        )
    elif message.type == "paid":
        if "amount" not in payload:
            raise Permanent("malformed paid event: required field 'amount' is missing")
        fail_times = int(payload.get("gateway_fails", 0))
        if message.attempt <= fail_times:
            raise Transient(f"payment gateway unavailable (attempt {message.attempt})")
        ctx.conn.execute(
            "UPDATE demo_orders SET state = 'paid', amount = %s, updated = clock_timestamp() WHERE order_id = %s",
            (payload["amount"], order),
        )
    elif message.type == "shipped":
        if state != "paid":
            raise Permanent(f"cannot ship order {order} in state {state}")
        ctx.conn.execute(
            "UPDATE demo_orders SET state = 'shipped', updated = clock_timestamp() WHERE order_id = %s",
            (order,),
        )
    else:
        raise Permanent(f"unknown event type {message.type!r}")
    ctx.conn.execute(
        "INSERT INTO demo_log (order_id, event, attempt) VALUES (%s, %s, %s)",
        (order, message.type, message.attempt),
    )


# --- the scenario ----------------------------------------------------------------------------

POLICY_TOML = """
[postbox]
dedup_retention_seconds = 604800

[consumers.orders]
sequence_mode = "gapless"
on_dead_letter = "block"
retry = { strategy = "exponential_full_jitter", base_delay = 0.2, max_delay = 1.0, max_attempts = 4 }
"""


def _events() -> list[dict[str, Any]]:
    def ev(order: str, seq: int, type_: str, **payload: Any) -> dict[str, Any]:
        return {
            "consumer": CONSUMER,
            "message_id": f"{order}/{seq}",
            "key": order,
            "sequence": seq,
            "type": type_,
            "payload": {"order": order, **payload},
            "correlation_id": f"checkout-{order}",
            "source": "shop.orders",
        }

    return [
        ev("order-1", 1, "created"),
        ev("order-1", 2, "paid", amount=42, gateway_fails=2),  # fails twice, then succeeds
        ev("order-1", 3, "shipped"),  # must wait for paid
        ev("order-2", 1, "created"),
        ev("order-2", 2, "paid", amount=7),
        ev("order-3", 1, "created"),
        ev("order-3", 2, "paid", note="no amount field"),  # malformed: dead-lettered at once
        ev("order-4", 1, "created"),
        ev("order-4", 2, "paid", amount=99, gateway_fails=99),  # never succeeds: retries run out
        ev("order-4", 3, "shipped"),  # held behind the blocked payment
    ]


def _say(text: str) -> None:
    print(text, flush=True)


def _database(base_url: str | None, data_dir: Path, name: str) -> tuple[str, Callable[[], None]]:
    """A fresh demo database on the given server, or on an embedded one when none is given."""
    if base_url:
        admin_url = base_url
        cleanup: Callable[[], None] = lambda: None  # noqa: E731
    else:
        from service.embedded import embedded_server

        _say(f"· no POSTBOX_DATABASE_URL: starting an embedded PostgreSQL in {data_dir}")
        server = embedded_server(data_dir)
        admin_url = str(server.get_uri())
        cleanup = lambda: None  # noqa: E731 - pgserver stops it when this process exits
    params = {k: v for k, v in conninfo_to_dict(admin_url).items() if v is not None}
    with psycopg.connect(admin_url, autocommit=True) as conn:
        ident = psycopg.sql.Identifier(name)
        conn.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
        conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(ident))
    params["dbname"] = name
    return _as_url(params), cleanup


def _as_url(params: dict[str, Any]) -> str:
    from urllib.parse import quote

    user = quote(str(params.get("user", "postgres")), safe="")
    pw = params.get("password")
    auth = f"{user}:{quote(str(pw), safe='')}@" if pw else f"{user}@"
    host = str(params.get("host", "127.0.0.1"))
    port = params.get("port", 5432)
    if host.startswith("/"):
        return f"postgresql://{auth}/{params['dbname']}?host={quote(host, safe='')}&port={port}"
    return f"postgresql://{auth}{host}:{port}/{params['dbname']}"


def _spawn_worker(url: str, config: Path, index: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(  # noqa: S603 - our own interpreter and module
        [sys.executable, "-m", "service", "--config", str(config), "--database-url", url, "worker",
         "--consumer", CONSUMER, "--app", "service.demo:registry", "--concurrency", "2",
         "--poll-interval", "0.1", "--heartbeat-interval", "1", "--stale-after", "5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ},
    )  # fmt: skip


def _narrate(conn: psycopg.Connection[Any], seen: dict[str, set[Any]]) -> None:
    for order, event, attempt in conn.execute(
        "SELECT order_id, event, attempt FROM demo_log ORDER BY id"
    ).fetchall():
        if (order, event) not in seen["done"]:
            seen["done"].add((order, event))
            note = f" (after {attempt - 1} failed attempts)" if attempt > 1 else ""
            _say(f"  ✓ {order}: {event} processed{note}")
    for mid, attempt, explanation, error in conn.execute(
        "SELECT message_id, attempt, explanation, error FROM postbox.attempts ORDER BY id"
    ).fetchall():
        if (mid, attempt) not in seen["failed"]:
            seen["failed"].add((mid, attempt))
            _say(f"  ✗ {mid} attempt {attempt}: {error} → {explanation}")
    for mid, reason, policy in conn.execute(
        "SELECT message_id, reason, ordering_policy FROM postbox.dead_letters ORDER BY id"
    ).fetchall():
        if mid not in seen["dead"]:
            seen["dead"].add(mid)
            _say(
                f"  ☠ {mid} dead-lettered ({reason}); its key is now {'blocked' if policy == 'block' else policy}"
            )


def _settled(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute(
        "SELECT count(*) FILTER (WHERE state IN ('ready', 'running')), count(*) FROM postbox.inbox"
    ).fetchone()
    return row is not None and row[0] == 0


SUMMARY_SQL = {
    "Orders (business table)": "SELECT order_id, state, amount FROM demo_orders ORDER BY order_id",
    "Dead letters by cause": "SELECT queue, type, reason, open, latest_error FROM postbox.dead_letter_groups ORDER BY type",
    "Blocked keys": "SELECT consumer, key, blocking_message_id, reason, held_messages FROM postbox.blocked_keys ORDER BY key",
    "Dead-letter count and oldest age": "SELECT queue, open, date_trunc('second', oldest_age) AS oldest_age FROM postbox.dead_letter_summary",
    "Failed attempts per message": "SELECT message_id, count(*) AS failed_attempts, max(explanation) AS last_decision FROM postbox.attempts GROUP BY message_id ORDER BY message_id",
}


def _table(conn: psycopg.Connection[Any], sql: str) -> str:
    cur = conn.execute(sql)
    names = [d.name for d in cur.description or []]
    rows = [[("" if v is None else str(v)) for v in r] for r in cur.fetchall()]
    widths = [max(len(n), *(len(r[i]) for r in rows)) if rows else len(n) for i, n in enumerate(names)]
    lines = ["  " + " | ".join(n.ljust(w) for n, w in zip(names, widths, strict=True))]
    lines.append("  " + "-+-".join("-" * w for w in widths))
    lines += ["  " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines) if rows else lines[0] + "\n  (none)"


def run_demo(
    base_url: str | None, data_dir: Path, timeout: float = 45.0, database: str = DEMO_DB
) -> dict[str, str]:
    """Run the scenario; returns each order's final state (for the test that checks the outcome)."""
    started = time.monotonic()
    _say("Postbox demo: the order scenario from the retry/DLQ article, on real PostgreSQL and real workers\n")
    url, cleanup = _database(base_url, data_dir, database)
    _say(f"· database {database}: migrating schema postbox")
    migrations.upgrade(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(BUSINESS_DDL)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "postbox.toml"
        config.write_text(POLICY_TOML, encoding="utf-8")
        _say("· starting 2 worker processes (consumer 'orders', gapless per-order sequences, 4 attempts max)")
        workers = [_spawn_worker(url, config, i) for i in range(2)]
        try:
            with psycopg.connect(url) as conn:
                deadline = time.monotonic() + 15
                while conn.execute("SELECT count(*) FROM postbox.workers").fetchone() != (2,):
                    if time.monotonic() > deadline:
                        raise RuntimeError("the demo workers did not start")
                    time.sleep(0.05)
                conn.commit()
                _say(
                    "· producers write 10 order events, each in its own transaction, out of order on purpose\n"
                )
                events = _events()
                for e in [events[2], *events[:2], *events[3:]]:  # shipped arrives before paid
                    receive_many(conn, [e])
                    conn.commit()
                seen: dict[str, set[Any]] = {"done": set(), "failed": set(), "dead": set()}
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    _narrate(conn, seen)
                    conn.commit()
                    if _settled(conn) and len(seen["dead"]) >= 2 and len(seen["done"]) >= 7:
                        break
                    time.sleep(0.1)
                _narrate(conn, seen)
                _say("\nSummary")
                for title, sql in SUMMARY_SQL.items():
                    _say(f"\n{title}:\n{_table(conn, sql)}")
                states: dict[str, str] = dict(
                    conn.execute("SELECT order_id, state FROM demo_orders").fetchall()
                )
        finally:
            for w in workers:
                w.send_signal(signal.SIGTERM)
            for w in workers:
                try:
                    w.wait(30)
                except subprocess.TimeoutExpired:
                    w.kill()
    _say("\nWhat a DBA would run to see the same (psql into the demo database):")
    for sql in SUMMARY_SQL.values():
        _say(f"  {sql};")
    _say(
        f"\nDone in {time.monotonic() - started:.1f} s; workers stopped. Database {DEMO_DB} is kept for you to explore."
    )
    cleanup()
    return {str(k): str(v) for k, v in states.items()}

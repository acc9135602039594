"""`postbox demo`: an order scenario, end to end, with real worker and relay processes.

Producers write order events in their own transactions; `paid` fails transiently twice then
succeeds; a malformed event is dead-lettered at once; `shipped` waits for `paid`; one order's
payment keeps failing until its retries run out, which blocks that order only. Each successful
payment writes a `shipment.requested` event to the outbox in the same transaction; the relay
delivers it to a second consumer's inbox (the PostgreSQL transport) and that consumer's worker
records the shipment. Then comes the fix: the malformed event's payload is corrected, the payment
gateway is back, and a rate-limited replay job sends both dead letters back; the blocked order's
held `shipped` follows. The demo narrates what happens, prints a summary and the SQL a DBA would
run to see the same, and stops everything it started.
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

from postbox.config.settings import mask_url
from postbox.deadletters import ops as deadletter
from postbox.deadletters import replay
from postbox.deadletters.ops import DeadLetterFilter
from postbox.deadletters.replay import ReplayJob, ReplayOptions, ReplayRunner
from postbox.demo.shop import BUSINESS_DDL, CONSUMER, POLICY_TOML, SHIPPING, events
from postbox.inbox.receive import receive_many
from postbox.schema import migrate as migrations

__all__ = ["DemoError", "run_demo"]

DEMO_DB = "postbox_demo"


def _say(text: str) -> None:
    print(text, flush=True)


DEMO_MARK = "created by postbox demo"


def _database(base_url: str | None, data_dir: Path, name: str) -> tuple[str, Callable[[], None]]:
    """A fresh demo database on the given server, or on an embedded one when none is given. A
    database of that name is dropped first only if an earlier demo created it (it carries a mark)."""
    if base_url:
        admin_url = base_url
        cleanup: Callable[[], None] = lambda: None  # noqa: E731
    else:
        from postbox.demo.embedded import embedded_server

        _say(f"· no POSTBOX_DATABASE_URL: starting an embedded PostgreSQL in {data_dir}")
        server = embedded_server(data_dir)
        admin_url = str(server.get_uri())
        cleanup = lambda: None  # noqa: E731 - pgserver stops it when this process exits
    params = {k: v for k, v in conninfo_to_dict(admin_url).items() if v is not None}
    with psycopg.connect(admin_url, autocommit=True) as conn:
        ident = psycopg.sql.Identifier(name)
        row = conn.execute(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s", [name]
        ).fetchone()
        if row is not None:
            if row[0] != DEMO_MARK:
                raise DemoError(
                    f"a database named {name} exists on this server and the demo did not create it: "
                    "give another name with --database, or drop it yourself"
                )
            conn.execute(psycopg.sql.SQL("DROP DATABASE {} WITH (FORCE)").format(ident))
        conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(ident))
        conn.execute(
            psycopg.sql.SQL("COMMENT ON DATABASE {} IS {}").format(ident, psycopg.sql.Literal(DEMO_MARK))
        )
    params["dbname"] = name
    return _as_url(params), cleanup


class DemoError(Exception):
    """The demo cannot run as asked (its message says why and what to do)."""


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


def _spawn(url: str, config: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(  # noqa: S603 - our own interpreter and module
        [sys.executable, "-m", "postbox", "--config", str(config), "--database-url", url, *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ},
    )  # fmt: skip


def _spawn_worker(url: str, config: Path, consumer: str) -> subprocess.Popen[bytes]:
    return _spawn(url, config, "worker", "--consumer", consumer, "--app", "postbox.demo.shop:registry",
                  "--concurrency", "2", "--poll-interval", "0.1", "--heartbeat-interval", "1",
                  "--stale-after", "5")  # fmt: skip


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
    for dl_id, mid, reason, policy in conn.execute(
        "SELECT id, message_id, reason, ordering_policy FROM postbox.dead_letters ORDER BY id"
    ).fetchall():
        if dl_id not in seen["dead"]:
            seen["dead"].add(dl_id)
            _say(
                f"  ☠ {mid} dead-lettered as #{dl_id} ({reason}); its key is now "
                f"{'blocked' if policy == 'block' else policy}"
            )
    for order, amount in conn.execute("SELECT order_id, amount FROM demo_shipments ORDER BY at").fetchall():
        if order not in seen["shipped"]:
            seen["shipped"].add(order)
            _say(
                f"  → shipment.requested for {order} ({amount}) relayed to inbox 'shipping' and recorded there"
            )


def _settled(conn: psycopg.Connection[Any]) -> bool:
    """Nothing left to do: no claimable inbox message, nothing left in the outbox."""
    row = conn.execute(
        "SELECT (SELECT count(*) FROM postbox.inbox WHERE state IN ('ready', 'running')),"
        "       (SELECT count(*) FROM postbox.outbox)"
    ).fetchone()
    return row == (0, 0)


def _wait(
    conn: psycopg.Connection[Any], seen: dict[str, set[Any]], until: Callable[[], bool], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _narrate(conn, seen)
        conn.commit()
        if until():
            break
        time.sleep(0.1)
    _narrate(conn, seen)
    conn.commit()


def _fix_and_replay(url: str, conn: psycopg.Connection[Any], seen: dict[str, set[Any]]) -> ReplayJob:
    """The fix: correct the malformed payload, end the gateway outage; then replay both, paced."""
    _say("\n· the fix: the producer team says order-3 paid 15; the payment gateway is back for order-4")
    malformed = deadletter.latest_for_message(conn, "order-3/2")
    if malformed is not None:
        version = deadletter.edit_payload(
            conn,
            malformed,
            {"order": "order-3", "amount": 15},
            "amount was missing; confirmed 15 by the shop",
            "demo",
        )
        _say(f"  ✎ dead letter #{malformed}: payload version {version} saved (the original is kept)")
    conn.execute("DELETE FROM demo_gateway_outages")
    conn.commit()
    job_id = replay.start(
        conn,
        DeadLetterFilter(queue=CONSUMER, type="paid"),
        "payments fixed",
        "demo",
        ReplayOptions(rate=2, batch_size=1),
    )
    conn.commit()
    _say(f"· replay job {job_id}: the open dead letters of paid, 2 per second, each key in order")
    last = [""]

    def progress(job: ReplayJob) -> None:
        line = f"  ↻ replay {job.id}: sent {job.replayed}/{job.total}, ok {job.succeeded}, failed {job.failed} ({job.state})"
        if line != last[0]:
            _say(line)
            last[0] = line
        _narrate(conn, seen)
        conn.commit()

    return ReplayRunner(url, poll_interval=0.1, runner_id="demo").run_job(job_id, progress)


SUMMARY_SQL = {
    "Orders (business table)": "SELECT order_id, state, amount FROM demo_orders ORDER BY order_id",
    "Shipments (the second service, fed by the relay)": "SELECT order_id, amount FROM demo_shipments ORDER BY order_id",
    "Dead letters and what became of them": "SELECT id, message_id, reason, status, status_reason FROM postbox.dead_letters ORDER BY id",
    "Open dead letters by cause": "SELECT queue, type, reason, open, latest_error FROM postbox.dead_letter_groups ORDER BY type",
    "Blocked keys": "SELECT consumer, key, blocking_message_id, reason, held_messages FROM postbox.blocked_keys ORDER BY key",
    "Failed attempts per message": "SELECT message_id, count(*) AS failed_attempts, max(explanation) AS last_decision FROM postbox.attempts GROUP BY message_id ORDER BY message_id",
    "Replay jobs": "SELECT id, state, total, succeeded, failed, rate, actor, reason FROM postbox.replay_progress",
    "Operator actions (audit trail)": "SELECT action, actor, reason FROM postbox.audit_log ORDER BY id",
    "Figures": "SELECT (SELECT count(*) FROM postbox.inbox_dedup) AS messages_received, (SELECT count(*) FROM demo_log) AS events_processed, (SELECT count(*) FROM postbox.attempts) AS failed_attempts, (SELECT count(*) FROM postbox.dead_letters) AS dead_lettered, (SELECT count(*) FROM postbox.dead_letters WHERE status = 'replayed') AS replayed_ok, (SELECT count(*) FROM demo_shipments) AS shipments_relayed",
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
    _say("Postbox demo: an order scenario end to end, on real PostgreSQL and real processes\n")
    url, cleanup = _database(base_url, data_dir, database)
    _say(f"· database {database} on {_server_of(url)}, created for this demo: migrating schema postbox")
    migrations.upgrade(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(BUSINESS_DDL)
        conn.execute("INSERT INTO demo_gateway_outages VALUES ('order-4')")
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "postbox.toml"
        config.write_text(POLICY_TOML, encoding="utf-8")
        processes = _start_processes(url, config)
        try:
            with psycopg.connect(url) as conn:
                _await_registered(conn, processes)
                states = _play(url, conn, timeout)
        finally:
            _stop_processes(processes)
    _epilogue(url, database, started, embedded=base_url is None)
    cleanup()
    return states


def _start_processes(url: str, config: Path) -> list[subprocess.Popen[bytes]]:
    _say("· starting 2 workers for 'orders' (gapless per-order sequences, 4 attempts max), 1 worker for")
    _say("  'shipping', and a relay that delivers the outbox destination 'shipping' into that inbox")
    processes = [_spawn_worker(url, config, CONSUMER) for _ in range(2)]
    processes.append(_spawn_worker(url, config, SHIPPING))
    processes.append(_spawn(url, config, "relay", "--destination", SHIPPING, "--poll-interval", "0.1"))
    return processes


def _await_registered(conn: psycopg.Connection[Any], processes: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 60  # a loaded machine starts Python slowly
    while conn.execute("SELECT count(*) FROM postbox.workers").fetchone() != (len(processes),):
        if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
            raise RuntimeError("the demo processes did not start")
        time.sleep(0.05)
    conn.commit()


def _play(url: str, conn: psycopg.Connection[Any], timeout: float) -> dict[str, str]:
    """Produce the events, wait for them to settle, fix and replay the dead letters, summarise."""
    _say("· producers write 10 order events, each in its own transaction, out of order on purpose\n")
    played = events()
    for e in [played[2], *played[:2], *played[3:]]:  # shipped arrives before paid
        receive_many(conn, [e])
        conn.commit()
    seen: dict[str, set[Any]] = {"done": set(), "failed": set(), "dead": set(), "shipped": set()}
    _wait(
        conn,
        seen,
        lambda: _settled(conn) and len(seen["dead"]) >= 2 and len(seen["shipped"]) >= 2,
        timeout,
    )
    job = _fix_and_replay(url, conn, seen)
    _say(f"  replay {job.id} {job.state}: {job.state_reason}")
    _wait(conn, seen, lambda: _settled(conn) and len(seen["shipped"]) >= 4, timeout)
    _say("\nSummary")
    for title, sql in SUMMARY_SQL.items():
        _say(f"\n{title}:\n{_table(conn, sql)}")
    rows = conn.execute("SELECT order_id, state FROM demo_orders").fetchall()
    return {str(k): str(v) for k, v in rows}


def _stop_processes(processes: list[subprocess.Popen[bytes]]) -> None:
    for proc in processes:
        proc.send_signal(signal.SIGTERM)
    for proc in processes:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _epilogue(url: str, database: str, started: float, *, embedded: bool) -> None:
    _say("\nWhat a DBA would run to see the same (psql into the demo database):")
    for sql in SUMMARY_SQL.values():
        _say(f"  {sql};")
    _say(
        f"  SELECT * FROM postbox.dlq_explain({deadletter_id_hint(url)});   -- one dead letter's whole story"
    )
    done = f"\nDone in {time.monotonic() - started:.1f} s; every process stopped."
    if embedded:
        _say(
            f"{done} The embedded PostgreSQL stops with the demo (its data stays in the data folder; the "
            "next demo replaces its database). To explore the result with psql, run the demo on a server "
            "of yours: POSTBOX_DATABASE_URL=postgresql://USER@HOST:PORT/postgres make demo"
        )
        return
    _say(
        f'{done} Database {database} is kept for you to explore (psql "{mask_url(url)}"); remove it with '
        f"DROP DATABASE {_identifier(database)} (the next demo replaces it)."
    )


def _server_of(url: str) -> str:
    p = conninfo_to_dict(url)
    host = str(p.get("host") or "localhost")
    return f"the embedded server ({host})" if host.startswith("/") else f"{host}:{p.get('port') or 5432}"


def deadletter_id_hint(url: str) -> int:
    """The id of the demo's first dead letter (for the explain example)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT min(id) FROM postbox.dead_letters").fetchone()
    return int(row[0]) if row and row[0] is not None else 1


def _identifier(name: str) -> str:
    """``name`` as psql takes it in a statement: as it is if it needs no quotes, else quoted."""
    if name.isidentifier() and name.isascii() and name == name.lower():
        return name
    return '"' + name.replace('"', '""') + '"'

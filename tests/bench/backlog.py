"""Postbox under the weight of what it keeps, for `make bench`: the claim's cost with a 10M-row
backlog, and a receive's cost with a 50M-row deduplication ledger. Each builds its database
set-based (a few INSERT ... SELECT statements, the times reported), measures, and has the harness
drop it at once (they take gigabytes)."""

from __future__ import annotations

import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg

import postbox
from tests.bench.harness import Harness
from tests.bench.scripts import BACKLOG_BLOCKED, BACKLOG_COLD, BACKLOG_HOT, LEDGER_FILL, LEDGER_VACUUM

LEDGER_CHUNK = 5_000_000  # ledger rows per statement (and transaction)


def claim_complete_ms(c: psycopg.Connection[Any], samples: int) -> float:
    """Median ms of one claim (1 message) + complete, each its own transaction."""
    times = []
    for _ in range(samples):
        t = time.perf_counter()
        rows = c.execute(
            "SELECT id, attempt FROM postbox.inbox_claim_v1('bench', 'w', 1, '1 minute', now())"
        ).fetchall()
        c.commit()
        c.execute(
            "SELECT postbox.inbox_complete_v1(%s, %s, now())",
            ([r[0] for r in rows], [r[1] for r in rows]),
        )
        c.commit()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def build_backlog(url: str, rows: int) -> float:
    """About ``rows`` pending messages over rows/100 keys: one hot key holding a tenth of them,
    rows/1,000 keys whose head is blocked, the rest over cold keys of ~100 rows each (a ready head
    and pending rows behind it); then VACUUM ANALYZE, as autovacuum would do after such inserts.
    Seconds taken. The rows are inserted with triggers off (``session_replication_role``): the
    deferred check that a pending row's key has a head would take a lock per key, and every key is
    built with its head."""
    hot, blocked, keys = rows // 10, rows // 1000, rows // 100
    cold = keys - blocked - 1
    per = (rows - hot - 5 * blocked) // cold - 1  # pending rows behind each cold head
    chunk = -(-cold // 4)
    statements: list[tuple[str, dict[str, int]]] = [
        (BACKLOG_HOT, {"hot": hot}),
        (BACKLOG_BLOCKED, {"blocked": blocked}),
    ]
    statements += [
        (BACKLOG_COLD, {"lo": lo, "hi": min(lo + chunk, cold) - 1, "per": per})
        for lo in range(0, cold, chunk)
    ]
    t = time.perf_counter()
    with psycopg.connect(url) as c:
        for sql, params in statements:
            c.execute("SET LOCAL synchronous_commit = off")
            c.execute("SET LOCAL session_replication_role = replica")
            c.execute(sql, params)
            c.commit()
        c.autocommit = True
        c.execute("VACUUM ANALYZE postbox.inbox")
    return time.perf_counter() - t


READY_10K = """INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)
SELECT 'bench', 'm' || g, 'k' || g, g, '{}', 'ready' FROM generate_series(1, 10000) g"""
TURNS = 5  # the large backlog's claims and the 10k reference's take turns, in this many rounds


def big_backlog_claim(b: Harness, rows: int, samples: int) -> tuple[float, float, float]:
    """Median ms of one claim + complete with the large backlog present; the same with 10k ready
    messages, measured taking turns with it (the machine's speed drifts over the minutes a full
    run takes: a reference measured at another time moved this ratio by half); and the build's
    seconds. The databases are dropped right after."""
    url, small = b.fresh(), b.fresh()
    try:
        took = build_backlog(url, rows)
        print(f"  (backlog of {rows:,} rows built in {took:.0f} s)", flush=True)
        with psycopg.connect(small) as c:
            c.execute(READY_10K)
            c.execute("ANALYZE postbox.inbox")
            c.commit()
        big_ms: list[float] = []
        small_ms: list[float] = []
        with psycopg.connect(url) as cb, psycopg.connect(small) as cs:
            for _ in range(TURNS):
                small_ms.append(claim_complete_ms(cs, max(1, samples // TURNS)))
                big_ms.append(claim_complete_ms(cb, max(1, samples // TURNS)))
        return statistics.median(big_ms), statistics.median(small_ms), took
    finally:
        b.drop(url)
        b.drop(small)


def fill_ledger(url: str, rows: int, connections: int = 2) -> tuple[float, float]:
    """``rows`` old entries in the deduplication ledger (scripts.LEDGER_FILL, by chunks, on
    ``connections`` connections at once: the server has a core for each), then VACUUM ANALYZE;
    seconds each took."""

    def chunk(start: int) -> None:
        with psycopg.connect(url) as c:
            c.execute(LEDGER_FILL.format(start=start, rows=min(LEDGER_CHUNK, rows - start)))

    t = time.perf_counter()
    with ThreadPoolExecutor(connections) as pool:
        list(pool.map(chunk, range(0, rows, LEDGER_CHUNK)))
    filled = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("SET maintenance_work_mem = '256MB'")
        c.execute(LEDGER_VACUUM)
    return filled - t, time.perf_counter() - filled


def _receive_ms(c: psycopg.Connection[Any], n: int) -> list[float]:
    """ms of each of ``n`` single receives (autocommit, fresh random message ids, no key)."""
    times = []
    for i in range(n):
        t = time.perf_counter()
        postbox.receive(c, consumer="bench", message_id=uuid.uuid4().hex, payload={"i": i})
        times.append((time.perf_counter() - t) * 1000)
    return times


def ledger_receive(b: Harness, rows: int, n: int, turn: int = 100) -> tuple[float, float, float]:
    """Median ms per single receive on an empty ledger and on one of ``rows`` old entries, and the
    fill's seconds. The two databases take turns (``turn`` receives each, after a warm-up) so that
    a noisy second of the machine does not decide their ratio. Both dropped after."""
    empty, big = b.fresh(), b.fresh()
    try:
        fill, vacuum = fill_ledger(big, rows)
        took = fill + vacuum
        print(
            f"  (ledger of {rows:,} rows: filled in {fill:.0f} s, VACUUM ANALYZE {vacuum:.0f} s)", flush=True
        )
        with psycopg.connect(empty, autocommit=True) as ce, psycopg.connect(big, autocommit=True) as cb:
            times: dict[str, list[float]] = {"empty": [], "big": []}
            for c in (ce, cb):
                _receive_ms(c, 100)  # warm-up: prepared statements, caches
            for _ in range(0, n, turn):
                times["empty"] += _receive_ms(ce, turn)
                times["big"] += _receive_ms(cb, turn)
        return statistics.median(times["empty"]), statistics.median(times["big"]), took
    finally:
        b.drop(empty)
        b.drop(big)

"""`make bench`: Postbox's hot paths against PostgreSQL's own ceiling, measured in one run.

The machine is small and shared, so every figure is reported next to a reference measured in the
same run (pgbench doing the same minimum work), as a ratio; repetitions are interleaved and the
median is reported with its min-max. Results go to bench-results/ as JSON and a markdown table.

    python -m tests.bench [--quick] [--database-url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

import postbox
from postbox.schema import migrate
from tests.conftest import _conninfo_url
from tests.helpers import spawn_postbox

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench-results"

BENCH_DDL = """
CREATE TABLE IF NOT EXISTS bench_effects (
    id bigserial PRIMARY KEY, message_id text NOT NULL, key text NOT NULL, seq bigint, latency_ms double precision,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS bench_rows (id integer PRIMARY KEY, n bigint NOT NULL DEFAULT 0);
INSERT INTO bench_rows (id) SELECT g FROM generate_series(1, 20000) g ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS bench_single (id bigserial PRIMARY KEY, payload jsonb NOT NULL);
CREATE SEQUENCE IF NOT EXISTS bench_ids;
"""


@dataclass
class Result:
    name: str
    unit: str
    runs: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.runs) if self.runs else float("nan")

    def span(self) -> str:
        return f"{min(self.runs):,.1f}..{max(self.runs):,.1f}" if self.runs else "-"


class Bench:
    def __init__(self, admin_url: str, quick: bool) -> None:
        self.admin_url = admin_url
        self.quick = quick
        self.params = {k: str(v) for k, v in conninfo_to_dict(admin_url).items() if v is not None}
        self.results: dict[str, Result] = {}
        self.extra: dict[str, Any] = {}
        self.template = f"postbox_bench_tmpl_{uuid.uuid4().hex[:6]}"
        self._create(self.template)
        url = self.url(self.template)
        migrate.upgrade(url)
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(BENCH_DDL)
        self.created: list[str] = [self.template]
        self._last = time.monotonic()  # each record prints how long its workload took

    def url(self, db: str) -> str:
        return _conninfo_url(dict(self.params, dbname=db))

    def _create(self, name: str, template: str | None = None) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            c.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))

    def fresh(self) -> str:
        name = f"postbox_bench_{uuid.uuid4().hex[:8]}"
        self._create(name, self.template)
        self.created.append(name)
        return self.url(name)

    def fresh_empty(self) -> str:
        """A new database without Postbox (for a peer queue), with the benchmark tables."""
        name = f"postbox_bench_peer_{uuid.uuid4().hex[:8]}"
        self._create(name)
        self.created.append(name)
        url = self.url(name)
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(BENCH_DDL)
        return url

    # --- peers: procrastinate and pgqueuer (the `bench` extra) --------------------------------

    def peer(self, kind: str) -> str:
        from tests.bench import peers

        url = self.fresh_empty()
        peers.install(kind, url)
        return url

    def peer_drain(self, kind: str, n: int, keys: int, ordered: bool, cap: float) -> float:
        from tests.bench import peers

        rate, bad = peers.drain(
            kind, self.peer(kind), n, keys, ordered, processes=2, concurrency=2, cap_seconds=cap
        )
        if ordered and bad:
            self.extra.setdefault("peer order violations", {})[kind] = bad
            print(f"  ! {kind} broke per-key order {bad} times", flush=True)
        return rate

    def cleanup(self) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as c:
            for name in reversed(self.created):
                c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def record(self, name: str, unit: str, value: float, note: str = "") -> None:
        r = self.results.setdefault(name, Result(name, unit, note=note))
        r.runs.append(value)
        now = time.monotonic()
        took, self._last = now - self._last, now
        print(f"  {name}: {value:,.1f} {unit}  ({took:.0f} s)", flush=True)

    # --- references: pgbench -----------------------------------------------------------------

    def pgbench(self, script: str, clients: int, threads: int, seconds: int, url: str | None = None) -> float:
        exe = shutil.which("pgbench") or next(
            iter(sorted(Path("/usr/lib/postgresql").glob("*/bin/pgbench"))), None
        )
        if exe is None:
            raise RuntimeError("pgbench not found")
        url = url or self.fresh()
        with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
            f.write(script)
        out = subprocess.run(
            [str(exe), "-n", "-f", f.name, "-c", str(clients), "-j", str(threads), "-T", str(seconds), url],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        os.unlink(f.name)
        for line in out.splitlines():
            if line.startswith("tps = "):
                return float(line.split()[2])
        raise RuntimeError(f"no tps in pgbench output: {out}")

    # --- Postbox workloads ---------------------------------------------------------------------

    def receive_single(self, n: int, own_transaction: bool) -> float:
        """One message per transaction: an implicit one (autocommit, like pgbench's single INSERT),
        or the caller's explicit BEGIN ... COMMIT (two more round trips)."""
        url = self.fresh()
        with psycopg.connect(url, autocommit=not own_transaction) as c:
            t = time.perf_counter()
            for i in range(n):
                postbox.receive(c, consumer="bench", message_id=str(i), payload={"i": i})
                if own_transaction:
                    c.commit()
            return n / (time.perf_counter() - t)

    def insert_single(self, n: int) -> float:
        """The Python client's own ceiling: pgbench's single INSERT from psycopg, autocommit."""
        url = self.fresh()
        with psycopg.connect(url, autocommit=True) as c:
            t = time.perf_counter()
            for _ in range(n):
                c.execute("INSERT INTO bench_single (payload) VALUES (%s::jsonb)", ('{"i": 1}',))
            return n / (time.perf_counter() - t)

    def receive_batch(self, n: int, batch: int = 500, keyed: bool = True) -> float:
        """Batches of ``batch`` per transaction: over 500 keys (from the second batch on, every message
        queues behind its key's head), or without keys (each message its own key, as a queue
        without per-key order receives them)."""
        url = self.fresh()
        with psycopg.connect(url) as c:
            t = time.perf_counter()
            for start in range(0, n, batch):
                postbox.receive_many(
                    c,
                    [
                        {"consumer": "bench", "message_id": str(i), "payload": {"i": i}}
                        | ({"key": f"k{i % 500}"} if keyed else {})
                        for i in range(start, min(start + batch, n))
                    ],
                )
                c.commit()
            return n / (time.perf_counter() - t)

    def _preload(self, url: str, n: int, keys: int) -> None:
        with psycopg.connect(url) as c:
            c.execute("SELECT postbox.consumer_halt_v1('bench', 'benchmark preload')")
            for start in range(0, n, 1000):
                postbox.receive_many(
                    c,
                    [
                        {
                            "consumer": "bench",
                            "message_id": str(i),
                            "key": f"k{i % keys}",
                            "sequence": i // keys,
                            "payload": {"i": i},
                        }
                        for i in range(start, min(start + 1000, n))
                    ],
                )
                c.commit()
            c.execute("ANALYZE")  # as for the peers: plans for the backlog, as autovacuum would make them
            c.commit()

    def drain(self, n: int, keys: int, processes: int, concurrency: int, batch: int) -> tuple[float, float]:
        """Ordered drain: msgs/s, and peak worker RSS in MB. Verifies order and exactly-once after."""
        url = self.fresh()
        self._preload(url, n, keys)
        procs = [
            spawn_postbox(
                "--database-url",
                url,
                "worker",
                "--consumer",
                "bench",
                "--app",
                "tests.bench.app:registry",
                "--concurrency",
                str(concurrency),
                "--batch-size",
                str(batch),
                "--poll-interval",
                "0.05",
            )
            for _ in range(processes)
        ]
        peak = 0.0
        try:
            with psycopg.connect(url, autocommit=True) as c:
                _wait(
                    lambda: c.execute("SELECT count(*) FROM postbox.workers").fetchone()[0] == processes, 30
                )
                t = time.perf_counter()
                c.execute("SELECT postbox.consumer_resume_v1('bench')")
                while c.execute("SELECT EXISTS (SELECT 1 FROM postbox.inbox)").fetchone()[0]:
                    peak = max(peak, *(_rss_mb(p.pid) for p in procs))
                    time.sleep(0.05)
                elapsed = time.perf_counter() - t
                bad = c.execute(
                    "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY key ORDER BY id) AS prev"
                    " FROM bench_effects) e WHERE prev IS NOT NULL AND seq <> prev + 1"
                ).fetchone()[0]
                count, distinct = c.execute(
                    "SELECT count(*), count(DISTINCT message_id) FROM bench_effects"
                ).fetchone()
            if bad or count != n or distinct != n:
                raise AssertionError(f"drain broke an invariant: {bad} out of order, {count} effects for {n}")
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(30)
        return n / elapsed, peak

    def drain_sql(self, n: int, keys: int, batch: int, seconds: int) -> float:
        """What bounds the drain: the same claim, effect rows and complete, in SQL only (no Python,
        no per-message round trips or savepoints), one batch per transaction, pgbench -c 4; msg/s.
        Started with more messages than it can take in that time (if not, it says so)."""
        url = self.fresh()
        self._preload(url, n, keys)
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(DRAIN_SQL_FUNCTION)
            c.execute("SELECT postbox.consumer_resume_v1('bench')")
            self.pgbench(f"SELECT bench_drain_batch({batch});\n", 4, 2, seconds, url=url)
            done, left = c.execute(
                "SELECT (SELECT count(*) FROM bench_effects), (SELECT count(*) FROM postbox.inbox)"
            ).fetchone()
        if not left:
            print("  ! the SQL-only drain ran dry: its figure is a lower bound", flush=True)
        return done / seconds

    def relay(
        self, n: int, keys: int, kind: str, batch: int = 200, concurrency: int = 2
    ) -> tuple[float, float]:
        """Relay throughput (rows/s) and the relay's peak RSS (MB): n rows over ``keys`` keys to the
        PostgreSQL transport (this database, another consumer) or to RabbitMQ with confirms."""
        url = self.fresh()
        queue = f"postbox-bench-{uuid.uuid4().hex[:8]}"
        with psycopg.connect(url) as c:
            for start in range(0, n, 1000):
                postbox.publish_many(
                    c,
                    [
                        {
                            "destination": "out",
                            "message_id": f"r{i}",
                            "key": f"k{i % keys}",
                            "payload": {"i": i},
                        }
                        for i in range(start, min(start + 1000, n))
                    ],
                )
                c.commit()
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            if kind == "postgres":
                f.write('[destinations.out]\nkind = "postgres"\nconsumer = "relayed"\n')
            else:
                f.write(f'[destinations.out]\nkind = "rabbitmq"\nrouting_key = "{queue}"\n')
        p = spawn_postbox(
            "--config",
            f.name,
            "--database-url",
            url,
            "relay",
            "--batch-size",
            str(batch),
            "--concurrency",
            str(concurrency),
            "--poll-interval",
            "0.05",
        )
        peak = 0.0
        try:
            with psycopg.connect(url, autocommit=True) as c:
                # Timed from the first row the relay takes out (its start-up is not counted).
                t, left = 0.0, n
                while left:
                    peak = max(peak, _rss_mb(p.pid))
                    time.sleep(0.05)
                    now_left = c.execute("SELECT count(*) FROM postbox.outbox").fetchone()[0]
                    if not t and now_left < n:
                        t, started_with = time.perf_counter(), now_left
                    left = now_left
                elapsed = time.perf_counter() - t
                n_timed = started_with
                if kind == "postgres":
                    got = c.execute(
                        "SELECT count(DISTINCT message_id) FROM postbox.inbox WHERE consumer = 'relayed'"
                    ).fetchone()[0]
                    bad = c.execute(
                        "SELECT count(*) FROM (SELECT substr(message_id, 2)::int AS i, lag(substr(message_id, 2)::int)"
                        " OVER (PARTITION BY key ORDER BY id) AS prev FROM postbox.inbox WHERE consumer = 'relayed') x"
                        " WHERE prev IS NOT NULL AND i < prev"
                    ).fetchone()[0]
                    if got != n or bad:
                        raise AssertionError(f"relay broke an invariant: {got} of {n}, {bad} out of order")
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(30)
            os.unlink(f.name)
            if kind == "rabbitmq":
                import pika

                conn = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1:5672/%2F"))
                ch = conn.channel()
                count = ch.queue_declare(queue, durable=True, passive=True).method.message_count
                ch.queue_delete(queue)
                conn.close()
                if count < n:
                    raise AssertionError(f"relay to RabbitMQ lost rows: {count} of {n}")
        return n_timed / elapsed, peak

    def replay(self, n: int, batch: int = 500) -> float:
        """Replay send-back rate (dead letters/s): n dead letters, each blocking its own key, sent back
        in place by one replay job stepped as fast as it allows (rate unlimited, batch of 500)."""
        url = self.fresh()
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(
                """WITH r AS (
                       INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state, attempt)
                       SELECT 'bench', 'm' || g, 'k' || g, g, '{"n": 1}', 'blocked', 5 FROM generate_series(1, %s) g
                       RETURNING *)
                   INSERT INTO postbox.dead_letters (origin, origin_id, consumer, message_id, key, position, payload,
                                                     received_at, attempt, reason, ordering_policy, fingerprint)
                   SELECT 'inbox', id, consumer, message_id, key, position, payload, received_at, 5,
                          'attempts_exhausted', 'block', 'Bench: failure' FROM r""",
                (n,),
            )
            c.execute("ANALYZE")
            job = c.execute(
                """SELECT postbox.dlq_replay('{"queue": "bench"}', reason => 'bench', rate => 100000,
                                             max_in_flight => %s, batch_size => %s)""",
                (n, batch),
            ).fetchone()[0]
            t0 = time.perf_counter()
            while c.execute("SELECT (postbox.replay_step(%s)).replayed", (job,)).fetchone()[0] < n:
                pass
            elapsed = time.perf_counter() - t0
            ready = c.execute(
                "SELECT count(*) FROM postbox.inbox WHERE state = 'ready' AND replay_of IS NOT NULL"
            ).fetchone()[0]
            if ready != n:
                raise AssertionError(f"replay sent back {ready} of {n}")
        return n / elapsed

    def claim_cost(self, backlog: str, samples: int) -> float:
        """Median ms of one claim (1 message) + complete, with the given backlog present."""
        url = self.fresh()
        with psycopg.connect(url) as c:
            if backlog == "10k":
                c.execute("""INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)
                             SELECT 'bench', 'm' || g, 'k' || g, g, '{}', 'ready' FROM generate_series(1, 10000) g""")
            else:
                c.execute("""
                    INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)
                    SELECT 'bench', 'hot-' || g, 'hot', g, '{}', CASE WHEN g = 1 THEN 'ready' ELSE 'pending' END
                      FROM generate_series(1, 500000) g;
                    INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)
                    SELECT 'bench', 'blocked-' || g, 'b' || g, g, '{}', 'blocked' FROM generate_series(1, 1000) g;
                    INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)
                    SELECT 'bench', 'cold-' || g, 'c' || (g % 9000), g, '{}',
                           CASE WHEN g <= 9000 THEN 'ready' ELSE 'pending' END
                      FROM generate_series(1, 499000) g;""")
            c.execute("ANALYZE postbox.inbox")
            c.commit()
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

    def latency(self, rate: float, seconds: float, listen: bool) -> dict[str, float]:
        """Receive-to-handler-start latency at a steady rate, in ms (p50, p99, max)."""
        url = self.fresh()
        args = ["--listen" if listen else "--no-listen", "--poll-interval", "0.05" if listen else "0.01"]
        p = spawn_postbox(
            "--database-url",
            url,
            "worker",
            "--consumer",
            "bench",
            "--app",
            "tests.bench.app:registry",
            "--concurrency",
            "2",
            "--batch-size",
            "10",
            *args,
        )
        try:
            with psycopg.connect(url) as c:
                _wait(lambda: c.execute("SELECT count(*) FROM postbox.workers").fetchone()[0] == 1, 30)
                c.commit()
                n = int(rate * seconds)
                start = time.perf_counter()
                for i in range(n):
                    due = start + i / rate
                    delay = due - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    c.execute("SET LOCAL postbox.notify = on")
                    postbox.receive(c, consumer="bench", message_id=str(i), key=f"k{i}", payload={})
                    c.commit()
                _wait(lambda: c.execute("SELECT count(*) FROM bench_effects").fetchone()[0] == n, 30)
                lat = sorted(r[0] for r in c.execute("SELECT latency_ms FROM bench_effects").fetchall())
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(30)
        return {"p50": lat[len(lat) // 2], "p99": lat[int(len(lat) * 0.99) - 1], "max": lat[-1]}


def _wait(check: Callable[[], bool], timeout: float) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise TimeoutError("benchmark setup did not converge")
        time.sleep(0.05)


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


PGBENCH_INSERT_UPDATE = """\\set k random(1, 20000)
BEGIN;
INSERT INTO bench_effects (message_id, key, seq) VALUES ('x', 'k', :k);
UPDATE bench_rows SET n = n + 1 WHERE id = :k;
COMMIT;
"""
# One batch of the drain in SQL: claim, one effect row per message, complete (bench_drain_batch).
DRAIN_SQL_FUNCTION = """CREATE FUNCTION bench_drain_batch(n integer) RETURNS integer LANGUAGE plpgsql AS $$
DECLARE ids bigint[]; attempts integer[];
BEGIN
    SELECT array_agg(id), array_agg(attempt) INTO ids, attempts
      FROM postbox.inbox_claim_v1('bench', 'sql', n, interval '60 seconds', now());
    IF ids IS NULL THEN
        RETURN 0;
    END IF;
    INSERT INTO bench_effects (message_id, key, seq)
    SELECT message_id, key, sequence FROM postbox.inbox WHERE id = ANY(ids);
    PERFORM postbox.inbox_complete_v1(ids, attempts, now());
    RETURN cardinality(ids);
END $$"""
PGBENCH_SINGLE_INSERT = "INSERT INTO bench_single (payload) VALUES ('{\"i\": 1}');\n"
# What bounds a single receive: the receive function itself without the Python client, and the two
# rows every receive must write (the deduplication ledger and the inbox row, with their indexes)
# with the uniqueness checks that deduplication and the one-head-per-key rule need (ON CONFLICT).
PGBENCH_RECEIVE = "SELECT postbox.inbox_receive_v1('bench', nextval('bench_ids')::text, '{\"i\": 1}');\n"
PGBENCH_TWO_INSERTS = """WITH n AS (SELECT nextval('bench_ids')::text AS id), \
d AS (INSERT INTO postbox.inbox_dedup (consumer, message_id, payload_hash, inbox_id) SELECT 'bench', id, '\\x00', 0 FROM n \
ON CONFLICT DO NOTHING) \
INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state) SELECT 'bench', id, id, 0, '{"i": 1}', 'ready' FROM n \
ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING;
"""
# The same two rows as plain INSERTs (no ON CONFLICT; the unique indexes still check): the most
# generous bound for any design that writes them, since a receive must handle a conflict somehow.
PGBENCH_TWO_PLAIN_INSERTS = """WITH n AS (SELECT nextval('bench_ids')::text AS id), \
d AS (INSERT INTO postbox.inbox_dedup (consumer, message_id, payload_hash, inbox_id) SELECT 'bench', id, '\\x00', 0 FROM n) \
INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state) SELECT 'bench', id, id, 0, '{"i": 1}', 'ready' FROM n;
"""
# Even one row per message (no ledger: what a single-table design would write at best) costs more
# than pgbench's single INSERT, because of the indexes a claimable, one-head-per-key row needs.
PGBENCH_INBOX_ROW = """INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state) \
SELECT 'bench', id, id, 0, '{"i": 1}', 'ready' FROM (SELECT nextval('bench_ids')::text AS id) n \
ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING;
"""
# The batch floor: the same two rows and checks for 500 messages in one statement (tx/s x 500).
PGBENCH_TWO_INSERTS_500 = """WITH n AS (SELECT nextval('bench_ids') AS id FROM generate_series(1, 500)), \
d AS (INSERT INTO postbox.inbox_dedup (consumer, message_id, payload_hash, inbox_id) SELECT 'bench', id::text, '\\x00', id FROM n \
ON CONFLICT DO NOTHING) \
INSERT INTO postbox.inbox (id, consumer, message_id, key, position, payload, state) SELECT id, 'bench', id::text, id::text, id, '{"i": 1}', 'ready' FROM n \
ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING;
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run in about a minute")
    ap.add_argument(
        "--database-url",
        default=os.environ.get("POSTBOX_BENCH_DATABASE_URL") or os.environ.get("POSTBOX_DATABASE_URL"),
    )
    ap.add_argument("--repeat", type=int, default=None)
    args = ap.parse_args()
    quick = args.quick
    repeat = args.repeat or (1 if quick else 3)
    admin = args.database_url
    if not admin:
        from postbox.demo.embedded import embedded_server

        admin = str(embedded_server(REPO / ".pgdata").get_uri())
    sizes = {
        "single": 300 if quick else 2000,
        "batch": 5000 if quick else 50000,
        "drain": 4000 if quick else 20000,
        "drain_sql": 40000 if quick else 100000,
        "pg_seconds": 3 if quick else 10,
        "relay": 4000 if quick else 20000,
        "claim_samples": 100 if quick else 500,
        "replay": 1000 if quick else 5000,
        "lat_seconds": 3 if quick else 20,
        "peer_cap": 5 if quick else 6,
        "bound_seconds": 3 if quick else 5,
    }
    with_peers = _peers_installed()
    b = Bench(admin, quick)
    started = time.monotonic()
    try:
        for rep in range(repeat):
            print(f"repetition {rep + 1}/{repeat}", flush=True)
            b.record(
                "pgbench single INSERT, -c 1",
                "tx/s",
                b.pgbench(PGBENCH_SINGLE_INSERT, 1, 1, sizes["pg_seconds"]),
            )
            b.record("receive, 1 message per transaction", "msg/s", b.receive_single(sizes["single"], False))
            b.record("psycopg single INSERT, autocommit", "tx/s", b.insert_single(sizes["single"]))
            b.record(
                "pgbench inbox_receive_v1 per transaction, -c 1",
                "tx/s",
                b.pgbench(PGBENCH_RECEIVE, 1, 1, sizes["bound_seconds"]),
            )
            b.record(
                "pgbench ledger + inbox INSERTs with their checks (no function), -c 1",
                "tx/s",
                b.pgbench(PGBENCH_TWO_INSERTS, 1, 1, sizes["bound_seconds"]),
            )
            b.record(
                "pgbench ledger + inbox INSERTs, plain (no ON CONFLICT, no function), -c 1",
                "tx/s",
                b.pgbench(PGBENCH_TWO_PLAIN_INSERTS, 1, 1, sizes["bound_seconds"]),
            )
            b.record(
                "pgbench one inbox row, no ledger (no function), -c 1",
                "tx/s",
                b.pgbench(PGBENCH_INBOX_ROW, 1, 1, sizes["bound_seconds"]),
            )
            b.record("receive in the caller's BEGIN/COMMIT", "msg/s", b.receive_single(sizes["single"], True))
            b.record("receive_many, 500 per transaction", "msg/s", b.receive_batch(sizes["batch"]))
            b.record(
                "receive_many, 500 per transaction, no keys",
                "msg/s",
                b.receive_batch(sizes["batch"], keyed=False),
            )
            if with_peers:  # measured right after ours: the same minute of a noisy machine
                from tests.bench import peers

                b.record(
                    PEER_PGQUEUER_BATCH,
                    "msg/s",
                    peers.pgqueuer_enqueue(b.peer("pgqueuer"), sizes["batch"], 500, 500),
                )
                b.record(
                    PEER_PGQUEUER_BATCH_DEDUPE,
                    "msg/s",
                    peers.pgqueuer_enqueue(b.peer("pgqueuer"), sizes["batch"], 500, 500, dedupe=True),
                )
            b.record(
                "pgbench ledger + inbox rows with their checks, 500 per statement (no function)",
                "msg/s",
                500 * b.pgbench(PGBENCH_TWO_INSERTS_500, 1, 1, sizes["bound_seconds"]),
            )
            b.record(
                "pgbench INSERT+UPDATE, -c 4 -j 2",
                "tx/s",
                b.pgbench(PGBENCH_INSERT_UPDATE, 4, 2, sizes["pg_seconds"]),
            )
            rate, rss = b.drain(sizes["drain"], 500, processes=2, concurrency=2, batch=50)
            b.record("ordered drain, 500 keys, 2 proc x 2 slots", "msg/s", rate)
            b.record("worker peak RSS during drain", "MB", rss)
            b.record(
                "drain in SQL only (claim + effects + complete per 50), pgbench -c 4",
                "msg/s",
                b.drain_sql(sizes["drain_sql"], 500, 50, sizes["bound_seconds"]),
            )
            for kind in ("postgres", "rabbitmq"):
                rate, rss = b.relay(sizes["relay"], 500, kind)
                b.record(f"relay to {kind}, 500 keys, in order, confirmed", "rows/s", rate)
                b.record(f"relay peak RSS ({kind})", "MB", rss)
            b.record("claim+complete, 10k ready", "ms", b.claim_cost("10k", sizes["claim_samples"]))
            b.record("replay send-back, blocked dead letters, batch 500", "msg/s", b.replay(sizes["replay"]))
            if rep == 0:  # building the 1M backlog is the longest setup: once per run
                b.record(
                    "claim+complete, 1M backlog (hot key 500k, 1k blocked)",
                    "ms",
                    b.claim_cost("1M", sizes["claim_samples"]),
                )
            for listen in (True, False):
                lat = b.latency(200, sizes["lat_seconds"], listen)
                label = "LISTEN/NOTIFY" if listen else "polling 10 ms"
                for q in ("p50", "p99", "max"):
                    b.record(f"receive→handler at 200 msg/s, {label}, {q}", "ms", lat[q])
            if with_peers:
                run_peers(b, sizes)
    finally:
        b.cleanup()
    report(b, quick, time.monotonic() - started)


def _peers_installed() -> bool:
    try:
        import asyncpg  # noqa: F401
        import pgqueuer  # noqa: F401
        import procrastinate  # noqa: F401
    except ImportError:
        print("peers skipped: install the bench extra (pip install -e '.[bench]', as `make bench` does)")
        return False
    return True


def run_peers(b: Bench, sizes: dict[str, int]) -> None:
    """The peers on the same workloads: drains are time-capped (rate = effects / elapsed)."""
    from tests.bench import peers

    n, cap = sizes["drain"], sizes["peer_cap"]
    b.record(PEER_PROCRASTINATE_ORDERED, "msg/s", b.peer_drain("procrastinate", n, 500, True, cap))
    b.record(PEER_PROCRASTINATE, "msg/s", b.peer_drain("procrastinate", n, 500, False, cap))
    b.record(PEER_PGQUEUER, "msg/s", b.peer_drain("pgqueuer", n, 500, False, cap))
    lat = peers.pgqueuer_latency(b.peer("pgqueuer"), 200, sizes["lat_seconds"])
    for q in ("p50", "p99", "max"):
        b.record(f"pgqueuer enqueue→handler at 200 msg/s, LISTEN/NOTIFY, {q}", "ms", lat[q])


PEER_PROCRASTINATE_ORDERED = "procrastinate drain, lock=<key>, 500 keys, 2 proc x 2"
PEER_PROCRASTINATE = "procrastinate drain, unordered, 2 proc x 2"
PEER_PGQUEUER = "pgqueuer drain, unordered, 2 proc x 2"
PEER_PGQUEUER_BATCH = "pgqueuer enqueue, 500 per statement"
PEER_PGQUEUER_BATCH_DEDUPE = "pgqueuer enqueue with dedupe keys (skip duplicates), 500 per statement"


def report(b: Bench, quick: bool, elapsed: float) -> None:
    r = b.results

    def ratio(a: str, ref: str) -> float:
        return r[a].median / r[ref].median

    ratios = {
        "single receive / pgbench single insert (-c 1)  [target ≥ 0.80]": ratio(
            "receive, 1 message per transaction", "pgbench single INSERT, -c 1"
        ),
        "  single receive / psycopg single insert (same Python client)": ratio(
            "receive, 1 message per transaction", "psycopg single INSERT, autocommit"
        ),
        "  pgbench inbox_receive_v1 / pgbench single insert (no client)": ratio(
            "pgbench inbox_receive_v1 per transaction, -c 1", "pgbench single INSERT, -c 1"
        ),
        "  pgbench ledger + inbox inserts with their checks / pgbench single insert (storage floor)": ratio(
            "pgbench ledger + inbox INSERTs with their checks (no function), -c 1",
            "pgbench single INSERT, -c 1",
        ),
        "  pgbench ledger + inbox rows as plain inserts / pgbench single insert (most generous floor)": ratio(
            "pgbench ledger + inbox INSERTs, plain (no ON CONFLICT, no function), -c 1",
            "pgbench single INSERT, -c 1",
        ),
        "  pgbench one inbox row, no ledger / pgbench single insert (single-table floor)": ratio(
            "pgbench one inbox row, no ledger (no function), -c 1", "pgbench single INSERT, -c 1"
        ),
        "ordered drain / pgbench insert+update (-c 4)  [target ≥ 0.75]": ratio(
            "ordered drain, 500 keys, 2 proc x 2 slots", "pgbench INSERT+UPDATE, -c 4 -j 2"
        ),
        "  drain in SQL only / pgbench insert+update (what the SQL design allows)": ratio(
            "drain in SQL only (claim + effects + complete per 50), pgbench -c 4",
            "pgbench INSERT+UPDATE, -c 4 -j 2",
        ),
        "claim cost, 1M backlog / 10k  [target ≤ 1.5]": ratio(
            "claim+complete, 1M backlog (hot key 500k, 1k blocked)", "claim+complete, 10k ready"
        ),
    }
    if PEER_PGQUEUER in r:
        drain = "ordered drain, 500 keys, 2 proc x 2 slots"
        ratios |= {
            "ordered drain / procrastinate ordered drain  [target ≥ 2]": ratio(
                drain, PEER_PROCRASTINATE_ORDERED
            ),
            "ordered drain / pgqueuer unordered drain  [target ≥ 1.5]": ratio(drain, PEER_PGQUEUER),
            "receive_many 500, no keys / pgqueuer batch enqueue 500  [target ≥ 1.0]": ratio(
                "receive_many, 500 per transaction, no keys", PEER_PGQUEUER_BATCH
            ),
            "  receive_many 500 over 500 keys / pgqueuer batch enqueue 500": ratio(
                "receive_many, 500 per transaction", PEER_PGQUEUER_BATCH
            ),
            "  receive_many 500, no keys / pgqueuer batch enqueue with dedupe keys": ratio(
                "receive_many, 500 per transaction, no keys", PEER_PGQUEUER_BATCH_DEDUPE
            ),
            "  pgbench ledger + inbox rows with their checks, 500 per statement / pgqueuer (storage floor)": ratio(
                "pgbench ledger + inbox rows with their checks, 500 per statement (no function)",
                PEER_PGQUEUER_BATCH,
            ),
            "p99 receive→handler / pgqueuer p99, LISTEN  [target ≤ 1.0]": ratio(
                "receive→handler at 200 msg/s, LISTEN/NOTIFY, p99",
                "pgqueuer enqueue→handler at 200 msg/s, LISTEN/NOTIFY, p99",
            ),
        }
    lines = [
        f"# Postbox benchmark ({'quick' if quick else 'full'}), {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"{os.cpu_count()} cores; {len(next(iter(r.values())).runs)} interleaved repetition(s); "
        f"medians with min..max; run took {elapsed:.0f} s.",
        "",
        "| workload | median | min..max | unit |",
        "|---|---:|---:|---|",
    ]
    lines += [f"| {x.name} | {x.median:,.1f} | {x.span()} | {x.unit} |" for x in r.values()]
    lines += ["", "| ratio (same run) | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in ratios.items()]
    table = "\n".join(lines)
    print("\n" + table)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    (RESULTS / f"bench-{stamp}.md").write_text(table + "\n")
    (RESULTS / f"bench-{stamp}.json").write_text(
        json.dumps(
            {
                "quick": quick,
                "results": {k: {"unit": v.unit, "runs": v.runs, "median": v.median} for k, v in r.items()},
                "ratios": ratios,
                "extra": b.extra,
            },
            indent=2,
        )
    )
    print(f"\nwritten to {RESULTS}/bench-{stamp}.md and .json")


if __name__ == "__main__":
    random.seed(1)
    main()

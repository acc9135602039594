"""Postbox's workloads for `make bench`: receive (single and batch), the ordered drain, the relay,
claim cost under a large backlog, replay, and receive-to-handler latency. Each runs in a fresh
database, and those that move messages check their invariants (nothing missing or doubled, per-key
order) and fail if they break."""

from __future__ import annotations

import itertools
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

import postbox
from tests.bench.backlog import READY_10K, claim_complete_ms
from tests.bench.harness import Harness, children_cpu, process_cpu, rss_mb, server_cpu, wait
from tests.bench.scripts import DRAIN_SQL_FUNCTION, SQL_BATCH_CONFIG, SQL_BATCH_HANDLER
from tests.helpers import spawn_postbox

KAFKA_PARTITIONS = 3


Chunk = Callable[[range], None]  # sends messages ``ids`` (one side of an interleaved comparison)


def interleaved(sides: dict[str, Chunk], n: int, chunk: int) -> dict[str, float]:
    """Each side sends messages 0..n, ``chunk`` at a time, the sides taking turns (the first to go
    moving on by one each round): msg/s per side, from the time of its own chunks only. A machine
    whose speed drifts during the comparison then slows every side alike, where one side measured
    after the other would take the drift as its own (a ratio moved by a tenth between repetitions)."""
    names = list(sides)
    took = dict.fromkeys(names, 0.0)
    for k, start in enumerate(range(0, n, chunk)):
        ids = range(start, min(start + chunk, n))
        for name in names[k % len(names) :] + names[: k % len(names)]:
            t = time.perf_counter()
            sides[name](ids)
            took[name] += time.perf_counter() - t
    return {name: n / took[name] for name in names}


Send = Callable[[int], None]  # sends message ``i`` (one side of a paced comparison)


@dataclass(frozen=True)
class Drained:
    """What a drain measured: its rate, its workers' peak RSS, and the CPU time a message took, of the
    client (the worker processes, or pgbench) and of the PostgreSQL server, from the first claim to the
    last message done. The server's is None when it runs on another machine."""

    rate: float  # msg/s
    rss: float  # MB (0 without worker processes)
    client_cpu: float  # µs per message
    server_cpu: float | None  # µs per message

    @property
    def cpu(self) -> float | None:
        """Client and server CPU per message, µs."""
        return None if self.server_cpu is None else self.client_cpu + self.server_cpu


def _per_message(seconds: float | None, before: float | None, n: int) -> float | None:
    """CPU seconds spent between two readings, as µs per message."""
    return None if seconds is None or before is None else (seconds - before) * 1e6 / n


@dataclass
class LatencySide:
    """One side of a latency comparison: ``send(i)`` sends message ``i``; ``latencies(n)`` waits for
    ``n`` messages to be handled and gives their enqueue-to-handler-start latencies in ms."""

    send: Send
    latencies: Callable[[int], list[float]]


WARM_UP = 20  # messages each side handles before it is timed (its connections' first plans)


def effects_side(c: psycopg.Connection, send: Send, effects: Callable[[], int]) -> LatencySide:
    """A side whose handler writes one ``bench_effects`` row (with ``latency_ms``) per message, read
    over ``c`` (autocommit): warmed up with WARM_UP messages at 200 a second, whose rows are then
    deleted."""
    for i in range(-WARM_UP, 0):
        send(i)
        time.sleep(0.005)
    wait(lambda: effects() == WARM_UP, 30)
    c.execute("DELETE FROM bench_effects")

    def latencies(n: int) -> list[float]:
        wait(lambda: effects() == n, 30)
        return [r[0] for r in c.execute("SELECT latency_ms FROM bench_effects").fetchall()]

    return LatencySide(send, latencies)


def paced(sides: dict[Any, Send], rate: float, n: int, chunk: int) -> None:
    """Each side sends messages 0..n, ``chunk`` at a time, the sides taking turns (the first to go
    moving on by one each round) on one schedule of ``rate`` messages a second: a message is sent
    when it is due (or at once when late). Latencies measured so share the machine's noisy minutes
    alike, where one side measured minutes after the other would take its own minute's noise."""
    names = list(sides)
    start, tick = time.perf_counter(), 0
    for k, first in enumerate(range(0, n, chunk)):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            for i in range(first, min(first + chunk, n)):
                delay = start + tick / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                sides[name](i)
                tick += 1


def quantiles(latencies: list[float]) -> dict[str, float]:
    """p50, p99 and max of the latencies (ms)."""
    lat = sorted(latencies)
    return {"p50": lat[len(lat) // 2], "p99": lat[int(len(lat) * 0.99) - 1], "max": lat[-1]}


def _key(i: int, keyed: bool) -> dict[str, str]:
    """Message ``i``'s key over 500 keys, if ``keyed`` (else none: each message its own key)."""
    return {"key": f"k{i % 500}"} if keyed else {}


def _batches(
    c: psycopg.Connection[Any], batch: int, send: Callable[..., object], item: Callable[[int], dict[str, Any]]
) -> Chunk:
    """A side sending its messages ``batch`` per transaction with ``send`` (``receive_many`` or
    ``publish_many``) on ``c``, each message ``item(i)``."""

    def many(ids: range) -> None:
        for start in range(ids.start, ids.stop, batch):
            send(c, [item(i) for i in range(start, min(start + batch, ids.stop))])
            c.commit()

    return many


class Bench(Harness):
    """The harness with Postbox's workloads; each returns its figure (the caller records it)."""

    @contextmanager
    def receive_sides(self, keyed: bool, batch: int) -> Iterator[Chunk]:
        """Postbox's side of an interleaved receive comparison, in a fresh database: one message per
        transaction (``batch`` 1, autocommit, as pgqueuer's enqueue of one job) or ``receive_many``
        of ``batch`` per transaction; over 500 keys if ``keyed``, else each message its own key."""
        url = self.fresh()
        with psycopg.connect(url, autocommit=batch == 1) as c:

            def single(ids: range) -> None:
                for i in ids:
                    postbox.receive(
                        c, consumer="bench", message_id=str(i), payload={"i": i}, **_key(i, keyed)
                    )

            def item(i: int) -> dict[str, Any]:
                return {"consumer": "bench", "message_id": str(i), "payload": {"i": i}} | _key(i, keyed)

            yield single if batch == 1 else _batches(c, batch, postbox.receive_many, item)

    @contextmanager
    def publish_side(self, keyed: bool, batch: int) -> Iterator[Chunk]:
        """``publish_many`` of ``batch`` events per transaction, in a fresh database; over 500 keys if
        ``keyed``, else each event its own key (a new UUID): the outbox's side of the comparison."""
        url = self.fresh()
        with psycopg.connect(url) as c:
            yield _batches(
                c,
                batch,
                postbox.publish_many,
                lambda i: {"destination": "bench", "payload": {"i": i}} | _key(i, keyed),
            )

    def receive_in_transaction(self, n: int) -> float:
        """One message per transaction, in the caller's explicit BEGIN ... COMMIT (two more round
        trips than the autocommit receive of ``receive_sides``)."""
        url = self.fresh()
        with psycopg.connect(url) as c:
            t = time.perf_counter()
            for i in range(n):
                postbox.receive(c, consumer="bench", message_id=str(i), payload={"i": i})
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

    def drain(
        self, n: int, keys: int, processes: int, concurrency: int, batch: int, app: str = "registry"
    ) -> Drained:
        """Ordered drain: msgs/s, peak worker RSS, CPU per message. Verifies order and exactly-once after.
        ``app`` names the handlers in tests/bench/app.py: ``registry`` (a handler per message,
        declared database-only), ``each_registry`` (the same without the declaration: a savepoint
        per message) or ``batch_registry`` (a batch handler: one statement per call); or ``sql_batch``, a
        SQL-function batch handler declared in the configuration (scripts.SQL_BATCH_HANDLER)."""
        url = self.fresh()
        self._preload(url, n, keys)
        handlers = ["--app", f"tests.bench.app:{app}"]
        config = None
        if app == "sql_batch":
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(SQL_BATCH_HANDLER)
            with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
                f.write(SQL_BATCH_CONFIG)
            config = f.name
            handlers = []
        procs = [
            spawn_postbox(
                *(("--config", config) if config else ()),
                "--database-url",
                url,
                "worker",
                "--consumer",
                "bench",
                *handlers,
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
                wait(lambda: c.execute("SELECT count(*) FROM postbox.workers").fetchone()[0] == processes, 30)
                server, client = server_cpu(c), sum(process_cpu(p.pid) for p in procs)
                t = time.perf_counter()
                c.execute("SELECT postbox.consumer_resume_v1('bench')")
                while c.execute("SELECT EXISTS (SELECT 1 FROM postbox.inbox)").fetchone()[0]:
                    peak = max(peak, *(rss_mb(p.pid) for p in procs))
                    time.sleep(0.05)
                elapsed = time.perf_counter() - t
                used = (sum(process_cpu(p.pid) for p in procs) - client) * 1e6 / n
                server_used = _per_message(server_cpu(c), server, n)
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
            if config:
                os.unlink(config)
        return Drained(n / elapsed, peak, used, server_used)

    def drain_sql(self, n: int, keys: int, batch: int, seconds: int) -> Drained:
        """What bounds the drain: the same claim, effect rows and complete, in SQL only (no Python,
        no per-message round trips or savepoints), one batch per transaction, pgbench -c 4; msg/s
        and CPU per message (the client's is pgbench's). Started with more messages than it can take
        in that time (if not, it says so)."""
        url = self.fresh()
        self._preload(url, n, keys)
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(DRAIN_SQL_FUNCTION)
            c.execute("SELECT postbox.consumer_resume_v1('bench')")
            server, client = server_cpu(c), children_cpu()
            self.pgbench(f"SELECT bench_drain_batch({batch});\n", 4, 2, seconds, url=url)
            server_after, client_after = server_cpu(c), children_cpu()
            done, left = c.execute(
                "SELECT (SELECT count(*) FROM bench_effects), (SELECT count(*) FROM postbox.inbox)"
            ).fetchone()
        if not left:
            print("  ! the SQL-only drain ran dry: its figure is a lower bound", flush=True)
        return Drained(
            done / seconds,
            0.0,
            (client_after - client) * 1e6 / done,
            _per_message(server_after, server, done),
        )

    def relay(
        self, n: int, keys: int, kind: str, batch: int = 200, concurrency: int = 2
    ) -> tuple[float, float]:
        """Relay throughput (rows/s) and the relay's peak RSS (MB): n rows over ``keys`` keys to the
        PostgreSQL transport (this database, another consumer), to RabbitMQ with confirms, or to a
        Kafka topic of 3 partitions (Tansu; idempotent producer, acks=all, each row confirmed by its
        delivery report)."""
        url = self.fresh()
        queue = f"postbox-bench-{uuid.uuid4().hex[:8]}"
        _outbox_rows(url, n, keys)
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            if kind == "postgres":
                f.write('[destinations.out]\nkind = "postgres"\nconsumer = "relayed"\n')
            elif kind == "kafka":
                self.kafka().create_topic(queue, KAFKA_PARTITIONS)
                f.write(
                    f'[destinations.out]\nkind = "kafka"\nbootstrap_servers = "{self.kafka().bootstrap}"\n'
                    f'topic = "{queue}"\n'
                )
            else:
                f.write(f'[destinations.out]\nkind = "rabbitmq"\nrouting_key = "{queue}"\n')
        p = spawn_postbox(
            *("--config", f.name, "--database-url", url, "relay"),
            *("--batch-size", str(batch), "--concurrency", str(concurrency), "--poll-interval", "0.05"),
        )
        try:
            rate, peak = _relay_rate(url, n, p.pid)
            if kind == "postgres":
                _check_relayed_inbox(url, n)
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(30)
            os.unlink(f.name)
            if kind == "rabbitmq":
                count = _rabbitmq_take_queue(queue)
        if kind == "rabbitmq" and count < n:
            raise AssertionError(f"relay to RabbitMQ lost rows: {count} of {n}")
        if kind == "kafka":
            _check_kafka_topic(self.kafka().bootstrap, queue, n)
        return rate, peak

    def topology_latency(self, rate: float, seconds: float) -> dict[str, float]:
        """A→C latency through Kafka, in ms (p50, p99, max): three databases (A, B, C) linked by two
        relays, two topics and two bridges, B's worker publishing as it handles
        (tests/bench/topology.py); A publishes at ``rate`` a second for ``seconds``, once a warm-up
        has gone through. From A's commit to C's effect; nothing lost or doubled, each key in order."""
        from tests.bench import topology

        urls = (self.fresh(), self.fresh(), self.fresh())
        with tempfile.TemporaryDirectory(prefix="postbox-bench-topology-") as tmp:
            return topology.latency(urls, self.kafka().bootstrap, Path(tmp), rate, seconds)

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
                c.execute(READY_10K)
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
            return claim_complete_ms(c, samples)

    @contextmanager
    def latency_side(self, listen: bool) -> Iterator[LatencySide]:
        """Postbox's side of a receive-to-handler-start latency comparison, in a fresh database: one
        worker process (2 slots, batch 10), woken by LISTEN/NOTIFY or polling every 10 ms; its
        producer receives one message per call on an autocommit connection (one statement, as
        pgqueuer's enqueue of one job), each message its own key. Warmed up before it is timed."""
        url = self.fresh()
        args = ["--listen" if listen else "--no-listen", "--poll-interval", "0.05" if listen else "0.01"]
        p = spawn_postbox(
            *("--database-url", url, "worker", "--consumer", "bench", "--app", "tests.bench.app:registry"),
            *("--concurrency", "2", "--batch-size", "10", *args),
        )
        try:
            with (
                psycopg.connect(url, autocommit=True) as c,
                psycopg.connect(url, autocommit=True) as producer,
            ):
                wait(lambda: c.execute("SELECT count(*) FROM postbox.workers").fetchone()[0] == 1, 30)

                def send(i: int) -> None:
                    postbox.receive(producer, consumer="bench", message_id=str(i), key=f"k{i}", payload={})

                def effects() -> int:
                    return c.execute("SELECT count(*) FROM bench_effects").fetchone()[0]

                yield effects_side(c, send, effects)
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(30)


def _outbox_rows(url: str, n: int, keys: int) -> None:
    """``n`` outbox rows to destination ``out`` over ``keys`` keys, 1,000 per transaction."""
    with psycopg.connect(url) as c:
        for start in range(0, n, 1000):
            postbox.publish_many(
                c,
                [
                    {"destination": "out", "message_id": f"r{i}", "key": f"k{i % keys}", "payload": {"i": i}}
                    for i in range(start, min(start + 1000, n))
                ],
            )
            c.commit()


def _relay_rate(url: str, n: int, pid: int) -> tuple[float, float]:
    """Watch the outbox empty: rows/s, timed from the first row the relay takes out (its start-up is
    not counted), and the relay's peak RSS in MB."""
    peak, started, started_with, left = 0.0, 0.0, n, n
    with psycopg.connect(url, autocommit=True) as c:
        while left:
            peak = max(peak, rss_mb(pid))
            time.sleep(0.05)
            left = c.execute("SELECT count(*) FROM postbox.outbox").fetchone()[0]
            if not started and left < n:
                started, started_with = time.perf_counter(), left
    return started_with / (time.perf_counter() - started), peak


def _check_relayed_inbox(url: str, n: int) -> None:
    """Every row reached the receiving inbox once, in per-key order."""
    with psycopg.connect(url, autocommit=True) as c:
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


def _check_kafka_topic(bootstrap: str, topic: str, n: int) -> None:
    """Every row reached the topic (at least once: a retried send may write a row twice), each
    key's rows in order on one partition."""
    from tests.kafka_broker import read_topic

    records = read_topic(bootstrap, topic, timeout=60)
    order: dict[str, list[int]] = {}
    for r in records:  # partition by partition, in offset order
        seq = order.setdefault(r["key"], [])
        i = int(r["headers"]["postbox-message-id"][1:])
        if not seq or seq[-1] != i:
            seq.append(i)
    got = {i for seq in order.values() for i in seq}
    bad = sum(1 for seq in order.values() for a, b in itertools.pairwise(seq) if b < a)
    if len(got) != n or bad:
        raise AssertionError(f"relay to Kafka broke an invariant: {len(got)} of {n}, {bad} out of order")


def _rabbitmq_take_queue(queue: str) -> int:
    """How many messages the benchmark's queue holds; the queue is deleted."""
    import pika

    conn = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1:5672/%2F"))
    try:
        ch = conn.channel()
        count = int(ch.queue_declare(queue, durable=True, passive=True).method.message_count)
        ch.queue_delete(queue)
    finally:
        conn.close()
    return count

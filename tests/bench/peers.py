"""Peer queues on the same workloads, for `make bench`: procrastinate and pgqueuer (the `bench` extra).

Each peer gets its own fresh database on the same server (created by the harness), the same N and
K, and the same minimum work per message: one effect row inserted by the handler (in its own
transaction, as neither peer runs a handler inside the transaction that completes the job).

Worker processes are started by the harness as ``python -m tests.bench.peers worker KIND URL ...``;
they set up, print ``ready``, wait for a line on stdin (the start signal, so that interpreter start
and imports are not timed) and then work until terminated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import asyncpg
import psycopg
import psycopg_pool

from tests.bench.workloads import LatencySide, effects_side

REPO = Path(__file__).resolve().parents[2]

EFFECT_SQL = (
    "INSERT INTO bench_effects (message_id, key, seq, latency_ms)"
    " VALUES (%s, %s, %s, extract(epoch FROM clock_timestamp() - %s::timestamptz) * 1000)"
)


# --- setup and load (called in the harness process) ----------------------------------------------


def install(kind: str, url: str) -> None:
    """Install the peer's schema in a fresh database."""
    asyncio.run(_install(kind, url))


async def _install(kind: str, url: str) -> None:
    if kind == "procrastinate":
        app = _procrastinate_app(url)
        async with app.open_async():
            await app.schema_manager.apply_schema_async()
    else:
        conn = await asyncpg.connect(url)
        try:
            await _pgqueuer(conn).install()
        finally:
            await conn.close()


def procrastinate_preload(url: str, n: int, keys: int, ordered: bool) -> None:
    """Defer ``n`` jobs over ``keys`` keys, interleaved as for Postbox (with ``lock=<key>`` when
    ordered), 1,000 per call."""

    async def go() -> None:
        app = _procrastinate_app(url)
        _procrastinate_task(app, None)
        async with app.open_async():
            deferrers = [app.tasks["bench"].configure(lock=f"k{k}" if ordered else None) for k in range(keys)]
            for start in range(0, n, 1000):
                jobs = [
                    deferrers[i % keys].make_new_job(i=i, k=f"k{i % keys}", s=i // keys)
                    for i in range(start, min(start + 1000, n))
                ]
                await app.job_manager.batch_defer_jobs_async(jobs)

    asyncio.run(go())


def pgqueuer_enqueue(url: str, n: int, keys: int, batch: int) -> None:
    """Enqueue ``n`` jobs over ``keys`` keys in batches of ``batch`` (one statement each,
    autocommit): a peer drain's backlog."""
    producer = PgqueuerProducer(url)
    try:
        for start in range(0, n, batch):
            producer.enqueue_many(range(start, min(start + batch, n)), keys)
    finally:
        producer.close()


class PgqueuerProducer:
    """One autocommit connection enqueuing one job per call (the latency workload's producer)."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.conn = self.loop.run_until_complete(asyncpg.connect(url))
        self.queries = _pgqueuer(self.conn)

    def enqueue(self, i: int) -> None:
        payload = json.dumps({"i": i, "k": f"k{i}", "s": 0}).encode()
        self.loop.run_until_complete(self.queries.enqueue("bench", payload, 0))

    def enqueue_many(self, ids: range, keys: int, dedupe: bool = False) -> None:
        """Jobs ``ids`` over ``keys`` keys in one statement. With ``dedupe``, each carries a dedupe key
        and duplicates are skipped (``on_conflict="skip"``): pgqueuer's nearest to a deduplicating
        receive (its keys only cover queued and running jobs)."""
        payloads = [json.dumps({"i": i, "k": f"k{i % keys}", "s": i // keys}).encode() for i in ids]
        n = len(ids)
        if dedupe:
            enqueue = self.queries.enqueue(
                ["bench"] * n, payloads, [0] * n, [None] * n, [str(i) for i in ids], on_conflict="skip"
            )
        else:
            enqueue = self.queries.enqueue(["bench"] * n, payloads, [0] * n)
        self.loop.run_until_complete(enqueue)

    def close(self) -> None:
        self.loop.run_until_complete(self.conn.close())
        self.loop.close()


@contextmanager
def pgqueuer_side(
    url: str, batch: int, keys: int = 500, dedupe: bool = False
) -> Iterator[Callable[[range], None]]:
    """pgqueuer's side of an interleaved receive comparison (``workloads.interleaved``): one job
    per call (``batch`` 1, autocommit), or ``batch`` per statement over ``keys`` keys, with dedupe
    keys if ``dedupe``."""
    producer = PgqueuerProducer(url)
    try:

        def single(ids: range) -> None:
            for i in ids:
                producer.enqueue(i)

        def many(ids: range) -> None:
            for start in range(ids.start, ids.stop, batch):
                producer.enqueue_many(range(start, min(start + batch, ids.stop)), keys, dedupe)

        yield single if batch == 1 else many
    finally:
        producer.close()


# --- drains and latency (harness side) ------------------------------------------------------------


def _spawn(kind: str, url: str, concurrency: int, batch_size: int, log: IO[bytes]) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.peers", "worker", kind, url,
         "--concurrency", str(concurrency), "--batch-size", str(batch_size)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
    )  # fmt: skip
    assert p.stdout is not None
    if p.stdout.readline().strip() != b"ready":
        p.kill()
        raise RuntimeError(f"{kind} worker did not start (see its log)")
    return p


@contextmanager
def workers(
    kind: str, url: str, processes: int, concurrency: int, batch_size: int = 10
) -> Iterator[Callable[[], None]]:
    """Start ``processes`` peer workers, ready and waiting; yields the function that starts them all."""
    with tempfile.TemporaryFile() as log:
        procs = [_spawn(kind, url, concurrency, batch_size, log) for _ in range(processes)]

        def go() -> None:
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(b"go\n")
                p.stdin.flush()

        try:
            yield go
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def drain(
    kind: str,
    url: str,
    n: int,
    keys: int,
    ordered: bool,
    processes: int,
    concurrency: int,
    cap_seconds: float,
) -> tuple[float, int]:
    """Drain ``n`` preloaded jobs (or as many as ``cap_seconds`` allows): (jobs/s, per-key order
    violations). The rate is effect rows over their time span, so a capped run still measures."""
    if kind == "procrastinate":
        procrastinate_preload(url, n, keys, ordered)
    else:
        pgqueuer_enqueue(url, n, keys, 1000)
    with psycopg.connect(url, autocommit=True) as c, workers(kind, url, processes, concurrency) as go:
        c.execute("ANALYZE")  # as autovacuum would have by then: plans for the backlog, not an empty table
        go()
        t = time.perf_counter()
        done = 0
        while done < n and time.perf_counter() - t < cap_seconds:
            time.sleep(0.05)
            done = c.execute("SELECT count(*) FROM bench_effects").fetchone()[0]
        # From the first effect to the last: a peer's start-up time is not counted against it.
        count, span, bad = c.execute(
            "SELECT count(*), extract(epoch FROM max(at) - min(at)),"
            " (SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY key ORDER BY id) AS prev"
            "   FROM bench_effects) e WHERE prev IS NOT NULL AND seq <> prev + 1)"
            " FROM bench_effects"
        ).fetchone()
    return ((count - 1) / float(span) if count > 1 and span else 0.0), bad


@contextmanager
def pgqueuer_latency_side(url: str) -> Iterator[LatencySide]:
    """pgqueuer's side of the enqueue-to-handler-start latency comparison (one worker process, batch
    10, its handler writing through a pool of 2 connections; LISTEN/NOTIFY): one job per call,
    autocommit; warmed up as Postbox's side is."""
    producer = PgqueuerProducer(url)
    try:
        with psycopg.connect(url, autocommit=True) as c, workers("pgqueuer", url, 1, 2) as go:
            go()

            def effects() -> int:
                return c.execute("SELECT count(*) FROM bench_effects").fetchone()[0]

            yield effects_side(c, producer.enqueue, effects)
    finally:
        producer.close()


def _pgqueuer(conn: Any) -> Any:
    """pgqueuer's queries over asyncpg, its primary driver (its psycopg driver holds the connection
    in a 1 s notifies() wait, which stalls every dequeue)."""
    from pgqueuer import AsyncpgDriver, Queries

    return Queries(AsyncpgDriver(conn))


# --- worker processes ----------------------------------------------------------------------------


def _procrastinate_app(url: str) -> Any:
    import procrastinate

    return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))


def _procrastinate_task(app: Any, effects: psycopg_pool.AsyncConnectionPool[Any] | None) -> None:
    @app.task(name="bench", queue="bench", pass_context=True)
    async def bench(context: Any, i: int, k: str, s: int) -> None:  # latency not measured: no enqueue time
        assert effects is not None
        async with effects.connection() as c:
            await c.execute(EFFECT_SQL, (str(i), k, s, None))


async def _wait_for_start() -> None:
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def _procrastinate_worker(url: str, concurrency: int) -> None:
    effects = psycopg_pool.AsyncConnectionPool(url, min_size=concurrency, max_size=concurrency, open=False)
    await effects.open()
    app = _procrastinate_app(url)
    _procrastinate_task(app, effects)
    async with app.open_async():
        await _wait_for_start()
        await app.run_worker_async(
            queues=["bench"],
            concurrency=concurrency,
            wait=True,
            fetch_job_polling_interval=0.05,
            delete_jobs="successful",
            install_signal_handlers=True,
        )


async def _pgqueuer_worker(url: str, concurrency: int, batch_size: int) -> None:
    from datetime import timedelta

    from pgqueuer import QueueManager
    from pgqueuer.models import Job

    effects = await asyncpg.create_pool(url, min_size=concurrency, max_size=concurrency)
    qm = QueueManager(_pgqueuer(await asyncpg.connect(url)))

    @qm.entrypoint("bench")
    async def bench(job: Job) -> None:
        m = json.loads(job.payload or b"{}")
        await effects.execute(
            "INSERT INTO bench_effects (message_id, key, seq, latency_ms)"
            " VALUES ($1, $2, $3, extract(epoch FROM clock_timestamp() - $4::timestamptz) * 1000)",
            str(m["i"]), m["k"], m["s"], job.created,
        )  # fmt: skip

    await _wait_for_start()
    await qm.run(
        batch_size=batch_size,
        max_concurrent_tasks=int(os.environ.get("PGQ_MAX", "0")) or None,
        dequeue_timeout=timedelta(seconds=0.05),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="run a peer's worker until terminated")
    w.add_argument("kind", choices=["procrastinate", "pgqueuer"])
    w.add_argument("url")
    w.add_argument("--concurrency", type=int, default=2)
    w.add_argument("--batch-size", type=int, default=10)
    args = ap.parse_args()
    if args.kind == "procrastinate":
        asyncio.run(_procrastinate_worker(args.url, args.concurrency))
    else:
        asyncio.run(_pgqueuer_worker(args.url, args.concurrency, args.batch_size))


if __name__ == "__main__":
    main()

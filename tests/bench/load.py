"""Sustained load for `make bench`: producers and workers running together, at a ladder of rates.

Two worker processes (the CLI, 2 slots each, batches of up to 25, LISTEN/NOTIFY) handle what
producer processes receive at a fixed rate: each producer sends batches of 10 messages over 500 keys, one
``receive_many`` transaction a batch, on a schedule (a producer that falls behind sends at once
until it catches up). For each rate: the rate achieved, whether the backlog stayed bounded, and the
p99 of receive→commit (the effect's transaction, see scripts.EFFECT_DONE_TRIGGER). The ladder stops
after the first rate whose backlog grows; every rate is checked for lost, doubled or reordered
messages, and a run that breaks one fails.

Queue tables under sustained load need vacuuming (docs/operations.md): ``postbox maintain`` runs
beside the workers as the schema's owner, and its vacuum_queues job vacuums them every few seconds.
The server's autovacuum is left as it is (the results page's header says which): turned on in the
middle of a run on a server that had it off, it would first catch up with every other database.
"""

from __future__ import annotations

import multiprocessing
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg

import postbox
from tests.bench import report
from tests.bench.harness import Harness, rss_mb, wait
from tests.bench.scripts import EFFECT_DONE_TRIGGER
from tests.helpers import spawn_postbox

PRODUCERS = 2
BATCH = 10  # messages per producer transaction
# Under load, a batch amortises its claim, completion and commit over its messages, and holds each
# until the others are handled: on this machine 25 kept p99 under 100 ms at higher rates than 10
# (too many batches) or 50 (too long a hold).
WORKER_BATCH = report.SUSTAINED_WORKER_BATCH
KEYS = 500
WORKERS = 2
P99_LIMIT_MS = 100.0
GROWTH_SHARE = 0.02
DRAIN_GRACE_S = 5.0  # a bounded backlog is gone this soon after the producers stop
# Of the ordered drain's rate in the same run; finer where this machine's limit lies (between 0.3 and
# 0.5 of it: steps of a tenth there missed it by up to a third).
FRACTIONS = (0.1, 0.2, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass
class Rung:
    """One rate of the ladder."""

    target: float  # msg/s asked of the producers
    achieved: float  # msg/s they sent: messages / time from the start to the last commit
    growth: float  # the backlog's growth over the second half of the period (regression), messages
    seconds: float  # the period
    drained_s: float  # seconds the backlog took to empty after the producers stopped
    p50: float  # receive→commit, ms
    p99: float
    max: float

    @property
    def bounded(self) -> bool:
        """The backlog grew over the second half by less than 2 % of the messages asked in it (100
        at least, for the batches in flight), and was gone soon after the producers stopped."""
        bound = max(100.0, GROWTH_SHARE * self.target * self.seconds / 2)
        return self.growth <= bound and self.drained_s <= DRAIN_GRACE_S

    @property
    def ok(self) -> bool:
        return self.bounded and self.p99 < P99_LIMIT_MS


def _producer(url: str, p: int, commands: Any, results: Any) -> None:
    """A producer process: for each command (tag, rate, seconds, start), receive rate x seconds
    messages on schedule; reply (messages received as new, time of the last commit)."""
    with psycopg.connect(url) as c:
        results.put(("ready", p))
        while (command := commands.get()) is not None:
            tag, rate, seconds, start = command
            n, new = round(rate * seconds), 0
            for i in range(0, n, BATCH):
                delay = start + i / rate - time.time()
                if delay > 0:
                    time.sleep(delay)
                batch = [
                    {
                        "consumer": "bench",
                        "message_id": f"{tag}-p{p}-{j}",
                        "key": f"k{j % KEYS}",
                        "sequence": j,
                    }
                    | {"payload": {"j": j}}
                    for j in range(i, min(i + BATCH, n))
                ]
                new += sum(r.status == "new" for r in postbox.receive_many(c, batch))
                c.commit()
            results.put((new, time.time()))


def _workers(url: str, app: str) -> list[Any]:
    return [
        spawn_postbox(
            *("--database-url", url, "worker", "--consumer", "bench", "--app", f"tests.bench.app:{app}"),
            *("--concurrency", "2", "--batch-size", str(WORKER_BATCH), "--listen", "--poll-interval", "0.05"),
        )
        for _ in range(WORKERS)
    ]


def _growth(samples: list[tuple[float, int]], start: float, seconds: float) -> float:
    """The backlog's trend over the second half of the period (least squares), in messages."""
    half = [(t, n) for t, n in samples if t >= start + seconds / 2]
    if len(half) < 3:
        return 0.0
    slope = statistics.linear_regression([t for t, _ in half], [float(n) for _, n in half]).slope
    return slope * seconds / 2


def _check(c: psycopg.Connection[Any], tag: str, n: int) -> list[float]:
    """Every message of this rate gave exactly one effect, each producer's messages of a key in
    order; returns the receive→commit latencies (ms), sorted."""
    count, distinct, unfinished = c.execute(
        "SELECT count(*), count(DISTINCT message_id), count(*) FILTER (WHERE done_ms IS NULL)"
        " FROM bench_effects WHERE message_id LIKE %s",
        (f"{tag}-%",),
    ).fetchone()
    bad = c.execute(
        "SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY key, split_part(message_id, '-', 2)"
        " ORDER BY id) AS prev FROM bench_effects WHERE message_id LIKE %s) e WHERE seq <= prev",
        (f"{tag}-%",),
    ).fetchone()[0]
    if count != n or distinct != n or bad or unfinished:
        raise AssertionError(
            f"sustained load broke an invariant at {tag}: {count} effects ({distinct} distinct) for {n}"
            f" messages, {bad} out of order, {unfinished} without a commit time"
        )
    rows = c.execute("SELECT done_ms FROM bench_effects WHERE message_id LIKE %s", (f"{tag}-%",))
    return sorted(r[0] for r in rows.fetchall())


def _stopped(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a process told to stop; one still running after 30 s is reported (with its threads'
    stacks, where py-spy is installed), then killed, so that a slow stop costs the run no figures."""
    try:
        proc.wait(30)
        return
    except subprocess.TimeoutExpired:
        pass
    print(
        f"    ! {' '.join(map(str, proc.args[2:]))} did not stop within 30 s of SIGTERM: killed", flush=True
    )
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if Path(spy).exists():
        subprocess.run([spy, "dump", "--pid", str(proc.pid)], check=False, timeout=60)
    proc.kill()
    proc.wait(30)


class Producers:
    """The producer processes, each receiving its share of what it is told to send."""

    def __init__(self, url: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(PRODUCERS)]
        self.procs = [
            ctx.Process(target=_producer, args=(url, p, self.commands[p], self.results), daemon=True)
            for p in range(PRODUCERS)
        ]
        for proc in self.procs:
            proc.start()

    def ready(self) -> None:
        for _ in range(PRODUCERS):
            self.results.get(timeout=60)

    def send(self, tag: str, rate: float, seconds: float) -> float:
        """Have them send ``rate`` x ``seconds`` messages in all, on schedule, from the time returned."""
        start = time.time() + 0.2
        for q in self.commands:
            q.put((tag, rate / PRODUCERS, seconds, start))
        return start

    def sent(self, timeout: float) -> tuple[int, float]:
        """Once they are done: the messages received as new, and the time of the last commit."""
        replies = [self.results.get(timeout=timeout) for _ in range(PRODUCERS)]
        return sum(r[0] for r in replies), max(r[1] for r in replies)

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for proc in self.procs:
            proc.join(10)


class Load:
    """The workload's database, worker processes and producer processes."""

    def __init__(self, url: str, app: str) -> None:
        self.url = url
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute(EFFECT_DONE_TRIGGER)
        self.workers = _workers(url, app)
        # Deployed beside the workers, as the schema's owner here: it vacuums the queue tables.
        self.maintain = spawn_postbox("--database-url", url, "maintain")
        self.producers = Producers(url)
        self.peak = 0.0

    def ready(self) -> None:
        workers = "SELECT count(*) FILTER (WHERE kind = 'worker'), count(*) FROM postbox.workers"
        wait(lambda: self.conn.execute(workers).fetchone() == (WORKERS, WORKERS + 1), 30)
        self.producers.ready()
        self.rung("w", 100, 1)  # the workers' and producers' first batches

    def _sample(self, samples: list[tuple[float, int]]) -> None:
        self.peak = max(self.peak, *(rss_mb(w.pid) for w in self.workers))
        samples.append((time.time(), self.conn.execute("SELECT count(*) FROM postbox.inbox").fetchone()[0]))

    def rung(self, tag: str, rate: float, seconds: float) -> Rung:
        start = self.producers.send(tag, rate, seconds)
        samples: list[tuple[float, int]] = []
        while time.time() < start + seconds:
            time.sleep(max(0.0, start + len(samples) + 1 - time.time()))
            self._sample(samples)
        n, last = self.producers.sent(seconds + 120)
        stopped = time.time()
        wait(lambda: not self.conn.execute("SELECT EXISTS (SELECT 1 FROM postbox.inbox)").fetchone()[0], 300)
        drained = time.time() - stopped
        self.peak = max(self.peak, *(rss_mb(w.pid) for w in self.workers))
        lat = _check(self.conn, tag, n)
        quantiles = {"p50": lat[len(lat) // 2], "p99": lat[max(0, int(len(lat) * 0.99) - 1)], "max": lat[-1]}
        return Rung(rate, n / (last - start), _growth(samples, start, seconds), seconds, drained, **quantiles)

    def close(self) -> None:
        self.producers.close()
        for w in (*self.workers, self.maintain):
            w.send_signal(signal.SIGTERM)
        for w in (*self.workers, self.maintain):
            _stopped(w)
        self.conn.close()


def producers_alone(b: Harness, messages: int) -> float:
    """The producers of the ladder alone on the machine (no worker, no maintenance): the same
    processes sending ``messages`` in all, as fast as they can; msg/s. With the drain alone at the
    workers' batch (``DRAIN_SUSTAINED_BATCH``), it gives what producers and workers together can
    do when they share the machine's cores: 1 / (1/producers + 1/drain)."""
    url = b.fresh()
    producers = Producers(url)
    try:
        producers.ready()
        # A rate no producer keeps up with: each sends its share at once.
        rate = 1e9
        start = producers.send("alone", rate, messages / rate)
        n, last = producers.sent(600)
        if n != messages:
            raise AssertionError(f"producers alone: {n} of {messages} messages received as new")
        return n / (last - start)
    finally:
        producers.close()
        b.drop(url)


def _ladder(url: str, drain_rate: float, seconds: float, app: str) -> tuple[Load, list[Rung]]:
    load = Load(url, app)
    rungs: list[Rung] = []
    try:
        load.ready()
        for k, fraction in enumerate(FRACTIONS):
            rung = load.rung(f"r{k}", fraction * drain_rate, seconds)
            rungs.append(rung)
            print(
                f"    {fraction:.2f} x drain: {rung.achieved:,.0f} msg/s of {rung.target:,.0f}, backlog growth"
                f" {rung.growth:,.0f}, drained in {rung.drained_s:.1f} s, receive→commit p50 {rung.p50:.1f}"
                f" p99 {rung.p99:.1f} max {rung.max:.1f} ms: {'ok' if rung.ok else 'FAILED'}",
                flush=True,
            )
            if not rung.bounded:  # a higher rate would only pile up more
                break
    finally:
        load.close()
    return load, rungs


def sustained(
    b: Harness, drain_rate: float, seconds: float, app: str = "registry"
) -> tuple[Rung | None, float, list[Rung]]:
    """The ladder at FRACTIONS of ``drain_rate``, ``seconds`` each (up to the first whose backlog
    grows), with the handlers ``app`` of tests/bench/app.py (``registry``: one per message;
    ``batch_registry``: a batch handler): the highest rung with a bounded backlog and p99 under
    P99_LIMIT_MS (None if none), the workers' peak RSS (MB), every rung run."""
    url = b.fresh()
    try:
        load, rungs = _ladder(url, drain_rate, seconds, app)
    finally:
        b.drop(url)
    key = "sustained load rungs" if app == "registry" else f"sustained load rungs ({app})"
    b.extra.setdefault(key, []).append([asdict(r) | {"ok": r.ok} for r in rungs])
    best = max((r for r in rungs if r.ok), key=lambda r: r.achieved, default=None)
    return best, load.peak, rungs

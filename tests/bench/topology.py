"""Three services, each on its own database with its own Postbox schema, linked through Kafka
(docs/scaling.md): A's outbox → ``postbox relay`` → topic 1 → ``postbox bridge`` → B's inbox →
B's ``postbox worker`` (its effect and an event to B's outbox, in one transaction) → ``postbox
relay`` → topic 2 → ``postbox bridge`` → C's inbox → C's ``postbox worker`` (its effect).

Used by tests/test_kafka_topology.py (nothing lost or doubled end to end, a process killed on the
way) and by `make bench` (A→C latency at a steady rate). The handlers below are the workers' app
(``--app tests.bench.topology:registry``).
"""

from __future__ import annotations

import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

import postbox
from postbox.inbox.handlers import Context, Message, Registry
from tests.helpers import spawn_postbox

B, C = "service-b", "service-c"
TO_B, TO_C = "to-b", "to-c"
# Consumer-group timeouts short enough for Tansu to assign partitions within a second or two
# (tests/kafka_broker.py), and for a killed bridge's partitions to move on quickly; and a short
# fetch wait: Tansu answers a fetch only when fetch.wait.max.ms (500 ms by default) has passed, even
# with records there, where Kafka answers as soon as there are fetch.min.bytes (1).
GROUP = {
    "session.timeout.ms": 1000, "heartbeat.interval.ms": 200, "max.poll.interval.ms": 10_000,
    "fetch.wait.max.ms": 50,
}  # fmt: skip

EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS topology_effects (
    id          bigserial PRIMARY KEY,
    origin      text NOT NULL,        -- A's message id, carried in the payload end to end
    key         text NOT NULL,
    seq         bigint NOT NULL,
    prev_seq    bigint,               -- the key's last seq when this effect was made
    latency_ms  double precision NOT NULL  -- from A's commit (its payload's sent_at) to this effect
)"""

registry = Registry()


def _effect(message: Message, ctx: Context) -> None:
    """One effect row per message, with the key's previous seq (an order violation shows)."""
    payload = message.payload
    prev = ctx.conn.execute(
        "SELECT seq FROM topology_effects WHERE key = %s ORDER BY id DESC LIMIT 1", (message.key,)
    ).fetchone()
    ctx.conn.execute(
        "INSERT INTO topology_effects (origin, key, seq, prev_seq, latency_ms) VALUES (%s, %s, %s, %s,"
        " (extract(epoch FROM clock_timestamp()) - %s) * 1000)",
        (payload["origin"], message.key, payload["seq"], prev[0] if prev else None, payload["sent_at"]),
    )


@registry.handler(B)
def service_b(message: Message, ctx: Context) -> None:
    """B: its effect, and an event for C in B's outbox, in the message's transaction."""
    _effect(message, ctx)
    ctx.publish(TO_C, message.payload, key=message.key, message_id=f"b-{message.message_id}")


@registry.handler(C)
def service_c(message: Message, ctx: Context) -> None:
    """C: its effect."""
    _effect(message, ctx)


def publish(
    url: str, start: int, n: int, keys: int, rate: float | None = None, done: list[int] | None = None
) -> None:
    """Service A: messages ``start`` .. ``start + n - 1`` to its outbox, one transaction each (at
    ``rate`` a second, or as fast as it goes), each appended to ``done`` once committed; message i
    has key ``k{i % keys}`` and seq ``i // keys`` (a key's seqs follow its order)."""
    began = time.perf_counter()
    with psycopg.connect(url) as c:
        for i in range(start, start + n):
            if rate is not None:
                time.sleep(max(0.0, began + (i - start) / rate - time.perf_counter()))
            postbox.publish(
                c, destination=TO_B, payload=payload(i, keys), key=f"k{i % keys}", message_id=f"a-{i}"
            )
            c.commit()
            if done is not None:
                done.append(i)


def payload(i: int, keys: int) -> dict[str, Any]:
    return {"origin": f"a-{i}", "seq": i // keys, "sent_at": time.time()}


class Topology:
    """The three databases' processes (one of each), started, killed and restarted by name:
    ``relay-a``, ``bridge-b``, ``worker-b``, ``relay-b``, ``bridge-c``, ``worker-c``."""

    def __init__(self, urls: tuple[str, str, str], bootstrap: str, tmp: Path, partitions: int = 3) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        self.a, self.b, self.c = urls
        run = uuid.uuid4().hex[:8]
        self.topics = (f"topology-{run}-b", f"topology-{run}-c")
        admin = AdminClient({"bootstrap.servers": bootstrap})
        for future in admin.create_topics(
            [NewTopic(t, num_partitions=partitions, replication_factor=1) for t in self.topics]
        ).values():
            future.result(15)
        for url in (self.b, self.c):
            with psycopg.connect(url, autocommit=True) as c:
                c.execute(EFFECTS_DDL)
        configs = []
        for destination, topic in zip((TO_B, TO_C), self.topics, strict=True):
            path = tmp / f"relay-{destination}.toml"
            path.write_text(
                f'[destinations.{destination}]\nkind = "kafka"\nbootstrap_servers = "{bootstrap}"\n'
                f'topic = "{topic}"\nsettings = {{ "linger.ms" = 1 }}\n'
            )
            configs.append(str(path))
        query = "&".join(f"{k}={v}" for k, v in GROUP.items())

        def bridge(url: str, topic: str, consumer: str) -> list[str]:
            source = f"kafka://{bootstrap}/?group={topic}-bridge&{query}"
            return [
                "--database-url",
                url,
                "bridge",
                "--from",
                source,
                "--name",
                topic,
                "--consumer",
                consumer,
            ]

        def worker(url: str, consumer: str) -> list[str]:
            return [
                "--database-url", url, "worker", "--consumer", consumer, "--app", "tests.bench.topology:registry",
                "--concurrency", "2", "--batch-size", "20", "--poll-interval", "0.05",
            ]  # fmt: skip

        relay = ("relay", "--poll-interval", "0.05", "--batch-size", "100", "--concurrency", "2")
        self.commands: dict[str, list[str]] = {
            "relay-a": ["--config", configs[0], "--database-url", self.a, *relay],
            "bridge-b": bridge(self.b, self.topics[0], B),
            "worker-b": worker(self.b, B),
            "relay-b": ["--config", configs[1], "--database-url", self.b, *relay],
            "bridge-c": bridge(self.c, self.topics[1], C),
            "worker-c": worker(self.c, C),
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, *names: str) -> None:
        for name in names or tuple(self.commands):
            self.procs[name] = spawn_postbox(*self.commands[name])

    def kill(self, name: str) -> None:
        """kill -9, and wait for it to be gone."""
        p = self.procs.pop(name)
        p.send_signal(signal.SIGKILL)
        p.wait(30)

    def stop(self) -> dict[str, int]:
        """SIGTERM to every process; their exit statuses."""
        for p in self.procs.values():
            p.send_signal(signal.SIGTERM)
        statuses = {}
        for name, p in self.procs.items():
            try:
                statuses[name] = p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                statuses[name] = p.wait()
        self.procs.clear()
        return statuses

    def effects(self, url: str) -> list[tuple[str, str, int, int | None, float]]:
        """The effects of B or C: (origin, key, seq, prev_seq, latency_ms), in the order made."""
        with psycopg.connect(url, autocommit=True) as c:
            return c.execute(
                "SELECT origin, key, seq, prev_seq, latency_ms FROM topology_effects ORDER BY id"
            ).fetchall()

    def count(self, url: str) -> int:
        with psycopg.connect(url, autocommit=True) as c:
            row = c.execute("SELECT count(*) FROM topology_effects").fetchone()
        return int(row[0]) if row else 0


def violations(effects: list[tuple[str, str, int, int | None, float]], n: int, keys: int) -> list[str]:
    """What breaks "every one of A's n messages once, each key in order, gap-free": an empty list
    when nothing does."""
    out = []
    seen: dict[str, int] = {}
    for origin, _key, _seq, _prev, _lat in effects:
        seen[origin] = seen.get(origin, 0) + 1
    out += [f"{o} {k} times" for o, k in seen.items() if k > 1]
    out += [f"a-{i} missing" for i in range(n) if f"a-{i}" not in seen]
    last: dict[str, int] = {}
    for origin, key, seq, prev, _lat in effects:
        if prev != last.get(key) or seq != last.get(key, -1) + 1:
            out.append(f"{origin}: {key} seq {seq} after {prev} (expected after {last.get(key)})")
        last[key] = seq
    return out


WARM_UP = 30  # messages through A→C before the measured ones (group joins, first produce)


def start(t: Topology) -> None:
    """Start the processes: the relays first, A's first message sent (Tansu answers a producer's
    first request slowly while consumer groups join), then the bridges and workers."""
    t.start("relay-a", "relay-b")
    publish(t.a, 0, 1, 1)
    _wait(lambda: _outbox_empty(t.a), 60, "A's first message sent")
    t.start("bridge-b", "worker-b", "bridge-c", "worker-c")


def latency(
    urls: tuple[str, str, str], bootstrap: str, tmp: Path, rate: float, seconds: float
) -> dict[str, float]:
    """A→C latency in ms (p50, p99, max) at ``rate`` messages a second for ``seconds``, after a
    warm-up of :data:`WARM_UP` messages; fails if a message is lost, doubled or out of order."""
    keys = 50
    t = Topology(urls, bootstrap, tmp)
    n = WARM_UP + int(rate * seconds)
    try:
        start(t)
        publish(t.a, 1, WARM_UP - 1, keys)
        _wait(lambda: t.count(t.c) >= WARM_UP, 90, "the warm-up through to C")
        publish(t.a, WARM_UP, n - WARM_UP, keys, rate)
        _wait(lambda: t.count(t.c) >= n, 120, f"{n} effects in C")
    finally:
        t.stop()
    effects = t.effects(t.c)
    broken = violations(effects, n, keys)
    if broken:
        raise AssertionError(f"A→C broke an invariant: {broken[:5]}")
    lat = sorted(e[4] for e in effects if int(e[0][2:]) >= WARM_UP)
    return {"p50": lat[len(lat) // 2], "p99": lat[max(0, int(len(lat) * 0.99) - 1)], "max": lat[-1]}


def _outbox_empty(url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute("SELECT count(*) FROM postbox.outbox").fetchone()
    return row is not None and row[0] == 0


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise TimeoutError(f"not reached within {timeout} s: {what}")
        time.sleep(0.05)

"""The load side of the chaos harness: producers at a steady rate that log every message's outcome,
and a consumer on the broker side that logs what the relay delivered."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg

import postbox

Outcome = Literal["ok", "failed", "unknown"]
PRODUCER_APP = "chaos-producer"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


@dataclass(frozen=True)
class Sent:
    message_id: str
    key: str
    sequence: int
    outcome: Outcome


@dataclass
class ProducerLog:
    """Every message a producer tried to commit, with its outcome: ``ok`` (COMMIT acknowledged),
    ``failed`` (an error before COMMIT: rolled back for sure) or ``unknown`` (the connection was
    lost during COMMIT: it may or may not have committed)."""

    sent: list[Sent] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, s: Sent) -> None:
        with self.lock:
            self.sent.append(s)

    def count(self, outcome: Outcome) -> int:
        with self.lock:
            return sum(1 for s in self.sent if s.outcome == outcome)


class Producers:
    """``threads`` producers, together ``rate`` messages per second, each message in its own
    transaction; each thread owns its keys, so per key the sequence follows commit order."""

    def __init__(
        self, url: str, consumer: str, log: ProducerLog, *, rate: float, threads: int, keys: int
    ) -> None:
        self.url = url
        self.consumer = consumer
        self.log = log
        self.interval = threads / rate
        self.keys = keys
        self._halt = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"chaos-producer-{i}", daemon=True)
            for i in range(threads)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._halt.set()
        for t in self._threads:
            if t.ident is not None:  # started (a run that failed before the load began did not)
                t.join(30)

    def _connect(self) -> psycopg.Connection[Any] | None:
        try:
            return psycopg.connect(
                self.url,
                application_name=PRODUCER_APP,
                connect_timeout=3,
                options="-c statement_timeout=10000",
            )
        except psycopg.OperationalError:
            return None

    def _run(self, index: int) -> None:
        rng = random.Random(index)
        sequences: dict[str, int] = {}
        conn: psycopg.Connection[Any] | None = None
        due = time.monotonic()
        n = 0
        while not self._halt.is_set():
            due += self.interval
            if self._halt.wait(max(0.0, due - time.monotonic())):
                break
            key = f"p{index}/k{int(self.keys * rng.random() ** 1.5)}"  # skewed: k0 gets 1/keys ** (2/3)
            sequence = sequences.get(key, 0)
            sequences[key] = sequence + 1
            mid = f"m{index}-{n}"
            n += 1
            if conn is None or conn.closed or conn.broken:
                conn = self._connect()
                if conn is None:
                    self.log.add(Sent(mid, key, sequence, "failed"))
                    continue
            try:
                postbox.receive(
                    conn, consumer=self.consumer, message_id=mid, key=key, sequence=sequence, payload={"n": n}
                )
            except psycopg.Error:
                self.log.add(Sent(mid, key, sequence, "failed"))
                if not conn.broken:
                    try:
                        conn.rollback()
                    except psycopg.Error:
                        conn.close()
                continue
            try:
                conn.commit()
            except psycopg.Error:
                self.log.add(Sent(mid, key, sequence, "unknown"))
                conn.close()
                continue
            self.log.add(Sent(mid, key, sequence, "ok"))
        if conn is not None:
            conn.close()


@dataclass(frozen=True)
class Delivery:
    message_id: str
    key: str
    source: str
    sequence: int


class BrokerLog(threading.Thread):
    """Consumes a RabbitMQ queue directly (not through the proxy) and logs every delivery."""

    def __init__(self, queue: str) -> None:
        super().__init__(name="chaos-broker-log", daemon=True)
        import pika

        self.queue = queue
        self.received: list[Delivery] = []
        self._halt = threading.Event()
        self._conn = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
        self._channel = self._conn.channel()
        self._channel.queue_declare(queue, durable=True)
        self._channel.basic_qos(prefetch_count=1000)
        self._channel.basic_consume(queue, self._on_message, auto_ack=True)

    def _on_message(self, channel: Any, method: Any, props: Any, body: bytes) -> None:
        payload = json.loads(body)
        self.received.append(
            Delivery(props.message_id, props.headers["postbox-key"], payload["source"], payload["sequence"])
        )

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                self._conn.process_data_events(time_limit=0.2)
        finally:
            try:
                self._channel.queue_delete(self.queue)
            finally:
                self._conn.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)

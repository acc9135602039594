"""Broker transports: RabbitMQ (transactional batches), NATS JetStream (PubAck, ``Nats-Msg-Id``),
Redis Streams (XADD) and HTTP webhooks. Each sends the row's ``message_id`` so receivers can
deduplicate, and its key, type, correlation and causation ids.

Failures become outcomes: a broker that cannot be reached, refuses or times out is transient; a
message the broker rejects for good (unroutable, too large) is permanent. Their texts are masked
(:func:`postbox.config.settings.mask_text`): a broker URL's password never reaches a failure record or a
log line, and each transport registers its URL's secrets when it is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from postbox.config.settings import mask_text, register_url_secrets
from postbox.failures.outcomes import Permanent, Transient
from postbox.messages import to_json
from postbox.outbox.transports import OutboxRow

if TYPE_CHECKING:
    from postbox.inbox.http_handlers import OutboundPolicy

__all__ = ["HttpTransport", "NatsTransport", "RabbitMQTransport", "RedisStreamsTransport", "envelope_headers"]


def envelope_headers(row: OutboxRow) -> dict[str, str]:
    """What travels next to the payload: ids for deduplication and tracing, and the row's headers."""
    headers = {str(k): (v if isinstance(v, str) else json.dumps(v)) for k, v in row.headers.items()}
    headers.update(
        {
            "postbox-message-id": row.message_id,
            "postbox-key": row.key,
            "postbox-destination": row.destination,
            "postbox-created-at": row.created_at.isoformat(),
        }
    )
    for name, value in (
        ("postbox-type", row.type),
        ("postbox-correlation-id", row.correlation_id),
        ("postbox-causation-id", row.causation_id),
    ):
        if value is not None:
            headers[name] = value
    return headers


class RabbitMQTransport:
    """Publishes persistent messages; ``message_id`` and ``correlation_id`` are AMQP properties.
    Routing: ``exchange`` ("" is the default exchange) and ``routing_key`` (default: the
    destination's name, a durable queue declared on first use).

    A batch is published in one AMQP transaction: ``tx.commit-ok`` means the broker took every
    message of it (persisted, for durable queues), one round trip per batch instead of one
    confirm per message. Messages the broker cannot route come back (``mandatory``) and fail
    permanently; a commit that fails leaves the whole batch unpublished (transient).
    """

    def __init__(self, url: str, routing_key: str, exchange: str = "", declare_queue: bool = True) -> None:
        register_url_secrets(url)
        self.url = url
        self.exchange = exchange
        self.routing_key = routing_key
        self.declare_queue = declare_queue
        self._conn: Any = None
        self._channel: Any = None
        self._returned: set[str] = set()

    def _ensure(self) -> Any:
        import pika

        if self._channel is None or not self._channel.is_open:
            self.close()
            params = pika.URLParameters(self.url)
            params.socket_timeout = 5
            params.blocked_connection_timeout = 10
            self._conn = pika.BlockingConnection(params)
            self._channel = self._conn.channel()
            self._channel.add_on_return_callback(
                lambda ch, method, props, body: self._returned.add(props.message_id)
            )
            if self.declare_queue and self.exchange == "":
                self._channel.queue_declare(self.routing_key, durable=True)
            self._channel.tx_select()
        return self._channel

    def publish(self, rows: Sequence[OutboxRow]) -> list[BaseException | None]:
        import pika
        import pika.exceptions as px

        try:
            try:
                channel = self._ensure()
            except ValueError as error:  # pika refuses the URL (an unknown parameter, a bad value)
                self.close()
                return [Permanent(mask_text(f"RabbitMQ URL refused: {error}"))] * len(rows)
            self._returned.clear()
            for row in rows:
                channel.basic_publish(
                    self.exchange,
                    self.routing_key,
                    to_json(row.payload).encode(),
                    pika.BasicProperties(
                        content_type="application/json",
                        delivery_mode=pika.DeliveryMode.Persistent,
                        message_id=row.message_id,
                        correlation_id=row.correlation_id,
                        type=row.type,
                        timestamp=int(row.created_at.timestamp()),
                        headers=envelope_headers(row),
                    ),
                    mandatory=True,
                )
            channel.tx_commit()
            # basic.return frames come before commit-ok; dispatch them to the return callback.
            self._conn.process_data_events(time_limit=0)
        except (px.AMQPError, OSError) as error:
            self.close()
            return [Transient(mask_text(f"RabbitMQ unavailable: {type(error).__name__}: {error}"))] * len(
                rows
            )
        return [
            Permanent(f"RabbitMQ could not route it to {self.routing_key!r}")
            if r.message_id in self._returned
            else None
            for r in rows
        ]

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a broken connection
            if self._conn is not None and self._conn.is_open:
                self._conn.close()
        self._conn = self._channel = None


class RedisStreamsTransport:
    """XADD to a stream (``MAXLEN ~`` bound optional); one pipeline per batch. Fields: message_id,
    key, type, payload (JSON), headers (JSON), correlation_id, causation_id."""

    def __init__(self, url: str, stream: str, maxlen: int | None = None) -> None:
        import redis

        register_url_secrets(url)
        self.stream = stream
        self.maxlen = maxlen
        self._client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)

    def publish(self, rows: Sequence[OutboxRow]) -> list[BaseException | None]:
        import redis

        try:
            pipe = self._client.pipeline(transaction=False)
            for row in rows:
                fields = {
                    "message_id": row.message_id, "key": row.key, "type": row.type or "",
                    "payload": to_json(row.payload), "headers": to_json(envelope_headers(row)),
                    "correlation_id": row.correlation_id or "", "causation_id": row.causation_id or "",
                }  # fmt: skip
                pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]
            pipe.execute()
            return [None] * len(rows)
        except (redis.ConnectionError, redis.TimeoutError) as error:
            return [Transient(mask_text(f"Redis unavailable: {error}"))] * len(rows)
        except redis.ResponseError as error:
            return [Permanent(mask_text(f"Redis refused XADD: {error}"))] * len(rows)

    def close(self) -> None:
        self._client.close()


class NatsTransport:
    """Publishes to a JetStream subject and waits for each PubAck; ``Nats-Msg-Id`` carries the
    ``message_id`` so the stream itself drops a duplicate within its deduplication window. The
    stream is created on first use if it does not exist."""

    def __init__(self, url: str, subject: str, stream: str, timeout: float = 5.0) -> None:
        register_url_secrets(url)
        self.url = url
        self.subject = subject
        self.stream = stream
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="postbox-nats", daemon=True)
        self._thread.start()
        self._nc: Any = None
        self._js: Any = None

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self.timeout * 4)

    async def _ensure(self) -> Any:
        import nats

        if self._nc is None or self._nc.is_closed or not self._nc.is_connected:
            if self._nc is not None:
                await self._close()
            self._nc = await nats.connect(
                self.url, connect_timeout=self.timeout, max_reconnect_attempts=0, allow_reconnect=False
            )
            self._js = self._nc.jetstream(timeout=self.timeout)
            try:
                await self._js.stream_info(self.stream)
            except Exception:
                await self._js.add_stream(name=self.stream, subjects=[self.subject])
        return self._js

    async def _publish(self, rows: Sequence[OutboxRow]) -> list[BaseException | None]:
        results: list[BaseException | None] = []
        for i, row in enumerate(rows):
            try:
                js = await self._ensure()
                headers = {**envelope_headers(row), "Nats-Msg-Id": row.message_id}
                await js.publish(
                    self.subject, to_json(row.payload).encode(), headers=headers, timeout=self.timeout
                )
                results.append(None)
            except Exception as error:
                await self._close()
                failure = Transient(mask_text(f"NATS unavailable: {type(error).__name__}: {error}"))
                results.extend([failure] * (len(rows) - i))
                break
        return results

    def publish(self, rows: Sequence[OutboxRow]) -> list[BaseException | None]:
        try:
            result: list[BaseException | None] = self._run(self._publish(rows))
            return result
        except Exception as error:
            return [Transient(mask_text(f"NATS publish did not complete: {error}"))] * len(rows)

    async def _close(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.close()

    def close(self) -> None:
        try:
            self._run(self._close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)


class HttpTransport:
    """POSTs each row to a webhook: ``Idempotency-Key`` is the ``message_id``; with a secret, an
    HMAC signature as for HTTP handlers. Status codes are classified as for HTTP handlers, redirects
    are not followed, and ``outbound`` (the allow-list and private-network settings) applies as
    for HTTP handlers: a refused host fails each row permanently."""

    def __init__(
        self,
        url: str,
        timeout: float = 10.0,
        secret: bytes | None = None,
        headers: dict[str, str] | None = None,
        outbound: OutboundPolicy | None = None,
    ) -> None:
        import httpx

        from postbox.inbox.http_handlers import OutboundPolicy, http_client, register_request_secrets

        self.url = url
        self.secret = secret
        self.headers = dict(headers or {})
        register_request_secrets(url, secret, self.headers)
        self.outbound = outbound or OutboundPolicy()
        self._refusal = self.outbound.host_refusal(httpx.URL(url).host)
        self._client = http_client(timeout, 10, self.outbound)

    def publish(self, rows: Sequence[OutboxRow]) -> list[BaseException | None]:
        from postbox.inbox.http_handlers import post, raise_for_response, sign

        if self._refusal is not None:
            return [Permanent(self._refusal) for _ in rows]
        results: list[BaseException | None] = []
        for row in rows:
            body = to_json(
                {
                    "message_id": row.message_id,
                    "key": row.key,
                    "type": row.type,
                    "payload": row.payload,
                    "headers": row.headers,
                    "correlation_id": row.correlation_id,
                    "causation_id": row.causation_id,
                    "created_at": row.created_at.isoformat(),
                }
            ).encode()
            headers = {
                **self.headers,
                "Content-Type": "application/json",
                "Idempotency-Key": row.message_id,
                **{k.title(): v for k, v in envelope_headers(row).items() if k.startswith("postbox-")},
            }
            for trace in ("traceparent", "tracestate"):
                if isinstance(row.headers.get(trace), str):
                    headers[trace] = row.headers[trace]
            if self.secret is not None:
                stamp = str(int(time.time()))
                headers["X-Postbox-Timestamp"] = stamp
                headers["X-Postbox-Signature"] = sign(self.secret, stamp, body)
            try:
                raise_for_response(post(self._client, self.url, body, headers))
                results.append(None)
            except Exception as error:
                results.append(error)
        return results

    def close(self) -> None:
        self._client.close()

"""RabbitMQ: the transport publishes in AMQP transactions, the bridge source consumes a queue.

Needs the ``rabbitmq`` extra (pika). Failures become outcomes: a broker that cannot be reached,
refuses or times out is transient; a message the broker cannot route is permanent. Their texts
are masked (:func:`postbox.config.settings.mask_text`): the URL's password never reaches a
failure record or a log line.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from postbox.config.settings import mask_text, register_url_secrets
from postbox.extras import require
from postbox.failures.outcomes import Permanent, Transient
from postbox.messages import to_json
from postbox.outbox.transports import Incoming, OutboxRow, envelope_headers, text

__all__ = ["RabbitMQSource", "RabbitMQTransport", "source"]

EXTRA = "rabbitmq"
NAME = "RabbitMQ"

# pika logs every failed connection attempt itself, at ERROR, one with a traceback; Postbox says it
# in a line of its own (the relay's transient failure, the bridge's wait for its broker).
for _noisy in (
    "pika.adapters.blocking_connection",
    "pika.adapters.utils.connection_workflow",
    "pika.adapters.utils.io_services_utils",
):
    logging.getLogger(_noisy).setLevel(logging.CRITICAL)


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
        require(EXTRA, f"the {NAME} transport")
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
            # The channel's own basic_publish writes each message out before it returns (a socket
            # flush and a poll per message); its underlying channel only queues the frames, and
            # tx.commit flushes the batch with them, in order, in the same connection.
            publish = getattr(channel, "_impl", channel).basic_publish
            for row in rows:
                publish(
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


class RabbitMQSource:
    """Consumes a durable queue (declared if missing), ``prefetch`` messages unacknowledged at most.
    The id is the AMQP ``message_id`` (or a ``postbox-message-id`` header), the type the AMQP
    ``type`` (or ``postbox-type``)."""

    def __init__(self, url: str, queue: str, prefetch: int = 200) -> None:
        require(EXTRA, f"the {NAME} bridge source")
        import pika

        self.queue = queue
        self._conn = pika.BlockingConnection(pika.URLParameters(url))
        self._ch = self._conn.channel()
        self._ch.queue_declare(queue, durable=True)
        self._ch.basic_qos(prefetch_count=prefetch)
        self._gen = self._ch.consume(queue, inactivity_timeout=0.05)

    def fetch(self, limit: int, timeout: float) -> list[Incoming]:
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
                method.delivery_tag, props.message_id or text(h.get("postbox-message-id")),
                text(h.get("postbox-key")), props.type or text(h.get("postbox-type")), body, h,
                props.correlation_id or text(h.get("postbox-correlation-id")), text(h.get("postbox-causation-id")),
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


TRANSPORT = RabbitMQTransport


def source(url: str, name: str) -> RabbitMQSource:
    """The bridge source of ``postbox bridge --from amqp://...``: ``name`` is the queue."""
    return RabbitMQSource(url, name)

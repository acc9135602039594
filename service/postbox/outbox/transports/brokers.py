"""The broker transports, now one module per broker (rabbitmq, nats, redis, http): these names stay
importable from here until every caller takes them from their broker's module."""

from postbox.outbox.transports import envelope_headers
from postbox.outbox.transports.http import HttpTransport
from postbox.outbox.transports.nats import NatsTransport
from postbox.outbox.transports.rabbitmq import RabbitMQTransport
from postbox.outbox.transports.redis import RedisStreamsTransport

__all__ = ["HttpTransport", "NatsTransport", "RabbitMQTransport", "RedisStreamsTransport", "envelope_headers"]

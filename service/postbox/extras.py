"""Optional dependencies: the broker clients, httpx and the embedded PostgreSQL are extras
(``pip install 'postbox[rabbitmq]'``). What needs one checks for it first, so that a missing
extra is one line naming it (:class:`postbox.errors.MissingExtra`), not an ``ImportError`` from
deep inside."""

from __future__ import annotations

import importlib
from types import ModuleType

from postbox.errors import MissingExtra

__all__ = ["EXTRAS", "require"]

# extra -> the module its package provides
EXTRAS = {
    "rabbitmq": "pika",
    "nats": "nats",
    "redis": "redis",
    "kafka": "confluent_kafka",
    "http": "httpx",
    "embedded": "pgserver",
}


def require(extra: str, what: str) -> ModuleType:
    """The module of ``extra``, imported; :class:`MissingExtra` saying that ``what`` (e.g. "the
    RabbitMQ transport") needs it if it is not installed."""
    try:
        return importlib.import_module(EXTRAS[extra])
    except ImportError:
        raise MissingExtra(what, extra) from None

"""Postbox: a transactional inbox and outbox on PostgreSQL.

The public API is what this module exports; everything else is machinery.
"""

from postbox.errors import ConfigError, InvalidMessage, InvalidRequest, PostboxError
from postbox.messages import InboxMessage, OutboxMessage, ReceiveResult, ReceiveStatus
from postbox.producer import (
    declare_consumer,
    publish,
    publish_async,
    publish_many,
    publish_many_async,
    receive,
    receive_async,
    receive_many,
    receive_many_async,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "InboxMessage",
    "InvalidMessage",
    "InvalidRequest",
    "OutboxMessage",
    "PostboxError",
    "ReceiveResult",
    "ReceiveStatus",
    "__version__",
    "declare_consumer",
    "publish",
    "publish_async",
    "publish_many",
    "publish_many_async",
    "receive",
    "receive_async",
    "receive_many",
    "receive_many_async",
]

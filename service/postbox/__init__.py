"""Postbox: a transactional inbox and outbox on PostgreSQL.

The public API is what this module exports (``__all__``); the subpackages are machinery and may
change between releases:

- write messages inside your own transaction: :func:`receive` (inbox), :func:`publish` (outbox),
  their ``_many`` (batch) and ``_async`` forms, and :func:`declare_consumer`;
- handle them: a :class:`Registry` of handlers, each given a :class:`Message` and a
  :class:`Context` (or, for a batch handler, the messages of a batch and a :class:`BatchContext`),
  saying how an attempt ended with :class:`Retry`, :class:`Permanent` or
  :class:`UnknownOutcome` (or any exception, classified by the rules);
- run them: :class:`Worker` (the inbox) and :class:`Relay` (the outbox) as the ``postbox``
  command does, or embedded in your own program;
- configure them: :class:`Settings`;
- errors Postbox raises: :class:`PostboxError` and its subclasses.
"""

from postbox._version import __version__
from postbox.config.settings import Settings
from postbox.errors import ConfigError, InvalidMessage, InvalidRequest, PostboxError
from postbox.failures.outcomes import Permanent, Retry, Transient, UnknownOutcome
from postbox.inbox.connection import HandlerEndedTransaction
from postbox.inbox.consumers import declare_consumer
from postbox.inbox.handlers import AsyncBatchContext, AsyncContext, BatchContext, Context, Message, Registry
from postbox.inbox.receive import receive, receive_async, receive_many, receive_many_async
from postbox.inbox.worker import Worker, WorkerSettings
from postbox.messages import InboxMessage, OutboxMessage, ReceiveResult, ReceiveStatus
from postbox.outbox.publish import publish, publish_async, publish_many, publish_many_async
from postbox.outbox.relay import Relay, RelaySettings

__all__ = [
    "AsyncBatchContext",
    "AsyncContext",
    "BatchContext",
    "ConfigError",
    "Context",
    "HandlerEndedTransaction",
    "InboxMessage",
    "InvalidMessage",
    "InvalidRequest",
    "Message",
    "OutboxMessage",
    "Permanent",
    "PostboxError",
    "ReceiveResult",
    "ReceiveStatus",
    "Registry",
    "Relay",
    "RelaySettings",
    "Retry",
    "Settings",
    "Transient",
    "UnknownOutcome",
    "Worker",
    "WorkerSettings",
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

"""Handlers that are HTTP endpoints: the message is POSTed as JSON.

Headers: ``Idempotency-Key`` (the message's stable key: the same on every retry and replay),
``X-Postbox-Message-Id``, ``X-Postbox-Attempt``, ``X-Correlation-Id``, ``traceparent`` when the
message carries one, and with a secret ``X-Postbox-Timestamp`` and ``X-Postbox-Signature``
(``sha256=`` HMAC of ``timestamp + "." + body``).

Outcomes: 2xx success; 408, 429, 5xx and timeouts transient (``Retry-After`` honoured); other 4xx
permanent; a refused connection transient; a response lost after the request was sent (the server
closed the connection) an unknown outcome, retried only if the endpoint is declared idempotent.
Connections are pooled and kept alive; ``max_concurrency`` bounds the requests in flight per
endpoint across all slots of the process. Redirects are never followed (a 3xx is a permanent
failure): a request goes to the configured URL or nowhere.

What an endpoint shares with the HTTP transport (the client, the outbound policy of
``http_allowed_hosts`` and ``http_deny_private_networks``, signatures, the classification of
responses, masked error texts) is in :mod:`postbox.outbox.transports.http`. Needs the ``http``
extra (httpx), checked when an endpoint is made.
"""

from __future__ import annotations

import threading

from postbox.inbox.handlers import Context, Message
from postbox.inbox.sql_handlers import message_document
from postbox.messages import to_json
from postbox.outbox.transports.http import HttpTarget, OutboundPolicy

__all__ = ["HttpEndpoint"]


class HttpEndpoint:
    """A handler that POSTs each message to ``url``. Thread-safe; share one per endpoint."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 10.0,
        max_concurrency: int = 8,
        secret: bytes | None = None,
        headers: dict[str, str] | None = None,
        outbound: OutboundPolicy | None = None,
    ) -> None:
        self.target = HttpTarget(
            url, timeout, secret, headers, outbound, max_connections=max_concurrency, what="HTTP handler"
        )
        self.url = url
        self._gate = threading.BoundedSemaphore(max_concurrency)

    def close(self) -> None:
        self.target.close()

    def __call__(self, message: Message, ctx: Context) -> None:
        body = to_json({**message_document(message), "attempt": message.attempt}).encode()
        headers = {
            "Idempotency-Key": ctx.idempotency_key,
            "X-Postbox-Message-Id": message.message_id,
            "X-Postbox-Attempt": str(message.attempt),
            "X-Correlation-Id": message.correlation_id or message.message_id,
        }
        traceparent = message.headers.get("traceparent") if isinstance(message.headers, dict) else None
        if isinstance(traceparent, str):
            headers["traceparent"] = traceparent
        with self._gate:
            self.target.post(body, headers)

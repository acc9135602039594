"""Handlers that are HTTP endpoints: the message is POSTed as JSON.

Headers: ``Idempotency-Key`` (the message's stable key: the same on every retry and replay),
``X-Postbox-Message-Id``, ``X-Postbox-Attempt``, ``X-Correlation-Id``, ``traceparent`` when the
message carries one, and with a secret ``X-Postbox-Timestamp`` and ``X-Postbox-Signature``
(``sha256=`` HMAC of ``timestamp + "." + body``).

Outcomes: 2xx success; 408, 429, 5xx and timeouts transient (``Retry-After`` honoured); other 4xx
permanent; a refused connection transient; a response lost after the request was sent (the server
closed the connection) an unknown outcome, retried only if the endpoint is declared idempotent.
Connections are pooled and kept alive; ``max_concurrency`` bounds the requests in flight per
endpoint across all slots of the process.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx

from service.handlers import Context, Message
from service.messages import to_json
from service.outcomes import Permanent, Retry, Transient, UnknownOutcome
from service.sql_handlers import message_document

__all__ = ["HttpEndpoint", "post", "raise_for_response", "retry_after_seconds", "sign"]


def sign(secret: bytes, timestamp: str, body: bytes) -> str:
    """The signature header value a receiver recomputes to authenticate a request."""
    return "sha256=" + hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def retry_after_seconds(value: str | None, now: datetime | None = None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date; None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


class HttpEndpoint:
    """A handler that POSTs each message to ``url``. Thread-safe; share one per endpoint."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 10.0,
        secret: bytes | None = None,
        headers: dict[str, str] | None = None,
        max_concurrency: int = 8,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"postbox: HTTP handler URL must start with http:// or https:// (got {url!r})")
        self.url = url
        self.secret = secret
        self.headers = dict(headers or {})
        self._gate = threading.BoundedSemaphore(max_concurrency)
        self._client = httpx.Client(
            timeout=httpx.Timeout(timeout),
            limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency),
        )

    def close(self) -> None:
        self._client.close()

    def __call__(self, message: Message, ctx: Context) -> None:
        body = to_json({**message_document(message), "attempt": message.attempt}).encode()
        headers = {
            **self.headers,
            "Content-Type": "application/json",
            "Idempotency-Key": ctx.idempotency_key,
            "X-Postbox-Message-Id": message.message_id,
            "X-Postbox-Attempt": str(message.attempt),
            "X-Correlation-Id": message.correlation_id or message.message_id,
        }
        traceparent = message.headers.get("traceparent") if isinstance(message.headers, dict) else None
        if isinstance(traceparent, str):
            headers["traceparent"] = traceparent
        if self.secret is not None:
            stamp = str(int(time.time()))
            headers["X-Postbox-Timestamp"] = stamp
            headers["X-Postbox-Signature"] = sign(self.secret, stamp, body)
        with self._gate:
            response = post(self._client, self.url, body, headers)
        raise_for_response(response)


def raise_for_response(response: httpx.Response) -> None:
    """Success for 2xx; else the outcome its status means (Retry-After honoured)."""
    status = response.status_code
    if 200 <= status < 300:
        return
    detail = f"HTTP {status}: {response.text[:200]}".strip()
    if status in (408, 425, 429) or status >= 500:
        after = retry_after_seconds(response.headers.get("Retry-After"))
        raise Retry(after=after, reason=detail) if after is not None else Transient(detail)
    raise Permanent(detail)


def post(client: httpx.Client, url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    """POST, turning transport errors into outcomes: timeouts and refused connections are
    transient; a response lost after the request was sent is an unknown outcome."""
    try:
        return client.post(url, content=body, headers=headers)
    except httpx.TimeoutException as error:
        raise Transient(f"HTTP request timed out: {type(error).__name__}") from error
    except httpx.ConnectError as error:
        raise Transient(f"HTTP connection failed: {error}") from error
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as error:
        raise UnknownOutcome(f"HTTP response lost after the request was sent: {error}") from error

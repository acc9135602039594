"""Outbound HTTP: the HTTP transport (each outbox row POSTed to a webhook), and what it shares with
HTTP handlers (:mod:`postbox.inbox.http_handlers`): the endpoint's URL, secrets and pooled client
(:class:`HttpTarget`), the outbound policy, signatures, and the classification of responses.

Needs the ``http`` extra (httpx), imported when a client is made: the outbound policy is plain
Python, so reading the settings never needs it.

Outcomes: 2xx success; 408, 425, 429, 5xx and timeouts transient (``Retry-After`` honoured); other
4xx permanent; a refused connection transient; a response lost after the request was sent (the
server closed the connection) an unknown outcome. Redirects are never followed (a 3xx is a
permanent failure): a request goes to the configured URL or nowhere.

Outbound policy (:class:`OutboundPolicy`, off by default): ``http_allowed_hosts`` limits the hosts
called; ``http_deny_private_networks`` refuses loopback, private, link-local and other non-public
addresses, checked on the addresses a name resolves to when the connection is made (so a name that
later resolves elsewhere is caught too). A refused request is a permanent failure naming the host
and the setting. Error texts are masked (:func:`postbox.config.settings.mask_text`): a server
echoing the URL's token does not put it in the failure records.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any

from postbox.config.masking import (
    host_pattern,
    is_secret_name,
    mask_text,
    register_secret,
    register_url_secrets,
)
from postbox.extras import require
from postbox.failures.outcomes import Permanent, Retry, Transient, UnknownOutcome
from postbox.messages import to_json
from postbox.outbox.transports import OutboxRow, envelope_headers

if TYPE_CHECKING:
    import httpcore
    import httpx

__all__ = [
    "HostRefused",
    "HttpTarget",
    "HttpTransport",
    "OutboundPolicy",
    "http_client",
    "post",
    "raise_for_response",
    "retry_after_seconds",
    "sign",
]

EXTRA = "http"
NAME = "HTTP"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class HostRefused(Exception):
    """A request the outbound HTTP settings do not allow (a permanent failure)."""


def _public(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


@dataclass(frozen=True)
class OutboundPolicy:
    """Where HTTP handlers and the HTTP transport may send requests. The default allows any host.

    ``allowed_hosts``: host names, ``*.domain`` (its subdomains), IP addresses and networks (CIDR;
    they match a URL whose host is an IP address); empty: any host. ``deny_private_networks``:
    refuse every address that is not public (loopback, RFC 1918, link-local such as cloud
    metadata, unique-local, CGNAT, reserved, multicast), checked on resolved addresses."""

    allowed_hosts: tuple[str, ...] = ()
    deny_private_networks: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_hosts", tuple(host_pattern(h) for h in self.allowed_hosts))

    def host_refusal(self, host: str) -> str | None:
        """Why ``host`` (a URL's host) may not be called, or None."""
        name = host.lower().rstrip(".").strip("[]")
        if self.allowed_hosts and not any(_matches(pattern, name) for pattern in self.allowed_hosts):
            return (
                f"outbound HTTP to {name} refused: the host is not in http_allowed_hosts "
                "([postbox] in the configuration file, or POSTBOX_HTTP_ALLOWED_HOSTS); add it there "
                "to allow it"
            )
        return self.address_refusal(name, _ip(name))

    def address_refusal(self, host: str, address: IPAddress | None) -> str | None:
        """Why connecting to ``address`` (``host`` resolved) is refused, or None."""
        if self.deny_private_networks and address is not None and not _public(address):
            shown = host if host == str(address) else f"{host} ({address})"
            return (
                f"outbound HTTP to {shown} refused: not a public address, and "
                "http_deny_private_networks is set ([postbox] in the configuration file, or "
                "POSTBOX_HTTP_DENY_PRIVATE_NETWORKS); list the host in http_allowed_hosts and turn "
                "http_deny_private_networks off to call it"
            )
        return None


def _ip(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def _matches(pattern: str, host: str) -> bool:
    if "/" in pattern:
        address = _ip(host)
        return address is not None and address in ipaddress.ip_network(pattern)
    if pattern.startswith("*."):
        return host.endswith(pattern[1:]) and len(host) > len(pattern) - 1
    address, wanted = _ip(host), _ip(pattern)
    if address is not None and wanted is not None:
        return address == wanted
    return host == pattern


@functools.cache
def _guarded_backend() -> Callable[[OutboundPolicy], httpcore.SyncBackend]:
    """The network backend that checks addresses (defined on first use: httpcore comes with httpx)."""
    import httpcore

    class GuardedBackend(httpcore.SyncBackend):
        """Resolves the host itself, refuses addresses the policy does not allow, and connects to
        the address it checked (not to a second resolution of the name)."""

        def __init__(self, policy: OutboundPolicy) -> None:
            self.policy = policy

        def connect_tcp(
            self,
            host: str,
            port: int,
            timeout: float | None = None,
            local_address: str | None = None,
            socket_options: Iterable[Any] | None = None,
        ) -> httpcore.NetworkStream:
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as error:
                raise httpcore.ConnectError(f"cannot resolve {host}: {error}") from error
            addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
            for address in addresses:
                refusal = self.policy.address_refusal(host, address)
                if refusal is not None:
                    raise HostRefused(refusal)
            last: Exception | None = None
            for info in infos:
                try:
                    return super().connect_tcp(str(info[4][0]), port, timeout, local_address, socket_options)
                except (httpcore.ConnectError, httpcore.ConnectTimeout) as error:
                    last = error
            raise last or httpcore.ConnectError(f"no address for {host}")

    return GuardedBackend


def http_client(timeout: float, max_connections: int, policy: OutboundPolicy | None = None) -> httpx.Client:
    """An HTTP client that never follows redirects, pools and keeps ``max_connections`` alive, and
    with ``policy.deny_private_networks`` checks every address it connects to."""
    import httpcore
    import httpx

    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    if policy is None or not policy.deny_private_networks:
        return httpx.Client(timeout=httpx.Timeout(timeout), limits=limits, follow_redirects=False)
    transport = httpx.HTTPTransport(limits=limits)
    # The pool httpx builds, with the checking network backend (httpx has no public option for it;
    # a transport given explicitly also turns off proxies from the environment, which would
    # otherwise be connected to instead of the checked address).
    if not isinstance(getattr(transport, "_pool", None), httpcore.ConnectionPool):
        raise RuntimeError("postbox: this httpx version cannot check addresses (http_deny_private_networks)")
    transport._pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=_guarded_backend()(policy),
    )
    return httpx.Client(timeout=httpx.Timeout(timeout), transport=transport, follow_redirects=False)


def register_request_secrets(url: str, secret: bytes | None, headers: dict[str, str]) -> None:
    """Mask the URL's password and secret parameters, the HMAC secret and secret header values in
    every output of this process."""
    register_url_secrets(url)
    if secret is not None:
        register_secret(secret.decode(errors="replace"))
    for name, value in headers.items():
        if is_secret_name(name):
            register_secret(value)
            register_secret(value.partition(" ")[2])  # "Bearer <token>"


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


def raise_for_response(response: httpx.Response) -> None:
    """Success for 2xx; else the outcome its status means (Retry-After honoured)."""
    status = response.status_code
    if 200 <= status < 300:
        return
    # Masked before it is cut: a cut could leave half a URL whose password no longer looks like one.
    detail = f"HTTP {status}: {mask_text(response.text[:8000])[:200]}".strip()
    if status in (408, 425, 429) or status >= 500:
        after = retry_after_seconds(response.headers.get("Retry-After"))
        raise Retry(after=after, reason=detail) if after is not None else Transient(detail)
    raise Permanent(detail)


def post(client: httpx.Client, url: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    """POST, turning transport errors into outcomes: timeouts and refused connections are
    transient; a response lost after the request was sent is an unknown outcome; a host the
    outbound policy refuses is permanent. Error texts are masked; the causes are not chained (their
    texts could hold the URL)."""
    import httpx

    try:
        return client.post(url, content=body, headers=headers)
    except HostRefused as error:
        raise Permanent(str(error)) from None
    except httpx.TimeoutException as error:
        raise Transient(f"HTTP request timed out: {type(error).__name__}") from None
    except httpx.ConnectError as error:
        raise Transient(mask_text(f"HTTP connection failed: {error}")) from None
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as error:
        raise UnknownOutcome(mask_text(f"HTTP response lost after the request was sent: {error}")) from None


class HttpTarget:
    """One endpoint's outbound side: its URL (http:// or https://), secrets masked from every
    output, the policy's verdict on its host, and a pooled client of ``max_connections``.
    Thread-safe. ``what`` names its user in errors ("HTTP handler", "HTTP transport")."""

    what = "HTTP endpoint"

    def __init__(
        self,
        url: str,
        timeout: float = 10.0,
        secret: bytes | None = None,
        headers: dict[str, str] | None = None,
        outbound: OutboundPolicy | None = None,
        *,
        max_connections: int = 10,
        what: str | None = None,
    ) -> None:
        self.what = what or self.what
        require(EXTRA, f"the {self.what}")
        import httpx

        if not url.startswith(("http://", "https://")):
            raise ValueError(
                f"postbox: {self.what} URL must start with http:// or https:// (got {mask_text(url)!r})"
            )
        self.url = url
        self.secret = secret
        self.headers = dict(headers or {})
        register_request_secrets(url, secret, self.headers)
        self.outbound = outbound or OutboundPolicy()
        self.refusal = self.outbound.host_refusal(httpx.URL(url).host)
        self.client = http_client(timeout, max_connections, self.outbound)

    def post(self, body: bytes, headers: dict[str, str]) -> None:
        """POST a JSON ``body`` with the configured headers, ``headers`` and, with a secret, a
        signature; returns on 2xx, raises the outcome otherwise (a refused host: permanent)."""
        if self.refusal is not None:
            raise Permanent(self.refusal)
        sent = {**self.headers, "Content-Type": "application/json", **headers}
        if self.secret is not None:
            stamp = str(int(time.time()))
            sent["X-Postbox-Timestamp"] = stamp
            sent["X-Postbox-Signature"] = sign(self.secret, stamp, body)
        raise_for_response(post(self.client, self.url, body, sent))

    def close(self) -> None:
        self.client.close()


class HttpTransport(HttpTarget):
    """POSTs each row to a webhook: ``Idempotency-Key`` is the ``message_id``; with a secret, an
    HMAC signature as for HTTP handlers. Status codes are classified as for HTTP handlers, redirects
    are not followed, and ``outbound`` (the allow-list and private-network settings) applies as
    for HTTP handlers: a refused host fails each row permanently."""

    what = f"{NAME} transport"

    def publish(self, rows: Sequence[OutboxRow]) -> list[BaseException | None]:
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
                "Idempotency-Key": row.message_id,
                **{k.title(): v for k, v in envelope_headers(row).items() if k.startswith("postbox-")},
            }
            for trace in ("traceparent", "tracestate"):
                if isinstance(row.headers.get(trace), str):
                    headers[trace] = row.headers[trace]
            try:
                self.post(body, headers)
                results.append(None)
            except Exception as error:
                results.append(error)
        return results


TRANSPORT = HttpTransport

"""Prometheus metrics: the HTTP endpoint of a Postbox process (``/metrics``, ``/healthz``,
``/readyz``) and what it serves, of two kinds:

- **process counters and histograms** (:mod:`postbox.operations.counters`), updated by the worker,
  relay, bridge and maintenance as things happen; re-exported here, where their users take them;
- **database gauges** (:mod:`postbox.operations.database_gauges`), read by one query on a timer.

The endpoint is prometheus_client's own WSGI application (``make_wsgi_app``: gzip when asked,
OpenMetrics when asked, ``?name[]=`` filters) on its threaded wsgiref server, behind a small
dispatcher that adds ``/healthz``, ``/readyz`` and ``HEAD``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from postbox.operations import counters
from postbox.operations.counters import *  # noqa: F403 (re-exported: their users take them from here)
from postbox.operations.counters import BUILD, REGISTRY
from postbox.operations.database_gauges import DATABASE_GAUGES, DatabaseMetrics

__all__ = [
    "DATABASE_GAUGES",
    "DatabaseMetrics",
    "MetricsServer",
    "exposed_names",
    "metrics_app",
    "start_observability",
]
__all__ += counters.__all__

log = logging.getLogger("postbox.metrics")

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
TEXT = "text/plain; charset=utf-8"


def _not_ready_reason(ready: Callable[[], bool]) -> str:
    """Why ``ready`` says no: its ``reason()`` if it has one (the process runtime's does)."""
    reason = getattr(ready, "reason", None)
    try:
        said = reason() if callable(reason) else None
    except Exception:
        said = None
    return str(said or "the service is not ready")


def _readiness(ready: Callable[[], bool]) -> tuple[bool, str]:
    try:
        ok = bool(ready())
    except Exception as error:  # a broken check is "not ready", with what broke
        return False, f"readiness check failed: {type(error).__name__}: {error}"
    return (True, "ready") if ok else (False, _not_ready_reason(ready))


def metrics_app(registry: CollectorRegistry = REGISTRY, ready: Callable[[], bool] = lambda: True) -> WsgiApp:
    """The WSGI application of the endpoint: ``/metrics`` is prometheus_client's ``make_wsgi_app``
    (``HEAD`` answered as ``GET`` without the body), ``/healthz`` 200 while the process runs,
    ``/readyz`` 200 when ``ready()`` is true, else 503 with the reason (``ready.reason()`` when the
    callable has one); anything else 404."""
    prometheus = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "") or "/"
        method = environ.get("REQUEST_METHOD", "GET")
        head = method == "HEAD"
        if path == "/metrics":
            if not head:
                return prometheus(environ, start_response)  # type: ignore[no-any-return]
            return _head(prometheus, dict(environ, REQUEST_METHOD="GET"), start_response)
        if method not in ("GET", "HEAD"):
            return _reply(
                start_response, "405 Method Not Allowed", b"use GET or HEAD\n", head, [("Allow", "GET, HEAD")]
            )
        if path == "/healthz":
            return _reply(start_response, "200 OK", b"ok\n", head)
        if path == "/readyz":
            ok, why = _readiness(ready)
            body = f"{why}\n" if ok else f"not ready: {why}\n"
            return _reply(start_response, "200 OK" if ok else "503 Service Unavailable", body.encode(), head)
        return _reply(
            start_response, "404 Not Found", b"not found: try /metrics, /healthz or /readyz\n", head
        )

    return app


def _reply(
    start_response: StartResponse,
    status: str,
    body: bytes,
    head: bool,
    extra: list[tuple[str, str]] | None = None,
) -> list[bytes]:
    start_response(status, [("Content-Type", TEXT), ("Content-Length", str(len(body))), *(extra or [])])
    return [b"" if head else body]


def _head(app: WsgiApp, environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
    """Run ``app`` as for GET and answer with its status and headers (the body's length), no body."""
    seen: dict[str, Any] = {}

    def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
        seen.update(status=status, headers=headers)
        return lambda _data: None

    body = b"".join(app(environ, capture))
    headers = [(k, v) for k, v in seen["headers"] if k.lower() != "content-length"]
    start_response(seen["status"], [*headers, ("Content-Length", str(len(body)))])
    return [b""]


class _QuietHandler(WSGIRequestHandler):
    """Scrapes and probes are not worth a log line."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _server_class(host: str) -> tuple[type[ThreadingWSGIServer], str]:
    """prometheus_client's threaded WSGI server for ``host``: IPv6 for an IPv6 address (``::``
    listens on every interface), IPv4 otherwise (a name resolves as before, to IPv4)."""
    ipv6 = ":" in host

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ipv6 else socket.AF_INET

    return Server, host.strip("[]")


class MetricsServer:
    """``/metrics`` (Prometheus text, or OpenMetrics when asked; gzip when asked), ``/healthz`` (the
    process is up) and ``/readyz`` (``ready()`` is true: connected and not stopping; else 503 with
    ``ready.reason()``), on a daemon thread. Listens on this host only unless given another
    ``host`` (``0.0.0.0``: every interface)."""

    def __init__(
        self,
        port: int,
        *,
        host: str = "127.0.0.1",
        ready: Callable[[], bool] = lambda: True,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        server_class, address = _server_class(host)
        self.httpd = make_server(
            address,
            port,
            metrics_app(registry, ready),
            server_class=server_class,
            handler_class=_QuietHandler,
        )
        self.port: int = self.httpd.server_address[1]
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="postbox-metrics-http", daemon=True
        )

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _start_when_ready(database: DatabaseMetrics, ready: Callable[[], bool], poll: float = 0.25) -> None:
    """Start the database gauges once the process is first ready (it has reached its database):
    before that each refresh would only fail and log it."""

    def wait_then_start() -> None:
        while not _readiness(ready)[0]:
            time.sleep(poll)
        database.start()

    threading.Thread(target=wait_then_start, name="postbox-db-metrics-start", daemon=True).start()


def start_observability(
    url: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    ready: Callable[[], bool] = lambda: True,
    db_interval: float = 15.0,
    stale_after: float = 30.0,
) -> tuple[MetricsServer, DatabaseMetrics | None] | None:
    """Serve metrics on ``port`` (0: off) with the database gauges refreshed every ``db_interval``
    seconds once the process is ready (0: no database gauges in this process). Returns what it
    started."""
    from postbox._version import __version__

    BUILD.info({"version": __version__})
    if port <= 0:
        return None
    database: DatabaseMetrics | None = None
    if db_interval > 0:
        database = DatabaseMetrics(url, interval=db_interval, stale_after=stale_after)
        REGISTRY.register(database)
        _start_when_ready(database, ready)
    server = MetricsServer(port, host=host, ready=ready).start()
    log.info("metrics on http://%s:%s/metrics", host, server.port, extra={"event": "metrics_started"})
    return server, database


def exposed_names(registry: CollectorRegistry = REGISTRY) -> set[str]:
    """Every series name the registry can expose (counters with ``_total``, histograms with
    ``_bucket``/``_sum``/``_count``), database gauges included, for checking alert rules."""
    names: set[str] = set()
    collectors: list[Any] = [registry]
    if not any(isinstance(c, DatabaseMetrics) for c in getattr(registry, "_collector_to_names", {})):
        collectors.append(DatabaseMetrics("postgresql://unused"))
    for source in collectors:
        for family in source.collect():
            names.add(family.name)
            if family.type == "counter":
                names.update({family.name + "_total", family.name + "_created"})
            elif family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count", "_created"))
            elif family.type == "info":
                names.add(family.name + "_info")
    return names

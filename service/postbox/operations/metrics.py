"""Prometheus metrics: the HTTP endpoint of a Postbox process (``/metrics``, ``/healthz``,
``/readyz``) and what it serves, of two kinds:

- **process counters and histograms** (:mod:`postbox.operations.counters`), updated by the worker,
  relay, bridge and maintenance as things happen; re-exported here, where their users take them;
- **database gauges** (:mod:`postbox.operations.database_gauges`), read by one query on a timer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from postbox.operations import counters
from postbox.operations.counters import *  # noqa: F403 (re-exported: their users take them from here)
from postbox.operations.counters import BUILD, REGISTRY
from postbox.operations.database_gauges import DATABASE_GAUGES, DatabaseMetrics

__all__ = ["DATABASE_GAUGES", "DatabaseMetrics", "MetricsServer", "exposed_names", "start_observability"]
__all__ += counters.__all__

log = logging.getLogger("postbox.metrics")


class MetricsServer:
    """``/metrics`` (Prometheus text format), ``/healthz`` (the process is up) and ``/readyz``
    (``ready()`` is true: connected and not stopping), on a daemon thread. Listens on this host
    only unless given another ``host`` (``0.0.0.0``: every interface)."""

    def __init__(
        self,
        port: int,
        *,
        host: str = "127.0.0.1",
        ready: Callable[[], bool] = lambda: True,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._send(200, b"ok\n")
                elif path == "/readyz":
                    ok = outer._safe_ready()
                    self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
                else:
                    self._send(404, b"not found\n")

            def _send(
                self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8"
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # scrapes are not worth a log line

        self._ready = ready
        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port: int = self.httpd.server_address[1]
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="postbox-metrics-http", daemon=True
        )

    def _safe_ready(self) -> bool:
        try:
            return bool(self._ready())
        except Exception:
            return False

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


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
    seconds (0: no database gauges in this process). Returns what it started."""
    from postbox._version import __version__

    BUILD.info({"version": __version__})
    if port <= 0:
        return None
    database: DatabaseMetrics | None = None
    if db_interval > 0:
        database = DatabaseMetrics(url, interval=db_interval, stale_after=stale_after)
        REGISTRY.register(database)
        database.start()
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

"""Prometheus metrics: what every Postbox process counts, what the database says, and the HTTP
endpoint that serves them (``/metrics``, ``/healthz``, ``/readyz``).

Two kinds of figures:

- **Process counters and histograms**, updated by the worker, relay, bridge and maintenance as
  things happen (messages processed, failed, retried, dead-lettered; handler, claim and publish
  durations; the circuit breaker's state). Labels are bounded: consumer, destination, message type,
  error type and classification, never a key or a message id (and never a secret: label values
  pass through :func:`postbox.config.settings.mask_text`).
- **Database gauges** (dead letters open and the oldest one's age, blocked keys, lag, retries in
  flight, relay backlog, stale workers, dead tuples, xmin age): one cheap query
  (``metrics_snapshot`` in ``sql/queries/metrics.sql``) run on a timer by a background thread, never
  per scrape. Every process that serves metrics exports them; aggregate them with ``max`` (not
  ``sum``) across processes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from postbox.clock import Clock, SystemClock
from postbox.config.settings import mask_text
from postbox.db import query

__all__ = [
    "REGISTRY",
    "DatabaseMetrics",
    "MetricsServer",
    "exposed_names",
    "record_claim",
    "record_failure",
    "record_handler",
    "record_start",
    "record_success",
]

log = logging.getLogger("postbox.metrics")

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LONG_SECONDS = (0.1, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 86400.0)

BUILD = Info("postbox_build", "Postbox version of this process.", registry=REGISTRY)

# --- inbox worker ----------------------------------------------------------------------------
DELIVERIES = Counter(
    "postbox_deliveries",
    "Messages claimed by a worker, by attempt number (1, 2, 3, 4, 5+); attempt > 1 is a redelivery.",
    ["consumer", "attempt"],
    registry=REGISTRY,
)
REDELIVERIES = Counter(
    "postbox_redeliveries",
    "Messages claimed again after an earlier delivery (a retry or a worker that died mid-attempt).",
    ["consumer"],
    registry=REGISTRY,
)
PROCESSED = Counter(
    "postbox_messages_processed",
    "Messages whose handler succeeded and whose effects committed.",
    ["consumer", "type"],
    registry=REGISTRY,
)
SUCCEEDED_AFTER_RETRY = Counter(
    "postbox_messages_succeeded_after_retry",
    "Messages that succeeded on a later attempt than the first (share: divide by processed).",
    ["consumer", "type"],
    registry=REGISTRY,
)
FAILED = Counter(
    "postbox_messages_failed",
    "Failed attempts, by classification (transient, permanent, unknown, lease_expired) and error type.",
    ["consumer", "type", "kind", "error_type"],
    registry=REGISTRY,
)
RETRIED = Counter(
    "postbox_messages_retried",
    "Failed attempts after which a retry was scheduled.",
    ["consumer", "type"],
    registry=REGISTRY,
)
DEAD_LETTERED = Counter(
    "postbox_messages_dead_lettered",
    "Messages moved to the dead-letter table, by reason.",
    ["consumer", "type", "reason"],
    registry=REGISTRY,
)
HANDLER_SECONDS = Histogram(
    "postbox_handler_duration_seconds",
    "Time a handler ran, successful or not.",
    ["consumer", "type"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
CLAIM_SECONDS = Histogram(
    "postbox_claim_duration_seconds",
    "Time of one claim (a batch of heads of keys) as the worker sees it, round trip included.",
    ["consumer"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
START_LAG_SECONDS = Histogram(
    "postbox_receive_to_start_seconds",
    "From a message's receipt to the start of its first attempt.",
    ["consumer"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
RECOVERY_SECONDS = Histogram(
    "postbox_failure_to_success_seconds",
    "From a message's first failure to its success.",
    ["consumer"],
    buckets=_LONG_SECONDS,
    registry=REGISTRY,
)
BREAKER_STATE = Gauge(
    "postbox_circuit_breaker_state",
    "Circuit breaker of this process for a consumer: 0 closed, 1 half-open (probing), 2 open.",
    ["consumer"],
    registry=REGISTRY,
)

# --- relay and bridge -------------------------------------------------------------------------
RELAY_PUBLISHED = Counter(
    "postbox_relay_published", "Outbox rows published and confirmed.", ["destination"], registry=REGISTRY
)
RELAY_FAILED = Counter(
    "postbox_relay_failed",
    "Failed publish attempts, by classification and error type.",
    ["destination", "kind", "error_type"],
    registry=REGISTRY,
)
RELAY_DEAD_LETTERED = Counter(
    "postbox_relay_dead_lettered",
    "Outbox rows moved to the dead-letter table, by reason.",
    ["destination", "reason"],
    registry=REGISTRY,
)
RELAY_SECONDS = Histogram(
    "postbox_relay_publish_duration_seconds",
    "Time of one batch's publish call to the destination (until confirmed).",
    ["destination"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
BRIDGE_MESSAGES = Counter(
    "postbox_bridge_messages",
    "Broker messages taken by the bridge, by outcome (new, duplicate, conflict, rejected).",
    ["consumer", "outcome"],
    registry=REGISTRY,
)

# --- maintenance ------------------------------------------------------------------------------
MAINTENANCE_RUNS = Counter(
    "postbox_maintenance_runs",
    "Maintenance job runs of this process, by outcome (ok, failed).",
    ["job", "outcome"],
    registry=REGISTRY,
)
MAINTENANCE_ROWS = Counter(
    "postbox_maintenance_rows",
    "Rows deleted, released or repaired by maintenance jobs.",
    ["job"],
    registry=REGISTRY,
)
MAINTENANCE_LAST_SUCCESS = Gauge(
    "postbox_maintenance_last_success_timestamp_seconds",
    "When each maintenance job last succeeded in this cluster (Unix time, from postbox.maintenance_runs).",
    ["job"],
    registry=REGISTRY,
)


# --- hooks ------------------------------------------------------------------------------------


_children: dict[tuple[int, tuple[str, ...]], Any] = {}


def _child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, cached: the label lookup costs more than the update itself."""
    key = (id(metric), labels)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*(mask_text(v) for v in labels))
    return child


def _type(message: Any) -> str:
    return message.type or ""


def _attempt_label(attempt: int) -> str:
    return str(attempt) if attempt < 5 else "5+"


def record_claim(consumer: str, messages: Sequence[Any], seconds: float) -> None:
    _child(CLAIM_SECONDS, consumer).observe(seconds)
    for m in messages:
        _child(DELIVERIES, consumer, _attempt_label(m.attempt)).inc()
        if m.attempt > 1:
            _child(REDELIVERIES, consumer).inc()


def record_start(message: Any, now: datetime) -> None:
    if message.attempt == 1:
        _child(START_LAG_SECONDS, message.consumer).observe(
            max(0.0, (now - message.received_at).total_seconds())
        )


def record_handler(message: Any, seconds: float) -> None:
    _child(HANDLER_SECONDS, message.consumer, _type(message)).observe(seconds)


def record_success(message: Any, now: datetime) -> None:
    """After the commit of a successful message."""
    _child(PROCESSED, message.consumer, _type(message)).inc()
    if message.attempt > 1:
        _child(SUCCEEDED_AFTER_RETRY, message.consumer, _type(message)).inc()
    if message.first_failed_at is not None:
        _child(RECOVERY_SECONDS, message.consumer).observe(
            max(0.0, (now - message.first_failed_at).total_seconds())
        )


def record_failure(message: Any, kind: str, error_type: str, dead_letter_reason: str | None) -> None:
    """After the commit of a failed attempt: retried, or dead-lettered for ``dead_letter_reason``."""
    t = _type(message)
    _child(FAILED, message.consumer, t, kind or "unknown", error_type or "").inc()
    if dead_letter_reason is None:
        _child(RETRIED, message.consumer, t).inc()
    else:
        _child(DEAD_LETTERED, message.consumer, t, dead_letter_reason).inc()


_BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}


def record_breaker(consumer: str, state: str) -> None:
    _child(BREAKER_STATE, consumer).set(_BREAKER_VALUES.get(state, 0))


# --- database gauges --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Gauge:
    name: str
    doc: str
    labels: tuple[str, ...]


# Rows of the metrics_snapshot query are (metric, label a, label b, value).
DATABASE_GAUGES: dict[str, _Gauge] = {
    g.name.removeprefix("postbox_"): g
    for g in (
        _Gauge("postbox_inbox_messages", "Live inbox messages by consumer and state.", ("consumer", "state")),
        _Gauge(
            "postbox_inbox_oldest_age_seconds",
            "Lag: age of the oldest unprocessed, not blocked message of each consumer.",
            ("consumer",),
        ),
        _Gauge(
            "postbox_inbox_retrying",
            "Retries in flight: live messages that failed at least once and will be retried.",
            ("consumer",),
        ),
        _Gauge(
            "postbox_dead_letters_open",
            "Open dead letters per origin (inbox, outbox) and queue (consumer or destination).",
            ("origin", "queue"),
        ),
        _Gauge(
            "postbox_dead_letter_oldest_age_seconds",
            "Age of the oldest open dead letter per origin and queue.",
            ("origin", "queue"),
        ),
        _Gauge("postbox_blocked_keys", "Keys held behind a dead-lettered head.", ("origin", "queue")),
        _Gauge(
            "postbox_blocked_key_oldest_seconds",
            "How long the longest-blocked key of each queue has been blocked.",
            ("origin", "queue"),
        ),
        _Gauge("postbox_relay_backlog", "Outbox rows not yet published, per destination.", ("destination",)),
        _Gauge(
            "postbox_relay_oldest_age_seconds",
            "Age of the oldest unpublished outbox row per destination.",
            ("destination",),
        ),
        _Gauge("postbox_key_gaps_timed_out", "gapless keys waiting past their gap_timeout.", ("consumer",)),
        _Gauge("postbox_workers_live", "Registered processes by kind, heartbeat recent.", ("kind",)),
        _Gauge(
            "postbox_workers_stale",
            "Registered processes whose heartbeat is older than the stale threshold (dead, not yet reaped).",
            ("kind",),
        ),
        _Gauge("postbox_table_dead_tuples", "Dead tuples per Postbox table (bloat).", ("table",)),
        _Gauge("postbox_table_live_tuples", "Live tuples per Postbox table (estimate).", ("table",)),
        _Gauge(
            "postbox_xmin_age_transactions",
            "Age in transactions of the oldest snapshot (xmin) held on the server: vacuum cannot clean behind it.",
            (),
        ),
        _Gauge(
            "postbox_oldest_transaction_seconds",
            "Duration of the longest open transaction on the server.",
            (),
        ),
    )
}


class DatabaseMetrics(Collector):
    """Gauges read from the database by one query every ``interval`` seconds in a background
    thread; scrapes serve the last snapshot."""

    def __init__(
        self,
        url: str,
        *,
        interval: float = 15.0,
        stale_after: float = 30.0,
        clock: Clock | None = None,
    ) -> None:
        self.url = url
        self.interval = interval
        self.stale_after = stale_after
        self.clock = clock or SystemClock()
        self._rows: list[tuple[str, str | None, str | None, float]] = []
        self._refreshed_at: float | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def refresh(self, conn: psycopg.Connection[Any] | None = None) -> None:
        """Run the snapshot query now."""
        if conn is None:
            with psycopg.connect(
                self.url, autocommit=True, connect_timeout=5, application_name="postbox-metrics"
            ) as own:
                self.refresh(own)
                return
        rows = conn.execute(
            query("metrics_snapshot").psycopg, {"now": self.clock.now(), "stale_after": self.stale_after}
        ).fetchall()
        with self._lock:
            self._rows = [(r[0], r[1], r[2], float(r[3] or 0.0)) for r in rows]
            self._refreshed_at = time.time()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="postbox-db-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.refresh()
            except psycopg.Error as error:
                log.warning(
                    "database metrics refresh failed: %s", error, extra={"event": "metrics_refresh_failed"}
                )
            self._stopping.wait(self.interval)

    def describe(self) -> Iterable[Metric]:
        return list(self._families([]))

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            rows = list(self._rows)
            refreshed = self._refreshed_at
        yield from self._families(rows)
        stamp = GaugeMetricFamily(
            "postbox_db_metrics_refreshed_timestamp_seconds",
            "When this process last read the database gauges (Unix time).",
        )
        if refreshed is not None:
            stamp.add_metric([], refreshed)
        yield stamp

    @staticmethod
    def _families(rows: list[tuple[str, str | None, str | None, float]]) -> Iterator[Metric]:
        families = {
            key: GaugeMetricFamily(g.name, g.doc, labels=list(g.labels)) for key, g in DATABASE_GAUGES.items()
        }
        for metric, a, b, value in rows:
            family = families.get(metric)
            if family is None:
                continue
            n = len(DATABASE_GAUGES[metric].labels)
            family.add_metric([v or "" for v in (a, b)[:n]], value)
        yield from families.values()


# --- HTTP endpoint ----------------------------------------------------------------------------


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
    from postbox import __version__

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

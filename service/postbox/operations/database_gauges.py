"""Database gauges: dead letters open and the oldest one's age, blocked keys, lag, retries in flight,
relay backlog, stale workers, dead tuples, xmin age. One cheap query (``metrics_snapshot`` in
``sql/queries/metrics.sql``) run on a timer by a background thread, never per scrape. Every process
that serves metrics exports them; aggregate them with ``max`` (not ``sum``) across processes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from postbox.clock import Clock, SystemClock
from postbox.db import query

__all__ = ["DATABASE_GAUGES", "DatabaseMetrics"]

log = logging.getLogger("postbox.metrics")


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

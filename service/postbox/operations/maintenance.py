"""Maintenance jobs, scheduled with APScheduler by ``postbox maintain``.

Jobs (each a function of a connection, the time and the settings, returning the rows it touched):

- ``dedup_prune``: the deduplication ledger's older slot is truncated once ``dedup_retention_seconds``
  (and a margin) have passed since the last rotation, and becomes the slot receives write; the
  receipts of messages still live or dead-lettered are carried over first. Nothing inside the
  window is dropped, and the window is exact whether or not a row was dropped yet: ``register`` sets
  it in the database (``postbox.dedup_window``), and a receive finds an older receipt expired.
- ``attempts_retention``: failed-attempt history older than ``attempts_retention_seconds``, except
  the history of open dead letters.
- ``dead_letter_retention``: replayed, discarded and resolved dead letters older than
  ``dead_letter_retention_seconds``. Open ones are never deleted.
- ``reap_stale_workers``: processes whose heartbeat stopped are forgotten and their claims made due
  (workers do this too on every heartbeat; this covers a cluster where none is running).
- ``repair_keys``: the safety net for orphaned keys (a ``key_repairs`` row older than a few
  seconds means no worker or relay claimed for that queue): gives them their next head.
- ``gap_timeouts``: reports (log line, gauge) gapless keys waiting past their ``gap_timeout``.
- ``vacuum_queues``: vacuums the inbox and the outbox once their dead row versions pile up, if the
  process's role may (:mod:`postbox.operations.vacuum`).

Deletes go in small batches (``maintenance_batch_size`` rows per transaction, ``SKIP LOCKED``), so
they never hold locks long nor build one huge transaction. A job runs at most once per period across
every maintenance process: a run takes a session advisory lock on the job (one at a time) and claims
the job's row in ``postbox.maintenance_runs`` only if its last start is at least 0.9 period old.
Processed inbox rows and published outbox rows need no job: they are deleted when they complete.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from postbox.clock import Clock, SystemClock
from postbox.db import query
from postbox.operations import metrics
from postbox.operations.runtime import Presence, process_id
from postbox.operations.vacuum import check_server, vacuum_queues

__all__ = ["JOBS", "Maintenance", "MaintenanceSettings"]

log = logging.getLogger("postbox.maintenance")

# A job is due when its last start is at least this share of its period old (two processes whose
# timers tick a little apart must not both run it in one period, one alone must not skip one).
DUE_SHARE = 0.9
# A key_repairs row this old was not picked up by a claim: repair it here.
ORPHAN_AFTER_SECONDS = 5.0


@dataclass(frozen=True)
class MaintenanceSettings:
    """Retention windows, batch size and job periods. Times are seconds."""

    dedup_retention_seconds: float = 7 * 86400.0
    attempts_retention_seconds: float = 30 * 86400.0
    dead_letter_retention_seconds: float = 30 * 86400.0
    batch_size: int = 1000
    max_batches: int = 100  # per run: a huge backlog is worked off over several periods
    stale_after: float = 30.0
    periods: Mapping[str, float] = field(default_factory=dict)  # job -> seconds, over DEFAULT_PERIODS

    def period(self, job: str) -> float:
        return float(self.periods.get(job, DEFAULT_PERIODS[job]))


def _batched(conn: psycopg.Connection[Any], name: str, params: dict[str, Any], s: MaintenanceSettings,
             stopping: threading.Event) -> int:  # fmt: skip
    total = 0
    for _ in range(s.max_batches):
        with conn.transaction():
            row = conn.execute(query(name).psycopg, {**params, "limit": s.batch_size}).fetchone()
        deleted = int(row[0]) if row and row[0] is not None else 0  # the function returns its count
        total += deleted
        if deleted < s.batch_size or stopping.is_set():
            break
    return total


def dedup_prune(
    conn: psycopg.Connection[Any], now: datetime, s: MaintenanceSettings, stop: threading.Event
) -> int:
    """Rotate the ledger's two slots once a window has passed since the last rotation: the older
    slot is truncated (its live and dead-lettered receipts carried over), never deleted row by row.
    About how many rows it dropped."""
    with conn.transaction():
        row = conn.execute(query("dedup_rotate").psycopg, {"now": now}).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def attempts_retention(
    conn: psycopg.Connection[Any], now: datetime, s: MaintenanceSettings, stop: threading.Event
) -> int:
    cutoff = now - timedelta(seconds=s.attempts_retention_seconds)
    return _batched(conn, "prune_attempts", {"cutoff": cutoff}, s, stop)


def dead_letter_retention(
    conn: psycopg.Connection[Any], now: datetime, s: MaintenanceSettings, stop: threading.Event
) -> int:
    cutoff = now - timedelta(seconds=s.dead_letter_retention_seconds)
    return _batched(conn, "prune_dead_letters", {"cutoff": cutoff}, s, stop)


def reap_stale_workers(
    conn: psycopg.Connection[Any], now: datetime, s: MaintenanceSettings, stop: threading.Event
) -> int:
    with conn.transaction():
        row = conn.execute(
            query("reap_stale_workers").psycopg, {"stale_after": s.stale_after, "now": now}
        ).fetchone()
    released = int(row[0]) if row and row[0] else 0
    if released:
        log.warning(
            "released %s messages of stale processes", released, extra={"event": "stale_workers_reaped"}
        )
    return released


def repair_keys(
    conn: psycopg.Connection[Any], now: datetime, s: MaintenanceSettings, stop: threading.Event
) -> int:
    before = now - timedelta(seconds=ORPHAN_AFTER_SECONDS)
    queues = conn.execute(query("orphan_repairs").psycopg, {"before": before}).fetchall()
    conn.commit()
    repaired = 0
    for origin, queue in queues:
        with conn.transaction():
            row = conn.execute(
                query("repair_keys").psycopg,
                {"origin": origin, "queue": queue, "now": now, "limit": s.batch_size},
            ).fetchone()
        n = int(row[0]) if row and row[0] else 0
        if n:
            log.warning(
                "repaired %s orphaned keys of %s %s",
                n,
                origin,
                queue,
                extra={"event": "keys_repaired", "consumer" if origin == "inbox" else "destination": queue},
            )
        repaired += n
    return repaired


def gap_timeouts(
    conn: psycopg.Connection[Any], now: datetime, s: MaintenanceSettings, stop: threading.Event
) -> int:
    rows = conn.execute(query("timed_out_gaps").psycopg, {"now": now}).fetchall()
    conn.commit()
    for consumer, count, since in rows:
        log.warning(
            "%s keys of %s wait for a missing sequence past gap_timeout (oldest since %s): see postbox.key_gaps",
            count,
            consumer,
            since.isoformat(),
            extra={"event": "gap_timed_out", "consumer": consumer},
        )
    return sum(int(r[1]) for r in rows)


JobFunc = Callable[[psycopg.Connection[Any], datetime, MaintenanceSettings, threading.Event], int]

JOBS: dict[str, JobFunc] = {
    "dedup_prune": dedup_prune,
    "attempts_retention": attempts_retention,
    "dead_letter_retention": dead_letter_retention,
    "reap_stale_workers": reap_stale_workers,
    "repair_keys": repair_keys,
    "gap_timeouts": gap_timeouts,
    "vacuum_queues": vacuum_queues,
}

DEFAULT_PERIODS: dict[str, float] = {
    "dedup_prune": 60.0,
    "attempts_retention": 300.0,
    "dead_letter_retention": 300.0,
    "reap_stale_workers": 10.0,
    "repair_keys": 10.0,
    "gap_timeouts": 60.0,
    "vacuum_queues": 5.0,
}


class Maintenance:
    """Runs the jobs on their periods (``start``/``stop``), or on demand (``run_due``, ``run_job``)."""

    def __init__(
        self,
        url: str,
        settings: MaintenanceSettings | None = None,
        *,
        jobs: list[str] | None = None,
        clock: Clock | None = None,
        heartbeat_interval: float = 5.0,
    ) -> None:
        self.url = url
        self.settings = settings or MaintenanceSettings()
        self.jobs = list(jobs or JOBS)
        unknown = sorted(set(self.jobs) - set(JOBS))
        if unknown:
            raise ValueError(f"postbox: unknown maintenance jobs {unknown}; known: {sorted(JOBS)}")
        self.clock = clock or SystemClock()
        self.id = process_id()
        self._stopping = threading.Event()
        self._scheduler: Any = None
        self.presence = Presence(
            url,
            id=self.id,
            kind="maintenance",
            queue=None,
            concurrency=1,
            interval=heartbeat_interval,
            stale_after=max(self.settings.stale_after, heartbeat_interval * 2),
            clock=self.clock,
            stopping=self._stopping,
        )

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, connect_timeout=10, application_name="postbox-maintenance")

    def register(self) -> None:
        with self._connect() as conn:
            conn.execute(query("maintenance_register").psycopg, {"jobs": list(JOBS)})
            # Receives judge the deduplication window exactly by this (pruning only reclaims space).
            seconds = self.settings.dedup_retention_seconds
            row = conn.execute(query("dedup_window_seconds").psycopg).fetchone()
            before = float(row[0]) if row is not None and row[0] is not None else None
            conn.execute(query("dedup_window_set").psycopg, {"seconds": seconds})
            conn.commit()
            if before is not None and abs(before - seconds) > 1e-6:
                log.log(
                    logging.WARNING if seconds < before else logging.INFO,
                    "deduplication window changed from %g s to %g s (dedup_retention_seconds)",
                    before,
                    seconds,
                    extra={"event": "dedup_window_changed", "from_seconds": before, "to_seconds": seconds},
                )
            if not check_server(conn) and "vacuum_queues" in self.jobs:
                # Leave its runs to a process that may vacuum (each job runs once per period).
                self.jobs.remove("vacuum_queues")

    def run_job(self, job: str, conn: psycopg.Connection[Any] | None = None) -> int:
        """Run ``job`` now, whatever its schedule (tests, operators); the rows it touched."""
        if conn is None:
            with self._connect() as own:
                return self.run_job(job, own)
        return JOBS[job](conn, self.clock.now(), self.settings, self._stopping)

    def run_due(self, job: str) -> bool:
        """Run ``job`` if no other process is running it and it is due; whether it ran."""
        with self._connect() as conn:
            conn.autocommit = True
            locked = conn.execute(query("maintenance_try_lock").psycopg, {"job": job}).fetchone()
            if not (locked and locked[0]):
                return False
            try:
                claimed = conn.execute(
                    query("maintenance_claim").psycopg,
                    {"job": job, "now": self.clock.now(), "runner": self.id,
                     "min_gap": self.settings.period(job) * DUE_SHARE},
                ).fetchone()  # fmt: skip
                if claimed is None:
                    return False
                conn.autocommit = False
                self._run_claimed(job, conn)
                return True
            finally:
                if not conn.closed and not conn.broken:
                    conn.rollback()
                    conn.autocommit = True
                    conn.execute(query("maintenance_unlock").psycopg, {"job": job})

    def _run_claimed(self, job: str, conn: psycopg.Connection[Any]) -> None:
        error: str | None = None
        rows = 0
        try:
            rows = JOBS[job](conn, self.clock.now(), self.settings, self._stopping)
        except psycopg.Error as e:
            conn.rollback()
            error = f"{type(e).__name__}: {e}"
            log.error(
                "maintenance job %s failed: %s", job, error, extra={"event": "maintenance_failed", "job": job}
            )
        now = self.clock.now()
        conn.execute(
            query("maintenance_finish").psycopg, {"job": job, "now": now, "rows": rows, "error": error}
        )
        conn.commit()
        metrics.MAINTENANCE_RUNS.labels(job, "failed" if error else "ok").inc()
        if error is None:
            metrics.MAINTENANCE_ROWS.labels(job).inc(rows)
            metrics.MAINTENANCE_LAST_SUCCESS.labels(job).set(now.timestamp())
            log.info(
                "maintenance job %s done (%s rows)",
                job,
                rows,
                extra={"event": "maintenance_done", "job": job, "rows": rows},
            )

    def refresh_last_success(self) -> None:
        """Copy every job's cluster-wide last success into the gauge (other processes' runs too)."""
        with self._connect() as conn:
            for job, at in conn.execute(query("maintenance_last_success").psycopg).fetchall():
                metrics.MAINTENANCE_LAST_SUCCESS.labels(job).set(at)

    def _tick(self, job: str) -> None:
        if self._stopping.is_set():
            return
        try:
            self.run_due(job)
        except psycopg.Error as error:
            log.warning(
                "maintenance job %s could not run: %s", job, error, extra={"event": "maintenance_failed"}
            )

    def _tick_metrics(self) -> None:
        try:
            self.refresh_last_success()
        except psycopg.Error as error:
            log.warning("maintenance metrics refresh failed: %s", error)

    def start(self) -> None:
        from apscheduler.schedulers.background import BackgroundScheduler

        self.register()
        self.presence.beat()
        first = datetime.now(UTC)
        scheduler = BackgroundScheduler(timezone="UTC")
        for job in self.jobs:
            scheduler.add_job(
                self._tick, "interval", args=[job], seconds=self.settings.period(job), id=job,
                next_run_time=first, max_instances=1, coalesce=True, misfire_grace_time=None,
            )  # fmt: skip
        scheduler.add_job(self.presence.beat, "interval", seconds=self.presence.interval, id="heartbeat")
        refresh = min(15.0, *(self.settings.period(job) for job in self.jobs))
        scheduler.add_job(
            self._tick_metrics, "interval", seconds=refresh, id="metrics_refresh", next_run_time=first
        )
        scheduler.start()
        self._scheduler = scheduler
        log.info(
            "maintenance started",
            extra={"event": "maintenance_started", "worker": self.id, "jobs": self.jobs},
        )

    def run_once(self) -> dict[str, bool]:
        """Run every due job once, one after the other; which ones ran."""
        self.register()
        return {job: self.run_due(job) for job in self.jobs}

    # --- lifecycle (the shape of postbox.operations.process.Service) ------------------------

    fatal: str | None = None  # maintenance has no fatal condition: a failed job is retried

    def stop(self) -> None:
        self._stopping.set()

    def abort(self) -> None:
        """Stop at once: a job in flight stops after its current batch (each batch commits)."""
        self.stop()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def ready(self) -> bool:
        return not self.stopping and self.presence.healthy()

    def join(self, grace: float | None = None) -> None:
        """Let the job in flight finish its batch, stop the scheduler, unregister."""
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=True)
            self._scheduler = None
        self.presence.unregister()

    def run(self) -> None:
        self.start()
        try:
            while not self._stopping.wait(0.5):
                pass
        finally:
            self.join()

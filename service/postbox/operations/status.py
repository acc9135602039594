"""``postbox status``: consumers, live workers, lag, retries in flight, blocked keys, dead letters
by group, relay backlog and running replays, on one screen (or as JSON)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from postbox.clock import Clock, SystemClock
from postbox.db import query

__all__ = ["collect_status"]


def _rows(conn: psycopg.Connection[Any], name: str, now: datetime) -> list[tuple[Any, ...]]:
    return conn.execute(query(name).psycopg, {"now": now}).fetchall()


def collect_status(conn: psycopg.Connection[Any], clock: Clock | None = None) -> dict[str, Any]:
    """Everything the status screen shows, as plain data (what ``--json`` prints)."""
    now = (clock or SystemClock()).now()
    recent = {r[0]: (r[1], r[2]) for r in _rows(conn, "status_processed", now)}
    consumers = [
        {"name": r[0], "sequence_mode": r[1], "on_dead_letter": r[2], "halted": bool(r[3]),
         "ready": r[4], "running": r[5], "pending": r[6], "blocked_keys": r[7], "retrying": r[8],
         "lag_seconds": round(r[9], 3), "received_last_minute": recent.get(r[0], (0, 0))[0],
         "received_last_minute_done": recent.get(r[0], (0, 0))[1]}
        for r in _rows(conn, "status_consumers", now)
    ]  # fmt: skip
    workers = [
        {"kind": r[0], "queue": r[1], "host": r[2], "pid": r[3], "concurrency": r[4],
         "heartbeat_age_seconds": round(r[5], 1), "in_flight": r[6], "version": r[7],
         "schema_revision": r[8], "state": "draining" if r[9] else "running"}
        for r in _rows(conn, "status_workers", now)
    ]  # fmt: skip
    dead_letters = [
        {"origin": r[0], "queue": r[1], "type": r[2], "reason": r[3], "open": r[4],
         "oldest_age_seconds": round(r[5], 1), "latest_error": r[6]}
        for r in _rows(conn, "status_dead_letter_groups", now)
    ]  # fmt: skip
    relay = [
        {"destination": r[0], "rows": r[1], "ready": r[2], "in_flight": r[3], "retrying": r[4],
         "blocked": r[5], "oldest_age_seconds": round(r[6], 1)}
        for r in _rows(conn, "status_relay", now)
    ]  # fmt: skip
    maintenance = [
        {"job": r[0], "runs": r[1], "last_success_age_seconds": None if r[2] is None else round(r[2], 1),
         "last_error": r[3]}
        for r in _rows(conn, "status_maintenance", now)
    ]  # fmt: skip
    replays: list[dict[str, Any]] = []
    exists = conn.execute(query("status_replays_exist").psycopg).fetchone()
    if exists and exists[0]:
        replays = [
            {"id": r[0], "state": r[1], "created_at": r[2].isoformat(), "total": r[3], "replayed": r[4],
             "succeeded": r[5], "failed": r[6]}
            for r in _rows(conn, "status_replays", now)
        ]  # fmt: skip
    conn.rollback()
    return {
        "at": now.isoformat(timespec="seconds"),
        "consumers": consumers,
        "workers": workers,
        "dead_letters": dead_letters,
        "relay": relay,
        "replays": replays,
        "maintenance": maintenance,
    }

"""``postbox status``: consumers, live workers, lag, retries in flight, blocked keys, dead letters
by group, relay backlog and running replays, on one screen (or as JSON)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from postbox.clock import Clock, SystemClock
from postbox.db import query

__all__ = ["collect_status", "render_status"]


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
         "heartbeat_age_seconds": round(r[5], 1), "in_flight": r[6]}
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


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [headers, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]


def render_status(s: dict[str, Any]) -> str:
    """The status as text for a terminal."""
    out = [f"Postbox status at {s['at']}", "", "Consumers"]
    if s["consumers"]:
        out += _table(
            ["consumer", "ready", "running", "pending", "retrying", "blocked keys", "lag", "in/min", "done", "state"],
            [[c["name"], c["ready"], c["running"], c["pending"], c["retrying"], c["blocked_keys"],
              _age(c["lag_seconds"]), c["received_last_minute"], c["received_last_minute_done"],
              "HALTED" if c["halted"] else "ok"]
             for c in s["consumers"]],
        )  # fmt: skip
    else:
        out.append("  (none)")
    out += ["", "Live processes"]
    if s["workers"]:
        out += _table(
            ["kind", "queue", "host", "pid", "slots", "heartbeat", "in flight"],
            [[w["kind"], w["queue"], w["host"], w["pid"], w["concurrency"], _age(w["heartbeat_age_seconds"]),
              w["in_flight"]] for w in s["workers"]],
        )  # fmt: skip
    else:
        out.append("  (none)")
    open_total = sum(d["open"] for d in s["dead_letters"])
    out += ["", f"Dead letters: {open_total} open"]
    if s["dead_letters"]:
        out += _table(
            ["origin", "queue", "type", "reason", "open", "oldest", "latest error"],
            [[d["origin"], d["queue"], d["type"], d["reason"], d["open"], _age(d["oldest_age_seconds"]),
              d["latest_error"][:60]] for d in s["dead_letters"]],
        )  # fmt: skip
    out += ["", "Relay backlog"]
    if s["relay"]:
        out += _table(
            ["destination", "rows", "ready", "in flight", "retrying", "blocked", "oldest"],
            [[r["destination"], r["rows"], r["ready"], r["in_flight"], r["retrying"], r["blocked"],
              _age(r["oldest_age_seconds"])] for r in s["relay"]],
        )  # fmt: skip
    else:
        out.append("  (empty)")
    if s["replays"]:
        out += ["", "Replays"]
        out += _table(
            ["id", "state", "total", "replayed", "succeeded", "failed"],
            [
                [r["id"], r["state"], r["total"], r["replayed"], r["succeeded"], r["failed"]]
                for r in s["replays"]
            ],
        )
    if s["maintenance"]:
        out += ["", "Maintenance"]
        out += _table(
            ["job", "runs", "last success", "last error"],
            [[m["job"], m["runs"], _age(m["last_success_age_seconds"]), (m["last_error"] or "")[:60]]
             for m in s["maintenance"]],
        )  # fmt: skip
    return "\n".join(out) + "\n"

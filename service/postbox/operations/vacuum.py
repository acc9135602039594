"""The ``vacuum_queues`` maintenance job: vacuum the inbox and the outbox when their dead row
versions pile up, if this process's role may.

Every message leaves dead row versions behind: it is inserted, updated as it becomes its key's
head and as it is claimed, and deleted when it completes. Until a vacuum removes them, claims and
key checks read past their index entries, and cost more the longer a busy queue runs. Autovacuum
visits a database once per ``autovacuum_naptime`` (a minute by default), and some servers run with
it off. On PostgreSQL 15 only a table's owner, the database's owner or a superuser may vacuum it: a
``postbox maintain`` running as such a role does it every few seconds; one running as
``postbox_maintainer`` (which owns nothing) leaves it to autovacuum, and says so once.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from postbox.db import query

__all__ = ["DEAD_ROWS", "check_server", "vacuum_queues"]

log = logging.getLogger("postbox.maintenance")

# A queue table is vacuumed once it holds this many dead row versions (about 1,700 messages' worth).
DEAD_ROWS = 5_000

_told: set[str] = set()  # what this process has already warned about (once each)


def _tell_once(key: str, message: str, *args: object) -> None:
    if key not in _told:
        _told.add(key)
        log.warning(message, *args, extra={"event": "vacuum_not_possible"})


def check_server(conn: psycopg.Connection[Any]) -> bool:
    """At start: whether this role may vacuum the queue tables; if it may not, say so (once), and
    warn if the server's autovacuum is off too."""
    rows = conn.execute(query("vacuum_candidates").psycopg, {"min_dead": 0}).fetchall()
    autovacuum = conn.execute(query("autovacuum_enabled").psycopg).fetchone()
    conn.commit()
    may = all(r[1] for r in rows)
    if not may:
        _tell_barred(conn.info.user, [r[0] for r in rows if not r[1]])
    if autovacuum and not autovacuum[0] and not may:
        _tell_once(
            "autovacuum",
            "the server's autovacuum is off and role %s may not vacuum the queue tables: nothing will "
            "clean them, and claims slow down as they fill with dead rows; turn autovacuum on, or run "
            "postbox maintain as the schema's owner (see Maintenance in docs/operations.md)",
            conn.info.user,
        )
    return may


def _tell_barred(user: str, tables: list[str]) -> None:
    _tell_once(
        "owner",
        "vacuum_queues: role %s may not vacuum %s (only their owner, the database's owner or a superuser "
        "may): autovacuum alone cleans them (see Maintenance in docs/operations.md)",
        user,
        ", ".join(f"postbox.{n}" for n in tables),
    )


def vacuum_queues(conn: psycopg.Connection[Any], now: datetime, s: object, stop: threading.Event) -> int:
    """VACUUM each queue table with at least DEAD_ROWS dead row versions (by the statistics, a second
    or so behind), skipping one another process holds locked. The dead rows it found there."""
    rows = conn.execute(query("vacuum_candidates").psycopg, {"min_dead": DEAD_ROWS}).fetchall()
    conn.commit()
    barred = [name for name, may, _ in rows if not may]
    if barred:
        _tell_barred(conn.info.user, barred)
    due = [(name, int(dead)) for name, may, dead in rows if may]
    done = 0
    conn.autocommit = True  # VACUUM runs outside a transaction
    try:
        for name, dead in due:
            if stop.is_set():
                break
            conn.execute(sql.SQL("VACUUM (SKIP_LOCKED) {}").format(sql.Identifier("postbox", name)))
            done += dead
    finally:
        conn.autocommit = False
    return done

"""What the console's pages read, paginated. Writes are never here: every action goes through the
audited operations of :mod:`postbox.deadletters.ops` and :mod:`postbox.deadletters.replay`.

The queries read views and tables the ``postbox_operator`` role may read (``postbox.dead_letters``,
``postbox.blocked_keys``, ``postbox.replay_progress``, ``postbox.audit_log``, ``postbox.inbox_dedup``,
``postbox.attempts``), and each stays under 200 ms with 100,000 open dead letters in 2,000 groups
(tests/test_console_scale.py): pages are bounded (``LIMIT``), members are read by keyset on ``id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from postbox.db import query
from postbox.deadletters.ops import DeadLetterFilter

__all__ = [
    "PAGE",
    "GroupFilter",
    "GroupKey",
    "audit_page",
    "blocked_keys_page",
    "group_members",
    "groups_page",
    "job_audit",
    "sparklines",
]

Row = dict[str, Any]
PAGE = 50
SPARK_MINUTES = 30


def _rows(conn: psycopg.Connection[Any], sql: str, params: dict[str, Any]) -> list[Row]:
    # Never prepared: the filters are optional ("NULL or equal"), which a generic plan cannot
    # prune; planned with the values at hand, each query reads the index that fits them.
    with conn.cursor(row_factory=dict_row) as cur:
        return list(cur.execute(sql, params, prepare=False).fetchall())


@dataclass(frozen=True)
class GroupFilter:
    """The dead-letter page's filters (each empty one matches everything)."""

    consumer: str = ""
    type: str = ""
    reason: str = ""
    key: str = ""
    older_than_hours: float = 0.0

    def params(self) -> dict[str, Any]:
        return {
            "queue": self.consumer or None,
            "type": self.type or None,
            "reason": self.reason or None,
            "key": self.key or None,
            "older": timedelta(hours=self.older_than_hours) if self.older_than_hours > 0 else None,
        }


@dataclass(frozen=True)
class GroupKey:
    """One fingerprint group: queue, type, reason code and error fingerprint (type and fingerprint
    may be absent: ``None`` matches only ``NULL``)."""

    origin: str
    queue: str
    type: str | None
    reason: str
    fingerprint: str | None

    def as_filter(self) -> DeadLetterFilter | None:
        """The same selection as an operations filter, or None when the filter cannot say it (a
        group without a type or fingerprint: the operations then get the members' ids)."""
        if self.type is None or self.fingerprint is None:
            return None
        return DeadLetterFilter(
            origin=self.origin,  # type: ignore[arg-type]
            queue=self.queue,
            type=self.type,
            reason=self.reason,
            fingerprint=self.fingerprint,
        )

    def params(self) -> dict[str, Any]:
        return {
            "origin": self.origin,
            "queue": self.queue,
            "type": self.type,
            "reason": self.reason,
            "fingerprint": self.fingerprint,
        }


_FILTERS = """
   status = 'open'
   AND (CAST(%(queue)s AS text) IS NULL OR consumer = %(queue)s
        OR (consumer IS NULL AND destination = %(queue)s))
   AND (CAST(%(type)s AS text) IS NULL OR type = %(type)s)
   AND (CAST(%(reason)s AS text) IS NULL OR reason = %(reason)s)
   AND (CAST(%(older)s AS interval) IS NULL OR dead_lettered_at < now() - CAST(%(older)s AS interval))
"""

# The inner query hands the rows over in the order of ``dead_letters_open_groups_idx``, so grouping every
# consumer's reads that index only and aggregates as it goes (a third of the time of the sequential scan
# and hash the planner picks otherwise); a filter by consumer still reads ``dead_letters_open_idx``.
_GROUPS = f"""
SELECT origin, queue, type, reason, fingerprint,
       count(*) AS open,
       min(dead_lettered_at) AS first_seen, max(dead_lettered_at) AS last_seen,
       max(last_error_type) AS error_type, min(id) AS sample_id
  FROM (SELECT origin, coalesce(consumer, destination) AS queue, type, reason, fingerprint,
               dead_lettered_at, last_error_type, id
          FROM postbox.dead_letters
         WHERE {_FILTERS}
           AND (CAST(%(key)s AS text) IS NULL OR (type, reason, fingerprint) IN (
                SELECT k.type, k.reason, k.fingerprint FROM postbox.dead_letters k
                 WHERE k.status = 'open' AND k.key = %(key)s AND (CAST(%(queue)s AS text) IS NULL
                       OR k.consumer = %(queue)s OR (k.consumer IS NULL AND k.destination = %(queue)s))))
         ORDER BY origin, coalesce(consumer, destination), type, reason, fingerprint) AS open_letters
 GROUP BY origin, queue, type, reason, fingerprint
 ORDER BY open DESC, first_seen, fingerprint
 LIMIT %(limit)s OFFSET %(offset)s
"""

_QUEUES = """
SELECT 'inbox' AS origin, consumer AS queue, count(*) AS open, min(dead_lettered_at) AS oldest_at
  FROM postbox.dead_letters WHERE status = 'open' AND consumer IS NOT NULL GROUP BY consumer
UNION ALL
SELECT 'outbox', destination, count(*), min(dead_lettered_at)
  FROM postbox.dead_letters WHERE status = 'open' AND consumer IS NULL GROUP BY destination
 ORDER BY 2
"""


def open_per_queue(conn: psycopg.Connection[Any]) -> list[Row]:
    """Open dead letters per consumer and destination: how many, and the oldest (an index-only scan of
    ``dead_letters_open_idx`` for the inbox's)."""
    return _rows(conn, _QUEUES, {})


_GROUP_ERRORS = """
SELECT id, last_error FROM postbox.dead_letters WHERE id = ANY(%(ids)s)
"""


def groups_page(conn: psycopg.Connection[Any], flt: GroupFilter, page: int) -> tuple[list[Row], bool]:
    """One page of open dead letters grouped by fingerprint, biggest first; whether there is more.
    Each group carries the error text of one member (``sample_id``)."""
    params = {**flt.params(), "limit": PAGE + 1, "offset": max(page, 0) * PAGE}
    rows = _rows(conn, _GROUPS, params)
    ids = [row["sample_id"] for row in rows[:PAGE]]
    errors = {r["id"]: r["last_error"] for r in _rows(conn, _GROUP_ERRORS, {"ids": ids})} if ids else {}
    for row in rows[:PAGE]:
        row["error"] = errors.get(row["sample_id"]) or ""
    return rows[:PAGE], len(rows) > PAGE


_MEMBERS = """
SELECT id, message_id, key, sequence, attempt, dead_lettered_at, last_error, payload_version
  FROM postbox.dead_letters
 WHERE status = 'open' AND origin = %(origin)s
   AND ((%(origin)s = 'inbox' AND consumer = %(queue)s) OR (%(origin)s = 'outbox' AND destination = %(queue)s))
   AND type IS NOT DISTINCT FROM %(type)s AND reason = %(reason)s
   AND fingerprint IS NOT DISTINCT FROM %(fingerprint)s AND id > %(after)s
 ORDER BY id
 LIMIT %(limit)s
"""

_GROUP_SIZE = """
SELECT count(*) AS open, min(dead_lettered_at) AS first_seen, max(dead_lettered_at) AS last_seen
  FROM postbox.dead_letters
 WHERE status = 'open' AND origin = %(origin)s
   AND ((%(origin)s = 'inbox' AND consumer = %(queue)s) OR (%(origin)s = 'outbox' AND destination = %(queue)s))
   AND type IS NOT DISTINCT FROM %(type)s AND reason = %(reason)s
   AND fingerprint IS NOT DISTINCT FROM %(fingerprint)s
"""


def group_members(
    conn: psycopg.Connection[Any], group: GroupKey, after: int = 0, limit: int = PAGE
) -> tuple[list[Row], Row]:
    """A page of a group's open members (ids above ``after``, ascending), and the group's size."""
    members = _rows(conn, _MEMBERS, {**group.params(), "after": after, "limit": limit})
    size = _rows(conn, _GROUP_SIZE, group.params())[0]
    return members, size


def member_ids(conn: psycopg.Connection[Any], group: GroupKey, limit: int) -> list[int]:
    """The ids of a group's open members (for an operation on a group its filter cannot name)."""
    rows = _rows(conn, _MEMBERS, {**group.params(), "after": 0, "limit": limit})
    return [int(r["id"]) for r in rows]


_BLOCKED = """
SELECT origin, coalesce(consumer, destination) AS queue, key, blocking_message_id, type, dead_letter_id,
       reason, blocked_since, blocked_for, held_messages, last_error
  FROM postbox.blocked_keys ORDER BY blocked_since, key LIMIT %(limit)s OFFSET %(offset)s
"""


def blocked_keys_page(conn: psycopg.Connection[Any], page: int) -> tuple[list[Row], bool]:
    """Blocked keys, oldest first (the view ``postbox keys blocked`` reads), one page."""
    rows = _rows(conn, _BLOCKED, {"limit": PAGE + 1, "offset": max(page, 0) * PAGE})
    return rows[:PAGE], len(rows) > PAGE


_HELD = """
SELECT message_id, sequence, type, state, received_at FROM postbox.inbox
 WHERE consumer = %(queue)s AND key = %(key)s AND state IN ('pending', 'blocked')
 ORDER BY position, id LIMIT %(limit)s
"""

_HELD_OUTBOX = """
SELECT message_id, NULL AS sequence, type, state, created_at AS received_at FROM postbox.outbox
 WHERE destination = %(queue)s AND key = %(key)s AND state IN ('pending', 'blocked')
 ORDER BY position, id LIMIT %(limit)s
"""


def held_messages(conn: psycopg.Connection[Any], origin: str, queue: str, key: str) -> list[Row]:
    """The messages of a key that wait behind its blocked head (and the head), first 100."""
    sql = _HELD if origin == "inbox" else _HELD_OUTBOX
    return _rows(conn, sql, {"queue": queue, "key": key, "limit": 100})


_ATTEMPTS = """
SELECT attempt, failed_at, duration_ms, error_type, error, decision, worker
  FROM postbox.attempts WHERE origin = %(origin)s AND origin_id = %(origin_id)s ORDER BY attempt, id
"""


def attempts(conn: psycopg.Connection[Any], origin: str, origin_id: int) -> list[Row]:
    """Every failed attempt of a message, with its error and the decision taken."""
    return _rows(conn, _ATTEMPTS, {"origin": origin, "origin_id": origin_id})


_AUDIT = """
SELECT id, at, db_user, db_role, actor, action, reason, target
  FROM postbox.audit_log WHERE (CAST(%(before)s AS bigint) IS NULL OR id < %(before)s)
 ORDER BY id DESC LIMIT %(limit)s
"""


def audit_page(conn: psycopg.Connection[Any], before: int | None) -> list[Row]:
    """Operator actions, newest first, a page below id ``before``."""
    return _rows(conn, _AUDIT, {"before": before, "limit": PAGE})


_JOB_AUDIT = """
SELECT id, at, db_user, db_role, actor, action, reason
  FROM postbox.audit_log WHERE target @> jsonb_build_object('replay_job', CAST(%(job)s AS bigint))
 ORDER BY id
"""


def job_audit(conn: psycopg.Connection[Any], job_id: int) -> list[Row]:
    """The audit entries of a replay job: its start, pauses, resumes, cancel or abort."""
    return _rows(conn, _JOB_AUDIT, {"job": job_id})


_RECEIVED = """
SELECT consumer AS queue, floor(extract(epoch FROM %(now)s - received_at) / 60)::int AS ago, count(*) AS n
  FROM postbox.inbox_dedup WHERE received_at >= %(since)s GROUP BY 1, 2
"""

_FAILED = """
SELECT queue, floor(extract(epoch FROM %(now)s - failed_at) / 60)::int AS ago, count(*) AS n
  FROM postbox.attempts WHERE failed_at >= %(since)s GROUP BY 1, 2
"""


def sparklines(conn: psycopg.Connection[Any], now: datetime) -> dict[str, dict[str, list[int]]]:
    """Per queue, messages received and attempts failed in each of the last 30 minutes (oldest
    first): the tables behind ``postbox status``'s throughput and the failure counters."""
    since = now - timedelta(minutes=SPARK_MINUTES)
    out: dict[str, dict[str, list[int]]] = {}
    for name, sql in (("received", _RECEIVED), ("failed", _FAILED)):
        for r in _rows(conn, sql, {"now": now, "since": since}):
            series = out.setdefault(
                str(r["queue"]), {"received": [0] * SPARK_MINUTES, "failed": [0] * SPARK_MINUTES}
            )
            ago = min(max(int(r["ago"]), 0), SPARK_MINUTES - 1)
            series[name][SPARK_MINUTES - 1 - ago] += int(r["n"])
    return out


def _named(conn: psycopg.Connection[Any], name: str, now: datetime) -> list[tuple[Any, ...]]:
    return conn.execute(query(name).psycopg, {"now": now}).fetchall()


def overview(conn: psycopg.Connection[Any], now: datetime) -> dict[str, Any]:
    """What ``postbox status`` shows (its named queries, sql/queries/status.sql), but the dead-letter
    groups, which the console reads per consumer (:func:`open_per_queue`, :func:`groups_page`)."""
    consumers = [
        {"name": r[0], "halted": bool(r[3]), "ready": r[4], "running": r[5], "pending": r[6],
         "blocked_keys": r[7], "retrying": r[8], "lag_seconds": r[9]}
        for r in _named(conn, "status_consumers", now)
    ]  # fmt: skip
    workers = [
        {"kind": r[0], "queue": r[1], "host": r[2], "pid": r[3], "heartbeat_age_seconds": r[5],
         "in_flight": r[6], "version": r[7], "schema_revision": r[8], "state": "draining" if r[9] else "running"}
        for r in _named(conn, "status_workers", now)
    ]  # fmt: skip
    relay = [
        {"destination": r[0], "ready": r[2], "in_flight": r[3], "retrying": r[4], "blocked": r[5],
         "oldest_age_seconds": r[6]}
        for r in _named(conn, "status_relay", now)
    ]  # fmt: skip
    replays = [
        {"id": r[0], "state": r[1], "total": r[3], "replayed": r[4], "succeeded": r[5], "failed": r[6]}
        for r in _named(conn, "status_replays", now)
    ]
    at = now.isoformat(timespec="seconds")
    return {"at": at, "consumers": consumers, "workers": workers, "relay": relay, "replays": replays}

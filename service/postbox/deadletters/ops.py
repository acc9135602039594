"""Dead-letter operations for operators: list, group, show, explain, discard, resolve, edit, blocked
keys, consumer halt and resume.

Each call is one SQL function of ``sql/functions/dead_letter_ops_v1.sql`` (so a DBA can do the same
from psql), runs in the caller's transaction, and is recorded in ``postbox.audit_log`` with the
database role and the ``actor`` given. Replay jobs are in :mod:`postbox.deadletters.replay`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import psycopg
from pydantic import BaseModel, ConfigDict, Field

from postbox.db.connector import run_dicts
from postbox.db.queries import query

__all__ = [
    "DeadLetterFilter",
    "HistoryEvent",
    "audit_trail",
    "blocked_keys",
    "consumer_halted",
    "discard",
    "edit_payload",
    "explain",
    "groups",
    "halt_consumer",
    "latest_for_message",
    "resolve",
    "resume_consumer",
    "select",
    "show",
    "summary",
    "unblock_key",
]

Row = dict[str, Any]


class DeadLetterFilter(BaseModel):
    """Which dead letters an operation covers; every field given must match (AND)."""

    model_config = ConfigDict(extra="forbid")

    ids: list[int] | None = None
    origin: Literal["inbox", "outbox"] | None = None
    queue: str | None = Field(default=None, description="consumer or destination")
    consumer: str | None = None
    destination: str | None = None
    type: str | None = None
    reason: str | None = None
    fingerprint: str | None = None
    key: str | None = None
    message_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    status: str | None = Field(default=None, description="default open; 'any' for all")

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json", exclude_none=True))

    def is_empty(self) -> bool:
        return not self.model_dump(exclude_none=True)


@dataclass(frozen=True)
class HistoryEvent:
    """One line of a dead letter's history."""

    at: datetime
    event: str
    detail: str


def select(conn: psycopg.Connection[Any], flt: DeadLetterFilter, limit: int = 100) -> list[Row]:
    """Dead letters matching ``flt`` (open ones unless ``status`` says otherwise), in replay order."""
    return run_dicts(conn, query("dlq_select"), {"filter": flt.to_json(), "limit": limit})


def show(conn: psycopg.Connection[Any], dead_letter_id: int) -> Row | None:
    """Every field of one dead letter, plus ``replay_payload`` (the edited payload, or the original)
    and ``edits`` (every payload version)."""
    rows = run_dicts(conn, query("dlq_show"), {"id": dead_letter_id})
    if not rows:
        return None
    row = rows[0]
    row["edits"] = run_dicts(conn, query("dlq_edits"), {"id": dead_letter_id})
    return row


def latest_for_message(conn: psycopg.Connection[Any], message_id: str) -> int | None:
    """The newest dead letter of a message id, if any."""
    rows = run_dicts(conn, query("dlq_latest_for_message"), {"message_id": message_id})
    return int(rows[0]["id"]) if rows else None


def groups(conn: psycopg.Connection[Any]) -> list[Row]:
    """Open dead letters grouped by queue, type, reason and error fingerprint, biggest first."""
    return run_dicts(conn, query("dlq_groups"), {})


def summary(conn: psycopg.Connection[Any]) -> list[Row]:
    """Open dead letters per queue: how many and how old the oldest is."""
    return run_dicts(conn, query("dlq_summary"), {})


def explain(conn: psycopg.Connection[Any], dead_letter_id: int) -> list[HistoryEvent]:
    """The whole history of a dead letter, oldest first (receipt, attempts, decisions, dead-lettering,
    edits, operator actions, replays and their outcomes)."""
    return [HistoryEvent(**r) for r in run_dicts(conn, query("dlq_explain"), {"id": dead_letter_id})]


def discard(
    conn: psycopg.Connection[Any], flt: DeadLetterFilter, reason: str, actor: str | None = None
) -> list[Row]:
    """Discard the open dead letters matching ``flt``; a key one of them blocked goes on."""
    return run_dicts(conn, query("dlq_discard"), {"filter": flt.to_json(), "reason": reason, "actor": actor})


def resolve(
    conn: psycopg.Connection[Any], flt: DeadLetterFilter, reason: str, actor: str | None = None
) -> list[Row]:
    """Mark the open dead letters matching ``flt`` resolved by hand; blocked keys go on."""
    return run_dicts(conn, query("dlq_resolve"), {"filter": flt.to_json(), "reason": reason, "actor": actor})


def edit_payload(
    conn: psycopg.Connection[Any], dead_letter_id: int, payload: Any, reason: str, actor: str | None = None
) -> int:
    """Set the payload a replay of this open dead letter will send; returns the new version number.
    The original payload is kept, and so is every earlier version."""
    rows = run_dicts(
        conn,
        query("dlq_edit"),
        {"id": dead_letter_id, "payload": json.dumps(payload), "reason": reason, "actor": actor},
    )
    return int(next(iter(rows[0].values())))


def blocked_keys(conn: psycopg.Connection[Any]) -> list[Row]:
    """Keys held behind a dead-lettered head, oldest first."""
    return run_dicts(conn, query("keys_blocked"), {})


def unblock_key(
    conn: psycopg.Connection[Any],
    origin: Literal["inbox", "outbox"],
    queue: str,
    key: str,
    reason: str,
    actor: str | None = None,
    replay: bool = False,
) -> str:
    """Unblock a key: discard its dead-lettered head (its held messages follow), or replay the head
    in place (``replay=True``: held messages follow once it succeeds). Returns what was done."""
    rows = run_dicts(
        conn,
        query("key_unblock"),
        {"origin": origin, "queue": queue, "key": key, "reason": reason, "actor": actor, "replay": replay},
    )
    return str(next(iter(rows[0].values())))


def consumer_names(conn: psycopg.Connection[Any], consumer: str) -> list[str]:
    """The consumers Postbox knows of (``consumer`` among them if it has messages)."""
    return [str(r["name"]) for r in run_dicts(conn, query("consumer_names"), {"consumer": consumer})]


def halt_consumer(
    conn: psycopg.Connection[Any], consumer: str, reason: str, actor: str | None = None
) -> None:
    """Halt a consumer: its workers claim nothing until it is resumed."""
    run_dicts(conn, query("consumer_halt"), {"consumer": consumer, "reason": reason, "actor": actor})


def consumer_halted(conn: psycopg.Connection[Any], consumer: str) -> Row | None:
    """Since when (``halted_at``) and why (``halted_reason``) ``consumer`` is halted; None if it is not."""
    rows = run_dicts(conn, query("consumer_halted"), {"consumer": consumer})
    return rows[0] if rows else None


def resume_consumer(
    conn: psycopg.Connection[Any], consumer: str, reason: str, actor: str | None = None
) -> bool:
    """Resume a halted consumer; whether it was halted."""
    rows = run_dicts(conn, query("consumer_resume"), {"consumer": consumer, "reason": reason, "actor": actor})
    return bool(next(iter(rows[0].values())))


def audit_trail(conn: psycopg.Connection[Any], limit: int = 50) -> list[Row]:
    """The newest operator actions first."""
    return run_dicts(conn, query("audit_list"), {"limit": limit})

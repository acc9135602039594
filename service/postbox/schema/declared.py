"""The declared database contract: every table of schema ``postbox`` as SQLAlchemy metadata.

Alembic revisions build the schema; a test diffs what they build against this declaration, so the
two cannot drift. Handlers may also use these tables with SQLAlchemy Core.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Double,
    ForeignKey,
    Index,
    Integer,
    Interval,
    PrimaryKeyConstraint,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import DOMAIN, JSONB

from postbox.schema.declared_base import C_TEXT, NOW, SCHEMA, TIMESTAMPTZ, metadata
from postbox.schema.declared_receive import dedup_window, inbox_commit_checks, inbox_dedup, inbox_keys

__all__ = [
    "SCHEMA",
    "attempts",
    "audit_log",
    "consumers",
    "dead_letter_edits",
    "dead_letters",
    "dedup_window",
    "inbox",
    "inbox_commit_checks",
    "inbox_dedup",
    "inbox_keys",
    "key_repairs",
    "metadata",
    "outbox",
    "replay_items",
    "replay_jobs",
    "workers",
]

_C, _TS, _NOW = C_TEXT, TIMESTAMPTZ, NOW
_CLAIMABLE, _PENDING = "state IN ('ready', 'running')", "state = 'pending'"
_STATES = "('pending', 'ready', 'running', 'blocked')"

# The inbox's state: a domain holding the check (PostgreSQL prepares a domain's check once per
# session, a table's CHECK for every inserting statement); the outbox keeps a CHECK.
INBOX_STATE = DOMAIN(
    "inbox_state", Text, check=f"VALUE IN {_STATES}", constraint_name="inbox_state_check", schema=SCHEMA,
    create_type=False,
)  # fmt: skip


def _queue_table(name: str, queue: str, *, inbox: bool) -> Table:
    """The inbox or the outbox: one definition for both (as ``migrations/versions/0001_queues.sql``).

    ``queue`` is the column naming a row's queue; ``inbox`` adds the columns only the inbox has
    (sequence, schema version, source, received_at) where the outbox has created_at.
    """

    def only(present: bool, *columns: Column[object]) -> list[Column[object]]:
        return list(columns) if present else []

    return Table(
        name,
        metadata,
        Column("id", BigInteger, primary_key=True, autoincrement=True),
        Column(queue, _C, nullable=False),
        Column("message_id", _C, nullable=False),
        Column("key", _C, nullable=False),
        *only(inbox, Column("sequence", BigInteger)),
        Column("position", BigInteger, nullable=False),
        Column("type", Text),
        *only(inbox, Column("schema_version", Integer, nullable=False, server_default=text("1"))),
        Column("payload", JSONB, nullable=False),
        Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
        Column("correlation_id", Text),
        Column("causation_id", Text),
        *only(inbox, Column("source", Text), Column("received_at", _TS, nullable=False, server_default=_NOW)),
        *only(not inbox, Column("created_at", _TS, nullable=False, server_default=_NOW)),
        Column("state", INBOX_STATE if inbox else Text, nullable=False),
        Column("available_at", _TS, nullable=False, server_default=_NOW),
        Column("attempt", Integer, nullable=False, server_default=text("0")),
        Column("first_failed_at", _TS),
        Column("last_failed_at", _TS),
        Column("next_retry_at", _TS),
        Column("last_error", Text),
        Column("last_error_type", Text),
        Column("claimed_by", Text),
        Column("claimed_at", _TS),
        Column("replay_of", BigInteger),
        *([] if inbox else [CheckConstraint(f"state IN {_STATES}")]),
        Index(f"{name}_head_uq", queue, "key", unique=True, postgresql_where=text("state <> 'pending'")),
        Index(f"{name}_claim_idx", queue, "available_at", "id", postgresql_where=text(_CLAIMABLE)),
        Index(f"{name}_pending_idx", queue, "key", "position", "id", postgresql_where=text(_PENDING)),
    )


consumers = Table(
    "consumers",
    metadata,
    Column("name", _C, primary_key=True),
    Column("sequence_mode", Text, nullable=False, server_default=text("'arrival'")),
    Column("first_sequence", BigInteger, nullable=False, server_default=text("1")),
    Column("late_policy", Text, nullable=False, server_default=text("'dead_letter'")),
    Column("on_dead_letter", Text, nullable=False, server_default=text("'block'")),
    Column("gap_timeout", Interval),
    Column("halted_at", _TS),
    Column("halted_reason", Text),
    Column("declared", Boolean, nullable=False, server_default=text("true")),
    Column("created_at", _TS, nullable=False, server_default=_NOW),
    Column("updated_at", _TS, nullable=False, server_default=_NOW),
)

inbox = _queue_table("inbox", "consumer", inbox=True)

outbox = _queue_table("outbox", "destination", inbox=False)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("origin", Text, nullable=False),
    Column("origin_id", BigInteger, nullable=False),
    Column("consumer", _C),
    Column("destination", _C),
    Column("message_id", _C, nullable=False),
    Column("key", _C, nullable=False),
    Column("sequence", BigInteger),
    Column("position", BigInteger, nullable=False),
    Column("type", Text),
    Column("schema_version", Integer, nullable=False, server_default=text("1")),
    Column("payload", JSONB, nullable=False),
    Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("correlation_id", Text),
    Column("causation_id", Text),
    Column("source", Text),
    Column("received_at", _TS, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("first_failed_at", _TS),
    Column("last_failed_at", _TS),
    Column("last_error", Text),
    Column("last_error_type", Text),
    Column("last_traceback", Text),
    Column("reason", Text, nullable=False),
    Column("fingerprint", Text),
    Column("ordering_policy", Text, nullable=False),
    Column("status", Text, nullable=False, server_default=text("'open'")),
    Column("dead_lettered_at", _TS, nullable=False, server_default=_NOW),
    Column("status_changed_at", _TS),
    Column("status_reason", Text),
    Column("edited_payload", JSONB),
    Column("payload_version", Integer, nullable=False, server_default=text("0")),
    Column("replay_of", BigInteger),
    Index(
        "dead_letters_open_uq",
        "origin",
        "origin_id",
        unique=True,
        postgresql_where=text("status IN ('open', 'replaying')"),
    ),
    Index(
        "dead_letters_open_idx",
        "consumer",
        "type",
        "dead_lettered_at",
        postgresql_where=text("status = 'open'"),
    ),
    Index("dead_letters_message_idx", "message_id"),
    # Revision 0003.
    Index(
        "dead_letters_open_groups_idx",
        "origin",
        text("coalesce(consumer, destination)"),
        "type",
        "reason",
        "fingerprint",
        postgresql_include=["key", "dead_lettered_at", "last_error_type", "id", "consumer", "destination"],
        postgresql_where=text("status = 'open'"),
    ),
    Index("dead_letters_replay_of_idx", "replay_of", postgresql_where=text("replay_of IS NOT NULL")),
)

key_repairs = Table(
    "key_repairs",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("origin", Text, nullable=False),
    Column("queue", _C, nullable=False),
    Column("key", _C, nullable=False),
    Column("created_at", _TS, nullable=False, server_default=_NOW),
    Index("key_repairs_queue_idx", "origin", "queue", "key"),
)

attempts = Table(
    "attempts",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("origin", Text, nullable=False),
    Column("origin_id", BigInteger, nullable=False),
    Column("queue", _C, nullable=False),
    Column("message_id", _C, nullable=False),
    Column("key", _C, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("worker", Text),
    Column("failed_at", _TS, nullable=False),
    Column("duration_ms", Double),
    Column("kind", Text, nullable=False),
    Column("error_type", Text),
    Column("error", Text),
    Column("traceback", Text),
    Column("decision", Text, nullable=False),
    Column("explanation", Text),
    Column("next_retry_at", _TS),
    Index("attempts_origin_idx", "origin", "origin_id"),
    Index("attempts_message_idx", "message_id"),
    Index("attempts_failed_at_brin", "failed_at", postgresql_using="brin"),
)

workers = Table(
    "workers",
    metadata,
    Column("id", _C, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("queue", _C),
    Column("host", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("concurrency", Integer, nullable=False, server_default=text("1")),
    Column("version", Text),
    Column("started_at", _TS, nullable=False, server_default=_NOW),
    Column("heartbeat_at", _TS, nullable=False, server_default=_NOW),
    Column("stopping_at", _TS),
    Column("schema_revision", Text),  # revision 0002
)

_CLOCK = text("clock_timestamp()")

audit_log = Table(
    "audit_log",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("at", _TS, nullable=False, server_default=_CLOCK),
    Column("db_user", Text, nullable=False, server_default=text("SESSION_USER")),
    Column("db_role", Text, nullable=False),
    Column("actor", Text),
    Column("action", Text, nullable=False),
    Column("reason", Text),
    Column("target", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("details", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Index("audit_log_at_idx", "at"),
    Index(
        "audit_log_target_idx", "target", postgresql_using="gin", postgresql_ops={"target": "jsonb_path_ops"}
    ),
)

dead_letter_edits = Table(
    "dead_letter_edits",
    metadata,
    Column(
        "dead_letter_id",
        BigInteger,
        ForeignKey("postbox.dead_letters.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("version", Integer, nullable=False),
    Column("payload", JSONB, nullable=False),
    Column("previous", JSONB, nullable=False),
    Column("reason", Text, nullable=False),
    Column("actor", Text),
    Column("db_user", Text, nullable=False, server_default=text("SESSION_USER")),
    Column("edited_at", _TS, nullable=False, server_default=_CLOCK),
    PrimaryKeyConstraint("dead_letter_id", "version"),
)

replay_jobs = Table(
    "replay_jobs",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("created_at", _TS, nullable=False, server_default=_CLOCK),
    Column("db_user", Text, nullable=False, server_default=text("SESSION_USER")),
    Column("actor", Text),
    Column("reason", Text),
    Column("filter", JSONB, nullable=False),
    Column("mode", Text, nullable=False),
    Column("rate", Double, nullable=False),
    Column("max_in_flight", Integer, nullable=False),
    Column("batch_size", Integer, nullable=False),
    Column("canary", Integer, nullable=False, server_default=text("0")),
    Column("abort_failure_ratio", Double, nullable=False),
    Column("abort_min_finished", Integer, nullable=False, server_default=text("5")),
    Column("dry_run", Boolean, nullable=False, server_default=text("false")),
    Column("state", Text, nullable=False, server_default=text("'pending'")),
    Column("state_reason", Text),
    Column("canary_passed", Boolean, nullable=False, server_default=text("false")),
    Column("total", Integer, nullable=False, server_default=text("0")),
    Column("replayed", Integer, nullable=False, server_default=text("0")),
    Column("succeeded", Integer, nullable=False, server_default=text("0")),
    Column("failed", Integer, nullable=False, server_default=text("0")),
    Column("skipped", Integer, nullable=False, server_default=text("0")),
    Column("tokens", Double, nullable=False, server_default=text("0")),
    Column("tokens_at", _TS),
    Column("started_at", _TS),
    Column("finished_at", _TS),
    Column("updated_at", _TS, nullable=False, server_default=_CLOCK),
    Column("last_step_at", _TS),
    Column("last_runner", Text),
    Index(
        "replay_jobs_active_idx",
        "id",
        postgresql_where=text("state IN ('pending', 'running', 'paused')"),
    ),
)

replay_items = Table(
    "replay_items",
    metadata,
    Column(
        "job_id",
        BigInteger,
        ForeignKey("postbox.replay_jobs.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("ordinal", Integer, nullable=False),
    Column("dead_letter_id", BigInteger, nullable=False),
    Column("state", Text, nullable=False, server_default=text("'pending'")),
    Column("action", Text),
    Column("replayed_at", _TS),
    Column("finished_at", _TS),
    PrimaryKeyConstraint("job_id", "ordinal"),
    Index(
        "replay_items_open_idx",
        "job_id",
        "state",
        postgresql_where=text("state IN ('pending', 'replaying')"),
    ),
    Index("replay_items_dead_letter_idx", "dead_letter_id"),
)

maintenance_runs = Table(
    "maintenance_runs",
    metadata,
    Column("job", _C, primary_key=True),
    Column("runs", BigInteger, nullable=False, server_default=text("0")),
    Column("last_started_at", _TS),
    Column("last_finished_at", _TS),
    Column("last_success_at", _TS),
    Column("last_runner", Text),
    Column("last_rows", BigInteger),
    Column("last_error", Text),
)

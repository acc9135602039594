"""The receiving side's tables: the deduplication ledger (two slots), its window, per-key progress,
and the transient commit checks of batch receives (part of ``postbox.schema.declared``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Identity,
    Interval,
    LargeBinary,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    text,
)
from sqlalchemy.sql.schema import SchemaItem

from postbox.schema.declared_base import C_TEXT, NOW, TIMESTAMPTZ, metadata

__all__ = ["dedup_window", "inbox_commit_checks", "inbox_dedup", "inbox_dedup_slots", "inbox_keys"]


def _ledger(name: str, *, partition: bool) -> Table:
    """The ledger (partitioned by slot) or one of its two slots (each with its own primary key)."""
    key: list[SchemaItem] = [PrimaryKeyConstraint("consumer", "message_id")] if partition else []
    options: dict[str, Any] = {} if partition else {"postgresql_partition_by": "LIST (slot)"}
    return Table(
        name,
        metadata,
        Column("consumer", C_TEXT, nullable=False),
        Column("message_id", C_TEXT, nullable=False),
        Column("payload_hash", LargeBinary, nullable=False),
        Column("inbox_id", BigInteger, nullable=False),
        Column("received_at", TIMESTAMPTZ, nullable=False, server_default=NOW),
        Column("slot", SmallInteger, nullable=False, server_default=text("postbox.dedup_current_slot_v1()")),
        *key,
        **options,
    )


inbox_dedup = _ledger("inbox_dedup", partition=False)
inbox_dedup_slots = [_ledger(f"inbox_dedup_{slot}", partition=True) for slot in (0, 1)]

# The deduplication window (one row), set by postbox maintain; the slot receives write.
dedup_window = Table(
    "dedup_window",
    metadata,
    Column("singleton", Boolean, primary_key=True, server_default=text("true")),
    Column("retention", Interval, nullable=False, server_default=text("'7 days'::interval")),
    Column("set_at", TIMESTAMPTZ, nullable=False, server_default=NOW),
    Column("current_slot", SmallInteger, nullable=False, server_default=text("0")),
    Column("rotated_at", TIMESTAMPTZ, nullable=False, server_default=NOW),
    CheckConstraint("singleton"),
    CheckConstraint("retention > interval '0'"),
    CheckConstraint("current_slot IN (0, 1)"),
)

# Transient (unlogged, empty between transactions): one row per batch receive that queued
# messages, checked and deleted at its commit.
inbox_commit_checks = Table(
    "inbox_commit_checks",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("consumers", ARRAY(Text), nullable=False),
    Column("keys", ARRAY(Text), nullable=False),
    prefixes=["UNLOGGED"],
)

inbox_keys = Table(
    "inbox_keys",
    metadata,
    Column("consumer", C_TEXT, nullable=False),
    Column("key", C_TEXT, nullable=False),
    Column("last_sequence", BigInteger),
    Column("last_done_at", TIMESTAMPTZ),
    Column("gap_since", TIMESTAMPTZ),
    PrimaryKeyConstraint("consumer", "key"),
)

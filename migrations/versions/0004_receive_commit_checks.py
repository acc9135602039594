"""Receiving costs less, with the same results and guarantees: a batch re-checks its queued
messages at commit once, set-based (postbox.inbox_commit_checks and its deferred trigger), instead
of one deferred trigger per queued message; a single receive in arrival mode writes its ledger row
and its head in one statement. inbox_receive_v1 and inbox_receive_rows_v1 keep their signatures and
results (bodies replaced), so processes of 0.1.0 and 0.2.0 work on it unchanged. The deduplication
window becomes exact at its edges: it lives in the database (postbox.dedup_window, set by
`postbox maintain`), and a receipt later than the window after the first is new again.

Expand only. Replacing the per-message trigger takes the inbox's table lock for an instant (it waits
for transactions that hold the inbox open, and holds off new ones meanwhile).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from postbox.schema.apply_sql import apply_frozen, run_sql, sql_file_text

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

FUNCTIONS = ["functions/inbox_dedup_slots_v1.sql", "functions/inbox_receive_commit_check_v1.sql"]

# Back to 0003: the per-message trigger for every queued row, and revision 0001's receive bodies
# (with the rights roles_v1.sql gives them, which CREATE OR REPLACE resets).
DOWNGRADE = """
DROP TRIGGER IF EXISTS inbox_pending_commit ON postbox.inbox;
CREATE CONSTRAINT TRIGGER inbox_pending_commit AFTER INSERT ON postbox.inbox
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.state = 'pending')
    EXECUTE FUNCTION postbox.inbox_pending_commit_v1();
DROP TABLE IF EXISTS postbox.inbox_commit_checks;
DROP FUNCTION IF EXISTS postbox.inbox_commit_check_v1();
DROP FUNCTION IF EXISTS postbox.inbox_dedup_take_expired_v1(text, text, bytea, bigint, smallint, interval);
DROP FUNCTION IF EXISTS postbox.inbox_receipt_live_v1(text, text, bigint);
-- The ledger in one table again: slot 0 keeps its rows, and takes slot 1's newer receipts.
ALTER TABLE postbox.inbox_dedup DETACH PARTITION postbox.inbox_dedup_0;
ALTER TABLE postbox.inbox_dedup DETACH PARTITION postbox.inbox_dedup_1;
DROP TABLE postbox.inbox_dedup;
INSERT INTO postbox.inbox_dedup_0 AS d (consumer, message_id, payload_hash, inbox_id, received_at, slot)
SELECT consumer, message_id, payload_hash, inbox_id, received_at, 0 FROM postbox.inbox_dedup_1
ON CONFLICT (consumer, message_id) DO UPDATE
   SET payload_hash = excluded.payload_hash, inbox_id = excluded.inbox_id, received_at = excluded.received_at
 WHERE excluded.received_at > d.received_at;
DROP TABLE postbox.inbox_dedup_1;
ALTER TABLE postbox.inbox_dedup_0 DROP COLUMN slot;
ALTER TABLE postbox.inbox_dedup_0 RENAME TO inbox_dedup;
ALTER INDEX postbox.inbox_dedup_0_pkey RENAME TO inbox_dedup_pkey;
CREATE INDEX inbox_dedup_received_at_brin ON postbox.inbox_dedup USING brin (received_at);
COMMENT ON TABLE postbox.inbox_dedup IS 'Deduplication ledger: one row per (consumer, message_id) ever received, kept for the retention window after the message left the inbox.';
DROP FUNCTION IF EXISTS postbox.dedup_rotate_v1(timestamptz);
DROP FUNCTION IF EXISTS postbox.dedup_window_set_v1(double precision);
DROP FUNCTION IF EXISTS postbox.dedup_current_slot_v1();
DROP FUNCTION IF EXISTS postbox.dedup_retention_v1();
DROP TABLE IF EXISTS postbox.dedup_window;
"""
RESTORED = ["functions/inbox_receive_v1.sql", "functions/roles_api_v1.sql", "roles_v1.sql"]

RELEASED_SHA256 = "59a9848a9ee6a8f67846add1a23b5eb294a5ab49177901c48642da3e962968bd"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [sql_file_text(f) for f in FUNCTIONS]


def downgrade_statements() -> list[str]:
    return [DOWNGRADE, *(sql_file_text(f) for f in RESTORED)]


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), *downgrade_statements()]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


# Re-applying roles_v1.sql (above) revokes every grant and gives 0001's: those revision 0002 added,
# which 0003 has, went with them, and a worker or maintenance login could no longer start. Given
# back after the frozen SQL, in the same transaction. Not part of what RELEASED_SHA256 pins: the
# released SQL is unchanged, this mends what running it left.
REGRANT_0002 = """
GRANT SELECT ON postbox.alembic_version TO postbox_worker, postbox_maintainer;
GRANT EXECUTE ON FUNCTION postbox.worker_heartbeat_v2(text, text, text, text, integer, integer, text, text, boolean, timestamptz)
    TO postbox_worker, postbox_maintainer;
"""


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=downgrade_statements())
    run_sql(REGRANT_0002)

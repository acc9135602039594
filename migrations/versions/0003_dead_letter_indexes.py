"""Dead letters at scale: an index that hands the console (and any DBA grouping open dead letters by
cause) the groups in order, read from the index alone; and one under replay_of, which
dlq_explain_v1 walks (without it, a story took a scan of the table per step: 0.4 s at 100,000
dead letters, 9 ms with it). Released in 0.2.0: frozen (RELEASED_SHA256 pins every line of SQL).

Expand only, nothing renamed: processes of 0.1.0 and 0.2.0 both work on it. CREATE INDEX holds
off new dead letters (not the live flow) while it builds: seconds for a million dead letters.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from postbox.schema.apply_sql import apply_frozen

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

FUNCTIONS: list[str] = []  # no sql/ file: the revision's SQL is below

SCHEMA = """
CREATE INDEX dead_letters_open_groups_idx ON postbox.dead_letters
    (origin, (coalesce(consumer, destination)), type, reason, fingerprint)
    INCLUDE (key, dead_lettered_at, last_error_type, id, consumer, destination)
    WHERE status = 'open';
COMMENT ON INDEX postbox.dead_letters_open_groups_idx IS 'Open dead letters by cause (origin, queue, type, reason, fingerprint): a GROUP BY over them reads this index only, in order.';
CREATE INDEX dead_letters_replay_of_idx ON postbox.dead_letters (replay_of) WHERE replay_of IS NOT NULL;
COMMENT ON INDEX postbox.dead_letters_replay_of_idx IS 'The replays of a dead letter (dlq_explain follows them).';
"""

DOWNGRADE = """
DROP INDEX IF EXISTS postbox.dead_letters_replay_of_idx;
DROP INDEX IF EXISTS postbox.dead_letters_open_groups_idx;
"""

RELEASED_SHA256 = "54903cb3edf09c4835f1d364841dac2991acd67f1e9f71194416b1857426c3bc"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [SCHEMA]


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), DOWNGRADE]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=[DOWNGRADE])

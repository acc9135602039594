"""A draining process keeps beating: worker_heartbeat_v2 (stopping_at, the schema revision of the
process's code); the process roles may read the schema's revision, which every process checks before
it starts. Released in 0.2.0: frozen (RELEASED_SHA256 pins every line of SQL it applies).

An expand-only revision: 0.1.0 processes keep calling worker_heartbeat_v1 while a rolling deploy
replaces them (see docs/upgrading.md).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from postbox.schema.apply_sql import apply_frozen, sql_file_text

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

SCHEMA = """
ALTER TABLE postbox.workers ADD COLUMN schema_revision text;
COMMENT ON COLUMN postbox.workers.schema_revision IS 'The schema revision the process''s code was written for (NULL: a process of 0.1.0, which does not say).';
COMMENT ON COLUMN postbox.workers.stopping_at IS 'When the process began to drain (stopped claiming; in-flight work finishing); it keeps beating until it exits.';
-- Every process checks the schema's revision before it starts (0.1.0's workers and maintenance,
-- logged in with only their Postbox role, were refused it).
GRANT SELECT ON postbox.alembic_version TO postbox_worker, postbox_maintainer;
"""

FUNCTIONS = "functions/workers_v2.sql"

DOWNGRADE = """
REVOKE SELECT ON postbox.alembic_version FROM postbox_worker, postbox_maintainer;
DROP FUNCTION IF EXISTS postbox.worker_heartbeat_v2(text, text, text, text, integer, integer, text, text, boolean, timestamptz);
COMMENT ON COLUMN postbox.workers.stopping_at IS NULL;
ALTER TABLE postbox.workers DROP COLUMN IF EXISTS schema_revision;
"""

RELEASED_SHA256 = "848f35b369ff253d085cfe18a3283fdeeae2effa68f1fa9f58f117f5d693032b"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [SCHEMA, sql_file_text(FUNCTIONS)]


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), DOWNGRADE]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=[DOWNGRADE])

"""Completing a batch reads each row by its primary key, whatever the planner's statistics say:
inbox_complete_v1 and outbox_complete_v1 keep their signatures and results (bodies replaced), so
processes of earlier releases work on it unchanged. Their old bodies could read the queue's partial
indexes whole, and between two vacuums those hold every dead entry a busy queue left behind.

Expand only; no table changes, the functions' grants unchanged.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

import re

from postbox.schema.apply_sql import apply_frozen, sql_file_text, template_text

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

FUNCTIONS = ["functions/queue_complete_v1.sql"]
# CREATE OR REPLACE resets what roles_v1.sql sets on an entry point (SECURITY DEFINER, its fixed
# search_path): the new bodies say it themselves, revision 0001's get it back after them. Grants
# stay as they are.
ENTRY_POINTS = """
ALTER FUNCTION postbox.inbox_complete_v1(bigint[], integer[], timestamptz)
    SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
ALTER FUNCTION postbox.outbox_complete_v1(bigint[], integer[], timestamptz)
    SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
"""

# Back to 0004: revision 0001's two bodies, taken from its queue protocol file as rendered for each
# direction (CREATE OR REPLACE keeps each function's owner and grants).
RESTORED = "functions/queue_v1.sql"
_COMPLETE = re.compile(
    r"^CREATE OR REPLACE FUNCTION postbox\.(?:inbox|outbox)_complete_v1\(.*?^\$\$;\n", re.M | re.S
)

RELEASED_SHA256 = "47b9a39c5ed5762a6f1bc8abaf81561e7ea2e58a35ee8609dfcd670ff4f18c71"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [sql_file_text(f) for f in FUNCTIONS]


def downgrade_statements() -> list[str]:
    bodies = _COMPLETE.findall(template_text(RESTORED))
    assert len(bodies) == 2, "revision 0001's inbox and outbox complete functions"
    return [*bodies, ENTRY_POINTS]


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), *downgrade_statements()]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=downgrade_statements())

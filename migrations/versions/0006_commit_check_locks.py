"""A batch receive's commit check takes its keys' locks without sorting them first:
inbox_commit_check_v1 keeps its signature and results (body replaced), so processes of earlier
releases work on it unchanged. The locks are shared and the key lock is only ever held exclusively
by trying, so their order cannot make a cycle; sorting the batch's keys cost more than locking them.

Expand only; no table changes, the function's grants unchanged.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

import re

from postbox.schema.apply_sql import apply_frozen, sql_file_text

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# The new body says SECURITY DEFINER and its search_path itself (CREATE OR REPLACE resets them).
FUNCTIONS = ["functions/inbox_commit_check_v1.sql"]

# Back to 0005: revision 0004's body, taken from its file, and what 0004 set on it.
RESTORED = "functions/inbox_receive_commit_check_v1.sql"
_CHECK = re.compile(r"^CREATE OR REPLACE FUNCTION postbox\.inbox_commit_check_v1\(\).*?^\$\$;\n", re.M | re.S)
ENTRY_POINT = """
ALTER FUNCTION postbox.inbox_commit_check_v1() SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
"""

RELEASED_SHA256 = "64035637786862d6b8e86284bd62c460a21684ed64ffb6e4b88536b2290adebd"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [sql_file_text(f) for f in FUNCTIONS]


def downgrade_statements() -> list[str]:
    bodies = _CHECK.findall(sql_file_text(RESTORED))
    assert len(bodies) == 1, "revision 0004's commit check"
    return [*bodies, ENTRY_POINT]


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), *downgrade_statements()]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=downgrade_statements())

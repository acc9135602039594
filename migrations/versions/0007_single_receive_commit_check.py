"""A single receive costs the server less: a message it queues behind its key's head files its
key's check at commit the way a batch does (postbox.inbox_commit_checks, whose check now has a
branch for one key), so the inbox loses its per-row insert trigger, whose condition every inserting
statement read back from the catalog; and the usual receive writes the current slot of the
deduplication ledger by name instead of routing its row through the partitioned table.
inbox_receive_v1 and inbox_commit_check_v1 keep their signatures and results (bodies replaced), so
processes of earlier releases work on them unchanged.

Expand only: no table changes besides the dropped trigger; the functions' grants unchanged.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

import re

from postbox.schema.apply_sql import apply_frozen, sql_file_text

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# The new body says SECURITY DEFINER and its search_path itself (CREATE OR REPLACE resets them).
FUNCTIONS = ["functions/inbox_receive_single_v1.sql"]

# Back to 0006: revision 0004's receive and trigger, taken from its file, with what 0004 set on the
# receive; and revision 0006's commit check (its file holds that function only).
RESTORED = "functions/inbox_receive_commit_check_v1.sql"
RESTORED_CHECK = "functions/inbox_commit_check_v1.sql"
_RECEIVE = re.compile(r"^CREATE OR REPLACE FUNCTION postbox\.inbox_receive_v1\(.*?^\$\$;\n", re.M | re.S)
_TRIGGER = re.compile(r"^CREATE CONSTRAINT TRIGGER inbox_pending_commit .*?;\n", re.M | re.S)
ENTRY_POINT = """
ALTER FUNCTION postbox.inbox_receive_v1(text, text, jsonb, text, text, bigint, jsonb, integer, text, text, text)
    SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
"""

RELEASED_SHA256 = "5dfdcafbee362412f61557f8668547a938317f522eeb7daca3f5d68d805466c2"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [sql_file_text(f) for f in FUNCTIONS]


def downgrade_statements() -> list[str]:
    text = sql_file_text(RESTORED)
    receive, trigger = _RECEIVE.findall(text), _TRIGGER.findall(text)
    assert len(receive) == 1, "revision 0004's receive"
    assert len(trigger) == 1, "revision 0004's trigger"
    return [*receive, ENTRY_POINT, *trigger, sql_file_text(RESTORED_CHECK)]


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), *downgrade_statements()]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=downgrade_statements())

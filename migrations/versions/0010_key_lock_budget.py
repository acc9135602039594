"""A transaction that receives or publishes messages under many keys no longer fills PostgreSQL's lock
table: each transaction locks at most 1,000 keys (shared, as producers do), and past that budget a
message queued behind its key's head files its key's repair instead of locking the key. Same
statuses, ids and guarantees; nothing is left without a head (see the SQL file).

inbox_receive_v1, the batches' core (inbox_receive_rows_v1), the inbox's check at commit
(inbox_commit_check_v1) and the outbox's (outbox_pending_commit_v1) keep their signatures (bodies
replaced), so processes of earlier releases work on them unchanged.

Expand only: no table changes; the functions' grants unchanged.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

import re

from postbox.schema.apply_sql import apply_frozen, sql_file_text, template_text

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# The new bodies say SECURITY DEFINER and their search_path where the functions had them (CREATE
# OR REPLACE resets both).
FUNCTIONS = ["functions/key_lock_budget_v1.sql"]

# Back to 0009, each function from the file of the revision that last made it: the receive from
# 0009's, the batch core from 0008's, the check at commit from 0007's (their bodies say SECURITY
# DEFINER where it applies), and the outbox's check from 0001's queue template, with what 0001's
# roles gave it.
_FUNCTION = r"^CREATE OR REPLACE FUNCTION postbox\.{}\(.*?^\$\$;\n"
RESTORED = [
    ("functions/inbox_receive_keyed_v1.sql", "inbox_receive_v1"),
    ("functions/inbox_receive_queue_lock_v1.sql", "inbox_receive_rows_v1"),
    ("functions/inbox_receive_single_v1.sql", "inbox_commit_check_v1"),
]
QUEUE_TEMPLATE = "functions/queue_v1.sql"
OUTBOX_CHECK_DEFINER = """
ALTER FUNCTION postbox.outbox_pending_commit_v1() SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
"""

RELEASED_SHA256 = "1b6cfa928d6ca260f8fffb009b3624bcd5d328ee3177e5f34ff4671af00f89cf"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [sql_file_text(f) for f in FUNCTIONS]


def _one(text: str, name: str) -> str:
    found = re.findall(_FUNCTION.format(re.escape(name)), text, re.M | re.S)
    assert len(found) == 1, f"one {name} to restore"
    return found[0]


def downgrade_statements() -> list[str]:
    restored = [_one(sql_file_text(file), name) for file, name in RESTORED]
    outbox_check = _one(template_text(QUEUE_TEMPLATE), "outbox_pending_commit_v1")
    return [*restored, outbox_check, OUTBOX_CHECK_DEFINER]


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), *downgrade_statements()]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=downgrade_statements())

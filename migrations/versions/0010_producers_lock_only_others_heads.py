"""A producer transaction locks only the keys it queues a message under behind another transaction's
head, so a transaction receiving or publishing messages under tens of thousands of new keys commits;
and a key's repair is never taken away unmade.

* The batches' core (inbox_receive_rows_v1) takes every key's lock before it looks for the heads
  only for its transaction's first 1,000 messages. Past them, it looks first, and locks (shared, to its
  commit) only the keys whose messages it queues behind a head another transaction made, then looks
  for those heads again under the locks. Under REPEATABLE READ only those keys get the check at
  commit.
* The outbox's check at commit (outbox_pending_commit_v1) skips a row queued behind a head its own
  transaction made: no lock, no check.
* repair_keys_v1 deletes a key's repairs before it looks for the key's head, instead of after: a
  repair filed in between is kept for the next claim instead of being deleted unmade.

Same statuses, ids and guarantees. All three keep their signatures (bodies replaced), so processes
of earlier releases work on them unchanged. Expand only: no table changes; grants unchanged.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06
"""

import re

from postbox.schema.apply_sql import apply_frozen, sql_file_text, template_text

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# The outbox's check says SECURITY DEFINER and its search_path itself (CREATE OR REPLACE resets
# them); the other two never had them.
FUNCTIONS = ["functions/producer_held_keys_v1.sql"]

# Back to 0009, each function from the file of the revision that last made it: the batch core from
# 0008's, the repair from 0001's, and the outbox's check from 0001's queue template, with what
# 0001's roles gave it.
_FUNCTION = r"^CREATE OR REPLACE FUNCTION postbox\.{}\(.*?^\$\$;\n"
RESTORED = [
    ("functions/inbox_receive_queue_lock_v1.sql", "inbox_receive_rows_v1"),
    ("functions/inbox_flow_v1.sql", "repair_keys_v1"),
]
QUEUE_TEMPLATE = "functions/queue_v1.sql"
OUTBOX_CHECK_DEFINER = """
ALTER FUNCTION postbox.outbox_pending_commit_v1() SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
"""

RELEASED_SHA256 = "885002a539fba08de9bfe22fd96f79495c145030a45403893f7aec38f4af0cd4"


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

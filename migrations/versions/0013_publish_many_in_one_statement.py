"""A batch publish (publish_many) writes its rows in one statement instead of one function call per
row, so it costs about what a batch receive of as many messages does.

* outbox_publish_batch_v1: when every message is well formed (one statement checks them all), the
  ids are taken in the loop's order, each key's first message becomes its head unless the key has
  queued rows or a head already, and the rest queue behind it, all in one statement. Under READ
  COMMITTED a second statement looks again at the heads it made under keys it was given: behind a
  row committed while the first waited for another transaction's head, such a head queues instead
  and the key gets a repair, as the loop left it. A batch with a malformed message runs the loop
  of 0001, which names the first bad field.

Same ids, order, heads, errors and guarantees. The function keeps its signature (body replaced), so
processes of earlier releases work on it unchanged. Expand only: no table changes; grants unchanged.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06
"""

import re

from postbox.schema.apply_sql import apply_frozen, sql_file_text

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# The new body says SECURITY DEFINER and its search_path itself (CREATE OR REPLACE resets them).
FUNCTIONS = ["functions/outbox_publish_batch_rows_v1.sql"]

# Back to 0012: the loop of 0001, taken from its file, with what 0001's roles gave it.
RESTORED = "functions/outbox_publish_v1.sql"
_BATCH = re.compile(r"^CREATE OR REPLACE FUNCTION postbox\.outbox_publish_batch_v1\(.*?^\$\$;\n", re.M | re.S)
DEFINER = """
ALTER FUNCTION postbox.outbox_publish_batch_v1(jsonb) SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp;
"""

RELEASED_SHA256 = "10f97595d4e03e50fe03f0c13d9287917eb09ed06c857fee2320d0e91f318dfa"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [sql_file_text(f) for f in FUNCTIONS]


def downgrade_statements() -> list[str]:
    batch = _BATCH.findall(sql_file_text(RESTORED))
    assert len(batch) == 1, "revision 0001's batch publish"
    return [*batch, DEFINER]


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), *downgrade_statements()]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=downgrade_statements())

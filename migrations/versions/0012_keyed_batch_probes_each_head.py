"""A keyed batch looks for its keys' heads with an index probe per message, whatever the inbox holds,
so its cost no longer grows with the messages queued in the inbox.

* inbox_receive_rows_v1 (the batches' core): for a transaction's first 1,000 batched messages under
  READ COMMITTED (keys locked first), whether a key has a head was an EXISTS, which PostgreSQL may
  run as a hash of the whole inbox, read by a sequential scan once per statement; it chose that with
  50,000 messages queued, so each batch cost more the more messages waited. It is now the scalar subquery the path past the first 1,000 messages
  already used: one probe of the head index per message.

Same statuses, ids and guarantees. The function keeps its signature (body replaced), so processes
of earlier releases work on it unchanged. Expand only: no table changes; grants unchanged.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06
"""

import re

from postbox.schema.apply_sql import apply_frozen, sql_file_text

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

FUNCTIONS = ["functions/inbox_receive_head_probe_v1.sql"]

# Back to 0011: the batch core of 0010, taken from its file (it never had SECURITY DEFINER nor a
# search_path of its own).
RESTORED = "functions/producer_held_keys_v1.sql"
_ROWS = re.compile(r"^CREATE OR REPLACE FUNCTION postbox\.inbox_receive_rows_v1\(.*?^\$\$;\n", re.M | re.S)

RELEASED_SHA256 = "9db1b3c02ba4e1ca313c86722e7b5c6db08749e0242aea862bc0a4e547404938"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [sql_file_text(f) for f in FUNCTIONS]


def downgrade_statements() -> list[str]:
    rows = _ROWS.findall(sql_file_text(RESTORED))
    assert len(rows) == 1, "revision 0010's batch core"
    return rows


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), *downgrade_statements()]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=downgrade_statements())

"""A single receive takes no key lock for a message it queues behind a head its own transaction made,
so a transaction receiving tens of thousands of messages one call at a time, several under each
key, commits instead of filling PostgreSQL's lock table.

* inbox_receive_v1: under READ COMMITTED, a message queued behind a head the same transaction made
  no longer takes its key's lock (shared, to the commit) nor looks for the head again; under
  REPEATABLE READ and SERIALIZABLE it no longer files its key's check at commit. Behind another
  transaction's head, or a head made in a savepoint, everything is as before.

Same statuses, ids and guarantees. The function keeps its signature (body replaced), so processes
of earlier releases work on it unchanged. Expand only: no table changes; grants unchanged.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06
"""

import re

from postbox.schema.apply_sql import apply_frozen, sql_file_text

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

FUNCTIONS = ["functions/inbox_receive_own_heads_v1.sql"]

# Back to 0010: the receive of 0009, taken from its file. Its body says SECURITY DEFINER and its
# search_path too.
RESTORED = "functions/inbox_receive_keyed_v1.sql"
_RECEIVE = re.compile(r"^CREATE OR REPLACE FUNCTION postbox\.inbox_receive_v1\(.*?^\$\$;\n", re.M | re.S)

RELEASED_SHA256 = "03babd756e5d45c1ac23f1c3f9dece16532a31802011e97725840708785abf28"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [sql_file_text(f) for f in FUNCTIONS]


def downgrade_statements() -> list[str]:
    receive = _RECEIVE.findall(sql_file_text(RESTORED))
    assert len(receive) == 1, "revision 0009's receive"
    return receive


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), *downgrade_statements()]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=downgrade_statements())

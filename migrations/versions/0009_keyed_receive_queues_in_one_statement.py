"""A single receive with a key costs the server less, with the same statuses, ids and guarantees.

Under READ COMMITTED, a message whose key already has a head (or queued messages) was inserted by a
second statement, after the receive's statement had tried to make it the key's head and found the
key taken. The receive's statement now looks for the key's head and queued messages itself and
inserts the message once, as the head or queued behind them. What follows a queued message is
unchanged: the key's lock taken shared and the head looked for again. One race ends differently: a
head completed while the statement runs leaves the message queued with its key's repair filed, so
it becomes the head at the next claim instead of at once (see the SQL file). Under REPEATABLE READ
and SERIALIZABLE, and for a message without a key, the receive does what revision 0008's did.
inbox_receive_v1 keeps its signature (body replaced), so processes of earlier releases work on it
unchanged.

Expand only: no table changes; the function's grants unchanged.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05
"""

import re

from postbox.schema.apply_sql import apply_frozen, sql_file_text

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# The new body says SECURITY DEFINER and its search_path itself (CREATE OR REPLACE resets them).
FUNCTIONS = ["functions/inbox_receive_keyed_v1.sql"]

# Back to 0008: its receive, taken from its file (which also holds 0008's batch core, unchanged
# here). Its body says SECURITY DEFINER and its search_path too.
RESTORED = "functions/inbox_receive_queue_lock_v1.sql"
_RECEIVE = re.compile(r"^CREATE OR REPLACE FUNCTION postbox\.inbox_receive_v1\(.*?^\$\$;\n", re.M | re.S)

RELEASED_SHA256 = "1b19896ee73076eccdd75c47f4cee09a8b30d5755a4d4a6db1d750d62caa5296"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [sql_file_text(f) for f in FUNCTIONS]


def downgrade_statements() -> list[str]:
    receive = _RECEIVE.findall(sql_file_text(RESTORED))
    assert len(receive) == 1, "revision 0008's receive"
    return receive


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), *downgrade_statements()]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=downgrade_statements())

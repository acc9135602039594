"""The JSON batch functions refuse a field they do not know: inbox_receive_batch_v2 and
outbox_publish_batch_v2 check every element's fields, then do what _v1 does; the unversioned
inbox_receive_batch and outbox_publish_batch call them. A misspelt field ("kye" for "key") was
dropped without a word, and the message stored without its key, so without its order.

The dead-letter retention keeps what a replay job has not settled: prune_dead_letters_v2 leaves a
dead letter alone while a replay item of it is pending or replaying (v1 deleted it, and the job
waited for it for ever).

An expand-only revision: the _v1 functions are unchanged, for processes of earlier releases
during a rolling deploy (see docs/upgrading.md).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""

import re

from postbox.schema.apply_sql import frozen_revision, sql_file_text

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

FUNCTIONS = ["functions/batch_fields_v2.sql", "functions/prune_dead_letters_v2.sql"]

# Back to 0013: the unversioned names call _v1 again, as 0001 made them (taken from its file), and
# the _v2 functions and their check go.
_ALIASES = re.compile(
    r"^CREATE OR REPLACE FUNCTION postbox\.(inbox_receive_batch|outbox_publish_batch)\(.*?^\$\$;\n",
    re.M | re.S,
)
DROPS = """
DROP FUNCTION IF EXISTS postbox.inbox_receive_batch_v2(jsonb);
DROP FUNCTION IF EXISTS postbox.outbox_publish_batch_v2(jsonb);
DROP FUNCTION IF EXISTS postbox.check_batch_fields_v1(jsonb, text[]);
DROP FUNCTION IF EXISTS postbox.prune_dead_letters_v2(timestamptz, integer);
"""

RELEASED_SHA256 = "8cb247aec3e37950e5f323b519189a23f6dfb2c94476978270d1411d02f26295"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [sql_file_text(f) for f in FUNCTIONS]


def downgrade_statements() -> list[str]:
    aliases = [m.group(0) for m in _ALIASES.finditer(sql_file_text("functions/aliases_v1.sql"))]
    assert len(aliases) == 2, "0001's two batch aliases"
    return [*aliases, DROPS]


# All the SQL of this revision, both ways (frozen(): what RELEASED_SHA256 pins), and how Alembic runs it.
frozen, upgrade, downgrade = frozen_revision(revision, RELEASED_SHA256, statements, downgrade_statements)

"""A gapless consumer's key starts at its first_sequence: a message below it is late (the
consumer's late_policy applies) instead of being taken for the key's start, after which the key
waited for ever for the sequence after it. inbox_promote_v1's body is replaced, and
postbox.key_gaps never shows an expected sequence below first_sequence.

Workers may read postbox.dedup_window: a worker compares the deduplication window in force (set
by postbox maintain) with its handlers' retry horizon at start, and says when it is too short.

A body replacement: the signature is unchanged, so processes of earlier releases work on the new
schema during a rolling deploy (see docs/upgrading.md).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07
"""

import re

from postbox.schema.apply_sql import frozen_revision, sql_file_text, template_text

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

FUNCTIONS = ["functions/inbox_promote_first_sequence_v1.sql"]

# Back to 0014: 0001's promotion (rendered from its queue template for the inbox) and view.
_PROMOTE = re.compile(r"^CREATE OR REPLACE FUNCTION postbox\.inbox_promote_v1\(.*?^\$\$;\n", re.M | re.S)
_VIEW = re.compile(r"^CREATE OR REPLACE VIEW postbox\.key_gaps AS\n.*?;\n", re.M | re.S)

GRANTS = "GRANT SELECT ON postbox.dedup_window TO postbox_worker;\n"
REVOKES = "REVOKE SELECT ON postbox.dedup_window FROM postbox_worker;\n"

RELEASED_SHA256 = "24a83beac7b663384c04a3438dc429b8e411d8b52ead4f94f50fd1e08a2e93d6"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [*(sql_file_text(f) for f in FUNCTIONS), GRANTS]


def downgrade_statements() -> list[str]:
    promote = _PROMOTE.findall(template_text("functions/queue_v1.sql"))
    view = _VIEW.findall(sql_file_text("views/views_v1.sql"))
    assert len(promote) == len(view) == 1, "0001's inbox promotion and key_gaps view"
    return [promote[0], view[0], REVOKES]


# All the SQL of this revision, both ways (frozen(): what RELEASED_SHA256 pins), and how Alembic runs it.
frozen, upgrade, downgrade = frozen_revision(revision, RELEASED_SHA256, statements, downgrade_statements)

"""A batch publish (publish_many, outbox_publish_batch_v1) writes its events in a few statements for
the whole batch, instead of one call of the single publish per event.

* outbox_publish_batch_v1: the checks find, in one pass, the events that may be wrong and check only
  those one by one (same errors); ids are taken in the batch's order; the first event of each key
  looks for its key's head (one index probe, none for an event without message_id and key, whose
  key is a new UUID) and, if there is none, tries to become it, in one statement, keys in one
  global order; a head just made whose key has earlier events queued steps back behind them and
  files the key's repair (looked for in a new statement, after any wait for another transaction's
  head); every other event is queued in one statement. Under READ COMMITTED the batch then checks the keys it queued events under behind
  another transaction's head itself, once per key (their lock, shared, to the commit, then their
  heads looked for again), instead of a check per queued row at commit: the outbox's trigger
  (outbox_pending_commit) skips the rows a batch checked, which it says in the transaction-local
  setting postbox.outbox_check. Under REPEATABLE READ and SERIALIZABLE the check per row at commit
  stays.

Same ids, order, errors and guarantees. The function keeps its signature (body replaced), so
processes of earlier releases work on it unchanged. Expand only: no table changes (one trigger's
condition); grants unchanged.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

import re

from postbox.schema.apply_sql import frozen_revision, sql_file_text

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

FUNCTIONS = ["functions/outbox_publish_rows_v1.sql"]

# Back to 0012: the loop of 0001, taken from its file, run as its owner as roles_v1.sql made it
# (CREATE OR REPLACE resets that).
RESTORED = "functions/outbox_publish_v1.sql"
_BATCH = re.compile(r"^CREATE OR REPLACE FUNCTION postbox\.outbox_publish_batch_v1\(.*?^\$\$;\n", re.M | re.S)
_DEFINER = (
    "ALTER FUNCTION postbox.outbox_publish_batch_v1(jsonb)"
    " SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp"
)
# ...and the outbox's check at commit on every queued row, as 0001 made it.
_TRIGGER = """DROP TRIGGER outbox_pending_commit ON postbox.outbox;
CREATE CONSTRAINT TRIGGER outbox_pending_commit AFTER INSERT ON postbox.outbox
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.state = 'pending')
    EXECUTE FUNCTION postbox.outbox_pending_commit_v1();
"""

RELEASED_SHA256 = "780d69928271b3b0bb63b859152330b8e7e798ed3e41bc53e7ba33fce4e64bb3"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [sql_file_text(f) for f in FUNCTIONS]


def downgrade_statements() -> list[str]:
    batch = _BATCH.findall(sql_file_text(RESTORED))
    assert len(batch) == 1, "revision 0001's batch publish"
    return [*batch, _DEFINER, _TRIGGER]


# All the SQL of this revision, both ways (frozen(): what RELEASED_SHA256 pins), and how Alembic runs it.
frozen, upgrade, downgrade = frozen_revision(revision, RELEASED_SHA256, statements, downgrade_statements)

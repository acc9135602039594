"""A single receive and a keyed batch cost the server less, with the same results and guarantees.

* A receive that queues a message behind its key's head, under READ COMMITTED, takes the key's lock
  shared when it queues the message, holds it to its commit and looks for the head at once, instead
  of filing its key's check at commit (a row of postbox.inbox_commit_checks and a deferred
  trigger). Under REPEATABLE READ and SERIALIZABLE the check at commit stays. inbox_receive_v1
  keeps its signature and results (body replaced), so processes of earlier releases work on it.
* A keyed batch does the same under READ COMMITTED: it takes its new messages' keys' locks shared
  before it looks for their heads, so the heads it finds are its queued messages' check, with no
  check row and no second look at commit. inbox_receive_rows_v1 keeps its signature and results.
* The inbox's state column is of a domain, postbox.inbox_state, which holds the table's former
  CHECK (the same four states): PostgreSQL 15 re-reads and prepares a table's CHECK for every
  statement that inserts into it, and a domain's check once per session. The column changes type
  without a rewrite (the domain is text), but the inbox's three partial indexes on the state are
  rebuilt under the table's lock, and the four views that read the column are re-created.

Expand only for processes: every earlier release's SQL reads and writes the column as text.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

import re

from postbox.schema.apply_sql import apply_frozen, sql_file_text

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# The new body says SECURITY DEFINER and its search_path itself (CREATE OR REPLACE resets them).
FUNCTIONS = ["functions/inbox_receive_queue_lock_v1.sql"]

# Back to 0007: its receive, taken from its file (which also holds 0007's commit check, unchanged
# here). Its body says SECURITY DEFINER and its search_path too.
RESTORED = "functions/inbox_receive_single_v1.sql"
_RECEIVE = re.compile(r"^CREATE OR REPLACE FUNCTION postbox\.inbox_receive_v1\(.*?^\$\$;\n", re.M | re.S)
# And the batch's core as revision 0004 made it (0005 to 0007 left it alone), from 0004's file.
RESTORED_BATCH = "functions/inbox_receive_commit_check_v1.sql"
_ROWS = re.compile(r"^CREATE OR REPLACE FUNCTION postbox\.inbox_receive_rows_v1\(.*?^\$\$;\n", re.M | re.S)

STATES = "('pending', 'ready', 'running', 'blocked')"
VIEWS = "postbox.blocked_keys, postbox.key_gaps, postbox.live_workers, postbox.inbox_by_attempt"
# The four views that read the column are dropped, then made again as they were: three from revision
# 0001's file, and live_workers with the workers' columns it has had since (its file selects w.*,
# which now has one more), each with its comment and the grants roles_v1.sql gave it.
VIEWS_FILE = "views/views_v1.sql"
_VIEW = r"^CREATE OR REPLACE VIEW postbox\.{}\b.*?;\nCOMMENT ON VIEW postbox\.{} IS .*?;\n"
LIVE_WORKERS = """
CREATE VIEW postbox.live_workers AS
SELECT w.id, w.kind, w.queue, w.host, w.pid, w.concurrency, w.version, w.started_at, w.heartbeat_at,
       w.stopping_at, now() - w.heartbeat_at AS since_heartbeat,
       (SELECT count(*) FROM postbox.inbox i WHERE i.state = 'running' AND i.claimed_by = w.id) AS inbox_in_flight
  FROM postbox.workers w;
COMMENT ON VIEW postbox.live_workers IS 'Registered processes with their heartbeat age and in-flight inbox messages.';
"""
VIEW_GRANTS = f"GRANT SELECT ON {VIEWS} TO postbox_operator, postbox_reader;\n"


def _views() -> str:
    """The four views as revision 0007 has them."""
    text = sql_file_text(VIEWS_FILE)
    found = [
        re.findall(_VIEW.format(v, v), text, re.M | re.S)
        for v in ("blocked_keys", "key_gaps", "inbox_by_attempt")
    ]
    assert all(len(f) == 1 for f in found), "revision 0001's views"
    return "".join(f[0] for f in found) + LIVE_WORKERS + VIEW_GRANTS


STATE_DOMAIN = f"""
DROP VIEW {VIEWS};
CREATE DOMAIN postbox.inbox_state AS text;
ALTER TABLE postbox.inbox ALTER COLUMN state TYPE postbox.inbox_state;
ALTER DOMAIN postbox.inbox_state ADD CONSTRAINT inbox_state_check CHECK (VALUE IN {STATES});
ALTER TABLE postbox.inbox DROP CONSTRAINT inbox_state_check;
COMMENT ON DOMAIN postbox.inbox_state IS 'The state of a live inbox message: pending (queued behind its key''s head), ready, running, blocked (its key held behind a dead letter).';
"""
STATE_TEXT = f"""
DROP VIEW {VIEWS};
ALTER TABLE postbox.inbox ALTER COLUMN state TYPE text;
ALTER TABLE postbox.inbox ADD CONSTRAINT inbox_state_check CHECK (state IN {STATES});
DROP DOMAIN postbox.inbox_state;
"""

RELEASED_SHA256 = "a232f1f587855cdce1bf63cb58648c6e2af7bba0ab933f49bda33275d1ded720"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    return [*(sql_file_text(f) for f in FUNCTIONS), STATE_DOMAIN, _views()]


def downgrade_statements() -> list[str]:
    receive = _RECEIVE.findall(sql_file_text(RESTORED))
    assert len(receive) == 1, "revision 0007's receive"
    rows = _ROWS.findall(sql_file_text(RESTORED_BATCH))
    assert len(rows) == 1, "revision 0004's batch core"
    return [STATE_TEXT, _views(), *receive, *rows]


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), *downgrade_statements()]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=downgrade_statements())

"""Initial schema: inbox, outbox, dead letters, workers; producer functions. Released in 0.1.0:
frozen (RELEASED_SHA256 pins every line of SQL it applies; a change is a new revision).

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from pathlib import Path

from postbox.schema.apply_sql import apply_frozen, sql_file_text, template_text
from postbox.schema.render import render_each

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

FUNCTIONS = [
    "functions/common_v1.sql",
    "functions/consumers_v1.sql",
    "functions/inbox_flow_v1.sql",
    "functions/inbox_receive_v1.sql",
    "functions/outbox_publish_v1.sql",
    "functions/inbox_worker_v1.sql",
    "functions/queue_v1.sql",
    "functions/aliases_v1.sql",
    "views/views_v1.sql",
    "functions/dead_letter_ops_v1.sql",
    "functions/replay_v1.sql",
    "functions/operator_aliases_v1.sql",
    "functions/roles_api_v1.sql",
]

# Queue templates: applied once for the inbox and once for the outbox (postbox.schema.render).
PER_DIRECTION = {"functions/queue_v1.sql"}

# Applied after everything else: grants cover every table and function present.
ROLES = "roles_v1.sql"

TRIGGERS = """
{{#each}}
CREATE CONSTRAINT TRIGGER {{table}}_pending_commit AFTER INSERT ON postbox.{{table}}
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.state = 'pending')
    EXECUTE FUNCTION postbox.{{table}}_pending_commit_v1();
CREATE TRIGGER {{table}}_replay_settled AFTER DELETE ON postbox.{{table}}
    FOR EACH ROW WHEN (OLD.replay_of IS NOT NULL) EXECUTE FUNCTION postbox.replay_settled_v1();
{{/each}}
CREATE TRIGGER dead_letters_link_replay BEFORE INSERT ON postbox.dead_letters
    FOR EACH ROW EXECUTE FUNCTION postbox.dead_letter_link_replay_v1();
"""


RELEASED_SHA256 = "4b6ff8c2387f48d1abb8aad14f69c5fc9520fea511f59e60ed358c4cf0cbb56e"


def statements() -> list[str]:
    """Every SQL text this revision applies, in order."""
    here = Path(__file__).parent
    parts = [(here / "0001_schema.sql").read_text(encoding="utf-8"), template_text(here / "0001_queues.sql")]
    parts += [template_text(n) if n in PER_DIRECTION else sql_file_text(n) for n in FUNCTIONS]
    return [*parts, render_each(TRIGGERS), sql_file_text(ROLES)]


def upgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=statements())


# Everything in schema postbox but Alembic's own version table.
DOWNGRADE = """
DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = 'postbox' AND c.relkind IN ('r', 'v', 'm', 'p') AND c.relname <> 'alembic_version'
    LOOP
        EXECUTE format('DROP %s IF EXISTS postbox.%I CASCADE',
                       CASE WHEN EXISTS (SELECT 1 FROM pg_views WHERE schemaname = 'postbox' AND viewname = r.relname)
                            THEN 'VIEW' ELSE 'TABLE' END, r.relname);
    END LOOP;
    FOR r IN SELECT p.oid::regprocedure AS sig FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
              WHERE n.nspname = 'postbox'
    LOOP
        EXECUTE format('DROP FUNCTION IF EXISTS %s CASCADE', r.sig);
    END LOOP;
END
$$;
"""


def downgrade() -> None:
    apply_frozen(revision, RELEASED_SHA256, frozen(), run=[DOWNGRADE])


def frozen() -> list[str]:
    """All the SQL of this revision, both ways: what RELEASED_SHA256 pins."""
    return [*statements(), DOWNGRADE]

"""Initial schema: inbox, outbox, dead letters, workers; producer functions.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from pathlib import Path

from postbox.schema.apply_sql import run_sql, run_sql_file, run_sql_template
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


def upgrade() -> None:
    here = Path(__file__).parent
    run_sql((here / "0001_schema.sql").read_text(encoding="utf-8"))
    run_sql_template(here / "0001_queues.sql")
    for name in FUNCTIONS:
        if name in PER_DIRECTION:
            run_sql_template(name)
        else:
            run_sql_file(name)
    run_sql(render_each(TRIGGERS))
    run_sql_file(ROLES)


def downgrade() -> None:
    # Everything in schema postbox but Alembic's own version table.
    run_sql(
        """
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
    )

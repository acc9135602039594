"""Schema management: migrations build exactly the declared schema, both ways, online and offline."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from postbox._version import SCHEMA_REVISION
from postbox.config.settings import sqlalchemy_url
from postbox.db.paths import sql_dir
from postbox.schema import migrate
from postbox.schema.declared import metadata
from postbox.schema.render import render, render_each


def _objects(url: str) -> set[tuple[str, str]]:
    with psycopg.connect(url) as c:
        rows = c.execute(
            """
            SELECT 'rel', c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = 'postbox' AND c.relname <> 'alembic_version'
               AND c.relname NOT LIKE 'alembic_version%'
            UNION ALL
            SELECT 'fn', p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname = 'postbox'
            """
        ).fetchall()
    return {(str(k), str(v)) for k, v in rows}


def _schema_diff(url: str) -> list[object]:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn,
                opts={
                    "compare_type": True,
                    "include_schemas": True,
                    "include_name": lambda name, type_, parent: type_ != "schema" or name == "postbox",
                    "include_object": lambda obj, name, type_, reflected, compare_to: (
                        name != "alembic_version"
                    ),
                },
            )
            diffs = compare_metadata(ctx, metadata)
    finally:
        engine.dispose()

    def is_comment(d: object) -> bool:
        first = d[0] if isinstance(d, list) else d
        return isinstance(first, tuple) and str(first[0]).endswith("comment")

    return [d for d in diffs if not is_comment(d)]


def test_upgrade_downgrade_upgrade_round_trip(empty_database):
    """Upgrading, downgrading to base and upgrading again gives the same objects; base leaves none."""
    url = empty_database.url
    migrate.upgrade(url)
    first = _objects(url)
    assert ("rel", "inbox") in first and ("rel", "outbox") in first and ("rel", "dead_letters") in first
    assert migrate.current_revision(url) == SCHEMA_REVISION
    migrate.downgrade(url, "base")
    assert _objects(url) == set()
    assert migrate.current_revision(url) is None
    migrate.upgrade(url)
    assert _objects(url) == first


def test_migrations_build_the_declared_schema(database):
    """Alembic's autogenerate finds no difference between the migrated database and postbox.schema.declared."""
    assert _schema_diff(database.url) == []


def test_offline_ddl_applies_to_an_empty_database(empty_database):
    """`postbox migrate --sql` prints DDL that a DBA can apply to an empty database as is."""
    out = subprocess.run(
        [sys.executable, "-m", "postbox", "migrate", "--sql"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "CREATE TABLE postbox.inbox" in out
    assert "CREATE OR REPLACE FUNCTION postbox.inbox_receive_v1" in out
    psql = shutil.which("psql")
    if psql:
        subprocess.run(
            [psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", empty_database.url],
            input=out,
            text=True,
            check=True,
            capture_output=True,
        )
    else:
        with psycopg.connect(empty_database.url, autocommit=True) as c:
            c.execute(out.encode())
    assert migrate.current_revision(empty_database.url) == SCHEMA_REVISION
    assert _schema_diff(empty_database.url) == []


def test_cli_migrate_applies_and_reports(empty_database):
    """`postbox migrate` upgrades the database named by --database-url and says which revision."""
    result = subprocess.run(
        [sys.executable, "-m", "postbox", "--database-url", empty_database.url, "migrate"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"revision {SCHEMA_REVISION}" in result.stderr
    assert migrate.current_revision(empty_database.url) == SCHEMA_REVISION


def _postbox(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "postbox", "--database-url", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_commands_on_a_database_never_migrated_say_what_to_do(empty_database):
    """Every kind of command (a one-shot listing, a status, a long-running worker) on a database
    without Postbox says in one line to run `postbox migrate`, exit 1, no traceback."""
    for args in (
        ("status",),
        ("dlq", "list"),
        ("worker", "--consumer", "basic", "--app", "tests.apps.basic:registry", "--connect-timeout", "5"),
    ):
        result = _postbox(empty_database.url, *args)
        assert result.returncode == 1, (args, result.stderr)
        assert "database not migrated: run 'postbox migrate'" in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_migrate_check_exits_non_zero_while_an_upgrade_is_pending(empty_database):
    pending = _postbox(empty_database.url, "migrate", "--check")
    assert pending.returncode == 1 and "database not migrated" in pending.stderr
    assert _postbox(empty_database.url, "migrate").returncode == 0
    done = _postbox(empty_database.url, "migrate", "--check")
    assert done.returncode == 0 and f"up to date (revision {SCHEMA_REVISION})" in done.stderr
    # SQLAlchemy's URL form is accepted as well.
    sa = _postbox(empty_database.url.replace("postgresql://", "postgresql+psycopg://"), "migrate", "--check")
    assert sa.returncode == 0, sa.stderr


def test_an_unknown_revision_is_refused_by_name(empty_database):
    for args in (
        ("migrate", "--revision", "zzz"),
        ("migrate", "--sql", "--revision", "zzz"),
        ("downgrade", "zzz"),
    ):
        result = _postbox(empty_database.url, *args)
        assert result.returncode == 1, args
        assert "unknown revision 'zzz'" in result.stderr and "0001" in result.stderr
        assert "Traceback" not in result.stderr


def test_a_backwards_sql_range_and_a_downgrade_of_nothing_say_so(empty_database):
    """``migrate --sql --from 0005 --revision 0003`` printed an empty BEGIN/COMMIT and exited 0: now
    a usage error (2). ``downgrade base`` on a database Postbox never migrated said it removed Postbox:
    now it says there is nothing to downgrade (exit 0, nothing touched)."""
    r = _postbox(empty_database.url, "migrate", "--sql", "--from", "0005", "--revision", "0003")
    assert r.returncode == 2 and "--from 0005 is past --revision 0003" in r.stderr and not r.stdout
    r = _postbox(empty_database.url, "downgrade", "base")
    assert r.returncode == 0 and "has no Postbox schema: nothing to downgrade" in r.stderr, r.stderr
    assert "removed" not in r.stderr


def test_migrate_and_downgrade_of_a_release_that_is_behind_the_schema_say_so_without_a_traceback(database):
    """A schema a newer release migrated (here a revision this Postbox does not ship): this release's
    ``migrate`` (an older image's migrate job in a rolling deploy) has nothing to do and exits 0,
    leaving it as it is; its ``downgrade`` cannot undo a revision it does not know, and says which
    release can (exit 1). Both used to end in alembic's traceback."""
    with psycopg.connect(database.url, autocommit=True) as c:
        c.execute("UPDATE postbox.alembic_version SET version_num = '9999'")
    up = _postbox(database.url, "migrate")
    assert up.returncode == 0, up.stderr
    assert f"schema at 9999 is newer than this postbox ({SCHEMA_REVISION}): nothing to migrate" in up.stderr
    down = _postbox(database.url, "downgrade", "0012")
    assert down.returncode == 1 and "with the release that made 9999" in down.stderr, down.stderr
    for result in (up, down):
        assert "Traceback" not in result.stderr, result.stderr
    assert migrate.current_revision(database.url) == "9999"


def test_downgrade_to_base_refuses_to_delete_data_unless_forced_and_removes_the_schema(database):
    """`postbox downgrade base` on a database holding messages says what would be lost and refuses;
    with --force it removes everything Postbox made, schema included."""
    import postbox

    with psycopg.connect(database.url) as c:
        postbox.receive(c, consumer="c", message_id="m", payload={})
        c.commit()
    refused = _postbox(database.url, "downgrade", "base")
    assert refused.returncode == 1
    assert "would delete live inbox messages (1)" in refused.stderr and "--force" in refused.stderr
    assert migrate.current_revision(database.url) == SCHEMA_REVISION
    forced = _postbox(database.url, "downgrade", "base", "--force")
    assert forced.returncode == 0, forced.stderr
    assert "schema postbox dropped" in forced.stderr
    with psycopg.connect(database.url) as c:
        assert c.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'postbox'").fetchone() == (0,)
    # Removing an empty Postbox needs no --force.
    assert _postbox(database.url, "migrate").returncode == 0
    assert _postbox(database.url, "downgrade", "base").returncode == 0


def test_the_queue_protocol_is_one_source_rendered_identically_for_the_inbox_and_the_outbox():
    """The queue templates render to the same SQL every time (migrations stay reproducible), leave
    no mark behind, and give each direction its own functions with its own table and queue column."""
    sql = migrate.upgrade_sql()
    assert sql == migrate.upgrade_sql()
    assert "{{" not in sql.replace("'{{", "")
    for name in ("claim", "complete", "retry", "dead_letter", "release", "promote", "pending_commit"):
        assert f"CREATE OR REPLACE FUNCTION postbox.inbox_{name}_v1(" in sql
        assert f"CREATE OR REPLACE FUNCTION postbox.outbox_{name}_v1(" in sql
    template = (sql_dir() / "functions" / "queue_v1.sql").read_text(encoding="utf-8")
    inbox, outbox = (re.sub(r"--[^\n]*", "", render(template, d)) for d in ("inbox", "outbox"))
    assert "outbox" not in inbox and "destination" not in inbox
    assert "inbox" not in outbox and "consumer" not in outbox


def test_a_template_mark_no_direction_knows_is_refused():
    with pytest.raises(ValueError, match="unknown template word"):
        render("SELECT {{tabel}}", "inbox")
    with pytest.raises(ValueError, match="left unrendered"):
        render_each("SELECT 1 {{#inbox}}")

"""Upgrades: a released revision applies exactly the SQL it was released with, forever."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import psycopg
import pytest

from postbox._version import SCHEMA_REVISION
from postbox.config.settings import sqlalchemy_url
from postbox.db.paths import migrations_dir, sql_dir
from postbox.schema import apply_sql, migrate
from postbox.schema.apply_sql import FrozenRevisionChanged, digest

# Each release's revisions and the SHA-256 of all their SQL (postbox.schema.apply_sql.digest). A
# failure here means a released revision's SQL changed: restore it, and put the change in a new
# revision (a new `_v2` function where behaviour changes). Only a revision that was never
# released may have its pin updated.
RELEASED = {
    "0001": "4b6ff8c2387f48d1abb8aad14f69c5fc9520fea511f59e60ed358c4cf0cbb56e",  # 0.1.0
    "0002": "848f35b369ff253d085cfe18a3283fdeeae2effa68f1fa9f58f117f5d693032b",  # 0.2.0
    "0003": "54903cb3edf09c4835f1d364841dac2991acd67f1e9f71194416b1857426c3bc",  # 0.2.0
    "0004": "59a9848a9ee6a8f67846add1a23b5eb294a5ab49177901c48642da3e962968bd",  # 0.3.0
    "0005": "47b9a39c5ed5762a6f1bc8abaf81561e7ea2e58a35ee8609dfcd670ff4f18c71",  # 0.4.0
    "0006": "64035637786862d6b8e86284bd62c460a21684ed64ffb6e4b88536b2290adebd",  # 0.5.0
    "0007": "5dfdcafbee362412f61557f8668547a938317f522eeb7daca3f5d68d805466c2",  # 0.6.0
    "0008": "a232f1f587855cdce1bf63cb58648c6e2af7bba0ab933f49bda33275d1ded720",  # 0.7.0
    "0009": "1b19896ee73076eccdd75c47f4cee09a8b30d5755a4d4a6db1d750d62caa5296",  # 0.8.0
    "0010": "885002a539fba08de9bfe22fd96f79495c145030a45403893f7aec38f4af0cd4",  # 0.9.0
    "0011": "03babd756e5d45c1ac23f1c3f9dece16532a31802011e97725840708785abf28",  # 0.10.0
    "0012": "9db1b3c02ba4e1ca313c86722e7b5c6db08749e0242aea862bc0a4e547404938",  # 0.11.0
    "0013": "780d69928271b3b0bb63b859152330b8e7e798ed3e41bc53e7ba33fce4e64bb3",  # 0.12.0
    "0014": "8cb247aec3e37950e5f323b519189a23f6dfb2c94476978270d1411d02f26295",  # 0.15.0
    "0015": "24a83beac7b663384c04a3438dc429b8e411d8b52ead4f94f50fd1e08a2e93d6",  # 0.16.0
}


def _revision_module(revision: str) -> ModuleType:
    (path,) = list((migrations_dir() / "versions").glob(f"{revision}_*.py"))
    spec = importlib.util.spec_from_file_location(f"postbox_revision_{revision}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("revision", migrate.known_revisions())
def test_a_released_revision_applies_exactly_the_sql_it_was_released_with(revision):
    module = _revision_module(revision)
    assert revision in RELEASED, f"revision {revision} has no pin: add it to RELEASED when it is released"
    assert RELEASED[revision] == module.RELEASED_SHA256, "the revision's own pin was changed"
    assert digest(module.frozen()) == RELEASED[revision], (
        f"the SQL of released revision {revision} changed: restore it and put the change in a new revision"
    )


def test_the_digest_tells_apart_texts_that_only_split_differently():
    assert digest(["ab", "c"]) != digest(["a", "bc"])
    assert digest(["SELECT 1"]) == digest(["SELECT 1"])


def test_a_changed_function_file_stops_the_migration_before_it_applies_anything(
    empty_database, tmp_path, monkeypatch
):
    """Someone edits a released `_v1` function in place: the upgrade refuses, names the revision and
    says what to do, and the database is left as it was."""
    edited = tmp_path / "sql"
    shutil.copytree(sql_dir(), edited)
    common = edited / "functions" / "common_v1.sql"
    common.write_text(common.read_text() + "\n-- a quiet fix\n")
    monkeypatch.setattr(apply_sql, "sql_dir", lambda: edited)
    with pytest.raises(FrozenRevisionChanged, match=r"revision 0001 is released and frozen.*new revision"):
        migrate.upgrade(empty_database.url)
    with psycopg.connect(empty_database.url) as c:
        tables = c.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'postbox'").fetchone()
    assert tables == (0,)


@pytest.mark.parametrize("revision", migrate.known_revisions())
def test_the_revision_files_name_no_sql_outside_the_package_data(revision):
    """What a revision reads is shipped: every file it names exists under sql/ or next to it."""
    module = _revision_module(revision)
    names = [module.FUNCTIONS] if isinstance(module.FUNCTIONS, str) else module.FUNCTIONS
    for name in names:
        assert (sql_dir() / name).is_file(), name
    assert Path(sql_dir() / "roles_v1.sql").is_file()


def test_the_schema_revision_the_code_needs_is_the_newest_it_ships():
    assert migrate.head_revision() == SCHEMA_REVISION
    assert migrate.known_revisions() == [f"{n:04d}" for n in range(1, 16)]


def _postbox(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "postbox", "--database-url", url, *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_commands_on_the_previous_releases_schema_say_to_migrate(empty_database):
    """A database left at 0001 (the previous release): every command that needs the schema says in
    one line what to do, exits 1, no traceback; `migrate --check` fails the deploy pipeline; the DDL
    of the step is printable for a DBA; `migrate` then makes it usable."""
    url = empty_database.url
    migrate.upgrade(url, "0001")
    needs = f"schema at 0001, this postbox needs {SCHEMA_REVISION}: run 'postbox migrate'"
    for args in (
        ("status",),
        ("dlq", "list"),
        ("worker", "--consumer", "basic", "--app", "tests.apps.basic:registry", "--connect-timeout", "5"),
        ("migrate", "--check"),
    ):
        result = _postbox(url, *args)
        assert result.returncode == 1, (args, result.stderr)
        assert needs in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
    ddl = _postbox(url, "migrate", "--sql", "--from", "0001")
    assert ddl.returncode == 0, ddl.stderr
    assert "worker_heartbeat_v2" in ddl.stdout and "CREATE TABLE postbox.inbox (" not in ddl.stdout
    assert _postbox(url, "migrate").returncode == 0
    assert _postbox(url, "status").returncode == 0


USER_ENV_PY = """
from alembic import context
from sqlalchemy import create_engine

engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
with engine.begin() as connection:
    context.configure(connection=connection)  # the application's own version table (public)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""

USER_REVISION = """
from alembic import op
import sqlalchemy as sa

revision = "a1"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table("orders", sa.Column("id", sa.Integer, primary_key=True))


def downgrade():
    op.drop_table("orders")
"""

# The deploy step of docs/upgrading.md: Postbox's revisions, then the application's, one after the
# other (an Alembic env.py cannot run another Alembic project inside itself).
USER_DEPLOY = """
import sys

from alembic import command
from alembic.config import Config

from postbox.schema import migrate as postbox_migrations

postbox_migrations.upgrade(sys.argv[1])  # recorded in postbox.alembic_version
command.upgrade(Config("alembic.ini"), "head")  # recorded in the application's own version table
"""


def test_an_applications_own_alembic_project_runs_beside_postbox_migrations(empty_database, tmp_path):
    """Each keeps its own version table, and `postbox migrate --check` sees an up-to-date schema."""
    project = tmp_path / "alembic"
    (project / "versions").mkdir(parents=True)
    (project / "env.py").write_text(USER_ENV_PY)
    (project / "versions" / "a1_orders.py").write_text(USER_REVISION)
    (tmp_path / "deploy.py").write_text(USER_DEPLOY)
    sa_url = sqlalchemy_url(empty_database.url)
    (tmp_path / "alembic.ini").write_text(
        f"[alembic]\nscript_location = {project}\nsqlalchemy.url = {sa_url.replace('%', '%%')}\n"
    )
    done = subprocess.run(
        [sys.executable, "deploy.py", empty_database.url],
        check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with psycopg.connect(empty_database.url) as c:
        assert c.execute("SELECT version_num FROM public.alembic_version").fetchall() == [("a1",)]
        assert c.execute("SELECT version_num FROM postbox.alembic_version").fetchall() == [(SCHEMA_REVISION,)]
        assert c.execute("SELECT to_regclass('public.orders') IS NOT NULL").fetchone() == (True,)
    check = subprocess.run(
        [sys.executable, "-m", "postbox", "--database-url", empty_database.url, "migrate", "--check"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr


# --- the previous release, for real ---------------------------------------------------------

CATALOG = {
    "columns": """SELECT table_name || '.' || column_name, concat_ws(' | ', ordinal_position, data_type,
                         is_nullable, column_default, collation_name)
                    FROM information_schema.columns WHERE table_schema = 'postbox'""",
    "indexes": "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'postbox'",
    "constraints": """SELECT conrelid::regclass || '.' || conname,
                             concat_ws(' | ', pg_get_constraintdef(c.oid), condeferrable, condeferred)
                        FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
                       WHERE n.nspname = 'postbox'""",
    "triggers": """SELECT tgrelid::regclass || '.' || tgname, pg_get_triggerdef(t.oid)
                     FROM pg_trigger t JOIN pg_class r ON r.oid = t.tgrelid JOIN pg_namespace n ON n.oid = r.relnamespace
                    WHERE n.nspname = 'postbox' AND NOT t.tgisinternal""",
    "views": "SELECT viewname, definition FROM pg_views WHERE schemaname = 'postbox'",
    "functions": """SELECT p.oid::regprocedure::text, concat_ws(' | ', pg_get_functiondef(p.oid), p.proacl::text,
                           obj_description(p.oid, 'pg_proc'))
                      FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'postbox'""",
    "relations": """SELECT c.relname, concat_ws(' | ', c.relkind, c.relacl::text, obj_description(c.oid, 'pg_class'))
                      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                     WHERE n.nspname = 'postbox' AND c.relkind IN ('r', 'v', 'm', 'p', 'S')""",
    "column comments and grants": """SELECT c.relname || '.' || a.attname,
                                            concat_ws(' | ', col_description(c.oid, a.attnum), a.attacl::text)
                                       FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                                       JOIN pg_namespace n ON n.oid = c.relnamespace
                                      WHERE n.nspname = 'postbox' AND a.attnum > 0 AND NOT a.attisdropped""",
    "schema": "SELECT nspname, concat_ws(' | ', nspacl::text, obj_description(oid, 'pg_namespace')) FROM pg_namespace WHERE nspname = 'postbox'",
}


def _catalog(url: str) -> dict[str, dict[str, str]]:
    with psycopg.connect(url) as c:
        return {part: dict(c.execute(sql).fetchall()) for part, sql in CATALOG.items()}  # type: ignore[misc]


def _assert_same_catalog(
    a: dict[str, dict[str, str]], b: dict[str, dict[str, str]], a_name: str, b_name: str
) -> None:
    """Every part of two catalogs (:func:`_catalog`) is the same; else what only each side has."""
    for part in CATALOG:
        only_a = {k: v for k, v in a[part].items() if b[part].get(k) != v}
        only_b = {k: v for k, v in b[part].items() if a[part].get(k) != v}
        assert only_a == only_b == {}, f"{part} differ:\n{a_name}: {only_a}\n{b_name}: {only_b}"


@pytest.fixture(scope="module")
def previous(tmp_path_factory):
    from tests.previous_release import unpack

    return unpack(tmp_path_factory.mktemp("release"))


def test_a_database_upgraded_from_the_previous_release_is_identical_to_a_fresh_one(pg_server, previous):
    """Built two ways: fresh at head by this postbox, and at 0001 by the released 0.1.0 (with
    messages in it), then upgraded by this postbox. Tables, columns, indexes, constraints, triggers,
    views, function bodies and their settings, grants and comments: no difference."""
    from contextlib import contextmanager

    from tests.conftest import _cloned

    cloned = contextmanager(_cloned)
    with cloned(pg_server, "postbox_fresh", None) as fresh, cloned(pg_server, "postbox_old", None) as old:
        migrate.upgrade(fresh.url)
        made = previous.postbox("--database-url", old.url, "migrate")
        assert made.returncode == 0, made.stderr
        assert migrate.current_revision(old.url) == "0001"
        with psycopg.connect(old.url) as c:
            c.execute("SELECT postbox.inbox_receive('c', 'm1', '{}'::jsonb, 'k')")
            c.execute("SELECT postbox.outbox_publish('d', '{}'::jsonb, 'k')")
        migrate.upgrade(old.url)
        assert migrate.current_revision(old.url) == SCHEMA_REVISION
        a, b = _catalog(fresh.url), _catalog(old.url)
    _assert_same_catalog(a, b, "fresh", "upgraded")
    assert (
        len(a["functions"]) > 50
        and "worker_heartbeat_v2(text,text,text,text,integer,integer,text,text,boolean,timestamp with time zone)"
        in str(a["functions"])
    )


def test_the_previous_release_keeps_working_on_the_new_schema_and_says_so(database, previous):
    """After the upgrade, 0.1.0's commands run (its versioned functions are all still there) and say
    that the schema is newer than they are; its migrate does not touch a schema it does not know."""
    status = previous.postbox("--database-url", database.url, "status")
    assert status.returncode == 0, status.stderr
    assert "Traceback" not in status.stderr
    check = previous.postbox("--database-url", database.url, "migrate", "--check")
    assert "Traceback" not in check.stderr, check.stderr


@pytest.mark.parametrize("revision", [f"{n:04d}" for n in range(2, 16)])
def test_a_downgrade_leaves_exactly_the_previous_revisions_schema(pg_server, revision):
    """A revision's downgrade restores what the revision before it made: a database upgraded to
    ``revision`` and downgraded one step has the same tables, indexes, triggers, function bodies
    and their settings, grants and comments as one built up to that previous revision."""
    from contextlib import contextmanager

    from tests.conftest import _cloned

    previous_revision = _revision_module(revision).down_revision
    cloned = contextmanager(_cloned)
    with cloned(pg_server, "postbox_before", None) as before, cloned(pg_server, "postbox_back", None) as back:
        migrate.upgrade(before.url, previous_revision)
        migrate.upgrade(back.url, revision)
        migrate.downgrade(back.url, previous_revision)
        assert migrate.current_revision(back.url) == previous_revision
        a, b = _catalog(before.url), _catalog(back.url)
    _assert_same_catalog(a, b, "built", "downgraded")

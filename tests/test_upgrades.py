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


def test_the_revision_files_name_no_sql_outside_the_package_data():
    """What a revision reads is shipped: every file it names exists under sql/ or next to it."""
    text = (migrations_dir() / "versions" / "0001_initial.py").read_text()
    for name in _revision_module("0001").FUNCTIONS:
        assert (sql_dir() / name).is_file(), name
        assert name in text
    assert Path(sql_dir() / "roles_v1.sql").is_file()


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
        assert c.execute("SELECT version_num FROM postbox.alembic_version").fetchall() == [("0001",)]
        assert c.execute("SELECT to_regclass('public.orders') IS NOT NULL").fetchone() == (True,)
    check = subprocess.run(
        [sys.executable, "-m", "postbox", "--database-url", empty_database.url, "migrate", "--check"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr

"""Upgrades: a released revision applies exactly the SQL it was released with, forever."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import psycopg
import pytest

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

"""Migrating while Postbox runs: an upgrade that cannot take a table lock in time, or deadlocks with a
running process, is rolled back whole and tried again; one that cannot get its locks at all gives up
saying who holds them, with nothing changed."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import psycopg
import pytest

from postbox._version import SCHEMA_REVISION
from postbox.schema import migrate
from postbox.schema.locks import LockPolicy, LocksUnavailable
from tests.helpers import eventually


@pytest.fixture
def at_0003(empty_database):
    """A database at revision 0003: the upgrade to 0004 replaces a trigger on the inbox."""
    migrate.upgrade(empty_database.url, "0003")
    return empty_database.url


@pytest.fixture
def receiving(at_0003: str) -> Iterator[psycopg.Connection]:
    """A transaction that holds the inbox the way a receive does, open until the test commits it."""
    conn = psycopg.connect(at_0003, application_name="long-receive")
    conn.execute("LOCK TABLE postbox.inbox IN ROW EXCLUSIVE MODE")
    try:
        yield conn
    finally:
        conn.close()


def _in_thread(target) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as error:  # handed to the test
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def _retries(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if getattr(r, "event", None) == "migrate_lock_retry"]


def test_an_upgrade_waiting_on_a_long_transaction_steps_aside_and_applies_once_it_ends(
    at_0003, receiving, caplog
):
    caplog.set_level("WARNING", logger="postbox.migrate")
    thread, errors = _in_thread(lambda: migrate.upgrade(at_0003, locks=LockPolicy(0.2, 60)))
    eventually(lambda: len(_retries(caplog)) >= 2, what="the upgrade tried again")
    assert migrate.current_revision(at_0003) == "0003"  # each attempt rolled back whole
    # Between attempts nothing queues behind the upgrade: another receive gets the inbox at once.
    with psycopg.connect(at_0003, autocommit=True) as other:
        other.execute("SET lock_timeout = '5s'")
        other.execute("BEGIN")
        other.execute("LOCK TABLE postbox.inbox IN ROW EXCLUSIVE MODE")
        other.execute("COMMIT")
    receiving.commit()
    thread.join(60)
    assert not thread.is_alive() and errors == []
    assert migrate.current_revision(at_0003) == SCHEMA_REVISION
    assert "a table lock held by another session" in _retries(caplog)[0]


def test_an_upgrade_that_deadlocks_with_a_running_process_is_tried_again(empty_database, caplog):
    """The upgrade from 0001 holds locks of earlier revisions when 0004 asks for the inbox's; a
    session holding the inbox then asks for one of those. PostgreSQL ends the upgrade (the other
    session's deadlock_timeout is longer) and the upgrade runs again after it."""
    url = empty_database.url
    migrate.upgrade(url, "0001")
    caplog.set_level("WARNING", logger="postbox.migrate")
    holder = psycopg.connect(url, application_name="long-receive")
    try:
        holder.execute("SET deadlock_timeout = '30s'")
        holder.execute("LOCK TABLE postbox.inbox IN ROW EXCLUSIVE MODE")
        thread, errors = _in_thread(lambda: migrate.upgrade(url, locks=LockPolicy(30, 120)))
        held = eventually(lambda: _held_while_waiting(url), timeout=60, what="the upgrade waits on a lock")
        holder.execute(f"LOCK TABLE postbox.{held} IN ACCESS EXCLUSIVE MODE")  # the deadlock; it wins
        holder.commit()
        thread.join(120)
    finally:
        holder.close()
    assert not thread.is_alive() and errors == []
    assert migrate.current_revision(url) == SCHEMA_REVISION
    assert any("deadlock" in m for m in _retries(caplog))


def _held_while_waiting(url: str) -> str | None:
    """A postbox table the waiting upgrade holds a lock on, once it waits for another."""
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(
            """
            SELECT c.relname
              FROM pg_stat_activity a
              JOIN pg_locks l ON l.pid = a.pid AND l.granted AND l.locktype = 'relation'
              JOIN pg_class c ON c.oid = l.relation AND c.relkind = 'r'
              JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'postbox'
             WHERE a.application_name = 'postbox-migrate' AND c.relname NOT IN ('inbox', 'alembic_version')
               AND EXISTS (SELECT 1 FROM pg_locks w WHERE w.pid = a.pid AND NOT w.granted)
             ORDER BY c.relname LIMIT 1
            """
        ).fetchone()
    return str(row[0]) if row else None


def test_an_upgrade_that_cannot_get_its_locks_gives_up_naming_the_sessions_and_changes_nothing(
    at_0003, receiving
):
    with pytest.raises(LocksUnavailable) as raised:
        migrate.upgrade(at_0003, locks=LockPolicy(0.1, 1.0))
    message = str(raised.value)
    assert "long-receive" in message and "inbox" in message and "Nothing was changed" in message
    assert migrate.current_revision(at_0003) == "0003"


def test_cli_migrate_that_cannot_get_its_locks_says_so_in_one_line_and_exits_1(at_0003, receiving):
    result = subprocess.run(
        [sys.executable, "-m", "postbox", "--database-url", at_0003, "migrate",
         "--lock-timeout", "0.1", "--give-up-after", "1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "could not take the table locks" in result.stderr and "long-receive" in result.stderr
    assert migrate.current_revision(at_0003) == "0003"


def test_lock_policy_refuses_a_timeout_that_is_not_positive():
    with pytest.raises(ValueError, match="lock_timeout"):
        LockPolicy(lock_timeout=0)

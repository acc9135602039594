"""The vacuum_queues maintenance job: a role that may vacuum the queue tables does once their dead
rows pile up; postbox_maintainer, which owns nothing, leaves them to autovacuum and says so once."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pytest

from postbox.operations import vacuum
from postbox.operations.maintenance import Maintenance
from tests.helpers import role_login


def _churn(url: str, table: str, queue: str, rows: int) -> None:
    """Insert and delete ``rows`` rows: that many dead row versions, in the statistics at once."""
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(
            f"INSERT INTO postbox.{table} ({queue}, message_id, key, position, payload, state)"
            " SELECT 'c', 'm' || g, 'k' || g, g, '{}', 'ready' FROM generate_series(1, %s) g",
            (rows,),
        )
        c.execute(f"DELETE FROM postbox.{table}")
        c.execute("SELECT pg_stat_force_next_flush()")


def _vacuums(url: str, table: str) -> int:
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("SELECT pg_stat_clear_snapshot()")
        return int(c.execute(f"SELECT pg_stat_get_vacuum_count('postbox.{table}'::regclass)").fetchone()[0])


@pytest.fixture
def maintainer_url(database) -> Iterator[str]:
    """A login in postbox_maintainer only, unique to this test."""
    yield from role_login(database, "postbox_maintainer", "vacuum")


@pytest.fixture(autouse=True)
def fresh_warnings() -> None:
    vacuum._told.clear()


def test_an_owner_vacuums_a_queue_table_once_its_dead_rows_pile_up(database):
    url = database.url
    m = Maintenance(url)
    _churn(url, "inbox", "consumer", vacuum.DEAD_ROWS // 2)
    assert m.run_job("vacuum_queues") == 0  # not enough yet
    assert _vacuums(url, "inbox") == 0
    _churn(url, "inbox", "consumer", vacuum.DEAD_ROWS)
    _churn(url, "outbox", "destination", vacuum.DEAD_ROWS)
    assert m.run_job("vacuum_queues") >= 2 * vacuum.DEAD_ROWS
    assert _vacuums(url, "inbox") == 1 and _vacuums(url, "outbox") == 1
    with psycopg.connect(url) as c:
        dead = c.execute("SELECT pg_stat_get_dead_tuples('postbox.inbox'::regclass)").fetchone()[0]
    assert dead == 0
    assert m.run_job("vacuum_queues") == 0  # nothing left to do


def test_the_maintainer_role_leaves_vacuum_to_autovacuum_and_says_so_once(database, maintainer_url, caplog):
    _churn(database.url, "inbox", "consumer", vacuum.DEAD_ROWS * 2)
    m = Maintenance(maintainer_url)
    with caplog.at_level(logging.WARNING, logger="postbox.maintenance"):
        assert m.run_job("vacuum_queues") == 0
        assert m.run_job("vacuum_queues") == 0
    assert _vacuums(database.url, "inbox") == 0
    told = [r.getMessage() for r in caplog.records if "may not vacuum" in r.getMessage()]
    assert len(told) == 1 and "postbox.inbox" in told[0] and "autovacuum" in told[0], told


def test_maintain_warns_at_start_when_nothing_will_vacuum_the_queues(database, maintainer_url, caplog):
    with psycopg.connect(database.url, autocommit=True) as c:
        autovacuum_on = c.execute("SHOW autovacuum").fetchone()[0] == "on"
    with caplog.at_level(logging.WARNING, logger="postbox.maintenance"):
        Maintenance(database.url).register()  # a superuser may vacuum: no warning
        assert not [r for r in caplog.records if "autovacuum is off" in r.getMessage()]
        Maintenance(maintainer_url).register()
    told = [r.getMessage() for r in caplog.records if "autovacuum is off" in r.getMessage()]
    assert len(told) == (0 if autovacuum_on else 1), told
    if told:
        assert "postbox maintain as the schema's owner" in told[0]


def test_a_maintenance_process_that_may_not_vacuum_leaves_the_job_to_one_that_may(database, maintainer_url):
    """Each job runs once per period across processes: the maintainer's process must not take the
    runs of an owner's process that can do the work."""
    barred, owner = Maintenance(maintainer_url), Maintenance(database.url)
    barred.register()
    owner.register()
    assert "vacuum_queues" not in barred.jobs and "vacuum_queues" in owner.jobs

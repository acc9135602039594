"""The demo's scenario, run for real, and its outcome (not its narration) checked."""

from __future__ import annotations

import subprocess
import sys
import uuid

import psycopg
import psycopg.sql

from postbox.demo.scenario import DEMO_MARK, _database, run_demo
from tests.conftest import _conninfo_url


def test_demo_scenario_outcome(pg_server, tmp_path):
    """paid succeeds after two transient failures and order-1 ships; the malformed event and the
    exhausted payment are dead-lettered and block only their own orders; every successful payment's
    outbox event is relayed into the shipping inbox and recorded once; after the fix, a paced replay
    sends both dead letters back, both succeed, and order-4's held shipped follows. Nothing keeps running."""
    name = f"postbox_demo_{uuid.uuid4().hex[:8]}"
    admin = _conninfo_url(dict(pg_server.params, dbname="postgres"))
    states = run_demo(admin, tmp_path, database=name)
    try:
        assert states == {"order-1": "shipped", "order-2": "paid", "order-3": "paid", "order-4": "shipped"}
        with psycopg.connect(_conninfo_url(dict(pg_server.params, dbname=name))) as c:
            dead = c.execute(
                "SELECT message_id, reason, status FROM postbox.dead_letters ORDER BY message_id"
            ).fetchall()
            blocked = c.execute("SELECT count(*) FROM postbox.blocked_keys").fetchone()[0]
            running = c.execute("SELECT count(*) FROM postbox.workers").fetchone()[0]
            shipments = c.execute(
                "SELECT string_agg(order_id || ':' || amount, ',' ORDER BY order_id) FROM demo_shipments"
            ).fetchone()[0]
            log = c.execute(
                "SELECT string_agg(event, ',' ORDER BY id) FROM demo_log WHERE order_id = 'order-4'"
            ).fetchone()[0]
            job = c.execute("SELECT state, total, succeeded FROM postbox.replay_progress").fetchone()
            audit = c.execute("SELECT string_agg(action, ',' ORDER BY id) FROM postbox.audit_log").fetchone()[
                0
            ]
            leftovers = c.execute(
                "SELECT (SELECT count(*) FROM postbox.inbox) + (SELECT count(*) FROM postbox.outbox)"
            ).fetchone()[0]
        assert dead == [
            ("order-3/2", "permanent", "replayed"),
            ("order-4/2", "attempts_exhausted", "replayed"),
        ]
        assert blocked == 0 and running == 0 and leftovers == 0
        assert shipments == "order-1:42,order-2:7,order-3:15,order-4:99"
        assert log == "created,paid,shipped"
        assert job == ("done", 2, 2) and audit == "dlq_edit,replay"
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_demo_never_drops_a_database_it_did_not_create(database, tmp_path):
    """A database that happens to carry the demo's name is left alone: the demo refuses by name and
    says what to do; one that an earlier demo created is replaced."""
    with psycopg.connect(database.url, autocommit=True) as c:
        c.execute("CREATE TABLE precious (v int)")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "postbox",
            "--database-url",
            database.url,
            "demo",
            "--database",
            database.name,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "the demo did not create it" in result.stderr and "--database" in result.stderr
    with psycopg.connect(database.url) as c:
        assert c.execute("SELECT to_regclass('precious') IS NOT NULL").fetchone() == (True,)

    admin = database.url.rsplit("/", 1)[0] + "/postgres"
    name = f"postbox_demo_{uuid.uuid4().hex[:8]}"
    try:
        _database(admin, tmp_path, name)
        with psycopg.connect(admin, autocommit=True) as c:
            mark = c.execute(
                "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s", [name]
            ).fetchone()
        assert mark == (DEMO_MARK,)
        _database(admin, tmp_path, name)  # an earlier demo's database is replaced
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(
                psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    psycopg.sql.Identifier(name)
                )
            )


def test_the_demos_drop_hint_quotes_a_database_name_that_needs_it():
    """The hint to remove the kept database is a statement psql takes as printed."""
    from postbox.demo.scenario import _identifier

    assert _identifier("postbox_demo") == "postbox_demo"
    assert _identifier("demo'x") == '"demo\'x"'
    assert _identifier('De"mo') == '"De""mo"'

"""The demo's scenario, run for real, and its outcome (not its narration) checked."""

from __future__ import annotations

import uuid

import psycopg

from service.demo import run_demo
from tests.conftest import _conninfo_url


def test_demo_scenario_outcome(pg_server, tmp_path):
    """paid succeeds after two transient failures and order-1 ships; the malformed event and the
    exhausted payment are dead-lettered and block only their own orders; order-2 is unaffected."""
    name = f"postbox_demo_{uuid.uuid4().hex[:8]}"
    admin = _conninfo_url(dict(pg_server.params, dbname="postgres"))
    states = run_demo(admin, tmp_path, database=name)
    try:
        assert states == {"order-1": "shipped", "order-2": "paid", "order-3": "created", "order-4": "created"}
        with psycopg.connect(_conninfo_url(dict(pg_server.params, dbname=name))) as c:
            dead = c.execute(
                "SELECT message_id, reason FROM postbox.dead_letters ORDER BY message_id"
            ).fetchall()
            blocked = c.execute("SELECT key, held_messages FROM postbox.blocked_keys ORDER BY key").fetchall()
            running = c.execute("SELECT count(*) FROM postbox.workers").fetchone()[0]
        assert dead == [("order-3/2", "permanent"), ("order-4/2", "attempts_exhausted")]
        assert blocked == [("order-3", 0), ("order-4", 1)]
        assert running == 0
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

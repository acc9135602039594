"""A process that drains stays alive: it beats until its last handler returns, its row says it is
stopping, and no other process takes it for dead and runs its in-flight messages a second time."""

from __future__ import annotations

import threading
import time

import psycopg

import postbox
from postbox._version import SCHEMA_REVISION, __version__
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from tests.helpers import EFFECTS_DDL, eventually, record_effect, scalar

# 15 heartbeats: a loaded machine (the suite runs tests side by side) may stall one for a second.
STALE_AFTER = 3.0


def test_a_draining_worker_keeps_beating_and_is_not_reaped_while_its_handler_finishes(database):
    url = database.url
    with database.connect(autocommit=True) as c:
        c.execute(EFFECTS_DDL)
    started, release = threading.Event(), threading.Event()
    reg = Registry()

    @reg.handler("c")
    def handle(m, ctx):
        started.set()
        assert release.wait(30), "the test never released the handler"
        record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)

    with psycopg.connect(url) as c:
        postbox.receive(c, consumer="c", message_id="slow", key="k", payload={})
        c.commit()
    settings = WorkerSettings(
        consumer="c", poll_interval=0.05, heartbeat_interval=0.2, stale_after=STALE_AFTER, grace_period=30
    )
    worker = Worker(url, reg, settings)
    worker.start()
    assert started.wait(10)
    worker.stop()  # drain: the handler is still running
    joiner = threading.Thread(target=worker.join)
    joiner.start()
    try:
        eventually(lambda: scalar(url, "SELECT stopping_at IS NOT NULL FROM postbox.workers") is True)
        assert scalar(url, "SELECT row(version, schema_revision)::text FROM postbox.workers") == (
            f"({__version__},{SCHEMA_REVISION})"
        )
        # Another process reaps stale ones, for longer than stale_after: the drainer is not stale.
        end = time.monotonic() + 2 * STALE_AFTER
        while time.monotonic() < end:
            reaped = scalar(
                url, "SELECT postbox.reap_stale_workers_v1(%s * interval '1 second', now())", (STALE_AFTER,)
            )
            assert reaped == 0, "a draining worker was taken for dead: its message was made due again"
            assert scalar(url, "SELECT count(*) FROM postbox.workers") == 1
            time.sleep(0.1)  # a reaper's period, not a synchronisation
        assert scalar(url, "SELECT row(state, attempt)::text FROM postbox.inbox") == "(running,1)"
    finally:
        release.set()
        joiner.join(30)
    assert not joiner.is_alive()
    assert scalar(url, "SELECT count(*) FROM effects") == 1
    assert scalar(url, "SELECT count(*) FROM postbox.inbox") == 0
    assert scalar(url, "SELECT count(*) FROM postbox.attempts") == 0  # no lease expiry, no second run
    assert scalar(url, "SELECT count(*) FROM postbox.workers") == 0  # unregistered, not re-registered

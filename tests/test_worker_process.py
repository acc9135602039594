"""The worker as an operator runs it: a process, signals, wake-ups, stalls."""

from __future__ import annotations

import signal
import subprocess

import psycopg
import pytest

import postbox
from tests.helpers import EFFECTS_DDL, eventually, scalar, spawn_postbox


@pytest.fixture
def db(database):
    with database.connect(autocommit=True) as c:
        c.execute(EFFECTS_DDL)
    return database


def spawn(url: str, *args: str) -> subprocess.Popen[bytes]:
    return spawn_postbox(
        "--database-url",
        url,
        "worker",
        "--consumer",
        "basic",
        "--app",
        "tests.apps.basic:registry",
        "--heartbeat-interval",
        "0.3",
        "--stale-after",
        "1.5",
        *args,
        stderr=subprocess.PIPE,
    )


def receive(url: str, *messages: dict) -> None:
    with psycopg.connect(url) as c:
        postbox.receive_many(c, [{"consumer": "basic", **m} for m in messages])
        c.commit()


def test_one_notify_per_producer_transaction(db):
    """A transaction that receives 100 messages for one consumer sends one notification."""
    with psycopg.connect(db.url, autocommit=True) as listener:
        listener.execute("LISTEN postbox_inbox")
        receive(db.url, *({"message_id": str(i), "payload": {}} for i in range(100)))
        got = list(listener.notifies(timeout=1.0))
    assert [(n.channel, n.payload) for n in got] == [("postbox_inbox", "basic")]


def test_notify_can_be_switched_off(db):
    """With postbox.notify = off, producers send no notification (for PgBouncer transaction pools)."""
    with psycopg.connect(db.url, autocommit=True) as listener:
        listener.execute("LISTEN postbox_inbox")
        with psycopg.connect(db.url) as c:
            c.execute("SET postbox.notify = off")
            postbox.receive(c, consumer="basic", message_id="x", payload={})
            c.commit()
        assert list(listener.notifies(timeout=0.5)) == []


def test_worker_without_listen_polls(db):
    """--no-listen: the worker finds work by polling alone."""
    p = spawn(db.url, "--no-listen", "--poll-interval", "0.1")
    try:
        eventually(lambda: scalar(db.url, "SELECT count(*) FROM postbox.workers") == 1)
        receive(db.url, *({"message_id": str(i), "payload": {}} for i in range(10)))
        eventually(lambda: scalar(db.url, "SELECT count(*) FROM effects") == 10)
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == 0


def test_sigterm_during_a_long_handler_finishes_it_and_unregisters(db):
    """SIGTERM while a handler runs: the handler finishes and commits, the process exits 0, its
    worker row is gone and nothing is left claimed."""
    p = spawn(db.url, "--poll-interval", "0.05")
    try:
        receive(
            db.url, {"message_id": "long", "payload": {"sleep": 1.5}}, {"message_id": "after", "payload": {}}
        )
        eventually(lambda: scalar(db.url, "SELECT count(*) FROM postbox.inbox WHERE state = 'running'") >= 1)
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
    assert scalar(db.url, "SELECT count(*) FROM effects WHERE message_id = 'long'") == 1
    assert scalar(db.url, "SELECT count(*) FROM postbox.inbox WHERE state = 'running'") == 0
    assert scalar(db.url, "SELECT count(*) FROM postbox.workers") == 0


def test_stalled_worker_cannot_commit_after_its_claim_passed_on(db):
    """A worker SIGSTOPped mid-handler loses its claim (stale heartbeat, lease); another worker does
    the message. When the first resumes, its late writes are fenced: the effect exists once."""
    a = spawn(db.url, "--poll-interval", "0.05", "--lease", "2")
    try:
        eventually(lambda: scalar(db.url, "SELECT count(*) FROM postbox.workers") == 1)
        receive(
            db.url,
            {"message_id": "m", "key": "k", "payload": {"sleep": 1.0}},
            {"message_id": "n", "key": "k", "payload": {}},
        )
        eventually(
            lambda: scalar(db.url, "SELECT state FROM postbox.inbox WHERE message_id = 'm'") == "running"
        )
        a.send_signal(signal.SIGSTOP)
        b = spawn(db.url, "--poll-interval", "0.05", "--lease", "2")
        try:
            eventually(lambda: scalar(db.url, "SELECT count(*) FROM effects") == 2, timeout=60)
            a.send_signal(signal.SIGCONT)
            a.send_signal(signal.SIGTERM)  # it ends its batch (fenced) before it exits
            assert a.wait(30) == 0
            # Either its transaction was ended by idle_in_transaction_session_timeout, or its
            # writes were refused by the attempt fence: both end with the effect not repeated.
            err = a.stderr.read() if a.stderr else b""
            assert b"claims lost" in err or b"lost its connection" in err
            assert scalar(db.url, "SELECT count(*) FROM effects WHERE message_id = 'm'") == 1
            assert scalar(db.url, "SELECT attempt FROM effects WHERE message_id = 'm'") == 2
        finally:
            b.send_signal(signal.SIGTERM)
            b.wait(20)
    finally:
        a.send_signal(signal.SIGCONT)
        a.send_signal(signal.SIGTERM)
        try:
            a.wait(20)
        except subprocess.TimeoutExpired:
            a.kill()


def test_sql_fencing_refuses_a_stale_claim(db):
    """inbox_complete_v1 with an attempt that is no longer current completes nothing."""
    receive(db.url, {"message_id": "m", "payload": {}})
    with psycopg.connect(db.url, autocommit=True) as c:
        ((mid, a1),) = c.execute(
            "SELECT id, attempt FROM postbox.inbox_claim_v1('basic', 'w1', 1, '1 second', now())"
        ).fetchall()
        ((_, a2),) = c.execute(
            "SELECT id, attempt FROM postbox.inbox_claim_v1('basic', 'w2', 1, '1 minute', now() + interval '2 seconds')"
        ).fetchall()
        assert (a1, a2) == (1, 2)
        assert c.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", ([mid], [a1])).fetchone()[0] == [
            mid
        ]
        assert (
            c.execute("SELECT postbox.inbox_retry_v1(%s, %s, now(), now(), 'x', 'y')", (mid, a1)).fetchone()[
                0
            ]
            is False
        )
        assert c.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", ([mid], [a2])).fetchone()[0] == []
        row = c.execute("SELECT last_error_type FROM postbox.dead_letters").fetchone()
        assert row is None

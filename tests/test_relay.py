"""The outbox relay with the PostgreSQL transport: per-key order, completeness, failures, kills."""

from __future__ import annotations

import random
import signal
import subprocess
import threading

import psycopg

import postbox
from postbox.failures.policy import Backoff, RetryPolicy
from postbox.outbox.relay import Relay, RelaySettings
from postbox.outbox.transports.postgres import PostgresTransport
from tests.helpers import eventually, scalar, spawn_postbox

FAST = {"poll_interval": 0.05, "heartbeat_interval": 0.3, "stale_after": 1.5, "grace_period": 5.0}
QUICK = RetryPolicy(strategy=Backoff.FIXED, base_delay=0.05, max_attempts=1000, max_total_seconds=None)


def start_relay(url: str, target_url: str | None = None, consumer: str = "next", **kw) -> Relay:
    r = Relay(
        url,
        {"next": PostgresTransport(target_url or url, consumer)},
        RelaySettings(**{**FAST, "retry": QUICK, **kw}),
    )
    r.start()
    return r


def publish(url: str, rows: list[tuple[str, str]], per_tx: int = 10) -> None:
    """Publish (message_id, key) rows in transactions of ``per_tx``."""
    with psycopg.connect(url) as c:
        for i in range(0, len(rows), per_tx):
            postbox.publish_many(
                c,
                [
                    {"destination": "next", "message_id": m, "key": k, "payload": {"m": m}}
                    for m, k in rows[i : i + per_tx]
                ],
            )
            c.commit()


def delivered_in_order(url: str, expected: dict[str, list[str]]) -> None:
    """Every row is in the target inbox once, and each key's rows arrived in the expected order."""
    with psycopg.connect(url) as c:
        got = c.execute(
            "SELECT key, message_id FROM postbox.inbox WHERE consumer = 'next' ORDER BY id"
        ).fetchall()
    by_key: dict[str, list[str]] = {}
    for key, mid in got:
        by_key.setdefault(key, []).append(mid)
    assert by_key == expected


def test_relay_delivers_every_row_once_in_key_order(database):
    """500 rows over 20 keys, two relay loops: all delivered, each key in the order written."""
    url = database.url
    rows = [(f"e{i}", f"k{i % 20}") for i in range(500)]
    publish(url, rows)
    assert (
        scalar(
            url,
            "SELECT row(destination, rows, ready, oldest_age > interval '0')::text FROM postbox.outbox_backlog",
        )
        == "(next,500,20,t)"
    )
    r = start_relay(url, concurrency=2, batch_size=25)
    try:
        eventually(lambda: scalar(url, "SELECT count(*) = 0 FROM postbox.outbox"))
    finally:
        r.stop()
        r.join()
    expected: dict[str, list[str]] = {}
    for m, k in rows:
        expected.setdefault(k, []).append(m)
    delivered_in_order(url, expected)
    assert scalar(url, "SELECT count(DISTINCT source) FROM postbox.inbox WHERE consumer = 'next'") == 1


def test_two_relay_processes_never_reorder_a_key(database, tmp_path):
    """Two relay processes on one outbox while producers keep writing: per-key order holds."""
    url = database.url
    config = tmp_path / "postbox.toml"
    config.write_text(
        '[destinations.next]\nkind = "postgres"\nconsumer = "next"\n'
        'retry = { strategy = "fixed", base_delay = 0.05 }\n'
    )
    relay_args = (
        "--config",
        str(config),
        "--database-url",
        url,
        "relay",
        "--batch-size",
        "7",
        "--poll-interval",
        "0.05",
        "--concurrency",
        "2",
    )
    procs = [spawn_postbox(*relay_args, stderr=subprocess.PIPE) for _ in range(2)]
    rows = [(f"e{i}", f"k{random.Random(i).randrange(15)}") for i in range(600)]
    try:
        # Both relays running before the rows come (a slow start could miss them all, and a stop
        # signal before a process has started is not a clean stop).
        pids = {p.pid for p in procs}

        def registered() -> bool:
            with psycopg.connect(url) as c:
                return {r[0] for r in c.execute("SELECT pid FROM postbox.workers").fetchall()} >= pids

        eventually(registered, timeout=60, what="both relay processes registered")
        writers = [threading.Thread(target=publish, args=(url, rows[j::3], 5)) for j in range(3)]
        for t in writers:
            t.start()
        for t in writers:
            t.join()
        eventually(lambda: scalar(url, "SELECT count(*) = 0 FROM postbox.outbox"), timeout=60)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            assert p.wait(30) == 0, p.stderr.read().decode() if p.stderr else ""
    # Each writer's rows of a key must arrive in the writer's order (writers are concurrent, so
    # rows of different writers may interleave).
    with psycopg.connect(url) as c:
        got = [
            m
            for (m,) in c.execute("SELECT message_id FROM postbox.inbox WHERE consumer = 'next' ORDER BY id")
        ]
    assert sorted(got) == sorted(m for m, _ in rows)
    position = {m: i for i, m in enumerate(got)}
    for j in range(3):
        mine = rows[j::3]
        for key in {k for _, k in mine}:
            seq = [position[m] for m, k in mine if k == key]
            assert seq == sorted(seq), f"writer {j} key {key} reordered"


def test_commit_order_trap(database):
    """Ids are not commit order. Two transactions writing one key commit in the opposite order of
    their ids, and a third commits long after later rows were published: nothing is lost. Rows
    that were committed when the key moved on go out in the order written; a row that commits late
    goes out when it commits, after what was published before it (never skipped)."""
    url = database.url
    publish(url, [("head", "k")])  # the key has a head the relay has not published yet
    with psycopg.connect(url) as a, psycopg.connect(url) as b, psycopg.connect(url) as late:
        postbox.publish(a, destination="next", message_id="a1", key="k", payload={})
        postbox.publish(b, destination="next", message_id="b1", key="k", payload={})
        postbox.publish(late, destination="next", message_id="late", key="k", payload={})
        b.commit()
        a.commit()
        r = start_relay(url)
        try:
            eventually(lambda: scalar(url, "SELECT count(*) FROM postbox.inbox WHERE consumer = 'next'") == 3)
            publish(url, [("after1", "k"), ("after2", "k")])
            eventually(lambda: scalar(url, "SELECT count(*) FROM postbox.inbox WHERE consumer = 'next'") == 5)
            assert (
                scalar(url, "SELECT count(*) FROM postbox.outbox") == 0
            )  # the late row is not committed yet
            late.commit()
            eventually(lambda: scalar(url, "SELECT count(*) FROM postbox.inbox WHERE consumer = 'next'") == 6)
        finally:
            r.stop()
            r.join()
    delivered_in_order(url, {"k": ["head", "a1", "b1", "after1", "after2", "late"]})


def test_destination_down_then_back_drains_in_order(database, pg_server):
    """While the target database refuses connections, rows stay and are retried with backoff; when it
    is back, they drain in key order and nothing is lost."""
    from tests.conftest import _conninfo_url

    target = f"{database.name}_target"
    admin = _conninfo_url(dict(pg_server.params, dbname="postgres"))
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{target}" TEMPLATE "{database.name}"')
        c.execute(f'ALTER DATABASE "{target}" ALLOW_CONNECTIONS false')
    target_url = _conninfo_url(dict(pg_server.params, dbname=target))
    try:
        rows = [(f"e{i}", f"k{i % 3}") for i in range(30)]
        publish(database.url, rows)
        r = start_relay(database.url, target_url)
        try:
            eventually(
                lambda: (
                    scalar(database.url, "SELECT count(*) FROM postbox.attempts WHERE origin = 'outbox'") >= 6
                )
            )
            assert scalar(database.url, "SELECT count(*) FROM postbox.outbox") == 30
            with psycopg.connect(admin, autocommit=True) as c:
                c.execute(f'ALTER DATABASE "{target}" ALLOW_CONNECTIONS true')
            eventually(lambda: scalar(database.url, "SELECT count(*) = 0 FROM postbox.outbox"), timeout=60)
        finally:
            r.stop()
            r.join()
        expected: dict[str, list[str]] = {}
        for m, k in rows:
            expected.setdefault(k, []).append(m)
        delivered_in_order(target_url, expected)
        assert scalar(database.url, "SELECT count(*) FROM postbox.dead_letters") == 0
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{target}" WITH (FORCE)')


def test_conflicting_row_is_dead_lettered_and_blocks_only_its_key(database):
    """A row whose message_id the target already holds with another payload is a permanent failure:
    dead-lettered, its key's later rows held; other keys flow."""
    url = database.url
    with psycopg.connect(url) as c:
        postbox.receive(c, consumer="next", message_id="clash", payload={"other": True})
        c.commit()
    publish(url, [("clash", "bad"), ("after", "bad"), ("fine", "good")])
    r = start_relay(url)
    try:
        eventually(lambda: scalar(url, "SELECT count(*) FROM postbox.dead_letters") == 1)
        eventually(lambda: scalar(url, "SELECT count(*) FROM postbox.inbox WHERE message_id = 'fine'") == 1)
    finally:
        r.stop()
        r.join()
    dl = scalar(
        url,
        "SELECT row(origin, destination, message_id, reason, attempt, ordering_policy)::text FROM postbox.dead_letters",
    )
    assert dl == "(outbox,next,clash,permanent,1,block)"
    assert (
        scalar(url, "SELECT string_agg(message_id || ':' || state, ',' ORDER BY id) FROM postbox.outbox")
        == "clash:blocked,after:pending"
    )
    assert (
        scalar(url, "SELECT row(origin, destination, key, held_messages)::text FROM postbox.blocked_keys")
        == "(outbox,next,bad,1)"
    )


def test_a_consumer_the_receiving_side_has_not_declared_yet_is_retried_until_it_is(database):
    """Deployed before the receiving service's worker declared its consumer (another one being
    declared, so it is refused): the rows are retried, not dead-lettered at their first attempt,
    and delivered in order once it is declared."""
    url = database.url
    with psycopg.connect(url) as c:
        postbox.declare_consumer(c, "other")
        c.commit()
    publish(url, [("m1", "k"), ("m2", "k")])
    r = start_relay(url)
    try:
        eventually(
            lambda: scalar(
                url, "SELECT last_error FROM postbox.outbox WHERE message_id = 'm1' AND attempt >= 2"
            ),
            what="a retried delivery",
        )
        assert scalar(url, "SELECT count(*) FROM postbox.dead_letters") == 0
        error = scalar(url, "SELECT last_error FROM postbox.outbox WHERE message_id = 'm1'")
        assert "not a declared consumer" in error and "[consumers.next]" in error, error
        with psycopg.connect(url) as c:
            postbox.declare_consumer(c, "next")
            c.commit()
        eventually(
            lambda: scalar(url, "SELECT count(*) FROM postbox.outbox") == 0, what="delivered once declared"
        )
    finally:
        r.stop()
        r.join()
    delivered_in_order(url, {"k": ["m1", "m2"]})
    assert scalar(url, "SELECT count(*) FROM postbox.dead_letters") == 0


def test_relay_killed_with_kill_9_loses_nothing(database, tmp_path):
    """A relay process killed mid-run and restarted: every row arrives; a row whose confirmation was
    lost may be published twice, and the receiving inbox absorbs it as a duplicate."""
    url = database.url
    config = tmp_path / "postbox.toml"
    config.write_text(
        '[destinations.next]\nkind = "postgres"\nconsumer = "next"\n'
        'retry = { strategy = "fixed", base_delay = 0.05 }\n'
    )
    args = (
        "--config",
        str(config),
        "--database-url",
        url,
        "relay",
        "--batch-size",
        "5",
        "--poll-interval",
        "0.05",
        "--heartbeat-interval",
        "0.3",
        "--stale-after",
        "1",
        "--lease",
        "2",
    )
    rows = [(f"e{i}", f"k{i % 25}") for i in range(1500)]
    publish(url, rows, per_tx=50)
    kills = 0
    p = spawn_postbox(*args)
    try:
        for _ in range(3):
            eventually(
                lambda n=kills: (
                    scalar(url, "SELECT count(*) FROM postbox.inbox WHERE consumer = 'next'") > 250 * (n + 1)
                ),
                timeout=60,
            )
            p.send_signal(signal.SIGKILL)
            p.wait()
            kills += 1
            p = spawn_postbox(*args)
        eventually(lambda: scalar(url, "SELECT count(*) = 0 FROM postbox.outbox"), timeout=90)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)
    expected: dict[str, list[str]] = {}
    for m, k in rows:
        expected.setdefault(k, []).append(m)
    delivered_in_order(url, expected)
    assert kills == 3

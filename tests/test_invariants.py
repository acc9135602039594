"""Many worker processes, random failures, kills and dropped connections: nothing lost, no duplicate
effect, per-key order kept (the checker in tests/checker.py)."""

from __future__ import annotations

import random
import threading

import psycopg
import pytest

from tests.checker import Produced, WorkerPool, check, produce, run_until, terminate_backends
from tests.helpers import EFFECTS_DDL, scalar

APP = "tests.apps.checker:registry"
BATCH_APP = "tests.apps.checker:batch_registry"  # the same handler as a batch handler
SHARED_APP = "tests.apps.checker:shared_registry"  # the same handler, declared database-only


@pytest.fixture
def chk_db(database):
    with database.connect(autocommit=True) as c:
        c.execute(EFFECTS_DDL)
    return database


def _live(url: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM postbox.inbox WHERE consumer = 'chk'"))


def _scenario(
    url: str,
    *,
    count: int,
    keys: int,
    env: dict[str, str],
    fault=None,
    fault_period: float = 1.0,
    processes: int = 3,
    concurrency: int = 4,
    seed: int = 1,
    drain_s: float = 120,
    app: str = APP,
):
    produced = Produced()
    pool = WorkerPool(url, "chk", app, processes, concurrency, env=env)
    rng = random.Random(seed)
    producers = [
        threading.Thread(target=produce, args=(url, "chk", count // 2, keys, produced, seed * 10 + i))
        for i in range(2)
    ]
    for t in producers:
        t.start()
    last_fault = [0.0]
    import time

    def tick() -> None:
        pool.keep_alive()
        if fault and time.monotonic() - last_fault[0] > fault_period:
            last_fault[0] = time.monotonic()
            fault(pool, rng)

    try:
        run_until(drain_s, lambda: not any(t.is_alive() for t in producers) and _live(url) == 0, tick)
    finally:
        pool.stop()
        for t in producers:
            t.join()
    report = check(url, produced, "chk")
    return report, pool


@pytest.mark.parametrize(
    "app", [APP, SHARED_APP, BATCH_APP], ids=["handler", "database_only", "batch_handler"]
)
def test_invariants_with_random_failures(chk_db, app):
    """3 processes x 4 slots, 200 skewed keys, 10% transient failures: every message's effect exactly once, in order."""
    report, _ = _scenario(chk_db.url, count=2000, keys=200, env={"CHECKER_FAIL_RATE": "0.1"}, app=app)
    report.assert_ok()
    assert report.done == report.produced == 2000
    assert scalar(chk_db.url, "SELECT count(*) FROM effects e WHERE attempt > 1") > 0  # retries happened


@pytest.mark.parametrize(
    "app", [APP, SHARED_APP, BATCH_APP], ids=["handler", "database_only", "batch_handler"]
)
def test_invariants_with_kill_9_at_every_point(chk_db, app):
    """Workers SIGKILLed from outside at random and by themselves before the effect, after the effect
    before commit, and after commit; restarted each time. Invariants still hold."""

    def kill(pool, rng):
        pool.kill_random(rng)

    report, pool = _scenario(
        chk_db.url,
        count=1500,
        keys=200,
        fault=kill,
        fault_period=1.0,
        env={"CHECKER_FAIL_RATE": "0.05", "CHECKER_DIE_RATE": "0.005"},
        app=app,
    )
    report.assert_ok()
    assert report.done == report.produced
    assert pool.kills + pool.restarts > 2
    # Attempts that died were counted: some message shows a delivery after a lease expiry.
    assert scalar(chk_db.url, "SELECT count(*) FROM effects WHERE attempt > 1") > 0


def test_invariants_with_terminated_connections(chk_db):
    """pg_terminate_backend on worker connections every half second: workers reconnect, invariants hold."""
    terminated = [0]

    def cut(pool, rng):
        terminated[0] += terminate_backends(chk_db.url, "postbox-worker%")

    report, _ = _scenario(
        chk_db.url, count=1500, keys=200, fault=cut, fault_period=0.5, env={"CHECKER_FAIL_RATE": "0.05"}
    )
    report.assert_ok()
    assert report.done == report.produced
    assert terminated[0] > 0


def test_poison_message_that_kills_its_worker_ends_dead_lettered(chk_db):
    """A message that kills its worker on every attempt uses up its deliveries and is dead-lettered
    (attempts_exhausted) instead of crash-looping; its key goes on (skip policy of this consumer)."""
    url = chk_db.url
    with psycopg.connect(url) as c:
        import postbox

        postbox.receive_many(
            c,
            [
                {"consumer": "chk", "message_id": "p-0", "key": "k", "sequence": 0, "payload": {}},
                {
                    "consumer": "chk",
                    "message_id": "poison",
                    "key": "k",
                    "sequence": 1,
                    "payload": {"poison": True},
                },
                {"consumer": "chk", "message_id": "p-2", "key": "k", "sequence": 2, "payload": {}},
            ],
        )
        c.commit()
    pool = WorkerPool(url, "chk", APP, 2, 2, env={"CHECKER_MAX_ATTEMPTS": "3"})
    try:
        run_until(60, lambda: _live(url) == 0, pool.keep_alive)
    finally:
        pool.stop()
    dl = scalar(
        url, "SELECT row(message_id, reason, attempt, last_error_type)::text FROM postbox.dead_letters"
    )
    # Three real attempts, counted once each: the claim that found the limit passed invents none.
    assert dl == "(poison,attempts_exhausted,3,LeaseExpired)"
    history = scalar(
        url,
        "SELECT string_agg(concat_ws(':', attempt, kind, decision), ',' ORDER BY attempt) "
        "FROM postbox.attempts WHERE message_id = 'poison'",
    )
    assert history == "1:lease_expired:retry,2:lease_expired:retry,3:lease_expired:dead_letter"
    assert pool.restarts >= 3
    assert scalar(url, "SELECT string_agg(message_id, ',' ORDER BY id) FROM effects") == "p-0,p-2"


def test_the_checker_catches_loss_duplicates_and_reordering(chk_db):
    """The checker itself: a lost message, a doubled effect and a swapped pair are all reported."""
    url = chk_db.url
    produced = Produced()
    produced.messages.update({"a": ("k", 0), "b": ("k", 1), "c": ("k", 2), "d": ("j", 0)})
    with psycopg.connect(url) as c:
        c.execute(
            "INSERT INTO effects (message_id, key, sequence, prev_seq, attempt) VALUES"
            " ('b', 'k', 1, NULL, 1), ('a', 'k', 0, 1, 1), ('a', 'k', 0, 0, 2), ('d', 'j', 0, NULL, 1)"
        )
        c.commit()
    report = check(url, produced, "chk")
    assert report.lost == ["c"]
    assert report.duplicates == ["a"]
    assert len(report.order_violations) >= 2
    with pytest.raises(AssertionError):
        report.assert_ok()


@pytest.mark.parametrize(
    "app", [APP, SHARED_APP, BATCH_APP], ids=["handler", "database_only", "batch_handler"]
)
def test_invariants_with_transient_and_permanent_failures(chk_db, app):
    """A mix of transient (10%) and permanent (3%) failures under concurrency: every message done or
    dead-lettered, none twice, no duplicate effect, order kept (skipping only the dead letters)."""
    report, _ = _scenario(
        chk_db.url,
        count=1500,
        keys=150,
        env={"CHECKER_FAIL_RATE": "0.1", "CHECKER_PERMANENT_RATE": "0.03"},
        app=app,
    )
    report.assert_ok()
    assert report.dead_lettered > 0 and report.done + report.dead_lettered == report.produced
    assert (
        scalar(
            chk_db.url,
            "SELECT count(*) FROM (SELECT message_id FROM postbox.dead_letters GROUP BY 1 HAVING count(*) > 1) d",
        )
        == 0
    )
    assert scalar(chk_db.url, "SELECT count(*) FROM postbox.dead_letters WHERE reason <> 'permanent'") == 0
    # A permanent failure is never retried: one permanent attempt per dead letter, and it is the last.
    assert (
        scalar(
            chk_db.url,
            """
        SELECT count(*) FROM postbox.dead_letters d
         WHERE (SELECT count(*) FROM postbox.attempts a WHERE a.message_id = d.message_id AND a.kind = 'permanent') <> 1
            OR (SELECT max(attempt) FROM postbox.attempts a WHERE a.message_id = d.message_id) <> d.attempt""",
        )
        == 0
    )

"""A producer transaction over many keys: PostgreSQL's lock table is shared by the whole server
(about 7,800 locks with the default settings), and a producer holds the key of each message it
queues behind a head, shared, to its commit. A transaction locks at most 1,000 keys; past that, a
queued message's key gets a repair instead of a lock, made at the first claims after the commit.
Nothing is left without a head, and every message is handled once, in its key's order."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest

import postbox

BUDGET = 1000
KEYS = 1500  # past the budget, so that some keys are locked and the rest repaired


def _advisory_locks(observer: psycopg.Connection, pid: int) -> int:
    return observer.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 1349471041 AND pid = %s",
        (pid,),
    ).fetchone()[0]


def _drain(c: psycopg.Connection, table: str, queue: str) -> list[tuple[str, str]]:
    """Claims and completes until the queue is empty: (key, message_id) in the order handled."""
    handled: list[tuple[str, str]] = []
    for _ in range(5 * KEYS):
        rows = c.execute(
            f"SELECT x.id, x.attempt, q.key, q.message_id FROM postbox.{table}_claim_v1(%s, 'w', 1000,"
            f" interval '60 s', now()) x JOIN postbox.{table} q ON q.id = x.id ORDER BY x.id",
            (queue,),
        ).fetchall()
        c.commit()
        if rows:
            handled += [(key, mid) for _, _, key, mid in rows]
            c.execute(
                f"SELECT postbox.{table}_complete_v1(%s::bigint[], %s::integer[], now())",
                ([r[0] for r in rows], [r[1] for r in rows]),
            )
            c.commit()
        elif not c.execute(f"SELECT EXISTS (SELECT 1 FROM postbox.{table})").fetchone()[0]:
            return handled
    raise AssertionError(f"{table} did not drain: messages left without a head")


def _receive_batches(c: psycopg.Connection, prefix: str, keys: int) -> None:
    for start in range(0, keys, 500):
        postbox.receive_many(
            c,
            [
                {"consumer": "c", "message_id": f"{prefix}{i}", "key": f"k{i}", "payload": {}}
                for i in range(start, min(start + 500, keys))
            ],
        )


def _receive_singles(c: psycopg.Connection, prefix: str, keys: int) -> None:
    for i in range(keys):
        postbox.receive(c, consumer="c", message_id=f"{prefix}{i}", key=f"k{i}", payload={})


def _publish_range(c: psycopg.Connection, prefix: str, start: int, stop: int) -> None:
    postbox.publish_many(
        c,
        [
            {"destination": "d", "message_id": f"{prefix}{i}", "key": f"k{i}", "payload": {}}
            for i in range(start, stop)
        ],
    )


def _publish_batches(c: psycopg.Connection, prefix: str, keys: int) -> None:
    for start in range(0, keys, 500):
        _publish_range(c, prefix, start, min(start + 500, keys))


def test_a_transaction_receiving_twenty_thousand_new_keys_commits_and_holds_at_most_the_budget(database):
    """Twenty thousand keys in one transaction used to fill the lock table ("out of shared memory");
    a message that becomes its key's head needs no lock, and a batch past the budget takes none."""
    with database.connect() as c, database.connect(autocommit=True) as observer:
        _receive_batches(c, "m", 20_000)
        assert _advisory_locks(observer, c.info.backend_pid) <= BUDGET
        c.commit()
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)
        assert c.execute("SELECT count(*) FROM postbox.inbox WHERE state = 'ready'").fetchone() == (20_000,)


def _claim_heads(c: psycopg.Connection, table: str, queue: str) -> list[tuple[int, int, int]]:
    """Claims every head: (id, attempt, the key's number)."""
    rows = c.execute(
        f"SELECT x.id, x.attempt, q.key FROM postbox.{table}_claim_v1(%s, 'w', %s, interval '60 s', now()) x"
        f" JOIN postbox.{table} q ON q.id = x.id",
        (queue, KEYS),
    ).fetchall()
    c.commit()
    assert len(rows) == KEYS
    return [(i, a, int(key[1:])) for i, a, key in rows]


def _complete(c: psycopg.Connection, table: str, heads: list[tuple[int, int, int]]) -> None:
    c.execute(
        f"SELECT postbox.{table}_complete_v1(%s::bigint[], %s::integer[], now())",
        ([h[0] for h in heads], [h[1] for h in heads]),
    )
    c.commit()


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
@pytest.mark.parametrize("produce", [_receive_batches, _receive_singles], ids=["batches", "singles"])
def test_messages_queued_under_more_keys_than_the_budget_are_all_handled_when_heads_finish_meanwhile(
    database, isolation: str, produce: Callable[[psycopg.Connection, str, int], None]
):
    """Every key has a claimed head; one transaction queues a second message under each of 1,500
    keys while heads complete: the completions of the keys it locked leave their hand-over to the
    first claim after its commit, those past the budget find nothing to hand over (the message is
    not committed yet), and its repairs make each such second message its key's head. (Under
    REPEATABLE READ the keys are locked at commit, and a head of one of the first 1,000 completed
    meanwhile fails the commit, to be retried, as documented: only the heads past the budget
    complete meanwhile there.)"""
    with (
        database.connect() as c,
        database.connect() as producer,
        database.connect(autocommit=True) as observer,
    ):
        _receive_batches(c, "first-", KEYS)
        c.commit()
        heads = _claim_heads(c, "inbox", "c")
        meanwhile = heads if isolation == "read committed" else [h for h in heads if h[2] >= BUDGET]
        producer.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        produce(producer, "second-", KEYS)
        assert _advisory_locks(observer, producer.info.backend_pid) <= BUDGET
        _complete(c, "inbox", meanwhile)
        producer.commit()
        _complete(c, "inbox", [h for h in heads if h not in meanwhile])
        handled = _drain(c, "inbox", "c")
    assert sorted(handled) == sorted((f"k{i}", f"second-{i}") for i in range(KEYS))


def test_an_outbox_transaction_over_more_keys_than_the_budget_is_relayed_whole_when_heads_finish_meanwhile(
    database,
):
    """The same for the outbox, whose queued rows take their keys' locks at commit."""
    with database.connect() as c, database.connect() as producer:
        _publish_batches(c, "first-", KEYS)
        c.commit()
        heads = _claim_heads(c, "outbox", "d")
        _publish_batches(producer, "second-", KEYS)
        _complete(c, "outbox", heads)
        producer.commit()
        handled = _drain(c, "outbox", "d")
    assert sorted(handled) == sorted((f"k{i}", f"second-{i}") for i in range(KEYS))


def test_twenty_thousand_outbox_rows_queued_behind_heads_commit_with_a_repair_past_the_budget(database):
    """The outbox's check at commit locked every queued row's key: 20,000 keys failed the commit
    ("out of shared memory"). Now the first 1,000 are locked and find their heads, and each of the
    others files its key's repair instead."""
    with database.connect() as c:
        for start in range(0, 20_000, 500):
            _publish_range(c, "first-", start, start + 500)
            c.commit()
        for start in range(0, 20_000, 500):
            _publish_range(c, "second-", start, start + 500)
        c.commit()
        assert c.execute("SELECT count(*), count(DISTINCT key) FROM postbox.key_repairs").fetchone() == (
            19_000,
            19_000,
        )


def test_one_key_queued_past_the_budget_keeps_its_order(database):
    """The budget counts queued messages, not keys: 1,500 messages queued behind one head in one
    transaction, the head completing meanwhile, are handled one at a time in their order."""
    with database.connect() as c, database.connect() as producer:
        postbox.receive(c, consumer="c", message_id="head", key="k", payload={})
        c.commit()
        ((head, attempt),) = c.execute(
            "SELECT id, attempt FROM postbox.inbox_claim_v1('c', 'w', 10, interval '60 s', now())"
        ).fetchall()
        c.commit()
        for i in range(KEYS):
            postbox.receive(producer, consumer="c", message_id=f"m{i}", key="k", payload={})
        c.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", ([head], [attempt]))
        c.commit()
        producer.commit()
        handled = _drain(c, "inbox", "c")
    assert handled == [("k", f"m{i}") for i in range(KEYS)]

"""The hand-over of a key's head when a producer commits while the head's completion is running.

A completion deletes the head, takes the key's lock (tried, never waited for) and makes the first
queued message of the key its next head; a producer that adds a message behind a head checks,
under the key's shared lock held to its commit, that the head is still there, or files a repair
(under READ COMMITTED a single receive takes that lock as it queues the message and a batch before
it looks for its keys' heads; a transaction whose snapshot is older than the lock does it at
commit). A producer that commits after the completion's statement began but before it took the key's lock
must still be seen: otherwise its message stays queued behind a head that is gone, and no claim
ever takes it. The completion is held in that window by a row lock on the head."""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
import pytest

import postbox
from tests.helpers import eventually


def _waiting_on_a_lock(database, pid: int) -> bool:
    with database.connect(autocommit=True) as c:
        row = c.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return row is not None and row[0] == "Lock"


def _complete_while_a_producer_commits(
    database,
    table: str,
    head_id: int,
    attempt: int,
    complete: str,
    produce: Callable[[psycopg.Connection], None],
) -> None:
    """Run ``complete`` for the claimed head while another transaction holds the head's row, let
    ``produce`` commit a message behind the head meanwhile, then let the completion finish."""
    with database.connect() as holder, database.connect() as completer, database.connect() as producer:
        holder.execute(f"SELECT 1 FROM postbox.{table} WHERE id = %s FOR UPDATE", (head_id,))
        done = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                completer.execute(complete, ([head_id], [attempt]))
                completer.commit()
            except BaseException as error:  # reported by the test below
                errors.append(error)
            finally:
                done.set()

        thread = threading.Thread(target=run)
        thread.start()
        eventually(lambda: _waiting_on_a_lock(database, completer.info.backend_pid), what="completion waits")
        produce(producer)
        producer.commit()
        holder.commit()
        assert done.wait(30), "the completion did not finish"
        thread.join()
        assert not errors, errors


@pytest.mark.parametrize("repeat", range(3))
def test_an_outbox_row_committed_during_its_heads_completion_is_relayed(database, repeat):
    with database.connect() as c:
        postbox.publish(c, destination="d", key="k", message_id="first", payload={})
        c.commit()
        head_id, attempt = c.execute(
            "SELECT id, attempt FROM postbox.outbox_claim_v1('d', 'w', 10, interval '60 s', now())"
        ).fetchone()
        c.commit()
    _complete_while_a_producer_commits(
        database, "outbox", head_id, attempt,
        "SELECT postbox.outbox_complete_v1(%s::bigint[], %s::integer[], now())",
        lambda p: postbox.publish(p, destination="d", key="k", message_id="second", payload={}),
    )  # fmt: skip
    with database.connect() as c:
        claimed = c.execute(
            "SELECT message_id FROM postbox.outbox_claim_v1('d', 'w', 10, interval '60 s', now())"
        ).fetchall()
    assert claimed == [("second",)]


@pytest.mark.parametrize("repeat", range(3))
def test_an_inbox_message_committed_during_its_heads_completion_is_claimed(database, repeat):
    with database.connect() as c:
        postbox.receive(c, consumer="c", message_id="first", key="k", type="t", payload={})
        c.commit()
        head_id, attempt = c.execute(
            "SELECT id, attempt FROM postbox.inbox_claim_v1('c', 'w', 10, interval '60 s', now())"
        ).fetchone()
        c.commit()
    _complete_while_a_producer_commits(
        database, "inbox", head_id, attempt,
        "SELECT postbox.inbox_complete_v1(%s::bigint[], %s::integer[], now())",
        lambda p: postbox.receive(p, consumer="c", message_id="second", key="k", type="t", payload={}),
    )  # fmt: skip
    with database.connect() as c:
        claimed = c.execute(
            "SELECT message_id FROM postbox.inbox_claim_v1('c', 'w', 10, interval '60 s', now())"
        ).fetchall()
    assert claimed == [("second",)]


@pytest.mark.parametrize("repeat", range(3))
def test_a_keyed_batch_committed_during_its_heads_completion_is_claimed_in_order(database, repeat):
    with database.connect() as c:
        postbox.receive(c, consumer="c", message_id="first", key="k", payload={})
        c.commit()
        head_id, attempt = c.execute(
            "SELECT id, attempt FROM postbox.inbox_claim_v1('c', 'w', 10, interval '60 s', now())"
        ).fetchone()
        c.commit()
    batch = [{"consumer": "c", "message_id": f"m{i}", "key": "k", "payload": {}} for i in range(3)]
    _complete_while_a_producer_commits(
        database, "inbox", head_id, attempt,
        "SELECT postbox.inbox_complete_v1(%s::bigint[], %s::integer[], now())",
        lambda p: postbox.receive_many(p, batch),
    )  # fmt: skip
    claimed = []
    with database.connect() as c:
        for _ in range(3):
            ((mid, att),) = c.execute(
                "SELECT id, attempt FROM postbox.inbox_claim_v1('c', 'w', 10, interval '60 s', now())"
            ).fetchall()
            claimed += c.execute("SELECT message_id FROM postbox.inbox WHERE id = %s", (mid,)).fetchall()
            c.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", ([mid], [att]))
            c.commit()
        assert c.execute("SELECT count(*) FROM postbox.inbox_commit_checks").fetchone() == (0,)
    assert claimed == [("m0",), ("m1",), ("m2",)]


def test_a_batch_rechecks_its_keys_once_at_commit_not_once_per_queued_message(database):
    """The heads of two keys finish while a batch that queued five messages behind them is open: the
    completions cannot take the keys' locks the batch holds and file one repair per key (nothing is
    checked per queued message, nor at the batch's commit), and each key's first message is next."""
    with database.connect() as c:
        for key in ("k1", "k2"):
            postbox.receive(c, consumer="c", message_id=f"head-{key}", key=key, payload={})
        c.commit()
        with database.connect() as producer:
            postbox.receive_many(
                producer,
                [{"consumer": "c", "message_id": f"{k}-{i}", "key": k, "payload": {}} for k, i in
                 [("k1", 0), ("k2", 0), ("k1", 1), ("k2", 1), ("k1", 2)]],
            )  # fmt: skip
            heads = c.execute(
                "SELECT id, attempt FROM postbox.inbox_claim_v1('c', 'w', 10, interval '60 s', now())"
            ).fetchall()
            c.execute(
                "SELECT postbox.inbox_complete_v1(%s, %s, now())",
                ([h[0] for h in heads], [h[1] for h in heads]),
            )
            c.commit()
            producer.commit()
        assert c.execute("SELECT key FROM postbox.key_repairs ORDER BY key").fetchall() == [("k1",), ("k2",)]
        assert c.execute("SELECT count(*) FROM postbox.inbox_commit_checks").fetchone() == (0,)
        claimed = c.execute(
            "SELECT i.message_id FROM postbox.inbox_claim_v1('c', 'w', 10, interval '60 s', now()) x"
            " JOIN postbox.inbox i ON i.id = x.id ORDER BY 1"
        ).fetchall()
    assert claimed == [("k1-0",), ("k2-0",)]


def _key_lock(c, consumer: str, key: str) -> list[tuple[str, bool]]:
    """The key's advisory lock (postbox.try_lock_key_v1's class 1) as pg_locks shows it, for any session."""
    return c.execute(
        "SELECT mode, granted FROM pg_locks WHERE locktype = 'advisory' AND classid = 1349471041"
        " AND objid = hashtext(%s || '/' || %s)::oid",
        (consumer, key),
    ).fetchall()


def _claim_ids(c) -> list[tuple[int, int]]:
    return c.execute(
        "SELECT id, attempt FROM postbox.inbox_claim_v1('c', 'w', 10, interval '60 s', now())"
    ).fetchall()


def _claimed_ids(c) -> list[str]:
    rows = c.execute(
        "SELECT i.message_id FROM postbox.inbox_claim_v1('c', 'w', 10, interval '60 s', now()) x"
        " JOIN postbox.inbox i ON i.id = x.id ORDER BY x.id"
    ).fetchall()
    return [r[0] for r in rows]


def test_a_queued_single_receive_holds_its_key_to_its_commit_and_files_no_check(database):
    """Under READ COMMITTED a single receive that queues a message behind a head another
    transaction made takes the key's lock shared at once and holds it to its commit, with nothing
    left to do at commit (no check row, no trigger); a receive that makes a head, or queues behind
    a head its own transaction made, takes no key lock. The inbox itself has no insert trigger."""
    with database.connect() as c, database.connect(autocommit=True) as observer:
        insert_triggers = c.execute(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'postbox.inbox'::regclass"
            " AND NOT tgisinternal AND tgtype & 4 <> 0"  # 4: TRIGGER_TYPE_INSERT
        ).fetchall()
        assert insert_triggers == []
        postbox.receive(c, consumer="c", message_id="head", key="k", payload={})
        assert _key_lock(observer, "c", "k") == []
        postbox.receive(c, consumer="c", message_id="next", key="k", payload={})
        assert _key_lock(observer, "c", "k") == []  # nobody finishes our own head before we commit
        c.commit()
        postbox.receive(c, consumer="c", message_id="third", key="k", payload={})
        assert _key_lock(observer, "c", "k") == [("ShareLock", True)]
        assert c.execute("SELECT count(*) FROM postbox.inbox_commit_checks").fetchone() == (0,)
        c.commit()
        assert _key_lock(observer, "c", "k") == []
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)  # its head was there
        assert _claimed_ids(c) == ["head"]


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
def test_under_repeatable_read_a_queued_single_receive_files_its_keys_check_at_commit(database, isolation):
    """A snapshot older than the key's lock cannot be trusted to see the head: under REPEATABLE READ
    and SERIALIZABLE the queued message's key is checked at commit instead (one check row, gone at
    commit), and no key lock is held before it."""
    with database.connect() as c, database.connect(autocommit=True) as observer:
        postbox.receive(c, consumer="c", message_id="head", key="k", payload={})
        c.commit()
        c.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        postbox.receive(c, consumer="c", message_id="next", key="k", payload={})
        assert c.execute("SELECT consumers, keys FROM postbox.inbox_commit_checks").fetchall() == [
            (["c"], ["k"])
        ]
        assert _key_lock(observer, "c", "k") == []
        c.commit()
        assert c.execute("SELECT count(*) FROM postbox.inbox_commit_checks").fetchone() == (0,)
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)


def test_a_head_completed_while_a_producer_holds_its_key_hands_over_after_the_producers_commit(database):
    """The head finishes while a producer that queued a message behind it is still open: the
    completion does not wait for the producer (it files a repair), another key's messages go on
    meanwhile, and the first claim after the producer's commit makes its message the head."""
    with database.connect() as c, database.connect() as producer:
        postbox.receive(c, consumer="c", message_id="head", key="k", payload={})
        c.commit()
        ((head, attempt),) = _claim_ids(c)
        c.commit()
        postbox.receive(producer, consumer="c", message_id="next", key="k", payload={})  # open: holds k
        c.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", ([head], [attempt]))
        c.commit()
        assert c.execute("SELECT key FROM postbox.key_repairs").fetchall() == [("k",)]
        postbox.receive(c, consumer="c", message_id="other", key="k2", payload={})
        c.commit()
        assert _claimed_ids(c) == ["other"]  # the repair waits for the producer; k2 does not
        c.commit()
        producer.commit()
        assert _claimed_ids(c) == ["next"]
        c.commit()
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)


def test_a_receive_that_queues_while_its_heads_completion_holds_the_key_files_a_repair(database):
    """The head is there when the receive decides to queue behind it, and gone by the time the
    receive has the key's lock (the completion held the lock meanwhile and commits without seeing
    the message): the receive files the repair itself, and the message is claimed next."""
    with database.connect() as c, database.connect() as completer, database.connect() as producer:
        postbox.receive(c, consumer="c", message_id="head", key="k", payload={})
        c.commit()
        # A completion in progress holds the key's lock exclusively (as a completion takes it).
        assert completer.execute("SELECT postbox.try_lock_key_v1(1, 'c', 'k')").fetchone() == (True,)
        done = threading.Event()
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                postbox.receive(producer, consumer="c", message_id="next", key="k", payload={})
                producer.commit()
            except BaseException as error:  # reported below
                errors.append(error)
            finally:
                done.set()

        thread = threading.Thread(target=receive)
        thread.start()
        eventually(
            lambda: _waiting_on_a_lock(database, producer.info.backend_pid), what="receive waits for the key"
        )
        # The receive has queued its message behind the head and waits for the key's lock: the
        # completion now takes the head out and commits, without the message in its snapshot.
        completer.execute("DELETE FROM postbox.inbox WHERE message_id = 'head'")
        completer.commit()
        assert done.wait(30), "the receive did not finish"
        thread.join()
        assert not errors, errors
        assert c.execute("SELECT key FROM postbox.key_repairs").fetchall() == [("k",)]
        assert _claimed_ids(c) == ["next"]


def _batch(keys_ids: list[tuple[str, str]]) -> list[dict[str, object]]:
    return [{"consumer": "c", "message_id": m, "key": k, "payload": {}} for k, m in keys_ids]


def test_a_keyed_batch_holds_its_keys_to_its_commit_and_files_no_check(database):
    """Under READ COMMITTED a transaction's batches, up to its first 1,000 messages, take their keys'
    locks shared before they look for their heads and hold them to its commit: the heads it found are its queued messages' check, so nothing is left
    for the commit (no check row) and no repair is filed while the heads are there."""
    with database.connect() as c, database.connect(autocommit=True) as observer:
        for key in ("k1", "k2"):
            postbox.receive(c, consumer="c", message_id=f"head-{key}", key=key, payload={})
        c.commit()
        postbox.receive_many(c, _batch([("k1", "a"), ("k2", "b"), ("k1", "c")]))
        assert _key_lock(observer, "c", "k1") == [("ShareLock", True)]
        assert _key_lock(observer, "c", "k2") == [("ShareLock", True)]
        assert c.execute("SELECT count(*) FROM postbox.inbox_commit_checks").fetchone() == (0,)
        c.commit()
        assert _key_lock(observer, "c", "k1") == [] and _key_lock(observer, "c", "k2") == []
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)
        assert _claimed_ids(c) == ["head-k1", "head-k2"]


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
def test_under_repeatable_read_a_keyed_batch_files_its_keys_check_at_commit(database, isolation):
    """A snapshot older than any lock cannot be trusted to see the heads: under REPEATABLE READ and
    SERIALIZABLE the keys a batch queued under are checked at its commit (one check row naming each
    key once, gone at commit), and no key lock is held before it."""
    with database.connect() as c, database.connect(autocommit=True) as observer:
        for key in ("k1", "k2"):
            postbox.receive(c, consumer="c", message_id=f"head-{key}", key=key, payload={})
        c.commit()
        c.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        postbox.receive_many(c, _batch([("k1", "a"), ("k2", "b"), ("k1", "c")]))
        ((consumers, keys),) = c.execute("SELECT consumers, keys FROM postbox.inbox_commit_checks").fetchall()
        assert consumers == ["c", "c"] and sorted(keys) == ["k1", "k2"]
        assert _key_lock(observer, "c", "k1") == []
        c.commit()
        assert c.execute("SELECT count(*) FROM postbox.inbox_commit_checks").fetchone() == (0,)
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)


def test_a_keyed_batch_over_a_key_waiting_for_its_repair_queues_behind_it_and_files_one(database):
    """The key's head finished while a producer that queued a message behind it was open, so the key
    has a queued message and no head until the next claim repairs it. A batch on that key neither
    overtakes the queued message nor leaves the key without a repair: it queues behind, files one,
    and the key's messages are claimed in their order."""
    with database.connect() as c, database.connect() as producer:
        postbox.receive(c, consumer="c", message_id="head", key="k", payload={})
        c.commit()
        ((head, attempt),) = _claim_ids(c)
        c.commit()
        postbox.receive(producer, consumer="c", message_id="a", key="k", payload={})  # open: holds k
        c.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", ([head], [attempt]))
        c.commit()
        producer.commit()
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (1,)
        postbox.receive_many(c, _batch([("k", "b0"), ("k", "b1")]))
        assert c.execute(
            "SELECT count(*) FROM postbox.inbox WHERE key = 'k' AND state <> 'pending'"
        ).fetchone() == (0,)
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (2,)
        c.commit()
        order = []
        for _ in range(3):
            ((mid, att),) = _claim_ids(c)
            order += c.execute("SELECT message_id FROM postbox.inbox WHERE id = %s", (mid,)).fetchone()
            c.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", ([mid], [att]))
            c.commit()
        assert order == ["a", "b0", "b1"]


@pytest.mark.parametrize(
    "past_first_keys", [False, True], ids=["first-messages", "past-the-first-1000-messages"]
)
def test_a_keyed_batch_that_waits_for_its_key_while_the_heads_completion_holds_it_sees_the_outcome(
    database, past_first_keys: bool
):
    """A completion holds the key's lock when a batch arrives: the batch waits for it (the only wait
    a producer can have, on a process that waits for no one), then sees the head gone. Among its
    transaction's first 1,000 messages, locked before it looks, it makes its own first message the
    key's head, with no repair needed. Past them it has looked first, found the head (not gone
    yet) and queued its messages behind it, so it files the key's repair, which the next claim
    makes. Either way the batch's first message is claimed first."""
    with database.connect() as c, database.connect() as completer, database.connect() as producer:
        postbox.receive(c, consumer="c", message_id="head", key="k", payload={})
        c.commit()
        assert completer.execute("SELECT postbox.try_lock_key_v1(1, 'c', 'k')").fetchone() == (True,)
        done = threading.Event()
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                if past_first_keys:  # 1,000 new keys of another consumer first, in the same transaction
                    for start in (0, 500):
                        postbox.receive_many(
                            producer,
                            [
                                {"consumer": "other", "message_id": f"o{i}", "key": f"o{i}", "payload": {}}
                                for i in range(start, start + 500)
                            ],
                        )
                postbox.receive_many(producer, _batch([("k", "b0"), ("k", "b1")]))
                producer.commit()
            except BaseException as error:  # reported below
                errors.append(error)
            finally:
                done.set()

        thread = threading.Thread(target=receive)
        thread.start()
        eventually(
            lambda: _waiting_on_a_lock(database, producer.info.backend_pid),
            what="the batch waits for the key",
        )
        completer.execute("DELETE FROM postbox.inbox WHERE message_id = 'head'")
        completer.commit()
        assert done.wait(30), "the batch did not finish"
        thread.join()
        assert not errors, errors
        repairs = c.execute("SELECT count(*) FROM postbox.key_repairs WHERE queue = 'c'").fetchone()
        assert repairs == ((1,) if past_first_keys else (0,))
        assert _claimed_ids(c) == ["b0"]


def test_a_keyed_receive_over_a_key_waiting_for_its_repair_queues_behind_it_and_files_one(database):
    """The same for a single receive: the key has a queued message and no head (its head finished
    while a producer held the key), so the next message neither overtakes the queued one nor leaves
    the key without a repair, and the key's messages are claimed in their order."""
    with database.connect() as c, database.connect() as producer:
        postbox.receive(c, consumer="c", message_id="head", key="k", payload={})
        c.commit()
        ((head, attempt),) = _claim_ids(c)
        c.commit()
        postbox.receive(producer, consumer="c", message_id="a", key="k", payload={})  # open: holds k
        c.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", ([head], [attempt]))
        c.commit()
        producer.commit()
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (1,)
        assert postbox.receive(c, consumer="c", message_id="b", key="k", payload={}).status == "new"
        assert c.execute(
            "SELECT message_id, state FROM postbox.inbox WHERE key = 'k' ORDER BY id"
        ).fetchall() == [("a", "pending"), ("b", "pending")]
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (2,)
        c.commit()
        order = []
        for _ in range(2):
            ((mid, att),) = _claim_ids(c)
            order += c.execute("SELECT message_id FROM postbox.inbox WHERE id = %s", (mid,)).fetchone()
            c.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", ([mid], [att]))
            c.commit()
        assert order == ["a", "b"]


@pytest.mark.parametrize("maker_commits", [True, False], ids=["commits", "rolls-back"])
def test_a_keyed_receive_waits_for_a_head_another_transaction_is_making(database, maker_commits):
    """Another transaction is making the key's head, not committed yet, when a receive on the key
    looks for it: the receive waits for that transaction. If it commits, the message queues behind
    its head (no repair: the head is there); if it rolls back, the message is the key's head."""
    with database.connect() as c, database.connect() as maker, database.connect() as producer:
        postbox.receive(maker, consumer="c", message_id="first", key="k", payload={})  # open
        done = threading.Event()
        results: list[object] = []

        def receive() -> None:
            try:
                results.append(
                    postbox.receive(producer, consumer="c", message_id="second", key="k", payload={})
                )
                producer.commit()
            except BaseException as error:  # reported below
                results.append(error)
            finally:
                done.set()

        thread = threading.Thread(target=receive)
        thread.start()
        eventually(
            lambda: _waiting_on_a_lock(database, producer.info.backend_pid),
            what="the receive waits for the head's transaction",
        )
        if maker_commits:
            maker.commit()
        else:
            maker.rollback()
        assert done.wait(30), "the receive did not finish"
        thread.join()
        assert len(results) == 1 and not isinstance(results[0], BaseException), results
        assert results[0].status == "new"
        states = c.execute(
            "SELECT message_id, state FROM postbox.inbox WHERE key = 'k' ORDER BY id"
        ).fetchall()
        if maker_commits:
            assert states == [("first", "ready"), ("second", "pending")]
        else:
            assert states == [("second", "ready")]
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)
        assert _claimed_ids(c) == (["first"] if maker_commits else ["second"])


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
def test_under_repeatable_read_a_keyed_receive_after_its_heads_completion_makes_the_next_head(
    database, isolation
):
    """The key's head finished after the producer's snapshot was taken, so the snapshot still shows
    it: the receive does not queue behind a head that is gone (whose check at commit could only fail),
    it makes its message the key's head, and the producer commits."""
    with database.connect() as c, database.connect() as producer:
        postbox.receive(c, consumer="c", message_id="head", key="k", payload={})
        c.commit()
        ((head, attempt),) = _claim_ids(c)
        c.commit()
        producer.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        producer.execute("SELECT count(*) FROM postbox.inbox").fetchone()  # the snapshot: the head is there
        c.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", ([head], [attempt]))
        c.commit()
        assert postbox.receive(producer, consumer="c", message_id="next", key="k", payload={}).status == "new"
        producer.commit()
        assert c.execute("SELECT message_id, state FROM postbox.inbox WHERE key = 'k'").fetchall() == [
            ("next", "ready")
        ]
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)

"""The hand-over of a key's head when a producer commits while the head's completion is running.

A completion deletes the head, takes the key's lock (tried, never waited for) and makes the first
queued message of the key its next head; a producer that adds a message behind a head checks, at
its commit and under the key's shared lock, that the head is still there, or files a repair. A
producer that commits after the completion's statement began but before it took the key's lock
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
    """The heads of two keys finish while a batch queues five messages behind them: its commit files
    one repair per key (one set-based check for the batch), and each key's first message is next."""
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


def test_a_queued_single_receive_files_one_check_for_its_key_and_the_inbox_has_no_insert_trigger(database):
    """A single receive that queues a message behind its key's head files one check for that key,
    made and gone at its commit; a receive that makes a head files none. The inbox itself has no
    insert trigger: nothing per row at commit, and no trigger condition read back from the catalog
    by every statement that inserts a head."""
    with database.connect() as c:
        insert_triggers = c.execute(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'postbox.inbox'::regclass"
            " AND NOT tgisinternal AND tgtype & 4 <> 0"  # 4: TRIGGER_TYPE_INSERT
        ).fetchall()
        assert insert_triggers == []
        postbox.receive(c, consumer="c", message_id="head", key="k", payload={})
        assert c.execute("SELECT count(*) FROM postbox.inbox_commit_checks").fetchone() == (0,)
        postbox.receive(c, consumer="c", message_id="next", key="k", payload={})
        checks = c.execute("SELECT consumers, keys FROM postbox.inbox_commit_checks").fetchall()
        assert checks == [(["c"], ["k"])]
        c.commit()
        assert c.execute("SELECT count(*) FROM postbox.inbox_commit_checks").fetchone() == (0,)
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)  # its head was there
        claimed = c.execute(
            "SELECT i.message_id FROM postbox.inbox_claim_v1('c', 'w', 10, interval '60 s', now()) x"
            " JOIN postbox.inbox i ON i.id = x.id"
        ).fetchall()
        assert claimed == [("head",)]

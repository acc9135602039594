"""The deduplication window is exact at its edges, whether or not maintenance has pruned the ledger:
a redelivery one second inside the window is a duplicate, one second outside it is new (unless the
first receipt is still in the inbox or dead-lettered). The window is the database's
(postbox.dedup_window), which `postbox maintain` sets from dedup_retention_seconds."""

from __future__ import annotations

import threading

import psycopg
import pytest

import postbox
from postbox.operations.maintenance import Maintenance, MaintenanceSettings
from tests.helpers import eventually, scalar

WINDOW = 60  # seconds


@pytest.fixture
def url(database) -> str:
    with psycopg.connect(database.url) as c:
        c.execute("SELECT postbox.dedup_window_set_v1(%s)", (WINDOW,))
        c.commit()
    return database.url


def _processed(url: str, consumer: str = "c") -> None:
    """Claim and complete everything ready: the messages leave the inbox."""
    with psycopg.connect(url) as c:
        rows = c.execute(
            "SELECT id, attempt FROM postbox.inbox_claim_v1(%s, 'w', 100, interval '60 s', now())",
            (consumer,),
        ).fetchall()
        c.execute(
            "SELECT postbox.inbox_complete_v1(%s, %s, now())", ([r[0] for r in rows], [r[1] for r in rows])
        )
        c.commit()


def _received_ago(url: str, message_id: str, seconds: int) -> None:
    with psycopg.connect(url) as c:
        c.execute(
            "UPDATE postbox.inbox_dedup SET received_at = now() - make_interval(secs => %s) WHERE message_id = %s",
            (seconds, message_id),
        )
        c.commit()


def _receive(url: str, message_id: str, payload: object = 1, key: str | None = None) -> str:
    with psycopg.connect(url) as c:
        result = postbox.receive(c, consumer="c", message_id=message_id, key=key, payload=payload)
        c.commit()
    return result.status.value


@pytest.mark.parametrize("key", [None, "k"])
def test_a_redelivery_one_second_inside_the_window_is_a_duplicate_one_second_outside_is_new(url, key):
    assert _receive(url, "m", key=key) == "new"
    _processed(url)
    _received_ago(url, "m", WINDOW - 1)
    assert _receive(url, "m", key=key) == "duplicate"
    _received_ago(url, "m", WINDOW + 1)
    assert _receive(url, "m", key=key) == "new"
    assert scalar(url, "SELECT count(*) FROM postbox.inbox WHERE message_id = 'm' AND state = 'ready'") == 1
    # The new receipt starts a new window.
    assert scalar(url, "SELECT received_at > now() - interval '5 s' FROM postbox.inbox_dedup") is True
    assert _receive(url, "m", key=key) == "duplicate"


def test_a_batch_judges_each_id_by_the_same_edges(url):
    with psycopg.connect(url) as c:
        postbox.receive_many(c, [{"consumer": "c", "message_id": m, "key": "k", "payload": 1} for m in "ab"])
        c.commit()
    _processed(url)
    _processed(url)
    _received_ago(url, "a", WINDOW - 1)
    _received_ago(url, "b", WINDOW + 1)
    with psycopg.connect(url) as c:
        results = postbox.receive_many(
            c,
            [{"consumer": "c", "message_id": m, "key": "k", "payload": 1} for m in ("a", "b", "b", "c")]
            + [{"consumer": "c", "message_id": f"x{i}", "key": "k", "payload": 1} for i in range(20)],
        )
        c.commit()
    assert [r.status.value for r in results[:4]] == ["duplicate", "new", "duplicate", "new"]
    assert scalar(url, "SELECT count(*) FROM postbox.inbox") == 22


def test_outside_the_window_another_payload_is_new_not_a_conflict(url):
    assert _receive(url, "m", payload={"v": 1}) == "new"
    _processed(url)
    assert _receive(url, "m", payload={"v": 2}) == "conflict"
    _received_ago(url, "m", WINDOW + 1)
    assert _receive(url, "m", payload={"v": 2}) == "new"


def test_a_message_still_live_or_dead_lettered_stays_a_duplicate_past_the_window(url):
    assert _receive(url, "live", key="k1") == "new"  # never processed: still in the inbox
    _received_ago(url, "live", WINDOW + 1)
    assert _receive(url, "live", key="k1") == "duplicate"
    assert _receive(url, "dead", key="k2") == "new"
    with psycopg.connect(url) as c:
        claimed = c.execute(
            "SELECT x.id, x.attempt FROM postbox.inbox_claim_v1('c', 'w', 10, interval '60 s', now()) x"
            " JOIN postbox.inbox i ON i.id = x.id WHERE i.message_id = 'dead'"
        ).fetchall()
        c.commit()
        ((mid, att),) = claimed
        c.execute(
            "SELECT postbox.inbox_dead_letter_v1(%s, %s, now(), 'permanent', 'boom', 'E', NULL, 'fp')",
            (mid, att),
        )
        c.commit()
    assert (
        scalar(url, "SELECT count(*) FROM postbox.dead_letters WHERE message_id = 'dead' AND status = 'open'")
        == 1
    )
    _received_ago(url, "dead", WINDOW + 1)
    assert _receive(url, "dead", key="k2") == "duplicate"


def test_concurrent_redeliveries_past_the_window_make_one_new_message(url):
    assert _receive(url, "m") == "new"
    _processed(url)
    _received_ago(url, "m", WINDOW + 1)
    with psycopg.connect(url) as first, psycopg.connect(url) as second:
        assert postbox.receive(first, consumer="c", message_id="m", payload=1).status.value == "new"
        results: list[str] = []

        def redeliver() -> None:
            results.append(postbox.receive(second, consumer="c", message_id="m", payload=1).status.value)
            second.commit()

        thread = threading.Thread(target=redeliver)
        thread.start()
        eventually(
            lambda: scalar(
                url, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'",
                (second.info.backend_pid,),
            ) == 1,
            what="the second redelivery waits for the first",
        )  # fmt: skip
        first.commit()
        thread.join(30)
    assert results == ["duplicate"]
    assert scalar(url, "SELECT count(*) FROM postbox.inbox WHERE message_id = 'm'") == 1


def test_postbox_maintain_sets_the_window_receives_judge_by(database):
    Maintenance(database.url, MaintenanceSettings(dedup_retention_seconds=90.5)).register()
    assert scalar(database.url, "SELECT extract(epoch FROM retention) FROM postbox.dedup_window") == 90.5
    with psycopg.connect(database.url) as c, pytest.raises(psycopg.Error, match="must be a positive"):
        c.execute("SELECT postbox.dedup_window_set_v1(0)")


def _rotate_due(url: str) -> int:
    """Make the rotation due (as if a window and its margin had passed) and run it."""
    with psycopg.connect(url) as c:
        c.execute("UPDATE postbox.dedup_window SET rotated_at = now() - interval '1 day'")
        c.commit()
        rows = c.execute("SELECT postbox.dedup_rotate_v1(now())").fetchone()
        c.commit()
    return int(rows[0]) if rows else -1


def _slots(url: str) -> dict[str, int]:
    with psycopg.connect(url) as c:
        return dict(
            c.execute("SELECT message_id, slot FROM postbox.inbox_dedup ORDER BY message_id").fetchall()
        )


def test_a_rotation_truncates_the_older_slot_and_keeps_every_decision(url):
    """Receipts move through the two slots: after one rotation a receipt is in the older slot and
    still counts; the next rotation drops it only once it is past the window, and carries over the
    receipts of messages still live or dead-lettered."""
    for m in ("old", "recent"):
        assert _receive(url, m, key=m) == "new"
    _processed(url)
    assert _slots(url) == {"old": 0, "recent": 0}
    assert _rotate_due(url) == 0  # slot 1 was empty
    assert scalar(url, "SELECT current_slot FROM postbox.dedup_window") == 1
    # In the older slot, inside the window: still duplicates.
    assert _receive(url, "old", key="old") == "duplicate"
    assert _receive(url, "recent", key="recent") == "duplicate"
    with psycopg.connect(url) as c:  # a message still live whose receipt is past the window
        postbox.receive(c, consumer="idle", message_id="kept", payload=1)  # no worker: stays live
        c.execute("UPDATE postbox.inbox_dedup SET slot = 0 WHERE message_id = 'kept'")
        c.commit()
    _received_ago(url, "old", WINDOW + 1)
    _received_ago(url, "kept", WINDOW + 1)
    assert _receive(url, "old", key="old") == "new"  # past the window: new, written to slot 1
    _processed(url, consumer="c")
    _received_ago(url, "recent", WINDOW + 1)  # as a real rotation finds every row of the older slot
    _rotate_due(url)
    assert scalar(url, "SELECT current_slot FROM postbox.dedup_window") == 0
    slots = _slots(url)
    assert "recent" not in slots, "a receipt past the window stayed"
    assert slots == {"old": 1, "kept": 1}, slots  # the live one was carried over from slot 0
    with psycopg.connect(url) as c:
        assert postbox.receive(c, consumer="idle", message_id="kept", payload=1).status.value == "duplicate"
    assert _receive(url, "old", key="old") == "duplicate"
    assert _receive(url, "recent", key="recent") == "new"


def test_a_rotation_waits_for_a_transaction_that_wrote_the_slot_it_passes(url):
    """A receive's transaction holds the ledger until it ends: the rotation waits for it (its
    receipt is in the slot that becomes the older one, seen by later receives), and a concurrent
    receive of the same id after the rotation is a duplicate."""
    with psycopg.connect(url) as open_tx:
        assert postbox.receive(open_tx, consumer="c", message_id="m", payload=1).status.value == "new"
        rotated: list[int] = []
        rotation = threading.Thread(target=lambda: rotated.append(_rotate_due(url)))
        rotation.start()
        eventually(
            lambda: scalar(
                url,
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND query LIKE '%%dedup_rotate_v1%%'",
            ) == 1,
            what="the rotation waits for the open receive",
        )  # fmt: skip
        open_tx.commit()
        rotation.join(30)
    assert rotated == [0]
    assert scalar(url, "SELECT current_slot FROM postbox.dedup_window") == 1
    assert _receive(url, "m") == "duplicate"
    assert _slots(url) == {"m": 0}


def test_a_repeatable_read_receive_whose_snapshot_predates_a_rotation_gets_a_retryable_error(url):
    """Its snapshot shows the slot the rotation passed: writing it could hide a duplicate, so the
    receive fails with a serialization error (the producer retries) instead."""
    with psycopg.connect(url) as producer:
        producer.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        producer.execute("SELECT 1")  # the transaction's snapshot, before the rotation
        _rotate_due(url)
        with pytest.raises(psycopg.errors.SerializationFailure):
            postbox.receive(producer, consumer="c", message_id="m", payload=1)
    assert _receive(url, "m") == "new"
    assert _slots(url) == {"m": 1}


def test_many_producers_racing_rotations_accept_each_id_once(url):
    """Two producers send the same ids at once while rotations are forced as fast as they go (the
    window is a day: no receipt ever expires): each id becomes exactly one inbox message."""
    with psycopg.connect(url) as c:
        c.execute("SELECT postbox.dedup_window_set_v1(86400)")
        c.commit()
    ids = [f"m{i}" for i in range(300)]
    done = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            with psycopg.connect(url) as c:
                for i in range(0, len(ids), 3):
                    postbox.receive_many(
                        c, [{"consumer": "c", "message_id": m, "payload": 1} for m in ids[i : i + 3]]
                    )
                    c.commit()
        except BaseException as error:
            errors.append(error)

    def rotate() -> None:  # one rotation per 50 ms: the producers, in step, never sit two apart
        while not done.wait(0.05):
            with psycopg.connect(url) as c:
                c.execute("UPDATE postbox.dedup_window SET rotated_at = now() - interval '3 days'")
                c.commit()
                c.execute("SELECT postbox.dedup_rotate_v1(now())")
                c.commit()

    rotator = threading.Thread(target=rotate)
    rotator.start()
    producers = [threading.Thread(target=produce) for _ in range(2)]
    for t in producers:
        t.start()
    for t in producers:
        t.join(60)
    done.set()
    rotator.join(30)
    assert not errors, errors
    assert scalar(url, "SELECT count(*) FROM postbox.inbox") == len(ids)
    assert scalar(url, "SELECT count(DISTINCT message_id) FROM postbox.inbox") == len(ids)

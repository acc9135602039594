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

"""Sequence modes (ORD-4): arrival, monotonic and gapless, with out-of-order and late messages."""

from __future__ import annotations

import psycopg
import pytest

import postbox
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from tests.helpers import EFFECTS_DDL, eventually, record_effect, scalar
from tests.helpers import FAST_WORKER as FAST


@pytest.fixture
def db(database):
    with database.connect(autocommit=True) as c:
        c.execute(EFFECTS_DDL)
    return database


def registry(consumer: str) -> Registry:
    reg = Registry()

    @reg.handler(consumer)
    def handle(m, ctx):
        record_effect(ctx.conn, m.message_id, m.key, m.sequence, m.attempt)

    return reg


def receive(url, consumer, *seqs, key="k", prefix="m"):
    with psycopg.connect(url) as c:
        for s in seqs:
            postbox.receive(c, consumer=consumer, message_id=f"{prefix}{s}", key=key, sequence=s, payload={})
            c.commit()


def effects(url):
    return scalar(url, "SELECT string_agg(sequence::text, ',' ORDER BY id) FROM effects")


def run_worker(url, consumer):
    w = Worker(url, registry(consumer), WorkerSettings(consumer=consumer, **FAST))
    w.start()
    return w


def test_gapless_waits_for_the_missing_sequence(db):
    """gapless: 2 and 3 wait (the gap is recorded) until 1 arrives; then 1, 2, 3 run in order."""
    url = db.url
    with psycopg.connect(url) as c:
        postbox.declare_consumer(c, "g", sequence_mode="gapless", gap_timeout_seconds=60)
        c.commit()
    receive(url, "g", 2, 3)
    w = run_worker(url, "g")
    try:
        gap = eventually(
            lambda: scalar(
                url,
                "SELECT row(key, expected_sequence, next_present_sequence, timed_out)::text FROM postbox.key_gaps",
            )
        )
        assert gap == "(k,1,2,f)"
        assert scalar(url, "SELECT count(*) FROM effects") == 0
        assert scalar(url, "SELECT count(*) FROM postbox.inbox WHERE state <> 'pending'") == 0
        receive(url, "g", 1)
        eventually(lambda: scalar(url, "SELECT count(*) FROM effects") == 3)
        assert effects(url) == "1,2,3"
        assert scalar(url, "SELECT count(*) FROM postbox.key_gaps") == 0
        # A gap after progress: 5 waits for 4.
        receive(url, "g", 5)
        eventually(lambda: scalar(url, "SELECT expected_sequence FROM postbox.key_gaps") == 4)
        receive(url, "g", 4)
        eventually(lambda: scalar(url, "SELECT count(*) FROM effects") == 5)
        assert effects(url) == "1,2,3,4,5"
    finally:
        w.stop()
        w.join()


def test_gap_timeout_is_surfaced(db):
    """A key waiting past its consumer's gap_timeout shows timed_out in postbox.key_gaps."""
    url = db.url
    with psycopg.connect(url) as c:
        postbox.declare_consumer(c, "g", sequence_mode="gapless", gap_timeout_seconds=1)
        c.commit()
    receive(url, "g", 3)
    # A worker's next claim looks at the key (it has no head) and records the gap.
    assert scalar(url, "SELECT count(*) FROM postbox.inbox_claim_v1('g', 'w', 10, '1 minute', now())") == 0
    assert scalar(url, "SELECT timed_out FROM postbox.key_gaps") is False
    with psycopg.connect(url) as c:
        c.execute("UPDATE postbox.inbox_keys SET gap_since = gap_since - interval '2 seconds'")
        c.commit()
    assert scalar(url, "SELECT timed_out FROM postbox.key_gaps") is True


def test_gapless_late_duplicate_sequence_is_dead_lettered(db):
    """gapless: a second message with an already processed sequence is late: dead-lettered, key goes on."""
    url = db.url
    with psycopg.connect(url) as c:
        postbox.declare_consumer(c, "g", sequence_mode="gapless")
        c.commit()
    w = run_worker(url, "g")
    try:
        receive(url, "g", 1, 2)
        eventually(lambda: scalar(url, "SELECT count(*) FROM effects") == 2)
        receive(url, "g", 2, prefix="again-")
        receive(url, "g", 3)
        eventually(lambda: scalar(url, "SELECT count(*) FROM effects") == 3)
    finally:
        w.stop()
        w.join()
    assert effects(url) == "1,2,3"
    assert (
        scalar(url, "SELECT row(message_id, reason, status)::text FROM postbox.dead_letters")
        == "(again-2,late,open)"
    )


@pytest.mark.parametrize("late_policy", ["dead_letter", "skip", "process"])
def test_gapless_sequence_below_first_sequence_is_late_and_the_key_starts_at_first(db, late_policy):
    """gapless, first_sequence 5: a message with sequence 3, on a key that has processed nothing, is
    late (its late_policy applies) and the key starts at 5. It was taken for the key's start: it ran
    first, and the key then waited for 4 for ever."""
    url = db.url
    with psycopg.connect(url) as c:
        postbox.declare_consumer(c, "g", sequence_mode="gapless", first_sequence=5, late_policy=late_policy)
        c.commit()
    receive(url, "g", 3, 5, 6)
    w = run_worker(url, "g")
    try:
        done = 3 if late_policy == "process" else 2
        eventually(lambda: scalar(url, "SELECT count(*) FROM effects") == done, what="the key ran")
        eventually(lambda: scalar(url, "SELECT count(*) FROM postbox.inbox") == 0, what="nothing left")
    finally:
        w.stop()
        w.join()
    assert effects(url) == ("3,5,6" if late_policy == "process" else "5,6")
    assert scalar(url, "SELECT count(*) FROM postbox.key_gaps") == 0
    dead = scalar(url, "SELECT row(message_id, reason, status, last_error)::text FROM postbox.dead_letters")
    if late_policy == "process":
        assert dead is None
    else:
        status = "open" if late_policy == "dead_letter" else "discarded"
        assert dead == f'(m3,late,{status},"sequence 3 is below the first_sequence 5 of consumer g")'


def test_monotonic_runs_lowest_present_sequence_first_and_flags_late_ones(db):
    """monotonic: 5 then 3 arriving before processing run as 3, 5; a 4 arriving after 5 is late."""
    url = db.url
    with psycopg.connect(url) as c:
        postbox.declare_consumer(c, "mono", sequence_mode="monotonic", late_policy="skip")
        c.commit()
    receive(url, "mono", 5, 3, 9)
    assert (
        scalar(url, "SELECT string_agg(sequence || ':' || state, ',' ORDER BY sequence) FROM postbox.inbox")
        == "3:ready,5:pending,9:pending"
    )
    w = run_worker(url, "mono")
    try:
        eventually(lambda: scalar(url, "SELECT count(*) FROM effects") == 3)
        receive(url, "mono", 4, 10)
        eventually(lambda: scalar(url, "SELECT count(*) FROM effects") == 4)
    finally:
        w.stop()
        w.join()
    assert effects(url) == "3,5,9,10"
    assert (
        scalar(url, "SELECT row(message_id, reason, status)::text FROM postbox.dead_letters")
        == "(m4,late,discarded)"
    )


def test_monotonic_late_policy_process_runs_late_messages(db):
    """late_policy=process: a late message is processed anyway (after what was queued)."""
    url = db.url
    with psycopg.connect(url) as c:
        postbox.declare_consumer(c, "mono", sequence_mode="monotonic", late_policy="process")
        c.commit()
    w = run_worker(url, "mono")
    try:
        receive(url, "mono", 2)
        eventually(lambda: scalar(url, "SELECT count(*) FROM effects") == 1)
        receive(url, "mono", 1)
        eventually(lambda: scalar(url, "SELECT count(*) FROM effects") == 2)
    finally:
        w.stop()
        w.join()
    assert effects(url) == "2,1"
    assert scalar(url, "SELECT count(*) FROM postbox.dead_letters") == 0


def test_arrival_mode_ignores_sequence_for_order(db):
    """arrival: messages of a key run in the order they were received, whatever their sequence."""
    url = db.url
    receive(url, "arr", 3, 1, 2)
    w = run_worker(url, "arr")
    try:
        eventually(lambda: scalar(url, "SELECT count(*) FROM effects") == 3)
    finally:
        w.stop()
        w.join()
    assert effects(url) == "3,1,2"

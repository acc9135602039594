"""The batch receive's set-based fast path gives exactly what receiving one message at a time gives.

inbox_receive_batch_v1 takes the whole batch in a few statements when every element is valid, goes
to an arrival-ordered consumer and no id comes twice; otherwise it falls back to inbox_receive_v1
per element. Either way the statuses, ids' order and inbox states must match the per-message path.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

import service


def _fast(conn: psycopg.Connection[Any], messages: list[dict[str, Any]]) -> bool:
    row = conn.execute(
        "SELECT postbox.inbox_receive_set_ok_v1(%s::jsonb)", (psycopg.types.json.Jsonb(messages),)
    ).fetchone()
    assert row is not None
    return bool(row[0])


def _inbox(conn: psycopg.Connection[Any], consumer: str) -> list[tuple[Any, ...]]:
    """(message_id, key, state) in position order: what a worker would see."""
    return conn.execute(
        "SELECT message_id, key, state FROM postbox.inbox WHERE consumer = %s ORDER BY key, position",
        (consumer,),
    ).fetchall()


BATCH = [
    {"message_id": "a1", "key": "a", "payload": {"n": 1}},
    {"message_id": "b1", "key": "b", "payload": {"n": 2}},
    {"message_id": "a2", "key": "a", "payload": {"n": 3}},
    {"message_id": "old", "key": "c", "payload": {"n": 4}},  # received before: a duplicate
    {"message_id": "clash", "key": "d", "payload": {"n": 5}},  # received before with another payload
    {"message_id": "c2", "key": "c", "payload": {"n": 6}},  # key c already has a head
    {"message_id": "solo", "payload": [1, 2]},  # no key: its own
]


def test_set_path_matches_one_at_a_time(conn):
    """Statuses, per-key order and states (head ready, the rest pending) are those of receive()."""
    results = {}
    for consumer in ("one", "set"):
        service.receive(conn, consumer=consumer, message_id="old", key="c", payload={"n": 4})
        service.receive(conn, consumer=consumer, message_id="clash", key="d", payload={"other": True})
    batch = [{"consumer": "set", **m} for m in BATCH]
    assert _fast(conn, batch)
    results["set"] = [r.status.value for r in service.receive_many(conn, batch)]
    results["one"] = [service.receive(conn, consumer="one", **m).status.value for m in BATCH]
    conn.commit()
    assert results["set"] == results["one"] == ["new", "new", "new", "duplicate", "conflict", "new", "new"]
    assert _inbox(conn, "set") == _inbox(conn, "one")
    states = {m: s for m, _, s in _inbox(conn, "set")}
    assert states["a1"] == "ready" and states["a2"] == "pending" and states["c2"] == "pending"


def test_set_path_ids_follow_the_batch_order(conn):
    """Ids (the arrival position) are taken in the batch's order, so a key keeps its order."""
    batch = [{"consumer": "c", "message_id": f"m{i}", "key": "k", "payload": i} for i in range(20)]
    results = service.receive_many(conn, batch)
    ids = [r.inbox_id for r in results]
    assert ids == sorted(ids)
    assert [m for m, _, _ in _inbox(conn, "c")] == [f"m{i}" for i in range(20)]


def test_set_path_never_overtakes_queued_messages(conn):
    """A key whose queued messages wait for a repaired head gets the batch's message queued too."""
    service.receive(conn, consumer="c", message_id="m1", key="k", payload=1)
    service.receive(conn, consumer="c", message_id="m2", key="k", payload=2)
    conn.commit()
    conn.execute("DELETE FROM postbox.inbox WHERE message_id = 'm1'")  # the head left, m2 still queued
    service.receive_many(conn, [{"consumer": "c", "message_id": "m3", "key": "k", "payload": 3}])
    assert _inbox(conn, "c") == [("m2", "k", "pending"), ("m3", "k", "pending")]


@pytest.mark.parametrize(
    "change",
    [
        {"message_id": ""},
        {"sequence": -1},
        {"sequence": 1.5},
        {"sequence": "abc"},
        {"sequence": 10**20},
        {"schema_version": 0},
        {"headers": []},
        {"type": 7},
        {"key": "k" * 1025},
    ],
    ids=[
        "empty-id",
        "negative-sequence",
        "fraction",
        "string-sequence",
        "huge-sequence",
        "schema-version",
        "headers",
        "type",
        "long-key",
    ],
)
def test_anything_invalid_takes_the_checking_path(conn, change):
    """Bad input is never taken set-based: the per-element path names the element and field."""
    batch = [
        {"consumer": "c", "message_id": "ok", "payload": 1},
        {"consumer": "c", "message_id": "x", "payload": 1},
    ]
    batch[1].update(change)
    assert not _fast(conn, batch)


def test_the_same_id_twice_in_a_batch(conn):
    """Twice the same id in one batch goes element by element: the second is a duplicate."""
    batch = [{"consumer": "c", "message_id": "m", "payload": 1}] * 2
    assert not _fast(conn, batch)
    assert [r.status.value for r in service.receive_many(conn, batch)] == ["new", "duplicate"]


def test_sequenced_and_refused_consumers_take_the_checking_path(conn):
    """Consumers ordered by sequence, and undeclared ones once any is declared, are not set-based."""
    service.declare_consumer(conn, "seq", sequence_mode="gapless")
    assert not _fast(conn, [{"consumer": "seq", "message_id": "m", "sequence": 1, "payload": 1}])
    assert not _fast(conn, [{"consumer": "nobody", "message_id": "m", "payload": 1}])
    service.declare_consumer(conn, "plain")
    assert _fast(conn, [{"consumer": "plain", "message_id": "m", "payload": 1}])
    results = service.receive_many(
        conn, [{"consumer": "seq", "message_id": "m", "sequence": 1, "payload": 1}]
    )
    assert results[0].status.value == "new"


def test_json_batch_matches_the_array_batch(conn):
    """Callers in other languages send one JSON array: same statuses and rows as the array form."""
    for consumer in ("json", "arrays"):
        service.receive(conn, consumer=consumer, message_id="old", key="c", payload={"n": 4})
        service.receive(conn, consumer=consumer, message_id="clash", key="d", payload={"other": True})
    statuses = [
        r.status.value for r in service.receive_many(conn, [{"consumer": "arrays", **m} for m in BATCH])
    ]
    rows = conn.execute(
        "SELECT status FROM postbox.inbox_receive_batch_v1(%s::jsonb) ORDER BY ordinality",
        (psycopg.types.json.Jsonb([{"consumer": "json", **m} for m in BATCH]),),
    ).fetchall()
    assert [r[0] for r in rows] == statuses
    assert _inbox(conn, "json") == _inbox(conn, "arrays")


def test_array_batch_checks_what_python_did_not(conn):
    """The array form called from SQL checks every element too: a missing payload is refused."""
    with pytest.raises(psycopg.errors.InvalidParameterValue) as info:
        conn.execute(
            "SELECT * FROM postbox.inbox_receive_arrays_v1(ARRAY['c', 'c'], ARRAY['m1', 'm2'],"
            " ARRAY['{}'::jsonb, NULL], NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)"
        )
    assert info.value.diag.column_name == "payload"

"""The batch receive's set-based fast path gives exactly what receiving one message at a time gives.

Every batch form (a JSON array, columns, arrays) goes through one path, inbox_receive_many_v1: the
whole batch in a few statements when every element is valid and goes to an arrival-ordered
consumer; otherwise inbox_receive_v1 per element. Either way the statuses, ids' order and inbox states must match the per-message path.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

import postbox


def _fast(conn: psycopg.Connection[Any], messages: list[dict[str, Any]]) -> bool:
    """Whether the batch is received set-based: of the JSON types its fields take, and valid as a
    whole by the one batch check."""
    row = conn.execute(
        "SELECT coalesce(postbox.inbox_batch_ok_v1(c.consumers, c.message_ids, c.payloads, c.keys, c.types,"
        " c.sequences, c.headers, c.schema_versions, c.correlation_ids, c.causation_ids, c.sources), false)"
        " FROM postbox.inbox_batch_columns_v1(%s::jsonb) AS c",
        (psycopg.types.json.Jsonb(messages),),
    ).fetchone()
    assert row is not None
    return bool(row[0])


def _inbox(conn: psycopg.Connection[Any], consumer: str) -> list[tuple[Any, ...]]:
    """(message_id, key, state) in position order: what a worker would see."""
    return conn.execute(
        "SELECT message_id, key, state FROM postbox.inbox WHERE consumer = %s ORDER BY key, position",
        (consumer,),
    ).fetchall()


def _levels(n: int) -> Any:
    """A JSON value nested ``n`` levels deep (the value itself is level 1)."""
    value: Any = 1
    for _ in range(n - 1):
        value = [value]
    return value


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
        postbox.receive(conn, consumer=consumer, message_id="old", key="c", payload={"n": 4})
        postbox.receive(conn, consumer=consumer, message_id="clash", key="d", payload={"other": True})
    batch = [{"consumer": "set", **m} for m in BATCH]
    assert _fast(conn, batch)
    results["set"] = [r.status.value for r in postbox.receive_many(conn, batch)]
    results["one"] = [postbox.receive(conn, consumer="one", **m).status.value for m in BATCH]
    conn.commit()
    assert results["set"] == results["one"] == ["new", "new", "new", "duplicate", "conflict", "new", "new"]
    assert _inbox(conn, "set") == _inbox(conn, "one")
    states = {m: s for m, _, s in _inbox(conn, "set")}
    assert states["a1"] == "ready" and states["a2"] == "pending" and states["c2"] == "pending"


def test_set_path_ids_follow_the_batch_order(conn):
    """Ids (the arrival position) are taken in the batch's order, so a key keeps its order."""
    batch = [{"consumer": "c", "message_id": f"m{i}", "key": "k", "payload": i} for i in range(20)]
    results = postbox.receive_many(conn, batch)
    ids = [r.inbox_id for r in results]
    assert ids == sorted(ids)
    assert [m for m, _, _ in _inbox(conn, "c")] == [f"m{i}" for i in range(20)]


def test_set_path_never_overtakes_queued_messages(conn):
    """A key whose queued messages wait for a repaired head gets the batch's message queued too."""
    postbox.receive(conn, consumer="c", message_id="m1", key="k", payload=1)
    postbox.receive(conn, consumer="c", message_id="m2", key="k", payload=2)
    conn.commit()
    conn.execute("DELETE FROM postbox.inbox WHERE message_id = 'm1'")  # the head left, m2 still queued
    postbox.receive_many(conn, [{"consumer": "c", "message_id": "m3", "key": "k", "payload": 3}])
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
        {"headers": {"h": "x" * 65536}},
        {"payload": _levels(65)},
        {"sequence": 2**63},
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
        "headers-over-64KiB",
        "payload-65-levels",
        "sequence-2**63",
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
    """The same id again in one batch is set-based too, with the outcomes of one-at-a-time receives:
    the first is new, a repeat is a duplicate (same payload) or a conflict (another payload)."""
    batch = [
        {"consumer": "set", "message_id": "m", "key": "k", "payload": 1},
        {"consumer": "set", "message_id": "m", "key": "k", "payload": 1},
        {"consumer": "set", "message_id": "m", "key": "k", "payload": 2},
        {"consumer": "set", "message_id": "n", "key": "k", "payload": 3},
    ]
    assert _fast(conn, batch)
    results = postbox.receive_many(conn, batch)
    one = [postbox.receive(conn, **(m | {"consumer": "one"})) for m in batch]
    assert [r.status.value for r in results] == [r.status.value for r in one]
    assert [r.status.value for r in results] == ["new", "duplicate", "conflict", "new"]
    assert results[1].inbox_id == results[2].inbox_id == results[0].inbox_id
    assert _inbox(conn, "set") == _inbox(conn, "one") == [("m", "k", "ready"), ("n", "k", "pending")]


def test_sequenced_and_refused_consumers_take_the_checking_path(conn):
    """Consumers ordered by sequence, and undeclared ones once any is declared, are not set-based."""
    postbox.declare_consumer(conn, "seq", sequence_mode="gapless")
    assert not _fast(conn, [{"consumer": "seq", "message_id": "m", "sequence": 1, "payload": 1}])
    assert not _fast(conn, [{"consumer": "nobody", "message_id": "m", "payload": 1}])
    postbox.declare_consumer(conn, "plain")
    assert _fast(conn, [{"consumer": "plain", "message_id": "m", "payload": 1}])
    results = postbox.receive_many(
        conn, [{"consumer": "seq", "message_id": "m", "sequence": 1, "payload": 1}]
    )
    assert results[0].status.value == "new"


def test_json_batch_matches_the_array_batch(conn):
    """Callers in other languages send one JSON array: same statuses and rows as the array form."""
    for consumer in ("json", "arrays"):
        postbox.receive(conn, consumer=consumer, message_id="old", key="c", payload={"n": 4})
        postbox.receive(conn, consumer=consumer, message_id="clash", key="d", payload={"other": True})
    statuses = [
        r.status.value for r in postbox.receive_many(conn, [{"consumer": "arrays", **m} for m in BATCH])
    ]
    rows = conn.execute(
        "SELECT status FROM postbox.inbox_receive_batch_v1(%s::jsonb) ORDER BY ordinality",
        (psycopg.types.json.Jsonb([{"consumer": "json", **m} for m in BATCH]),),
    ).fetchall()
    assert [r[0] for r in rows] == statuses
    assert _inbox(conn, "json") == _inbox(conn, "arrays")


@pytest.mark.parametrize(
    ("function", "element", "refused"),
    [("inbox_receive_batch", {"consumer": "c", "message_id": "t", "payload": 1, "kye": "order-1"},
      "messages[2].kye is not a field (did you mean key?)"),
     ("inbox_receive_batch", {"consumer": "c", "message_id": "t", "payload": 1, "Key": "order-1"},
      "messages[2].Key is not a field (did you mean key?)"),
     ("outbox_publish_batch", {"destination": "d", "payload": 1, "keys": "order-1"},
      "messages[2].keys is not a field (did you mean key?)"),
     ("outbox_publish_batch", {"destination": "d", "payload": 1, "sequence": 3},
      "messages[2].sequence is not a field: the fields are destination,")],
)  # fmt: skip
def test_the_json_batch_functions_refuse_a_field_they_do_not_know(database, function, element, refused):
    """A misspelt field in an element of a JSON batch (SQL callers in any language) was dropped
    without a word: "kye" stored the message without its key, so without its order. Refused now,
    naming the element, the field and what it may stand for; nothing of the batch is written."""
    first = (
        {"consumer": "c", "message_id": "ok", "payload": 1}
        if "receive" in function
        else {"destination": "d", "payload": 1}
    )
    with database.connect() as c:
        with pytest.raises(psycopg.DataError) as info:
            c.execute(
                f"SELECT * FROM postbox.{function}(%s::jsonb)", (psycopg.types.json.Jsonb([first, element]),)
            )
        assert info.value.sqlstate == "22PB1" and refused in str(info.value)
        c.rollback()
        assert c.execute(
            "SELECT (SELECT count(*) FROM postbox.inbox) + (SELECT count(*) FROM postbox.outbox)"
        ).fetchone() == (0,)
        rows = c.execute(
            f"SELECT count(*) FROM postbox.{function}(%s::jsonb)", (psycopg.types.json.Jsonb([first]),)
        ).fetchone()
        assert rows == (1,)  # the known fields, as before


def test_array_batch_checks_what_python_did_not(conn):
    """The array form called from SQL checks every element too: a missing payload is refused."""
    with pytest.raises(psycopg.DataError) as info:
        conn.execute(
            "SELECT * FROM postbox.inbox_receive_arrays_v1(ARRAY['c', 'c'], ARRAY['m1', 'm2'],"
            " ARRAY['{}'::jsonb, NULL], NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)"
        )
    assert info.value.sqlstate == "22PB1"
    assert info.value.diag.column_name == "payload"


def test_array_batch_takes_a_null_headers_element_as_no_headers(conn):
    """In the array form a NULL headers element stands for {}, as an absent one does in JSON."""
    rows = conn.execute(
        "SELECT status FROM postbox.inbox_receive_arrays_v1(ARRAY['a', 'b'], ARRAY['m1', 'm2'],"
        " ARRAY['1'::jsonb, '2'], NULL, NULL, NULL, ARRAY[NULL, '{\"h\": 1}'::jsonb], NULL, NULL, NULL, NULL)"
        " ORDER BY ordinality"
    ).fetchall()
    assert rows == [("new",), ("new",)]
    headers = conn.execute("SELECT headers FROM postbox.inbox ORDER BY id").fetchall()
    assert headers == [({},), ({"h": 1},)]


def test_a_batch_mixing_consumers_is_one_statement(conn, database):
    """A batch for several consumers keeps the batch's order in its results and each consumer's
    order in its inbox, and is one statement: when a message is refused, nothing is written, even
    on an autocommit connection."""
    batch = [
        {"consumer": "a" if i % 3 else "b", "message_id": f"m{i}", "key": "k", "payload": i} for i in range(9)
    ]
    results = postbox.receive_many(conn, batch)
    assert [r.status.value for r in results] == ["new"] * 9
    for consumer in ("a", "b"):
        ids = [r.inbox_id for r, m in zip(results, batch, strict=True) if m["consumer"] == consumer]
        assert ids == sorted(ids)
        assert [m for m, _, _ in _inbox(conn, consumer)] == [
            m["message_id"] for m in batch if m["consumer"] == consumer
        ]
    assert postbox.receive_many(conn, []) == []
    conn.commit()
    with database.connect(autocommit=True) as auto:
        postbox.declare_consumer(auto, "a")
        postbox.declare_consumer(auto, "b")
        bad = [
            {"consumer": "a", "message_id": "x1", "payload": 1},
            {"consumer": "nobody", "message_id": "x2", "payload": 2},
        ]
        with pytest.raises(postbox.InvalidMessage) as info:
            postbox.receive_many(auto, bad)
        assert info.value.field.endswith("consumer")
        assert auto.execute(
            "SELECT count(*) FROM postbox.inbox_dedup WHERE message_id = 'x1'"
        ).fetchone() == (0,)


def test_columns_form_from_sql(conn):
    """Drivers may send one consumer and a column per field (payloads as one JSON array): same
    outcomes; absent columns are NULL; an empty batch returns nothing."""
    rows = conn.execute(
        "SELECT status FROM postbox.inbox_receive_columns_v1('c', ARRAY['m1', 'm2', 'm1'], "
        "'[{\"a\": 1}, 2, {\"a\": 1}]', keys => ARRAY['k', 'k', 'k'],"
        " headers => '[{}, {\"h\": 1}, {}]') ORDER BY ordinality"
    ).fetchall()
    assert [r[0] for r in rows] == ["new", "new", "duplicate"]
    assert _inbox(conn, "c") == [("m1", "k", "ready"), ("m2", "k", "pending")]
    row = conn.execute("SELECT headers FROM postbox.inbox WHERE message_id = 'm2'").fetchone()
    assert row is not None and row[0] == {"h": 1}
    assert conn.execute("SELECT * FROM postbox.inbox_receive_columns_v1('c', '{}', '[]')").fetchall() == []


@pytest.mark.parametrize(
    ("call", "field"),
    [
        ("postbox.inbox_receive_columns_v1('c', ARRAY['m1', 'm2'], '[1]')", "payloads"),
        ("postbox.inbox_receive_columns_v1('c', ARRAY['m1'], '{\"a\": 1}')", "payloads"),
        ("postbox.inbox_receive_columns_v1('c', ARRAY['m1'], '[1]', keys => ARRAY['k', 'l'])", "keys"),
        ("postbox.inbox_receive_columns_v1('c', ARRAY['m1'], '[1]', headers => '[]')", "headers"),
        ("postbox.inbox_receive_columns_v1(NULL, ARRAY['m1'], '[1]')", "consumer"),
        ("postbox.inbox_receive_columns_v1('c', NULL, '[]')", "message_ids"),
        ("postbox.inbox_receive_columns_v1('c', ARRAY['m1', NULL], '[1, 2]')", "message_id"),
        (
            "postbox.inbox_receive_arrays_v1(ARRAY['c', 'c'], ARRAY['m1', 'm2'], ARRAY['1'::jsonb, '2'],"
            " ARRAY['k'], NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
            "keys",
        ),
        (
            "postbox.inbox_receive_arrays_v1(ARRAY['c', NULL], ARRAY['m1', 'm2'], ARRAY['1'::jsonb, '2'],"
            " NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
            "consumer",
        ),
    ],
    ids=[
        "short-payloads",
        "payloads-object",
        "long-keys",
        "short-headers",
        "no-consumer",
        "no-ids",
        "null-id",
        "arrays-short-keys",
        "arrays-null-consumer",
    ],
)
def test_column_and_array_shapes_are_checked(conn, call, field):
    """Columns of the wrong length (which unnest would silently pad) and missing required values are
    refused with the field named, before anything is written."""
    with pytest.raises(psycopg.DataError) as info:
        conn.execute(f"SELECT * FROM {call}")
    assert info.value.sqlstate == "22PB1"
    assert info.value.diag.column_name == field
    conn.rollback()
    assert conn.execute("SELECT count(*) FROM postbox.inbox_dedup").fetchone() == (0,)


# --- plain inserts first (inbox_receive_rows_v1) ------------------------------------------------
# A batch of 16 or more first tries plain inserts in a subtransaction and falls back to ON CONFLICT
# on a unique violation. Rows a subtransaction wrote carry its xid, not the transaction's: that is
# how these tests see which path a batch took.


# A subtransaction's xid comes after its transaction's; rows of earlier transactions have lower ones.
_WRITER = {
    table: "SELECT CASE sign(xmin::text::bigint - mod(txid_current(), 4294967296)) "
    "WHEN 1 THEN 'sub' WHEN 0 THEN 'top' ELSE 'before' END "
    f"FROM postbox.{table} WHERE consumer = %s ORDER BY message_id"
    for table in ("inbox", "inbox_dedup")
}


def _writers(conn: psycopg.Connection[Any], table: str, consumer: str) -> list[str]:
    """For each row of ``consumer`` in ``table``, by message id, what wrote it: a subtransaction of
    this transaction ('sub'), the transaction itself ('top'), or an earlier one ('before')."""
    return [r[0] for r in conn.execute(_WRITER[table], (consumer,))]


def test_a_fresh_batch_without_keys_goes_in_with_plain_inserts(conn):
    """Nothing to conflict with: the ledger rows and the heads are written by the plain try, and
    the outcome is what one-at-a-time receives give."""
    batch = [{"consumer": "set", "message_id": f"m{i:02}", "payload": {"i": i}} for i in range(20)]
    results = postbox.receive_many(conn, batch)
    assert [r.status.value for r in results] == ["new"] * 20
    assert _writers(conn, "inbox_dedup", "set") == _writers(conn, "inbox", "set") == ["sub"] * 20
    one = [postbox.receive(conn, **(m | {"consumer": "one"})) for m in batch]
    assert [r.status for r in one] == [r.status for r in results]
    assert _inbox(conn, "set") == _inbox(conn, "one")
    assert {s for _, _, s in _inbox(conn, "set")} == {"ready"}


def test_a_batch_that_conflicts_falls_back_with_the_outcomes_of_one_at_a_time(conn):
    """An id seen before (same or other payload), the same id twice in the batch, and an id that
    another message uses as its key: the plain try is undone and the ON CONFLICT path gives exactly
    what receiving one at a time gives."""
    batch = [{"message_id": f"m{i:02}", "payload": {"i": i}} for i in range(20)]
    batch[3] = {"message_id": "old", "payload": {"n": 1}}  # a duplicate
    batch[5] = {"message_id": "clash", "payload": {"n": 2}}  # a conflict
    batch[7] = {"message_id": "m06", "payload": {"i": 6}}  # m06 again in this batch
    batch[9] = {"message_id": "k", "payload": {"n": 3}}  # key k has a head: queued behind it
    results = {}
    for consumer in ("set", "one"):
        postbox.receive(conn, consumer=consumer, message_id="old", payload={"n": 1})
        postbox.receive(conn, consumer=consumer, message_id="clash", payload={"other": True})
        postbox.receive(conn, consumer=consumer, message_id="head", key="k", payload={})
    conn.commit()
    results["set"] = [
        r.status.value for r in postbox.receive_many(conn, [m | {"consumer": "set"} for m in batch])
    ]
    results["one"] = [postbox.receive(conn, consumer="one", **m).status.value for m in batch]
    expected = ["new"] * 20
    expected[3], expected[5], expected[7] = "duplicate", "conflict", "duplicate"
    assert results["set"] == results["one"] == expected
    assert _inbox(conn, "set") == _inbox(conn, "one")
    assert ("k", "k", "pending") in _inbox(conn, "set")
    assert "sub" not in _writers(conn, "inbox", "set")  # the try left nothing behind
    assert conn.execute("SELECT count(*) FROM postbox.inbox_dedup WHERE consumer = 'set'").fetchone() == (20,)


def test_a_keyed_batch_writes_its_ledger_rows_plainly_and_its_heads_with_on_conflict(conn):
    """With keys, a head may already exist: only the ledger rows take the plain try; heads and
    queued messages are those of one-at-a-time receives."""
    postbox.receive(conn, consumer="set", message_id="first", key="k0", payload={})
    postbox.receive(conn, consumer="one", message_id="first", key="k0", payload={})
    conn.commit()
    batch = [{"message_id": f"m{i:02}", "key": f"k{i % 3}", "payload": {"i": i}} for i in range(20)]
    results = postbox.receive_many(conn, [m | {"consumer": "set"} for m in batch])
    one = [postbox.receive(conn, consumer="one", **m) for m in batch]
    assert [r.status for r in results] == [r.status for r in one]
    assert _inbox(conn, "set") == _inbox(conn, "one")
    assert _writers(conn, "inbox_dedup", "set") == ["before"] + ["sub"] * 20  # "first", then m00..m19
    assert set(_writers(conn, "inbox", "set")) == {"before", "top"}


def test_plain_tries_are_capped_per_transaction(conn):
    """At most 32 batches per transaction try plain inserts (each a subtransaction: PostgreSQL's
    cache holds 64); later ones take the ON CONFLICT path, and the next transaction starts over."""
    for b in range(40):
        batch = [{"consumer": "c", "message_id": f"b{b:02}-{i:02}", "payload": i} for i in range(16)]
        assert all(r.is_new for r in postbox.receive_many(conn, batch))
    assert conn.execute("SELECT current_setting('postbox.plain_batches')").fetchone() == ("32",)
    assert _writers(conn, "inbox", "c") == ["sub"] * 32 * 16 + ["top"] * 8 * 16
    conn.commit()
    assert conn.execute("SELECT current_setting('postbox.plain_batches', true)").fetchone() in {
        ("",),
        (None,),
    }
    postbox.receive_many(
        conn, [{"consumer": "c", "message_id": f"next-{i:02}", "payload": i} for i in range(16)]
    )
    assert conn.execute("SELECT current_setting('postbox.plain_batches')").fetchone() == ("1",)


def test_small_batches_take_no_subtransaction(conn):
    """Under 16 messages a subtransaction costs more than it saves: ON CONFLICT straight away."""
    postbox.receive_many(conn, [{"consumer": "c", "message_id": f"m{i:02}", "payload": i} for i in range(15)])
    assert _writers(conn, "inbox", "c") == ["top"] * 15
    assert conn.execute("SELECT current_setting('postbox.plain_batches', true)").fetchone() in {
        ("",),
        (None,),
    }


# Texts an array literal must quote or escape: quotes, backslashes, the literal's own punctuation,
# blanks, the word NULL, and non-ASCII.
AWKWARD = [
    '"',
    "\\",
    'a"b\\c',
    "{x}",
    "a,b",
    " lead",
    "trail ",
    "NULL",
    "null",
    "tab\there",
    "line\nbreak",
    "é✓",
]


def test_array_literals_give_the_server_the_lists_themselves(conn):
    """A batch's lists are bound as array literals on a psycopg connection: every text arrives as
    it was, NULLs included, and integers too."""
    from postbox.db.connector import int_array, text_array

    for values in (AWKWARD, [None, *AWKWARD, None], ["plain", "ids"], [None], []):
        assert conn.execute("SELECT CAST(%s AS text[])", (text_array(values),)).fetchone() == (values,)
    for numbers in ([1, 2, 3], [None, 0, 2**62, None], []):
        assert conn.execute("SELECT CAST(%s AS bigint[])", (int_array(numbers),)).fetchone() == (numbers,)


@pytest.mark.parametrize("mixed", [False, True], ids=["one-consumer", "mixed-consumers"])
def test_awkward_texts_are_stored_as_given_through_psycopg_and_sqlalchemy(database, mixed):
    """Ids, keys, types and references that need quoting in an array literal are stored exactly as
    given, by a psycopg connection (array literals) and a SQLAlchemy session (lists) alike."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from postbox.config.settings import sqlalchemy_url

    def batch(prefix: str) -> list[dict[str, Any]]:
        return [
            {
                "consumer": f"c{i % 2}" if mixed else "c",
                "message_id": f"{prefix}{text}",
                "key": text,
                "type": text,
                "source": text if i % 3 else None,
                "sequence": i if i % 2 else None,
                "payload": {"t": text},
                "headers": {"h": text},
            }
            for i, text in enumerate(AWKWARD)
        ]

    stored = "SELECT message_id, key, type, source, sequence, payload, headers FROM postbox.inbox WHERE message_id LIKE %s ORDER BY id"
    with database.connect() as c:
        results = postbox.receive_many(c, batch("p:"))
        c.commit()
        assert [r.status.value for r in results] == ["new"] * len(AWKWARD)
        by_psycopg = c.execute(stored, ("p:%",)).fetchall()
    engine = create_engine(sqlalchemy_url(database.url))
    try:
        with Session(engine) as session:
            assert all(r.is_new for r in postbox.receive_many(session, batch("s:")))
            session.commit()
    finally:
        engine.dispose()
    with database.connect() as c:
        by_sqlalchemy = c.execute(stored, ("s:%",)).fetchall()
    expected = [
        (
            f"p:{m['message_id'][2:]}",
            m["key"],
            m["type"],
            m["source"],
            m["sequence"],
            m["payload"],
            m["headers"],
        )
        for m in batch("p:")
    ]
    assert by_psycopg == expected
    assert [(f"p:{r[0][2:]}", *r[1:]) for r in by_sqlalchemy] == expected

"""The producer API and the SQL functions behind it: transactional, deduplicated, strict on input."""

from __future__ import annotations

import asyncio
import re
import threading
import unicodedata

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

import postbox
from postbox import InboxMessage, InvalidMessage, ReceiveStatus
from postbox.config.settings import sqlalchemy_url


def count(conn, table: str, where: str = "true") -> int:
    return conn.execute(f"SELECT count(*) FROM postbox.{table} WHERE {where}").fetchone()[0]


def test_receive_is_visible_only_after_commit_and_rollback_leaves_nothing(database):
    """A received message is invisible to others until commit; a rollback leaves no trace anywhere."""
    with database.connect() as producer, database.connect(autocommit=True) as observer:
        r = postbox.receive(producer, consumer="billing", message_id="m-1", payload={"n": 1})
        assert r.status is ReceiveStatus.NEW
        assert count(observer, "inbox") == 0
        producer.rollback()
        assert count(observer, "inbox") == 0 and count(observer, "inbox_dedup") == 0
        postbox.receive(producer, consumer="billing", message_id="m-1", payload={"n": 1})
        producer.commit()
        assert count(observer, "inbox") == 1 and count(observer, "inbox_dedup") == 1


def test_publish_rolls_back_with_the_callers_transaction(database):
    """An outbox row written in a transaction that rolls back never exists."""
    with database.connect() as producer, database.connect(autocommit=True) as observer:
        oid = postbox.publish(producer, destination="orders", payload={"x": 1}, key="o-1")
        assert oid > 0
        producer.rollback()
        assert count(observer, "outbox") == 0
        ids = postbox.publish_many(
            producer,
            [{"destination": "orders", "payload": {"i": i}, "key": "o-1"} for i in range(3)],
        )
        producer.commit()
        assert ids == sorted(ids) and len(ids) == 3
        rows = observer.execute("SELECT id, state FROM postbox.outbox ORDER BY id").fetchall()
        assert [s for _, s in rows] == ["ready", "pending", "pending"]


def test_duplicate_and_conflict_are_reported(conn):
    """Same id and payload is a duplicate; same id with another payload is a conflict; nothing new is stored."""
    first = postbox.receive(conn, consumer="c", message_id="m", payload={"a": 1, "b": [1, 2]})
    again = postbox.receive(conn, consumer="c", message_id="m", payload={"b": [1, 2], "a": 1})
    other = postbox.receive(conn, consumer="c", message_id="m", payload={"a": 2})
    elsewhere = postbox.receive(conn, consumer="d", message_id="m", payload={"a": 2})
    assert first.is_new and again.is_duplicate and other.is_conflict and elsewhere.is_new
    assert again.inbox_id == first.inbox_id == other.inbox_id
    assert count(conn, "inbox") == 2


def test_deduplication_outlives_processing(conn):
    """A redelivery after the message left the inbox (processed) is still a duplicate."""
    r = postbox.receive(conn, consumer="c", message_id="m", payload={})
    conn.execute("DELETE FROM postbox.inbox WHERE id = %s", (r.inbox_id,))
    assert postbox.receive(conn, consumer="c", message_id="m", payload={}).is_duplicate
    assert count(conn, "inbox") == 0


@pytest.mark.parametrize("first_outcome", ["commit", "rollback"])
def test_concurrent_receive_of_one_id_has_one_winner(database, first_outcome):
    """Two transactions receive the same id: the second waits for the first, then sees a duplicate
    (first committed) or stores the message itself (first rolled back)."""
    with database.connect() as a, database.connect() as b:
        assert postbox.receive(a, consumer="c", message_id="race", payload={"v": 1}).is_new
        result: dict[str, object] = {}

        def second() -> None:
            result["r"] = postbox.receive(b, consumer="c", message_id="race", payload={"v": 1})
            b.commit()

        t = threading.Thread(target=second)
        t.start()
        with database.connect(autocommit=True) as watcher:
            # b must be waiting on a's unique-index entry before a decides.
            for _ in range(500):
                waiting = watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                ).fetchone()[0]
                if waiting:
                    break
                threading.Event().wait(0.01)
            assert waiting == 1
        if first_outcome == "commit":
            a.commit()
        else:
            a.rollback()
        t.join(10)
        r = result["r"]
        assert isinstance(r, postbox.ReceiveResult)
        assert r.status is (ReceiveStatus.DUPLICATE if first_outcome == "commit" else ReceiveStatus.NEW)
        assert count(a, "inbox", "message_id = 'race'") == 1


def test_keys_order_messages_one_head_per_key(conn):
    """The first message of a key is its head (ready); later ones wait behind it (pending)."""
    for i in range(3):
        postbox.receive(conn, consumer="c", message_id=f"k1-{i}", key="k1", payload={"i": i})
    postbox.receive(conn, consumer="c", message_id="k2-0", key="k2", payload={})
    postbox.receive(conn, consumer="c", message_id="solo", payload={})
    conn.commit()
    rows = conn.execute("SELECT message_id, key, state FROM postbox.inbox ORDER BY id").fetchall()
    assert rows == [
        ("k1-0", "k1", "ready"),
        ("k1-1", "k1", "pending"),
        ("k1-2", "k1", "pending"),
        ("k2-0", "k2", "ready"),
        ("solo", "solo", "ready"),
    ]


def test_pending_message_gets_a_head_if_its_head_finished_before_commit(database):
    """The producer/worker race: a head that finishes while a producer's transaction is open must
    not leave the producer's message without a head: the commit files a repair, and the next claim
    makes the message its key's head."""
    with database.connect() as producer, database.connect() as worker:
        postbox.receive(worker, consumer="c", message_id="h", key="k", payload={})
        worker.commit()
        postbox.receive(producer, consumer="c", message_id="next", key="k", payload={})
        ((hid, att),) = worker.execute(
            "SELECT id, attempt FROM postbox.inbox_claim_v1('c', 'w', 10, '1 minute', now())"
        ).fetchall()
        worker.commit()
        worker.execute("SELECT postbox.inbox_complete_v1(%s, %s, now())", ([hid], [att]))
        worker.commit()  # nothing to promote: the producer's row is not committed yet
        producer.commit()
        assert producer.execute("SELECT state FROM postbox.inbox WHERE message_id = 'next'").fetchone() == (
            "pending",
        )
        assert producer.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (1,)
        producer.commit()
        claimed = worker.execute(
            "SELECT message_id FROM postbox.inbox_claim_v1('c', 'w', 10, '1 minute', now())"
        ).fetchall()
        worker.commit()
        assert claimed == [("next",)]
        assert worker.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)


def test_a_new_message_never_overtakes_messages_waiting_for_repair(database):
    """While a key's queued messages wait for their repair, a newly received message queues behind
    them instead of becoming the head."""
    with database.connect() as c:
        c.execute(
            "INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)"
            " VALUES ('c', 'old', 'k', 1, '{}', 'pending')"
        )
        c.commit()
        postbox.receive(c, consumer="c", message_id="new", key="k", payload={})
        c.commit()
        rows = c.execute("SELECT message_id, state FROM postbox.inbox ORDER BY position").fetchall()
        assert rows == [("old", "pending"), ("new", "pending")]
        claimed = c.execute(
            "SELECT message_id FROM postbox.inbox_claim_v1('c', 'w', 10, '1 minute', now())"
        ).fetchall()
        assert claimed == [("old",)]


# --- every connection kind -------------------------------------------------------------------


def test_a_connection_with_a_row_factory_or_in_a_pipeline_gets_its_results(database):
    """A psycopg connection made with ``row_factory=dict_row``, and one in pipeline mode: receive,
    receive_many, publish and publish_many return their results (dict_row raised a KeyError after the
    statement had run; in a pipeline, receive_many returned [] and receive raised, the rows written),
    sync and async; a refusal in a pipeline still names its field."""
    from psycopg.rows import dict_row

    def check(c, tag):
        assert postbox.receive(c, consumer="c", message_id=f"{tag}1", payload={}).is_new
        assert [r.status for r in postbox.receive_many(c, [
            {"consumer": "c", "message_id": f"{tag}1", "payload": {}},
            {"consumer": "c", "message_id": f"{tag}2", "payload": {}},
        ])] == [ReceiveStatus.DUPLICATE, ReceiveStatus.NEW]  # fmt: skip
        assert isinstance(postbox.publish(c, destination="d", payload={}), int)
        assert len(postbox.publish_many(c, [{"destination": "d", "payload": i} for i in range(3)])) == 3

    with psycopg.connect(database.url, row_factory=dict_row) as c:
        check(c, "dict")
        c.commit()
    with psycopg.connect(database.url) as c:
        with c.pipeline():
            check(c, "pipe")
        c.commit()
        with pytest.raises(InvalidMessage) as refused, c.pipeline():
            postbox.receive(c, consumer="c", message_id="bad", payload={}, sequence=-1)
        assert refused.value.field == "sequence"

    async def check_async(tag, **kw):
        async with await psycopg.AsyncConnection.connect(database.url, **kw) as c:
            if kw:
                assert (await postbox.receive_async(c, consumer="c", message_id=f"{tag}1", payload={})).is_new
            else:
                async with c.pipeline():
                    assert (
                        await postbox.receive_async(c, consumer="c", message_id=f"{tag}1", payload={})
                    ).is_new
                    results = await postbox.receive_many_async(
                        c, [{"consumer": "c", "message_id": f"{tag}2", "payload": {}}]
                    )
                    assert [r.status for r in results] == [ReceiveStatus.NEW]
            await c.commit()

    asyncio.run(check_async("adict", row_factory=dict_row))
    asyncio.run(check_async("apipe"))
    with database.connect() as c:
        assert count(c, "inbox") == 7 and count(c, "outbox") == 8


def test_sqlalchemy_session_and_connection(database):
    """receive/publish work on a SQLAlchemy Session and Connection, inside their transactions."""
    engine = create_engine(sqlalchemy_url(database.url))
    try:
        with Session(engine) as session:
            assert postbox.receive(session, consumer="c", message_id="s1", payload={"a": 1}).is_new
            postbox.publish(session, destination="d", payload={"a": 1})
            session.rollback()
            assert postbox.receive(session, consumer="c", message_id="s1", payload={"a": 1}).is_new
            results = postbox.receive_many(
                session,
                [
                    InboxMessage(consumer="c", message_id="s1", payload={"a": 1}),
                    {"consumer": "c", "message_id": "s2", "payload": 2},
                ],
            )
            assert [r.status for r in results] == [ReceiveStatus.DUPLICATE, ReceiveStatus.NEW]
            session.commit()
        with engine.begin() as connection:
            assert postbox.receive(connection, consumer="c", message_id="s3", payload=None).is_new
            assert connection.execute(text("SELECT count(*) FROM postbox.inbox")).scalar() == 3
    finally:
        engine.dispose()


def test_async_psycopg_and_sqlalchemy(database):
    """The async forms do the same on psycopg AsyncConnection and SQLAlchemy AsyncSession."""
    from sqlalchemy.ext.asyncio import AsyncSession

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(database.url) as aconn:
            r = await postbox.receive_async(aconn, consumer="c", message_id="a1", payload={"x": 1})
            assert r.is_new
            await postbox.publish_async(aconn, destination="d", payload={})
            await aconn.rollback()
            many = await postbox.receive_many_async(
                aconn, [{"consumer": "c", "message_id": f"a{i}", "payload": i} for i in range(3)]
            )
            assert all(m.is_new for m in many)
            assert len(await postbox.publish_many_async(aconn, [{"destination": "d", "payload": 1}])) == 1
            await aconn.commit()
        engine = create_async_engine(sqlalchemy_url(database.url))
        try:
            async with AsyncSession(engine) as session:
                r = await postbox.receive_async(session, consumer="c", message_id="a0", payload=0)
                assert r.is_duplicate
                await session.commit()
        finally:
            await engine.dispose()

    asyncio.run(scenario())
    with database.connect() as c:
        assert count(c, "inbox") == 3 and count(c, "outbox") == 1


def test_refusals_through_sqlalchemys_asyncpg_driver_name_their_field(database):
    """Through SQLAlchemy with asyncpg, what only the server refuses (an undeclared consumer, a
    sequence a sequenced consumer needs) raises InvalidMessage naming the field, as with psycopg
    (it raised SQLAlchemy's DBAPIError)."""
    from sqlalchemy.ext.asyncio import AsyncSession

    with database.connect() as c:
        postbox.declare_consumer(c, "ledger", sequence_mode="monotonic")
        c.commit()
    url = sqlalchemy_url(database.url).replace("postgresql+psycopg://", "postgresql+asyncpg://", 1)

    async def scenario() -> None:
        engine = create_async_engine(url)
        try:
            for fields, field in (({"consumer": "nobody"}, "consumer"), ({"consumer": "ledger"}, "sequence")):
                async with AsyncSession(engine) as session:
                    with pytest.raises(InvalidMessage) as refused:
                        await postbox.receive_async(session, message_id="m", payload={}, **fields)
                    assert refused.value.field == field
            async with AsyncSession(engine) as session:
                assert (
                    await postbox.receive_async(
                        session, consumer="ledger", message_id="m", payload={}, sequence=1
                    )
                ).is_new
                await session.commit()
        finally:
            await engine.dispose()

    asyncio.run(scenario())


def test_one_message_may_be_a_dict_and_a_wrong_argument_says_what_to_pass(database):
    """receive/publish take the message as a dict too, as the batches do (they raised AttributeError:
    'dict' object has no attribute 'batch_item'); a batch given one dict, None or a text says to pass
    a list (it said "messages[0] is a str", or raised a bare TypeError)."""
    with database.connect() as c:
        assert postbox.receive(c, {"consumer": "c", "message_id": "d1", "payload": {}, "key": "k"}).is_new
        assert postbox.receive(c, consumer="c", message_id="d1", payload={}, key="k").is_duplicate
        assert isinstance(postbox.publish(c, {"destination": "d", "payload": 1}), int)
        with pytest.raises(InvalidMessage) as refused:
            postbox.receive(c, {"consumer": "c", "message_id": "d2", "payload": {}, "kye": "k"})
        assert refused.value.field == "kye"
        for call, text in (
            (lambda: postbox.receive(c, "d3"), "pass an InboxMessage, a dict or the message's fields as keywords, not a str"),
            (lambda: postbox.receive(c, {"consumer": "c"}, message_id="x"), "either a message or its fields"),
            (lambda: postbox.receive_many(c, {"consumer": "c", "message_id": "x", "payload": 1}),
             "pass a list of messages (InboxMessages or dicts), not a dict: for one message, the function without _many"),
            (lambda: postbox.receive_many(c, None), "not a NoneType"),
            (lambda: postbox.publish_many(c, "abc"), "pass a list of messages (OutboxMessages or dicts), not a str"),
        ):  # fmt: skip
            with pytest.raises(TypeError, match=re.escape(text)):
                call()
        c.commit()
        assert count(c, "inbox") == 1 and count(c, "outbox") == 1


# --- bad input -------------------------------------------------------------------------------

BAD = [
    ({"sequence": 2**63}, "sequence"),
    ({"schema_version": 2**31}, "schema_version"),
    ({"payload": {"n": 10**5000}}, "payload"),
    ({"headers": {"n": -(10**4300)}}, "headers"),
    ({"message_id": ""}, "message_id"),
    ({"consumer": ""}, "consumer"),
    ({"key": ""}, "key"),
    ({"key": "k" * 1025}, "key"),
    ({"message_id": "é" * 257}, "message_id"),
    ({"key": "a\x00b"}, "key"),
    ({"payload": {"text": "a\x00b"}}, "payload"),
    ({"payload": {"n": float("nan")}}, "payload"),
    ({"payload": {1: "non-string key"}}, "payload"),
    ({"payload": {"when": object()}}, "payload"),
    ({"payload": "\ud800"}, "payload"),
    ({"sequence": -1}, "sequence"),
    ({"sequence": "3"}, "sequence"),
    ({"sequence": 1.5}, "sequence"),
    ({"schema_version": 0}, "schema_version"),
    ({"headers": ["not", "an", "object"]}, "headers"),
    ({"unexpected": 1}, "unexpected"),
]


@pytest.mark.parametrize(("change", "field"), BAD, ids=[f for _, f in BAD])
def test_python_api_rejects_bad_input_naming_the_field(conn, change, field):
    """Bad input raises InvalidMessage naming the field, and nothing is written."""
    fields = {"consumer": "c", "message_id": "m", "payload": {"ok": True}, **change}
    with pytest.raises(InvalidMessage) as info:
        postbox.receive(conn, **fields)
    assert info.value.field == field
    assert count(conn, "inbox") == 0 and count(conn, "inbox_dedup") == 0


def test_batch_errors_name_the_element(conn):
    """In a batch, the error names the element and field; nothing of the batch is written."""
    with pytest.raises(InvalidMessage) as info:
        postbox.receive_many(
            conn,
            [
                {"consumer": "c", "message_id": "ok", "payload": 1},
                {"consumer": "c", "message_id": "", "payload": 1},
            ],
        )
    assert info.value.field == "messages[1].message_id"
    assert count(conn, "inbox") == 0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"destination": ""}, "messages[1].destination"),
        ({"destination": None}, "messages[1].destination"),
        ({"key": "k" * 1025}, "messages[1].key"),
        ({"headers": []}, "messages[1].headers"),
        ({"payload": float("nan")}, "messages[1].payload"),
        ({"sequence": 1}, "messages[1].sequence"),  # an inbox field: not an outbox event's
    ],
    ids=["empty-destination", "no-destination", "long-key", "headers-list", "nan", "unknown-field"],
)
def test_outbox_batch_errors_name_the_element(conn, change, field):
    """publish_many checks each event as receive_many does, naming the element and field; nothing
    of the batch is written."""
    batch = [{"destination": "d", "payload": 1}, {"destination": "d", "payload": 1} | change]
    with pytest.raises(InvalidMessage) as info:
        postbox.publish_many(conn, batch)
    assert info.value.field == field
    assert count(conn, "outbox") == 0


def test_outbox_batch_of_dicts_writes_what_models_write(conn):
    """Plain dicts (checked without building a model) and OutboxMessage give the same rows."""
    fields = [
        {"destination": "d", "payload": {"n": 1}},
        {
            "destination": "d",
            "payload": [1],
            "key": "k",
            "type": "t",
            "message_id": "e-1",
            "headers": {"h": "1"},
        },
        {"destination": "é", "payload": "ü", "correlation_id": "c", "causation_id": None},
    ]
    columns = "destination, key IS NULL, type, payload, headers, correlation_id, causation_id"
    read = f"SELECT {columns} FROM postbox.outbox WHERE id = ANY(%s) ORDER BY id"
    plain = postbox.publish_many(conn, fields)
    models = postbox.publish_many(conn, [postbox.OutboxMessage(**f) for f in fields])
    assert conn.execute(read, (plain,)).fetchall() == conn.execute(read, (models,)).fetchall()


def test_a_batch_element_of_another_kind_is_refused(conn):
    """An outbox event in an inbox batch (or anything but the model or a dict) is a TypeError."""
    with pytest.raises(TypeError, match=r"messages\[0\] is a OutboxMessage"):
        postbox.receive_many(conn, [postbox.OutboxMessage(destination="d", payload=1)])


SQL_BAD = [
    ("consumer => '', message_id => 'm', payload => '{}'", "consumer"),
    ("consumer => 'c', message_id => NULL, payload => '{}'", "message_id"),
    ("consumer => 'c', message_id => 'm', payload => NULL", "payload"),
    ("consumer => 'c', message_id => 'm', payload => '{}', key => repeat('k', 1025)", "key"),
    ("consumer => 'c', message_id => 'm', payload => '{}', sequence => -5", "sequence"),
    ("consumer => 'c', message_id => 'm', payload => '{}', headers => '[]'", "headers"),
    ("consumer => 'c', message_id => 'm', payload => '{}', schema_version => 0", "schema_version"),
    ("consumer => 'c', message_id => 'm', payload => '{\"n\": 1e4300}'", "payload"),
    (
        "consumer => 'c', message_id => 'm', payload => '{}', headers => jsonb_build_object('h', repeat('x', 65536))",
        "headers",
    ),
]


@pytest.mark.parametrize(("args", "field"), SQL_BAD, ids=[f for _, f in SQL_BAD])
def test_sql_function_rejects_bad_input_naming_the_field(conn, args, field):
    """Called from plain SQL, bad input fails with SQLSTATE 22PB1 (a psycopg DataError) and the
    field in the message and in the COLUMN field."""
    with pytest.raises(psycopg.DataError) as info:
        conn.execute(f"SELECT * FROM postbox.inbox_receive({args})")
    assert info.value.sqlstate == "22PB1"
    assert info.value.diag.column_name == field
    assert field in info.value.diag.message_primary


def test_non_json_payload_is_refused_by_sql(conn):
    """A payload that is not JSON never reaches the table."""
    with pytest.raises(psycopg.errors.InvalidTextRepresentation):
        conn.execute("SELECT * FROM postbox.inbox_receive('c', 'm', 'not json')")
    conn.rollback()
    with pytest.raises(psycopg.errors.UntranslatableCharacter):
        conn.execute("""SELECT * FROM postbox.inbox_receive('c', 'm', '{"a": "\\u0000"}')""")
    conn.rollback()
    assert count(conn, "inbox") == 0


def test_payload_limit_is_configurable(conn):
    """Payloads over postbox.max_payload_bytes are refused with the field named; the limit is a setting."""
    conn.execute("SET postbox.max_payload_bytes = 100")
    postbox.receive(conn, consumer="c", message_id="fits", payload="x" * 90)
    with pytest.raises(InvalidMessage) as info:
        postbox.receive(conn, consumer="c", message_id="big", payload="x" * 200)
    assert info.value.field == "payload" and "over the limit of 100" in info.value.problem
    conn.rollback()
    with pytest.raises(InvalidMessage) as info:
        postbox.receive(conn, consumer="c", message_id="big", payload="x" * 1_100_000)
    assert info.value.field == "payload"  # the default limit is 1 MiB


def test_unknown_consumer_is_refused_once_consumers_are_declared(conn):
    """Undeclared consumers are accepted until the first declaration; then they are refused."""
    assert postbox.receive(conn, consumer="anything", message_id="1", payload={}).is_new
    postbox.declare_consumer(conn, "billing")
    with pytest.raises(InvalidMessage) as info:
        postbox.receive(conn, consumer="anything", message_id="2", payload={})
    assert info.value.field == "consumer" and "not a declared consumer" in info.value.problem
    conn.rollback()


@pytest.mark.parametrize(
    ("name", "options", "field"),
    [("bad\x00name", {}, "name"), ("", {}, "name"), (7, {}, "name"),
     ("g", {"gap_timeout_seconds": -1}, "gap_timeout_seconds"),
     ("g", {"gap_timeout_seconds": float("nan")}, "gap_timeout_seconds"),
     ("g", {"sequence_mode": "sorted"}, "sequence_mode")],
)  # fmt: skip
def test_declare_consumer_refuses_bad_input_naming_the_field(conn, name, options, field):
    """A name with NUL, empty or not a text, and a negative or NaN gap timeout: InvalidMessage naming
    the setting, before the round trip (a negative timeout was stored; NaN and NUL raised psycopg's
    errors)."""
    with pytest.raises(InvalidMessage) as info:
        postbox.declare_consumer(conn, name, **options)
    assert info.value.field == field
    assert count(conn, "consumers") == 0  # nothing sent: the transaction goes on


def test_sequenced_consumer_requires_sequence(conn):
    """A consumer in monotonic or gapless mode refuses a message without a sequence."""
    postbox.declare_consumer(conn, "ledger", sequence_mode="gapless")
    with pytest.raises(InvalidMessage) as info:
        postbox.receive(conn, consumer="ledger", message_id="1", payload={})
    assert info.value.field == "sequence"


def test_keys_are_compared_exactly_without_unicode_normalisation(conn):
    """NFC and NFD spellings of a key are two keys (documented rule: no normalisation)."""
    nfc = unicodedata.normalize("NFC", "café")
    nfd = unicodedata.normalize("NFD", "café")
    assert nfc != nfd
    postbox.receive(conn, consumer="c", message_id="1", key=nfc, payload={})
    postbox.receive(conn, consumer="c", message_id="2", key=nfd, payload={})
    postbox.receive(conn, consumer="c", message_id="3", key="'; DROP TABLE postbox.inbox; --", payload={})
    rows = conn.execute("SELECT key, state FROM postbox.inbox ORDER BY id").fetchall()
    assert rows == [(nfc, "ready"), (nfd, "ready"), ("'; DROP TABLE postbox.inbox; --", "ready")]


# --- SQL and Python give the same results ----------------------------------------------------


def test_sql_functions_match_the_python_api(database):
    """The same messages received through plain SQL and through Python give identical rows."""
    messages = [
        {
            "consumer": "c",
            "message_id": "1",
            "key": "k",
            "payload": {"a": [1, 2]},
            "type": "t",
            "headers": {"h": "v"},
            "correlation_id": "corr",
            "causation_id": "cause",
            "source": "topic",
        },
        {"consumer": "c", "message_id": "2", "key": "k", "payload": "text"},
        {"consumer": "c", "message_id": "1", "key": "k", "payload": {"a": [1, 2]}},
        {"consumer": "c", "message_id": "1", "key": "k", "payload": {"a": 3}},
    ]
    cols = (
        "consumer, message_id, key, position - (SELECT min(id) FROM postbox.inbox), type, payload,"
        " headers, correlation_id, causation_id, source, state, schema_version"
    )

    with database.connect() as py:
        py_results = [postbox.receive(py, **m) for m in messages]
        py_rows = py.execute(f"SELECT {cols} FROM postbox.inbox ORDER BY id").fetchall()
        py.rollback()

    with database.connect() as sql:
        sql_results = []
        for m in messages:
            row = sql.execute(
                "SELECT status, inbox_id FROM postbox.inbox_receive(consumer => %s, message_id => %s,"
                " payload => %s::jsonb, key => %s, type => %s, headers => %s::jsonb,"
                " correlation_id => %s, causation_id => %s, source => %s)",
                (
                    m["consumer"],
                    m["message_id"],
                    postbox.messages.to_json(m["payload"]),
                    m.get("key"),
                    m.get("type"),
                    postbox.messages.to_json(m.get("headers", {})),
                    m.get("correlation_id"),
                    m.get("causation_id"),
                    m.get("source"),
                ),
            ).fetchone()
            sql_results.append(row[0])
        sql_rows = sql.execute(f"SELECT {cols} FROM postbox.inbox ORDER BY id").fetchall()
        batch = sql.execute(
            "SELECT status FROM postbox.inbox_receive_batch(%s::jsonb) ORDER BY ordinality",
            (postbox.messages.to_json(messages),),
        ).fetchall()

    assert [r.status.value for r in py_results] == sql_results == ["new", "new", "duplicate", "conflict"]
    assert py_rows == sql_rows
    assert [b[0] for b in batch] == ["duplicate", "duplicate", "duplicate", "conflict"]


def test_outbox_sql_matches_python(conn):
    """outbox_publish from SQL and publish() from Python write the same row shape."""
    a = postbox.publish(
        conn,
        destination="d",
        payload={"x": 1},
        key="k",
        type="t",
        message_id="e-1",
        headers={"h": "1"},
        correlation_id="c",
        causation_id="m",
    )
    b = conn.execute(
        "SELECT postbox.outbox_publish(destination => 'd', payload => '{\"x\": 1}', key => 'k', type => 't',"
        " message_id => 'e-2', headers => '{\"h\": \"1\"}', correlation_id => 'c', causation_id => 'm')"
    ).fetchone()[0]
    rows = conn.execute(
        "SELECT destination, key, type, payload, headers, correlation_id, causation_id, state"
        " FROM postbox.outbox WHERE id IN (%s, %s) ORDER BY id",
        (a, b),
    ).fetchall()
    assert rows[0][:7] == rows[1][:7]
    assert [r[7] for r in rows] == ["ready", "pending"]
    generated = postbox.publish(conn, destination="d", payload=1)
    mid = conn.execute("SELECT message_id, key FROM postbox.outbox WHERE id = %s", (generated,)).fetchone()
    assert len(mid[0]) == 36 and mid[1] == mid[0]

"""Bad input, through the Python API and the SQL functions: each case ends in a defined state,
either refused at receive with an error naming the field (nothing written) or dead-lettered with
its reason at attempt 1. The README's "Bad input" table lists the same cases."""

from __future__ import annotations

import json
import subprocess
import unicodedata

import psycopg
import pytest

import postbox
from postbox import InvalidMessage
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from tests.helpers import EFFECTS_DDL, FAST_WORKER, eventually, scalar, spawn_postbox

LIMIT = 1000  # postbox.max_payload_bytes for the limit tests


def stored(conn: psycopg.Connection) -> int:
    """Messages stored, as this connection sees them (after rolling back a failed transaction)."""
    if conn.info.transaction_status is psycopg.pq.TransactionStatus.INERROR:
        conn.rollback()
    return conn.execute("SELECT count(*) FROM postbox.inbox_dedup").fetchone()[0]


def refused(conn: psycopg.Connection, field: str, **fields: object) -> InvalidMessage:
    """Receive through the Python API, expect InvalidMessage naming ``field`` and nothing written."""
    with pytest.raises(InvalidMessage) as info:
        postbox.receive(conn, **{"consumer": "c", "message_id": "m", "payload": {}, **fields})
    assert info.value.field == field, info.value
    assert stored(conn) == 0
    return info.value


def sql_refused(conn: psycopg.Connection, sql: str, params: tuple[object, ...] = ()) -> psycopg.Error:
    """Run a SQL call expected to fail; roll back; check nothing was written."""
    with pytest.raises(psycopg.Error) as info:
        conn.execute(sql, params)
    conn.rollback()
    assert stored(conn) == 0
    return info.value


# --- malformed, truncated and invalid JSON ------------------------------------------------------


@pytest.mark.parametrize("text", ['{"amount": 42', '{"amount": }', "{'amount': 42}", "", "NaN", '{"a": 1} x'])
def test_malformed_or_truncated_json_is_refused_by_sql(conn, text):
    """The SQL functions take jsonb: malformed or truncated JSON text never reaches a table
    (SQLSTATE 22P02 from PostgreSQL's JSON parser), one message or a batch."""
    error = sql_refused(conn, "SELECT * FROM postbox.inbox_receive('c', 'm', %s::text::jsonb)", (text,))
    assert isinstance(error, psycopg.errors.InvalidTextRepresentation)
    assert "json" in str(error)
    batch = json.dumps([{"consumer": "c", "message_id": "m", "payload": 1}])[:-3]
    error = sql_refused(conn, "SELECT * FROM postbox.inbox_receive_batch(%s::text::jsonb)", (batch,))
    assert isinstance(error, psycopg.errors.InvalidTextRepresentation)


@pytest.mark.parametrize(
    "payload", [b'{"amount": 42', bytearray(b"{}"), {"when": object()}, {"n": float("inf")}, {1: "x"}]
)
def test_python_payloads_that_are_not_json_are_refused(conn, payload):
    """The Python API takes JSON values: bytes (truncated JSON or not), other objects, infinities
    and non-string object keys are refused naming ``payload``. (A ``str`` payload is a JSON string,
    stored as such: Postbox never parses a producer's text as JSON behind its back.)"""
    refused(conn, "payload", payload=payload)
    assert postbox.receive(conn, consumer="c", message_id="s", payload='{"amount": 42').is_new
    assert conn.execute("SELECT payload FROM postbox.inbox").fetchone()[0] == '{"amount": 42'


def test_invalid_utf8_is_refused_by_the_server(conn):
    """Bytes that are not UTF-8, sent by a client of any language as a key or inside a JSON payload,
    are refused by PostgreSQL (SQLSTATE 22021) before the function runs; from Python a lone
    surrogate (the only way a str can hold invalid UTF-8) is refused naming the field."""
    pgconn = conn.pgconn
    for sql, params in (
        (b"SELECT * FROM postbox.inbox_receive('c', 'm', $1::jsonb)", [b'{"a": "\xff\xfe"}']),
        (b"SELECT * FROM postbox.inbox_receive('c', 'm', '{}', key => $1)", [b"key-\xc3\x28"]),
    ):
        result = pgconn.exec_params(sql, params)
        assert result.error_field(psycopg.pq.DiagnosticField.SQLSTATE) == b"22021"
        conn.rollback()
    assert stored(conn) == 0
    refused(conn, "payload", payload={"text": "\udcff"})
    refused(conn, "key", key="k\ud800")


def test_nul_is_refused_everywhere(conn):
    """NUL (``\\u0000``) cannot be stored in jsonb text: refused in a payload, a header, a key or an
    id, from Python (naming the field) and from SQL (22P05 for JSON; a text parameter cannot even
    carry it, the driver refuses it)."""
    refused(conn, "payload", payload={"a": "x\x00y"})
    refused(conn, "payload", payload={"a\x00": 1})
    refused(conn, "headers", headers={"h": "\x00"})
    refused(conn, "key", key="k\x00")
    refused(conn, "message_id", message_id="m\x00")
    error = sql_refused(conn, """SELECT * FROM postbox.inbox_receive('c', 'm', '{"a": "\\u0000"}')""")
    assert isinstance(error, psycopg.errors.UntranslatableCharacter)
    with pytest.raises(psycopg.DataError):
        conn.execute("SELECT * FROM postbox.inbox_receive('c', %s, '{}')", ("m\x00",))
    conn.rollback()
    assert stored(conn) == 0


# --- size limits --------------------------------------------------------------------------------


def _payload_of(size: int) -> str:
    """A JSON string payload whose JSON text is exactly ``size`` bytes."""
    return "x" * (size - 2)


def test_payload_just_under_at_and_over_the_limit(conn):
    """With postbox.max_payload_bytes = 1000: 999 and 1000 bytes of JSON text are accepted, 1001
    refused naming ``payload`` and the limit, through Python and SQL alike."""
    conn.execute(f"SET postbox.max_payload_bytes = {LIMIT}")
    conn.commit()  # a session setting that a later rollback does not undo
    for size in (LIMIT - 1, LIMIT):
        assert postbox.receive(conn, consumer="c", message_id=f"py-{size}", payload=_payload_of(size)).is_new
        row = conn.execute(
            "SELECT status FROM postbox.inbox_receive('c', %s, %s::jsonb)",
            (f"sql-{size}", json.dumps(_payload_of(size))),
        ).fetchone()
        assert row == ("new",)
    conn.commit()
    error = refused_after(
        conn, lambda: postbox.receive(conn, consumer="c", message_id="big", payload=_payload_of(LIMIT + 1))
    )
    assert isinstance(error, InvalidMessage) and error.field == "payload"
    assert f"over the limit of {LIMIT}" in error.problem
    with pytest.raises(psycopg.DataError) as info:
        conn.execute(
            "SELECT * FROM postbox.inbox_receive('c', 'big', %s::jsonb)",
            (json.dumps(_payload_of(LIMIT + 1)),),
        )
    assert info.value.sqlstate == "22PB1" and info.value.diag.column_name == "payload"
    conn.rollback()
    assert stored(conn) == 4


def refused_after(conn: psycopg.Connection, call) -> BaseException:  # type: ignore[no-untyped-def]
    before = stored(conn)
    with pytest.raises(InvalidMessage) as info:
        call()
    assert stored(conn) == before
    return info.value


def test_ten_mib_payload_is_refused_by_default(conn):
    """A 10 MiB payload is over the default limit (1 MiB): refused at receive, Python and SQL."""
    big = {"blob": "y" * (10 * 1024 * 1024)}
    error = refused(conn, "payload", payload=big)
    assert "over the limit of 1048576" in error.problem
    with pytest.raises(psycopg.DataError) as info:
        conn.execute("SELECT * FROM postbox.inbox_receive('c', 'm', %s::jsonb)", (json.dumps(big),))
    assert info.value.sqlstate == "22PB1" and info.value.diag.column_name == "payload"
    conn.rollback()
    assert stored(conn) == 0


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_worker_memory_stays_bounded_with_ten_mib_payloads(database):
    """Where an operator raises the limit, three 10 MiB messages are processed by a real worker
    process (one batch) whose peak memory stays bounded (under 400 MB; the payloads are 30 MiB)."""
    with database.connect(autocommit=True) as c:
        c.execute(EFFECTS_DDL)
    with database.connect() as c:
        c.execute("SET postbox.max_payload_bytes = 20000000")
        for i in range(3):
            postbox.receive(
                c,
                consumer="basic",
                message_id=f"big-{i}",
                key="k",
                sequence=i,
                payload={"blob": str(i) * 10485760},
            )
        c.commit()
    worker = spawn_postbox(
        "--database-url", database.url, "worker", "--consumer", "basic", "--app", "tests.apps.basic:registry",
        "--poll-interval", "0.05", stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM effects") == 3, timeout=60)
        peak = _peak_rss_mb(worker.pid)
    finally:
        worker.terminate()
        worker.wait(30)
    assert peak < 400, f"worker peak RSS {peak:.0f} MB"
    assert scalar(database.url, "SELECT count(*) FROM postbox.inbox") == 0


# --- headers, numbers, nesting; the caller's transaction ---------------------------------------

HEADERS_LIMIT = 1000  # postbox.max_headers_bytes for the SQL limit tests


def _deep(levels: int) -> list[object]:
    """A list nested ``levels`` deep: [[...[1]...]] (the number is at level ``levels`` + 1)."""
    value: list[object] = [1]
    for _ in range(levels - 1):
        value = [value]
    return value


def _nested(levels: int) -> object:
    """A JSON value of exactly ``levels`` levels (the value itself is level 1), built iteratively."""
    return _deep(levels - 1) if levels > 1 else 1


def kept_transaction(conn: psycopg.Connection, field: str, call) -> InvalidMessage:  # type: ignore[no-untyped-def]
    """``call`` is refused with InvalidMessage naming ``field`` before the round trip: the caller's
    transaction, with a message received earlier in it, stays usable and commits."""
    assert postbox.receive(conn, consumer="c", message_id="earlier", payload={}).is_new
    with pytest.raises(InvalidMessage) as info:
        call()
    assert info.value.field == field, info.value
    assert conn.info.transaction_status is psycopg.pq.TransactionStatus.INTRANS
    conn.commit()
    assert conn.execute("SELECT message_id FROM postbox.inbox_dedup").fetchall() == [("earlier",)]
    assert conn.execute("SELECT count(*) FROM postbox.outbox").fetchone() == (0,)
    return info.value


def _receive(conn, **change):  # type: ignore[no-untyped-def]
    return lambda: postbox.receive(conn, **{"consumer": "c", "message_id": "m", "payload": {}, **change})


def _receive_many(conn, consumers=("c", "c"), **change):  # type: ignore[no-untyped-def]
    return lambda: postbox.receive_many(
        conn,
        [{"consumer": consumers[0], "message_id": "ok", "payload": {}},
         {"consumer": consumers[1], "message_id": "m", "payload": {}, **change}],
    )  # fmt: skip


def _publish(conn, **change):  # type: ignore[no-untyped-def]
    return lambda: postbox.publish(conn, **{"destination": "d", "payload": {}, **change})


def _publish_many(conn, **change):  # type: ignore[no-untyped-def]
    return lambda: postbox.publish_many(
        conn, [{"destination": "d", "payload": {}}, {"destination": "d", "payload": {}, **change}]
    )


ENTRY_POINTS = {
    "receive": (_receive, ""),
    "receive_many-one-consumer": (_receive_many, "messages[1]."),
    "receive_many-mixed-consumers": (
        lambda conn, **ch: _receive_many(conn, ("c", "c2"), **ch),
        "messages[1].",
    ),
    "publish": (_publish, ""),
    "publish_many": (_publish_many, "messages[1]."),
}
FINDINGS = {
    # headers had no limit: 50 MiB of them went in (and into a worker's memory)
    "headers-50MiB": ({"headers": {"h": "x" * 50 * 2**20}}, "headers", "over the limit of 65536"),
    "payload-over-1MiB": ({"payload": "x" * 2**20}, "payload", "over the limit of 1048576"),
    "payload-10**5000": ({"payload": {"n": 10**5000}}, "payload", "more than 4300 digits"),
    "headers-huge-integer": ({"headers": {"n": -(10**4300)}}, "headers", "more than 4300 digits"),
    "payload-100000-deep": ({"payload": _deep(100_000)}, "payload", "deeper than 64 levels"),
    "headers-65-levels": ({"headers": {"h": _nested(64)}}, "headers", "deeper than 64 levels"),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("finding", FINDINGS)
def test_oversize_deep_and_unreadable_values_are_refused_before_the_round_trip(conn, entry, finding):
    """Headers over their limit (64 KiB by default), a payload over its own, an integer of more
    than 4300 digits, nesting deeper than 64 levels: refused by every Python entry point with
    InvalidMessage naming the field (and the element in a batch), before anything is sent, so
    the caller's transaction goes on. (Before: headers had no limit, 10**5000 raised a bare
    ValueError, deep nesting a RecursionError, and an oversize payload aborted the transaction.)"""
    make, prefix = ENTRY_POINTS[entry]
    change, field, problem = FINDINGS[finding]
    error = kept_transaction(conn, prefix + field, make(conn, **change))
    assert problem in error.problem


@pytest.mark.parametrize(
    ("change", "field", "problem"),
    [
        ({"sequence": 2**63}, "sequence", "9223372036854775807"),
        ({"schema_version": 2**31}, "schema_version", "2147483647"),
    ],
    ids=["sequence-2**63", "schema_version-2**31"],
)
@pytest.mark.parametrize("entry", ["receive", "receive_many-one-consumer", "receive_many-mixed-consumers"])
def test_integers_out_of_their_column_range_are_refused_before_the_round_trip(
    conn, entry, change, field, problem
):
    """``sequence`` must fit a bigint and ``schema_version`` an integer: refused naming the field,
    the caller's transaction untouched. (Before: the server's NumericValueOutOfRange aborted it.)"""
    make, prefix = ENTRY_POINTS[entry]
    error = kept_transaction(conn, prefix + field, make(conn, **change))
    assert problem in error.problem


def test_the_deepest_accepted_value_and_the_largest_integer_are_stored(conn):
    """64 levels and integers of 4300 digits are accepted, through Python and SQL, and read back."""
    big = int("9" * 4300)
    payload = {"deep": _nested(63), "big": big, "small": -big}
    assert postbox.receive(conn, consumer="c", message_id="py", payload=payload).is_new
    conn.execute("SELECT * FROM postbox.inbox_receive('c', 'sql', %s::jsonb)", (json.dumps(payload),))
    rows = conn.execute("SELECT payload FROM postbox.inbox ORDER BY id").fetchall()
    assert rows == [(payload,), (payload,)]


def _sql_calls() -> dict[str, str]:
    """Each SQL function that writes a message, with the payload as %(p)s and the headers as %(h)s."""
    message = "jsonb_build_object('consumer', 'c', 'message_id', 'm', 'payload', %(p)s::jsonb, 'headers', %(h)s::jsonb)"
    return {
        "inbox_receive_v1": "SELECT status FROM postbox.inbox_receive_v1('c', 'm', %(p)s::jsonb, headers => %(h)s::jsonb)",
        "inbox_receive_batch_v1": f"SELECT status FROM postbox.inbox_receive_batch_v1(jsonb_build_array({message}))",
        "inbox_receive_arrays_v1": "SELECT status FROM postbox.inbox_receive_arrays_v1(ARRAY['c'], ARRAY['m'],"
        " ARRAY[%(p)s::jsonb], NULL, NULL, NULL, ARRAY[%(h)s::jsonb], NULL, NULL, NULL, NULL)",
        "inbox_receive_columns_v1": "SELECT status FROM postbox.inbox_receive_columns_v1('c', ARRAY['m'],"
        " jsonb_build_array(%(p)s::jsonb), headers => jsonb_build_array(%(h)s::jsonb))",
        "outbox_publish_v1": "SELECT 'new' FROM postbox.outbox_publish_v1('d', %(p)s::jsonb, headers => %(h)s::jsonb)",
        "outbox_publish_batch_v1": "SELECT 'new' FROM postbox.outbox_publish_batch_v1(jsonb_build_array("
        "jsonb_build_object('destination', 'd', 'payload', %(p)s::jsonb, 'headers', %(h)s::jsonb)))",
    }


SQL_CALLS = _sql_calls()
# (payload, headers) JSON texts, the field refused (None: accepted), and what the message says.
SQL_CASES = {
    "headers-at-the-limit": ("{}", json.dumps({"h": "x" * (HEADERS_LIMIT - 9)}), None, ""),
    "headers-1-byte-over-the-limit": (
        "{}",
        json.dumps({"h": "x" * (HEADERS_LIMIT - 8)}),
        "headers",
        "over the limit of 1000",
    ),
    "payload-64-levels": (json.dumps(_nested(64)), "{}", None, ""),
    "payload-65-levels": (json.dumps(_nested(65)), "{}", "payload", "deeper than 64 levels"),
    "headers-65-levels": ("{}", json.dumps({"h": _nested(64)}), "headers", "deeper than 64 levels"),
    "payload-4300-digits": ('{"n": ' + "9" * 4300 + "}", "{}", None, ""),
    "payload-1e4300": ('{"n": 1e4300}', "{}", "payload", "more than 4300 digits"),
    "headers-minus-1e5000": ("{}", '{"n": -1e5000}', "headers", "more than 4300 digits"),
}


@pytest.mark.parametrize("case", SQL_CASES)
@pytest.mark.parametrize("call", SQL_CALLS)
def test_sql_functions_refuse_what_python_refuses_with_22PB1_naming_the_field(conn, call, case):
    """Every SQL function that writes a message applies the same limits (the size cases with
    postbox.max_headers_bytes = 1000): refused with SQLSTATE 22PB1, the field in the message and
    in the COLUMN field; within the limit, accepted. A refusal inside a savepoint leaves the rest of
    the caller's transaction usable."""
    payload, headers, field, problem = SQL_CASES[case]
    assert postbox.receive(conn, consumer="c", message_id="earlier", payload={}).is_new
    if "limit" in case:
        conn.execute(f"SET postbox.max_headers_bytes = {HEADERS_LIMIT}")
    if field is None:
        assert conn.execute(SQL_CALLS[call], {"p": payload, "h": headers}).fetchone() == ("new",)
        return
    with pytest.raises(psycopg.DataError) as info, conn.transaction():
        conn.execute(SQL_CALLS[call], {"p": payload, "h": headers})
    assert info.value.sqlstate == "22PB1"
    assert info.value.diag.column_name == field
    assert (
        f"postbox: {field} " in info.value.diag.message_primary and problem in info.value.diag.message_primary
    )
    assert conn.info.transaction_status is psycopg.pq.TransactionStatus.INTRANS
    assert stored(conn) == 1 and conn.execute("SELECT count(*) FROM postbox.outbox").fetchone() == (0,)


@pytest.mark.parametrize(
    ("element", "field"),
    [
        ('"sequence": 9223372036854775808', "messages[1].sequence"),
        ('"sequence": -99999999999999999999', "messages[1].sequence"),
        ('"schema_version": 2147483648', "messages[1].schema_version"),
    ],
    ids=["sequence-2**63", "sequence-very-negative", "schema_version-2**31"],
)
def test_json_batch_refuses_integers_out_of_range_by_name(conn, element, field):
    """The JSON batch form carries integers of any size: one that does not fit its column is
    refused with 22PB1 naming the element and field, not PostgreSQL's out-of-range error."""
    batch = '[{"consumer": "c", "message_id": "m", "payload": {}, ' + element + "}]"
    with pytest.raises(psycopg.DataError) as info:
        conn.execute("SELECT * FROM postbox.inbox_receive_batch_v1(%s::jsonb)", (batch,))
    assert info.value.sqlstate == "22PB1" and info.value.diag.column_name == field
    conn.rollback()
    assert stored(conn) == 0


def test_the_dead_letter_payload_edit_applies_the_payload_checks(conn):
    """An operator's payload edit is held to the producer's checks: nesting and numbers too."""
    for payload in (json.dumps(_nested(65)), '{"n": 1e4300}'):
        with pytest.raises(psycopg.DataError) as info:
            conn.execute("SELECT postbox.dlq_edit_v1(1, %s::jsonb, 'fix')", (payload,))
        assert info.value.sqlstate == "22PB1" and info.value.diag.column_name == "payload"
        conn.rollback()


# --- keys ---------------------------------------------------------------------------------------

HOSTILE_KEYS = [
    "'; DROP TABLE postbox.inbox; --",
    'k"; SELECT pg_sleep(10); --',
    "$$; DROP SCHEMA postbox CASCADE; $$",
    "a\\'b\\\\",
    "%s %(key)s {key} :key $1",
    "café",  # NFC
    unicodedata.normalize("NFD", "café"),
    "\uff21\uff22\uff23",  # full-width ABC
    "a\u200db",  # zero-width joiner
    "\u202eevil",  # right-to-left override
    "🔑 key",
    " padded ",
]


def test_injection_style_and_unicode_variant_keys_are_stored_verbatim(conn):
    """Hostile and Unicode-variant keys are data: stored byte for byte, never normalised (NFC and
    NFD are two keys), each its own key with its own head; Python and SQL alike."""
    for i, key in enumerate(HOSTILE_KEYS):
        postbox.receive(conn, consumer="c", message_id=f"py-{i}", key=key, payload={"k": key})
        conn.execute(
            "SELECT * FROM postbox.inbox_receive('d', %s, %s::jsonb, key => %s)",
            (f"sql-{i}", json.dumps({"k": key}), key),
        )
    conn.commit()
    for consumer in ("c", "d"):
        rows = conn.execute(
            "SELECT key, payload ->> 'k', state FROM postbox.inbox WHERE consumer = %s ORDER BY id",
            (consumer,),
        ).fetchall()
        assert [r[0] for r in rows] == HOSTILE_KEYS
        assert all(r[0] == r[1] and r[2] == "ready" for r in rows)
    assert conn.execute("SELECT count(*) FROM postbox.inbox").fetchone()[0] == 2 * len(HOSTILE_KEYS)


def test_over_long_keys_are_refused_before_any_index_sees_them(conn):
    """A key of 1024 bytes (UTF-8) is accepted; 1025 bytes, or 300 four-byte characters (1200
    bytes), are refused naming ``key`` with the size; never a btree "index row size" error."""
    assert postbox.receive(conn, consumer="c", message_id="ok", key="k" * 1024, payload={}).is_new
    error = refused_after(
        conn, lambda: postbox.receive(conn, consumer="c", message_id="m", key="k" * 1025, payload={})
    )
    assert "1025 bytes, over the limit of 1024" in str(error)
    refused_after(
        conn, lambda: postbox.receive(conn, consumer="c", message_id="m", key="🔑" * 300, payload={})
    )
    for key in ("k" * 1025, "🔑" * 300, "k" * 100_000):
        with pytest.raises(psycopg.DataError) as info:
            conn.execute("SELECT * FROM postbox.inbox_receive('c', 'm2', '{}', key => %s)", (key,))
        assert info.value.sqlstate == "22PB1" and info.value.diag.column_name == "key"
        conn.rollback()
    assert stored(conn) == 0  # the accepted one was rolled back with the refused ones


def test_same_message_id_with_a_different_payload_is_a_conflict(conn):
    """Same id, same payload: duplicate. Same id, different payload: conflict, nothing written,
    reported through Python, the SQL function and a batch."""
    assert postbox.receive(conn, consumer="c", message_id="m", payload={"amount": 42}).is_new
    assert postbox.receive(conn, consumer="c", message_id="m", payload={"amount": 42}).is_duplicate
    assert postbox.receive(conn, consumer="c", message_id="m", payload={"amount": 43}).is_conflict
    row = conn.execute("SELECT status FROM postbox.inbox_receive('c', 'm', '{\"amount\": 44}')").fetchone()
    assert row == ("conflict",)
    batch = postbox.receive_many(
        conn,
        [{"consumer": "c", "message_id": "m", "payload": {"amount": 45}},
         {"consumer": "c", "message_id": "n", "payload": {}}],
    )  # fmt: skip
    assert [r.status.value for r in batch] == ["conflict", "new"]
    assert conn.execute("SELECT payload FROM postbox.inbox WHERE message_id = 'm'").fetchone()[0] == {
        "amount": 42
    }
    assert stored(conn) == 2


# --- accepted at receive, dead-lettered at attempt 1 --------------------------------------------


def _run_worker(url: str, registry: Registry, consumer: str) -> Worker:
    w = Worker(url, registry, WorkerSettings(consumer=consumer, **FAST_WORKER))
    w.start()
    return w


@pytest.mark.parametrize(
    ("change", "reason_text"),
    [
        ({"schema_version": 7}, "unsupported schema_version 7"),
        ({"payload": {"no_amount": True}}, "amount"),
        ({"payload": {"amount": "forty-two"}}, "forty-two"),
        ({"type": "order.unknown"}, "no handler"),
    ],
    ids=["unknown-schema-version", "missing-field", "wrong-type", "unknown-type"],
)
def test_valid_json_the_handler_cannot_use_is_dead_lettered_at_attempt_1(database, change, reason_text):
    """A message that is valid JSON but not what the handler accepts (an unknown schema_version, a
    missing or mistyped field, a type without handler) is dead-lettered at once: reason
    ``permanent``, attempt 1, the error text saying why; never retried."""
    reg = Registry()

    @reg.handler("orders", "order.paid", schema_versions={1, 2})
    def handle(m, ctx):
        int(m.payload["amount"])

    fields = {
        "consumer": "orders",
        "message_id": "m",
        "type": "order.paid",
        "payload": {"amount": 1},
        **change,
    }
    with database.connect() as c:
        postbox.receive(c, **fields)
        c.commit()
    w = _run_worker(database.url, reg, "orders")
    try:
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM postbox.dead_letters") == 1)
    finally:
        w.stop()
        w.join()
    row = scalar(database.url, "SELECT row(reason, attempt)::text FROM postbox.dead_letters")
    assert row == "(permanent,1)"
    assert reason_text in scalar(database.url, "SELECT last_error FROM postbox.dead_letters")
    assert scalar(database.url, "SELECT count(*) FROM postbox.attempts") == 1

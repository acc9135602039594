"""Properties of receive and publish over arbitrary input, through Python and through the SQL
functions: every message is either accepted and stored exactly as given (read back and compared),
or refused with the field named and nothing written, the caller's transaction still usable.

From Python every refusal here comes before the round trip (the limits are at their defaults and
the values small). From SQL a refusal is an error (SQLSTATE 22PB1 naming the field, or
PostgreSQL's own for JSON its parser refuses), which aborts the caller's transaction: the caller
who wants to go on wraps the call in a savepoint, as these tests do.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import psycopg
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import postbox
from postbox import InvalidMessage

SETTINGS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_ids = itertools.count()

# --- strategies: anything a caller might pass ---------------------------------------------------

_STRINGS = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "a\x00b", "\ud800", "k" * 1025, "é" * 300, "🔑" * 130, " ", "ok"]),
)
_INTEGERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, -1, 0]),
    # 4299 to 4301 digits (the limit is 4300), built lazily: such an int has no repr
    st.integers(min_value=4299, max_value=4301).map(lambda digits: 10**digits - 1),
    st.integers(min_value=4299, max_value=4301).map(lambda digits: 1 - 10**digits),
)


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels - 1):
        value = [value]
    return value


_JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        _INTEGERS,
        st.floats(),
        _STRINGS,
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(_STRINGS, inner, max_size=4),
        st.dictionaries(st.integers(), inner, min_size=1, max_size=2),  # non-string keys
    ),
    max_leaves=12,
)
# Mostly values that should be accepted, so that both outcomes are well exercised.
_GOOD_JSON = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text()
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_PAYLOADS = st.one_of(
    _GOOD_JSON, _GOOD_JSON, _JSON, st.integers(min_value=62, max_value=66).map(_deep), st.just(b"bytes")
)
_HEADERS = st.one_of(
    st.dictionaries(st.text(max_size=8), _GOOD_JSON, max_size=4),
    st.dictionaries(_STRINGS, _JSON, max_size=4),
    st.integers(min_value=62, max_value=66).map(lambda n: {"h": _deep(n)}),
    _JSON,
)
_TEXT_OR_NONE = st.one_of(st.none(), st.text(min_size=1, max_size=12), _STRINGS, _INTEGERS)


def _optional(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


_INBOX_FIELDS = _optional(
    key=_TEXT_OR_NONE,
    type=_TEXT_OR_NONE,
    sequence=st.one_of(st.none(), _INTEGERS, st.floats(), _STRINGS),
    headers=_HEADERS,
    schema_version=st.one_of(_INTEGERS, _STRINGS),
    correlation_id=_TEXT_OR_NONE,
    causation_id=_TEXT_OR_NONE,
    source=_TEXT_OR_NONE,
)
_OUTBOX_FIELDS = _optional(
    key=_TEXT_OR_NONE,
    type=_TEXT_OR_NONE,
    message_id=_TEXT_OR_NONE,
    headers=_HEADERS,
    correlation_id=_TEXT_OR_NONE,
    causation_id=_TEXT_OR_NONE,
)
_INBOX_DEFAULTS = {
    "key": None, "type": None, "sequence": None, "headers": {}, "schema_version": 1,
    "correlation_id": None, "causation_id": None, "source": None,
}  # fmt: skip
_OUTBOX_DEFAULTS = {"key": None, "type": None, "headers": {}, "correlation_id": None, "causation_id": None}


# --- what "stored exactly" means -----------------------------------------------------------------


def _number(value: Any) -> Any:
    """JSON values with numbers as their decimal values: jsonb keeps the decimal written (a float
    written 1e+16 reads back as the int 10000000000000000; -0.0 as 0.0)."""
    kind = type(value)
    if kind is bool or value is None or kind is str:
        return value
    if kind is int:
        return Decimal(value)
    if kind is float:
        return Decimal(repr(value))
    if kind is dict:
        return {k: _number(v) for k, v in value.items()}
    if kind is list or kind is tuple:
        return [_number(v) for v in value]
    raise AssertionError(f"not JSON: {value!r}")


def _in_transaction(conn: psycopg.Connection[Any]) -> bool:
    return conn.info.transaction_status is psycopg.pq.TransactionStatus.INTRANS


def _rows(conn: psycopg.Connection[Any], table: str) -> int:
    return int(conn.execute(f"SELECT count(*) FROM postbox.{table}").fetchone()[0])  # type: ignore[index]


def _root(field: str) -> str:
    """The message field an error names (``headers`` for ``headers.1.[key]``)."""
    match = re.match(r"\w+", field)
    return match.group() if match else field


def _attempt(call: Callable[[], Any]) -> Any:
    """What ``call`` returned, or the InvalidMessage it raised."""
    try:
        return call()
    except InvalidMessage as error:
        return error


def _refused_by_name(error: InvalidMessage, given: dict[str, Any]) -> None:
    event(f"refused: {_root(error.field)}")
    assert _root(error.field) in given, error
    assert str(error).startswith(f"{error.field}: ")


# --- through Python ------------------------------------------------------------------------------


@SETTINGS
@given(payload=_PAYLOADS, fields=_INBOX_FIELDS)
def test_receive_stores_exactly_or_refuses_by_name_before_the_round_trip(conn, payload, fields):
    """receive: accepted and stored exactly, or InvalidMessage naming a field it was given, nothing
    written and the caller's transaction usable."""
    message_id = f"m{next(_ids)}"
    before = _rows(conn, "inbox_dedup")
    result = _attempt(
        lambda: postbox.receive(conn, consumer="c", message_id=message_id, payload=payload, **fields)
    )
    assert _in_transaction(conn)
    if isinstance(result, InvalidMessage):
        _refused_by_name(result, {"payload": payload, **fields})
        assert _rows(conn, "inbox_dedup") == before
        return
    assert result.is_new
    event("accepted")
    expected = _INBOX_DEFAULTS | fields
    row = conn.execute(
        "SELECT payload, key, type, sequence, headers, schema_version, correlation_id, causation_id, source"
        " FROM postbox.inbox WHERE id = %s",
        (result.inbox_id,),
    ).fetchone()
    assert row is not None
    assert _number(row[0]) == _number(payload)
    assert row[1] == (expected["key"] if expected["key"] is not None else message_id)
    assert (row[2], row[3]) == (expected["type"], expected["sequence"])
    assert _number(row[4]) == _number(expected["headers"])
    assert row[5:] == (
        expected["schema_version"],
        expected["correlation_id"],
        expected["causation_id"],
        expected["source"],
    )


@SETTINGS
@given(payload=_PAYLOADS, fields=_OUTBOX_FIELDS)
def test_publish_stores_exactly_or_refuses_by_name_before_the_round_trip(conn, payload, fields):
    """publish: the same property for the outbox."""
    before = _rows(conn, "outbox")
    outbox_id = _attempt(lambda: postbox.publish(conn, destination="d", payload=payload, **fields))
    assert _in_transaction(conn)
    if isinstance(outbox_id, InvalidMessage):
        _refused_by_name(outbox_id, {"payload": payload, **fields})
        assert _rows(conn, "outbox") == before
        return
    event("accepted")
    expected = _OUTBOX_DEFAULTS | fields
    row = conn.execute(
        "SELECT payload, key, message_id, type, headers, correlation_id, causation_id FROM postbox.outbox WHERE id = %s",
        (outbox_id,),
    ).fetchone()
    assert row is not None
    assert _number(row[0]) == _number(payload)
    if fields.get("message_id") is not None:
        assert row[2] == fields["message_id"]
    assert row[1] == (expected["key"] if expected["key"] is not None else row[2])
    assert row[3] == expected["type"]
    assert _number(row[4]) == _number(expected["headers"])
    assert row[5:] == (expected["correlation_id"], expected["causation_id"])


@SETTINGS
@given(payloads=st.lists(_PAYLOADS, min_size=1, max_size=4), fields=_INBOX_FIELDS, at=st.integers(0, 3))
def test_receive_many_stores_exactly_or_refuses_the_element_by_name(conn, payloads, fields, at):
    """receive_many: every message stored exactly, or the batch refused naming the element and
    field (messages[i].field), nothing of it written."""
    batch: list[dict[str, Any]] = [
        {"consumer": "c", "message_id": f"m{next(_ids)}", "payload": p} for p in payloads
    ]
    batch[at % len(batch)].update(fields)
    before = _rows(conn, "inbox_dedup")
    results = _attempt(lambda: postbox.receive_many(conn, batch))
    assert _in_transaction(conn)
    if isinstance(results, InvalidMessage):
        index, _, field = results.field.partition("].")
        assert index.startswith("messages["), results
        assert _root(field) in batch[int(index.removeprefix("messages["))], results
        assert _rows(conn, "inbox_dedup") == before
        return
    event("accepted")
    for message, result in zip(batch, results, strict=True):
        row = conn.execute(
            "SELECT payload, headers FROM postbox.inbox WHERE id = %s", (result.inbox_id,)
        ).fetchone()
        assert row is not None and _number(row[0]) == _number(message["payload"])
        assert _number(row[1]) == _number(message.get("headers", {}))


# --- through the SQL functions -------------------------------------------------------------------

# JSON text as any client might send it (\u escapes for what is not ASCII, surrogates included);
# values that Python cannot write as JSON (inf, NaN, integers of more than 4300 digits, bytes,
# non-string keys) have no JSON text to send.
_ASCII_JSON = json.JSONEncoder(ensure_ascii=True, allow_nan=False)

# What PostgreSQL itself refuses before a Postbox function runs: JSON text its parser refuses
# (\u0000, a lone surrogate escape), text parameters the driver cannot send (NUL).
_POSTGRES_OWN = {"22P02", "22P05"}


def _json_text(value: Any) -> str | None:
    try:
        return _ASCII_JSON.encode(value)
    except (ValueError, TypeError):
        return None


def _sql_text(value: Any) -> str | None:
    """A text parameter: a string given as such, anything else as NULL (a SQL caller cannot pass
    another type where text is declared)."""
    return value if isinstance(value, str) else None


def _call_in_savepoint(conn: psycopg.Connection[Any], sql: str, params: dict[str, Any]) -> Any:
    """The call's row, or the error it raised, after rolling back to a savepoint around it."""
    try:
        with conn.transaction():
            return conn.execute(sql, params).fetchone()
    except (psycopg.Error, UnicodeEncodeError) as error:
        return error  # (UnicodeEncodeError: the driver cannot send a lone surrogate)


def _check_sql_refusal(error: Exception, names: set[str]) -> None:
    if isinstance(error, UnicodeEncodeError):
        return  # the driver cannot encode a lone surrogate in a text parameter
    if isinstance(error, psycopg.DataError) and "NUL" in str(error):
        return  # the driver refused a text parameter with NUL before sending it
    assert isinstance(error, psycopg.Error), error
    event(f"refused: {error.sqlstate} {error.diag.column_name}")
    if error.sqlstate in _POSTGRES_OWN:
        return
    assert error.sqlstate == "22PB1", error
    field = error.diag.column_name
    assert field is not None and field.rpartition(".")[2] in names, error
    assert f"postbox: {field} " in (error.diag.message_primary or "")


def _bounded(value: Any, low: int, high: int) -> Any:
    """An integer parameter of a SQL type: one out of its range cannot even be passed."""
    return value if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high else None


@SETTINGS
@given(payload=_PAYLOADS, fields=_INBOX_FIELDS)
def test_inbox_receive_v1_stores_exactly_or_refuses_by_name(conn, payload, fields):
    """postbox.inbox_receive_v1 over arbitrary JSON and text: stored exactly, or refused naming the
    field (22PB1) or by PostgreSQL's own JSON parser; nothing written, the savepoint keeps the
    transaction usable."""
    text = _json_text(payload)
    headers = _json_text(fields.get("headers", {}))
    if text is None or headers is None:
        return
    message_id = f"m{next(_ids)}"
    params = {
        "id": message_id, "p": text, "h": headers,
        "key": _sql_text(fields.get("key")), "type": _sql_text(fields.get("type")),
        "seq": _bounded(fields.get("sequence"), -(2**63), 2**63 - 1),
        "sv": _bounded(fields.get("schema_version", 1), -(2**31), 2**31 - 1),
        "corr": _sql_text(fields.get("correlation_id")), "caus": _sql_text(fields.get("causation_id")),
        "src": _sql_text(fields.get("source")),
    }  # fmt: skip
    before = _rows(conn, "inbox_dedup")
    outcome = _call_in_savepoint(
        conn,
        "SELECT status, inbox_id FROM postbox.inbox_receive_v1(consumer => 'c', message_id => %(id)s,"
        " payload => %(p)s::jsonb, key => %(key)s, type => %(type)s, sequence => %(seq)s::bigint,"
        " headers => %(h)s::jsonb, schema_version => %(sv)s::integer, correlation_id => %(corr)s,"
        " causation_id => %(caus)s, source => %(src)s)",
        params,
    )
    assert _in_transaction(conn)
    if isinstance(outcome, Exception):
        _check_sql_refusal(outcome, {"payload", "headers", "key", "type", "sequence", "schema_version",
                                     "correlation_id", "causation_id", "source"})  # fmt: skip
        assert _rows(conn, "inbox_dedup") == before
        return
    assert outcome[0] == "new"
    event("accepted")
    row = conn.execute(
        "SELECT payload, headers, key, type, sequence, schema_version, correlation_id, causation_id, source"
        " FROM postbox.inbox WHERE id = %s",
        (outcome[1],),
    ).fetchone()
    assert row is not None
    assert _number(row[0]) == _number(json.loads(text)) and _number(row[1]) == _number(json.loads(headers))
    assert row[2] == (params["key"] if params["key"] is not None else message_id)
    assert row[3:] == (
        params["type"],
        params["seq"],
        params["sv"],
        params["corr"],
        params["caus"],
        params["src"],
    )


@SETTINGS
@given(payload=_PAYLOADS, fields=_INBOX_FIELDS)
def test_inbox_receive_batch_v1_stores_exactly_or_refuses_the_element_by_name(conn, payload, fields):
    """postbox.inbox_receive_batch_v1 (a JSON array, so integers of any size and any JSON type in
    every field): stored exactly, or refused naming the field; nothing written."""
    element = {"consumer": "c", "message_id": f"m{next(_ids)}", "payload": payload, **fields}
    text = _json_text([{"consumer": "c", "message_id": "x", "payload": {}}, element])
    if text is None:
        return
    before = _rows(conn, "inbox_dedup")
    outcome = _call_in_savepoint(
        conn,
        "SELECT array_agg(inbox_id ORDER BY ordinality) FROM postbox.inbox_receive_batch_v1(%(b)s::jsonb)",
        {"b": text},
    )
    assert _in_transaction(conn)
    if isinstance(outcome, Exception):
        _check_sql_refusal(outcome, set(element))
        assert _rows(conn, "inbox_dedup") == before
        return
    event("accepted")
    sent = json.loads(text)[1]
    row = conn.execute(
        "SELECT payload, headers, key, sequence FROM postbox.inbox WHERE id = %s", (outcome[0][1],)
    ).fetchone()
    assert row is not None
    assert _number(row[0]) == _number(sent["payload"]) and _number(row[1]) == _number(sent.get("headers", {}))
    assert row[2] == (sent.get("key") if sent.get("key") is not None else sent["message_id"])
    assert _number(row[3]) == _number(sent.get("sequence"))  # JSON 1e+16 is the integer 10**16


@SETTINGS
@given(payload=_PAYLOADS, fields=_OUTBOX_FIELDS)
def test_outbox_publish_v1_stores_exactly_or_refuses_by_name(conn, payload, fields):
    """postbox.outbox_publish_v1: the same property for the outbox."""
    text = _json_text(payload)
    headers = _json_text(fields.get("headers", {}))
    if text is None or headers is None:
        return
    params = {
        "p": text, "h": headers, "key": _sql_text(fields.get("key")), "type": _sql_text(fields.get("type")),
        "mid": _sql_text(fields.get("message_id")), "corr": _sql_text(fields.get("correlation_id")),
        "caus": _sql_text(fields.get("causation_id")),
    }  # fmt: skip
    before = _rows(conn, "outbox")
    outcome = _call_in_savepoint(
        conn,
        "SELECT postbox.outbox_publish_v1(destination => 'd', payload => %(p)s::jsonb, key => %(key)s,"
        " type => %(type)s, message_id => %(mid)s, headers => %(h)s::jsonb, correlation_id => %(corr)s,"
        " causation_id => %(caus)s)",
        params,
    )
    assert _in_transaction(conn)
    if isinstance(outcome, Exception):
        _check_sql_refusal(outcome, {"payload", "headers", "key", "type", "message_id", "correlation_id",
                                     "causation_id"})  # fmt: skip
        assert _rows(conn, "outbox") == before
        return
    event("accepted")
    row = conn.execute(
        "SELECT payload, headers, key, message_id, type, correlation_id, causation_id FROM postbox.outbox WHERE id = %s",
        (outcome[0],),
    ).fetchone()
    assert row is not None
    assert _number(row[0]) == _number(json.loads(text)) and _number(row[1]) == _number(json.loads(headers))
    if params["mid"] is not None:
        assert row[3] == params["mid"]
    assert row[2] == (params["key"] if params["key"] is not None else row[3])
    assert row[4:] == (params["type"], params["corr"], params["caus"])

"""A claimed row becomes the same Message that pydantic's ``model_construct`` would make, without
its per-field loop: equal, frozen, with the same fields set and the same dump; its JSON columns
parsed as ``json.loads`` would."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import psycopg
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import postbox
from postbox.inbox.handlers import Message, Registry
from postbox.inbox.worker import Worker, WorkerSettings
from postbox.inbox.worker.batch import MESSAGE_FIELDS, message_from_row
from postbox.values import from_json, to_json, to_sql_json
from tests.helpers import FAST_WORKER as FAST
from tests.helpers import eventually

ROWS = [
    (1, "c", "m-1", "k", 3, "order.paid", 1, {"amount": 42}, {"traceparent": "00-x"}, "corr", "cause", "svc",
     datetime(2026, 12, 3, 12, 0, tzinfo=UTC), 1, None, None, None),
    (2, "c", "m-2", "m-2", None, None, 2, [1, "two", None], {}, None, None, None,
     datetime(2026, 12, 3, 12, 0, 1, tzinfo=UTC), 4, datetime(2026, 12, 3, 12, 0, 2, tzinfo=UTC), "boom",
     "ValueError"),
]  # fmt: skip


@pytest.mark.parametrize("row", ROWS, ids=["first_attempt", "after_failures"])
def test_a_claimed_row_is_the_message_model_construct_makes(row):
    made = message_from_row(row)
    reference = Message.model_construct(**dict(zip(MESSAGE_FIELDS, row, strict=True)))
    assert made == reference
    assert made.model_fields_set == reference.model_fields_set == set(MESSAGE_FIELDS)
    assert made.model_dump() == reference.model_dump()
    assert made.model_dump_json() == reference.model_dump_json()
    assert repr(made) == repr(reference)
    assert made.model_copy(update={"attempt": 9}).attempt == 9
    with pytest.raises(pydantic.ValidationError):
        made.attempt = 2  # frozen, as every Message


def test_a_row_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="columns"):
        message_from_row(ROWS[0][:-1])


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(value=_JSON, spaced=st.booleans())
def test_claimed_json_is_parsed_as_json_loads_parses_it(value, spaced):
    """The loader of the claiming connections gives json.loads's result for any JSON text, as
    bytes or a memoryview (what psycopg passes), in PostgreSQL's spacing or compact."""
    text = to_sql_json(value) if spaced else to_json(value)
    data = text.encode("utf-8", "surrogatepass")
    expected = json.loads(data)
    assert from_json(data) == expected
    assert from_json(memoryview(data)) == expected
    assert from_json(text) == expected


def test_an_empty_object_is_a_new_dict_each_time():
    """Headers are mostly ``{}``: each message gets its own dict, which a handler may change."""
    first, second = from_json(b"{}"), from_json(memoryview(b"{}"))
    first["changed"] = True
    assert second == {} and from_json(b"{}") == {}


def test_a_worker_hands_handlers_the_payload_and_headers_as_received(database):
    """Through a real claim: the payload and headers a handler gets equal what was received
    (nested, non-ASCII, empty), and changing one message's headers leaves the next one's alone."""
    payloads = [{"ünï": ["cödé", 1.5, None, {"deep": [True]}]}, {}, [1, "two"], "text", 7]
    got: dict[str, tuple[Any, Any]] = {}
    reg = Registry()

    @reg.handler("c")
    def handle(m, ctx):
        got[m.message_id] = (m.payload, dict(m.headers))
        m.headers["touched"] = True

    with psycopg.connect(database.url) as c:
        postbox.receive_many(
            c,
            [{"consumer": "c", "message_id": f"m{i}", "key": "k", "payload": p,
              **({"headers": {"h": "ü"}} if i == 0 else {})} for i, p in enumerate(payloads)],
        )  # fmt: skip
        c.commit()
    w = Worker(database.url, reg, WorkerSettings(consumer="c", **FAST))
    w.start()
    try:
        eventually(lambda: len(got) == len(payloads), what="every message handled")
    finally:
        w.stop()
        w.join()
    assert got == {f"m{i}": (p, {"h": "ü"} if i == 0 else {}) for i, p in enumerate(payloads)}

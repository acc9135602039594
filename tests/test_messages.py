"""The batch path's shortcut past pydantic never accepts what the model refuses, nor changes a value."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from service.messages import INBOX_DEFAULTS, InboxMessage, plain_inbox_item

_TEXTS = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["", "a\x00b", "\ud800", "k" * 1025, "é" * 600, "ok"]),
)
_JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        _TEXTS,
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(_TEXTS, st.integers()), inner, max_size=3),
    ),
    max_leaves=8,
)
_VALUES = st.one_of(_JSON, st.tuples(st.integers()), st.just(object()))
_FIELDS = [
    "consumer",
    "message_id",
    "payload",
    "key",
    "type",
    "sequence",
    "headers",
    "schema_version",
    "correlation_id",
    "causation_id",
    "source",
    "unknown",
]


@settings(max_examples=1500, deadline=None)
@given(
    st.fixed_dictionaries(
        {
            "consumer": st.one_of(_TEXTS, _VALUES),
            "message_id": st.one_of(_TEXTS, _VALUES),
            "payload": _VALUES,
        },
        optional={name: st.one_of(_TEXTS, _VALUES) for name in _FIELDS[3:]},
    )
)
def test_plain_items_are_exactly_what_the_model_gives(fields: dict[str, Any]) -> None:
    """Whatever the shortcut accepts, the model accepts too, with the same fields and values."""
    item = plain_inbox_item(fields)
    if item is None:
        return
    try:
        model = InboxMessage(**fields)
    except ValidationError as error:
        raise AssertionError(f"shortcut accepted what the model refuses: {error}") from None
    assert item is fields  # no copy: absent fields stand for their defaults
    assert _same(INBOX_DEFAULTS | item, model.batch_item())


def test_the_usual_message_takes_the_shortcut() -> None:
    """A plain dict with the usual fields is accepted without building a model."""
    fields = {"consumer": "c", "message_id": "m", "payload": {"a": [1, 2.5, None]}, "key": "k", "sequence": 3}
    item = plain_inbox_item(fields)
    assert item is not None and _same(INBOX_DEFAULTS | item, InboxMessage(**fields).batch_item())
    assert plain_inbox_item(fields | {"sequence": True}) is None  # the model refuses a bool sequence
    assert plain_inbox_item(fields | {"payload": {1: "x"}}) is None  # a non-string key


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b

"""The batch path's shortcut past pydantic never accepts what the model refuses, nor changes a value."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import postbox
from postbox.messages import INBOX_DEFAULTS, InboxMessage, invalid_message_from, plain_inbox_item

_TEXTS = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["", "a\x00b", "\ud800", "k" * 1025, "é" * 600, "ok"]),
)
_JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.sampled_from([2**63, 2**31, -(2**63)]),
        # 4299 to 4301 digits (the limit is 4300), built lazily: such an int has no repr
        st.integers(min_value=4299, max_value=4301).map(lambda digits: 10**digits - 1),
        st.integers(min_value=4299, max_value=4301).map(lambda digits: 1 - 10**digits),
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


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"sequence": 2**63}, "sequence"),
        ({"schema_version": 2**31}, "schema_version"),
        ({"payload": {"n": 10**4300}}, "payload"),
        ({"payload": _deep(65)}, "payload"),
        ({"payload": _deep(100_000)}, "payload"),
        ({"headers": {"h": _deep(64)}}, "headers"),
    ],
    ids=[
        "sequence-2**63",
        "schema_version-2**31",
        "10**4300",
        "65-levels",
        "100000-levels",
        "headers-65-levels",
    ],
)
def test_limits_are_the_same_through_the_shortcut_and_the_model(change: dict[str, Any], field: str) -> None:
    """Out-of-range integers, numbers of more than 4300 digits and nesting deeper than 64 levels
    are refused by the model naming the field, and never taken by the shortcut; no RecursionError."""
    fields = {"consumer": "c", "message_id": "m", "payload": {}, **change}
    assert plain_inbox_item(fields) is None
    with pytest.raises(ValidationError) as info:
        InboxMessage(**fields)
    assert invalid_message_from(info.value).field == field


def test_the_limits_themselves_are_accepted() -> None:
    """64 levels, 4300-digit integers, the largest bigint sequence and integer schema_version."""
    fields = {
        "consumer": "c",
        "message_id": "m",
        "payload": {"deep": _deep(63), "n": 10**4300 - 1, "m": -(10**4300) + 1},
        "headers": {"h": _deep(63)},
        "sequence": 2**63 - 1,
        "schema_version": 2**31 - 1,
    }
    assert plain_inbox_item(fields) is fields
    assert InboxMessage(**fields).sequence == 2**63 - 1


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


_ANY = st.one_of(_TEXTS, _VALUES, st.just(None), st.integers(min_value=-1, max_value=2**31))
_GOOD = {  # values the shortcut usually takes, so that whole batches pass often
    "payload": _JSON,
    "headers": st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2),
    "sequence": st.one_of(st.none(), st.integers(0, 9)),
    "schema_version": st.integers(1, 3),
}


@st.composite
def _same_shaped_batches(draw: st.DrawFn) -> list[Any]:
    """Batches whose dicts mostly share their fields (the shape the column-wise check takes),
    with values mostly valid and now and then anything; sometimes a message of another shape, or
    not a dict at all."""
    clean = draw(st.booleans())  # half the batches: only valid values, the usual fields
    names = draw(st.sets(st.sampled_from(_FIELDS[3:-1] if clean else _FIELDS[3:])))
    names |= {"consumer", "message_id", "payload"}
    if not clean:
        names -= draw(st.sets(st.sampled_from(["consumer", "message_id", "payload"]), max_size=1))
    good_text = st.text(st.characters(max_codepoint=127, exclude_characters="\x00"), min_size=1, max_size=6)

    def value(name: str) -> st.SearchStrategy[Any]:
        good = _GOOD.get(name, good_text)
        return good if clean else st.one_of(good, good, good, good, good, _ANY)

    one = st.fixed_dictionaries({name: value(name) for name in sorted(names)})
    batch = draw(st.lists(one, min_size=1, max_size=4))
    if not clean and draw(st.booleans()):
        batch.insert(draw(st.integers(0, len(batch))), draw(st.one_of(st.just(object()), _JSON)))
    return batch


@settings(max_examples=1500, deadline=None)
@given(_same_shaped_batches())
def test_the_column_wise_check_never_takes_what_one_by_one_would_refuse(batch: list[Any]) -> None:
    """A batch the column-wise check takes is one whose every message the one-by-one shortcut
    takes (and so the model), unchanged."""
    from postbox.messages import _PLAIN, _plain_batch, _plain_item

    taken = _plain_batch(_PLAIN[InboxMessage], batch)
    event(f"taken: {taken is not None}")
    if taken is None:
        return
    assert taken == batch and all(a is b for a, b in zip(taken, batch, strict=True))
    for fields in batch:
        assert _plain_item(_PLAIN[InboxMessage], fields) is fields


def test_a_usual_batch_is_checked_column_wise_and_handed_back_as_a_new_list() -> None:
    """The usual batch takes the column-wise check; the caller's list is never the one returned."""
    from postbox.messages import _PLAIN, _plain_batch, batch_items

    batch = [
        {
            "consumer": "c",
            "message_id": f"m{i}",
            "payload": {"i": i, "s": "x"},
            "key": f"k{i % 3}",
            "sequence": i,
        }
        for i in range(10)
    ]
    assert _plain_batch(_PLAIN[InboxMessage], batch) is batch
    items = batch_items(InboxMessage, batch)
    assert items == batch and items is not batch
    # one message unlike the others: each is checked on its own, and the bad one is named
    with pytest.raises(postbox.InvalidMessage) as info:
        batch_items(InboxMessage, [*batch, {"consumer": "c", "message_id": "", "payload": 1}])
    assert info.value.field == "messages[10].message_id"

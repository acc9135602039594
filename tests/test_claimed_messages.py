"""A claimed row becomes the same Message that pydantic's ``model_construct`` would make, without
its per-field loop: equal, frozen, with the same fields set and the same dump."""

from __future__ import annotations

from datetime import UTC, datetime

import pydantic
import pytest

from postbox.inbox.handlers import Message
from postbox.inbox.worker.batch import MESSAGE_FIELDS, message_from_row

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

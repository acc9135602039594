"""Messages as producers hand them to Postbox: validated pydantic models, and the one validator
of a message or a batch of them.

Validation mirrors the SQL functions' checks (which stay the authority for any language), so a
Python caller gets an error naming the field before its transaction is touched.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from postbox.errors import InvalidMessage
from postbox.values import (
    CONSUMER_MAX_BYTES,
    KEY_MAX_BYTES,
    MESSAGE_ID_MAX_BYTES,
    REF_MAX_BYTES,
    SCHEMA_VERSION_MAX,
    SEQUENCE_MAX,
    TYPE_MAX_BYTES,
    check_json,
    check_text,
    json_plainly_ok,
    to_json,
    to_sql_json,
    utf8_size,
)

__all__ = [
    "INBOX_DEFAULTS",
    "InboxMessage",
    "OutboxMessage",
    "ReceiveResult",
    "ReceiveStatus",
    "batch_items",
    "checked",
    "invalid_message_from",
    "plain_inbox_item",
    "to_json",
    "to_sql_json",
    "utf8_size",
]


# The text fields, with their byte limits (UTF-8): every value stays indexable by btree; the SQL
# functions use the same.
TEXT_LIMITS = {
    "consumer": CONSUMER_MAX_BYTES,
    "destination": CONSUMER_MAX_BYTES,
    "message_id": MESSAGE_ID_MAX_BYTES,
    "key": KEY_MAX_BYTES,
    "type": TYPE_MAX_BYTES,
    "correlation_id": REF_MAX_BYTES,
    "causation_id": REF_MAX_BYTES,
    "source": REF_MAX_BYTES,
}


class _Common(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=False)

    payload: Any
    key: str | None = None
    type: str | None = None
    message_id: str | None = None
    headers: dict[str, Any] = Field(default_factory=dict)
    correlation_id: str | None = None
    causation_id: str | None = None

    @field_validator("payload", "headers")
    @classmethod
    def _json(cls, v: Any) -> Any:
        check_json(v)
        return v

    @field_validator(*TEXT_LIMITS, check_fields=False)
    @classmethod
    def _text(cls, v: str | None, info: ValidationInfo) -> str | None:
        return check_text(v, TEXT_LIMITS[info.field_name or ""])

    def params(self) -> dict[str, Any]:
        """Bind parameters for the single-message query: the fields, payload and headers as JSON text."""
        return self.__dict__ | {"payload": to_sql_json(self.payload), "headers": to_sql_json(self.headers)}

    def batch_item(self) -> dict[str, Any]:
        """This message as an element of a batch: its fields."""
        return dict(self.__dict__)


class InboxMessage(_Common):
    """A message for the inbox of ``consumer``.

    ``message_id`` is required: it is what deduplication keys on. ``key`` (default: the message id,
    meaning no ordering) groups messages that must be processed one at a time in order; ``sequence``
    orders them within the key for consumers in monotonic or gapless mode. Keys and ids are compared
    exactly as given (no Unicode normalisation): normalise them yourself if producers may differ.
    """

    consumer: str
    message_id: str
    sequence: Annotated[int, Field(strict=True, ge=0, le=SEQUENCE_MAX)] | None = None
    schema_version: Annotated[int, Field(strict=True, ge=1, le=SCHEMA_VERSION_MAX)] = 1
    source: str | None = None


class OutboxMessage(_Common):
    """An event for ``destination``; the relay publishes it after the writing transaction commits.

    ``message_id`` defaults to a random UUID chosen by the database; rows of one ``key`` are
    published in the order they were written.
    """

    destination: str


# --- the one validator -----------------------------------------------------------------------

_Message = TypeVar("_Message", InboxMessage, OutboxMessage)


def checked(
    model: type[_Message], message: _Message | None, fields: dict[str, Any], prefix: str = ""
) -> _Message:
    """``message`` as given, or ``fields`` checked by ``model``: :class:`InvalidMessage` names the
    first bad field (after ``prefix``, ``messages[3].`` in a batch)."""
    if message is not None:
        if fields:
            raise TypeError("postbox: pass either a message or its fields, not both")
        if isinstance(message, dict):  # the message as a dict, as a batch takes it
            fields, message = message, None
        elif not isinstance(message, model):
            raise TypeError(
                f"postbox: pass an {model.__name__}, a dict or the message's fields as keywords, "
                f"not a {type(message).__name__}"
            )
        else:
            return message
    try:
        return model(**fields)
    except ValidationError as error:
        raise invalid_message_from(error, prefix) from None


def batch_items(model: type[_Message], messages: Iterable[_Message | dict[str, Any]]) -> list[dict[str, Any]]:
    """Each message checked, as the batch functions' fields: a dict itself when it is plainly valid
    (:func:`_plain_item`: an absent field stands for its default), any other dict through
    ``model``, which names the element and the bad field; a ``model`` as its :meth:`batch_item`."""
    spec = _PLAIN[model]
    if messages is None or isinstance(messages, dict | str | bytes | model):
        raise TypeError(
            f"postbox: pass a list of messages ({model.__name__}s or dicts), not a {type(messages).__name__}"
            + (": for one message, the function without _many" if isinstance(messages, dict | model) else "")
        )
    messages = list(messages)  # a list of our own (the caller's is never handed back)
    plain = _plain_batch(spec, messages)
    if plain is not None:
        return plain
    items = []
    for i, m in enumerate(messages):
        if isinstance(m, dict):
            item = _plain_item(spec, m)
            items.append(
                item if item is not None else checked(model, None, m, f"messages[{i}].").batch_item()
            )
        elif isinstance(m, model):
            items.append(m.batch_item())
        else:
            raise TypeError(
                f"postbox: messages[{i}] is a {type(m).__name__}, not a {model.__name__} or a dict"
            )
    return items


@dataclass(frozen=True, slots=True)
class _Plain:
    """A model's fields, as the shortcut past pydantic checks them."""

    texts: dict[str, int]  # the text fields, with their byte limits
    required: tuple[str, ...]  # the text fields that must be present (and not None)
    fields: frozenset[str]  # every field


def _plain_spec(model: type[_Common]) -> _Plain:
    fields = model.model_fields
    texts = {name: limit for name, limit in TEXT_LIMITS.items() if name in fields}
    return _Plain(texts, tuple(n for n in texts if fields[n].is_required()), frozenset(fields))


_PLAIN: dict[type[Any], _Plain] = {model: _plain_spec(model) for model in (InboxMessage, OutboxMessage)}

# What an inbox field absent from a dict stands for (InboxMessage's defaults).
INBOX_DEFAULTS: dict[str, Any] = {
    "key": None,
    "type": None,
    "sequence": None,
    "headers": {},
    "schema_version": 1,
    "correlation_id": None,
    "causation_id": None,
    "source": None,
}


def plain_inbox_item(fields: dict[str, Any]) -> dict[str, Any] | None:
    """``fields`` themselves if they are a plainly valid inbox message, else None."""
    return _plain_item(_PLAIN[InboxMessage], fields)


def _plain_item(spec: _Plain, fields: dict[str, Any]) -> dict[str, Any] | None:
    """``fields`` themselves if they are plainly valid, else None. An absent field stands for its
    default, so ``INBOX_DEFAULTS | item`` is what :meth:`InboxMessage.batch_item` gives.

    The batch path's shortcut past pydantic: the same checks (``check_text``, ``check_json``) on
    values already of the exact type the model wants. Anything else (a missing or unknown field,
    a value pydantic would coerce or refuse) gives None, and the caller builds the model, which
    names the problem. A test holds the two to the same verdicts.
    """
    if not fields.keys() <= spec.fields or "payload" not in fields:
        return None
    for name in spec.required:
        if fields.get(name) is None:
            return None
    texts = spec.texts
    try:
        for name, value in fields.items():
            limit = texts.get(name)
            if limit is not None:
                if value is None:
                    continue
                if type(value) is not str:
                    return None
                # The usual text: ASCII, so one byte per character, and no NUL.
                if not (0 < len(value) <= limit and value.isascii() and "\x00" not in value):
                    check_text(value, limit)
            elif name == "payload":
                check_json(value)
            elif name == "headers":
                if type(value) is not dict:
                    return None
                check_json(value)
            elif name == "sequence":
                if value is not None and (type(value) is not int or not 0 <= value <= SEQUENCE_MAX):
                    return None
            elif type(value) is not int or not 1 <= value <= SCHEMA_VERSION_MAX:  # schema_version
                return None
    except ValueError:
        return None
    return fields


_NONE = type(None)


def _plain_batch(spec: _Plain, messages: list[Any]) -> list[dict[str, Any]] | None:
    """``messages`` themselves if they are dicts with the same fields that :func:`_plain_item`
    would each take as they are, else None (and each is then checked on its own, which names the
    first bad one). The same checks, made column by column: a batch's usual shape costs a third of
    checking its messages one by one. Stricter where that is cheaper (any non-ASCII text, or a JSON
    value only the slow walk takes, sends the batch the long way), never looser: a test holds it
    to that."""
    if not messages or set(map(type, messages)) != {dict}:
        return None
    names = messages[0].keys()
    if (
        set(map(len, messages)) != {len(names)}
        or not names <= spec.fields
        or "payload" not in names
        or not names >= set(spec.required)
    ):
        return None
    texts = spec.texts
    try:
        for name in names:
            column = [m[name] for m in messages]  # KeyError: not every message has the same fields
            kinds = set(map(type, column))
            limit = texts.get(name)
            if limit is not None:
                if kinds != {str}:
                    if kinds not in ({str, _NONE}, {_NONE}) or name in spec.required:
                        return None
                    column = [v for v in column if v is not None]
                    if not column:
                        continue
                joined = "".join(column)
                if (
                    not joined.isascii()
                    or "\x00" in joined
                    or not 0 < min(map(len, column)) <= max(map(len, column)) <= limit
                ):
                    return None
            elif name in {"payload", "headers"}:
                if name == "headers" and kinds != {dict}:
                    return None
                for value in column:
                    if not json_plainly_ok(value):
                        return None
            elif name == "sequence":
                if not kinds <= {int, _NONE}:
                    return None
                column = [v for v in column if v is not None] if _NONE in kinds else column
                if column and not 0 <= min(column) <= max(column) <= SEQUENCE_MAX:
                    return None
            elif (
                kinds != {int} or not 1 <= min(column) <= max(column) <= SCHEMA_VERSION_MAX
            ):  # schema_version
                return None
    except KeyError:
        return None
    return messages


class ReceiveStatus(StrEnum):
    """What a receive did: stored a new message, or recognised one seen before."""

    NEW = "new"
    DUPLICATE = "duplicate"
    CONFLICT = "conflict"


@dataclass(frozen=True, slots=True)
class ReceiveResult:
    """Outcome of one receive. ``conflict`` means the id was seen before with another payload.

    A plain frozen dataclass, not a model: it is only ever built from what the database returned,
    and a batch builds one per message."""

    status: ReceiveStatus
    inbox_id: int

    def __post_init__(self) -> None:
        if type(self.status) is not ReceiveStatus:  # built by hand from a string: "new"
            object.__setattr__(self, "status", ReceiveStatus(self.status))

    @property
    def is_new(self) -> bool:
        return self.status is ReceiveStatus.NEW

    @property
    def is_duplicate(self) -> bool:
        return self.status is ReceiveStatus.DUPLICATE

    @property
    def is_conflict(self) -> bool:
        return self.status is ReceiveStatus.CONFLICT


def invalid_message_from(error: ValidationError, prefix: str = "") -> InvalidMessage:
    """Turn pydantic's error into ours, naming the first offending field."""
    first = error.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "message"
    message = first["msg"].removeprefix("Value error, ")
    return InvalidMessage(f"{prefix}{field}", message)

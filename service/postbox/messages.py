"""Messages as producers hand them to Postbox: validated pydantic models.

Validation mirrors the SQL functions' checks (which stay the authority for any language), so a
Python caller gets an error naming the field before its transaction is touched.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from postbox.errors import InvalidMessage

__all__ = [
    "INBOX_DEFAULTS",
    "InboxMessage",
    "OutboxMessage",
    "ReceiveResult",
    "ReceiveStatus",
    "invalid_message_from",
    "plain_inbox_item",
    "to_json",
    "to_sql_json",
    "utf8_size",
]

# Byte limits (UTF-8) that keep every value indexable by btree; the SQL functions use the same.
CONSUMER_MAX_BYTES = 200
MESSAGE_ID_MAX_BYTES = 512
KEY_MAX_BYTES = 1024
TYPE_MAX_BYTES = 200
REF_MAX_BYTES = 512

# Limits on free-form JSON (payloads and headers); the SQL functions apply the same. Nesting: at
# most 64 levels, the value itself being level 1 ({"a": [1]} has 3). Integers: at most 4300
# digits, what JSON readers such as Python's read by default (a worker could not load more).
MAX_DEPTH = 64
MAX_NUMBER_DIGITS = 4300
_INT_BOUND = 10**MAX_NUMBER_DIGITS
_INT_FLOOR = -_INT_BOUND

# The server's default size limits, in bytes of JSON text (settings postbox.max_payload_bytes and
# postbox.max_headers_bytes; the server holds the values in force).
PAYLOAD_MAX_BYTES = 1_048_576
HEADERS_MAX_BYTES = 65_536

# The columns' types: sequence is a bigint, schema_version an integer.
SEQUENCE_MAX = 2**63 - 1
SCHEMA_VERSION_MAX = 2**31 - 1


def _check_text(value: str | None, max_bytes: int) -> str | None:
    if value is None:
        return None
    if value == "":
        raise ValueError("must not be empty")
    if "\x00" in value:
        raise ValueError("must not contain NUL (\\u0000)")
    if value.isascii():  # the usual case: one byte per character, no surrogates
        size = len(value)
    else:
        size = len(value.encode("utf-8", "surrogatepass"))
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            if size <= max_bytes:
                raise ValueError("is not valid Unicode (lone surrogate)") from None
    if size > max_bytes:
        raise ValueError(f"is {size} bytes, over the limit of {max_bytes}")
    return value


def _json_ok(value: Any) -> bool:
    """True if jsonb can hold ``value`` as JSON within the nesting and number limits (the fast
    walk, iterative so that no nesting exhausts the stack; _explain_json says what is wrong)."""
    kind = type(value)
    if kind is not dict and kind is not list and kind is not tuple:
        return _scalar_ok(value, kind)
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        container, level = stack.pop()
        if type(container) is dict:
            for k in container:
                if type(k) is not str or "\x00" in k or not (k.isascii() or _utf8_ok(k)):
                    return False
            children = container.values()
        else:
            children = container
        if level >= MAX_DEPTH:
            if children:  # its elements would be one level too deep
                return False
            continue
        level += 1
        for v in children:  # a loop, not all(genexpr): this runs for every message of a batch
            kind = type(v)
            if kind is str:
                if "\x00" in v or not (v.isascii() or _utf8_ok(v)):
                    return False
            elif kind is int:
                if not _INT_FLOOR < v < _INT_BOUND:
                    return False
            elif kind is dict or kind is list or kind is tuple:
                stack.append((v, level))
            elif kind is float:
                if not math.isfinite(v):
                    return False
            elif kind is not bool and v is not None:
                return False
    return True


def _scalar_ok(value: Any, kind: type) -> bool:
    if kind is str:
        return "\x00" not in value and (value.isascii() or _utf8_ok(value))
    if kind is int:
        return bool(_INT_FLOOR < value < _INT_BOUND)
    if kind is float:
        return math.isfinite(value)
    return kind is bool or value is None


def _utf8_ok(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_json(value: Any) -> None:
    """Refuse what PostgreSQL's jsonb cannot hold, JSON cannot express, or breaks the nesting and
    number limits, saying where."""
    if not _json_ok(value):  # or only unusual types (str or int subclasses): the slow walk decides
        _explain_json(value)


def _where(path: str) -> str:
    """``path`` for an error message: shortened, and with what cannot be printed (a lone
    surrogate or NUL in an object key) escaped."""
    if not path:
        return "top level"
    if len(path) > 80:
        path = f"{path[:77]}..."
    if not path.isascii():
        path = path.encode("utf-8", "backslashreplace").decode("utf-8")
    return path.replace("\x00", "\\x00")


def _explain_json(value: Any) -> None:
    """Raise ValueError for the first thing in ``value`` that jsonb cannot hold or the limits
    refuse, with its path. Iterative, in document order."""
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        v, path, level = stack.pop()
        if level > MAX_DEPTH:
            raise ValueError(
                f"nests deeper than {MAX_DEPTH} levels at {_where(path)} (the value itself is level 1)"
            )
        if isinstance(v, str):
            _explain_text(v, path)
        elif isinstance(v, bool) or v is None:
            continue
        elif isinstance(v, int):
            if not _INT_FLOOR < v < _INT_BOUND:
                raise ValueError(
                    f"has an integer of more than {MAX_NUMBER_DIGITS} digits at {_where(path)}, which JSON "
                    "readers refuse (send it as a string)"
                )
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise ValueError(f"contains {v!r} at {_where(path)}, which is not JSON")
        elif isinstance(v, dict):
            children: list[tuple[Any, str, int]] = []
            for k, x in v.items():
                if not isinstance(k, str):
                    raise ValueError(f"has a non-string object key {_short_repr(k)} at {_where(path)}")
                child = f"{path}.{k}" if path else k
                _explain_text(k, child)
                children.append((x, child, level + 1))
            stack.extend(reversed(children))
        elif isinstance(v, list | tuple):
            stack.extend(reversed([(x, f"{path}[{i}]", level + 1) for i, x in enumerate(v)]))
        else:
            raise ValueError(f"has a {type(v).__name__} at {_where(path)}, which is not JSON")


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int too long to print
        return f"(an {type(value).__name__})"
    return text if len(text) <= 40 else f"{text[:37]}..."


def _explain_text(value: str, path: str) -> None:
    if "\x00" in value:
        raise ValueError(f"contains NUL (\\u0000) at {_where(path)}; jsonb cannot store it")
    if not _utf8_ok(value):
        raise ValueError(f"contains a lone surrogate at {_where(path)}")


def to_json(value: Any) -> str:
    """Serialise a checked JSON value compactly (UTF-8 kept as is)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# The JSON text PostgreSQL prints for a jsonb value has a space after each ',' and ':'; sent that
# way, a value's text is as long as the one the server's size limits measure (except floats
# written with an exponent, 1e+16, which PostgreSQL prints digit by digit).
to_sql_json = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": "), allow_nan=False).encode


def utf8_size(text: str) -> int:
    """Bytes of ``text`` in UTF-8."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


class _Common(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=False)

    payload: Any
    key: str | None = None
    type: str | None = None
    message_id: str | None = None
    headers: dict[str, Any] = Field(default_factory=dict)
    correlation_id: str | None = None
    causation_id: str | None = None

    @field_validator("payload")
    @classmethod
    def _payload(cls, v: Any) -> Any:
        _check_json(v)
        return v

    @field_validator("headers")
    @classmethod
    def _headers(cls, v: dict[str, Any]) -> dict[str, Any]:
        _check_json(v)
        return v

    @field_validator("key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        return _check_text(v, KEY_MAX_BYTES)

    @field_validator("type")
    @classmethod
    def _type(cls, v: str | None) -> str | None:
        return _check_text(v, TYPE_MAX_BYTES)

    @field_validator("message_id")
    @classmethod
    def _message_id(cls, v: str | None) -> str | None:
        return _check_text(v, MESSAGE_ID_MAX_BYTES)

    @field_validator("correlation_id", "causation_id")
    @classmethod
    def _refs(cls, v: str | None) -> str | None:
        return _check_text(v, REF_MAX_BYTES)


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

    @field_validator("consumer")
    @classmethod
    def _consumer(cls, v: str) -> str:
        checked = _check_text(v, CONSUMER_MAX_BYTES)
        assert checked is not None
        return checked

    @field_validator("source")
    @classmethod
    def _source(cls, v: str | None) -> str | None:
        return _check_text(v, REF_MAX_BYTES)

    def params(self) -> dict[str, Any]:
        """Bind parameters for the ``inbox_receive`` query."""
        return {
            "consumer": self.consumer,
            "message_id": self.message_id,
            "payload": to_sql_json(self.payload),
            "key": self.key,
            "type": self.type,
            "sequence": self.sequence,
            "headers": to_sql_json(self.headers),
            "schema_version": self.schema_version,
            "correlation_id": self.correlation_id,
            "causation_id": self.causation_id,
            "source": self.source,
        }

    def batch_item(self) -> dict[str, Any]:
        """This message as an element of the batch function's JSON array."""
        return {
            "consumer": self.consumer,
            "message_id": self.message_id,
            "payload": self.payload,
            "key": self.key,
            "type": self.type,
            "sequence": self.sequence,
            "headers": self.headers,
            "schema_version": self.schema_version,
            "correlation_id": self.correlation_id,
            "causation_id": self.causation_id,
            "source": self.source,
        }


class OutboxMessage(_Common):
    """An event for ``destination``; the relay publishes it after the writing transaction commits.

    ``message_id`` defaults to a random UUID chosen by the database; rows of one ``key`` are
    published in the order they were written.
    """

    destination: str

    @field_validator("destination")
    @classmethod
    def _destination(cls, v: str) -> str:
        checked = _check_text(v, CONSUMER_MAX_BYTES)
        assert checked is not None
        return checked

    def params(self) -> dict[str, Any]:
        """Bind parameters for the ``outbox_publish`` query."""
        return {
            "destination": self.destination,
            "payload": to_sql_json(self.payload),
            "key": self.key,
            "type": self.type,
            "message_id": self.message_id,
            "headers": to_sql_json(self.headers),
            "correlation_id": self.correlation_id,
            "causation_id": self.causation_id,
        }

    def batch_item(self) -> dict[str, Any]:
        """This event as an element of the batch function's JSON array."""
        return {
            "destination": self.destination,
            "payload": self.payload,
            "key": self.key,
            "type": self.type,
            "message_id": self.message_id,
            "headers": self.headers,
            "correlation_id": self.correlation_id,
            "causation_id": self.causation_id,
        }


# The fields of an inbox message given as a dict, with their byte limits (None: not text).
_INBOX_TEXT = {
    "consumer": CONSUMER_MAX_BYTES,
    "message_id": MESSAGE_ID_MAX_BYTES,
    "key": KEY_MAX_BYTES,
    "type": TYPE_MAX_BYTES,
    "correlation_id": REF_MAX_BYTES,
    "causation_id": REF_MAX_BYTES,
    "source": REF_MAX_BYTES,
}
_INBOX_FIELDS = frozenset(_INBOX_TEXT) | {"payload", "headers", "sequence", "schema_version"}


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
    """``fields`` themselves if they are plainly valid, else None. An absent field stands for its
    default (:data:`INBOX_DEFAULTS`), so ``INBOX_DEFAULTS | item`` is what
    :meth:`InboxMessage.batch_item` gives.

    The batch path's shortcut past pydantic: the same checks (``_check_text``, ``_check_json``)
    on values already of the exact type the model wants. Anything else (a missing or unknown
    field, a value pydantic would coerce or refuse) gives None, and the caller builds the model,
    which names the problem. A test holds the two to the same verdicts.
    """
    if not fields.keys() <= _INBOX_FIELDS:
        return None
    try:
        for name, value in fields.items():
            limit = _INBOX_TEXT.get(name)
            if limit is not None:
                if value is None:
                    continue
                if type(value) is not str:
                    return None
                # The usual text: ASCII, so one byte per character, and no NUL.
                if not (0 < len(value) <= limit and value.isascii() and "\x00" not in value):
                    _check_text(value, limit)
            elif name == "payload":
                _check_json(value)
            elif name == "headers":
                if type(value) is not dict:
                    return None
                _check_json(value)
            elif name == "sequence":
                if value is not None and (type(value) is not int or not 0 <= value <= SEQUENCE_MAX):
                    return None
            elif type(value) is not int or not 1 <= value <= SCHEMA_VERSION_MAX:  # schema_version
                return None
    except ValueError:
        return None
    if fields.get("consumer") is None or fields.get("message_id") is None or "payload" not in fields:
        return None
    return fields


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

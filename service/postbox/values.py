"""Values as Postbox stores them: text fields within their byte limits, and free-form JSON
(payloads and headers) that jsonb can hold, JSON readers can load, within the nesting and number
limits. The SQL functions apply the same checks (they stay the authority for any language).
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = [
    "CONSUMER_MAX_BYTES",
    "HEADERS_MAX_BYTES",
    "KEY_MAX_BYTES",
    "MAX_DEPTH",
    "MAX_NUMBER_DIGITS",
    "MESSAGE_ID_MAX_BYTES",
    "PAYLOAD_MAX_BYTES",
    "REF_MAX_BYTES",
    "SCHEMA_VERSION_MAX",
    "SEQUENCE_MAX",
    "TYPE_MAX_BYTES",
    "check_json",
    "check_text",
    "from_json",
    "json_plainly_ok",
    "json_text_value",
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


def check_text(value: str | None, max_bytes: int) -> str | None:
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


def json_plainly_ok(value: Any) -> bool:
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


def check_json(value: Any) -> None:
    """Refuse what PostgreSQL's jsonb cannot hold, JSON cannot express, or breaks the nesting and
    number limits, saying where."""
    if not json_plainly_ok(value):  # or only unusual types (str or int subclasses): the slow walk decides
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


_decode_json = json.JSONDecoder().decode


def from_json(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON text as ``json.loads`` does, for the JSON PostgreSQL sends (UTF-8 bytes):
    without ``json.loads``'s detection of the encoding, and an empty object (what most messages
    have as headers) without parsing it. Installed as the json/jsonb loader of the connections
    that claim messages, where parsing is a part of every message's cost."""
    if data == b"{}":
        return {}
    if not isinstance(data, str):
        data = bytes(data).decode("utf-8", "surrogatepass")
    return _decode_json(data)


# The JSON text PostgreSQL prints for a jsonb value has a space after each ',' and ':'; sent that
# way, a value's text is as long as the one the server's size limits measure (except floats
# written with an exponent, 1e+16, which PostgreSQL prints digit by digit).
to_sql_json = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": "), allow_nan=False).encode


def utf8_size(text: str) -> int:
    """Bytes of ``text`` in UTF-8."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value (PostgreSQL's jsonb has no NaN or Infinity)")


def json_text_value(text: str) -> Any:
    """JSON text a person typed (a payload to edit), parsed as ``json.loads`` does but refusing
    ``NaN``, ``Infinity`` and ``-Infinity``, which Python's parser takes and jsonb does not: a
    ``ValueError`` (``json.JSONDecodeError`` for text that is not JSON at all)."""
    return json.loads(text, parse_constant=_not_json)

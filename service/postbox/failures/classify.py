"""Failure classification as data: rules map exceptions, SQLSTATEs and HTTP statuses to transient,
permanent or unknown outcome. User rules come first; the first rule that matches wins."""

from __future__ import annotations

import logging
import math
import re
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError

from postbox.config.settings import mask_text
from postbox.failures.outcomes import Outcome, Permanent, Retry, UnknownOutcome
from postbox.failures.policy import FailureKind

log = logging.getLogger("postbox.worker")

__all__ = [
    "DEFAULT_RULES",
    "Classification",
    "Classifier",
    "Rule",
    "fingerprint",
    "http_status_of",
    "retry_after_of",
    "sqlstate_of",
]

TRANSIENT_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})
PERMANENT_HTTP = frozenset({400, 401, 403, 404, 405, 409, 410, 413, 415, 422})

# SQLSTATE prefixes: serialization failure, deadlock, connection trouble, shutdown, resources,
# lock not available, query cancelled (a timeout): worth retrying.
TRANSIENT_SQLSTATES = (
    "40001",
    "40P01",
    "08",
    "57P01",
    "57P02",
    "57P03",
    "53",
    "55P03",
    "57014",
    "58",
)
# Data and integrity errors, undefined objects, privileges: retrying the same message cannot help.
PERMANENT_SQLSTATES = ("22", "23", "42", "2B", "P0001")


def sqlstate_of(error: BaseException) -> str | None:
    for e in (error, getattr(error, "orig", None)):
        code = getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)
        if isinstance(code, str):
            return code
    return None


def http_status_of(error: BaseException) -> int | None:
    """The HTTP status carried by an exception (``status``/``status_code``, or on ``.response``)."""
    for obj in (error, getattr(error, "response", None)):
        for attr in ("status_code", "status"):
            value = getattr(obj, attr, None)
            if isinstance(value, int) and 100 <= value <= 599:
                return value
    return None


def retry_after_of(error: BaseException) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds form) or a ``retry_after`` attribute."""
    value = getattr(error, "retry_after", None)
    if isinstance(value, int | float):
        return float(value) if value >= 0 else None  # not NaN, nor negative
    headers = getattr(error, "headers", None) or getattr(getattr(error, "response", None), "headers", None)
    if headers is not None:
        raw = headers.get("Retry-After") or headers.get("retry-after")
        if raw is not None:
            try:
                seconds = float(str(raw).strip())
            except ValueError:
                return None
            return None if math.isnan(seconds) else max(0.0, seconds)  # NaN is no delay
    return None


@dataclass(frozen=True)
class Rule:
    """Matches an error by exception type, SQLSTATE prefix, HTTP status or predicate (all given must match)."""

    kind: FailureKind
    exceptions: tuple[type[BaseException], ...] = ()
    sqlstates: tuple[str, ...] = ()
    http_statuses: frozenset[int] = frozenset()
    predicate: Callable[[BaseException], bool] | None = None
    name: str = ""

    def matches(self, error: BaseException) -> bool:
        if self.exceptions and not isinstance(error, self.exceptions):
            return False
        if self.sqlstates:
            code = sqlstate_of(error)
            if code is None or not code.startswith(self.sqlstates):
                return False
        if self.http_statuses:
            status = http_status_of(error)
            if status is None or status not in self.http_statuses:
                return False
        return self.predicate is None or self.predicate(error)


DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(FailureKind.TRANSIENT, sqlstates=TRANSIENT_SQLSTATES, name="transient SQLSTATE"),
    Rule(FailureKind.PERMANENT, sqlstates=PERMANENT_SQLSTATES, name="permanent SQLSTATE"),
    Rule(FailureKind.TRANSIENT, http_statuses=TRANSIENT_HTTP, name="transient HTTP status"),
    Rule(FailureKind.PERMANENT, http_statuses=PERMANENT_HTTP, name="permanent HTTP status"),
    Rule(FailureKind.TRANSIENT, http_statuses=frozenset(range(500, 600)), name="HTTP 5xx"),
    Rule(FailureKind.PERMANENT, http_statuses=frozenset(range(400, 500)), name="HTTP 4xx"),
    Rule(FailureKind.PERMANENT, exceptions=(ValidationError,), name="validation error"),
    Rule(
        FailureKind.TRANSIENT,
        exceptions=(TimeoutError, ConnectionError),
        name="timeout or connection",
    ),
    Rule(
        FailureKind.PERMANENT,
        exceptions=(
            KeyError,
            ValueError,
            TypeError,
            LookupError,
            AttributeError,
            NotImplementedError,
        ),
        name="malformed message or handler bug",
    ),
)


@dataclass(frozen=True)
class Classification:
    kind: FailureKind
    error_type: str
    message: str
    traceback: str
    retry_after: float | None = None
    rule: str = ""


@dataclass
class Classifier:
    """Classify errors: explicit outcomes first, then user rules, then the defaults, else transient."""

    rules: Sequence[Rule] = field(default_factory=tuple)
    default: FailureKind = FailureKind.TRANSIENT

    def with_rules(self, rules: Iterable[Rule]) -> Classifier:
        return Classifier(tuple(rules) + tuple(self.rules), self.default)

    def classify(self, error: BaseException) -> Classification:
        tb = mask_text("".join(traceback.format_exception(error)))
        error_type = type(error).__name__
        message = mask_text(_text(error) or error_type)
        if isinstance(error, Outcome):
            kind = (
                FailureKind.PERMANENT
                if isinstance(error, Permanent)
                else FailureKind.UNKNOWN
                if isinstance(error, UnknownOutcome)
                else FailureKind.TRANSIENT
            )
            after = error.after if isinstance(error, Retry) else None
            return Classification(kind, error_type, message, tb, after, "explicit outcome")
        for rule in (*self.rules, *DEFAULT_RULES):
            if _matches(rule, error):
                after = retry_after_of(error) if rule.kind is FailureKind.TRANSIENT else None
                return Classification(rule.kind, error_type, message, tb, after, rule.name)
        return Classification(self.default, error_type, message, tb, None, "default")


def _text(error: BaseException) -> str:
    """``str(error)``, or what says it failed: an exception whose ``__str__`` raises is classified too."""
    try:
        return str(error)
    except Exception as broken:
        return f"<str() of this {type(error).__name__} raised {type(broken).__name__}: {broken!r}>"


def _matches(rule: Rule, error: BaseException) -> bool:
    """Whether ``rule`` matches ``error``; a rule whose predicate raises does not (and is logged):
    a rule's bug must not keep the attempt from being recorded."""
    try:
        return rule.matches(error)
    except Exception:
        log.warning(
            "the classification rule %r raised; taken as not matching", rule.name or rule, exc_info=True
        )
        return False


_NUMBERS = re.compile(r"\b\d+(\.\d+)?\b|0x[0-9a-f]+", re.IGNORECASE)
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)


def fingerprint(error_type: str, message: str) -> str:
    """A grouping key: the error type plus its message with ids, numbers and quoted values removed."""
    normal = _UUID.sub("<uuid>", message)
    normal = _QUOTED.sub("<str>", normal)
    normal = _NUMBERS.sub("<n>", normal)
    normal = " ".join(normal.split())[:200]
    return f"{error_type}: {normal}"

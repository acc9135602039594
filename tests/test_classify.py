"""Classification rules: each maps a kind of error to transient, permanent or unknown outcome."""

from __future__ import annotations

import psycopg
import pytest
from pydantic import BaseModel, ValidationError

from postbox.failures.classify import Classifier, Rule, fingerprint
from postbox.failures.outcomes import Permanent, Retry, Transient, UnknownOutcome
from postbox.failures.policy import FailureKind

T, P, U = FailureKind.TRANSIENT, FailureKind.PERMANENT, FailureKind.UNKNOWN


class HTTPError(Exception):
    """Shaped like httpx/requests errors: a response with a status code and headers."""

    def __init__(self, status: int, headers: dict[str, str] | None = None) -> None:
        super().__init__(f"HTTP {status}")
        self.response = type("Response", (), {"status_code": status, "headers": headers or {}})()


class Model(BaseModel):
    amount: int


def validation_error() -> ValidationError:
    try:
        Model(amount="many")  # type: ignore[arg-type]
    except ValidationError as e:
        return e
    raise AssertionError


CASES = [
    (psycopg.errors.SerializationFailure(), T),
    (psycopg.errors.DeadlockDetected(), T),
    (psycopg.errors.AdminShutdown(), T),
    (psycopg.errors.QueryCanceled(), T),
    (psycopg.errors.LockNotAvailable(), T),
    (psycopg.OperationalError("connection lost"), T),
    (psycopg.errors.UniqueViolation(), P),
    (psycopg.errors.InvalidTextRepresentation(), P),
    (psycopg.errors.UndefinedTable(), P),
    (psycopg.errors.RaiseException(), P),
    (HTTPError(429), T),
    (HTTPError(502), T),
    (HTTPError(503), T),
    (HTTPError(504), T),
    (HTTPError(500), T),
    (HTTPError(400), P),
    (HTTPError(404), P),
    (HTTPError(409), P),
    (HTTPError(410), P),
    (HTTPError(422), P),
    (HTTPError(418), P),
    (TimeoutError(), T),
    (ConnectionRefusedError(), T),
    (validation_error(), P),
    (KeyError("amount"), P),
    (ValueError("bad"), P),
    (RuntimeError("who knows"), T),
    (Transient("flaky"), T),
    (Retry(after=3), T),
    (Permanent("bad"), P),
    (UnknownOutcome("lost response"), U),
]


@pytest.mark.parametrize(("error", "kind"), CASES, ids=[f"{type(e).__name__}-{k.value}" for e, k in CASES])
def test_default_rules(error, kind):
    """Each built-in rule classifies its errors as the spec says (CLASS-1)."""
    assert Classifier().classify(error).kind is kind


def test_http_429_with_retry_after_is_transient_with_that_delay():
    """429 Too Many Requests with Retry-After: 7 is retried after 7 s."""
    c = Classifier().classify(HTTPError(429, {"Retry-After": "7"}))
    assert c.kind is T and c.retry_after == 7.0


def test_explicit_retry_carries_its_delay():
    assert Classifier().classify(Retry(after=2.5)).retry_after == 2.5


def test_user_rules_come_first():
    """A user rule overrides the defaults (here: timeouts of this handler are permanent)."""
    c = Classifier().with_rules([Rule(P, exceptions=(TimeoutError,), name="ours")])
    result = c.classify(TimeoutError())
    assert result.kind is P and result.rule == "ours"
    by_predicate = Classifier().with_rules([Rule(U, predicate=lambda e: "maybe" in str(e))])
    assert by_predicate.classify(RuntimeError("maybe sent")).kind is U


def test_classification_keeps_type_message_and_traceback():
    try:
        raise KeyError("amount")
    except KeyError as e:
        c = Classifier().classify(e)
    assert c.error_type == "KeyError" and "amount" in c.message and "raise KeyError" in c.traceback


def test_fingerprint_groups_errors_that_differ_only_in_values():
    a = fingerprint("ValueError", "order 123 has amount '17.50' for 7f1e2d3c-0000-4000-8000-000000000001")
    b = fingerprint("ValueError", "order 456 has amount '3.00' for 7f1e2d3c-0000-4000-8000-000000000002")
    assert a == b and a.startswith("ValueError: order <n> has amount <str>")
    assert fingerprint("KeyError", "x") != fingerprint("ValueError", "x")

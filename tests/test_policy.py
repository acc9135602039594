"""Retry policy as pure functions: backoff envelopes (property tests) and the limits that end retries."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from postbox.failures.policy import (
    Backoff,
    DeadLetter,
    FailureKind,
    RetryAt,
    RetryPolicy,
    backoff_delay,
    decide,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)

policies = st.builds(
    RetryPolicy,
    strategy=st.sampled_from(list(Backoff)),
    base_delay=st.floats(0.001, 10),
    max_delay=st.floats(10, 1000),
    jitter=st.floats(0, 5),
    max_attempts=st.integers(1, 50),
)


@settings(max_examples=400)
@given(policy=policies, attempt=st.integers(1, 200), seed=st.integers(0, 2**32))
def test_every_delay_lies_in_its_strategys_envelope(policy, attempt, seed):
    """Each strategy's delay is within its formula's envelope and never above max_delay."""
    delay = backoff_delay(policy, attempt, random.Random(seed))
    exp = min(policy.max_delay, policy.base_delay * 2.0 ** min(attempt - 1, 1000))
    assert 0 <= delay <= policy.max_delay
    match policy.strategy:
        case Backoff.FIXED:
            assert delay == pytest.approx(min(policy.base_delay, policy.max_delay))
        case Backoff.LINEAR:
            assert delay == pytest.approx(min(policy.base_delay * attempt, policy.max_delay))
        case Backoff.EXPONENTIAL:
            assert delay == pytest.approx(exp)
        case Backoff.EXPONENTIAL_FULL_JITTER:
            assert 0 <= delay <= exp
        case Backoff.EXPONENTIAL_ADDITIVE_JITTER:
            assert exp <= delay + 1e-9 and delay <= min(exp + policy.jitter, policy.max_delay) + 1e-9


def test_full_jitter_is_the_default_and_spreads():
    """The default strategy is exponential with full jitter: delays for one attempt differ."""
    p = RetryPolicy()
    assert p.strategy is Backoff.EXPONENTIAL_FULL_JITTER
    rng = random.Random(7)
    assert len({round(backoff_delay(p, 5, rng), 6) for _ in range(20)}) > 15


@given(policy=policies, seed=st.integers(0, 2**32))
def test_attempts_limit_ends_retries_at_max_attempts(policy, seed):
    """Transient failures retry until attempt max_attempts, which is dead-lettered as exhausted."""
    policy = policy.model_copy(update={"max_total_seconds": None, "max_age_seconds": None})
    rng = random.Random(seed)
    for attempt in range(1, policy.max_attempts):
        d = decide(
            policy,
            FailureKind.TRANSIENT,
            attempt=attempt,
            now=T0,
            first_failed_at=T0,
            received_at=T0,
            rng=rng,
        )
        assert isinstance(d, RetryAt) and d.at >= T0
    last = decide(
        policy,
        FailureKind.TRANSIENT,
        attempt=policy.max_attempts,
        now=T0,
        first_failed_at=T0,
        received_at=T0,
        rng=rng,
    )
    assert isinstance(last, DeadLetter) and last.reason == "attempts_exhausted"


def test_total_time_limit_since_first_failure():
    """The retry that would land past max_total_seconds since the first failure is not scheduled."""
    p = RetryPolicy(strategy=Backoff.FIXED, base_delay=10, max_attempts=100, max_total_seconds=60)
    rng = random.Random(1)
    assert isinstance(
        decide(
            p,
            FailureKind.TRANSIENT,
            attempt=5,
            now=T0 + timedelta(seconds=50),
            first_failed_at=T0,
            received_at=T0,
            rng=rng,
        ),
        RetryAt,
    )
    d = decide(
        p,
        FailureKind.TRANSIENT,
        attempt=6,
        now=T0 + timedelta(seconds=51),
        first_failed_at=T0,
        received_at=T0,
        rng=rng,
    )
    assert isinstance(d, DeadLetter) and d.reason == "deadline"


def test_age_limit_since_receipt():
    """max_age_seconds counts from receipt, whenever the first failure was."""
    p = RetryPolicy(strategy=Backoff.FIXED, base_delay=10, max_total_seconds=None, max_age_seconds=100)
    d = decide(
        p,
        FailureKind.TRANSIENT,
        attempt=1,
        now=T0 + timedelta(seconds=95),
        first_failed_at=None,
        received_at=T0,
        rng=random.Random(),
    )
    assert isinstance(d, DeadLetter) and d.reason == "deadline"


def test_max_delay_caps_computed_delays_and_refuses_longer_explicit_ones():
    """Computed delays stop at max_delay; an explicit Retry longer than max_delay ends the retries."""
    p = RetryPolicy(strategy=Backoff.EXPONENTIAL, base_delay=1, max_delay=30, max_total_seconds=None)
    assert backoff_delay(p, 40, random.Random()) == 30
    ok = decide(
        p,
        FailureKind.TRANSIENT,
        attempt=1,
        now=T0,
        first_failed_at=None,
        received_at=T0,
        rng=random.Random(),
        explicit_delay=29,
    )
    assert isinstance(ok, RetryAt) and ok.at == T0 + timedelta(seconds=29)
    too_long = decide(
        p,
        FailureKind.TRANSIENT,
        attempt=1,
        now=T0,
        first_failed_at=None,
        received_at=T0,
        rng=random.Random(),
        explicit_delay=31,
    )
    assert isinstance(too_long, DeadLetter) and too_long.reason == "deadline"


def test_permanent_and_unknown_outcomes():
    """Permanent: dead-lettered at once. Unknown: retried only when the handler is idempotent."""
    p = RetryPolicy()
    kw = {"attempt": 1, "now": T0, "first_failed_at": None, "received_at": T0, "rng": random.Random()}
    assert decide(p, FailureKind.PERMANENT, **kw).reason == "permanent"
    assert decide(p, FailureKind.UNKNOWN, **kw).reason == "unknown_outcome"
    assert isinstance(decide(p, FailureKind.UNKNOWN, idempotent=True, **kw), RetryAt)


def test_explanations_say_what_was_decided():
    """A retry decision reads like 'transient, attempt 3 of 5, next in 4 s'."""
    p = RetryPolicy(strategy=Backoff.FIXED, base_delay=4, max_attempts=5)
    d = decide(
        p, FailureKind.TRANSIENT, attempt=3, now=T0, first_failed_at=T0, received_at=T0, rng=random.Random()
    )
    assert d.explanation == "transient, attempt 3 of 5, next in 4 s"


def test_incoherent_policy_is_refused():
    """max_delay below base_delay, or zero attempts, fail validation with the field named."""
    with pytest.raises(ValidationError, match="max_delay"):
        RetryPolicy(base_delay=10, max_delay=1)
    with pytest.raises(ValidationError, match="max_attempts"):
        RetryPolicy(max_attempts=0)

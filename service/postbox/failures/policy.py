"""Retry policy: backoff strategies and limits, as pure functions of (policy, attempt, time, randomness).

Nothing here touches a database or the wall clock, so every decision is unit-testable.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "Backoff",
    "DeadLetter",
    "Decision",
    "FailureKind",
    "RetryAt",
    "RetryPolicy",
    "backoff_delay",
    "decide",
]


class Backoff(StrEnum):
    FIXED = "fixed"
    LINEAR = "linear"
    EXPONENTIAL = "exponential"
    EXPONENTIAL_FULL_JITTER = "exponential_full_jitter"
    EXPONENTIAL_ADDITIVE_JITTER = "exponential_additive_jitter"


class FailureKind(StrEnum):
    TRANSIENT = "transient"
    PERMANENT = "permanent"
    UNKNOWN = "unknown"


class RetryPolicy(BaseModel):
    """How often and how long to retry a transiently failing message; the first limit hit ends it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Backoff = Backoff.EXPONENTIAL_FULL_JITTER
    base_delay: float = Field(default=1.0, gt=0, description="seconds")
    max_delay: float = Field(default=300.0, gt=0, description="seconds; also the longest explicit Retry")
    jitter: float = Field(default=1.0, ge=0, description="seconds of additive jitter (additive strategy)")
    max_attempts: int = Field(default=10, ge=1, description="deliveries in all, the first included")
    max_total_seconds: float | None = Field(default=3600.0, gt=0, description="since the first failure")
    max_age_seconds: float | None = Field(default=None, gt=0, description="since the message was received")

    @model_validator(mode="after")
    def _coherent(self) -> RetryPolicy:
        if self.max_delay < self.base_delay:
            raise ValueError(f"max_delay ({self.max_delay}) must not be below base_delay ({self.base_delay})")
        return self

    def horizon_seconds(self) -> float:
        """The longest a message can stay in retries under this policy (for retention checks)."""
        limits = [self.max_delay * (self.max_attempts - 1)]
        limits += [x for x in (self.max_total_seconds, self.max_age_seconds) if x is not None]
        return min(limits)


def backoff_delay(policy: RetryPolicy, attempt: int, rng: random.Random) -> float:
    """Seconds to wait after failed attempt number ``attempt`` (1 = the first delivery)."""
    n = max(attempt, 1)
    base, cap = policy.base_delay, policy.max_delay
    exp = cap if n > 64 else min(cap, base * 2.0 ** (n - 1))
    match policy.strategy:
        case Backoff.FIXED:
            delay = base
        case Backoff.LINEAR:
            delay = base * n
        case Backoff.EXPONENTIAL:
            delay = exp
        case Backoff.EXPONENTIAL_FULL_JITTER:
            delay = rng.uniform(0.0, exp)
        case Backoff.EXPONENTIAL_ADDITIVE_JITTER:
            delay = exp + rng.uniform(0.0, policy.jitter)
    return min(delay, cap)


@dataclass(frozen=True)
class RetryAt:
    at: datetime
    explanation: str
    kind: Literal["retry"] = "retry"


@dataclass(frozen=True)
class DeadLetter:
    reason: str  # attempts_exhausted | deadline | permanent | unknown_outcome
    explanation: str
    kind: Literal["dead_letter"] = "dead_letter"


Decision = RetryAt | DeadLetter


def decide(
    policy: RetryPolicy,
    failure: FailureKind,
    *,
    attempt: int,
    now: datetime,
    first_failed_at: datetime | None,
    received_at: datetime,
    rng: random.Random,
    explicit_delay: float | None = None,
    idempotent: bool = False,
) -> Decision:
    """What to do after failed attempt ``attempt``: retry at a time, or dead-letter with a reason."""
    if failure is FailureKind.PERMANENT:
        return DeadLetter("permanent", f"permanent failure on attempt {attempt}")
    if failure is FailureKind.UNKNOWN and not idempotent:
        return DeadLetter(
            "unknown_outcome",
            f"outcome unknown on attempt {attempt} and the handler is not declared idempotent",
        )
    if attempt >= policy.max_attempts:
        return DeadLetter(
            "attempts_exhausted", f"{failure.value}, attempt {attempt} of {policy.max_attempts}"
        )
    if explicit_delay is not None:
        if explicit_delay > policy.max_delay:
            return DeadLetter(
                "deadline",
                f"retry requested in {explicit_delay:g} s, beyond max_delay {policy.max_delay:g} s",
            )
        delay = explicit_delay
    else:
        delay = backoff_delay(policy, attempt, rng)
    at = now + timedelta(seconds=delay)
    first = first_failed_at or now
    if policy.max_total_seconds is not None and (at - first).total_seconds() > policy.max_total_seconds:
        return DeadLetter(
            "deadline",
            f"next attempt would be {policy.max_total_seconds:g} s past the first failure",
        )
    if policy.max_age_seconds is not None and (at - received_at).total_seconds() > policy.max_age_seconds:
        return DeadLetter("deadline", f"next attempt would be {policy.max_age_seconds:g} s past receipt")
    return RetryAt(at, f"{failure.value}, attempt {attempt} of {policy.max_attempts}, next in {delay:.3g} s")

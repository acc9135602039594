"""A consumer-level circuit breaker: when a dependency looks down, stop burning every message's
attempts and probe with one message at a time instead.

What it counts is an outage signal, not attempts: it opens when most recent attempts failed
transiently *and* those failures involve many distinct keys. One bad batch retrying over and over
(a few keys failing again and again) is the retry policy's business and never opens it; permanent
failures never count as failures at all.

Pure logic with an injected monotonic clock; the worker asks it how many messages to claim.
State is per worker process: each process trips and recovers on what it sees.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["BreakerSettings", "BreakerState", "CircuitBreaker"]


class BreakerSettings(BaseModel):
    """When to open (share of transient failures in a window, spread over enough distinct keys) and
    how often to probe while open."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    window_seconds: float = Field(default=30.0, gt=0)
    min_attempts: int = Field(default=20, ge=1, description="attempts in the window before it may open")
    failure_ratio: float = Field(default=0.8, gt=0, le=1)
    min_keys: int = Field(
        default=10, ge=1, description="distinct keys among the window's transient failures before it may open"
    )
    probe_interval: float = Field(default=5.0, gt=0, description="seconds between probes while open")


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class _Bucket:
    """The outcomes of a hundredth of the window."""

    number: int
    attempts: int = 0
    failed: int = 0  # transient failures
    keys: set[str] = field(default_factory=set)  # keys that failed transiently (at most min_keys)


class CircuitBreaker:
    # Outcomes are counted in buckets of a hundredth of the window: recording costs the same and
    # memory stays the same whatever the rate (an outcome leaves the window up to one bucket late).
    _BUCKETS = 100

    def __init__(self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._resolution = settings.window_seconds / self._BUCKETS
        self._buckets: deque[_Bucket] = deque()
        self._attempts = 0
        self._failed = 0
        # Per key, in how many of the window's buckets it failed transiently: its length is the
        # number of distinct failing keys. A bucket keeps at most min_keys keys (that many in one
        # bucket is already enough), so memory stays bounded whatever the number of keys.
        self._failing_keys: dict[str, int] = {}
        self.state = BreakerState.CLOSED
        self._next_probe = 0.0
        self.opened_count = 0

    def _trim(self, now: float) -> None:
        """Drop the buckets whose every outcome is older than the window."""
        horizon = now - self.settings.window_seconds
        while self._buckets and (self._buckets[0].number + 1) * self._resolution <= horizon:
            old = self._buckets.popleft()
            self._attempts -= old.attempts
            self._failed -= old.failed
            for key in old.keys:
                left = self._failing_keys[key] - 1
                if left:
                    self._failing_keys[key] = left
                else:
                    del self._failing_keys[key]

    def _clear(self) -> None:
        self._buckets.clear()
        self._attempts = self._failed = 0
        self._failing_keys.clear()

    def _count(self, now: float, transient_failure: bool, key: str, attempts: int = 1) -> None:
        number = int(now // self._resolution)
        if not self._buckets or self._buckets[-1].number != number:
            self._buckets.append(_Bucket(number))
        last = self._buckets[-1]
        last.attempts += attempts
        self._attempts += attempts
        if transient_failure:
            last.failed += 1
            self._failed += 1
            if key not in last.keys and len(last.keys) < self.settings.min_keys:
                last.keys.add(key)
                self._failing_keys[key] = self._failing_keys.get(key, 0) + 1

    def _outage(self) -> bool:
        """Enough attempts, most of them failed transiently, over enough distinct keys."""
        return (
            self._attempts >= self.settings.min_attempts
            and self._failed / self._attempts >= self.settings.failure_ratio
            and len(self._failing_keys) >= self.settings.min_keys
        )

    def record(self, transient_failure: bool, key: str, attempts: int = 1) -> BreakerState:
        """Record an attempt's outcome (``key``: the message's key; a permanent failure is not a
        transient failure), or ``attempts`` successful ones at once (a batch handler's call);
        returns the state after it."""
        if not self.settings.enabled:
            return self.state
        with self._lock:
            now = self._clock()
            if self.state is BreakerState.HALF_OPEN:
                if transient_failure:
                    self._open(now)
                    return self.state
                self.state = BreakerState.CLOSED
                self._clear()
                attempts -= 1  # the probe's success closed the circuit; any others count from there
                if attempts <= 0:
                    return self.state
            self._count(now, transient_failure, key, attempts)
            self._trim(now)
            if self.state is BreakerState.CLOSED and self._outage():
                self._open(now)
            return self.state

    def describe(self) -> str:
        """What the window holds, for the log line of a change of state."""
        with self._lock:
            keys = len(self._failing_keys)
            many = " or more" if keys >= self.settings.min_keys else ""
            return (
                f"{self._failed} of {self._attempts} attempts in the last {self.settings.window_seconds:g} s "
                f"failed transiently, across {keys}{many} keys"
            )

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self._next_probe = now + self.settings.probe_interval
        self.opened_count += 1

    def claim_limit(self, batch_size: int) -> int:
        """How many messages to claim now: the batch when closed, one probe when due, else none."""
        if not self.settings.enabled:
            return batch_size
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return batch_size
            now = self._clock()
            if self.state is BreakerState.OPEN and now >= self._next_probe:
                self.state = BreakerState.HALF_OPEN
                self._next_probe = now + self.settings.probe_interval
                return 1
            if self.state is BreakerState.HALF_OPEN and now >= self._next_probe:
                # The probe never reported (its slot died or it was released): probe again.
                self._next_probe = now + self.settings.probe_interval
                return 1
            return 0

    def release_probe(self) -> None:
        """A claimed probe was not run (nothing to probe with): allow another one soon."""
        with self._lock:
            if self.state is BreakerState.HALF_OPEN:
                self.state = BreakerState.OPEN
                self._next_probe = self._clock()

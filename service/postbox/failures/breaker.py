"""A consumer-level circuit breaker: when most recent attempts fail transiently (a dependency is
down), stop burning every message's attempts and probe with one message at a time instead.

Pure logic with an injected monotonic clock; the worker asks it how many messages to claim.
State is per worker process: each process trips and recovers on what it sees.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["BreakerSettings", "BreakerState", "CircuitBreaker"]


class BreakerSettings(BaseModel):
    """When to open (share of transient failures in a window) and how often to probe while open."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    window_seconds: float = Field(default=30.0, gt=0)
    min_attempts: int = Field(default=20, ge=1, description="attempts in the window before it may open")
    failure_ratio: float = Field(default=0.8, gt=0, le=1)
    probe_interval: float = Field(default=5.0, gt=0, description="seconds between probes while open")


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    # Outcomes are counted in buckets of a hundredth of the window: recording costs the same and
    # memory stays the same whatever the rate (an outcome leaves the window up to one bucket late).
    _BUCKETS = 100

    def __init__(self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._resolution = settings.window_seconds / self._BUCKETS
        self._buckets: deque[list[int]] = deque()  # [bucket number, attempts, transient failures]
        self._attempts = 0
        self._failed = 0
        self.state = BreakerState.CLOSED
        self._next_probe = 0.0
        self.opened_count = 0

    def _trim(self, now: float) -> None:
        """Drop the buckets whose every outcome is older than the window."""
        horizon = now - self.settings.window_seconds
        while self._buckets and (self._buckets[0][0] + 1) * self._resolution <= horizon:
            _, attempts, failed = self._buckets.popleft()
            self._attempts -= attempts
            self._failed -= failed

    def _clear(self) -> None:
        self._buckets.clear()
        self._attempts = self._failed = 0

    def record(self, transient_failure: bool) -> BreakerState:
        """Record an attempt's outcome; returns the state after it."""
        if not self.settings.enabled:
            return self.state
        with self._lock:
            now = self._clock()
            if self.state is BreakerState.HALF_OPEN:
                if transient_failure:
                    self._open(now)
                else:
                    self.state = BreakerState.CLOSED
                    self._clear()
                return self.state
            bucket = int(now // self._resolution)
            if not self._buckets or self._buckets[-1][0] != bucket:
                self._buckets.append([bucket, 0, 0])
            last = self._buckets[-1]
            last[1] += 1
            self._attempts += 1
            if transient_failure:
                last[2] += 1
                self._failed += 1
            self._trim(now)
            if (
                self.state is BreakerState.CLOSED
                and self._attempts >= self.settings.min_attempts
                and self._failed / self._attempts >= self.settings.failure_ratio
            ):
                self._open(now)
            return self.state

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

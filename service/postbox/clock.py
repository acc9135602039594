"""Time, injected: the worker and the SQL functions it calls use ``clock.now()``, never the wall clock
directly, so tests can move time without sleeping."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from typing import Protocol

__all__ = ["Clock", "FakeClock", "SystemClock"]


class Clock(Protocol):
    def now(self) -> datetime: ...


class SystemClock:
    """The real time, in UTC."""

    def now(self) -> datetime:
        return datetime.now(UTC)


class FakeClock:
    """A clock tests move by hand: the real time plus an offset that ``advance`` grows.

    It keeps running with the wall clock, so rows the database stamps with ``now()`` are due for it
    too; jumping ahead makes retries and leases due without waiting for them.
    """

    def __init__(self) -> None:
        self._offset = timedelta(0)
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return datetime.now(UTC) + self._offset

    def advance(self, seconds: float) -> datetime:
        with self._lock:
            self._offset += timedelta(seconds=seconds)
        return self.now()

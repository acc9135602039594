"""The circuit breaker's pure logic, on an injected clock."""

from __future__ import annotations

from postbox.failures.breaker import BreakerSettings, BreakerState, CircuitBreaker


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _breaker(**settings: float) -> tuple[CircuitBreaker, _Clock]:
    clock = _Clock()
    defaults: dict[str, float] = {
        "window_seconds": 30,
        "min_attempts": 10,
        "failure_ratio": 0.8,
        "probe_interval": 5,
    }
    return CircuitBreaker(BreakerSettings(**(defaults | settings)), clock), clock


def test_opens_when_most_recent_attempts_failed_transiently():
    """Below min_attempts it stays closed; at the failure ratio it opens and claims nothing."""
    b, _ = _breaker()
    for _ in range(9):
        assert b.record(True) is BreakerState.CLOSED
    assert b.record(True) is BreakerState.OPEN
    assert b.claim_limit(50) == 0


def test_successes_keep_it_closed():
    """7 failures in 10 is under a 0.8 ratio."""
    b, _ = _breaker()
    for i in range(10):
        b.record(i < 7)
    assert b.state is BreakerState.CLOSED
    assert b.claim_limit(50) == 50


def test_outcomes_leave_the_window():
    """Failures older than the window no longer count: fresh successes dilute nothing stale."""
    b, clock = _breaker()
    for _ in range(8):
        b.record(True)
    clock.now += 31
    for _ in range(8):
        b.record(False)
    for _ in range(2):
        b.record(True)
    assert b.state is BreakerState.CLOSED  # 2 failures in 10 within the window, not 10 in 18


def _probing() -> CircuitBreaker:
    """A breaker opened by 10 transient failures, its probe interval passed, one probe claimed."""
    b, clock = _breaker()
    for _ in range(10):
        b.record(True)
    clock.now += 5
    assert b.claim_limit(50) == 1
    return b


def test_probes_one_message_and_closes_on_success():
    """Open: one probe after probe_interval; a success closes it and starts a fresh window."""
    b = _probing()
    assert b.state is BreakerState.HALF_OPEN
    assert b.record(False) is BreakerState.CLOSED
    for _ in range(9):
        assert b.record(True) is BreakerState.CLOSED  # the old failures were forgotten


def test_a_failed_probe_opens_it_again():
    """A transient failure of the probe opens it again: nothing more is claimed."""
    b = _probing()
    assert b.record(True) is BreakerState.OPEN
    assert b.claim_limit(50) == 0


def test_memory_stays_bounded_whatever_the_rate():
    """A long run at a high rate keeps at most one counter per hundredth of the window (recording
    once kept every outcome of the window and summed them all on every attempt)."""
    b, clock = _breaker(min_attempts=1)
    for i in range(200_000):
        clock.now += 0.001  # 1,000 attempts a second for 200 s
        b.record(i % 10 == 9)
    assert b.state is BreakerState.CLOSED
    assert len(b._buckets) <= 101
    assert b._attempts == sum(n for _, n, _ in b._buckets) <= 30_000 + 300

"""The circuit breaker's pure logic, on an injected clock: it opens on an outage signal (transient
failures across many keys), not on one bad batch retrying."""

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
        "min_keys": 5,
    }
    return CircuitBreaker(BreakerSettings(**(defaults | settings)), clock), clock


def test_opens_when_most_recent_attempts_failed_transiently():
    """Below min_attempts it stays closed; at the failure ratio, over enough keys, it opens and
    claims nothing."""
    b, _ = _breaker()
    for i in range(9):
        assert b.record(True, f"k{i}") is BreakerState.CLOSED
    assert b.record(True, "k9") is BreakerState.OPEN
    assert b.claim_limit(50) == 0
    assert b.describe() == "10 of 10 attempts in the last 30 s failed transiently, across 5 or more keys"


def test_one_bad_batch_retrying_does_not_open_it():
    """With the defaults: a batch of 3 keys failing transiently 50 times each (150 failed attempts,
    every attempt of the window) is retries, not an outage: the breaker stays closed."""
    b = CircuitBreaker(BreakerSettings(), _Clock())
    for _ in range(50):
        for key in ("order-1", "order-2", "order-3"):
            assert b.record(True, key) is BreakerState.CLOSED
    assert b.claim_limit(100) == 100
    assert b.describe() == "150 of 150 attempts in the last 30 s failed transiently, across 3 keys"


def test_transient_failures_across_many_keys_open_it():
    """With the defaults: attempts over 20 keys, 90 % of them failing transiently, open it."""
    b = CircuitBreaker(BreakerSettings(), _Clock())
    states = [b.record(i % 10 != 9, f"k{i % 20}") for i in range(40)]
    assert states[-1] is BreakerState.OPEN
    assert states.index(BreakerState.OPEN) >= 19  # not before min_attempts (20)
    assert b.claim_limit(100) == 0


def test_an_outage_opens_it_and_a_successful_probe_closes_it():
    """With the defaults: opened by transient failures across 20 keys, it claims nothing until
    probe_interval has passed, then one probe; the probe's success closes it."""
    clock = _Clock()
    b = CircuitBreaker(BreakerSettings(), clock)
    for i in range(20):
        b.record(True, f"k{i}")
    assert b.state is BreakerState.OPEN
    clock.now += 4.9
    assert b.claim_limit(100) == 0
    clock.now += 0.1
    assert b.claim_limit(100) == 1
    assert b.state is BreakerState.HALF_OPEN
    assert b.record(False, "k0") is BreakerState.CLOSED
    assert b.claim_limit(100) == 100


def test_permanent_failures_never_count():
    """Permanent failures are recorded as attempts that did not fail transiently: across many keys
    and every attempt, they never open it (they are bad messages, not a dependency down)."""
    b, _ = _breaker()
    for i in range(100):
        assert b.record(False, f"k{i}") is BreakerState.CLOSED


def test_failing_keys_leave_the_window():
    """Keys whose failures are older than the window no longer count towards min_keys."""
    b, clock = _breaker(min_attempts=1)
    for i in range(4):
        b.record(True, f"old{i}")
    clock.now += 31
    for _ in range(20):
        assert b.record(True, "new") is BreakerState.CLOSED  # 1 key in the window, not 5
    assert b.record(True, "new2") is BreakerState.CLOSED
    assert "across 2 keys" in b.describe()


def test_successes_keep_it_closed():
    """7 failures in 10 is under a 0.8 ratio."""
    b, _ = _breaker()
    for i in range(10):
        b.record(i < 7, f"k{i}")
    assert b.state is BreakerState.CLOSED
    assert b.claim_limit(50) == 50


def test_outcomes_leave_the_window():
    """Failures older than the window no longer count: fresh successes dilute nothing stale."""
    b, clock = _breaker()
    for i in range(8):
        b.record(True, f"k{i}")
    clock.now += 31
    for i in range(8):
        b.record(False, f"k{i}")
    for i in range(2):
        b.record(True, f"k{i}")
    assert b.state is BreakerState.CLOSED  # 2 failures in 10 within the window, not 10 in 18


def _probing() -> CircuitBreaker:
    """A breaker opened by 10 transient failures, its probe interval passed, one probe claimed."""
    b, clock = _breaker()
    for i in range(10):
        b.record(True, f"k{i}")
    clock.now += 5
    assert b.claim_limit(50) == 1
    return b


def test_probes_one_message_and_closes_on_success():
    """Open: one probe after probe_interval; a success closes it and starts a fresh window."""
    b = _probing()
    assert b.state is BreakerState.HALF_OPEN
    assert b.record(False, "k0") is BreakerState.CLOSED
    for i in range(9):
        assert b.record(True, f"k{i}") is BreakerState.CLOSED  # the old failures were forgotten


def test_a_failed_probe_opens_it_again():
    """A transient failure of the probe opens it again: nothing more is claimed."""
    b = _probing()
    assert b.record(True, "k0") is BreakerState.OPEN
    assert b.claim_limit(50) == 0


def test_memory_stays_bounded_whatever_the_rate():
    """A long run at a high rate keeps at most one counter per hundredth of the window (recording
    once kept every outcome of the window and summed them all on every attempt)."""
    b, clock = _breaker(min_attempts=1)
    for i in range(200_000):
        clock.now += 0.001  # 1,000 attempts a second for 200 s, every one of another key
        b.record(i % 10 == 9, f"k{i}")
    assert b.state is BreakerState.CLOSED
    assert len(b._buckets) <= 101
    assert b._attempts == sum(bucket.attempts for bucket in b._buckets) <= 30_000 + 300
    assert all(len(bucket.keys) <= 5 for bucket in b._buckets)  # at most min_keys kept per bucket
    assert len(b._failing_keys) <= 5 * 101


def test_a_batch_of_successes_counts_as_that_many_successes():
    """record(False, key, n) leaves the breaker as n successful record() calls would: in the window
    (diluting failures), and after a probe (which it closes, the rest counted from there)."""
    one, _ = _breaker()
    many, _ = _breaker()
    for b in (one, many):
        for i in range(7):
            b.record(True, f"k{i}")
    for _ in range(3):
        one.record(False, "k")
    assert many.record(False, "k", 3) is BreakerState.CLOSED
    for b in (one, many):
        assert b.record(True, "k7") is BreakerState.CLOSED  # 8 failures in 11: under 0.8
        assert b.record(True, "k8") is BreakerState.CLOSED  # 9 in 12
    assert vars(one)["_attempts"] == vars(many)["_attempts"] == 12

    probed = _probing()
    assert probed.record(False, "k", 4) is BreakerState.CLOSED
    assert vars(probed)["_attempts"] == 3  # the probe closed it; the other 3 are in the new window
    assert probed.record(False, "k", 0) is BreakerState.CLOSED

"""The worker's batched metric updates give the same figures as updating one message at a time."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from postbox.operations.counters import observe_many


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name.removeprefix(name), tuple(sorted(s.labels.items()))): s.value
        for metric in registry.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


@pytest.mark.parametrize(
    "values",
    [
        [0.0, 0.005, 0.0051, 0.1, 0.1, 2.5, 9.99, 10.0, 11.0, 1e9, -1.0],  # on, between and past the bounds
        [0.25] * 50,  # a call's share, the same for each of its messages
        [3.0, float("nan")],
        [],
    ],
)
def test_observe_many_is_observe_for_each_value(values):
    one_by_one, at_once = CollectorRegistry(), CollectorRegistry()
    a = Histogram("h", "h", ["consumer"], registry=one_by_one).labels("c")
    b = Histogram("h", "h", ["consumer"], registry=at_once).labels("c")
    for v in values:
        a.observe(v)
    observe_many(b, values)
    expected, got = _samples(one_by_one, "h"), _samples(at_once, "h")
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, nan_ok=True), key


def test_a_batchs_handler_runs_reach_the_histograms_as_one_observation_each():
    """record_runs: each run's handler time under its consumer and type, and the receive-to-start
    time of first attempts only (a retry's start says nothing of the queue's lag)."""
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from postbox.operations import counters

    t0 = datetime(2026, 12, 7, tzinfo=UTC)
    runs = [
        (
            SimpleNamespace(consumer="rr-a", type="x", attempt=1, received_at=t0),
            t0 + timedelta(seconds=0.02),
            0.003,
        ),
        (
            SimpleNamespace(consumer="rr-a", type="x", attempt=2, received_at=t0),
            t0 + timedelta(seconds=9),
            0.5,
        ),
        (
            SimpleNamespace(consumer="rr-a", type=None, attempt=1, received_at=t0),
            t0 + timedelta(seconds=0.3),
            0.07,
        ),
        (
            SimpleNamespace(consumer="rr-b", type="x", attempt=1, received_at=t0),
            t0 - timedelta(seconds=1),
            2.0,
        ),
    ]

    def count(histogram: Histogram, *labels: str) -> tuple[float, float]:
        samples = {s.name: s.value for m in histogram.labels(*labels).collect() for s in m.samples}
        return samples[histogram._name + "_count"], samples[histogram._name + "_sum"]

    before = {
        "handler a x": count(counters.HANDLER_SECONDS, "rr-a", "x"),
        "handler a": count(counters.HANDLER_SECONDS, "rr-a", ""),
        "handler b x": count(counters.HANDLER_SECONDS, "rr-b", "x"),
        "lag a": count(counters.START_LAG_SECONDS, "rr-a"),
        "lag b": count(counters.START_LAG_SECONDS, "rr-b"),
    }
    counters.record_runs(runs)
    after = {
        "handler a x": count(counters.HANDLER_SECONDS, "rr-a", "x"),
        "handler a": count(counters.HANDLER_SECONDS, "rr-a", ""),
        "handler b x": count(counters.HANDLER_SECONDS, "rr-b", "x"),
        "lag a": count(counters.START_LAG_SECONDS, "rr-a"),
        "lag b": count(counters.START_LAG_SECONDS, "rr-b"),
    }
    grew = {k: (after[k][0] - before[k][0], round(after[k][1] - before[k][1], 6)) for k in after}
    assert grew == {
        "handler a x": (2, 0.503),
        "handler a": (1, 0.07),
        "handler b x": (1, 2.0),
        "lag a": (2, 0.32),  # the retry (attempt 2) has no lag
        "lag b": (1, 0.0),  # a clock behind the database's counts as no lag
    }

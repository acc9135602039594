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

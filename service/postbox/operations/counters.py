"""What every Postbox process counts as things happen: process counters, histograms and the circuit
breaker's state, updated by the worker, relay, bridge and maintenance (messages processed, failed,
retried, dead-lettered; handler, claim and publish durations). Labels are bounded: consumer,
destination, message type, error type and classification, never a key or a message id (and never a
secret: label values pass through :func:`postbox.config.settings.mask_text`).

Served with the database gauges by :mod:`postbox.operations.metrics`.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector

from postbox.config.settings import mask_text

__all__ = [
    "BREAKER_STATE",
    "BRIDGE_MESSAGES",
    "BUILD",
    "CLAIM_SECONDS",
    "DEAD_LETTERED",
    "DELIVERIES",
    "FAILED",
    "HANDLER_SECONDS",
    "MAINTENANCE_LAST_SUCCESS",
    "MAINTENANCE_ROWS",
    "MAINTENANCE_RUNS",
    "PROCESSED",
    "RECOVERY_SECONDS",
    "REDELIVERIES",
    "REGISTRY",
    "RELAY_DEAD_LETTERED",
    "RELAY_FAILED",
    "RELAY_PUBLISHED",
    "RELAY_SECONDS",
    "RETRIED",
    "START_LAG_SECONDS",
    "SUCCEEDED_AFTER_RETRY",
    "observe_many",
    "record_breaker",
    "record_claim",
    "record_failure",
    "record_runs",
    "record_success",
    "record_successes",
]

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LONG_SECONDS = (0.1, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 86400.0)

BUILD = Info("postbox_build", "Postbox version of this process.", registry=REGISTRY)

# --- inbox worker ----------------------------------------------------------------------------
DELIVERIES = Counter(
    "postbox_deliveries",
    "Messages claimed by a worker, by attempt number (1, 2, 3, 4, 5+); attempt > 1 is a redelivery.",
    ["consumer", "attempt"],
    registry=REGISTRY,
)
REDELIVERIES = Counter(
    "postbox_redeliveries",
    "Messages claimed again after an earlier delivery (a retry or a worker that died mid-attempt).",
    ["consumer"],
    registry=REGISTRY,
)
PROCESSED = Counter(
    "postbox_messages_processed",
    "Messages whose handler succeeded and whose effects committed.",
    ["consumer", "type"],
    registry=REGISTRY,
)
SUCCEEDED_AFTER_RETRY = Counter(
    "postbox_messages_succeeded_after_retry",
    "Messages that succeeded on a later attempt than the first (share: divide by processed).",
    ["consumer", "type"],
    registry=REGISTRY,
)
FAILED = Counter(
    "postbox_messages_failed",
    "Failed attempts, by classification (transient, permanent, unknown, lease_expired) and error type.",
    ["consumer", "type", "kind", "error_type"],
    registry=REGISTRY,
)
RETRIED = Counter(
    "postbox_messages_retried",
    "Failed attempts after which a retry was scheduled.",
    ["consumer", "type"],
    registry=REGISTRY,
)
DEAD_LETTERED = Counter(
    "postbox_messages_dead_lettered",
    "Messages moved to the dead-letter table, by reason.",
    ["consumer", "type", "reason"],
    registry=REGISTRY,
)
HANDLER_SECONDS = Histogram(
    "postbox_handler_duration_seconds",
    "Time a handler ran, successful or not.",
    ["consumer", "type"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
CLAIM_SECONDS = Histogram(
    "postbox_claim_duration_seconds",
    "Time of one claim (a batch of heads of keys) as the worker sees it, round trip included.",
    ["consumer"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
START_LAG_SECONDS = Histogram(
    "postbox_receive_to_start_seconds",
    "From a message's receipt to the start of its first attempt.",
    ["consumer"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
RECOVERY_SECONDS = Histogram(
    "postbox_failure_to_success_seconds",
    "From a message's first failure to its success.",
    ["consumer"],
    buckets=_LONG_SECONDS,
    registry=REGISTRY,
)
BREAKER_STATE = Gauge(
    "postbox_circuit_breaker_state",
    "Circuit breaker of this process for a consumer: 0 closed, 1 half-open (probing), 2 open.",
    ["consumer"],
    registry=REGISTRY,
)

# --- relay and bridge -------------------------------------------------------------------------
RELAY_PUBLISHED = Counter(
    "postbox_relay_published", "Outbox rows published and confirmed.", ["destination"], registry=REGISTRY
)
RELAY_FAILED = Counter(
    "postbox_relay_failed",
    "Failed publish attempts, by classification and error type.",
    ["destination", "kind", "error_type"],
    registry=REGISTRY,
)
RELAY_DEAD_LETTERED = Counter(
    "postbox_relay_dead_lettered",
    "Outbox rows moved to the dead-letter table, by reason.",
    ["destination", "reason"],
    registry=REGISTRY,
)
RELAY_SECONDS = Histogram(
    "postbox_relay_publish_duration_seconds",
    "Time of one batch's publish call to the destination (until confirmed).",
    ["destination"],
    buckets=_SECONDS,
    registry=REGISTRY,
)
BRIDGE_MESSAGES = Counter(
    "postbox_bridge_messages",
    "Broker messages taken by the bridge, by outcome (new, duplicate, conflict, rejected).",
    ["consumer", "outcome"],
    registry=REGISTRY,
)

# --- maintenance ------------------------------------------------------------------------------
# The job's name is the label `task`: `job` is Prometheus's own label (the scrape job), and a
# target's `job` would be renamed `exported_job` on the way in, so no rule could select on it.
MAINTENANCE_RUNS = Counter(
    "postbox_maintenance_runs",
    "Maintenance job runs of this process, by job (label task) and outcome (ok, failed).",
    ["task", "outcome"],
    registry=REGISTRY,
)
MAINTENANCE_ROWS = Counter(
    "postbox_maintenance_rows",
    "Rows deleted, released or repaired by maintenance jobs (label task).",
    ["task"],
    registry=REGISTRY,
)
MAINTENANCE_LAST_SUCCESS = Gauge(
    "postbox_maintenance_last_success_timestamp_seconds",
    "When each maintenance job (label task) last succeeded in this cluster (Unix time, from postbox.maintenance_runs).",
    ["task"],
    registry=REGISTRY,
)


# --- hooks ------------------------------------------------------------------------------------


_children: dict[tuple[int, tuple[str, ...]], Any] = {}


def _child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, cached: the label lookup costs more than the update itself."""
    key = (id(metric), labels)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*(mask_text(v) for v in labels))
    return child


def _type(message: Any) -> str:
    return message.type or ""


def _attempt_label(attempt: int) -> str:
    return str(attempt) if attempt < 5 else "5+"


def record_claim(consumer: str, messages: Sequence[Any], seconds: float) -> None:
    """A claim of ``messages``: its time, and the deliveries counted once per attempt label."""
    _child(CLAIM_SECONDS, consumer).observe(seconds)
    if not messages:
        return
    labels: dict[str, int] = {}
    for m in messages:
        label = _attempt_label(m.attempt)
        labels[label] = labels.get(label, 0) + 1
    for label, n in labels.items():
        _child(DELIVERIES, consumer, label).inc(n)
    redelivered = len(messages) - labels.get("1", 0)
    if redelivered:
        _child(REDELIVERIES, consumer).inc(redelivered)


def observe_many(histogram: Any, values: Sequence[float]) -> None:
    """``histogram.observe(v)`` for each of ``values`` (a labelled child, no exemplars), with one
    update of its sum and of each bucket it touches, where each observation would take the locks
    of both. Falls back to observing one by one if prometheus_client lays out its histograms
    otherwise (a test holds the two to the same figures)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(values) < 2:
        for v in values:
            histogram.observe(v)
        return
    counts: dict[int, int] = {}
    for v in values:
        if math.isnan(v):  # in no bucket, as observe() has it
            continue
        i = bisect_left(bounds, v)  # the first bucket whose bound is >= v (the last is +Inf)
        counts[i] = counts.get(i, 0) + 1
    total.inc(math.fsum(values))
    for i, n in counts.items():
        buckets[i].inc(n)


def record_runs(runs: Sequence[tuple[Any, datetime, float]]) -> None:
    """The handler runs of a batch, each ``(message, when its handler started, the seconds it took)``
    (a batch handler's call: its share for each message): the time from receipt to the first
    attempt's start, and the handler's time, with one update of each histogram per consumer (and
    type) where an observation each would take its locks every time."""
    lags: dict[str, list[float]] = {}
    took: dict[tuple[str, str], list[float]] = {}
    for message, started, seconds in runs:
        if message.attempt == 1:
            lag = max(0.0, (started - message.received_at).total_seconds())
            lags.setdefault(message.consumer, []).append(lag)
        took.setdefault((message.consumer, _type(message)), []).append(seconds)
    for consumer, values in lags.items():
        observe_many(_child(START_LAG_SECONDS, consumer), values)
    for labels, values in took.items():
        observe_many(_child(HANDLER_SECONDS, *labels), values)


def record_successes(messages: Sequence[Any], now: datetime) -> None:
    """After the commit of a batch's successful messages: :func:`record_success` for each, with
    one update of the processed count per consumer and type."""
    counts: dict[tuple[str, str], int] = {}
    for message in messages:
        labels = (message.consumer, _type(message))
        counts[labels] = counts.get(labels, 0) + 1
        if message.attempt > 1 or message.first_failed_at is not None:
            _after_failures(message, now)
    for labels, n in counts.items():
        _child(PROCESSED, *labels).inc(n)


def record_success(message: Any, now: datetime) -> None:
    """After the commit of a successful message."""
    _child(PROCESSED, message.consumer, _type(message)).inc()
    _after_failures(message, now)


def _after_failures(message: Any, now: datetime) -> None:
    if message.attempt > 1:
        _child(SUCCEEDED_AFTER_RETRY, message.consumer, _type(message)).inc()
    if message.first_failed_at is not None:
        _child(RECOVERY_SECONDS, message.consumer).observe(
            max(0.0, (now - message.first_failed_at).total_seconds())
        )


def record_failure(message: Any, kind: str, error_type: str, dead_letter_reason: str | None) -> None:
    """After the commit of a failed attempt: retried, or dead-lettered for ``dead_letter_reason``."""
    t = _type(message)
    _child(FAILED, message.consumer, t, kind or "unknown", error_type or "").inc()
    if dead_letter_reason is None:
        _child(RETRIED, message.consumer, t).inc()
    else:
        _child(DEAD_LETTERED, message.consumer, t, dead_letter_reason).inc()


_BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}


def record_breaker(consumer: str, state: str) -> None:
    _child(BREAKER_STATE, consumer).set(_BREAKER_VALUES.get(state, 0))

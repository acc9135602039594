"""The checker of the chaos harness: what the producers logged, the effects the handlers appended,
the dead letters, and what the broker received, against the invariants of DESIGN.md."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import psycopg

from tests.apps.chaos import (
    DEAD_KINDS,
    KINDS,
    LATE_ACCEPTED,
    LATE_REFUSED,
    MISBEHAVIOUR_DDL,
    STUCK_KINDS,
    expected_dead_letter,
    misbehaviour,
)
from tests.chaos.load import Delivery, ProducerLog

EFFECTS_DDL = (
    """
CREATE TABLE IF NOT EXISTS chaos_effects (
    id          bigserial PRIMARY KEY,
    message_id  text NOT NULL,
    key         text NOT NULL,
    sequence    bigint,
    prev_seq    bigint,
    attempt     integer NOT NULL,
    worker_pid  integer NOT NULL,
    inbox_id    bigint,
    received_at timestamptz,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS chaos_key_state (
    key       text PRIMARY KEY,
    last_seq  bigint NOT NULL
);
"""
    + MISBEHAVIOUR_DDL
)

# What a misbehaving attempt must be recorded as in postbox.attempts: (kind, error_type, decision).
_RECORDED_AS = {
    **dict.fromkeys(DEAD_KINDS, ("permanent", "HandlerEndedTransaction", "dead_letter")),
    **dict.fromkeys(STUCK_KINDS, ("timeout", "HandlerTimeout", "retry")),
    "system_exit": ("transient", "SystemExit", "retry"),
    "keyboard_interrupt": ("transient", "KeyboardInterrupt", "retry"),
    "async_system_exit": ("transient", "SystemExit", "retry"),
    "async_keyboard_interrupt": ("transient", "KeyboardInterrupt", "retry"),
    "swallowed_db_error": ("transient", "HandlerLeftTransactionInError", "retry"),
}


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 3)


@dataclass
class Verdict:
    """The figures of one run; ``problems()`` lists every broken invariant (empty: passed)."""

    produced: int = 0
    ok: int = 0
    failed: int = 0
    unknown: int = 0
    unknown_committed: int = 0
    done: int = 0
    dead_lettered: int = 0
    live: int = 0
    lost: list[str] = field(default_factory=list)
    phantoms: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    order_violations: list[str] = field(default_factory=list)
    attempt_violations: list[str] = field(default_factory=list)
    unexpected_dead: list[str] = field(default_factory=list)
    retried_effects: int = 0
    lease_takeovers: int = 0
    events_expected: int = 0
    events_delivered: int = 0
    events_redelivered: int = 0
    events_missing: list[str] = field(default_factory=list)
    events_phantom: list[str] = field(default_factory=list)
    event_order_violations: list[str] = field(default_factory=list)
    outbox_left: int = 0
    drain_seconds: float | None = None
    missing_dead: list[str] = field(default_factory=list)
    # Misbehaving handlers (F6); None when the run injected none.
    misbehaviours: dict[str, int] | None = None
    misbehaviour_violations: list[str] = field(default_factory=list)
    late_writes_tried: int = 0
    late_writes_accepted: int = 0
    late_rows: int = 0
    committed_by_handler: int = 0  # effects of earlier messages of a batch made durable by a handler's COMMIT
    rerun_after_rollback: int = 0  # earlier messages of a batch undone by a handler's ROLLBACK, run again
    waits: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def problems(self) -> list[str]:
        out = []
        for name in (
            "lost",
            "phantoms",
            "duplicates",
            "order_violations",
            "attempt_violations",
            "unexpected_dead",
            "missing_dead",
            "misbehaviour_violations",
            "events_missing",
            "events_phantom",
            "event_order_violations",
        ):
            items: list[str] = getattr(self, name)
            if items:
                out.append(f"{name}: {len(items)} e.g. {items[:5]}")
        if self.live:
            out.append(f"{self.live} messages still live")
        if self.outbox_left:
            out.append(f"{self.outbox_left} outbox rows not published")
        if self.late_writes_accepted:
            out.append(f"{self.late_writes_accepted} late writes by abandoned handler code were accepted")
        if self.late_rows:
            out.append(f"{self.late_rows} late writes by abandoned handler code were committed")
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "produced": self.produced,
            "ok": self.ok,
            "failed": self.failed,
            "unknown": self.unknown,
            "unknown_committed": self.unknown_committed,
            "done": self.done,
            "dead_lettered": self.dead_lettered,
            "lost": len(self.lost),
            "phantoms": len(self.phantoms),
            "duplicate_effects": len(self.duplicates),
            "order_violations": len(self.order_violations),
            "attempt_violations": len(self.attempt_violations),
            "unexpected_dead_letters": len(self.unexpected_dead),
            "retried_effects": self.retried_effects,
            "lease_takeovers": self.lease_takeovers,
            "events_expected": self.events_expected,
            "events_delivered": self.events_delivered,
            "events_redelivered": self.events_redelivered,
            "events_missing": len(self.events_missing),
            "events_phantom": len(self.events_phantom),
            "event_order_violations": len(self.event_order_violations),
            "drain_seconds": self.drain_seconds,
            **(self._misbehaviour_summary() if self.misbehaviours is not None else {}),
            "problems": self.problems(),
        }

    def _misbehaviour_summary(self) -> dict[str, Any]:
        assert self.misbehaviours is not None
        return {
            "misbehaviours": sum(self.misbehaviours.values()),
            "misbehaviour_kinds": dict(self.misbehaviours),
            "missing_dead_letters": len(self.missing_dead),
            "misbehaviour_violations": len(self.misbehaviour_violations),
            "committed_by_handler_commit": self.committed_by_handler,
            "rerun_after_handler_rollback": self.rerun_after_rollback,
            "late_writes_tried": self.late_writes_tried,
            "late_writes": self.late_writes_accepted + self.late_rows,
            "waits": len(self.waits),
            "wait_max_s": round(max(self.waits), 3) if self.waits else None,
            "wait_p99_s": _percentile(self.waits, 0.99),
            "latency_max_s": round(max(self.latencies), 3) if self.latencies else None,
            "latency_p99_s": _percentile(self.latencies, 0.99),
        }


def check(
    url: str,
    consumer: str,
    log: ProducerLog,
    deliveries: list[Delivery],
    *,
    max_attempts: int,
    permanent_rate: float,
    misbehave_rate: float = 0.0,
) -> Verdict:
    """Check every invariant once the faults are healed and the backlog drained.

    - nothing lost: every ``ok`` message (and every ``unknown`` one that did commit) has an effect or
      a dead letter (or is still live, reported apart); a ``failed`` message left no trace;
    - no duplicate effect; per key, effects follow the sequence with no gap but the dead letters,
      and each handler saw its predecessor's effect; attempts within the retry policy;
    - exactly the injected permanent failures and the handlers that ended the transaction are
      dead-lettered, each with its reason;
    - with misbehaving handlers (``misbehave_rate``): each misbehaving attempt recorded as it must
      be (see ``_RECORDED_AS``), no late write of abandoned code accepted or committed; and how long
      well-behaved messages of a stuck handler's batch waited for their effect (from the stuck
      attempt's start), and every well-behaved message from its receipt;
    - every committed effect's outbox event reached the broker at least once, per key in order of
      first delivery, and no event of a rolled-back attempt was ever published.
    """
    v = Verdict()
    with psycopg.connect(url, autocommit=True) as c:
        stored = {
            r[0]
            for r in c.execute("SELECT message_id FROM postbox.inbox_dedup WHERE consumer = %s", (consumer,))
        }
        effects = c.execute(
            "SELECT message_id, key, sequence, prev_seq, attempt FROM chaos_effects ORDER BY id"
        ).fetchall()
        effect_times = {
            r[0]: (r[1], r[2])
            for r in c.execute("SELECT message_id, at, received_at FROM chaos_effects ORDER BY id DESC")
        }
        dead = c.execute(
            "SELECT message_id, reason, attempt FROM postbox.dead_letters WHERE origin = 'inbox' AND consumer = %s",
            (consumer,),
        ).fetchall()
        v.dead_lettered = len(dead)
        live = {
            r[0] for r in c.execute("SELECT message_id FROM postbox.inbox WHERE consumer = %s", (consumer,))
        }
        v.live = len(live)
        v.outbox_left = c.execute("SELECT count(*) FROM postbox.outbox").fetchone()[0]  # type: ignore[index]
        v.lease_takeovers = c.execute(
            "SELECT count(*) FROM postbox.attempts WHERE origin = 'inbox' AND kind = 'lease_expired'"
        ).fetchone()[0]  # type: ignore[index]
        outbox_dead = c.execute(
            "SELECT message_id, reason FROM postbox.dead_letters WHERE origin = 'outbox'"
        ).fetchall()
    with log.lock:
        sent = list(log.sent)
    v.produced = len(sent)
    v.ok = sum(1 for s in sent if s.outcome == "ok")
    v.failed = sum(1 for s in sent if s.outcome == "failed")
    v.unknown = sum(1 for s in sent if s.outcome == "unknown")
    v.unknown_committed = sum(1 for s in sent if s.outcome == "unknown" and s.message_id in stored)
    v.phantoms = [s.message_id for s in sent if s.outcome == "failed" and s.message_id in stored]
    exists = [s for s in sent if s.outcome == "ok" or (s.outcome == "unknown" and s.message_id in stored)]

    effect_count: dict[str, int] = defaultdict(int)
    for mid, *_ in effects:
        effect_count[mid] += 1
    v.done = len(effect_count)
    v.duplicates = [m for m, n in effect_count.items() if n > 1]
    v.retried_effects = sum(1 for e in effects if e[4] > 1)
    dead_ids = {d[0] for d in dead}
    # Lost: neither done, nor dead-lettered, nor still live (a drain that timed out leaves live ones).
    v.lost = [
        s.message_id
        for s in exists
        if s.message_id not in effect_count and s.message_id not in dead_ids and s.message_id not in live
    ]

    def reason(mid: str) -> str | None:
        return expected_dead_letter(mid, misbehave_rate=misbehave_rate, permanent_rate=permanent_rate)

    v.unexpected_dead = [f"{d[0]}: {d[1]}" for d in dead if d[1] != reason(d[0])]
    v.missing_dead = [
        f"{s.message_id}: expected {reason(s.message_id)}"
        for s in exists
        if reason(s.message_id) and s.message_id not in dead_ids and s.message_id not in live
    ]
    v.unexpected_dead += [f"outbox {d[0]}: {d[1]}" for d in outbox_dead]
    v.attempt_violations = [f"{e[0]} effect at attempt {e[4]}" for e in effects if e[4] > max_attempts]
    v.attempt_violations += [f"{d[0]} dead at attempt {d[2]}" for d in dead if d[2] > max_attempts + 1]

    # Per key order: the expected sequences are those of the messages that exist, minus dead letters.
    expected: dict[str, list[int]] = defaultdict(list)
    for s in exists:
        if s.message_id not in dead_ids and s.message_id not in live:
            expected[s.key].append(s.sequence)
    got: dict[str, list[int]] = defaultdict(list)
    for mid, key, seq, prev, _attempt in effects:
        before = got[key][-1] if got[key] else None
        if prev != before:
            v.order_violations.append(f"{key}: {mid} (seq {seq}) saw prev {prev}, expected {before}")
        got[key].append(seq)
    for key in set(expected) | set(got):
        want = sorted(expected.get(key, []))
        have = got.get(key, [])
        if have != want:
            v.order_violations.append(f"{key}: effects {have[:12]} expected {want[:12]}")

    # Outbox events: at least once, per key in order of first delivery, never one of a rolled-back attempt.
    by_mid_seq = {mid: (key, seq) for mid, key, seq, _p, _a in effects}
    v.events_expected = len(by_mid_seq)
    first: dict[str, Delivery] = {}
    for d in deliveries:
        if d.message_id in first:
            v.events_redelivered += 1
        else:
            first[d.message_id] = d
    v.events_delivered = len(first)
    v.events_missing = [f"out-{m}" for m in by_mid_seq if f"out-{m}" not in first]
    v.events_phantom = [m for m, d in first.items() if d.source not in by_mid_seq]
    per_key: dict[str, list[int]] = defaultdict(list)
    for d in first.values():  # dict order is first-delivery order
        per_key[d.key].append(d.sequence)
    for key, seqs in per_key.items():
        if seqs != sorted(seqs):
            v.event_order_violations.append(f"{key}: delivered {seqs[:12]}")
    if misbehave_rate > 0:
        _check_misbehaviour(url, consumer, v, effects, effect_times, dead, misbehave_rate, permanent_rate)
    return v


def _check_misbehaviour(
    url: str,
    consumer: str,
    v: Verdict,
    effects: list[tuple[Any, ...]],
    effect_times: dict[str, tuple[Any, Any]],
    dead: list[tuple[Any, ...]],
    misbehave_rate: float,
    permanent_rate: float,
) -> None:
    """The figures and checks of misbehaving handlers (F6)."""
    with psycopg.connect(url, autocommit=True) as c:
        logged = c.execute(
            "SELECT message_id, inbox_id, attempt, kind, batch, at FROM chaos_misbehaviour ORDER BY id"
        ).fetchall()
        recorded = {
            (r[0], r[1]): (r[2], r[3], r[4])
            for r in c.execute(
                "SELECT message_id, attempt, kind, error_type, decision FROM postbox.attempts"
                " WHERE origin = 'inbox' AND queue = %s",
                (consumer,),
            )
        }
        v.late_rows = c.execute("SELECT count(*) FROM chaos_late_writes").fetchone()[0]  # type: ignore[index]
        message_of: dict[int, str] = dict(
            c.execute("SELECT inbox_id, message_id FROM postbox.inbox_dedup WHERE consumer = %s", (consumer,))
        )
    v.misbehaviours = dict.fromkeys(KINDS, 0)
    first_effect_attempt: dict[str, int] = {}
    for mid, _key, _seq, _prev, attempt in effects:
        first_effect_attempt.setdefault(mid, attempt)
    dead_attempt = {d[0]: d[2] for d in dead}

    def well_behaved(mid: str) -> bool:
        return misbehaviour(mid, misbehave_rate) is None and not permanent_failure_of(mid)

    def permanent_failure_of(mid: str) -> bool:
        return expected_dead_letter(mid, misbehave_rate=0.0, permanent_rate=permanent_rate) is not None

    for mid, inbox_id, attempt, kind, batch, at in logged:
        if kind == LATE_REFUSED:
            v.late_writes_tried += 1
            continue
        if kind == LATE_ACCEPTED:
            v.late_writes_tried += 1
            v.late_writes_accepted += 1
            v.misbehaviour_violations.append(f"{mid}: the late write of attempt {attempt} was accepted")
            continue
        v.misbehaviours[kind] = v.misbehaviours.get(kind, 0) + 1
        if kind != misbehaviour(mid, misbehave_rate):
            v.misbehaviour_violations.append(
                f"{mid}: misbehaved as {kind}, scheduled {misbehaviour(mid, misbehave_rate)}"
            )
        want = _RECORDED_AS[kind]
        got = recorded.get((mid, attempt))
        if got != want:
            v.misbehaviour_violations.append(
                f"{mid} ({kind}): attempt {attempt} recorded as {got}, expected {want}"
            )
        if kind in DEAD_KINDS and dead_attempt.get(mid, 1) != 1:
            v.misbehaviour_violations.append(
                f"{mid} ({kind}): dead-lettered at attempt {dead_attempt[mid]}, not 1"
            )
        if kind not in DEAD_KINDS and first_effect_attempt.get(mid, 2) <= attempt:
            v.misbehaviour_violations.append(
                f"{mid} ({kind}): an effect of its misbehaving attempt {attempt}"
            )
        if kind in ("sql_commit", "sql_rollback", "sql_commit_stuck") and inbox_id in batch:
            # The messages before it in its batch (claim order is run order): a COMMIT made the
            # effects of those that succeeded durable (marked done at once: a second effect would
            # show as a duplicate); a ROLLBACK undid them (any effect is of a later attempt).
            for earlier in batch[: batch.index(inbox_id)]:
                other = message_of.get(earlier)
                if other is None or other not in effect_times:
                    continue
                before = effect_times[other][0] < at
                if kind in ("sql_commit", "sql_commit_stuck") and before:
                    v.committed_by_handler += 1
                elif kind == "sql_rollback" and before:
                    v.misbehaviour_violations.append(f"{other}: its effect survived {mid}'s ROLLBACK")
                elif kind == "sql_rollback":
                    v.rerun_after_rollback += 1
        if kind in STUCK_KINDS:
            # The other messages of its batch: given back at once, processed by another slot.
            for member in batch:
                other = message_of.get(member)
                if other is None or other == mid or not well_behaved(other) or other not in effect_times:
                    continue
                done_at = effect_times[other][0]
                if done_at > at:
                    v.waits.append((done_at - at).total_seconds())
    v.latencies = [
        (done_at - received_at).total_seconds()
        for mid, (done_at, received_at) in effect_times.items()
        if received_at is not None and well_behaved(mid)
    ]

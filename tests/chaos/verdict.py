"""The checker of the chaos harness: what the producers logged, the effects the handlers appended,
the dead letters, and what the broker received, against the invariants of DESIGN.md."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import psycopg

from tests.chaos.load import Delivery, ProducerLog

EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS chaos_effects (
    id          bigserial PRIMARY KEY,
    message_id  text NOT NULL,
    key         text NOT NULL,
    sequence    bigint,
    prev_seq    bigint,
    attempt     integer NOT NULL,
    worker_pid  integer NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS chaos_key_state (
    key       text PRIMARY KEY,
    last_seq  bigint NOT NULL
);
"""


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

    def problems(self) -> list[str]:
        out = []
        for name in (
            "lost",
            "phantoms",
            "duplicates",
            "order_violations",
            "attempt_violations",
            "unexpected_dead",
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
            "problems": self.problems(),
        }


def check(
    url: str, consumer: str, log: ProducerLog, deliveries: list[Delivery], *, max_attempts: int
) -> Verdict:
    """Check every invariant once the faults are healed and the backlog drained.

    - nothing lost: every ``ok`` message (and every ``unknown`` one that did commit) has an effect or
      a dead letter (or is still live, reported apart); a ``failed`` message left no trace;
    - no duplicate effect; per key, effects follow the sequence with no gap but the dead letters,
      and each handler saw its predecessor's effect; attempts within the retry policy;
    - only the injected permanent failures are dead-lettered;
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
    v.unexpected_dead = [f"{d[0]}: {d[1]}" for d in dead if d[1] != "permanent"]
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
    return v

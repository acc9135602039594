"""The invariant checker and a pool of real worker processes, for the concurrency and fault tests.

Method (after Jepsen): record every message produced, let workers process them while faults are
injected, heal, drain, then check: nothing lost, no duplicate effects, per-key order kept.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import typing
from dataclasses import dataclass, field

import psycopg

import postbox
from tests.helpers import REPO


@dataclass
class Produced:
    """Every message a producer committed: message_id -> (key, sequence)."""

    messages: dict[str, tuple[str, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def skewed_keys(n_keys: int, rng: random.Random) -> str:
    """A key with a hot-key skew: low indexes are much more frequent."""
    return f"key-{int(n_keys * rng.random() ** 3)}"


def produce(
    url: str,
    consumer: str,
    count: int,
    n_keys: int,
    produced: Produced,
    seed: int,
    batch: int = 50,
    extra: dict[str, dict[str, object]] | None = None,
) -> None:
    """Commit ``count`` messages in batches; per key, sequences increase in commit order."""
    rng = random.Random(seed)
    next_seq: dict[str, int] = {}
    with psycopg.connect(url) as conn:
        for start in range(0, count, batch):
            msgs = []
            for i in range(start, min(start + batch, count)):
                key = skewed_keys(n_keys, rng)
                seq = next_seq.get(key, 0)
                next_seq[key] = seq + 1
                mid = f"{seed}-{i}"
                payload = (extra or {}).get(mid, {"i": i})
                msgs.append(
                    {
                        "consumer": consumer,
                        "message_id": mid,
                        "key": f"{seed}/{key}",
                        "sequence": seq,
                        "payload": payload,
                    }
                )
            for attempt in range(1, 6):
                try:
                    postbox.receive_many(conn, msgs)
                    conn.commit()
                    break
                except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
                    # As a producer should: PostgreSQL may end this transaction instead of a
                    # migration it deadlocked with (docs/upgrading.md); nothing of it was written.
                    conn.rollback()
                    if attempt == 5:
                        raise
            with produced.lock:
                for m in msgs:
                    produced.messages[m["message_id"]] = (m["key"], m["sequence"])


@dataclass
class Report:
    produced: int
    done: int
    dead_lettered: int
    lost: list[str]
    duplicates: list[str]
    order_violations: list[str]
    live: int

    def assert_ok(self) -> None:
        assert self.lost == [], f"lost messages: {self.lost[:10]}"
        assert self.duplicates == [], f"duplicate effects: {self.duplicates[:10]}"
        assert self.order_violations == [], f"order violations: {self.order_violations[:10]}"
        assert self.live == 0, f"{self.live} messages still live"


def check(url: str, produced: Produced, consumer: str) -> Report:
    with psycopg.connect(url) as c:
        effects = c.execute("SELECT message_id, key, sequence, prev_seq FROM effects ORDER BY id").fetchall()
        dead = {
            r[0]
            for r in c.execute(
                "SELECT message_id FROM postbox.dead_letters WHERE consumer = %s", (consumer,)
            ).fetchall()
        }
        live = c.execute("SELECT count(*) FROM postbox.inbox WHERE consumer = %s", (consumer,)).fetchone()[0]
    seen: dict[str, int] = {}
    for mid, *_ in effects:
        seen[mid] = seen.get(mid, 0) + 1
    duplicates = [m for m, n in seen.items() if n > 1]
    lost = [m for m in produced.messages if m not in seen and m not in dead]
    # Per key: effects in commit order must follow the sequence, skipping only dead-lettered ones,
    # and each handler must have seen its predecessor's effect.
    skipped = {produced.messages[m] for m in dead if m in produced.messages}
    violations = []
    last: dict[str, int] = {}
    for mid, key, seq, prev in effects:
        before = last.get(key)
        expected = 0 if before is None else before + 1
        while (key, expected) in skipped:
            expected += 1
        if seq != expected or prev != (before if before is not None else None):
            violations.append(f"{key}: {mid} seq {seq} after {before} (handler saw {prev})")
        last[key] = seq
    return Report(len(produced.messages), len(seen), len(dead), lost, duplicates, violations, live)


class WorkerPool:
    """Real ``postbox worker`` processes that can be killed and are restarted."""

    def __init__(
        self,
        url: str,
        consumer: str,
        app: str | None,
        processes: int,
        concurrency: int,
        env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
        config: str | None = None,
    ) -> None:
        self.url = url
        self.args = [
            sys.executable,
            "-m",
            "postbox",
            *(["--config", config] if config else []),
            "--database-url",
            url,
            "worker",
            "--consumer",
            consumer,
            *(["--app", app] if app else []),
            "--concurrency",
            str(concurrency),
            "--poll-interval",
            "0.05",
            "--heartbeat-interval",
            "0.3",
            "--stale-after",
            "1.5",
            "--batch-size",
            "10",
            "--grace-period",
            "5",
            *extra_args,
        ]
        self.env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: dict[int, typing.IO[bytes]] = {}
        self.kills = 0
        self.restarts = 0
        for _ in range(processes):
            self.procs.append(self._spawn())

    def _spawn(self) -> subprocess.Popen[bytes]:
        # stderr goes to a file, never an unread pipe: a full pipe would block a chatty worker.
        log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(self.args, env=self.env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)
        self._logs[proc.pid] = log
        return proc

    def stderr_of(self, proc: subprocess.Popen[bytes]) -> str:
        log = self._logs.get(proc.pid)
        if log is None:
            return ""
        log.seek(0)
        return log.read().decode(errors="replace")

    def keep_alive(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                if p.returncode not in (-signal.SIGKILL, 0, -signal.SIGTERM):
                    err = self.stderr_of(p)
                    raise AssertionError(f"worker exited with {p.returncode}: {err[-2000:]}")
                self.procs[i] = self._spawn()
                self.restarts += 1

    def kill_random(self, rng: random.Random) -> None:
        alive = [p for p in self.procs if p.poll() is None]
        if alive:
            rng.choice(alive).send_signal(signal.SIGKILL)
            self.kills += 1

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def terminate_backends(url: str, application_like: str) -> int:
    """pg_terminate_backend on every connection whose application_name matches."""
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name LIKE %s AND pid <> pg_backend_pid() AND datname = current_database()",
            (application_like,),
        ).fetchone()
    return int(row[0]) if row else 0


def run_until(deadline_s: float, done: callable, tick: callable, period: float = 0.1) -> None:  # type: ignore[valid-type]
    """Call ``tick`` every ``period`` until ``done()`` or the deadline (then fail)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if done():
            return
        tick()
        time.sleep(period)
    raise AssertionError(f"did not drain within {deadline_s}s")

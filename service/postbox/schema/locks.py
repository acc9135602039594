"""Changing the schema while Postbox runs: table locks taken without stalling everyone for long.

A migration takes table locks (a trigger replaced on the inbox, a table partitioned) while workers,
relays and producers hold locks of their own, taken in their order. Two things can go wrong:

- the migration waits behind a long transaction, and every receive and claim queues behind the
  migration meanwhile: each attempt therefore waits at most ``lock_timeout`` for a lock;
- the migration and a running process each wait for a lock the other holds: PostgreSQL ends one of
  the two transactions (a deadlock).

Either way the whole migration transaction is rolled back (nothing of it applied) and tried again
after a jittered pause, until ``give_up_after`` seconds have passed; then :class:`LocksUnavailable`
names the sessions that held Postbox's tables.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg

__all__ = ["LockPolicy", "LocksUnavailable", "retry_on_locks"]

log = logging.getLogger("postbox.migrate")

# SQLSTATEs after which the migration transaction is tried again, and what they mean.
RETRYABLE = {
    "40P01": "deadlock with a running process",
    "55P03": "a table lock held by another session",
}

_HOLDERS = """
SELECT a.pid, coalesce(nullif(a.application_name, ''), '-'), coalesce(a.state, '-'),
       extract(epoch FROM clock_timestamp() - a.xact_start)::int,
       string_agg(DISTINCT c.relname, ', ' ORDER BY c.relname)
  FROM pg_locks l
  JOIN pg_class c ON c.oid = l.relation
  JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'postbox'
  JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.granted AND l.pid <> pg_backend_pid() AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
 GROUP BY a.pid, a.application_name, a.state, a.xact_start
 ORDER BY a.xact_start NULLS LAST
 LIMIT 5
"""


class LocksUnavailable(Exception):
    """The migration could not take the table locks it needs in time; says who held them."""


@dataclass(frozen=True)
class LockPolicy:
    """How a migration waits for table locks: ``lock_timeout`` per attempt (seconds), and
    attempts until ``give_up_after`` seconds have passed."""

    lock_timeout: float = 2.0
    give_up_after: float = 300.0

    def __post_init__(self) -> None:
        if self.lock_timeout <= 0 or self.give_up_after < 0:
            raise ValueError("lock_timeout must be > 0 and give_up_after >= 0 (seconds)")

    def set_local(self) -> str:
        """The statement that bounds one attempt's lock waits (inside its transaction)."""
        return f"SET LOCAL lock_timeout = '{max(1, round(self.lock_timeout * 1000))}ms'"


def sqlstate(error: BaseException) -> str | None:
    """The SQLSTATE of a psycopg error, or of the one a SQLAlchemy error wraps."""
    inner = getattr(error, "orig", None) or error
    state = getattr(inner, "sqlstate", None)
    return state if isinstance(state, str) else None


def holders(url: str) -> list[str]:
    """Other sessions holding locks on tables of schema postbox, longest transaction first."""
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
            rows = conn.execute(_HOLDERS).fetchall()
    except psycopg.Error:
        return []
    return [
        f"pid {pid} ({app}, {state}, transaction open {age if age is not None else '?'} s) on {tables}"
        for pid, app, state, age, tables in rows
    ]


def retry_on_locks(
    url: str,
    attempt: Callable[[LockPolicy], None],
    policy: LockPolicy,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Run ``attempt`` (one whole migration transaction) until it commits; again after a deadlock or
    a lock timeout, until ``policy.give_up_after`` has passed."""
    started = clock()
    failures = 0
    while True:
        try:
            attempt(policy)
            return
        except Exception as error:
            state = sqlstate(error)
            if state not in RETRYABLE:
                raise
            failures += 1
            pause = min(5.0, 0.1 * 2**failures) * random.uniform(0.5, 1.0)
            waited = clock() - started
            if waited + pause > policy.give_up_after:
                held = holders(url)
                raise LocksUnavailable(
                    f"could not take the table locks the migration needs within {waited:.0f} s "
                    f"({failures} attempts; last: {RETRYABLE[state]}). Nothing was changed. "
                    + (f"Sessions holding Postbox tables: {'; '.join(held)}. " if held else "")
                    + "Run it again when they are done, or give it longer (--give-up-after)"
                ) from None
            log.warning(
                "migrate: %s; rolled back, trying again in %.1f s (attempt %d)",
                RETRYABLE[state],
                pause,
                failures + 1,
                extra={"event": "migrate_lock_retry"},
            )
            sleep(pause)

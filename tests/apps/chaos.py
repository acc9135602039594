"""The handler side of the chaos harness (``tests/chaos``), run by real ``postbox worker`` processes.

Each attempt appends a row to ``chaos_effects`` (no unique constraint, so a duplicate effect would
show) with the previous sequence the handler saw for its key, the attempt number, the worker's pid,
the message's inbox id and receive time, and writes one outbox event ``out-<message_id>`` to the
destination ``chaos-out`` in the same transaction. Faults are driven by environment variables so
that every process of a run behaves alike:

- ``CHAOS_DIE_RATE``: share of attempts whose process SIGKILLs itself, at a point chosen among before
  the effect, after the effect but before commit, and after commit (F1);
- ``CHAOS_FAIL_RATE``: share of attempts that fail transiently;
- ``CHAOS_PERMANENT_RATE``: share of messages that always fail permanently (dead-lettered, skipped);
- ``CHAOS_HANDLER_SLEEP``: seconds each handler sleeps in Python (widens the window in which a
  SIGSTOP or a terminated connection hits a handler mid-way);
- ``CHAOS_MAX_ATTEMPTS``: the retry policy's ``max_attempts``;
- ``CHAOS_MISBEHAVE_RATE``: share of messages whose handler misbehaves (F6), one of ``KINDS`` per
  message, chosen from its id by :func:`misbehaviour` (the verdict uses the same function);
- ``CHAOS_DATABASE_URL``: where misbehaving handlers log (see below);
- ``CHAOS_STUCK_SECONDS``: how long a stuck handler (sleeping, spinning, blocking its event loop)
  stays stuck before it tries a late write (which must be refused: its slot was abandoned).

A share of messages (``ASYNC_SHARE``) is handled by a coroutine (the handler returns one), so
that the worker's async path runs under every fault too.

Misbehaving handlers log each misbehaviour (and the outcome of each late write) to
``chaos_misbehaviour`` on a connection of their own, in autocommit: it survives the attempt.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import re
import signal
import threading
import time
from collections.abc import Coroutine
from typing import Any

import psycopg

from postbox.failures.outcomes import Permanent
from postbox.failures.policy import Backoff, RetryPolicy
from postbox.inbox.handlers import Context, Message, Registry

CONSUMER = "chaos"
DESTINATION = "chaos-out"
DIE_RATE = float(os.environ.get("CHAOS_DIE_RATE", "0"))
FAIL_RATE = float(os.environ.get("CHAOS_FAIL_RATE", "0"))
PERMANENT_RATE = float(os.environ.get("CHAOS_PERMANENT_RATE", "0"))
HANDLER_SLEEP = float(os.environ.get("CHAOS_HANDLER_SLEEP", "0"))
MAX_ATTEMPTS = int(os.environ.get("CHAOS_MAX_ATTEMPTS", "1000"))
MISBEHAVE_RATE = float(os.environ.get("CHAOS_MISBEHAVE_RATE", "0"))
STUCK_SECONDS = float(os.environ.get("CHAOS_STUCK_SECONDS", "3.5"))
ASYNC_SHARE = 0.2
POLICY = RetryPolicy(
    strategy=Backoff.EXPONENTIAL_FULL_JITTER,
    base_delay=0.01,
    max_delay=0.2,
    max_attempts=MAX_ATTEMPTS,
    max_total_seconds=None,
)

# Misbehaviours that end (or try to end) the worker's transaction: dead-lettered at once with reason
# handler_ended_transaction, at every attempt. The Python-API ones are refused (the handler writes
# its effect first: it must be rolled back); the SQL ones are issued before the effect (written
# after the COMMIT/ROLLBACK, in a transaction of its own that the worker must roll back).
DEAD_KINDS = (
    "api_commit",  # ctx.conn.commit()
    "api_rollback",  # ctx.conn.rollback()
    "api_close",  # ctx.conn.close()
    "api_autocommit",  # ctx.conn.autocommit = True
    "api_commit_swallowed",  # ctx.conn.commit(), the refusal caught and ignored
    "sql_commit",  # ctx.conn.execute("COMMIT")
    "sql_rollback",  # ctx.conn.execute("ROLLBACK")
    "sql_commit_stuck",  # ctx.conn.execute("COMMIT"), then stuck past the time limit (slot abandoned)
)
# Handlers stuck in Python past the time limit (their slot abandoned), at the first attempt only.
STUCK_KINDS = (
    "sleep",  # time.sleep in a sync handler
    "spin",  # a busy loop in a sync handler
    "async_block",  # time.sleep inside an async handler (blocks its event loop)
)
# Other misbehaviours that fail the first attempt only (transient: retried, then succeed).
RETRIED_KINDS = (
    *STUCK_KINDS,
    "system_exit",  # raise SystemExit
    "keyboard_interrupt",  # raise KeyboardInterrupt
    "async_system_exit",  # raise SystemExit in an async handler
    "async_keyboard_interrupt",  # raise KeyboardInterrupt in an async handler
    "swallowed_db_error",  # a database error caught and the handler returns
)
ASYNC_KINDS = ("async_block", "async_system_exit", "async_keyboard_interrupt")
KINDS = (*DEAD_KINDS, *RETRIED_KINDS)
LATE_ACCEPTED = "late_write_accepted"
LATE_REFUSED = "late_write_refused"

MISBEHAVIOUR_DDL = """
CREATE TABLE IF NOT EXISTS chaos_misbehaviour (
    id          bigserial PRIMARY KEY,
    message_id  text NOT NULL,
    inbox_id    bigint NOT NULL,
    attempt     integer NOT NULL,
    kind        text NOT NULL,
    batch       bigint[] NOT NULL DEFAULT '{}',
    worker_pid  integer NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS chaos_late_writes (
    message_id  text NOT NULL,
    attempt     integer NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""

registry = Registry()
_kill_after_commit: set[int] = set()
_claimed = threading.local()  # the inbox ids of the batch the current slot thread claimed last


class _LogConnection:
    """This process's connection for ``_log`` (one, shared by the slots under a lock)."""

    lock = threading.Lock()
    conn: psycopg.Connection[Any] | None = None


_MESSAGE_ID = re.compile(r"m(\d+)-(\d+)")


def _roll(*parts: object) -> float:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def permanent_failure(message_id: str, rate: float | None = None) -> bool:
    """Whether a message is one of the injected permanent failures (the same in every process)."""
    return _roll(message_id, "permanent") < (PERMANENT_RATE if rate is None else rate)


def misbehaviour(message_id: str, rate: float | None = None) -> str | None:
    """The misbehaviour of a message (one of ``KINDS``), or None: the same in every process and in
    the verdict. The producers' ids are ``m<thread>-<n>``: every ``1/rate``-th message of a thread
    misbehaves, the kinds in turn, so that a short run meets every kind; the threads are offset by
    half a period (a misbehaving message's batch holds well-behaved ones) and by half the kinds."""
    rate = MISBEHAVE_RATE if rate is None else rate
    match = _MESSAGE_ID.fullmatch(message_id)
    if rate <= 0 or match is None:
        return None
    thread, n = int(match[1]), int(match[2])
    period = max(1, round(1 / rate))
    n += thread * (period // 2)
    if n % period != period - 1:
        return None
    return KINDS[(n // period + thread * (len(KINDS) // 2)) % len(KINDS)]


def expected_dead_letter(message_id: str, *, misbehave_rate: float, permanent_rate: float) -> str | None:
    """The reason a message must be dead-lettered with, or None if it must not be."""
    if misbehaviour(message_id, misbehave_rate) in DEAD_KINDS:
        return "handler_ended_transaction"
    if permanent_failure(message_id, permanent_rate):
        return "permanent"
    return None


def _log(message: Message, kind: str) -> None:
    """Record a misbehaviour (or a late write's outcome) on this process's own connection, in
    autocommit: it survives whatever happens to the attempt."""
    batch = list(getattr(_claimed, "ids", ()))
    log = _LogConnection
    with log.lock:
        for _ in range(3):
            try:
                if log.conn is None or log.conn.closed:
                    log.conn = psycopg.connect(
                        os.environ["CHAOS_DATABASE_URL"],
                        autocommit=True,
                        application_name="chaos-misbehaviour-log",
                    )
                log.conn.execute(
                    "INSERT INTO chaos_misbehaviour (message_id, inbox_id, attempt, kind, batch, worker_pid)"
                    " VALUES (%s, %s, %s, %s, %s, %s)",
                    (message.message_id, message.id, message.attempt, kind, batch, os.getpid()),
                )
                return
            except psycopg.OperationalError:
                if log.conn is not None:
                    log.conn.close()
                log.conn = None


def _effect(message: Message, ctx: Context) -> None:
    """The message's effect: its row in ``chaos_effects``, its key's state, its outbox event."""
    prev = ctx.conn.execute(
        "SELECT last_seq FROM chaos_key_state WHERE key = %s FOR UPDATE", (message.key,)
    ).fetchone()
    ctx.conn.execute(
        "INSERT INTO chaos_effects (message_id, key, sequence, prev_seq, attempt, worker_pid, inbox_id, received_at)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
        (message.message_id, message.key, message.sequence, prev[0] if prev else None, message.attempt,
         os.getpid(), message.id, message.received_at),
    )  # fmt: skip
    ctx.conn.execute(
        "INSERT INTO chaos_key_state (key, last_seq) VALUES (%s, %s)"
        " ON CONFLICT (key) DO UPDATE SET last_seq = excluded.last_seq",
        (message.key, message.sequence),
    )
    ctx.publish(
        DESTINATION,
        {"source": message.message_id, "sequence": message.sequence},
        key=message.key,
        message_id=f"out-{message.message_id}",
    )


def _late_write(message: Message, ctx: Context) -> None:
    """After being stuck past the time limit (the slot abandoned): try to write and commit on the
    attempt's connection. Both must be refused; the outcome is logged."""
    try:
        ctx.conn.execute(
            "INSERT INTO chaos_late_writes (message_id, attempt) VALUES (%s, %s)",
            (message.message_id, message.attempt),
        )
    except Exception:
        _log(message, LATE_REFUSED)
        return
    _log(message, LATE_ACCEPTED)


def _misbehave(kind: str, message: Message, ctx: Context) -> None:
    """Do ``kind`` (one of ``KINDS``, but for ``async_block``); return normally only where the
    misbehaviour is a return (a swallowed refusal or error)."""
    _log(message, kind)
    if kind in ("sql_commit", "sql_rollback"):
        ctx.conn.execute("COMMIT" if kind == "sql_commit" else "ROLLBACK")
        _effect(message, ctx)  # in a transaction of its own, which the worker must roll back
        return
    if kind == "sql_commit_stuck":
        # The COMMIT makes the batch's earlier effects durable; the slot that settles the
        # abandoned batch must find that out (none may run again), and refuse the late write.
        ctx.conn.execute("COMMIT")
        time.sleep(STUCK_SECONDS)
        _late_write(message, ctx)
        return
    _effect(message, ctx)  # must be rolled back: the attempt fails
    match kind:
        case "api_commit":
            ctx.conn.commit()
        case "api_rollback":
            ctx.conn.rollback()
        case "api_close":
            ctx.conn.close()
        case "api_autocommit":
            ctx.conn.autocommit = True
        case "api_commit_swallowed":
            with contextlib.suppress(Exception):
                ctx.conn.commit()
        case "sleep":
            time.sleep(STUCK_SECONDS)
            _late_write(message, ctx)
        case "spin":
            end = time.monotonic() + STUCK_SECONDS
            while time.monotonic() < end:
                pass
            _late_write(message, ctx)
        case "system_exit" | "async_system_exit":
            raise SystemExit(3)
        case "keyboard_interrupt" | "async_keyboard_interrupt":
            raise KeyboardInterrupt
        case "swallowed_db_error":
            with contextlib.suppress(psycopg.Error):
                ctx.conn.execute("SELECT 1 / 0")
        case _:
            raise AssertionError(f"unknown misbehaviour {kind!r}")


def _handle(message: Message, ctx: Context, kind: str | None) -> None:
    salt = (message.message_id, message.attempt, os.getpid())
    if kind is not None and (kind in DEAD_KINDS or message.attempt == 1):
        _misbehave(kind, message, ctx)
        return
    die = _roll(*salt, "die") < DIE_RATE
    point = int(_roll(*salt, "point") * 3)
    if die and point == 0:
        _die()
    if HANDLER_SLEEP:
        time.sleep(HANDLER_SLEEP)
    if _roll(*salt, "fail") < FAIL_RATE:
        raise ConnectionError("injected transient failure")
    if permanent_failure(message.message_id):
        raise Permanent(f"injected permanent failure of {message.message_id}")
    _effect(message, ctx)
    if die and point == 1:
        _die()
    if die and point == 2:
        _kill_after_commit.add(message.id)


async def _handle_async(message: Message, ctx: Context, kind: str | None) -> None:
    if kind == "async_block" and message.attempt == 1:
        _log(message, kind)
        _effect(message, ctx)  # must be rolled back: the slot is abandoned
        time.sleep(STUCK_SECONDS)  # blocks the event loop: the misbehaviour under test
        _late_write(message, ctx)
        return
    _handle(message, ctx, kind)


@registry.handler(CONSUMER, retry=POLICY, on_dead_letter="skip")
def handle(message: Message, ctx: Context) -> Coroutine[Any, Any, None] | None:
    """Sync, or a coroutine (which the worker runs) for ``ASYNC_KINDS`` and a share of the others."""
    kind = misbehaviour(message.message_id)
    if kind in ASYNC_KINDS or _roll(message.message_id, "async") < ASYNC_SHARE:
        return _handle_async(message, ctx, kind)
    _handle(message, ctx, kind)
    return None


def _listener(event: str, data: dict[str, Any]) -> None:
    if event == "claimed":  # in the slot's thread, before its handlers run
        _claimed.ids = tuple(data.get("ids", ()))
    elif event == "completed" and _kill_after_commit.intersection(data.get("ids", ())):
        _die()


registry.listeners.append(_listener)

# The same handler declared database_only (F6 with a shared savepoint): the neighbours of a batch
# share one savepoint, and a failure runs the ones before it again. Its effects and outbox events
# all go through ctx.conn; the misbehaviour log is the harness's record, not an effect.
# (The previous release's workers of F7 import this module too, and it has no database_only.)
shared_registry = Registry()
if "database_only" in inspect.signature(Registry.add).parameters:
    shared_registry.add(handle, CONSUMER, retry=POLICY, on_dead_letter="skip", database_only=True)
shared_registry.listeners.append(_listener)

"""The handler side of the chaos harness (``tests/chaos``), run by real ``postbox worker`` processes.

Each attempt appends a row to ``chaos_effects`` (no unique constraint, so a duplicate effect would
show) with the previous sequence the handler saw for its key, the attempt number and the worker's
pid, and writes one outbox event ``out-<message_id>`` to the destination ``chaos-out`` in the same
transaction. Faults are driven by environment variables so that every process of a run behaves alike:

- ``CHAOS_DIE_RATE``: share of attempts whose process SIGKILLs itself, at a point chosen among before
  the effect, after the effect but before commit, and after commit (F1);
- ``CHAOS_FAIL_RATE``: share of attempts that fail transiently;
- ``CHAOS_PERMANENT_RATE``: share of messages that always fail permanently (dead-lettered, skipped);
- ``CHAOS_HANDLER_SLEEP``: seconds each handler sleeps in Python (widens the window in which a
  SIGSTOP or a terminated connection hits a handler mid-way);
- ``CHAOS_MAX_ATTEMPTS``: the retry policy's ``max_attempts``.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

from service.handlers import Context, Message, Registry
from service.outcomes import Permanent
from service.policy import Backoff, RetryPolicy

CONSUMER = "chaos"
DESTINATION = "chaos-out"
DIE_RATE = float(os.environ.get("CHAOS_DIE_RATE", "0"))
FAIL_RATE = float(os.environ.get("CHAOS_FAIL_RATE", "0"))
PERMANENT_RATE = float(os.environ.get("CHAOS_PERMANENT_RATE", "0"))
HANDLER_SLEEP = float(os.environ.get("CHAOS_HANDLER_SLEEP", "0"))
MAX_ATTEMPTS = int(os.environ.get("CHAOS_MAX_ATTEMPTS", "1000"))
POLICY = RetryPolicy(
    strategy=Backoff.EXPONENTIAL_FULL_JITTER,
    base_delay=0.01,
    max_delay=0.2,
    max_attempts=MAX_ATTEMPTS,
    max_total_seconds=None,
)

registry = Registry()
_kill_after_commit: set[int] = set()


def _roll(*parts: object) -> float:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def permanent_failure(message_id: str) -> bool:
    """Whether a message is one of the injected permanent failures (the same in every process)."""
    return _roll(message_id, "permanent") < PERMANENT_RATE


@registry.handler(CONSUMER, retry=POLICY, on_dead_letter="skip")
def handle(message: Message, ctx: Context) -> None:
    salt = (message.message_id, message.attempt, os.getpid())
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
    prev = ctx.conn.execute(
        "SELECT last_seq FROM chaos_key_state WHERE key = %s FOR UPDATE", (message.key,)
    ).fetchone()
    ctx.conn.execute(
        "INSERT INTO chaos_effects (message_id, key, sequence, prev_seq, attempt, worker_pid)"
        " VALUES (%s, %s, %s, %s, %s, %s)",
        (message.message_id, message.key, message.sequence, prev[0] if prev else None, message.attempt,
         os.getpid()),
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
    if die and point == 1:
        _die()
    if die and point == 2:
        _kill_after_commit.add(message.id)


def _after_commit(event: str, data: dict[str, Any]) -> None:
    if event == "completed" and _kill_after_commit.intersection(data.get("ids", ())):
        _die()


registry.listeners.append(_after_commit)

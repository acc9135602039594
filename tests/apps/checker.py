"""The handler side of the invariant checker, run by real worker processes in the tests.

Each handler appends to ``effects`` (no unique constraint: duplicates would show) in the message's
transaction, with the previous sequence it saw for the key. Faults are driven by environment
variables so that every process of a run misbehaves the same way:

- ``CHECKER_FAIL_RATE``: share of attempts that fail transiently (decided by a hash, reproducible);
- ``CHECKER_DIE_RATE``: share of attempts whose process SIGKILLs itself, at a point chosen among
  before the effect, after the effect but before commit, and after commit;
- ``CHECKER_PERMANENT_RATE``: share of messages that always fail permanently (dead-lettered, skipped);
- payload ``{"poison": true}``: the process kills itself on every attempt of that message.

``batch_registry`` is the same handler as a batch handler: the faults of each message of a call
are rolled for that message, so a failing message fails the whole call (which is then run again
one message at a time) and a dying one kills the process in the middle of a call.
``shared_registry`` is the same handler declared database-only: consecutive messages of a batch
share one savepoint, so a failing message undoes its neighbours' effects, which run again.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import signal
from typing import TYPE_CHECKING, Any

from postbox.failures.outcomes import Permanent
from postbox.failures.policy import Backoff, RetryPolicy
from postbox.inbox.handlers import Context, Message, Registry
from tests.helpers import record_effect

if TYPE_CHECKING:  # not at run time: the upgrade tests run this app with releases that predate it
    from postbox.inbox.handlers import BatchContext

FAIL_RATE = float(os.environ.get("CHECKER_FAIL_RATE", "0"))
DIE_RATE = float(os.environ.get("CHECKER_DIE_RATE", "0"))
PERMANENT_RATE = float(os.environ.get("CHECKER_PERMANENT_RATE", "0"))
POLICY = RetryPolicy(
    strategy=Backoff.EXPONENTIAL_FULL_JITTER,
    base_delay=0.01,
    max_delay=0.2,
    max_attempts=int(os.environ.get("CHECKER_MAX_ATTEMPTS", "1000")),
    max_total_seconds=None,
)

registry = Registry()
_pending_kill_after_commit: set[int] = set()


def _roll(message: Message, salt: str) -> float:
    digest = hashlib.sha256(f"{message.message_id}/{message.attempt}/{salt}/{os.getpid()}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@registry.handler("chk", retry=POLICY, on_dead_letter="skip")
def handle(message: Message, ctx: Context | BatchContext) -> None:
    if isinstance(message.payload, dict) and message.payload.get("poison"):
        _die()
    die = _roll(message, "die") < DIE_RATE
    point = int(_roll(message, "point") * 3)
    if die and point == 0:
        _die()
    if _roll(message, "fail") < FAIL_RATE:
        raise ConnectionError("injected transient failure")
    if (
        int.from_bytes(hashlib.sha256(f"{message.message_id}/permanent".encode()).digest()[:8], "big") / 2**64
        < PERMANENT_RATE
    ):
        raise Permanent(f"injected permanent failure of {message.message_id}")
    record_effect(ctx.conn, message.message_id, message.key, message.sequence, message.attempt)
    if die and point == 1:
        _die()
    if die and point == 2:
        _pending_kill_after_commit.add(message.id)


def _after_commit(event: str, data: dict[str, Any]) -> None:
    if event == "completed" and _pending_kill_after_commit.intersection(data.get("ids", ())):
        _die()


registry.listeners.append(_after_commit)


def handle_batch(messages: list[Message], ctx: BatchContext) -> None:
    for message in messages:
        handle(message, ctx)


# The same handler declared database-only (it is): the messages of a batch share a savepoint.
shared_registry = Registry()
if "database_only" in inspect.signature(Registry.handler).parameters:  # releases before it lack it
    shared_registry.handler("chk", retry=POLICY, on_dead_letter="skip", database_only=True)(handle)
    shared_registry.listeners.append(_after_commit)

batch_registry = Registry()
if hasattr(batch_registry, "batch_handler"):  # releases before batch handlers run only `registry`
    batch_registry.batch_handler("chk", retry=POLICY, on_dead_letter="skip")(handle_batch)
    batch_registry.listeners.append(_after_commit)

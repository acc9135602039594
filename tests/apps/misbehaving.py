"""Handlers that misbehave on purpose, for the handler-isolation tests and the chaos suite.

Every handler first records its effect (tests.helpers.record_effect), then does what the
payload's ``do`` says. ``only_attempt`` limits the misbehaviour to one attempt (later attempts
just succeed). ``marker``: a file written when the handler's code finally ends, saying whether
its late write reached the database ("wrote") or was refused ("refused: ...").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import psycopg

from postbox.failures.classify import Rule
from postbox.failures.outcomes import Retry
from postbox.failures.policy import FailureKind
from postbox.inbox.handlers import AsyncContext, Context, Message, Registry
from tests.helpers import record_effect

CONSUMER = "mis"

registry = Registry()
_tasks: set[asyncio.Task[None]] = set()


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


class Unruly(Exception):
    pass


def _unruly(error: BaseException) -> bool:
    raise RuntimeError("a classification rule with a bug")


registry.rules.append(Rule(FailureKind.PERMANENT, exceptions=(Unruly,), predicate=_unruly, name="unruly"))


def _misbehave(message: Message, ctx: Context) -> None:
    p: dict[str, Any] = message.payload if isinstance(message.payload, dict) else {}
    do = p.get("do", "ok")
    only = p.get("only_attempt")
    if only is not None and message.attempt != only:
        do = "ok"
    if do == "crash":  # kills its worker before any effect
        os._exit(17)
    record_effect(ctx.conn, message.message_id, message.key, message.sequence, message.attempt)
    match do:
        case "ok":
            return
        case "rollback_execute":
            ctx.conn.rollback()
            ctx.conn.execute("SELECT 1")
        case "commit_execute":
            ctx.conn.commit()
            ctx.conn.execute("SELECT 1")
        case "commit":
            ctx.conn.commit()
        case "close":
            ctx.conn.close()
        case "autocommit":
            ctx.conn.autocommit = True
        case "swallow_commit":  # refused, but the handler hides the refusal and returns
            with contextlib.suppress(Exception):
                ctx.conn.commit()
        case "sql_commit_execute":
            ctx.conn.execute("COMMIT")
            ctx.conn.execute("SELECT 1")
        case "sql_rollback_execute":
            ctx.conn.execute("ROLLBACK")
            ctx.conn.execute("SELECT 1")
        case "sql_commit":
            ctx.conn.execute("COMMIT")
        case "sql_commit_sleep":  # commits, then hangs past its time limit
            ctx.conn.execute("COMMIT")
            time.sleep(float(p.get("seconds", 3600)))
        case "swallow_error":
            with contextlib.suppress(psycopg.Error):
                ctx.conn.execute("SELECT 1 / 0")
        case "retry_nan":  # Retry refuses a NaN delay: the handler fails with that ValueError
            raise Retry(after=float("nan"))
        case "unprintable":
            raise Unprintable
        case "unruly":  # the registry's rule for it raises while classifying it
            raise Unruly("no rule can say what this is")
        case "set_role":  # the completion then runs as a role that may not touch postbox
            ctx.conn.execute("SET LOCAL ROLE pg_monitor")
        case "deferred_violation":  # a constraint checked at commit: the batch's commit fails
            ctx.conn.execute("INSERT INTO deferred_children (parent) VALUES (-1)")
        case "serialization_at_commit":  # the first commit fails as a serialization failure would
            ctx.conn.execute("INSERT INTO flaky_rows DEFAULT VALUES")
        case "cancelled_at_commit":  # every commit's statement cancelled, as a statement_timeout does
            ctx.conn.execute("INSERT INTO cancelled_rows DEFAULT VALUES")
        case "exit":
            raise SystemExit(3)
        case "keyboard_interrupt":
            raise KeyboardInterrupt
        case "sleep":
            time.sleep(float(p.get("seconds", 3600)))
            _late_write(ctx, message, p)
        case "spin":  # pure Python holding the GIL between bytecodes
            end = time.monotonic() + float(p.get("seconds", 3600))
            while time.monotonic() < end:
                pass
            _late_write(ctx, message, p)
        case _:
            raise ValueError(f"unknown misbehaviour {do!r}")


def _late_write(ctx: Context, message: Message, p: dict[str, Any]) -> None:
    """After a stall: try to write again (must be refused once the slot was abandoned)."""
    try:
        ctx.conn.execute(
            "INSERT INTO effects (message_id, key, sequence, attempt) VALUES (%s, %s, %s, %s)",
            (message.message_id + ":late", message.key, message.sequence, message.attempt),
        )
        outcome = "wrote"
    except Exception as error:
        outcome = f"refused: {error}"
    if p.get("marker"):
        _write_marker(p["marker"], outcome)


def _write_marker(path: str, outcome: str) -> None:
    """Write the marker whole or not at all (a temporary file renamed): a test polling for the file
    must never read it between its creation and its text."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(outcome, encoding="utf-8")
    os.replace(tmp, path)


@registry.handler(CONSUMER)
def handle(message: Message, ctx: Context) -> None:
    _misbehave(message, ctx)


async def _record_effect_async(ctx: AsyncContext, message: Message, suffix: str = "") -> None:
    """record_effect through an async handler's connection."""
    cur = await ctx.conn.execute("SELECT last_seq FROM key_state WHERE key = %s FOR UPDATE", (message.key,))
    prev = await cur.fetchone()
    await ctx.conn.execute(
        "INSERT INTO effects (message_id, key, sequence, prev_seq, attempt) VALUES (%s, %s, %s, %s, %s)",
        (
            message.message_id + suffix,
            message.key,
            message.sequence,
            prev[0] if prev else None,
            message.attempt,
        ),
    )
    if not suffix:
        await ctx.conn.execute(
            "INSERT INTO key_state (key, last_seq) VALUES (%s, %s) ON CONFLICT (key) DO UPDATE SET last_seq = excluded.last_seq",
            (message.key, message.sequence if message.sequence is not None else -1),
        )


async def _late_write_async(ctx: AsyncContext, message: Message, p: dict[str, Any]) -> None:
    try:
        await _record_effect_async(ctx, message, ":late")
        outcome = "wrote"
    except Exception as error:
        outcome = f"refused: {error}"
    if p.get("marker"):
        _write_marker(p["marker"], outcome)


@registry.handler(CONSUMER, "async")
async def handle_async(message: Message, ctx: AsyncContext) -> None:
    """The async twin of ``handle``, through the async context (``ctx.conn`` is an AsyncConnection)."""
    p: dict[str, Any] = message.payload if isinstance(message.payload, dict) else {}
    do = p.get("do", "ok")
    if p.get("only_attempt", message.attempt) != message.attempt:
        do = "ok"
    await _record_effect_async(ctx, message)
    match do:
        case "ok":
            return
        case "spawn_task":  # fire-and-forget: a task that would write after the handler returned

            async def later() -> None:
                await asyncio.sleep(0.05)
                await _record_effect_async(ctx, message, ":task")

            _tasks.add(asyncio.get_running_loop().create_task(later()))
        case "await_sleep":
            await asyncio.sleep(float(p.get("seconds", 3600)))
        case "sleep":  # blocking calls inside an async handler block its event loop
            time.sleep(float(p.get("seconds", 3600)))
            await _late_write_async(ctx, message, p)
        case "commit":
            await ctx.conn.commit()
        case "sql_commit":
            await ctx.conn.execute("COMMIT")
        case "exit":
            raise SystemExit(3)
        case "keyboard_interrupt":
            raise KeyboardInterrupt
        case _:
            raise ValueError(f"unknown async misbehaviour {do!r}")

"""Controlled replay of dead letters (SPEC REPLAY-1..4).

A replay is a job recorded in ``postbox.replay_jobs``: the filter, a snapshot of the dead letters it
covers, its pacing (messages per second, batch, in flight, canary), its abort rule, progress and state.
``postbox.replay_step_v1`` advances it by one transaction, so any process can drive it, a killed
runner loses nothing and replays nothing twice, and pause, resume and cancel work from any session.
:class:`ReplayRunner` is the loop that steps jobs at their pace (``postbox replay run``, or the CLI in
the foreground); time comes from an injected clock and waiting from an injected ``sleep``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import psycopg
from pydantic import BaseModel, ConfigDict, Field

from postbox.clock import Clock, SystemClock
from postbox.db.connector import run_dicts
from postbox.db.queries import query
from postbox.deadletters.ops import DeadLetterFilter

__all__ = [
    "TERMINAL_STATES",
    "ReplayJob",
    "ReplayOptions",
    "ReplayRunner",
    "cancel",
    "get",
    "items",
    "jobs",
    "pause",
    "resume",
    "start",
    "step",
]

log = logging.getLogger("postbox.replay")

TERMINAL_STATES = frozenset({"done", "aborted", "cancelled"})


class ReplayOptions(BaseModel):
    """How a replay job sends dead letters back."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["in_place", "new_message"] = "in_place"
    rate: float = Field(default=10.0, gt=0, le=100_000, description="messages per second at most")
    max_in_flight: int = Field(default=100, ge=1, description="sent back and not yet settled, at most")
    batch_size: int = Field(default=50, ge=1, le=10_000, description="sent back in one step, at most")
    canary: int = Field(default=0, ge=0, description="send this many first; go on only if all succeed")
    abort_failure_ratio: float = Field(
        default=0.5, ge=0, le=1, description="abort above this failed/finished ratio"
    )
    dry_run: bool = False


@dataclass(frozen=True)
class ReplayJob:
    """A replay job and its progress, as ``postbox.replay_progress`` shows it."""

    id: int
    state: str
    state_reason: str | None
    mode: str
    dry_run: bool
    rate: float
    batch_size: int
    max_in_flight: int
    canary: int
    total: int
    replayed: int
    succeeded: int
    failed: int
    skipped: int
    tokens: float
    in_flight: int
    waiting: int
    percent_done: float | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    last_step_at: datetime | None
    db_user: str
    actor: str | None
    reason: str | None
    filter: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ReplayJob:
        row = dict(row)
        row["in_flight"] = int(row["in_flight"])
        row["waiting"] = int(row["waiting"])
        row["percent_done"] = float(row["percent_done"]) if row["percent_done"] is not None else None
        return cls(**row)


def start(
    conn: psycopg.Connection[Any],
    flt: DeadLetterFilter,
    reason: str,
    actor: str | None = None,
    options: ReplayOptions | None = None,
) -> int:
    """Create a replay job over the open dead letters matching ``flt``; returns its id. Nothing is
    sent back until the job is stepped (by a :class:`ReplayRunner`)."""
    o = options or ReplayOptions()
    rows = run_dicts(
        conn,
        query("dlq_replay"),
        {"filter": flt.to_json(), "reason": reason, "actor": actor, **o.model_dump()},
    )
    return int(next(iter(rows[0].values())))


def step(conn: psycopg.Connection[Any], job_id: int, now: datetime, runner: str | None = None) -> ReplayJob:
    """Advance a job by one step (one transaction when ``conn`` is in autocommit)."""
    run_dicts(conn, query("replay_step"), {"job": job_id, "now": now, "runner": runner})
    return get(conn, job_id)


def get(conn: psycopg.Connection[Any], job_id: int) -> ReplayJob:
    rows = run_dicts(conn, query("replay_get"), {"job": job_id})
    if not rows:
        raise LookupError(f"postbox: replay job {job_id} does not exist")
    return ReplayJob.from_row(rows[0])


def jobs(conn: psycopg.Connection[Any], active_only: bool = False, limit: int = 50) -> list[ReplayJob]:
    rows = run_dicts(conn, query("replay_list"), {"active_only": active_only, "limit": limit})
    return [ReplayJob.from_row(r) for r in rows]


def items(conn: psycopg.Connection[Any], job_id: int, limit: int = 1000) -> list[dict[str, Any]]:
    """The dead letters a job covers, in replay order, with what became of each."""
    return run_dicts(conn, query("replay_items"), {"job": job_id, "limit": limit})


def pause(conn: psycopg.Connection[Any], job_id: int, reason: str, actor: str | None = None) -> ReplayJob:
    run_dicts(conn, query("replay_pause"), {"job": job_id, "reason": reason, "actor": actor})
    return get(conn, job_id)


def resume(
    conn: psycopg.Connection[Any],
    job_id: int,
    reason: str,
    actor: str | None = None,
    now: datetime | None = None,
) -> ReplayJob:
    params = {"job": job_id, "reason": reason, "actor": actor, "now": now or SystemClock().now()}
    run_dicts(conn, query("replay_resume"), params)
    return get(conn, job_id)


def cancel(conn: psycopg.Connection[Any], job_id: int, reason: str, actor: str | None = None) -> ReplayJob:
    run_dicts(conn, query("replay_cancel"), {"job": job_id, "reason": reason, "actor": actor})
    return get(conn, job_id)


class ReplayRunner:
    """Steps replay jobs at their pace until they finish.

    ``sleep(seconds)`` waits and returns True when the runner should stop (default: an Event's
    ``wait``); tests pass one that advances a FakeClock instead, so no test waits on wall time.
    """

    def __init__(
        self,
        url: str,
        clock: Clock | None = None,
        poll_interval: float = 0.5,
        runner_id: str = "replay-runner",
        sleep: Callable[[float], bool] | None = None,
    ) -> None:
        self.url = url
        self.clock = clock or SystemClock()
        self.poll_interval = poll_interval
        self.runner_id = runner_id
        self.stop_event = threading.Event()
        self._sleep = sleep or self.stop_event.wait
        self._thread: threading.Thread | None = None
        self.fatal: str | None = None

    # --- lifecycle (the shape of postbox.operations.process.Service) ----------------------------

    def start(self) -> None:
        """:meth:`serve` in a background thread."""
        self._thread = threading.Thread(target=self.serve, name="postbox-replay", daemon=True)
        self._thread.start()

    def run(self) -> None:
        self.serve()

    def stop(self) -> None:
        self.stop_event.set()

    def abort(self) -> None:
        """Stop at once: a step in flight is one transaction, committed or not."""
        self.stop()

    def join(self, grace: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(grace)

    def ready(self) -> bool:
        return not self.stopping and self.fatal is None

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    def _delay(self, job: ReplayJob) -> float:
        """How long until the job can send its next message (or should check outcomes again)."""
        if job.state != "running" or job.waiting == 0 or job.tokens >= 1:
            # Tokens left but nothing sent: waiting for outcomes (in flight, canary) or a busy key.
            return self.poll_interval
        return min(self.poll_interval, max(0.001, (1.0 - job.tokens) / job.rate))

    def run_job(self, job_id: int, on_progress: Callable[[ReplayJob], None] | None = None) -> ReplayJob:
        """Step one job until it is done, aborted or cancelled (a paused job is waited for), or the
        runner is stopped. Connection failures are retried: the job lives in the database."""
        failures = 0
        while True:
            try:
                with psycopg.connect(self.url, autocommit=True, application_name="postbox replay") as conn:
                    failures = 0
                    while True:
                        job = step(conn, job_id, self.clock.now(), self.runner_id)
                        if on_progress:
                            on_progress(job)
                        if job.finished:
                            return job
                        if self._sleep(self._delay(job)):
                            return job
            except psycopg.OperationalError as error:
                failures += 1
                log.warning("replay job %s: database unavailable (%s); retrying", job_id, error)
                if self._sleep(min(5.0, 0.2 * 2**failures)):
                    raise

    def serve(self) -> None:
        """Step every runnable job, forever (``postbox replay run``), until stopped."""
        failures = 0
        while not self.stop_event.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, application_name="postbox replay") as conn:
                    failures = 0
                    while not self.stop_event.is_set():
                        delay = self.poll_interval
                        for row in run_dicts(conn, query("replay_runnable"), {}):
                            job = step(conn, int(row["id"]), self.clock.now(), self.runner_id)
                            if not job.finished:
                                delay = min(delay, self._delay(job))
                        if self._sleep(delay):
                            return
            except psycopg.OperationalError as error:
                failures += 1
                log.warning("replay runner: database unavailable (%s); retrying", error)
                if self._sleep(min(5.0, 0.2 * 2**failures)):
                    return
            except Exception as error:  # a step refused (a grant missing) or a bug: it cannot go on
                need = (
                    " (the replay runner needs a login granted postbox_operator)"
                    if isinstance(error, psycopg.errors.InsufficientPrivilege)
                    else ""
                )
                self.fatal = f"the replay runner stopped: {type(error).__name__}: {error}{need}".strip()
                log.critical("%s", self.fatal, exc_info=not need)
                return

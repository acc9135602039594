"""``postbox replay …``: replay jobs (status, run, pause, resume, cancel), and the foreground run of
``postbox dlq replay``."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from postbox.cli.context import checked_database_url, connect_timeout_option, database_url, run_service
from postbox.cli.output import actor_option, connection, emit, emit_json, json_option, reason_option
from postbox.cli.progress import progress_bar
from postbox.deadletters import replay
from postbox.deadletters.replay import ReplayJob, ReplayRunner

__all__ = ["replay_group", "report", "run_in_foreground", "watching"]


def progress_line(job: ReplayJob) -> str:
    width = 24
    done = job.succeeded + job.failed + job.skipped
    filled = int(width * done / job.total) if job.total else width
    return (
        f"job {job.id} [{'#' * filled}{'.' * (width - filled)}] {done}/{job.total} "
        f"sent {job.replayed}, ok {job.succeeded}, failed {job.failed}, skipped {job.skipped}, "
        f"in flight {job.in_flight} - {job.state}"
    )


def report(job: ReplayJob, as_json: bool, items: list[dict[str, Any]] | None = None) -> None:
    """One job: an object in JSON on one line (with its ``items`` if given), its progress line
    otherwise."""
    if as_json:
        emit_json(job.__dict__ if items is None else {**job.__dict__, "items": items}, indent=None)
        return
    click.echo(progress_line(job) + (f": {job.state_reason}" if job.state_reason else ""))
    if items is not None:
        emit(items, ["ordinal", "dead_letter_id", "state", "action"], False, "", full=True)


@contextmanager
def watching(job_id: int, as_json: bool) -> Iterator[Callable[[ReplayJob], None]]:
    """Show a job's progress as it goes: a bar on a terminal; when stderr is not one, a line to
    stderr each time it changes (none with --json)."""
    last = [""]
    with progress_bar(f"replay job {job_id}", enabled=not as_json) as bar:

        def show(job: ReplayJob) -> None:
            line = progress_line(job)
            if bar.live:
                bar.update(
                    total=job.total,
                    completed=job.succeeded + job.failed + job.skipped,
                    detail=f"sent {job.replayed}, ok {job.succeeded}, failed {job.failed}, "
                    f"skipped {job.skipped}, in flight {job.in_flight} - {job.state}",
                )
            elif line != last[0] and not as_json:
                click.echo(line, err=True)
            last[0] = line

        yield show


def run_in_foreground(ctx: click.Context, job_id: int, as_json: bool) -> ReplayJob:
    runner = ReplayRunner(checked_database_url(ctx), runner_id=f"cli-{os.getpid()}")

    def on_signal(signum: int, frame: object) -> None:
        runner.stop()

    previous = signal.signal(signal.SIGINT, on_signal)
    try:
        with watching(job_id, as_json) as show:
            job = runner.run_job(job_id, show)
    finally:
        signal.signal(signal.SIGINT, previous)
    if not job.finished:
        click.echo(
            f"stopped watching; job {job_id} is {job.state} and goes on when a runner steps it "
            f"(`postbox replay run`), or `postbox replay cancel {job_id}`",
            err=True,
        )
    report(job, as_json)
    return job


@click.group("replay")
def replay_group() -> None:
    """Replay jobs: status, run, pause, resume, cancel."""


@replay_group.command("status")
@click.argument("job_id", type=int, required=False)
@click.option("--all", "show_all", is_flag=True, help="Finished jobs too.")
@click.option("--items", "show_items", is_flag=True, help="With JOB_ID: what became of each dead letter.")
@click.option("--watch", is_flag=True, help="With JOB_ID: follow it until it finishes (steps nothing).")
@json_option
@click.pass_context
def replay_status(
    ctx: click.Context, job_id: int | None, show_all: bool, show_items: bool, watch: bool, as_json: bool
) -> None:
    """Replay jobs and their progress."""
    with connection(ctx) as conn:
        if job_id is None:
            rows = [j.__dict__ for j in replay.jobs(conn, active_only=not show_all)]
            emit(
                rows,
                [
                    "id",
                    "state",
                    "mode",
                    "rate",
                    "total",
                    "replayed",
                    "succeeded",
                    "failed",
                    "skipped",
                    "in_flight",
                    "percent_done",
                    "actor",
                    "state_reason",
                ],
                as_json,
                "no replay jobs",
            )
            return
        job = replay.get(conn, job_id)
        if watch and not job.finished:
            with watching(job_id, as_json) as show:
                while not job.finished:
                    show(job)
                    time.sleep(1.0)  # a refresh period for a human, not synchronisation
                    job = replay.get(conn, job_id)
                show(job)
        report(job, as_json, replay.items(conn, job_id) if show_items else None)


@replay_group.command("run")
@click.option("--poll-interval", default=0.5, show_default=True, type=click.FloatRange(0.01, 60))
@connect_timeout_option
@click.pass_context
def replay_run(ctx: click.Context, poll_interval: float, connect_timeout: float | None) -> None:
    """Run replay jobs (every pending or running one) until stopped (SIGTERM/SIGINT)."""
    url = database_url(ctx)
    runner = ReplayRunner(url, poll_interval=poll_interval, runner_id=f"runner-{os.getpid()}")
    run_service(ctx, runner, "replay runner", url, connect_timeout, stop_message="replay runner stopping")


def _control(action: Callable[..., ReplayJob], help_text: str) -> click.Command:
    @click.argument("job_id", type=int)
    @reason_option
    @actor_option
    @json_option
    @click.pass_context
    def command(ctx: click.Context, job_id: int, reason: str, actor: str, as_json: bool) -> None:
        with connection(ctx) as conn:
            report(action(conn, job_id, reason, actor), as_json)

    return click.command(help=help_text)(command)


replay_group.add_command(_control(replay.pause, "Pause a replay job (from any session)."), "pause")
replay_group.add_command(_control(replay.resume, "Resume a paused replay job."), "resume")
replay_group.add_command(_control(replay.cancel, "Cancel a replay job (sent messages go on)."), "cancel")

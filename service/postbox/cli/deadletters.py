"""Dead-letter commands: ``postbox dlq …``, ``postbox replay …``, ``postbox keys …``, ``postbox consumer …``.

Tables for people, ``--json`` for scripts. Every command that changes something needs ``--reason``
and records ``--actor`` (default: ``$POSTBOX_ACTOR`` or the OS user) in ``postbox.audit_log``. Each
is a thin layer over :mod:`postbox.deadletters.ops` and :mod:`postbox.deadletters.replay`, which are thin layers over
SQL functions a DBA can call directly.
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Literal, cast

import click
import psycopg

from postbox.cli.context import await_database, connect_timeout_option, database_url
from postbox.deadletters import ops as deadletter
from postbox.deadletters import replay
from postbox.deadletters.ops import DeadLetterFilter
from postbox.deadletters.replay import ReplayJob, ReplayOptions, ReplayRunner
from postbox.errors import InvalidRequest

__all__ = ["register"]


# --- plumbing ------------------------------------------------------------------------------------


@contextmanager
def _connection(ctx: click.Context) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to the configured database; bad input becomes a clean error."""
    try:
        with psycopg.connect(database_url(ctx), autocommit=True, application_name="postbox cli") as conn:
            yield conn
    except InvalidRequest as error:
        raise click.ClickException(str(error)) from None
    except (LookupError, psycopg.errors.InsufficientPrivilege) as error:
        raise click.ClickException(str(error).strip().splitlines()[0]) from None


def _default_actor() -> str:
    try:
        return os.environ.get("POSTBOX_ACTOR") or getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        return "unknown"


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


def _human(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, timedelta):
        seconds = int(value.total_seconds())
        if seconds >= 86_400:
            return f"{seconds // 86_400}d{(seconds % 86_400) // 3600}h"
        if seconds >= 3600:
            return f"{seconds // 3600}h{(seconds % 3600) // 60}m"
        return f"{seconds // 60}m{seconds % 60}s" if seconds >= 60 else f"{seconds}s"
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _emit(rows: Sequence[dict[str, Any]], columns: Sequence[str], as_json: bool, empty: str) -> None:
    if as_json:
        click.echo(json.dumps([{k: _plain(v) for k, v in r.items()} for r in rows], indent=2, default=str))
        return
    if not rows:
        click.echo(empty)
        return
    cells = [[_human(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    click.echo("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def _filter_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The dead-letter filter as options (all optional, combined with AND)."""
    options = [
        click.option("--id", "ids", type=int, multiple=True, help="Dead letter id (repeatable)."),
        click.option("--origin", type=click.Choice(["inbox", "outbox"])),
        click.option("--queue", help="Consumer or destination."),
        click.option("--consumer"),
        click.option("--destination"),
        click.option("--type", "type_", help="Message type."),
        click.option("--cause", help="Dead-letter reason: attempts_exhausted, permanent, deadline, late…"),
        click.option("--fingerprint", help="Error group (see `postbox dlq groups`)."),
        click.option("--key"),
        click.option("--message-id"),
        click.option("--since", type=click.DateTime(), help="Dead-lettered at or after."),
        click.option("--until", type=click.DateTime(), help="Dead-lettered before."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _filter(kw: dict[str, Any], status: str | None = None) -> DeadLetterFilter:
    return DeadLetterFilter(
        ids=list(kw.pop("ids")) or None,
        origin=kw.pop("origin"),
        queue=kw.pop("queue"),
        consumer=kw.pop("consumer"),
        destination=kw.pop("destination"),
        type=kw.pop("type_"),
        reason=kw.pop("cause"),
        fingerprint=kw.pop("fingerprint"),
        key=kw.pop("key"),
        message_id=kw.pop("message_id"),
        since=kw.pop("since"),
        until=kw.pop("until"),
        status=status,
    )


def _require_selection(flt: DeadLetterFilter, everything: bool) -> None:
    if flt.is_empty() and not everything:
        raise click.UsageError(
            "give a filter (--id, --queue, --type, --fingerprint, …) or --all to act on every open dead letter"
        )


_actor = click.option(
    "--actor",
    default=_default_actor,
    show_default="$POSTBOX_ACTOR or the OS user",
    help="Who you are, for the audit trail.",
)
_reason = click.option("--reason", required=True, help="Why (recorded in the audit trail).")
_json = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


# --- postbox dlq -----------------------------------------------------------------------------------


@click.group()
def dlq() -> None:
    """Dead letters: list, group, show, explain, replay, discard, resolve, edit."""


@dlq.command("list")
@_filter_options
@click.option(
    "--status",
    default="open",
    show_default=True,
    type=click.Choice(["open", "replaying", "replayed", "replay_failed", "discarded", "resolved", "any"]),
)
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 100_000))
@_json
@click.pass_context
def dlq_list(ctx: click.Context, /, status: str, limit: int, as_json: bool, **kw: Any) -> None:
    """Dead letters matching the filter, in replay order."""
    with _connection(ctx) as conn:
        rows = deadletter.select(conn, _filter(kw, status), limit)
    _emit(
        rows,
        [
            "id",
            "queue",
            "key",
            "sequence",
            "type",
            "reason",
            "attempt",
            "status",
            "dead_lettered_at",
            "last_error",
        ],
        as_json,
        "no dead letters match",
    )


@dlq.command("groups")
@_json
@click.pass_context
def dlq_groups(ctx: click.Context, as_json: bool) -> None:
    """Open dead letters grouped by queue, type, reason and error fingerprint."""
    with _connection(ctx) as conn:
        rows = deadletter.groups(conn)
    _emit(
        rows,
        ["queue", "type", "reason", "open", "keys", "oldest_age", "fingerprint"],
        as_json,
        "no open dead letters",
    )


@dlq.command("show")
@click.argument("dead_letter_id", type=int)
@_json
@click.pass_context
def dlq_show(ctx: click.Context, dead_letter_id: int, as_json: bool) -> None:
    """Every field of one dead letter, with its payload versions."""
    with _connection(ctx) as conn:
        row = deadletter.show(conn, dead_letter_id)
    if row is None:
        raise click.ClickException(f"dead letter {dead_letter_id} does not exist")
    if as_json:
        click.echo(json.dumps({k: _plain(v) for k, v in row.items()}, indent=2, default=str))
        return
    for name, value in row.items():
        if name in ("edits", "last_traceback"):
            continue
        click.echo(
            f"{name:>18}  {json.dumps(value, ensure_ascii=False) if isinstance(value, dict | list) else _plain(value)}"
        )
    if row.get("last_traceback"):
        click.echo("\n" + str(row["last_traceback"]).rstrip())
    for e in row["edits"]:
        click.echo(
            f"\nedit v{e['version']} by {e['db_user']}{' as ' + e['actor'] if e['actor'] else ''} "
            f"at {_human(e['edited_at'])}: {e['reason']}"
        )


@dlq.command("explain")
@click.argument("dead_letter_id", type=int, required=False)
@click.option("--message-id", help="Explain the newest dead letter of this message id.")
@_json
@click.pass_context
def dlq_explain(
    ctx: click.Context, dead_letter_id: int | None, message_id: str | None, as_json: bool
) -> None:
    """The whole history of a dead letter: receipt, attempts, decisions, replays."""
    with _connection(ctx) as conn:
        if dead_letter_id is None:
            if not message_id:
                raise click.UsageError("give a DEAD_LETTER_ID or --message-id")
            dead_letter_id = deadletter.latest_for_message(conn, message_id)
            if dead_letter_id is None:
                raise click.ClickException(f"message {message_id!r} has no dead letter")
        events = deadletter.explain(conn, dead_letter_id)
    if not events:
        raise click.ClickException(f"dead letter {dead_letter_id} does not exist")
    _emit([e.__dict__ for e in events], ["at", "event", "detail"], as_json, "")


def _closing(action: Callable[..., list[dict[str, Any]]], verb: str) -> Callable[..., None]:
    @_filter_options
    @click.option("--all", "everything", is_flag=True, help="Every open dead letter (no filter).")
    @_reason
    @_actor
    @_json
    @click.pass_context
    def command(
        ctx: click.Context, /, everything: bool, reason: str, actor: str, as_json: bool, **kw: Any
    ) -> None:
        flt = _filter(kw)
        _require_selection(flt, everything)
        with _connection(ctx) as conn:
            rows = action(conn, flt, reason, actor)
        if as_json:
            _emit(rows, [], True, "")
        else:
            for r in rows:
                click.echo(f"dead letter {r['dead_letter_id']} {verb}: {r['action']}")
            click.echo(f"{len(rows)} dead letter(s) {verb}")

    return command


dlq.command("discard", help="Discard open dead letters, with a reason; keys they blocked go on.")(
    _closing(deadletter.discard, "discarded")
)
dlq.command("resolve", help="Mark open dead letters resolved by hand; keys they blocked go on.")(
    _closing(deadletter.resolve, "resolved")
)


@dlq.command("edit")
@click.argument("dead_letter_id", type=int)
@click.option("--payload", "payload_text", help="The new payload, as JSON.")
@click.option(
    "--payload-file", type=click.File("r"), help="Read the new payload (JSON) from a file ('-': stdin)."
)
@_reason
@_actor
@click.pass_context
def dlq_edit(
    ctx: click.Context,
    dead_letter_id: int,
    payload_text: str | None,
    payload_file: Any,
    reason: str,
    actor: str,
) -> None:
    """Set the payload a replay will send (versioned; the original is kept)."""
    if (payload_text is None) == (payload_file is None):
        raise click.UsageError("give exactly one of --payload or --payload-file")
    raw = payload_text if payload_text is not None else payload_file.read()
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as error:
        raise click.BadParameter(f"not JSON: {error}", param_hint="--payload") from None
    with _connection(ctx) as conn:
        version = deadletter.edit_payload(conn, dead_letter_id, payload, reason, actor)
    click.echo(f"dead letter {dead_letter_id}: payload version {version} saved (the original is kept)")


@dlq.command("replay")
@_filter_options
@click.option("--all", "everything", is_flag=True, help="Every open dead letter (no filter).")
@click.option(
    "--mode",
    type=click.Choice(["in_place", "new_message"]),
    default="in_place",
    show_default=True,
    help="in_place: same message_id; new_message: a new message referencing the original.",
)
@click.option("--rate", type=float, default=10.0, show_default=True, help="Messages per second at most.")
@click.option("--batch-size", type=int, default=50, show_default=True)
@click.option("--max-in-flight", type=int, default=100, show_default=True)
@click.option(
    "--canary",
    type=int,
    default=0,
    show_default=True,
    help="Replay this many first; go on only if all succeed.",
)
@click.option(
    "--abort-ratio",
    type=float,
    default=0.5,
    show_default=True,
    help="Abort above this failed/finished ratio.",
)
@click.option("--dry-run", is_flag=True, help="Say what would happen; send nothing.")
@click.option("--detach", is_flag=True, help="Only create the job (a `postbox replay run` process runs it).")
@_reason
@_actor
@_json
@click.pass_context
def dlq_replay(
    ctx: click.Context,
    /,
    everything: bool,
    mode: str,
    rate: float,
    batch_size: int,
    max_in_flight: int,
    canary: int,
    abort_ratio: float,
    dry_run: bool,
    detach: bool,
    reason: str,
    actor: str,
    as_json: bool,
    **kw: Any,
) -> None:
    """Replay dead letters as a controlled job: rate-limited, per key in order, stoppable."""
    flt = _filter(kw)
    _require_selection(flt, everything)
    try:
        options = ReplayOptions(
            mode=cast(Literal["in_place", "new_message"], mode),
            rate=rate,
            batch_size=batch_size,
            max_in_flight=max_in_flight,
            canary=canary,
            abort_failure_ratio=abort_ratio,
            dry_run=dry_run,
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    with _connection(ctx) as conn:
        job_id = replay.start(conn, flt, reason, actor, options)
    if not as_json:
        click.echo(f"replay job {job_id} created ({'dry run' if dry_run else mode}, {rate:g}/s)", err=True)
    if detach:
        with _connection(ctx) as conn:
            _report(replay.get(conn, job_id), as_json)
        return
    job = _run_in_foreground(ctx, job_id, as_json)
    if dry_run and not as_json:
        with _connection(ctx) as conn:
            for item in replay.items(conn, job_id):
                click.echo(f"  dead letter {item['dead_letter_id']}: {item['action']}")
    if job.state in ("aborted", "cancelled"):
        sys.exit(1)


@dlq.command("audit")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 100_000))
@_json
@click.pass_context
def dlq_audit(ctx: click.Context, limit: int, as_json: bool) -> None:
    """Operator actions, newest first (postbox.audit_log)."""
    with _connection(ctx) as conn:
        rows = deadletter.audit_trail(conn, limit)
    _emit(
        rows,
        ["id", "at", "db_role", "actor", "action", "reason", "target"],
        as_json,
        "no operator actions yet",
    )


# --- postbox replay --------------------------------------------------------------------------------


def _progress_line(job: ReplayJob) -> str:
    width = 24
    done = job.succeeded + job.failed + job.skipped
    filled = int(width * done / job.total) if job.total else width
    return (
        f"job {job.id} [{'#' * filled}{'.' * (width - filled)}] {done}/{job.total} "
        f"sent {job.replayed}, ok {job.succeeded}, failed {job.failed}, skipped {job.skipped}, "
        f"in flight {job.in_flight} - {job.state}"
    )


def _report(job: ReplayJob, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({k: _plain(v) for k, v in job.__dict__.items()}, default=str))
    else:
        click.echo(_progress_line(job) + (f": {job.state_reason}" if job.state_reason else ""))


def _run_in_foreground(ctx: click.Context, job_id: int, as_json: bool) -> ReplayJob:
    runner = ReplayRunner(database_url(ctx), runner_id=f"cli-{os.getpid()}")
    tty = sys.stderr.isatty() and not as_json
    last = [""]

    def progress(job: ReplayJob) -> None:
        line = _progress_line(job)
        if tty:
            click.echo("\r" + line.ljust(len(last[0])), nl=False, err=True)
        elif line != last[0] and not as_json:
            click.echo(line, err=True)
        last[0] = line

    def on_signal(signum: int, frame: object) -> None:
        runner.stop()

    previous = signal.signal(signal.SIGINT, on_signal)
    try:
        job = runner.run_job(job_id, progress)
    finally:
        signal.signal(signal.SIGINT, previous)
    if tty:
        click.echo("", err=True)
    if not job.finished:
        click.echo(
            f"stopped watching; job {job_id} is {job.state} and goes on when a runner steps it "
            f"(`postbox replay run`), or `postbox replay cancel {job_id}`",
            err=True,
        )
    _report(job, as_json)
    return job


@click.group("replay")
def replay_group() -> None:
    """Replay jobs: status, run, pause, resume, cancel."""


@replay_group.command("status")
@click.argument("job_id", type=int, required=False)
@click.option("--all", "show_all", is_flag=True, help="Finished jobs too.")
@click.option("--items", "show_items", is_flag=True, help="With JOB_ID: what became of each dead letter.")
@click.option("--watch", is_flag=True, help="With JOB_ID: follow it until it finishes (steps nothing).")
@_json
@click.pass_context
def replay_status(
    ctx: click.Context, job_id: int | None, show_all: bool, show_items: bool, watch: bool, as_json: bool
) -> None:
    """Replay jobs and their progress."""
    with _connection(ctx) as conn:
        if job_id is None:
            rows = [j.__dict__ for j in replay.jobs(conn, active_only=not show_all)]
            _emit(
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
        while watch and not job.finished:
            click.echo(_progress_line(job), err=True)
            time.sleep(1.0)
            job = replay.get(conn, job_id)
        _report(job, as_json)
        if show_items:
            _emit(replay.items(conn, job_id), ["ordinal", "dead_letter_id", "state", "action"], as_json, "")


@replay_group.command("run")
@click.option("--poll-interval", default=0.5, show_default=True, type=click.FloatRange(0.01, 60))
@connect_timeout_option
@click.pass_context
def replay_run(ctx: click.Context, poll_interval: float, connect_timeout: float | None) -> None:
    """Run replay jobs (every pending or running one) until stopped (SIGTERM/SIGINT)."""
    from postbox.cli.root import _stop_on_signals

    url = database_url(ctx)
    await_database(url, "replay runner", connect_timeout)
    runner = ReplayRunner(url, poll_interval=poll_interval, runner_id=f"runner-{os.getpid()}")
    _stop_on_signals(runner.stop, "replay runner stopping")
    runner.serve()


def _control(action: Callable[..., ReplayJob], help_text: str) -> click.Command:
    @click.argument("job_id", type=int)
    @_reason
    @_actor
    @_json
    @click.pass_context
    def command(ctx: click.Context, job_id: int, reason: str, actor: str, as_json: bool) -> None:
        with _connection(ctx) as conn:
            _report(action(conn, job_id, reason, actor), as_json)

    return click.command(help=help_text)(command)


replay_group.add_command(_control(replay.pause, "Pause a replay job (from any session)."), "pause")
replay_group.add_command(_control(replay.resume, "Resume a paused replay job."), "resume")
replay_group.add_command(_control(replay.cancel, "Cancel a replay job (sent messages go on)."), "cancel")


# --- postbox keys / postbox consumer ------------------------------------------------------------------


@click.group()
def keys() -> None:
    """Keys held behind a dead-lettered head."""


@keys.command("blocked")
@_json
@click.pass_context
def keys_blocked(ctx: click.Context, as_json: bool) -> None:
    """Blocked keys, oldest first, with the dead letter holding each and how many messages wait."""
    with _connection(ctx) as conn:
        rows = deadletter.blocked_keys(conn)
    _emit(
        rows,
        ["origin", "queue", "key", "dead_letter_id", "reason", "blocked_for", "held_messages"],
        as_json,
        "no blocked keys",
    )


@keys.command("unblock")
@click.argument("queue")
@click.argument("key")
@click.option("--origin", type=click.Choice(["inbox", "outbox"]), default="inbox", show_default=True)
@click.option(
    "--replay", "do_replay", is_flag=True, help="Replay the head in place instead of discarding it."
)
@_reason
@_actor
@click.pass_context
def keys_unblock(
    ctx: click.Context, queue: str, key: str, origin: str, do_replay: bool, reason: str, actor: str
) -> None:
    """Unblock KEY of QUEUE: discard its dead-lettered head (held messages follow), or --replay it."""
    with _connection(ctx) as conn:
        click.echo(deadletter.unblock_key(conn, origin, queue, key, reason, actor, do_replay))  # type: ignore[arg-type]


@click.group()
def consumer() -> None:
    """Halt and resume consumers."""


@consumer.command("halt")
@click.argument("name")
@_reason
@_actor
@click.pass_context
def consumer_halt(ctx: click.Context, name: str, reason: str, actor: str) -> None:
    """Halt a consumer: its workers claim nothing until it is resumed."""
    with _connection(ctx) as conn:
        deadletter.halt_consumer(conn, name, reason, actor)
    click.echo(f"consumer {name} halted")


@consumer.command("resume")
@click.argument("name")
@_reason
@_actor
@click.pass_context
def consumer_resume(ctx: click.Context, name: str, reason: str, actor: str) -> None:
    """Resume a halted consumer."""
    with _connection(ctx) as conn:
        was = deadletter.resume_consumer(conn, name, reason, actor)
    click.echo(f"consumer {name} resumed" if was else f"consumer {name} was not halted")


def register(cli: click.Group) -> None:
    """Add the operator command groups to the root command."""
    cli.add_command(dlq)
    cli.add_command(replay_group, "replay")
    cli.add_command(keys)
    cli.add_command(consumer)

"""``postbox dlq …``: list, group, show, explain, replay, discard, resolve, edit dead letters.

Tables for people, ``--json`` for scripts. Every command that changes something needs ``--reason``
and records ``--actor`` (default: ``$POSTBOX_ACTOR`` or the OS user) in ``postbox.audit_log``. Each
is a thin layer over :mod:`postbox.deadletters.ops` and :mod:`postbox.deadletters.replay`, which are
thin layers over SQL functions a DBA can call directly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Literal, cast

import click

from postbox.cli.output import (
    actor_option,
    connection,
    dead_letter_filter,
    emit,
    emit_json,
    filter_options,
    full_option,
    human,
    json_option,
    reason_option,
    record,
    require_selection,
)
from postbox.cli.replay import report, run_in_foreground
from postbox.deadletters import ops as deadletter
from postbox.deadletters import replay
from postbox.deadletters.replay import ReplayOptions
from postbox.values import json_text_value

__all__ = ["dlq"]


def _replay_default(name: str) -> Any:
    """A replay option's default, as the settings model declares it (one place)."""
    return ReplayOptions.model_fields[name].default


@click.group()
def dlq() -> None:
    """Dead letters: list, group, show, explain, replay, discard, resolve, edit."""


@dlq.command("list")
@filter_options
@click.option(
    "--status",
    default="open",
    show_default=True,
    type=click.Choice(["open", "replaying", "replayed", "replay_failed", "discarded", "resolved", "any"]),
)
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 100_000))
@full_option
@json_option
@click.pass_context
def dlq_list(ctx: click.Context, /, status: str, limit: int, full: bool, as_json: bool, **kw: Any) -> None:
    """Dead letters matching the filter, in replay order."""
    with connection(ctx) as conn:
        rows = deadletter.select(conn, dead_letter_filter(kw, status), limit)
    for row in rows:
        row["error"] = ": ".join(str(p) for p in (row.get("last_error_type"), row.get("last_error")) if p)
    emit(
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
            "error",
        ],
        as_json,
        "no dead letters match",
        full,
    )


@dlq.command("groups")
@json_option
@click.pass_context
def dlq_groups(ctx: click.Context, as_json: bool) -> None:
    """Open dead letters grouped by queue, type, reason and error fingerprint."""
    with connection(ctx) as conn:
        rows = deadletter.groups(conn)
    emit(
        rows,
        ["queue", "type", "reason", "open", "keys", "oldest_age", "fingerprint"],
        as_json,
        "no open dead letters",
    )


@dlq.command("show")
@click.argument("dead_letter_id", type=int)
@json_option
@click.pass_context
def dlq_show(ctx: click.Context, dead_letter_id: int, as_json: bool) -> None:
    """Every field of one dead letter, with its payload versions."""
    with connection(ctx) as conn:
        row = deadletter.show(conn, dead_letter_id)
    if row is None:
        raise click.ClickException(f"dead letter {dead_letter_id} does not exist")
    if as_json:
        emit_json(row)
        return
    record(row, skip=("edits", "last_traceback"))
    if row.get("last_traceback"):
        click.echo("\n" + str(row["last_traceback"]).rstrip())
    for e in row["edits"]:
        click.echo(
            f"\nedit v{e['version']} by {e['db_user']}{' as ' + e['actor'] if e['actor'] else ''} "
            f"at {human(e['edited_at'])}: {e['reason']}"
        )


@dlq.command("explain")
@click.argument("dead_letter_id", type=int, required=False)
@click.option("--message-id", help="Explain the newest dead letter of this message id.")
@full_option
@json_option
@click.pass_context
def dlq_explain(
    ctx: click.Context, dead_letter_id: int | None, message_id: str | None, full: bool, as_json: bool
) -> None:
    """The whole history of a dead letter: receipt, attempts, decisions, replays (details whole and
    wrapped on a terminal; cut at 60 characters when piped, unless --full)."""
    with connection(ctx) as conn:
        if dead_letter_id is None:
            if not message_id:
                raise click.UsageError("give a DEAD_LETTER_ID or --message-id")
            dead_letter_id = deadletter.latest_for_message(conn, message_id)
            if dead_letter_id is None:
                raise click.ClickException(f"message {message_id!r} has no dead letter")
        events = deadletter.explain(conn, dead_letter_id)
    if not events:
        raise click.ClickException(f"dead letter {dead_letter_id} does not exist")
    emit([e.__dict__ for e in events], ["at", "event", "detail"], as_json, "", full, wrap=True)


def _closing(action: Callable[..., list[dict[str, Any]]], verb: str) -> Callable[..., None]:
    @filter_options
    @click.option("--all", "everything", is_flag=True, help="Every open dead letter (no filter).")
    @reason_option
    @actor_option
    @json_option
    @click.pass_context
    def command(
        ctx: click.Context, /, everything: bool, reason: str, actor: str, as_json: bool, **kw: Any
    ) -> None:
        flt = dead_letter_filter(kw)
        require_selection(flt, everything)
        with connection(ctx) as conn:
            _check_closable(conn, flt, verb)
            rows = action(conn, flt, reason, actor)
        if as_json:
            emit_json(rows)
        else:
            for r in rows:
                click.echo(f"dead letter {r['dead_letter_id']} {verb}: {r['action']}")
            click.echo(f"{len(rows)} dead letter(s) {verb}")
        missed = sorted(set(flt.ids or ()) - {r["dead_letter_id"] for r in rows})
        if missed:  # open when checked, closed or sent back by someone else since
            raise click.ClickException(f"{_named(missed)} no longer open: not {verb}")

    return command


def _check_closable(conn: Any, flt: deadletter.DeadLetterFilter, verb: str) -> None:
    """Refuse, before anything is done (or audited), dead letters given by id that do not exist or
    are not open, and a selection that matches no open dead letter."""
    if flt.ids:
        found = deadletter.select(conn, flt.model_copy(update={"status": "any"}), limit=len(flt.ids))
        status = {r["id"]: r["status"] for r in found}
        unknown = sorted(set(flt.ids) - set(status))
        if unknown:
            raise click.ClickException(f"{_named(unknown)} {'does' if len(unknown) == 1 else 'do'} not exist")
        closed = sorted(i for i in set(flt.ids) if status[i] != "open")
        if closed:
            which = ", ".join(f"{i} is {status[i]}" for i in closed)
            raise click.ClickException(
                f"dead letter {which}: only open dead letters can be {verb}; nothing was {verb}"
            )
    if not deadletter.select(conn, flt, limit=1):
        raise click.ClickException(f"no open dead letter matches: nothing was {verb}")


def _named(ids: list[int]) -> str:
    return f"dead letter {ids[0]}" if len(ids) == 1 else f"dead letters {', '.join(map(str, ids))}"


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
@reason_option
@actor_option
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
        payload = json_text_value(raw)
    except ValueError as error:
        raise click.BadParameter(f"not JSON: {error}", param_hint="--payload") from None
    with connection(ctx) as conn:
        version = deadletter.edit_payload(conn, dead_letter_id, payload, reason, actor)
    click.echo(f"dead letter {dead_letter_id}: payload version {version} saved (the original is kept)")


@dlq.command("replay")
@filter_options
@click.option("--all", "everything", is_flag=True, help="Every open dead letter (no filter).")
@click.option(
    "--mode",
    type=click.Choice(["in_place", "new_message"]),
    default=_replay_default("mode"),
    show_default=True,
    help="in_place: same message_id; new_message: a new message referencing the original.",
)
@click.option(
    "--rate",
    type=float,
    default=_replay_default("rate"),
    show_default=True,
    help="Messages per second at most.",
)
@click.option("--batch-size", type=int, default=_replay_default("batch_size"), show_default=True)
@click.option("--max-in-flight", type=int, default=_replay_default("max_in_flight"), show_default=True)
@click.option(
    "--canary",
    type=int,
    default=_replay_default("canary"),
    show_default=True,
    help="Replay this many first; go on only if all succeed.",
)
@click.option(
    "--abort-ratio",
    type=float,
    default=_replay_default("abort_failure_ratio"),
    show_default=True,
    help="Abort above this failed/finished ratio.",
)
@click.option("--dry-run", is_flag=True, help="Say what would happen; send nothing.")
@click.option("--detach", is_flag=True, help="Only create the job (a `postbox replay run` process runs it).")
@reason_option
@actor_option
@json_option
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
    flt = dead_letter_filter(kw)
    require_selection(flt, everything)
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
    with connection(ctx) as conn:
        job_id = replay.start(conn, flt, reason, actor, options)
    if not as_json:
        click.echo(f"replay job {job_id} created ({'dry run' if dry_run else mode}, {rate:g}/s)", err=True)
    if detach:
        with connection(ctx) as conn:
            report(replay.get(conn, job_id), as_json)
        return
    job = run_in_foreground(ctx, job_id, as_json)
    if dry_run and not as_json:
        with connection(ctx) as conn:
            emit(replay.items(conn, job_id), ["dead_letter_id", "action"], False, "", full=True)
    if job.state in ("aborted", "cancelled"):
        sys.exit(1)


@dlq.command("audit")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 100_000))
@json_option
@click.pass_context
def dlq_audit(ctx: click.Context, limit: int, as_json: bool) -> None:
    """Operator actions, newest first (postbox.audit_log)."""
    with connection(ctx) as conn:
        rows = deadletter.audit_trail(conn, limit)
    emit(
        rows,
        ["id", "at", "db_role", "actor", "action", "reason", "target"],
        as_json,
        "no operator actions yet",
    )

"""The console's actions: one POST endpoint, two steps. The first POST checks the form (a reason,
JSON that parses, a rate above 0, ids that exist) and shows what will happen (the diff of an edit);
the second, with ``confirmed=yes``, does it, by calling the same audited operations as the CLI
(:mod:`postbox.deadletters.ops`, :mod:`postbox.deadletters.replay`), with the signed-in user as the
actor. Only operators act; every POST carries the session's CSRF token. Bad input changes nothing.
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from postbox.console import csrf, queries
from postbox.console.pages import group_key, group_url
from postbox.console.web import Console, console_of, render
from postbox.deadletters import ops, replay
from postbox.deadletters.ops import DeadLetterFilter
from postbox.deadletters.replay import ReplayOptions
from postbox.values import json_text_value

__all__ = ["BadInput", "act"]

log = logging.getLogger("postbox.console")
Conn = psycopg.Connection[Any]
GROUP_LIMIT = 100_000


class BadInput(ValueError):
    """What is wrong with the form, for the person who filled it in."""


@dataclass
class Plan:
    """What an action will do: said first, done once confirmed."""

    title: str
    summary: list[str]
    run: Callable[[Conn, str], str]  # (connection, actor) -> what was done
    back: str
    diff: str | None = None
    fields: dict[str, list[str]] = field(default_factory=dict)


def _reason(form: FormData) -> str:
    reason = str(form.get("reason") or "").strip()
    if not reason:
        raise BadInput("give a reason: it goes into the audit log with your name")
    return reason


def _id(form: FormData, name: str) -> int:
    raw = str(form.get(name) or "").strip()
    try:
        return int(raw)
    except ValueError:
        raise BadInput(f"{name} must be a whole number, not {raw!r}") from None


def _selection(conn: Conn, form: FormData) -> tuple[DeadLetterFilter, str, str]:
    """The dead letters an action covers: the ids ticked, or a whole group; (filter, words, back)."""
    if form.get("scope") == "group":
        try:
            key = group_key(form, "g_")
        except HTTPException as error:
            raise BadInput(str(error.detail)) from None
        size = queries.group_members(conn, key, limit=1)[1]["open"]
        if not size:
            raise BadInput("this group has no open dead letters any more")
        flt = key.as_filter() or DeadLetterFilter(ids=queries.member_ids(conn, key, GROUP_LIMIT))
        words = f"the whole group ({size} open dead letters of {key.queue}, {key.type or 'no type'}, {key.reason})"
        return flt, words, group_url(key.params())
    ids: list[int] = []
    for raw in form.getlist("ids"):
        try:
            ids.append(int(str(raw)))
        except ValueError:
            raise BadInput(f"not a dead letter id: {raw!r}") from None
    if not ids:
        raise BadInput("select at least one dead letter (or the whole group)")
    found = {r[0]: r[1] for r in conn.execute(
        "SELECT id, status FROM postbox.dead_letters WHERE id = ANY(%s)", (ids,)).fetchall()}  # fmt: skip
    unknown = [i for i in ids if i not in found]
    if unknown:
        raise BadInput(f"no dead letter {', '.join(map(str, unknown))}")
    closed = [f"{i} ({found[i]})" for i in ids if found[i] != "open"]
    if closed:
        raise BadInput(f"not open any more: dead letter {', '.join(closed)}")
    back = f"/dead-letters/{ids[0]}" if len(ids) == 1 else "/dead-letters"
    return DeadLetterFilter(ids=ids), f"{len(ids)} dead letter(s): {', '.join(map(str, ids))}", back


def _plan_edit(conn: Conn, form: FormData) -> Plan:
    dead_letter_id, reason = _id(form, "id"), _reason(form)
    try:
        payload = json_text_value(str(form.get("payload") or ""))
    except ValueError as error:
        raise BadInput(f"the payload is not JSON: {error}") from None
    row = ops.show(conn, dead_letter_id)
    if row is None:
        raise BadInput(f"no dead letter {dead_letter_id}")
    if row["status"] != "open":
        raise BadInput(f"dead letter {dead_letter_id} is {row['status']}: only an open one can be edited")
    old = json.dumps(row["replay_payload"], indent=2, sort_keys=True).splitlines()
    new = json.dumps(payload, indent=2, sort_keys=True).splitlines()
    diff = "\n".join(
        difflib.unified_diff(old, new, f"version {row['payload_version']}", "edited", lineterm="")
    )

    def run(c: Conn, actor: str) -> str:
        version = ops.edit_payload(c, dead_letter_id, payload, reason, actor)
        return f"dead letter {dead_letter_id}: payload version {version} saved (the original is kept)"

    summary = [f"Edit the payload of dead letter {dead_letter_id} (a replay sends it)", f"Reason: {reason}"]
    return Plan("Edit payload", summary, run, f"/dead-letters/{dead_letter_id}", diff or "(no change)")


def _plan_close(verb: str) -> Callable[[Conn, FormData], Plan]:
    operation = ops.discard if verb == "discard" else ops.resolve

    def plan(conn: Conn, form: FormData) -> Plan:
        reason = _reason(form)
        flt, words, back = _selection(conn, form)

        def run(c: Conn, actor: str) -> str:
            rows = operation(c, flt, reason, actor)
            return f"{len(rows)} dead letter(s) {verb}{'ed' if verb == 'discard' else 'd'}"

        return Plan(verb.capitalize(), [f"{verb.capitalize()} {words}", f"Reason: {reason}"], run, back)

    return plan


def _replay_options(form: FormData) -> ReplayOptions:
    def number(name: str, cast: Callable[[str], Any]) -> Any:
        raw = str(form.get(name) or "").strip()
        try:
            return cast(raw)
        except ValueError:
            raise BadInput(f"{name.replace('_', ' ')} must be a number, not {raw!r}") from None

    try:
        return ReplayOptions(
            mode=str(form.get("mode") or "in_place"),  # type: ignore[arg-type]
            rate=number("rate", float),
            max_in_flight=number("max_in_flight", int),
            batch_size=number("batch_size", int),
            canary=number("canary", int),
            abort_failure_ratio=number("abort_failure_ratio", float),
        )
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise BadInput(f"replay options: {problems}") from None


def _plan_replay(conn: Conn, form: FormData) -> Plan:
    reason, options = _reason(form), _replay_options(form)
    flt, words, _ = _selection(conn, form)

    def run(c: Conn, actor: str) -> str:
        job_id = replay.start(c, flt, reason, actor, options)
        return f"replay job {job_id} started"

    summary = [
        f"Replay {words}",
        f"{options.mode}, {options.rate:g} per second, at most {options.max_in_flight} in flight, "
        f"canary {options.canary}, abort above {options.abort_failure_ratio:g} failed",
        f"Reason: {reason}",
    ]
    return Plan("Start a replay job", summary, run, "/jobs")


def _plan_job(conn: Conn, form: FormData) -> Plan:
    job_id, reason, verb = _id(form, "job"), _reason(form), str(form.get("verb") or "")
    operation = {"pause": replay.pause, "resume": replay.resume, "cancel": replay.cancel}.get(verb)
    if operation is None:
        raise BadInput(f"a job can be paused, resumed or cancelled, not {verb!r}")
    try:
        job = replay.get(conn, job_id)
    except LookupError:
        raise BadInput(f"no replay job {job_id}") from None
    if job.finished:
        raise BadInput(f"replay job {job_id} is {job.state} already")

    def run(c: Conn, actor: str) -> str:
        return f"replay job {job_id}: {operation(c, job_id, reason, actor).state}"

    summary = [f"{verb.capitalize()} replay job {job_id} (now {job.state})", f"Reason: {reason}"]
    return Plan(f"{verb.capitalize()} a replay job", summary, run, f"/jobs/{job_id}")


def _plan_consumer(conn: Conn, form: FormData) -> Plan:
    name, reason, verb = str(form.get("consumer") or ""), _reason(form), str(form.get("verb") or "")
    if verb not in ("halt", "resume"):
        raise BadInput(f"a consumer can be halted or resumed, not {verb!r}")
    if name not in ops.consumer_names(conn, name):
        raise BadInput(f"unknown consumer {name!r}")

    def run(c: Conn, actor: str) -> str:
        if verb == "halt":
            already = ops.consumer_halted(c, name)
            if already is not None:  # the first halt's reason stands; nothing is audited
                return f"consumer {name} was already halted ({already['halted_reason'] or 'no reason given'})"
            ops.halt_consumer(c, name, reason, actor)
            return f"consumer {name} halted"
        return f"consumer {name} {'resumed' if ops.resume_consumer(c, name, reason, actor) else 'was not halted'}"

    summary = [f"{verb.capitalize()} consumer {name}", f"Reason: {reason}"]
    return Plan(f"{verb.capitalize()} a consumer", summary, run, "/")


PLANS: dict[str, Callable[[Conn, FormData], Plan]] = {
    "edit": _plan_edit,
    "discard": _plan_close("discard"),
    "resolve": _plan_close("resolve"),
    "replay": _plan_replay,
    "job": _plan_job,
    "consumer": _plan_consumer,
}


def _plan(console: Console, op: str, form: FormData) -> Plan:
    """What ``op`` would do (checked; nothing changed)."""
    with console.connect(autocommit=False) as conn:
        plan = PLANS[op](conn, form)
        conn.rollback()
        return plan


def _do(console: Console, op: str, form: FormData, actor: str) -> str:
    """Do ``op`` (checked again, in the transaction that does it), as ``actor``."""
    with console.connect(autocommit=False) as conn:
        done = PLANS[op](conn, form).run(conn, actor)
        conn.commit()
        return done


async def act(request: Request) -> Response:
    console = console_of(request)
    user = console.users.current(request)
    form = await request.form()
    csrf.check(request, form)
    if user is None or not user.may_act:
        raise HTTPException(403, "refused: only an operator may act (you are a viewer)")
    op = str(form.get("op") or "")
    if op not in PLANS:
        raise HTTPException(400, f"unknown action {op!r}")
    try:
        plan = await run_in_threadpool(_plan, console, op, form)
        if form.get("confirmed") != "yes":
            fields = [(k, str(v)) for k, v in form.multi_items() if k not in (csrf.FIELD, "confirmed")]
            return render(request, "confirm.html", {"plan": plan, "fields": fields})
        done = await run_in_threadpool(_do, console, op, form, user.name)
    except BadInput as error:
        return render(request, "message.html", {"title": "Nothing changed", "message": str(error)}, 400)
    except psycopg.Error as error:
        detail = error.diag.message_primary or str(error)
        return render(request, "message.html", {"title": "Nothing changed", "message": detail}, 400)
    log.info("console: %s: %s", user.name, done)
    request.session["notice"] = done
    back = plan.back
    if op == "replay" and done.startswith("replay job "):
        back = f"/jobs/{done.split()[2]}"
    return RedirectResponse(back, status_code=303)

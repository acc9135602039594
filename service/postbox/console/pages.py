"""The console's pages (GET, read only): overview, dead letters by group, a group's members, one dead
letter's story, blocked keys, replay jobs, the audit log."""

from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import urlencode

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from postbox.console import queries
from postbox.console.queries import GroupFilter, GroupKey
from postbox.console.web import console_of, render
from postbox.deadletters import ops, replay
from postbox.deadletters.replay import ReplayOptions

__all__ = ["group_key", "group_url", "routes"]

REDACTED = "[redacted: your role does not see payloads]"


def _int(request: Request, name: str, default: int = 0, maximum: int = 2**63 - 1) -> int:
    """A whole-number query parameter, from 0 to ``maximum`` (a bigint, or a page the offset of
    which is one): anything else is a 400, not the database's out-of-range error."""
    raw = request.query_params.get(name, "")
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise HTTPException(400, f"{name} must be a whole number, not {raw!r}") from None
    if not 0 <= value <= maximum:
        raise HTTPException(400, f"{name} must be a whole number from 0 to {maximum}, not {raw}")
    return value


MAX_PAGE = 10**9  # times the page size, still far within a bigint offset


def _overview_data(request: Request) -> dict[str, Any]:
    with console_of(request).connect() as conn:
        now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        status = queries.overview(conn, now)
        summary = {r["queue"]: r for r in queries.open_per_queue(conn)}
        sparks = queries.sparklines(conn, now)
    return {"status": status, "summary": summary, "sparks": sparks, "status_now": now}


def overview(request: Request) -> Response:
    return render(request, "overview.html", _overview_data(request))


def overview_panel(request: Request) -> Response:
    return render(request, "_overview.html", _overview_data(request))


def dead_letters(request: Request) -> Response:
    q = request.query_params
    try:
        older = float(q.get("older_than_hours") or 0)
    except ValueError:
        raise HTTPException(400, "older_than_hours must be a number") from None
    if not 0 <= older < 10**7:  # NaN and infinity too
        raise HTTPException(400, "older_than_hours must be a number of hours from 0 to 10000000")
    flt = GroupFilter(q.get("consumer", ""), q.get("type", ""), q.get("reason", ""), q.get("key", ""), older)
    page = _int(request, "page", maximum=MAX_PAGE)
    groups: list[dict[str, Any]] = []
    more = False
    with console_of(request).connect() as conn:
        per_queue = queries.open_per_queue(conn)
        total = sum(int(r["open"]) for r in per_queue)
        if not flt.consumer and len(per_queue) == 1:
            flt = dataclasses.replace(flt, consumer=str(per_queue[0]["queue"]))
        groups, more = queries.groups_page(conn, flt, page)
    for g in groups:
        g["url"] = group_url(g)
    args = urlencode({k: v for k, v in q.items() if k != "page"})
    ctx = {"groups": groups, "filter": flt, "page": page, "more": more, "args": args}
    return render(request, "dead_letters.html", {**ctx, "queues": per_queue, "total": total})


def group_url(g: dict[str, Any]) -> str:
    params = {k: g[k] for k in ("origin", "queue", "type", "reason", "fingerprint") if g.get(k) is not None}
    return "/dead-letters/group?" + urlencode(params)


def group_key(values: Any, prefix: str = "") -> GroupKey:
    """A group from query parameters or form fields (an absent type or fingerprint is NULL)."""
    origin, queue, reason = (str(values.get(prefix + k) or "") for k in ("origin", "queue", "reason"))
    if origin not in ("inbox", "outbox") or not queue or not reason:
        raise HTTPException(400, "a group needs its origin (inbox or outbox), queue and reason")
    t, f = values.get(prefix + "type"), values.get(prefix + "fingerprint")
    return GroupKey(origin, queue, str(t) if t else None, reason, str(f) if f else None)


def group(request: Request) -> Response:
    key = group_key(request.query_params)
    after = _int(request, "after")
    with console_of(request).connect() as conn:
        members, size = queries.group_members(conn, key, after)
    next_after = members[-1]["id"] if len(members) == queries.PAGE else None
    return render(
        request,
        "group.html",
        {
            "group": key,
            "members": members,
            "size": size,
            "next_after": next_after,
            "url": group_url(key.params()),
            "defaults": ReplayOptions(),
        },
    )


def story(request: Request) -> Response:
    """One dead letter's whole story: what ``postbox dlq explain`` shows, its attempts, headers,
    payload and versions, and the key's held messages."""
    dead_letter_id = int(request.path_params["id"])
    console = console_of(request)
    user = console.users.current(request)
    with console.connect() as conn:
        row = ops.show(conn, dead_letter_id)
        if row is None:
            raise HTTPException(404, f"dead letter {dead_letter_id} does not exist")
        events = ops.explain(conn, dead_letter_id)
        attempts = queries.attempts(conn, row["origin"], row["origin_id"])
        queue = row["consumer"] or row["destination"]
        held = queries.held_messages(conn, row["origin"], queue, row["key"])
    visible = user is not None and console.sees_payloads(user)
    if not visible:
        for name in ("payload", "edited_payload", "replay_payload", "headers"):
            row[name] = REDACTED
        for edit in row["edits"]:
            edit["payload"] = edit["previous"] = REDACTED
    ctx = {"d": row, "queue": queue, "events": events, "attempts": attempts, "held": held}
    ctx |= {"visible": visible, "defaults": ReplayOptions(), "group_url": group_url({**row, "queue": queue})}
    return render(request, "story.html", ctx)


def keys(request: Request) -> Response:
    page = _int(request, "page", maximum=MAX_PAGE)
    with console_of(request).connect() as conn:
        rows, more = queries.blocked_keys_page(conn, page)
    return render(request, "keys.html", {"keys": rows, "page": page, "more": more})


def jobs(request: Request) -> Response:
    with console_of(request).connect() as conn:
        rows = replay.jobs(conn, active_only=False, limit=queries.PAGE)
    return render(request, "jobs.html", {"jobs": rows})


def _job_data(request: Request) -> dict[str, Any]:
    job_id = int(request.path_params["id"])
    with console_of(request).connect() as conn:
        try:
            job = replay.get(conn, job_id)
        except LookupError:
            raise HTTPException(404, f"replay job {job_id} does not exist") from None
        audit = queries.job_audit(conn, job_id)
        items = replay.items(conn, job_id, limit=queries.PAGE)
    elapsed = None
    if job.started_at is not None:
        end = job.finished_at or job.last_step_at or job.started_at
        elapsed = (end - job.started_at).total_seconds()
    actual_rate = job.replayed / elapsed if elapsed else None
    return {"job": job, "audit": audit, "items": items, "actual_rate": actual_rate}


def job(request: Request) -> Response:
    return render(request, "job.html", _job_data(request))


def job_panel(request: Request) -> Response:
    """The job's progress for htmx's polling; 286 once it is finished (htmx then stops polling)."""
    data = _job_data(request)
    return render(request, "_job.html", data, status=286 if data["job"].finished else 200)


def audit(request: Request) -> Response:
    before = _int(request, "before") or None
    with console_of(request).connect() as conn:
        rows = queries.audit_page(conn, before)
    next_before = rows[-1]["id"] if len(rows) == queries.PAGE else None
    return render(request, "audit.html", {"rows": rows, "next_before": next_before})


routes = [
    Route("/", overview),
    Route("/overview/panel", overview_panel),
    Route("/dead-letters", dead_letters),
    Route("/dead-letters/group", group),
    Route("/dead-letters/{id:int}", story),
    Route("/keys", keys),
    Route("/jobs", jobs),
    Route("/jobs/{id:int}", job),
    Route("/jobs/{id:int}/panel", job_panel),
    Route("/audit", audit),
]

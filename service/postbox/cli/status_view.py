"""``postbox status`` on screen: one table per section in the CLI's one table style (rich on a
terminal, plain aligned text when piped), from the data :func:`postbox.operations.status.collect_status`
gathers (already masked)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import click

from postbox.cli.output import Columns, table

__all__ = ["show_status"]


def _age(seconds: float | None) -> timedelta | str:
    return "never" if seconds is None else timedelta(seconds=seconds)


def _sections(s: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]], Columns, str]]:
    """(title, rows, columns, what an empty section says) for each section of the screen."""
    consumers = [
        {**c, "lag": _age(c["lag_seconds"]), "state": "HALTED" if c["halted"] else "ok"}
        for c in s["consumers"]
    ]
    workers = [{**w, "heartbeat": _age(w["heartbeat_age_seconds"])} for w in s["workers"]]
    dead = [{**d, "oldest": _age(d["oldest_age_seconds"])} for d in s["dead_letters"]]
    relay = [{**r, "oldest": _age(r["oldest_age_seconds"])} for r in s["relay"]]
    maintenance = [{**m, "last_success": _age(m["last_success_age_seconds"])} for m in s["maintenance"]]
    open_total = sum(d["open"] for d in s["dead_letters"])
    sections: list[tuple[str, list[dict[str, Any]], Columns, str]] = [
        ("Consumers", consumers,
         [("name", "CONSUMER"), "ready", "running", "pending", "retrying", "blocked_keys", "lag",
          ("received_last_minute", "IN/MIN"), ("received_last_minute_done", "DONE"), "state"], "(none)"),
        ("Live processes", workers,
         ["kind", "queue", "host", "pid", ("concurrency", "SLOTS"), "heartbeat", "in_flight", "version",
          ("schema_revision", "REVISION"), "state"], "(none)"),
        (f"Dead letters: {open_total} open", dead,
         ["origin", "queue", "type", "reason", "open", "oldest", "latest_error"], ""),
        ("Relay backlog", relay,
         ["destination", "rows", "ready", "in_flight", "retrying", "blocked", "oldest"], "(empty)"),
    ]  # fmt: skip
    if s["replays"]:
        sections.append(
            ("Replays", s["replays"], ["id", "state", "total", "replayed", "succeeded", "failed"], "")
        )
    if maintenance:
        sections.append(("Maintenance", maintenance, ["job", "runs", "last_success", "last_error"], ""))
    return sections


def show_status(s: dict[str, Any]) -> None:
    """The status screen: a title, then each section (an empty one says so)."""
    click.echo(f"Postbox status at {s['at']}")
    for title, rows, columns, empty in _sections(s):
        click.echo("")
        table(rows, columns, empty=empty, title=title)

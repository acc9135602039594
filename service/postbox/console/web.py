"""What the pages and actions share: the database and users (:class:`Console`), the templates and
their filters, and :func:`render`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from starlette.requests import Request
from starlette.responses import Response
from starlette.templating import Jinja2Templates

from postbox.console import csrf
from postbox.console.auth import User, Users

__all__ = ["Console", "console_of", "render", "templates"]

HERE = Path(__file__).resolve().parent


@dataclass
class Console:
    """What every route needs: the database, the users, the redaction rule."""

    url: str
    users: Users
    viewers_see_payloads: bool

    @contextmanager
    def connect(self, autocommit: bool = True) -> Iterator[psycopg.Connection[Any]]:
        with psycopg.connect(self.url, autocommit=autocommit, application_name="postbox console") as conn:
            yield conn

    def sees_payloads(self, user: User) -> bool:
        return user.may_act or self.viewers_see_payloads


def _age(value: Any) -> str:
    """3d 4h, 5m 2s, 800ms: how long, for people."""
    if value is None:
        return ""
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    parts: list[str] = []
    left = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size or (unit == "s" and not parts):
            parts.append(f"{left // size}{unit}")
            left %= size
        if len(parts) == 2:
            break
    return " ".join(parts)


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if isinstance(value, datetime) else str(value or "")


def _spark(values: list[int], width: int = 120, height: int = 24) -> str:
    """The points of an SVG polyline for ``values`` (scaled to the highest)."""
    top = max(values or [0]) or 1
    step = width / max(len(values) - 1, 1)
    return " ".join(
        f"{i * step:.1f},{height - 2 - (v / top) * (height - 4):.1f}" for i, v in enumerate(values)
    )


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)


templates = Jinja2Templates(directory=str(HERE / "templates"))
templates.env.filters.update(age=_age, when=_when, spark=_spark, pretty=_pretty)


def render(request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
    """A page, with the signed-in user, this session's CSRF token and the pending notice."""
    console: Console = request.app.state.console
    user = console.users.current(request)
    notice = request.session.pop("notice", None)
    ctx = {"user": user, "csrf_token": csrf.token(request), "notice": notice, **context}
    return templates.TemplateResponse(request, name, ctx, status_code=status)


def console_of(request: Request) -> Console:
    console: Console = request.app.state.console
    return console

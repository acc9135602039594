"""CSRF protection: every POST carries the session's token (a form field ``csrf_token``, or the
``X-CSRF-Token`` header htmx sends), compared in constant time; a POST without it changes nothing."""

from __future__ import annotations

import hmac
import secrets

from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request

__all__ = ["check", "token"]

FIELD = "csrf_token"
HEADER = "x-csrf-token"


def token(request: Request) -> str:
    """This session's token (made on first use)."""
    value = request.session.get("csrf")
    if not isinstance(value, str):
        value = secrets.token_urlsafe(32)
        request.session["csrf"] = value
    return value


def check(request: Request, form: FormData) -> None:
    """Refuse (403) a POST whose token is missing or not this session's."""
    expected = request.session.get("csrf")
    given = form.get(FIELD) or request.headers.get(HEADER) or ""
    if (
        not isinstance(expected, str)
        or not isinstance(given, str)
        or not hmac.compare_digest(expected.encode(), given.encode())
    ):
        raise HTTPException(403, "refused: the form's CSRF token is missing or stale; reload the page")

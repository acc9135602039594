"""The console's application: Starlette routes, the signed session cookie, sign-in, the templates,
and the replay runner that steps the jobs (this process is then a ``postbox replay run`` too).

Pages are rendered on the server (Jinja2); htmx (vendored in ``static/``) refreshes the overview
and a job's progress. Reads go through :mod:`postbox.console.queries`, actions through
:mod:`postbox.console.actions`, both on the database URL given (a login granted ``postbox_operator``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from postbox.config.settings import ConsoleOptions
from postbox.console import actions, csrf, pages
from postbox.console.auth import Users
from postbox.console.web import HERE, Console, render
from postbox.deadletters.replay import ReplayRunner

__all__ = ["create_app"]

log = logging.getLogger("postbox.console")
PUBLIC = ("/login", "/static/", "/healthz")


class RequireSignIn(BaseHTTPMiddleware):
    """Every page but sign-in, the static files and the health check needs a signed-in user."""

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        path = request.url.path
        if any("\x00" in v for v in request.query_params.values()):  # no PostgreSQL text holds one
            return PlainTextResponse("refused: a query parameter contains NUL (\\u0000)", status_code=400)
        if not path.startswith(PUBLIC) and request.app.state.console.users.current(request) is None:
            if request.method != "GET":
                return PlainTextResponse("sign in first", status_code=401)
            return RedirectResponse(f"/login?next={request.url.path}", status_code=303)
        response = await call_next(request)
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'"
        )
        response.headers["Cache-Control"] = "no-store"
        return response


async def login_form(request: Request) -> Response:
    return render(request, "login.html", {"next": request.query_params.get("next", "/"), "error": None})


async def login(request: Request) -> Response:
    form = await request.form()
    csrf.check(request, form)
    console: Console = request.app.state.console
    user = console.users.authenticate(str(form.get("username", "")), str(form.get("password", "")))
    target = str(form.get("next") or "/")
    if not target.startswith("/") or target.startswith(("//", "/\\")) or any(c in target for c in "\r\n"):
        target = "/"  # only a path of this site (browsers read /\\host as //host)
    if user is None:
        ctx = {"next": target, "error": "unknown user or wrong password/token"}
        return render(request, "login.html", ctx, status=401)
    request.session.clear()  # a new session (and CSRF token) at sign-in
    request.session["user"] = user.name
    log.info("console: %s signed in (%s)", user.name, user.role)
    return RedirectResponse(target, status_code=303)


async def logout(request: Request) -> Response:
    form = await request.form()
    csrf.check(request, form)
    request.session.clear()
    return RedirectResponse("/login", status_code=303)


async def healthz(request: Request) -> Response:
    return PlainTextResponse("ok")


def create_app(
    url: str,
    options: ConsoleOptions,
    session_secret: str | None = None,
    run_replays: bool = True,
    poll_interval: float = 0.5,
) -> Starlette:
    """The console on database ``url``; ``run_replays`` steps every runnable replay job in a
    background thread while the application runs (stopped with it)."""
    users = Users(options)  # ConfigError when nobody could sign in
    if not session_secret:
        log.warning("console: no session secret given; sessions end when this process does")
        session_secret = os.urandom(32).hex()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runner = ReplayRunner(url, poll_interval=poll_interval, runner_id=f"console-{os.getpid()}")
        if run_replays:
            runner.start()
        try:
            yield
        finally:
            runner.stop()
            runner.join(10)

    routes = [
        Route("/login", login_form, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/healthz", healthz),
        *pages.routes,
        Route("/act", actions.act, methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    middleware = [
        Middleware(
            SessionMiddleware,
            secret_key=session_secret,
            session_cookie="postbox_console",
            max_age=8 * 3600,
            same_site="strict",
        ),
        Middleware(RequireSignIn),
    ]
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.console = Console(url, users, options.viewers_see_payloads)
    return app

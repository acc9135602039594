"""``postbox console``: the operator console, a web page served by uvicorn (docs/console.md)."""

from __future__ import annotations

import contextlib
import getpass
import os
import signal
from collections.abc import Iterator

import click

from postbox.cli.context import checked_database_url, serve_metrics, settings
from postbox.errors import MissingExtra

__all__ = ["console"]


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, stopping on SIGTERM or SIGINT and then exiting 0 like every other
        postbox process (uvicorn raises the signal again once stopped)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), default=8470, show_default=True, help="Port.")
@click.option(
    "--session-secret",
    default=None,
    help="Signs the session cookie; better from the environment. Without one, a secret is made for "
    "this process (sessions end with it; several console processes would not share them).",
)
@click.option(
    "--run-replays/--no-run-replays",
    default=True,
    show_default=True,
    help="Step replay jobs in this process (like `postbox replay run`); off when a replay runner runs "
    "elsewhere and should do it alone.",
)
@click.option(
    "--hash-password", is_flag=True, help="Ask for a password, print its hash for the settings, exit."
)
@click.pass_context
def console(
    ctx: click.Context,
    host: str,
    port: int,
    session_secret: str | None,
    run_replays: bool,
    hash_password: bool,
) -> None:
    """Serve the operator console: overview, dead letters, replay jobs, blocked keys, with sign-in.

    Users and roles (viewer, operator) come from [postbox.console.users.NAME] in the configuration
    file. Run it as a login granted postbox_operator; it listens on 127.0.0.1 unless told otherwise.
    """
    try:
        import uvicorn

        from postbox.console.app import create_app
        from postbox.console.auth import hash_password as make_hash
    except ImportError:
        raise MissingExtra("postbox console", "console") from None

    if hash_password:
        password = getpass.getpass("password: ")
        if not password or password != getpass.getpass("again: "):
            raise click.ClickException("the passwords are empty or differ")
        click.echo(make_hash(password))
        return
    s = settings(ctx)
    url = checked_database_url(ctx)
    app = create_app(url, s.console, session_secret, run_replays=run_replays)
    server = _server_class()(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    # /metrics, /healthz, /readyz when a port is given; ready once uvicorn listens (its signal
    # handlers are in place by then: a SIGTERM from then on stops it cleanly) and until it stops.
    serve_metrics(ctx, s, url, lambda: bool(server.started and not server.should_exit))
    click.echo(f"postbox console on http://{host}:{port} (pid {os.getpid()})", err=True)
    server.run()

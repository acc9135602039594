"""The package as an application meets it: ``import postbox`` next to the application's own
packages, a public API in ``postbox.__all__``, and types a strict mypy accepts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import postbox

USER_MODULE = '''
"""A user's handler module, typed strictly against Postbox's public API only."""

from __future__ import annotations

import psycopg

import postbox

registry = postbox.Registry()


@registry.handler("orders", "order.placed")
def place(message: postbox.Message, ctx: postbox.Context) -> None:
    if not isinstance(message.payload, dict):
        raise postbox.Permanent("payload must be an object")
    ctx.conn.execute("SELECT 1")


def accept(conn: psycopg.Connection[object], order_id: str) -> postbox.ReceiveResult:
    result = postbox.receive(
        conn, consumer="orders", message_id=order_id, type="order.placed", payload={"id": order_id}
    )
    postbox.publish(conn, destination="emails", key=order_id, payload={"id": order_id})
    return result


def later() -> postbox.Retry:
    return postbox.Retry(5.0, "the warehouse is busy")


def worker(url: str) -> postbox.Worker:
    return postbox.Worker(url, registry, postbox.WorkerSettings(consumer="orders"))
'''


def test_every_name_in_all_is_exported_and_the_package_is_typed():
    assert all(hasattr(postbox, name) for name in postbox.__all__)
    assert {
        "receive",
        "publish",
        "Registry",
        "Retry",
        "Permanent",
        "UnknownOutcome",
        "Worker",
        "Relay",
    } <= set(postbox.__all__)
    assert (Path(postbox.__file__).parent / "py.typed").is_file()


# The name the package once installed by mistake (its source folder); an application may own it.
APP_PACKAGE = "service"


def test_an_application_with_its_own_service_package_imports_both(tmp_path):
    app = tmp_path / APP_PACKAGE
    app.mkdir()
    (app / "__init__.py").write_text("receive = 'the application\\'s own'\n")
    script = textwrap.dedent(
        f"""
        import importlib
        import postbox
        app = importlib.import_module({APP_PACKAGE!r})
        assert app.receive == "the application's own", app.receive
        assert callable(postbox.receive) and app.__file__ != postbox.__file__
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_strict_mypy_accepts_a_user_module_written_against_the_public_api(tmp_path):
    """No ``ignore_missing_imports``: the package ships ``py.typed`` and its annotations."""
    (tmp_path / "user_app.py").write_text(USER_MODULE)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "user_app.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr

"""Helpers shared by the tests: polling with a deadline (never a bare sleep), effects tables."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import sql

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent

EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS effects (
    id          bigserial PRIMARY KEY,
    message_id  text NOT NULL,
    key         text NOT NULL,
    sequence    bigint,
    prev_seq    bigint,
    attempt     integer NOT NULL,
    pid         integer NOT NULL DEFAULT pg_backend_pid(),
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS key_state (
    key       text PRIMARY KEY,
    last_seq  bigint NOT NULL
);
"""


def eventually(
    check: Callable[[], T | None], timeout: float = 30.0, interval: float = 0.02, what: str = ""
) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"not reached within {timeout}s: {what or check!r} (last: {last!r})")


def scalar(url: str, sql: str, params: tuple[object, ...] = ()) -> object:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(sql, params).fetchone()
        return row[0] if row else None


def record_effect(
    conn: psycopg.Connection, message_id: str, key: str, sequence: int | None, attempt: int
) -> None:
    """The handler side of the checker: append an effect, with the previous sequence seen for the key."""
    prev = conn.execute("SELECT last_seq FROM key_state WHERE key = %s FOR UPDATE", (key,)).fetchone()
    conn.execute(
        "INSERT INTO effects (message_id, key, sequence, prev_seq, attempt) VALUES (%s, %s, %s, %s, %s)",
        (message_id, key, sequence, prev[0] if prev else None, attempt),
    )
    conn.execute(
        "INSERT INTO key_state (key, last_seq) VALUES (%s, %s) ON CONFLICT (key) DO UPDATE SET last_seq = excluded.last_seq",
        (key, sequence if sequence is not None else -1),
    )


# Worker settings that make tests quick: short polls, heartbeats and stale detection.
FAST_WORKER: dict[str, float] = {
    "poll_interval": 0.05,
    "heartbeat_interval": 0.5,
    "stale_after": 2.0,
    "grace_period": 5.0,
}


SESSION_OF_ITS_OWN = True
"""Processes the tests start (and stop themselves) run in a session of their own: a test that
SIGSTOPs one must not see the kernel end it with SIGHUP because the shell that started the test
run went away meanwhile (a stopped process in a process group that becomes orphaned gets SIGHUP
and SIGCONT), nor a Ctrl-C meant for pytest reach it before the test stops it."""


def spawn_postbox(*args: str, stderr: int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    """Start ``python -m postbox ARGS`` (the ``postbox`` command) from the repository, output
    discarded unless ``stderr=subprocess.PIPE``. In a session of its own (see SESSION_OF_ITS_OWN)."""
    return subprocess.Popen(
        [sys.executable, "-m", "postbox", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=SESSION_OF_ITS_OWN,
    )


def role_login(database: Any, role: str, tag: str) -> Iterator[str]:
    """For a fixture: a login granted only ``role`` in ``database`` (a tests.conftest.Database), with a
    name unique to the test (roles belong to the cluster); its URL, then it is dropped with whatever
    it was granted."""
    from tests.conftest import _conninfo_url

    name, password = f"pbx_{tag}_{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    with database.connect(autocommit=True) as c:
        c.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE {}").format(
            sql.Identifier(name), sql.Literal(password), sql.Identifier(role)))  # fmt: skip
    try:
        yield _conninfo_url(dict(database.server.params, dbname=database.name, user=name, password=password))
    finally:
        with database.connect(autocommit=True) as c:
            c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,))
            c.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
            c.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))

"""The command line's output, for people and for scripts: the real ``postbox`` command run through a
pseudo-terminal draws rich tables in colour (and progress bars on stderr), the same command through a
pipe prints plain aligned text with the same headers and no escape code, ``--json`` prints JSON and
nothing else, and ``NO_COLOR``, ``FORCE_COLOR`` and ``TERM=dumb`` are respected.

Each run forks this process (Postbox already imported, which keeps the many runs fast) and calls the
command's entry point in the child, its file descriptors 0-2 on a pseudo-terminal or on pipes."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

import psycopg
import pytest

import postbox
from postbox.cli.root import main
from postbox.deadletters import ops as deadletter
from tests.apps import failing
from tests.conftest import Database, Server, _cloned
from tests.helpers import FAST_WORKER, eventually, scalar

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LONG = "x" * 120

# Every listing, and what its table shows (a header, a value).
LISTINGS = {
    "status": (["status"], ["CONSUMER", "HALTED", "Dead letters: 1 open"]),
    "dlq list": (["dlq", "list"], ["ID", "QUEUE", "DEAD LETTERED AT", "failing"]),
    "dlq groups": (["dlq", "groups"], ["FINGERPRINT", "permanent"]),
    "dlq explain": (["dlq", "explain", "--message-id", "long"], ["EVENT", "attempt 1 failed"]),
    "dlq show": (["dlq", "show", "1"], ["message_id", "long"]),
    "dlq audit": (["dlq", "audit"], ["ACTOR", "consumer_halt"]),
    "keys blocked": (["keys", "blocked"], ["HELD MESSAGES", "failing"]),
    "replay status": (["replay", "status", "--all"], ["STATE", "done"]),
}


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE")}
    return {**env, "PYTHONIOENCODING": "utf-8", "COLUMNS": "120", "TERM": "xterm-256color",
            "POSTBOX_ACTOR": "tester", **extra}  # fmt: skip


def _child(url: str, args: tuple[str, ...], env: dict[str, str]) -> None:
    """In the forked process: the ``postbox`` command's entry point, on file descriptors 0-2 (the
    terminal or the pipes), with its own environment; never returns."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 (closed by _exit)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.argv = ["postbox", "--database-url", url, *args]
        main()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else int(done.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _drain(fds: list[int]) -> dict[int, str]:
    """Everything written to ``fds`` until each is closed (EOF, or EIO for a terminal)."""
    out = {fd: bytearray() for fd in fds}
    open_fds, deadline = list(fds), time.monotonic() + 120
    while open_fds and time.monotonic() < deadline:
        ready, _, _ = select.select(open_fds, [], [], deadline - time.monotonic())
        for fd in ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the terminal's other end is closed, the command is done
                chunk = b""
            if chunk:
                out[fd] += chunk
            else:
                open_fds.remove(fd)
    for fd in fds:
        os.close(fd)
    return {fd: data.decode().replace("\r\n", "\n") for fd, data in out.items()}


def _exit_code(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def on_terminal(url: str, *args: str, **env: str) -> tuple[int, str]:
    """``postbox`` with stdin, stdout and stderr on a pseudo-terminal (``pty.fork``): its exit
    code and what it drew."""
    pid, master = pty.fork()
    if pid == 0:
        _child(url, args, _env(**env))
    drawn = _drain([master])[master]
    return _exit_code(pid), drawn


def through_pipe(url: str, *args: str, **env: str) -> Run:
    """``postbox`` with stdout and stderr on pipes (and no stdin)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((null, 0), (out_w, 1), (err_w, 2)):
            os.dup2(fd, target)
        for fd in (null, out_r, out_w, err_r, err_w):
            os.close(fd)
        _child(url, args, _env(**env))
    os.close(out_w)
    os.close(err_w)
    got = _drain([out_r, err_r])
    return Run(_exit_code(pid), got[out_r], got[err_r])


@pytest.fixture(scope="module")
def world(pg_server: Server, template_db: str) -> Iterator[Database]:
    """Inbox messages of consumer billing (halted), a dead letter of consumer failing holding its
    key (its error repeats the 120-character payload), a finished dry-run replay job over it."""
    with contextmanager(_cloned)(pg_server, "postbox_out", template_db) as db:
        with psycopg.connect(db.url) as conn:
            postbox.receive_many(
                conn,
                [{"consumer": "billing", "message_id": f"b{i}", "key": "k", "payload": i} for i in range(3)],
            )
            conn.execute("SELECT postbox.inbox_receive('failing', 'long', %s::jsonb)", (json.dumps(LONG),))
            conn.commit()
        with postbox.Worker(db.url, failing.registry, consumer="failing", **FAST_WORKER):
            eventually(lambda: scalar(db.url, "SELECT count(*) FROM postbox.dead_letters") == 1)
        with psycopg.connect(db.url, autocommit=True) as conn:
            deadletter.halt_consumer(conn, "billing", "deploy", "tester")
            job = conn.execute(
                """SELECT postbox.dlq_replay('{"queue": "failing"}', reason => 'look', dry_run => true)"""
            ).fetchone()
            assert job is not None
            conn.execute("SELECT postbox.replay_step(%s)", (job[0],))
        yield db


def _cells(text: str) -> str:
    """The text of a rich table without escape codes, borders and spaces (wrapped cells rejoin)."""
    return re.sub(r"[\s│─╭╮╰╯├┤┬┴┼]", "", ANSI.sub("", text))


@pytest.mark.parametrize("name", list(LISTINGS))
def test_a_listing_on_a_terminal_is_a_rich_table_in_colour_and_plain_text_through_a_pipe(world, name):
    args, shown = LISTINGS[name]
    code, drawn = on_terminal(world.url, *args)
    assert code == 0, drawn
    assert ANSI.search(drawn), drawn
    assert "╭" in drawn and "│" in drawn and "╰" in drawn, drawn
    for text in shown:  # (a narrow column may wrap a cell: compared without spaces)
        assert _cells(text) in _cells(drawn), (text, drawn)

    piped = through_pipe(world.url, *args)
    assert piped.returncode == 0, piped.stderr
    assert "\x1b" not in piped.stdout and "│" not in piped.stdout, piped.stdout
    for text in shown:
        assert text in piped.stdout, (text, piped.stdout)


def test_colour_marks_what_needs_attention_and_a_terminal_gets_details_whole(world):
    """A halted consumer and an open dead letter are highlighted; `dlq explain` on a terminal
    wraps the whole detail, and cuts it at 60 characters only through a pipe (unless --full)."""
    _, status = on_terminal(world.url, "status")
    assert re.search(r"\x1b\[[0-9;]*31[0-9;]*mHALTED", status), status
    _, listed = on_terminal(world.url, "dlq", "list")
    assert re.search(r"\x1b\[[0-9;]*33[0-9;]*mopen", listed), listed
    _, explained = on_terminal(world.url, "dlq", "explain", "1")
    assert LONG in _cells(explained) and "..." not in explained
    piped = through_pipe(world.url, "dlq", "explain", "1").stdout
    assert LONG not in piped and "..." in piped
    assert LONG in through_pipe(world.url, "dlq", "explain", "1", "--full").stdout


def test_plain_text_keeps_the_headers_aligned_in_one_case(world):
    lines = through_pipe(world.url, "dlq", "list").stdout.splitlines()
    assert lines[0].split()[:3] == ["ID", "QUEUE", "KEY"]
    assert lines[0].index("QUEUE") == lines[1].index("failing")
    status = through_pipe(world.url, "status").stdout
    assert "\n  CONSUMER  READY" in status and "HALTED" in status and "Relay backlog\n  (empty)" in status


@pytest.mark.parametrize(
    ("args", "keys"),
    [
        (["dlq", "list"], {"id", "queue", "key", "reason", "status", "dead_lettered_at", "error"}),
        (["dlq", "groups"], {"queue", "type", "reason", "open", "keys", "fingerprint"}),
        (["dlq", "explain", "1"], {"at", "event", "detail"}),
        (["dlq", "audit"], {"id", "at", "actor", "action", "reason"}),
        (["keys", "blocked"], {"origin", "queue", "key", "dead_letter_id", "held_messages"}),
        (["replay", "status", "--all"], {"id", "state", "total", "succeeded", "failed"}),
    ],
)
def test_json_of_every_listing_is_a_list_of_objects_and_nothing_else(world, args, keys):
    done = through_pipe(world.url, *args, "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert isinstance(rows, list) and rows, done.stdout
    assert keys <= set(rows[0]), rows[0]


def test_json_of_single_items_and_status_is_one_object(world):
    shown = json.loads(through_pipe(world.url, "dlq", "show", "1", "--json").stdout)
    assert shown["message_id"] == "long" and shown["payload"] == LONG and shown["status"] == "open"
    datetime.fromisoformat(shown["dead_lettered_at"])
    status = json.loads(through_pipe(world.url, "status", "--json").stdout)
    billing = next(c for c in status["consumers"] if c["name"] == "billing")
    assert billing["halted"] is True and status["dead_letters"][0]["open"] == 1
    job_id = json.loads(through_pipe(world.url, "replay", "status", "--all", "--json").stdout)[0]["id"]
    job = json.loads(through_pipe(world.url, "replay", "status", str(job_id), "--items", "--json").stdout)
    assert job["state"] == "done" and job["items"][0]["dead_letter_id"] == 1


def test_json_on_a_terminal_has_no_colour_either(world):
    code, drawn = on_terminal(world.url, "dlq", "list", "--json")
    assert code == 0 and "\x1b" not in drawn
    assert json.loads(drawn)[0]["error"] == f"ValueError: amount must be a number, got '{LONG}'"


def test_no_color_dumb_terminals_and_force_color_are_respected(world):
    """NO_COLOR keeps the table and drops every escape code; TERM=dumb gets plain text; FORCE_COLOR
    draws the table in colour into a pipe."""
    _, no_color = on_terminal(world.url, "keys", "blocked", NO_COLOR="1")
    assert "\x1b" not in no_color and "│" in no_color and "HELDMESSAGES" in _cells(no_color)
    _, dumb = on_terminal(world.url, "keys", "blocked", TERM="dumb")
    assert "\x1b" not in dumb and "│" not in dumb and dumb.startswith("ORIGIN  QUEUE")
    forced = through_pipe(world.url, "keys", "blocked", FORCE_COLOR="1").stdout
    assert ANSI.search(forced) and "│" in forced


def test_maintenance_run_once_shows_a_progress_bar_on_a_terminal_only(world):
    code, drawn = on_terminal(world.url, "maintain", "--once", "--period", "0.01")
    assert code == 0, drawn
    assert "maintenance" in drawn and "━" in drawn and re.search(r"\b(\d+)/\1\b", ANSI.sub("", drawn))
    assert "dedup_prune" in _cells(drawn)
    piped = through_pipe(world.url, "maintain", "--once")
    assert piped.returncode == 0 and "━" not in piped.stderr + piped.stdout and "\x1b" not in piped.stdout
    assert piped.stdout.splitlines()[0].split() == ["JOB", "RESULT"]
    ran = json.loads(through_pipe(world.url, "maintain", "--once", "--json", "--period", "0.01").stdout)
    assert {r["job"] for r in ran} >= {"dedup_prune", "repair_keys"} and all(r["ran"] for r in ran)


def test_migrate_and_a_foreground_replay_show_progress_bars_on_a_terminal(empty_database, database):
    code, drawn = on_terminal(empty_database.url, "migrate")
    assert code == 0, drawn
    assert "migrate" in drawn and "━" in drawn and "is at revision" in drawn
    with psycopg.connect(database.url) as conn:
        conn.execute("SELECT postbox.inbox_receive('failing', 'm1', '1'::jsonb)")
        conn.commit()
    with postbox.Worker(database.url, failing.registry, consumer="failing", **FAST_WORKER):
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM postbox.dead_letters") == 1)
    code, drawn = on_terminal(database.url, "dlq", "replay", "--all", "--dry-run", "--reason", "look")
    assert code == 0, drawn
    assert "replay job 1" in drawn and "━" in drawn and "wouldsendback" in _cells(drawn)
    piped = through_pipe(database.url, "dlq", "replay", "--all", "--dry-run", "--reason", "again")
    assert piped.returncode == 0 and "━" not in piped.stderr and "\x1b" not in piped.stderr + piped.stdout

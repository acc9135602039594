"""Security (SPEC SEC-3): hostile consumer, key, type and destination names go through every API
and CLI path as data (stored verbatim, never executed), and database passwords never appear in
the output of the commands."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from psycopg import sql

import postbox
from tests.apps.hostile import CONSUMER, DESTINATION, TYPE
from tests.helpers import REPO, eventually, scalar, spawn_postbox

KEY = "k'; DELETE FROM postbox.inbox; --\"$$\\🔑 %s {0} :x $1"
SETUP = """
CREATE TABLE canary (alive boolean);
INSERT INTO canary VALUES (true);
CREATE TABLE hostile_effects (consumer text, message_id text, key text, type text);
"""


@pytest.fixture
def db(database):
    with database.connect(autocommit=True) as c:
        c.execute(SETUP)
    return database


def canary_alive(url: str) -> bool:
    return bool(scalar(url, "SELECT alive FROM canary"))


def test_hostile_names_through_python_and_sql_are_stored_verbatim(db):
    """Python producer (single, batch, async-free forms) and the SQL functions (receive, publish,
    batches, declare, halt/resume) take hostile names as data: stored byte for byte, nothing run."""
    with db.connect() as c:
        assert postbox.receive(
            c, consumer=CONSUMER, message_id="py", key=KEY, type=TYPE, payload={"k": KEY}
        ).is_new
        postbox.receive_many(
            c, [{"consumer": CONSUMER, "message_id": "py-b", "key": KEY, "type": TYPE, "payload": 1}]
        )
        postbox.publish(c, destination=DESTINATION, key=KEY, type=TYPE, payload={"k": KEY})
        postbox.publish_many(c, [{"destination": DESTINATION, "key": KEY, "type": TYPE, "payload": 2}])
        c.execute(
            "SELECT * FROM postbox.inbox_receive(consumer => %s, message_id => 'sql', payload => '{}',"
            " key => %s, type => %s)",
            (CONSUMER, KEY, TYPE),
        )
        batch = [{"consumer": CONSUMER, "message_id": "sql-b", "key": KEY, "type": TYPE, "payload": {}}]
        c.execute("SELECT * FROM postbox.inbox_receive_batch(%s::jsonb)", (json.dumps(batch),))
        c.execute(
            "SELECT postbox.outbox_publish(destination => %s, payload => '{}', key => %s, type => %s)",
            (DESTINATION, KEY, TYPE),
        )
        batch = [{"destination": DESTINATION, "key": KEY, "type": TYPE, "payload": {}}]
        c.execute("SELECT * FROM postbox.outbox_publish_batch(%s::jsonb)", (json.dumps(batch),))
        c.execute("SELECT postbox.declare_consumer_v1(name => %s)", (CONSUMER,))
        c.execute("SELECT postbox.consumer_halt_v1(%s, %s)", (CONSUMER, KEY))
        c.execute("SELECT postbox.consumer_resume_v1(%s)", (CONSUMER,))
        c.commit()
        inbox = c.execute("SELECT DISTINCT consumer, key, type FROM postbox.inbox").fetchall()
        outbox = c.execute("SELECT DISTINCT destination, key, type FROM postbox.outbox").fetchall()
        consumers = c.execute("SELECT name FROM postbox.consumers").fetchall()
        assert c.execute("SELECT count(*) FROM postbox.inbox").fetchone()[0] == 4
        assert c.execute("SELECT count(*) FROM postbox.outbox").fetchone()[0] == 4
    assert inbox == [(CONSUMER, KEY, TYPE)]
    assert outbox == [(DESTINATION, KEY, TYPE)]
    assert consumers == [(CONSUMER,)]
    assert canary_alive(db.url)


def test_hostile_names_through_the_relay_and_worker_commands(db, tmp_path):
    """``postbox relay --destination <hostile>`` (a PostgreSQL destination delivering to a hostile
    consumer) and ``postbox worker --consumer <hostile>``: the message goes outbox -> relay ->
    inbox -> handler -> outbox with every name intact, over LISTEN/NOTIFY and polling alike."""
    config = tmp_path / "postbox.toml"
    name = json.dumps(DESTINATION, ensure_ascii=False)  # a TOML basic string
    config.write_text(
        f'[destinations.{name}]\nkind = "postgres"\nconsumer = {json.dumps(CONSUMER, ensure_ascii=False)}\n'
        'retry = { strategy = "fixed", base_delay = 0.05 }\n'
    )
    with db.connect() as c:
        postbox.publish(
            c, destination=DESTINATION, message_id="hop-1", key=KEY, type=TYPE, payload={"k": KEY}
        )
        c.commit()
    common = ("--poll-interval", "0.05", "--heartbeat-interval", "0.3", "--stale-after", "1.5")
    relay = spawn_postbox(
        "--config", str(config), "--database-url", db.url, "relay", "--destination", DESTINATION, *common,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    worker = spawn_postbox(
        "--database-url", db.url, "worker", "--consumer", CONSUMER, "--app", "tests.apps.hostile:registry",
        *common, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        # The handler's own outbox event to DESTINATION is relayed too, into the inbox again
        # (message id from the outbox), and processed: two effects in all.
        eventually(lambda: scalar(db.url, "SELECT count(*) FROM hostile_effects") >= 2, timeout=60)
    finally:
        for p in (relay, worker):
            p.send_signal(signal.SIGTERM)
        for p in (relay, worker):
            assert p.wait(30) == 0, p.stderr.read().decode() if p.stderr else ""
    rows = scalar(db.url, "SELECT array_agg(DISTINCT row(consumer, key, type)::text) FROM hostile_effects")
    expected = scalar(db.url, "SELECT row(%s::text, %s::text, %s::text)::text", (CONSUMER, KEY, TYPE))
    assert rows == [expected]
    assert scalar(db.url, "SELECT count(*) FROM postbox.dead_letters") == 0
    assert canary_alive(db.url)


# --- secrets ------------------------------------------------------------------------------------

SECRET = "s3cr3t-Pa55"


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "postbox", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


def output(p: subprocess.Popen[bytes], run_for: float) -> str:
    """The command's stdout and stderr together. A command still running after ``run_for`` seconds
    (the bridge waits for its database) is stopped with SIGTERM first."""
    try:
        out, _ = p.communicate(timeout=run_for)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
        try:
            out, _ = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
    return out.decode(errors="replace")


URLS = [
    f"postgresql://postbox:{SECRET}@127.0.0.1:1/app",  # nothing listens on port 1
    f"postgresql://postbox@127.0.0.1:1/app?password={SECRET}",
    f"postgresql://postbox:{SECRET}@127.0.0.1:5432/no_such_database_here",  # a server's own error
]
COMMANDS = [
    ("migrate",),
    ("migrate", "--sql"),
    ("downgrade", "base"),
    ("worker", "--consumer", "basic", "--app", "tests.apps.basic:registry"),
    ("relay",),
    ("bridge", "--from", "redis://127.0.0.1:6379/0", "--name", "x", "--consumer", "c"),
]


def test_database_password_never_appears_in_command_output(tmp_path):
    """Every command given a database URL with a password that cannot connect (nothing listening,
    password in the query string, the server's own error) on the command line, or in
    POSTBOX_DATABASE_URL, fails with a message that never shows the password."""
    config = tmp_path / "postbox.toml"
    config.write_text('[destinations.d]\nkind = "postgres"\nconsumer = "c"\n')
    runs = []
    cases = [(c, URLS[0]) for c in COMMANDS] + [
        (COMMANDS[0], URLS[1]), (COMMANDS[3], URLS[1]), (COMMANDS[0], URLS[2]), (COMMANDS[4], URLS[2]),
    ]  # fmt: skip
    for command, url in cases:
        extra = ("--config", str(config)) if command[0] == "relay" else ()
        # Long-running commands wait for an unreachable database: bounded here (their give-up
        # message is checked too).
        runs.append(
            (command, start(*extra, "--database-url", url, *command, env={"POSTBOX_CONNECT_TIMEOUT": "3"}))
        )
    runs.append(
        (
            COMMANDS[3],
            start(*COMMANDS[3], env={"POSTBOX_DATABASE_URL": URLS[0], "POSTBOX_CONNECT_TIMEOUT": "3"}),
        )
    )
    for command, p in runs:
        out = output(p, 5 if command[0] == "bridge" else 90)
        assert SECRET not in out, (command, out)
        assert out.strip(), command  # it said something (an error, or the DDL of migrate --sql)


def test_broker_password_never_appears_in_relay_output_or_failure_records(db, tmp_path):
    """A relay whose RabbitMQ URL carries a password and cannot connect logs, and records in
    postbox.attempts, the failure without the password."""
    config = tmp_path / "postbox.toml"
    config.write_text(
        f'[destinations.events]\nkind = "rabbitmq"\nurl = "amqp://guest:{SECRET}@127.0.0.1:1/%2F"\n'
        'retry = { strategy = "fixed", base_delay = 0.05 }\n'
    )
    with db.connect() as c:
        postbox.publish(c, destination="events", payload={})
        c.commit()
    relay = spawn_postbox(
        "--config", str(config), "--database-url", db.url, "relay", "--poll-interval", "0.05",
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        eventually(lambda: scalar(db.url, "SELECT count(*) FROM postbox.attempts") >= 3, timeout=60)
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
    err = relay.stderr.read().decode() if relay.stderr else ""
    assert SECRET not in err
    recorded = scalar(
        db.url,
        "SELECT string_agg(concat_ws(' ', error, traceback, explanation), ' ') FROM postbox.attempts",
    )
    assert "RabbitMQ unavailable" in str(recorded)
    assert SECRET not in str(recorded)
    assert SECRET not in str(scalar(db.url, "SELECT string_agg(last_error, ' ') FROM postbox.outbox"))


# --- SQL-function handlers with hostile names, and a guard on how SQL is built -------------------

SCHEMA = 'we\'ird; "schema" $$'
FUNCTION = "apply'); DROP TABLE canary; --\\ü"


def test_hostile_sql_function_handler_name_is_a_quoted_identifier(db, tmp_path):
    """A handler function whose schema and name hold quotes, semicolons and dollar quotes, declared
    in the config file for a hostile consumer: ``postbox worker`` checks it exists and calls it as
    a quoted identifier; a name that does not exist is refused at start, nothing executed."""
    with db.connect() as c:
        c.execute(
            sql.SQL(
                "CREATE SCHEMA {schema}; CREATE FUNCTION {schema}.{fn}(message jsonb, context jsonb)"
                " RETURNS void LANGUAGE sql AS $body$ INSERT INTO hostile_effects (consumer, message_id, key, type)"
                " VALUES (message ->> 'consumer', message ->> 'message_id', message ->> 'key', message ->> 'type')"
                " $body$"
            ).format(schema=sql.Identifier(SCHEMA), fn=sql.Identifier(FUNCTION))
        )
        postbox.receive(c, consumer=CONSUMER, message_id="f-1", key=KEY, type=TYPE, payload={})
        c.commit()
    consumer = json.dumps(CONSUMER, ensure_ascii=False)
    config = tmp_path / "postbox.toml"
    config.write_text(
        f'[consumers.{consumer}.handlers."*"]\nkind = "sql"\n'
        f"function = {json.dumps(f'{SCHEMA}.{FUNCTION}', ensure_ascii=False)}\n"
    )
    worker = spawn_postbox(
        "--config", str(config), "--database-url", db.url, "worker", "--consumer", CONSUMER,
        "--poll-interval", "0.05", "--no-listen", stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        eventually(lambda: scalar(db.url, "SELECT count(*) FROM hostile_effects") == 1, timeout=60)
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0, worker.stderr.read().decode() if worker.stderr else ""
    row = scalar(db.url, "SELECT row(consumer, message_id, key, type)::text FROM hostile_effects")
    assert row == scalar(
        db.url, "SELECT row(%s::text, 'f-1'::text, %s::text, %s::text)::text", (CONSUMER, KEY, TYPE)
    )
    config.write_text(
        f'[consumers.{consumer}.handlers."*"]\nkind = "sql"\n'
        f"function = {json.dumps('public.x; DROP TABLE canary', ensure_ascii=False)}\n"
    )
    out = output(
        start("--config", str(config), "--database-url", db.url, "worker", "--consumer", CONSUMER), 60
    )
    assert "does not exist" in out
    assert canary_alive(db.url)


ALLOWED_DYNAMIC_SQL = {
    # file: reason the statement text is not built from user data
    "service/postbox/operations/runtime.py": "LISTEN on a channel name that is a constant of the code",
}


def _dynamic_sql_calls(path: Path) -> list[int]:
    """Lines where ``.execute(...)`` gets an f-string, a ``%``-formatted or ``.format()``-ed str."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "execute"
        ):
            if not node.args:
                continue
            arg = node.args[0]
            formatted = (
                isinstance(arg, ast.JoinedStr)
                or (isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Mod | ast.Add))
                or (
                    isinstance(arg, ast.Call)
                    and isinstance(arg.func, ast.Attribute)
                    and arg.func.attr == "format"
                    and isinstance(arg.func.value, ast.Constant)
                )
            )
            if formatted:
                lines.append(node.lineno)
    return lines


# Dynamic EXECUTE in SQL: always format() with %I/%L for names and values; %s only where the text
# comes from the catalog, in these files.
ALLOWED_EXECUTE_PLAIN_S = {
    "sql/roles_v1.sql": "GRANT on function signatures read from pg_proc (regprocedure text)",
    "migrations/versions/0001_initial.py": "DROP of objects listed from the catalog",
}
DYNAMIC_EXECUTE = re.compile(
    r"\bEXECUTE\s+(?!FUNCTION\b|PROCEDURE\b|ON\b)(.{0,300})", re.IGNORECASE | re.DOTALL
)


def _execute_problems(rel: str, text: str) -> list[str]:
    text = re.sub(r"--[^\n]*", "", text)  # comments
    problems = []
    for match in DYNAMIC_EXECUTE.finditer(text):
        statement = match.group(1)
        if not statement.lower().startswith("format("):
            problems.append(f"{rel}: EXECUTE of a string not built by format(): {statement[:60]!r}")
        elif "%s" in statement.split(")")[0] and rel not in ALLOWED_EXECUTE_PLAIN_S:
            problems.append(f"{rel}: EXECUTE format() with %s (use %I or %L): {statement[:60]!r}")
    return problems


def test_sql_is_built_from_parameters_and_quoted_identifiers():
    """A guard for SEC-3: no statement in ``service/`` is text built by string formatting (only
    parameters, ``psycopg.sql`` compositions of quoted identifiers, and the SQL files), except the
    listed constant ones; SQL functions run dynamic ``EXECUTE`` only through ``format()`` with
    ``%I``/``%L`` (``%s`` only for catalog text, in the listed files)."""
    found = {}
    for path in sorted((REPO / "service").rglob("*.py")):
        lines = _dynamic_sql_calls(path)
        rel = str(path.relative_to(REPO))
        if lines and rel not in ALLOWED_DYNAMIC_SQL:
            found[rel] = lines
    assert found == {}, f"SQL built by string formatting: {found}"
    problems = []
    for path in [
        *(REPO / "sql").rglob("*.sql"),
        *(REPO / "migrations").rglob("*.sql"),
        *(REPO / "migrations").rglob("*.py"),
    ]:
        problems += _execute_problems(str(path.relative_to(REPO)), path.read_text())
    assert problems == []
    # The guard itself catches what it is for.
    assert _execute_problems("x.sql", "BEGIN EXECUTE 'DROP TABLE ' || name; END") != []
    assert _execute_problems("x.sql", "EXECUTE format('DROP TABLE %s', name);") != []
    assert (
        _execute_problems(
            "x.sql", "EXECUTE format('DROP TABLE %I', name); GRANT EXECUTE ON FUNCTION f() TO r;"
        )
        == []
    )

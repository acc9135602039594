"""README.md and the manual in docs/: every snippet in them is exercised here, so they cannot drift.

The fenced code blocks are extracted from the file and each one is run by its language, so a block
added later is covered without a change here; a block in a language this test does not know fails:

- ``sql``: every statement runs (one transaction per block, rolled back) against a clone of a
  migrated database that holds the README's world: the consumers, messages, dead letters (42, 43,
  the blocked keys ``order-7`` and ``order-9``), replay job 7 and roles its snippets name;
- ``sh``/``bash``: every ``postbox …`` line is parsed by the real click CLI (usage notation such as
  ``[--flag]``, ``a|b`` and placeholders expanded), ``make`` lines name Makefile targets,
  ``docker compose`` lines name services of ``docker-compose.yml``, ``pip install`` lines install
  Postbox with extras ``pyproject.toml`` defines, and SQL handed to ``psql`` (``-c`` or a
  here-document) runs like a ``sql`` block; any other program fails;
- ``python``: executed, with ``url`` pointing at the README's world;
- ``toml``: parsed and validated by the project's loaders (policies, destinations, settings).

Inline code that is a whole SQL statement or a ``postbox``/``make`` command is checked the same way.
"""

from __future__ import annotations

import importlib
import itertools
import json
import re
import shlex
import tomllib
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click
import psycopg
import pytest
import yaml

import postbox
from postbox.cli.root import cli
from postbox.config.policies import build_transports, load_policies
from postbox.config.settings import load_settings
from postbox.examples import orders as orders_example
from postbox.failures.outcomes import Permanent
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from tests.conftest import Database, Server, _conninfo_url
from tests.helpers import FAST_WORKER, REPO, eventually, scalar

README = REPO / "README.md"

# --- extraction -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snippet:
    """A fenced block (``language`` from its info string) or an inline code span (``inline``)."""

    language: str
    text: str
    line: int  # 1-based line of the opening fence (or of the span)
    inline: bool = False
    source: str = "README.md"  # the file, relative to the repository

    @property
    def id(self) -> str:
        page = "" if self.source == "README.md" else f"{Path(self.source).stem}-"
        return f"{page}L{self.line}-{'inline-' if self.inline else ''}{self.language or 'none'}"


FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def fenced_blocks(text: str) -> list[Snippet]:
    """Every fenced code block (CommonMark fences of backticks or tildes, indented up to 3 spaces)."""
    blocks: list[Snippet] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, info = opening["fence"], opening["info"].strip()
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if (
                closing
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"].strip()
            ):
                break
            body.append(lines[j])
            j += 1
        else:
            raise AssertionError(f"line {i + 1}: code fence never closed")
        language = info.split()[0].lower() if info else ""
        blocks.append(Snippet(language, "\n".join(body) + "\n", i + 1))
        i = j + 1
    return blocks


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of everything outside fenced blocks."""
    inside: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        fence = FENCE.match(line)
        if fence and inside is None:
            inside = fence["fence"]
        elif fence and inside and fence["fence"][0] == inside[0] and not fence["info"].strip():
            inside = None
        elif inside is None:
            yield number, line


SQL_START = re.compile(
    r"^(SELECT|WITH|SET|ALTER|GRANT|REVOKE|INSERT|UPDATE|DELETE|CREATE|DROP|EXPLAIN|CALL|VACUUM|TRUNCATE|DO)\s"
)
# An inline span with an ellipsis is a fragment of a statement (``SELECT … FOR UPDATE SKIP LOCKED``),
# quoted to name a technique, not a statement to run.
ELISION = ("…", "...")


def inline_snippets(text: str) -> list[Snippet]:
    """Inline code spans that are whole SQL statements or ``postbox``/``make`` commands."""
    spans = []
    for number, line in prose_lines(text):
        for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", line):
            if SQL_START.match(span) and not any(e in span for e in ELISION):
                spans.append(Snippet("sql", span, number, inline=True))
            elif re.match(r"^(postbox|make)(\s|$)", span):
                spans.append(Snippet("sh", span, number, inline=True))
    return spans


# The README and the manual in docs/: every page's snippets are checked the same way.
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
BLOCKS = [
    replace(b, source=str(page.relative_to(REPO)))
    for page in PAGES
    for b in fenced_blocks(page.read_text(encoding="utf-8"))
]
INLINE = [
    replace(s, source=str(page.relative_to(REPO)))
    for page in PAGES
    for s in inline_snippets(page.read_text(encoding="utf-8"))
]

# --- the README's world: the data its snippets refer to ---------------------------------------

# Roles the roles section grants to (per cluster: created inside the block's transaction, rolled back).
WORLD_ROLES = ("orders_app", "postbox_runtime", "alice")

# Dead letters of consumer "billing", dead-lettered in this order so they get these ids, as the
# README's snippets name them: (id, message_id, key, payload). Key order-9 also has a held message.
WORLD_DEAD_LETTERS = (
    (42, "evt-8f2c", "order-42", {"amount": "12.5"}),  # explained, edited
    (43, "evt-43", "order-43", {"amount": "42"}),  # discarded as a duplicate
    (44, "evt-7", "order-7", {"amount": "7"}),  # resolved by key
    (45, "evt-9", "order-9", {"amount": "9"}),  # its key unblocked
    (46, "evt-5", "order-5", {"amount": "5"}),  # covered by replay job 7
)
WORLD_REPLAY_JOB = 7


def world_registry() -> Registry:
    """Consumer billing: ``order.paid`` records the payment and asks for a receipt through the outbox;
    an amount that is not a number is a permanent failure."""
    registry = Registry()

    @registry.handler("billing", "order.paid")
    def paid(message: Any, ctx: Any) -> None:
        amount = message.payload.get("amount")
        if not isinstance(amount, int | float):
            raise Permanent(f"amount is not a number: {amount!r}")
        ctx.conn.execute(
            "INSERT INTO billing.payments (order_id, amount, idempotency_key) VALUES (%s, %s, %s)",
            (message.key, amount, ctx.idempotency_key),
        )
        ctx.publish("emails", {"template": "receipt"}, key=message.key)

    return registry


def seed_world(url: str) -> None:
    """Fill a migrated database with what the README's snippets refer to, through the real API and a
    real worker (so dead letters, attempts and blocked keys are what Postbox itself records)."""
    with psycopg.connect(url, autocommit=True) as c:
        for script in sorted((REPO / "deploy" / "initdb").glob("*.sql")):  # the compose example's tables
            c.execute(script.read_text(encoding="utf-8"))
        c.execute(
            "CREATE SCHEMA billing;"
            " CREATE TABLE billing.payments (order_id text, amount numeric, idempotency_key text);"
            " CREATE TABLE accounts (id bigint PRIMARY KEY, balance numeric NOT NULL);"
            " INSERT INTO accounts VALUES (7, 100)"
        )
        for consumer in ("billing", "orders", "shipping"):
            c.execute("SELECT postbox.declare_consumer_v1(name => %s)", (consumer,))
        c.execute("SELECT setval(pg_get_serial_sequence('postbox.dead_letters', 'id'), %s)", (41,))
        c.execute("SELECT setval(pg_get_serial_sequence('postbox.replay_jobs', 'id'), %s)", (6,))
    worker = Worker(url, world_registry(), WorkerSettings(consumer="billing", **FAST_WORKER))
    worker.start()
    try:
        with psycopg.connect(url) as c:
            postbox.receive(
                c,
                consumer="billing",
                message_id="evt-1",
                key="order-1",
                type="order.paid",
                payload={"amount": 10},
            )
            c.commit()
        for dead_letter_id, message_id, key, payload in WORLD_DEAD_LETTERS:
            with psycopg.connect(url) as c:
                postbox.receive(
                    c,
                    consumer="billing",
                    message_id=message_id,
                    key=key,
                    type="order.paid",
                    payload=payload,
                    correlation_id=f"checkout-{key}",
                )
                c.commit()
            eventually(
                lambda d=dead_letter_id: scalar(url, "SELECT max(id) FROM postbox.dead_letters") == d,
                what=f"dead letter {dead_letter_id}",
            )
        eventually(lambda: scalar(url, "SELECT count(*) FROM billing.payments") == 1)
        with psycopg.connect(url) as c:  # held behind the dead-lettered head of order-9
            postbox.receive(
                c,
                consumer="billing",
                message_id="evt-9b",
                key="order-9",
                type="order.paid",
                payload={"amount": 9},
            )
            c.commit()
    finally:
        worker.stop()
        worker.join()
    assert scalar(url, "SELECT count(*) FROM postbox.blocked_keys") == len(WORLD_DEAD_LETTERS)
    # The compose example (README "Running with docker compose"): an order paid, its shipment request
    # delivered to the shipping inbox (as the bridge does), both processed by the example app.
    with psycopg.connect(url) as c:
        postbox.receive(
            c,
            consumer="orders",
            message_id="order-0-paid",
            key="order-0",
            type="order.paid",
            payload={"amount": 42},
        )
        postbox.receive(
            c,
            consumer="shipping",
            message_id="order-0-paid:shipment",
            key="order-0",
            type="shipment.requested",
            payload={"order_id": "order-0", "amount": 42},
        )
        c.commit()
    for consumer, table in (("orders", "example_orders"), ("shipping", "example_shipments")):
        worker = Worker(url, orders_example.registry, WorkerSettings(consumer=consumer, **FAST_WORKER))
        worker.start()
        try:
            eventually(lambda t=table: scalar(url, f"SELECT count(*) FROM {t}") == 1, what=table)
        finally:
            worker.stop()
            worker.join()
    job = scalar(url, "SELECT postbox.dlq_replay('{\"ids\": [46]}', reason => 'amounts are parsed now')")
    assert job == WORLD_REPLAY_JOB


@pytest.fixture(scope="module")
def world_template(pg_server: Server, template_db: str) -> Iterator[str]:
    """A migrated database holding the README's world, seeded once and cloned for each snippet."""
    name = f"postbox_readme_{uuid.uuid4().hex[:12]}"
    janitor = pg_server.janitor(name, template=template_db)
    janitor.init()
    try:
        url = _conninfo_url(dict(pg_server.params, dbname=name))
        seed_world(url)
        admin = _conninfo_url(dict(pg_server.params, dbname="postgres"))
        eventually(  # a clone needs the template to have no connections left
            lambda: scalar(admin, "SELECT count(*) = 0 FROM pg_stat_activity WHERE datname = %s", (name,)),
            what="the seeded database's connections closed",
        )
        yield name
    finally:
        janitor.drop()


@pytest.fixture
def world(pg_server: Server, world_template: str) -> Iterator[Database]:
    """A fresh clone of the README's world."""
    name = f"postbox_rw_{uuid.uuid4().hex[:12]}"
    janitor = pg_server.janitor(name, template=world_template)
    janitor.init()
    try:
        yield Database(name, _conninfo_url(dict(pg_server.params, dbname=name)), pg_server)
    finally:
        janitor.drop()


# --- SQL --------------------------------------------------------------------------------------


def split_sql(text: str) -> list[str]:
    """Statements of a SQL text, split at top-level semicolons (quotes, quoted identifiers, dollar
    quotes and comments respected); statements that are only comments are dropped."""
    statements: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if text.startswith("--", i):
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            i = end
            continue
        if text.startswith("/*", i):
            end = text.index("*/", i + 2) + 2
            i = end
            continue
        if ch in ("'", '"'):
            end = i + 1
            while True:
                end = text.index(ch, end)
                if text.startswith(ch * 2, end):
                    end += 2
                    continue
                break
            current.append(text[i : end + 1])
            i = end + 1
            continue
        dollar = re.match(r"\$([A-Za-z_]\w*)?\$", text[i:])
        if dollar:
            tag = dollar.group(0)
            end = text.index(tag, i + len(tag)) + len(tag)
            current.append(text[i:end])
            i = end
            continue
        if ch == ";":
            statements.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
        i += 1
    statements.append("".join(current).strip())
    return [s for s in statements if s]


def test_the_sql_splitter_respects_quotes_dollar_quotes_and_comments():
    """Semicolons inside strings, identifiers, function bodies and comments do not split."""
    text = """SELECT 'a;b', "c;d"; -- x; y
    CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN 1; END $$; /* ; */
    SELECT $q$;$q$; SELECT 'it''s;'"""
    assert split_sql(text) == [
        "SELECT 'a;b', \"c;d\"",
        "CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN 1; END $$",
        "SELECT $q$;$q$",
        "SELECT 'it''s;'",
    ]


# A query of the README that finds nothing means the world lacks what the snippet names (or the
# snippet names what does not exist). These may rightly be empty there, and why:
MAY_BE_EMPTY = {
    r"postbox\.live_workers": "no worker process runs while the snippets do",
}


# The README's own transaction control runs as a savepoint inside the block's transaction, which is
# rolled back in the end (so the roles it needs never outlive it).
TRANSACTION_CONTROL = {
    r"(BEGIN|START TRANSACTION)( TRANSACTION| WORK)?": "SAVEPOINT readme",
    r"(COMMIT|END)( TRANSACTION| WORK)?": "RELEASE SAVEPOINT readme",
    r"ROLLBACK( TRANSACTION| WORK)?": "ROLLBACK TO SAVEPOINT readme",
}
# Statements PostgreSQL refuses inside a transaction block: run on their own connection, in autocommit.
OUTSIDE_TRANSACTION = re.compile(
    r"^(VACUUM|CREATE INDEX CONCURRENTLY|REINDEX\b.*\bCONCURRENTLY|CHECKPOINT)\b", re.I
)


def run_sql(db: Database, text: str, where: str) -> None:
    """Run every statement of ``text`` in one transaction (rolled back, as the README's roles exist
    only there) in the README's world; the first failing statement fails with its text, and so does
    a query that finds nothing (unless it is one of ``MAY_BE_EMPTY``)."""
    with db.connect() as c:
        for role in WORLD_ROLES:
            c.execute(
                f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN"
                f" CREATE ROLE {role} NOLOGIN; END IF; END $$"
            )
        # "app" stands for the reader's own database (ALTER DATABASE app SET ...)
        text = re.sub(r"\bDATABASE app\b", f'DATABASE "{db.name}"', text)
        statements = split_sql(text)
        assert statements, f"{where}: no SQL statement"
        assert not re.search(r"^ALTER SYSTEM\b", text, re.I | re.M), f"{where}: ALTER SYSTEM is not run here"
        for statement in statements:
            for pattern, replacement in TRANSACTION_CONTROL.items():
                if re.fullmatch(pattern, statement, re.I):
                    statement = replacement
            try:
                if OUTSIDE_TRANSACTION.match(statement):
                    with db.connect(autocommit=True) as other:
                        cursor = other.execute(statement.encode())
                        rows = cursor.fetchall() if cursor.description is not None else None
                else:
                    cursor = c.execute(statement.encode())
                    rows = cursor.fetchall() if cursor.description is not None else None
            except psycopg.Error as error:
                pytest.fail(
                    f"{where}: the README's SQL fails:\n{statement}\n-> {type(error).__name__}: {error}"
                )
            if rows == [] and not any(re.search(p, statement) for p in MAY_BE_EMPTY):
                pytest.fail(f"{where}: the README's query finds nothing in the README's world:\n{statement}")
        c.rollback()


def test_sql_transaction_control_and_maintenance_statements_run(world):
    """A snippet's BEGIN/COMMIT/ROLLBACK become a savepoint in the block's transaction (which is
    rolled back); VACUUM runs on its own connection; a failing statement or an empty query fails."""
    run_sql(world, "BEGIN; SELECT 1; COMMIT; BEGIN; SELECT 2; ROLLBACK; VACUUM postbox.inbox;", "here")
    with pytest.raises(pytest.fail.Exception, match="finds nothing"):
        run_sql(world, "SELECT * FROM postbox.dead_letters WHERE id = 4242", "here")
    with pytest.raises(pytest.fail.Exception, match="UndefinedTable"):
        run_sql(world, "SELECT * FROM postbox.no_such_view", "here")


# --- shell ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    words: list[str]
    stdin: str | None  # a here-document's body
    line: int


def shell_commands(text: str, first_line: int) -> list[Command]:
    """Commands of a shell snippet: continuation lines joined, comments dropped, lists (``&&``, ``;``,
    ``|``) split, here-documents attached to their command as stdin."""
    lines = text.splitlines()
    commands: list[Command] = []
    i = 0
    while i < len(lines):
        number = first_line + i
        line = lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i]
        i += 1
        heredoc = re.search(r"<<-?\s*(['\"]?)(\w+)\1", line)
        stdin = None
        if heredoc:
            tag = heredoc.group(2)
            body = []
            while i < len(lines) and lines[i].strip() != tag:
                body.append(lines[i])
                i += 1
            assert i < len(lines), f"line {number}: here-document {tag} never ends"
            i += 1
            stdin = "\n".join(body) + "\n"
            line = line[: heredoc.start()] + line[heredoc.end() :]
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for word in [*lexer, ";"]:
            if word in (";", "&&", "||", "|", "&"):
                if words:
                    commands.append(Command(words, stdin, number))
                    stdin = None
                words = []
            else:
                words.append(word)
    return commands


# Sample values for the placeholders of usage lines (``--consumer NAME``): a value per placeholder,
# or per option for an elided value (``--app ...``).
PLACEHOLDERS = {
    "NAME": "billing",
    "N": "2",
    "SECONDS": "60",
    "JOB": "7",
    "URL": "amqp://guest:guest@127.0.0.1:5672/%2F",
    "QUEUE": "orders",
    "REVISION": "base",
    "module:registry": "postbox.examples.orders:registry",
    "myapp.handlers:registry": "postbox.examples.orders:registry",  # the reader's own handler app
}
ELIDED_OPTION_VALUES = {"--app": "postbox.examples.orders:registry"}


def expand_usage(words: list[str]) -> list[list[str]]:
    """Concrete command lines from a usage line: optional parts ``[...]`` included, alternatives
    ``a|b`` expanded, placeholders given sample values, ``...`` (more of the same) dropped or, after an
    option that needs a value, given one."""
    concrete: list[list[str]] = []
    for word in words:
        if re.fullmatch(r"\[(--[\w-]+|[A-Z][A-Z_]*|\.\.\.)\]?", word) or re.fullmatch(r"\[--[\w-]+", word):
            word = word.lstrip("[").rstrip("]")
        elif re.fullmatch(r"(--[\w-]+|[A-Z][A-Z_]*|\.\.\.)\]", word):
            word = word.rstrip("]")
        if re.fullmatch(r"[a-z][\w-]*(\|[a-z][\w-]*)+", word):
            concrete.append(word.split("|"))
        elif word == "...":
            previous = concrete[-1][0] if concrete else ""
            if previous in ELIDED_OPTION_VALUES:
                concrete.append([ELIDED_OPTION_VALUES[previous]])
        elif word in PLACEHOLDERS:
            concrete.append([PLACEHOLDERS[word]])
        else:
            assert not re.fullmatch(r"[A-Z][A-Z_]*", word), f"placeholder {word} has no sample value"
            concrete.append([word])
    return [list(line) for line in itertools.product(*concrete)]


def parse_postbox(args: list[str], complete: bool = True) -> click.Context:
    """Parse ``postbox ARGS`` with the real click group, down the chain of subcommands, without
    running anything: unknown commands or options, missing required options and bad values raise
    UsageError. ``complete=False`` only resolves the command chain (an inline mention of a command)."""
    try:
        ctx = cli.make_context("postbox", list(args), resilient_parsing=not complete)
    except click.exceptions.Exit as done:  # --version, --help: answered at parse time
        if done.exit_code != 0:
            raise AssertionError(f"postbox {shlex.join(args)}: exit {done.exit_code}") from None
        return cli.make_context("postbox", [], resilient_parsing=True)
    command: click.Command = cli
    while isinstance(command, click.Group):
        with warnings.catch_warnings():  # Click 9 will leave the subcommand in ctx.args
            warnings.simplefilter("ignore", DeprecationWarning)
            rest = [*ctx.protected_args, *ctx.args]
        if not rest:
            assert not complete or command.invoke_without_command, (
                f"postbox {shlex.join(args)}: no subcommand"
            )
            return ctx
        name, sub, rest = command.resolve_command(ctx, rest)
        assert sub is not None and name is not None
        ctx = sub.make_context(name, rest, parent=ctx, resilient_parsing=not complete)
        command = sub
    return ctx


def deep_merge(into: dict[str, Any], data: dict[str, Any], path: str = "") -> None:
    for name, value in data.items():
        if isinstance(value, dict) and isinstance(into.get(name), dict):
            deep_merge(into[name], value, f"{path}{name}.")
        else:
            assert name not in into, f"README's TOML blocks set {path}{name} twice"
            into[name] = value


def readme_config() -> dict[str, Any]:
    """The README's ``postbox.toml``: its TOML blocks together (they show parts of one file)."""
    merged: dict[str, Any] = {}
    for block in BLOCKS:
        if block.language == "toml":
            deep_merge(merged, tomllib.loads(block.text))
    return merged


def given_app(words: list[str]) -> str | None:
    """The ``--app`` value as the README writes it (before placeholders are filled)."""
    return next((words[i + 1] for i, w in enumerate(words[:-1]) if w.lstrip("[") == "--app"), None)


def check_names(ctx: click.Context, where: str, app_as_written: str | None) -> None:
    """What a command line names exists: with the README's ``--config postbox.toml``, the relay's
    destinations and, for a worker without ``--app``, the consumer's handlers are in that file; an
    ``--app`` that is not a placeholder is an importable Registry with a handler for the consumer."""
    root = ctx.find_root()
    config = readme_config() if str(root.params.get("config")) == "postbox.toml" else None
    if ctx.info_name == "relay" and config is not None:
        unknown = set(ctx.params["destinations"]) - set(config.get("destinations", {}))
        assert not unknown, f"{where}: destinations {unknown} are not in the README's postbox.toml"
    if ctx.info_name == "worker":
        app = ctx.params.get("app")
        if app is None:
            assert config is not None, f"{where}: a worker needs --app or a config file with handlers"
            assert config.get("consumers", {}).get(ctx.params["consumer"], {}).get("handlers"), (
                f"{where}: consumer {ctx.params['consumer']} has no handlers in the README's postbox.toml"
            )
        elif app_as_written not in (*PLACEHOLDERS, "..."):  # the reader's own app: any importable one
            module_name, _, attr = app.partition(":")
            registry = getattr(importlib.import_module(module_name), attr)
            assert isinstance(registry, Registry), f"{where}: {app} is not a Registry"
            assert ctx.params["consumer"] in registry.consumers(), f"{where}: no such consumer in {app}"


def test_the_readme_toml_blocks_make_one_valid_config_file():
    """Together, the README's TOML blocks are one valid ``postbox.toml`` (the file its command lines
    pass with ``--config``): no setting given twice, every section accepted by the loaders."""
    config = readme_config()
    load_settings(**config.get("postbox", {}))
    policies = load_policies(config)
    assert set(policies.consumers) == set(config.get("consumers", {}))
    assert set(policies.destinations) == set(config.get("destinations", {}))


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.MULTILINE))


def compose_services() -> set[str]:
    data = yaml.safe_load((REPO / "docker-compose.yml").read_text(encoding="utf-8"))
    return set(data["services"])


# docker compose subcommands the README may use, with the options that take a value.
COMPOSE_SUBCOMMANDS: dict[str, set[str]] = {
    "up": {"--scale"},
    "down": set(),
    "ps": set(),
    "logs": set(),
    "build": set(),
    "stop": set(),
    "restart": set(),
    "exec": {"-u", "--user", "-w", "--workdir", "-e", "--env"},
}


def psql_sql(words: list[str], stdin: str | None) -> list[str]:
    """The SQL a psql command line runs: its ``-c`` strings and its here-document."""
    sql = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("-c", "--command")]
    if stdin is not None:
        sql.append(stdin)
    assert sql, f"psql {shlex.join(words)} runs no SQL the README shows"
    return sql


def check_command(command: Command, snippet: Snippet, db: Callable[[], Database]) -> int:
    """Check one shell command against what it names; returns how many concrete command lines
    (or SQL texts) were checked."""
    where = f"{snippet.source}:{command.line}"
    program, *args = command.words
    if program == "postbox":
        lines = expand_usage(args)
        for line in lines:
            complete = not snippet.inline or any(word.startswith("-") for word in line)
            try:
                ctx = parse_postbox(line, complete=complete)
            except click.UsageError as error:
                pytest.fail(f"{where}: postbox {shlex.join(line)}: {error.format_message()}")
            if complete:
                check_names(ctx, f"{where}: postbox {shlex.join(line)}", given_app(args))
        return len(lines)
    if program == "make":
        targets = [a for a in args if not a.startswith("-") and "=" not in a]
        assert targets, f"{where}: make without a target"
        unknown = set(targets) - makefile_targets()
        assert not unknown, f"{where}: no Makefile target {unknown}"
        return len(targets)
    if program == "docker" and args[:1] == ["compose"]:
        return check_compose(args[1:], command, db)
    if program in ("pip", "pip3"):
        return check_pip(args, where)
    if program == "psql":
        texts = psql_sql(args, command.stdin)
        for text in texts:
            run_sql(db(), text, where)
        return len(texts)
    raise AssertionError(f"{where}: the README runs {program!r}, which this test does not know how to check")


def package_extras() -> set[str]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return set(data["project"]["optional-dependencies"])


def check_pip(args: list[str], where: str) -> int:
    """``pip install`` lines install Postbox (by name, or the checkout with ``-e .``) with extras
    that pyproject.toml defines."""
    assert args[:1] == ["install"], f"{where}: pip {shlex.join(args)}: only pip install is shown"
    requirements = [a for a in args[1:] if not a.startswith("-")]
    assert requirements, f"{where}: pip install of nothing"
    for requirement in requirements:
        match = re.fullmatch(r"(postbox|\.)(?:\[([\w,-]+)\])?", requirement)
        assert match, f"{where}: pip install {requirement}: the README installs only postbox"
        unknown = set(filter(None, (match[2] or "").split(","))) - package_extras()
        assert not unknown, f"{where}: pip install {requirement}: no extra {unknown} in pyproject.toml"
    return len(requirements)


def check_compose(args: list[str], command: Command, db: Callable[[], Database]) -> int:
    where = f"line {command.line}"
    assert args and args[0] in COMPOSE_SUBCOMMANDS, f"{where}: docker compose {args[:1]}: unknown here"
    subcommand, rest = args[0], args[1:]
    services = compose_services()
    named: list[str] = []
    i = 0
    while i < len(rest):
        word = rest[i]
        if word.startswith("-"):
            if word in COMPOSE_SUBCOMMANDS[subcommand]:
                if word == "--scale":
                    named.append(rest[i + 1].split("=", 1)[0])
                i += 2
            else:
                i += 1
            continue
        named.append(word)
        if subcommand == "exec":  # SERVICE COMMAND...: the command runs inside the container
            break
        i += 1
    unknown = set(named) - services
    assert not unknown, f"{where}: docker compose {subcommand}: no service {unknown} in docker-compose.yml"
    if subcommand == "exec":
        inner = rest[i + 1 :]
        assert inner, f"{where}: docker compose exec without a command"
        return 1 + check_command(Command(inner, command.stdin, command.line), Snippet("sh", "", 0), db)
    return 1


def run_shell(snippet: Snippet, db: Callable[[], Database]) -> None:
    commands = shell_commands(snippet.text, snippet.line + (0 if snippet.inline else 1))
    assert commands, f"{snippet.source}:{snippet.line}: no command"
    for command in commands:
        assert check_command(command, snippet, db) > 0


def test_usage_notation_is_expanded_into_real_command_lines():
    """Optional parts are included, alternatives expanded, placeholders and elided values filled."""
    assert expand_usage(shlex.split("replay pause|resume JOB [--items] [--concurrency N] ...")) == [
        ["replay", "pause", "7", "--items", "--concurrency", "2"],
        ["replay", "resume", "7", "--items", "--concurrency", "2"],
    ]
    assert expand_usage(["worker", "--app", "..."]) == [
        ["worker", "--app", "postbox.examples.orders:registry"]
    ]


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("postbox wrker --consumer billing", "No such command 'wrker'"),
        ("postbox dlq lst", "No such command 'lst'"),
        ("postbox worker --consumer billing --concurency 4", "No such option '--concurency'"),
        ("postbox worker --app module:registry", "Missing option '--consumer'"),
        ("postbox relay --batch-size many", "Invalid value for '--batch-size'"),
        ("postbox replay pause|resme JOB --reason x", "No such command 'resme'"),
        ("postbox --config postbox.toml relay --destination nowhere", "not in the README's postbox.toml"),
        ("postbox --config postbox.toml worker --consumer nobody", "nobody has no handlers"),
        ("postbox worker --consumer billing --app postbox.examples.orders:registry", "no such consumer"),
        ("make no-such-target", "no Makefile target"),
        ("docker compose exec -T no-such-service psql -c 'SELECT 1'", "no service {'no-such-service'}"),
        ("docker compose up --scale no-such-service=3", "no service {'no-such-service'}"),
        ("docker compose teleport", "unknown here"),
        ("pip install 'postbox[binary,rabbit]'", "no extra {'rabbit'}"),
        ("pip install requests", "installs only postbox"),
        ("pip uninstall postbox", "only pip install"),
        ("kubectl apply -f postbox.yaml", "does not know how to check"),
    ],
)
def test_a_wrong_command_line_fails_the_check(line, complaint):
    """The check is not lenient: a misspelt command, subcommand or option, a missing required option,
    a bad value, a destination or consumer the README's config lacks, a handler app without the
    consumer, an unknown Makefile target, compose command or service, a package extra pyproject.toml
    lacks, or an unknown program fails."""

    def no_database() -> Database:
        raise RuntimeError("no database needed")

    with pytest.raises((AssertionError, pytest.fail.Exception), match=re.escape(complaint)):
        run_shell(Snippet("sh", line + "\n", 1), no_database)


# --- Python and TOML --------------------------------------------------------------------------


def run_python(snippet: Snippet, db: Callable[[], Database]) -> None:
    """Execute the block as a script; ``url`` is the README's world (the blocks connect with it)."""
    code = compile(snippet.text, f"{snippet.source}:{snippet.line}", "exec")
    namespace: dict[str, Any] = {"__name__": "readme"}
    if "url" in code.co_names:
        namespace["url"] = db().url
    exec(code, namespace)


def run_toml(snippet: Snippet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse the block as a configuration file and validate it as ``postbox --config`` would: the
    settings, the consumer policies and handlers, and the destinations' transports (built, not
    connected; secrets named by ``*_env`` are set for the check)."""
    where = f"{snippet.source}:{snippet.line}"
    try:
        data = tomllib.loads(snippet.text)
    except tomllib.TOMLDecodeError as error:
        pytest.fail(f"{where}: not valid TOML: {error}")
    path = tmp_path / "postbox.toml"
    path.write_text(snippet.text, encoding="utf-8")
    load_settings(path)
    policies = load_policies(path)
    for kind in ("consumers", "destinations"):
        missing = set(data.get(kind, {})) - set(getattr(policies, kind))
        assert not missing, f"{where}: {kind} {missing} not loaded"
    for variable in re.findall(r'\w+_env\s*=\s*"(\w+)"', snippet.text):  # secrets come from the environment
        monkeypatch.setenv(variable, "readme-secret")
    if policies.destinations:
        transports = build_transports(policies, list(policies.destinations), "postgresql://localhost/app")
        assert set(transports) == set(policies.destinations)


# --- the snippets -----------------------------------------------------------------------------

SHELL_LANGUAGES = {"sh", "bash", "shell"}


def exercise(
    snippet: Snippet, db: Callable[[], Database], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run or check one snippet by its language; an unknown language (or none) fails."""
    where = f"{snippet.source}:{snippet.line}"
    if snippet.language == "sql":
        run_sql(db(), snippet.text, where)
    elif snippet.language in SHELL_LANGUAGES:
        run_shell(snippet, db)
    elif snippet.language == "python":
        run_python(snippet, db)
    elif snippet.language == "toml":
        run_toml(snippet, tmp_path, monkeypatch)
    elif snippet.language in ("yaml", "yml"):  # e.g. alert rules: must at least be valid YAML
        assert yaml.safe_load(snippet.text) is not None, f"{where}: empty YAML"
    elif snippet.language == "json":
        json.loads(snippet.text)
    else:
        pytest.fail(
            f"{where}: a code block in {snippet.language or 'no language'!r}: not exercised by any test"
        )


@pytest.mark.parametrize("snippet", BLOCKS + INLINE, ids=lambda s: s.id)
def test_readme_snippet(snippet: Snippet, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch):
    """Each README snippet, by its language: SQL runs in the README's world, shell lines are real
    commands (and their SQL runs), Python executes, TOML is a valid configuration, YAML and JSON
    parse. A block in any other language, or without one, fails: decide how to exercise it and add
    it here."""
    exercise(snippet, lambda: request.getfixturevalue("world"), tmp_path, monkeypatch)


def test_a_block_in_an_unknown_language_or_none_fails(tmp_path, monkeypatch):
    """New kinds of blocks are not skipped silently: the test fails until one decides how to run them."""
    for language in ("", "text", "console", "promql"):
        with pytest.raises(pytest.fail.Exception, match="not exercised"):
            exercise(Snippet(language, "x\n", 1), lambda: pytest.fail("no database"), tmp_path, monkeypatch)
    blocks = fenced_blocks("intro\n```\nuntagged\n```\n~~~~text\n```\n~~~~\n")
    assert [(b.language, b.text, b.line) for b in blocks] == [("", "untagged\n", 2), ("text", "```\n", 5)]


def test_the_readme_has_snippets_of_every_kind():
    """The extraction finds the manual's blocks (a broken fence would hide them)."""
    languages = {b.language for b in BLOCKS}
    assert {"sql", "sh", "python", "toml"} <= languages, languages
    assert len(BLOCKS) >= 15
    assert any(s.language == "sql" for s in INLINE) and any(s.language == "sh" for s in INLINE)


def test_the_world_has_what_the_snippets_name(world):
    """The seeded world is what the README talks about: dead letters 42..46 of billing with their
    attempts, blocked keys (order-9 holding a message), replay job 7, an outbox row."""
    rows = scalar(world.url, "SELECT array_agg(id ORDER BY id) FROM postbox.dead_letters")
    assert rows == [d[0] for d in WORLD_DEAD_LETTERS]
    assert scalar(world.url, "SELECT count(*) FROM postbox.attempts WHERE message_id = 'evt-8f2c'") == 1
    assert scalar(world.url, "SELECT held_messages FROM postbox.blocked_keys WHERE key = 'order-9'") == 1
    assert scalar(world.url, "SELECT state FROM postbox.replay_jobs WHERE id = 7") == "pending"
    assert scalar(world.url, "SELECT count(*) FROM postbox.outbox WHERE destination = 'emails'") == 1


# --- the prose --------------------------------------------------------------------------------

# Requirement ids of the project's specification (``REPLAY-2``): internal bookkeeping, meaningless
# to a reader. ``UTF-8`` and the like are not ids.
REQUIREMENT_ID = re.compile(r"\b(INBOX|ORD|HANDLE|CLASS|RETRY|DLQ|REPLAY|OUTBOX|RELAY|OBS|OPS|SEC)-\d+\b")
INTERNAL_WORDS = re.compile(r"\bseeds?\b|\bsource documents?\b", re.IGNORECASE)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_user_facing_text_cites_no_requirement_ids_or_internal_sources(page: Path):
    """README and the manual speak to users: no requirement ids, no references to the documents the
    project was specified from."""
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        assert not REQUIREMENT_ID.search(line), f"{page.name}:{number}: a requirement id: {line.strip()}"
        assert not INTERNAL_WORDS.search(line), f"{page.name}:{number}: an internal reference: {line.strip()}"


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them."""
    found = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading[1].strip().lower().replace("`", ""))
            found.add(text.replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_between_pages_lead_somewhere(page: Path):
    """Every relative link of README and the manual names a file of the repository and, with a
    ``#fragment``, a heading of that page."""
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"^[a-z]+:", target):
                continue  # an absolute URL
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}:{number}: link to {target}: no such file"
            if fragment:
                assert fragment in anchors(linked), f"{page.name}:{number}: link to {target}: no such heading"

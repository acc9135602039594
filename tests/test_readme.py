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

Inline code that is a whole SQL statement or a ``postbox``/``make`` command is checked the same way,
and the prose itself: links between pages lead somewhere, and no requirement id is cited. The
machinery is in ``tests/readme/`` (extraction, the world and its SQL, shell lines).
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from postbox.config.policies import build_transports, load_policies
from postbox.config.settings import load_settings
from tests.conftest import Database, Server, _conninfo_url
from tests.helpers import eventually, scalar
from tests.readme.extract import BLOCKS, INLINE, PAGES, Snippet, anchors, fenced_blocks, prose_lines
from tests.readme.shell import expand_usage, readme_config, run_shell
from tests.readme.world import WORLD_DEAD_LETTERS, run_sql, seed_world, split_sql


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


def test_sql_transaction_control_and_maintenance_statements_run(world):
    """A snippet's BEGIN/COMMIT/ROLLBACK become a savepoint in the block's transaction (which is
    rolled back); VACUUM runs on its own connection; a failing statement or an empty query fails."""
    run_sql(world, "BEGIN; SELECT 1; COMMIT; BEGIN; SELECT 2; ROLLBACK; VACUUM postbox.inbox;", "here")
    with pytest.raises(pytest.fail.Exception, match="finds nothing"):
        run_sql(world, "SELECT * FROM postbox.dead_letters WHERE id = 4242", "here")
    with pytest.raises(pytest.fail.Exception, match="UndefinedTable"):
        run_sql(world, "SELECT * FROM postbox.no_such_view", "here")


def test_the_readme_toml_blocks_make_one_valid_config_file():
    """Together, the README's TOML blocks are one valid ``postbox.toml`` (the file its command lines
    pass with ``--config``): no setting given twice, every section accepted by the loaders."""
    config = readme_config()
    load_settings(**config.get("postbox", {}))
    policies = load_policies(config)
    assert set(policies.consumers) == set(config.get("consumers", {}))
    assert set(policies.destinations) == set(config.get("destinations", {}))


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

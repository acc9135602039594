"""Shell snippets: command lines split out of a block, usage notation expanded into concrete lines,
and each line checked against what it names (the real CLI, Makefile targets, compose services,
package extras, SQL given to psql)."""

from __future__ import annotations

import importlib
import itertools
import re
import shlex
import tomllib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click
import pytest
import yaml

from postbox import Registry
from postbox.cli.root import cli
from tests.conftest import Database
from tests.helpers import REPO
from tests.readme.extract import BLOCKS, Snippet
from tests.readme.world import run_sql

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

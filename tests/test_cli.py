"""The command line: clear errors for bad input and configuration, no secrets in messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import click

from postbox._version import __version__
from tests.checker import REPO


def postbox(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "postbox", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        timeout=120,
        check=False,
    )


def test_bad_policy_file_is_refused_with_the_setting_named(tmp_path, database):
    cfg = tmp_path / "p.toml"
    cfg.write_text('[consumers.basic]\non_dead_letter = "explode"\n')
    r = postbox(
        "--config",
        str(cfg),
        "--database-url",
        database.url,
        "worker",
        "--consumer",
        "basic",
        "--app",
        "tests.apps.basic:registry",
    )
    assert r.returncode == 2
    assert "consumers.basic.on_dead_letter" in r.stderr
    assert "Traceback" not in r.stderr


def test_short_dedup_retention_is_refused(tmp_path, database):
    cfg = tmp_path / "p.toml"
    cfg.write_text("[postbox]\ndedup_retention_seconds = 60\n")
    r = postbox(
        "--config",
        str(cfg),
        "--database-url",
        database.url,
        "worker",
        "--consumer",
        "basic",
        "--app",
        "tests.apps.basic:registry",
    )
    assert r.returncode == 2 and "dedup_retention_seconds" in r.stderr


def test_unknown_app_and_consumer_are_clear_errors(database):
    r = postbox(
        "--database-url", database.url, "worker", "--consumer", "basic", "--app", "nope.nothing:registry"
    )
    assert r.returncode == 2 and "cannot import nope.nothing" in r.stderr
    r = postbox(
        "--database-url", database.url, "worker", "--consumer", "other", "--app", "tests.apps.basic:registry"
    )
    assert r.returncode == 2 and "no handler for consumer 'other'" in r.stderr


def test_password_never_appears_in_error_output(tmp_path):
    url = "postgresql://postbox:s3cr3t-pw@127.0.0.1:1/nowhere"
    r = postbox("--database-url", url, "migrate")
    assert r.returncode != 0
    assert "s3cr3t-pw" not in r.stderr + r.stdout


def test_version_and_short_help_everywhere():
    r = postbox("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"postbox {__version__}"
    for args in (("-h",), ("worker", "-h"), ("dlq", "list", "-h"), ("replay", "run", "-h")):
        r = postbox(*args)
        assert r.returncode == 0 and "Usage:" in r.stdout, args


def test_every_option_can_come_from_the_environment_and_help_says_which(database):
    """POSTBOX_<COMMAND>_<OPTION>: a worker configured through the environment alone (for example the
    bridge's --from URL, which must not be visible in `ps`)."""
    help_text = postbox("worker", "--help").stdout
    assert "POSTBOX_WORKER_CONCURRENCY" in help_text and "POSTBOX_WORKER_HANDLER_TIMEOUT" in help_text
    assert "POSTBOX_BRIDGE_FROM" in postbox("bridge", "--help").stdout
    r = postbox(
        "worker",
        env={
            "POSTBOX_DATABASE_URL": database.url,
            "POSTBOX_WORKER_CONSUMER": "other",
            "POSTBOX_WORKER_APP": "tests.apps.basic:registry",
        },
    )
    assert r.returncode == 2 and "no handler for consumer 'other'" in r.stderr


def _options(
    command: click.Command, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Option]]:
    for param in command.params:
        if isinstance(param, click.Option) and param.name not in ("help", "version"):
            yield path, param
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _options(sub, (*path, name))


def test_every_options_variable_is_named_after_its_flag_as_documented():
    """POSTBOX_<COMMAND>_<OPTION> after the option's long flag, whatever the option's name in the
    code (``--sql`` of ``migrate``: POSTBOX_MIGRATE_SQL, not POSTBOX_MIGRATE_AS_SQL)."""
    from postbox.cli.root import cli

    missing = []
    for path, option in _options(cli):
        envvar = option.envvar
        names = [envvar] if isinstance(envvar, str) else list(envvar or ())
        if names == ["POSTBOX_CONNECT_TIMEOUT"]:  # names its own, shared by every long-running command
            continue
        flag = max((o for o in option.opts if o.startswith("--")), key=len)[2:]
        expected = "_".join(["POSTBOX", *path, flag]).upper().replace("-", "_")
        if expected not in names:
            missing.append((" ".join(path), flag, names))
    assert not missing, missing


def test_an_option_set_through_its_documented_variable_applies(empty_database, database):
    """``POSTBOX_MIGRATE_SQL=1 postbox migrate`` prints the DDL and leaves the database alone (it
    used to be ignored, so the migration ran); ``POSTBOX_STATUS_JSON=1`` prints JSON; the variable
    --help named before (after the option's name in the code) is still read."""
    for variable in ("POSTBOX_MIGRATE_SQL", "POSTBOX_MIGRATE_AS_SQL"):
        r = postbox("--database-url", empty_database.url, "migrate", env={variable: "1"})
        assert r.returncode == 0 and "CREATE TABLE postbox.inbox" in r.stdout, (variable, r.stderr)
        with empty_database.connect() as c:
            assert c.execute("SELECT to_regnamespace('postbox')").fetchone()[0] is None, variable
    r = postbox("--database-url", database.url, "status", env={"POSTBOX_STATUS_JSON": "1"})
    assert r.returncode == 0 and isinstance(json.loads(r.stdout), dict), r.stdout
    shown = postbox("migrate", "--help").stdout
    assert "POSTBOX_MIGRATE_SQL" in shown and "POSTBOX_MIGRATE_AS_SQL" not in shown  # read, not shown


def test_a_wrong_app_is_named_with_what_to_do(database):
    """--app naming an attribute the module lacks, something not a Registry, or a Registry without a
    handler for the consumer: each says which, exit 2 (the first two said "is not a Registry", the
    last "give --app" although it was given)."""
    for app, said in (
        ("tests.apps.basic:nosuch", "tests.apps.basic has no attribute 'nosuch'"),
        ("tests.apps.basic:time", "tests.apps.basic:time is a module, not a postbox.Registry"),
        # A handler named instead of its registry: it was called without arguments (a traceback).
        (
            "tests.apps.basic:handle",
            "tests.apps.basic:handle is a function that takes arguments (a handler?)",
        ),
        (
            "tests.apps.basic:registry",
            "no handler for consumer 'other' in tests.apps.basic:registry (it has handlers for: ",
        ),
    ):
        r = postbox("--database-url", database.url, "worker", "--consumer", "other", "--app", app)
        assert r.returncode == 2 and said in r.stderr, (app, r.stderr)
        assert "Traceback" not in r.stderr


def test_app_modules_are_found_in_the_current_directory(tmp_path, database):
    """Like uvicorn and celery, `--app myhandlers:registry` finds myhandlers.py where the command
    runs, without PYTHONPATH (through the installed `postbox` command)."""
    (tmp_path / "myhandlers.py").write_text(
        "from postbox.inbox.handlers import Registry\nregistry = Registry()\n"
        "@registry.handler('mine')\ndef handle(message, ctx):\n    pass\n"
    )
    script = os.path.join(os.path.dirname(sys.executable), "postbox")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def worker(consumer: str, app: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [script, "--database-url", database.url, "worker", "--consumer", consumer, "--app", app],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=120,
            check=False,
        )

    r = worker("other", "myhandlers:registry")
    # Imported: the error is about the consumer, not the module.
    assert r.returncode == 2 and "no handler for consumer 'other'" in r.stderr, r.stderr
    r = worker("x", "nothere:registry")
    assert r.returncode == 2 and "cannot import nothere" in r.stderr and str(tmp_path) in r.stderr

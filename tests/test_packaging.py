"""The package and its extras: a plain install brings no broker client, httpx or embedded
PostgreSQL, and whatever needs a missing extra says so in one line naming it (the ``postbox``
command: exit 1, no traceback; library use: :class:`postbox.errors.MissingExtra`, a ConfigError).

The missing client is made missing for real: the subprocess refuses to import it (a meta path
finder), as Python does when it is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import REPO

NAMES = {
    "rabbitmq": "RabbitMQ", "nats": "NATS", "redis": "Redis", "kafka": "Kafka", "http": "HTTP",
    "embedded": "embedded",
}  # fmt: skip
MODULES = {
    "rabbitmq": "pika", "nats": "nats", "redis": "redis", "kafka": "confluent_kafka", "http": "httpx",
    "embedded": "pgserver",
}  # fmt: skip

BLOCKING = """
import sys

class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == {module!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Missing())
"""


def run_without(
    extra: str, code: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (with ``args`` as ``sys.argv[1:]``) in a Python that cannot import the module of ``extra``."""
    script = BLOCKING.format(module=MODULES[extra]) + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def postbox_without(
    extra: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The ``postbox`` command, ``args`` given, without the module of ``extra``."""
    return run_without(extra, "from postbox.cli.root import main\nmain()\n", *args, env=env)


def one_line(extra: str, what: str) -> str:
    return f"postbox: {what} needs the {extra!r} extra: pip install 'postbox[{extra}]'"


DESTINATIONS = {
    "rabbitmq": 'kind = "rabbitmq"\nrouting_key = "packaging"\n',
    "nats": 'kind = "nats"\n',
    "redis": 'kind = "redis"\n',
    "kafka": 'kind = "kafka"\n',
    "http": 'kind = "http"\nurl = "http://127.0.0.1:9/hook"\n',
}


@pytest.mark.parametrize("extra", sorted(DESTINATIONS))
def test_a_relay_to_a_destination_whose_extra_is_missing_fails_in_one_line_naming_it(
    extra, database, tmp_path
):
    config = tmp_path / "postbox.toml"
    config.write_text(f"[destinations.out]\n{DESTINATIONS[extra]}")
    result = postbox_without(extra, "--config", str(config), "--database-url", database.url, "relay")
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == one_line(extra, f"the {NAMES[extra]} transport")
    assert "Traceback" not in result.stderr


def test_a_relay_needs_only_the_extras_of_its_own_destinations(database, tmp_path):
    """Without pika, the transports of a relay to Redis are built and made, though the config
    declares a RabbitMQ destination too: only the destinations relayed need their client."""
    config = tmp_path / "postbox.toml"
    config.write_text(
        f"[destinations.out]\n{DESTINATIONS['redis']}[destinations.other]\n{DESTINATIONS['rabbitmq']}"
    )
    code = """
    from postbox.config.policies import build_transports, load_policies
    from pathlib import Path
    import sys

    transports = build_transports(load_policies(Path(sys.argv[1])), ["out"], "postgresql://unused")
    transports["out"]().close()
    print("made", sorted(transports))
    """
    result = run_without("rabbitmq", code, str(config))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "made ['out']"


SOURCES = {
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672/%2F",
    "nats": "nats://127.0.0.1:4222",
    "redis": "redis://127.0.0.1:6379/0",
    "kafka": "kafka://127.0.0.1:9",
}


@pytest.mark.parametrize("extra", sorted(SOURCES))
def test_a_bridge_from_a_broker_whose_extra_is_missing_fails_in_one_line_naming_it(extra, database):
    result = postbox_without(
        extra,
        "--database-url",
        database.url,
        "bridge",
        "--from",
        SOURCES[extra],
        "--name",
        "PACKAGING:packaging.in",
        "--consumer",
        "packaging",
        "--connect-timeout",
        "5",
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == one_line(extra, f"the {NAMES[extra]} bridge source")
    assert "Traceback" not in result.stderr


def test_library_use_gets_a_config_error_naming_the_extra():
    """Making a transport, a source or an HTTP handler without its client raises MissingExtra (a
    ConfigError) with the same one line; importing the modules needs no client."""
    code = """
    import postbox
    from postbox.errors import MissingExtra
    from postbox.inbox.http_handlers import HttpEndpoint
    from postbox.outbox.transports.http import HttpTransport, OutboundPolicy

    OutboundPolicy(("example.com",), True).host_refusal("example.com")
    for make in (lambda: HttpEndpoint("http://127.0.0.1:9/"), lambda: HttpTransport("http://127.0.0.1:9/")):
        try:
            make()
        except postbox.ConfigError as error:
            print(type(error).__name__, isinstance(error, MissingExtra), error)
    """
    result = run_without("http", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "MissingExtra True " + one_line("http", "the HTTP handler").removeprefix("postbox: "),
        "MissingExtra True " + one_line("http", "the HTTP transport").removeprefix("postbox: "),
    ]


def test_http_handlers_declared_in_the_config_need_the_http_extra(tmp_path):
    config = tmp_path / "postbox.toml"
    config.write_text('[consumers.orders.handlers."*"]\nkind = "http"\nurl = "http://127.0.0.1:9/"\n')
    code = """
    import sys
    from pathlib import Path
    from postbox.config.policies import configured_handlers, load_policies
    from postbox.inbox.handlers import Registry
    from postbox.errors import MissingExtra

    try:
        configured_handlers(Registry(), load_policies(Path(sys.argv[1])), "orders")
    except MissingExtra as error:
        print(error)
    """
    result = run_without("http", code, str(config))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == one_line("http", "the HTTP handler").removeprefix("postbox: ")


def test_the_demo_without_a_database_url_needs_the_embedded_extra(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSTBOX_")}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            BLOCKING.format(module="pgserver") + "from postbox.cli.root import main\nmain()\n",
            "demo",
        ],
        check=False,
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == one_line(
        "embedded", "the embedded PostgreSQL (used by the demo when no database URL is set)"
    )
    assert "Traceback" not in result.stderr


LEFT_OUT = {
    "pika", "nats-py", "redis", "confluent-kafka", "httpx", "pgserver", "psycopg-binary", "psycopg-pool",
}  # fmt: skip


def _installed(python: Path) -> set[str]:
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return {p["name"].lower() for p in json.loads(listed.stdout)}


@pytest.mark.slow
def test_a_plain_install_brings_no_extra_and_an_extra_brings_its_client(tmp_path):
    """A fresh virtualenv, ``pip install <repo>``: postbox imports (psycopg on the system's libpq)
    and exports its API, without a broker client, httpx, the embedded PostgreSQL or psycopg's
    binary wheel; ``pip install '<repo>[rabbitmq]'`` adds pika."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, str(REPO)], check=True, timeout=900, cwd=tmp_path)

    imported = subprocess.run(
        [str(python), "-c", "import postbox; print(postbox.__all__)"],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert imported.returncode == 0, imported.stderr
    assert "'Relay'" in imported.stdout and "'Worker'" in imported.stdout
    assert (
        str(REPO)
        not in subprocess.run(
            [str(python), "-c", "import postbox; print(postbox.__file__)"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            check=True,
        ).stdout
    ), "the installed package, not the source tree"
    installed = _installed(python)
    assert "postbox" in installed and "psycopg" in installed
    assert not installed & LEFT_OUT

    subprocess.run([*pip, f"{REPO}[rabbitmq]"], check=True, timeout=900, cwd=tmp_path)
    with_rabbitmq = _installed(python)
    assert with_rabbitmq - installed == {"pika"}

"""Secrets never shown: the masking function on every kind of secret (by structure, not by name
lists only), and a deployment whose configuration is full of secrets, each a distinct random
marker, whose every output is searched for them: ``config check``, ``status``, ``migrate``'s
start line, the JSON logs and metrics pages of a worker and a relay, the failure records after
destinations fail with errors that contain their URLs, and ``pg_stat_activity``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

import postbox
from postbox.config.settings import mask_secrets, mask_text, mask_url, register_secret
from postbox.inbox.consumers import declare_consumer
from tests.helpers import REPO, eventually, scalar


def marker(kind: str) -> str:
    """A random string that appears nowhere unless a secret leaked."""
    return f"{kind}{uuid.uuid4().hex[:14]}"


# --- the masking function -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "kept"),
    [
        ("postgresql://app:{m}@db.internal:5432/orders", "postgresql://app:***@db.internal:5432/orders"),
        ("postgresql+psycopg://app:{m}@h/db", "postgresql+psycopg://app:***@h/db"),
        ("postgresql://app@h/db?password={m}&sslmode=require", "sslmode=require"),
        ("amqp://guest:{m}@rabbit:5672/%2F", "amqp://guest:***@rabbit:5672/%2F"),
        ("redis://:{m}@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("nats://audit:{m}@nats:4222", "nats://audit:***@nats:4222"),
        ("nats://{m}@nats:4222", "nats://***@nats:4222"),  # a NATS token is the user part
        ("https://u:{m}@hooks.example/h?team=billing", "team=billing"),
        ("https://hooks.example/h?token={m}&team=billing", "team=billing"),
        ("https://hooks.example/h?api_key={m}", "api_key=***"),
        ("https://hooks.example/h?key={m}", "key=***"),
        ("https://blob.example/f?sv=2024&sig={m}", "sv=2024"),
        ("https://s3.example/f?X-Amz-Signature={m}&X-Amz-Credential={m}", "X-Amz-Signature=***"),
        ("https://app.example/cb#access_token={m}&state=7", "state=7"),
        ("postgresql://u:pa%40ss/{m}@h/db", "@h/db"),  # a slash in the password
        ("could not reach 'postgresql://u:{m}@h/db': refused", "refused"),
        ('{{"url": "amqp://u:{m}@h/"}}', '"url": "amqp://u:***@h/"'),
        ("host=db port=5432 password={m} dbname=app", "dbname=app"),
        ("host=db password='{m} with space' dbname=app", "dbname=app"),
        ("Authorization: Bearer {m}", "Authorization: Bearer ***"),
        ("Authorization: Basic {m}", "Basic ***"),
        ("X-Api-Key: {m}", "X-Api-Key: ***"),
        ('{{"client_secret": "{m}", "n": 1}}', '"client_secret": "***"'),
        ("sasl_password={m}", "sasl_password=***"),
        ("X-Auth-Token={m}&x=1", "x=1"),
    ],
)
def test_mask_text_finds_secrets_by_their_structure(template, kept):
    """Passwords in URLs of every scheme, secret query parameters and fragments, NATS tokens,
    connection strings, headers and JSON fields are masked; what is not secret stays."""
    m = marker("struct")
    text = template.format(m=m)
    masked = mask_text(text)
    assert m not in masked
    assert kept in masked
    assert mask_url(text) == masked
    assert mask_text(masked) == masked  # masking twice changes nothing


@pytest.mark.parametrize(
    "text",
    [
        "postgresql://app@db:5432/orders",
        "http://hooks.example:8080/h?team=billing&routing_key=orders",
        'password authentication failed for user "app"',
        "key=order-17 routing_key=orders consumer=billing",
        "HTTP 500: upstream is down",
        "type=auth:login",  # a colon inside a name is not a separator
    ],
)
def test_mask_text_leaves_text_without_secrets_as_it_is(text):
    assert mask_text(text) == text


def test_mask_secrets_masks_values_named_like_secrets_and_secrets_inside_strings():
    m = [marker(f"n{i}") for i in range(6)]
    document = {
        "database_url": f"postgresql://app:{m[0]}@db/app",
        "password": m[1],
        "headers": {"Authorization": f"Bearer {m[2]}", "X-Api-Key": m[3], "X-Team": "billing"},
        "sasl": {"mechanism": "PLAIN", "password": m[4]},
        "tokens": [m[5]],
        "hmac_secret_env": "HOOK_SECRET",
        "routing_key": "orders",
        "timeout": 5,
        "empty_password": "",
    }
    masked = mask_secrets(document)
    text = json.dumps(masked)
    assert not [x for x in m if x in text]
    assert masked["hmac_secret_env"] == "HOOK_SECRET"  # the variable's name, not the secret
    assert masked["routing_key"] == "orders" and masked["timeout"] == 5
    assert masked["sasl"]["mechanism"] == "PLAIN"  # a setting about secrets is not one
    assert mask_secrets({"sasl.username": "relay", "sasl.mechanism": "SCRAM-SHA-512"}) == {
        "sasl.username": "relay",
        "sasl.mechanism": "SCRAM-SHA-512",
    }
    assert masked["headers"]["X-Team"] == "billing" and masked["empty_password"] == ""
    assert masked["database_url"] == "postgresql://app:***@db/app"


def test_a_registered_secret_is_masked_wherever_it_appears():
    """A secret the configuration holds is masked even in text that has no structure around it
    (a server echoing it back); values shorter than 8 characters are not registered."""
    secret = marker("echo")
    assert mask_text(f"the server said {secret}!") == f"the server said {secret}!"
    register_secret(secret)
    assert mask_text(f"the server said {secret}!") == "the server said ***!"
    register_secret("guest")
    assert mask_text("guest user") == "guest user"


# --- a deployment full of secrets ---------------------------------------------------------------


class EchoServer:
    """Answers every POST with 500 and a body that quotes the URL it was configured with (an
    upstream error that contains the caller's URL) and the request's secret headers."""

    def __init__(self) -> None:
        self.urls: dict[str, str] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                configured = server.urls.get(self.path.split("?", 1)[0], "?")
                body = (
                    f"upstream refused the call to {configured} "
                    f"(Authorization: {self.headers.get('Authorization')})"
                ).encode()
                self.send_response(500)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


def _with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    netloc = f"{parts.username}:{password}@{parts.hostname}:{parts.port or 5432}"
    return urlunsplit(parts._replace(netloc=netloc))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _postbox(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "postbox", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=120,
        check=False,
    )


def _run(*args: str, env: dict[str, str]) -> str:
    """The command's stdout and stderr together."""
    done = _postbox(*args, env=env)
    return done.stdout + done.stderr


def _tables_as_text(url: str) -> str:
    """Every row of every postbox table, as text."""
    with psycopg.connect(url, autocommit=True) as conn:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = 'postbox' "
                "AND table_type = 'BASE TABLE'"
            )
        ]
        out = []
        for table in tables:
            row = conn.execute(
                sql.SQL("SELECT string_agg(t::text, E'\\n') FROM postbox.{} t").format(sql.Identifier(table))
            ).fetchone()
            out.append(f"{table}: {row[0] if row else ''}")
        return "\n".join(out)


def _activity(url: str, dbname: str) -> str:
    return str(
        scalar(
            url,
            "SELECT string_agg(concat_ws(' ', application_name, usename, client_hostname, query, "
            "backend_type), E'\\n') FROM pg_stat_activity WHERE datname = %s",
            (dbname,),
        )
    )


def test_no_secret_of_the_configuration_appears_in_any_output(database, echo, tmp_path):
    """A configuration holding every kind of secret (database, broker and webhook passwords, a
    NATS token, URL tokens and signatures, secret headers, HMAC secrets), each a distinct marker:
    none of them appears in config check, status (text and JSON), migrate's line, the JSON logs and
    /metrics of a worker and a relay that run against it, the failure records after the HTTP
    endpoints answer with errors quoting their URLs and the brokers cannot be reached, or
    pg_stat_activity. The outputs are not empty: the test reads real content."""
    if urlsplit(database.url).password:
        pytest.skip("the test server needs a real password; the markers replace it")
    m = {k: marker(k) for k in (
        "dbpw", "mirrorpw", "amqppw", "redispw", "natspw", "natstoken", "hookpw", "hooktoken",
        "hookbearer", "hookapikey", "hookhmac", "partnerpw", "partnerkey", "partnersig",
        "partnerheader", "partnerhmac",
    )}  # fmt: skip
    db_url = _with_password(database.url, m["dbpw"])
    mirror_url = _with_password(database.url, m["mirrorpw"])  # trust authentication: it connects
    hook_url = f"http://hooker:{m['hookpw']}@127.0.0.1:{echo.port}/hook?token={m['hooktoken']}&team=billing"
    partner_url = (
        f"http://partner:{m['partnerpw']}@127.0.0.1:{echo.port}/partner"
        f"?api_key={m['partnerkey']}&sig={m['partnersig']}"
    )
    echo.urls = {"/hook": hook_url, "/partner": partner_url}
    retry = 'retry = { strategy = "fixed", base_delay = 0.05, max_attempts = 2 }'
    config = tmp_path / "postbox.toml"
    config.write_text(
        f"""
[consumers.hooks]
{retry}
[consumers.hooks.handlers."*"]
kind = "http"
url = "{hook_url}"
hmac_secret_env = "TEST_HOOK_SECRET"
headers = {{ "Authorization" = "Bearer {m["hookbearer"]}", "X-Api-Key" = "{m["hookapikey"]}", "X-Team" = "billing" }}

[destinations.partner]
kind = "http"
url = "{partner_url}"
hmac_secret_env = "TEST_PARTNER_SECRET"
headers = {{ "X-Auth-Token" = "{m["partnerheader"]}" }}
{retry}

[destinations.mirror]
kind = "postgres"
consumer = "mirror"
url = "{mirror_url}"

[destinations.events]
kind = "rabbitmq"
url = "amqp://guest:{m["amqppw"]}@127.0.0.1:1/%2F"
{retry}

[destinations.stream]
kind = "redis"
url = "redis://:{m["redispw"]}@127.0.0.1:1/0"
{retry}

[destinations.audit]
kind = "nats"
url = "nats://auditor:{m["natspw"]}@127.0.0.1:1"
{retry}

[destinations.audit2]
kind = "nats"
url = "nats://{m["natstoken"]}@127.0.0.1:1"
{retry}
"""
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "POSTBOX_DATABASE_URL": db_url,
        "TEST_HOOK_SECRET": m["hookhmac"],
        "TEST_PARTNER_SECRET": m["partnerhmac"],
        "POSTBOX_DB_METRICS_INTERVAL_SECONDS": "0.2",
    }

    def leaked(text: str) -> list[str]:
        return [k for k, v in m.items() if v in text]

    outputs: dict[str, str] = {}
    outputs["config check"] = _run("--config", str(config), "config", "check", env=env)
    assert "configuration is valid" in outputs["config check"], outputs["config check"]
    assert "team=billing" in outputs["config check"] and '"X-Team": "billing"' in outputs["config check"]
    outputs["migrate"] = _run("migrate", env=env)
    assert "is at revision" in outputs["migrate"], outputs["migrate"]

    with psycopg.connect(database.url) as c:
        for consumer in ("hooks", "mirror"):  # once one is declared, undeclared consumers are refused
            declare_consumer(c, consumer)
        postbox.receive(c, consumer="hooks", message_id="hook-1", key="k1", payload={"n": 1})
        for destination in ("partner", "mirror", "events", "stream", "audit", "audit2"):
            postbox.publish(c, destination=destination, key="k1", payload={"to": destination})
        c.commit()

    worker_port, relay_port = _free_port(), _free_port()
    common = ("--config", str(config), "--log-format", "json", "--log-level", "debug")
    logs = {"worker": tmp_path / "worker.log", "relay": tmp_path / "relay.log"}
    commands = {
        "worker": [*common, "--metrics-port", str(worker_port), "worker", "--consumer", "hooks",
                   "--poll-interval", "0.05", "--heartbeat-interval", "0.3", "--stale-after", "2"],
        "relay": [*common, "--metrics-port", str(relay_port), "relay",
                  "--poll-interval", "0.05", "--heartbeat-interval", "0.3", "--stale-after", "2"],
    }  # fmt: skip
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, args in commands.items():
            with logs[name].open("wb") as log_file:
                processes[name] = subprocess.Popen(
                    [sys.executable, "-m", "postbox", *args],
                    cwd=REPO,
                    env=env,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
        eventually(lambda: _ready(worker_port) and _ready(relay_port), timeout=60, what="both ready")
        # The webhook handler and five destinations fail (HTTP 500 quoting the URL, brokers not
        # listening) until their messages are dead-lettered; the PostgreSQL one delivers.
        try:
            eventually(
                lambda: (
                    scalar(database.url, "SELECT count(*) FROM postbox.dead_letters") == 6
                    and scalar(database.url, "SELECT count(*) FROM postbox.inbox WHERE consumer = 'mirror'")
                    == 1
                ),
                timeout=90,
                what="six dead letters and the mirrored row",
            )
        except AssertionError as error:
            state = scalar(
                database.url,
                "SELECT string_agg(concat_ws(' ', destination, state, attempt, last_error), E'\\n') "
                "FROM postbox.outbox",
            )
            dead = scalar(
                database.url,
                "SELECT string_agg(concat_ws(' ', consumer, destination), ', ') FROM postbox.dead_letters",
            )
            raise AssertionError(
                f"{error}\ndead letters: {dead}\noutbox:\n{state}\n"
                f"relay log:\n{logs['relay'].read_text()[-3000:]}\nworker log:\n{logs['worker'].read_text()[-1500:]}"
            ) from None
        outputs["pg_stat_activity"] = _activity(database.url, database.name)
        assert "postbox-worker:hooks" in outputs["pg_stat_activity"]
        outputs["worker metrics"] = _scrape(worker_port)
        outputs["relay metrics"] = _scrape(relay_port)
        assert "postbox_messages_dead_lettered_total" in outputs["worker metrics"]
        assert "postbox_relay_dead_lettered_total" in outputs["relay metrics"]
    finally:
        for p in processes.values():
            p.send_signal(signal.SIGTERM)
        for p in processes.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    for name, path in logs.items():
        outputs[f"{name} log"] = path.read_text(errors="replace")
    assert '"event": "attempt_failed"' in outputs["worker log"]
    assert '"event": "publish_failed"' in outputs["relay log"]
    outputs["status"] = _run("status", env=env)
    outputs["status --json"] = _run("status", "--json", env=env)
    assert "HTTP 500" in outputs["status"] and "upstream refused" in outputs["status --json"]
    outputs["failure records"] = _tables_as_text(database.url)
    records = outputs["failure records"]
    assert "upstream refused the call to http://hooker:***@127.0.0.1" in records
    assert "RabbitMQ unavailable" in records and "Redis unavailable" in records

    leaks = {where: leaked(text) for where, text in outputs.items() if leaked(text)}
    assert not leaks, leaks


def test_config_check_masks_secrets_it_cannot_know_by_value(tmp_path):
    """``config check`` masks by structure and by setting name: a header named like a secret, a
    URL's password and token, and the database URL's password."""
    m = {k: marker(k) for k in ("db", "url", "query", "header")}
    config = tmp_path / "postbox.toml"
    config.write_text(
        f"""
[destinations.partner]
kind = "http"
url = "https://p:{m["url"]}@partner.example/hook?token={m["query"]}"
headers = {{ "X-Signature" = "{m["header"]}" }}
"""
    )
    done = _postbox(
        "--config", str(config), "config", "check",
        env={**os.environ, "PYTHONPATH": str(REPO),
             "POSTBOX_DATABASE_URL": f"postgresql://app:{m['db']}@127.0.0.1:1/app"},
    )  # fmt: skip
    assert "configuration is valid" in done.stderr
    assert not [k for k, v in m.items() if v in done.stdout + done.stderr], done
    document = json.loads(done.stdout)
    assert document["postbox"]["database_url"] == "postgresql://app:***@127.0.0.1:1/app"
    assert document["destinations"]["partner"]["headers"] == {"X-Signature": "***"}

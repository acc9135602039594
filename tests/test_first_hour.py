"""What a new user and operator meet first: every accepted database URL form works in every command,
mistakes in names and configuration files are errors that say what was meant, and the bridge reads
the fields the manual documents."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from psycopg.conninfo import conninfo_to_dict

import postbox
from postbox.config.urls import libpq_url, sqlalchemy_url
from postbox.outbox.bridge import Bridge
from postbox.outbox.transports import source_for
from tests.apps import failing
from tests.helpers import FAST_WORKER, eventually, scalar, spawn_postbox

REPO = Path(__file__).resolve().parents[1]


def _postbox(*args: str, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    head = ["--config", str(config)] if config else []
    return subprocess.run(
        [sys.executable, "-m", "postbox", *head, *args],
        check=False, capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip


def _forms(url: str) -> dict[str, str]:
    """The same database as a libpq URL, postgres://, SQLAlchemy's URL and a key=value DSN."""
    params = conninfo_to_dict(url)
    dsn = " ".join(f"{k}={v}" for k, v in params.items())
    rest = url.split("://", 1)[1]
    return {
        "libpq": url,
        "postgres": "postgres://" + rest,
        "sqlalchemy": "postgresql+psycopg://" + rest,
        "dsn": dsn,
    }


@pytest.mark.parametrize("form", ["libpq", "postgres", "sqlalchemy", "dsn"])
def test_every_database_url_form_works_in_every_command(database, form):
    url = _forms(database.url)[form]
    for command in (["status", "--json"], ["dlq", "list", "--json"], ["migrate", "--check"]):
        done = _postbox("--database-url", url, *command)
        assert done.returncode == 0, (command, done.stderr)
        assert "Traceback" not in done.stderr
    json.loads(_postbox("--database-url", url, "status", "--json").stdout)


def test_urls_are_read_by_sqlalchemy_and_written_in_the_form_each_client_needs():
    assert libpq_url("postgresql+psycopg://u:p%40ss@h:5433/db?sslmode=require") == (
        "postgresql://u:p%40ss@h:5433/db?sslmode=require"
    )
    assert sqlalchemy_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    socket = conninfo_to_dict(libpq_url("host=/var/run/postgresql port=5433 dbname=app user=u"))
    assert socket == {"host": "/var/run/postgresql", "port": "5433", "dbname": "app", "user": "u"}


def test_a_url_that_is_not_postgresql_is_one_line_saying_what_to_give(tmp_path):
    done = _postbox("--database-url", "mysql://u:secret@h/db", "status")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "not a PostgreSQL URL" in done.stderr and "postgresql://" in done.stderr
    assert "secret" not in done.stderr


def test_halting_a_consumer_nobody_knows_is_an_error_naming_the_close_one(database, conn):
    conn.execute("SELECT postbox.inbox_receive('orders', 'm1', '{}'::jsonb)")
    conn.commit()
    done = _postbox("--database-url", database.url, "consumer", "halt", "ordres", "--reason", "typo")
    assert done.returncode == 1
    assert "unknown consumer 'ordres'" in done.stderr and "did you mean 'orders'?" in done.stderr
    assert scalar(database.url, "SELECT count(*) FROM postbox.consumers WHERE name = 'ordres'") == 0
    done = _postbox("--database-url", database.url, "consumer", "resume", "ordres", "--reason", "typo")
    assert done.returncode == 1 and "unknown consumer" in done.stderr
    ok = _postbox("--database-url", database.url, "consumer", "halt", "orders", "--reason", "maintenance")
    assert ok.returncode == 0 and "consumer orders halted" in ok.stdout


def test_halting_a_halted_consumer_says_so_and_keeps_the_first_halts_reason(database, conn):
    """A second halt said "halted" again, as if it had done something: it now names the halt in
    force (its time and reason), which stands, and audits nothing."""
    conn.execute("SELECT postbox.inbox_receive('orders', 'm1', '{}'::jsonb)")
    conn.commit()
    first = _postbox("--database-url", database.url, "consumer", "halt", "orders", "--reason", "ERP down")
    assert first.returncode == 0 and "consumer orders halted" in first.stdout
    again = _postbox("--database-url", database.url, "consumer", "halt", "orders", "--reason", "deploy")
    assert again.returncode == 0, again.stderr
    assert "consumer orders was already halted (since " in again.stdout
    assert "reason: ERP down); nothing changed" in again.stdout
    assert (
        scalar(database.url, "SELECT halted_reason FROM postbox.consumers WHERE name = 'orders'")
        == "ERP down"
    )
    assert scalar(database.url, "SELECT count(*) FROM postbox.audit_log WHERE action = 'consumer_halt'") == 1


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("[consumerz.orders]\n", "unknown section [consumerz] (did you mean 'consumers'?)"),
        (
            '[destination.x]\nkind = "postgres"\n',
            "unknown section [destination] (did you mean 'destinations'?)",
        ),
        ("[consumers.orders]\nretyr = { max_attempts = 3 }\n", "consumers.orders.retyr"),
        ("[postbox]\nmetrics_prot = 9100\n", "(did you mean 'metrics_port'?)"),
        ('[consumers.o.types."t"]\non_dead_leter = "skip"\n', "(did you mean 'on_dead_letter'?)"),
    ],
)
def test_a_misspelt_configuration_file_is_refused_with_what_was_meant(tmp_path, text, complaint):
    config = tmp_path / "postbox.toml"
    config.write_text(text)
    done = _postbox("config", "check", config=config)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert complaint in done.stderr
    assert done.stdout == ""


def test_the_redis_bridge_reads_the_documented_field_names(database):
    """An entry written by another program with the manual's field names (`postbox-message-id`,
    `postbox-key`, `payload`) lands in the inbox; the transport's own names still work."""
    stream = f"fields:{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        r.xadd(
            stream, {"postbox-message-id": "doc-1", "postbox-key": "k1", "payload": '{"n": 1}', "type": "t"}
        )
        r.xadd(stream, {"message_id": "own-2", "key": "k1", "payload": '{"n": 2}'})
        bridge = Bridge(database.url, source_for("redis://127.0.0.1:6379/0", stream), "orders", wait=0.2)
        thread = threading.Thread(target=bridge.run)
        thread.start()
        try:
            eventually(lambda: scalar(database.url, "SELECT count(*) FROM postbox.inbox") == 2)
        finally:
            bridge.stop()
            thread.join(30)
        got = scalar(
            database.url,
            "SELECT string_agg(message_id || '/' || key || '/' || (payload->>'n'), ',' ORDER BY message_id)"
            " FROM postbox.inbox",
        )
        assert got == "doc-1/k1/1,own-2/k1/2"
    finally:
        r.delete(stream)
        r.close()


@pytest.mark.parametrize(
    "command", [["status"], ["dlq", "list"], ["migrate"], ["consumer", "halt", "x", "--reason", "r"]]
)
def test_a_command_without_a_database_says_how_to_give_one_and_starts_nothing(tmp_path, command):
    """Only the demo starts an embedded PostgreSQL; every other command names the three ways to give
    a database, at once, and leaves no data folder behind."""
    env = {k: v for k, v in os.environ.items() if k not in ("POSTBOX_DATABASE_URL", "POSTBOX_CONFIG")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "postbox", *command],
        check=False, capture_output=True, text=True, timeout=60, cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO / "service")},
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], "one line"
    assert "no database given" in done.stderr and "POSTBOX_DATABASE_URL" in done.stderr
    assert "--database-url" in done.stderr and "postbox demo" in done.stderr
    assert not (tmp_path / ".pgdata").exists()
    assert time.monotonic() - started < 30


def test_a_json_log_stream_is_json_to_the_last_line_and_failures_carry_the_error(database, conn, tmp_path):
    """Start, a failed attempt, a dead letter, the stop on SIGTERM: every line one JSON object; the
    failure lines name the error's type and message, the message and the decision."""
    conn.execute(
        "SELECT postbox.inbox_receive('failing', 'j1', '\"abc\"'::jsonb, key => 'k-json', type => 't')"
    )
    conn.commit()
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        p = spawn_postbox(
            "--database-url", database.url, "--log-format", "json", "--log-level", "info", "worker", "--consumer", "failing",
            "--app", "tests.apps.failing:registry", "--poll-interval", "0.1", stderr=out.fileno(),
        )  # fmt: skip
    try:
        eventually(
            lambda: scalar(database.url, "SELECT count(*) FROM postbox.attempts WHERE message_id = 'j1'") >= 1
        )
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    failed = next((entry for entry in lines if entry.get("event") == "attempt_failed"), None)
    assert failed is not None, lines
    assert failed["error_type"] == "ValueError" and failed["error"] == "amount must be a number, got 'abc'"
    where = (failed["consumer"], failed["key"], failed["message_id"], failed["attempt"])
    assert where == ("failing", "k-json", "j1", 1)
    assert failed["decision"] in ("retry", "dead_letter")
    assert any(entry.get("event") == "process" and "stopping" in entry["msg"] for entry in lines)
    assert not any("is not declared" in entry["msg"] for entry in lines)  # no consumer is
    assert not any("window in force" in entry["msg"] for entry in lines)  # the default window covers it


def _worker_warning(url: str, tmp_path: Path, needle: str) -> dict[str, Any]:
    """Start a worker (JSON logs) for consumer ``failing``, wait for the log line holding ``needle``,
    stop it (exit 0); that line."""
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        p = spawn_postbox(
            "--database-url", url, "--log-format", "json", "worker", "--consumer", "failing",
            "--app", "tests.apps.failing:registry", "--poll-interval", "0.1", stderr=out.fileno(),
        )  # fmt: skip
    try:
        eventually(lambda: needle in log.read_text(), what=needle)
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    return next(json.loads(line) for line in log.read_text().splitlines() if needle in line)


def test_a_worker_for_an_undeclared_consumer_says_producers_are_refused_while_others_are_declared(
    database, conn, tmp_path
):
    """Once a consumer is declared, the database refuses messages for an undeclared one: a worker
    started for one without it in the configuration file says so, and how to declare it (it started
    and reported ready without a word). It does not declare it: that would make the database refuse
    every other undeclared consumer's messages."""
    postbox.declare_consumer(conn, "billing")
    conn.commit()
    warning = _worker_warning(database.url, tmp_path, "is not declared")
    assert warning["level"] == "warning"
    assert "consumer 'failing' is not declared while others are ('billing')" in warning["msg"]
    assert "[consumers.failing] in the configuration file, or postbox.declare_consumer" in warning["msg"]
    assert scalar(database.url, "SELECT count(*) FROM postbox.consumers WHERE name = 'failing'") == 0


def test_a_worker_says_when_the_deduplication_window_in_force_is_shorter_than_its_retries_need(
    database, conn, tmp_path
):
    """The window in force is the one postbox maintain set, from its own settings: a worker whose
    retries and replay window need more says so at start, naming the setting to raise (it checked
    only its own settings, and redeliveries past the window were processed twice)."""
    conn.execute("SELECT postbox.dedup_window_set_v1(3600)")
    conn.commit()
    warning = _worker_warning(database.url, tmp_path, "window in force")
    assert warning["level"] == "warning"
    assert warning["msg"].startswith("the deduplication window in force (3600 s, set by postbox maintain)")
    assert "run postbox maintain with POSTBOX_DEDUP_RETENTION_SECONDS of at least " in warning["msg"]


def test_a_process_that_cannot_start_says_why_in_its_log_format(tmp_path):
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        p = spawn_postbox(
            "--database-url", "postgresql://postgres@127.0.0.1:1/none", "--log-format", "json", "worker",
            "--consumer", "mis", "--app", "tests.apps.misbehaving:registry", "--connect-timeout", "0.5",
            stderr=out.fileno(),
        )  # fmt: skip
    assert p.wait(30) == 1
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert lines[-1]["level"] == "error" and "gave up after" in lines[-1]["msg"]


def test_dead_letter_listings_show_the_error_type_and_explain_shows_details_whole(database, conn):
    """`dlq list` shows `ValueError: …` (type and message); `dlq explain` cuts long details at 60
    characters, and `--full` shows them whole."""
    long_value = "x" * 120
    conn.execute("SELECT postbox.inbox_receive('failing', 'long', %s::jsonb)", (json.dumps(long_value),))
    conn.commit()
    with postbox.Worker(database.url, failing.registry, consumer="failing", **FAST_WORKER):
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM postbox.dead_letters") == 1)
    listed = _postbox("--database-url", database.url, "dlq", "list", "--full")
    assert listed.returncode == 0
    assert f"ValueError: amount must be a number, got '{long_value}'" in listed.stdout
    assert (
        "ValueError: amount must be a number"
        in _postbox("--database-url", database.url, "dlq", "list").stdout
    )
    cut = _postbox("--database-url", database.url, "dlq", "explain", "--message-id", "long")
    assert cut.returncode == 0 and long_value not in cut.stdout and "..." in cut.stdout
    whole = _postbox("--database-url", database.url, "dlq", "explain", "--message-id", "long", "--full")
    assert whole.returncode == 0 and long_value in whole.stdout
    as_json = json.loads(_postbox("--database-url", database.url, "dlq", "explain", "1", "--json").stdout)
    assert any(long_value in str(event["detail"]) for event in as_json)


def test_no_metric_uses_a_label_prometheus_keeps_for_the_scrape_target():
    """A metric labelled `job` or `instance` is renamed `exported_job` on a real scrape, and a rule
    selecting on it never fires: the maintenance job's name is the label `task`."""
    from postbox.operations import counters

    collectors = list(counters.REGISTRY._collector_to_names)
    labelled = {c: set(getattr(c, "_labelnames", ())) for c in collectors}
    assert any("task" in names for names in labelled.values())
    assert not [c for c, names in labelled.items() if names & {"job", "instance"}]
    rules = (REPO / "deploy" / "prometheus" / "alerts.yml").read_text()
    assert 'postbox_maintenance_last_success_timestamp_seconds{task="dedup_prune"}' in rules
    assert "$labels.job" not in rules

"""`postbox status` and `postbox config check` from the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psycopg

import postbox
from tests.helpers import REPO


def run_postbox(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "postbox", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_status_shows_consumers_lag_dead_letters_backlog_and_replays(database):
    """status --json and the text screen show each consumer's live messages, the relay backlog,
    dead-letter groups, live processes, and running replays once postbox.replay_jobs exists."""
    url = database.url
    with psycopg.connect(url) as c:
        postbox.receive_many(
            c, [{"consumer": "billing", "message_id": f"m{i}", "key": "k", "payload": i} for i in range(3)]
        )
        postbox.publish(c, destination="emails", key="k", payload={"x": 1})
        c.execute(
            """INSERT INTO postbox.dead_letters (origin, origin_id, consumer, message_id, key, position, payload,
                   received_at, attempt, reason, ordering_policy, last_error, fingerprint)
               VALUES ('inbox', 999, 'billing', 'gone', 'k2', 1, '1', now(), 3, 'attempts_exhausted', 'skip',
                       'boom', 'RuntimeError: boom')"""
        )
        c.commit()
    r = run_postbox("--database-url", url, "status", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    billing = next(x for x in s["consumers"] if x["name"] == "billing")
    assert (billing["ready"], billing["pending"], billing["blocked_keys"]) == (1, 2, 0)
    assert billing["lag_seconds"] >= 0
    assert s["relay"][0]["destination"] == "emails" and s["relay"][0]["rows"] == 1
    assert s["dead_letters"][0]["open"] == 1 and s["dead_letters"][0]["reason"] == "attempts_exhausted"
    assert s["replays"] == []

    with psycopg.connect(url, autocommit=True) as c:  # a finished dry run, and a running replay job
        dry = c.execute(
            """SELECT postbox.dlq_replay('{"queue": "billing"}', reason => 'look', dry_run => true)"""
        ).fetchone()[0]
        c.execute("SELECT postbox.replay_step(%s)", (dry,))
        job = c.execute(
            """SELECT postbox.dlq_replay('{"queue": "billing"}', reason => 'fixed')"""
        ).fetchone()[0]
        assert c.execute("SELECT (postbox.replay_step(%s)).state", (job,)).fetchone()[0] == "running"
    r = run_postbox("--database-url", url, "status")
    assert r.returncode == 0, r.stderr
    text = r.stdout
    for expected in (
        "Consumers",
        "billing",
        "Live processes",
        "Dead letters: 0 open",  # the one dead letter was sent back by the running replay
        "emails",
        "Replays",
        "running",
    ):
        assert expected in text, text
    assert "done" not in text.split("Replays", 1)[1].split("\n\n", 1)[0]


def test_config_check_masks_secrets_and_reports_errors(tmp_path):
    """config check prints the effective configuration with no password or token in it, exit 0;
    with an invalid setting it names the setting and exits 1, still without secrets."""
    config = tmp_path / "postbox.toml"
    config.write_text(
        """
[postbox]
dedup_retention_seconds = 1209600

[consumers.billing]
retry = { max_attempts = 5 }

[destinations.orders]
kind = "rabbitmq"
url = "amqp://app:rabbit-pw-42@mq.internal:5672/%2F"

[destinations.partner]
kind = "http"
url = "https://partner.example/hooks"
hmac_secret_env = "PARTNER_SECRET"
headers = { "Authorization" = "Bearer tok-abc-123" }
"""
    )
    env = {
        "POSTBOX_DATABASE_URL": "postgresql://app:db-pw-99@db.internal:5432/app",
        "POSTBOX_METRICS_PORT": "9464",
        "PARTNER_SECRET": "hmac-pw-77",  # the variable the file names for the webhook's secret
    }
    r = run_postbox("--config", str(config), "config", "check", env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for secret in ("db-pw-99", "rabbit-pw-42", "tok-abc-123", "hmac-pw-77"):
        assert secret not in out
    effective = json.loads(r.stdout)
    assert effective["postbox"]["database_url"] == "postgresql://app:***@db.internal:5432/app"
    assert effective["postbox"]["metrics_port"] == 9464
    assert effective["postbox"]["dedup_retention_seconds"] == 1209600
    assert effective["destinations"]["partner"]["hmac_secret_env"] == "PARTNER_SECRET"
    assert effective["consumers"]["billing"]["retry"] == {"max_attempts": 5}

    config.write_text(config.read_text().replace("max_attempts = 5", "max_attempts = 0"))
    r = run_postbox("--config", str(config), "config", "check", env={**env, "POSTBOX_LOG_LEVEL": "error"})
    out = r.stdout + r.stderr
    assert r.returncode == 1
    assert "max_attempts" in r.stderr
    for secret in ("db-pw-99", "rabbit-pw-42", "tok-abc-123"):
        assert secret not in out


def config_check(
    tmp_path: Path, text: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``postbox config check`` of a file holding ``text``."""
    config = tmp_path / "postbox.toml"
    config.write_text(text)
    return run_postbox("--config", str(config), "config", "check", env=env)


def refused(result: subprocess.CompletedProcess[str], *problems: str) -> None:
    """Exit 1, each of ``problems`` said, and not that the configuration is valid."""
    assert result.returncode == 1, result.stderr
    for problem in problems:
        assert problem in result.stderr, (problem, result.stderr)
    assert "configuration is valid" not in result.stderr


def valid(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0 and "configuration is valid" in result.stderr, result.stderr


def test_config_check_refuses_a_deduplication_window_shorter_than_the_files_retries_as_a_worker_would(
    tmp_path,
):
    """A window shorter than the longest retry horizon plus the replay window: config check says so
    and exits 1, as a worker started with the file refuses it (config check said it was valid). A
    consumer's longer retries in the file count too."""
    refused(
        config_check(tmp_path, "[postbox]\ndedup_retention_seconds = 100\n"),
        "dedup_retention_seconds (100) is shorter than",
    )
    # Long enough for the default retries, not for the file's consumer that retries for 30 days.
    too_short = (
        "[postbox]\ndedup_retention_seconds = 604800\nreplay_window_seconds = 86400\n"
        "[consumers.billing]\nretry = { max_attempts = 100, max_delay = 86400, max_total_seconds = 2592000 }\n"
    )
    refused(config_check(tmp_path, too_short), "dedup_retention_seconds (604800) is shorter than")
    valid(config_check(tmp_path, "[postbox]\ndedup_retention_seconds = 604800\n"))


def test_config_check_warns_of_each_secret_variable_that_is_not_set_by_its_setting(tmp_path):
    """A Kafka destination's SASL and key passwords and an HTTP destination's HMAC secret come from
    environment variables: config check warns of each one unset, under its own setting (the relay
    refuses to start without them; it named the Kafka ones hmac_secret_env), the file still valid
    (a check may run where the secrets are not, in CI); once set, no warning."""
    text = (
        '[destinations.k]\nkind = "kafka"\nsasl_password_env = "PB_T_SASL"\nssl_key_password_env = "PB_T_KEY"\n'
        '[destinations.h]\nkind = "http"\nurl = "https://partner.example/h"\nhmac_secret_env = "PB_T_HMAC"\n'
    )
    r = config_check(tmp_path, text)
    valid(r)
    for line in (
        "warning: destinations.k.sasl_password_env: environment variable PB_T_SASL is not set",
        "warning: destinations.k.ssl_key_password_env: environment variable PB_T_KEY is not set",
        "warning: destinations.h.hmac_secret_env: environment variable PB_T_HMAC is not set",
    ):
        assert line in r.stderr, r.stderr
    relay = run_postbox(
        "--config", str(tmp_path / "postbox.toml"), "--database-url", "postgresql://x@127.0.0.1:1/x", "relay",
        "--destination", "k", env={"PB_T_KEY": "x", "PB_T_HMAC": "x"},
    )  # fmt: skip
    assert (
        relay.returncode == 2
        and "destinations.k.sasl_password_env: environment variable PB_T_SASL" in relay.stderr
    )
    r = config_check(tmp_path, text, env={"PB_T_SASL": "s", "PB_T_KEY": "k", "PB_T_HMAC": "h"})
    valid(r)
    assert "warning" not in r.stderr, r.stderr


def test_config_check_warns_of_kafka_settings_librdkafka_refuses_here_and_the_relay_refuses_them(tmp_path):
    """A Kafka destination whose CA file is not on this machine: config check warns, naming the
    setting and librdkafka's reason, and still exits 0 (the file may be on the relay's machine
    only); a relay started here with the file refuses to start (exit 2), as the warning says."""
    text = (
        '[destinations.events]\nkind = "kafka"\nbootstrap_servers = "127.0.0.1:1"\n'
        '[destinations.events.settings]\n"security.protocol" = "ssl"\n"ssl.ca.location" = "/nonexistent/ca.pem"\n'
    )
    r = config_check(tmp_path, text)
    valid(r)
    assert "warning: destinations.events.settings: librdkafka refuses them here: " in r.stderr, r.stderr
    assert "ssl.ca.location" in r.stderr and "a relay refuses to start with them" in r.stderr
    relay = run_postbox(
        "--config", str(tmp_path / "postbox.toml"), "--database-url", "postgresql://x@127.0.0.1:1/x", "relay"
    )
    assert relay.returncode == 2 and "destinations.events.settings: librdkafka refuses them" in relay.stderr
    fixed = text.replace('"ssl.ca.location" = "/nonexistent/ca.pem"\n', "")
    r = config_check(tmp_path, fixed)
    valid(r)
    assert "warning" not in r.stderr, r.stderr


def test_a_destination_or_handler_table_without_kind_is_refused_with_the_kinds_it_takes(tmp_path):
    """Without ``kind`` (``type`` written instead, say), the table's error names ``kind`` and its
    values, not pydantic's "Unable to extract tag using discriminator"."""
    r = config_check(tmp_path, '[destinations.events]\ntype = "kafka"\n')
    refused(
        r,
        "destinations.events",
        "no kind given: add kind = one of 'postgres', 'rabbitmq', 'nats', 'redis', 'kafka', 'http' (not type)",
    )
    assert "discriminator" not in r.stderr
    r = config_check(tmp_path, '[consumers.billing.handlers.paid]\nfunction = "app.paid"\n')
    refused(r, "consumers.billing.handlers.paid", "no kind given: add kind = one of 'sql', 'http'")


def test_config_check_names_every_problem_of_a_file_in_one_run(tmp_path):
    """A bad setting, a bad retry table and a type's bad retry table of another consumer: all named
    at once (the retry tables were checked only once the rest was valid, one problem at a time)."""
    bad = (
        '[postbox]\nlog_format = "jsonx"\n'
        '[consumers.billing]\non_dead_letter = "explode"\nretry = { max_delay = "abc" }\n'
        "[consumers.stock.types.reserve]\nretry = { base_delay = -1 }\n"
    )
    refused(
        config_check(tmp_path, bad),
        "log_format",
        "consumers.billing.on_dead_letter",
        "consumers.billing.retry.max_delay",
        "consumers.stock.types.reserve.retry.base_delay",
    )
    retries = "[consumers.billing]\nretry = { max_attempts = 0 }\n[consumers.stock.types.reserve]\nretry = { base_delay = -1 }\n"
    refused(
        config_check(tmp_path, retries),
        "consumers.billing.retry.max_attempts",
        "consumers.stock.types.reserve.retry.base_delay",
    )
    # A type's own mistake is named even while its consumer's table is wrong (it was named only
    # once that was fixed), and a problem of the consumer's table is said once, not again per type.
    same = (
        "[consumers.billing]\nretry = { max_delay = 1, base_delay = 10 }\n"
        "[consumers.billing.types.paid]\nretry = { max_attempts = 0 }\n"
    )
    r = config_check(tmp_path, same)
    refused(
        r,
        "consumers.billing.retry: max_delay (1.0) must not be below base_delay (10.0)",
        "consumers.billing.types.paid.retry.max_attempts",
    )
    assert r.stderr.count("must not be below") == 1, r.stderr


def test_status_watch_prints_one_json_object_a_line_and_ctrl_c_ends_it_with_status_0(database):
    """``status --watch --json`` refreshes until interrupted, one JSON object per refresh; SIGINT
    (Ctrl-C), whether it lands in the pause or in a query, ends it with status 0 and no traceback.
    Three interrupts at different moments of the refresh cycle."""
    for pause in ("0.1", "0.2", "0.3"):
        p = subprocess.Popen(
            [sys.executable, "-m", "postbox", "--database-url", database.url, "status", "--watch", "--json",
             "--interval", pause],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            assert p.stdout is not None
            for _ in range(3):
                line = p.stdout.readline()
                assert "consumers" in json.loads(line)
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=20)
            assert p.returncode == 0, err
            assert b"Traceback" not in err and b"Aborted" not in err
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()

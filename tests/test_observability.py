"""Metrics and structured logs of a running worker process after a scripted scenario (OBS-1, OBS-2),
and the trace context a handler's outbox events inherit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

import postbox
from postbox.operations.tracing import child_traceparent, trace_id
from tests.helpers import REPO, eventually

TRACE = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{TRACE}-b7ad6b7169203331-01"

CONFIG = """
[consumers.obs]
on_dead_letter = "block"
retry = { strategy = "fixed", base_delay = 0.05, max_delay = 1, max_attempts = 5 }
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def status_of(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:  # not listening yet
        return 0


@pytest.fixture
def observed_worker(database, tmp_path):
    config = tmp_path / "postbox.toml"
    config.write_text(CONFIG)
    log_path = tmp_path / "worker.log"
    port = free_port()
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "postbox", "--config", str(config), "--database-url", database.url,
             "--log-format", "json", "--log-level", "debug", "--metrics-port", str(port),
             "worker", "--consumer", "obs", "--app", "tests.apps.observed:registry",
             "--poll-interval", "0.05", "--heartbeat-interval", "0.3", "--stale-after", "2"],
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "POSTBOX_DB_METRICS_INTERVAL_SECONDS": "0.2"},
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )  # fmt: skip
        try:
            eventually(lambda: proc.poll() is None and status_of(port, "/readyz") == 200, what="worker ready")
            yield port, log_path
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0


def _scenario(url: str) -> None:
    messages = [
        *(
            {"message_id": f"ok-{i}", "key": f"k{i}", "type": "ok", "payload": {"publish": True}}
            for i in range(5)
        ),
        {"message_id": "retry-1", "key": "kr1", "type": "retry", "payload": {"succeed_at": 3}},
        {"message_id": "retry-2", "key": "kr2", "type": "retry", "payload": {"succeed_at": 2}},
        {"message_id": "bad-1", "key": "kb", "type": "bad", "payload": {"invalid": True}},
        {"message_id": "held-1", "key": "kb", "type": "ok", "payload": {}},
    ]
    with psycopg.connect(url) as conn:
        postbox.receive_many(
            conn,
            [{"consumer": "obs", "headers": {"traceparent": TRACEPARENT}, "correlation_id": "checkout-7", **m}
             for m in messages],
        )  # fmt: skip
        conn.commit()


def test_metrics_of_a_worker_after_a_scenario(database, observed_worker):
    """After 5 successes, 2 messages that succeed after 2 and 1 transient failures, and a permanent
    failure that dead-letters its message and blocks its key (one message held behind it), the
    worker's /metrics shows each figure with its exact value: processed, succeeded after retry,
    failed by kind and error type, retried, dead-lettered, deliveries by attempt, redeliveries,
    histogram counts, breaker state, and the database gauges (dead letters, blocked keys, held and
    retrying messages, relay backlog, live workers)."""
    port, _ = observed_worker
    _scenario(database.url)

    expected = {
        ("postbox_messages_processed_total", (("consumer", "obs"), ("type", "ok"))): 5,
        ("postbox_messages_processed_total", (("consumer", "obs"), ("type", "retry"))): 2,
        ("postbox_messages_succeeded_after_retry_total", (("consumer", "obs"), ("type", "retry"))): 2,
        ("postbox_messages_succeeded_after_retry_total", (("consumer", "obs"), ("type", "ok"))): 0,
        (
            "postbox_messages_failed_total",
            (
                ("consumer", "obs"),
                ("type", "retry"),
                ("kind", "transient"),
                ("error_type", "ConnectionError"),
            ),
        ): 3,
        (
            "postbox_messages_failed_total",
            (("consumer", "obs"), ("type", "bad"), ("kind", "permanent"), ("error_type", "ValueError")),
        ): 1,
        ("postbox_messages_retried_total", (("consumer", "obs"), ("type", "retry"))): 3,
        (
            "postbox_messages_dead_lettered_total",
            (("consumer", "obs"), ("type", "bad"), ("reason", "permanent")),
        ): 1,
        ("postbox_deliveries_total", (("consumer", "obs"), ("attempt", "1"))): 8,
        ("postbox_deliveries_total", (("consumer", "obs"), ("attempt", "2"))): 2,
        ("postbox_deliveries_total", (("consumer", "obs"), ("attempt", "3"))): 1,
        ("postbox_redeliveries_total", (("consumer", "obs"),)): 3,
        ("postbox_handler_duration_seconds_count", (("consumer", "obs"), ("type", "ok"))): 5,
        ("postbox_handler_duration_seconds_count", (("consumer", "obs"), ("type", "retry"))): 5,
        ("postbox_handler_duration_seconds_count", (("consumer", "obs"), ("type", "bad"))): 1,
        ("postbox_receive_to_start_seconds_count", (("consumer", "obs"),)): 8,
        ("postbox_failure_to_success_seconds_count", (("consumer", "obs"),)): 2,
        ("postbox_circuit_breaker_state", (("consumer", "obs"),)): 0,
        ("postbox_dead_letters_open", (("origin", "inbox"), ("queue", "obs"))): 1,
        ("postbox_blocked_keys", (("origin", "inbox"), ("queue", "obs"))): 1,
        ("postbox_inbox_messages", (("consumer", "obs"), ("state", "blocked"))): 1,
        ("postbox_inbox_messages", (("consumer", "obs"), ("state", "pending"))): 1,
        ("postbox_inbox_retrying", (("consumer", "obs"),)): 0,
        ("postbox_relay_backlog", (("destination", "out"),)): 5,
        ("postbox_workers_live", (("kind", "worker"),)): 1,
    }
    last: list[str] = []

    def settled():
        # Counters move as messages finish, gauges with each database snapshot: wait until the
        # scrape shows the end state everywhere, then no figure may differ.
        s = scrape(port)
        last[:] = [
            f"{name}{dict(labels)}: {value(s, name, **dict(labels))} != {want}"
            for (name, labels), want in expected.items()
            if value(s, name, **dict(labels)) != want
        ]
        return s if not last else None

    try:
        s = eventually(settled, timeout=30, what="scenario reflected in /metrics")
    except AssertionError:
        raise AssertionError(f"figures differ: {last}") from None
    assert value(s, "postbox_claim_duration_seconds_count", consumer="obs") >= 1
    assert value(s, "postbox_dead_letter_oldest_age_seconds", origin="inbox", queue="obs") >= 0
    assert value(s, "postbox_blocked_key_oldest_seconds", origin="inbox", queue="obs") >= 0
    assert ("postbox_table_dead_tuples", (("table", "inbox"),)) in s
    assert ("postbox_xmin_age_transactions", ()) in s
    # Never a key or a message id as a label.
    for _, labels in s:
        for label, _v in labels:
            assert label not in ("key", "message_id")
    assert status_of(port, "/healthz") == 200
    assert status_of(port, "/readyz") == 200


def test_log_lines_are_json_with_the_stable_fields(database, observed_worker):
    """Every log line of the scenario is a JSON object; every message-related one carries ts, level,
    event, consumer, message_id, key, type, attempt, worker, correlation_id and trace_id; failures
    carry error_type, processed messages duration_ms."""
    port, log_path = observed_worker
    _scenario(database.url)
    eventually(
        lambda: value(scrape(port), "postbox_messages_processed_total", consumer="obs") == 7, what="processed"
    )

    def lines():
        entries = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
        events = [e for e in entries if e.get("message_id")]
        if sum(e["event"] == "message_processed" for e in events) == 7 and any(
            e["event"] == "message_dead_lettered" for e in events
        ):
            return entries
        return None

    entries = eventually(lines, what="log lines")
    for e in entries:
        assert {"ts", "level", "event", "logger", "msg"} <= e.keys()
    about_messages = [e for e in entries if e.get("message_id")]
    for e in about_messages:
        assert {
            "consumer",
            "message_id",
            "key",
            "type",
            "attempt",
            "worker",
            "correlation_id",
            "trace_id",
        } <= e.keys(), e
        assert e["consumer"] == "obs" and e["trace_id"] == TRACE and e["correlation_id"] == "checkout-7"
    processed = {e["message_id"]: e for e in about_messages if e["event"] == "message_processed"}
    assert set(processed) == {*(f"ok-{i}" for i in range(5)), "retry-1", "retry-2"}
    assert processed["retry-1"]["attempt"] == 3 and processed["ok-0"]["duration_ms"] >= 0
    failed = [e for e in about_messages if e["event"] == "attempt_failed"]
    assert sorted((e["message_id"], e["attempt"], e["error_type"]) for e in failed) == [
        ("bad-1", 1, "ValueError"),
        ("retry-1", 1, "ConnectionError"),
        ("retry-1", 2, "ConnectionError"),
        ("retry-2", 1, "ConnectionError"),
    ]
    dead = [e for e in about_messages if e["event"] == "message_dead_lettered"]
    assert [(e["message_id"], e["reason"], e["level"]) for e in dead] == [("bad-1", "permanent", "warning")]


def test_handler_events_carry_the_trace_and_the_causation(database, observed_worker):
    """An outbox row written by a handler has the inbox message's trace id with a new span id, its
    correlation id, and the message's id as causation id."""
    port, _ = observed_worker
    _scenario(database.url)
    eventually(
        lambda: value(scrape(port), "postbox_messages_processed_total", type="ok") == 5, what="processed"
    )
    with psycopg.connect(database.url) as conn:
        rows = conn.execute(
            "SELECT headers, correlation_id, causation_id FROM postbox.outbox WHERE destination = 'out' ORDER BY causation_id"
        ).fetchall()
    assert [r[2] for r in rows] == [f"ok-{i}" for i in range(5)]
    for headers, correlation, _causation in rows:
        assert correlation == "checkout-7"
        assert trace_id(headers) == TRACE
        assert headers["traceparent"] != TRACEPARENT and headers["traceparent"].endswith("-01")


def test_trace_context_helpers():
    """A child traceparent keeps the trace id and flags and gets a fresh span id; invalid ones are ignored."""
    child = child_traceparent(TRACEPARENT)
    assert child is not None and child.startswith(f"00-{TRACE}-") and child.endswith("-01")
    assert child.split("-")[2] != "b7ad6b7169203331"
    assert child_traceparent("garbage") is None
    assert child_traceparent(f"00-{'0' * 32}-b7ad6b7169203331-01") is None
    assert trace_id({"traceparent": "nope"}) is None


class _Down:
    """A destination that refuses every publish."""

    def publish(self, rows):
        return [ConnectionError("destination down") for _ in rows]

    def close(self) -> None:
        pass


def test_relay_metrics_count_published_failed_and_dead_lettered(database):
    """A relay counts confirmed rows per destination, failed publishes by error type, and rows it
    dead-letters, with the publish duration histogram per destination."""
    from postbox.failures.policy import Backoff, RetryPolicy
    from postbox.operations.metrics import REGISTRY
    from postbox.outbox.relay import Relay, RelaySettings
    from postbox.outbox.transports.postgres import PostgresTransport

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = {
        "published": sample("postbox_relay_published_total", destination="next"),
        "failed": sample(
            "postbox_relay_failed_total", destination="down", kind="transient", error_type="ConnectionError"
        ),
        "dead": sample("postbox_relay_dead_lettered_total", destination="down", reason="attempts_exhausted"),
        "calls": sample("postbox_relay_publish_duration_seconds_count", destination="next"),
    }
    url = database.url
    with psycopg.connect(url) as c:
        postbox.publish_many(c, [{"destination": "next", "key": f"k{i}", "payload": i} for i in range(4)])
        postbox.publish_many(c, [{"destination": "down", "key": "d", "payload": 1}])
        c.commit()
    relay = Relay(
        url,
        {"next": PostgresTransport(url, "next"), "down": _Down()},
        RelaySettings(poll_interval=0.05, heartbeat_interval=0.3, stale_after=1.5, grace_period=5.0),
        policies={"down": RetryPolicy(strategy=Backoff.FIXED, base_delay=0.05, max_attempts=2)},
    )
    relay.start()
    try:
        eventually(
            lambda: (
                sample("postbox_relay_dead_lettered_total", destination="down", reason="attempts_exhausted")
                > before["dead"]
            )
        )
        eventually(
            lambda: sample("postbox_relay_published_total", destination="next") - before["published"] == 4
        )
    finally:
        relay.stop()
        relay.join()
    assert (
        sample(
            "postbox_relay_failed_total", destination="down", kind="transient", error_type="ConnectionError"
        )
        - before["failed"]
        == 2
    )
    assert (
        sample("postbox_relay_dead_lettered_total", destination="down", reason="attempts_exhausted")
        - before["dead"]
        == 1
    )
    assert sample("postbox_relay_publish_duration_seconds_count", destination="next") > before["calls"]


class _Tty:
    """A text stream that says it is a terminal."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_log_format_auto_is_text_on_a_terminal_and_json_otherwise():
    """--log-format auto writes readable text to a terminal and one JSON object per line elsewhere;
    extra fields appear in both, fields that are None are left out of JSON."""
    import io
    import logging

    from postbox.operations.logs import configure_logging

    log = logging.getLogger("postbox.test")
    tty = _Tty()
    configure_logging("auto", "info", tty)  # type: ignore[arg-type]
    log.info("hello %s", "there", extra={"event": "greeting", "consumer": "c", "key": None})
    text = "".join(tty.lines)
    assert (
        "INFO" in text
        and "hello there" in text
        and "consumer=c" in text
        and not text.lstrip().startswith("{")
    )

    pipe = io.StringIO()
    configure_logging("auto", "info", pipe)
    log.info("hello", extra={"event": "greeting", "consumer": "c", "key": None})
    log.debug("hidden")
    entries = [json.loads(line) for line in pipe.getvalue().splitlines()]
    assert len(entries) == 1
    assert entries[0]["event"] == "greeting" and entries[0]["consumer"] == "c" and "key" not in entries[0]
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_postbox", False)]:
        root.removeHandler(handler)  # leave logging as the other tests expect it
    logging.getLogger("postbox").setLevel(logging.NOTSET)


def test_metrics_server_answers_health_and_readiness():
    """/healthz is 200 while the process runs; /readyz follows the readiness check (503 when not
    ready, also when the check raises); other paths are 404."""
    from postbox.operations.metrics import MetricsServer

    state = {"ready": False}

    def ready() -> bool:
        if state["ready"] is None:
            raise RuntimeError("broken check")
        return bool(state["ready"])

    server = MetricsServer(0, host="127.0.0.1", ready=ready).start()
    try:
        assert status_of(server.port, "/healthz") == 200
        assert status_of(server.port, "/readyz") == 503
        state["ready"] = True
        assert status_of(server.port, "/readyz") == 200
        state["ready"] = None  # type: ignore[assignment]
        assert status_of(server.port, "/readyz") == 503
        assert status_of(server.port, "/nope") == 404
        assert status_of(server.port, "/metrics") == 200
    finally:
        server.stop()


def test_log_lines_never_show_secrets_in_either_format():
    """The message, extra fields and the exception text of a log line are masked in JSON and in
    text: a URL's password, a secret query parameter, a connection string's password."""
    import io
    import logging
    import uuid

    from postbox.operations.logs import configure_logging

    marks = [f"logmark{uuid.uuid4().hex[:12]}" for _ in range(4)]
    log = logging.getLogger("postbox.test")
    try:
        for fmt in ("json", "text"):
            out = io.StringIO()
            configure_logging(fmt, "info", out)
            try:
                raise ConnectionError(f"cannot reach host=db password={marks[3]}")
            except ConnectionError:
                log.exception(
                    "cannot reach postgresql://app:%s@db/app",
                    marks[0],
                    extra={"event": "x", "url": f"https://hooks.example/h?token={marks[1]}",
                           "destinations": [f"amqp://u:{marks[2]}@rabbit/"]},
                )  # fmt: skip
            text = out.getvalue()
            assert "postgresql://app:***@db/app" in text and "token=***" in text
            assert not [m for m in marks if m in text], text
    finally:
        root = logging.getLogger()
        for handler in [h for h in root.handlers if getattr(h, "_postbox", False)]:
            root.removeHandler(handler)
        logging.getLogger("postbox").setLevel(logging.NOTSET)


def _listening_addresses(port: int) -> set[str]:
    """The local addresses TCP sockets listen on at ``port`` (from /proc/net/tcp and tcp6)."""
    from pathlib import Path

    found = set()
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            host_hex, port_hex = fields[1].split(":")
            if fields[3] != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(host_hex)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # host byte order words
            found.add(socket.inet_ntop(family, raw))
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp")
@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ((), {}, {"127.0.0.1"}),
        (("--metrics-host", "0.0.0.0"), {}, {"0.0.0.0"}),
        ((), {"POSTBOX_METRICS_HOST": "0.0.0.0"}, {"0.0.0.0"}),
    ],
    ids=["default", "flag", "environment"],
)
def test_the_metrics_endpoint_listens_on_localhost_unless_told_otherwise(database, args, env, expected):
    """A real `postbox maintain` serving metrics listens on 127.0.0.1 only by default; the
    --metrics-host flag or POSTBOX_METRICS_HOST widen it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "postbox", "--database-url", database.url, "--metrics-port", str(port),
         *args, "maintain", "--period", "60"],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "POSTBOX_DB_METRICS_INTERVAL_SECONDS": "0", **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        eventually(lambda: proc.poll() is None and status_of(port, "/healthz") == 200, what="metrics served")
        assert _listening_addresses(port) == expected
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

"""HTTP endpoints as handlers, against a real local HTTP server started by the test."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
import pytest

import postbox
from postbox.clock import FakeClock
from postbox.config.policies import configured_handlers, load_policies
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from postbox.outbox.transports.http import OutboundPolicy, retry_after_seconds
from tests.helpers import FAST_WORKER, eventually, scalar

SECRET = "s3cret-for-tests"


class Endpoint:
    """A scripted HTTP server: each message's payload says how to answer, attempt by attempt."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.work_done: list[str] = []
        self.lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                doc = json.loads(body)
                with endpoint.lock:
                    endpoint.requests.append({"headers": dict(self.headers), "body": doc, "raw": body})
                    seen = sum(1 for r in endpoint.requests if r["body"]["message_id"] == doc["message_id"])
                script = doc["payload"].get("script", ["200"])
                action = script[min(seen, len(script)) - 1]
                if action == "lost":  # do the work, then drop the connection without answering
                    with endpoint.lock:
                        endpoint.work_done.append(doc["message_id"])
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action.startswith("sleep"):
                    threading.Event().wait(float(action[5:]))
                    action = "200"
                status, _, retry_after = action.partition("/")
                if status == "200":
                    with endpoint.lock:
                        endpoint.work_done.append(doc["message_id"])
                self.send_response(int(status))
                if retry_after:
                    self.send_header("Retry-After", retry_after)
                if status.startswith("3"):  # a redirect back here: seen as a second request if followed
                    self.send_header("Location", f"{endpoint.url}?redirected=1")
                reply = b'{"ok": true}'
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def attempts(self, message_id: str) -> list[dict]:
        with self.lock:
            return [r for r in self.requests if r["body"]["message_id"] == message_id]


@pytest.fixture
def endpoint():
    e = Endpoint()
    yield e
    e.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    db, url: str, *, idempotent: bool, monkeypatch, clock=None, timeout: float = 2.0, postbox=None
) -> Worker:
    monkeypatch.setenv("HOOK_SECRET", SECRET)
    config = load_policies(
        {
            "postbox": postbox or {},
            "consumers": {
                "hooks": {
                    "retry": {"strategy": "fixed", "base_delay": 0.05, "max_attempts": 5},
                    "handlers": {
                        "*": {
                            "kind": "http",
                            "url": url,
                            "timeout": timeout,
                            "idempotent": idempotent,
                            "hmac_secret_env": "HOOK_SECRET",
                            "headers": {"X-Team": "billing"},
                        }
                    },
                }
            },
        }
    )
    registry = configured_handlers(Registry(), config, "hooks")
    w = Worker(
        db.url,
        registry,
        WorkerSettings(consumer="hooks", retry=config.consumers["hooks"].retry_policy(), **FAST_WORKER),
        clock=clock,
    )
    w.start()
    return w


def send(db, message_id: str, script: list[str], **extra) -> None:
    with psycopg.connect(db.url) as c:
        postbox.receive(c, consumer="hooks", message_id=message_id, payload={"script": script}, **extra)
        c.commit()


def settled(db) -> bool:
    return bool(scalar(db.url, "SELECT count(*) = 0 FROM postbox.inbox WHERE state <> 'blocked'"))


@pytest.mark.parametrize(
    ("script", "attempts", "dead"),
    [
        (["200"], 1, None),
        (["503", "502", "200"], 3, None),
        (["504", "200"], 2, None),
        (["500", "200"], 2, None),
        (["400"], 1, "permanent"),
        (["404"], 1, "permanent"),
        (["409"], 1, "permanent"),
        (["422"], 1, "permanent"),
    ],
    ids=lambda v: "-".join(v) if isinstance(v, list) else str(v),
)
def test_status_classes(database, endpoint, monkeypatch, script, attempts, dead):
    """2xx succeeds; 5xx retried; 4xx dead-lettered at once; the server sees one request per attempt."""
    w = run(database, endpoint.url, idempotent=False, monkeypatch=monkeypatch)
    try:
        send(database, "m", script)
        eventually(lambda: settled(database))
    finally:
        w.stop()
        w.join()
    assert len(endpoint.attempts("m")) == attempts
    assert scalar(database.url, "SELECT reason FROM postbox.dead_letters") == dead


def test_429_retry_after_is_honoured(database, endpoint, monkeypatch):
    """429 with Retry-After: 120 schedules the next attempt 120 s later (injected clock)."""
    clock = FakeClock()
    w = run(database, endpoint.url, idempotent=False, monkeypatch=monkeypatch, clock=clock)
    try:
        send(database, "m", ["429/120", "200"])
        eventually(lambda: scalar(database.url, "SELECT attempt = 1 AND state = 'ready' FROM postbox.inbox"))
        delay = scalar(
            database.url, "SELECT extract(epoch FROM next_retry_at - last_failed_at) FROM postbox.inbox"
        )
        assert float(delay) == pytest.approx(120, abs=1)
        clock.advance(121)
        eventually(lambda: settled(database))
    finally:
        w.stop()
        w.join()
    assert len(endpoint.attempts("m")) == 2


def test_timeout_is_transient(database, endpoint, monkeypatch):
    """A request that outlives the endpoint's timeout is retried."""
    w = run(database, endpoint.url, idempotent=False, monkeypatch=monkeypatch, timeout=0.3)
    try:
        send(database, "m", ["sleep1.0", "200"])
        eventually(lambda: settled(database))
    finally:
        w.stop()
        w.join()
    assert scalar(database.url, "SELECT error FROM postbox.attempts").startswith("HTTP request timed out")
    assert len(endpoint.attempts("m")) == 2


def test_connection_refused_is_transient(database, monkeypatch):
    """Nothing listening: a transient failure, retried until the limit."""
    w = run(database, f"http://127.0.0.1:{free_port()}/hook", idempotent=False, monkeypatch=monkeypatch)
    try:
        send(database, "m", ["200"])
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM postbox.dead_letters") == 1)
    finally:
        w.stop()
        w.join()
    assert (
        scalar(database.url, "SELECT row(reason, attempt)::text FROM postbox.dead_letters")
        == "(attempts_exhausted,5)"
    )
    assert "connection failed" in scalar(database.url, "SELECT last_error FROM postbox.dead_letters")


@pytest.mark.parametrize("idempotent", [False, True])
def test_lost_response_is_an_unknown_outcome(database, endpoint, monkeypatch, idempotent):
    """The server did the work but the response was lost: retried (same Idempotency-Key) only for
    an idempotent endpoint; otherwise dead-lettered with reason unknown_outcome."""
    w = run(database, endpoint.url, idempotent=idempotent, monkeypatch=monkeypatch)
    try:
        send(database, "m", ["lost", "200"])
        eventually(lambda: settled(database))
    finally:
        w.stop()
        w.join()
    seen = endpoint.attempts("m")
    if idempotent:
        assert len(seen) == 2 and scalar(database.url, "SELECT count(*) FROM postbox.dead_letters") == 0
        assert seen[0]["headers"]["Idempotency-Key"] == seen[1]["headers"]["Idempotency-Key"]
    else:
        assert len(seen) == 1
        assert (
            scalar(database.url, "SELECT row(reason, attempt)::text FROM postbox.dead_letters")
            == "(unknown_outcome,1)"
        )


def test_headers_signature_and_stable_idempotency_key(database, endpoint, monkeypatch):
    """Every attempt carries the same Idempotency-Key, the correlation and trace headers, the
    configured headers, and a valid HMAC signature of timestamp and body."""
    w = run(database, endpoint.url, idempotent=False, monkeypatch=monkeypatch)
    try:
        send(
            database,
            "m",
            ["503", "503", "200"],
            correlation_id="corr-1",
            headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        )
        eventually(lambda: settled(database))
    finally:
        w.stop()
        w.join()
    seen = endpoint.attempts("m")
    assert len(seen) == 3
    assert len({r["headers"]["Idempotency-Key"] for r in seen}) == 1
    assert [r["headers"]["X-Postbox-Attempt"] for r in seen] == ["1", "2", "3"]
    for r in seen:
        h = r["headers"]
        assert h["X-Correlation-Id"] == "corr-1" and h["traceparent"].startswith("00-0af7")
        assert h["X-Team"] == "billing" and h["X-Postbox-Message-Id"] == "m"
        expected = (
            "sha256="
            + hmac.new(
                SECRET.encode(), h["X-Postbox-Timestamp"].encode() + b"." + r["raw"], hashlib.sha256
            ).hexdigest()
        )
        assert hmac.compare_digest(h["X-Postbox-Signature"], expected)
        assert r["body"]["payload"] == {"script": ["503", "503", "200"]} and r["body"]["key"] == "m"


def test_retry_after_forms():
    from datetime import UTC, datetime

    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert retry_after_seconds("7") == 7
    assert retry_after_seconds("Thu, 01 Jan 2026 00:00:30 GMT", now) == 30
    assert retry_after_seconds("soon") is None and retry_after_seconds(None) is None


def test_missing_secret_variable_is_a_config_error(monkeypatch):
    from postbox.errors import ConfigError

    monkeypatch.delenv("NOPE_SECRET", raising=False)
    config = load_policies(
        {
            "consumers": {
                "hooks": {
                    "handlers": {
                        "*": {"kind": "http", "url": "http://127.0.0.1:1/", "hmac_secret_env": "NOPE_SECRET"}
                    }
                }
            }
        }
    )
    with pytest.raises(ConfigError, match="NOPE_SECRET is not set"):
        configured_handlers(Registry(), config, "hooks")


# --- redirects and the outbound policy ------------------------------------------------------------


def dead_letter(db) -> tuple[str, str]:
    row = scalar(db.url, "SELECT row(reason, last_error)::text FROM postbox.dead_letters")
    assert isinstance(row, str), row
    reason, _, error = row.strip("()").partition(",")
    return reason, error


@pytest.mark.parametrize("status", ["307", "308"])
def test_redirects_are_never_followed(database, endpoint, monkeypatch, status):
    """A 3xx answer whose Location points back at the endpoint (307 and 308 would repeat the POST
    there) is a permanent failure: the Location is never requested."""
    w = run(database, endpoint.url, idempotent=True, monkeypatch=monkeypatch)
    try:
        send(database, "m", [status, "200"])
        eventually(lambda: settled(database))
    finally:
        w.stop()
        w.join()
    assert len(endpoint.attempts("m")) == 1
    reason, error = dead_letter(database)
    assert reason == "permanent" and f"HTTP {status}" in error


@pytest.mark.parametrize("where", ["file", "environment"])
def test_a_host_outside_the_allow_list_is_refused_permanently_and_never_called(
    database, endpoint, monkeypatch, where
):
    """With http_allowed_hosts set (in the file, or POSTBOX_HTTP_ALLOWED_HOSTS) and the endpoint's
    host not in it, the message is dead-lettered at its first attempt with an error naming the
    host and the setting; the endpoint receives nothing."""
    allowed = ["hooks.example.com", "*.partner.example", "10.0.0.0/8"]
    if where == "environment":
        monkeypatch.setenv("POSTBOX_HTTP_ALLOWED_HOSTS", ",".join(allowed))
    postbox = {"http_allowed_hosts": allowed} if where == "file" else None
    w = run(database, endpoint.url, idempotent=True, monkeypatch=monkeypatch, postbox=postbox)
    try:
        send(database, "m", ["200"])
        eventually(lambda: settled(database))
    finally:
        w.stop()
        w.join()
    assert endpoint.attempts("m") == []
    reason, error = dead_letter(database)
    assert reason == "permanent"
    assert "127.0.0.1" in error and "http_allowed_hosts" in error


def test_a_host_in_the_allow_list_is_called(database, endpoint, monkeypatch):
    w = run(
        database,
        endpoint.url,
        idempotent=True,
        monkeypatch=monkeypatch,
        postbox={"http_allowed_hosts": ["hooks.example.com", "127.0.0.0/8"]},
    )
    try:
        send(database, "m", ["200"])
        eventually(lambda: settled(database))
    finally:
        w.stop()
        w.join()
    assert len(endpoint.attempts("m")) == 1
    assert scalar(database.url, "SELECT count(*) FROM postbox.dead_letters") == 0


def test_private_addresses_are_refused_also_behind_a_name(database, endpoint, monkeypatch):
    """With http_deny_private_networks, a URL naming ``localhost`` is refused when the name
    resolves to a loopback address: a permanent failure naming the host, its address and the
    setting; the endpoint receives nothing."""
    url = endpoint.url.replace("127.0.0.1", "localhost")
    w = run(
        database, url, idempotent=True, monkeypatch=monkeypatch, postbox={"http_deny_private_networks": True}
    )
    try:
        send(database, "m", ["200"])
        eventually(lambda: settled(database))
    finally:
        w.stop()
        w.join()
    assert endpoint.attempts("m") == []
    reason, error = dead_letter(database)
    assert reason == "permanent"
    assert "localhost" in error and "http_deny_private_networks" in error


def test_local_addresses_are_called_when_private_networks_are_not_denied(database, endpoint, monkeypatch):
    """The same local endpoint behind ``localhost`` is called with http_deny_private_networks
    off (the default)."""
    url = endpoint.url.replace("127.0.0.1", "localhost")
    w = run(
        database, url, idempotent=True, monkeypatch=monkeypatch, postbox={"http_deny_private_networks": False}
    )
    try:
        send(database, "m", ["200"])
        eventually(lambda: settled(database))
    finally:
        w.stop()
        w.join()
    assert len(endpoint.attempts("m")) == 1


def test_allow_list_entries_match_names_wildcards_addresses_and_networks():
    policy = OutboundPolicy(("Hooks.Example.com", "*.partner.example", "10.0.0.0/8", "::1"))
    for host in ("hooks.example.com", "HOOKS.example.com.", "a.partner.example", "b.a.partner.example",
                 "10.2.3.4", "::1", "[::1]"):  # fmt: skip
        assert policy.host_refusal(host) is None, host
    for host in (
        "example.com",
        "partner.example",
        "evilpartner.example",
        "11.0.0.1",
        "hooks.example.com.evil",
    ):
        refusal = policy.host_refusal(host)
        assert refusal is not None and host.rstrip(".") in refusal and "http_allowed_hosts" in refusal
    assert OutboundPolicy().host_refusal("anything.example") is None  # off by default


def test_private_network_check_refuses_every_non_public_address():
    policy = OutboundPolicy(deny_private_networks=True)
    for address in ("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
                    "0.0.0.0", "::1", "fd00::1", "fe80::1", "::ffff:127.0.0.1", "224.0.0.1"):  # fmt: skip
        assert policy.host_refusal(address) is not None, address
    assert policy.host_refusal("93.184.216.34") is None
    assert policy.host_refusal("hooks.example.com") is None  # names are checked when connecting


@pytest.mark.parametrize("entry", ["https://hooks.example.com", "hooks.example.com:443", "10.0.0.0/33", "*"])
def test_a_malformed_allow_list_entry_is_a_config_error_naming_it(entry):
    from postbox.errors import ConfigError

    with pytest.raises(ConfigError, match="http_allowed_hosts"):
        load_policies({"postbox": {"http_allowed_hosts": [entry]}})

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

import service
from service.clock import FakeClock
from service.config import configured_handlers, load_policies
from service.handlers import Registry
from service.http_handlers import retry_after_seconds
from service.worker import Worker, WorkerSettings
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


def run(db, url: str, *, idempotent: bool, monkeypatch, clock=None, timeout: float = 2.0) -> Worker:
    monkeypatch.setenv("HOOK_SECRET", SECRET)
    config = load_policies(
        {
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
            }
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
        service.receive(c, consumer="hooks", message_id=message_id, payload={"script": script}, **extra)
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
    from service.errors import ConfigError

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

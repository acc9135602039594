"""The metrics endpoint of every long-running process (worker, relay, bridge, maintain), each started
as a real ``postbox`` subprocess with ``--metrics-port``: prometheus_client's WSGI application
(text format that parses, HEAD, gzip and OpenMetrics when asked) beside ``/healthz`` and
``/readyz``, which says 503 and why while the database does not exist yet, then 200 once the
process runs on it."""

from __future__ import annotations

import contextlib
import gzip
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import REPO, eventually
from tests.test_observability import free_port

CONFIG = """
[consumers.obs]
on_dead_letter = "block"

[destinations.out]
kind = "postgres"
consumer = "obs"
"""

STREAM = f"postbox-metrics-endpoint-{uuid.uuid4().hex[:8]}"

COMMANDS = {
    "worker": ["worker", "--consumer", "obs", "--app", "tests.apps.observed:registry",
               "--poll-interval", "0.05", "--heartbeat-interval", "0.3"],
    "relay": ["relay", "--destination", "out", "--poll-interval", "0.05", "--heartbeat-interval", "0.3"],
    "bridge": ["bridge", "--from", "redis://127.0.0.1:6379/0", "--name", STREAM, "--consumer", "obs"],
    "maintain": ["maintain", "--period", "60"],
}  # fmt: skip


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def request(port: int, path: str, method: str = "GET", **headers: str) -> Reply:
    """One HTTP request to the endpoint (status 0: nothing listens yet)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        method=method,
        headers={k.replace("_", "-"): v for k, v in headers.items()},
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return Reply(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
    except urllib.error.HTTPError as error:
        return Reply(error.code, {k.lower(): v for k, v in error.headers.items()}, error.read())
    except OSError:
        return Reply(0, {}, b"")


@pytest.fixture
def later_database(pg_server, template_db) -> Iterator[tuple[str, object]]:
    """The URL of a database that does not exist yet, and its janitor (``init()`` creates it as a
    clone of the migrated template); dropped at the end."""
    from tests.conftest import _conninfo_url

    name = f"postbox_m_{uuid.uuid4().hex[:12]}"
    janitor = pg_server.janitor(name, template=template_db)
    yield _conninfo_url(dict(pg_server.params, dbname=name)), janitor
    with contextlib.suppress(Exception):  # never created if the test failed before
        janitor.drop()


@pytest.fixture(scope="module", autouse=True)
def _redis_stream() -> Iterator[None]:
    yield
    import redis

    redis.Redis.from_url("redis://127.0.0.1:6379/0").delete(STREAM)


def _spawn(kind: str, url: str, port: int, config: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "postbox", "--config", str(config), "--database-url", url,
         "--metrics-port", str(port), *COMMANDS[kind]],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "POSTBOX_LOG_LEVEL": "error",
             "POSTBOX_DB_METRICS_INTERVAL_SECONDS": "0.2"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip


@pytest.mark.parametrize("kind", sorted(COMMANDS))
def test_every_process_serves_metrics_health_and_readiness(kind, later_database, tmp_path):
    """``postbox --metrics-port P <kind>`` pointed at a database that does not exist yet: /healthz
    200 and /readyz 503 "not ready: waiting for the database" at once; the database created, /readyz
    200. Then /metrics: the text format parses (database gauges included, read once ready), HEAD
    is 200 with the length and no body, gzip when asked, OpenMetrics when asked; other paths 404.
    SIGTERM: exit 0."""
    url, janitor = later_database
    config = tmp_path / "postbox.toml"
    config.write_text(CONFIG)
    port = free_port()
    proc = _spawn(kind, url, port, config)
    try:

        def answering() -> Reply | None:
            assert proc.poll() is None, proc.communicate()[1].decode()
            reply = request(port, "/readyz")
            return reply if reply.status else None

        waiting = eventually(answering, timeout=30, what=f"{kind} serves /readyz")
        assert (waiting.status, waiting.body) == (503, b"not ready: waiting for the database\n")
        assert request(port, "/healthz").status == 200
        janitor.init()  # type: ignore[attr-defined]

        ready = eventually(
            lambda: answering() if request(port, "/readyz").status == 200 else None,
            timeout=30,
            what=f"{kind} ready on its database",
        )
        assert ready.body == b"ready\n" and ready.headers["content-type"].startswith("text/plain")
        _check_metrics(port)
        assert request(port, "/nope").status == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=40)
    assert proc.returncode == 0, stderr.decode()


def _check_metrics(port: int) -> None:
    def refreshed() -> dict[str, object] | None:
        reply = request(port, "/metrics")
        assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(reply.body.decode())}
        stamp = families.get("postbox_db_metrics_refreshed_timestamp_seconds")
        return families if stamp is not None and stamp.samples else None

    families = eventually(refreshed, timeout=30, what="the database gauges read once ready")
    assert "postbox_build_info" in families and "postbox_dead_letters_open" in families

    head = request(port, "/metrics", method="HEAD")
    assert head.status == 200 and head.body == b""
    assert head.headers["content-type"].startswith("text/plain") and int(head.headers["content-length"]) > 0

    zipped = request(port, "/metrics", Accept_Encoding="gzip")
    assert zipped.status == 200 and zipped.headers.get("content-encoding") == "gzip"
    assert {f.name for f in text_string_to_metric_families(gzip.decompress(zipped.body).decode())} >= {
        "postbox_build_info",
        "postbox_dead_letters_open",
    }

    om = request(port, "/metrics", Accept="application/openmetrics-text; version=1.0.0")
    assert om.status == 200 and om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.body.endswith(b"# EOF\n")
    assert "postbox_dead_letters_open" in {f.name for f in openmetrics_families(om.body.decode())}


def test_readiness_says_why_not_and_a_broken_check_is_not_ready():
    """/readyz answers 503 with the check's ``reason()``, or with what broke when the check raises;
    HEAD works on every path; a method other than GET/HEAD is refused."""
    from postbox.operations.metrics import MetricsServer

    class Check:
        state: bool | None = False

        def __call__(self) -> bool:
            if self.state is None:
                raise RuntimeError("broken check")
            return self.state

        def reason(self) -> str:
            return "stopping"

    check = Check()
    server = MetricsServer(0, ready=check).start()
    try:
        assert (request(server.port, "/readyz").status, request(server.port, "/readyz").body) == (
            503,
            b"not ready: stopping\n",
        )
        check.state = None
        assert (
            request(server.port, "/readyz").body
            == b"not ready: readiness check failed: RuntimeError: broken check\n"
        )
        check.state = True
        head = request(server.port, "/readyz", method="HEAD")
        assert (head.status, head.body, head.headers["content-length"]) == (200, b"", "6")
        assert request(server.port, "/healthz", method="POST").status == 405
        assert request(server.port, "/metrics", method="POST").status == 405
    finally:
        server.stop()

"""A second SIGTERM or SIGINT exits at once, whatever the process is waiting for: here a relay whose
batch in flight waits on a webhook that never answers, with a grace period of a minute. The row it
held is not lost: it is still in the outbox, published again once its lease runs out. SIGINT (Ctrl-C
in a terminal) is taken exactly as SIGTERM is, never as a KeyboardInterrupt's traceback."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import postbox
from tests.helpers import eventually, scalar, spawn_postbox


@pytest.fixture
def silent_webhook() -> Iterator[tuple[int, threading.Event]]:
    """A TCP port that accepts connections and never answers; the event is set on the first."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    accepted = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            accepted.set()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        server.close()
        for conn in held:
            conn.close()


def slow_destination(url: str, tmp_path: Path, port: int) -> Path:
    """A configuration whose destination ``slow`` is the silent webhook, and a row for it (``held``)."""
    config = tmp_path / "postbox.toml"
    config.write_text(
        f'[destinations.slow]\nkind = "http"\nurl = "http://127.0.0.1:{port}/hook"\ntimeout = 600\n'
    )
    with psycopg.connect(url) as c:
        postbox.publish(c, destination="slow", payload={"n": 1}, message_id="held")
        c.commit()
    return config


STOP_SIGNALS = pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])


@STOP_SIGNALS
def test_a_second_signal_exits_a_relay_at_once_and_its_row_stays_in_the_outbox(
    database, tmp_path, monkeypatch, silent_webhook, sig
):
    port, accepted = silent_webhook
    config = slow_destination(database.url, tmp_path, port)
    monkeypatch.setenv("POSTBOX_LOG_LEVEL", "info")  # the stopping lines are at level info
    log = tmp_path / "relay.log"
    with open(log, "wb") as out:
        p = spawn_postbox(
            "--config", str(config), "--database-url", database.url, "relay", "--destination", "slow",
            "--grace-period", "60", stderr=out.fileno(),
        )  # fmt: skip
    try:
        assert accepted.wait(30), log.read_text()
        p.send_signal(sig)
        eventually(lambda: "relay stopping" in log.read_text(), what="the first signal taken")
        started = time.monotonic()
        p.send_signal(sig)
        assert p.wait(10) == 0
        assert time.monotonic() - started < 3.0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = log.read_text()
    assert "exited before its work in flight finished" in text and "Traceback" not in text
    assert scalar(database.url, "SELECT count(*) FROM postbox.outbox WHERE message_id = 'held'") == 1


@STOP_SIGNALS
def test_one_signal_still_lets_the_batch_in_flight_finish_within_the_grace_period(
    database, tmp_path, monkeypatch, silent_webhook, sig
):
    """The first signal alone: the relay waits for its batch up to --grace-period, then exits 0."""
    port, accepted = silent_webhook
    config = slow_destination(database.url, tmp_path, port)
    log = tmp_path / "relay.log"
    with open(log, "wb") as out:
        p: subprocess.Popen[bytes] = spawn_postbox(
            "--config", str(config), "--database-url", database.url, "relay", "--destination", "slow",
            "--grace-period", "1", stderr=out.fileno(),
        )  # fmt: skip
    try:
        assert accepted.wait(30)
        started = time.monotonic()
        p.send_signal(sig)
        assert p.wait(15) == 0
        assert 0.9 <= time.monotonic() - started < 1.0 + 5.0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "Traceback" not in log.read_text()
    assert scalar(database.url, "SELECT count(*) FROM postbox.outbox WHERE message_id = 'held'") == 1

"""A relay whose database connection dies between publishing a batch and recording it gives the
batch back as soon as it has reconnected, instead of leaving its keys waiting for the lease."""

from __future__ import annotations

import time
from collections.abc import Sequence

import psycopg

import postbox
from postbox.failures.policy import Backoff, RetryPolicy
from postbox.outbox.relay import Relay, RelaySettings
from postbox.outbox.transports import OutboxRow
from postbox.outbox.transports.postgres import PostgresTransport
from tests.helpers import eventually, scalar

QUICK = RetryPolicy(strategy=Backoff.FIXED, base_delay=0.05, max_attempts=1000, max_total_seconds=None)


class CutAfterFirstPublish:
    """Delivers like the PostgreSQL transport; the first time, it then terminates the relay's own
    database connection, so recording the batch fails."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.inner = PostgresTransport(url, "next")
        self.calls = 0

    def publish(self, rows: Sequence[OutboxRow]) -> list[BaseException | None]:
        self.calls += 1
        results = self.inner.publish(rows)
        if self.calls == 1:
            with psycopg.connect(self.url, autocommit=True) as c:
                c.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = 'postbox-relay:next' AND datname = current_database()"
                )
        return results

    def close(self) -> None:
        self.inner.close()


def test_relay_gives_its_batch_back_after_losing_its_connection(database):
    """The relay's connection is terminated after a publish: it reconnects, releases the batch
    (fenced by attempt) and publishes it again at once, far within the 60 s lease, so the key goes
    on; the receiver sees the row twice at most (at-least-once, same message_id)."""
    url = database.url
    with psycopg.connect(url) as c:
        postbox.publish_many(
            c, [{"destination": "next", "message_id": f"e{i}", "key": "k", "payload": {}} for i in range(3)]
        )
        c.commit()
    transport = CutAfterFirstPublish(url)
    relay = Relay(
        url,
        {"next": transport},
        RelaySettings(poll_interval=0.05, heartbeat_interval=0.3, stale_after=30, lease=60, retry=QUICK),
    )
    started = time.monotonic()
    relay.start()
    try:
        eventually(lambda: scalar(url, "SELECT count(*) = 0 FROM postbox.outbox"), timeout=20)
    finally:
        relay.stop()
        relay.join()
    assert time.monotonic() - started < 20 < 60
    assert transport.calls >= 2
    got = [r for (r,) in psycopg.connect(url).execute(
        "SELECT message_id FROM postbox.inbox WHERE consumer = 'next' ORDER BY id").fetchall()]  # fmt: skip
    assert got == ["e0", "e1", "e2"]  # the republished head is deduplicated by message_id

"""The PostgreSQL transport: deliver outbox rows into a Postbox inbox, in this database or another.

Service to service without a broker: the receiving side's deduplication (by ``message_id``) absorbs
a row published twice. A row whose ``message_id`` is already in the target inbox with another
payload is a permanent failure (a conflict, never silently dropped). A consumer the receiving
database has not declared (once it declares any) is a transient one: its worker may not have
started yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from postbox.config.settings import register_url_secrets
from postbox.errors import InvalidMessage
from postbox.failures.outcomes import Permanent, Transient
from postbox.inbox.receive import receive_many
from postbox.messages import InboxMessage, ReceiveResult
from postbox.outbox.transports import OutboxRow

__all__ = ["PostgresTransport"]

EXTRA = None  # psycopg is a dependency of Postbox itself
NAME = "PostgreSQL"


class PostgresTransport:
    """Receives each row into the inbox of ``consumer`` at ``url`` (one transaction per batch)."""

    def __init__(self, url: str, consumer: str, source: str | None = None) -> None:
        register_url_secrets(url)  # masked in every output of this process
        self.url = url
        self.consumer = consumer
        self.source = source
        self._conn: psycopg.Connection[Any] | None = None

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = psycopg.connect(
                self.url, application_name="postbox-relay:postgres", connect_timeout=5
            )
        return self._conn

    def _message(self, row: OutboxRow) -> InboxMessage:
        return InboxMessage(
            consumer=self.consumer,
            message_id=row.message_id,
            key=row.key,
            type=row.type,
            payload=row.payload,
            headers=row.headers,
            correlation_id=row.correlation_id,
            causation_id=row.causation_id,
            source=self.source or row.destination,
        )

    def _result(self, row: OutboxRow, result: ReceiveResult) -> BaseException | None:
        if result.is_conflict:
            return Permanent(
                f"message_id {row.message_id} is already in the inbox of {self.consumer} with another payload"
            )
        return None  # new, or a duplicate of what was delivered before: either way it is there

    def publish(self, rows: Sequence[OutboxRow]) -> list[BaseException | None]:
        try:
            conn = self._connection()
        except psycopg.OperationalError as error:
            return [error] * len(rows)
        try:
            results = receive_many(conn, [self._message(r) for r in rows])
            conn.commit()
            return [self._result(r, res) for r, res in zip(rows, results, strict=True)]
        except psycopg.OperationalError as error:
            self.close()
            return [error] * len(rows)
        except (InvalidMessage, psycopg.Error):
            # One bad row fails the batch's transaction: deliver one by one to find it.
            conn.rollback()
            return [self._publish_one(conn, r) for r in rows]

    def _publish_one(self, conn: psycopg.Connection[Any], row: OutboxRow) -> BaseException | None:
        try:
            (result,) = receive_many(conn, [self._message(row)])
            conn.commit()
            return self._result(row, result)
        except (InvalidMessage, psycopg.Error) as error:
            if not conn.closed:
                conn.rollback()
            if (
                isinstance(error, InvalidMessage)
                and error.field == "consumer"
                and "not a declared" in error.problem
            ):
                # Deployed before the receiving side declared its consumer: retried, as a broker
                # not up yet would be, until it is (or the row's retries run out).
                return Transient(
                    f"consumer {error.problem} in the receiving database: its worker declares it at start "
                    f"from a [consumers.{self.consumer}] table of its configuration file (or call "
                    "postbox.declare_consumer there); retried meanwhile"
                )
            return error

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


TRANSPORT = PostgresTransport

"""The bridge: consume from a broker into the inbox (insert, commit, then acknowledge).

Broker redelivery (a crash between commit and ack, a lost ack) is absorbed by the inbox's
deduplication, so the loop broker → inbox → handler → outbox → broker is effectively once at every
hop that has an id. Sources (in :mod:`postbox.outbox.transports`, with each broker's transport):
RabbitMQ (a queue), Redis Streams (a consumer group), NATS JetStream (a durable pull
consumer) and Kafka (a consumer group). A message needs an id: the AMQP ``message_id`` property or a
``postbox-message-id`` / ``Nats-Msg-Id`` header (or field); its key comes from ``postbox-key``
(default: the id), its type from ``postbox-type`` or the AMQP ``type``. A message without an id, or
whose content is refused (not JSON, over the database's size limits), is rejected (not requeued)
and logged: nothing is written for it, and the source may dead-letter it (Kafka's does).
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from collections.abc import Callable
from typing import Any, cast

import psycopg
from pydantic import ValidationError

from postbox.config.masking import mask_text
from postbox.errors import ConfigError, InvalidMessage
from postbox.inbox.receive import receive_many
from postbox.messages import InboxMessage, ReceiveResult
from postbox.operations import metrics
from postbox.outbox.transports import Incoming, Source, source_for

# source_for (postbox.outbox.transports) is re-exported for callers that take it from here.
__all__ = ["Bridge", "Incoming", "Source", "source_for"]

log = logging.getLogger("postbox.bridge")


class Bridge:
    """Moves messages from ``source`` into the inbox of ``consumer``: one transaction per batch,
    acknowledged only after it committed. ``source`` is a connected source, or what connects one
    (:func:`postbox.outbox.transports.source_maker`): the bridge then connects when it starts, and
    waits for a broker that is not reachable yet (a line a try, with backoff) until stopped."""

    def __init__(
        self,
        url: str,
        source: Source | Callable[[], Source],
        consumer: str,
        *,
        batch_size: int = 100,
        wait: float = 0.5,
        origin: str | None = None,
    ) -> None:
        self.url = url
        connected = hasattr(source, "fetch")
        self.source: Source | None = cast(Source, source) if connected else None
        self._connect_source = None if connected else cast(Callable[[], Source], source)
        self.consumer = consumer
        self.batch_size = batch_size
        self.wait = wait
        self.origin = origin
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.fatal: str | None = None
        self.received = self.duplicates = self.rejected = 0

    # --- lifecycle (the shape of postbox.operations.process.Service) ------------------------

    def start(self) -> None:
        """Bridge in a background thread until stopped (a failure of the source stops it, fatal)."""
        self._thread = threading.Thread(target=self._guarded_loop, name="postbox-bridge", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Bridge in the calling thread's stead until stopped; a failure of the source is raised."""
        self.start()
        self.join(None)
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._stopping.set()

    def abort(self) -> None:
        """Stop at once: a batch not yet committed is not acknowledged (the broker redelivers it)."""
        self.stop()

    def join(self, grace: float | None = None) -> None:
        """Wait for the batch in flight (None: until the loop ends)."""
        if self._thread is not None:
            self._thread.join(grace)

    def ready(self) -> bool:
        return not self.stopping and self.fatal is None

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _guarded_loop(self) -> None:
        try:
            self._loop()
        except Exception as error:
            self._error = error
            self.fatal = f"bridge stopped: {type(error).__name__}: {error}"
            log.error(self.fatal, extra={"event": "bridge_failed", "consumer": self.consumer})
            self._stopping.set()

    def _message(self, item: Incoming) -> InboxMessage:
        if not item.message_id:
            raise InvalidMessage(
                "message_id", "the broker message has no id (message_id / postbox-message-id)"
            )
        try:
            payload = json.loads(item.body) if item.body else None
        except ValueError:
            raise InvalidMessage("payload", "is not JSON") from None
        headers = {
            k: v
            for k, v in item.headers.items()
            if isinstance(k, str) and not k.startswith("postbox-") and isinstance(v, str | int | float | bool)
        }
        try:
            return InboxMessage(
                consumer=self.consumer,
                message_id=item.message_id,
                key=item.key,
                type=item.type,
                payload=payload,
                headers=headers,
                correlation_id=item.correlation_id,
                causation_id=item.causation_id,
                source=self.origin,
            )
        except ValidationError as error:
            raise InvalidMessage("message", str(error.errors()[0]["msg"])) from None

    def _wait_for_consumer(self) -> None:
        """Once any consumer is declared, receiving for an undeclared one is refused: rather than fail
        on the first message, wait (stoppably) until this bridge's consumer is declared by its worker.
        A database that is unreachable meanwhile (restarting, not up yet) is waited for too."""
        warned = False
        failures = 0
        while not self._stopping.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, application_name="postbox-bridge") as conn:
                    row = conn.execute(
                        "SELECT NOT EXISTS (SELECT 1 FROM postbox.consumers WHERE declared)"
                        " OR EXISTS (SELECT 1 FROM postbox.consumers WHERE name = %s AND declared)",
                        (self.consumer,),
                    ).fetchone()
            except psycopg.OperationalError as error:
                failures += 1
                self._unavailable(error, failures, "waiting for it before bridging")
                continue
            failures = 0
            if row and row[0]:
                return
            if not warned:
                log.warning(
                    "bridge: consumer %r is not declared yet; waiting (its worker declares it at start from a"
                    " [consumers.%s] table of its configuration file; or call postbox.declare_consumer)",
                    self.consumer,
                    self.consumer,
                )
                warned = True
            self._stopping.wait(1.0)

    def _open_source(self) -> Source | None:
        """The source, connected now if it is not yet, waiting (stoppably, with jittered backoff up
        to 10 s) while the broker is unreachable; None if the bridge was stopped meanwhile. A
        missing client (its extra) is fatal at once."""
        failures = 0
        while self.source is None and self._connect_source is not None:
            if self._stopping.is_set():
                return None
            try:
                self.source = self._connect_source()
            except ConfigError:
                raise
            except Exception as error:  # unreachable, refused, not ready yet: the next try may do
                if self._stopping.is_set():
                    return None
                failures += 1
                pause = min(10.0, 0.5 * 2 ** (failures - 1)) * random.uniform(0.75, 1.25)
                text = (str(error).strip().splitlines() or [""])[0] or type(error).__name__
                log.warning(
                    "bridge: cannot reach the broker (try %s): %s: %s; retrying in %.1f s",
                    failures,
                    type(error).__name__,
                    mask_text(text),
                    pause,
                    extra={"event": "bridge_broker_unavailable", "consumer": self.consumer},
                )
                self._stopping.wait(pause)
        if failures:
            log.info(
                "bridge: broker reachable after %s tries",
                failures + 1,
                extra={"event": "bridge_broker_reachable"},
            )
        return self.source

    def _unavailable(self, error: psycopg.OperationalError, failures: int, doing: str) -> bool:
        """Log that the database is unavailable and back off (jittered, up to 5 s); True if the
        bridge was stopped meanwhile."""
        text = str(error).strip()
        log.warning(
            "bridge: database unavailable (%s); %s",
            text.splitlines()[0] if text else type(error).__name__,
            doing,
            extra={"event": "bridge_db_unavailable", "consumer": self.consumer},
        )
        return self._stopping.wait(min(5.0, 0.1 * 2**failures) * random.uniform(0.5, 1.0))

    def _store(
        self, messages: list[InboxMessage], conn: psycopg.Connection[Any] | None, *, each: bool = False
    ) -> tuple[list[Any] | InvalidMessage | None, psycopg.Connection[Any] | None]:
        """Receive a batch and commit it, retrying with jittered backoff while the database is
        unreachable (a retry after a commit whose outcome was lost finds duplicates: nothing is
        stored twice). Committed first, acknowledged after: a crash in between means a redelivery.
        Returns no results if the bridge is stopped meanwhile, the refusal if the database refuses
        a message of the batch (over its size limits: nothing of the batch is stored). With
        ``each``, every message is received in a savepoint of its own and a refused one gives its
        refusal in its result's place, the others stored."""
        failures = 0
        while True:
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(self.url, application_name="postbox-bridge")
                results: list[Any] = _each(conn, messages) if each else receive_many(conn, messages)
                conn.commit()
                return results, conn
            except InvalidMessage as refused:  # raised before the batch is sent: conn is connected
                if conn is not None:
                    conn.rollback()
                return refused, conn
            except psycopg.OperationalError as error:
                failures += 1
                if conn is not None:
                    conn.close()
                conn = None
                if self._unavailable(error, failures, f"retrying the batch of {len(messages)}"):
                    return None, None

    def _reject(self, item: Incoming, error: InvalidMessage) -> None:
        log.warning(
            "bridge rejects a message: %s",
            error,
            extra={"event": "bridge_rejected", "consumer": self.consumer,
                   "message_id": item.message_id, "key": item.key},
        )  # fmt: skip
        metrics.BRIDGE_MESSAGES.labels(self.consumer, "rejected").inc()
        self.rejected += 1
        item.refused = str(error)
        assert self.source is not None  # connected before anything is fetched
        self.source.reject(item)

    def _store_refusing(
        self, good: list[tuple[Incoming, InboxMessage]], conn: psycopg.Connection[Any] | None
    ) -> tuple[list[ReceiveResult] | None, psycopg.Connection[Any] | None]:
        """:meth:`_store`, rejecting a message the database refuses (over its size limits) and
        storing the others: a message too large for the inbox must not stop the bridge. ``good``
        is left holding what was stored."""
        while True:
            results, conn = self._store([m for _, m in good], conn)
            if not isinstance(results, InvalidMessage):
                return results, conn
            match = re.match(r"messages\[(\d+)\]", results.field)
            if match is not None and int(match.group(1)) < len(good):
                item, _ = good.pop(int(match.group(1)))
                self._reject(item, results)
                continue
            # Refused by the database, which does not say which message (a size limit set below
            # what the client checks): each in a savepoint of its own, the refused ones rejected.
            each, conn = self._store([m for _, m in good], conn, each=True)
            if each is None or isinstance(each, InvalidMessage):
                return None, conn  # stopped meanwhile: nothing acknowledged
            kept = [(g, r) for g, r in zip(good, each, strict=True) if not isinstance(r, InvalidMessage)]
            for (item, _), r in zip(good, each, strict=True):
                if isinstance(r, InvalidMessage):
                    self._reject(item, r)
            good[:] = [g for g, _ in kept]
            return [r for _, r in kept], conn

    def _loop(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        self._wait_for_consumer()
        source = self._open_source()
        if source is None:
            return
        try:
            while not self._stopping.is_set():
                items = source.fetch(self.batch_size, self.wait)
                if not items:
                    continue
                good: list[tuple[Incoming, InboxMessage]] = []
                for item in items:
                    try:
                        good.append((item, self._message(item)))
                    except InvalidMessage as error:
                        self._reject(item, error)
                results, conn = self._store_refusing(good, conn)
                if results is None:  # stopped while the database was unreachable: not acknowledged
                    break
                source.ack([i for i, _ in good])
                self.received += sum(1 for r in results if r.is_new)
                self.duplicates += sum(1 for r in results if not r.is_new)
                for (_, m), r in zip(good, results, strict=True):
                    outcome = "conflict" if r.is_conflict else "new" if r.is_new else "duplicate"
                    metrics.BRIDGE_MESSAGES.labels(self.consumer, outcome).inc()
                    if r.is_conflict:
                        log.warning(
                            "bridge: %s arrived again with another payload (conflict, not stored)",
                            m.message_id,
                        )
        finally:
            if conn is not None:
                conn.close()
            source.close()


def _each(
    conn: psycopg.Connection[Any], messages: list[InboxMessage]
) -> list[ReceiveResult | InvalidMessage]:
    """Each message received in a savepoint of its own: its result, or the database's refusal of it
    (that savepoint rolled back, the transaction and the others intact)."""
    out: list[ReceiveResult | InvalidMessage] = []
    for m in messages:
        try:
            with conn.transaction():
                out.append(receive_many(conn, [m])[0])
        except InvalidMessage as refused:
            out.append(refused)
    return out

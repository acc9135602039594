"""Redis Streams: the transport appends with XADD, the bridge source reads through a consumer group.

Needs the ``redis`` extra. Fields of an entry: message_id, key, type, payload (JSON), headers
(JSON), correlation_id, causation_id. A Redis that cannot be reached or times out is a transient
failure, an XADD it refuses a permanent one; texts are masked.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from postbox.config.settings import mask_text, register_url_secrets
from postbox.extras import require
from postbox.failures.outcomes import Permanent, Transient
from postbox.messages import to_json
from postbox.outbox.transports import Incoming, OutboxRow, envelope_headers, text

__all__ = ["RedisSource", "RedisStreamsTransport", "source"]

EXTRA = "redis"
NAME = "Redis"


class RedisStreamsTransport:
    """XADD to a stream (``MAXLEN ~`` bound optional); one pipeline per batch."""

    def __init__(self, url: str, stream: str, maxlen: int | None = None) -> None:
        require(EXTRA, f"the {NAME} transport")
        import redis

        register_url_secrets(url)
        self.stream = stream
        self.maxlen = maxlen
        self._client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)

    def publish(self, rows: Sequence[OutboxRow]) -> list[BaseException | None]:
        import redis

        try:
            pipe = self._client.pipeline(transaction=False)
            for row in rows:
                fields = {
                    "message_id": row.message_id, "key": row.key, "type": row.type or "",
                    "payload": to_json(row.payload), "headers": to_json(envelope_headers(row)),
                    "correlation_id": row.correlation_id or "", "causation_id": row.causation_id or "",
                }  # fmt: skip
                pipe.xadd(self.stream, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]
            pipe.execute()
            return [None] * len(rows)
        except (redis.ConnectionError, redis.TimeoutError) as error:
            return [Transient(mask_text(f"Redis unavailable: {error}"))] * len(rows)
        except redis.ResponseError as error:
            return [Permanent(mask_text(f"Redis refused XADD: {error}"))] * len(rows)

    def close(self) -> None:
        self._client.close()


class RedisSource:
    """Reads a stream through a consumer group (created if missing); entries of a dead bridge
    that were never acknowledged are read again from the group's pending list at start."""

    def __init__(self, url: str, stream: str, group: str = "postbox", consumer: str = "bridge") -> None:
        require(EXTRA, f"the {NAME} bridge source")
        import redis

        self.stream, self.group, self.consumer = stream, group, consumer
        self._r = redis.Redis.from_url(url)
        try:
            self._r.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        self._backlog = True  # first our own pending entries, then new ones

    def fetch(self, limit: int, timeout: float) -> list[Incoming]:
        start = "0" if self._backlog else ">"
        reply: Any = self._r.xreadgroup(
            self.group, self.consumer, {self.stream: start}, count=limit,
            block=None if self._backlog else int(timeout * 1000),
        )  # fmt: skip
        entries: list[Any] = reply[0][1] if reply else []
        if self._backlog and not entries:
            self._backlog = False
        out = []
        for entry_id, raw in entries:
            f: dict[str, str] = {str(text(k)): str(text(v)) for k, v in raw.items()}
            headers = json.loads(f["headers"]) if f.get("headers") else {}
            out.append(
                Incoming(
                    entry_id,
                    f.get("message_id") or f.get("postbox-message-id"),
                    f.get("key") or f.get("postbox-key"),
                    f.get("type") or None,
                    (f.get("payload") or "null").encode(),
                    headers,
                    f.get("correlation_id") or None,
                    f.get("causation_id") or None,
                )
            )
        return out

    def ack(self, items: Sequence[Incoming]) -> None:
        if items:
            self._r.xack(self.stream, self.group, *[i.token for i in items])

    def reject(self, item: Incoming) -> None:
        self._r.xack(self.stream, self.group, item.token)  # nothing to redeliver: it is logged

    def close(self) -> None:
        self._r.close()


TRANSPORT = RedisStreamsTransport


def source(url: str, name: str) -> RedisSource:
    """The bridge source of ``postbox bridge --from redis://...``: ``name`` is the stream."""
    return RedisSource(url, name)

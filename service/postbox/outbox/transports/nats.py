"""NATS JetStream: the transport publishes and waits for each PubAck, the bridge source is a
durable pull consumer.

Needs the ``nats`` extra (nats-py). The asyncio client runs on an event loop of its own in a
daemon thread; the relay and the bridge call it synchronously. ``Nats-Msg-Id`` carries the
``message_id``, so the stream itself drops a duplicate within its deduplication window. A stream
is created on first use if it does not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

from postbox.config.settings import mask_text, register_url_secrets
from postbox.extras import require
from postbox.failures.outcomes import Transient
from postbox.messages import to_json
from postbox.outbox.transports import Incoming, OutboxRow, envelope_headers

__all__ = ["NatsSource", "NatsTransport", "source"]

EXTRA = "nats"
NAME = "NATS"
CONNECT_SECONDS = 5.0  # a bridge source's first connection, each try

log = logging.getLogger("postbox.nats")


class _LoopThread:
    """An event loop in a daemon thread, for calling the asyncio client from synchronous code."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        """Cancel what the client left running (its reader, flusher and subscription tasks), wait
        for it, then stop and close the loop: nothing is left to be destroyed while pending."""
        with contextlib.suppress(Exception):
            self.run(_cancel_others(), 5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()


async def _cancel_others() -> None:
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


async def _stream(js: Any, stream: str, subject: str) -> None:
    """Create ``stream`` (for ``subject``) unless it exists."""
    try:
        await js.stream_info(stream)
    except Exception:
        await js.add_stream(name=stream, subjects=[subject])


class NatsTransport:
    """Publishes to a JetStream subject and waits for each PubAck."""

    def __init__(self, url: str, subject: str, stream: str, timeout: float = 5.0) -> None:
        require(EXTRA, f"the {NAME} transport")
        register_url_secrets(url)
        self.url, self.subject, self.stream, self.timeout = url, subject, stream, timeout
        self._loop = _LoopThread("postbox-nats")
        self._nc: Any = None
        self._js: Any = None

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self._loop.run(coro, self.timeout * 4)

    async def _ensure(self) -> Any:
        import nats

        if self._nc is None or self._nc.is_closed or not self._nc.is_connected:
            if self._nc is not None:
                await self._close()
            self._nc = await nats.connect(
                self.url, connect_timeout=self.timeout, max_reconnect_attempts=0, allow_reconnect=False
            )
            self._js = self._nc.jetstream(timeout=self.timeout)
            await _stream(self._js, self.stream, self.subject)
        return self._js

    async def _publish(self, rows: Sequence[OutboxRow]) -> list[BaseException | None]:
        results: list[BaseException | None] = []
        for i, row in enumerate(rows):
            try:
                js = await self._ensure()
                headers = {**envelope_headers(row), "Nats-Msg-Id": row.message_id}
                await js.publish(
                    self.subject, to_json(row.payload).encode(), headers=headers, timeout=self.timeout
                )
                results.append(None)
            except Exception as error:
                await self._close()
                failure = Transient(mask_text(f"NATS unavailable: {type(error).__name__}: {error}"))
                results.extend([failure] * (len(rows) - i))
                break
        return results

    def publish(self, rows: Sequence[OutboxRow]) -> list[BaseException | None]:
        try:
            result: list[BaseException | None] = self._run(self._publish(rows))
            return result
        except Exception as error:
            return [Transient(mask_text(f"NATS publish did not complete: {error}"))] * len(rows)

    async def _close(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.close()

    def close(self) -> None:
        try:
            self._run(self._close())
        finally:
            self._loop.stop()


class NatsSource:
    """A durable JetStream pull consumer on ``subject`` of ``stream``. The id is the
    ``Nats-Msg-Id`` (or ``postbox-message-id``) header."""

    def __init__(self, url: str, stream: str, subject: str, durable: str = "postbox-bridge") -> None:
        require(EXTRA, f"the {NAME} bridge source")
        self._loop = _LoopThread("postbox-nats-bridge")
        self.url, self.stream, self.subject, self.durable = url, stream, subject, durable
        self._nc: Any = None
        try:
            self._sub: Any = self._run(self._connect())
        except BaseException:
            self._loop.stop()  # nothing of a failed try is left running
            raise

    def _run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        return self._loop.run(coro, timeout)

    async def _connect(self) -> Any:
        import nats

        last: list[Exception] = []

        async def quiet(error: Exception) -> None:  # the client's own report is a traceback a try
            last[:] = [error]
            log.debug("nats: %s", mask_text(str(error)))

        # Bounded: the client retries an unreachable server on its own for minutes; the bridge waits
        # for its broker itself, a line a try, and stops at once when told to.
        try:
            self._nc = await asyncio.wait_for(
                nats.connect(self.url, error_cb=quiet, connect_timeout=2), CONNECT_SECONDS
            )
        except TimeoutError:
            why = f": {type(last[0]).__name__}: {last[0]}" if last else ""
            raise ConnectionError(f"no connection to NATS within {CONNECT_SECONDS:g} s{why}") from None
        js = self._nc.jetstream()
        await _stream(js, self.stream, self.subject)
        return await js.pull_subscribe(self.subject, durable=self.durable, stream=self.stream)

    async def _fetch(self, limit: int, timeout: float) -> list[Any]:
        import nats.errors

        try:
            return list(await self._sub.fetch(limit, timeout=timeout))
        except (nats.errors.TimeoutError, TimeoutError):  # nats-py raises either when nothing came
            return []

    def fetch(self, limit: int, timeout: float) -> list[Incoming]:
        out = []
        for m in self._run(self._fetch(limit, timeout)):
            h = dict(m.headers or {})
            out.append(
                Incoming(
                    m,
                    h.get("Nats-Msg-Id") or h.get("postbox-message-id"),
                    h.get("postbox-key"),
                    h.get("postbox-type"),
                    m.data,
                    h,
                    h.get("postbox-correlation-id"),
                    h.get("postbox-causation-id"),
                )
            )
        return out

    def ack(self, items: Sequence[Incoming]) -> None:
        async def _ack() -> None:
            for i in items:
                await i.token.ack()

        self._run(_ack())

    def reject(self, item: Incoming) -> None:
        self._run(item.token.term())

    def close(self) -> None:
        try:
            self._run(self._nc.close())
        finally:
            self._loop.stop()


TRANSPORT = NatsTransport


def source(url: str, name: str) -> NatsSource:
    """The bridge source of ``postbox bridge --from nats://...``: ``name`` is STREAM:SUBJECT (the
    subject defaults to every subject under the stream's name in lower case)."""
    stream, _, subject = name.partition(":")
    return NatsSource(url, stream, subject or f"{stream.lower()}.>")

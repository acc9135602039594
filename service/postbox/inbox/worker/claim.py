"""The claim loop: a slot's thread. It claims batches (one short transaction that counts a
delivery on each message and leases them), hands each to the slot to process, waits for a
wake-up (LISTEN/NOTIFY or the poll interval) when there is nothing to claim, and survives lost
connections and its own bugs. Leases are renewed by the worker's heartbeat (its presence)."""

from __future__ import annotations

import logging
import time

import psycopg

from postbox.db import query
from postbox.failures.breaker import BreakerState
from postbox.inbox.handlers import Message
from postbox.inbox.worker.base import SlotBase
from postbox.inbox.worker.batch import message_from_row
from postbox.inbox.worker.settings import Abandoned, SlotStop
from postbox.operations import metrics
from postbox.operations.lifecycle import claim

__all__ = ["ClaimLoop"]

log = logging.getLogger("postbox.worker")


class ClaimLoop(SlotBase):
    """A slot's part that claims and hands batches to the slot's ``_process``."""

    def run(self) -> None:
        try:
            self.conn = self._connect()
            if self._inheritance is not None:
                self._settle_inheritance()
            while not self.worker.stopping:
                self._step()
        except (SlotStop, Abandoned):
            pass
        except BaseException as error:  # recorded; the watchdog starts a new slot
            self.died = error
            log.critical("slot %s died: %r", self.index, error, exc_info=True)
        finally:
            if self._loop is not None and not self.abandoned:
                self._loop.close()
            if self.conn is not None:
                try:
                    self.conn.close()
                except Exception:
                    log.debug("closing the slot's connection failed", exc_info=True)

    def _step(self) -> None:
        """Claim and process one batch, or wait for work."""
        generation = self.worker.wakeup.generation
        try:
            limit = self.worker.breaker.claim_limit(1 if self._solo else self.settings.batch_size)
            if limit == 0:  # circuit open: wait for the next probe
                self.worker._stopping.wait(min(self.settings.poll_interval, 0.5))
                return
            batch = self._claim(limit)
            if not batch:
                if limit == 1 and self.worker.breaker.state is BreakerState.HALF_OPEN:
                    self.worker.breaker.release_probe()
                self.worker._emit("idle", slot=self.index)
                self.worker.wakeup.wait(generation)
                return
            self._process(batch)
        except (SlotStop, Abandoned):
            raise
        except psycopg.OperationalError as error:
            self._check_abandoned()
            log.warning("slot %s lost its connection: %s", self.index, error)
            self._reconnect()
        except Exception:  # a slot must never die: log, reset the connection, go on
            self._check_abandoned()
            log.exception("slot %s failed; resetting its connection", self.index)
            self._reconnect()

    def _claim(self, limit: int) -> list[Message]:
        assert self.conn is not None
        started = time.monotonic()
        rows = claim(
            self.conn,
            query("inbox_claim"),
            {"consumer": self.settings.consumer, "worker": self.worker.id, "limit": limit,
             "lease": self.settings.lease_seconds, "now": self.worker.clock.now()},
        )  # fmt: skip
        batch = [message_from_row(r) for r in rows]
        if batch and self._solo:
            self._solo -= 1
        metrics.record_claim(self.settings.consumer, batch, time.monotonic() - started)
        if batch:
            self.worker._emit("claimed", ids=[m.id for m in batch])
        return batch

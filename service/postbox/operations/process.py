"""One runtime for every long-running Postbox process (worker, relay, bridge, maintenance, replay
runner): wait for the database, run the service until SIGTERM/SIGINT, join it within the grace
period, decide the exit code, flush the logs.

A service is anything of the :class:`Service` shape; :func:`run_process` runs one as the process.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol, runtime_checkable

from postbox.operations.runtime import DatabaseUnreachable, wait_for_database

__all__ = ["EXIT_FATAL", "ProcessSpec", "Service", "StartupFailed", "await_database", "run_process"]

EXIT_FATAL = 70
"""The exit status of a process that cannot go on (for its supervisor to restart it)."""


@runtime_checkable
class Service(Protocol):
    """What a long-running Postbox component offers the process that runs it."""

    def start(self) -> None:
        """Start working in background threads and return."""

    def run(self) -> None:
        """``start``, wait until stopped, ``join``: the service in the calling thread."""

    def stop(self) -> None:
        """Stop taking new work; what is in flight finishes (``join`` bounds it)."""

    def abort(self) -> None:
        """Stop at once: what is in flight is given back."""

    def join(self, grace: float | None = None) -> None:
        """Wait up to ``grace`` seconds (None: the service's own) for in-flight work, then clean up."""

    def ready(self) -> bool:
        """For ``/readyz``: running and able to work."""

    @property
    def stopping(self) -> bool:
        """``stop`` (or ``abort``) was called."""

    @property
    def fatal(self) -> str | None:
        """Why the service cannot go on (the process exits with :data:`EXIT_FATAL`), or None."""


class StartupFailed(Exception):
    """The process could not start (database unreachable, schema not ready)."""


_log = logging.getLogger("postbox.process")


def _say(text: str, level: int = logging.INFO) -> None:
    """A line about the process itself: through the configured log format (so a JSON log stream
    stays JSON), or plain on stderr when logging is not set up."""
    if any(getattr(h, "_postbox", False) for h in logging.getLogger().handlers):
        _log.log(level, text, extra={"event": "process"})
    else:
        print(f"postbox: {text}", file=sys.stderr, flush=True)


@dataclass
class ProcessSpec:
    """How to run one service as a process.

    ``what`` names it in messages; ``stop_message`` is printed on the first signal (``aborting`` on
    the second); ``before_start`` runs once the database answers (declarations, checks);
    ``serve`` starts the metrics and readiness endpoint before the database is awaited, with a
    readiness check (the service's ``ready`` once it runs; ``reason()`` says why not);
    ``check_schema`` returns a warning to print, or raises :class:`StartupFailed`."""

    what: str
    url: str
    connect_timeout: float | None = None
    connect_timeout_source: str = "--connect-timeout {:g}"  # how the give-up message names it
    grace: float | None = None
    stop_message: str = "stopping"
    before_start: Callable[[], None] | None = None
    serve: Callable[[Callable[[], bool]], Any] | None = None
    check_schema: Callable[[str], str | None] | None = None
    say: Callable[..., None] = field(default=_say)


class _Signals:
    """SIGTERM/SIGINT: the first stops the service, the second aborts it.

    The handler itself only queues the signal: Python runs it in the main thread between two
    bytecodes, possibly while that thread holds a lock the handling needs (the event's, inside
    ``Event.wait``), which would deadlock it. A thread of its own does the handling.
    """

    def __init__(self, service: Service, spec: ProcessSpec) -> None:
        self.service = service
        self.spec = spec
        self.count = 0
        self.event = threading.Event()
        self.aborted = threading.Event()  # a second signal came
        self._previous: dict[int, Any] = {}
        self._received: queue.SimpleQueue[int | None] = queue.SimpleQueue()  # put() is reentrant
        self._relay = threading.Thread(target=self._handle_all, name="postbox-signals", daemon=True)

    def __enter__(self) -> _Signals:
        self._relay.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._received.put(None)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._received.put(signum)

    def _handle_all(self) -> None:
        while (signum := self._received.get()) is not None:
            self.count += 1
            self.event.set()
            if self.count == 1:
                self.spec.say(f"{self.spec.stop_message} (signal {signum})")
                self.service.stop()
            else:
                self.spec.say("aborting", logging.WARNING)
                self.aborted.set()
                self.service.abort()


def await_database(spec: ProcessSpec, stopping: threading.Event) -> bool:
    """Wait for the database (``connect_timeout``), then check its schema; False if ``stopping``
    was set meanwhile."""
    try:
        reached = wait_for_database(
            spec.url,
            what=spec.what,
            timeout=spec.connect_timeout,
            timeout_source=spec.connect_timeout_source,
            stopping=stopping,
        )
    except DatabaseUnreachable as error:
        raise StartupFailed(f"{spec.what}: cannot reach the database: {error}") from None
    if not reached:
        return False
    if spec.check_schema is not None:
        warning = spec.check_schema(spec.url)
        if warning is not None:
            spec.say(warning, logging.WARNING)
    return True


class _Readiness:
    """What ``/readyz`` asks: false until the service runs (the database reached, ``before_start``
    done), then the service's own ``ready()``; ``reason()`` says why not."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.phase = "waiting for the database"

    def __call__(self) -> bool:
        return self.phase == "running" and bool(self.service.ready())

    def reason(self) -> str:
        if self.phase != "running":
            return self.phase
        if self.service.fatal is not None:
            return f"failed: {self.service.fatal}"
        if self.service.stopping:
            return "stopping"
        return "the service reports not ready (its heartbeat is late, or none of its loops runs)"


def run_process(service: Service, spec: ProcessSpec) -> int:
    """Run ``service`` as this process until a signal stops it; the exit status.

    Serves metrics (``/readyz`` 503 until the service runs), waits for the database
    (``connect_timeout``; a signal meanwhile exits 0), runs ``before_start``, starts the service,
    waits until it stops (a signal, or a fatal condition), joins it within ``grace`` (at once after
    a second signal). A fatal service exits :data:`EXIT_FATAL`; handler threads still stuck in
    user code are not waited for."""
    with _Signals(service, spec) as signals:
        readiness = _Readiness(service)
        if spec.serve is not None:
            spec.serve(readiness)  # /readyz says 503 and why until the service runs
        if not await_database(spec, signals.event):
            spec.say(f"{spec.what} stopped while waiting for the database")
            return 0
        readiness.phase = "starting"
        if spec.before_start is not None:
            spec.before_start()
        # What startup made (modules, the app, settings) lives as long as the process: kept out of
        # every later collection, whose full passes would otherwise walk it again and again.
        gc.collect()
        gc.freeze()
        service.start()
        readiness.phase = "running"
        try:
            while not service.stopping and service.fatal is None:
                signals.event.wait(0.5)
        finally:
            joined = _join(service, spec.grace, signals.aborted)
    if not joined:
        # A second signal, and the service still finishing: leave now, as a crash would (what it
        # held is leased or unacknowledged, and taken up again: nothing is lost).
        spec.say(f"{spec.what} exited before its work in flight finished (second signal)", logging.WARNING)
        _flush_logs()
        logging.shutdown()
        os._exit(0)
    return _exit(service, spec)


# After a second signal, how long a service's own abort has to end its join (a worker gives back
# what it runs within moments) before the process leaves without it.
ABORT_SECONDS = 2.0


def _join(service: Service, grace: float | None, aborted: threading.Event) -> bool:
    """``service.join(grace)``; False if a second signal came and the join did not end within
    :data:`ABORT_SECONDS` of it (every service's own threads are daemons: the process may leave)."""
    failed: list[BaseException] = []

    def join() -> None:
        try:
            service.join(grace)
        except BaseException as error:  # raised in the main thread, as before
            failed.append(error)

    joiner = threading.Thread(target=join, name="postbox-join", daemon=True)
    joiner.start()
    while True:
        joiner.join(0.05)
        if not joiner.is_alive():
            break
        if aborted.is_set():
            joiner.join(ABORT_SECONDS)
            if joiner.is_alive():
                return False
            break
    if failed:
        raise failed[0]
    return True


def _exit(service: Service, spec: ProcessSpec) -> int:
    fatal = service.fatal
    if fatal is not None:
        spec.say(fatal, logging.ERROR)
    stuck = int(getattr(service, "stuck_threads", 0))
    _flush_logs()
    if fatal is None and not stuck:
        return 0
    # Threads may still be stuck in user code: leave without waiting for them.
    logging.shutdown()
    os._exit(EXIT_FATAL if fatal is not None else 0)


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers + logging.getLogger("postbox").handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()

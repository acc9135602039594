"""A process's SIGTERM/SIGINT handling never deadlocks the process it is meant to stop.

Python runs a signal handler in the main thread between two bytecodes, possibly while that thread
holds the lock of the event it waits on (inside ``Event.wait``). A handler that set that event
itself then waited for a lock its own thread held: a worker or `postbox maintain` sent SIGTERM at
that instant never stopped (seen once under `make bench`, its stack taken with py-spy)."""

from __future__ import annotations

import signal
import threading

from postbox.operations.process import ProcessSpec, _Signals


class _Service:
    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.aborted = threading.Event()

    def stop(self) -> None:
        self.stopped.set()

    def abort(self) -> None:
        self.aborted.set()


def test_a_signal_arriving_while_the_main_thread_holds_the_events_lock_still_stops_the_service():
    service = _Service()
    said: list[str] = []
    spec = ProcessSpec(what="test", url="", say=lambda text, level=0: said.append(text))
    with _Signals(service, spec) as signals:  # type: ignore[arg-type]
        handled = threading.Event()

        def deliver() -> None:
            # As in Event.wait: the event's own lock held by this thread when the handler runs.
            with signals.event._cond:  # type: ignore[attr-defined]
                signals._on_signal(signal.SIGTERM, None)
            handled.set()

        runner = threading.Thread(target=deliver, daemon=True)
        runner.start()
        assert handled.wait(5), "the signal handler blocked on a lock its own thread held"
        assert service.stopped.wait(5) and signals.event.wait(5)
        signals._on_signal(signal.SIGINT, None)  # a second signal aborts
        assert service.aborted.wait(5)
    assert said[0] == "stopping (signal 15)" and "aborting" in said

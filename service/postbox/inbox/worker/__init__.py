"""The inbox worker: claims heads of keys, runs handlers, commits effects with the "done" mark.

:class:`Worker` owns the slots and their watchdog (:mod:`.worker`); a slot (:mod:`.slot`) is a
claim loop (:mod:`.claim`), a handler executor (:mod:`.executor`) and a completer
(:mod:`.completer`); :mod:`.settings` holds the settings and the errors of an attempt.
"""

from postbox.inbox.worker.settings import (
    ABANDON_AFTER,
    HandlerLeftTransactionInError,
    HandlerTimeout,
    WorkerSettings,
    WorkerShutdown,
)
from postbox.inbox.worker.worker import Worker

__all__ = [
    "ABANDON_AFTER",
    "HandlerLeftTransactionInError",
    "HandlerTimeout",
    "Worker",
    "WorkerSettings",
    "WorkerShutdown",
]

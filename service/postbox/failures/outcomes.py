"""What a handler can say about an attempt, by returning or raising one of these.

Returning normally (or ``None``) is success. Any other exception is classified by the rules of
:mod:`postbox.failures.classify` (transient, permanent or unknown outcome).
"""

from __future__ import annotations

__all__ = ["Outcome", "Permanent", "Retry", "Transient", "UnknownOutcome"]


class Outcome(Exception):
    """Base of the explicit outcomes."""

    def __init__(self, reason: str = "") -> None:
        self.reason = reason
        super().__init__(reason)


class Transient(Outcome):
    """Failed, and trying again later may succeed: retried with the policy's backoff."""


class Retry(Transient):
    """Failed transiently; try again after ``after`` seconds (for example a ``Retry-After``)."""

    def __init__(self, after: float, reason: str = "") -> None:
        if not after >= 0:  # NaN too: no delay can be made of it
            raise ValueError(f"Retry(after=...) must be a number of seconds, not negative: {after!r}")
        self.after = after
        super().__init__(reason or f"retry requested in {after:g} s")


class Permanent(Outcome):
    """Failed, and retrying cannot help (malformed, business rule, unsupported schema version):
    dead-lettered at once."""


class UnknownOutcome(Outcome):
    """The operation may or may not have happened (a lost response). Retried only if the handler is
    declared idempotent; otherwise dead-lettered with reason ``unknown_outcome``."""

"""Declaring a consumer and its ordering policies."""

from __future__ import annotations

import math

from postbox.db import AnySyncConnection, query, run
from postbox.errors import InvalidMessage
from postbox.values import CONSUMER_MAX_BYTES, check_text

__all__ = ["SEQUENCE_MODES", "declare_consumer"]

SEQUENCE_MODES = ("arrival", "monotonic", "gapless")


def declare_consumer(
    conn: AnySyncConnection,
    name: str,
    *,
    sequence_mode: str = "arrival",
    first_sequence: int = 1,
    late_policy: str = "dead_letter",
    on_dead_letter: str = "block",
    gap_timeout_seconds: float | None = None,
) -> None:
    """Declare (or update) a consumer and its ordering policies, in ``conn``'s transaction.

    Once any consumer is declared, receiving for an undeclared one is refused.
    """
    if sequence_mode not in SEQUENCE_MODES:
        raise InvalidMessage("sequence_mode", f"must be one of {', '.join(SEQUENCE_MODES)}")
    if not isinstance(name, str):
        raise InvalidMessage("name", f"must be a text, not a {type(name).__name__}")
    try:
        check_text(name, CONSUMER_MAX_BYTES)
    except ValueError as error:
        raise InvalidMessage("name", str(error)) from None
    if gap_timeout_seconds is not None and not (
        isinstance(gap_timeout_seconds, int | float) and 0 < gap_timeout_seconds < math.inf
    ):
        raise InvalidMessage(
            "gap_timeout_seconds", f"must be a positive number of seconds, not {gap_timeout_seconds!r}"
        )
    run(
        conn,
        query("declare_consumer"),
        {
            "name": name,
            "sequence_mode": sequence_mode,
            "first_sequence": first_sequence,
            "late_policy": late_policy,
            "on_dead_letter": on_dead_letter,
            "gap_timeout": None if gap_timeout_seconds is None else f"{gap_timeout_seconds} seconds",
        },
    )

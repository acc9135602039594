"""W3C trace context (``traceparent``/``tracestate`` headers): read the trace id of a message, and
derive the header of an event a handler publishes, so the trace goes on through the outbox."""

from __future__ import annotations

import re
import secrets
from typing import Any

__all__ = ["child_headers", "child_traceparent", "trace_id"]

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def _parse(value: Any) -> tuple[str, str, str, str] | None:
    if not isinstance(value, str):
        return None
    match = _TRACEPARENT.match(value.strip().lower())
    if match is None or match.group(2) == "0" * 32 or match.group(1) == "ff":
        return None
    version, trace, span, flags = match.groups()
    return version, trace, span, flags


def trace_id(headers: Any) -> str | None:
    """The trace id of the ``traceparent`` in ``headers`` (``00-<trace id>-<span id>-<flags>``)."""
    if not isinstance(headers, dict):
        return None
    parsed = _parse(headers.get("traceparent"))
    return parsed[1] if parsed else None


def child_traceparent(parent: str) -> str | None:
    """The same trace with a new span id (the handler's work is the parent of the new event)."""
    parsed = _parse(parent)
    if parsed is None:
        return None
    _, trace, _, flags = parsed
    return f"00-{trace}-{secrets.token_hex(8)}-{flags}"


def child_headers(incoming: Any, outgoing: dict[str, Any] | None) -> dict[str, Any]:
    """``outgoing`` headers with the trace context of ``incoming`` added (explicit values win)."""
    headers = dict(outgoing or {})
    if not isinstance(incoming, dict) or "traceparent" in headers:
        return headers
    child = child_traceparent(incoming.get("traceparent"))  # type: ignore[arg-type]
    if child is None:
        return headers
    headers["traceparent"] = child
    if isinstance(incoming.get("tracestate"), str):
        headers.setdefault("tracestate", incoming["tracestate"])
    return headers

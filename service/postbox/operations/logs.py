"""Logging: one JSON object per line with stable fields (for log pipelines), or readable text on a
terminal.

Every message-related line carries, when known: ``consumer`` (or ``destination``), ``message_id``,
``key``, ``sequence``, ``type``, ``attempt``, ``worker``, ``duration_ms``, ``error_type``, ``error``
(the error's message, cut at :data:`ERROR_TEXT_LIMIT` characters), ``decision``,
``correlation_id``, ``causation_id`` and ``trace_id`` (from the message's W3C ``traceparent``),
next to ``ts``, ``level``, ``logger``, ``event`` (a stable snake_case name such as
``message_processed``) and ``msg`` (the sentence for humans). Fields are passed with
``log.info(..., extra={...})``; any extra field is written.

Secrets never reach a line: the message, every field and the exception text go through
:func:`postbox.config.settings.mask_text` (passwords in URLs, secret query parameters and pairs, and the
secrets the configuration holds).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any

from postbox.config.settings import mask_text
from postbox.operations.tracing import trace_id

__all__ = [
    "ERROR_TEXT_LIMIT",
    "JsonFormatter",
    "TextFormatter",
    "configure_logging",
    "error_text",
    "message_fields",
    "trace_id",
]

ERROR_TEXT_LIMIT = 500
"""Characters of an error's message a log line carries (the failure records keep it whole)."""


def error_text(text: str | None) -> str | None:
    """An error's message for a log line's ``error`` field, cut at :data:`ERROR_TEXT_LIMIT`."""
    if text is None or len(text) <= ERROR_TEXT_LIMIT:
        return text
    return text[: ERROR_TEXT_LIMIT - 1] + "…"


# Attributes every LogRecord has: anything else on a record came from ``extra``.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


def message_fields(message: Any, **more: Any) -> dict[str, Any]:
    """The stable log fields of an inbox message (a ``postbox.inbox.handlers.Message``)."""
    fields = {
        "consumer": message.consumer,
        "message_id": message.message_id,
        "key": message.key,
        "sequence": message.sequence,
        "type": message.type,
        "attempt": message.attempt,
        "correlation_id": message.correlation_id,
        "causation_id": message.causation_id,
        "trace_id": trace_id(message.headers),
    }
    fields.update(more)
    return fields


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: _masked(v) for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


def _masked(value: Any) -> Any:
    """``value`` with secrets masked in every string it holds (other values as they are)."""
    if isinstance(value, str):
        return mask_text(value)
    if isinstance(value, int | float | bool) or value is None:
        return value
    if isinstance(value, dict):
        return {k: _masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_masked(v) for v in value]
    return mask_text(str(value))


class JsonFormatter(logging.Formatter):
    """One JSON object per line; fields that are None are left out."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": None,
            "msg": mask_text(record.getMessage()),
        }
        for k, v in _extras(record).items():
            if v is not None:
                entry[k] = v
        if entry["event"] is None:
            entry["event"] = record.name.rsplit(".", 1)[-1]
        if record.exc_info:
            entry["exception"] = mask_text(self.formatException(record.exc_info))
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``12:00:01.234 INFO  postbox.worker  retry scheduled  consumer=billing message_id=…``"""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created).strftime("%H:%M:%S.%f")[:-3]
        fields = " ".join(f"{k}={v}" for k, v in _extras(record).items() if v is not None and k != "event")
        line = f"{ts} {record.levelname:<7} {record.name}  {mask_text(record.getMessage())}"
        if fields:
            line += f"  {fields}"
        if record.exc_info:
            line += "\n" + mask_text(self.formatException(record.exc_info))
        return line


def configure_logging(fmt: str = "auto", level: str = "info", stream: IO[str] | None = None) -> None:
    """Log the ``postbox`` loggers (and warnings of libraries) to ``stream`` (stderr): ``json``,
    ``text``, or ``auto`` (text on a terminal, JSON otherwise)."""
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "text" if stream.isatty() else "json"
    if fmt not in ("json", "text"):
        raise ValueError(f"postbox: log format must be json, text or auto, not {fmt!r}")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_postbox", False)]:
        root.removeHandler(old)
    handler._postbox = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("postbox").setLevel(level.upper())

"""Errors Postbox raises to its callers."""

from __future__ import annotations

__all__ = ["ConfigError", "InvalidMessage", "InvalidRequest", "PostboxError"]


class PostboxError(Exception):
    """Base class of every error Postbox raises on purpose."""


class InvalidRequest(PostboxError, ValueError):
    """A request was refused before anything was written; ``field`` names the offending field."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


class InvalidMessage(InvalidRequest):
    """A message was refused before anything was written; ``field`` names the offending field."""


class ConfigError(PostboxError):
    """The configuration is invalid; the message says which setting and why."""

"""Errors Postbox raises to its callers."""

from __future__ import annotations

__all__ = ["ConfigError", "InvalidMessage", "InvalidRequest", "MissingExtra", "PostboxError"]


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

    exit_code = 2  # of the ``postbox`` command that meets it


class MissingExtra(ConfigError):
    """What was asked for needs an optional dependency that is not installed; the message names
    the extra and the command that installs it."""

    exit_code = 1

    def __init__(self, what: str, extra: str) -> None:
        self.what = what
        self.extra = extra
        super().__init__(f"{what} needs the {extra!r} extra: pip install 'postbox[{extra}]'")

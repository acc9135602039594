"""Where the project's SQL files and Alembic migrations are, in a checkout or an installed wheel."""

from __future__ import annotations

from pathlib import Path

__all__ = ["migrations_dir", "sql_dir"]

_PACKAGE = Path(__file__).resolve().parent.parent  # postbox/
_CHECKOUT = _PACKAGE.parent.parent  # the repository, when postbox runs from service/postbox


def _find(name: str) -> Path:
    for candidate in (_PACKAGE / "_data" / name, _CHECKOUT / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"postbox: cannot find the {name}/ folder next to {_PACKAGE}")


def sql_dir() -> Path:
    """The ``sql/`` folder: functions, views and named queries."""
    return _find("sql")


def migrations_dir() -> Path:
    """The Alembic ``migrations/`` folder."""
    return _find("migrations")

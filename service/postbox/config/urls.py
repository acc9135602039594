"""Database URLs in every form a user may give, read by SQLAlchemy's ``make_url`` (or libpq's own
parser for a ``key=value`` DSN) and written back in the one form each consumer needs: libpq's
``postgresql://`` for psycopg, ``postgresql+psycopg://`` for SQLAlchemy and Alembic.

Accepted: ``postgresql://…``, ``postgres://…``, ``postgresql+psycopg://…`` (any ``+driver``), and
``host=… dbname=… user=…``. A Unix-socket folder stays a ``host`` query parameter.
"""

from __future__ import annotations

from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from postbox.config.masking import mask_text
from postbox.errors import ConfigError

__all__ = ["libpq_url", "sqlalchemy_url"]

_FORMS = "postgresql://USER:PASSWORD@HOST:PORT/DATABASE (or postgres://, postgresql+psycopg://, or host=… dbname=…)"


def _from_dsn(text: str) -> URL:
    try:
        params = {k: str(v) for k, v in conninfo_to_dict(text).items()}
    except Exception:
        raise ConfigError(f"database URL not understood: {mask_text(text)}; give {_FORMS}") from None
    port = params.pop("port", None)
    return URL.create(
        "postgresql",
        username=params.pop("user", None),
        password=params.pop("password", None),
        host=None if (params.get("host") or "").startswith("/") else params.pop("host", None),
        port=int(port) if port and port.isdigit() else None,
        database=params.pop("dbname", None),
        query={**params, **({"port": port} if port and not port.isdigit() else {})},
    )


def _parse(url: str) -> URL:
    text = url.strip()
    if "://" not in text:
        return _from_dsn(text)
    try:
        parsed = make_url(text)
    except ArgumentError:
        raise ConfigError(f"database URL not understood: {mask_text(text)}; give {_FORMS}") from None
    if parsed.drivername.split("+")[0] not in ("postgresql", "postgres"):
        raise ConfigError(f"not a PostgreSQL URL: {mask_text(text)}; give {_FORMS}")
    return parsed


def libpq_url(url: str) -> str:
    """``url`` as a ``postgresql://`` URL that psycopg (libpq) connects with."""
    return _parse(url).set(drivername="postgresql").render_as_string(hide_password=False)


def sqlalchemy_url(url: str) -> str:
    """``url`` with SQLAlchemy's psycopg 3 driver (``postgresql+psycopg://``)."""
    return _parse(url).set(drivername="postgresql+psycopg").render_as_string(hide_password=False)

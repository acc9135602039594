"""Named queries, loaded from ``sql/queries/*.sql``.

A file holds blocks that start with ``-- name: <name>``; parameters are written ``:name``. Each
query is kept in two spellings: psycopg's (``%(name)s``) and SQLAlchemy ``text()``'s (``:name``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from postbox.db.paths import sql_dir
from postbox.schema.render import expand_if_template

__all__ = ["Query", "query"]

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)
_PARAM = re.compile(r"(?<![:\w]):(\w+)(?!:)")


@dataclass(frozen=True)
class Query:
    name: str
    text: str  # SQLAlchemy spelling, ``:param``
    psycopg: str  # psycopg spelling, ``%(param)s``


def _to_psycopg(sql: str) -> str:
    return _PARAM.sub(r"%(\1)s", sql.replace("%", "%%"))


@cache
def _all() -> dict[str, Query]:
    found: dict[str, Query] = {}
    for path in sorted((sql_dir() / "queries").glob("*.sql")):
        content = expand_if_template(path.read_text(encoding="utf-8"))
        marks = list(_NAME.finditer(content))
        for i, mark in enumerate(marks):
            end = marks[i + 1].start() if i + 1 < len(marks) else len(content)
            body = content[mark.end() : end].strip().rstrip(";").strip()
            name = mark.group(1)
            if name in found:
                raise ValueError(f"postbox: query {name!r} is defined twice (in {path.name})")
            found[name] = Query(name, body, _to_psycopg(body))
    return found


def query(name: str) -> Query:
    """The named query; ``KeyError`` names the missing one."""
    try:
        return _all()[name]
    except KeyError:
        raise KeyError(f"postbox: no query named {name!r} in sql/queries/") from None

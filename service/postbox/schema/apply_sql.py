"""Apply SQL text and ``sql/`` files inside an Alembic revision.

Online, the text goes to psycopg as is (no parameter processing, so ``%`` and ``:`` stay literal).
Offline (``postbox migrate --sql``) it is printed verbatim for a DBA to apply.

A released revision is frozen: it pins the SHA-256 of exactly the SQL it applies (its ``sql/``
files as rendered, and its own text) and :func:`apply_frozen` refuses to run it if that changed.
A later change to the schema or a function is a new revision (a new ``_v2`` name where behaviour
changes, so workers of the previous release keep calling ``_v1`` during a rolling deploy).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path

from alembic import context, op

from postbox.db.paths import sql_dir
from postbox.schema.render import expand, render_each

__all__ = [
    "FrozenRevisionChanged",
    "apply_frozen",
    "digest",
    "frozen_revision",
    "run_sql",
    "run_sql_file",
    "run_sql_template",
    "sql_file_text",
    "template_text",
]


class FrozenRevisionChanged(RuntimeError):
    """A released revision would apply other SQL than it was released with."""


def run_sql(sql: str) -> None:
    """Execute ``sql`` (several statements allowed) in the migration's transaction."""
    if context.is_offline_mode():
        op.execute(sql)
    else:
        op.get_bind().connection.driver_connection.execute(sql)  # type: ignore[union-attr]


def sql_file_text(relative: str) -> str:
    """The text of ``sql/<relative>``, its ``{{#each}}`` blocks repeated for the inbox and the outbox
    (``postbox.schema.render``). Files there are versioned (``_v1``), frozen once released."""
    return render_each((sql_dir() / relative).read_text(encoding="utf-8"))


def template_text(path: str | Path) -> str:
    """A queue template rendered for the inbox, then for the outbox.

    ``path`` is relative to ``sql/``, or an absolute path (a migration's own ``.sql`` file).
    """
    file = Path(path) if Path(path).is_absolute() else sql_dir() / path
    return expand(file.read_text(encoding="utf-8"))


def run_sql_file(relative: str) -> None:
    """Execute ``sql/<relative>`` (see :func:`sql_file_text`)."""
    run_sql(sql_file_text(relative))


def run_sql_template(path: str | Path) -> None:
    """Execute a queue template, rendered for the inbox, then for the outbox."""
    run_sql(template_text(path))


def digest(parts: Iterable[str]) -> str:
    """The SHA-256 (hex) of SQL texts in order, each length-prefixed so that no two lists collide."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def apply_frozen(revision: str, released_sha256: str, frozen: list[str], run: list[str]) -> None:
    """Execute ``run`` (upgrade or downgrade) after checking that ``frozen``, all the SQL of the
    revision, is exactly what ``revision`` was released with."""
    found = digest(frozen)
    if found != released_sha256:
        raise FrozenRevisionChanged(
            f"revision {revision} is released and frozen, but the SQL it would apply has changed "
            f"(sha256 {found[:16]}, released {released_sha256[:16]}): restore it, and put the change "
            "in a new revision"
        )
    for part in run:
        run_sql(part)


def frozen_revision(
    revision: str,
    released_sha256: str,
    statements: Callable[[], list[str]],
    downgrade_statements: Callable[[], list[str]],
) -> tuple[Callable[[], list[str]], Callable[[], None], Callable[[], None]]:
    """A revision made only of SQL texts, both ways: its ``frozen()`` (all of them, what
    ``released_sha256`` pins), ``upgrade()`` and ``downgrade()``, for the revision's module to
    name as Alembic and the pin tests look for them."""

    def frozen() -> list[str]:
        return [*statements(), *downgrade_statements()]

    def upgrade() -> None:
        apply_frozen(revision, released_sha256, frozen(), run=statements())

    def downgrade() -> None:
        apply_frozen(revision, released_sha256, frozen(), run=downgrade_statements())

    return frozen, upgrade, downgrade

"""Apply SQL text and ``sql/`` files inside an Alembic revision.

Online, the text goes to psycopg as is (no parameter processing, so ``%`` and ``:`` stay literal).
Offline (``postbox migrate --sql``) it is printed verbatim for a DBA to apply.
"""

from __future__ import annotations

from pathlib import Path

from alembic import context, op

from postbox.db.paths import sql_dir
from postbox.schema.render import expand, render_each

__all__ = ["run_sql", "run_sql_file", "run_sql_template"]


def run_sql(sql: str) -> None:
    """Execute ``sql`` (several statements allowed) in the migration's transaction."""
    if context.is_offline_mode():
        op.execute(sql)
    else:
        op.get_bind().connection.driver_connection.execute(sql)  # type: ignore[union-attr]


def run_sql_file(relative: str) -> None:
    """Execute ``sql/<relative>``; files there are versioned (``_v1``), frozen once released.

    ``{{#each}}`` blocks in the file are repeated for the inbox and the outbox (``postbox.schema.render``).
    """
    run_sql(render_each((sql_dir() / relative).read_text(encoding="utf-8")))


def run_sql_template(path: str | Path) -> None:
    """Execute a queue template twice, rendered for the inbox, then for the outbox.

    ``path`` is relative to ``sql/``, or an absolute path (a migration's own ``.sql`` file).
    """
    file = Path(path) if Path(path).is_absolute() else sql_dir() / path
    run_sql(expand(file.read_text(encoding="utf-8")))

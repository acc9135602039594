"""Apply SQL text and ``sql/`` files inside an Alembic revision.

Online, the text goes to psycopg as is (no parameter processing, so ``%`` and ``:`` stay literal).
Offline (``postbox migrate --sql``) it is printed verbatim for a DBA to apply.
"""

from __future__ import annotations

from alembic import context, op

from postbox.db.paths import sql_dir

__all__ = ["run_sql", "run_sql_file"]


def run_sql(sql: str) -> None:
    """Execute ``sql`` (several statements allowed) in the migration's transaction."""
    if context.is_offline_mode():
        op.execute(sql)
    else:
        op.get_bind().connection.driver_connection.execute(sql)  # type: ignore[union-attr]


def run_sql_file(relative: str) -> None:
    """Execute ``sql/<relative>``; files there are versioned (``_v1``), frozen once released."""
    run_sql((sql_dir() / relative).read_text(encoding="utf-8"))

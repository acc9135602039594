"""The database seam: named SQL queries and one way to run them on any supported connection."""

from postbox.db.connector import AnyAsyncConnection, AnySyncConnection, run, run_async
from postbox.db.queries import Query, query

__all__ = ["AnyAsyncConnection", "AnySyncConnection", "Query", "query", "run", "run_async"]

"""The database seam: named SQL queries and one way to run them on any supported connection."""

from service.db.connector import AnyAsyncConnection, AnySyncConnection, run, run_async
from service.db.queries import Query, query

__all__ = ["AnyAsyncConnection", "AnySyncConnection", "Query", "query", "run", "run_async"]

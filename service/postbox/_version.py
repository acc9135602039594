"""The version of this Postbox release (one place; the root module and the CLI re-export it), and
the schema revision its code is written for (the newest Alembic revision it ships; a test checks)."""

__version__ = "0.16.0"
SCHEMA_REVISION = "0015"

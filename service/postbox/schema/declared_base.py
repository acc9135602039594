"""What every declared table shares: the schema's ``MetaData`` and the column types used throughout
(``postbox.schema.declared`` is the contract; this is its base)."""

from __future__ import annotations

from sqlalchemy import MetaData, Text, text
from sqlalchemy.dialects.postgresql import TIMESTAMP

__all__ = ["C_TEXT", "NOW", "SCHEMA", "TIMESTAMPTZ", "metadata"]

SCHEMA = "postbox"
metadata = MetaData(schema=SCHEMA)

C_TEXT = Text(collation="C")  # names, ids and keys: byte order, as the indexes sort them
TIMESTAMPTZ = TIMESTAMP(timezone=True)
NOW = text("now()")

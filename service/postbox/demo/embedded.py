"""An embedded PostgreSQL (the ``pgserver`` package, the ``embedded`` extra) for machines without a
database server."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from postbox.extras import require

__all__ = ["embedded_server", "embedded_url"]

_servers: dict[Path, Any] = {}


def embedded_server(data_dir: Path, *, cleanup: str | None = "stop") -> Any:
    """Start (or reuse) the embedded server whose data lives in ``data_dir``.

    ``cleanup="stop"`` stops it when the last Python user exits; ``None`` leaves it running.
    """
    path = data_dir.resolve()
    if path not in _servers:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs complains about XDG_RUNTIME_DIR on servers
            # imported lazily: starting it is slow and most processes never need it
            pgserver = require(
                "embedded", "the embedded PostgreSQL (used by the demo when no database URL is set)"
            )

            path.mkdir(parents=True, exist_ok=True)
            _servers[path] = pgserver.get_server(path, cleanup_mode=cleanup)
    return _servers[path]


def embedded_url(data_dir: Path, database: str = "postgres") -> str:
    """The URL of the embedded server (started if needed), connecting over its Unix socket."""
    server = embedded_server(data_dir)
    return str(server.get_uri(database))

"""A private PostgreSQL cluster the chaos harness owns and may restart (fault F4).

The machine's shared server is never restarted: this cluster uses the binaries of the ``pgserver``
package, lives in a temporary folder, listens on a free TCP port of 127.0.0.1 and trusts local
connections. PostgreSQL refuses to run as root, so as root it runs as pgserver's own system user.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Literal

__all__ = ["PrivateCluster"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateCluster:
    """``start()``, ``stop(mode)``, ``url(dbname)`` and ``destroy()`` of one throw-away cluster."""

    def __init__(self) -> None:
        from pgserver._commands import POSTGRES_BIN_PATH  # type: ignore[import-untyped]

        self.bin = Path(POSTGRES_BIN_PATH)
        self.user: str | None = None
        if os.geteuid() == 0:
            from pgserver.utils import ensure_user_exists  # type: ignore[import-untyped]

            self.user = "pgserver"
            ensure_user_exists(self.user)
        self.root = Path(tempfile.mkdtemp(prefix="postbox-chaos-pg-"))
        self.root.chmod(0o755)
        self.data = self.root / "data"
        self.data.mkdir()
        if self.user is not None:
            shutil.chown(self.root, self.user)
            shutil.chown(self.data, self.user)
        self.port = _free_port()
        self.restarts = 0
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-N")
        self.start()

    def _run(self, program: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        command = [str(self.bin / program), *args]
        return subprocess.run(
            command,
            check=check,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=120,
            user=self.user,
            cwd=self.root,
        )

    def start(self) -> None:
        """Start the server (crash recovery first if it was stopped ``immediate``); waits until ready."""
        self._run(
            "pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-l", str(self.root / "log"),
            "-o", f"-h 127.0.0.1 -p {self.port} -k {self.root} -c max_connections=200", "start",
        )  # fmt: skip

    def stop(self, mode: Literal["immediate", "fast"]) -> None:
        """``immediate``: every process quits at once, no checkpoint (like a crash); ``fast``: clients
        are disconnected, a checkpoint is written."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-m", mode, "stop")
        self.restarts += 1

    def ensure_running(self) -> None:
        """Start the server if it is down (a run that failed between a stop and its start)."""
        if self._run("pg_ctl", "-D", str(self.data), "status", check=False).returncode != 0:
            self.start()

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def log_tail(self, chars: int = 3000) -> str:
        path = self.root / "log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def destroy(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "-m", "immediate", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)

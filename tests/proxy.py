"""A TCP proxy the tests switch off and on, to take a broker away from the relay without touching
the broker itself (the machine's brokers are shared)."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from psycopg.conninfo import conninfo_to_dict


class Proxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        # A host that is a folder is a Unix socket's (libpq's convention), as the embedded
        # PostgreSQL of `make test` has.
        self.target: tuple[str, int] | str = (
            f"{target_host}/.s.PGSQL.{target_port}"
            if target_host.startswith("/")
            else (target_host, target_port)
        )
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        # A port below the kernel's ephemeral range: while the proxy is down, an outgoing
        # connection could otherwise be given its port as a source port and keep it.
        rng = random.Random()
        for _ in range(200):
            self.port = rng.randrange(20000, 32000)
            try:
                self.up()
                return
            except OSError:
                continue
        raise OSError("no free port for the test proxy")

    def up(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", self.port))
        except OSError:
            s.close()
            raise
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def down(self) -> None:
        """Refuse new connections and cut the open ones (both directions)."""
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            with contextlib.suppress(OSError):
                self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                c.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                if isinstance(self.target, str):
                    upstream = socket.socket(socket.AF_UNIX)
                    upstream.settimeout(5)
                    upstream.connect(self.target)
                else:
                    upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def database_proxy(url: str) -> tuple[Proxy, str]:
    """A proxy in front of the database of ``url`` (TCP or Unix socket), and the URL through it."""
    params = conninfo_to_dict(url)
    proxy = Proxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k not in ("host", "port")])
    netloc = f"{user}@127.0.0.1:{proxy.port}" if user else f"127.0.0.1:{proxy.port}"
    return proxy, urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))

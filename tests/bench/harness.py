"""The benchmark's harness: a fresh database per workload (cloned from a migrated template), pgbench,
the peers' databases, and the record of every figure, per repetition."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from postbox.schema import migrate
from tests.bench.report import Result
from tests.bench.scripts import BENCH_DDL
from tests.conftest import _conninfo_url


class Harness:
    """Databases on one server (``admin_url``: a superuser's), and the figures recorded so far."""

    def __init__(self, admin_url: str, quick: bool) -> None:
        self.admin_url = admin_url
        self.quick = quick
        self.params = {k: str(v) for k, v in conninfo_to_dict(admin_url).items() if v is not None}
        self.results: dict[str, Result] = {}
        self.extra: dict[str, Any] = {}
        self.template = f"postbox_bench_tmpl_{uuid.uuid4().hex[:6]}"
        self._create(self.template)
        url = self.url(self.template)
        migrate.upgrade(url)
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(BENCH_DDL)
        self.created: list[str] = [self.template]
        self._kafka: Any = None  # a Tansu broker (tests/kafka_broker.py), started when first needed
        self._last = time.monotonic()  # each record prints how long its workload took

    def url(self, db: str) -> str:
        return _conninfo_url(dict(self.params, dbname=db))

    def _create(self, name: str, template: str | None = None) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            c.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))

    def fresh(self) -> str:
        name = f"postbox_bench_{uuid.uuid4().hex[:8]}"
        self._create(name, self.template)
        self.created.append(name)
        return self.url(name)

    def fresh_empty(self) -> str:
        """A new database without Postbox (for a peer queue), with the benchmark tables."""
        name = f"postbox_bench_peer_{uuid.uuid4().hex[:8]}"
        self._create(name)
        self.created.append(name)
        url = self.url(name)
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(BENCH_DDL)
        return url

    # --- peers: procrastinate and pgqueuer (the `bench` extra) --------------------------------

    def peer(self, kind: str) -> str:
        from tests.bench import peers

        url = self.fresh_empty()
        peers.install(kind, url)
        return url

    def peer_drain(self, kind: str, n: int, keys: int, ordered: bool, cap: float) -> float:
        from tests.bench import peers

        rate, bad = peers.drain(
            kind, self.peer(kind), n, keys, ordered, processes=2, concurrency=2, cap_seconds=cap
        )
        if ordered and bad:
            self.extra.setdefault("peer order violations", {})[kind] = bad
            print(f"  ! {kind} broke per-key order {bad} times", flush=True)
        return rate

    def drop(self, url: str) -> None:
        """Drop a database of this run now rather than at cleanup (a large one: disk space)."""
        name = conninfo_to_dict(url)["dbname"]
        with psycopg.connect(self.admin_url, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if name in self.created:
            self.created.remove(name)

    def kafka(self) -> Any:
        """The run's Kafka-compatible broker (a tests.kafka_broker.Tansu, in-memory storage),
        started at the first call and killed by :meth:`cleanup`."""
        if self._kafka is None:
            from tests.kafka_broker import Tansu

            self._kafka = Tansu().start()
        return self._kafka

    def cleanup(self) -> None:
        if self._kafka is not None:
            self._kafka.close()
        with psycopg.connect(self.admin_url, autocommit=True) as c:
            for name in reversed(self.created):
                c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def failed(self, name: str, error: AssertionError) -> None:
        """A workload whose result broke an invariant (a relay's rows lost or reordered at the
        broker): no figure for this repetition; the run goes on, lists it on its page and exits
        non-zero."""
        why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self.extra.setdefault("failures", []).append(f"{name}: {why}")
        self._last = time.monotonic()
        print(f"  ! {name}: FAILED: {why}", flush=True)

    def record(self, name: str, unit: str, value: float) -> None:
        r = self.results.setdefault(name, Result(name, unit))
        r.runs.append(value)
        now = time.monotonic()
        took, self._last = now - self._last, now
        print(f"  {name}: {value:,.1f} {unit}  ({took:.0f} s)", flush=True)

    # --- references: pgbench -----------------------------------------------------------------

    def pgbench(self, script: str, clients: int, threads: int, seconds: int, url: str | None = None) -> float:
        exe = shutil.which("pgbench") or next(
            iter(sorted(Path("/usr/lib/postgresql").glob("*/bin/pgbench"))), None
        )
        if exe is None:
            raise RuntimeError("pgbench not found")
        url = url or self.fresh()
        with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
            f.write(script)
        out = subprocess.run(
            [str(exe), "-n", "-f", f.name, "-c", str(clients), "-j", str(threads), "-T", str(seconds), url],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        os.unlink(f.name)
        for line in out.splitlines():
            if line.startswith("tps = "):
                return float(line.split()[2])
        raise RuntimeError(f"no tps in pgbench output: {out}")

    def server(self) -> tuple[str, str, str]:
        """The server's version, its ``synchronous_commit`` and its ``autovacuum`` (for the machine
        summary)."""
        with psycopg.connect(self.admin_url, autocommit=True) as c:
            shown = [
                c.execute(f"SHOW {name}").fetchone()
                for name in ("server_version", "synchronous_commit", "autovacuum")
            ]
        version, sync, autovacuum = (str(row[0]) if row else "?" for row in shown)
        return version, sync, autovacuum


def wait(check: Callable[[], bool], timeout: float) -> None:
    """Poll ``check`` until it holds; a setup that does not converge in ``timeout`` seconds fails."""
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            raise TimeoutError("benchmark setup did not converge")
        time.sleep(0.05)


def rss_mb(pid: int) -> float:
    """A process's peak resident memory so far (VmHWM), in MB; 0 once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int | str) -> tuple[str, list[str]] | None:
    """A process's name and the fields of /proc/PID/stat after it; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    head, _, rest = text.rpartition(")")
    return head.partition("(")[2], rest.split()


def process_cpu(pid: int) -> float:
    """A process's CPU time so far (user and system, all its threads), in seconds; 0 once it is gone."""
    stat = _stat(pid)
    return (int(stat[1][11]) + int(stat[1][12])) / _TICK if stat else 0.0


def children_cpu() -> float:
    """The CPU time (user and system, seconds) of this process's children that ended and were waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def server_cpu(conn: psycopg.Connection[Any]) -> float | None:
    """The CPU time (user and system, seconds) of the PostgreSQL server ``conn`` is connected to, all
    its processes so far: the postmaster's children alive now, and the postmaster with the children it
    has reaped (backends that ended). None when the server does not run on this machine.

    A backend's time moves to the postmaster's when the postmaster reaps it. Reaped while the
    children are read, it would be in neither reading: the reading is taken again until the
    postmaster's reaped time is the same before and after it. A backend that has exited but is not
    reaped yet (a zombie) shows no time of its own: the reading waits, up to 5 s, until none is left
    (the backends of a pgbench that just ended)."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    backend = _stat(row[0]) if row else None
    if backend is None or backend[0] != "postgres":
        return None
    postmaster = backend[1][1]
    deadline = time.monotonic() + 5.0
    while True:
        own = _stat(postmaster)
        if own is None or own[0] != "postgres":
            return None
        ticks = sum(int(x) for x in own[1][11:15])  # utime, stime, cutime, cstime
        ended = False
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                stat = _stat(entry.name)
                if stat is not None and stat[1][1] == postmaster:
                    ended = ended or stat[1][0] in ("Z", "X")
                    ticks += int(stat[1][11]) + int(stat[1][12])
        again = _stat(postmaster)
        settled = again is not None and again[1][13:15] == own[1][13:15] and not ended
        if settled or time.monotonic() > deadline:
            return ticks / _TICK
        time.sleep(0.01)


def cpu_times() -> tuple[int, int] | None:
    """The machine's CPU time so far, in ticks: (stolen by the hypervisor, all); None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_share(since: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time the hypervisor took since ``since`` (a ``cpu_times()``)."""
    now = cpu_times()
    if since is None or now is None or now[1] <= since[1]:
        return None
    return (now[0] - since[0]) / (now[1] - since[1])

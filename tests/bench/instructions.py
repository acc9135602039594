"""What receiving costs the server, counted instead of timed: instructions per message.

A timed figure on a shared machine moves with its neighbours (pgbench's own single INSERT has
moved by 48 % between two repetitions of one run). valgrind's callgrind counts the instructions a
PostgreSQL backend executes, and the count for the same work is the same whatever else the machine
does. So the receive workloads are also run here, with pgqueuer's enqueue beside them, in a
single-user backend (``postgres --single``) of a throwaway cluster under callgrind.

Each workload runs twice, in a fresh copy of its database: ``warm`` units (batches, or single
messages), then ``warm + more``. The difference, divided by the messages of the ``more`` units, is
the count per message: start-up, catalog caches and first plans cancel out. Each side gets the same
messages as ``receive_workloads``, as one prepared statement with its parameters as text, as a
client sends them; each statement is its own transaction, its commit included (``fsync`` is off,
and a flush is not counted anyway). This is the server's share only: the client's is not counted,
and a commit's wait for the disk is not an instruction.

Needs valgrind and PostgreSQL's server programs (``initdb``, ``pg_ctl``, ``postgres``); as root, a
``postgres`` user to run them. Without them, :func:`unavailable` says what is missing.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg

from postbox.schema import migrate

# The programs' fixed arguments: a throwaway cluster, never flushed.
_SERVER_OPTIONS = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
_CALLGRIND = ["valgrind", "--tool=callgrind", "--dump-instr=no", "--compress-strings=no"]
_TOTAL = re.compile(r"^(?:summary|totals):\s+(\d+)", re.M)

Script = Callable[[int, int], str]  # (units, size) -> the statements of a single-user backend


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _text_array(values: list[str]) -> str:
    """A text[] parameter as a client sends it (text format)."""
    return _lit("{" + ",".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values) + "}")


def _statements(prepare: str, executes: Iterator[str]) -> str:
    """A single-user backend's input (``-j``: a statement ends at a semicolon and a blank line)."""
    return "".join(f"{s};\n\n" for s in (prepare, *executes))


def postbox_batches(units: int, size: int, keyed: bool) -> str:
    """``units`` batches of ``size`` as ``receive_many`` sends them (the columns form, payloads as one
    JSON array), over 500 keys if ``keyed``."""

    def batch(b: int) -> str:
        ids = range(b * size, (b + 1) * size)
        keys = _text_array([f"k{i % 500}" for i in ids]) if keyed else "NULL"
        payloads = _lit(json.dumps([{"i": i} for i in ids]))
        return f"EXECUTE r('bench', {_text_array([str(i) for i in ids])}, {payloads}, {keys})"

    prepare = (
        "PREPARE r(text, text[], jsonb, text[]) AS"
        " SELECT count(*) FROM postbox.inbox_receive_columns_v1($1, $2, $3, $4)"
    )
    return _statements(prepare, (batch(b) for b in range(units)))


def postbox_singles(units: int, size: int, keyed: bool) -> str:
    """``units * size`` single receives (``receive``'s call), over 500 keys if ``keyed``."""

    def one(i: int) -> str:
        key = _lit(f"k{i % 500}") if keyed else "NULL"
        return f"EXECUTE s('bench', {_lit(str(i))}, {_lit(json.dumps({'i': i}))}, {key})"

    prepare = "PREPARE s(text, text, jsonb, text) AS SELECT * FROM postbox.inbox_receive_v1($1, $2, $3, $4)"
    return _statements(prepare, (one(i) for i in range(units * size)))


def two_rows_singles(units: int, size: int) -> str:
    """``units * size`` times the two rows a receive writes, with the checks deduplication and one
    head per key need, in one prepared statement and no function: a single receive's floor (the
    statement of pgbench's reference, with the receive's payload hash)."""

    def one(i: int) -> str:
        return f"EXECUTE t('bench', {_lit(json.dumps({'i': i}))})"

    prepare = (
        "PREPARE t(text, jsonb) AS WITH n AS (SELECT nextval('postbox.inbox_id_seq') AS id),"
        " d AS (INSERT INTO postbox.inbox_dedup (consumer, message_id, payload_hash, inbox_id)"
        " SELECT $1, id::text, decode(md5($2::text), 'hex'), id FROM n ON CONFLICT DO NOTHING)"
        " INSERT INTO postbox.inbox (id, consumer, message_id, key, position, payload, state)"
        " SELECT id, $1, id::text, id::text, id, $2, 'ready' FROM n"
        " ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING"
    )
    return _statements(prepare, (one(i) for i in range(units * size)))


def _pgqueuer_arrays(ids: range) -> str:
    """pgqueuer's enqueue parameters for jobs ``ids``, as tests/bench/peers.py enqueues them."""
    n = len(ids)
    payloads = ["\\\\x" + json.dumps({"i": i, "k": f"k{i % 500}", "s": i // 500}).encode().hex() for i in ids]
    return ", ".join(
        _lit("{" + ",".join(values) + "}")
        for values in (
            ["0"] * n,
            ["bench"] * n,
            [f'"{p}"' for p in payloads],
            ['"0"'] * n,
            ["NULL"] * n,
            ["NULL"] * n,
        )
    )


_PGQUEUER_TYPES = "int[], text[], bytea[], interval[], text[], jsonb[]"


def pgqueuer_batches(units: int, size: int) -> str:
    """``units`` batches of ``size`` through pgqueuer's own enqueue statement (in the function
    ``pgqueuer_enqueue_bench``: its rows counted, as for Postbox, not printed)."""
    prepare = (
        f"PREPARE q({_PGQUEUER_TYPES}) AS SELECT count(*) FROM pgqueuer_enqueue_bench($1, $2, $3, $4, $5, $6)"
    )
    return _statements(
        prepare, (f"EXECUTE q({_pgqueuer_arrays(range(b * size, (b + 1) * size))})" for b in range(units))
    )


def pgqueuer_singles(units: int, size: int) -> str:
    """``units * size`` single enqueues: pgqueuer's statement itself, prepared (as asyncpg does)."""
    prepare = f"PREPARE q({_PGQUEUER_TYPES}) AS {_pgqueuer_statement()}"
    return _statements(
        prepare, (f"EXECUTE q({_pgqueuer_arrays(range(i, i + 1))})" for i in range(units * size))
    )


def _pgqueuer_statement() -> str:
    """pgqueuer's enqueue statement, as the installed pgqueuer builds it (its casts dropped: the
    prepared statement declares the types)."""
    from pgqueuer.adapters.persistence.qb import QueryQueueBuilder

    sql = QueryQueueBuilder().build_enqueue_query()
    sql = "\n".join(line for line in sql.splitlines() if line.strip() and not line.strip().startswith("--"))
    for n, kind in enumerate(_PGQUEUER_TYPES.split(", "), start=1):
        sql = sql.replace(f"${n}::{kind}", f"${n}")
    return sql


def pgqueuer_function() -> str:
    return (
        f"CREATE FUNCTION pgqueuer_enqueue_bench({_PGQUEUER_TYPES}) RETURNS TABLE (ord bigint, id bigint)"
        f" LANGUAGE sql AS $fn$\n{_pgqueuer_statement()}\n$fn$"
    )


# --- the throwaway cluster -----------------------------------------------------------------------


def _server_programs() -> Path | None:
    """The directory of PostgreSQL's server programs: pg_config's, else Debian's newest."""
    found = []
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False)
        found.append(Path(out.stdout.strip()))
    found += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True)
    for bindir in found:
        if all((bindir / name).is_file() for name in ("initdb", "pg_ctl", "postgres")):
            return bindir
    return None


def _runner() -> pwd.struct_passwd | None:
    """Who runs the server: this user, or (as root, which initdb refuses) ``postgres``."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid())
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        return None


def unavailable() -> str | None:
    """Why the count cannot run on this machine, or None."""
    if shutil.which("valgrind") is None:
        return "valgrind is not installed"
    if _server_programs() is None:
        return "PostgreSQL's server programs (initdb, pg_ctl, postgres) are not installed"
    if _runner() is None:
        return "running as root, and there is no 'postgres' user to run PostgreSQL's server as"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    """A cluster in ``home`` (its own user, port and data directory), started and stopped at will."""

    home: Path
    bindir: Path
    user: pwd.struct_passwd
    port: int

    @property
    def data(self) -> Path:
        return self.home / "data"

    def url(self, db: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def run(self, args: list[str], **kwargs: object) -> subprocess.CompletedProcess[bytes]:
        as_user = {"user": self.user.pw_uid, "group": self.user.pw_gid} if os.geteuid() == 0 else {}
        return subprocess.run(args, cwd=self.home, check=False, **as_user, **kwargs)  # type: ignore[call-overload, no-any-return]

    def _checked(self, args: list[str]) -> None:
        done = self.run(args, capture_output=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(args[:2])} failed: {done.stderr.decode(errors='replace')[-500:]}")

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.home} {_SERVER_OPTIONS}"
        log = str(self.home / "server.log")
        self._checked(
            [str(self.bindir / "pg_ctl"), "start", "-w", "-D", str(self.data), "-l", log, "-o", options]
        )

    def stop(self) -> None:
        self._checked([str(self.bindir / "pg_ctl"), "stop", "-w", "-m", "fast", "-D", str(self.data)])

    def count(self, db: str, script: str) -> int:
        """Instructions a single-user backend on ``db`` executes for ``script`` (the server stopped)."""
        (self.home / "in.sql").write_text(script)
        out = self.home / "callgrind.out"
        out.unlink(missing_ok=True)
        backend = [
            str(self.bindir / "postgres"),
            "--single",
            "-j",
            "-D",
            str(self.data),
            *_SERVER_OPTIONS.split(),
            db,
        ]
        with open(self.home / "in.sql", "rb") as stdin:
            done = self.run(
                [*_CALLGRIND, f"--callgrind-out-file={out}", *backend],
                stdin=stdin,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        errors = [line for line in done.stderr.decode(errors="replace").splitlines() if "ERROR:" in line]
        if done.returncode or errors:
            why = errors[0] if errors else f"exit status {done.returncode}"
            raise RuntimeError(f"the single-user backend failed: {why}")
        total = _TOTAL.search(out.read_text())
        if total is None:
            raise RuntimeError(f"no instruction total in {out}")
        return int(total.group(1))


@contextmanager
def cluster() -> Iterator[Cluster]:
    """A new cluster, initialised and started; removed after."""
    bindir, user = _server_programs(), _runner()
    assert bindir is not None and user is not None, unavailable()
    home = Path(tempfile.mkdtemp(prefix="postbox-bench-instructions-"))
    try:
        os.chown(home, user.pw_uid, user.pw_gid)
        c = Cluster(home, bindir, user, _free_port())
        c._checked(
            [str(bindir / "initdb"), "-D", str(c.data), "-A", "trust", "-U", "postgres", "-N", "-E", "UTF8"]
        )
        c.start()
        try:
            yield c
        finally:
            c.stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)


@dataclass(frozen=True)
class Workload:
    """One figure: ``script(units, size)`` run in a copy of database ``template``."""

    name: str
    template: str
    script: Script
    size: int
    warm: int
    more: int


def per_message(c: Cluster, w: Workload) -> float:
    """``w``'s instructions per message: two counts in fresh copies of its database (the server is
    up before and after)."""
    copies = [f"{w.template}_warm", f"{w.template}_more"]
    with psycopg.connect(c.url("postgres"), autocommit=True) as conn:
        for copy in copies:
            conn.execute(f'DROP DATABASE IF EXISTS "{copy}"')
            conn.execute(f'CREATE DATABASE "{copy}" TEMPLATE "{w.template}"')
    c.stop()
    try:
        short = c.count(copies[0], w.script(w.warm, w.size))
        long = c.count(copies[1], w.script(w.warm + w.more, w.size))
    finally:
        c.start()
    return (long - short) / (w.more * w.size)


def prepare(c: Cluster, with_pgqueuer: bool) -> None:
    """The two templates: Postbox's schema (``postbox``) and pgqueuer's with its enqueue statement
    as a function (``pgqueuer``)."""
    with psycopg.connect(c.url("postgres"), autocommit=True) as conn:
        conn.execute("CREATE DATABASE postbox")
        if with_pgqueuer:
            conn.execute("CREATE DATABASE pgqueuer")
    migrate.upgrade(c.url("postbox"))
    if with_pgqueuer:
        from tests.bench import peers

        peers.install("pgqueuer", c.url("pgqueuer"))
        with psycopg.connect(c.url("pgqueuer"), autocommit=True) as conn:
            conn.execute(pgqueuer_function())

"""Runs one fault scenario: load on, fault injected and healed ``iterations`` times, load off,
backlog drained, invariants checked (``tests.chaos.verdict``)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psycopg

from tests import previous_release
from tests.apps.chaos import CONSUMER, DESTINATION
from tests.chaos import kafka as chaos_kafka
from tests.chaos.kafka import KafkaBrokerLog
from tests.chaos.load import BrokerLog, ProducerLog, Producers
from tests.chaos.pgcluster import PrivateCluster
from tests.chaos.verdict import EFFECTS_DDL, Verdict, check
from tests.helpers import REPO, SESSION_OF_ITS_OWN, eventually
from tests.kafka_broker import Tansu
from tests.proxy import Proxy

APP = "tests.apps.chaos:registry"
MAX_ATTEMPTS = 1000
# Worker and relay settings that make a fault show quickly: short polls, heartbeats, stale detection.
WORKER_ARGS = (
    "--concurrency", "3", "--batch-size", "10", "--poll-interval", "0.05", "--heartbeat-interval", "0.3",
    "--stale-after", "1.5", "--grace-period", "5", "--handler-timeout", "2",
)  # fmt: skip
RELAY_ARGS = (
    "--concurrency", "1", "--batch-size", "20", "--poll-interval", "0.05", "--heartbeat-interval", "0.3",
    "--stale-after", "1.5", "--grace-period", "5", "--lease", "5",
)  # fmt: skip


class Processes:
    """Real ``postbox`` processes, restarted when they die; output goes to files (a full pipe would
    stall a process that logs a lot while its database is away)."""

    def __init__(
        self,
        name: str,
        args: list[str],
        count: int,
        env: dict[str, str],
        logdir: Path,
        expected_exits: tuple[int, ...] = (),
    ) -> None:
        self.name = name
        self.expected_exits = expected_exits
        self.args = [sys.executable, "-m", "postbox", *args]
        self.env = {**os.environ, "PYTHONPATH": str(REPO), **env}
        self.release_of: dict[int, str] = {}  # pid -> the PYTHONPATH (release) it was started with
        self.logdir = logdir
        self.spawned = 0
        self.restarts = 0
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self._log_of: dict[int, int] = {}  # pid -> log file number
        self.stopped: set[int] = set()
        self.exits: dict[str, int] = {}
        for _ in range(count):
            self.procs.append(self._spawn())

    def _spawn(self) -> subprocess.Popen[bytes]:
        self.spawned += 1
        log = open(self.logdir / f"{self.name}-{self.spawned}.log", "wb")  # noqa: SIM115
        self._logs.append(log)
        p = subprocess.Popen(
            self.args, env=self.env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log,
            start_new_session=SESSION_OF_ITS_OWN,  # F2 SIGSTOPs them: no SIGHUP from an orphaned group
        )  # fmt: skip
        self._log_of[p.pid] = self.spawned
        self.release_of[p.pid] = self.env["PYTHONPATH"]
        return p

    def log_tail(self, index: int, chars: int = 2000) -> str:
        path = self.logdir / f"{self.name}-{index}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def keep_alive(self) -> None:
        """Restart dead processes. Killed ones are expected; one that exits because the database is
        unreachable at start-up (during a restart) too, and the fault's ``expected_exits`` (a worker
        with too many stuck handler threads exits 70 for its supervisor); anything else is a failure."""
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                continue
            tail = self.log_tail(self._log_of[p.pid])
            unreachable_at_start = p.returncode == 1 and "cannot reach the database" in tail
            expected = p.returncode in (-signal.SIGKILL, -signal.SIGTERM, 0, *self.expected_exits)
            if not expected and not unreachable_at_start:
                raise AssertionError(f"{self.name} exited with {p.returncode}: {tail}")
            if p.returncode != -signal.SIGKILL:
                reason = f"{self.name} exit {p.returncode}"
                self.exits[reason] = self.exits.get(reason, 0) + 1
                if os.environ.get("CHAOS_DEBUG"):
                    print(f"{reason}: {tail}", file=sys.stderr)
            self.procs[i] = self._spawn()
            self.restarts += 1

    def count_in_logs(self, text: str) -> int:
        return sum(
            (self.logdir / f"{self.name}-{i}.log").read_text(errors="replace").count(text)
            for i in range(1, self.spawned + 1)
        )

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.procs if p.poll() is None]

    def signal_random(
        self, rng: random.Random, sig: int, prefer: set[int] | None = None
    ) -> subprocess.Popen[bytes] | None:
        """Send ``sig`` to a random running process, one of the ``prefer`` pids if any is running."""
        alive = [p for p in self.alive() if p.pid not in self.stopped]
        preferred = [p for p in alive if p.pid in (prefer or set())]
        if not alive:
            return None
        p = rng.choice(preferred or alive)
        p.send_signal(sig)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self._logs:
            log.close()


@dataclass
class Rig:
    """Everything a fault acts on."""

    url: str
    workers: Processes
    relays: Processes
    proxy: Proxy
    cluster: PrivateCluster | None
    rng: random.Random
    notes: dict[str, int] = field(default_factory=dict)

    def note(self, what: str, n: int = 1) -> None:
        self.notes[what] = self.notes.get(what, 0) + n

    def tick(self) -> None:
        self.workers.keep_alive()
        self.relays.keep_alive()

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds`` while keeping the processes alive (restarting killed ones)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.tick()
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))


@dataclass(frozen=True)
class Fault:
    """``inject`` breaks something, ``heal`` repairs it ``hold`` seconds later; ``gap`` seconds of
    normal operation separate two injections. ``env`` is given to the worker processes,
    ``worker_args`` added to their command line (after ``WORKER_ARGS``, so they override them);
    ``expected_exits`` are exit statuses of workers that are restarted, not failures."""

    name: str
    description: str
    inject: Callable[[Rig], None]
    heal: Callable[[Rig], None]
    hold: float
    gap: float
    env: dict[str, str] = field(default_factory=dict)
    needs_cluster: bool = False
    worker_args: tuple[str, ...] = ()
    expected_exits: tuple[int, ...] = ()
    # Start at the previous release: its schema (migrated by it) and its workers and relay.
    from_previous_release: bool = False
    # The relay's destination: "rabbitmq" (the machine's, through the proxy) or "kafka" (a Tansu
    # broker of the run's own, behind the proxy: tests/chaos/kafka.py).
    broker: str = "rabbitmq"

    @property
    def ident(self) -> str:
        """Its short name: ``F5``, ``F5-kafka`` (CHAOS_FAULTS takes either, ``F5`` picks both)."""
        return self.name.split()[0] + ("-kafka" if self.broker == "kafka" else "")


@dataclass
class Result:
    fault: str
    iterations: int
    seconds: float
    verdict: Verdict
    notes: dict[str, int]

    def row(self) -> dict[str, Any]:
        return {"fault": self.fault, "iterations": self.iterations, "seconds": round(self.seconds, 1),
                **self.verdict.summary(), "notes": self.notes}  # fmt: skip


def _relay_config(path: Path, proxy_port: int, queue: str) -> None:
    path.write_text(
        f"[destinations.{DESTINATION}]\n"
        'kind = "rabbitmq"\n'
        f'url = "amqp://guest:guest@127.0.0.1:{proxy_port}/%2F"\n'
        f'routing_key = "{queue}"\n'
        'retry = { strategy = "exponential_full_jitter", base_delay = 0.05, max_delay = 0.5,'
        " max_attempts = 100000 }\n"
    )


def _registered(url: str, workers: int) -> bool:
    """Whether every worker and the relay have started (registered in postbox.workers)."""
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(
            "SELECT count(*) FILTER (WHERE kind = 'worker'), count(*) FILTER (WHERE kind = 'relay')"
            " FROM postbox.workers"
        ).fetchone()
    return row is not None and row[0] >= workers and row[1] >= 1


def _stuck(url: str) -> str:
    """What is left in the inbox and outbox, with the keys' repair records: for a failed drain."""
    with psycopg.connect(url, autocommit=True) as c:
        parts = []
        for sql in (
            "SELECT id, message_id, key, state, attempt, available_at, claimed_by FROM postbox.outbox ORDER BY id LIMIT 10",
            "SELECT id, message_id, key, state, attempt, available_at, claimed_by FROM postbox.inbox ORDER BY id LIMIT 10",
            "SELECT * FROM postbox.key_repairs LIMIT 10",
            "SELECT id, kind, queue, heartbeat_at FROM postbox.workers",
            "SELECT now()",
        ):
            parts.append(f"{sql}:\n" + "\n".join(map(str, c.execute(sql).fetchall())))  # type: ignore[arg-type]
    return "\n".join(parts)


def _failed_sends(url: str) -> int:
    """How many of the relay's sends failed (and were retried)."""
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute("SELECT count(*) FROM postbox.attempts WHERE origin = 'outbox'").fetchone()
    return int(row[0]) if row else 0


def _drained(url: str, broker: BrokerLog | KafkaBrokerLog) -> bool:
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=3) as c:
            row = c.execute(
                "SELECT (SELECT count(*) FROM postbox.inbox WHERE consumer = %s),"
                " (SELECT count(*) FROM postbox.outbox),"
                " (SELECT count(DISTINCT message_id) FROM chaos_effects)",
                (CONSUMER,),
            ).fetchone()
    except psycopg.OperationalError:
        return False
    assert row is not None
    delivered = {d.message_id for d in broker.received}
    return row[0] == 0 and row[1] == 0 and len(delivered) >= row[2]


def run_fault(
    fault: Fault,
    url: str,
    *,
    iterations: int,
    cluster: PrivateCluster | None = None,
    rate: float = 60.0,
    keys: int = 40,
    processes: int = 2,
    drain_bound: float = 90.0,
    seed: int = 1,
) -> Result:
    """Run ``fault`` ``iterations`` times under load against the migrated database at ``url``."""
    queue = f"postbox-chaos-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="postbox-chaos-") as tmp:
        logdir = Path(tmp)
        release_env: dict[str, str] = {}
        if fault.from_previous_release:
            previous = previous_release.unpack(logdir)
            made = previous.postbox("--database-url", url, "migrate")
            assert made.returncode == 0, made.stderr
            release_env = {"PYTHONPATH": previous.env["PYTHONPATH"]}
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(EFFECTS_DDL)
        config = logdir / "relay.toml"
        kafka: Tansu | None = None
        broker: BrokerLog | KafkaBrokerLog
        if fault.broker == "kafka":
            kafka, proxy = chaos_kafka.start_broker()
            chaos_kafka.relay_config(config, DESTINATION, proxy.port, queue)
            broker = KafkaBrokerLog(kafka, queue)
        else:
            proxy = Proxy("127.0.0.1", 5672)
            _relay_config(config, proxy.port, queue)
            broker = BrokerLog(queue)
        broker.start()
        env = {
            "CHAOS_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
            "CHAOS_PERMANENT_RATE": "0.01",
            "CHAOS_FAIL_RATE": "0.03",
            "CHAOS_DATABASE_URL": url,
            **fault.env,
            **release_env,
        }
        workers = Processes(
            "worker",
            ["--database-url", url, "worker", "--consumer", CONSUMER, "--app", APP, *WORKER_ARGS,
             *fault.worker_args],
            processes,
            env,
            logdir,
            fault.expected_exits,
        )  # fmt: skip
        relays = Processes(
            "relay",
            ["--config", str(config), "--database-url", url, "relay", *RELAY_ARGS],
            1,
            release_env,
            logdir,
        )
        rig = Rig(url, workers, relays, proxy, cluster, random.Random(seed))
        log = ProducerLog()
        producers = Producers(url, CONSUMER, log, rate=rate, threads=2, keys=keys)
        drain: float | None = None
        try:
            try:
                eventually(lambda: _registered(url, processes), timeout=60, what="processes started")
            except AssertionError as error:  # say why: the processes' own words
                tails = [
                    f"{g.name} {i}: {g.log_tail(i, 600)}"
                    for g in (workers, relays)
                    for i in sorted({1, g.spawned})
                ]
                raise AssertionError(f"{error}\n" + "\n".join(tails)) from None
            producers.start()
            rig.wait(fault.gap)
            for _ in range(iterations):
                fault.inject(rig)
                rig.wait(fault.hold)
                fault.heal(rig)
                rig.wait(fault.gap)
            producers.stop()
            healed = time.monotonic()
            deadline = healed + drain_bound
            while not _drained(url, broker):
                if time.monotonic() > deadline:
                    break
                rig.tick()
                time.sleep(0.1)
            else:
                drain = time.monotonic() - healed
            if drain is None and isinstance(broker, KafkaBrokerLog):
                rig.notes["records a fresh reader finds in the topic"] = broker.count_afresh()
                rig.notes["records the log read"] = len(broker.received)
        finally:
            if cluster is not None:
                cluster.ensure_running()
            producers.stop()
            workers.stop()
            relays.stop()
            broker.stop()
            proxy.down()
            if kafka is not None:
                kafka.close()
        verdict = check(
            url,
            CONSUMER,
            log,
            broker.received,
            max_attempts=MAX_ATTEMPTS,
            permanent_rate=float(env["CHAOS_PERMANENT_RATE"]),
            misbehave_rate=float(env.get("CHAOS_MISBEHAVE_RATE", "0")),
        )
        verdict.drain_seconds = None if drain is None else round(drain, 2)
        notes = {**rig.notes, **workers.exits, **relays.exits}
        notes["late completions refused by the fence"] = workers.count_in_logs("claims lost for")
        if "CHAOS_MISBEHAVE_RATE" in env:
            notes["slots abandoned"] = workers.count_in_logs('"event": "handler_abandoned"')
            # Handlers declared database_only: a failure undid its neighbours' effects with its own.
            notes["shared savepoints split by a failure"] = workers.count_in_logs(
                '"event": "shared_savepoint_split"'
            )
        if fault.broker == "kafka":
            notes["relay attempts failed"] = _failed_sends(url)
            if isinstance(broker, KafkaBrokerLog):
                notes["broker log reader replaced after a quiet spell"] = broker.reopened
                notes["broker log reader errors"] = "; ".join(broker.errors[-3:])
                if broker.longest_call_s > 1.0:  # a call is 0.2 s: only a stalled client shows
                    notes["broker log reader's longest call (s)"] = round(broker.longest_call_s, 1)
        notes = {k: v for k, v in notes.items() if v}
        if drain is None:
            worker_tail = workers.log_tail(workers.spawned)
            raise AssertionError(
                f"{fault.name}: backlog did not drain within {drain_bound}s: {verdict.problems()} {notes}"
                f"\nlast worker log: {worker_tail}\nrelay log: {relays.log_tail(relays.spawned)}\n{_stuck(url)}"
            )
    return Result(fault.name, iterations, time.monotonic() - started, verdict, notes)

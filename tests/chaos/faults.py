"""The faults F1..F7 of the chaos harness, as inject/heal pairs acting on a ``Rig``; F5 twice, for
RabbitMQ and for Kafka."""

from __future__ import annotations

import signal

import psycopg

from tests.chaos.harness import Fault, Rig
from tests.chaos.load import PRODUCER_APP
from tests.helpers import REPO


def _busy_pids(rig: Rig) -> set[int]:
    """Pids of the workers holding claimed messages right now (their ids are host:pid:suffix)."""
    try:
        with psycopg.connect(rig.url, autocommit=True, connect_timeout=3) as c:
            rows = c.execute(
                "SELECT DISTINCT split_part(claimed_by, ':', 2) FROM postbox.inbox WHERE state = 'running'"
            ).fetchall()
    except psycopg.OperationalError:
        return set()
    return {int(r[0]) for r in rows if r[0] and r[0].isdigit()}


def _kill_worker(rig: Rig) -> None:
    """kill -9 of a worker with messages in flight (any worker if none has)."""
    p = rig.workers.signal_random(rig.rng, signal.SIGKILL, prefer=_busy_pids(rig))
    if p is not None:
        p.wait()
        # Checked after it died: claims it still holds can only be taken over after their lease.
        rig.note("kill -9 of a worker holding claims" if p.pid in _busy_pids(rig) else "kill -9")


def _stop_worker(rig: Rig) -> None:
    """SIGSTOP of a worker with messages in flight (any worker if none has)."""
    p = rig.workers.signal_random(rig.rng, signal.SIGSTOP, prefer=_busy_pids(rig))
    if p is not None:
        rig.workers.stopped.add(p.pid)
        # Checked once it is stopped: claims it still holds can only be taken over after their lease.
        rig.note("SIGSTOP of a worker holding claims" if p.pid in _busy_pids(rig) else "SIGSTOP")


def _continue_workers(rig: Rig) -> None:
    for p in rig.workers.procs:
        if p.pid in rig.workers.stopped and p.poll() is None:
            p.send_signal(signal.SIGCONT)
    rig.workers.stopped.clear()


def _terminate_connections(rig: Rig) -> None:
    """pg_terminate_backend on a random half of the worker, relay and producer connections."""
    with psycopg.connect(rig.url, autocommit=True) as c:
        rows = c.execute(
            "SELECT pid, application_name FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND (application_name LIKE 'postbox-%%' OR application_name = %s)",
            (PRODUCER_APP,),
        ).fetchall()
        victims = [r for r in rows if rig.rng.random() < 0.5] or rows[:1]
        for pid, app in victims:
            c.execute("SELECT pg_terminate_backend(%s)", (pid,))
            rig.note(f"terminated {app.split(':')[0]}")


def _restart(mode: str) -> Fault:
    def inject(rig: Rig) -> None:
        assert rig.cluster is not None
        rig.cluster.stop("immediate" if mode == "immediate" else "fast")
        rig.note(f"pg_ctl stop -m {mode}")

    def heal(rig: Rig) -> None:
        assert rig.cluster is not None
        rig.cluster.start()

    return Fault(
        f"F4 restart {mode}",
        f"PostgreSQL stopped with -m {mode} for 1 s, then started (crash recovery for immediate)",
        inject,
        heal,
        hold=1.0,
        gap=2.5,
        needs_cluster=True,
    )


def _noop(rig: Rig) -> None:
    pass


def _proxy_down(rig: Rig) -> None:
    rig.proxy.down()
    rig.note("broker cut")


def _proxy_up(rig: Rig) -> None:
    rig.proxy.up()


F1 = Fault(
    "F1 kill -9",
    "kill -9 of a random worker from outside, and workers killing themselves before the effect,"
    " after it before commit, and after commit (1% of attempts)",
    _kill_worker,
    _noop,
    hold=0.2,
    gap=0.8,
    env={"CHAOS_DIE_RATE": "0.01"},
)
F2 = Fault(
    "F2 SIGSTOP",
    "SIGSTOP of a random worker mid-handler for 3 s (past --stale-after 1.5 s and --handler-timeout 2 s),"
    " its claims taken over, then SIGCONT",
    _stop_worker,
    _continue_workers,
    hold=3.0,
    gap=0.5,
    env={"CHAOS_HANDLER_SLEEP": "0.05"},
)
F3 = Fault(
    "F3 terminate",
    "pg_terminate_backend on a random half of the worker, relay and producer connections",
    _terminate_connections,
    _noop,
    hold=0.2,
    gap=0.8,
    env={"CHAOS_HANDLER_SLEEP": "0.002"},
)
F4_IMMEDIATE = _restart("immediate")
F4_FAST = _restart("fast")
F5 = Fault(
    "F5 broker outage",
    "the TCP proxy between the relay and RabbitMQ cut (open connections reset, new ones refused) for 2 s",
    _proxy_down,
    _proxy_up,
    hold=2.0,
    gap=1.0,
)
# The same cut in front of Kafka (a Tansu broker of the run's own, tests/chaos/kafka.py). The issue
# asks for the broker killed and restarted; Tansu here keeps its log in memory only, so a restarted
# broker would come back without the topic and the records already written (the reader would see
# them lost though the relay did its part): cutting the broker off the network is the outage that
# keeps it honest. The relay's delivery timeout (2 s) is shorter than the cut, so in-flight records
# fail, the broker fences the producer and the relay makes a new one.
F5_KAFKA = Fault(
    "F5 kafka broker outage",
    "the TCP proxy in front of a Kafka broker (Tansu, which every client reaches through it) cut for"
    " 2 s: open connections reset, new ones refused (a network outage rather than a restart: Tansu"
    " keeps its log in memory only, a restart would empty it)",
    _proxy_down,
    _proxy_up,
    hold=2.0,
    gap=1.0,
    broker="kafka",
)

# F6: handlers that misbehave (tests/apps/chaos.py, ``KINDS``), all the time rather than in windows:
# an iteration is a stretch of load. A 1 s time limit; stuck code ends after 3.5 s (abandoned at
# about 2 s), then tries a late write. A worker past 6 stuck threads exits 70 and is restarted.
MISBEHAVE_RATE = 0.05
MISBEHAVE_TIMEOUT = 1.0


def _misbehaving(batch_size: int, *, database_only: bool = False) -> Fault:
    def inject(rig: Rig) -> None:
        rig.note("misbehaviour windows")

    args: tuple[str, ...] = (
        "--batch-size", str(batch_size), "--handler-timeout", str(MISBEHAVE_TIMEOUT), "--max-stuck-handlers", "6",
    )  # fmt: skip
    if batch_size > 1:
        # Polled, not woken by each message: batches fill up, so that a handler's SQL COMMIT or
        # ROLLBACK has messages before it in its batch to commit or undo.
        args += ("--no-listen", "--poll-interval", "0.5")
    if database_only:
        # The handler declared database_only: its neighbours in a batch share a savepoint.
        args += ("--app", "tests.apps.chaos:shared_registry")

    return Fault(
        f"F6 misbehaving handlers, batch {batch_size}"
        + (", declared database_only" if database_only else ""),
        f"{MISBEHAVE_RATE:.0%} of messages misbehave: commit/rollback/close/autocommit through ctx.conn"
        " (refused), SQL COMMIT and ROLLBACK, sleeping, spinning and blocking an async handler past"
        f" a {MISBEHAVE_TIMEOUT:g} s time limit, SystemExit, KeyboardInterrupt, a swallowed database error;"
        f" batches of {batch_size}"
        + (" (polled every 0.5 s)" if batch_size > 1 else "")
        + (
            "; the handler declared database_only (a batch's neighbours share a savepoint)"
            if database_only
            else ""
        ),
        inject,
        _noop,
        hold=3.0,
        gap=1.0,
        env={
            "CHAOS_MISBEHAVE_RATE": str(MISBEHAVE_RATE),
            "CHAOS_STUCK_SECONDS": "3.5",
            # The run counts the shared savepoints a failure split (an info line each).
            **({"POSTBOX_LOG_LEVEL": "info"} if database_only else {}),
        },
        worker_args=args,
        expected_exits=(70,),
    )


F6_BATCH1 = _misbehaving(1)
F6_BATCH10 = _misbehaving(10)
F6_SHARED = _misbehaving(10, database_only=True)
MISBEHAVING = [F6_BATCH1, F6_BATCH10, F6_SHARED]


# F7: a rolling deploy under load. The run starts at the previous release (its schema, workers and
# relay); the first injection upgrades the schema with this release while they work, then each one
# replaces one process of the previous release by one of this release (SIGTERM: it drains; its
# replacement starts as this release), the workers first; once none is left, a kill -9.
def _roll(rig: Rig) -> None:
    from postbox._version import SCHEMA_REVISION
    from postbox.schema import migrate

    if migrate.current_revision(rig.url) != SCHEMA_REVISION:
        migrate.upgrade(rig.url)
        rig.note("schema upgraded under load")
    for group in (rig.workers, rig.relays):
        group.env["PYTHONPATH"] = str(REPO)  # what starts from now on is this release
        previous = [p for p in group.alive() if group.release_of.get(p.pid) != str(REPO)]
        if previous:
            rig.rng.choice(previous).send_signal(signal.SIGTERM)
            rig.note(f"{group.name} of the previous release replaced")
            return
    _kill_worker(rig)


F7 = Fault(
    "F7 rolling upgrade",
    "the schema upgraded from the previous release under load, then its workers and relay replaced"
    " one by one by this release's (SIGTERM, drain), then kill -9",
    _roll,
    _noop,
    hold=1.0,
    gap=1.5,
    from_previous_release=True,
)

ALL = [F1, F2, F3, F4_IMMEDIATE, F4_FAST, F5, F5_KAFKA, *MISBEHAVING, F7]

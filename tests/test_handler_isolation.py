"""A misbehaving handler harms only its own message: real `postbox worker` processes running the
handlers of tests/apps/misbehaving.py (one slot, batches of 10, a 1 s time limit), checked for
nothing lost, no duplicate effect, and other keys not held."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psycopg
import pytest

import postbox
from tests.helpers import EFFECTS_DDL, eventually, scalar, spawn_postbox
from tests.proxy import database_proxy
from tests.test_metrics_endpoint import request
from tests.test_observability import free_port

TIMEOUT = 1.0
# What a key may wait past a stuck handler's time limit: the cancel, ABANDON_AFTER, the new slot.
HELD_BOUND = 4.0


@pytest.fixture
def db(database):
    with database.connect(autocommit=True) as c:
        c.execute(EFFECTS_DDL)
    return database


def spawn(url: str, *args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    out = open(log, "wb") if log is not None else None  # noqa: SIM115 - the child keeps it
    try:
        return spawn_postbox(
            "--database-url", url, "worker", "--consumer", "mis", "--app", "tests.apps.misbehaving:registry",
            "--concurrency", "1", "--batch-size", "10", "--handler-timeout", str(TIMEOUT),
            "--heartbeat-interval", "0.3", "--stale-after", "1.5", "--poll-interval", "0.05",
            *args,
            stderr=out.fileno() if out is not None else subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        if out is not None:
            out.close()


def produce(url: str, *messages: tuple[str, dict]) -> None:
    """One transaction, so that a worker started afterwards claims them as one batch; each message
    on its own key (its id)."""
    with psycopg.connect(url) as c:
        postbox.receive_many(
            c,
            [
                {"consumer": "mis", "message_id": mid, "key": mid, "payload": payload,
                 **({"type": payload["type"]} if "type" in payload else {})}
                for mid, payload in messages
            ],
        )  # fmt: skip
        c.commit()


def stop(p: subprocess.Popen[bytes]) -> int:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    return p.wait(20)


def live(url: str) -> int:
    return scalar(url, "SELECT count(*) FROM postbox.inbox WHERE state <> 'blocked'")  # type: ignore[return-value]


def effects(url: str) -> dict[str, list[int]]:
    with psycopg.connect(url) as c:
        rows = c.execute("SELECT message_id, attempt FROM effects ORDER BY id").fetchall()
    out: dict[str, list[int]] = {}
    for mid, attempt in rows:
        out.setdefault(mid, []).append(attempt)
    return out


def dead(url: str) -> dict[str, tuple[str, int]]:
    with psycopg.connect(url) as c:
        rows = c.execute("SELECT message_id, reason, attempt FROM postbox.dead_letters").fetchall()
    return {mid: (reason, attempt) for mid, reason, attempt in rows}


def attempts(url: str, message_id: str) -> list[tuple[int, str, str, str]]:
    with psycopg.connect(url) as c:
        return c.execute(
            "SELECT attempt, kind, error_type, decision FROM postbox.attempts WHERE message_id = %s ORDER BY id",
            (message_id,),
        ).fetchall()


@pytest.mark.parametrize(
    ("misbehaviour", "batch"),
    [("rollback_execute", 10), ("commit_execute", 10), ("commit", 10), ("commit", 1), ("close", 10),
     ("autocommit", 10), ("swallow_commit", 10)],
)  # fmt: skip
def test_a_handler_that_tries_to_end_the_transaction_harms_only_its_own_message(db, misbehaviour, batch):
    """ctx.conn refuses commit, rollback, close and reconfiguration while a handler runs: the
    culprit is dead-lettered at attempt 1 with nothing of it committed, and every other message of
    its batch (before and after it) commits its effect exactly once."""
    produce(db.url, ("a", {}), ("b", {}), ("bad", {"do": misbehaviour}), ("c", {}))
    p = spawn(db.url, "--batch-size", str(batch))
    try:
        eventually(lambda: live(db.url) == 0, what="batch settled")
    finally:
        assert stop(p) == 0
    assert effects(db.url) == {"a": [1], "b": [1], "c": [1]}
    assert dead(db.url) == {"bad": ("handler_ended_transaction", 1)}
    assert attempts(db.url, "bad") == [(1, "permanent", "HandlerEndedTransaction", "dead_letter")]
    assert "must leave the transaction to the worker" in scalar(
        db.url, "SELECT last_error FROM postbox.dead_letters WHERE message_id = 'bad'"
    )


@pytest.mark.parametrize(
    ("misbehaviour", "committed"),
    [("sql_commit_execute", True), ("sql_commit", True), ("sql_rollback_execute", False)],
)
def test_a_handler_that_ends_the_transaction_with_sql_is_settled_by_what_happened(
    db, misbehaviour, committed
):
    """COMMIT or ROLLBACK sent as SQL cannot be refused beforehand. The worker detects it right after
    the handler: a COMMIT made the earlier messages' effects durable, so they are marked done at
    once (never run again); a ROLLBACK undid them, so they run again with their attempt intact.
    The culprit is dead-lettered; no effect is ever duplicated."""
    produce(db.url, ("a", {}), ("b", {}), ("bad", {"do": misbehaviour}), ("c", {}))
    p = spawn(db.url)
    try:
        eventually(lambda: live(db.url) == 0, what="batch settled")
    finally:
        assert stop(p) == 0
    got = effects(db.url)
    assert {k: got[k] for k in ("a", "b", "c")} == {"a": [1], "b": [1], "c": [1]}
    assert got.get("bad", []) == ([1] if committed else [])  # its own effect went with its COMMIT
    assert dead(db.url) == {"bad": ("handler_ended_transaction", 1)}
    assert scalar(db.url, "SELECT count(*) FROM postbox.attempts WHERE message_id <> 'bad'") == 0


def test_a_handler_that_commits_with_sql_then_hangs_never_has_a_committed_message_run_again(db):
    """A handler that runs COMMIT as SQL and then hangs past its time limit: its slot is abandoned,
    and whoever settles the batch finds the transaction committed. The earlier messages, whose
    effects the COMMIT made durable, are done and never run again; the culprit, whose own effect it
    committed too, is dead-lettered, not retried."""
    produce(db.url, ("a", {}), ("b", {}), ("bad", {"do": "sql_commit_sleep", "seconds": 6}), ("c", {}))
    p = spawn(db.url)
    try:
        eventually(lambda: live(db.url) == 0, timeout=30, what="batch settled")
    finally:
        assert stop(p) == 0
    assert effects(db.url) == {"a": [1], "b": [1], "bad": [1], "c": [1]}
    assert dead(db.url) == {"bad": ("handler_ended_transaction", 1)}


def test_a_handler_that_swallows_a_database_error_fails_its_attempt_only(db):
    """A handler that catches a database error and returns leaves its transaction failed: its
    attempt fails (and is retried), the batch's other messages are unaffected."""
    produce(db.url, ("a", {}), ("bad", {"do": "swallow_error", "only_attempt": 1}), ("c", {}))
    p = spawn(db.url)
    try:
        eventually(lambda: live(db.url) == 0, what="batch settled")
    finally:
        assert stop(p) == 0
    assert effects(db.url) == {"a": [1], "bad": [2], "c": [1]}
    assert attempts(db.url, "bad") == [(1, "transient", "HandlerLeftTransactionInError", "retry")]


@pytest.mark.parametrize(
    ("misbehaviour", "kind", "batch"),
    [("sleep", "sync", 10), ("sleep", "sync", 1), ("spin", "sync", 10), ("sleep", "async", 10),
     ("await_sleep", "async", 10)],
)  # fmt: skip
def test_a_handler_past_its_time_limit_holds_no_other_key_and_can_no_longer_write(
    db, tmp_path, misbehaviour, kind, batch
):
    """A handler stuck in Python (sleeping, spinning, or blocking an async handler's loop) past its
    time limit: the attempt ends as `timeout`, the other key of its batch moves on within seconds
    (not after the lease), and the stuck code's late write is refused. The next attempt succeeds."""
    marker = tmp_path / "late"
    slow = {"do": misbehaviour, "seconds": 4, "only_attempt": 1, "marker": str(marker)}
    if kind == "async":
        slow["type"] = "async"
    produce(db.url, ("slow", slow), ("other", {}))
    started = time.monotonic()
    p = spawn(db.url, "--batch-size", str(batch))
    try:
        eventually(lambda: "other" in effects(db.url), timeout=30, what="the other key moved on")
        waited = time.monotonic() - started
        eventually(lambda: live(db.url) == 0, what="slow retried")
        if misbehaviour != "await_sleep":  # a cancelled coroutine never reaches its late write
            eventually(marker.exists, timeout=15, what="the stuck code ended")
            assert marker.read_text().startswith("refused")
        assert p.poll() is None  # the worker goes on
    finally:
        assert stop(p) == 0
    assert waited < 2.0 + TIMEOUT + HELD_BOUND  # process start included; the lease is 30 s + 10 x 1 s
    assert effects(db.url) == {"other": [1], "slow": [2]}
    assert attempts(db.url, "slow")[0][:3] == (1, "timeout", "HandlerTimeout")


def test_sigterm_stops_within_the_grace_period_whatever_the_handler_does(db):
    """SIGTERM while a handler sleeps for an hour, with --grace-period 1: the process exits within
    the grace period plus a moment, the attempt is counted and the message given back (claimable
    again at once), and the worker is unregistered."""
    produce(db.url, ("slow", {"do": "sleep", "seconds": 3600}))
    p = spawn(db.url, "--grace-period", "1", "--handler-timeout", "600")
    eventually(
        lambda: scalar(db.url, "SELECT state FROM postbox.inbox WHERE message_id = 'slow'") == "running"
    )
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0
    assert time.monotonic() - t0 < 1.0 + 3.0
    assert (
        scalar(db.url, "SELECT row(state, attempt)::text FROM postbox.inbox WHERE message_id = 'slow'")
        == "(ready,1)"
    )
    assert [a[:3] for a in attempts(db.url, "slow")] == [(1, "transient", "WorkerShutdown")]
    assert scalar(db.url, "SELECT count(*) FROM postbox.workers") == 0


def test_readiness_says_stopping_while_in_flight_messages_finish(db, monkeypatch):
    """SIGTERM while a handler runs (2 s): until the process exits, /readyz answers 503 "not ready:
    stopping" (a load balancer takes it out); the message finishes within the grace period and
    the process exits 0."""
    port = free_port()
    monkeypatch.setenv("POSTBOX_METRICS_PORT", str(port))
    produce(db.url, ("draining", {"do": "sleep", "seconds": 2}))
    p = spawn(db.url, "--grace-period", "30", "--handler-timeout", "60")
    try:
        eventually(
            lambda: (
                scalar(db.url, "SELECT state FROM postbox.inbox WHERE message_id = 'draining'") == "running"
            )
        )
        assert request(port, "/readyz").status == 200
        p.send_signal(signal.SIGTERM)
        stopping = eventually(lambda: request(port, "/readyz").status == 503, what="not ready")
        assert stopping and request(port, "/readyz").body == b"not ready: stopping\n"
        assert p.poll() is None  # still finishing its message
        assert p.wait(30) == 0
    finally:
        stop(p)
    # Its effects, the one after the sleep included, committed with its done mark.
    assert effects(db.url) == {"draining": [1], "draining:late": [1]} and live(db.url) == 0


def test_a_second_signal_exits_at_once(db):
    """With a long grace period, a second SIGTERM exits at once; the running message is given back."""
    produce(db.url, ("slow", {"do": "sleep", "seconds": 3600}))
    p = spawn(db.url, "--grace-period", "60", "--handler-timeout", "600")
    eventually(
        lambda: scalar(db.url, "SELECT state FROM postbox.inbox WHERE message_id = 'slow'") == "running"
    )
    p.send_signal(signal.SIGTERM)
    time.sleep(0.3)  # two distinct signals, not one coalesced
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 0
    assert time.monotonic() - t0 < 3.0
    assert scalar(db.url, "SELECT state FROM postbox.inbox WHERE message_id = 'slow'") == "ready"


def test_too_many_stuck_handlers_stop_the_process_for_its_supervisor(db):
    """Past --max-stuck-handlers abandoned threads the process exits with status 70 (for its
    supervisor to start a fresh one), after settling what it held."""
    produce(db.url, ("slow", {"do": "sleep", "seconds": 3600}), ("other", {}))
    p = spawn(db.url, "--max-stuck-handlers", "0")
    assert p.wait(30) == 70
    assert scalar(db.url, "SELECT state FROM postbox.inbox WHERE message_id = 'slow'") == "ready"
    assert attempts(db.url, "slow")[0][:3] == (1, "timeout", "HandlerTimeout")
    assert scalar(db.url, "SELECT count(*) FROM postbox.inbox WHERE state = 'running'") == 0


@pytest.mark.parametrize(
    ("misbehaviour", "kind"), [("exit", "sync"), ("keyboard_interrupt", "sync"), ("exit", "async"),
                               ("keyboard_interrupt", "async")]
)  # fmt: skip
def test_a_base_exception_in_a_handler_fails_its_attempt_and_the_slot_goes_on(db, misbehaviour, kind):
    """SystemExit or KeyboardInterrupt raised by a handler (sync, or async: there it would stop the
    slot's event loop) is recorded as that attempt's failure; the slot keeps working (no zombie),
    and nothing of that attempt runs again later in another message's transaction."""
    typed = {"type": "async"} if kind == "async" else {}
    produce(db.url, ("bad", {"do": misbehaviour, "only_attempt": 1, **typed}), ("a", typed), ("b", typed))
    p = spawn(db.url)
    try:
        eventually(lambda: live(db.url) == 0, what="batch settled")
        produce(db.url, ("later", typed))
        eventually(lambda: "later" in effects(db.url), what="a later message processed")
        assert p.poll() is None
        assert scalar(db.url, "SELECT count(*) FROM postbox.live_workers") == 1
    finally:
        assert stop(p) == 0
    expected_type = "SystemExit" if misbehaviour == "exit" else "KeyboardInterrupt"
    assert [a[:3] for a in attempts(db.url, "bad")] == [(1, "transient", expected_type)]
    assert effects(db.url) == {"bad": [2], "a": [1], "b": [1], "later": [1]}


@pytest.mark.parametrize(
    ("misbehaviour", "error_type", "kind"),
    [("retry_nan", "ValueError", "permanent"), ("unprintable", "Unprintable", "transient"),
     ("unruly", "Unruly", "transient")],
)  # fmt: skip
def test_an_error_that_is_hard_to_classify_fails_its_own_attempt_only(db, misbehaviour, error_type, kind):
    """Retry(after=nan), an exception whose str() raises, a registry rule whose predicate raises:
    each failed the slot while it classified the error, leaving the whole batch claimed until its
    lease ran out, then counted against every message of it. Now the attempt is recorded against
    its own message, and its neighbours are done at once."""
    produce(db.url, ("bad", {"do": misbehaviour, "only_attempt": 1}), ("a", {}), ("b", {}))
    p = spawn(db.url)
    try:
        eventually(lambda: live(db.url) == 0, what="batch settled", timeout=20)
    finally:
        assert stop(p) == 0
    assert [a[:3] for a in attempts(db.url, "bad")] == [(1, kind, error_type)]
    if kind == "transient":  # retried, and done
        assert effects(db.url) == {"bad": [2], "a": [1], "b": [1]}
        assert dead(db.url) == {}
    else:  # a ValueError: dead-lettered at once
        assert effects(db.url) == {"a": [1], "b": [1]}
        assert dead(db.url) == {"bad": ("permanent", 1)}


@pytest.mark.parametrize("misbehaviour", ["set_role", "deferred_violation", "cancelled_at_commit"])
def test_a_handler_that_leaves_its_transaction_unable_to_complete_fails_its_own_attempts(db, misbehaviour):
    """A handler that makes the batch's completion or commit fail (``SET LOCAL ROLE`` to a role
    without Postbox's grants; a row breaking a constraint checked at commit): the batch was given
    back untouched, claimed again and run again, without end (no attempt counted, its neighbours
    never done). Now the batch runs again a message at a time; the culprit's attempts fail with
    that error until it is dead-lettered, and every other message is done once."""
    with psycopg.connect(db.url, autocommit=True) as c:
        c.execute(
            "CREATE TABLE deferred_parents (id int PRIMARY KEY);"
            "CREATE TABLE deferred_children (parent int REFERENCES deferred_parents DEFERRABLE INITIALLY DEFERRED);"
            # What a handler's SET LOCAL statement_timeout does to the completion, every time.
            "CREATE TABLE cancelled_rows (id serial);"
            "CREATE FUNCTION cancelled() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            " RAISE EXCEPTION 'canceling statement due to statement timeout' USING ERRCODE = '57014'; END $$;"
            "CREATE CONSTRAINT TRIGGER cancelled AFTER INSERT ON cancelled_rows DEFERRABLE INITIALLY DEFERRED"
            " FOR EACH ROW EXECUTE FUNCTION cancelled()"
        )
    produce(db.url, ("a", {}), ("bad", {"do": misbehaviour}), ("b", {}))
    p = spawn(db.url)
    try:
        eventually(
            lambda: set(effects(db.url)) == {"a", "b"} and len(attempts(db.url, "bad")) >= 1,
            what="the others done, the culprit's attempt recorded", timeout=30,
        )  # fmt: skip
        if misbehaviour != "cancelled_at_commit":  # permanent: dead-lettered at once
            eventually(lambda: live(db.url) == 0, what="batch settled", timeout=30)
    finally:
        assert stop(p) == 0
    got = effects(db.url)
    assert got["a"] == [1] and got["b"] == [1] and "bad" not in got  # its effects never committed
    failed = attempts(db.url, "bad")
    assert failed and {a[2] for a in failed} <= {
        "InsufficientPrivilege",
        "ForeignKeyViolation",
        "QueryCanceled",
    }
    if misbehaviour != "cancelled_at_commit":
        assert dead(db.url)["bad"][0] in ("attempts_exhausted", "permanent")
    else:  # transient: retried with backoff, each attempt counted (it ran without end, uncounted)
        assert [a[0] for a in failed] == list(range(1, len(failed) + 1))


def test_a_batch_whose_commit_meets_a_serialization_failure_is_given_back_as_it_is(db):
    """A failure a retry may well get past (SQLSTATE 40001 at commit, once) is nobody's attempt: the
    batch is given back untouched and done at the next claim, nothing charged, each effect once."""
    with psycopg.connect(db.url, autocommit=True) as c:
        c.execute(
            "CREATE SEQUENCE flaky_seq; CREATE TABLE flaky_rows (id serial);"
            " CREATE FUNCTION flaky() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            "  IF nextval('flaky_seq') = 1 THEN"
            "   RAISE EXCEPTION 'could not serialize access' USING ERRCODE = '40001'; END IF;"
            "  RETURN NULL; END $$;"
            " CREATE CONSTRAINT TRIGGER flaky AFTER INSERT ON flaky_rows DEFERRABLE INITIALLY DEFERRED"
            "  FOR EACH ROW EXECUTE FUNCTION flaky()"
        )
    produce(db.url, ("a", {}), ("flaky", {"do": "serialization_at_commit"}), ("b", {}))
    p = spawn(db.url)
    try:
        eventually(lambda: live(db.url) == 0, what="batch settled", timeout=20)
    finally:
        assert stop(p) == 0
    assert effects(db.url) == {"a": [1], "flaky": [1], "b": [1]}
    assert scalar(db.url, "SELECT count(*) FROM postbox.attempts") == 0
    assert scalar(db.url, "SELECT nextval('flaky_seq')") == 3  # two commits: the refused one, then this one


def test_a_task_an_async_handler_leaves_running_never_writes_into_another_message(db):
    """A fire-and-forget task from an async handler is cancelled when the handler returns: it cannot
    write into the next message's transaction."""
    produce(db.url, ("spawner", {"do": "spawn_task", "type": "async"}), ("next", {"do": "await_sleep", "seconds": 0.3,
            "type": "async"}))  # fmt: skip
    p = spawn(db.url)
    try:
        eventually(lambda: live(db.url) == 0, what="batch settled")
    finally:
        assert stop(p) == 0
    assert effects(db.url) == {"spawner": [1], "next": [1]}


def test_a_worker_started_while_the_database_is_down_waits_for_it(db, tmp_path):
    """Started while its database refuses connections, the worker logs each try and waits; once the
    database answers it starts and processes messages."""
    proxy, url = database_proxy(db.url)
    proxy.down()
    log = tmp_path / "worker.log"
    p = spawn(url, log=log)
    try:
        eventually(lambda: log.read_text().count("cannot reach the database") >= 2, timeout=20)
        assert p.poll() is None
        produce(db.url, ("a", {}))
        proxy.up()
        eventually(lambda: "a" in effects(db.url), timeout=30, what="processed once reachable")
    finally:
        assert stop(p) == 0
        proxy.down()


# Every long-running command, as an operator starts it.
LONG_RUNNING = [
    ("worker", "--consumer", "mis", "--app", "tests.apps.misbehaving:registry"),
    ("relay",),
    ("bridge", "--from", "amqp://guest:guest@127.0.0.1:5672/%2F", "--name", "q", "--consumer", "mis"),
    ("replay", "run"),
    ("maintain",),
    ("maintain", "--once"),  # runs once, but waits for its database as the others do
]


def spawn_unreachable(
    db, tmp_path: Path, command: tuple[str, ...], *args: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """``postbox <command>`` on a database that refuses connections, its stderr in a log file."""
    proxy, url = database_proxy(db.url)
    proxy.down()
    log = tmp_path / "process.log"
    config = tmp_path / "postbox.toml"  # a relay needs a destination before it waits for anything
    config.write_text('[destinations.elsewhere]\nkind = "postgres"\nconsumer = "mis"\n')
    with open(log, "wb") as out:
        p = spawn_postbox(
            "--config", str(config), "--database-url", url, *command, *args, stderr=out.fileno()
        )
    return p, log


@pytest.mark.parametrize("command", LONG_RUNNING, ids=lambda c: " ".join(c[:2]))
def test_connect_timeout_gives_up_with_a_clear_error(db, tmp_path, command):
    """Every long-running process waits for an unreachable database; --connect-timeout bounds the
    wait, then it exits 1 with one line saying why, no traceback."""
    p, log = spawn_unreachable(db, tmp_path, command, "--connect-timeout", "1.5")
    assert p.wait(30) == 1
    text = log.read_text()
    assert "cannot reach the database" in text and "gave up after" in text and "--connect-timeout" in text
    assert "Traceback" not in text


@pytest.mark.parametrize("command", LONG_RUNNING, ids=lambda c: " ".join(c[:2]))
def test_sigterm_while_waiting_for_the_database_exits_0_and_says_so(db, tmp_path, monkeypatch, command):
    """A process stopped (SIGTERM, as a supervisor stops it) while it still waits for its database
    exits at once with status 0 and one line saying so: no traceback, and nothing registered."""
    monkeypatch.setenv("POSTBOX_LOG_LEVEL", "info")  # the line is at level info
    p, log = spawn_unreachable(db, tmp_path, command)
    try:
        eventually(lambda: "cannot reach the database" in log.read_text(), timeout=20, what="waiting")
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = log.read_text()
    assert "stopped while waiting for the database" in text
    assert "Traceback" not in text
    assert scalar(db.url, "SELECT count(*) FROM postbox.workers") == 0

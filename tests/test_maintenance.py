"""Maintenance (OPS-2): retention in small batches under load with an injected clock, nothing inside
the deduplication window or still live ever deleted, and each job once per period across processes."""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta

import psycopg
import pytest

import postbox
from postbox.clock import FakeClock
from postbox.inbox.worker import Worker, WorkerSettings
from postbox.operations.maintenance import JOBS, Maintenance, MaintenanceSettings
from tests.apps.basic import registry as basic_registry
from tests.helpers import EFFECTS_DDL, FAST_WORKER, eventually, scalar, spawn_postbox
from tests.test_observability import free_port, scrape, value

WINDOW = 3600.0


def _receive(url: str, consumer: str, ids: list[str]) -> None:
    with psycopg.connect(url) as c:
        postbox.receive_many(
            c, [{"consumer": consumer, "message_id": i, "key": i, "payload": 1} for i in ids]
        )
        c.commit()


def _ledger(url: str, consumer: str) -> dict[str, object]:
    with psycopg.connect(url) as c:
        rows = c.execute(
            "SELECT message_id, received_at FROM postbox.inbox_dedup WHERE consumer = %s", (consumer,)
        ).fetchall()
    return dict(rows)


def test_dedup_rotation_under_load_keeps_the_window_and_live_messages(database):
    """While a worker processes a stream of messages, the dedup job, driven by a FakeClock moved 20
    minutes per round (window: 1 hour; a rotation is due a window and a margin of an hour after the
    last), only ever drops the older slot: no ledger row received inside the window goes, every
    message still in the inbox keeps its receipt, and two rotations later the receipts of processed
    messages are gone while those of live ones stay."""
    url = database.url
    with psycopg.connect(url) as c:
        c.execute(EFFECTS_DDL)
        c.execute("UPDATE postbox.dedup_window SET rotated_at = now()")  # the last rotation: now
        c.commit()
    clock = FakeClock()
    maintenance = Maintenance(url, MaintenanceSettings(dedup_retention_seconds=WINDOW), clock=clock)
    maintenance.register()
    worker = Worker(url, basic_registry, WorkerSettings(consumer="basic", concurrency=2, **FAST_WORKER))
    worker.start()
    rotations = 0
    try:
        for round_ in range(8):
            _receive(url, "basic", [f"r{round_}-{i}" for i in range(150)])
            _receive(url, "idle", [f"idle-{round_}-{i}" for i in range(2)])  # no worker: stays live
            clock.advance(1200)
            before = _ledger(url, "basic")
            slot = scalar(url, "SELECT current_slot FROM postbox.dedup_window")
            maintenance.run_job("dedup_prune")  # while the worker is still processing
            rotations += scalar(url, "SELECT current_slot FROM postbox.dedup_window") != slot
            cutoff = clock.now() - timedelta(seconds=WINDOW)
            inside = {m for m, at in before.items() if at >= cutoff}
            assert inside <= set(_ledger(url, "basic")), "a ledger row inside the dedup window was dropped"
            assert (
                scalar(
                    url,
                    "SELECT count(*) FROM postbox.inbox i WHERE NOT EXISTS "
                    "(SELECT 1 FROM postbox.inbox_dedup d WHERE d.inbox_id = i.id)",
                )
                == 0
            ), "a live message lost its ledger row"
        assert rotations == 1
        eventually(lambda: scalar(url, "SELECT count(*) = 0 FROM postbox.inbox WHERE consumer = 'basic'"))
        for _ in range(2):
            clock.advance(3 * WINDOW)
            maintenance.run_job("dedup_prune")
        assert scalar(url, "SELECT count(*) FROM effects") >= 8 * 150
        assert _ledger(url, "basic") == {}, "processed messages past the window stay in the ledger"
        assert len(_ledger(url, "idle")) == 16, "a live message's ledger row was dropped"
    finally:
        worker.stop()
        worker.join()


def test_attempt_and_dead_letter_retention(database):
    """Attempts past their retention go unless they belong to an open dead letter; closed dead
    letters (replayed, discarded, resolved) past theirs go; open ones and recent ones stay."""
    url = database.url
    clock = FakeClock()
    settings = MaintenanceSettings(
        attempts_retention_seconds=86400, dead_letter_retention_seconds=86400, batch_size=2
    )
    with psycopg.connect(url) as c:
        for i, (status, age_days) in enumerate(
            [("open", 10), ("resolved", 10), ("discarded", 10), ("replayed", 10), ("resolved", 0)]
        ):
            c.execute(
                """INSERT INTO postbox.dead_letters (origin, origin_id, consumer, message_id, key, position, payload,
                       received_at, attempt, reason, ordering_policy, status, dead_lettered_at, status_changed_at)
                   VALUES ('inbox', %(i)s, 'c', %(m)s, %(m)s, 1, '1', now(), 1, 'permanent', 'block', %(s)s,
                           now() - make_interval(days => %(d)s), now() - make_interval(days => %(d)s))""",
                {"i": 100 + i, "m": f"dl-{i}", "s": status, "d": age_days},
            )
            for attempt in (1, 2):
                c.execute(
                    """INSERT INTO postbox.attempts (origin, origin_id, queue, message_id, key, attempt, failed_at, kind, decision)
                       VALUES ('inbox', %(i)s, 'c', %(m)s, %(m)s, %(a)s, now() - make_interval(days => %(d)s), 'transient', 'retry')""",
                    {"i": 100 + i, "m": f"dl-{i}", "a": attempt, "d": age_days},
                )
        c.commit()
    m = Maintenance(url, settings, clock=clock)
    assert m.run_job("attempts_retention") == 6  # old attempts of the 3 closed dead letters
    assert m.run_job("dead_letter_retention") == 3
    with psycopg.connect(url) as c:
        left = c.execute("SELECT message_id, status FROM postbox.dead_letters ORDER BY message_id").fetchall()
        attempts = c.execute("SELECT DISTINCT message_id FROM postbox.attempts ORDER BY 1").fetchall()
    assert left == [("dl-0", "open"), ("dl-4", "resolved")]
    assert [a[0] for a in attempts] == ["dl-0", "dl-4"]


def test_two_maintain_processes_run_each_job_once_per_period(database):
    """Two `postbox maintain --period 1` processes at once: each job runs about once per second in
    all, not twice, and both processes are registered as live maintenance processes."""
    url = database.url
    args = ("maintain", "--period", "1", "--stale-after", "5")
    port = free_port()
    started = time.monotonic()
    procs = [
        spawn_postbox("--database-url", url, "--metrics-port", str(port), *args),
        spawn_postbox("--database-url", url, *args),
    ]
    try:
        eventually(
            lambda: scalar(url, "SELECT count(*) FROM postbox.workers WHERE kind = 'maintenance'") == 2,
            what="both registered",
        )
        eventually(
            lambda: scalar(url, "SELECT min(runs) >= 6 FROM postbox.maintenance_runs"),
            timeout=30,
            what="6 runs",
        )

        def last_successes():
            s = scrape(port)
            ok = all(value(s, "postbox_maintenance_last_success_timestamp_seconds", task=j) > 0 for j in JOBS)
            return s if ok else None

        # Each job's cluster-wide last success, whichever process ran it, is a metric of both.
        eventually(last_successes, what="last-success metrics")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            assert p.wait(30) == 0
    elapsed = time.monotonic() - started
    with psycopg.connect(url) as c:
        runs = dict(c.execute("SELECT job, runs FROM postbox.maintenance_runs").fetchall())
    assert set(runs) == set(JOBS)
    for job, n in runs.items():
        # Once per period: at most one run per 0.9 s (the due threshold), plus the first.
        assert 6 <= n <= elapsed / 0.9 + 1, f"{job} ran {n} times in {elapsed:.1f} s"
    assert scalar(url, "SELECT count(*) FROM postbox.workers WHERE kind = 'maintenance'") == 0


def test_a_job_is_not_run_twice_within_its_period(database):
    """run_due claims a job only when its last start is at least 0.9 period old, whichever process asks."""
    clock = FakeClock()
    settings = MaintenanceSettings(periods=dict.fromkeys(JOBS, 60.0))
    a = Maintenance(database.url, settings, clock=clock)
    b = Maintenance(database.url, settings, clock=clock)
    a.register()
    assert a.run_due("dedup_prune") is True
    assert b.run_due("dedup_prune") is False
    assert a.run_due("dedup_prune") is False
    clock.advance(55)
    assert b.run_due("dedup_prune") is True
    assert a.run_due("dedup_prune") is False
    assert scalar(database.url, "SELECT runs FROM postbox.maintenance_runs WHERE job = 'dedup_prune'") == 2


def test_concurrent_runs_of_one_job_take_turns(database):
    """Many threads asking to run one job at the same moment: exactly one runs it."""
    settings = MaintenanceSettings(periods=dict.fromkeys(JOBS, 60.0))
    clock = FakeClock()
    ms = [Maintenance(database.url, settings, clock=clock) for _ in range(6)]
    ms[0].register()
    results: list[bool] = []
    barrier = threading.Barrier(len(ms))

    def go(m: Maintenance) -> None:
        barrier.wait()
        results.append(m.run_due("attempts_retention"))

    threads = [threading.Thread(target=go, args=(m,)) for m in ms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 5 + [True]


def test_unknown_job_is_refused(database):
    """A job name that does not exist is an error naming the known ones."""
    with pytest.raises(ValueError, match="dedup_prune"):
        Maintenance(database.url, jobs=["nope"])


def test_gap_timeouts_stale_workers_and_orphaned_keys(database):
    """The reporting and recovery jobs: a gapless key waiting past its gap_timeout is counted; a
    process whose heartbeat stopped is forgotten and its claimed message made due at once."""
    url = database.url
    clock = FakeClock()
    m = Maintenance(url, MaintenanceSettings(stale_after=30), clock=clock)
    with psycopg.connect(url) as c:
        postbox.declare_consumer(c, "ledger", sequence_mode="gapless", gap_timeout_seconds=60)
        postbox.declare_consumer(c, "basic")
        postbox.receive(c, consumer="ledger", message_id="s2", key="acct", sequence=2, payload=1)
        postbox.receive(c, consumer="basic", message_id="m", key="k", payload=1)
        c.commit()
        # A claim (a worker's) notices the missing sequence 1 and records since when the key waits.
        c.execute(
            "SELECT * FROM postbox.inbox_claim_v1('ledger', 'w', 1, interval '1 minute', now())"
        ).fetchall()
        c.commit()
    assert m.run_job("gap_timeouts") == 0  # waiting, but not for long
    clock.advance(120)
    assert m.run_job("gap_timeouts") == 1

    with psycopg.connect(url, autocommit=True) as c:
        c.execute(
            "INSERT INTO postbox.workers (id, kind, queue, host, pid, heartbeat_at) "
            "VALUES ('dead-one', 'worker', 'basic', 'h', 1, now() - interval '10 minutes')"
        )
        c.execute(
            "SELECT * FROM postbox.inbox_claim_v1('basic', 'dead-one', 1, interval '1 hour', now())"
        ).fetchall()
    assert m.run_job("reap_stale_workers") == 1
    assert scalar(url, "SELECT count(*) FROM postbox.workers WHERE id = 'dead-one'") == 0
    # Due at the maintenance clock's now (120 s ahead of the server), no longer at the end of its 1-hour lease.
    due = scalar(url, "SELECT available_at FROM postbox.inbox WHERE message_id = 'm'")
    assert abs((due - clock.now()).total_seconds()) < 30
    assert m.run_job("repair_keys") == 0  # nothing orphaned


def test_maintain_refuses_a_deduplication_window_the_retries_outlast_and_says_when_it_changes_it(
    database, tmp_path
):
    """The window maintenance sets is the one every receive judges by. One shorter than the file's
    (or the default policy's) retries plus the replay window was set without a word, where a worker
    refuses it: a redelivery after it was then received as new, and processed twice. Now maintain
    refuses it too (exit 2, the window in force untouched), and says when it changes the window."""
    from tests.test_ops_commands import run_postbox

    config = tmp_path / "postbox.toml"
    config.write_text("[consumers.billing]\nretry = { max_attempts = 10, max_delay = 300 }\n")

    def window() -> float:
        return scalar(database.url, "SELECT extract(epoch FROM retention)::float8 FROM postbox.dedup_window")

    before = window()
    for args in (["--config", str(config)], []):
        r = run_postbox(*args, "--database-url", database.url, "maintain", "--once",
                        env={"POSTBOX_DEDUP_RETENTION_SECONDS": "2"})  # fmt: skip
        assert r.returncode == 2, r.stderr
        assert "dedup_retention_seconds (2) is shorter than the longest retry horizon" in r.stderr
        assert window() == before
    r = run_postbox("--database-url", database.url, "maintain", "--once", "--job", "reap_stale_workers",
                    env={"POSTBOX_DEDUP_RETENTION_SECONDS": "900000", "POSTBOX_LOG_LEVEL": "info"})  # fmt: skip
    assert r.returncode == 0 and f"deduplication window changed from {before:g} s to 900000 s" in r.stderr
    assert window() == 900000
    r = run_postbox("--database-url", database.url, "maintain", "--once", "--job", "reap_stale_workers")
    assert (
        r.returncode == 0 and "deduplication window changed from 900000 s to 604800 s" in r.stderr
    )  # a warning
    assert window() == 604800

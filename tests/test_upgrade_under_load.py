"""A rolling deploy, for real: the database is upgraded from the previous release's schema while
producers write and that release's workers process (messages pending, running, retrying,
dead-lettered, a replay job half done); workers of the new release join them on the same consumer,
then the old ones leave. Checked by the invariant checker: nothing lost, no duplicate effect, per-key
order kept; the replay job finishes."""

from __future__ import annotations

import random
import threading

import psycopg
import pytest

from postbox._version import SCHEMA_REVISION, __version__
from postbox.schema import migrate
from tests import previous_release
from tests.checker import Produced, WorkerPool, check, produce, run_until
from tests.helpers import EFFECTS_DDL, eventually, scalar

FAULTS = {"CHECKER_FAIL_RATE": "0.2", "CHECKER_PERMANENT_RATE": "0.03"}


@pytest.fixture(scope="module")
def previous(tmp_path_factory):
    return previous_release.unpack(tmp_path_factory.mktemp("release"))


def _producing(url: str, produced: Produced, stop: threading.Event) -> threading.Thread:
    """Producers write until ``stop``: 60 messages over 25 keys a round, a few rounds a second."""

    def loop() -> None:
        seed = 0
        while not stop.is_set():
            seed += 1
            produce(url, "chk", 60, 25, produced, seed=seed, batch=20)
            stop.wait(0.1)  # pacing of the load, not a synchronisation

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def _versions(url: str) -> dict[str, set[str]]:
    with psycopg.connect(url) as c:
        rows = c.execute("SELECT id, version FROM postbox.workers WHERE kind = 'worker'").fetchall()
    out: dict[str, set[str]] = {}
    for worker_id, version in rows:
        out.setdefault(version, set()).add(worker_id)
    return out


def _attempts_since(url: str, since: object, workers: set[str]) -> int:
    return int(
        scalar(
            url,
            "SELECT count(*) FROM postbox.attempts WHERE failed_at > %s AND worker = ANY(%s)",
            (since, list(workers)),
        )
    )


def test_an_upgrade_under_load_loses_nothing_while_both_releases_drain_one_consumer(empty_database, previous):
    url = empty_database.url
    made = previous.postbox("--database-url", url, "migrate")
    assert made.returncode == 0, made.stderr
    assert migrate.current_revision(url) == previous_release.REVISION
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(EFFECTS_DDL)

    produced, stop = Produced(), threading.Event()
    old = WorkerPool(url, "chk", "tests.apps.checker:registry", processes=2, concurrency=2,
                     env={"PYTHONPATH": previous.env["PYTHONPATH"], **FAULTS})  # fmt: skip
    new: WorkerPool | None = None
    producer = _producing(url, produced, stop)
    try:
        # The previous release at work: retries, dead letters, and a replay job half done.
        eventually(lambda: scalar(url, "SELECT count(*) FROM postbox.dead_letters") >= 4, timeout=60)
        eventually(lambda: previous_release.VERSION in _versions(url))
        job = scalar(
            url,
            "SELECT postbox.dlq_replay('{\"queue\": \"chk\"}', 'upgrade test', 'tester', rate => 1000,"
            " max_in_flight => 2, batch_size => 2, abort_failure_ratio => 1.0)",
        )
        scalar(url, "SELECT (postbox.replay_step(%s)).state", (job,))
        assert scalar(url, "SELECT replayed FROM postbox.replay_jobs WHERE id = %s", (job,)) > 0
        assert scalar(url, "SELECT count(*) FROM postbox.inbox WHERE state = 'pending'") > 0

        # The upgrade, while producers write and 0.1.0 workers process.
        upgraded_at = scalar(url, "SELECT clock_timestamp()")
        migrate.upgrade(url)
        assert migrate.current_revision(url) == SCHEMA_REVISION

        # An old worker crashes mid-deploy and comes back: it starts on the new schema, and says so.
        old.kill_random(random.Random(1))

        def restarted_and_warned() -> bool:
            old.keep_alive()  # restarts it once it is gone
            return old.restarts == 1 and any("newer than this postbox" in old.stderr_of(p) for p in old.procs)

        eventually(
            restarted_and_warned,
            what="a 0.1.0 worker started on the new schema saying it keeps working",
        )

        # The new release joins; both drain the consumer together, each calling its own functions.
        new = WorkerPool(url, "chk", "tests.apps.checker:registry", processes=2, concurrency=2, env=FAULTS)
        eventually(lambda: {previous_release.VERSION, __version__} <= _versions(url).keys(), timeout=60)
        both = _versions(url)
        assert (
            scalar(url, "SELECT count(*) FROM postbox.workers WHERE schema_revision = %s", (SCHEMA_REVISION,))
            >= 1
        )
        eventually(
            lambda: (
                _attempts_since(url, upgraded_at, both[previous_release.VERSION]) > 0
                and _attempts_since(url, upgraded_at, both[__version__]) > 0
            ),
            timeout=60,
            what="workers of both releases processing after the upgrade",
        )
        stop.set()
        producer.join(60)
        assert not producer.is_alive()

        # The old release leaves (end of the rolling deploy); the new one finishes the work.
        old.stop()
        for p in old.procs:
            assert p.returncode == 0, old.stderr_of(p)[-2000:]

        def replay_done() -> bool:
            state = scalar(url, "SELECT (postbox.replay_step(%s)).state", (job,))
            return state in ("done", "aborted", "cancelled")

        eventually(replay_done, timeout=120, what="the replay job to finish")
        assert scalar(url, "SELECT state FROM postbox.replay_jobs WHERE id = %s", (job,)) == "done"

        run_until(
            180,
            lambda: scalar(url, "SELECT count(*) FROM postbox.inbox WHERE consumer = 'chk'") == 0,
            new.keep_alive,
        )
    finally:
        stop.set()
        producer.join(60)
        old.stop()
        if new is not None:
            new.stop()
    report = check(url, produced, "chk")
    report.assert_ok()
    assert report.produced >= 4 * 60 and report.dead_lettered > 0

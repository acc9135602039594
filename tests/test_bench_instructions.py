"""`make bench`'s counted figures (tests/bench/instructions.py): the statements it counts receive
what the timed workloads receive, and a count is the same every time."""

from __future__ import annotations

import pytest

from tests.bench import instructions


def _run(conn, script: str) -> list[tuple[object, ...]]:
    """A single-user backend's input run statement by statement; the last statement's rows."""
    rows: list[tuple[object, ...]] = []
    for statement in filter(None, (s.strip() for s in script.split(";\n\n"))):
        cur = conn.execute(statement)
        rows = cur.fetchall() if cur.description else []
    return rows


def test_the_counted_batches_receive_what_receive_many_would(conn):
    conn.execute("DEALLOCATE ALL")
    _run(conn, instructions.postbox_batches(3, 20, keyed=True))
    conn.commit()
    rows = conn.execute("SELECT message_id, key, payload, state FROM postbox.inbox ORDER BY id").fetchall()
    assert [r[0] for r in rows] == [str(i) for i in range(60)]
    assert rows[0][1:] == ("k0", {"i": 0}, "ready")
    assert {r[3] for r in rows} == {"ready"}  # 60 messages over 500 keys: each is its key's head
    conn.execute("DEALLOCATE ALL")
    _run(conn, instructions.postbox_batches(1, 20, keyed=True))  # the same ids again
    conn.commit()
    assert conn.execute("SELECT count(*) FROM postbox.inbox").fetchone() == (60,)


def test_the_counted_single_receives_are_receives_one_message_each(conn):
    conn.execute("DEALLOCATE ALL")
    last = _run(conn, instructions.postbox_singles(2, 5, keyed=False))
    conn.commit()
    assert last[0][0] == "new"
    rows = conn.execute("SELECT message_id, key, payload FROM postbox.inbox ORDER BY id").fetchall()
    assert rows == [(str(i), str(i), {"i": i}) for i in range(10)]


def test_the_counted_floor_writes_the_two_rows_of_a_receive(conn):
    conn.execute("DEALLOCATE ALL")
    _run(conn, instructions.two_rows_singles(1, 3))
    conn.commit()
    inbox = conn.execute(
        "SELECT id::text = message_id, payload, state FROM postbox.inbox ORDER BY id"
    ).fetchall()
    assert inbox == [(True, {"i": i}, "ready") for i in range(3)]
    assert conn.execute("SELECT count(*) FROM postbox.inbox_dedup").fetchone() == (3,)


def test_the_counted_pgqueuer_enqueues_enqueue_its_jobs(empty_database):
    pytest.importorskip("pgqueuer", reason="pgqueuer is in the bench extra (make bench installs it)")
    import psycopg

    from tests.bench import peers

    peers.install("pgqueuer", empty_database.url)
    with psycopg.connect(empty_database.url, autocommit=True) as c:
        c.execute(instructions.pgqueuer_function())
        assert _run(c, instructions.pgqueuer_batches(2, 10)) == [(10,)]
        _run(c, "DEALLOCATE ALL;\n\n" + instructions.pgqueuer_singles(1, 3))
        rows = c.execute("SELECT convert_from(payload, 'UTF8')::jsonb FROM pgqueuer ORDER BY id").fetchall()
    assert [r[0]["i"] for r in rows] == [*range(20), 0, 1, 2]


def test_a_count_is_the_same_every_time():
    why = instructions.unavailable()
    if why:
        pytest.skip(why)
    single = instructions.Workload(
        "single", "postbox", lambda u, n: instructions.postbox_singles(u, n, False), 1, 20, 60
    )
    keyed = instructions.Workload(
        "batch", "postbox", lambda u, n: instructions.postbox_batches(u, n, True), 100, 1, 1
    )
    with instructions.cluster() as c:
        instructions.prepare(c, with_pgqueuer=False)
        first, second = (instructions.per_message(c, single) for _ in range(2))
        batch = instructions.per_message(c, keyed)
    assert 100_000 < first < 5_000_000
    assert abs(first - second) / first < 0.01
    assert batch < first  # a batch shares its statement's and its commit's cost among its messages

"""The bench's CPU readings, which say what bounds a drain (tests/bench/harness.py)."""

from __future__ import annotations

import os
import time

import pytest

from tests.bench.harness import process_cpu, server_cpu


def test_the_servers_cpu_time_grows_with_the_work_it_does(conn):
    before = server_cpu(conn)
    if before is None:
        pytest.skip("the test database's server runs on another machine: its CPU time is not seen")
    conn.execute("SELECT count(*) FROM generate_series(1, 5000000)")
    after = server_cpu(conn)
    assert after is not None
    assert after - before >= 0.1  # the query takes a few tenths of a second of the server's CPU


def test_the_time_of_a_backend_that_just_ended_is_counted(conn, database):
    """A backend whose client has just gone ends while the server's processes are read: its time
    moves to the postmaster's as it is reaped, and the reading must find it in one place or the
    other (pgbench's backends, at the end of its run)."""
    import psycopg

    before = server_cpu(conn)
    if before is None:
        pytest.skip("the test database's server runs on another machine: its CPU time is not seen")
    with psycopg.connect(database.url) as other:
        other.execute("SELECT count(*) FROM generate_series(1, 5000000)")
    after = server_cpu(conn)
    assert after is not None
    assert after - before >= 0.1


def test_a_process_cpu_time_grows_as_it_computes_and_is_zero_once_it_is_gone():
    before = process_cpu(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert process_cpu(os.getpid()) - before >= 0.15
    assert process_cpu(2**22 + 12345) == 0.0

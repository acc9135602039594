"""Completing a batch costs the same after a long run as at its start: the rows are reached by
their primary key, never by reading the queue's partial indexes, which hold every dead entry a busy
queue leaves behind between two vacuums. A claim, however often a session calls it, reads a few
pages, never the whole queue."""

from __future__ import annotations

import json
import statistics

import psycopg
import pytest

KEYS, PER_KEY, BATCH = 500, 60, 10
INDEX_PAGES = """SELECT coalesce(sum(pg_stat_get_xact_blocks_fetched(indexrelid)), 0) FROM pg_index
                  WHERE indrelid = CAST(%(table)s AS regclass)"""


def _complete_index_pages(c: psycopg.Connection, table: str) -> tuple[int, int]:
    """Claim a batch and complete it: the pages of the table's indexes the completion read (its
    statements included; this session's own counts, taken before and after it in its transaction)
    and how many rows it completed.

    Index pages, not every page: while any transaction of the cluster holds back the cleanup horizon
    (the full suite runs tests side by side), the rows a busy queue deletes cannot be pruned, and the
    heap pages a completion reads grow whatever the plan (three times as many here). What a plan that
    reads the partial indexes whole adds is index pages."""
    rows = c.execute(
        f"SELECT id, attempt FROM postbox.{table}_claim_v1(%s, 'w', %s, interval '1 minute', now())",
        ("c", BATCH),
    ).fetchall()
    ids, attempts = [r[0] for r in rows], [r[1] for r in rows]
    before = c.execute(INDEX_PAGES, {"table": f"postbox.{table}"}).fetchone()[0]
    c.execute(f"SELECT postbox.{table}_complete_v1(%s, %s, now())", (ids, attempts))
    after = c.execute(INDEX_PAGES, {"table": f"postbox.{table}"}).fetchone()[0]
    c.commit()
    return int(after - before), len(ids)


@pytest.mark.parametrize(("table", "queue"), [("inbox", "consumer"), ("outbox", "destination")])
def test_completing_a_batch_reads_as_few_index_pages_after_thousands_of_completions_as_at_first(
    database, table, queue
):
    with database.connect() as c:
        # Heads for every key, queued messages behind them, and statistics taken now (as after a
        # quiet period): few ready rows, so a plan that reads the partial indexes looks cheap.
        c.execute(
            f"INSERT INTO postbox.{table} ({queue}, message_id, key, position, payload, state)"
            " SELECT 'c', k || '-' || n, 'k' || k, n, '{}', CASE WHEN n = 1 THEN 'ready' ELSE 'pending' END"
            f" FROM generate_series(1, {KEYS}) k, generate_series(1, {PER_KEY}) n"
        )
        c.commit()
        c.execute(f"ANALYZE postbox.{table}")
        c.commit()
        early = [_complete_index_pages(c, table)[0] for _ in range(6)][1:]  # the first compiles the function
        # Thousands of messages done since: their dead entries stay in the indexes (no vacuum).
        done = 0
        for _ in range(KEYS * PER_KEY // BATCH // 2):
            done += _complete_index_pages(c, table)[1]
        late = [_complete_index_pages(c, table) for _ in range(5)]
    assert done > KEYS * PER_KEY // 3 and all(n == BATCH for _, n in late)
    # Reading the partial indexes whole reads ~200 more index pages after 15,000 messages (their
    # dead entries, 2 a message); by primary key, the index pages read stay level (about 200).
    assert statistics.median(b for b, _ in late) <= statistics.median(early) + 50, (early, late)


@pytest.mark.parametrize(("table", "queue"), [("inbox", "consumer"), ("outbox", "destination")])
def test_claiming_one_message_reads_a_few_pages_not_the_queue_however_often_it_is_called(
    database, table, queue
):
    """A plan the session keeps for the claim (after five calls, PostgreSQL may switch to one made
    without the values) must still reach the claimed rows by their primary key: one made for an
    unknown LIMIT joins them to the whole queue (a sequential scan and a hash) and reads every page
    of it at every claim."""
    with database.connect() as c:
        c.execute(
            f"INSERT INTO postbox.{table} ({queue}, message_id, key, position, payload, state)"
            " SELECT 'c', 'm' || g, 'k' || g, g, '{}', 'ready' FROM generate_series(1, 10000) g"
        )
        c.commit()
        c.execute(f"ANALYZE postbox.{table}")
        c.commit()
        claim = f"SELECT * FROM postbox.{table}_claim_v1('c', 'w', 1, interval '1 minute', now())"
        pages = []
        for _ in range(12):  # each claim rolled back: the queue stays as it is
            plan = c.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + claim).fetchone()[0]
            c.rollback()
            top = (plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"]
            pages.append(top["Shared Hit Blocks"] + top["Shared Read Blocks"])
    # By primary key a claim of one reads a few dozen pages; the whole queue is over 150 more.
    assert max(pages[6:]) <= 100, pages

"""EXPLAIN guard for the producers: every statement a receive or a publish runs inside Postbox's
functions reads the inbox, the ledger and the outbox through their indexes, never by a sequential
scan, whatever the statistics say, with tens of thousands of messages queued behind their keys'
heads. A plan that scans grows with the queue: each receive would cost more the longer the
workers are behind (an EXISTS that PostgreSQL ran as a hash of the whole inbox did, in keyed
batches, until 0.11.0).

The plans are the ones PostgreSQL really runs, nested statements included, as the auto_explain
module reports them (its notices, in JSON)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import count
from typing import Any

import psycopg
import pytest

import postbox
from tests.conftest import _cloned

KEYS = 400
QUEUED = 100  # messages under each key: one head, the rest queued behind it
# Tables small by design (one row, one per consumer, or a row per open transaction's check at commit,
# deleted by that commit): a scan of them is the cheapest plan.
SMALL = {"consumers", "dedup_window", "inbox_commit_checks"}


def _seq_scans(plan: dict[str, Any]) -> Iterator[str]:
    if plan.get("Node Type") == "Seq Scan":
        yield plan.get("Relation Name", "?")
    for child in plan.get("Plans", []):
        yield from _seq_scans(child)


@contextmanager
def _queued_database(pg_server, template_db, name: str, analyzed_at: int | None) -> Iterator[str]:
    """A database whose inbox and outbox hold ``KEYS`` keys of ``QUEUED`` messages each (a head, the
    rest queued behind it), all committed by other transactions, and both ledger slots holding
    receipts; autovacuum off, so that its tables keep the statistics the test gave them: none, or
    those of ``ANALYZE`` run before batch ``analyzed_at``. Its name: the tests use copies of it."""
    with contextmanager(_cloned)(pg_server, name, template_db) as db:
        with db.connect() as c:
            try:
                c.execute("LOAD 'auto_explain'")
            except psycopg.errors.UndefinedFile:
                pytest.skip("this PostgreSQL has no auto_explain module (the embedded one lacks it)")
            c.rollback()
            tables = c.execute(
                "SELECT c.oid::regclass::text FROM pg_class c"
                " WHERE c.relnamespace = 'postbox'::regnamespace AND c.relkind = 'r'"
            ).fetchall()
            for (table,) in tables:
                c.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")
            for b in range(QUEUED):
                if b == analyzed_at:
                    c.execute("ANALYZE")
                    c.commit()
                if b == QUEUED // 2:
                    # The ledger's slots rotate, so that both hold receipts (an empty table is
                    # rightly scanned).
                    c.execute("SELECT postbox.dedup_rotate_v1(now() + interval '100 years')")
                ids = range(b * KEYS, (b + 1) * KEYS)
                postbox.receive_many(
                    c,
                    [
                        {"consumer": "c", "message_id": str(i), "payload": {"i": i}, "key": f"k{i % KEYS}"}
                        for i in ids
                    ],
                )
                postbox.publish_many(
                    c, [{"destination": "d", "payload": {"i": i}, "key": f"k{i % KEYS}"} for i in ids]
                )
                c.commit()
        yield db.name


@pytest.fixture(scope="module")
def queued_template(pg_server, template_db) -> Iterator[str]:
    """The queued database, never analyzed."""
    with _queued_database(pg_server, template_db, "postbox_plans", None) as name:
        yield name


@pytest.fixture(scope="module")
def grown_template(pg_server, template_db) -> Iterator[str]:
    """The queued database, analyzed while it was empty (as right after the schema was made) and
    filled since: the statistics of a queue that grew before autovacuum analyzed it again."""
    with _queued_database(pg_server, template_db, "postbox_plans_grown", 0) as name:
        yield name


@pytest.fixture(scope="module", params=["never analyzed", "analyzed", "analyzed empty, then grown"])
def queued(request, pg_server) -> Iterator[str]:
    """A copy of the queued database, its statistics as the parameter says."""
    template = request.getfixturevalue(
        "grown_template" if request.param.endswith("grown") else "queued_template"
    )
    with contextmanager(_cloned)(pg_server, "postbox_plans_copy", template) as db:
        if request.param == "analyzed":
            with db.connect(autocommit=True) as c:
                c.execute("ANALYZE")
        yield db.url


_ids = count(10**9)


def _new() -> str:
    return str(next(_ids))


def _batch(keyed: bool) -> list[dict[str, Any]]:
    return [
        {"consumer": "c", "message_id": _new(), "payload": {}} | ({"key": f"k{i % KEYS}"} if keyed else {})
        for i in range(500)
    ]


OPERATIONS: dict[str, Callable[[psycopg.Connection], object]] = {
    "receive behind a head": lambda c: [
        postbox.receive(c, consumer="c", message_id=_new(), key="k1", payload={}) for _ in range(3)
    ],
    "receive under a new key": lambda c: [
        postbox.receive(c, consumer="c", message_id=_new(), key=f"new-{_new()}", payload={}) for _ in range(3)
    ],
    "receive without a key": lambda c: [
        postbox.receive(c, consumer="c", message_id=_new(), payload={}) for _ in range(3)
    ],
    # Three batches of 500: the first two lock their keys first, the third (past the transaction's
    # first 1,000 batched messages) looks for its heads before it locks.
    "receive_many behind heads": lambda c: [postbox.receive_many(c, _batch(keyed=True)) for _ in range(3)],
    "receive_many without keys": lambda c: postbox.receive_many(c, _batch(keyed=False)),
    "receive_many of redeliveries": lambda c: postbox.receive_many(
        c,
        [
            {"consumer": "c", "message_id": str(i), "payload": {"i": i}, "key": f"k{i % KEYS}"}
            for i in range(500)
        ],
    ),
    "publish behind a head": lambda c: [
        postbox.publish(c, destination="d", key="k1", payload={}) for _ in range(3)
    ],
    "publish_many behind heads": lambda c: postbox.publish_many(
        c, [{"destination": "d", "payload": {}, "key": f"k{i % KEYS}"} for i in range(500)]
    ),
    "publish_many without keys": lambda c: postbox.publish_many(
        c, [{"destination": "d", "payload": {}}] * 500
    ),
}


def _plans(
    url: str, isolation: str, operation: Callable[[psycopg.Connection], object]
) -> list[dict[str, Any]]:
    """The plans of every statement ``operation`` runs (nested ones included), its commit's (the
    deferred checks) too."""
    notices: list[str] = []
    with psycopg.connect(url) as c:
        c.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        c.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        c.execute("LOAD 'auto_explain'")
        for setting in (
            "log_min_duration = 0",
            "log_nested_statements = on",
            "log_format = json",
            "log_level = notice",
        ):
            c.execute(f"SET LOCAL auto_explain.{setting}")
        operation(c)
        c.commit()
    plans = []
    for notice in notices:
        _, _, text = notice.partition("plan:")
        if text.strip():
            plans.append(json.loads(text))
    return plans


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_no_statement_a_producer_runs_scans_a_queue_or_the_ledger(queued, operation, isolation):
    plans = _plans(queued, isolation, OPERATIONS[operation])
    assert len(plans) > 3, "auto_explain reported the statements"
    scans = [
        (table, plan["Query Text"][:300])
        for plan in plans
        for table in _seq_scans(plan["Plan"])
        if table not in SMALL
    ]
    assert not scans, scans

"""Least privilege, enforced by PostgreSQL, asserted from real logins of each Postbox role.

The matrix covers every table, view, sequence and function of schema ``postbox``, listed from the
catalog: an object the matrix does not name fails the test (decide who may use it, in
``sql/roles_v1.sql`` and here). Every kind of Postbox process then does its basic work as a login in
its role: producer, worker, relay, bridge, maintenance, metrics, the operator CLI (replay included)
and ``postbox status``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

import postbox
from postbox.clock import FakeClock
from postbox.failures.outcomes import Permanent, Transient
from postbox.failures.policy import Backoff, RetryPolicy
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from postbox.operations.maintenance import JOBS, Maintenance, MaintenanceSettings
from postbox.operations.metrics import DatabaseMetrics
from postbox.outbox.bridge import Bridge, Incoming
from postbox.outbox.relay import Relay, RelaySettings
from postbox.outbox.transports.postgres import PostgresTransport
from tests.conftest import Database, _conninfo_url
from tests.helpers import FAST_WORKER, REPO, eventually, scalar

ROLES = ("producer", "worker", "maintainer", "operator", "reader")
NOBODY = "nobody"  # a login in no Postbox role: what PUBLIC may do
LOGINS = (*ROLES, NOBODY)

PRODUCER, WORKER, MAINTAINER, OPERATOR, READER = ROLES
READ_ALL = frozenset({OPERATOR, READER})

# --- the matrix ---------------------------------------------------------------------------------

# Tables: the roles that may SELECT. No Postbox role may INSERT, UPDATE, DELETE or TRUNCATE any of
# them (every change is a SECURITY DEFINER function), nor hold REFERENCES or TRIGGER.
TABLES: dict[str, frozenset[str]] = {
    "consumers": READ_ALL
    | {WORKER, MAINTAINER},  # bridges wait for their consumer; maintenance: gap timeouts
    "inbox": READ_ALL,
    "inbox_dedup": READ_ALL,
    "inbox_dedup_0": READ_ALL,
    "inbox_dedup_1": READ_ALL,
    "inbox_commit_checks": READ_ALL,
    "dedup_window": READ_ALL
    | {MAINTAINER, WORKER},  # maintenance reads the window it set, a worker checks it
    "inbox_keys": READ_ALL | {MAINTAINER},
    "outbox": READ_ALL,
    "dead_letters": READ_ALL,
    "key_repairs": READ_ALL | {MAINTAINER},
    "attempts": READ_ALL,
    "workers": READ_ALL,
    "audit_log": READ_ALL,
    "dead_letter_edits": READ_ALL,
    "replay_jobs": READ_ALL,
    "replay_items": READ_ALL,
    "maintenance_runs": READ_ALL | {MAINTAINER},
    "alembic_version": READ_ALL | {WORKER, MAINTAINER},  # processes check the revision at start
}

VIEWS: dict[str, frozenset[str]] = dict.fromkeys(
    (
        "blocked_keys",
        "key_gaps",
        "live_workers",
        "dead_letter_summary",
        "dead_letter_groups",
        "inbox_by_attempt",
        "outbox_backlog",
        "replay_progress",
    ),
    READ_ALL,
)

# Sequences: nobody (ids are drawn inside the functions).

PRODUCE = frozenset({PRODUCER, WORKER})  # handlers publish in the worker's transaction; bridges receive
OPERATE = frozenset({OPERATOR})
NONE: frozenset[str] = frozenset()

# Functions, by name (every overload): the roles that may call them.
FUNCTIONS: dict[str, frozenset[str]] = {
    # producers
    "inbox_receive_v1": PRODUCE,
    "inbox_receive_batch_v1": PRODUCE,
    "inbox_receive_columns_v1": PRODUCE,
    "inbox_receive_arrays_v1": PRODUCE,
    "outbox_publish_v1": PRODUCE,
    "outbox_publish_batch_v1": PRODUCE,
    "inbox_receive_batch_v2": PRODUCE,
    "outbox_publish_batch_v2": PRODUCE,
    "inbox_receive": PRODUCE,
    "inbox_receive_batch": PRODUCE,
    "outbox_publish": PRODUCE,
    "outbox_publish_batch": PRODUCE,
    "max_payload_bytes_v1": PRODUCE,  # the limits in force, read before sending a large message
    "max_headers_bytes_v1": PRODUCE,
    # workers and relays
    "declare_consumer_v1": frozenset({WORKER}),
    "inbox_claim_v1": frozenset({WORKER}),
    "inbox_complete_v1": frozenset({WORKER}),
    "inbox_retry_v1": frozenset({WORKER}),
    "inbox_dead_letter_v1": frozenset({WORKER}),
    "inbox_exhaust_v1": frozenset({WORKER}),
    "inbox_release_v1": frozenset({WORKER}),
    "outbox_claim_v1": frozenset({WORKER}),
    "outbox_complete_v1": frozenset({WORKER}),
    "outbox_retry_v1": frozenset({WORKER}),
    "outbox_dead_letter_v1": frozenset({WORKER}),
    "outbox_release_v1": frozenset({WORKER}),
    # every long-running process
    "worker_heartbeat_v1": frozenset({WORKER, MAINTAINER}),  # 0.1.0 processes, during a rolling deploy
    "worker_heartbeat_v2": frozenset({WORKER, MAINTAINER}),
    "reap_stale_workers_v1": frozenset({WORKER, MAINTAINER}),
    "worker_unregister_v1": frozenset({WORKER, MAINTAINER}),
    "metrics_snapshot_v1": frozenset({WORKER, MAINTAINER, OPERATOR, READER}),
    # maintenance
    "maintenance_register_v1": frozenset({MAINTAINER}),
    "maintenance_claim_v1": frozenset({MAINTAINER}),
    "maintenance_finish_v1": frozenset({MAINTAINER}),
    "prune_dedup_v1": frozenset({MAINTAINER}),
    "dedup_window_set_v1": frozenset({MAINTAINER}),
    "dedup_rotate_v1": frozenset({MAINTAINER}),
    "prune_attempts_v1": frozenset({MAINTAINER}),
    "prune_dead_letters_v1": frozenset({MAINTAINER}),  # earlier releases' maintenance, during a deploy
    "prune_dead_letters_v2": frozenset({MAINTAINER}),
    "maintenance_repair_keys_v1": frozenset({MAINTAINER}),
    # operators (audited)
    "dlq_discard_v1": OPERATE,
    "dlq_resolve_v1": OPERATE,
    "dlq_edit_v1": OPERATE,
    "dlq_replay_v1": OPERATE,
    "replay_step_v1": OPERATE,
    "replay_pause_v1": OPERATE,
    "replay_resume_v1": OPERATE,
    "replay_cancel_v1": OPERATE,
    "key_unblock_v1": OPERATE,
    "consumer_halt_op_v1": OPERATE,
    "consumer_resume_op_v1": OPERATE,
    "dlq_discard": OPERATE,
    "dlq_resolve": OPERATE,
    "dlq_edit": OPERATE,
    "dlq_replay": OPERATE,
    "replay_step": OPERATE,
    "replay_pause": OPERATE,
    "replay_resume": OPERATE,
    "replay_cancel": OPERATE,
    "key_unblock": OPERATE,
    "consumer_halt": OPERATE,
    "consumer_resume": OPERATE,
    # reading dead letters
    "dlq_select_v1": READ_ALL,
    "dlq_explain_v1": READ_ALL,
    "dlq_select": READ_ALL,
    "dlq_explain": READ_ALL,
    # internal helpers: run inside the entry points, as their owner; callable by no Postbox role
    **dict.fromkeys(
        (
            "notify_enabled_v1",
            "reject_v1",
            "check_text_v1",
            "check_json_v1",
            "message_fields_bad_v1",
            "reject_message_fields_v1",
            "check_message_json_v1",
            "check_batch_fields_v1",
            "message_json_large_v1",
            "check_message_element_v1",
            "json_problem_v1",
            "json_array_ok_v1",
            "jsonb_values_ok_v1",
            "texts_ok_v1",
            "check_batch_arrays_v1",
            "try_lock_key_v1",
            "lock_key_shared_v1",
            "consumer_halt_v1",
            "consumer_resume_v1",
            "audit_v1",
            "require_reason_v1",
            "dead_letter_release_key_v1",
            "dlq_close_v1",
            "dead_letter_send_back_v1",
            "inbox_copy_to_dead_letters_v1",
            "inbox_promote_v1",
            "repair_keys_v1",
            "inbox_receive_rows_v1",
            "dedup_retention_v1",
            "dedup_current_slot_v1",
            "inbox_receipt_live_v1",
            "inbox_dedup_take_expired_v1",
            "inbox_batch_ok_v1",
            "inbox_receive_many_v1",
            "inbox_batch_columns_v1",
            "inbox_receive_arrays_each_v1",
            "inbox_receive_each_v1",
            "inbox_finish_v1",
            "outbox_promote_v1",
            "outbox_next_v1",
            "dead_letter_replay_plan_v1",
            "replay_settle_v1",
            "replay_control_v1",
            # trigger functions (fired, never called; they need no grant)
            "inbox_pending_commit_v1",
            "inbox_commit_check_v1",
            "outbox_pending_commit_v1",
            "replay_settled_v1",
            "dead_letter_link_replay_v1",
        ),
        NONE,
    ),
}

# Granted functions that run with the caller's rights: they only call entry points (the unversioned
# aliases) or read what their callers may read, and call no internal helper (which their callers
# may not call). Every other granted function is SECURITY DEFINER.
CALLERS_RIGHTS = frozenset(
    {
        "inbox_receive",
        "inbox_receive_batch",
        "outbox_publish",
        "outbox_publish_batch",
        "max_payload_bytes_v1",
        "max_headers_bytes_v1",
        "dlq_discard",
        "dlq_resolve",
        "dlq_edit",
        "dlq_replay",
        "replay_step",
        "replay_pause",
        "replay_resume",
        "replay_cancel",
        "key_unblock",
        "consumer_halt",
        "consumer_resume",
        "dlq_explain_v1",
        "dlq_select",
        "dlq_explain",
    }
)
FIXED_PATH = "search_path=pg_catalog, postbox, pg_temp"

# --- logins ---------------------------------------------------------------------------------------


@pytest.fixture
def logins(database: Database) -> Iterator[dict[str, str]]:
    """One login per Postbox role (and one in none), unique to this test (roles are per cluster),
    dropped afterwards; the URL of each, by role."""
    tag = uuid.uuid4().hex[:10]
    password = uuid.uuid4().hex
    names = {role: f"pbx_{tag}_{role}" for role in LOGINS}
    with database.connect(autocommit=True) as c:
        for role, name in names.items():
            member = (
                sql.SQL("")
                if role == NOBODY
                else sql.SQL(" IN ROLE {}").format(sql.Identifier(f"postbox_{role}"))
            )
            c.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}{}").format(
                    sql.Identifier(name), sql.Literal(password), member
                )
            )
    try:
        yield {
            role: _conninfo_url(
                dict(database.server.params, dbname=database.name, user=name, password=password)
            )
            for role, name in names.items()
        }
    finally:
        with database.connect(autocommit=True) as c:
            c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = ANY (%s)",
                      (list(names.values()),))  # fmt: skip
            users = sql.SQL(", ").join(sql.Identifier(n) for n in names.values())
            c.execute(sql.SQL("DROP OWNED BY {}").format(users))  # grants the test gave them here
            c.execute(sql.SQL("DROP ROLE {}").format(users))


def allowed(conn: psycopg.Connection[Any], statement: sql.Composable | str) -> bool:
    """Whether the login may run ``statement``: True if it ran, or failed for another reason than
    privileges (a function called with NULL arguments refuses them); False if refused. Nothing it
    does is kept."""
    try:
        with conn.transaction():
            conn.execute(statement)
            raise psycopg.Rollback()
    except psycopg.errors.InsufficientPrivilege:
        return False
    except psycopg.Error:
        return True
    return True


Relation = tuple[str, int]  # relkind, oid
Function = tuple[str, str, list[str], str, int]  # name, signature, argument types, kind, oid


def _catalog(conn: psycopg.Connection[Any]) -> tuple[dict[str, Relation], list[Function]]:
    """Every relation (name -> kind, oid) and function of schema postbox. Privileges are then asked
    by oid: a name would need USAGE on the schema just to be looked up."""
    relations = {
        name: (kind, int(oid))
        for name, kind, oid in conn.execute(
            """SELECT c.relname, c.relkind::text, c.oid::int8 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                WHERE n.nspname = 'postbox' AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')"""
        ).fetchall()
    }
    functions = [
        (name, signature, list(args), kind, int(oid))
        for name, signature, args, kind, oid in conn.execute(
            """SELECT p.proname, p.oid::regprocedure::text,
                      ARRAY(SELECT format_type(t.oid, NULL) FROM unnest(p.proargtypes::oid[]) WITH ORDINALITY AS t (oid, i)
                             ORDER BY t.i),
                      CASE WHEN p.prorettype = 'pg_catalog.trigger'::regtype THEN 't' ELSE p.prokind::text END,
                      p.oid::int8
                 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                WHERE n.nspname = 'postbox' ORDER BY 2"""
        ).fetchall()
    ]
    return relations, functions


def _call(name: str, args: Sequence[str], kind: str) -> sql.Composed:
    nulls = sql.SQL(", ").join(
        sql.SQL("NULL::{}").format(sql.SQL(a)) for a in args
    )  # type names from the catalog
    verb = sql.SQL("CALL") if kind == "p" else sql.SQL("SELECT")
    return sql.SQL("{} postbox.{}({})").format(verb, sql.Identifier(name), nulls)


def test_every_postbox_object_is_in_the_matrix_and_every_entry_point_runs_as_its_owner(database):
    """The matrix names every table, view and function in schema postbox (a new one must be
    placed); entry points granted to a role are SECURITY DEFINER with search_path fixed, and so are
    trigger functions (deferred ones fire at COMMIT as the committing login); internal helpers are
    not (they are called per row: no SET clause to pay for, inlinable); granted callers'-rights
    functions are only the aliases and the dead-letter readers."""
    with database.connect() as c:
        relations, functions = _catalog(c)
        config = {
            sig: (secdef, cfg or [])
            for sig, secdef, cfg in c.execute(
                """SELECT p.oid::regprocedure::text, p.prosecdef, p.proconfig FROM pg_proc p
                     JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'postbox'"""
            ).fetchall()
        }
    tables = {n for n, (k, _) in relations.items() if k in ("r", "p", "f")}
    views = {n for n, (k, _) in relations.items() if k in ("v", "m")}
    names = {f[0] for f in functions}
    problems = [f"table postbox.{t} is not in the matrix (TABLES)" for t in sorted(tables - set(TABLES))]
    problems += [f"view postbox.{v} is not in the matrix (VIEWS)" for v in sorted(views - set(VIEWS))]
    problems += [
        f"function postbox.{n} is not in the matrix (FUNCTIONS)" for n in sorted(names - set(FUNCTIONS))
    ]
    problems += [f"postbox.{t} is in TABLES but not in the database" for t in sorted(set(TABLES) - tables)]
    problems += [f"postbox.{v} is in VIEWS but not in the database" for v in sorted(set(VIEWS) - views)]
    problems += [
        f"postbox.{n} is granted in FUNCTIONS but not in the database"
        for n in sorted(n for n, roles in FUNCTIONS.items() if roles and n not in names)
    ]
    for name, signature, _, kind, _ in functions:
        secdef, cfg = config[signature]
        entry = bool(FUNCTIONS.get(name)) and name not in CALLERS_RIGHTS
        if entry or kind == "t":
            if not secdef or FIXED_PATH not in cfg:
                problems.append(
                    f"{signature} must be SECURITY DEFINER with {FIXED_PATH} (has {secdef}, {cfg})"
                )
        elif secdef:
            problems.append(f"{signature} is SECURITY DEFINER but not an entry point of any role")
        if secdef and not any(s.startswith("search_path=") for s in cfg):
            problems.append(f"{signature} is SECURITY DEFINER without a fixed search_path")
    assert not problems, "\n".join(problems)


def test_each_role_may_do_exactly_what_the_matrix_says(database, logins):
    """From a login in each role (and one in none): SELECT, INSERT, UPDATE, DELETE and TRUNCATE on
    every table, SELECT on every view, nextval on every sequence and a call of every function, each
    run for real (in a savepoint, rolled back); the catalog's privileges agree for the rest."""
    with database.connect() as c:
        relations, functions = _catalog(c)
        first_column = dict(
            c.execute(
                """SELECT c.relname, a.attname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                     JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = 1
                    WHERE n.nspname = 'postbox'"""
            ).fetchall()
        )
    problems: list[str] = []

    def expect(role: str, what: str, want: bool, got: bool) -> None:
        if want != got:
            problems.append(
                f"{role}: {what} is {'allowed' if got else 'refused'}, should be {'allowed' if want else 'refused'}"
            )

    for role in LOGINS:
        with psycopg.connect(logins[role]) as c:
            c.execute("SET statement_timeout = '10s'")
            schema_usage, schema_create = c.execute(
                "SELECT has_schema_privilege('postbox', 'USAGE'), has_schema_privilege('postbox', 'CREATE')"
            ).fetchone() or (None, None)
            expect(role, "USAGE on schema postbox", role != NOBODY, bool(schema_usage))
            expect(role, "CREATE in schema postbox", False, bool(schema_create))
            for name, (kind, oid) in sorted(relations.items()):
                target = sql.SQL("postbox.{}").format(sql.Identifier(name))
                if kind == "S":
                    expect(role, f"nextval on sequence {name}", False,
                           allowed(c, sql.SQL("SELECT nextval({})").format(sql.Literal(f"postbox.{name}"))))  # fmt: skip
                    rights = c.execute(
                        "SELECT has_sequence_privilege(%s::oid, 'USAGE, SELECT, UPDATE')", (oid,)
                    ).fetchone()
                    expect(role, f"privileges on sequence {name}", False, bool(rights and rights[0]))
                    continue
                readers = TABLES.get(name, VIEWS.get(name, NONE))
                expect(role, f"SELECT on {name}", role in readers,
                       allowed(c, sql.SQL("SELECT count(*) FROM {}").format(target)))  # fmt: skip
                if kind in ("r", "p", "f"):
                    column = sql.Identifier(first_column[name])
                    for verb, statement in (
                        ("INSERT", sql.SQL("INSERT INTO {} DEFAULT VALUES").format(target)),
                        (
                            "UPDATE",
                            sql.SQL("UPDATE {} SET {} = {} WHERE false").format(target, column, column),
                        ),
                        ("DELETE", sql.SQL("DELETE FROM {} WHERE false").format(target)),
                        ("TRUNCATE", sql.SQL("TRUNCATE {}").format(target)),
                    ):
                        expect(role, f"{verb} on {name}", False, allowed(c, statement))
                # Views are not updatable through these statements either way; the catalog says who may.
                granted = c.execute(
                    "SELECT privilege FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE',"
                    " 'REFERENCES', 'TRIGGER']) AS privilege WHERE has_table_privilege(%s::oid, privilege)",
                    (oid,),
                ).fetchall()
                expect(role, f"write privileges on {name}", False, any(p != "SELECT" for (p,) in granted))
                expect(role, f"SELECT privilege on {name}", role in readers, ("SELECT",) in granted)
            for name, signature, args, kind, oid in functions:
                may = role in FUNCTIONS.get(name, NONE)
                expect(role, f"calling {signature}", may, allowed(c, _call(name, args, kind)))
                privilege = c.execute("SELECT has_function_privilege(%s::oid, 'EXECUTE')", (oid,)).fetchone()
                expect(role, f"EXECUTE privilege on {signature}", may, bool(privilege and privilege[0]))
    assert not problems, "\n".join(problems)


# --- every process, as its role ------------------------------------------------------------------

QUICK = RetryPolicy(strategy=Backoff.FIXED, base_delay=0.05, max_attempts=1000, max_total_seconds=None)
FAST_RELAY = {"poll_interval": 0.05, "heartbeat_interval": 0.3, "stale_after": 1.5, "grace_period": 5.0}


def _count(url: str, where: str, params: tuple[object, ...] = ()) -> int:
    return int(scalar(url, f"SELECT count(*) FROM {where}", params) or 0)


def test_producer_login_receives_and_publishes_and_wakes_workers(database, logins):
    """A producer login, with no right on any table, receives in every form (one, columns, arrays,
    JSON batch) and publishes (one, batch) in one transaction; messages queued behind their key's
    head are checked at its COMMIT (deferred trigger) as that login; a worker login listening is
    woken by NOTIFY; a redelivery is told apart as a duplicate."""
    url = database.url
    with psycopg.connect(logins[WORKER], autocommit=True) as listener:
        listener.execute("LISTEN postbox_inbox")
        with psycopg.connect(logins[PRODUCER]) as c:
            first = postbox.receive(c, consumer="orders", message_id="o-1", key="k1", payload={"n": 1})
            columns = postbox.receive_many(
                c,
                [
                    {"consumer": "orders", "message_id": "o-2", "key": "k1", "payload": {"n": 2}},
                    {"consumer": "orders", "message_id": "o-3", "key": "k2", "payload": {"n": 3}},
                ],
            )
            arrays = postbox.receive_many(
                c,
                [
                    {"consumer": "orders", "message_id": "o-4", "key": "k1", "payload": {"n": 4}},
                    {"consumer": "billing", "message_id": "b-1", "key": "k1", "payload": {"n": 1}},
                ],
            )
            batch = c.execute(
                "SELECT status FROM postbox.inbox_receive_batch(%s::jsonb)",
                (json.dumps([{"consumer": "billing", "message_id": "b-2", "key": "k1", "payload": 2}]),),
            ).fetchall()
            postbox.publish(c, destination="emails", key="k1", payload={"n": 1})
            postbox.publish_many(
                c, [{"destination": "emails", "key": "k1", "payload": {"n": i}} for i in (2, 3)]
            )
            c.commit()
            assert [r.status.value for r in (first, *columns, *arrays)] == ["new"] * 5
            assert batch == [("new",)]
            again = postbox.receive(c, consumer="orders", message_id="o-1", key="k1", payload={"n": 1})
            c.commit()
            assert again.status.value == "duplicate"
        woken = {n.payload for n in listener.notifies(timeout=5, stop_after=2)}
        assert woken == {"orders", "billing"}
    assert _count(url, "postbox.inbox") == 6
    assert _count(url, "postbox.inbox WHERE state = 'pending'") == 3  # o-2, o-4 behind o-1; b-2 behind b-1
    assert _count(url, "postbox.outbox") == 3
    assert _count(url, "postbox.key_repairs") == 0  # their heads were there at COMMIT


class ListSource:
    """A broker stand-in for the bridge: hands out its items, records acks."""

    def __init__(self, items: list[Incoming]) -> None:
        self.items = items
        self.acked: list[Incoming] = []
        self._idle = threading.Event()

    def fetch(self, limit: int, timeout: float) -> list[Incoming]:
        batch, self.items = self.items[:limit], self.items[limit:]
        if not batch:
            self._idle.wait(timeout)  # an empty broker waits for its timeout
        return batch

    def ack(self, items: Sequence[Incoming]) -> None:
        self.acked.extend(items)

    def reject(self, item: Incoming) -> None:
        raise AssertionError(f"rejected {item}")

    def close(self) -> None:
        pass


def test_worker_relay_and_bridge_run_as_worker_logins(database, logins):
    """A worker login declares its consumer, drains it with a Worker (completing, retrying and
    dead-lettering, publishing from its handler), a relay login moves the outbox to another
    consumer's inbox, a bridge login receives from a broker; each registers its presence and
    leaves at a clean stop; the database gauges refresh as that login."""
    url = database.url
    with database.connect(autocommit=True) as c:
        c.execute("CREATE TABLE handled (message_id text PRIMARY KEY)")
        c.execute(
            sql.SQL("GRANT SELECT, INSERT ON handled TO {}").format(sql.Identifier(_user(logins[WORKER])))
        )
    with psycopg.connect(logins[WORKER]) as c:
        for consumer in ("orders", "next"):
            postbox.declare_consumer(c, consumer)
        c.commit()
    with psycopg.connect(logins[PRODUCER]) as c:
        postbox.receive_many(
            c,
            [
                {"consumer": "orders", "message_id": f"o-{i}", "key": f"k{i % 2}", "payload": {"i": i}}
                for i in range(4)
            ]
            + [
                {"consumer": "orders", "message_id": "o-flaky", "key": "k9", "payload": {"flaky": True}},
                {"consumer": "orders", "message_id": "o-bad", "key": "k8", "payload": {"bad": True}},
            ],
        )
        c.commit()
    failed_once: set[str] = set()
    reg = Registry()

    @reg.handler("orders")
    def handle(m: Any, ctx: Any) -> None:
        if m.payload.get("bad"):
            raise Permanent("bad order")
        if m.payload.get("flaky") and m.message_id not in failed_once:
            failed_once.add(m.message_id)
            raise Transient("try again")
        ctx.conn.execute("INSERT INTO handled VALUES (%s)", (m.message_id,))
        ctx.publish("next", {"from": m.message_id}, key=m.key)

    w = Worker(logins[WORKER], reg, WorkerSettings(consumer="orders", retry=QUICK, **FAST_WORKER))
    w.start()
    try:
        eventually(lambda: _count(url, "handled") == 5, what="orders handled")
        eventually(lambda: _count(url, "postbox.dead_letters WHERE message_id = 'o-bad'") == 1)
        assert _count(url, "postbox.workers WHERE kind = 'worker'") == 1
    finally:
        w.stop()
        w.join()
    assert _count(url, "postbox.workers") == 0  # unregistered at its clean stop
    assert _count(url, "postbox.attempts WHERE message_id = 'o-flaky'") == 1

    relay = Relay(
        logins[WORKER],
        {"next": PostgresTransport(logins[WORKER], "next")},
        RelaySettings(**{**FAST_RELAY, "retry": QUICK}),
    )
    relay.start()
    try:
        eventually(lambda: _count(url, "postbox.outbox") == 0, what="outbox relayed")
    finally:
        relay.stop()
        relay.join()
    assert _count(url, "postbox.inbox WHERE consumer = 'next'") == 5
    assert _count(url, "postbox.workers") == 0

    source = ListSource([Incoming(i, f"br-{i}", "bk", "order.event", b'{"i": 1}') for i in range(3)])
    bridge = Bridge(logins[WORKER], source, "orders", batch_size=16, wait=0.05, origin="memory")
    thread = threading.Thread(target=bridge.run)
    thread.start()
    try:
        eventually(lambda: len(source.acked) == 3, what="bridged")
    finally:
        bridge.stop()
        thread.join(30)
    assert bridge.received == 3
    assert _count(url, "postbox.inbox WHERE starts_with(message_id, 'br-')") == 3

    gauges = DatabaseMetrics(logins[WORKER])
    gauges.refresh()
    inbox = {
        s.labels["consumer"]: s.value
        for f in gauges.collect()
        if f.name == "postbox_inbox_messages"
        for s in f.samples
    }
    assert inbox.get("orders") and inbox.get("next")


def test_maintenance_runs_every_job_as_a_maintainer_login(database, logins):
    """A maintainer login runs every maintenance job (prunes through functions, repairs an orphaned
    key, reaps a stale process, reports gap timeouts), records each run, beats and leaves; it reads
    the gauges too."""
    url = database.url
    with database.connect() as c:
        # In the older slot, the window and its margin long passed: the rotation drops it.
        c.execute("""INSERT INTO postbox.inbox_dedup (consumer, message_id, payload_hash, inbox_id, received_at, slot)
                     VALUES ('c', 'gone', '\\x00', 424242, now() - interval '40 days', 1)""")
        c.execute("UPDATE postbox.dedup_window SET rotated_at = now() - interval '40 days'")
        c.execute("""INSERT INTO postbox.dead_letters (origin, origin_id, consumer, message_id, key, position, payload,
                         received_at, attempt, reason, ordering_policy, status, dead_lettered_at, status_changed_at)
                     VALUES ('inbox', 7, 'c', 'old', 'k', 1, '1', now(), 1, 'permanent', 'block', 'resolved',
                             now() - interval '40 days', now() - interval '40 days')""")
        c.execute("""INSERT INTO postbox.attempts (origin, origin_id, queue, message_id, key, attempt, failed_at, kind, decision)
                     VALUES ('inbox', 7, 'c', 'old', 'k', 1, now() - interval '40 days', 'transient', 'retry')""")
        c.execute("""INSERT INTO postbox.workers (id, kind, host, pid, heartbeat_at)
                     VALUES ('dead', 'worker', 'h', 1, now() - interval '1 hour')""")
        c.execute("""INSERT INTO postbox.inbox (consumer, message_id, key, position, payload, state)
                     VALUES ('c', 'orphan', 'ko', 1, '{}', 'pending')""")
        c.execute("""INSERT INTO postbox.key_repairs (origin, queue, key, created_at)
                     VALUES ('inbox', 'c', 'ko', now() - interval '1 minute')""")
        c.commit()
    day = 86400.0
    settings = MaintenanceSettings(
        dedup_retention_seconds=day, attempts_retention_seconds=day, dead_letter_retention_seconds=day
    )
    m = Maintenance(logins[MAINTAINER], settings, clock=FakeClock(), heartbeat_interval=0.5)
    # All but vacuum_queues: the role owns no table, so it leaves vacuuming to autovacuum or to a
    # process that may (tests/test_vacuum.py).
    jobs = [job for job in JOBS if job != "vacuum_queues"]
    assert m.run_once() == dict.fromkeys(jobs, True)
    with database.connect() as c:
        runs = c.execute(
            "SELECT job, last_success_at IS NOT NULL, last_error FROM postbox.maintenance_runs"
        ).fetchall()
        assert sorted(runs) == sorted([*((job, True, None) for job in jobs), ("vacuum_queues", False, None)])
        assert c.execute("SELECT state FROM postbox.inbox WHERE message_id = 'orphan'").fetchone() == (
            "ready",
        )
        left = c.execute(
            "SELECT (SELECT count(*) FROM postbox.inbox_dedup), (SELECT count(*) FROM postbox.dead_letters),"
            " (SELECT count(*) FROM postbox.attempts), (SELECT count(*) FROM postbox.workers),"
            " (SELECT count(*) FROM postbox.key_repairs)"
        ).fetchone()
    assert left == (0, 0, 0, 0, 0)
    m.presence.beat()
    assert _count(url, "postbox.workers WHERE kind = 'maintenance'") == 1
    m.presence.unregister()
    assert _count(url, "postbox.workers") == 0
    gauges = DatabaseMetrics(logins[MAINTAINER])
    gauges.refresh()
    assert any(f.name == "postbox_inbox_messages" and f.samples for f in gauges.collect())


def _user(url: str) -> str:
    return str(conninfo_to_dict(url)["user"])


def postbox_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "postbox", "--database-url", url, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "POSTBOX_ACTOR": "ops"},
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"postbox {' '.join(args)}: {result.stderr}"
    return result


def test_operator_login_runs_the_cli_and_a_reader_login_the_status(database, logins):
    """An operator login lists, edits and replays (the replay runner in the foreground, a worker
    login processing what it sends back), discards and halts through the CLI, every action audited
    under its login; a reader login prints `postbox status`."""
    url = database.url
    with database.connect(autocommit=True) as c:
        c.execute("CREATE TABLE handled (message_id text PRIMARY KEY)")
        c.execute(
            sql.SQL("GRANT SELECT, INSERT ON handled TO {}").format(sql.Identifier(_user(logins[WORKER])))
        )
    with psycopg.connect(logins[PRODUCER]) as c:
        postbox.receive_many(
            c,
            [
                {"consumer": "stock", "message_id": "s-1", "key": "a", "payload": {"bad": True}},
                {"consumer": "stock", "message_id": "s-2", "key": "a", "payload": {}},
                {"consumer": "stock", "message_id": "s-3", "key": "b", "payload": {"bad": True}},
            ],
        )
        c.commit()
    reg = Registry()

    @reg.handler("stock")
    def handle(m: Any, ctx: Any) -> None:
        if m.payload.get("bad"):
            raise Permanent("bad reservation")
        ctx.conn.execute("INSERT INTO handled VALUES (%s)", (m.message_id,))

    w = Worker(logins[WORKER], reg, WorkerSettings(consumer="stock", **FAST_WORKER))
    w.start()
    try:
        eventually(lambda: _count(url, "postbox.blocked_keys") == 2, what="two keys blocked")
        op = logins[OPERATOR]
        listed = json.loads(postbox_cli(op, "dlq", "list", "--queue", "stock", "--json").stdout)
        ids = {r["key"]: r["id"] for r in listed}
        postbox_cli(
            op, "dlq", "edit", str(ids["a"]), "--payload", '{"bad": false}', "--reason", "fixed upstream"
        )
        postbox_cli(op, "dlq", "replay", "--id", str(ids["a"]), "--rate", "100", "--reason", "fixed upstream")
        postbox_cli(op, "dlq", "discard", "--id", str(ids["b"]), "--reason", "obsolete")
        eventually(lambda: _count(url, "handled") == 2, what="key a processed after its replay")
        postbox_cli(op, "consumer", "halt", "stock", "--reason", "stock count")
    finally:
        w.stop()
        w.join()
    with database.connect() as c:
        statuses = dict(c.execute("SELECT key, status FROM postbox.dead_letters").fetchall())
        audit = c.execute("SELECT action, db_user, actor FROM postbox.audit_log ORDER BY id").fetchall()
        halted = c.execute(
            "SELECT halted_at IS NOT NULL FROM postbox.consumers WHERE name = 'stock'"
        ).fetchone()
    assert statuses == {"a": "replayed", "b": "discarded"}
    assert [a for a, _, _ in audit] == ["dlq_edit", "replay", "dlq_discard", "consumer_halt"]
    assert {(u, actor) for _, u, actor in audit} == {(_user(op), "ops")}
    assert halted == (True,)
    status = json.loads(postbox_cli(logins[READER], "status", "--json").stdout)
    assert "stock" in json.dumps(status)


def test_a_login_without_the_commands_role_gets_one_line_naming_the_role_it_needs(database, logins):
    """A command run by a login without the role it needs (status by a worker login, a worker or
    maintenance by a producer login, the dead-letter commands by a worker login...) printed a
    traceback ending in InsufficientPrivilege. Now: one line, the server's refusal and the role the
    command needs, exit 1."""
    cases = [
        (WORKER, ["status"], "postbox_reader or postbox_operator"),
        (MAINTAINER, ["status"], "postbox_reader or postbox_operator"),
        (PRODUCER, ["status"], "postbox_reader or postbox_operator"),
        (PRODUCER, ["worker", "--consumer", "basic", "--app", "tests.apps.basic:registry"], "postbox_worker"),
        (WORKER, ["maintain", "--once"], "postbox_maintainer"),
        (WORKER, ["dlq", "list"], "postbox_operator"),
        (WORKER, ["keys", "blocked"], "postbox_operator"),
        (NOBODY, ["migrate", "--check"], "any Postbox role but postbox_producer"),
        (OPERATOR, ["migrate"], "the schema's owner"),
    ]
    for role, args, needed in cases:
        r = subprocess.run(
            [sys.executable, "-m", "postbox", "--database-url", logins[role], *args],
            capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=60, check=False,
        )  # fmt: skip
        assert r.returncode == 1 and "Traceback" not in r.stderr, (role, args, r.stderr)
        lines = [line for line in r.stderr.splitlines() if line.startswith("postbox:")]
        assert len(lines) == 1 and "permission denied for" in lines[0] and needed in lines[0], (
            role,
            args,
            r.stderr,
        )

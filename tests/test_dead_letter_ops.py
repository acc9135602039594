"""Dead-letter operations from SQL, Python and the CLI: filters, discard, resolve, edit, explain,
unblock, consumer halt/resume, the audit trail, and the database roles (least privilege)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime

import psycopg
import pytest

import postbox
from postbox.deadletters import ops as deadletter
from postbox.deadletters import replay
from postbox.deadletters.ops import DeadLetterFilter
from postbox.deadletters.replay import ReplayOptions, ReplayRunner
from postbox.errors import InvalidRequest
from postbox.failures.outcomes import Permanent
from postbox.inbox.handlers import Registry
from postbox.inbox.worker import Worker, WorkerSettings
from tests.helpers import FAST_WORKER, REPO, eventually, scalar


@pytest.fixture
def blocked(database):
    """Consumer 'stock': s1 and s2 each blocked behind a dead-lettered head with one held message;
    s3 processed. The handler fails for payloads with "bad": true."""
    with database.connect(autocommit=True) as c:
        c.execute("CREATE TABLE done (message_id text, key text, payload jsonb)")
    with database.connect() as c:
        for key, bad in (("s1", True), ("s2", True), ("s3", False)):
            for i in (1, 2):
                postbox.receive(
                    c,
                    postbox.InboxMessage(
                        consumer="stock",
                        message_id=f"{key}-{i}",
                        key=key,
                        type="reserve",
                        payload={"n": i, "bad": bad and i == 1},
                    ),
                )
        c.commit()
    w = start(database.url)
    try:
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM postbox.blocked_keys") == 2)
        eventually(lambda: scalar(database.url, "SELECT count(*) FROM done") == 2)
    finally:
        w.stop()
        w.join()
    return database


def stock_registry() -> Registry:
    reg = Registry()

    @reg.handler("stock")
    def handle(m, ctx):
        if m.payload.get("bad"):
            raise Permanent("bad reservation")
        ctx.conn.execute(
            "INSERT INTO done (message_id, key, payload) VALUES (%s, %s, %s)",
            (m.message_id, m.key, json.dumps(m.payload)),
        )

    return reg


def start(url: str) -> Worker:
    w = Worker(url, stock_registry(), WorkerSettings(consumer="stock", **FAST_WORKER))
    w.start()
    return w


def done_keys(url: str) -> str:
    return scalar(url, "SELECT string_agg(message_id, ',' ORDER BY message_id) FROM done")


def test_filters_are_validated_with_the_field_named(blocked):
    """Unknown filter fields, wrong types and bad timestamps are refused before anything happens."""
    with blocked.connect(autocommit=True) as c:
        for bad, needle in (
            ('{"colour": "red"}', "unknown field 'colour'"),
            ('{"ids": "7"}', "must be an array"),
            ('{"ids": ["x"]}', "array of integers"),
            ('{"since": "not a date"}', "must be timestamps"),
            ('{"status": "lost"}', "must be open"),
            ("[1]", "must be a JSON object"),
        ):
            with pytest.raises(psycopg.DataError, match=needle) as info:
                c.execute("SELECT * FROM postbox.dlq_select(%s::jsonb)", (bad,))
            assert info.value.diag.column_name == "filter"
        with pytest.raises(InvalidRequest, match="reason"):
            deadletter.discard(c, DeadLetterFilter(queue="stock"), reason="  ")
    assert scalar(blocked.url, "SELECT count(*) FROM postbox.audit_log") == 0


def test_discard_with_a_reason_lets_the_key_go_on_and_is_audited(blocked):
    """Discarding s1's dead letter releases its key: the held s1-2 is processed; s2 stays blocked.
    The audit trail says who (role and actor), why and which dead letters."""
    with blocked.connect(autocommit=True) as c:
        dl = scalar(blocked.url, "SELECT id FROM postbox.dead_letters WHERE key = 's1'")
        rows = deadletter.discard(c, DeadLetterFilter(key="s1"), reason="duplicate reservation", actor="dave")
        assert rows == [{"dead_letter_id": dl, "action": "key released: its next message is the head"}]
    w = start(blocked.url)
    try:
        eventually(lambda: done_keys(blocked.url) == "s1-2,s3-1,s3-2")
    finally:
        w.stop()
        w.join()
    assert scalar(
        blocked.url, "SELECT status || ':' || status_reason FROM postbox.dead_letters WHERE id = %s", (dl,)
    ) == ("discarded:duplicate reservation")
    assert scalar(blocked.url, "SELECT count(*) FROM postbox.blocked_keys") == 1
    with blocked.connect() as c:
        (entry,) = deadletter.audit_trail(c)
    assert entry["action"] == "dlq_discard" and entry["actor"] == "dave" and entry["db_role"] == "postgres"
    assert entry["reason"] == "duplicate reservation" and entry["target"] == {"dead_letters": [dl]}


def test_resolve_and_unblock_from_sql(blocked):
    """A DBA resolves s1 by hand with plain SQL and unblocks s2 with postbox.key_unblock; both keys go on."""
    with blocked.connect(autocommit=True) as c:
        c.execute(
            """SELECT * FROM postbox.dlq_resolve('{"key": "s1"}', reason => 'fixed in the ERP by hand')"""
        )
        action = c.execute(
            "SELECT postbox.key_unblock('inbox', 'stock', 's2', reason => 'customer cancelled', actor => 'erin')"
        ).fetchone()[0]
        assert action.endswith("discarded; key released: its next message is the head")
        with pytest.raises(psycopg.DataError, match="not blocked"):
            c.execute("SELECT postbox.key_unblock('inbox', 'stock', 's2', reason => 'again')")
    w = start(blocked.url)
    try:
        eventually(lambda: done_keys(blocked.url) == "s1-2,s2-2,s3-1,s3-2")
    finally:
        w.stop()
        w.join()
    assert (
        scalar(blocked.url, "SELECT string_agg(action, ',' ORDER BY id) FROM postbox.audit_log")
        == "dlq_resolve,key_unblock"
    )


def test_edit_keeps_every_version_and_the_replay_sends_the_edit(blocked):
    """Two edits of s1's payload are versioned (the original stays in payload); a replay sends the
    latest edit; explain shows receipt, the failed attempt, the dead-lettering, the edits and the replay."""
    dl = scalar(blocked.url, "SELECT id FROM postbox.dead_letters WHERE key = 's1'")
    with blocked.connect(autocommit=True) as c:
        assert deadletter.edit_payload(c, dl, {"n": 1, "bad": True, "note": "v1"}, "first try", "fay") == 1
        assert deadletter.edit_payload(c, dl, {"n": 1, "bad": False}, "clear the flag", "fay") == 2
        shown = deadletter.show(c, dl)
        assert shown["payload"] == {"n": 1, "bad": True} and shown["replay_payload"] == {"n": 1, "bad": False}
        assert [(e["version"], e["previous"]) for e in shown["edits"]] == [
            (1, {"n": 1, "bad": True}),
            (2, {"n": 1, "bad": True, "note": "v1"}),
        ]
        job = replay.start(c, DeadLetterFilter(ids=[dl]), "payload fixed", "fay", ReplayOptions(rate=100))
    w = start(blocked.url)
    try:
        ReplayRunner(blocked.url, poll_interval=0.05).run_job(job)
        eventually(lambda: "s1-2" in done_keys(blocked.url))
    finally:
        w.stop()
        w.join()
    assert scalar(blocked.url, "SELECT payload FROM done WHERE message_id = 's1-1'") == {"n": 1, "bad": False}
    with blocked.connect() as c:
        events = [e.event for e in deadletter.explain(c, dl)]
    assert events[0] == "received" and events[1] == "attempt 1 failed"
    assert events[2] == f"dead-lettered as #{dl}"
    assert (
        f"payload of #{dl} edited (version 1)" in events and f"payload of #{dl} edited (version 2)" in events
    )
    assert "operator: replay" in events and events[-1] == f"#{dl} is replayed"


def test_consumer_halt_and_resume_are_audited(blocked):
    """An operator halts a consumer (its workers claim nothing) and resumes it; both are audited."""
    with blocked.connect(autocommit=True) as c:
        deadletter.halt_consumer(c, "stock", "ERP maintenance window", "gus")
        postbox.receive(
            c, postbox.InboxMessage(consumer="stock", message_id="s4-1", key="s4", payload={"n": 1})
        )
    w = start(blocked.url)
    try:
        assert (
            scalar(blocked.url, "SELECT halted_reason FROM postbox.consumers WHERE name = 'stock'")
            == "ERP maintenance window"
        )
        with blocked.connect(autocommit=True) as c:
            assert deadletter.resume_consumer(c, "stock", "window over", "gus") is True
        eventually(lambda: "s4-1" in done_keys(blocked.url))
    finally:
        w.stop()
        w.join()
    assert scalar(
        blocked.url, "SELECT string_agg(action || ':' || actor, ',' ORDER BY id) FROM postbox.audit_log"
    ) == ("consumer_halt:gus,consumer_resume:gus")


def test_roles_separate_producers_workers_and_operators(blocked):
    """postbox_producer can receive and publish but cannot read dead letters, replay, discard or write
    the audit trail; postbox_worker cannot call operator functions; postbox_operator can replay and
    read, but cannot change dead letters or the audit trail except through the audited functions."""
    url = blocked.url
    with psycopg.connect(url, autocommit=True) as c:
        c.execute("SET ROLE postbox_producer")
        assert (
            postbox.receive(
                c, postbox.InboxMessage(consumer="stock", message_id="p-1", key="s9", payload={"n": 1})
            ).status.value
            == "new"
        )
        with c.transaction():
            postbox.receive_many(
                c, [{"consumer": "stock", "message_id": f"p-{i}", "key": "s9", "payload": {}} for i in (2, 3)]
            )
        postbox.publish(c, postbox.OutboxMessage(destination="erp", key="s9", payload={"n": 1}))
        for sql in (
            "SELECT payload FROM postbox.dead_letters",
            "SELECT * FROM postbox.dlq_select('{}')",
            """SELECT postbox.dlq_replay('{"queue": "stock"}', reason => 'x')""",
            """SELECT * FROM postbox.dlq_discard('{"queue": "stock"}', reason => 'x')""",
            "SELECT postbox.consumer_halt('stock', reason => 'x')",
            "INSERT INTO postbox.audit_log (db_role, action) VALUES ('x', 'forged')",
            "SELECT * FROM postbox.attempts",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute(sql)
        c.execute("RESET ROLE")
        c.execute("SET ROLE postbox_worker")
        for sql in (
            """SELECT postbox.dlq_replay('{"queue": "stock"}', reason => 'x')""",
            "INSERT INTO postbox.audit_log (db_role, action) VALUES ('x', 'forged')",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute(sql)
        c.execute("RESET ROLE")
        c.execute("SET ROLE postbox_operator")
        assert c.execute("SELECT count(*) FROM postbox.dead_letters").fetchone()[0] == 2
        job = c.execute(
            """SELECT postbox.dlq_replay('{"key": "s1"}', reason => 'fixed', actor => 'ops')"""
        ).fetchone()[0]
        assert c.execute("SELECT (postbox.replay_step(%s)).replayed", (job,)).fetchone()[0] == 1
        for sql in (
            "UPDATE postbox.dead_letters SET status = 'resolved'",
            "DELETE FROM postbox.audit_log",
            "INSERT INTO postbox.inbox_dedup VALUES ('x', 'y', '', 1)",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                c.execute(sql)
        c.execute("RESET ROLE")
    assert scalar(url, "SELECT db_role FROM postbox.audit_log WHERE action = 'replay'") == "postbox_operator"


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "postbox", "--database-url", url, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "POSTBOX_ACTOR": "cli-tester"},
        timeout=120,
        check=False,
    )


def test_cli_lists_groups_shows_explains_and_replays(blocked):
    """The CLI: list/groups/show/explain as tables and JSON; keys blocked; a dry run and a real replay
    in the foreground; replay status; discard; audit - every action with the actor from the environment."""
    url = blocked.url
    listed = json.loads(cli(url, "dlq", "list", "--queue", "stock", "--json").stdout)
    assert [(r["key"], r["type"], r["reason"]) for r in listed] == [
        ("s1", "reserve", "permanent"),
        ("s2", "reserve", "permanent"),
    ]
    table = cli(url, "dlq", "list").stdout
    assert table.splitlines()[0].split()[:3] == ["ID", "QUEUE", "KEY"] and "bad reservation" in table
    groups = json.loads(cli(url, "dlq", "groups", "--json").stdout)
    assert groups[0]["open"] == 2 and groups[0]["keys"] == 2
    s1 = listed[0]["id"]
    shown = json.loads(cli(url, "dlq", "show", str(s1), "--json").stdout)
    assert shown["payload"] == {"n": 1, "bad": True} and shown["message_id"] == "s1-1"
    explained = cli(url, "dlq", "explain", "--message-id", "s1-1").stdout
    assert "received" in explained and "attempt 1 failed" in explained and "bad reservation" in explained
    blocked_keys = json.loads(cli(url, "keys", "blocked", "--json").stdout)
    assert sorted(k["key"] for k in blocked_keys) == ["s1", "s2"] and blocked_keys[0]["held_messages"] == 1

    refused = cli(url, "dlq", "replay", "--reason", "go")
    assert refused.returncode == 2 and "--all" in refused.stderr
    dry = cli(url, "dlq", "replay", "--key", "s1", "--dry-run", "--reason", "look first")
    assert dry.returncode == 0 and "would send back in place as the head of key s1" in dry.stdout
    assert scalar(url, "SELECT status FROM postbox.dead_letters WHERE id = %s", (s1,)) == "open"

    cli(url, "dlq", "edit", str(s1), "--payload", '{"n": 1, "bad": false}', "--reason", "clear flag")
    w = start(url)
    try:
        done = cli(url, "dlq", "replay", "--key", "s1", "--rate", "50", "--reason", "flag cleared", "--json")
        assert done.returncode == 0, done.stderr
        job = json.loads(done.stdout.splitlines()[-1])
        assert job["state"] == "done" and job["succeeded"] == 1
        eventually(lambda: "s1-2" in done_keys(url))
    finally:
        w.stop()
        w.join()
    status = cli(url, "replay", "status", "--all").stdout
    assert f"{job['id']}" in status and "done" in status
    refused_pause = cli(url, "replay", "pause", str(job["id"]), "--reason", "late")
    assert refused_pause.returncode == 1 and "is done: cannot pause it" in refused_pause.stderr
    discarded = cli(url, "dlq", "discard", "--key", "s2", "--reason", "obsolete")
    assert discarded.returncode == 0 and "1 dead letter(s) discarded" in discarded.stdout
    halted = cli(url, "consumer", "halt", "stock", "--reason", "deploy")
    resumed = cli(url, "consumer", "resume", "stock", "--reason", "deployed", "--actor", "hank")
    assert halted.returncode == resumed.returncode == 0
    audit = json.loads(cli(url, "dlq", "audit", "--json").stdout)
    assert [(a["action"], a["actor"]) for a in reversed(audit)] == [
        ("replay_dry_run", "cli-tester"),
        ("dlq_edit", "cli-tester"),
        ("replay", "cli-tester"),
        ("dlq_discard", "cli-tester"),
        ("consumer_halt", "cli-tester"),
        ("consumer_resume", "hank"),
    ]


def test_cli_discard_and_resolve_refuse_what_they_cannot_close_and_do_nothing(blocked):
    """An id that does not exist, one that is not open, or a selection that matches no open dead
    letter: exit 1 with a line saying so, nothing closed and nothing audited (they said "0 dead
    letter(s) discarded" and exited 0). A mix of open and unknown ids closes none of them."""
    url = blocked.url
    s1, s2 = (r["id"] for r in json.loads(cli(url, "dlq", "list", "--queue", "stock", "--json").stdout))
    assert cli(url, "dlq", "resolve", "--id", str(s1), "--reason", "by hand").returncode == 0
    for args, said in (
        (("discard", "--id", "999999"), "dead letter 999999 does not exist"),
        (("discard", "--id", str(s2), "--id", "999999"), "dead letter 999999 does not exist"),
        (
            ("resolve", "--id", str(s1)),
            f"dead letter {s1} is resolved: only open dead letters can be resolved",
        ),
        (("discard", "--key", "nosuch"), "no open dead letter matches: nothing was discarded"),
        (("resolve", "--key", "s1"), "no open dead letter matches: nothing was resolved"),
    ):
        result = cli(url, "dlq", *args, "--reason", "x")
        assert result.returncode == 1 and said in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert scalar(url, "SELECT status FROM postbox.dead_letters WHERE id = %s", (s2,)) == "open"
    assert (
        scalar(url, "SELECT count(*) FROM postbox.audit_log WHERE action IN ('dlq_discard', 'dlq_resolve')")
        == 1
    )


def test_cli_json_gives_every_timestamp_in_iso_8601_nested_ones_too(blocked):
    """``dlq show --json``: a payload edit's ``edited_at`` as ``dead_lettered_at`` is, ISO 8601 with
    its ``T`` (it was the database's text form, with a space)."""
    url = blocked.url
    s1 = json.loads(cli(url, "dlq", "list", "--queue", "stock", "--json").stdout)[0]["id"]
    assert cli(url, "dlq", "edit", str(s1), "--payload", '{"n": 1}', "--reason", "fix").returncode == 0
    shown = json.loads(cli(url, "dlq", "show", str(s1), "--json").stdout)
    for stamp in (shown["dead_lettered_at"], shown["edits"][0]["edited_at"]):
        assert datetime.fromisoformat(stamp).tzinfo is not None and "T" in stamp, stamp


def test_cli_refuses_bad_input_cleanly(blocked):
    """Unknown jobs, bad JSON payloads and bad options end with one clear line, never a traceback."""
    url = blocked.url
    for args, needle in (
        (("replay", "pause", "999", "--reason", "x"), "Error: replay job 999 does not exist"),
        (("replay", "status", "999"), "Error: replay job 999 does not exist"),
        (("dlq", "edit", "999", "--payload", "{}", "--reason", "x"), "Error: dead letter 999 does not exist"),
        (("dlq", "edit", "1", "--payload", "{nope", "--reason", "x"), "not JSON"),
        (
            ("dlq", "edit", "1", "--payload", '{"a": -Infinity}', "--reason", "x"),
            "-Infinity is not a JSON value",
        ),
        (("dlq", "replay", "--queue", "stock", "--rate", "0", "--reason", "x"), "rate"),
        (("dlq", "replay", "--queue", "nobody", "--reason", "x"), "matches no open dead letter"),
        (("dlq", "show", "424242"), "does not exist"),
        (
            ("keys", "unblock", "stock", "s3", "--reason", "x"),
            "Error: key inbox stock/s3 is not blocked by an open",
        ),
    ):
        r = cli(url, *args)
        assert r.returncode != 0 and needle in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr


def test_outbox_dead_letters_replay_in_place_and_settle_when_published(database):
    """An outbox row the relay dead-lettered (its key blocked, a later row held) is replayed in place:
    it is the ready head again with fresh attempts; when the relay publishes it, the dead letter
    becomes replayed and the held row becomes the head."""
    url = database.url
    with psycopg.connect(url, autocommit=True) as c:
        for n in (1, 2):
            postbox.publish(
                c, postbox.OutboxMessage(destination="erp", key="k", message_id=f"e{n}", payload={"n": n})
            )
        row = c.execute(
            "SELECT id, attempt FROM postbox.outbox_claim_v1('erp', 'relay-1', 10, interval '30 s', now())"
        ).fetchone()
        c.execute(
            "SELECT postbox.outbox_dead_letter_v1(%s, %s, now(), 'permanent', 'HTTP 400', 'HttpError', NULL, 'fp')",
            row,
        )
        assert scalar(url, "SELECT count(*) FROM postbox.blocked_keys WHERE origin = 'outbox'") == 1
        job = replay.start(c, DeadLetterFilter(origin="outbox", destination="erp"), "endpoint fixed")
        sent = replay.step(c, job, service_now(c))
        assert sent.replayed == 1
        head = c.execute(
            "SELECT id, message_id, state, attempt, replay_of IS NOT NULL FROM postbox.outbox WHERE state <> 'pending'"
        ).fetchone()
        # The head again, as a new row (a relay stalled since the old attempt stays fenced out).
        assert head[0] != row[0] and head[1:] == ("e1", "ready", 0, True)
        again = c.execute(
            "SELECT id, attempt FROM postbox.outbox_claim_v1('erp', 'relay-1', 10, interval '30 s', now())"
        ).fetchone()
        c.execute(
            "SELECT postbox.outbox_complete_v1(ARRAY[%s]::bigint[], ARRAY[%s]::integer[], now())", again
        )
        assert scalar(url, "SELECT status FROM postbox.dead_letters") == "replayed"
        assert c.execute("SELECT message_id, state FROM postbox.outbox").fetchall() == [("e2", "ready")]
        assert replay.step(c, job, service_now(c)).state == "done"


def service_now(c: psycopg.Connection) -> object:
    return c.execute("SELECT clock_timestamp()").fetchone()[0]

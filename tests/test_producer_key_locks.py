"""A producer transaction holds a key's lock, shared, to its commit, for a message it queues behind
another transaction's head, so that the head cannot finish without handing over; and, under READ
COMMITTED, its batches lock the keys of its first 1,000 messages up front, which is cheaper than
looking for their heads twice. Past those, new keys take no lock: PostgreSQL's lock table is shared by the whole server (about 7,800
locks with the default settings), and a transaction starting tens of thousands of keys would fill
it."""

from __future__ import annotations

import psycopg
import pytest

import postbox

KEY_LOCK = 1349471041  # the first half of an inbox key's advisory lock
FIRST_KEYS = 1000  # a transaction's batches lock the keys of this many messages before they look


def _key_locks(observer: psycopg.Connection, pid: int) -> int:
    return observer.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND pid = %s",
        (KEY_LOCK, pid),
    ).fetchone()[0]


def _locked_keys(observer: psycopg.Connection, pid: int, keys: list[str]) -> int:
    """How many of ``keys`` (of consumer c) the backend holds the lock of."""
    return observer.execute(
        "SELECT count(*) FROM pg_locks l JOIN unnest(%s::text[]) k(key)"
        " ON l.objid = hashtext('c/' || k.key)::oid"
        " WHERE l.locktype = 'advisory' AND l.classid = %s AND l.pid = %s",
        (keys, KEY_LOCK, pid),
    ).fetchone()[0]


def _assert_holds_exactly(
    c: psycopg.Connection, observer: psycopg.Connection, isolation: str, held: list[str], besides: int = 0
) -> None:
    """Under READ COMMITTED the transaction holds the locks of ``held`` (and ``besides`` others) and
    has no check at commit; under REPEATABLE READ it holds no key lock, and exactly ``held`` are to
    be checked at commit."""
    pid = c.info.backend_pid
    if isolation == "read committed":
        assert _key_locks(observer, pid) == len(held) + besides
        assert _locked_keys(observer, pid, held) == len(held)
        assert c.execute("SELECT count(*) FROM postbox.inbox_commit_checks").fetchone() == (0,)
    else:
        assert _key_locks(observer, pid) == 0
        checked = c.execute("SELECT k FROM postbox.inbox_commit_checks, unnest(keys) k").fetchall()
        assert sorted(k for (k,) in checked) == sorted(held)


def _batches(c: psycopg.Connection, messages: list[tuple[str, str]]) -> None:
    """Receives (message_id, key) pairs for consumer c, 500 per call, in one transaction."""
    for start in range(0, len(messages), 500):
        postbox.receive_many(
            c,
            [
                {"consumer": "c", "message_id": m, "key": k, "payload": {}}
                for m, k in messages[start : start + 500]
            ],
        )


def _claim(c: psycopg.Connection, limit: int = 1000) -> list[tuple[int, int, str, str]]:
    """(id, attempt, key, message_id) of the messages a claim takes, committed."""
    rows = c.execute(
        "SELECT x.id, x.attempt, i.key, i.message_id FROM postbox.inbox_claim_v1('c', 'w', %s, interval '60 s',"
        " now()) x JOIN postbox.inbox i ON i.id = x.id ORDER BY x.id",
        (limit,),
    ).fetchall()
    c.commit()
    return rows


def _complete(c: psycopg.Connection, claimed: list[tuple[int, int, str, str]]) -> None:
    c.execute(
        "SELECT postbox.inbox_complete_v1(%s::bigint[], %s::integer[], now())",
        ([r[0] for r in claimed], [r[1] for r in claimed]),
    )


def _drain(c: psycopg.Connection) -> list[tuple[str, str]]:
    """Claims and completes until the inbox is empty: (key, message_id) in the order handled."""
    handled: list[tuple[str, str]] = []
    for _ in range(100):
        claimed = _claim(c)
        if claimed:
            handled += [(key, mid) for _, _, key, mid in claimed]
            _complete(c, claimed)
            c.commit()
        elif not c.execute("SELECT EXISTS (SELECT 1 FROM postbox.inbox WHERE consumer = 'c')").fetchone()[0]:
            return handled
    raise AssertionError("the inbox did not drain: messages left without a head")


LAYOUTS = {
    "one-per-key": (20_000, 1, False),
    "two-per-key-together": (10_000, 2, False),
    # Every key's first message in the first 10,000, its second in the last: queued behind a head
    # an earlier batch of the same transaction made.
    "two-per-key-apart": (10_000, 2, True),
}


def _layout(name: str) -> list[tuple[str, str]]:
    keys, per_key, apart = LAYOUTS[name]
    if apart:
        return [(f"m{i}-{j}", f"k{i}") for j in range(per_key) for i in range(keys)]
    return [(f"m{i}-{j}", f"k{i}") for i in range(keys) for j in range(per_key)]


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_transaction_receiving_twenty_thousand_messages_under_new_keys_commits_past_its_first_keys_unlocked(
    database, isolation: str, layout: str
):
    """Until 0.9.0 a batch took every key's lock: twenty thousand keys in one transaction filled the
    lock table ("out of shared memory"). Past the first 1,000, a message that becomes its key's head
    needs no lock, nor do those queued behind a head the same transaction made: nobody can finish
    it before the commit. (Under REPEATABLE READ nothing is locked before the commit.)"""
    keys, per_key, _ = LAYOUTS[layout]
    with database.connect() as c, database.connect(autocommit=True) as observer:
        c.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation.upper()}")
        _batches(c, _layout(layout))
        locks = _key_locks(observer, c.info.backend_pid)
        if isolation != "read committed":
            assert locks == 0
        else:  # the keys of the first 1,000 messages, locked up front
            assert locks == FIRST_KEYS // per_key if layout != "two-per-key-apart" else locks == FIRST_KEYS
        assert c.execute("SELECT count(*) FROM postbox.inbox_commit_checks").fetchone() == (0,)
        c.commit()
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)
        assert c.execute(
            "SELECT count(*) FILTER (WHERE state = 'ready'), count(*) FILTER (WHERE state = 'pending')"
            " FROM postbox.inbox"
        ).fetchone() == (keys, keys * (per_key - 1))


@pytest.mark.parametrize("layout", ["two-per-key-together", "two-per-key-apart"])
def test_a_transaction_publishing_two_messages_under_each_of_twenty_thousand_new_keys_commits(
    database, layout: str
):
    """Until 0.9.0 the outbox's check at commit locked the key of every row queued behind a head,
    its own transaction's heads included: 20,000 keys with two messages each failed at the commit
    with "out of shared memory". Each key's first message is its head, its second queued behind it."""
    keys = 20_000
    messages = [(f"m{i}-{j}", f"k{i}") for i in range(keys) for j in range(2)]
    if layout == "two-per-key-apart":
        messages = [(f"m{i}-{j}", f"k{i}") for j in range(2) for i in range(keys)]
    with database.connect() as c:
        for start in range(0, len(messages), 500):
            postbox.publish_many(
                c,
                [
                    {"destination": "d", "message_id": m, "key": k, "payload": {}}
                    for m, k in messages[start : start + 500]
                ],
            )
        c.commit()
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)
        assert c.execute(
            "SELECT count(*) FILTER (WHERE state = 'ready'), count(*) FILTER (WHERE state = 'pending')"
            " FROM postbox.outbox"
        ).fetchone() == (keys, keys)
        heads = c.execute(
            "SELECT count(*) FROM postbox.outbox WHERE state = 'ready' AND message_id LIKE '%-0'"
        ).fetchone()
        assert heads == (keys,)


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_a_batch_checks_exactly_the_keys_it_queues_behind_another_transactions_head(database, isolation: str):
    """Past its transaction's first 1,000 messages (another consumer's here), a batch of 500: 200
    messages under keys with heads committed before it, 200 under new keys, and a second message
    under 100 of the new keys. Under READ COMMITTED it holds the 200 held keys' locks and no other;
    under REPEATABLE READ those 200 keys, and only they, are checked at commit. Every message is
    then handled once, in its key's order."""
    held = [f"h{i}" for i in range(200)]
    new = [f"n{i}" for i in range(200)]
    with database.connect() as c, database.connect(autocommit=True) as observer:
        _batches(c, [(f"first-{k}", k) for k in held])
        c.commit()
        c.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation.upper()}")
        postbox.receive_many(
            c,
            [
                {"consumer": "other", "message_id": f"o{i}", "key": f"o{i}", "payload": {}}
                for i in range(FIRST_KEYS)
            ],
        )
        _batches(
            c,
            [(f"second-{k}", k) for k in held]
            + [(f"first-{k}", k) for k in new]
            + [(f"second-{k}", k) for k in new[:100]],
        )
        _assert_holds_exactly(c, observer, isolation, held, besides=FIRST_KEYS)
        assert _locked_keys(observer, c.info.backend_pid, new) == 0
        c.commit()
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)
        handled = _drain(c)
    assert sorted(handled) == sorted(
        [(k, f"first-{k}") for k in held + new] + [(k, f"second-{k}") for k in held + new[:100]]
    )
    for k in held + new[:100]:
        assert [m for key, m in handled if key == k] == [f"first-{k}", f"second-{k}"]


# Single receives: the same rule, one call at a time.

SINGLE_KEYS = 20_000  # two messages each: 20,000 queued messages, more locks than the lock table holds


def _receive_loop(c: psycopg.Connection, first: int, keys: int, rounds: int) -> None:
    """Round ``r`` receives message ``m<i>-<r>`` under key ``k<i>`` for i in first..first+keys-1, one
    single receive each (in SQL, in one statement of the caller's transaction: faster than the
    client, and the same function)."""
    last = first + keys - 1
    c.execute(
        f"DO $$ BEGIN FOR r IN 0..{rounds - 1} LOOP FOR i IN {first}..{last} LOOP"
        " PERFORM postbox.inbox_receive_v1('c', format('m%s-%s', i, r), '{}'::jsonb, format('k%s', i));"
        " END LOOP; END LOOP; END $$"
    )


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_a_transaction_receiving_two_messages_under_each_of_twenty_thousand_new_keys_one_call_at_a_time_commits(
    database, isolation: str
):
    """Until 0.10.0 a single receive locked the key of every message it queued, behind its own
    transaction's heads too (under REPEATABLE READ it filed the key's check at commit, which locks
    it then): a bulk load through single receives, two per key, filled the lock table. A message
    queued behind a head its own transaction made now needs neither: nobody finishes that head
    before the commit."""
    with database.connect() as c, database.connect(autocommit=True) as observer:
        c.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation.upper()}")
        _receive_loop(c, 0, SINGLE_KEYS, rounds=2)  # every key's head first, then its second message
        assert _key_locks(observer, c.info.backend_pid) == 0
        assert c.execute("SELECT count(*) FROM postbox.inbox_commit_checks").fetchone() == (0,)
        c.commit()
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)
        assert c.execute(
            "SELECT count(*) FILTER (WHERE state = 'ready' AND message_id LIKE '%-0'),"
            " count(*) FILTER (WHERE state = 'pending' AND message_id LIKE '%-1') FROM postbox.inbox"
        ).fetchone() == (SINGLE_KEYS, SINGLE_KEYS)


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_a_single_receive_holds_exactly_the_keys_it_queues_behind_another_transactions_head(
    database, isolation: str
):
    """In one transaction: a second message under 50 keys whose heads another transaction made,
    and two messages under 50 new keys. Under READ COMMITTED it holds the 50 held keys' locks and
    no other; under REPEATABLE READ those 50 keys, and only they, are checked at commit. Every
    message is then handled once, in its key's order."""
    with database.connect() as c, database.connect(autocommit=True) as observer:
        _receive_loop(c, 0, 50, rounds=1)  # heads of k0..k49, committed
        c.commit()
        c.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation.upper()}")
        c.execute(
            "DO $$ BEGIN FOR i IN 0..49 LOOP"
            " PERFORM postbox.inbox_receive_v1('c', format('m%s-1', i), '{}'::jsonb, format('k%s', i));"
            " END LOOP; END $$"
        )
        _receive_loop(c, 50, 50, rounds=2)
        _assert_holds_exactly(c, observer, isolation, [f"k{i}" for i in range(50)])
        c.commit()
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)
        handled = _drain(c)
    assert len(handled) == 200
    for i in range(100):
        assert [m for key, m in handled if key == f"k{i}"] == [f"m{i}-0", f"m{i}-1"]


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read"])
def test_a_single_receive_behind_its_own_head_takes_no_lock_without_a_key_or_with_a_sequence_order(
    database, isolation: str
):
    """The receive's other paths too: a message without a key whose id is the key of a head the
    transaction made, and messages of consumers ordering keys by sequence (monotonic, gapless),
    queued behind their key's head of the same transaction: no lock, no check at commit. Each is
    then handled after its head."""
    with database.connect() as c, database.connect(autocommit=True) as observer:
        postbox.declare_consumer(c, "c")
        postbox.declare_consumer(c, "mono", sequence_mode="monotonic")
        postbox.declare_consumer(c, "gapless", sequence_mode="gapless")
        c.commit()
        c.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation.upper()}")
        postbox.receive(c, consumer="c", message_id="head", key="x", payload={})
        postbox.receive(c, consumer="c", message_id="x", payload={})  # no key: its id, x, is its key
        for consumer in ("mono", "gapless"):
            for seq in (1, 2):
                postbox.receive(c, consumer=consumer, message_id=f"s{seq}", key="k", sequence=seq, payload={})
        assert c.execute("SELECT count(*) FROM postbox.inbox WHERE state = 'pending'").fetchone() == (3,)
        _assert_holds_exactly(c, observer, isolation, [])
        c.commit()
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)
        order: dict[str, list[str]] = {}
        for _ in range(10):
            claimed = c.execute(
                "SELECT x.id, x.attempt, i.consumer, i.message_id FROM unnest(array['c','mono','gapless']) q,"
                " postbox.inbox_claim_v1(q, 'w', 10, interval '60 s', now()) x JOIN postbox.inbox i ON i.id = x.id"
            ).fetchall()
            c.commit()
            if not claimed:
                break
            for _, _, consumer, mid in claimed:
                order.setdefault(consumer, []).append(mid)
            _complete(c, [(i, a, "", "") for i, a, _, _ in claimed])
            c.commit()
    assert order == {"c": ["head", "x"], "mono": ["s1", "s2"], "gapless": ["s1", "s2"]}


def test_a_head_made_in_a_savepoint_counts_as_another_transactions(database):
    """The documented limit: a head made inside a savepoint carries the savepoint's transaction id,
    so a message queued behind it after the savepoint still takes the key's lock."""
    with database.connect() as c, database.connect(autocommit=True) as observer:
        c.execute("SELECT 1")  # the connection's transaction
        with c.transaction():  # a savepoint inside it
            postbox.receive(c, consumer="c", message_id="head", key="k", payload={})
        assert c.info.transaction_status.name == "INTRANS"
        postbox.receive(c, consumer="c", message_id="next", key="k", payload={})
        assert _locked_keys(observer, c.info.backend_pid, ["k"]) == 1
        c.commit()


def test_a_message_queued_in_a_savepoint_behind_its_transactions_own_head_takes_no_lock(database):
    """The head made by the transaction itself, outside any savepoint; a message queued behind it
    inside a savepoint takes no lock (the savepoint cannot outlive the head). Rolled back to the
    savepoint, the message is gone and the head goes on; the one queued after is handled next."""
    with database.connect() as c, database.connect(autocommit=True) as observer:
        postbox.receive(c, consumer="c", message_id="head", key="k", payload={})
        with c.transaction() as savepoint:  # rolled back
            postbox.receive(c, consumer="c", message_id="undone", key="k", payload={})
            assert _key_locks(observer, c.info.backend_pid) == 0
            raise psycopg.Rollback(savepoint)
        with c.transaction():  # a savepoint, released
            postbox.receive(c, consumer="c", message_id="kept", key="k", payload={})
        assert _key_locks(observer, c.info.backend_pid) == 0
        c.commit()
        assert c.execute("SELECT count(*) FROM postbox.key_repairs").fetchone() == (0,)
        assert _drain(c) == [("k", "head"), ("k", "kept")]

-- Revision 0011: a single receive takes no key lock for a message it queues behind a head its own
-- transaction made, so a transaction receiving tens of thousands of messages one call at a time,
-- several under each key, fits in PostgreSQL's lock table (shared by the whole server). Same
-- statuses, ids and guarantees.
--
-- Until now, under READ COMMITTED, every message a single receive queued took its key's lock
-- shared, held to the commit, and looked for the key's head again under it, even behind a head the
-- same transaction had made (under REPEATABLE READ and SERIALIZABLE it filed the key's check at
-- commit, which locks the key then). Nobody can finish a head before the transaction that made it
-- commits, so a message queued behind it needs neither: after the commit the head and the message
-- are there together, and the head's completion hands over to it, as for the batches (revision
-- 0010). A head is the transaction's own when its row's version is (xmin is the transaction's id)
-- and it was received now(): a frozen row keeps an xid from 2^32 transactions ago. A head made in a
-- savepoint (a batch without keys makes its first rows in one of its own) has the savepoint's xid,
-- and a head the transaction only updated (claimed, promoted) was received earlier: both still
-- count as another transaction's (the lock is taken, as before).
--
-- Whose head it is costs one more index probe, paid only by a message queued in a transaction
-- that had written something before this receive: a transaction without an xid when the receive
-- starts has made no row, so no head can be its own. A receive in a transaction of its own, the
-- usual case, pays only for telling which case it is in (a one-off count with the bench's
-- callgrind harness: 0.5 % more server instructions per receive without a key, 1 % with one).
--
-- Everything else is as revision 0009 made it (inbox_receive_keyed_v1.sql says which races its one
-- statement meets, and how each ends). inbox_receive_v1 keeps its signature and results; its body
-- is replaced (revision 0009's is in inbox_receive_keyed_v1.sql, which the downgrade restores).

CREATE OR REPLACE FUNCTION postbox.inbox_receive_v1(
    consumer        text,
    message_id      text,
    payload         jsonb,
    key             text    DEFAULT NULL,
    type            text    DEFAULT NULL,
    sequence        bigint  DEFAULT NULL,
    headers         jsonb   DEFAULT '{}'::jsonb,
    schema_version  integer DEFAULT 1,
    correlation_id  text    DEFAULT NULL,
    causation_id    text    DEFAULT NULL,
    source          text    DEFAULT NULL,
    OUT status      text,
    OUT inbox_id    bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, postbox, pg_temp AS $$
#variable_conflict use_column
DECLARE
    v_consumer  text   := inbox_receive_v1.consumer;
    v_key       text   := coalesce(inbox_receive_v1.key, inbox_receive_v1.message_id);
    v_seq       bigint := inbox_receive_v1.sequence;
    v_text      text   := inbox_receive_v1.payload::text;
    v_htext     text   := inbox_receive_v1.headers::text;
    v_hash      bytea;
    v_mode      text;
    v_first     bigint;
    v_last      bigint;
    v_id        bigint;
    v_position  bigint;
    v_state     text;
    v_old       record;
    v_refused   boolean;
    v_new       boolean;
    v_head      boolean;
    v_put       text;
    v_slot      smallint;
    v_window    interval;
    v_rc        boolean := current_setting('transaction_isolation') = 'read committed';
    v_fresh     boolean;
    v_own       boolean;
BEGIN
    -- One cheap expression checks everything; only bad input pays for finding which field it was.
    IF postbox.message_fields_bad_v1(v_consumer, inbox_receive_v1.message_id, true, inbox_receive_v1.key,
                                     inbox_receive_v1.type, inbox_receive_v1.correlation_id,
                                     inbox_receive_v1.causation_id, inbox_receive_v1.source,
                                     inbox_receive_v1.payload, inbox_receive_v1.headers)
       OR v_seq < 0 OR inbox_receive_v1.schema_version IS NULL OR inbox_receive_v1.schema_version < 1
    THEN
        PERFORM postbox.reject_message_fields_v1('consumer', v_consumer, inbox_receive_v1.message_id, true,
                                                 inbox_receive_v1.key, inbox_receive_v1.type,
                                                 inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id,
                                                 inbox_receive_v1.source, inbox_receive_v1.payload,
                                                 inbox_receive_v1.headers);
        IF v_seq < 0 THEN
            PERFORM postbox.reject_v1('sequence', 'must not be negative');
        END IF;
        PERFORM postbox.reject_v1('schema_version', 'must be a positive integer');
    END IF;
    IF postbox.message_json_large_v1(v_text, v_htext) THEN
        PERFORM postbox.check_message_json_v1(inbox_receive_v1.payload, v_text, inbox_receive_v1.headers, v_htext);
    END IF;

    -- The ledger's slot is read after taking the ledger's lock, held to the end of the transaction:
    -- a rotation (dedup_rotate_v1) waits for us, or we for it and then read the slot it made current.
    LOCK TABLE ONLY postbox.inbox_dedup IN ROW EXCLUSIVE MODE;
    -- One read: the window and current slot, the consumer's mode and, only if it is not declared,
    -- whether any consumer is; and whether the transaction has written nothing yet (no xid: then
    -- no head can be its own; unknown, NULL, if the window's row were missing: then the key is
    -- held as before).
    SELECT c.sequence_mode, c.first_sequence,
           c.name IS NULL AND EXISTS (SELECT 1 FROM postbox.consumers d WHERE d.declared),
           w.current_slot, w.retention, pg_current_xact_id_if_assigned() IS NULL
      INTO v_mode, v_first, v_refused, v_slot, v_window, v_fresh
      FROM postbox.dedup_window w LEFT JOIN postbox.consumers c ON c.name = v_consumer;
    IF NOT v_rc THEN
        -- An older snapshot may predate a rotation: locking the row then fails with a
        -- serialization error, which the producer retries.
        PERFORM 1 FROM postbox.dedup_window FOR KEY SHARE;
    END IF;
    IF v_refused THEN
        PERFORM postbox.reject_v1('consumer', format('%L is not a declared consumer', v_consumer));
    END IF;
    v_mode := coalesce(v_mode, 'arrival');
    IF v_mode <> 'arrival' AND v_seq IS NULL THEN
        PERFORM postbox.reject_v1('sequence', format('is required: consumer %L orders keys by sequence (%s)', v_consumer, v_mode));
    END IF;

    v_hash := decode(md5(v_text), 'hex');
    v_id := nextval('postbox.inbox_id_seq');
    IF v_mode = 'arrival' AND inbox_receive_v1.key IS NULL THEN
        -- Without a key (its id is its key), the usual case in one statement: the ledger row and,
        -- unless messages of the same id are queued (never overtake them), the message as its key's
        -- head.
        -- The ledger's slot named, not found by routing: the same rows, without routing a row and
        -- pruning the ledger's partitions in every receive.
        IF v_slot = 0 THEN
            WITH d AS (
                INSERT INTO postbox.inbox_dedup_0 (consumer, message_id, payload_hash, inbox_id, slot)
                SELECT v_consumer, inbox_receive_v1.message_id, v_hash, v_id, 0
                 WHERE NOT EXISTS (
                       -- The previous slot's receipt of the id, if it still counts (inside the window, or
                       -- its message live or dead-lettered).
                       SELECT 1 FROM postbox.inbox_dedup_1 p
                        WHERE p.consumer = v_consumer
                          AND p.message_id = inbox_receive_v1.message_id
                          AND (p.received_at >= now() - v_window
                               OR postbox.inbox_receipt_live_v1(p.consumer, p.message_id, p.inbox_id)))
                ON CONFLICT DO NOTHING
                RETURNING 1),
            h AS (
                INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type, schema_version,
                                                payload, headers, correlation_id, causation_id, source, state)
                SELECT v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_id, inbox_receive_v1.type,
                       inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                       inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'ready'
                 WHERE EXISTS (SELECT 1 FROM d)
                   AND NOT EXISTS (SELECT 1 FROM postbox.inbox p
                                    WHERE p.consumer = v_consumer AND p.key = v_key AND p.state = 'pending'
                                      AND p.position < v_id)
                ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING
                RETURNING 1)
            SELECT EXISTS (SELECT 1 FROM d), EXISTS (SELECT 1 FROM h) INTO v_new, v_head;
        ELSE
            WITH d AS (
                INSERT INTO postbox.inbox_dedup_1 (consumer, message_id, payload_hash, inbox_id, slot)
                SELECT v_consumer, inbox_receive_v1.message_id, v_hash, v_id, 1
                 WHERE NOT EXISTS (
                       -- The previous slot's receipt of the id, if it still counts (inside the window, or
                       -- its message live or dead-lettered).
                       SELECT 1 FROM postbox.inbox_dedup_0 p
                        WHERE p.consumer = v_consumer
                          AND p.message_id = inbox_receive_v1.message_id
                          AND (p.received_at >= now() - v_window
                               OR postbox.inbox_receipt_live_v1(p.consumer, p.message_id, p.inbox_id)))
                ON CONFLICT DO NOTHING
                RETURNING 1),
            h AS (
                INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type, schema_version,
                                                payload, headers, correlation_id, causation_id, source, state)
                SELECT v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_id, inbox_receive_v1.type,
                       inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                       inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'ready'
                 WHERE EXISTS (SELECT 1 FROM d)
                   AND NOT EXISTS (SELECT 1 FROM postbox.inbox p
                                    WHERE p.consumer = v_consumer AND p.key = v_key AND p.state = 'pending'
                                      AND p.position < v_id)
                ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING
                RETURNING 1)
            SELECT EXISTS (SELECT 1 FROM d), EXISTS (SELECT 1 FROM h) INTO v_new, v_head;
        END IF;
        IF v_new AND v_head THEN
            IF postbox.notify_enabled_v1() THEN
                PERFORM pg_notify('postbox_inbox', v_consumer);
            END IF;
            status := 'new';
            inbox_id := v_id;
            RETURN;
        ELSIF v_new THEN
            -- Queued behind the head; its key held and checked now (as below), unless the head is
            -- this transaction's own.
            INSERT INTO postbox.inbox (id, consumer, message_id, key, sequence, position, type, schema_version,
                                       payload, headers, correlation_id, causation_id, source, state)
            VALUES (v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_id, inbox_receive_v1.type,
                    inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                    inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'pending');
            IF NOT v_fresh THEN
                v_own := EXISTS (SELECT 1 FROM postbox.inbox i
                                  WHERE i.consumer = v_consumer AND i.key = v_key AND i.state <> 'pending'
                                    AND i.xmin = pg_current_xact_id()::xid AND i.received_at = now());
            END IF;
            IF v_fresh IS NOT FALSE OR NOT v_own THEN
                IF v_rc THEN
                    -- postbox.lock_key_shared_v1(1, ...), inline.
                    PERFORM pg_advisory_xact_lock_shared(1349471041, hashtext(v_consumer || '/' || v_key));
                    PERFORM 1 FROM postbox.inbox i WHERE i.consumer = v_consumer AND i.key = v_key AND i.state <> 'pending';
                    IF NOT FOUND THEN
                        INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('inbox', v_consumer, v_key);
                    END IF;
                ELSE
                    INSERT INTO postbox.inbox_commit_checks (consumers, keys) VALUES (ARRAY[v_consumer], ARRAY[v_key]);
                END IF;
            END IF;
            status := 'new';
            inbox_id := v_id;
            RETURN;
        END IF;
        -- Seen before: new again only outside the window (then on through the general path below).
        v_new := postbox.inbox_dedup_take_expired_v1(v_consumer, inbox_receive_v1.message_id, v_hash, v_id,
                                                          v_slot, v_window);
    ELSIF v_mode = 'arrival' THEN
        -- With a key, the usual case in one statement too: the ledger row and the message, as its
        -- key's head unless the key has a head or queued messages (never overtake them), else
        -- queued behind them. A queued message is inserted by that statement, not by a second one
        -- after its attempt at the head has failed. (A queued row is not checked against the
        -- heads' index, which only holds heads.)
        IF v_slot = 0 THEN
            WITH d AS (
                INSERT INTO postbox.inbox_dedup_0 (consumer, message_id, payload_hash, inbox_id, slot)
                SELECT v_consumer, inbox_receive_v1.message_id, v_hash, v_id, 0
                 WHERE NOT EXISTS (
                       -- The previous slot's receipt of the id, if it still counts (inside the window, or
                       -- its message live or dead-lettered).
                       SELECT 1 FROM postbox.inbox_dedup_1 p
                        WHERE p.consumer = v_consumer
                          AND p.message_id = inbox_receive_v1.message_id
                          AND (p.received_at >= now() - v_window
                               OR postbox.inbox_receipt_live_v1(p.consumer, p.message_id, p.inbox_id)))
                ON CONFLICT DO NOTHING
                RETURNING 1),
            h AS (
                INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type, schema_version,
                                                payload, headers, correlation_id, causation_id, source, state)
                SELECT v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_id, inbox_receive_v1.type,
                       inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                       inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source,
                       -- (Under REPEATABLE READ the snapshot may show a head finished since: the
                       -- attempt at the head finds out, as without a key.)
                       CASE WHEN v_rc AND EXISTS (SELECT 1 FROM postbox.inbox p
                                                   WHERE p.consumer = v_consumer AND p.key = v_key
                                                     AND p.state <> 'pending')
                              OR EXISTS (SELECT 1 FROM postbox.inbox p
                                          WHERE p.consumer = v_consumer AND p.key = v_key AND p.state = 'pending'
                                            AND p.position < v_id)
                            THEN 'pending' ELSE 'ready' END
                 WHERE EXISTS (SELECT 1 FROM d)
                ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING
                RETURNING i.state)
            SELECT EXISTS (SELECT 1 FROM d), (SELECT h.state FROM h) INTO v_new, v_put;
        ELSE
            WITH d AS (
                INSERT INTO postbox.inbox_dedup_1 (consumer, message_id, payload_hash, inbox_id, slot)
                SELECT v_consumer, inbox_receive_v1.message_id, v_hash, v_id, 1
                 WHERE NOT EXISTS (
                       -- The previous slot's receipt of the id, if it still counts (inside the window, or
                       -- its message live or dead-lettered).
                       SELECT 1 FROM postbox.inbox_dedup_0 p
                        WHERE p.consumer = v_consumer
                          AND p.message_id = inbox_receive_v1.message_id
                          AND (p.received_at >= now() - v_window
                               OR postbox.inbox_receipt_live_v1(p.consumer, p.message_id, p.inbox_id)))
                ON CONFLICT DO NOTHING
                RETURNING 1),
            h AS (
                INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type, schema_version,
                                                payload, headers, correlation_id, causation_id, source, state)
                SELECT v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_id, inbox_receive_v1.type,
                       inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                       inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source,
                       -- (Under REPEATABLE READ the snapshot may show a head finished since: the
                       -- attempt at the head finds out, as without a key.)
                       CASE WHEN v_rc AND EXISTS (SELECT 1 FROM postbox.inbox p
                                                   WHERE p.consumer = v_consumer AND p.key = v_key
                                                     AND p.state <> 'pending')
                              OR EXISTS (SELECT 1 FROM postbox.inbox p
                                          WHERE p.consumer = v_consumer AND p.key = v_key AND p.state = 'pending'
                                            AND p.position < v_id)
                            THEN 'pending' ELSE 'ready' END
                 WHERE EXISTS (SELECT 1 FROM d)
                ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING
                RETURNING i.state)
            SELECT EXISTS (SELECT 1 FROM d), (SELECT h.state FROM h) INTO v_new, v_put;
        END IF;
        IF v_put = 'ready' THEN
            IF postbox.notify_enabled_v1() THEN
                PERFORM pg_notify('postbox_inbox', v_consumer);
            END IF;
            status := 'new';
            inbox_id := v_id;
            RETURN;
        ELSIF v_new THEN
            IF v_put IS NULL THEN
                -- The attempt at the head found one: a head another transaction was making, which
                -- committed while the statement waited for it, or (under REPEATABLE READ, where the
                -- statement does not look for the head itself) any head. Queued behind it.
                INSERT INTO postbox.inbox (id, consumer, message_id, key, sequence, position, type, schema_version,
                                           payload, headers, correlation_id, causation_id, source, state)
                VALUES (v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_id, inbox_receive_v1.type,
                        inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                        inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'pending');
            END IF;
            -- Queued: its key held and checked now (as below), unless the head is this transaction's
            -- own.
            IF NOT v_fresh THEN
                v_own := EXISTS (SELECT 1 FROM postbox.inbox i
                                  WHERE i.consumer = v_consumer AND i.key = v_key AND i.state <> 'pending'
                                    AND i.xmin = pg_current_xact_id()::xid AND i.received_at = now());
            END IF;
            IF v_fresh IS NOT FALSE OR NOT v_own THEN
                IF v_rc THEN
                    -- postbox.lock_key_shared_v1(1, ...), inline.
                    PERFORM pg_advisory_xact_lock_shared(1349471041, hashtext(v_consumer || '/' || v_key));
                    PERFORM 1 FROM postbox.inbox i WHERE i.consumer = v_consumer AND i.key = v_key AND i.state <> 'pending';
                    IF NOT FOUND THEN
                        INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('inbox', v_consumer, v_key);
                    END IF;
                ELSE
                    INSERT INTO postbox.inbox_commit_checks (consumers, keys) VALUES (ARRAY[v_consumer], ARRAY[v_key]);
                END IF;
            END IF;
            status := 'new';
            inbox_id := v_id;
            RETURN;
        END IF;
        -- Seen before: new again only outside the window (then on through the general path below).
        v_new := postbox.inbox_dedup_take_expired_v1(v_consumer, inbox_receive_v1.message_id, v_hash, v_id,
                                                          v_slot, v_window);
    ELSE
        INSERT INTO postbox.inbox_dedup (consumer, message_id, payload_hash, inbox_id, slot)
        SELECT v_consumer, inbox_receive_v1.message_id, v_hash, v_id, v_slot
         WHERE NOT EXISTS (
               -- The previous slot's receipt of the id, if it still counts (inside the window, or
               -- its message live or dead-lettered).
               SELECT 1 FROM postbox.inbox_dedup p
                WHERE p.slot = 1 - v_slot AND p.consumer = v_consumer
                  AND p.message_id = inbox_receive_v1.message_id
                  AND (p.received_at >= now() - v_window
                       OR postbox.inbox_receipt_live_v1(p.consumer, p.message_id, p.inbox_id)))
        ON CONFLICT DO NOTHING;
        v_new := FOUND;
        IF NOT v_new THEN
            v_new := postbox.inbox_dedup_take_expired_v1(v_consumer, inbox_receive_v1.message_id, v_hash, v_id,
                                                          v_slot, v_window);
        END IF;
    END IF;
    IF NOT v_new THEN
        -- The latest receipt decides (the previous slot may hold an earlier one).
        SELECT d.payload_hash, d.inbox_id INTO v_old
          FROM postbox.inbox_dedup d
         WHERE d.consumer = v_consumer AND d.message_id = inbox_receive_v1.message_id
         ORDER BY d.received_at DESC
         LIMIT 1;
        status := CASE WHEN v_old.payload_hash = v_hash THEN 'duplicate' ELSE 'conflict' END;
        inbox_id := v_old.inbox_id;
        RETURN;
    END IF;

    v_position := CASE WHEN v_mode = 'arrival' THEN v_id ELSE v_seq END;
    v_state := 'ready';
    IF v_mode = 'gapless' THEN
        SELECT k.last_sequence INTO v_last FROM postbox.inbox_keys k
         WHERE k.consumer = v_consumer AND k.key = v_key;
        IF v_seq <> coalesce(v_last + 1, v_first) THEN
            v_state := 'pending';
        END IF;
    ELSIF v_mode = 'monotonic' THEN
        SELECT k.last_sequence INTO v_last FROM postbox.inbox_keys k
         WHERE k.consumer = v_consumer AND k.key = v_key;
        IF v_seq <= v_last THEN
            v_state := 'pending';   -- late: the promote step applies the consumer's late policy
        END IF;
    END IF;

    IF v_state = 'ready' AND EXISTS (
        SELECT 1 FROM postbox.inbox p
         WHERE p.consumer = v_consumer AND p.key = v_key AND p.state = 'pending' AND p.position < v_position) THEN
        -- Earlier messages are queued and wait for their head to be repaired: never overtake them.
        v_state := 'pending';
    END IF;
    IF v_state = 'ready' THEN
        -- Become the head of the key unless it already has one (which we then queue behind).
        INSERT INTO postbox.inbox AS i (id, consumer, message_id, key, sequence, position, type, schema_version,
                                        payload, headers, correlation_id, causation_id, source, state)
        VALUES (v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_position, inbox_receive_v1.type,
                inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'ready')
        ON CONFLICT (consumer, key) WHERE state <> 'pending' DO NOTHING;
        IF NOT FOUND AND v_mode = 'monotonic' THEN
            -- Lowest present sequence first: a head nobody has claimed yet steps back behind us.
            UPDATE postbox.inbox SET state = 'pending'
             WHERE consumer = v_consumer AND key = v_key AND state = 'ready' AND position > v_seq;
            IF FOUND THEN
                INSERT INTO postbox.inbox (id, consumer, message_id, key, sequence, position, type, schema_version,
                                           payload, headers, correlation_id, causation_id, source, state)
                VALUES (v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_position, inbox_receive_v1.type,
                        inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                        inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'ready');
            END IF;
        END IF;
        IF NOT FOUND THEN
            v_state := 'pending';
        ELSIF postbox.notify_enabled_v1() THEN
            PERFORM pg_notify('postbox_inbox', v_consumer);
        END IF;
    END IF;
    IF v_state = 'pending' THEN
        -- Queued behind the head. So that a head that finishes while this transaction is open can
        -- never leave this message without one: under READ COMMITTED the key's lock is taken shared
        -- now and held to our commit, and the head probed after it (a completion that starts later
        -- cannot take the lock and files a repair, made at the claim after our commit; one that
        -- finished before has its result seen by the probe, and no head means a repair, ours).
        -- Under REPEATABLE READ the snapshot predates the lock: the key's check at commit
        -- (inbox_commit_check_v1) does it there, locking the head to catch a change since the snapshot.
        -- Behind a head this transaction made, neither: nobody can finish that head before we commit.
        INSERT INTO postbox.inbox (id, consumer, message_id, key, sequence, position, type, schema_version,
                                   payload, headers, correlation_id, causation_id, source, state)
        VALUES (v_id, v_consumer, inbox_receive_v1.message_id, v_key, v_seq, v_position, inbox_receive_v1.type,
                inbox_receive_v1.schema_version, inbox_receive_v1.payload, coalesce(inbox_receive_v1.headers, '{}'),
                inbox_receive_v1.correlation_id, inbox_receive_v1.causation_id, inbox_receive_v1.source, 'pending');
        IF NOT v_fresh THEN
            v_own := EXISTS (SELECT 1 FROM postbox.inbox i
                              WHERE i.consumer = v_consumer AND i.key = v_key AND i.state <> 'pending'
                                AND i.xmin = pg_current_xact_id()::xid AND i.received_at = now());
        END IF;
        IF v_fresh IS NOT FALSE OR NOT v_own THEN
            IF v_rc THEN
                -- postbox.lock_key_shared_v1(1, ...), inline.
                PERFORM pg_advisory_xact_lock_shared(1349471041, hashtext(v_consumer || '/' || v_key));
                PERFORM 1 FROM postbox.inbox i WHERE i.consumer = v_consumer AND i.key = v_key AND i.state <> 'pending';
                IF NOT FOUND THEN
                    INSERT INTO postbox.key_repairs (origin, queue, key) VALUES ('inbox', v_consumer, v_key);
                END IF;
            ELSE
                INSERT INTO postbox.inbox_commit_checks (consumers, keys) VALUES (ARRAY[v_consumer], ARRAY[v_key]);
            END IF;
        END IF;
    END IF;
    status := 'new';
    inbox_id := v_id;
END
$$;
